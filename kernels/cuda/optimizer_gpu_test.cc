// OptimizerUpdate on the GPU against the CPU reference: every rule, f32 and
// bf16, odd sizes, several steps with the moments carried over, clipping on
// and off, and a non-finite norm that must leave everything as it was.
// OptimizerStep (the multi-tensor step) the same way over many parameters at
// once: every rule and schedule, chains (rmsprop, lion, optax.chain with
// clips after their first link), clipping decided from the global norm on
// the device, a non-finite step skipped on the device, the counters and the
// step's info record, mixed and unaligned slots, more slots than one launch
// takes; and the FP8 copies the step writes (OptimizerSlot::fp8): bit for
// bit the GPU's own QuantizeTranspose of its new params, near the CPU's, and
// untouched by a skipped step or a slot without a gradient.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "kernels/optimizer_math.h"

namespace te {
namespace {

using testing::RandomValues;
using testing::RelativeError;
using testing::ToDoubles;
using testing::Tolerance;
using Rule = OptimizerUpdateArgs::Rule;

class OptimizerGpuTest : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    gpu_ = *device_->NewOps(int64_t{1} << 30);
  }
  Tensor Upload(const Tensor& host) {
    Tensor t = *gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(gpu_->Upload(host.data(), &t).ok());
    return t;
  }
  Tensor Download(const Tensor& device) {
    Tensor t = *cpu_.Allocate(device.dtype(), device.shape());
    EXPECT_TRUE(gpu_->Download(device, t.data()).ok());
    return t;
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

OptimizerUpdateArgs ArgsFor(int rule_case) {
  OptimizerUpdateArgs a;
  a.learning_rate = 0.1f;
  switch (rule_case) {
    case 0: a.rule = Rule::kSgd; break;
    case 1: a.rule = Rule::kSgd; a.momentum = 0.9f; break;
    case 2: a.rule = Rule::kSgd; a.momentum = 0.9f; a.nesterov = true; break;
    case 3: a.rule = Rule::kAdam; a.eps_root = 1e-4f; break;
    default: a.rule = Rule::kAdam; a.weight_decay = 0.05f; a.max_norm = 1.0f; break;
  }
  return a;
}

TEST_P(OptimizerGpuTest, MatchesCpuReference) {
  const auto [rule_case, dtype] = GetParam();
  OptimizerUpdateArgs args = ArgsFor(rule_case);
  const bool adam = args.rule == Rule::kAdam;
  const bool trace = args.momentum != 0.0f;
  const Shape shape = {129, 67};
  Tensor p_cpu = testing::MakeRandom(cpu_, dtype, shape, 1);
  Tensor m_cpu = testing::MakeRandom(cpu_, dtype, shape, 2, -0.5f, 0.5f);
  Tensor v_cpu = testing::MakeRandom(cpu_, dtype, shape, 3, 0.01f, 1.0f);
  Tensor p_gpu = Upload(p_cpu), m_gpu = Upload(m_cpu), v_gpu = Upload(v_cpu);
  for (int step = 1; step <= 3; ++step) {
    args.bias_correction1 = 1.0f - std::pow(args.b1, float(step));
    args.bias_correction2 = 1.0f - std::pow(args.b2, float(step));
    Tensor g_cpu = testing::MakeRandom(cpu_, dtype, shape, 10 + step);
    const std::vector<double> g = ToDoubles(g_cpu);
    double norm_sq = 0;
    for (double x : g) norm_sq += x * x;
    Tensor n_cpu = testing::Scalar(cpu_, static_cast<float>(norm_sq));
    Tensor g_gpu = Upload(g_cpu), n_gpu = Upload(n_cpu);
    ASSERT_TRUE(cpu_.OptimizerUpdate(args, g_cpu, n_cpu, &p_cpu, adam || trace ? &m_cpu : nullptr,
                                     adam ? &v_cpu : nullptr).ok());
    ASSERT_TRUE(gpu_->OptimizerUpdate(args, g_gpu, n_gpu, &p_gpu, adam || trace ? &m_gpu : nullptr,
                                      adam ? &v_gpu : nullptr).ok());
    // Same float32 formula on both: the results differ by the GPU's fused
    // multiply-adds at most.
    EXPECT_LT(RelativeError(Download(p_gpu), ToDoubles(p_cpu)), Tolerance(dtype)) << step;
    if (adam || trace) { EXPECT_LT(RelativeError(Download(m_gpu), ToDoubles(m_cpu)), Tolerance(dtype)); }
    if (adam) { EXPECT_LT(RelativeError(Download(v_gpu), ToDoubles(v_cpu)), Tolerance(dtype)); }
  }
  // A non-finite norm: nothing written.
  const std::vector<double> before = ToDoubles(Download(p_gpu));
  Tensor g_gpu = Upload(testing::MakeRandom(cpu_, dtype, shape, 99));
  Tensor inf_gpu = Upload(testing::Scalar(cpu_, INFINITY));
  ASSERT_TRUE(gpu_->OptimizerUpdate(args, g_gpu, inf_gpu, &p_gpu, adam || trace ? &m_gpu : nullptr,
                                    adam ? &v_gpu : nullptr).ok());
  EXPECT_EQ(ToDoubles(Download(p_gpu)), before);
}

INSTANTIATE_TEST_SUITE_P(Rules, OptimizerGpuTest,
                         ::testing::Combine(::testing::Range(0, 5),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

// ---- OptimizerStep ----------------------------------------------------------------

OptimizerHyperparams HyperparamsFor(int rule_case) {
  OptimizerHyperparams h;
  h.learning_rate = h.schedules.AddConstant(0.05);
  switch (rule_case) {
    case 0: break;  // plain sgd
    case 1: h.momentum = 0.9; break;
    case 2: h.momentum = 0.9; h.nesterov = true; h.max_norm = 3.0; break;
    case 3: h.rule = Rule::kAdam; h.eps_root = 1e-4; break;
    case 4: h.rule = Rule::kAdam; h.weight_decay = 0.05; h.max_norm = 1.0; break;  // adamw, clipped
    default: {  // adamw under warmup_cosine_decay, clipped
      h.rule = Rule::kAdam;
      h.weight_decay = 1e-4;
      h.max_norm = 2.0;
      // optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 5, 0.01, 1.5): a join
      // of a linear warmup and a cosine decay.
      h.schedules = ScheduleTable();
      ScheduleNode warmup, cosine, join;
      warmup.kind = ScheduleNode::Kind::kPolynomial;
      warmup.init_value = 0.0;
      warmup.end_value = 0.1;
      warmup.steps = 2;
      cosine.kind = ScheduleNode::Kind::kCosineDecay;
      cosine.init_value = 0.1;
      cosine.steps = 3;
      cosine.alpha = 0.1;
      cosine.power = 1.5;
      h.schedules.knots[0].node = h.schedules.Add(warmup);
      h.schedules.knots[1].node = h.schedules.Add(cosine);
      h.schedules.knots[1].step = 2;
      h.schedules.num_knots = 2;
      join.kind = ScheduleNode::Kind::kJoin;
      join.first = 0;
      join.num = 2;
      h.learning_rate = h.schedules.Add(join);
      break;
    }
  }
  return h;
}

// Chains (OptimizerHyperparams::links) as the server builds them for
// rmsprop, lion and optax.chain: kChainCases cases after the fused ones.
constexpr int kFusedCases = 6;
constexpr int kChainCases = 4;
OptimizerHyperparams ChainFor(int chain_case) {
  using Kind = OptimizerLink::Kind;
  OptimizerHyperparams h;
  auto link = [&](Kind kind, int state = 0) -> OptimizerLink& {
    OptimizerLink& l = h.links[h.num_links++];
    l.kind = kind;
    l.state = state;
    return l;
  };
  auto lr = [&](int32_t node) {
    link(Kind::kScaleByLearningRate).schedule = node;
    if (h.learning_rate < 0) h.learning_rate = node;
  };
  switch (chain_case) {
    case 0: {  // rmsprop(centered, momentum, nesterov) under exponential_decay
      ScheduleNode e;
      e.kind = ScheduleNode::Kind::kExponentialDecay;
      e.init_value = 0.05;
      e.steps = 2;
      e.rate = 0.5;
      e.begin = 1;
      OptimizerLink& s = link(Kind::kScaleByStddev, 0);
      s.b2 = 0.9;
      s.eps = 1e-4;
      s.flag = 1;
      lr(h.schedules.Add(e));
      OptimizerLink& t = link(Kind::kTrace, 2);
      t.b1 = 0.9;
      t.flag = 1;
      h.num_state = 3;
      break;
    }
    case 1: {  // clip_by_global_norm then lion(weight_decay) under piecewise_constant
      ScheduleNode pc;
      pc.kind = ScheduleNode::Kind::kPiecewiseConstant;
      pc.init_value = 0.02;
      pc.first = 0;
      pc.num = 2;
      h.schedules.knots[0].step = 1;
      h.schedules.knots[0].scale = 0.5;
      h.schedules.knots[1].step = 3;
      h.schedules.knots[1].scale = 0.1;
      h.schedules.num_knots = 2;
      link(Kind::kClipByGlobalNorm).value = 5.0;
      OptimizerLink& l = link(Kind::kScaleByLion, 0);
      l.b1 = 0.9;
      l.b2 = 0.99;
      link(Kind::kAddDecayedWeights).value = 0.1;
      lr(h.schedules.Add(pc));
      h.num_state = 1;
      break;
    }
    case 2: {  // chain(adam(-1), clip_by_global_norm, add_decayed_weights,
               // scale_by_learning_rate(linear), clip, scale)
      ScheduleNode linear;
      linear.kind = ScheduleNode::Kind::kPolynomial;
      linear.init_value = 0.1;
      linear.end_value = 0.01;
      linear.steps = 4;
      OptimizerLink& a = link(Kind::kScaleByAdam, 0);
      a.b1 = 0.9;
      a.b2 = 0.999;
      a.eps = 1e-8;
      a.eps_root = 1e-6;
      link(Kind::kScale).value = 1.0;
      link(Kind::kClipByGlobalNorm).value = 20.0;
      link(Kind::kAddDecayedWeights).value = 0.01;
      lr(h.schedules.Add(linear));
      link(Kind::kClip).value = 0.02;
      link(Kind::kScale).value = 0.5;
      h.num_state = 2;
      break;
    }
    default: {  // chain(rmsprop(eps outside the root), lion, two clips)
      OptimizerLink& r = link(Kind::kScaleByRms, 0);
      r.b2 = 0.8;
      r.eps = 1e-3;
      r.flag = 0;
      lr(h.schedules.AddConstant(-1.0));
      OptimizerLink& l = link(Kind::kScaleByLion, 1);
      l.b1 = 0.8;
      l.b2 = 0.95;
      lr(h.schedules.AddConstant(0.01));
      link(Kind::kClipByGlobalNorm).value = 1.0;
      link(Kind::kClipByGlobalNorm).value = 0.5;
      h.num_state = 2;
      break;
    }
  }
  return h;
}

OptimizerHyperparams StepCase(int step_case) {
  return step_case < kFusedCases ? HyperparamsFor(step_case) : ChainFor(step_case - kFusedCases);
}

// One backend's copy of the parameters, moments and counters.
struct StepState {
  std::vector<Tensor> storage;  // what the unaligned slots are views into
  std::vector<OptimizerSlot> slots;
  Tensor count, total_notfinite;
  std::unique_ptr<OptimizerPlan> plan;
};

class OptimizerStepGpuTest : public OptimizerGpuTest {
 protected:
  // A layout on the CPU: sizes, dtypes and slices chosen by `spec`.
  struct SlotSpec {
    int64_t numel;
    DType dtype;
    bool unaligned;  // a view one element into a bigger tensor
  };
  StepState MakeCpu(const std::vector<SlotSpec>& specs, const OptimizerHyperparams& h,
                    uint32_t seed) {
    const bool chain = h.num_links > 0;
    const bool adam = !chain && h.rule == Rule::kAdam;
    const bool trace = !chain && !adam && h.momentum != 0.0;
    // A chain's state in the ranges its link keeps it in: second moments
    // positive and above the square of a first moment kept beside them.
    std::vector<std::pair<float, float>> ranges(h.num_state, {-0.5f, 0.5f});
    for (int k = 0; k < h.num_links; ++k) {
      const OptimizerLink& l = h.links[k];
      if (l.kind == OptimizerLink::Kind::kScaleByAdam ||
          l.kind == OptimizerLink::Kind::kScaleByStddev) {
        ranges[l.state] = {-0.1f, 0.1f};
        ranges[l.state + 1] = {0.05f, 1.0f};
      } else if (l.kind == OptimizerLink::Kind::kScaleByRms) {
        ranges[l.state] = {0.01f, 1.0f};
      }
    }
    StepState s;
    for (size_t i = 0; i < specs.size(); ++i) {
      const SlotSpec& spec = specs[i];
      auto make = [&](uint32_t k, float lo, float hi) {
        const int64_t extra = spec.unaligned ? 1 : 0;
        Tensor t = testing::MakeRandom(cpu_, spec.dtype, {spec.numel + extra}, seed + 7 * i + k, lo, hi);
        s.storage.push_back(t);
        return spec.unaligned ? t.Slice0(1, spec.numel + 1) : t;
      };
      OptimizerSlot slot;
      slot.param = make(0, -2.0f, 2.0f);
      if (adam || trace) slot.mu = make(1, -0.5f, 0.5f);
      if (adam) slot.nu = make(2, 0.01f, 1.0f);
      for (int j = 0; j < h.num_state; ++j) {
        slot.state.push_back(make(3 + j, ranges[j].first, ranges[j].second));
      }
      s.slots.push_back(slot);
    }
    s.count = *cpu_.Allocate(DType::kI32, {1});
    s.total_notfinite = *cpu_.Allocate(DType::kI32, {1});
    *s.count.data_as<int32_t>() = 0;
    *s.total_notfinite.data_as<int32_t>() = 0;
    return s;
  }
  // The same values on the GPU, unaligned views included.
  StepState ToGpu(const StepState& c) {
    StepState g;
    auto up = [&](const Tensor& t) -> Tensor {
      // No moment: none on the GPU either. An empty slot stays an empty
      // tensor of its shape (its storage may be null on the CPU).
      if (t.data() == nullptr && t.shape().empty()) return Tensor();
      if (t.numel() == 0) return *gpu_->Allocate(t.dtype(), t.shape());
      // A view of the CPU storage: upload that storage and take the same view.
      for (const Tensor& base : c.storage) {
        const char* b = static_cast<const char*>(base.data());
        const char* p = static_cast<const char*>(t.data());
        if (p > b && p < b + base.nbytes()) {
          Tensor whole = Upload(base);
          g.storage.push_back(whole);
          const int64_t offset = (p - b) / static_cast<int64_t>(DTypeSize(t.dtype()));
          return whole.Slice0(offset, offset + t.numel());
        }
      }
      return Upload(t);
    };
    for (const OptimizerSlot& s : c.slots) {
      g.slots.push_back({up(s.param), up(s.mu), up(s.nu)});
      for (const Tensor& t : s.state) g.slots.back().state.push_back(up(t));
    }
    g.count = Upload(c.count);
    g.total_notfinite = Upload(c.total_notfinite);
    return g;
  }
  std::vector<Tensor> Grads(const std::vector<SlotSpec>& specs, DType grad_dtype, uint32_t seed,
                            int skip_slot, bool poison) {
    std::vector<Tensor> grads;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (static_cast<int>(i) == skip_slot) {
        grads.emplace_back();  // no gradient reached this param
        continue;
      }
      const DType d = grad_dtype == DType::kF32 ? DType::kF32 : specs[i].dtype;
      Tensor g = testing::MakeRandom(cpu_, d, {specs[i].numel}, seed + 31 * i);
      grads.push_back(g);
    }
    if (poison) StoreFromFloat(&grads.back(), grads.back().numel() / 2, NAN);
    return grads;
  }
  OptimizerStepInfo GpuInfo(const OptimizerPlan& plan) {
    OptimizerStepInfo info;
    EXPECT_TRUE(gpu_->Download(plan.info(), &info).ok());
    return info;
  }
  static OptimizerStepInfo CpuInfo(const OptimizerPlan& plan) {
    OptimizerStepInfo info;
    std::memcpy(&info, plan.info().data(), sizeof(info));
    return info;
  }
  // lion's update is sign(x): where x is within rounding of 0 the backends
  // (the GPU's fused multiply-adds) may take opposite signs, a difference of
  // 2 lr in that one element. `sign_flips`: such elements, at most one in
  // kFlipsPer, are left out and the rest compared as usual.
  static constexpr int64_t kFlipsPer = 10000;
  void ExpectSame(const StepState& cpu, const StepState& gpu, int step, bool sign_flips = false) {
    for (size_t i = 0; i < cpu.slots.size(); ++i) {
      const double tol = Tolerance(cpu.slots[i].param.dtype());
      std::vector<double> got = ToDoubles(Download(gpu.slots[i].param));
      std::vector<double> want = ToDoubles(cpu.slots[i].param);
      if (sign_flips) {
        // Past rounding: 3 bf16 ulps, or 1e-4 in f32 (a flip is >= 2e-3 here).
        const double past = cpu.slots[i].param.dtype() == DType::kF32 ? 1e-4 : 3.0 / 256;
        std::vector<double> kept_got, kept_want;
        int64_t flips = 0;
        for (size_t k = 0; k < got.size(); ++k) {
          if (std::abs(got[k] - want[k]) > past * (1.0 + std::abs(want[k]))) {
            ++flips;
            continue;
          }
          kept_got.push_back(got[k]);
          kept_want.push_back(want[k]);
        }
        EXPECT_LE(flips, 1 + static_cast<int64_t>(got.size()) / kFlipsPer)
            << "slot " << i << " param, step " << step;
        got = std::move(kept_got);
        want = std::move(kept_want);
      }
      if (!want.empty()) {
        EXPECT_LT(RelativeError(got, want), tol) << "slot " << i << " param, step " << step;
      }
      if (cpu.slots[i].mu.data() != nullptr) {
        EXPECT_LT(RelativeError(Download(gpu.slots[i].mu), ToDoubles(cpu.slots[i].mu)), tol)
            << "slot " << i << " mu, step " << step;
      }
      if (cpu.slots[i].nu.data() != nullptr) {
        EXPECT_LT(RelativeError(Download(gpu.slots[i].nu), ToDoubles(cpu.slots[i].nu)), tol)
            << "slot " << i << " nu, step " << step;
      }
      for (size_t j = 0; j < cpu.slots[i].state.size(); ++j) {
        if (cpu.slots[i].param.numel() == 0) continue;
        EXPECT_LT(RelativeError(Download(gpu.slots[i].state[j]), ToDoubles(cpu.slots[i].state[j])),
                  tol)
            << "slot " << i << " state " << j << ", step " << step;
      }
    }
  }
  // Every value of every slot, to check that a skipped step wrote nothing.
  std::vector<std::vector<double>> Snapshot(const StepState& gpu) {
    std::vector<std::vector<double>> all;
    for (const OptimizerSlot& s : gpu.slots) {
      for (const Tensor* t : {&s.param, &s.mu, &s.nu}) {
        if (t->data() != nullptr) all.push_back(ToDoubles(Download(*t)));
      }
      for (const Tensor& t : s.state) {
        if (t.data() != nullptr) all.push_back(ToDoubles(Download(t)));
      }
    }
    return all;
  }

  // Steps 1..5 on both backends from the same values: step 3's gradient
  // holds a NaN (skipped on the device), slot `skip_slot` has no gradient in
  // step 2. Params, moments, counters and the info record agree each step.
  void RunSteps(const OptimizerHyperparams& h, const std::vector<SlotSpec>& specs,
                DType grad_dtype, int skip_slot) {
    StepState cpu = MakeCpu(specs, h, 100);
    StepState gpu = ToGpu(cpu);
    auto cpu_plan = cpu_.NewOptimizerPlan(h, cpu.slots, cpu.count, cpu.total_notfinite);
    ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();
    auto gpu_plan = gpu_->NewOptimizerPlan(h, gpu.slots, gpu.count, gpu.total_notfinite);
    ASSERT_TRUE(gpu_plan.ok()) << gpu_plan.status();
    int32_t want_count = 0, want_notfinite = 0;
    for (int step = 1; step <= 5; ++step) {
      const bool poison = step == 3;
      std::vector<Tensor> grads =
          Grads(specs, grad_dtype, 1000 * step, step == 2 ? skip_slot : -1, poison);
      double norm_sq = 0;
      for (const Tensor& g : grads) {
        if (g.data() == nullptr) continue;
        for (double x : ToDoubles(g)) norm_sq += x * x;
      }
      std::vector<Tensor> gpu_grads;
      for (const Tensor& g : grads) gpu_grads.push_back(g.data() == nullptr ? Tensor() : Upload(g));
      const std::vector<std::vector<double>> before = poison ? Snapshot(gpu) : decltype(Snapshot(gpu)){};
      ASSERT_TRUE(cpu_.OptimizerStep(**cpu_plan, cpu.slots, grads, &cpu.count,
                                     &cpu.total_notfinite).ok());
      ASSERT_TRUE(gpu_->OptimizerStep(**gpu_plan, gpu.slots, gpu_grads, &gpu.count,
                                      &gpu.total_notfinite).ok());
      const OptimizerStepInfo ci = CpuInfo(**cpu_plan), gi = GpuInfo(**gpu_plan);
      EXPECT_EQ(gi.applied, poison ? 0 : 1) << step;
      EXPECT_EQ(gi.applied, ci.applied) << step;
      if (!poison) {
        ++want_count;
        // Both sums against float64: float32 accumulation in different orders.
        EXPECT_NEAR(gi.grad_norm_sq, norm_sq, testing::kF32Tolerance * norm_sq) << step;
        EXPECT_NEAR(ci.grad_norm_sq, norm_sq, testing::kF32Tolerance * norm_sq) << step;
      } else {
        ++want_notfinite;
        EXPECT_FALSE(std::isfinite(gi.grad_norm_sq)) << step;
      }
      EXPECT_EQ(gi.count, want_count) << step;
      EXPECT_EQ(ci.count, want_count) << step;
      EXPECT_EQ(gi.total_notfinite, want_notfinite) << step;
      EXPECT_EQ(ci.total_notfinite, want_notfinite) << step;
      // The schedule in float64 on the device and on the host.
      EXPECT_NEAR(gi.learning_rate, ci.learning_rate, 1e-12) << step;
      EXPECT_EQ(ci.learning_rate,
                LearningRateAt(h.schedules, h.learning_rate, want_count - (poison ? 0 : 1)));
      int32_t gpu_count = 0;
      ASSERT_TRUE(gpu_->Download(gpu.count, &gpu_count).ok());
      EXPECT_EQ(gpu_count, want_count);
      if (poison) {
        EXPECT_EQ(Snapshot(gpu), before) << "a non-finite step must write nothing";
      }
      ExpectSame(cpu, gpu, step, HasLion(h));
    }
  }
  static bool HasLion(const OptimizerHyperparams& h) {
    for (int k = 0; k < h.num_links; ++k) {
      if (h.links[k].kind == OptimizerLink::Kind::kScaleByLion) return true;
    }
    return false;
  }
};

TEST_P(OptimizerStepGpuTest, ManySlotsMatchCpuReference) {
  const auto [rule_case, dtype] = GetParam();
  const OptimizerHyperparams h = StepCase(rule_case);
  // Odd sizes around the kernels' 16 K-element chunks and 8-element packs,
  // one unaligned slot, one of the other dtype (a second segment), one empty.
  const DType other = dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
  const std::vector<SlotSpec> specs = {
      {129 * 67, dtype, false}, {1, dtype, false},     {7, dtype, false},
      {16384 + 3, dtype, false}, {3 * 16384, dtype, false}, {1000, dtype, true},
      {4099, other, false},      {0, dtype, false},    {40001, dtype, false}};
  RunSteps(h, specs, dtype, /*skip_slot=*/3);
}

// Gradients in float32 for bf16 params (another grad dtype per launch).
TEST_P(OptimizerStepGpuTest, Float32GradsMatchCpuReference) {
  const auto [rule_case, dtype] = GetParam();
  const std::vector<SlotSpec> specs = {{5000, dtype, false}, {333, dtype, true}, {17, dtype, false}};
  RunSteps(StepCase(rule_case), specs, DType::kF32, /*skip_slot=*/0);
}

INSTANTIATE_TEST_SUITE_P(Rules, OptimizerStepGpuTest,
                         ::testing::Combine(::testing::Range(0, kFusedCases + kChainCases),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

// Not parameterised: the step fixture's helpers with one fixed case each.
class OptimizerManySlotsGpuTest : public OptimizerStepGpuTest {};

// More slots than one launch's argument block carries: several segments.
TEST_F(OptimizerManySlotsGpuTest, SevenHundredSlotsInSeveralLaunches) {
  std::vector<SlotSpec> specs;
  for (int i = 0; i < 700; ++i) specs.push_back({1 + (i * 37) % 300, DType::kF32, i % 5 == 0});
  RunSteps(HyperparamsFor(4), specs, DType::kF32, /*skip_slot=*/650);
}

// The same for a chain: its state table spans the segments too.
TEST_F(OptimizerManySlotsGpuTest, SevenHundredSlotsUnderAChain) {
  std::vector<SlotSpec> specs;
  for (int i = 0; i < 700; ++i) specs.push_back({1 + (i * 37) % 300, DType::kF32, i % 5 == 0});
  RunSteps(ChainFor(3), specs, DType::kF32, /*skip_slot=*/650);
}

// ---- OptimizerStep's FP8 copies ------------------------------------------------------

std::vector<uint8_t> Bytes(const Tensor& host) {
  const auto* p = static_cast<const uint8_t*>(host.data());
  return std::vector<uint8_t>(p, p + host.nbytes());
}

// Not parameterised (the step fixture's parameters are not used): each test
// runs its cases in a loop.
class OptimizerFp8CopyGpuTest : public OptimizerStepGpuTest {
 protected:
  struct CopySpec {
    int64_t rows, cols;  // 0: no copy (a 1-D param of `rows` elements)
    bool unaligned;
  };
  // A copy of [rows, cols] in `dtype` on `ops`: bytes unlike any the step
  // writes, and no record (kept_scale NaN).
  OptimizerFp8Copy NewCopy(Ops& ops, int64_t rows, int64_t cols, DType dtype) {
    std::vector<uint8_t> junk(static_cast<size_t>(rows * cols), 0x5a);
    OptimizerFp8Copy c;
    c.data = *ops.Allocate(dtype, {rows, cols});
    c.data_t = *ops.Allocate(dtype, {cols, rows});
    EXPECT_TRUE(ops.Upload(junk.data(), &c.data).ok());
    EXPECT_TRUE(ops.Upload(junk.data(), &c.data_t).ok());
    for (auto [t, v] : {std::pair<Tensor*, float>{&c.scale_inv, -1.0f},
                        {&c.kept_scale, std::nanf("")},
                        {&c.kept_amax, -1.0f}}) {
      *t = *ops.Allocate(DType::kF32, {1});
      EXPECT_TRUE(ops.Upload(&v, t).ok());
    }
    return c;
  }
  // The step's scales: a new tensor each step on each backend (as a session
  // passes them), E4M3's saturating at the largest.
  void SetScales(StepState* cpu, StepState* gpu, int step) {
    for (size_t i = 0; i < cpu->slots.size(); ++i) {
      if (cpu->slots[i].fp8.data.data() == nullptr) continue;
      const float scale = std::vector<float>{3.0f, 150.0f, 0.75f, 900.0f}[(i + step) % 4];
      cpu->slots[i].fp8.scale = testing::Scalar(cpu_, scale);
      gpu->slots[i].fp8.scale = Upload(cpu->slots[i].fp8.scale);
    }
  }
  // Every byte of every GPU copy.
  std::vector<std::vector<uint8_t>> CopySnapshot(const StepState& gpu) {
    std::vector<std::vector<uint8_t>> all;
    for (const OptimizerSlot& s : gpu.slots) {
      if (s.fp8.data.data() == nullptr) continue;
      for (const Tensor* t : {&s.fp8.data, &s.fp8.data_t, &s.fp8.scale_inv, &s.fp8.kept_scale,
                              &s.fp8.kept_amax}) {
        all.push_back(Bytes(Download(*t)));
      }
    }
    return all;
  }
  // The GPU copy is what the GPU's QuantizeTranspose makes of the GPU's new
  // param (so the next forward would find what it would have made), bit for
  // bit; against the CPU's copy, within the FP8 format (the params may
  // differ in their last bits).
  void ExpectCopies(const StepState& cpu, const StepState& gpu, DType fp8, int step) {
    for (size_t i = 0; i < gpu.slots.size(); ++i) {
      const OptimizerFp8Copy& g = gpu.slots[i].fp8;
      const OptimizerFp8Copy& c = cpu.slots[i].fp8;
      if (g.data.data() == nullptr) continue;
      SCOPED_TRACE(::testing::Message() << "slot " << i << ", step " << step);
      Fp8Output out;
      out.scale = g.scale;
      out.amax = *gpu_->Allocate(DType::kF32, {1});
      out.scale_inv = *gpu_->Allocate(DType::kF32, {1});
      Tensor y = *gpu_->Allocate(fp8, g.data.shape());
      Tensor y_t = *gpu_->Allocate(fp8, g.data_t.shape());
      ASSERT_TRUE(gpu_->QuantizeTranspose(gpu.slots[i].param.Reshaped(g.data.shape()), out, &y,
                                          &y_t)
                      .ok());
      EXPECT_EQ(Bytes(Download(g.data)), Bytes(Download(y)));
      EXPECT_EQ(Bytes(Download(g.data_t)), Bytes(Download(y_t)));
      EXPECT_EQ(Bytes(Download(g.kept_amax)), Bytes(Download(out.amax)));
      EXPECT_EQ(Bytes(Download(g.scale_inv)), Bytes(Download(out.scale_inv)));
      EXPECT_EQ(Bytes(Download(g.kept_scale)), Bytes(Download(g.scale)));
      // Against the CPU reference: the codes dequantized, both layouts.
      for (const auto& [gt, ct] : {std::pair<const Tensor*, const Tensor*>{&g.data, &c.data},
                                  {&g.data_t, &c.data_t}}) {
        const std::vector<double> want = ToDoubles(*ct);
        EXPECT_LT(RelativeError(Download(*gt), want), Tolerance(fp8));
      }
      EXPECT_EQ(Bytes(Download(g.scale_inv)), Bytes(c.scale_inv));
      EXPECT_EQ(Bytes(Download(g.kept_scale)), Bytes(c.kept_scale));
      EXPECT_NEAR(testing::ScalarValue(Download(g.kept_amax)), testing::ScalarValue(c.kept_amax),
                  Tolerance(gpu.slots[i].param.dtype()) * testing::ScalarValue(c.kept_amax));
    }
  }
  // Five steps on both backends: step 2 leaves slot 1 without a gradient,
  // step 3's gradient holds a NaN (skipped); copies of odd shapes (byte
  // transposes), of shapes the 16-byte transpose takes (multiples of 16), of
  // one the word transpose takes (multiples of 4), of a param over several
  // 16 K chunks and of an unaligned param view.
  void RunCopySteps(int rule_case, DType dtype, DType fp8);
};

// Every rule case with and without moments, and a chain, f32 and bf16
// params, both formats.
TEST_F(OptimizerFp8CopyGpuTest, CopiesMatchQuantizeTransposeOfTheNewParams) {
  for (int rule_case : {0, 4, kFusedCases + 2}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (DType fp8 : {DType::kE4M3, DType::kE5M2}) {
        SCOPED_TRACE(::testing::Message() << "rule case " << rule_case << ", "
                                          << DTypeName(dtype) << " params, " << DTypeName(fp8));
        RunCopySteps(rule_case, dtype, fp8);
      }
    }
  }
}

void OptimizerFp8CopyGpuTest::RunCopySteps(int rule_case, DType dtype, DType fp8) {
  const OptimizerHyperparams h = StepCase(rule_case);
  const std::vector<CopySpec> copies = {
      {129, 67, false}, {256, 384, false}, {7, 0, false}, {40, 25, true}, {64, 64, false},
      {68, 36, false}};
  std::vector<SlotSpec> specs;
  for (const CopySpec& c : copies) {
    specs.push_back({c.cols == 0 ? c.rows : c.rows * c.cols, dtype, c.unaligned});
  }
  StepState cpu = MakeCpu(specs, h, 300);
  StepState gpu = ToGpu(cpu);
  for (size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].cols == 0) continue;
    cpu.slots[i].fp8 = NewCopy(cpu_, copies[i].rows, copies[i].cols, fp8);
    gpu.slots[i].fp8 = NewCopy(*gpu_, copies[i].rows, copies[i].cols, fp8);
  }
  SetScales(&cpu, &gpu, 0);
  auto cpu_plan = cpu_.NewOptimizerPlan(h, cpu.slots, cpu.count, cpu.total_notfinite);
  ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();
  auto gpu_plan = gpu_->NewOptimizerPlan(h, gpu.slots, gpu.count, gpu.total_notfinite);
  ASSERT_TRUE(gpu_plan.ok()) << gpu_plan.status();
  for (int step = 1; step <= 5; ++step) {
    SetScales(&cpu, &gpu, step);
    const bool poison = step == 3;
    const int skip_slot = step == 2 ? 1 : -1;
    std::vector<Tensor> grads = Grads(specs, dtype, 1000 * step, skip_slot, poison);
    std::vector<Tensor> gpu_grads;
    for (const Tensor& g : grads) gpu_grads.push_back(g.data() == nullptr ? Tensor() : Upload(g));
    const auto before = CopySnapshot(gpu);
    ASSERT_TRUE(cpu_.OptimizerStep(**cpu_plan, cpu.slots, grads, &cpu.count,
                                   &cpu.total_notfinite).ok());
    ASSERT_TRUE(gpu_->OptimizerStep(**gpu_plan, gpu.slots, gpu_grads, &gpu.count,
                                    &gpu.total_notfinite).ok());
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const auto after = CopySnapshot(gpu);
    if (poison) {
      EXPECT_EQ(after, before) << "a skipped step must leave every copy";
      continue;
    }
    if (skip_slot >= 0) {
      // Slot 1 is the second copy: its 5 tensors in the snapshot.
      for (int k = 5; k < 10; ++k) EXPECT_EQ(after[k], before[k]) << "slot 1 had no gradient";
    }
    ExpectSame(cpu, gpu, step, HasLion(h));
    // A slot left alone this step keeps its copy of the previous step's
    // scale, which the check below would not take for current.
    if (skip_slot >= 0) {
      gpu.slots[skip_slot].fp8.scale = Upload(Download(gpu.slots[skip_slot].fp8.kept_scale));
      cpu.slots[skip_slot].fp8.scale = cpu.slots[skip_slot].fp8.kept_scale;
    }
    ExpectCopies(cpu, gpu, fp8, step);
  }
}

// The compute copies (OptimizerSlot::compute_copy) of float32 params: after
// each step every copy is, byte for byte, what Cast makes of the new param
// on the same backend, and matches the CPU reference's copy; a skipped step
// and a slot without a gradient leave theirs. Slots across the update's
// 16 K chunks, an unaligned param view, bf16 and f16 copies, Adam and a
// chain.
TEST_F(OptimizerFp8CopyGpuTest, ComputeCopiesAreTheNewParamsCast) {
  for (int rule_case : {0, kFusedCases + 2}) {
    SCOPED_TRACE(::testing::Message() << "rule case " << rule_case);
    const OptimizerHyperparams h = StepCase(rule_case);
    const std::vector<SlotSpec> specs = {
        {40000, DType::kF32, false}, {1001, DType::kF32, true}, {64, DType::kF32, false}};
    const std::vector<DType> copy_dtypes = {DType::kBF16, DType::kF16, DType::kBF16};
    StepState cpu = MakeCpu(specs, h, 500);
    StepState gpu = ToGpu(cpu);
    for (size_t i = 0; i < specs.size(); ++i) {
      cpu.slots[i].compute_copy = *cpu_.Allocate(copy_dtypes[i], {specs[i].numel});
      gpu.slots[i].compute_copy = *gpu_->Allocate(copy_dtypes[i], {specs[i].numel});
      ASSERT_TRUE(cpu_.Cast(cpu.slots[i].param, &cpu.slots[i].compute_copy).ok());
      ASSERT_TRUE(gpu_->Cast(gpu.slots[i].param, &gpu.slots[i].compute_copy).ok());
    }
    auto cpu_plan = cpu_.NewOptimizerPlan(h, cpu.slots, cpu.count, cpu.total_notfinite);
    ASSERT_TRUE(cpu_plan.ok()) << cpu_plan.status();
    auto gpu_plan = gpu_->NewOptimizerPlan(h, gpu.slots, gpu.count, gpu.total_notfinite);
    ASSERT_TRUE(gpu_plan.ok()) << gpu_plan.status();
    for (int step = 1; step <= 5; ++step) {
      SCOPED_TRACE(step);
      const bool poison = step == 3;
      const int skip_slot = step == 2 ? 1 : -1;
      std::vector<Tensor> grads = Grads(specs, DType::kF32, 1000 * step, skip_slot, poison);
      std::vector<Tensor> gpu_grads;
      for (const Tensor& g : grads) gpu_grads.push_back(g.data() == nullptr ? Tensor() : Upload(g));
      std::vector<std::vector<uint8_t>> before;
      for (const OptimizerSlot& s : gpu.slots) before.push_back(Bytes(Download(s.compute_copy)));
      ASSERT_TRUE(cpu_.OptimizerStep(**cpu_plan, cpu.slots, grads, &cpu.count,
                                     &cpu.total_notfinite).ok());
      ASSERT_TRUE(gpu_->OptimizerStep(**gpu_plan, gpu.slots, gpu_grads, &gpu.count,
                                      &gpu.total_notfinite).ok());
      for (size_t i = 0; i < specs.size(); ++i) {
        const Tensor& copy = gpu.slots[i].compute_copy;
        if (poison || static_cast<int>(i) == skip_slot) {
          EXPECT_EQ(Bytes(Download(copy)), before[i]) << "slot " << i << " must keep its copy";
          continue;
        }
        Tensor want = *gpu_->Allocate(copy.dtype(), copy.shape());
        ASSERT_TRUE(gpu_->Cast(gpu.slots[i].param, &want).ok());
        EXPECT_EQ(Bytes(Download(copy)), Bytes(Download(want))) << "slot " << i;
        EXPECT_LT(RelativeError(Download(copy), ToDoubles(cpu.slots[i].compute_copy)),
                  Tolerance(copy.dtype()))
            << "slot " << i;
      }
    }
  }
}

// A plan is for its tensors: others are INVALID_ARGUMENT, on both backends.
TEST_F(OptimizerManySlotsGpuTest, StaleSlotsAreInvalidArgument) {
  const std::vector<SlotSpec> specs = {{10, DType::kF32, false}};
  OptimizerHyperparams h = HyperparamsFor(3);
  StepState cpu = MakeCpu(specs, h, 1);
  StepState gpu = ToGpu(cpu);
  auto plan = gpu_->NewOptimizerPlan(h, gpu.slots, gpu.count, gpu.total_notfinite);
  ASSERT_TRUE(plan.ok()) << plan.status();
  StepState other = ToGpu(cpu);  // same values, other memory
  std::vector<Tensor> grads = {Upload(testing::MakeRandom(cpu_, DType::kF32, {10}, 3))};
  EXPECT_EQ(gpu_->OptimizerStep(**plan, other.slots, grads, &other.count, &other.total_notfinite)
                .code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<Tensor> short_grads = {Upload(testing::MakeRandom(cpu_, DType::kF32, {9}, 3))};
  EXPECT_EQ(gpu_->OptimizerStep(**plan, gpu.slots, short_grads, &gpu.count, &gpu.total_notfinite)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te
