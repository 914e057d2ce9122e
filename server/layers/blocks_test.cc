// Blocks used inside composite modules: scoped names, dropout, residual add,
// activation parsing. (Numerics are covered through the module tests.)
#include "server/layers/blocks.h"

#include "gtest/gtest.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::RandomTensor;
using testing::Values;

TEST(DenseBlockTest, ScopedNamesAndShapes) {
  DenseConfig c;
  c.scope = "attention/qkv";
  c.in_dims = {16};
  c.features = {3, 16};
  c.fp8_postfix = "";
  Dense dense(c);
  EXPECT_EQ(dense.in(), 16);
  EXPECT_EQ(dense.out(), 48);
  const Fp8Recipe delayed = testing::DelayedRecipe(4);
  std::map<std::string, Shape> got;
  for (const auto& d : dense.Defs(&delayed)) got[d.spec.name] = d.spec.shape;
  EXPECT_EQ(got.at("params/attention/qkv/kernel"), (Shape{16, 3, 16}));
  EXPECT_EQ(got.at("params/attention/qkv/bias"), (Shape{3, 16}));
  EXPECT_EQ(got.at("fp8_metas/attention/qkv/x_scale"), (Shape{1}));
  EXPECT_EQ(got.at("fp8_metas/attention/qkv/grad_amax_history"), (Shape{4}));
  EXPECT_EQ(got.size(), 8u);
}

TEST(DenseBlockTest, ForwardBackwardShapesAndSavedBytes) {
  auto ops = testing::NewCpuOps();
  DenseConfig c;
  c.scope = "out";
  c.in_dims = {8};
  c.features = {4};
  c.param_dtype = DType::kF32;
  Dense dense(c);
  Variables vars;
  ASSERT_TRUE(InitVariables(*ops, 1, dense.Defs(nullptr), &vars).ok());
  const Tensor x = RandomTensor(*ops, {5, 8}, DType::kBF16, 2);
  Tensor y;
  Dense::Saved saved;
  ASSERT_TRUE(dense.Forward(*ops, &vars, x, nullptr, false, &y, &saved).ok());
  EXPECT_EQ(y.shape(), (Shape{5, 4}));
  EXPECT_EQ(y.dtype(), DType::kBF16);
  // x (bf16) plus the bf16 copy of the f32 kernel.
  EXPECT_EQ(saved.bytes(), 5 * 8 * 2 + 8 * 4 * 2);
  Tensor dx;
  Variables grads;
  ASSERT_TRUE(dense.Backward(*ops, &vars, saved, RandomTensor(*ops, {5, 4}, DType::kBF16, 3), &dx,
                             &grads)
                  .ok());
  EXPECT_EQ(dx.shape(), (Shape{5, 8}));
  EXPECT_EQ(grads.at("params/out/kernel").dtype(), DType::kF32);
  EXPECT_EQ(grads.at("params/out/bias").shape(), (Shape{4}));
  const Tensor wrong = RandomTensor(*ops, {5, 7}, DType::kF32, 2);
  EXPECT_EQ(dense.Forward(*ops, &vars, wrong, nullptr, false, &y, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MlpBlockTest, ScopedNames) {
  MlpConfig c;
  c.scope = "mlp";
  c.hidden = 8;
  c.intermediate = 32;
  c.activations = {Activation::kGelu, Activation::kLinear};
  c.use_bias = true;
  Mlp mlp(c);
  const Fp8Recipe delayed = testing::DelayedRecipe(4);
  std::map<std::string, Shape> got;
  for (const auto& d : mlp.Defs(&delayed)) got[d.spec.name] = d.spec.shape;
  EXPECT_EQ(got.at("params/mlp/scale"), (Shape{8}));
  EXPECT_EQ(got.at("params/mlp/wi_kernel"), (Shape{8, 2, 32}));
  EXPECT_EQ(got.at("params/mlp/wi_bias"), (Shape{2, 32}));
  EXPECT_EQ(got.at("params/mlp/wo_kernel"), (Shape{32, 8}));
  EXPECT_EQ(got.at("fp8_metas/mlp/x_0_scale"), (Shape{1}));
  EXPECT_EQ(got.at("fp8_metas/mlp/grad_1_amax_history"), (Shape{4}));
}

TEST(DropoutTest, OffSharesMemoryOnSeedsScales) {
  auto ops = testing::NewCpuOps();
  const Tensor x = RandomTensor(*ops, {64, 64}, DType::kF32, 1);
  Tensor y;
  DropoutSaved saved;
  ASSERT_TRUE(Dropout(*ops, 0.25f, /*deterministic=*/true, 7, x, &y, &saved).ok());
  EXPECT_EQ(y.data(), x.data());
  ASSERT_TRUE(Dropout(*ops, 0.25f, false, 7, x, &y, &saved).ok());
  const auto xs = Values(x), ys = Values(y);
  int dropped = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (ys[i] == 0.0f) {
      ++dropped;
    } else {
      EXPECT_FLOAT_EQ(ys[i], xs[i] / 0.75f);
    }
  }
  EXPECT_NEAR(dropped / static_cast<double>(xs.size()), 0.25, 0.03);
  Tensor dx;
  const Tensor dy = RandomTensor(*ops, {64, 64}, DType::kF32, 2);
  ASSERT_TRUE(DropoutGrad(*ops, saved, dy, &dx).ok());
  const auto dys = Values(dy), dxs = Values(dx);
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_FLOAT_EQ(dxs[i], ys[i] == 0.0f ? 0.0f : dys[i] / 0.75f);
  }
  // Rate 1 drops everything (as Flax does), with zero gradients.
  ASSERT_TRUE(Dropout(*ops, 1.0f, false, 7, x, &y, &saved).ok());
  EXPECT_EQ(Values(y), std::vector<float>(xs.size(), 0.0f));
  ASSERT_TRUE(DropoutGrad(*ops, saved, dy, &dx).ok());
  EXPECT_EQ(Values(dx), std::vector<float>(xs.size(), 0.0f));
}

TEST(ResidualAddTest, Adds) {
  auto ops = testing::NewCpuOps();
  const Tensor a = RandomTensor(*ops, {3, 4}, DType::kF32, 1);
  const Tensor b = RandomTensor(*ops, {3, 4}, DType::kF32, 2);
  Tensor y;
  ASSERT_TRUE(ResidualAdd(*ops, a, b, &y).ok());
  const auto av = Values(a), bv = Values(b), yv = Values(y);
  for (size_t i = 0; i < yv.size(); ++i) EXPECT_FLOAT_EQ(yv[i], av[i] + bv[i]);
  const Tensor c = RandomTensor(*ops, {3, 5}, DType::kF32, 2);
  EXPECT_EQ(ResidualAdd(*ops, a, c, &y).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseActivationsTest, NormalisesAsTe) {
  auto acts = ParseActivations({"Linear", "GELU"}, "f");
  ASSERT_TRUE(acts.ok());
  EXPECT_EQ(*acts, (std::vector<Activation>{Activation::kGelu, Activation::kLinear}));
  auto single = ParseActivations({"squared_relu"}, "f");
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(*single, std::vector<Activation>{Activation::kSquaredRelu});
  EXPECT_EQ(ParseActivations({}, "f").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseActivations({"relu", "relu", "linear"}, "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseActivations({"linear", "linear"}, "f").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
