#include "server/layers/sequential.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kernels/status_macros.h"
#include "server/layers/graph.h"

namespace te::layers {
namespace {

using te::v1::GraphSpec;
using te::v1::SequentialSpec;

// Modules that read a padding mask; pass_attention_mask on any other stage
// has nothing to pass (the chain always accepted it there).
bool TakesMask(const te::v1::LayerSpec& m) {
  switch (m.module_case()) {
    case te::v1::LayerSpec::kDotProductAttention:
    case te::v1::LayerSpec::kMultiHeadAttention:
    case te::v1::LayerSpec::kTransformerLayer:
      return true;
    default:
      return false;
  }
}

// k and v for attention on separate q, k, v: the chain's first module gets
// them from the request's extra inputs.
int ExtraInputsOf(const te::v1::LayerSpec& m) {
  return m.has_dot_product_attention() && m.dot_product_attention().qkv_layout() != te::v1::BS3HD
             ? 2
             : 0;
}

// The graph of a chain, with the stage each node stands for.
struct Translation {
  GraphSpec graph;
  std::vector<int> stage_of;  // by node
};

constexpr int kMaxSplitParts = 3;  // q, k, v

std::string StageField(int i) { return absl::StrCat("spec.sequential.stages[", i, "]"); }

// The graph's messages name its nodes ("spec.graph.nodes[k] (name)"); a
// chain's user wrote stages, so they are named instead.
absl::Status AboutStages(const Translation& t, const absl::Status& status) {
  if (status.ok()) return status;
  std::string message(status.message());
  for (int k = 0; k < t.graph.nodes_size(); ++k) {
    message = absl::StrReplaceAll(
        message, {{absl::StrCat("spec.graph.nodes[", k, "] (", t.graph.nodes(k).name(), ")"),
                   StageField(t.stage_of[k])}});
  }
  for (int k = 0; k < t.graph.nodes_size(); ++k) {
    message = absl::StrReplaceAll(
        message, {{absl::StrCat("spec.graph.nodes[", k, "]"), StageField(t.stage_of[k])}});
  }
  message = absl::StrReplaceAll(message, {{"spec.graph.outputs", "the chain's output"}});
  return absl::Status(status.code(), message);
}

absl::Status ExpectOne(size_t count, const std::string& where) {
  if (count == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": takes one tensor, and the chain has ", count, " here"));
}

// The shape of `tensor` of the graph built so far, for an x of `input`.
absl::StatusOr<Shape> ShapeOf(const Translation& t, const std::string& tensor, const Shape& input) {
  if (tensor == "x") return input;
  Translation prefix = t;
  prefix.graph.clear_outputs();
  prefix.graph.add_outputs(tensor);
  absl::StatusOr<std::unique_ptr<Layer>> layer = MakeGraph(prefix.graph);
  if (!layer.ok()) return AboutStages(prefix, layer.status());
  absl::StatusOr<Shape> shape = (*layer)->OutputShape(input);
  if (!shape.ok()) return AboutStages(prefix, shape.status());
  return *shape;
}

// The chain as a graph. Without `input`, only the structure is right: each
// reshape keeps one leading dim of any size (-1), which is enough for
// MakeGraph's structure checks.
absl::StatusOr<Translation> Translate(const SequentialSpec& spec, const Shape* input) {
  Translation t;
  std::set<std::string> module_names;
  for (const SequentialSpec::Stage& s : spec.stages()) {
    if (s.has_module()) module_names.insert(s.name());
  }
  std::vector<std::string> current = {"x"};
  if (spec.stages_size() > 0 && spec.stages(0).has_module()) {
    for (int j = 0; j < ExtraInputsOf(spec.stages(0).module()); ++j) {
      current.push_back(absl::StrCat("extra_inputs[", j, "]"));
    }
  }
  std::vector<std::string> forks;
  for (int i = 0; i < spec.stages_size(); ++i) {
    const SequentialSpec::Stage& s = spec.stages(i);
    const std::string field = StageField(i);
    // Glue has no variables and no seed, so its name only has to be unique.
    std::string name = absl::StrCat("stages[", i, "]");
    while (module_names.count(name) > 0) name += "_";
    auto add_node = [&](const std::string& node_name) {
      GraphSpec::Node* node = t.graph.add_nodes();
      node->set_name(node_name);
      t.stage_of.push_back(i);
      return node;
    };
    switch (s.kind_case()) {
      case SequentialSpec::Stage::kModule: {
        GraphSpec::Node* node = add_node(s.name());
        for (const std::string& in : current) node->add_inputs(in);
        node->add_outputs(absl::StrCat(s.name(), ":y"));
        if (s.pass_attention_mask() && TakesMask(s.module())) node->set_mask("attention_mask");
        *node->mutable_module() = s.module();
        current = {node->outputs(0)};
        break;
      }
      case SequentialSpec::Stage::kReshape: {
        RETURN_IF_ERROR(ExpectOne(current.size(), field));
        const Shape from(s.reshape().from().begin(), s.reshape().from().end());
        Shape full = {-1};
        if (input != nullptr) {
          ASSIGN_OR_RETURN(const Shape shape, ShapeOf(t, current[0], *input));
          if (shape.size() < from.size() || !std::equal(from.begin(), from.end(), shape.end() - from.size())) {
            return absl::InvalidArgumentError(absl::StrCat("input_shape ", ShapeString(*input), ": ",
                                                           field, ": the tensor ", ShapeString(shape),
                                                           " does not end in ", ShapeString(from)));
          }
          full.assign(shape.begin(), shape.end() - from.size());
        }
        full.insert(full.end(), s.reshape().to().begin(), s.reshape().to().end());
        GraphSpec::Node* node = add_node(name);
        node->add_inputs(current[0]);
        node->add_outputs(absl::StrCat(name, ":y"));
        for (int64_t d : full) node->mutable_reshape()->add_shape(d);
        current = {node->outputs(0)};
        break;
      }
      case SequentialSpec::Stage::kSplitLastAxis: {
        RETURN_IF_ERROR(ExpectOne(current.size(), field));
        GraphSpec::Node* node = add_node(name);
        node->add_inputs(current[0]);
        node->mutable_split()->set_axis(-1);
        node->mutable_split()->set_parts(s.split_last_axis());
        current.clear();
        for (int j = 0; j < s.split_last_axis(); ++j) {
          node->add_outputs(absl::StrCat(name, ":", j));
          current.push_back(node->outputs(j));
        }
        break;
      }
      case SequentialSpec::Stage::kResidual:
        RETURN_IF_ERROR(ExpectOne(current.size(), field));
        if (s.residual() == SequentialSpec::FORK) {
          forks.push_back(current[0]);
        } else {
          GraphSpec::Node* node = add_node(name);
          node->add_inputs(current[0]);
          node->add_inputs(forks.back());
          node->mutable_add();
          node->add_outputs(absl::StrCat(name, ":y"));
          forks.pop_back();
          current = {node->outputs(0)};
        }
        break;
      case SequentialSpec::Stage::KIND_NOT_SET:
        break;  // MakeSequential rejects it
    }
  }
  RETURN_IF_ERROR(ExpectOne(current.size(), "spec.sequential.stages: the chain's output"));
  t.graph.add_outputs(current[0]);
  return t;
}

// A graph built for one x shape, and how to name its nodes' errors.
struct Built {
  Translation translation;
  std::unique_ptr<Layer> graph;
};

absl::StatusOr<std::shared_ptr<const Built>> Build(const SequentialSpec& spec, const Shape* input) {
  auto built = std::make_shared<Built>();
  ASSIGN_OR_RETURN(built->translation, Translate(spec, input));
  absl::StatusOr<std::unique_ptr<Layer>> graph = MakeGraph(built->translation.graph);
  if (!graph.ok()) return AboutStages(built->translation, graph.status());
  built->graph = *std::move(graph);
  return std::shared_ptr<const Built>(std::move(built));
}

struct SequentialSaved : SavedForward {
  std::shared_ptr<const Built> built;  // the graph that ran the forward
  std::unique_ptr<SavedForward> graph;
  int64_t bytes() const override { return graph != nullptr ? graph->bytes() : 0; }
};

class SequentialLayer : public Layer {
 public:
  explicit SequentialLayer(SequentialSpec spec) : spec_(std::move(spec)) {}

  std::string type_name() const override { return "Sequential"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    ASSIGN_OR_RETURN(std::shared_ptr<const Built> b, GraphFor(input_shape));
    absl::StatusOr<std::vector<VariableSpec>> specs = b->graph->VariableSpecs(input_shape, fp8);
    if (!specs.ok()) return AboutStages(b->translation, specs.status());
    return specs;
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    ASSIGN_OR_RETURN(std::shared_ptr<const Built> b, GraphFor(input_shape));
    absl::StatusOr<Shape> shape = b->graph->OutputShape(input_shape);
    if (!shape.ok()) return AboutStages(b->translation, shape.status());
    return shape;
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(std::shared_ptr<const Built> b, GraphFor(input_shape));
    return AboutStages(b->translation, b->graph->Init(ops, seed, input_shape, fp8, vars));
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    if (!in.x.defined()) return absl::InvalidArgumentError("x: missing");
    ASSIGN_OR_RETURN(std::shared_ptr<const Built> b, GraphFor(in.x.shape()));
    auto kept = std::make_unique<SequentialSaved>();
    RETURN_IF_ERROR(
        AboutStages(b->translation, b->graph->Forward(ops, vars, in, opts, out, &kept->graph)));
    kept->built = std::move(b);
    if (opts.keep_for_backward && saved != nullptr) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const SequentialSaved*>(&saved);
    if (kept == nullptr || kept->graph == nullptr) {
      return absl::InvalidArgumentError("saved forward was not made by this Sequential layer");
    }
    return AboutStages(kept->built->translation,
                       kept->built->graph->Backward(ops, vars, *kept->graph, dy, grads));
  }

 private:
  // A session meets few x shapes (its batch sizes); the bound only keeps a
  // client that sends many from growing the layer without limit.
  static constexpr size_t kMaxShapes = 16;

  absl::StatusOr<std::shared_ptr<const Built>> GraphFor(const Shape& input_shape) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = graphs_.find(input_shape);
    if (it != graphs_.end()) return it->second;
    ASSIGN_OR_RETURN(std::shared_ptr<const Built> built, Build(spec_, &input_shape));
    if (graphs_.size() >= kMaxShapes) graphs_.clear();  // held forwards keep theirs alive
    graphs_.emplace(input_shape, built);
    return built;
  }

  const SequentialSpec spec_;
  mutable std::mutex mu_;
  mutable std::map<Shape, std::shared_ptr<const Built>> graphs_;  // guarded by mu_
};

}  // namespace

absl::StatusOr<te::v1::GraphSpec> SequentialAsGraph(const SequentialSpec& spec, const Shape& input_shape) {
  ASSIGN_OR_RETURN(Translation t, Translate(spec, &input_shape));
  return t.graph;
}

absl::StatusOr<std::unique_ptr<Layer>> MakeSequential(const SequentialSpec& spec) {
  if (spec.stages().empty()) {
    return absl::InvalidArgumentError("spec.sequential.stages: empty");
  }
  std::set<std::string> names;
  int open_forks = 0;
  for (int i = 0; i < spec.stages_size(); ++i) {
    const SequentialSpec::Stage& s = spec.stages(i);
    const std::string field = StageField(i);
    switch (s.kind_case()) {
      case SequentialSpec::Stage::kModule:
        if (s.name().empty() || !names.insert(s.name()).second) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".name: a module stage needs a name unique among the stages; got \"", s.name(),
              "\""));
        }
        if (s.module().module_case() == te::v1::LayerSpec::kSequential) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".module: a Sequential inside a Sequential"));
        }
        break;
      case SequentialSpec::Stage::kReshape: {
        const Shape from(s.reshape().from().begin(), s.reshape().from().end());
        const Shape to(s.reshape().to().begin(), s.reshape().to().end());
        const auto positive = [](const Shape& shape) {
          return std::all_of(shape.begin(), shape.end(), [](int64_t d) { return d > 0; });
        };
        // Overflow-checked: two products that wrap alike would pass as equal.
        const std::optional<int64_t> from_n = CheckedNumElements(from);
        const std::optional<int64_t> to_n = CheckedNumElements(to);
        if (from.empty() || to.empty() || !positive(from) || !positive(to) || !from_n || !to_n ||
            *from_n != *to_n) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".reshape: from ", ShapeString(from), " and to ", ShapeString(to),
              " must be non-empty, positive and of one element count (under 2^63)"));
        }
        break;
      }
      case SequentialSpec::Stage::kSplitLastAxis:
        // The parts feed the next stage, which takes one tensor or a module's
        // x and extra inputs (q, k, v): more parts can never fit, and each
        // would be a graph output to build.
        if (s.split_last_axis() < 2 || s.split_last_axis() > kMaxSplitParts) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".split_last_axis: ", s.split_last_axis(), " parts; want 2 to ", kMaxSplitParts,
              " (the next module's x and extra inputs)"));
        }
        break;
      case SequentialSpec::Stage::kResidual:
        if (s.residual() == SequentialSpec::FORK) {
          ++open_forks;
        } else if (s.residual() == SequentialSpec::JOIN) {
          if (open_forks == 0) {
            return absl::InvalidArgumentError(absl::StrCat(field, ".residual: JOIN without a FORK"));
          }
          --open_forks;
        } else {
          return absl::InvalidArgumentError(absl::StrCat(field, ".residual: FORK or JOIN"));
        }
        break;
      case SequentialSpec::Stage::KIND_NOT_SET:
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": no kind set (module, reshape, split_last_axis or residual)"));
    }
  }
  if (open_forks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.sequential.stages: ", open_forks, " FORK(s) without a JOIN"));
  }
  // The graph's structure checks (module specs, input counts, masks) hold
  // for every x shape, so they are made once here.
  RETURN_IF_ERROR(Build(spec, nullptr).status());
  return std::unique_ptr<Layer>(new SequentialLayer(spec));
}

}  // namespace te::layers
