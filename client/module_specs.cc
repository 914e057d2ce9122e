// Each module's te.v1.LayerSpec. Every field is written, TE's defaults
// included, so what the server runs is exactly what the object says.
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/modules.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

absl::StatusOr<te::v1::LayerNormType> ParseLayerNormType(const std::string& field, const std::string& value) {
  if (value == "layernorm") return te::v1::LAYERNORM;
  if (value == "rmsnorm") return te::v1::RMSNORM;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", value, "\" is not a layernorm type (layernorm, rmsnorm)"));
}

absl::StatusOr<te::v1::AttnMaskType> ParseMaskType(const std::string& field, const std::string& value) {
  if (value == "no_mask") return te::v1::NO_MASK;
  if (value == "padding") return te::v1::PADDING;
  if (value == "causal") return te::v1::CAUSAL;
  // TE's canonicalize_attn_mask_type, aliases included.
  if (value == "padding_causal" || value == "causal_padding") return te::v1::PADDING_CAUSAL;
  if (value == "causal_bottom_right" || value == "bottom_right_causal") {
    return te::v1::CAUSAL_BOTTOM_RIGHT;
  }
  if (value == "padding_causal_bottom_right" || value == "causal_padding_bottom_right" ||
      value == "bottom_right_causal_padding" || value == "bottom_right_padding_causal") {
    return te::v1::PADDING_CAUSAL_BOTTOM_RIGHT;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", value,
                   "\" is not a mask type (no_mask, padding, causal, padding_causal, "
                   "causal_bottom_right, padding_causal_bottom_right)"));
}

// TE's TransformerLayerType by its value's name ("encoder", "decoder"),
// case-insensitive as TE's enum names are written either way.
absl::StatusOr<te::v1::TransformerLayerType> ParseLayerType(const std::string& field,
                                                            const std::string& value) {
  const std::string lower = absl::AsciiStrToLower(value);
  if (lower == "encoder") return te::v1::ENCODER;
  if (lower == "decoder") return te::v1::DECODER;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", value, "\" is not a layer type (encoder, decoder)"));
}

absl::StatusOr<te::v1::QkvLayout> ParseQkvLayout(const std::string& field, const std::string& value) {
  if (value == "bshd_bshd_bshd") return te::v1::BSHD_BSHD_BSHD;
  if (value == "bs3hd") return te::v1::BS3HD;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", value, "\" is not a qkv layout (bshd_bshd_bshd, bs3hd)"));
}

absl::StatusOr<te::v1::AttnBiasType> ParseBiasType(const std::string& field,
                                                   const std::optional<std::string>& value) {
  if (!value.has_value()) return te::v1::ATTN_BIAS_TYPE_UNSPECIFIED;
  if (*value == "no_bias") return te::v1::NO_BIAS;
  if (*value == "post_scale_bias") return te::v1::POST_SCALE_BIAS;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": \"", *value, "\" is not a bias type (no_bias, post_scale_bias)"));
}

absl::StatusOr<te::v1::ParamDType> ParseParamDType(const std::string& field, DType dtype) {
  if (dtype == DType::kF32) return te::v1::PARAM_FLOAT32;
  if (dtype == DType::kBF16) return te::v1::PARAM_BFLOAT16;
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": parameters can be float32 or bfloat16, not ", DTypeName(dtype)));
}

// A Flax dtype field: float32, bfloat16 or float16; None (Flax's "promote
// the input and the parameters") is te.v1's DTYPE_UNSPECIFIED.
absl::StatusOr<te::v1::DType> ParseFlaxDType(const std::string& field, std::optional<DType> dtype) {
  if (!dtype.has_value()) return te::v1::DTYPE_UNSPECIFIED;
  if (*dtype == DType::kF32 || *dtype == DType::kBF16 || *dtype == DType::kF16) return DTypeToProto(*dtype);
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": Flax's modules take float32, bfloat16 or float16, not ", DTypeName(*dtype)));
}

// A Flax module's dtype (None: promote) and param_dtype, as the Python client writes them.
template <typename FlaxSpec>
absl::Status SetFlaxDTypes(std::optional<DType> dtype, DType param_dtype, FlaxSpec* p) {
  ASSIGN_OR_RETURN(te::v1::DType compute, ParseFlaxDType("dtype", dtype));
  p->set_dtype(compute);
  ASSIGN_OR_RETURN(te::v1::DType params, ParseFlaxDType("param_dtype", param_dtype));
  p->set_param_dtype(params);
  return absl::OkStatus();
}

// Flax's matmul precision: DEFAULT (Flax's None: the call's
// DefaultMatmulPrecision) unless exact float32 is asked for.
te::v1::Precision PrecisionOf(bool highest) {
  return highest ? te::v1::PRECISION_HIGHEST : te::v1::PRECISION_DEFAULT;
}

template <typename Repeated, typename Values>
void SetAll(Repeated* out, const Values& values) {
  for (const auto& v : values) out->Add(v);
}

}  // namespace

absl::StatusOr<te::v1::LayerSpec> LayerNorm::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::LayerNorm* p = spec.mutable_layer_norm();
  p->set_epsilon(epsilon);
  ASSIGN_OR_RETURN(te::v1::LayerNormType type, ParseLayerNormType("layernorm_type", layernorm_type));
  p->set_layernorm_type(type);
  p->set_zero_centered_gamma(zero_centered_gamma);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> DenseGeneral::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::DenseGeneral* p = spec.mutable_dense_general();
  SetAll(p->mutable_features(), features);
  p->set_use_bias(use_bias);
  SetAll(p->mutable_axis(), axis);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> Activation::Spec() const {
  te::v1::LayerSpec spec;
  for (const std::string& a : activations) spec.mutable_activation()->add_activations(a);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> LayerNormDenseGeneral::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::LayerNormDenseGeneral* p = spec.mutable_layer_norm_dense_general();
  SetAll(p->mutable_features(), features);
  p->set_epsilon(epsilon);
  ASSIGN_OR_RETURN(te::v1::LayerNormType type, ParseLayerNormType("layernorm_type", layernorm_type));
  p->set_layernorm_type(type);
  p->set_zero_centered_gamma(zero_centered_gamma);
  p->set_use_bias(use_bias);
  p->set_return_layernorm_output(return_layernorm_output);
  p->set_enable_layernorm(enable_layernorm);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> LayerNormMLP::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::LayerNormMLP* p = spec.mutable_layer_norm_mlp();
  p->set_intermediate_dim(intermediate_dim);
  for (const std::string& a : activations) p->add_activations(a);
  p->set_intermediate_dropout_rate(intermediate_dropout_rate);
  p->set_use_bias(use_bias);
  p->set_return_layernorm_output(return_layernorm_output);
  p->set_epsilon(epsilon);
  ASSIGN_OR_RETURN(te::v1::LayerNormType type, ParseLayerNormType("layernorm_type", layernorm_type));
  p->set_layernorm_type(type);
  p->set_zero_centered_gamma(zero_centered_gamma);
  p->set_enable_layernorm(enable_layernorm);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> DotProductAttention::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::DotProductAttention* p = spec.mutable_dot_product_attention();
  p->set_head_dim(head_dim);
  p->set_num_attention_heads(num_attention_heads);
  p->set_num_gqa_groups(num_gqa_groups.value_or(num_attention_heads));
  p->set_attention_dropout(attention_dropout);
  ASSIGN_OR_RETURN(te::v1::AttnMaskType mask, ParseMaskType("attn_mask_type", attn_mask_type));
  p->set_attn_mask_type(mask);
  ASSIGN_OR_RETURN(te::v1::QkvLayout layout, ParseQkvLayout("qkv_layout", qkv_layout));
  p->set_qkv_layout(layout);
  if (scale_factor.has_value()) p->set_scale_factor(*scale_factor);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> MultiHeadAttention::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::MultiHeadAttention* p = spec.mutable_multi_head_attention();
  p->set_head_dim(head_dim);
  p->set_num_attention_heads(num_attention_heads);
  p->set_num_gqa_groups(num_gqa_groups.value_or(num_attention_heads));
  p->set_attention_dropout(attention_dropout);
  p->set_input_layernorm(input_layernorm);
  ASSIGN_OR_RETURN(te::v1::LayerNormType type, ParseLayerNormType("layernorm_type", layernorm_type));
  p->set_layernorm_type(type);
  p->set_layernorm_epsilon(layernorm_epsilon);
  p->set_zero_centered_gamma(zero_centered_gamma);
  p->set_use_bias(use_bias);
  ASSIGN_OR_RETURN(te::v1::AttnMaskType mask, ParseMaskType("attn_mask_type", attn_mask_type));
  p->set_attn_mask_type(mask);
  p->set_enable_rotary_pos_emb(enable_rotary_pos_emb);
  p->set_scale_attn_logits(scale_attn_logits);
  p->set_scaled_query_init(scaled_query_init);
  p->set_return_layernorm_output(return_layernorm_output);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> TransformerLayer::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* p = spec.mutable_transformer_layer();
  p->set_hidden_size(hidden_size);
  p->set_mlp_hidden_size(mlp_hidden_size);
  p->set_num_attention_heads(num_attention_heads);
  // Unset is TE's None (one group per head), and what the Python client
  // sends for it: both clients then build the same spec.
  if (num_gqa_groups) p->set_num_gqa_groups(*num_gqa_groups);
  ASSIGN_OR_RETURN(te::v1::LayerNormType type, ParseLayerNormType("layernorm_type", layernorm_type));
  p->set_layernorm_type(type);
  p->set_layernorm_epsilon(layernorm_epsilon);
  p->set_zero_centered_gamma(zero_centered_gamma);
  p->set_hidden_dropout(hidden_dropout);
  p->set_attention_dropout(attention_dropout);
  p->set_intermediate_dropout(intermediate_dropout);
  for (const std::string& a : mlp_activations) p->add_mlp_activations(a);
  p->set_use_bias(use_bias);
  ASSIGN_OR_RETURN(te::v1::AttnMaskType mask, ParseMaskType("self_attn_mask_type", self_attn_mask_type));
  p->set_self_attn_mask_type(mask);
  ASSIGN_OR_RETURN(te::v1::AttnBiasType bias, ParseBiasType("self_attn_bias_type", self_attn_bias_type));
  p->set_self_attn_bias_type(bias);
  p->set_enable_relative_embedding(enable_relative_embedding);
  p->set_enable_rotary_pos_emb(enable_rotary_pos_emb);
  p->set_scale_attn_logits(scale_attn_logits);
  p->set_scaled_query_init(scaled_query_init);
  ASSIGN_OR_RETURN(te::v1::ParamDType param_dtype, ParseParamDType("dtype", dtype));
  p->set_dtype(param_dtype);
  // An encoder (TE's default) is left unset, so that specs of encoder layers
  // stay as the Python client writes them.
  ASSIGN_OR_RETURN(te::v1::TransformerLayerType kind, ParseLayerType("layer_type", layer_type));
  if (kind != te::v1::ENCODER) p->set_layer_type(kind);
  return spec;
}

// Flax's modules: optional fields written as the Python client writes them
// (dtype left unset for None, Flax's "promote"), so that both clients send
// the same spec.
absl::StatusOr<te::v1::LayerSpec> FlaxDense::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::FlaxDense* p = spec.mutable_flax_dense();
  p->set_features(features);
  p->set_use_bias(use_bias);
  p->set_precision(PrecisionOf(highest_precision));
  RETURN_IF_ERROR(SetFlaxDTypes(dtype, param_dtype, p));
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> FlaxDenseGeneral::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::FlaxDenseGeneral* p = spec.mutable_flax_dense_general();
  SetAll(p->mutable_features(), features);
  SetAll(p->mutable_axis(), axis);
  p->set_use_bias(use_bias);
  p->set_precision(PrecisionOf(highest_precision));
  RETURN_IF_ERROR(SetFlaxDTypes(dtype, param_dtype, p));
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> FlaxLayerNorm::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::FlaxLayerNorm* p = spec.mutable_flax_layer_norm();
  p->set_epsilon(epsilon);
  p->set_use_bias(use_bias);
  p->set_use_scale(use_scale);
  RETURN_IF_ERROR(SetFlaxDTypes(dtype, param_dtype, p));
  return spec;
}

absl::StatusOr<te::v1::LayerSpec> FlaxMultiHeadDotProductAttention::Spec() const {
  te::v1::LayerSpec spec;
  te::v1::FlaxMultiHeadDotProductAttention* p = spec.mutable_flax_multi_head_dot_product_attention();
  p->set_num_heads(num_heads);
  if (qkv_features.has_value()) p->set_qkv_features(*qkv_features);
  if (out_features.has_value()) p->set_out_features(*out_features);
  p->set_dropout_rate(dropout_rate);
  p->set_use_bias(use_bias);
  p->set_broadcast_dropout(broadcast_dropout);
  p->set_precision(PrecisionOf(highest_precision));
  RETURN_IF_ERROR(SetFlaxDTypes(dtype, param_dtype, p));
  return spec;
}

}  // namespace te::client
