#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/fp8_state.h"
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

std::unique_ptr<Layer> MakeDense(std::vector<int64_t> features, bool use_bias = true,
                                 std::vector<int> axis = {}) {
  te::v1::DenseGeneral spec;
  for (int64_t f : features) spec.add_features(f);
  spec.set_use_bias(use_bias);
  for (int a : axis) spec.add_axis(a);
  auto layer = MakeDenseGeneral(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

Fp8Recipe Delayed(int history = 16) {
  Fp8Recipe r;
  r.kind = Fp8Recipe::Kind::kDelayedScaling;
  r.amax_history_len = history;
  return r;
}

TEST(DenseGeneralTest, VariableSpecsMatchTe) {
  auto layer = MakeDense({3, 8});
  auto specs = layer->VariableSpecs({2, 5, 16}, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 2u);
  EXPECT_EQ((*specs)[0].name, "params/kernel");
  EXPECT_EQ((*specs)[0].shape, (Shape{16, 3, 8}));
  EXPECT_EQ((*specs)[0].dtype, DType::kF32);
  EXPECT_EQ((*specs)[1].name, "params/bias");
  EXPECT_EQ((*specs)[1].shape, (Shape{3, 8}));
  auto shape = layer->OutputShape({2, 5, 16});
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(*shape, (Shape{2, 5, 3, 8}));
}

TEST(DenseGeneralTest, Fp8MetasOnlyUnderDelayedScaling) {
  auto layer = MakeDense({8});
  const Fp8Recipe delayed = Delayed(16);
  auto specs = layer->VariableSpecs({4, 16}, &delayed);
  ASSERT_TRUE(specs.ok());
  std::map<std::string, Shape> metas;
  for (const auto& s : *specs) {
    if (s.name.rfind("fp8_metas/", 0) == 0) metas[s.name] = s.shape;
  }
  const std::map<std::string, Shape> want = {
      {"fp8_metas/grad_amax_history", {16}},   {"fp8_metas/grad_scale", {1}},
      {"fp8_metas/kernel_amax_history", {16}}, {"fp8_metas/kernel_scale", {1}},
      {"fp8_metas/x_amax_history", {16}},      {"fp8_metas/x_scale", {1}},
  };
  EXPECT_EQ(metas, want);
  Fp8Recipe current;
  current.kind = Fp8Recipe::Kind::kCurrentScaling;
  auto plain = layer->VariableSpecs({4, 16}, &current);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->size(), 2u);
}

TEST(DenseGeneralTest, ForwardMatchesHostReference) {
  auto ops = testing::NewCpuOps();
  auto layer = MakeDense({6});
  auto vars = InitLayer(*ops, *layer, {3, 5}, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 7);
  LayerInputs in;
  in.x = RandomTensor(*ops, {3, 5}, DType::kF32, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, &saved).ok());
  const auto x = Values(in.x), w = Values(vars->at("params/kernel")),
             b = Values(vars->at("params/bias"));
  std::vector<float> want(18);
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 6; ++j) {
      double acc = b[j];
      for (int k = 0; k < 5; ++k) acc += static_cast<double>(x[i * 5 + k]) * w[k * 6 + j];
      want[i * 6 + j] = static_cast<float>(acc);
    }
  }
  EXPECT_LT(RelativeError(Values(out.y), want), 1e-6);
}

TEST(DenseGeneralTest, GradientsMatchFiniteDifferences) {
  auto ops = testing::NewCpuOps();
  auto layer = MakeDense({2, 3});
  auto vars = InitLayer(*ops, *layer, {2, 3, 4}, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 3);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 3, 4}, DType::kF32, 2);
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
}

TEST(DenseGeneralTest, NonTrailingAxisGradients) {
  auto ops = testing::NewCpuOps();
  auto layer = MakeDense({5}, /*use_bias=*/true, /*axis=*/{1});
  auto shape = layer->OutputShape({2, 4, 3});
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(*shape, (Shape{2, 3, 5}));
  auto vars = InitLayer(*ops, *layer, {2, 4, 3}, nullptr);
  ASSERT_TRUE(vars.ok());
  EXPECT_EQ(vars->at("params/kernel").shape(), (Shape{4, 5}));
  RandomizeParams(*ops, &*vars, 3);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 4, 3}, DType::kF32, 2);
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
}

TEST(DenseGeneralTest, MultiAxisContraction) {
  auto ops = testing::NewCpuOps();
  auto layer = MakeDense({3}, /*use_bias=*/false, /*axis=*/{-1, 0});
  auto vars = InitLayer(*ops, *layer, {2, 3, 4}, nullptr);
  ASSERT_TRUE(vars.ok());
  EXPECT_EQ(vars->at("params/kernel").shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(vars->count("params/bias"), 0u);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 3, 4}, DType::kF32, 2);
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
}

TEST(DenseGeneralTest, BadAxisAndInputAreInvalidArgument) {
  auto layer = MakeDense({3}, true, {2});
  EXPECT_EQ(layer->VariableSpecs({4, 5}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto repeated = MakeDense({3}, true, {0, -2});
  EXPECT_EQ(repeated->OutputShape({4, 5}).status().code(), absl::StatusCode::kInvalidArgument);

  auto ops = testing::NewCpuOps();
  auto dense = MakeDense({3});
  auto vars = InitLayer(*ops, *dense, {4, 5}, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, {4, 6}, DType::kF32, 1);  // hidden 6 != 5
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = dense->Forward(*ops, &*vars, in, {}, &out, &saved);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("params/kernel"), std::string::npos) << s;

  te::v1::DenseGeneral spec;
  EXPECT_EQ(MakeDenseGeneral(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.add_features(-1);
  auto bad = MakeDenseGeneral(spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("spec.dense_general.features"), std::string::npos);
}

TEST(DenseGeneralTest, Bf16ParamsAndInputs) {
  auto ops = testing::NewCpuOps();
  te::v1::DenseGeneral spec;
  spec.add_features(16);
  spec.set_dtype(te::v1::PARAM_BFLOAT16);
  auto layer = MakeDenseGeneral(spec);
  ASSERT_TRUE(layer.ok());
  auto vars = InitLayer(*ops, **layer, {4, 32}, nullptr);
  ASSERT_TRUE(vars.ok());
  EXPECT_EQ(vars->at("params/kernel").dtype(), DType::kBF16);
  LayerInputs in;
  in.x = RandomTensor(*ops, {4, 32}, DType::kBF16, 1);
  ForwardOptions opts;
  opts.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  LayerGrads grads;
  ASSERT_TRUE((*layer)->Backward(*ops, &*vars, *saved, RandomTensor(*ops, {4, 16}, DType::kBF16, 3),
                                 &grads).ok());
  EXPECT_EQ(grads.dx.dtype(), DType::kBF16);
  EXPECT_EQ(grads.params.at("params/kernel").dtype(), DType::kBF16);
  EXPECT_EQ(grads.params.at("params/bias").shape(), (Shape{16}));
}

}  // namespace
}  // namespace te::layers
