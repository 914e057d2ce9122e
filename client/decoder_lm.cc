#include "client/decoder_lm.h"

#include "client/modules.h"

namespace te::client {

Graph DecoderLm(const DecoderLmSize& size) {
  Graph g("DecoderLM", {size.batch, size.seq}, DType::kI32);
  const Graph::Edge labels = g.ExtraInput(0, {size.batch, size.seq}, DType::kI32);
  const Graph::Edge embedded = g.Embed(g.x(), size.vocab, size.hidden);
  Graph::Edge x = g.Cast(embedded, size.compute_dtype);
  for (int i = 0; i < size.num_layers; ++i) {
    TransformerLayer layer;
    layer.hidden_size = size.hidden;
    layer.mlp_hidden_size = 4 * size.hidden;
    layer.num_attention_heads = size.heads;
    layer.mlp_activations = {"gelu"};
    layer.hidden_dropout = 0.0f;
    layer.attention_dropout = 0.0f;
    layer.intermediate_dropout = 0.0f;
    x = g.Call(layer, {x});
  }
  x = g.Call(FlaxLayerNorm(), {x});  // float32 params: promotes to float32
  g.SetOutput(g.SoftmaxCrossEntropyWithIntegerLabels(g.Attend(embedded, x), labels));
  return g;
}

}  // namespace te::client
