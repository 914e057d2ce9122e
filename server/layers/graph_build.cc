// BuildGraph: a te.v1.GraphSpec -> a checked Graph (graph_internal.h): named
// edges resolved to tensor ids, each node's fields checked, and a
// topological order computed once, so a forward only walks it.
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"
#include "proto/dtype.h"
#include "server/layers/attention_core.h"
#include "server/layers/flax_modules.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

using te::v1::GraphSpec;

constexpr char kAttentionMask[] = "attention_mask";
// extra_inputs[i] beyond this is surely a mistake, not a module's input.
constexpr int kMaxExtraInputs = 64;

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

// i for "extra_inputs[i]" (decimal, no sign), else -1.
int ExtraIndex(const std::string& name) {
  constexpr absl::string_view kPrefix = "extra_inputs[";
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, "]")) return -1;
  const std::string digits = name.substr(kPrefix.size(), name.size() - kPrefix.size() - 1);
  int i = -1;
  if (digits.empty() || digits.size() > 9 || (digits.size() > 1 && digits[0] == '0') ||
      !absl::SimpleAtoi(digits, &i) || digits.find_first_not_of("0123456789") != std::string::npos) {
    return -1;
  }
  return i;
}

bool IsGraphInputName(const std::string& name) {
  return name == "x" || name == kAttentionMask || ExtraIndex(name) >= 0;
}

// What CreateLayer alone does not say about a module: whether it takes an
// attention mask (and of which type), and whether it returns ln_out.
struct ModuleTraits {
  std::optional<MaskType> mask_type;
  bool returns_ln_out = false;
  int num_inputs = 1;  // x, then its extra inputs
};

absl::StatusOr<ModuleTraits> TraitsOf(const te::v1::LayerSpec& spec, const std::string& field) {
  ModuleTraits t;
  switch (spec.module_case()) {
    case te::v1::LayerSpec::kDotProductAttention: {
      const te::v1::DotProductAttention& s = spec.dot_product_attention();
      ASSIGN_OR_RETURN(t.mask_type, ResolveMaskType(s.attn_mask_type(), field));
      t.num_inputs = s.qkv_layout() == te::v1::BS3HD ? 1 : 3;
      break;
    }
    case te::v1::LayerSpec::kMultiHeadAttention: {
      const te::v1::MultiHeadAttention& s = spec.multi_head_attention();
      ASSIGN_OR_RETURN(t.mask_type, ResolveMaskType(s.attn_mask_type(), field));
      t.returns_ln_out = s.has_return_layernorm_output() && s.return_layernorm_output();
      break;
    }
    case te::v1::LayerSpec::kTransformerLayer: {
      ASSIGN_OR_RETURN(t.mask_type,
                       ResolveMaskType(spec.transformer_layer().self_attn_mask_type(), field));
      break;
    }
    case te::v1::LayerSpec::kFlaxMultiHeadDotProductAttention:
      // Flax's attention takes its mask as data: either kind (Module() makes
      // it causal for a causal_mask node's output); q, k, v.
      t.mask_type = MaskType::kPaddingCausal;
      t.num_inputs = 3;
      break;
    case te::v1::LayerSpec::kLayerNormDenseGeneral: {
      const te::v1::LayerNormDenseGeneral& s = spec.layer_norm_dense_general();
      t.returns_ln_out = !s.has_return_layernorm_output() || s.return_layernorm_output();
      break;
    }
    case te::v1::LayerSpec::kLayerNormMlp: {
      const te::v1::LayerNormMLP& s = spec.layer_norm_mlp();
      t.returns_ln_out = !s.has_return_layernorm_output() || s.return_layernorm_output();
      break;
    }
    case te::v1::LayerSpec::kLayerNorm:  // x in, y out, no mask
    case te::v1::LayerSpec::kDenseGeneral:
    case te::v1::LayerSpec::kActivation:
    case te::v1::LayerSpec::kGraph:  // refused by Module()
    case te::v1::LayerSpec::kFlaxDense:
    case te::v1::LayerSpec::kFlaxDenseGeneral:
    case te::v1::LayerSpec::kFlaxLayerNorm:
    case te::v1::LayerSpec::kFlaxEmbed:
    case te::v1::LayerSpec::MODULE_NOT_SET:  // refused by CreateLayer
      break;
  }
  return t;
}

absl::Status ExpectCount(const std::string& where, absl::string_view what, int got, int want) {
  if (got == want) return absl::OkStatus();
  return Invalid(where, absl::StrCat("takes ", want, " ", what, ", got ", got));
}

absl::StatusOr<DType> CastDType(te::v1::DType dtype, const std::string& where) {
  return FloatDTypeFromProto(dtype, where);
}

// The op fields of glue node `node` from its spec, with the arity of each op.
absl::Status ParseGlue(const GraphSpec::Node& s, Node* node) {
  const std::string& f = node->field;
  const int n_in = s.inputs_size(), n_out = s.outputs_size();
  switch (s.op_case()) {
    case GraphSpec::Node::kReshape: {
      node->kind = NodeKind::kReshape;
      node->shape.assign(s.reshape().shape().begin(), s.reshape().shape().end());
      int wildcards = 0;
      Shape known;
      for (int64_t d : node->shape) {
        if (d == -1) {
          ++wildcards;
        } else if (d > 0) {
          known.push_back(d);
        } else {
          wildcards = 2;  // reported below
        }
      }
      if (wildcards > 1 || !CheckedNumElements(known)) {
        return Invalid(f + ".reshape.shape",
                       absl::StrCat(ShapeString(node->shape),
                                    ": want positive dims and at most one -1, of a product "
                                    "under 2^63"));
      }
      break;
    }
    case GraphSpec::Node::kSplit:
      node->kind = NodeKind::kSplit;
      node->axis = s.split().axis();
      node->parts = s.split().parts();
      if (node->parts < 2) {
        return Invalid(f + ".split.parts", absl::StrCat(node->parts, "; want 2 or more"));
      }
      RETURN_IF_ERROR(ExpectCount(f, "input", n_in, 1));
      return ExpectCount(f, "outputs (split.parts)", n_out, node->parts);
    case GraphSpec::Node::kConcatenate:
      node->kind = NodeKind::kConcatenate;
      node->axis = s.concatenate().axis();
      if (n_in < 1) return Invalid(f, "concatenate takes one input or more, got none");
      return ExpectCount(f, "output", n_out, 1);
    case GraphSpec::Node::kAdd:
      node->kind = NodeKind::kAdd;
      if (n_in < 2) return Invalid(f, absl::StrCat("add takes two inputs or more, got ", n_in));
      return ExpectCount(f, "output", n_out, 1);
    case GraphSpec::Node::kScale: {
      node->kind = NodeKind::kScale;
      const double factor = s.scale().factor();
      if (!std::isfinite(factor) || std::abs(factor) > std::numeric_limits<float>::max()) {
        return Invalid(f + ".scale.factor", absl::StrCat(factor, "; want a finite float32"));
      }
      node->factor = static_cast<float>(factor);
      break;
    }
    case GraphSpec::Node::kCast: {
      node->kind = NodeKind::kCast;
      ASSIGN_OR_RETURN(node->dtype, CastDType(s.cast().dtype(), f + ".cast.dtype"));
      break;
    }
    case GraphSpec::Node::kTranspose:
      node->kind = NodeKind::kTranspose;
      node->axes.assign(s.transpose().axes().begin(), s.transpose().axes().end());
      break;
    case GraphSpec::Node::kDropout: {
      node->kind = NodeKind::kDropout;
      node->rate = s.dropout().rate();
      if (!std::isfinite(node->rate) || node->rate < 0.0f || node->rate >= 1.0f) {
        return Invalid(f + ".dropout.rate", absl::StrCat(node->rate, "; want [0, 1)"));
      }
      node->broadcast_dims.assign(s.dropout().broadcast_dims().begin(),
                                  s.dropout().broadcast_dims().end());
      break;
    }
    case GraphSpec::Node::kCausalMask:
      node->kind = NodeKind::kCausalMask;
      break;
    case GraphSpec::Node::kSoftmaxCrossEntropy:
      node->kind = NodeKind::kSoftmaxCrossEntropy;
      RETURN_IF_ERROR(ExpectCount(f, "inputs (logits, labels)", n_in, 2));
      return ExpectCount(f, "output", n_out, 1);
    case GraphSpec::Node::kAttend: {
      node->kind = NodeKind::kAttend;
      if (s.attend().dtype() != te::v1::DTYPE_UNSPECIFIED) {
        ASSIGN_OR_RETURN(node->attend_dtype, CastDType(s.attend().dtype(), f + ".attend.dtype"));
      }
      break;  // attend.embed is resolved once every node is known
    }
    case GraphSpec::Node::kBinary:
    case GraphSpec::Node::kUnary:
    case GraphSpec::Node::kWhere:
    case GraphSpec::Node::kReduce:
    case GraphSpec::Node::kEinsum:
    case GraphSpec::Node::kSlice:
    case GraphSpec::Node::kSoftmax:
    case GraphSpec::Node::kParam:
      return ParseNumpyNode(s, node);  // graph_numpy_parse.cc
    case GraphSpec::Node::kModule:  // InputsAndOp takes these two
    case GraphSpec::Node::OP_NOT_SET:
      return absl::InternalError(absl::StrCat(f, ": not a glue op ", s.op_case()));
  }
  RETURN_IF_ERROR(ExpectCount(f, "input", n_in, 1));
  return ExpectCount(f, "output", n_out, 1);
}

class Builder {
 public:
  explicit Builder(const GraphSpec& spec) : spec_(spec) {}

  absl::StatusOr<Graph> Build() {
    if (spec_.nodes().empty()) return Invalid("spec.graph.nodes", "empty");
    Id("x");
    RETURN_IF_ERROR(NamesAndOutputs());
    for (int i = 0; i < spec_.nodes_size(); ++i) RETURN_IF_ERROR(InputsAndOp(i));
    RETURN_IF_ERROR(ResolveAttends());
    RETURN_IF_ERROR(Outputs());
    RETURN_IF_ERROR(ScopesAreDisjoint());
    RETURN_IF_ERROR(LayerNormOutputsUnread());
    RETURN_IF_ERROR(Order());
    LastReaders();
    return std::move(g_);
  }

 private:
  // The id of `name`, made on first sight.
  int Id(const std::string& name) {
    auto [it, inserted] = ids_.emplace(name, static_cast<int>(g_.tensors.size()));
    if (inserted) {
      TensorDef t;
      t.name = name;
      g_.tensors.push_back(std::move(t));
    }
    return it->second;
  }

  // Pass 1: node names, and what each node writes (nodes may be listed in
  // any order, so every writer is known before reads are resolved).
  absl::Status NamesAndOutputs() {
    std::map<std::string, int> names;
    g_.nodes.resize(spec_.nodes_size());
    for (int i = 0; i < spec_.nodes_size(); ++i) {
      const GraphSpec::Node& s = spec_.nodes(i);
      Node& node = g_.nodes[i];
      node.name = s.name();
      node.field = absl::StrCat("spec.graph.nodes[", i, "] (", s.name(), ")");
      if (s.name().empty() && s.op_case() != GraphSpec::Node::kModule) {
        return Invalid(node.field + ".name", "empty; every node needs a name");
      }
      auto [it, inserted] = names.emplace(s.name(), i);
      if (!inserted) {
        return Invalid(node.field + ".name",
                       absl::StrCat("\"", s.name(), "\" is also the name of spec.graph.nodes[",
                                    it->second, "]"));
      }
      for (int j = 0; j < s.outputs_size(); ++j) {
        const std::string& out = s.outputs(j);
        const std::string where = absl::StrCat(node.field, ".outputs[", j, "]");
        if (out.empty()) return Invalid(where, "empty tensor name");
        if (IsGraphInputName(out)) {
          return Invalid(where, absl::StrCat("\"", out, "\" is a graph input; it cannot be written"));
        }
        const int id = Id(out);
        TensorDef& t = g_.tensors[id];
        if (t.producer >= 0) {
          return Invalid(where, absl::StrCat("\"", out, "\" is written twice: also by ",
                                             g_.nodes[t.producer].field));
        }
        t.producer = i;
        t.is_mask = s.op_case() == GraphSpec::Node::kCausalMask;
        node.outputs.push_back(id);
      }
    }
    return absl::OkStatus();
  }

  // A tensor a node reads: written by a node, or one of the graph's inputs.
  absl::StatusOr<int> Read(const std::string& name, const std::string& where) {
    // Every name known so far is x, a node's output or an input seen before.
    auto it = ids_.find(name);
    if (it != ids_.end()) return it->second;
    const int extra = ExtraIndex(name);
    if (extra >= 0) {
      if (extra >= kMaxExtraInputs) {
        return Invalid(where, absl::StrCat("\"", name, "\": at most ", kMaxExtraInputs,
                                           " extra inputs"));
      }
      const int id = Id(name);
      g_.tensors[id].extra_index = extra;
      if (extra >= g_.num_extra) {
        g_.num_extra = extra + 1;
        g_.extras.resize(g_.num_extra, -1);
      }
      g_.extras[extra] = id;
      return id;
    }
    if (name == kAttentionMask) {
      const int id = Id(name);
      g_.tensors[id].is_mask = true;
      g_.attention_mask = id;
      return id;
    }
    return Invalid(where, absl::StrCat("\"", name,
                                       "\" is read but never written (no node writes it, and it "
                                       "is not x, extra_inputs[i] or attention_mask)"));
  }

  // Pass 2: node i's inputs, mask and op fields.
  absl::Status InputsAndOp(int i) {
    const GraphSpec::Node& s = spec_.nodes(i);
    Node& node = g_.nodes[i];
    for (int j = 0; j < s.inputs_size(); ++j) {
      const std::string where = absl::StrCat(node.field, ".inputs[", j, "]");
      ASSIGN_OR_RETURN(const int id, Read(s.inputs(j), where));
      if (g_.tensors[id].is_mask) {
        return Invalid(where, absl::StrCat("\"", s.inputs(j),
                                           "\" is an attention mask: it is read only as a "
                                           "module's mask, not as an input"));
      }
      node.inputs.push_back(id);
    }
    if (s.op_case() == GraphSpec::Node::OP_NOT_SET) {
      return Invalid(node.field, "no op set (module, reshape, split, concatenate, add, scale, "
                                 "cast, transpose, dropout, causal_mask, softmax_cross_entropy, "
                                 "attend, binary, unary, where, reduce, einsum, slice, softmax "
                                 "or param)");
    }
    if (s.op_case() != GraphSpec::Node::kModule) {
      if (!s.mask().empty()) {
        return Invalid(node.field + ".mask", "only a module node reads a mask");
      }
      return ParseGlue(s, &node);
    }
    return Module(s, &node);
  }

  absl::Status Module(const GraphSpec::Node& s, Node* node) {
    const std::string& f = node->field;
    const te::v1::LayerSpec::ModuleCase kind = s.module().module_case();
    if (kind == te::v1::LayerSpec::kGraph) {
      return Invalid(f + ".module", "a graph inside a graph: list its nodes here");
    }
    absl::StatusOr<std::unique_ptr<Layer>> layer = CreateLayer(s.module());
    if (!layer.ok()) {
      return absl::Status(layer.status().code(),
                          absl::StrCat(f, ".module: ", layer.status().message()));
    }
    node->module = *std::move(layer);
    if (kind == te::v1::LayerSpec::kFlaxEmbed) {
      node->is_embed = true;
      node->vocab = s.module().flax_embed().num_embeddings();
      node->features = s.module().flax_embed().features();
      // MakeFlaxEmbed checked it.
      node->param_dtype = s.module().flax_embed().param_dtype() == te::v1::DTYPE_UNSPECIFIED
                              ? DType::kF32
                              : *CastDType(s.module().flax_embed().param_dtype(), f);
    }
    ASSIGN_OR_RETURN(const ModuleTraits traits, TraitsOf(s.module(), f + ".module"));
    node->mask_type = traits.mask_type;
    node->returns_ln_out = traits.returns_ln_out;
    RETURN_IF_ERROR(ExpectCount(f, absl::StrCat("inputs (", node->module->type_name(), ")"),
                                s.inputs_size(), traits.num_inputs));
    const int max_out = traits.returns_ln_out ? 2 : 1;
    if (s.outputs_size() < 1 || s.outputs_size() > max_out) {
      return Invalid(f, absl::StrCat(node->module->type_name(), " gives ",
                                     traits.returns_ln_out ? "y and ln_out" : "y alone",
                                     "; got ", s.outputs_size(), " outputs"));
    }
    if (s.mask().empty()) return absl::OkStatus();
    const std::string where = f + ".mask";
    if (!traits.mask_type) {
      return Invalid(where, absl::StrCat(node->module->type_name(), " takes no attention mask"));
    }
    ASSIGN_OR_RETURN(node->mask, Read(s.mask(), where));
    const TensorDef& mask = g_.tensors[node->mask];
    if (!mask.is_mask) {
      return Invalid(where, absl::StrCat("\"", s.mask(),
                                         "\" is not a mask; want attention_mask or a causal_mask "
                                         "node's output"));
    }
    // A causal_mask node's output is flax.linen.make_causal_mask's: 1 where
    // key j <= query i. TE's causal types ignore a mask and apply causality
    // themselves, which equals reading this one (padding_causal reads it as
    // causality with every position valid: TE's fused path, which derives
    // lengths from the mask, and its unfused one disagree on such a mask);
    // no_mask ignores it; padding applies it elementwise as TE's unfused
    // softmax does, ones masked out.
    if (mask.producer >= 0 && *traits.mask_type == MaskType::kPadding &&
        kind != te::v1::LayerSpec::kFlaxMultiHeadDotProductAttention) {
      node->causal_node_elementwise = true;
    }
    if (mask.producer >= 0 && kind == te::v1::LayerSpec::kFlaxMultiHeadDotProductAttention) {
      ASSIGN_OR_RETURN(node->module, MakeFlaxMultiHeadDotProductAttention(
                                         s.module().flax_multi_head_dot_product_attention(),
                                         /*causal=*/true));
    }
    return absl::OkStatus();
  }

  // An attend node's `embed` names a flax_embed module node, whose table it shares.
  absl::Status ResolveAttends() {
    std::map<std::string, int> by_name;
    for (size_t i = 0; i < g_.nodes.size(); ++i) by_name.emplace(g_.nodes[i].name, i);
    for (int i = 0; i < spec_.nodes_size(); ++i) {
      Node& node = g_.nodes[i];
      if (node.kind != NodeKind::kAttend) continue;
      const std::string& embed = spec_.nodes(i).attend().embed();
      auto it = by_name.find(embed);
      if (it == by_name.end() || !g_.nodes[it->second].is_embed) {
        return Invalid(node.field + ".attend.embed",
                       absl::StrCat("\"", embed, "\" is not ",
                                    it == by_name.end() ? "a node" : "a flax_embed module node",
                                    "; attend reads an Embed's embedding"));
      }
      const Node& table = g_.nodes[it->second];
      node.embed = it->second;
      node.vocab = table.vocab;
      node.features = table.features;
      node.param_dtype = table.param_dtype;
    }
    return absl::OkStatus();
  }

  absl::Status Outputs() {
    if (spec_.outputs().empty()) return Invalid("spec.graph.outputs", "empty; name y");
    for (int j = 0; j < spec_.outputs_size(); ++j) {
      const std::string where = absl::StrCat("spec.graph.outputs[", j, "]");
      ASSIGN_OR_RETURN(const int id, Read(spec_.outputs(j), where));
      if (g_.tensors[id].is_mask) {
        return Invalid(where, absl::StrCat("\"", spec_.outputs(j), "\" is a mask, not a result"));
      }
      g_.outputs.push_back(id);
    }
    return absl::OkStatus();
  }

  // A module's variables are "<collection>/<node>/..."; a node named like
  // another's scope ("a" and "a/b") would see the other's variables as its own.
  // A param node's variable "params/<node>" is a leaf of the same tree. A
  // param node inside a module's scope (or beside a module named "") is
  // that module's own parameter, read again (a loss's penalty on a kernel):
  // VariableSpecs checks that the module has it.
  absl::Status ScopesAreDisjoint() const {
    std::map<std::string, int> modules;
    int module_count = 0;
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      const NodeKind kind = g_.nodes[i].kind;
      if (kind == NodeKind::kModule || kind == NodeKind::kParam) modules.emplace(g_.nodes[i].name, i);
      module_count += kind == NodeKind::kModule ? 1 : 0;
    }
    // "": the root scope, where a layer that is one module keeps its
    // variables (a graph added over it names that module so).
    if (modules.count("") > 0 && module_count > 1) {
      return Invalid(g_.nodes[modules.at("")].field + ".name",
                     "empty: a module named \"\" has the root scope, so it must be the graph's "
                     "only module");
    }
    for (const auto& [name, i] : modules) {
      for (size_t slash = name.find('/'); slash != std::string::npos;
           slash = name.find('/', slash + 1)) {
        auto it = modules.find(name.substr(0, slash));
        if (it != modules.end() && !(g_.nodes[i].kind == NodeKind::kParam &&
                                     g_.nodes[it->second].kind == NodeKind::kModule)) {
          return Invalid(g_.nodes[i].field + ".name",
                         absl::StrCat("lies inside the scope of module ", g_.nodes[it->second].field,
                                      "; their variables would mix"));
        }
      }
    }
    return absl::OkStatus();
  }

  // The Layer interface takes dy alone: a gradient reaching a module's
  // ln_out could not flow back, so ln_out may only be a graph output (which
  // gets no gradient).
  absl::Status LayerNormOutputsUnread() const {
    for (const Node& node : g_.nodes) {
      for (int id : node.inputs) {
        const TensorDef& t = g_.tensors[id];
        if (t.producer < 0) continue;
        const Node& writer = g_.nodes[t.producer];
        if (writer.kind == NodeKind::kModule && writer.outputs.size() == 2 &&
            writer.outputs[1] == id) {
          return Invalid(node.field,
                         absl::StrCat("reads \"", t.name, "\", the ln_out of ", writer.field,
                                      "; its gradient cannot reach that module's backward (only "
                                      "y's can), so ln_out may only be a graph output"));
        }
      }
    }
    return absl::OkStatus();
  }

  std::vector<int> Dependencies(int i) const {
    std::vector<int> deps;
    const Node& node = g_.nodes[i];
    for (int id : node.inputs) deps.push_back(g_.tensors[id].producer);
    if (node.mask >= 0) deps.push_back(g_.tensors[node.mask].producer);
    return deps;
  }

  // Kahn's algorithm, the lowest-numbered ready node first, so a spec listed
  // in dependency order runs in its own order.
  absl::Status Order() {
    const int n = static_cast<int>(g_.nodes.size());
    std::vector<int> waiting(n, 0);
    std::vector<std::vector<int>> consumers(n);
    for (int i = 0; i < n; ++i) {
      for (int p : Dependencies(i)) {
        if (p < 0) continue;
        ++waiting[i];
        consumers[p].push_back(i);
      }
    }
    std::set<int> ready;
    for (int i = 0; i < n; ++i) {
      if (waiting[i] == 0) ready.insert(i);
    }
    while (!ready.empty()) {
      const int i = *ready.begin();
      ready.erase(ready.begin());
      g_.order.push_back(i);
      for (int c : consumers[i]) {
        if (--waiting[c] == 0) ready.insert(c);
      }
    }
    if (static_cast<int>(g_.order.size()) == n) return absl::OkStatus();
    // Walk back from a node left waiting through producers still waiting
    // until one repeats: that one lies on a cycle.
    int at = 0;
    while (waiting[at] == 0) ++at;
    std::vector<int> path;
    std::vector<int> seen(n, -1);
    while (seen[at] < 0) {
      seen[at] = static_cast<int>(path.size());
      path.push_back(at);
      for (int p : Dependencies(at)) {
        if (p >= 0 && waiting[p] > 0) {
          at = p;
          break;
        }
      }
    }
    // path[k + 1] feeds path[k], and `at` (= path[seen[at]]) feeds path.back().
    std::vector<std::string> cycle = {g_.nodes[at].name};
    for (size_t k = path.size(); k-- > static_cast<size_t>(seen[at]);) {
      cycle.push_back(g_.nodes[path[k]].name);
    }
    return Invalid(g_.nodes[at].field,
                   absl::StrCat("in a cycle: ", absl::StrJoin(cycle, " -> "),
                                " (each feeds the next)"));
  }

  void LastReaders() {
    std::vector<int> position(g_.nodes.size());
    for (size_t k = 0; k < g_.order.size(); ++k) position[g_.order[k]] = static_cast<int>(k);
    std::vector<int> last(g_.tensors.size(), -1);
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      for (int id : g_.nodes[i].inputs) {
        if (last[id] < 0 || position[i] > position[last[id]]) last[id] = static_cast<int>(i);
      }
    }
    for (int id : g_.outputs) last[id] = -1;
    g_.last_read_by.assign(g_.nodes.size(), {});
    for (size_t id = 0; id < last.size(); ++id) {
      if (last[id] >= 0) g_.last_read_by[last[id]].push_back(static_cast<int>(id));
    }
  }

  const GraphSpec& spec_;
  Graph g_;
  std::map<std::string, int> ids_;
};

}  // namespace

absl::StatusOr<Graph> BuildGraph(const te::v1::GraphSpec& spec) { return Builder(spec).Build(); }

}  // namespace te::layers::graph
