// The layers of TE's JAX quickstart (docs/examples/quickstart_jax.ipynb)
// built from the client's modules, with its sizes and FP8 recipe: one place
// for the quickstart tool, the GPU benchmark (tests/bench/layer_bench) and
// te_bench, so all of them run the same layers.
#ifndef TE_CLIENT_QUICKSTART_LAYERS_H_
#define TE_CLIENT_QUICKSTART_LAYERS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/modules.h"
#include "client/recipe.h"
#include "client/sequential.h"

namespace te::client {

// The layer's sizes; the input x is [batch, seq, hidden].
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

// FlaxTransformerLayer (variant 1): plain Flax, dropout in attention only.
FlaxTransformerLayer QuickstartFlaxLayer(const LayerSize& c);
// TEUnfusedTransformerLayer (variants 2-4): te_flax LayerNorm, DenseGeneral,
// activation and DotProductAttention with the notebook's reshapes, q/k/v
// split and residual adds between them.
Sequential UnfusedLayer(const LayerSize& c);
// TEFusedTransformerLayer (variant 5): LayerNormDenseGeneral, attention,
// DenseGeneral, LayerNormMLP.
Sequential FusedLayer(const LayerSize& c);
// te_flax.TransformerLayer as the notebook configures it (variant 6).
TransformerLayer QuickstartTransformerLayer(const LayerSize& c);

}  // namespace te::client

#endif  // TE_CLIENT_QUICKSTART_LAYERS_H_
