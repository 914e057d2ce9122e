#include "client/quickstart_layers.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/modules.h"

namespace te::client {
namespace {

// The attention block of TEUnfusedTransformerLayer / TEFusedTransformerLayer
// after the qkv projection: qkv.reshape(b, s, heads, 3 * kv_channels), split
// into q, k, v, DotProductAttention, reshape to (b, s, hidden), then the
// output DenseGeneral. The graph's reshapes keep the batch free (-1) and the
// sequence length of `c`. (The notebook's nn.Dropout after the projection is
// left out, so that the host-side chain, the graph's reference, has the same
// steps; the attention's own dropout is kept.)
void AddAttention(const LayerSize& c, Sequential* layer) {
  const int64_t kv_channels = c.hidden / c.heads;
  layer->AddHost("qkv_reshape", ReshapeTrailing({3 * c.hidden}, {c.heads, 3 * kv_channels}, {-1, c.seq}));
  layer->AddHost("qkv_split", SplitLastAxisStep(3));
  auto attention = std::make_shared<DotProductAttention>(static_cast<int>(kv_channels), c.heads);
  attention->num_gqa_groups = c.heads;
  attention->attention_dropout = 0.1f;
  attention->attn_mask_type = "causal";
  attention->dtype = DType::kBF16;
  layer->Add("DotProductAttention_0", attention);
  layer->AddHost("heads_merge", ReshapeTrailing({c.heads, kv_channels}, {c.hidden}, {-1, c.seq}));
  auto proj = std::make_shared<DenseGeneral>(std::vector<int64_t>{c.hidden});
  proj->use_bias = true;
  layer->Add("DenseGeneral_1", proj);
}

}  // namespace

// Variants 2-4: TEUnfusedTransformerLayer. The server has no standalone Flax
// attention (Flax's attention lives only inside FlaxTransformerLayer), so
// variant 2 runs TE's DotProductAttention as variant 3 does: the two differ
// in the notebook, not here. The causal mask is the attention's mask type;
// the server takes explicit masks only for padding.
Sequential UnfusedLayer(const LayerSize& c) {
  Sequential layer;
  auto ln = [] {
    auto norm = std::make_shared<LayerNorm>();
    norm->epsilon = 1e-5f;
    return norm;
  };
  layer.Fork();
  layer.Add("LayerNorm_0", ln());
  auto qkv = std::make_shared<DenseGeneral>(std::vector<int64_t>{3 * c.hidden});
  qkv->use_bias = true;
  layer.Add("DenseGeneral_0", qkv);
  AddAttention(c, &layer);
  layer.Join();
  layer.Fork();
  layer.Add("LayerNorm_1", ln());
  // TEUnfusedMLP: DenseGeneral(ffn) -> te.activation.activation(gelu) -> DenseGeneral(hidden).
  auto fc1 = std::make_shared<DenseGeneral>(std::vector<int64_t>{c.ffn});
  fc1->use_bias = true;
  layer.Add("TEUnfusedMLP_0/DenseGeneral_0", fc1);
  auto gelu = std::make_shared<Activation>();
  gelu->activations = {"gelu"};
  layer.Add("TEUnfusedMLP_0/activation", gelu);
  auto fc2 = std::make_shared<DenseGeneral>(std::vector<int64_t>{c.hidden});
  fc2->use_bias = true;
  layer.Add("TEUnfusedMLP_0/DenseGeneral_1", fc2);
  layer.Join();
  return layer;
}

// Variant 5: TEFusedTransformerLayer.
Sequential FusedLayer(const LayerSize& c) {
  Sequential layer;
  layer.Fork();
  auto qkv = std::make_shared<LayerNormDenseGeneral>(std::vector<int64_t>{3 * c.hidden});
  qkv->epsilon = 1e-5f;
  qkv->use_bias = true;
  qkv->return_layernorm_output = false;
  layer.Add("LayerNormDenseGeneral_0", qkv);
  AddAttention(c, &layer);
  layer.Join();
  layer.Fork();
  auto mlp = std::make_shared<LayerNormMLP>();
  mlp->intermediate_dim = c.ffn;
  mlp->epsilon = 1e-5f;
  mlp->use_bias = true;
  mlp->activations = {"gelu"};
  mlp->intermediate_dropout_rate = 0.0f;
  mlp->return_layernorm_output = false;
  layer.Add("LayerNormMLP_0", mlp);
  layer.Join();
  return layer;
}

absl::StatusOr<LayerSize> SizeForConfig(absl::string_view config) {
  if (config == "small") return LayerSize{2, 32, 64, 256, 4};
  if (config == "quickstart") return LayerSize{4, 2048, 4096, 16384, 32};
  return absl::InvalidArgumentError(absl::StrCat("--config: \"", config, "\" is not small or quickstart"));
}

DelayedScaling QuickstartRecipe() {
  DelayedScaling recipe;
  recipe.fp8_format = Format::kHybrid;
  recipe.amax_history_len = 16;
  recipe.amax_compute_algo = "max";
  return recipe;
}

FlaxTransformerLayer QuickstartFlaxLayer(const LayerSize& c) {
  FlaxTransformerLayer layer(c.hidden, c.ffn, c.heads);
  layer.hidden_dropout = 0.0f;  // the notebook's FlaxTransformerLayer drops out in attention only
  return layer;
}

TransformerLayer QuickstartTransformerLayer(const LayerSize& c) {
  TransformerLayer layer;
  layer.hidden_size = c.hidden;
  layer.mlp_hidden_size = c.ffn;
  layer.num_attention_heads = c.heads;
  layer.mlp_activations = {"gelu"};
  layer.self_attn_mask_type = "causal";
  layer.layernorm_epsilon = 1e-5f;
  layer.use_bias = true;
  layer.intermediate_dropout = 0.0f;
  layer.enable_relative_embedding = false;
  layer.self_attn_bias_type = "no_bias";
  layer.hidden_dropout = 0.0f;
  layer.dtype = DType::kBF16;
  return layer;
}

}  // namespace te::client
