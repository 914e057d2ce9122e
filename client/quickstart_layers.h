// The layers of TE's JAX quickstart (docs/examples/quickstart_jax.ipynb) at
// any size, with its FP8 recipe: one place for the quickstart tool, the GPU
// benchmark (bench/layers/layer_bench) and te_bench, so all of them run the
// same layers. The composed ones (sections 1-5) are Graphs built node for
// node as the notebook's classes write them, so each is the spec the Python
// client traces from the same class (tests/data/quickstart_graphs).
#ifndef TE_CLIENT_QUICKSTART_LAYERS_H_
#define TE_CLIENT_QUICKSTART_LAYERS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/graph.h"
#include "client/modules.h"
#include "client/recipe.h"

namespace te::client {

// The layer's sizes; the input x is bf16 [batch, seq, hidden].
struct LayerSize {
  int64_t batch = 2;
  int64_t seq = 32;
  int64_t hidden = 64;
  int64_t ffn = 256;
  int heads = 4;
};

// "small" (batch 2, seq 32, hidden 64, ffn 256, 4 heads) or "quickstart"
// (batch 4, seq 2048, hidden 4096, ffn 16384, 32 heads); INVALID_ARGUMENT
// naming --config otherwise.
absl::StatusOr<LayerSize> SizeForConfig(absl::string_view config);

// The notebook's fp8_recipe: DelayedScaling(HYBRID, amax_history_len=16, "max").
DelayedScaling QuickstartRecipe();

// Section 1, FlaxTransformerLayer: Flax's LayerNorm, Dense and
// MultiHeadDotProductAttention (its qkv_features = kv_channels, as the
// notebook passes it) with a causal mask, and FlaxMLP (Dense, gelu, Dense).
// Flax's dtype rule makes its y float32 for the bf16 x.
Graph QuickstartFlaxLayer(const LayerSize& c);
// Sections 2 (use_te_attention false: Flax's attention) and 3/4:
// TEUnfusedTransformerLayer, te_flax LayerNorm and DenseGeneral with TE's
// DotProductAttention, the notebook's reshapes, q/k/v split, dropout and
// residual adds, and TEUnfusedMLP.
Graph UnfusedLayer(const LayerSize& c, bool use_te_attention = true);
// Section 5, TEFusedTransformerLayer: LayerNormDenseGeneral, attention,
// DenseGeneral, LayerNormMLP.
Graph FusedLayer(const LayerSize& c);
// Section 6: te_flax.TransformerLayer as the notebook configures it.
TransformerLayer QuickstartTransformerLayer(const LayerSize& c);

// A section (1-6) as the quickstart runs it: one server module, under FP8
// for 4-6. INVALID_ARGUMENT for another number.
struct QuickstartSection {
  std::string title;
  bool fp8 = false;
  std::shared_ptr<const Module> layer;
};
absl::StatusOr<QuickstartSection> SectionFor(int section, const LayerSize& c);

// The modules of sections 3-5 as the notebook's classes configure them:
// te_flax.DotProductAttention (causal, dropout 0.1, bf16), DenseGeneral with
// a bias, LayerNorm (eps 1e-5), and section 5's fused LayerNormDenseGeneral
// (the qkv projection) and LayerNormMLP (gelu).
DotProductAttention TeAttention(const LayerSize& c);
DenseGeneral TeDense(int64_t features);
LayerNorm TeNorm();
LayerNormDenseGeneral FusedQkv(const LayerSize& c);
LayerNormMLP FusedMlp(const LayerSize& c);

}  // namespace te::client

#endif  // TE_CLIENT_QUICKSTART_LAYERS_H_
