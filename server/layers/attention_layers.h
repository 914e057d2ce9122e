// Factories for the attention modules and the layers built on them
// (CreateLayer in create_layer.cc calls them).
// Each validates its spec (INVALID_ARGUMENT naming the field, e.g.
// "spec.dot_product_attention.head_dim") and applies TE's defaults.
#ifndef TE_SERVER_LAYERS_ATTENTION_LAYERS_H_
#define TE_SERVER_LAYERS_ATTENTION_LAYERS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

absl::StatusOr<std::unique_ptr<Layer>> MakeDotProductAttention(
    const te::v1::DotProductAttention& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeMultiHeadAttention(
    const te::v1::MultiHeadAttention& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeTransformerLayer(const te::v1::TransformerLayer& spec);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_ATTENTION_LAYERS_H_
