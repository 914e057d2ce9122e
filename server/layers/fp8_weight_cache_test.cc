#include "server/layers/fp8_weight_cache.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/kept_check_counting_ops.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::RandomTensor;
using testing::Values;

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

// Everything a step leaves behind: y, dx, every parameter gradient and every
// variable (the fp8_metas have moved).
std::map<std::string, std::vector<float>> RunStep(Ops& ops, const Layer& layer, Variables* vars,
                                                  const LayerInputs& in, const Tensor& dy,
                                                  const Fp8Recipe& fp8) {
  std::map<std::string, std::vector<float>> got;
  ForwardOptions opts;
  opts.fp8 = &fp8;
  opts.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status forward = layer.Forward(ops, vars, in, opts, &out, &saved);
  EXPECT_TRUE(forward.ok()) << forward;
  if (!forward.ok()) return got;
  LayerGrads grads;
  absl::Status backward = layer.Backward(ops, vars, *saved, dy, &grads);
  EXPECT_TRUE(backward.ok()) << backward;
  EXPECT_TRUE(UpdateFp8Metas(ops, fp8, vars).ok());
  got["y"] = Values(out.y);
  got["dx"] = Values(grads.dx);
  for (const auto& [name, g] : grads.params) got["grad " + name] = Values(g);
  for (const auto& [name, v] : *vars) got[name] = Values(v);
  return got;
}

class Fp8WeightCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ops_ = std::make_unique<KeptCheckCountingOps>(&checks_);
    layer_ = MakeMlp();
    fp8_ = testing::DelayedRecipe(4);
    auto vars = testing::InitLayer(*ops_, *layer_, {4, 8, 32}, &fp8_);
    ASSERT_TRUE(vars.ok()) << vars.status();
    testing::RandomizeParams(*ops_, &*vars, 7);
    plain_vars_ = CopyOf(*vars);
    cached_vars_ = CopyOf(*vars);
    in_.x = RandomTensor(*ops_, {4, 8, 32}, DType::kF32, 3);
    dy_ = RandomTensor(*ops_, {4, 8, 32}, DType::kF32, 5);
    cached_fp8_ = fp8_;
    cached_fp8_.weight_cache = &cache_;
  }

  Variables CopyOf(const Variables& vars) {
    Variables copy;
    for (const auto& [name, t] : vars) {
      Tensor c = *ops_->Allocate(t.dtype(), t.shape());
      EXPECT_TRUE(ops_->Copy(t, &c).ok());
      copy[name] = c;
    }
    return copy;
  }

  KeptChecks checks_;
  std::unique_ptr<Ops> ops_;
  std::unique_ptr<Layer> layer_;
  Fp8Recipe fp8_, cached_fp8_;
  Fp8WeightCache cache_;
  Variables plain_vars_, cached_vars_;
  LayerInputs in_;
  Tensor dy_;
};

// Steps from the kept copies equal steps that quantize every weight every
// step, bit for bit, while the kernel scales settle (steps 1-2) and after.
TEST_F(Fp8WeightCacheTest, StepsMatchQuantizingEveryStep) {
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE(step);
    const auto want = RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
    const auto got = RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
  }
  EXPECT_EQ(cache_.size(), 2u);  // the MLP's two kernels
  // Each kernel in both layouts (1 byte each), its scale_inv and the record.
  EXPECT_EQ(cache_.bytes(), 2 * (2 * 32 * 64 + 3 * 4));
}

// Every copy checked at the forward's start (CheckBeforeForward, one
// QuantizeTransposeKeptMany) gives the steps of checking each at its read,
// bit for bit, while the kernel scales settle (the batched checks quantize
// again) and after; the forward then checks none on its own. A check made against other variables (another step's scales) is
// not taken: the forward checks that weight itself.
TEST_F(Fp8WeightCacheTest, ChecksBeforeTheForwardMatchChecksAtEachRead) {
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE(step);
    const auto want = RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
    const int64_t batched = checks_.at_once, single = checks_.alone;
    ASSERT_TRUE(cache_.CheckBeforeForward(*ops_, cached_fp8_, cached_vars_).ok());
    const auto got = RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
    cache_.ForgetChecks();  // the step's scaling update ran
    // The first forward makes the copies; each later one finds them checked.
    EXPECT_EQ(checks_.at_once - batched, step == 0 ? 0 : 2);
    EXPECT_EQ(checks_.alone - single, step == 0 ? 2 : 0);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
  }
  Variables elsewhere = CopyOf(cached_vars_);
  ASSERT_TRUE(cache_.CheckBeforeForward(*ops_, cached_fp8_, elsewhere).ok());
  const int64_t single = checks_.alone;
  const auto want = RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
  const auto got = RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
  EXPECT_EQ(checks_.alone - single, 2);
  for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
}

// Checks serve the call that made them: a call that ends (failed here,
// before its forward) leaves none for the next, whose forward checks each
// weight itself although its variables sit at the same addresses.
TEST_F(Fp8WeightCacheTest, ChecksEndWithTheirCall) {
  {
    Fp8WeightCache::Call call(&cache_);
    RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
    call.Commit();
  }
  {
    Fp8WeightCache::Call call(&cache_);
    ASSERT_TRUE(cache_.CheckBeforeForward(*ops_, cached_fp8_, cached_vars_).ok());
  }
  const int64_t single = checks_.alone;
  Fp8WeightCache::Call call(&cache_);
  RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
  EXPECT_EQ(checks_.alone - single, 2);
}

// A weight written in place (as an optimizer update writes it) needs Clear:
// without it the stale copy is used, which this test shows the cache really
// serves; with it, the step matches again.
TEST_F(Fp8WeightCacheTest, ClearAfterTheWeightsChange) {
  for (int step = 0; step < 3; ++step) {
    RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
    RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
  }
  const std::string kernel = "params/wi_kernel";
  ASSERT_EQ(plain_vars_.count(kernel), 1u) << "the MLP's first kernel is named " << kernel;
  const Tensor fresh = RandomTensor(*ops_, plain_vars_.at(kernel).shape(), DType::kF32, 11);
  ASSERT_TRUE(ops_->Copy(fresh, &plain_vars_.at(kernel)).ok());
  ASSERT_TRUE(ops_->Copy(fresh, &cached_vars_.at(kernel)).ok());

  auto want = RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
  const auto stale = RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
  EXPECT_NE(stale.at("y"), want.at("y"));

  cache_.Clear();
  EXPECT_EQ(cache_.size(), 0u);
  // Both sides take one more step from the same state, so they agree again.
  cached_vars_ = CopyOf(plain_vars_);
  want = RunStep(*ops_, *layer_, &plain_vars_, in_, dy_, fp8_);
  const auto got = RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
  for (const auto& [name, values] : want) EXPECT_EQ(got.at(name), values) << name;
}

// A call that fails (no Commit) leaves no copy behind, and the session's
// memory as it was; a committed call keeps its copies for the next.
TEST_F(Fp8WeightCacheTest, OnlyACommittedCallKeepsItsCopies) {
  const int64_t before = ops_->bytes_in_use();
  {
    Fp8WeightCache::Call call(&cache_);
    RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
    EXPECT_EQ(cache_.size(), 2u);
  }
  EXPECT_EQ(cache_.size(), 0u);
  {
    Fp8WeightCache::Call call(&cache_);
    RunStep(*ops_, *layer_, &cached_vars_, in_, dy_, cached_fp8_);
    call.Commit();
  }
  EXPECT_EQ(cache_.size(), 2u);
  EXPECT_EQ(ops_->bytes_in_use(), before + cache_.bytes());
}

// Recipes other than DelayedScaling never use the cache.
TEST_F(Fp8WeightCacheTest, OnlyDelayedScalingKeepsCopies) {
  Fp8Recipe current = testing::CurrentScalingRecipe();
  current.weight_cache = &cache_;
  auto vars = testing::InitLayer(*ops_, *layer_, {4, 8, 32}, &current);
  ASSERT_TRUE(vars.ok());
  RunStep(*ops_, *layer_, &*vars, in_, dy_, current);
  EXPECT_EQ(cache_.size(), 0u);
}

}  // namespace
}  // namespace te::layers
