// Internals of the Flax modules (flax_modules.h), shared by their files: the
// spec's dtype fields, and Flax's DenseGeneral as a block that the dense
// modules and MultiHeadDotProductAttention's four projections use.
#ifndef TE_SERVER_LAYERS_FLAX_MODULES_INTERNAL_H_
#define TE_SERVER_LAYERS_FLAX_MODULES_INTERNAL_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/ops.h"
#include "server/layers/blocks.h"
#include "server/layers/init.h"
#include "server/layers/layer.h"
#include "server/layers/module_util.h"
#include "te/v1/layers.pb.h"
#include "te/v1/tensor.pb.h"

namespace te::layers::flax {

// A spec's `dtype`: nullopt for DTYPE_UNSPECIFIED (Flax's None: promote),
// else float32, bfloat16 or float16; INVALID_ARGUMENT naming `field` for any
// other value.
absl::StatusOr<std::optional<DType>> ComputeDTypeOf(te::v1::DType dtype, absl::string_view field);
// A spec's `param_dtype`: float32 when unspecified (Flax's default).
absl::StatusOr<DType> ParamDTypeOf(te::v1::DType dtype, absl::string_view field);
// A spec's `precision`: whether it is HIGHEST (float32 matmuls exact
// whatever the call's precision) or DEFAULT (Flax's None: the call's
// jax.default_matmul_precision, ForwardOptions::tf32); INVALID_ARGUMENT
// naming `field` else.
absl::StatusOr<bool> HighestPrecisionOf(te::v1::Precision precision, absl::string_view field);

// The dtype a module computes in for an input of `x`: `dtype` when set,
// else jnp.result_type(x, params) (params absent: x's dtype).
DType ComputeDType(const std::optional<DType>& dtype, DType x, DType param_dtype, bool has_params);

// ---- nn.DenseGeneral as a block ---------------------------------------------
struct DenseGeneralConfig {
  std::string scope;           // "" standalone; "query", "out"... in attention
  Shape features;
  std::vector<int> axis = {-1};  // contracted x axes, negative from the end
  bool use_bias = true;
  std::optional<DType> dtype;  // computation dtype; nullopt: promote
  DType param_dtype = DType::kF32;
  bool highest_precision = false;  // precision HIGHEST; DEFAULT follows the call's
  std::string field;           // the spec field for messages ("spec.flax_dense")
};

class DenseGeneral {
 public:
  explicit DenseGeneral(DenseGeneralConfig config) : config_(std::move(config)) {}
  const DenseGeneralConfig& config() const { return config_; }

  // How an x of some shape is laid out for the GEMM: its batch axes, then its
  // contracted axes in `axis` order.
  using Plan = ContractionPlan;
  // INVALID_ARGUMENT naming "<field>.axis" (out of range or repeated) or
  // "input_shape" (not positive; a permutation past Ops::Permute's rank).
  absl::StatusOr<Plan> MakePlan(const Shape& x) const;
  Shape OutputShape(const Plan& plan) const;
  // kernel (in_dims..., features...) lecun_normal over prod(in_dims), bias zeros.
  std::vector<VariableDef> Defs(const Plan& plan) const;
  DType ComputeDTypeFor(DType x) const;

  struct Saved {
    Plan plan;
    Dense::Saved dense;
    Shape x_shape;
    DType x_dtype = DType::kF32;
    DType compute = DType::kF32;
    int64_t bytes() const { return dense.bytes(); }
  };
  // x -> *y [batch dims..., features...] in the computation dtype. tf32:
  // the call's matmul precision (ForwardOptions::tf32).
  absl::Status Forward(Ops& ops, Variables* vars, const Tensor& x, bool tf32, Tensor* y,
                       Saved* saved) const;
  // dy (y's shape, any float dtype) -> *dx (x's shape and dtype); kernel and
  // bias gradients into *grads.
  absl::Status Backward(Ops& ops, Variables* vars, const Saved& saved, const Tensor& dy,
                        Tensor* dx, Variables* grads) const;

 private:
  layers::Dense DenseFor(const Plan& plan) const;

  DenseGeneralConfig config_;
};

}  // namespace te::layers::flax

#endif  // TE_SERVER_LAYERS_FLAX_MODULES_INTERNAL_H_
