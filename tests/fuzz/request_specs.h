// Request pieces that both the harness (its live session) and the seeds
// build: one definition, so a seed's layer is the live layer's kind exactly.
#ifndef TE_TESTS_FUZZ_REQUEST_SPECS_H_
#define TE_TESTS_FUZZ_REQUEST_SPECS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "te/v1/layers.pb.h"
#include "te/v1/service.pb.h"

namespace te::fuzz {

// FP8 autocast under DelayedScaling with an amax history of `history`.
inline te::v1::Autocast DelayedScaling(int history = 4) {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(history);
  return autocast;
}

inline te::v1::LayerSpec DenseSpec(std::vector<int64_t> features) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->mutable_features()->Assign(features.begin(), features.end());
  return spec;
}

// DotProductAttention over 2 heads of 4.
inline te::v1::LayerSpec AttentionSpec() {
  te::v1::LayerSpec spec;
  spec.mutable_dot_product_attention()->set_head_dim(4);
  spec.mutable_dot_product_attention()->set_num_attention_heads(2);
  return spec;
}

// A node of `g` named `name`, reading `inputs` and writing `outputs`; the
// caller sets what it does.
inline te::v1::GraphSpec::Node* GraphNode(te::v1::GraphSpec* g, const std::string& name,
                                          std::vector<std::string> inputs,
                                          std::vector<std::string> outputs) {
  te::v1::GraphSpec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& in : inputs) node->add_inputs(in);
  for (const std::string& out : outputs) node->add_outputs(out);
  return node;
}

inline void SetReshape(te::v1::GraphSpec::Node* node, std::vector<int64_t> shape) {
  node->mutable_reshape()->mutable_shape()->Assign(shape.begin(), shape.end());
}

// The quickstart's unfused attention block for x [2, 3, 8], as the clients
// trace it: y = x + DenseGeneral_1(attention(split(reshape(
// DenseGeneral_0(LayerNorm_0(x)))))).
inline te::v1::LayerSpec UnfusedGraphSpec() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  GraphNode(g, "LayerNorm_0", {"x"}, {"h"})->mutable_module()->mutable_layer_norm();
  *GraphNode(g, "DenseGeneral_0", {"h"}, {"qkv"})->mutable_module() = DenseSpec({24});
  SetReshape(GraphNode(g, "qkv_reshape", {"qkv"}, {"qkv4"}), {2, 3, 2, 12});
  te::v1::GraphSpec::Node* split = GraphNode(g, "qkv_split", {"qkv4"}, {"q", "k", "v"});
  split->mutable_split()->set_axis(-1);
  split->mutable_split()->set_parts(3);
  *GraphNode(g, "DotProductAttention_0", {"q", "k", "v"}, {"a"})->mutable_module() =
      AttentionSpec();
  SetReshape(GraphNode(g, "heads_merge", {"a"}, {"a3"}), {2, 3, 8});
  *GraphNode(g, "DenseGeneral_1", {"a3"}, {"o"})->mutable_module() = DenseSpec({8});
  GraphNode(g, "residual", {"o", "x"}, {"y"})->mutable_add();
  g->add_outputs("y");
  return spec;
}

// Attention first, for x = q [2, 3, 2, 4] with k and v the extra inputs (of
// any length), then the heads merged and a DenseGeneral: y [2, 3, 8].
inline te::v1::LayerSpec AttentionGraphSpec() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  *GraphNode(g, "DotProductAttention_0", {"x", "extra_inputs[0]", "extra_inputs[1]"}, {"a"})
       ->mutable_module() = AttentionSpec();
  SetReshape(GraphNode(g, "heads_merge", {"a"}, {"a3"}), {2, 3, 8});
  *GraphNode(g, "DenseGeneral_0", {"a3"}, {"y"})->mutable_module() = DenseSpec({8});
  g->add_outputs("y");
  return spec;
}

}  // namespace te::fuzz

#endif  // TE_TESTS_FUZZ_REQUEST_SPECS_H_
