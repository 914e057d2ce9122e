#include "server/layers/module_util.h"

#include <cmath>

#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"

namespace te::layers {

absl::Status CheckInputShape(const Shape& shape, int min_rank) {
  if (static_cast<int>(shape.size()) < min_rank) {
    return absl::InvalidArgumentError(absl::StrCat("input_shape ", ShapeString(shape),
                                                   " must have rank >= ", min_rank));
  }
  for (int64_t d : shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_shape ", ShapeString(shape), " must have positive dimensions"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckInputs(const LayerInputs& in, int min_rank, absl::string_view layer) {
  if (!in.extra.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("extra_inputs: ", layer, " takes one input x, got ", in.extra.size(),
                     " extra inputs"));
  }
  if (!in.x.defined() || !IsFloating(in.x.dtype()) || IsFloat8(in.x.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("x must be float32, bfloat16 or float16, got ", DTypeName(in.x.dtype())));
  }
  absl::Status shape = CheckInputShape(in.x.shape(), min_rank);
  if (!shape.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("x: ", shape.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> PrepareDy(Ops& ops, const Tensor& dy, const Shape& y_shape,
                                 DType compute) {
  if (!dy.defined() || dy.shape() != y_shape || !IsFloating(dy.dtype()) ||
      IsFloat8(dy.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("dy must be a float tensor shaped like y ",
                                                   ShapeString(y_shape), ", got ",
                                                   ShapeString(dy.shape()), " ",
                                                   DTypeName(dy.dtype())));
  }
  return CastTo(ops, dy, compute);
}

absl::Status CheckEpsilon(float epsilon, absl::string_view field) {
  if (!std::isfinite(epsilon) || epsilon < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be finite and >= 0, got ", epsilon));
  }
  return absl::OkStatus();
}

absl::Status CheckRate(float rate, absl::string_view field) {
  if (!(rate >= 0.0f && rate <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be in [0, 1], got ", rate));
  }
  return absl::OkStatus();
}

absl::Status CheckFeatures(const google::protobuf::RepeatedField<int64_t>& features,
                           absl::string_view field) {
  if (features.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  for (int64_t f : features) {
    if (f <= 0 || f > (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be positive (and < 2^31), got ", f));
    }
  }
  return absl::OkStatus();
}

NormArgs MakeNormArgs(te::v1::LayerNormType type, float epsilon, bool zero_centered_gamma) {
  NormArgs args;
  args.type = type == te::v1::RMSNORM ? NormType::kRMSNorm : NormType::kLayerNorm;
  args.epsilon = epsilon;
  args.zero_centered_gamma = zero_centered_gamma;
  return args;
}

absl::Status CheckNormType(te::v1::LayerNormType type, absl::string_view field) {
  if (te::v1::LayerNormType_IsValid(type)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown layernorm type ", static_cast<int>(type)));
}

absl::Status CheckParamDType(te::v1::ParamDType dtype, absl::string_view field) {
  if (te::v1::ParamDType_IsValid(dtype)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown parameter dtype ", static_cast<int>(dtype)));
}

Shape Concat(const Shape& a, const Shape& b) {
  Shape s = a;
  s.insert(s.end(), b.begin(), b.end());
  return s;
}

absl::StatusOr<ContractionPlan> MakeContractionPlan(const Shape& x_shape,
                                                    const std::vector<int>& axis,
                                                    absl::string_view axis_field,
                                                    absl::string_view shape_name) {
  RETURN_IF_ERROR(CheckInputShape(x_shape, 1));
  const int rank = static_cast<int>(x_shape.size());
  ContractionPlan plan;
  std::vector<bool> contracted(rank, false);
  std::vector<int> axes;
  for (int a : axis) {
    const int norm = a < 0 ? a + rank : a;
    if (norm < 0 || norm >= rank || contracted[norm]) {
      return absl::InvalidArgumentError(absl::StrCat(axis_field, ": axis ", a,
                                                     " is out of range or repeated for ",
                                                     shape_name, " ", ShapeString(x_shape)));
    }
    contracted[norm] = true;
    axes.push_back(norm);
  }
  for (int a = 0; a < rank; ++a) {
    if (contracted[a]) continue;
    plan.perm.push_back(a);
    plan.batch_dims.push_back(x_shape[a]);
  }
  for (int a : axes) {
    plan.perm.push_back(a);
    plan.in_dims.push_back(x_shape[a]);
  }
  for (int i = 0; i < rank; ++i) plan.identity = plan.identity && plan.perm[i] == i;
  if (!plan.identity && rank > kPermuteMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("input_shape ", ShapeString(x_shape),
                     ": contracting non-trailing axes needs rank <= ", kPermuteMaxRank));
  }
  return plan;
}

absl::StatusOr<Tensor> ApplyContractionPermute(Ops& ops, const ContractionPlan& plan,
                                               const Tensor& x) {
  if (plan.identity) return x;
  Shape permuted;
  for (int a : plan.perm) permuted.push_back(x.dim(a));
  ASSIGN_OR_RETURN(Tensor moved, ops.Allocate(x.dtype(), permuted));
  RETURN_IF_ERROR(ops.Permute(x, plan.perm, &moved));
  return moved;
}

absl::StatusOr<Tensor> UndoContractionPermute(Ops& ops, const ContractionPlan& plan,
                                              const Tensor& d, const Shape& x_shape) {
  if (plan.identity) return d.Reshaped(x_shape);
  std::vector<int> inverse(plan.perm.size());
  Shape permuted;
  for (size_t i = 0; i < plan.perm.size(); ++i) {
    inverse[plan.perm[i]] = static_cast<int>(i);
    permuted.push_back(x_shape[plan.perm[i]]);
  }
  ASSIGN_OR_RETURN(Tensor restored, ops.Allocate(d.dtype(), x_shape));
  RETURN_IF_ERROR(ops.Permute(d.Reshaped(permuted), inverse, &restored));
  return restored;
}

}  // namespace te::layers
