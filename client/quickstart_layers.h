// The layers of TE's JAX quickstart (docs/examples/quickstart_jax.ipynb)
// built from the client's modules, shared by the quickstart tool and the GPU
// benchmark (tests/bench/layer_bench) so both time the same layers.
#ifndef TE_CLIENT_QUICKSTART_LAYERS_H_
#define TE_CLIENT_QUICKSTART_LAYERS_H_

#include <cstdint>

#include "client/sequential.h"

namespace te::client {

struct LayerSizes {
  int64_t hidden = 0;
  int64_t ffn = 0;
  int heads = 0;
};

// TEUnfusedTransformerLayer (variants 2-4): te_flax LayerNorm, DenseGeneral,
// activation and DotProductAttention with the notebook's reshapes, q/k/v
// split and residual adds between them.
Sequential UnfusedLayer(const LayerSizes& c);
// TEFusedTransformerLayer (variant 5): LayerNormDenseGeneral, attention,
// DenseGeneral, LayerNormMLP.
Sequential FusedLayer(const LayerSizes& c);

}  // namespace te::client

#endif  // TE_CLIENT_QUICKSTART_LAYERS_H_
