// Training under DelayedScaling with the optimizer step rewriting the kept
// FP8 weight copies (Fp8WeightCache::CopiesForUpdate, OptimizerSlot::fp8)
// against the same steps with the copies cleared after every update: losses,
// gradients, params, optimizer state, amax histories, scales and the FP8
// copies are bit for bit the same, and the forward after an update quantizes
// no weight (unless its scale moved after the update).
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "server/layers/fp8_weight_cache.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"
#include "server/optim/optimizer.h"

namespace te::layers {
namespace {

using testing::RandomTensor;
using testing::Values;

// The CPU reference, counting the cast-transposes of the weights: those of a
// forward (a kept copy that was not current) and those of the update.
class CountingOps : public CpuOps {
 public:
  absl::Status QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                 Tensor* y_t) override {
    if (weights.count(x.data()) != 0) ++(in_update ? update_quantizations : forward_quantizations);
    return CpuOps::QuantizeTranspose(x, fp8, y, y_t);
  }
  std::set<const void*> weights;  // the params' storage
  bool in_update = false;
  int forward_quantizations = 0;
  int update_quantizations = 0;
};

std::unique_ptr<Layer> MakeMlp() {
  te::v1::LayerNormMLP spec;
  spec.set_intermediate_dim(64);
  spec.add_activations("gelu");
  spec.set_use_bias(true);
  spec.set_intermediate_dropout_rate(0.0f);
  auto layer = MakeLayerNormMLP(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

std::vector<uint8_t> Bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

// One run of the training loop: its variables, optimizer and kept copies.
struct TrainingRun {
  CountingOps ops;
  Variables vars, state;
  Fp8Recipe fp8;
  Fp8WeightCache cache;
  optim::Updater updater;
};

constexpr char kFirstKernel[] = "params/wi_kernel";

class Fp8WeightUpdateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layer_ = MakeMlp();
    te::v1::Optimizer spec;
    spec.mutable_adamw()->mutable_learning_rate()->set_constant(0.05);
    spec.mutable_adamw()->set_weight_decay(0.01);
    auto config = optim::ResolveOptimizer(spec, "optimizer");
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
    for (TrainingRun* run : {&kept_, &cleared_}) {
      run->fp8 = testing::DelayedRecipe(3);
      run->fp8.weight_cache = &run->cache;
      // 20 tokens: no activation has a kernel's shape.
      auto vars = testing::InitLayer(run->ops, *layer_, kInput, &run->fp8);
      ASSERT_TRUE(vars.ok()) << vars.status();
      testing::RandomizeParams(run->ops, &*vars, 7);
      run->vars = *std::move(vars);
      auto state = optim::InitState(run->ops, config_, run->vars);
      ASSERT_TRUE(state.ok()) << state.status();
      run->state = *std::move(state);
      for (const auto& [name, t] : run->vars) {
        if (name.rfind("params/", 0) == 0) run->ops.weights.insert(t.data());
      }
    }
    ASSERT_EQ(kept_.vars.count(kFirstKernel), 1u);
    // One kernel quantizer's scale: "fp8_metas/<scope>/kernel<postfix>_scale".
    for (const auto& [name, t] : kept_.vars) {
      if (name.rfind("fp8_metas/", 0) == 0 && name.find("/kernel") != std::string::npos &&
          name.size() > 6 && name.compare(name.size() - 6, 6, "_scale") == 0) {
        kernel_scale_ = name;
        break;
      }
    }
    ASSERT_FALSE(kernel_scale_.empty()) << "no kernel quantizer scale among the variables";
  }

  // Forward, backward and the FP8 scaling update (the session's Step), then
  // the optimizer step: rewriting the kept copies, or clearing them.
  // Returns everything the step leaves behind.
  std::map<std::string, std::vector<float>> TrainStep(TrainingRun& run, bool rewrite, int step,
                                                      int poison_step) {
    std::map<std::string, std::vector<float>> got;
    LayerInputs in;
    in.x = RandomTensor(run.ops, kInput, DType::kF32, 100 + step);
    const Tensor dy = RandomTensor(run.ops, kInput, DType::kF32, 200 + step);
    ForwardOptions opts;
    opts.fp8 = &run.fp8;
    opts.keep_for_backward = true;
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    EXPECT_TRUE(layer_->Forward(run.ops, &run.vars, in, opts, &out, &saved).ok());
    LayerGrads grads;
    EXPECT_TRUE(layer_->Backward(run.ops, &run.vars, *saved, dy, &grads).ok());
    EXPECT_TRUE(UpdateFp8Metas(run.ops, run.fp8, &run.vars).ok());
    Variables grad_vars;
    for (const auto& [name, g] : grads.params) {
      got["grad " + name] = Values(g);
      grad_vars["grads" + name.substr(name.find('/'))] = g;
    }
    if (step == poison_step) {
      Tensor& g = grad_vars.begin()->second;
      std::vector<float> v = Values(g);
      v[1] = std::nanf("");
      testing::SetValues(v, &g);
    }
    got["y"] = Values(out.y);
    got["dx"] = Values(grads.dx);
    // The copies the forward used, before the update moves anything.
    for (const auto& [name, t] : run.vars) {
      if (name.find("_kernel") == std::string::npos || name.rfind("params/", 0) != 0) continue;
      const GemmOperand* copy =
          run.cache.Find(t.Reshaped({t.dim(0), t.numel() / t.dim(0)}), DType::kE4M3);
      EXPECT_NE(copy, nullptr) << name << " has no kept copy after the forward";
      if (copy == nullptr) continue;
      for (const Tensor* part : {&copy->data, &copy->data_t, &copy->scale_inv}) {
        const std::vector<uint8_t> b = Bytes(*part);
        got["copy " + name].insert(got["copy " + name].end(), b.begin(), b.end());
      }
    }
    std::map<const void*, OptimizerFp8Copy> copies;
    if (rewrite) copies = run.cache.CopiesForUpdate(run.vars);
    run.ops.in_update = true;
    EXPECT_TRUE(run.updater
                    .Step(run.ops, config_, grad_vars, &run.vars, &run.state,
                          rewrite ? &copies : nullptr)
                    .ok());
    run.ops.in_update = false;
    if (!rewrite) run.cache.Clear();
    for (const auto& [name, v] : run.vars) got[name] = Values(v);
    for (const auto& [name, v] : run.state) got[name] = Values(v);
    return got;
  }

  // Both runs take `steps` steps; every step's results agree bit for bit.
  void ExpectSameSteps(int first, int steps, int poison_step) {
    for (int step = first; step < first + steps; ++step) {
      SCOPED_TRACE(step);
      const auto want = TrainStep(cleared_, false, step, poison_step);
      const auto got = TrainStep(kept_, true, step, poison_step);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
    }
  }

  static inline const Shape kInput = {4, 5, 32};
  std::unique_ptr<Layer> layer_;
  optim::OptimizerConfig config_;
  std::string kernel_scale_;
  TrainingRun kept_, cleared_;
};

// Six steps: the scales settle in the first (history length 3) and then
// stay, so after the first update no forward quantizes a weight.
TEST_F(Fp8WeightUpdateTest, StepsMatchClearingAfterEachUpdate) {
  ExpectSameSteps(0, 6, /*poison_step=*/-1);
  EXPECT_EQ(kept_.cache.size(), 2u);  // the MLP's two kernels, kept throughout
  // Cleared: both kernels quantized by every forward. Kept: by the first
  // forward only (no copy yet), then by each update instead.
  EXPECT_EQ(cleared_.ops.forward_quantizations, 2 * 6);
  EXPECT_EQ(cleared_.ops.update_quantizations, 0);
  EXPECT_EQ(kept_.ops.forward_quantizations, 2);
  EXPECT_EQ(kept_.ops.update_quantizations, 2 * 6);
  // No device memory comes and goes for the copies after the first step.
  EXPECT_EQ(kept_.ops.bytes_in_use(), cleared_.ops.bytes_in_use() + kept_.cache.bytes());
}

// A skipped update (a NaN gradient) leaves the copies as they are, still
// those of the unchanged weights: the steps after it agree too.
TEST_F(Fp8WeightUpdateTest, SkippedUpdateKeepsTheCopies) {
  ExpectSameSteps(0, 2, /*poison_step=*/2);
  auto copy_bytes = [&] {
    std::vector<uint8_t> all;
    for (const char* name : {"params/wi_kernel", "params/wo_kernel"}) {
      const Tensor& t = kept_.vars.at(name);
      const GemmOperand* copy =
          kept_.cache.Find(t.Reshaped({t.dim(0), t.numel() / t.dim(0)}), DType::kE4M3);
      EXPECT_NE(copy, nullptr) << name;
      if (copy == nullptr) continue;
      for (const Tensor* part : {&copy->data, &copy->data_t, &copy->scale_inv}) {
        const std::vector<uint8_t> b = Bytes(*part);
        all.insert(all.end(), b.begin(), b.end());
      }
    }
    return all;
  };
  const std::vector<uint8_t> before = copy_bytes();
  ExpectSameSteps(2, 1, /*poison_step=*/2);
  EXPECT_EQ(*kept_.state.at(optim::kTotalNotfinite).data_as<int32_t>(), 1);
  EXPECT_EQ(copy_bytes(), before);
  ExpectSameSteps(3, 2, /*poison_step=*/2);
  EXPECT_EQ(kept_.ops.update_quantizations, 2 * 4);  // none in the skipped update
}

// A scale that moves after the update (here set by hand, as SetVariables
// would) makes the next forward quantize that kernel again, from the kept
// copy's record; the results still agree.
TEST_F(Fp8WeightUpdateTest, ScaleMovedAfterTheUpdateQuantizesAgain) {
  ExpectSameSteps(0, 2, -1);
  const int before = kept_.ops.forward_quantizations;
  for (TrainingRun* run : {&kept_, &cleared_}) {
    Tensor& scale = run->vars.at(kernel_scale_);
    ASSERT_TRUE(run->ops.Fill(Values(scale)[0] * 0.5f, &scale).ok());
  }
  ExpectSameSteps(2, 2, -1);
  EXPECT_EQ(kept_.ops.forward_quantizations, before + 1);
}

// A copy the update cannot rewrite goes, as Clear drops it: here the
// layer's copies when the variables it is given hold other params.
TEST_F(Fp8WeightUpdateTest, CopiesOfOtherTensorsGo) {
  ExpectSameSteps(0, 1, -1);
  ASSERT_EQ(kept_.cache.size(), 2u);
  Variables others = cleared_.vars;  // the same names, other storage
  EXPECT_TRUE(kept_.cache.CopiesForUpdate(others).empty());
  EXPECT_EQ(kept_.cache.size(), 0u);
}

}  // namespace
}  // namespace te::layers
