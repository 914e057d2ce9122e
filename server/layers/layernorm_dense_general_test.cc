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

te::v1::LayerNormDenseGeneral Spec(std::vector<int64_t> features) {
  te::v1::LayerNormDenseGeneral spec;
  for (int64_t f : features) spec.add_features(f);
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::LayerNormDenseGeneral& spec) {
  auto layer = MakeLayerNormDenseGeneral(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

TEST(LayerNormDenseGeneralTest, VariablesMatchTe) {
  auto layer = Make(Spec({3, 16}));
  auto specs = layer->VariableSpecs({2, 4, 8}, nullptr);
  ASSERT_TRUE(specs.ok());
  std::map<std::string, Shape> got;
  for (const auto& s : *specs) got[s.name] = s.shape;
  // TE's default use_bias is false for this module.
  const std::map<std::string, Shape> want = {
      {"params/scale", {8}}, {"params/ln_bias", {8}}, {"params/kernel", {8, 3, 16}}};
  EXPECT_EQ(got, want);
  EXPECT_EQ(*layer->OutputShape({2, 4, 8}), (Shape{2, 4, 3, 16}));

  const Fp8Recipe delayed = testing::DelayedRecipe(8);
  auto fp8_specs = layer->VariableSpecs({2, 4, 8}, &delayed);
  ASSERT_TRUE(fp8_specs.ok());
  EXPECT_EQ(fp8_specs->size(), 9u);
  auto rms = Spec({16});
  rms.set_layernorm_type(te::v1::RMSNORM);
  rms.set_use_bias(true);
  auto rms_specs = Make(rms)->VariableSpecs({4, 8}, nullptr);
  ASSERT_TRUE(rms_specs.ok());
  got.clear();
  for (const auto& s : *rms_specs) got[s.name] = s.shape;
  EXPECT_EQ(got, (std::map<std::string, Shape>{
                     {"params/scale", {8}}, {"params/kernel", {8, 16}}, {"params/bias", {16}}}));
}

TEST(LayerNormDenseGeneralTest, ReturnsLayernormOutput) {
  auto ops = testing::NewCpuOps();
  auto spec = Spec({6});
  spec.set_return_layernorm_output(true);  // TE's default is false
  auto layer = Make(spec);
  auto vars = InitLayer(*ops, *layer, {3, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 2);
  LayerInputs in;
  in.x = RandomTensor(*ops, {3, 8}, DType::kF32, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, &saved).ok());
  ASSERT_TRUE(out.ln_out.defined());
  // ln_out is what a standalone LayerNorm with the same params gives.
  te::v1::LayerNorm ln_spec;
  auto ln = MakeLayerNorm(ln_spec);
  ASSERT_TRUE(ln.ok());
  Variables ln_vars = {{"params/scale", vars->at("params/scale")},
                       {"params/ln_bias", vars->at("params/ln_bias")}};
  LayerOutputs ln_out;
  ASSERT_TRUE((*ln)->Forward(*ops, &ln_vars, in, {}, &ln_out, &saved).ok());
  EXPECT_EQ(Values(out.ln_out), Values(ln_out.y));

  spec.set_return_layernorm_output(false);
  LayerOutputs no_ln;
  ASSERT_TRUE(Make(spec)->Forward(*ops, &*vars, in, {}, &no_ln, &saved).ok());
  EXPECT_FALSE(no_ln.ln_out.defined());
  EXPECT_EQ(Values(no_ln.y), Values(out.y));
}

TEST(LayerNormDenseGeneralTest, GradientsMatchFiniteDifferences) {
  auto ops = testing::NewCpuOps();
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    auto spec = Spec({2, 5});
    spec.set_use_bias(true);
    if (variant == 1) spec.set_layernorm_type(te::v1::RMSNORM);
    if (variant == 2) spec.set_enable_layernorm(false);
    auto layer = Make(spec);
    auto vars = InitLayer(*ops, *layer, {2, 3, 6}, nullptr);
    ASSERT_TRUE(vars.ok());
    EXPECT_EQ(vars->count("params/scale"), variant == 2 ? 0u : 1u);
    RandomizeParams(*ops, &*vars, 9);
    LayerInputs in;
    in.x = RandomTensor(*ops, {2, 3, 6}, DType::kF32, 3);
    EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
  }
}

TEST(LayerNormDenseGeneralTest, Fp8StaysCloseForEveryRecipe) {
  auto ops = testing::NewCpuOps();
  auto layer = Make(Spec({32}));
  for (const Fp8Recipe& recipe : {testing::DelayedRecipe(), testing::CurrentScalingRecipe(),
                                  testing::Mxfp8Recipe()}) {
    SCOPED_TRACE(static_cast<int>(recipe.kind));
    auto vars = InitLayer(*ops, *layer, {32, 32}, &recipe);
    ASSERT_TRUE(vars.ok());
    EXPECT_EQ(vars->count("fp8_metas/x_scale"),
              recipe.kind == Fp8Recipe::Kind::kDelayedScaling ? 1u : 0u);
    LayerInputs in;
    in.x = RandomTensor(*ops, {32, 32}, DType::kF32, 5);
    auto cmp = CompareWithFp8(*ops, *layer, &*vars, in, recipe);
    ASSERT_TRUE(cmp.ok()) << cmp.status();
    EXPECT_GT(cmp->y, 0.0);
    EXPECT_LT(cmp->y, testing::kFp8ForwardTolerance);
    EXPECT_LT(cmp->dx, testing::kFp8BackwardTolerance);
    EXPECT_LT(cmp->params.at("params/kernel"), testing::kFp8BackwardTolerance);
    EXPECT_LT(cmp->params.at("params/scale"), testing::kFp8BackwardTolerance);
  }
}

// Without ln_out under DelayedScaling the norm writes FP8 itself; in float32
// compute that is exactly the unfused norm-then-quantize.
TEST(LayerNormDenseGeneralTest, FusedNormQuantizeMatchesUnfused) {
  auto ops = testing::NewCpuOps();
  auto spec = Spec({16});
  auto unfused = Make(spec);
  spec.set_return_layernorm_output(false);
  auto fused = Make(spec);
  const Fp8Recipe recipe = testing::DelayedRecipe(4);
  auto vars = InitLayer(*ops, *unfused, {8, 32}, &recipe);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 4);
  LayerInputs in;
  in.x = RandomTensor(*ops, {8, 32}, DType::kF32, 2, 3.0f);
  ForwardOptions opts;
  opts.fp8 = &recipe;
  opts.keep_for_backward = true;
  const Tensor dy = RandomTensor(*ops, {8, 16}, DType::kF32, 3);
  std::vector<std::vector<float>> ys, dxs, amaxes;
  for (const Layer* layer : {unfused.get(), fused.get()}) {
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE(layer->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
    LayerGrads grads;
    ASSERT_TRUE(layer->Backward(*ops, &*vars, *saved, dy, &grads).ok());
    ys.push_back(Values(out.y));
    dxs.push_back(Values(grads.dx));
    amaxes.push_back(Values(vars->at("fp8_metas/x_amax_history")));
  }
  EXPECT_EQ(ys[0], ys[1]);
  EXPECT_EQ(dxs[0], dxs[1]);
  EXPECT_EQ(amaxes[0], amaxes[1]);
  EXPECT_GT(amaxes[1][0], 0.0f);
}

TEST(LayerNormDenseGeneralTest, DelayedFp8WithoutMetasIsFailedPrecondition) {
  auto ops = testing::NewCpuOps();
  auto layer = Make(Spec({16}));
  auto vars = InitLayer(*ops, *layer, {4, 16}, nullptr);
  ASSERT_TRUE(vars.ok());
  const Fp8Recipe recipe = testing::DelayedRecipe();
  ForwardOptions opts;
  opts.fp8 = &recipe;
  LayerInputs in;
  in.x = RandomTensor(*ops, {4, 16}, DType::kF32, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  EXPECT_EQ(layer->Forward(*ops, &*vars, in, opts, &out, &saved).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(LayerNormDenseGeneralTest, FeaturesAreRequired) {
  te::v1::LayerNormDenseGeneral spec;
  auto s = MakeLayerNormDenseGeneral(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.layer_norm_dense_general.features"), std::string::npos);
}

}  // namespace
}  // namespace te::layers
