#include "tests/lm_graph_text.h"

#include "absl/strings/str_cat.h"

namespace te::testing {

std::string LmGraphText(const LmGraphOptions& o) {
  const std::string layer = absl::StrCat(
      "transformer_layer { hidden_size: ", o.hidden, " mlp_hidden_size: ", o.mlp_hidden,
      " num_attention_heads: 4 mlp_activations: \"gelu\" hidden_dropout: 0 "
      "attention_dropout: 0 intermediate_dropout: 0 enable_rotary_pos_emb: ",
      o.rotary ? "true" : "false", " }");
  std::string text = absl::StrCat(
      "graph {\n  nodes { name: \"Embed_0\" inputs: \"x\" outputs: \"e\" module { flax_embed { "
      "num_embeddings: ", o.vocab, " features: ", o.hidden, " } } }\n",
      o.cast ? "  nodes { name: \"cast_0\" inputs: \"e\" outputs: \"h0\" cast { dtype: BFLOAT16 } }\n"
             : "  nodes { name: \"scale_0\" inputs: \"e\" outputs: \"h0\" scale { factor: 1 } }\n");
  for (int i = 0; i < o.layers; ++i) {
    absl::StrAppend(&text, "  nodes { name: \"TransformerLayer_", i, "\" inputs: \"h", i,
                    "\" outputs: \"h", i + 1, "\" module { ", layer, " } }\n");
  }
  absl::StrAppend(&text, "  nodes { name: \"LayerNorm_0\" inputs: \"h", o.layers,
                  "\" outputs: \"n\" module { flax_layer_norm {} } }\n",
                  "  nodes { name: \"attend_0\" inputs: \"n\" outputs: \"logits\" attend { embed: "
                  "\"Embed_0\" } }\n");
  if (o.loss) {
    absl::StrAppend(&text,
                    "  nodes { name: \"loss_0\" inputs: \"logits\" inputs: \"extra_inputs[0]\" "
                    "outputs: \"loss\" softmax_cross_entropy {} }\n  outputs: \"loss\"\n}");
  } else {
    absl::StrAppend(&text, "  outputs: \"logits\"\n}");
  }
  return text;
}

}  // namespace te::testing
