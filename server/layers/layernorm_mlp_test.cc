#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::CompareWithFp8;
using testing::InitLayer;
using testing::RandomTensor;
using testing::RandomizeParams;
using testing::RelativeError;
using testing::Values;

te::v1::LayerNormMLP Spec(int64_t inter, std::vector<std::string> acts, bool use_bias = true,
                          float dropout = 0.0f) {
  te::v1::LayerNormMLP spec;
  spec.set_intermediate_dim(inter);
  for (const auto& a : acts) spec.add_activations(a);
  spec.set_use_bias(use_bias);
  spec.set_intermediate_dropout_rate(dropout);
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::LayerNormMLP& spec) {
  auto layer = MakeLayerNormMLP(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

TEST(LayerNormMlpTest, VariablesMatchTe) {
  auto layer = Make(Spec(24, {"gelu", "linear"}));
  const Fp8Recipe delayed = testing::DelayedRecipe(8);
  auto specs = layer->VariableSpecs({2, 3, 8}, &delayed);
  ASSERT_TRUE(specs.ok());
  std::map<std::string, Shape> got;
  for (const auto& s : *specs) got[s.name] = s.shape;
  std::map<std::string, Shape> want = {
      {"params/scale", {8}},          {"params/ln_bias", {8}},
      {"params/wi_kernel", {8, 2, 24}}, {"params/wi_bias", {2, 24}},
      {"params/wo_kernel", {24, 8}},  {"params/wo_bias", {8}},
  };
  for (const char* q : {"x", "kernel", "grad"}) {
    for (const char* postfix : {"_0", "_1"}) {
      want[std::string("fp8_metas/") + q + postfix + "_scale"] = {1};
      want[std::string("fp8_metas/") + q + postfix + "_amax_history"] = {8};
    }
  }
  EXPECT_EQ(got, want);
}

TEST(LayerNormMlpTest, TeDefaults) {
  auto layer = Make(te::v1::LayerNormMLP());
  auto specs = layer->VariableSpecs({4, 16}, nullptr);
  ASSERT_TRUE(specs.ok());
  std::map<std::string, Shape> got;
  for (const auto& s : *specs) got[s.name] = s.shape;
  // intermediate_dim 2048, ("gelu",), use_bias false.
  EXPECT_EQ(got, (std::map<std::string, Shape>{{"params/scale", {16}},
                                                {"params/ln_bias", {16}},
                                                {"params/wi_kernel", {16, 1, 2048}},
                                                {"params/wo_kernel", {2048, 16}}}));
}

TEST(LayerNormMlpTest, KernelInitUsesPerActivationFanIn) {
  auto ops = testing::NewCpuOps();
  auto layer = Make(Spec(256, {"silu", "linear"}, false));
  auto vars = InitLayer(*ops, *layer, {2, 64}, nullptr, 42);
  ASSERT_TRUE(vars.ok());
  for (const auto& [name, fan_in] :
       std::vector<std::pair<std::string, double>>{{"params/wi_kernel", 64.0},
                                                   {"params/wo_kernel", 256.0}}) {
    const auto w = Values(vars->at(name));
    double sq = 0.0, mean = 0.0, max_abs = 0.0;
    for (float v : w) {
      sq += v * v;
      mean += v;
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(v)));
    }
    const double std = std::sqrt(sq / w.size());
    const double want = std::sqrt(1.0 / fan_in);
    EXPECT_NEAR(std, want, 0.03 * want) << name;  // 32768 samples: ~0.5% sampling error
    EXPECT_NEAR(mean / w.size(), 0.0, 0.02 * want) << name;
    EXPECT_LE(max_abs, 2.0 * want / 0.87962566103423978 + 1e-6) << name;  // truncated at 2 sigma
  }
}

TEST(LayerNormMlpTest, GradientsMatchFiniteDifferences) {
  auto ops = testing::NewCpuOps();
  struct Case {
    std::vector<std::string> acts;
    bool use_bias;
    te::v1::LayerNormType norm;
  };
  const Case cases[] = {{{"gelu", "linear"}, true, te::v1::LAYERNORM},
                        {{"silu"}, false, te::v1::RMSNORM},
                        {{"linear", "quick_gelu"}, true, te::v1::LAYERNORM}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.acts[0]);
    auto spec = Spec(6, c.acts, c.use_bias);
    spec.set_layernorm_type(c.norm);
    auto layer = Make(spec);
    auto vars = InitLayer(*ops, *layer, {2, 3, 5}, nullptr);
    ASSERT_TRUE(vars.ok());
    RandomizeParams(*ops, &*vars, 21);
    LayerInputs in;
    in.x = RandomTensor(*ops, {2, 3, 5}, DType::kF32, 8);
    EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
  }
}

TEST(LayerNormMlpTest, IntermediateDropout) {
  auto ops = testing::NewCpuOps();
  auto layer = Make(Spec(16, {"gelu"}, true, 0.5f));
  auto vars = InitLayer(*ops, *layer, {4, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 1);
  LayerInputs in;
  in.x = RandomTensor(*ops, {4, 8}, DType::kF32, 2);
  auto run = [&](bool deterministic, uint64_t seed) {
    ForwardOptions opts;
    opts.deterministic = deterministic;
    opts.dropout_seed = seed;
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    EXPECT_TRUE(layer->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
    return Values(out.y);
  };
  auto no_dropout = Make(Spec(16, {"gelu"}, true, 0.0f));
  LayerOutputs ref;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(no_dropout->Forward(*ops, &*vars, in, {}, &ref, &saved).ok());
  EXPECT_EQ(run(true, 1), Values(ref.y));  // deterministic: dropout off
  EXPECT_EQ(run(false, 1), run(false, 1)); // same seed, same mask
  EXPECT_NE(run(false, 1), run(false, 2));
  EXPECT_GT(RelativeError(run(false, 1), Values(ref.y)), 0.05);

  // Gradients through a fixed mask.
  ForwardOptions train;
  train.deterministic = false;
  train.dropout_seed = 3;
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, train));
}

TEST(LayerNormMlpTest, Fp8StaysCloseForEveryRecipe) {
  auto ops = testing::NewCpuOps();
  auto layer = Make(Spec(64, {"gelu", "linear"}, true));
  for (const Fp8Recipe& recipe : {testing::DelayedRecipe(), testing::CurrentScalingRecipe(),
                                  testing::Mxfp8Recipe()}) {
    SCOPED_TRACE(static_cast<int>(recipe.kind));
    auto vars = InitLayer(*ops, *layer, {32, 32}, &recipe);
    ASSERT_TRUE(vars.ok());
    LayerInputs in;
    in.x = RandomTensor(*ops, {32, 32}, DType::kF32, 6);
    auto cmp = CompareWithFp8(*ops, *layer, &*vars, in, recipe);
    ASSERT_TRUE(cmp.ok()) << cmp.status();
    EXPECT_GT(cmp->y, 0.0);
    EXPECT_LT(cmp->y, testing::kFp8ForwardTolerance);
    EXPECT_LT(cmp->dx, testing::kFp8BackwardTolerance);
    for (const char* p : {"params/wi_kernel", "params/wo_kernel", "params/wi_bias"}) {
      EXPECT_LT(cmp->params.at(p), testing::kFp8BackwardTolerance) << p;
    }
    if (recipe.kind == Fp8Recipe::Kind::kDelayedScaling) {
      // Both GEMMs recorded their amaxes.
      for (const char* h : {"fp8_metas/x_0_amax_history", "fp8_metas/kernel_1_amax_history",
                            "fp8_metas/grad_0_amax_history", "fp8_metas/grad_1_amax_history"}) {
        EXPECT_GT(Values(vars->at(h))[0], 0.0f) << h;
      }
    }
  }
}

// Under DelayedScaling without dropout, the norm (when ln_out is not
// returned) and the activation write FP8 directly; in float32 compute that is
// exactly the unfused result.
TEST(LayerNormMlpTest, FusedQuantizeMatchesUnfused) {
  auto ops = testing::NewCpuOps();
  auto spec = Spec(32, {"gelu"}, true, 0.1f);
  spec.set_return_layernorm_output(true);
  auto with_ln = Make(spec);
  spec.set_return_layernorm_output(false);
  auto without_ln = Make(spec);
  const Fp8Recipe recipe = testing::DelayedRecipe(4);
  auto vars = InitLayer(*ops, *with_ln, {8, 16}, &recipe);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 4);
  LayerInputs in;
  in.x = RandomTensor(*ops, {8, 16}, DType::kF32, 2, 3.0f);
  ForwardOptions opts;
  opts.fp8 = &recipe;
  std::vector<std::vector<float>> ys, x1_amax;
  for (const Layer* layer : {with_ln.get(), without_ln.get()}) {
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE(layer->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
    EXPECT_EQ(out.ln_out.defined(), layer == with_ln.get());
    ys.push_back(Values(out.y));
    x1_amax.push_back(Values(vars->at("fp8_metas/x_1_amax_history")));
  }
  EXPECT_EQ(ys[0], ys[1]);
  EXPECT_EQ(x1_amax[0], x1_amax[1]);
  EXPECT_GT(x1_amax[0][0], 0.0f);  // the fused activation recorded its amax
  // And the fused path stays within FP8 bounds of the result without FP8.
  opts.fp8 = nullptr;
  LayerOutputs ref;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(with_ln->Forward(*ops, &*vars, in, opts, &ref, &saved).ok());
  EXPECT_LT(RelativeError(ys[0], Values(ref.y)), testing::kFp8ForwardTolerance);
}

TEST(LayerNormMlpTest, InvalidSpecs) {
  auto s = MakeLayerNormMLP(Spec(0, {"relu"})).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.layer_norm_mlp.intermediate_dim"), std::string::npos);
  s = MakeLayerNormMLP(Spec(8, {"relu"}, true, 1.5f)).status();
  EXPECT_NE(s.message().find("spec.layer_norm_mlp.intermediate_dropout_rate"), std::string::npos);
  s = MakeLayerNormMLP(Spec(8, {"gelu", "silu"})).status();
  EXPECT_NE(s.message().find("spec.layer_norm_mlp.activations"), std::string::npos);
}

}  // namespace
}  // namespace te::layers
