// How a graph decodes (graph_internal.h): which module nodes run one position
// at a time, and which nodes a decode step runs.
#include <string>
#include <vector>

#include "server/layers/graph_internal.h"

namespace te::layers::graph {

DecodeRole DecodeRoleOf(const Layer& module) {
  // Named rather than asked of each module: the list is short and its members
  // compute each position from that position alone (a dense layer that
  // contracted the sequence axis would need other variables at another
  // length, which the step's variable check refuses).
  static const char* const kPositionWise[] = {
      "LayerNorm", "DenseGeneral",  "LayerNormDenseGeneral", "LayerNormMLP",    "Activation",
      "Embed",     "FlaxLayerNorm", "FlaxDense",             "FlaxDenseGeneral",
  };
  const std::string type = module.type_name();
  for (const char* name : kPositionWise) {
    if (type == name) return DecodeRole::kPositionWise;
  }
  if (type == "MultiHeadAttention" || type == "TransformerLayer") return DecodeRole::kCached;
  return DecodeRole::kUnsupported;
}

int DecodeOutput(const Graph& graph) {
  const int y = graph.outputs[0];
  const int producer = graph.tensors[y].producer;
  if (producer >= 0 && graph.nodes[producer].kind == NodeKind::kSoftmaxCrossEntropy) {
    return graph.nodes[producer].inputs[0];
  }
  return y;
}

std::vector<bool> NodesFeeding(const Graph& graph, int id) {
  std::vector<bool> needed_tensor(graph.tensors.size(), false);
  std::vector<bool> run(graph.nodes.size(), false);
  needed_tensor[id] = true;
  // Reverse topological order: a node's readers come before it.
  for (size_t k = graph.order.size(); k-- > 0;) {
    const int i = graph.order[k];
    const Node& node = graph.nodes[i];
    bool feeds = false;
    for (int out : node.outputs) feeds = feeds || needed_tensor[out];
    if (!feeds) continue;
    run[i] = true;
    for (int in : node.inputs) needed_tensor[in] = true;
    if (node.mask >= 0) needed_tensor[node.mask] = true;
  }
  return run;
}

}  // namespace te::layers::graph
