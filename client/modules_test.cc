// Modules without a server: specs carry TE's (and Flax's) defaults, and
// shape trees print as the quickstart prints them.
#include "client/modules.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace te::client {
namespace {

TEST(ShapeTreeTest, PrintsLikeTheQuickstart) {
  // The quickstart's FlaxTransformerLayer at its own sizes, in server order.
  const std::vector<VariableInfo> vars = {
      {"params", "LayerNorm_0/scale", {4096}, DType::kF32},
      {"params", "LayerNorm_0/bias", {4096}, DType::kF32},
      {"params", "Dense_0/kernel", {4096, 12288}, DType::kF32},
      {"params", "Dense_0/bias", {12288}, DType::kF32},
      {"params", "Dense_1/kernel", {4096, 4096}, DType::kF32},
      {"params", "Dense_1/bias", {4096}, DType::kF32},
      {"params", "LayerNorm_1/scale", {4096}, DType::kF32},
      {"params", "LayerNorm_1/bias", {4096}, DType::kF32},
      {"params", "FlaxMLP_0/Dense_0/kernel", {4096, 16384}, DType::kF32},
      {"params", "FlaxMLP_0/Dense_0/bias", {16384}, DType::kF32},
      {"params", "FlaxMLP_0/Dense_1/kernel", {16384, 4096}, DType::kF32},
      {"params", "FlaxMLP_0/Dense_1/bias", {4096}, DType::kF32},
  };
  EXPECT_EQ(ShapeTree(vars),
            "{'params': {'Dense_0': {'bias': (12288,), 'kernel': (4096, 12288)}, 'Dense_1': {'bias': (4096,), "
            "'kernel': (4096, 4096)}, 'FlaxMLP_0': {'Dense_0': {'bias': (16384,), 'kernel': (4096, 16384)}, "
            "'Dense_1': {'bias': (4096,), 'kernel': (16384, 4096)}}, 'LayerNorm_0': {'bias': (4096,), 'scale': "
            "(4096,)}, 'LayerNorm_1': {'bias': (4096,), 'scale': (4096,)}}}");
}

TEST(ShapeTreeTest, Fp8MetasAndScalars) {
  const std::vector<VariableInfo> vars = {
      {"params", "kernel", {64, 192}, DType::kF32},
      {"fp8_metas", "kernel_amax_history", {16}, DType::kF32},
      {"fp8_metas", "kernel_scale", {1}, DType::kF32},
      {"params", "step", {}, DType::kI32},
  };
  EXPECT_EQ(ShapeTree(vars),
            "{'fp8_metas': {'kernel_amax_history': (16,), 'kernel_scale': (1,)}, "
            "'params': {'kernel': (64, 192), 'step': ()}}");
  EXPECT_EQ(ShapeTree({}), "{}");
}

TEST(ModuleSpecTest, TransformerLayerDefaultsAreTEs) {
  const TransformerLayer layer;
  absl::StatusOr<te::v1::LayerSpec> spec = layer.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_transformer_layer());
  const te::v1::TransformerLayer& p = spec->transformer_layer();
  EXPECT_EQ(p.hidden_size(), 512);
  EXPECT_EQ(p.mlp_hidden_size(), 2048);
  EXPECT_EQ(p.num_attention_heads(), 8);
  EXPECT_FALSE(p.has_num_gqa_groups());  // None: one group per head, the server's default
  EXPECT_EQ(p.layernorm_type(), te::v1::LAYERNORM);
  EXPECT_FLOAT_EQ(p.layernorm_epsilon(), 1e-6f);
  EXPECT_FLOAT_EQ(p.hidden_dropout(), 0.1f);
  EXPECT_FLOAT_EQ(p.attention_dropout(), 0.1f);
  EXPECT_FLOAT_EQ(p.intermediate_dropout(), 0.0f);  // TE >= 2.10
  ASSERT_EQ(p.mlp_activations_size(), 1);
  EXPECT_EQ(p.mlp_activations(0), "gelu");
  EXPECT_FALSE(p.use_bias());
  EXPECT_EQ(p.self_attn_mask_type(), te::v1::CAUSAL);
  EXPECT_EQ(p.self_attn_bias_type(), te::v1::ATTN_BIAS_TYPE_UNSPECIFIED);
  EXPECT_TRUE(p.enable_relative_embedding());
  EXPECT_TRUE(p.scaled_query_init());
  EXPECT_EQ(p.dtype(), te::v1::PARAM_FLOAT32);
}

TEST(ModuleSpecTest, TransformerLayerTypeIsTes) {
  TransformerLayer layer;
  // Unset: TE's default, ENCODER.
  EXPECT_EQ(layer.Spec()->transformer_layer().layer_type(),
            te::v1::TRANSFORMER_LAYER_TYPE_UNSPECIFIED);
  layer.layer_type = "decoder";
  EXPECT_EQ(layer.Spec()->transformer_layer().layer_type(), te::v1::DECODER);
  layer.layer_type = "DECODER";  // TE's enum name
  EXPECT_EQ(layer.Spec()->transformer_layer().layer_type(), te::v1::DECODER);
  layer.layer_type = "seq2seq";
  const absl::Status bad = layer.Spec().status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("layer_type"), std::string::npos) << bad;
}

TEST(ModuleSpecTest, QuickstartFusedModules) {
  LayerNormDenseGeneral qkv({192});
  qkv.epsilon = 1e-5f;
  qkv.use_bias = true;
  qkv.return_layernorm_output = false;
  absl::StatusOr<te::v1::LayerSpec> spec = qkv.Spec();
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->layer_norm_dense_general().features(0), 192);
  EXPECT_TRUE(spec->layer_norm_dense_general().use_bias());
  EXPECT_FALSE(spec->layer_norm_dense_general().return_layernorm_output());
  EXPECT_TRUE(spec->layer_norm_dense_general().enable_layernorm());

  const LayerNormMLP mlp;
  spec = mlp.Spec();
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->layer_norm_mlp().intermediate_dim(), 2048);
  EXPECT_EQ(spec->layer_norm_mlp().activations(0), "gelu");
  EXPECT_FLOAT_EQ(spec->layer_norm_mlp().intermediate_dropout_rate(), 0.0f);
  EXPECT_FALSE(spec->layer_norm_mlp().return_layernorm_output());
  EXPECT_FALSE(spec->layer_norm_mlp().use_bias());

  DotProductAttention attention(16, 4);
  spec = attention.Spec();
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->dot_product_attention().attn_mask_type(), te::v1::CAUSAL);
  EXPECT_EQ(spec->dot_product_attention().qkv_layout(), te::v1::BSHD_BSHD_BSHD);
  EXPECT_FALSE(spec->dot_product_attention().has_scale_factor());  // 1/sqrt(head_dim) on the server
}

// Every mask type name TE's canonicalize_attn_mask_type takes, aliases
// included, maps to its te.v1 value.
TEST(ModuleSpecTest, MaskTypeNamesAreTes) {
  const std::pair<const char*, te::v1::AttnMaskType> names[] = {
      {"no_mask", te::v1::NO_MASK},
      {"padding", te::v1::PADDING},
      {"causal", te::v1::CAUSAL},
      {"padding_causal", te::v1::PADDING_CAUSAL},
      {"causal_padding", te::v1::PADDING_CAUSAL},
      {"causal_bottom_right", te::v1::CAUSAL_BOTTOM_RIGHT},
      {"bottom_right_causal", te::v1::CAUSAL_BOTTOM_RIGHT},
      {"padding_causal_bottom_right", te::v1::PADDING_CAUSAL_BOTTOM_RIGHT},
      {"causal_padding_bottom_right", te::v1::PADDING_CAUSAL_BOTTOM_RIGHT},
      {"bottom_right_causal_padding", te::v1::PADDING_CAUSAL_BOTTOM_RIGHT},
      {"bottom_right_padding_causal", te::v1::PADDING_CAUSAL_BOTTOM_RIGHT},
  };
  for (const auto& [name, want] : names) {
    DotProductAttention attention(16, 4);
    attention.attn_mask_type = name;
    absl::StatusOr<te::v1::LayerSpec> spec = attention.Spec();
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    EXPECT_EQ(spec->dot_product_attention().attn_mask_type(), want) << name;
    TransformerLayer layer;
    layer.self_attn_mask_type = name;
    spec = layer.Spec();
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    EXPECT_EQ(spec->transformer_layer().self_attn_mask_type(), want) << name;
  }
}

TEST(ModuleSpecTest, UnknownStringsNameTheField) {
  LayerNorm norm;
  norm.layernorm_type = "batchnorm";
  absl::Status status = norm.Spec().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("layernorm_type"), std::string::npos) << status;

  TransformerLayer layer;
  layer.self_attn_mask_type = "diagonal";
  status = layer.Spec().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("self_attn_mask_type"), std::string::npos) << status;

  DenseGeneral dense({8});
  dense.dtype = DType::kE4M3;
  EXPECT_EQ(dense.Spec().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ModuleTest, ApplyNeedsVariablesFromInit) {
  const DenseGeneral dense({8});
  const HostTensor x = HostTensor::RandomNormal({2, 4}, DType::kBF16, 3);
  EXPECT_EQ(dense.Apply(Variables{}, x).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dense.ValueAndGrad(Variables{}, x, x).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ModuleTest, DropoutUsersAreModulesWithARateAboveZero) {
  using Names = std::vector<std::string>;
  EXPECT_EQ(TransformerLayer().DropoutUsers(), Names{"TransformerLayer"});  // hidden, attention 0.1
  TransformerLayer no_dropout;
  no_dropout.hidden_dropout = no_dropout.attention_dropout = no_dropout.intermediate_dropout = 0.0f;
  EXPECT_TRUE(no_dropout.DropoutUsers().empty());
  no_dropout.intermediate_dropout = 0.25f;
  EXPECT_EQ(no_dropout.DropoutUsers(), Names{"TransformerLayer"});
  EXPECT_TRUE(LayerNormMLP().DropoutUsers().empty());  // intermediate_dropout_rate 0.0
  LayerNormMLP mlp_dropout;
  mlp_dropout.intermediate_dropout_rate = 0.1f;
  EXPECT_EQ(mlp_dropout.DropoutUsers(), Names{"LayerNormMLP"});
  EXPECT_TRUE(DotProductAttention(8, 2).DropoutUsers().empty());  // attention_dropout 0.0
  MultiHeadAttention attention(8, 2);
  attention.attention_dropout = 0.1f;
  EXPECT_EQ(attention.DropoutUsers(), Names{"MultiHeadAttention"});
  FlaxMultiHeadDotProductAttention flax_attention(2);
  EXPECT_TRUE(flax_attention.DropoutUsers().empty());
  flax_attention.dropout_rate = 0.1f;
  EXPECT_EQ(flax_attention.DropoutUsers(), Names{"MultiHeadDotProductAttention"});
  EXPECT_TRUE(DenseGeneral({8}).DropoutUsers().empty());
}

// Flax's modules carry Flax's defaults, and leave dtype unset for None
// (Flax's "promote the input and the parameters"), as the Python client does.
TEST(ModuleSpecTest, FlaxModulesDefaultsAreFlaxs) {
  absl::StatusOr<te::v1::LayerSpec> spec = FlaxDense(8).Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->flax_dense().features(), 8);
  EXPECT_TRUE(spec->flax_dense().use_bias());
  EXPECT_EQ(spec->flax_dense().dtype(), te::v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(spec->flax_dense().param_dtype(), te::v1::FLOAT32);

  spec = FlaxLayerNorm().Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FLOAT_EQ(spec->flax_layer_norm().epsilon(), 1e-6f);
  EXPECT_TRUE(spec->flax_layer_norm().has_use_bias() && spec->flax_layer_norm().use_bias());
  EXPECT_TRUE(spec->flax_layer_norm().has_use_scale() && spec->flax_layer_norm().use_scale());

  spec = FlaxDenseGeneral({4, 2}).Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->flax_dense_general().features_size(), 2);
  ASSERT_EQ(spec->flax_dense_general().axis_size(), 1);
  EXPECT_EQ(spec->flax_dense_general().axis(0), -1);

  FlaxMultiHeadDotProductAttention attention(4);
  spec = attention.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  const te::v1::FlaxMultiHeadDotProductAttention& a = spec->flax_multi_head_dot_product_attention();
  EXPECT_EQ(a.num_heads(), 4);
  EXPECT_FALSE(a.has_qkv_features());  // None: inputs_q's features
  EXPECT_FALSE(a.has_out_features());
  EXPECT_TRUE(a.has_dropout_rate());
  EXPECT_EQ(a.dropout_rate(), 0.0f);
  EXPECT_TRUE(a.broadcast_dropout());

  attention.dtype = DType::kBF16;
  attention.qkv_features = 16;
  spec = attention.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->flax_multi_head_dot_product_attention().dtype(), te::v1::BFLOAT16);
  EXPECT_EQ(spec->flax_multi_head_dot_product_attention().qkv_features(), 16);

  FlaxDense fp8(8);
  fp8.param_dtype = DType::kE4M3;
  absl::Status status = fp8.Spec().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("param_dtype"), std::string::npos) << status;
}

// precision: JAX's default (TensorFloat-32 on a GPU) unless HIGHEST is asked
// for, on every Flax module with a matmul.
TEST(ModuleSpecTest, FlaxMatmulPrecisionIsDefaultUnlessHighest) {
  FlaxDense dense(8);
  EXPECT_EQ(dense.Spec()->flax_dense().precision(), te::v1::PRECISION_DEFAULT);
  dense.highest_precision = true;
  EXPECT_EQ(dense.Spec()->flax_dense().precision(), te::v1::PRECISION_HIGHEST);
  FlaxDenseGeneral general({4});
  general.highest_precision = true;
  EXPECT_EQ(general.Spec()->flax_dense_general().precision(), te::v1::PRECISION_HIGHEST);
  FlaxMultiHeadDotProductAttention attention(4);
  EXPECT_EQ(attention.Spec()->flax_multi_head_dot_product_attention().precision(),
            te::v1::PRECISION_DEFAULT);
  attention.highest_precision = true;
  EXPECT_EQ(attention.Spec()->flax_multi_head_dot_product_attention().precision(),
            te::v1::PRECISION_HIGHEST);
}

}  // namespace
}  // namespace te::client
