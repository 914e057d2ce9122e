// The LM of client/python/examples/train_lm.py as a te.v1 LayerSpec in text
// form, as te_client's tracer writes it (test-only): nn.Embed, a cast to
// bfloat16 (or an identity scale), `layers` TransformerLayers (gelu, no
// dropout), a final LayerNorm, the output projection tied to the embedding,
// then the loss or the logits.
#ifndef TE_TESTS_LM_GRAPH_TEXT_H_
#define TE_TESTS_LM_GRAPH_TEXT_H_

#include <cstdint>
#include <string>

namespace te::testing {

struct LmGraphOptions {
  int64_t vocab = 256;
  int64_t hidden = 32;
  int64_t mlp_hidden = 128;
  int layers = 2;
  bool cast = true;    // bfloat16 after the Embed, as train_lm.py does; else a scale by 1
  bool rotary = true;  // enable_rotary_pos_emb
  bool loss = true;    // ends in the loss (as init traces it), else in the logits
};

std::string LmGraphText(const LmGraphOptions& options);

}  // namespace te::testing

#endif  // TE_TESTS_LM_GRAPH_TEXT_H_
