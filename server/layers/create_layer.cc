// CreateLayer: one te.v1.LayerSpec -> the module that implements it.
#include "absl/status/status.h"
#include "server/layers/attention_layers.h"
#include "server/layers/flax_embed.h"
#include "server/layers/flax_modules.h"
#include "server/layers/graph.h"
#include "server/layers/layer.h"
#include "server/layers/modules.h"

namespace te::layers {

absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const te::v1::LayerSpec& spec) {
  switch (spec.module_case()) {
    case te::v1::LayerSpec::kLayerNorm: return MakeLayerNorm(spec.layer_norm());
    case te::v1::LayerSpec::kDenseGeneral: return MakeDenseGeneral(spec.dense_general());
    case te::v1::LayerSpec::kActivation: return MakeActivation(spec.activation());
    case te::v1::LayerSpec::kLayerNormDenseGeneral:
      return MakeLayerNormDenseGeneral(spec.layer_norm_dense_general());
    case te::v1::LayerSpec::kLayerNormMlp: return MakeLayerNormMLP(spec.layer_norm_mlp());
    case te::v1::LayerSpec::kDotProductAttention:
      return MakeDotProductAttention(spec.dot_product_attention());
    case te::v1::LayerSpec::kMultiHeadAttention:
      return MakeMultiHeadAttention(spec.multi_head_attention());
    case te::v1::LayerSpec::kTransformerLayer:
      return MakeTransformerLayer(spec.transformer_layer());
    case te::v1::LayerSpec::kGraph: return MakeGraph(spec.graph());
    case te::v1::LayerSpec::kFlaxDense: return MakeFlaxDense(spec.flax_dense());
    case te::v1::LayerSpec::kFlaxDenseGeneral:
      return MakeFlaxDenseGeneral(spec.flax_dense_general());
    case te::v1::LayerSpec::kFlaxLayerNorm: return MakeFlaxLayerNorm(spec.flax_layer_norm());
    case te::v1::LayerSpec::kFlaxMultiHeadDotProductAttention:
      return MakeFlaxMultiHeadDotProductAttention(spec.flax_multi_head_dot_product_attention());
    case te::v1::LayerSpec::kFlaxEmbed: return MakeFlaxEmbed(spec.flax_embed());
    case te::v1::LayerSpec::MODULE_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      "spec: no module set (one of layer_norm, dense_general, activation, "
      "layer_norm_dense_general, layer_norm_mlp, dot_product_attention, multi_head_attention, "
      "transformer_layer, graph, flax_dense, "
      "flax_dense_general, flax_layer_norm, flax_multi_head_dot_product_attention, flax_embed)");
}

}  // namespace te::layers
