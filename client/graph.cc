#include "client/graph.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/module_outputs.h"

namespace te::client {
namespace {

const Shape kNoShape;

bool IsFloat(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16; }

int64_t Elements(const Shape& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<int64_t>());
}

// axis in [0, rank), negative counting from the end; -1 when out of range.
int NormalizedAxis(int axis, size_t rank) {
  const int r = static_cast<int>(rank);
  return axis >= -r && axis < r ? (axis + r) % r : -1;
}

std::string Joined(const std::string& scope, const std::string& name) {
  return scope.empty() ? name : absl::StrCat(scope, "/", name);
}

}  // namespace

Graph::Graph(std::string type_name, Shape x_shape, DType x_dtype) : type_name_(std::move(type_name)) {
  edges_.push_back(EdgeInfo{std::move(x_shape), x_dtype, -1, "x", false});
}

Graph::Edge Graph::AttentionMask(Shape shape) {
  edges_.push_back(EdgeInfo{std::move(shape), DType::kBool, -1, "attention_mask", true});
  return Edge{static_cast<int>(edges_.size()) - 1};
}

Graph::Edge Graph::ExtraInput(int i, Shape shape, DType dtype) {
  edges_.push_back(EdgeInfo{std::move(shape), dtype, -1, absl::StrCat("extra_inputs[", i, "]"), false});
  return Edge{static_cast<int>(edges_.size()) - 1};
}

const Shape& Graph::shape(Edge e) const {
  return e.id >= 0 && e.id < static_cast<int>(edges_.size()) ? edges_[e.id].shape : kNoShape;
}

DType Graph::dtype(Edge e) const {
  return e.id >= 0 && e.id < static_cast<int>(edges_.size()) ? edges_[e.id].dtype : DType::kF32;
}

// ---- scopes and names ------------------------------------------------------------

std::string Graph::ScopePath() const { return absl::StrJoin(scope_, "/"); }

std::string Graph::AutoName(const std::string& type_name) {
  int& n = auto_names_[ScopePath()][type_name];
  return absl::StrCat(type_name, "_", n++);
}

Graph::Scope Graph::Submodule(const std::string& type_name, const std::string& name) {
  scope_.push_back(name.empty() ? AutoName(type_name) : name);
  return Scope(this);
}

Graph::Scope::~Scope() { graph_->scope_.pop_back(); }

std::string Graph::GlueNameNow(const std::string& label) const {
  const std::string scope = ScopePath();
  int n = 0;
  for (const NodeInfo& node : nodes_) {
    if (node.name.empty() && node.scope == scope && node.label == label) ++n;
  }
  return Joined(scope, absl::StrCat(label, "_", n));
}

// ---- recording -------------------------------------------------------------------

// A module's name must be new and must not be a graph input's, which its
// output edge would take.
bool Graph::Claimable(const std::string& name, const std::string& where) {
  if (module_names_.count(name)) {
    Fail(where, "the name is already used by another module in this scope");
    return false;
  }
  if (name == "x" || name == "attention_mask" || absl::StartsWith(name, "extra_inputs[")) {
    Fail(where, "a module's output would be named like the graph input");
    return false;
  }
  return true;
}

Graph::Edge Graph::Fail(const std::string& where, const std::string& message) {
  if (error_.ok()) error_ = absl::InvalidArgumentError(absl::StrCat(where, ": ", message));
  return Edge{};
}

bool Graph::Readable(const std::vector<Edge>& edges, const std::string& where) {
  if (!error_.ok()) return false;
  for (Edge e : edges) {
    if (e.id < 0 || e.id >= static_cast<int>(edges_.size())) {
      Fail(where, "reads an edge not of this graph");
      return false;
    }
    if (edges_[e.id].is_mask) {
      Fail(where, "reads an attention mask as data; a mask is read only as a module's mask");
      return false;
    }
  }
  return true;
}

Graph::NodeInfo Graph::Glue(const std::string& label, const std::vector<Edge>& inputs) const {
  NodeInfo node;
  node.scope = ScopePath();
  node.label = label;
  for (Edge e : inputs) node.inputs.push_back(e.id);
  return node;
}

std::vector<Graph::Edge> Graph::Record(NodeInfo node, const std::vector<Shape>& shapes, DType dtype,
                                       bool makes_mask) {
  const int index = static_cast<int>(nodes_.size());
  std::vector<Edge> out;
  for (const Shape& s : shapes) {
    node.outputs.push_back(static_cast<int>(edges_.size()));
    out.push_back(Edge{node.outputs.back()});
    edges_.push_back(EdgeInfo{s, dtype, index, "", makes_mask});
  }
  if (!node.name.empty() || node.root) module_names_[node.name] = index;
  nodes_.push_back(std::move(node));
  return out;
}

Graph::Edge Graph::RecordOne(NodeInfo node, Shape shape, DType dtype) {
  return Record(std::move(node), {std::move(shape)}, dtype).front();
}

std::vector<Graph::Edge> Graph::CallAll(const Module& module, const std::vector<Edge>& inputs, Edge mask,
                                        const std::string& name) {
  return CallModule(module, inputs, mask,
                    Joined(ScopePath(), name.empty() ? AutoName(module.type_name()) : name), false);
}

Graph::Edge Graph::CallLayer(const Module& module, const std::vector<Edge>& inputs, Edge mask) {
  if (!scope_.empty()) return Fail(absl::StrCat("CallLayer (", module.type_name(), ")"), "inside a Submodule scope; the layer is the root");
  std::vector<Edge> outputs = CallModule(module, inputs, mask, "", true);
  return outputs.empty() ? Edge{} : outputs.front();
}

std::vector<Graph::Edge> Graph::CallModule(const Module& module, const std::vector<Edge>& inputs, Edge mask,
                                           const std::string& node_name, bool root) {
  const std::string where = absl::StrCat(root ? "the layer" : node_name, " (", module.type_name(), ")");
  if (root && module_names_.count("")) {
    Fail(where, "CallLayer called twice: a graph reads its layer's one module once");
    return {};
  }
  if (!Readable(inputs, where)) return {};
  if (inputs.empty()) {
    Fail(where, "no input x");
    return {};
  }
  if (!Claimable(node_name, where)) return {};
  if (mask.id != -1 && (mask.id < 0 || mask.id >= static_cast<int>(edges_.size()) || !edges_[mask.id].is_mask)) {
    Fail(where, "its mask is not a mask (the graph's AttentionMask() or a CausalMask() output)");
    return {};
  }
  absl::StatusOr<te::v1::LayerSpec> spec = module.Spec();
  if (!spec.ok()) {
    Fail(where, std::string(spec.status().message()));
    return {};
  }
  std::vector<Shape> shapes;
  for (Edge e : inputs) shapes.push_back(edges_[e.id].shape);
  absl::StatusOr<ModuleOutputs> outputs = InferModuleOutputs(*spec, shapes, edges_[inputs[0].id].dtype);
  if (!outputs.ok()) {
    Fail(where, std::string(outputs.status().message()));
    return {};
  }

  NodeInfo node = Glue("", inputs);
  node.name = node_name;
  node.root = root;
  node.mask = mask.id;
  node.keep = true;
  *node.op.mutable_module() = *std::move(spec);
  if (!module.DropoutUsers().empty()) dropout_users_.push_back(node_name);
  return Record(std::move(node), outputs->shapes, outputs->dtype);
}

Graph::Edge Graph::Call(const Module& module, const std::vector<Edge>& inputs, Edge mask, const std::string& name) {
  std::vector<Edge> outputs = CallAll(module, inputs, mask, name);
  return outputs.empty() ? Edge{} : outputs.front();
}

Graph::Edge Graph::Reshape(Edge t, Shape shape) {
  const std::string where = GlueNameNow("reshape");
  if (!Readable({t}, where)) return Edge{};
  const Shape& from = edges_[t.id].shape;
  int unknown = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1 && unknown == -1) {
      unknown = static_cast<int>(i);
    } else if (shape[i] < 0) {
      return Fail(where, absl::StrCat("shape ", ShapeString(shape), " may hold one -1 and otherwise sizes >= 0"));
    } else {
      known *= shape[i];
    }
  }
  if (unknown >= 0 && known > 0 && Elements(from) % known == 0) shape[unknown] = Elements(from) / known;
  if (Elements(shape) != Elements(from) || (unknown >= 0 && known == 0)) {
    return Fail(where, absl::StrCat("cannot reshape ", ShapeString(from), " into ", ShapeString(shape)));
  }
  if (shape == from) return t;
  NodeInfo node = Glue("reshape", {t});
  for (int64_t d : shape) node.op.mutable_reshape()->add_shape(d);
  return RecordOne(std::move(node), shape, edges_[t.id].dtype);
}

std::vector<Graph::Edge> Graph::Split(Edge t, int parts, int axis) {
  const std::string where = GlueNameNow("split");
  if (!Readable({t}, where)) return {};
  Shape shape = edges_[t.id].shape;
  const int a = NormalizedAxis(axis, shape.size());
  if (a < 0) {
    Fail(where, absl::StrCat("axis ", axis, " is out of range for ", ShapeString(shape)));
    return {};
  }
  if (parts < 1 || shape[a] % parts != 0) {
    Fail(where, absl::StrCat(parts, " parts do not divide axis ", a, " of ", ShapeString(shape)));
    return {};
  }
  if (parts == 1) return {t};
  shape[a] /= parts;
  NodeInfo node = Glue("split", {t});
  node.op.mutable_split()->set_axis(a);
  node.op.mutable_split()->set_parts(parts);
  return Record(std::move(node), std::vector<Shape>(parts, shape), edges_[t.id].dtype);
}

std::vector<Graph::Edge> Graph::Promoted(const std::vector<Edge>& ts, const std::string& op) {
  const std::string where = GlueNameNow(op);
  DType wide = edges_[ts[0].id].dtype;
  for (Edge e : ts) {
    if (!IsFloat(edges_[e.id].dtype)) {
      Fail(where, absl::StrCat("reads a ", DTypeName(edges_[e.id].dtype), " tensor; ", op, " takes float tensors"));
      return {};
    }
    wide = PromoteFloat(wide, edges_[e.id].dtype);
  }
  std::vector<Edge> out;
  for (Edge e : ts) out.push_back(Cast(e, wide));
  return out;
}

Graph::Edge Graph::Concatenate(const std::vector<Edge>& ts, int axis) {
  const std::string where = GlueNameNow("concatenate");
  if (!Readable(ts, where)) return Edge{};
  if (ts.empty()) return Fail(where, "no tensors");
  if (ts.size() == 1) return ts[0];
  Shape shape = edges_[ts[0].id].shape;
  const int a = NormalizedAxis(axis, shape.size());
  if (a < 0) return Fail(where, absl::StrCat("axis ", axis, " is out of range for ", ShapeString(shape)));
  int64_t total = 0;
  for (Edge e : ts) {
    Shape other = edges_[e.id].shape;
    if (other.size() == shape.size()) total += other[a], other[a] = shape[a];
    if (other != shape) {
      return Fail(where, absl::StrCat("shapes ", ShapeString(shape), " and ", ShapeString(edges_[e.id].shape),
                                      " differ off axis ", a));
    }
  }
  shape[a] = total;
  const std::vector<Edge> inputs = Promoted(ts, "concatenate");
  if (inputs.empty()) return Edge{};
  NodeInfo node = Glue("concatenate", inputs);
  node.op.mutable_concatenate()->set_axis(a);
  return RecordOne(std::move(node), shape, edges_[inputs[0].id].dtype);
}

Graph::Edge Graph::Add(Edge a, Edge b) {
  const std::string where = GlueNameNow("add");
  if (!Readable({a, b}, where)) return Edge{};
  if (edges_[a.id].shape != edges_[b.id].shape) {
    return Fail(where, absl::StrCat("shapes ", ShapeString(edges_[a.id].shape), " and ",
                                    ShapeString(edges_[b.id].shape), " differ; add takes equal shapes"));
  }
  const std::vector<Edge> inputs = Promoted({a, b}, "add");
  if (inputs.empty()) return Edge{};
  NodeInfo node = Glue("add", inputs);
  node.op.mutable_add();
  return RecordOne(std::move(node), edges_[a.id].shape, edges_[inputs[0].id].dtype);
}

Graph::Edge Graph::Scale(Edge t, double factor) {
  const std::string where = GlueNameNow("scale");
  if (!Readable({t}, where)) return Edge{};
  if (!IsFloat(edges_[t.id].dtype)) {
    return Fail(where, absl::StrCat("scale takes float tensors, not ", DTypeName(edges_[t.id].dtype)));
  }
  NodeInfo node = Glue("scale", {t});
  node.op.mutable_scale()->set_factor(factor);
  return RecordOne(std::move(node), edges_[t.id].shape, edges_[t.id].dtype);
}

Graph::Edge Graph::Cast(Edge t, DType dtype) {
  const std::string where = GlueNameNow("cast");
  if (!Readable({t}, where)) return Edge{};
  if (edges_[t.id].dtype == dtype) return t;
  if (!IsFloat(dtype)) {
    return Fail(where, absl::StrCat("cast gives float32, bfloat16 or float16, not ", DTypeName(dtype)));
  }
  NodeInfo node = Glue("cast", {t});
  node.op.mutable_cast()->set_dtype(DTypeToProto(dtype));
  return RecordOne(std::move(node), edges_[t.id].shape, dtype);
}

Graph::Edge Graph::Transpose(Edge t, const std::vector<int>& axes) {
  const std::string where = GlueNameNow("transpose");
  if (!Readable({t}, where)) return Edge{};
  const Shape& from = edges_[t.id].shape;
  std::vector<int> norm;
  for (int a : axes) norm.push_back(NormalizedAxis(a, from.size()));
  std::vector<int> sorted = norm;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int> identity(from.size());
  std::iota(identity.begin(), identity.end(), 0);
  if (sorted != identity) {
    return Fail(where, absl::StrCat("axes [", absl::StrJoin(axes, ", "), "] are not a permutation of ",
                                    from.size(), " axes"));
  }
  if (norm == identity) return t;
  Shape shape;
  NodeInfo node = Glue("transpose", {t});
  for (int a : norm) {
    shape.push_back(from[a]);
    node.op.mutable_transpose()->add_axes(a);
  }
  return RecordOne(std::move(node), shape, edges_[t.id].dtype);
}

Graph::Edge Graph::Dropout(Edge t, float rate, const std::vector<int>& broadcast_dims, const std::string& name) {
  const std::string node_name = Joined(ScopePath(), name.empty() ? AutoName("Dropout") : name);
  const std::string where = absl::StrCat(node_name, " (Dropout)");
  if (!Readable({t}, where)) return Edge{};
  if (rate == 0.0f) return t;
  if (!(rate > 0.0f && rate < 1.0f)) return Fail(where, absl::StrCat("rate ", rate, "; want [0, 1)"));
  if (!Claimable(node_name, where)) return Edge{};
  std::set<int> dims;
  for (int d : broadcast_dims) {
    const int a = NormalizedAxis(d, edges_[t.id].shape.size());
    if (a < 0) return Fail(where, absl::StrCat("broadcast_dims: ", d, " is out of range"));
    dims.insert(a);
  }
  NodeInfo node = Glue("", {t});
  node.name = node_name;
  node.op.mutable_dropout()->set_rate(rate);
  for (int d : dims) node.op.mutable_dropout()->add_broadcast_dims(d);
  dropout_users_.push_back(node_name);
  return RecordOne(std::move(node), edges_[t.id].shape, edges_[t.id].dtype);
}

Graph::Edge Graph::CausalMask(Edge x) {
  const std::string where = GlueNameNow("causal_mask");
  if (!Readable({x}, where)) return Edge{};
  const Shape& s = edges_[x.id].shape;
  if (s.size() < 2) return Fail(where, absl::StrCat("x ", ShapeString(s), "; want [batch, seq, ...]"));
  NodeInfo node = Glue("causal_mask", {x});
  node.op.mutable_causal_mask();
  return Record(std::move(node), {Shape{s[0], 1, s[1], s[1]}}, DType::kBool, /*makes_mask=*/true).front();
}

Graph::Edge Graph::Activation(Edge t, const std::vector<std::string>& activations) {
  const std::string where = GlueNameNow("activation");
  if (!Readable({t}, where)) return Edge{};
  Shape shape = edges_[t.id].shape;
  if (activations.size() == 1 && shape.size() >= 2 && shape[shape.size() - 2] == 1) {
    // TE's [..., 1, I] is the server's [..., I].
    shape.erase(shape.end() - 2);
    t = Reshape(t, shape);
  }
  te::client::Activation module;
  module.activations = activations;
  absl::StatusOr<te::v1::LayerSpec> spec = module.Spec();
  absl::StatusOr<ModuleOutputs> out = InferModuleOutputs(*spec, {shape}, edges_[t.id].dtype);
  if (!out.ok()) return Fail(where, std::string(out.status().message()));
  NodeInfo node = Glue("activation", {t});
  *node.op.mutable_module() = *std::move(spec);
  return RecordOne(std::move(node), out->shapes.front(), out->dtype);
}

Graph::Edge Graph::Gelu(Edge t) {
  if (!Readable({t}, GlueNameNow("gelu"))) return Edge{};
  NodeInfo node = Glue("gelu", {t});
  node.op.mutable_module()->mutable_activation()->add_activations("gelu");
  return RecordOne(std::move(node), edges_[t.id].shape, edges_[t.id].dtype);
}

// ---- language-model nodes --------------------------------------------------------

Graph::Edge Graph::Embed(Edge ids, int64_t num_embeddings, int64_t features,
                         const EmbedOptions& options, const std::string& name) {
  const std::string node_name = Joined(ScopePath(), name.empty() ? AutoName("Embed") : name);
  const std::string where = absl::StrCat(node_name, " (Embed)");
  if (!Readable({ids}, where)) return Edge{};
  if (edges_[ids.id].dtype != DType::kI32) {
    return Fail(where, absl::StrCat("reads ", DTypeName(edges_[ids.id].dtype),
                                    " ids; nn.Embed takes int32 token ids"));
  }
  if (num_embeddings < 1 || features < 1) {
    return Fail(where, absl::StrCat("num_embeddings ", num_embeddings, " and features ", features,
                                    " must be positive"));
  }
  for (const std::optional<DType>& d : {options.dtype, std::optional<DType>(options.param_dtype)}) {
    if (d && !IsFloat(*d)) {
      return Fail(where, absl::StrCat("dtype ", DTypeName(*d), ": want float32, bfloat16 or float16"));
    }
  }
  if (!Claimable(node_name, where)) return Edge{};
  NodeInfo node = Glue("", {ids});
  node.name = node_name;
  node.keep = true;
  te::v1::FlaxEmbed* e = node.op.mutable_module()->mutable_flax_embed();
  e->set_num_embeddings(num_embeddings);
  e->set_features(features);
  if (options.dtype) e->set_dtype(DTypeToProto(*options.dtype));
  e->set_param_dtype(DTypeToProto(options.param_dtype));
  absl::StatusOr<ModuleOutputs> out =
      InferModuleOutputs(node.op.module(), {edges_[ids.id].shape}, edges_[ids.id].dtype);
  if (!out.ok()) return Fail(where, std::string(out.status().message()));
  embed_options_[static_cast<int>(nodes_.size())] = options;
  return RecordOne(std::move(node), out->shapes.front(), out->dtype);
}

Graph::Edge Graph::Attend(Edge embedded, Edge query) {
  const std::string where = GlueNameNow("attend");
  if (!Readable({embedded, query}, where)) return Edge{};
  const int embed_node = edges_[embedded.id].node;
  if (embed_node < 0 || !nodes_[embed_node].op.has_module() ||
      !nodes_[embed_node].op.module().has_flax_embed()) {
    return Fail(where, "`embedded` is not the output of an Embed node (attend ties to an Embed's table)");
  }
  const NodeInfo& embed = nodes_[embed_node];
  const te::v1::FlaxEmbed& e = embed.op.module().flax_embed();
  const Shape& q = edges_[query.id].shape;
  if (!IsFloat(edges_[query.id].dtype)) {
    return Fail(where, absl::StrCat("reads a ", DTypeName(edges_[query.id].dtype),
                                    " query; attend takes a float one"));
  }
  if (q.empty() || q.back() != e.features()) {
    return Fail(where, absl::StrCat("query ", ShapeString(q), " does not end in ", embed.name,
                                    "'s features (", e.features(), ")"));
  }
  const EmbedOptions& options = embed_options_.at(embed_node);
  NodeInfo node = Glue("attend", {query});
  node.op.mutable_attend()->set_embed(embed.name);
  if (options.dtype) node.op.mutable_attend()->set_dtype(e.dtype());
  Shape shape = q;
  shape.back() = e.num_embeddings();
  return RecordOne(std::move(node), std::move(shape),
                   options.dtype.value_or(PromoteFloat(edges_[query.id].dtype, options.param_dtype)));
}

Graph::Edge Graph::SoftmaxCrossEntropyWithIntegerLabels(Edge logits, Edge labels) {
  const std::string where = GlueNameNow("softmax_cross_entropy");
  if (!Readable({logits, labels}, where)) return Edge{};
  const Shape& l = edges_[logits.id].shape;
  const Shape& y = edges_[labels.id].shape;
  if (!IsFloat(edges_[logits.id].dtype)) {
    return Fail(where, absl::StrCat("logits are ", DTypeName(edges_[logits.id].dtype), "; want float"));
  }
  if (edges_[labels.id].dtype != DType::kI32) {
    return Fail(where, absl::StrCat("labels are ", DTypeName(edges_[labels.id].dtype),
                                    "; want int32 class indices"));
  }
  if (l.empty() || Shape(l.begin(), l.end() - 1) != y) {
    return Fail(where, absl::StrCat("labels ", ShapeString(y), " are not logits ", ShapeString(l),
                                    " less its last (class) axis"));
  }
  NodeInfo node = Glue("softmax_cross_entropy", {logits, labels});
  node.op.mutable_softmax_cross_entropy();
  return RecordOne(std::move(node), Shape{}, DType::kF32);
}

void Graph::SetOutput(Edge y) { SetOutputs({y}); }

void Graph::SetOutputs(const std::vector<Edge>& outputs) {
  if (outputs.empty()) {
    Fail("outputs", "empty; y first");
    return;
  }
  if (!Readable(outputs, "outputs")) return;
  outputs_.clear();
  for (Edge e : outputs) outputs_.push_back(e.id);
}

// ---- the spec ----------------------------------------------------------------------

absl::StatusOr<te::v1::LayerSpec> Graph::Spec() const {
  if (!error_.ok()) return error_;
  if (outputs_.empty()) return absl::InvalidArgumentError(absl::StrCat(type_name_, ": no output set (SetOutput)"));

  // What the output depends on, and every module node.
  std::vector<bool> live(nodes_.size(), false);
  std::vector<int> stack;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (nodes_[i].keep) stack.push_back(static_cast<int>(i));
  }
  for (int output : outputs_) {
    if (edges_[output].node >= 0) stack.push_back(edges_[output].node);
  }
  while (!stack.empty()) {
    const int n = stack.back();
    stack.pop_back();
    if (live[n]) continue;
    live[n] = true;
    std::vector<int> reads = nodes_[n].inputs;
    if (nodes_[n].mask >= 0) reads.push_back(nodes_[n].mask);
    for (int e : reads) {
      if (edges_[e].node >= 0) stack.push_back(edges_[e].node);
    }
  }

  // Glue names among the live nodes, passing over the modules' and inputs'.
  std::set<std::string> taken;
  for (const EdgeInfo& e : edges_) {
    if (e.node < 0) taken.insert(e.input_name);
  }
  for (const auto& [name, node] : module_names_) taken.insert(name);
  std::map<std::pair<std::string, std::string>, int> counters;
  std::vector<std::string> names(nodes_.size());
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const NodeInfo& node = nodes_[i];
    if (!live[i]) continue;
    if (!node.name.empty() || node.root) {
      names[i] = node.name;
      continue;
    }
    int& k = counters[{node.scope, node.label}];
    while (taken.count(Joined(node.scope, absl::StrCat(node.label, "_", k)))) ++k;
    names[i] = Joined(node.scope, absl::StrCat(node.label, "_", k++));
    taken.insert(names[i]);
  }

  std::vector<std::string> edge_names(edges_.size());
  for (size_t e = 0; e < edges_.size(); ++e) {
    const EdgeInfo& info = edges_[e];
    if (info.node < 0) {
      edge_names[e] = info.input_name;
      continue;
    }
    const NodeInfo& node = nodes_[info.node];
    // The layer's own module is the node named "": its edges need a name.
    const std::string stem = node.root ? std::string(kLayerEdge) : names[info.node];
    if (node.outputs.size() == 1) {
      edge_names[e] = stem;
    } else {
      const size_t i = std::find(node.outputs.begin(), node.outputs.end(), static_cast<int>(e)) - node.outputs.begin();
      edge_names[e] = absl::StrCat(stem, ":", i);
    }
  }

  te::v1::LayerSpec spec;
  te::v1::GraphSpec* graph = spec.mutable_graph();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!live[i]) continue;
    const NodeInfo& node = nodes_[i];
    te::v1::GraphSpec::Node* out = graph->add_nodes();
    out->set_name(names[i]);
    for (int e : node.inputs) out->add_inputs(edge_names[e]);
    for (int e : node.outputs) out->add_outputs(edge_names[e]);
    if (node.mask >= 0) out->set_mask(edge_names[node.mask]);
    out->MergeFrom(node.op);
  }
  for (int output : outputs_) graph->add_outputs(edge_names[output]);
  return spec;
}

namespace {

// i for "extra_inputs[i]", else -1.
int ExtraIndex(const std::string& name) {
  constexpr absl::string_view kPrefix = "extra_inputs[";
  int i = -1;
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, "]")) return -1;
  return absl::SimpleAtoi(name.substr(kPrefix.size(), name.size() - kPrefix.size() - 1), &i) ? i : -1;
}

}  // namespace

std::vector<te::v1::TensorHeader> Graph::ExtraInputs(const Shape& x) const {
  absl::StatusOr<te::v1::LayerSpec> spec = Spec();
  if (!spec.ok()) return {};  // Init sends the spec's error
  int count = 0;
  for (const te::v1::GraphSpec::Node& node : spec->graph().nodes()) {
    for (const std::string& input : node.inputs()) count = std::max(count, ExtraIndex(input) + 1);
  }
  for (const std::string& output : spec->graph().outputs()) {
    count = std::max(count, ExtraIndex(output) + 1);
  }
  std::vector<te::v1::TensorHeader> headers(count);
  std::vector<bool> made(count, false);
  const Shape& traced_x = edges_[0].shape;
  for (const EdgeInfo& e : edges_) {
    const int i = e.node < 0 ? ExtraIndex(e.input_name) : -1;
    if (i < 0 || i >= count) continue;
    headers[i].set_dtype(DTypeToProto(e.dtype));
    headers[i].clear_shape();
    // The server's rule (te.v1 InitLayerRequest.extra_inputs): leading dims
    // that are the traced x's follow x's.
    bool leading = true;
    for (size_t d = 0; d < e.shape.size(); ++d) {
      leading = leading && d < traced_x.size() && d < x.size() && e.shape[d] == traced_x[d];
      headers[i].add_shape(leading ? x[d] : e.shape[d]);
    }
    made[i] = true;
  }
  if (std::find(made.begin(), made.end(), false) != made.end()) return {};
  return headers;
}

}  // namespace te::client
