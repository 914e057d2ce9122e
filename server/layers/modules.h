// Factories for the non-attention modules (create_layer.cc dispatches to them).
// Each validates its spec (INVALID_ARGUMENT naming the field, e.g.
// "spec.dense_general.features") and applies TE's defaults.
//
// Inputs x [..., hidden] of any leading shape; compute runs in x's dtype.
//   LayerNorm              params scale [H], ln_bias [H] (layernorm only)
//   DenseGeneral           params kernel (contracted dims..., features...), bias (features...)
//   Activation             no params; x [..., I] or, gated, [..., 2, I] -> y [..., I]
//   LayerNormDenseGeneral  scale, ln_bias, kernel (H, features...), bias; y and ln_out
//   LayerNormMLP           scale, ln_bias, wi_kernel (H, n_act, I), wi_bias (n_act, I),
//                          wo_kernel (I, H), wo_bias (H); y and ln_out
#ifndef TE_SERVER_LAYERS_MODULES_H_
#define TE_SERVER_LAYERS_MODULES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNorm(const te::v1::LayerNorm& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeDenseGeneral(const te::v1::DenseGeneral& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeActivation(const te::v1::Activation& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNormDenseGeneral(
    const te::v1::LayerNormDenseGeneral& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNormMLP(const te::v1::LayerNormMLP& spec);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_MODULES_H_
