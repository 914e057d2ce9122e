// The C++ client's module option defaults are TE's: every field of every TE
// module against tests/data/te_module_defaults.json (read in TE's current
// transformer_engine/jax/flax/module.py and transformer.py), so a default
// changed on either side fails here.
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "client/modules.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/module_defaults_table.h"

namespace te::client {
namespace {

using nlohmann::json;

// A client field's value as the table writes it.
json Value(float v) { return v; }
json Value(int64_t v) { return v; }
json Value(int v) { return v; }
json Value(bool v) { return v; }
json Value(const std::string& v) { return v; }
json Value(const std::vector<std::string>& v) { return v; }
json Value(DType v) { return DTypeName(v); }
json Value(const std::vector<int>& v) { return v.size() == 1 ? json(v[0]) : json(v); }
template <typename T>
json Value(const std::optional<T>& v) {
  return v.has_value() ? Value(*v) : json(nullptr);
}

using Fields = std::vector<std::pair<std::string, json>>;

// Every field of each module that the table lists. The C++ client has no
// transpose_batch_sequence (te.v1 takes [batch, seq, ...] only): always false.
Fields Of(const LayerNorm& m) {
  return {{"epsilon", Value(m.epsilon)}, {"layernorm_type", Value(m.layernorm_type)},
          {"zero_centered_gamma", Value(m.zero_centered_gamma)}, {"dtype", Value(m.dtype)}};
}
Fields Of(const DenseGeneral& m) {
  return {{"use_bias", Value(m.use_bias)}, {"axis", Value(m.axis)}, {"dtype", Value(m.dtype)}};
}
Fields Of(const LayerNormDenseGeneral& m) {
  return {{"epsilon", Value(m.epsilon)},
          {"layernorm_type", Value(m.layernorm_type)},
          {"zero_centered_gamma", Value(m.zero_centered_gamma)},
          {"use_bias", Value(m.use_bias)},
          {"return_layernorm_output", Value(m.return_layernorm_output)},
          {"enable_layernorm", Value(m.enable_layernorm)},
          {"dtype", Value(m.dtype)}};
}
Fields Of(const LayerNormMLP& m) {
  return {{"intermediate_dim", Value(m.intermediate_dim)},
          {"activations", Value(m.activations)},
          {"intermediate_dropout_rate", Value(m.intermediate_dropout_rate)},
          {"use_bias", Value(m.use_bias)},
          {"return_layernorm_output", Value(m.return_layernorm_output)},
          {"epsilon", Value(m.epsilon)},
          {"layernorm_type", Value(m.layernorm_type)},
          {"zero_centered_gamma", Value(m.zero_centered_gamma)},
          {"enable_layernorm", Value(m.enable_layernorm)},
          {"dtype", Value(m.dtype)}};
}
Fields Of(const DotProductAttention& m) {
  return {{"num_gqa_groups", Value(m.num_gqa_groups)},
          {"attention_dropout", Value(m.attention_dropout)},
          {"attn_mask_type", Value(m.attn_mask_type)},
          {"qkv_layout", Value(m.qkv_layout)},
          {"scale_factor", Value(m.scale_factor)},
          {"transpose_batch_sequence", false},
          {"dtype", Value(m.dtype)}};
}
Fields Of(const MultiHeadAttention& m) {
  return {{"num_gqa_groups", Value(m.num_gqa_groups)},
          {"attention_dropout", Value(m.attention_dropout)},
          {"input_layernorm", Value(m.input_layernorm)},
          {"layernorm_type", Value(m.layernorm_type)},
          {"layernorm_epsilon", Value(m.layernorm_epsilon)},
          {"zero_centered_gamma", Value(m.zero_centered_gamma)},
          {"use_bias", Value(m.use_bias)},
          {"attn_mask_type", Value(m.attn_mask_type)},
          {"enable_rotary_pos_emb", Value(m.enable_rotary_pos_emb)},
          {"scale_attn_logits", Value(m.scale_attn_logits)},
          {"scaled_query_init", Value(m.scaled_query_init)},
          {"return_layernorm_output", Value(m.return_layernorm_output)},
          {"transpose_batch_sequence", false},
          {"dtype", Value(m.dtype)}};
}
Fields Of(const TransformerLayer& m) {
  return {{"hidden_size", Value(m.hidden_size)},
          {"mlp_hidden_size", Value(m.mlp_hidden_size)},
          {"num_attention_heads", Value(m.num_attention_heads)},
          {"num_gqa_groups", Value(m.num_gqa_groups)},
          {"layernorm_type", Value(m.layernorm_type)},
          {"layernorm_epsilon", Value(m.layernorm_epsilon)},
          {"zero_centered_gamma", Value(m.zero_centered_gamma)},
          {"hidden_dropout", Value(m.hidden_dropout)},
          {"attention_dropout", Value(m.attention_dropout)},
          {"intermediate_dropout", Value(m.intermediate_dropout)},
          {"mlp_activations", Value(m.mlp_activations)},
          {"use_bias", Value(m.use_bias)},
          {"self_attn_mask_type", Value(m.self_attn_mask_type)},
          {"self_attn_bias_type", Value(m.self_attn_bias_type)},
          {"enable_relative_embedding", Value(m.enable_relative_embedding)},
          {"enable_rotary_pos_emb", Value(m.enable_rotary_pos_emb)},
          {"scale_attn_logits", Value(m.scale_attn_logits)},
          {"scaled_query_init", Value(m.scaled_query_init)},
          {"transpose_batch_sequence", false},
          {"dtype", Value(m.dtype)},
          {"layer_type", Value(m.layer_type)}};
}

// Equal as the client stores it: floats compared in float32.
bool Same(const json& got, const json& want) {
  if (got.is_number_float() || want.is_number_float()) {
    return got.is_number() && want.is_number() &&
           static_cast<float>(got.get<double>()) == static_cast<float>(want.get<double>());
  }
  return got == want;
}

void Check(const std::string& module, const Fields& fields) {
  const json table = te::testing::ModuleDefaultsTable();
  ASSERT_TRUE(table.contains(module)) << module;
  const json& want = table[module];
  std::vector<std::string> seen;
  for (const auto& [name, got] : fields) {
    seen.push_back(name);
    ASSERT_TRUE(want.contains(name)) << module << "." << name << " is not in the table";
    json expected = want[name];
    const std::string key = module + "." + name;
    if (table["deviations"].contains(key)) expected = table["deviations"][key]["clients"];
    EXPECT_TRUE(Same(got, expected)) << key << ": client " << got << ", TE " << expected;
  }
  // Every field the table lists is checked.
  EXPECT_EQ(seen.size(), want.size()) << module;
}

TEST(ModuleDefaultsTest, EveryTeModuleFieldIsTeS) {
  Check("LayerNorm", Of(LayerNorm()));
  Check("DenseGeneral", Of(DenseGeneral({4})));
  Check("LayerNormDenseGeneral", Of(LayerNormDenseGeneral({4})));
  Check("LayerNormMLP", Of(LayerNormMLP()));
  Check("DotProductAttention", Of(DotProductAttention(8, 2)));
  Check("MultiHeadAttention", Of(MultiHeadAttention(8, 2)));
  Check("TransformerLayer", Of(TransformerLayer()));
}

}  // namespace
}  // namespace te::client
