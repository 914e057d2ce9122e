#include "client/quickstart_layers.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace te::client {
namespace {

using Edge = Graph::Edge;

constexpr float kLayerNormEps = 1e-5f;  // the classes' layernorm_eps
constexpr float kAttentionDropout = 0.1f;

int64_t KvChannels(const LayerSize& c) { return c.hidden / c.heads; }

}  // namespace

// te_flax.DotProductAttention as sections 3-5 configure it.
DotProductAttention TeAttention(const LayerSize& c) {
  DotProductAttention attention(static_cast<int>(KvChannels(c)), c.heads);
  attention.num_gqa_groups = c.heads;
  attention.attention_dropout = kAttentionDropout;
  attention.attn_mask_type = "causal";
  attention.dtype = DType::kBF16;
  return attention;
}

DenseGeneral TeDense(int64_t features) {
  DenseGeneral dense({features});
  dense.use_bias = true;
  return dense;
}

LayerNorm TeNorm() {
  LayerNorm norm;
  norm.epsilon = kLayerNormEps;
  return norm;
}

LayerNormMLP FusedMlp(const LayerSize& c) {
  LayerNormMLP mlp;
  mlp.intermediate_dim = c.ffn;
  mlp.epsilon = kLayerNormEps;
  mlp.use_bias = true;
  mlp.activations = {"gelu"};
  mlp.intermediate_dropout_rate = 0.0f;
  mlp.return_layernorm_output = false;
  return mlp;
}

LayerNormDenseGeneral FusedQkv(const LayerSize& c) {
  LayerNormDenseGeneral qkv({3 * c.hidden});
  qkv.epsilon = kLayerNormEps;
  qkv.use_bias = true;
  qkv.return_layernorm_output = false;
  return qkv;
}

namespace {

// qkv.reshape(b, s, heads, 3 * kv_channels); q, k, v = jnp.split(qkv, 3, axis=3).
std::vector<Edge> SplitQkv(Graph& g, Edge qkv, const LayerSize& c) {
  qkv = g.Reshape(qkv, {c.batch, c.seq, c.heads, 3 * KvChannels(c)});
  return g.Split(qkv, 3, 3);
}

// The Flax-attention branch (sections 1 and 2): q, k, v reshaped to
// (b, s, hidden), nn.MultiHeadDotProductAttention with the causal mask.
Edge FlaxAttention(Graph& g, const std::vector<Edge>& qkv, Edge mask, const LayerSize& c) {
  std::vector<Edge> inputs;
  for (Edge t : qkv) inputs.push_back(g.Reshape(t, {c.batch, c.seq, c.hidden}));
  FlaxMultiHeadDotProductAttention attention(c.heads);
  attention.qkv_features = KvChannels(c);
  attention.dropout_rate = kAttentionDropout;
  return g.Call(attention, inputs, mask);
}

// The TE-attention branch (sections 3-5): DotProductAttention, the reshape
// back to (b, s, hidden), the output DenseGeneral and nn.Dropout.
Edge TeAttentionBlock(Graph& g, const std::vector<Edge>& qkv, const LayerSize& c) {
  Edge x = g.Call(TeAttention(c), qkv);
  x = g.Reshape(x, {c.batch, c.seq, c.hidden});
  x = g.Call(TeDense(c.hidden), {x});
  return g.Dropout(x, kAttentionDropout);
}

Graph NewGraph(std::string type_name, const LayerSize& c) {
  return Graph(std::move(type_name), {c.batch, c.seq, c.hidden}, DType::kBF16);
}

}  // namespace

Graph QuickstartFlaxLayer(const LayerSize& c) {
  Graph g = NewGraph("FlaxTransformerLayer", c);
  const Edge mask = g.CausalMask(g.x());  // attention_mask is None
  Edge res = g.x();
  FlaxLayerNorm norm;
  norm.epsilon = kLayerNormEps;
  Edge x = g.Call(norm, {g.x()});
  const Edge qkv = g.Call(FlaxDense(3 * c.hidden), {x});
  x = FlaxAttention(g, SplitQkv(g, qkv, c), mask, c);
  x = g.Add(res, x);

  res = x;
  x = g.Call(norm, {x});
  {
    Graph::Scope mlp = g.Submodule("FlaxMLP");
    x = g.Call(FlaxDense(c.ffn), {x});
    x = g.Gelu(x);
    x = g.Call(FlaxDense(c.hidden), {x});
  }
  g.SetOutput(g.Add(x, res));
  return g;
}

Graph UnfusedLayer(const LayerSize& c, bool use_te_attention) {
  Graph g = NewGraph("TEUnfusedTransformerLayer", c);
  // Made whether or not a branch reads it; TE's attention does not (its
  // mask type is causal), and then the graph leaves it out.
  const Edge mask = g.CausalMask(g.x());
  Edge res = g.x();
  Edge x = g.Call(TeNorm(), {g.x()});
  const Edge qkv = g.Call(TeDense(3 * c.hidden), {x});
  const std::vector<Edge> q_k_v = SplitQkv(g, qkv, c);
  x = use_te_attention ? TeAttentionBlock(g, q_k_v, c) : FlaxAttention(g, q_k_v, mask, c);
  x = g.Add(res, x);

  res = x;
  x = g.Call(TeNorm(), {x});
  {
    Graph::Scope mlp = g.Submodule("TEUnfusedMLP");
    x = g.Call(TeDense(c.ffn), {x});
    x = g.Reshape(x, {c.batch, c.seq, 1, c.ffn});
    x = g.Activation(x, {"gelu"});
    x = g.Call(TeDense(c.hidden), {x});
  }
  g.SetOutput(g.Add(x, res));
  return g;
}

Graph FusedLayer(const LayerSize& c) {
  Graph g = NewGraph("TEFusedTransformerLayer", c);
  Edge res = g.x();
  const Edge qkv = g.Call(FusedQkv(c), {g.x()});
  Edge x = TeAttentionBlock(g, SplitQkv(g, qkv, c), c);
  x = g.Add(res, x);

  res = x;
  x = g.Call(FusedMlp(c), {x});
  g.SetOutput(g.Add(x, res));
  return g;
}

TransformerLayer QuickstartTransformerLayer(const LayerSize& c) {
  TransformerLayer layer;
  layer.hidden_size = c.hidden;
  layer.mlp_hidden_size = c.ffn;
  layer.num_attention_heads = c.heads;
  layer.mlp_activations = {"gelu"};
  layer.self_attn_mask_type = "causal";
  layer.layernorm_epsilon = kLayerNormEps;
  layer.use_bias = true;
  layer.intermediate_dropout = 0.0f;
  layer.enable_relative_embedding = false;
  layer.self_attn_bias_type = "no_bias";
  layer.hidden_dropout = 0.0f;
  layer.dtype = DType::kBF16;
  return layer;
}

absl::StatusOr<QuickstartSection> SectionFor(int section, const LayerSize& c) {
  switch (section) {
    case 1:
      return QuickstartSection{"Pure Flax FlaxTransformerLayer", false,
                               std::make_shared<Graph>(QuickstartFlaxLayer(c))};
    case 2:
      return QuickstartSection{"TE DenseGeneral + LayerNorm + activation, Flax attention", false,
                               std::make_shared<Graph>(UnfusedLayer(c, /*use_te_attention=*/false))};
    case 3:
      return QuickstartSection{"TE DenseGeneral + LayerNorm + activation + DotProductAttention", false,
                               std::make_shared<Graph>(UnfusedLayer(c))};
    case 4:
      return QuickstartSection{"TE unfused layer under FP8 (DelayedScaling HYBRID, amax_history_len=16, max)",
                               true, std::make_shared<Graph>(UnfusedLayer(c))};
    case 5:
      return QuickstartSection{"TE fused LayerNormDenseGeneral + LayerNormMLP under FP8", true,
                               std::make_shared<Graph>(FusedLayer(c))};
    case 6:
      return QuickstartSection{"TE TransformerLayer under FP8", true,
                               std::make_shared<TransformerLayer>(QuickstartTransformerLayer(c))};
  }
  return absl::InvalidArgumentError(absl::StrCat("section: ", section, " is not a quickstart section 1-6"));
}

DelayedScaling QuickstartRecipe() {
  DelayedScaling recipe;
  recipe.fp8_format = Format::kHybrid;
  recipe.amax_history_len = 16;
  recipe.amax_compute_algo = "max";
  return recipe;
}

absl::StatusOr<LayerSize> SizeForConfig(absl::string_view config) {
  if (config == "small") return LayerSize{2, 32, 64, 256, 4};
  if (config == "quickstart") return LayerSize{4, 2048, 4096, 16384, 32};
  return absl::InvalidArgumentError(absl::StrCat("--config: \"", config, "\" is not small or quickstart"));
}

}  // namespace te::client
