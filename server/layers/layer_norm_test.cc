#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::InitLayer;
using testing::RandomTensor;
using testing::RandomizeParams;
using testing::RelativeError;
using testing::Values;

std::unique_ptr<Layer> Make(te::v1::LayerNormType type, bool zero_centered = false,
                            float epsilon = 1e-6f) {
  te::v1::LayerNorm spec;
  spec.set_layernorm_type(type);
  spec.set_zero_centered_gamma(zero_centered);
  spec.set_epsilon(epsilon);
  auto layer = MakeLayerNorm(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

TEST(LayerNormTest, ParamsNamesShapesAndInit) {
  auto ops = testing::NewCpuOps();
  auto ln = Make(te::v1::LAYERNORM_TYPE_UNSPECIFIED);
  auto vars = InitLayer(*ops, *ln, {2, 3, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  ASSERT_EQ(vars->size(), 2u);
  EXPECT_EQ(Values(vars->at("params/scale")), std::vector<float>(8, 1.0f));
  EXPECT_EQ(Values(vars->at("params/ln_bias")), std::vector<float>(8, 0.0f));

  auto rms = Make(te::v1::RMSNORM);
  auto rvars = InitLayer(*ops, *rms, {2, 8}, nullptr);
  ASSERT_TRUE(rvars.ok());
  EXPECT_EQ(rvars->size(), 1u);  // no ln_bias for rmsnorm
  EXPECT_EQ(rvars->count("params/scale"), 1u);

  auto zc = Make(te::v1::LAYERNORM, /*zero_centered=*/true);
  auto zvars = InitLayer(*ops, *zc, {2, 8}, nullptr);
  ASSERT_TRUE(zvars.ok());
  EXPECT_EQ(Values(zvars->at("params/scale")), std::vector<float>(8, 0.0f));
}

TEST(LayerNormTest, ForwardMatchesHostReference) {
  auto ops = testing::NewCpuOps();
  auto ln = Make(te::v1::LAYERNORM, false, 1e-3f);
  auto vars = InitLayer(*ops, *ln, {3, 6}, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 5);
  LayerInputs in;
  in.x = RandomTensor(*ops, {3, 6}, DType::kF32, 1, 3.0f);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(ln->Forward(*ops, &*vars, in, {}, &out, &saved).ok());
  const auto x = Values(in.x), g = Values(vars->at("params/scale")),
             b = Values(vars->at("params/ln_bias"));
  std::vector<float> want;
  for (int r = 0; r < 3; ++r) {
    double mean = 0, var = 0;
    for (int c = 0; c < 6; ++c) mean += x[r * 6 + c] / 6.0;
    for (int c = 0; c < 6; ++c) var += (x[r * 6 + c] - mean) * (x[r * 6 + c] - mean) / 6.0;
    for (int c = 0; c < 6; ++c) {
      want.push_back(static_cast<float>((x[r * 6 + c] - mean) / std::sqrt(var + 1e-3) * g[c] + b[c]));
    }
  }
  EXPECT_LT(RelativeError(Values(out.y), want), 1e-5);
}

TEST(LayerNormTest, GradientsMatchFiniteDifferences) {
  auto ops = testing::NewCpuOps();
  for (auto type : {te::v1::LAYERNORM, te::v1::RMSNORM}) {
    for (bool zc : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "type " << type << " zero_centered " << zc);
      auto ln = Make(type, zc);
      auto vars = InitLayer(*ops, *ln, {2, 3, 8}, nullptr);
      ASSERT_TRUE(vars.ok());
      RandomizeParams(*ops, &*vars, 11);
      LayerInputs in;
      in.x = RandomTensor(*ops, {2, 3, 8}, DType::kF32, 2);
      EXPECT_TRUE(CheckGradients(*ops, *ln, &*vars, in, {}));
    }
  }
}

TEST(LayerNormTest, Bf16ComputeAndValidation) {
  auto ops = testing::NewCpuOps();
  auto ln = Make(te::v1::LAYERNORM);
  auto vars = InitLayer(*ops, *ln, {4, 16}, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, {4, 16}, DType::kBF16, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ForwardOptions opts;
  opts.keep_for_backward = true;
  ASSERT_TRUE(ln->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  LayerGrads grads;
  EXPECT_EQ(ln->Backward(*ops, &*vars, *saved, RandomTensor(*ops, {4, 8}, DType::kBF16, 2), &grads)
                .code(),
            absl::StatusCode::kInvalidArgument);  // dy shaped unlike y
  ASSERT_TRUE(
      ln->Backward(*ops, &*vars, *saved, RandomTensor(*ops, {4, 16}, DType::kF32, 2), &grads).ok());
  EXPECT_EQ(grads.dx.dtype(), DType::kBF16);
  EXPECT_EQ(grads.params.at("params/scale").dtype(), DType::kF32);

  te::v1::LayerNorm bad;
  bad.set_epsilon(-1.0f);
  auto s = MakeLayerNorm(bad).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.layer_norm.epsilon"), std::string::npos);
}

}  // namespace
}  // namespace te::layers
