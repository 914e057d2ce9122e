// OptimizerUpdate against a float64 reference of optax's formulas, on random
// values (never zeros), over several steps so the moments carry over; and
// OptimizerStep's FP8 copies against QuantizeTranspose of the new params.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::MakeTensor;
using testing::RelativeError;
using testing::ScalarValue;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;
using Rule = OptimizerUpdateArgs::Rule;

// The parameter's change (param_out - param_in) is compared in float32, not
// the parameter: the change is what the formula computes, and against a
// parameter of |p| ~ 1 a wrong update of 1e-3 would hide under the bound. In
// bf16 a change can be smaller than the parameter's ulp, so there each
// parameter must be its float64 reference rounded to bf16, within one bf16
// ulp (2^-7 relative: half an ulp of rounding, the rest for float32 math).
constexpr double kBf16ParamUlps = 1.0 / 128;

struct Case {
  std::string name;
  OptimizerUpdateArgs args;
  bool trace = false;  // sgd with momentum
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  OptimizerUpdateArgs sgd;
  sgd.rule = Rule::kSgd;
  sgd.learning_rate = 0.3f;
  cases.push_back({"sgd", sgd});
  OptimizerUpdateArgs momentum = sgd;
  momentum.momentum = 0.9f;
  cases.push_back({"sgd_momentum", momentum, true});
  OptimizerUpdateArgs nesterov = momentum;
  nesterov.nesterov = true;
  cases.push_back({"sgd_nesterov", nesterov, true});
  OptimizerUpdateArgs adam;
  adam.rule = Rule::kAdam;
  adam.learning_rate = 0.2f;
  adam.b1 = 0.8f;
  adam.b2 = 0.95f;
  adam.eps = 1e-3f;
  adam.eps_root = 1e-4f;
  cases.push_back({"adam", adam});
  OptimizerUpdateArgs adamw = adam;
  adamw.eps = 1e-8f;
  adamw.eps_root = 0.0f;
  adamw.weight_decay = 0.05f;
  cases.push_back({"adamw", adamw});
  OptimizerUpdateArgs clipped = adamw;
  clipped.max_norm = 1.5f;  // below the random gradients' norm: clipping acts
  cases.push_back({"adamw_clipped", clipped});
  OptimizerUpdateArgs clipped_sgd = momentum;
  clipped_sgd.max_norm = 1e6f;  // above it: the gradients pass unchanged
  cases.push_back({"sgd_momentum_unclipped", clipped_sgd, true});
  return cases;
}

// optax's update of one element, in float64, from the stored inputs.
struct Ref {
  double param, mu, nu;
};
Ref Reference(const OptimizerUpdateArgs& a, bool trace, double g, double p, double mu, double nu,
              double norm) {
  if (a.max_norm > 0 && !(norm < a.max_norm)) g = g / norm * a.max_norm;
  double u = g;
  Ref r{p, mu, nu};
  if (a.rule == Rule::kAdam) {
    r.mu = (1 - double(a.b1)) * g + double(a.b1) * mu;
    r.nu = (1 - double(a.b2)) * g * g + double(a.b2) * nu;
    u = (r.mu / a.bias_correction1) / (std::sqrt(r.nu / a.bias_correction2 + a.eps_root) + a.eps);
  } else if (trace) {
    r.mu = g + double(a.momentum) * mu;
    u = a.nesterov ? g + double(a.momentum) * r.mu : r.mu;
  }
  u += double(a.weight_decay) * p;
  r.param = p - double(a.learning_rate) * u;
  return r;
}

class OptimizerUpdateTest : public ::testing::TestWithParam<std::tuple<Case, DType>> {};

TEST_P(OptimizerUpdateTest, MatchesFloat64OptaxOverSteps) {
  const auto& [c, dtype] = GetParam();
  CpuOps ops;
  const Shape shape = {37, 19};  // odd sizes
  Tensor param = MakeRandom(ops, dtype, shape, 11);
  const bool adam = c.args.rule == Rule::kAdam;
  Tensor mu = adam || c.trace ? MakeRandom(ops, dtype, shape, 12, -0.5f, 0.5f) : Tensor();
  Tensor nu = adam ? MakeRandom(ops, dtype, shape, 13, 0.01f, 1.0f) : Tensor();
  for (int step = 1; step <= 4; ++step) {
    OptimizerUpdateArgs args = c.args;
    args.bias_correction1 = static_cast<float>(1 - std::pow(double(args.b1), step));
    args.bias_correction2 = static_cast<float>(1 - std::pow(double(args.b2), step));
    Tensor grad = MakeRandom(ops, dtype, shape, 100 + step);
    const std::vector<double> g = ToDoubles(grad), p = ToDoubles(param);
    const std::vector<double> m = mu.defined() ? ToDoubles(mu) : std::vector<double>(g.size());
    const std::vector<double> v = nu.defined() ? ToDoubles(nu) : std::vector<double>(g.size());
    double norm_sq = 0;
    for (double x : g) norm_sq += x * x;
    Tensor norm_sq_t = MakeTensor(ops, DType::kF32, {1}, {static_cast<float>(norm_sq)});
    ASSERT_TRUE(ops.OptimizerUpdate(args, grad, norm_sq_t, &param, mu.defined() ? &mu : nullptr,
                                    nu.defined() ? &nu : nullptr)
                    .ok());
    std::vector<double> ref_delta(g.size()), ref_mu(g.size()), ref_nu(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const Ref r = Reference(args, c.trace, g[i], p[i], m[i], v[i], std::sqrt(norm_sq));
      ref_delta[i] = r.param - p[i];
      ref_mu[i] = r.mu;
      ref_nu[i] = r.nu;
    }
    const std::vector<double> out = ToDoubles(param);
    if (dtype == DType::kBF16) {
      for (size_t i = 0; i < out.size(); ++i) {
        const double ref = p[i] + ref_delta[i];
        ASSERT_LE(std::fabs(out[i] - ref), kBf16ParamUlps * std::fabs(ref)) << "step " << step << " [" << i << "]";
      }
    } else {
      std::vector<double> delta(out.size());
      for (size_t i = 0; i < out.size(); ++i) delta[i] = out[i] - p[i];
      EXPECT_LT(RelativeError(delta, ref_delta), Tolerance(dtype)) << "step " << step;
    }
    if (mu.defined()) { EXPECT_LT(RelativeError(mu, ref_mu), Tolerance(dtype)) << "step " << step; }
    if (nu.defined()) { EXPECT_LT(RelativeError(nu, ref_nu), Tolerance(dtype)) << "step " << step; }
  }
}

TEST_P(OptimizerUpdateTest, NonFiniteNormSkipsTheStep) {
  const auto& [c, dtype] = GetParam();
  CpuOps ops;
  const Shape shape = {5, 7};
  Tensor param = MakeRandom(ops, dtype, shape, 21);
  const bool adam = c.args.rule == Rule::kAdam;
  Tensor mu = adam || c.trace ? MakeRandom(ops, dtype, shape, 22) : Tensor();
  Tensor nu = adam ? MakeRandom(ops, dtype, shape, 23, 0.1f, 1.0f) : Tensor();
  Tensor grad = MakeRandom(ops, dtype, shape, 24);
  const std::vector<double> p = ToDoubles(param);
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Tensor norm_sq = MakeTensor(ops, DType::kF32, {1}, {bad});
    ASSERT_TRUE(ops.OptimizerUpdate(c.args, grad, norm_sq, &param, mu.defined() ? &mu : nullptr,
                                    nu.defined() ? &nu : nullptr)
                    .ok());
    EXPECT_EQ(ToDoubles(param), p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, OptimizerUpdateTest,
    ::testing::Combine(::testing::ValuesIn(Cases()),
                       ::testing::Values(DType::kF32, DType::kBF16)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_" + ShortName(std::get<1>(info.param));
    });

TEST(OptimizerUpdateArgsTest, AdamWithoutMomentsIsInvalid) {
  CpuOps ops;
  Tensor param = MakeRandom(ops, DType::kF32, {4}, 1);
  Tensor grad = MakeRandom(ops, DType::kF32, {4}, 2);
  Tensor norm_sq = MakeTensor(ops, DType::kF32, {1}, {1.0f});
  OptimizerUpdateArgs args;
  args.rule = Rule::kAdam;
  const absl::Status status = ops.OptimizerUpdate(args, grad, norm_sq, &param, nullptr, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("mu"), std::string::npos) << status;
  Tensor short_mu = MakeEmpty(ops, DType::kF32, {3});
  Tensor nu = MakeEmpty(ops, DType::kF32, {4});
  EXPECT_EQ(ops.OptimizerUpdate(args, grad, norm_sq, &param, &short_mu, &nu).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- OptimizerStep's FP8 copies ------------------------------------------------------

// A copy of `param` viewed as [rows, cols] in `dtype`, filled with bytes
// unlike any the step writes, and no record (kept_scale NaN).
OptimizerFp8Copy NewCopy(CpuOps& ops, int64_t rows, int64_t cols, DType dtype, float scale) {
  OptimizerFp8Copy c;
  c.data = MakeEmpty(ops, dtype, {rows, cols});
  c.data_t = MakeEmpty(ops, dtype, {cols, rows});
  std::memset(c.data.data(), 0x5a, c.data.nbytes());
  std::memset(c.data_t.data(), 0x5a, c.data_t.nbytes());
  c.scale_inv = MakeTensor(ops, DType::kF32, {1}, {-1.0f});
  c.kept_scale = MakeTensor(ops, DType::kF32, {1}, {std::nanf("")});
  c.kept_amax = MakeTensor(ops, DType::kF32, {1}, {-1.0f});
  c.scale = MakeTensor(ops, DType::kF32, {1}, {scale});
  return c;
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// Everything a copy holds, to compare whole copies.
std::vector<uint8_t> CopyBytes(const OptimizerFp8Copy& c) {
  std::vector<uint8_t> all;
  for (const Tensor* t : {&c.data, &c.data_t, &c.scale_inv, &c.kept_scale, &c.kept_amax}) {
    const std::vector<uint8_t> b = Bytes(*t);
    all.insert(all.end(), b.begin(), b.end());
  }
  return all;
}

class OptimizerStepFp8CopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    h_.rule = Rule::kAdam;
    h_.learning_rate = h_.schedules.AddConstant(0.05);
    h_.weight_decay = 0.01;
    // bf16 [6, 10] with an E4M3 copy, f32 [4, 8] with an E5M2 one, and a
    // param with no copy.
    const std::vector<std::tuple<Shape, DType, DType>> specs = {
        {{6, 10}, DType::kBF16, DType::kE4M3},
        {{4, 8}, DType::kF32, DType::kE5M2},
        {{5}, DType::kF32, DType::kF32}};
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [shape, dtype, fp8] = specs[i];
      OptimizerSlot s;
      s.param = MakeRandom(ops_, dtype, shape, 10 + i);
      s.mu = MakeRandom(ops_, dtype, shape, 20 + i, -0.5f, 0.5f);
      s.nu = MakeRandom(ops_, dtype, shape, 30 + i, 0.01f, 1.0f);
      if (IsFloat8(fp8)) s.fp8 = NewCopy(ops_, shape[0], shape[1], fp8, 2.5f + i);
      slots_.push_back(s);
    }
    count_ = MakeTensor(ops_, DType::kI32, {1}, {0.0f});
    total_notfinite_ = MakeTensor(ops_, DType::kI32, {1}, {0.0f});
    auto plan = ops_.NewOptimizerPlan(h_, slots_, count_, total_notfinite_);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *std::move(plan);
  }
  std::vector<Tensor> Grads(uint32_t seed) {
    std::vector<Tensor> grads;
    for (const OptimizerSlot& s : slots_) {
      grads.push_back(MakeRandom(ops_, s.param.dtype(), s.param.shape(), seed++));
    }
    return grads;
  }
  absl::Status Step(const std::vector<Tensor>& grads) {
    return ops_.OptimizerStep(*plan_, slots_, grads, &count_, &total_notfinite_);
  }
  // The copy the next forward's QuantizeTransposeKept would make of slot i's
  // param now, with its scale.
  void ExpectCurrent(size_t i) {
    const OptimizerFp8Copy& c = slots_[i].fp8;
    Fp8Output out;
    out.scale = c.scale;
    out.amax = MakeEmpty(ops_, DType::kF32, {1});
    out.scale_inv = MakeEmpty(ops_, DType::kF32, {1});
    Tensor y = MakeEmpty(ops_, c.data.dtype(), c.data.shape());
    Tensor y_t = MakeEmpty(ops_, c.data.dtype(), c.data_t.shape());
    ASSERT_TRUE(
        ops_.QuantizeTranspose(slots_[i].param.Reshaped(c.data.shape()), out, &y, &y_t).ok());
    EXPECT_EQ(Bytes(c.data), Bytes(y)) << "slot " << i;
    EXPECT_EQ(Bytes(c.data_t), Bytes(y_t)) << "slot " << i;
    EXPECT_EQ(Bytes(c.kept_amax), Bytes(out.amax)) << "slot " << i;
    EXPECT_EQ(Bytes(c.scale_inv), Bytes(out.scale_inv)) << "slot " << i;
    EXPECT_EQ(Bytes(c.kept_scale), Bytes(c.scale)) << "slot " << i;
  }

  CpuOps ops_;
  OptimizerHyperparams h_;
  std::vector<OptimizerSlot> slots_;
  Tensor count_, total_notfinite_;
  std::unique_ptr<OptimizerPlan> plan_;
};

// Each step leaves each copy as QuantizeTranspose makes it from the new
// param with the step's scale (a new scale tensor every step, as a session
// passes them), with its record.
TEST_F(OptimizerStepFp8CopyTest, CopiesAreTheNewParamsQuantized) {
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    for (size_t i = 0; i < 2; ++i) {
      slots_[i].fp8.scale = MakeTensor(ops_, DType::kF32, {1}, {1.5f * (step + 1) + i});
    }
    const std::vector<double> before = ToDoubles(slots_[0].param);
    ASSERT_TRUE(Step(Grads(100 * step)).ok());
    ASSERT_NE(ToDoubles(slots_[0].param), before) << "the step must move the params";
    ExpectCurrent(0);
    ExpectCurrent(1);
    EXPECT_EQ(ScalarValue(slots_[0].fp8.kept_scale), 1.5f * (step + 1));
  }
}

// A skipped step (a non-finite gradient) and a slot without a gradient leave
// the copies as they were: they still hold the unchanged params.
TEST_F(OptimizerStepFp8CopyTest, SkippedStepsAndSlotsKeepTheirCopies) {
  ASSERT_TRUE(Step(Grads(1)).ok());
  const std::vector<uint8_t> copy0 = CopyBytes(slots_[0].fp8);
  const std::vector<uint8_t> copy1 = CopyBytes(slots_[1].fp8);
  std::vector<Tensor> poisoned = Grads(2);
  StoreFromFloat(&poisoned[2], 3, std::nanf(""));
  ASSERT_TRUE(Step(poisoned).ok());
  EXPECT_EQ(*total_notfinite_.data_as<int32_t>(), 1);
  EXPECT_EQ(CopyBytes(slots_[0].fp8), copy0);
  EXPECT_EQ(CopyBytes(slots_[1].fp8), copy1);

  std::vector<Tensor> partial = Grads(3);
  partial[0] = Tensor();  // no gradient reached slot 0
  slots_[0].fp8.scale = MakeTensor(ops_, DType::kF32, {1}, {100.0f});
  ASSERT_TRUE(Step(partial).ok());
  EXPECT_EQ(CopyBytes(slots_[0].fp8), copy0);
  EXPECT_NE(CopyBytes(slots_[1].fp8), copy1);
  ExpectCurrent(1);
}

// A copy that does not fit its param, or a step without its scale, is
// INVALID_ARGUMENT naming it; a plan is for its copies too.
TEST_F(OptimizerStepFp8CopyTest, BadCopiesAreInvalidArgument) {
  auto expect_bad_plan = [&](std::vector<OptimizerSlot> slots, const std::string& field) {
    auto plan = ops_.NewOptimizerPlan(h_, slots, count_, total_notfinite_);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(field), std::string::npos) << plan.status();
  };
  std::vector<OptimizerSlot> bad = slots_;
  bad[0].fp8.data = MakeEmpty(ops_, DType::kE4M3, {6, 9});
  expect_bad_plan(bad, "slots[0].fp8.data");
  bad = slots_;
  bad[1].fp8.data = MakeEmpty(ops_, DType::kBF16, {4, 8});
  expect_bad_plan(bad, "slots[1].fp8.data");
  bad = slots_;
  bad[0].fp8.data_t = MakeEmpty(ops_, DType::kE4M3, {6, 10});
  expect_bad_plan(bad, "slots[0].fp8.data_t");
  bad = slots_;
  bad[1].fp8.kept_amax = Tensor();
  expect_bad_plan(bad, "slots[1].fp8.kept_amax");

  std::vector<OptimizerSlot> no_scale = slots_;
  no_scale[1].fp8.scale = Tensor();
  const absl::Status step =
      ops_.OptimizerStep(*plan_, no_scale, Grads(4), &count_, &total_notfinite_);
  EXPECT_EQ(step.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(step.message().find("slots[1].fp8.scale"), std::string::npos) << step;

  std::vector<OptimizerSlot> without = slots_;
  without[0].fp8 = OptimizerFp8Copy();
  EXPECT_FALSE(plan_->Matches(without, count_, total_notfinite_));
  EXPECT_TRUE(plan_->Matches(slots_, count_, total_notfinite_));
}

// ---- OptimizerStep's compute copies ----------------------------------------------------

class OptimizerStepComputeCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    h_.rule = Rule::kAdam;
    h_.learning_rate = h_.schedules.AddConstant(0.05);
    h_.weight_decay = 0.01;
    // f32 [6, 10] with a bf16 copy viewed as [10, 6] (a copy's shape is its
    // own), f32 [4, 8] with an f16 copy, and a param with none.
    const std::vector<std::tuple<Shape, DType, Shape>> specs = {
        {{6, 10}, DType::kBF16, {10, 6}}, {{4, 8}, DType::kF16, {4, 8}}, {{5}, DType::kF32, {}}};
    for (size_t i = 0; i < specs.size(); ++i) {
      const auto& [shape, copy_dtype, copy_shape] = specs[i];
      OptimizerSlot s;
      s.param = MakeRandom(ops_, DType::kF32, shape, 10 + i);
      s.mu = MakeRandom(ops_, DType::kF32, shape, 20 + i, -0.5f, 0.5f);
      s.nu = MakeRandom(ops_, DType::kF32, shape, 30 + i, 0.01f, 1.0f);
      if (copy_dtype != DType::kF32) {
        s.compute_copy = MakeEmpty(ops_, copy_dtype, copy_shape);
        std::memset(s.compute_copy.data(), 0x5a, s.compute_copy.nbytes());
      }
      slots_.push_back(s);
    }
    count_ = MakeTensor(ops_, DType::kI32, {1}, {0.0f});
    total_notfinite_ = MakeTensor(ops_, DType::kI32, {1}, {0.0f});
    auto plan = ops_.NewOptimizerPlan(h_, slots_, count_, total_notfinite_);
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = *std::move(plan);
  }
  std::vector<Tensor> Grads(uint32_t seed) {
    std::vector<Tensor> grads;
    for (const OptimizerSlot& s : slots_) {
      grads.push_back(MakeRandom(ops_, DType::kF32, s.param.shape(), seed++));
    }
    return grads;
  }
  absl::Status Step(const std::vector<Tensor>& grads) {
    return ops_.OptimizerStep(*plan_, slots_, grads, &count_, &total_notfinite_);
  }
  // Slot i's copy is what Cast makes of its param now.
  void ExpectCurrent(size_t i) {
    const Tensor& copy = slots_[i].compute_copy;
    Tensor want = MakeEmpty(ops_, copy.dtype(), copy.shape());
    ASSERT_TRUE(ops_.Cast(slots_[i].param.Reshaped(copy.shape()), &want).ok());
    EXPECT_EQ(Bytes(copy), Bytes(want)) << "slot " << i;
  }

  CpuOps ops_;
  OptimizerHyperparams h_;
  std::vector<OptimizerSlot> slots_;
  Tensor count_, total_notfinite_;
  std::unique_ptr<OptimizerPlan> plan_;
};

TEST_F(OptimizerStepComputeCopyTest, CopiesAreTheNewParamsCast) {
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    const std::vector<double> before = ToDoubles(slots_[0].param);
    ASSERT_TRUE(Step(Grads(100 * step)).ok());
    ASSERT_NE(ToDoubles(slots_[0].param), before) << "the step must move the params";
    ExpectCurrent(0);
    ExpectCurrent(1);
  }
}

// A skipped step and a slot without a gradient leave the copies as they
// were, which is what they hold: their params did not move.
TEST_F(OptimizerStepComputeCopyTest, SkippedStepsAndSlotsKeepTheirCopies) {
  ASSERT_TRUE(Step(Grads(1)).ok());
  const std::vector<uint8_t> copy0 = Bytes(slots_[0].compute_copy);
  const std::vector<uint8_t> copy1 = Bytes(slots_[1].compute_copy);
  std::vector<Tensor> poisoned = Grads(2);
  StoreFromFloat(&poisoned[2], 3, std::nanf(""));
  ASSERT_TRUE(Step(poisoned).ok());
  EXPECT_EQ(*total_notfinite_.data_as<int32_t>(), 1);
  EXPECT_EQ(Bytes(slots_[0].compute_copy), copy0);
  EXPECT_EQ(Bytes(slots_[1].compute_copy), copy1);

  std::vector<Tensor> partial = Grads(3);
  partial[0] = Tensor();  // no gradient reached slot 0
  ASSERT_TRUE(Step(partial).ok());
  EXPECT_EQ(Bytes(slots_[0].compute_copy), copy0);
  EXPECT_NE(Bytes(slots_[1].compute_copy), copy1);
  ExpectCurrent(0);
  ExpectCurrent(1);
}

// A copy in the param's own dtype, in no 16-bit float dtype, or of another
// element count is INVALID_ARGUMENT naming it; a plan is for its copies.
TEST_F(OptimizerStepComputeCopyTest, BadCopiesAreInvalidArgument) {
  auto expect_bad_plan = [&](std::vector<OptimizerSlot> slots, const std::string& field) {
    auto plan = ops_.NewOptimizerPlan(h_, slots, count_, total_notfinite_);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(plan.status().message().find(field), std::string::npos) << plan.status();
  };
  std::vector<OptimizerSlot> bad = slots_;
  bad[0].compute_copy = MakeEmpty(ops_, DType::kF32, {6, 10});
  expect_bad_plan(bad, "slots[0].compute_copy");
  bad = slots_;
  bad[1].compute_copy = MakeEmpty(ops_, DType::kE4M3, {4, 8});
  expect_bad_plan(bad, "slots[1].compute_copy");
  bad = slots_;
  bad[1].compute_copy = MakeEmpty(ops_, DType::kBF16, {4, 9});
  expect_bad_plan(bad, "slots[1].compute_copy");

  std::vector<OptimizerSlot> without = slots_;
  without[0].compute_copy = Tensor();
  EXPECT_FALSE(plan_->Matches(without, count_, total_notfinite_));
  EXPECT_TRUE(plan_->Matches(slots_, count_, total_notfinite_));
}

// A chain's slots keep their state in `state`, as many tensors as the
// hyperparams say, of the param's dtype and size; anything else is
// INVALID_ARGUMENT at planning, and a plan follows the state tensors too.
TEST(OptimizerChainPlanTest, BadChainSlotsAreInvalidArgument) {
  CpuOps ops;
  OptimizerHyperparams h;
  h.num_links = 2;
  h.num_state = 1;
  h.links[0].kind = OptimizerLink::Kind::kScaleByLion;
  h.links[0].b1 = 0.9;
  h.links[0].b2 = 0.99;
  h.links[1].kind = OptimizerLink::Kind::kScaleByLearningRate;
  h.links[1].schedule = h.learning_rate = h.schedules.AddConstant(0.1);
  Tensor count = *ops.Allocate(DType::kI32, {1});
  Tensor total = *ops.Allocate(DType::kI32, {1});
  OptimizerSlot good;
  good.param = MakeRandom(ops, DType::kF32, {5}, 1);
  good.state = {MakeRandom(ops, DType::kF32, {5}, 2)};
  auto plan = ops.NewOptimizerPlan(h, {good}, count, total);
  ASSERT_TRUE(plan.ok()) << plan.status();
  OptimizerSlot other_state = good;
  other_state.state = {MakeRandom(ops, DType::kF32, {5}, 3)};
  EXPECT_FALSE((*plan)->Matches({other_state}, count, total));
  EXPECT_TRUE((*plan)->Matches({good}, count, total));

  auto expect_bad = [&](const OptimizerHyperparams& hp, const OptimizerSlot& slot,
                        const std::string& want) {
    auto bad = ops.NewOptimizerPlan(hp, {slot}, count, total);
    ASSERT_FALSE(bad.ok()) << want;
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find(want), std::string::npos) << bad.status();
  };
  OptimizerSlot with_mu = good;
  with_mu.mu = MakeRandom(ops, DType::kF32, {5}, 4);
  expect_bad(h, with_mu, "slots[0]: a chain keeps 1 state tensors");
  OptimizerSlot missing = good;
  missing.state.clear();
  expect_bad(h, missing, "slots[0]: a chain keeps 1 state tensors");
  OptimizerSlot wrong_dtype = good;
  wrong_dtype.state = {MakeRandom(ops, DType::kBF16, {5}, 5)};
  expect_bad(h, wrong_dtype, "slots[0]: a state tensor is bfloat16");
  OptimizerHyperparams out_of_range = h;
  out_of_range.links[0].state = 1;
  expect_bad(out_of_range, good, "links[0] keeps 1 state tensors from 1");
  OptimizerHyperparams fused = h;
  fused.num_links = 0;
  expect_bad(fused, good, "slots[0].state is given; only a chain keeps it");
}

}  // namespace
}  // namespace te
