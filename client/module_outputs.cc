#include "client/module_outputs.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

// x with its `axis` dims contracted away and `features` appended (TE's and
// Flax's DenseGeneral).
absl::StatusOr<Shape> DenseShape(const Shape& x, const std::vector<int>& axis, const std::vector<int64_t>& features,
                                 const std::string& field) {
  const int rank = static_cast<int>(x.size());
  std::set<int> contracted;
  for (int a : axis) {
    const int norm = a < 0 ? a + rank : a;
    if (norm < 0 || norm >= rank || !contracted.insert(norm).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".axis: ", a, " is out of range or repeated for x ", ShapeString(x)));
    }
  }
  Shape out;
  for (int i = 0; i < rank; ++i) {
    if (!contracted.count(i)) out.push_back(x[i]);
  }
  out.insert(out.end(), features.begin(), features.end());
  return out;
}

std::vector<int> Ints(const google::protobuf::RepeatedField<int32_t>& values, std::vector<int> empty_means) {
  if (values.empty()) return empty_means;
  return std::vector<int>(values.begin(), values.end());
}

std::vector<int64_t> Int64s(const google::protobuf::RepeatedField<int64_t>& values) {
  return std::vector<int64_t>(values.begin(), values.end());
}

// A Flax module's y dtype: `dtype` when set, else the promotion of x's and
// param_dtype's (float32 unset), or x's for a module without parameters.
absl::StatusOr<DType> FlaxOutputDType(te::v1::DType dtype, te::v1::DType param_dtype, bool has_params, DType x) {
  if (dtype != te::v1::DTYPE_UNSPECIFIED) return DTypeFromProto(dtype, "dtype");
  if (!has_params) return x;
  DType params = DType::kF32;
  if (param_dtype != te::v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(params, DTypeFromProto(param_dtype, "param_dtype"));
  }
  return PromoteFloat(x, params);
}

Shape WithLast(Shape shape, int64_t last) {
  shape.back() = last;
  return shape;
}

}  // namespace

DType PromoteFloat(DType a, DType b) { return a == b ? a : DType::kF32; }

absl::StatusOr<ModuleOutputs> InferModuleOutputs(const te::v1::LayerSpec& spec, const std::vector<Shape>& inputs,
                                                 DType x_dtype) {
  if (inputs.empty() || inputs[0].empty()) return absl::InvalidArgumentError("x: a module takes x of rank >= 1");
  const Shape& x = inputs[0];
  ModuleOutputs out;
  out.dtype = x_dtype;  // TE's modules compute in their input's dtype
  switch (spec.module_case()) {
    case te::v1::LayerSpec::kLayerNorm:
    case te::v1::LayerSpec::kTransformerLayer:
      out.shapes = {x};
      break;
    case te::v1::LayerSpec::kDenseGeneral: {
      const te::v1::DenseGeneral& p = spec.dense_general();
      ASSIGN_OR_RETURN(Shape y, DenseShape(x, Ints(p.axis(), {-1}), Int64s(p.features()), "dense_general"));
      out.shapes = {y};
      break;
    }
    case te::v1::LayerSpec::kActivation: {
      const int n = spec.activation().activations_size();
      if (n <= 1) {
        out.shapes = {x};
      } else if (x.size() < 2 || x[x.size() - 2] != n) {
        return absl::InvalidArgumentError(
            absl::StrCat("activation: x ", ShapeString(x), " for ", n, " activations; want [..., ", n, ", I]"));
      } else {
        Shape y(x.begin(), x.end() - 2);
        y.push_back(x.back());
        out.shapes = {y};
      }
      break;
    }
    case te::v1::LayerSpec::kLayerNormDenseGeneral: {
      const te::v1::LayerNormDenseGeneral& p = spec.layer_norm_dense_general();
      ASSIGN_OR_RETURN(Shape y, DenseShape(x, {-1}, Int64s(p.features()), "layer_norm_dense_general"));
      out.shapes = {y};
      if (!p.has_return_layernorm_output() || p.return_layernorm_output()) out.shapes.push_back(x);
      break;
    }
    case te::v1::LayerSpec::kLayerNormMlp: {
      const te::v1::LayerNormMLP& p = spec.layer_norm_mlp();
      out.shapes = {x};
      if (!p.has_return_layernorm_output() || p.return_layernorm_output()) out.shapes.push_back(x);
      break;
    }
    case te::v1::LayerSpec::kMultiHeadAttention: {
      const te::v1::MultiHeadAttention& p = spec.multi_head_attention();
      out.shapes = {x};
      if (p.return_layernorm_output()) out.shapes.push_back(x);
      break;
    }
    case te::v1::LayerSpec::kDotProductAttention: {
      if (spec.dot_product_attention().qkv_layout() != te::v1::BS3HD) {
        out.shapes = {x};
      } else if (x.size() != 5 || x[2] != 3) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dot_product_attention: a bs3hd qkv is [batch, seq, 3, heads, head_dim], not ", ShapeString(x)));
      } else {
        out.shapes = {Shape{x[0], x[1], x[3], x[4]}};
      }
      break;
    }
    case te::v1::LayerSpec::kFlaxDense: {
      const te::v1::FlaxDense& p = spec.flax_dense();
      out.shapes = {WithLast(x, p.features())};
      ASSIGN_OR_RETURN(out.dtype, FlaxOutputDType(p.dtype(), p.param_dtype(), true, x_dtype));
      break;
    }
    case te::v1::LayerSpec::kFlaxDenseGeneral: {
      const te::v1::FlaxDenseGeneral& p = spec.flax_dense_general();
      ASSIGN_OR_RETURN(Shape y, DenseShape(x, Ints(p.axis(), {-1}), Int64s(p.features()), "flax_dense_general"));
      out.shapes = {y};
      ASSIGN_OR_RETURN(out.dtype, FlaxOutputDType(p.dtype(), p.param_dtype(), true, x_dtype));
      break;
    }
    case te::v1::LayerSpec::kFlaxLayerNorm: {
      const te::v1::FlaxLayerNorm& p = spec.flax_layer_norm();
      const bool has_params = !p.has_use_bias() || p.use_bias() || !p.has_use_scale() || p.use_scale();
      out.shapes = {x};
      ASSIGN_OR_RETURN(out.dtype, FlaxOutputDType(p.dtype(), p.param_dtype(), has_params, x_dtype));
      break;
    }
    case te::v1::LayerSpec::kFlaxMultiHeadDotProductAttention: {
      const te::v1::FlaxMultiHeadDotProductAttention& p = spec.flax_multi_head_dot_product_attention();
      out.shapes = {p.has_out_features() ? WithLast(x, p.out_features()) : x};
      ASSIGN_OR_RETURN(out.dtype, FlaxOutputDType(p.dtype(), p.param_dtype(), true, x_dtype));
      break;
    }
    case te::v1::LayerSpec::kFlaxEmbed: {
      // nn.Embed: int32 ids [...] -> [..., features]. Flax promotes the
      // embedding alone (inexact=False), so the ids' dtype plays no part.
      const te::v1::FlaxEmbed& p = spec.flax_embed();
      if (x_dtype != DType::kI32) {
        return absl::InvalidArgumentError(
            absl::StrCat("flax_embed: ids are ", DTypeName(x_dtype), "; nn.Embed takes int32 token ids"));
      }
      Shape y = x;
      y.push_back(p.features());
      out.shapes = {y};
      out.dtype = DType::kF32;  // param_dtype's default
      if (p.dtype() != te::v1::DTYPE_UNSPECIFIED) {
        ASSIGN_OR_RETURN(out.dtype, DTypeFromProto(p.dtype(), "flax_embed.dtype"));
      } else if (p.param_dtype() != te::v1::DTYPE_UNSPECIFIED) {
        ASSIGN_OR_RETURN(out.dtype, DTypeFromProto(p.param_dtype(), "flax_embed.param_dtype"));
      }
      break;
    }
    case te::v1::LayerSpec::kGraph:
      return absl::UnimplementedError("a composite inside a graph: build its nodes into the outer graph");
    case te::v1::LayerSpec::MODULE_NOT_SET:
      return absl::InvalidArgumentError("module: not set");
  }
  return out;
}

}  // namespace te::client
