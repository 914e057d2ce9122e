// The byte-level decoder LM of client/python/examples/train_lm.py, built with
// the C++ client's Graph as DecoderLM.__call__ writes it: nn.Embed, the cast
// to the compute dtype, `num_layers` TE TransformerLayers (causal, gelu MLP
// of 4 x hidden, no dropout; TE's relative position bias the only position
// signal), Flax's nn.LayerNorm, the tied embed.attend and optax's softmax
// cross entropy with integer labels, mean over the tokens. x is the int32
// tokens [batch, seq], extra_inputs[0] the int32 next-token labels of the
// same shape, and y the scalar loss: a ForwardBackward step needs no dy.
// Node for node the graph the Python tracer builds (//client:lm_graphs_test).
#ifndef TE_CLIENT_DECODER_LM_H_
#define TE_CLIENT_DECODER_LM_H_

#include <cstdint>

#include "client/graph.h"

namespace te::client {

struct DecoderLmSize {
  int num_layers = 4;
  int64_t hidden = 256;
  int heads = 8;
  int64_t vocab = 256;  // bytes
  int64_t batch = 16;
  int64_t seq = 128;
  DType compute_dtype = DType::kBF16;
};

// The graph ("DecoderLM"); its errors, if any, come from Spec().
Graph DecoderLm(const DecoderLmSize& size);

}  // namespace te::client

#endif  // TE_CLIENT_DECODER_LM_H_
