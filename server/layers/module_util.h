// Helpers shared by the module implementations (not part of the layer API).
#ifndef TE_SERVER_LAYERS_MODULE_UTIL_H_
#define TE_SERVER_LAYERS_MODULE_UTIL_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/layers/layer.h"
#include "server/layers/variables.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// What a module's forward keeps: its block's Saved plus the shapes to undo
// the flattening.
template <typename BlockSaved>
class ModuleSaved : public SavedForward {
 public:
  BlockSaved block;
  Shape x_shape;
  Shape y_shape;
  DType compute = DType::kF32;
  int64_t bytes() const override { return block.bytes(); }
};

// The concrete Saved a layer made, or INVALID_ARGUMENT when `saved` came from
// another kind of layer.
template <typename T>
absl::StatusOr<const T*> SavedAs(const SavedForward& saved, absl::string_view layer) {
  const T* typed = dynamic_cast<const T*>(&saved);
  if (typed == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("saved forward was not made by a ", layer, " layer"));
  }
  return typed;
}

// input_shape has rank >= `min_rank` and positive dims: INVALID_ARGUMENT
// naming "input_shape" otherwise.
absl::Status CheckInputShape(const Shape& shape, int min_rank);
// x is a float (non-FP8) tensor of rank >= min_rank with positive dims and no
// extra inputs: INVALID_ARGUMENT naming "x" otherwise.
absl::Status CheckInputs(const LayerInputs& in, int min_rank, absl::string_view layer);
// dy has y's shape; returns it in the compute dtype. INVALID_ARGUMENT naming "dy".
absl::StatusOr<Tensor> PrepareDy(Ops& ops, const Tensor& dy, const Shape& y_shape,
                                 DType compute);

// Field checks: INVALID_ARGUMENT naming `field`.
absl::Status CheckEpsilon(float epsilon, absl::string_view field);
absl::Status CheckRate(float rate, absl::string_view field);
absl::Status CheckFeatures(const google::protobuf::RepeatedField<int64_t>& features,
                           absl::string_view field);

absl::Status CheckParamDType(te::v1::ParamDType dtype, absl::string_view field);

NormArgs MakeNormArgs(te::v1::LayerNormType type, float epsilon, bool zero_centered_gamma);
absl::Status CheckNormType(te::v1::LayerNormType type, absl::string_view field);

Shape Concat(const Shape& a, const Shape& b);

// How an x of some shape is laid out for a DenseGeneral GEMM: its batch axes,
// then its contracted axes in `axis` order, so x flattens to [N, in].
struct ContractionPlan {
  std::vector<int> perm;  // x axes in GEMM order
  bool identity = true;   // perm is 0, 1, ..., rank - 1: no Permute
  Shape batch_dims;
  Shape in_dims;
};
// INVALID_ARGUMENT naming "<axis_field>: axis A is out of range or repeated
// for <shape_name> S", or "input_shape" (not positive; a permutation past
// Ops::Permute's rank).
absl::StatusOr<ContractionPlan> MakeContractionPlan(const Shape& x_shape,
                                                    const std::vector<int>& axis,
                                                    absl::string_view axis_field,
                                                    absl::string_view shape_name);
// x with its axes in the plan's GEMM order (x itself when that is its order).
absl::StatusOr<Tensor> ApplyContractionPermute(Ops& ops, const ContractionPlan& plan,
                                               const Tensor& x);
// d is x's gradient in the plan's GEMM layout: returns it in x's layout.
absl::StatusOr<Tensor> UndoContractionPermute(Ops& ops, const ContractionPlan& plan,
                                              const Tensor& d, const Shape& x_shape);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_MODULE_UTIL_H_
