#include "gtest/gtest.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

std::string TypeOf(const te::v1::LayerSpec& spec) {
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? (*layer)->type_name() : "";
}

TEST(CreateLayerTest, DispatchesEveryModule) {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm();
  EXPECT_EQ(TypeOf(spec), "LayerNorm");
  spec.mutable_dense_general()->add_features(8);
  EXPECT_EQ(TypeOf(spec), "DenseGeneral");
  spec.mutable_activation();
  EXPECT_EQ(TypeOf(spec), "Activation");
  spec.mutable_layer_norm_dense_general()->add_features(8);
  EXPECT_EQ(TypeOf(spec), "LayerNormDenseGeneral");
  spec.mutable_layer_norm_mlp();
  EXPECT_EQ(TypeOf(spec), "LayerNormMLP");
  auto* dpa = spec.mutable_dot_product_attention();
  dpa->set_head_dim(8);
  dpa->set_num_attention_heads(2);
  EXPECT_EQ(TypeOf(spec), "DotProductAttention");
  auto* mha = spec.mutable_multi_head_attention();
  mha->set_head_dim(8);
  mha->set_num_attention_heads(2);
  EXPECT_EQ(TypeOf(spec), "MultiHeadAttention");
  spec.mutable_transformer_layer();
  EXPECT_EQ(TypeOf(spec), "TransformerLayer");
}

TEST(CreateLayerTest, ErrorsNameTheField) {
  te::v1::LayerSpec empty;
  auto s = CreateLayer(empty).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec"), std::string::npos);
  te::v1::LayerSpec dense;
  dense.mutable_dense_general();  // features are required
  s = CreateLayer(dense).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.dense_general.features"), std::string::npos) << s;
}

TEST(CreateLayerTest, CreatedLayerRuns) {
  auto ops = testing::NewCpuOps();
  te::v1::LayerSpec spec;
  auto* mlp = spec.mutable_layer_norm_mlp();
  mlp->set_intermediate_dim(16);
  mlp->add_activations("gelu");
  mlp->add_activations("linear");
  auto layer = CreateLayer(spec);
  ASSERT_TRUE(layer.ok());
  auto vars = testing::InitLayer(*ops, **layer, {2, 4, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = testing::RandomTensor(*ops, {2, 4, 8}, DType::kF32, 1);
  // TE's default intermediate_dropout_rate (0.1) is active when not deterministic.
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 5;
  EXPECT_TRUE(testing::CheckGradients(*ops, **layer, &*vars, in, opts));
}

}  // namespace
}  // namespace te::layers
