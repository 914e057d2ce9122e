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

inline te::v1::SequentialSpec::Stage ModuleStage(const std::string& name,
                                                 const te::v1::LayerSpec& spec) {
  te::v1::SequentialSpec::Stage stage;
  stage.set_name(name);
  *stage.mutable_module() = spec;
  return stage;
}

inline te::v1::SequentialSpec::Stage ReshapeStage(std::vector<int64_t> from,
                                                  std::vector<int64_t> to) {
  te::v1::SequentialSpec::Stage stage;
  stage.mutable_reshape()->mutable_from()->Assign(from.begin(), from.end());
  stage.mutable_reshape()->mutable_to()->Assign(to.begin(), to.end());
  return stage;
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

}  // namespace te::fuzz

#endif  // TE_TESTS_FUZZ_REQUEST_SPECS_H_
