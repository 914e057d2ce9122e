// The graph layer's executor: init, forward and backward over a checked
// Graph (graph_internal.h) in its topological order.
//
// Forward keeps each tensor as a handle in a vector indexed by tensor id,
// dropped after its last reader ran; what backward needs is a GraphSaved:
// the plan (every tensor's shape and dtype for this input), each module
// node's own SavedForward and each dropout node's mask. Backward walks the
// order in reverse with one gradient slot per tensor: a gradient that reaches
// a tensor already holding one is summed into a new tensor (never in place:
// slots share memory with dy, views and module outputs), in the tensor's
// dtype.
#include "server/layers/graph.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/flax_embed.h"
#include "server/layers/graph_internal.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

using graph::Graph;
using graph::kX;
using graph::Node;
using graph::NodeKind;
using graph::Plan;
using graph::TensorInfo;

uint64_t SeedOf(uint64_t seed, const std::string& name) {
  return DeriveSeed(seed, name);
}

// "params/kernel" of node "qkv" -> "params/qkv/kernel" (Flax's scoping). A
// module node named "" is the root scope: a graph added over a layer that is
// one module names that module so, and it keeps the module's own names.
std::string Scoped(const std::string& node, const std::string& key) {
  if (node.empty()) return key;
  const size_t slash = key.find('/');
  if (slash == std::string::npos) return absl::StrCat(node, "/", key);
  return absl::StrCat(key.substr(0, slash), "/", node, "/", key.substr(slash + 1));
}

// The node's variables as its module names them ("params/kernel"): handles
// to the same device memory, so what the module writes in place (amax
// histories) lands in the layer's variables; WriteBack stores replacements.
// Every name is "<collection>/<node>/<rest>", so in the ordered map a node's
// names in one collection are one range: the view visits those ranges (one
// lookup per collection) rather than every variable of the graph, which a
// decode step would do once per node per token.
Variables ScopeView(const Variables& vars, const std::string& node) {
  if (node.empty()) return vars;  // the root module: the graph's only one
  Variables view;
  auto it = vars.begin();
  while (it != vars.end()) {
    const size_t slash = it->first.find('/');
    if (slash == std::string::npos) {
      ++it;
      continue;
    }
    const std::string collection = it->first.substr(0, slash + 1);  // "params/"
    const std::string prefix = absl::StrCat(collection, node, "/");
    for (auto in = vars.lower_bound(prefix);
         in != vars.end() && in->first.compare(0, prefix.size(), prefix) == 0; ++in) {
      view.emplace_hint(view.end(), collection + in->first.substr(prefix.size()), in->second);
    }
    // The first name past this collection ('0' follows '/').
    it = vars.lower_bound(absl::StrCat(collection.substr(0, slash), "0"));
  }
  return view;
}

void WriteBack(const Variables& view, const std::string& node, Variables* vars) {
  for (const auto& [key, tensor] : view) (*vars)[Scoped(node, key)] = tensor;
}

absl::Status AboutNode(const Node& node, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(node.field, ": ", status.message()));
}

absl::Status CheckFloatInput(const Tensor& t, const std::string& field) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, ": missing"));
  if (IsFloating(t.dtype()) && !IsFloat8(t.dtype())) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " must be float32, bfloat16 or float16, got ",
                                                 DTypeName(t.dtype())));
}

// A graph input: float, or int32 where the graph takes token ids (x, and
// undeclared extra inputs such as a loss's labels, which arrive in x's dtype).
absl::Status CheckGraphInput(const Tensor& t, bool ids, const std::string& field) {
  if (!ids) return CheckFloatInput(t, field);
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, ": missing"));
  if (t.dtype() == DType::kI32) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " must be int32 token ids (the graph's x feeds an Embed), got ", DTypeName(t.dtype())));
}

class GraphSaved : public SavedForward {
 public:
  Plan plan;
  std::vector<TensorInfo> extras;                      // the request's extra inputs
  std::vector<std::unique_ptr<SavedForward>> modules;  // by node; null for glue
  std::vector<DropoutSaved> dropouts;                  // by node
  std::vector<graph::LmSaved> lm;                      // by node: loss and attend
  std::vector<graph::NumpySaved> numpy;                // by node: jax.numpy's nodes
  int64_t bytes() const override {
    int64_t total = 0;
    for (const graph::NumpySaved& n : numpy) total += n.bytes();
    for (const auto& m : modules) total += m != nullptr ? m->bytes() : 0;
    for (const DropoutSaved& d : dropouts) total += d.bytes();
    for (const graph::LmSaved& l : lm) total += l.bytes();
    return total;
  }
};

class GraphLayer : public Layer {
 public:
  GraphLayer(Graph graph, std::optional<DeclaredExtras> extras)
      : g_(std::move(graph)), extras_(std::move(extras)) {
    for (const Node& node : g_.nodes) {
      for (int id : node.inputs) {
        takes_ids_ = takes_ids_ || (id == kX && node.kind == NodeKind::kModule &&
                                    node.module->TakesTokenIds());
      }
    }
    const int producer = g_.tensors[g_.outputs[0]].producer;
    returns_loss_ = producer >= 0 && g_.nodes[producer].kind == NodeKind::kSoftmaxCrossEntropy;
  }

  std::string type_name() const override { return "Graph"; }
  bool TakesTokenIds() const override { return takes_ids_; }
  bool ReturnsLoss() const override { return returns_loss_; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    std::vector<VariableSpec> specs;
    RETURN_IF_ERROR(InferAtInit(input_shape, [&](const Node& node, const Shape& x) -> absl::Status {
                      ASSIGN_OR_RETURN(std::vector<VariableSpec> own,
                                       node.module->VariableSpecs(x, fp8));
                      for (VariableSpec& v : own) {
                        v.name = Scoped(node.name, v.name);
                        specs.push_back(std::move(v));
                      }
                      return absl::OkStatus();
                    }).status());
    // A param node may read a module node's variable (a loss's penalty on a
    // kernel): one variable, which the module creates.
    for (const Node& node : g_.nodes) {
      if (node.kind != NodeKind::kParam) continue;
      VariableSpec spec = graph::ParamSpec(node);
      auto same = std::find_if(specs.begin(), specs.end(),
                               [&](const VariableSpec& s) { return s.name == spec.name; });
      if (same == specs.end()) {
        const Node* owner = ScopeOwner(node.name);
        if (owner != nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(
              node.field, ".name: lies inside the scope of module ", owner->field, ", which has no ",
              spec.name, " for x ", ShapeString(input_shape),
              "; a param there reads one of the module's own"));
        }
        specs.push_back(std::move(spec));
      } else if (same->shape != spec.shape || same->dtype != spec.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            node.field, ".param: ", ShapeString(spec.shape), " ", DTypeName(spec.dtype), ", but ",
            spec.name, " is ", ShapeString(same->shape), " ", DTypeName(same->dtype),
            " (a module node's)"));
      }
    }
    return specs;
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    ASSIGN_OR_RETURN(const Plan plan, InferAtInit(input_shape, nullptr));
    const TensorInfo& y = plan.tensors[g_.outputs[0]];
    if (!y.known) {
      return absl::InvalidArgumentError(
          "spec.graph.outputs[0]: y's shape derives from an extra input alone, whose shape "
          "InitLayer is not given");
    }
    return y.shape;
  }

  // Inference's dtype rules without the shapes: extra inputs have their
  // declared dtypes (else x's), a module gives its OutputDType, a cast its
  // dtype, every other op its first input's (the inputs of add and
  // concatenate agree).
  DType OutputDType(DType input) const override {
    std::vector<DType> dtypes(g_.tensors.size(), input);
    for (int i = 0; extras_ && i < g_.num_extra; ++i) {
      if (g_.extras[i] >= 0) dtypes[g_.extras[i]] = extras_->dtypes[i];
    }
    for (int i : g_.order) {
      const Node& node = g_.nodes[i];
      DType out = node.inputs.empty() ? input : dtypes[node.inputs[0]];
      if (node.kind == NodeKind::kModule) out = node.module->OutputDType(out);
      if (node.kind == NodeKind::kCast) out = node.dtype;
      if (node.kind == NodeKind::kCausalMask) out = DType::kBool;
      if (node.kind == NodeKind::kSoftmaxCrossEntropy) out = DType::kF32;
      if (node.kind == NodeKind::kAttend) out = AttendDType(node.attend_dtype, out, node.param_dtype);
      if (graph::IsNumpyKind(node.kind) || node.kind == NodeKind::kParam) {
        std::vector<DType> in;
        for (int id : node.inputs) in.push_back(dtypes[id]);
        out = graph::NumpyOutputDType(node, in);
      }
      for (int id : node.outputs) dtypes[id] = out;
    }
    return dtypes[g_.outputs[0]];
  }

  // The caches of its attention module nodes, each under its node
  // ("cache/<node>/cached_key", "cache/<node>/self_attention/cached_key"),
  // for x of input_shape. TE's decode (not internal_decode): every node runs
  // and every attention module decodes by TE's rules (a MultiHeadAttention
  // with separate q, k, v; a DECODER TransformerLayer); the graph needs one.
  // Generation's (internal_decode): the nodes that make the logits, every
  // causal self-attention among them.
  absl::StatusOr<std::vector<VariableSpec>> CacheSpecs(const Shape& input_shape,
                                                       DType input_dtype,
                                                       bool internal_decode) const override {
    if (!CheckedNumElements(input_shape) || NumElements(input_shape) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input_shape ", ShapeString(input_shape), " must have positive dimensions"));
    }
    ASSIGN_OR_RETURN(const Plan plan,
                     graph::Infer(g_, TensorInfo{true, input_shape, input_dtype}, {}, nullptr));
    const std::vector<bool> run = DecodeRuns(internal_decode);
    std::vector<VariableSpec> specs;
    for (int i : g_.order) {
      const Node& node = g_.nodes[i];
      if (!run[i] || node.kind != NodeKind::kModule) continue;
      RETURN_IF_ERROR(DecodeSupported(node));
      if (graph::DecodeRoleOf(*node.module) != graph::DecodeRole::kCached) continue;
      const TensorInfo& x = plan.tensors[node.inputs[0]];
      absl::StatusOr<std::vector<VariableSpec>> own =
          node.module->CacheSpecs(x.shape, x.dtype.value_or(input_dtype), internal_decode);
      if (!own.ok()) return AboutNode(node, own.status());
      for (VariableSpec& v : *own) {
        v.name = Scoped(node.name, v.name);
        specs.push_back(std::move(v));
      }
    }
    if (specs.empty() && !internal_decode) {
      return absl::InvalidArgumentError(
          "decode: the graph has no attention module that decodes (MultiHeadAttention, DECODER "
          "TransformerLayer): it has no cache to keep");
    }
    return specs;
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    RETURN_IF_ERROR(InferAtInit(input_shape, [&](const Node& node, const Shape& x) -> absl::Status {
                      Variables own;
                      RETURN_IF_ERROR(node.module->Init(ops, SeedOf(seed, node.name), x, fp8, &own));
                      WriteBack(own, node.name, vars);
                      return absl::OkStatus();
                    }).status());
    for (const Node& node : g_.nodes) {
      if (node.kind != NodeKind::kParam || vars->count(graph::ParamName(node)) > 0) continue;
      RETURN_IF_ERROR(graph::InitParam(ops, seed, node, vars));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                       const ForwardOptions& call_opts, LayerOutputs* out,
                       std::unique_ptr<SavedForward>* saved) const override {
    // What the nodes share, for this call only where the caller keeps none
    // across calls (a session does: ForwardOptions::constants).
    DeviceConstants constants;
    ForwardOptions opts = call_opts;
    if (opts.constants == nullptr) opts.constants = &constants;
    RETURN_IF_ERROR(CheckGraphInput(in.x, takes_ids_, "x"));
    if (opts.decode) RETURN_IF_ERROR(CheckDecodeRequest(in, opts));
    // Generation's step runs the nodes that make its output, and takes no
    // extra inputs (a loss's labels): it returns the loss's logits. TE's
    // decode runs the whole graph, as apply does.
    const bool generation = opts.decode && opts.internal_decode;
    const int output = generation ? graph::DecodeOutput(g_) : g_.outputs[0];
    const std::vector<bool> run = DecodeRuns(generation);
    if (!generation && static_cast<int>(in.extra.size()) != g_.num_extra) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: the graph takes ",
          g_.num_extra == 0 ? std::string("none")
                            : absl::StrCat(g_.num_extra, " (extra_inputs[0] to [", g_.num_extra - 1,
                                           "])"),
          "; got ", in.extra.size()));
    }
    auto kept = std::make_unique<GraphSaved>();
    for (size_t i = 0; i < in.extra.size(); ++i) {
      const std::string field = absl::StrCat("extra_inputs[", i, "]");
      if (extras_) {
        if (!in.extra[i].defined()) return absl::InvalidArgumentError(field + ": missing");
        RETURN_IF_ERROR(CheckDeclaredExtra(*extras_, i, in.extra[i].dtype(), in.extra[i].shape(),
                                           in.x.shape(), field));
      } else {
        RETURN_IF_ERROR(CheckGraphInput(in.extra[i], takes_ids_, field));
      }
      kept->extras.push_back(TensorInfo{true, in.extra[i].shape(), in.extra[i].dtype()});
    }
    ASSIGN_OR_RETURN(kept->plan, graph::Infer(g_, TensorInfo{true, in.x.shape(), in.x.dtype()},
                                              kept->extras, nullptr));
    kept->modules.resize(g_.nodes.size());
    kept->dropouts.resize(g_.nodes.size());
    kept->lm.resize(g_.nodes.size());
    kept->numpy.resize(g_.nodes.size());

    std::vector<Tensor> values(g_.tensors.size());
    values[kX] = in.x;
    for (int i = 0; i < static_cast<int>(in.extra.size()); ++i) {
      if (g_.extras[i] >= 0) values[g_.extras[i]] = in.extra[i];
    }
    for (int i : g_.order) {
      if (!run[i]) continue;
      RETURN_IF_ERROR(ops.CheckInterrupt());
      const Node& node = g_.nodes[i];
      std::vector<Tensor> inputs, outputs;
      for (int id : node.inputs) inputs.push_back(values[id]);
      if (opts.decode) RETURN_IF_ERROR(DecodeSupported(node));
      if (generation) {
        for (int id : node.inputs) {
          if (g_.tensors[id].extra_index >= 0) {
            return AboutNode(node, absl::InvalidArgumentError(
                                       "reads an extra input, which a decode step does not take"));
          }
        }
      }
      if (node.kind == NodeKind::kModule) {
        RETURN_IF_ERROR(ForwardModule(ops, vars, node, in, inputs, opts, kept->plan, &outputs,
                                      &kept->modules[i]));
      } else if (node.kind == NodeKind::kSoftmaxCrossEntropy) {
        outputs.resize(1);
        RETURN_IF_ERROR(AboutNode(
            node, graph::LossForward(ops, inputs[0], inputs[1], &outputs[0], &kept->lm[i])));
      } else if (node.kind == NodeKind::kAttend) {
        outputs.resize(1);
        ASSIGN_OR_RETURN(const Tensor embedding, EmbeddingOf(*vars, node));
        RETURN_IF_ERROR(AboutNode(node, graph::AttendNodeForward(ops, node, embedding, inputs[0],
                                                                 &outputs[0], &kept->lm[i])));
      } else if (node.kind == NodeKind::kParam) {
        auto it = vars->find(graph::ParamName(node));
        if (it == vars->end()) {
          return absl::FailedPreconditionError(
              absl::StrCat(node.field, ": no variable ", graph::ParamName(node)));
        }
        outputs = {it->second};
      } else if (graph::IsNumpyKind(node.kind)) {
        RETURN_IF_ERROR(AboutNode(node, graph::NumpyForward(ops, node, kept->plan.nodes[i],
                                                            kept->plan, inputs, &outputs,
                                                            &kept->numpy[i])));
      } else {
        RETURN_IF_ERROR(AboutNode(
            node, graph::GlueForward(ops, node, kept->plan.nodes[i], inputs, opts.deterministic,
                                     SeedOf(opts.dropout_seed, node.name), &outputs,
                                     &kept->dropouts[i])));
      }
      for (size_t j = 0; j < node.outputs.size(); ++j) values[node.outputs[j]] = outputs[j];
      for (int id : g_.last_read_by[i]) values[id] = Tensor();
    }
    out->y = values[output];
    out->aux.clear();
    if (!generation) {  // generation's step returns the logits alone
      if (g_.outputs.size() > 1) out->ln_out = values[g_.outputs[1]];
      for (size_t j = 1; j < g_.outputs.size(); ++j) out->aux.push_back(values[g_.outputs[j]]);
    }
    if (opts.keep_for_backward && saved != nullptr) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const GraphSaved*>(&saved);
    if (kept == nullptr || kept->modules.size() != g_.nodes.size()) {
      return absl::InvalidArgumentError("saved forward was not made by this Graph layer");
    }
    const Plan& plan = kept->plan;
    const TensorInfo& y = plan.tensors[g_.outputs[0]];
    if (!dy.defined() || dy.shape() != y.shape || !IsFloating(dy.dtype()) || IsFloat8(dy.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat("dy must be a float tensor shaped like y ",
                                                     ShapeString(y.shape), ", got ",
                                                     ShapeString(dy.shape()), " ",
                                                     DTypeName(dy.dtype())));
    }
    std::vector<Tensor> slots(g_.tensors.size());
    RETURN_IF_ERROR(Accumulate(ops, plan, g_.outputs[0], dy, &slots));
    for (size_t k = g_.order.size(); k-- > 0;) {
      RETURN_IF_ERROR(ops.CheckInterrupt());
      const int i = g_.order[k];
      const Node& node = g_.nodes[i];
      // Every reader of this node's outputs ran its backward already.
      std::vector<Tensor> dout;
      for (int id : node.outputs) dout.push_back(std::exchange(slots[id], Tensor()));
      std::vector<Tensor> din;
      if (node.kind == NodeKind::kModule) {
        if (kept->modules[i] == nullptr) {
          return absl::InternalError(absl::StrCat(node.field, ": the forward kept nothing"));
        }
        RETURN_IF_ERROR(BackwardModule(ops, vars, node, *kept->modules[i], dout[0], &din, grads));
      } else if (node.kind == NodeKind::kSoftmaxCrossEntropy) {
        RETURN_IF_ERROR(AboutNode(node, graph::LossBackward(ops, kept->lm[i], dout[0], &din)));
      } else if (node.kind == NodeKind::kAttend) {
        if (dout[0].defined()) {
          Tensor dembedding;
          RETURN_IF_ERROR(AboutNode(node, graph::AttendNodeBackward(ops, node, kept->lm[i], dout[0],
                                                                    &din, &dembedding)));
          RETURN_IF_ERROR(AddParamGrad(ops, EmbeddingName(node), dembedding, grads));
        }
      } else if (node.kind == NodeKind::kParam) {  // no gradient reached it: zeros
        const TensorInfo& info = plan.tensors[node.outputs[0]];
        Tensor g = dout[0];
        if (!g.defined()) {
          ASSIGN_OR_RETURN(g, graph::Zeros(ops, *info.dtype, info.shape));
        }
        RETURN_IF_ERROR(AddParamGrad(ops, graph::ParamName(node), g, grads));
      } else if (graph::IsNumpyKind(node.kind)) {
        RETURN_IF_ERROR(AboutNode(node, graph::NumpyBackward(ops, node, plan.nodes[i], plan,
                                                             kept->numpy[i], dout, &din)));
      } else {
        RETURN_IF_ERROR(AboutNode(node, graph::GlueBackward(ops, node, plan.nodes[i], plan,
                                                            kept->dropouts[i], dout, &din)));
      }
      for (size_t j = 0; j < din.size() && j < node.inputs.size(); ++j) {
        if (din[j].defined()) RETURN_IF_ERROR(Accumulate(ops, plan, node.inputs[j], din[j], &slots));
      }
    }
    ASSIGN_OR_RETURN(grads->dx, GradOrZeros(ops, slots[kX], plan.tensors[kX]));
    grads->dextra.clear();
    for (int i = 0; i < g_.num_extra; ++i) {
      const int id = g_.extras[i];
      ASSIGN_OR_RETURN(Tensor d, GradOrZeros(ops, id >= 0 ? slots[id] : Tensor(), kept->extras[i]));
      grads->dextra.push_back(std::move(d));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status CheckDecodeRequest(const LayerInputs& in, const ForwardOptions& opts) const {
    if (opts.keep_for_backward) {
      return absl::InvalidArgumentError(
          "keep_for_backward: a decode step is inference only; it keeps nothing for a backward");
    }
    if (opts.internal_decode && !in.extra.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: a decode step takes none (it returns the loss's logits); got ",
          in.extra.size()));
    }
    return absl::OkStatus();
  }

  // By node: whether a step runs it: generation's, the nodes that make the
  // logits (graph::DecodeOutput); any other, every node.
  std::vector<bool> DecodeRuns(bool generation) const {
    return generation ? graph::NodesFeeding(g_, graph::DecodeOutput(g_))
                      : std::vector<bool>(g_.nodes.size(), true);
  }

  static absl::Status DecodeSupported(const Node& node) {
    if (node.kind != NodeKind::kModule ||
        graph::DecodeRoleOf(*node.module) != graph::DecodeRole::kUnsupported) {
      return absl::OkStatus();
    }
    return AboutNode(node, absl::InvalidArgumentError(absl::StrCat(
                               "decode: ", node.module->type_name(),
                               " cannot run one position at a time (a decode step runs "
                               "MultiHeadAttention and TransformerLayer through their caches, "
                               "and position-wise modules as they are)")));
  }

  absl::StatusOr<Plan> InferAtInit(const Shape& input_shape,
                                   const graph::ModuleVisitor& on_module) const {
    if (!CheckedNumElements(input_shape) || NumElements(input_shape) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input_shape ", ShapeString(input_shape), " must have positive dimensions"));
    }
    return graph::Infer(g_, TensorInfo{true, input_shape, std::nullopt}, DeclaredInfos(input_shape),
                        on_module);
  }

  // The module node whose scope holds `name` (the module named "" holds
  // every name), or null.
  const Node* ScopeOwner(const std::string& name) const {
    for (const Node& node : g_.nodes) {
      if (node.kind != NodeKind::kModule) continue;
      if (node.name.empty() || absl::StartsWith(name, node.name + "/")) return &node;
    }
    return nullptr;
  }

  // What inference knows of the extra inputs beside an x of `x`: their
  // declared dtypes and shapes, or nothing (x's dtype; shapes unknown).
  std::vector<TensorInfo> DeclaredInfos(const Shape& x) const {
    std::vector<TensorInfo> infos;
    for (size_t i = 0; extras_ && i < extras_->dtypes.size(); ++i) {
      infos.push_back(TensorInfo{true, DeclaredExtraShape(extras_->shapes[i], extras_->x, x),
                                 extras_->dtypes[i]});
    }
    return infos;
  }

  absl::Status ForwardModule(Ops& ops, Variables* vars, const Node& node, const LayerInputs& in,
                             const std::vector<Tensor>& inputs, const ForwardOptions& opts,
                             const Plan& plan, std::vector<Tensor>* outputs,
                             std::unique_ptr<SavedForward>* saved) const {
    LayerInputs module_in;
    module_in.x = inputs[0];
    module_in.extra.assign(inputs.begin() + 1, inputs.end());
    // A causal_mask node's output carries no padding: the module gets none,
    // except a padding-type module, which applies its ones elementwise.
    if (node.mask >= 0 && node.mask == g_.attention_mask) {
      module_in.q_seqlens = in.q_seqlens;
      module_in.kv_seqlens = in.kv_seqlens;
      module_in.seqlens_with_causal = in.seqlens_with_causal;
      module_in.elementwise_mask = in.elementwise_mask;
      module_in.mask_heads = in.mask_heads;
      module_in.mask_error = in.mask_error;
    } else if (node.causal_node_elementwise && !opts.decode) {
      // (A decode step's causality is its cache's.)
      const Shape& m = plan.tensors[node.mask].shape;  // [B, 1, S, S]
      std::vector<uint8_t> host(static_cast<size_t>(m[0] * m[2] * m[3]));
      for (int64_t b = 0; b < m[0]; ++b) {
        for (int64_t i = 0; i < m[2]; ++i) {
          for (int64_t j = 0; j < m[3]; ++j) host[(b * m[2] + i) * m[3] + j] = j <= i ? 1 : 0;
        }
      }
      ASSIGN_OR_RETURN(module_in.elementwise_mask, ops.Allocate(DType::kBool, {m[0], m[2], m[3]}));
      RETURN_IF_ERROR(ops.Upload(host.data(), &module_in.elementwise_mask));
    }
    ForwardOptions module_opts = opts;
    module_opts.dropout_seed = SeedOf(opts.dropout_seed, node.name);
    // The module sees its variables under its own names (ScopeView): the
    // recipe says where they are in the layer's, so the FP8 weight copies it
    // keeps are known to the layer's optimizer update by the layer's names
    // (Fp8Recipe::variables_scope); otherwise every update would drop them
    // and each step make and quantize them all again.
    Fp8Recipe module_fp8;
    if (opts.fp8 != nullptr && !node.name.empty()) {
      module_fp8 = *opts.fp8;
      module_fp8.variables_scope = JoinScope(opts.fp8->variables_scope, node.name);
      module_opts.fp8 = &module_fp8;
    }
    Variables view = ScopeView(*vars, node.name);
    LayerOutputs module_out;
    RETURN_IF_ERROR(AboutNode(node, node.module->Forward(ops, &view, module_in, module_opts,
                                                         &module_out, saved)));
    WriteBack(view, node.name, vars);
    const TensorInfo& want = plan.tensors[node.outputs[0]];
    if (module_out.y.shape() != want.shape || module_out.y.dtype() != *want.dtype) {
      return absl::InternalError(absl::StrCat(
          node.field, ": ", node.module->type_name(), " gave y ", ShapeString(module_out.y.shape()),
          " ", DTypeName(module_out.y.dtype()), "; its OutputShape and OutputDType say ",
          ShapeString(want.shape), " ", DTypeName(*want.dtype)));
    }
    outputs->push_back(module_out.y);
    if (node.outputs.size() > 1) {
      if (!module_out.ln_out.defined()) {
        return absl::InternalError(absl::StrCat(node.field, ": ", node.module->type_name(),
                                                " gave no ln_out"));
      }
      outputs->push_back(module_out.ln_out);
    }
    return absl::OkStatus();
  }

  // dy undefined: no gradient reached y (an unused module): its parameter
  // gradients are zeros and nothing flows to its inputs.
  absl::Status BackwardModule(Ops& ops, Variables* vars, const Node& node,
                              const SavedForward& saved, const Tensor& dy,
                              std::vector<Tensor>* din, LayerGrads* grads) const {
    Variables view = ScopeView(*vars, node.name);
    if (!dy.defined()) {
      for (const auto& [key, t] : view) {
        if (!absl::StartsWith(key, "params/")) continue;
        if (grads->params.count(Scoped(node.name, key)) > 0) continue;  // an attend's gradient
        ASSIGN_OR_RETURN(grads->params[Scoped(node.name, key)], graph::Zeros(ops, t.dtype(), t.shape()));
      }
      return absl::OkStatus();
    }
    LayerGrads own;
    RETURN_IF_ERROR(AboutNode(node, node.module->Backward(ops, &view, saved, dy, &own)));
    WriteBack(view, node.name, vars);
    if (own.dextra.size() + 1 != node.inputs.size()) {
      return absl::InternalError(absl::StrCat(node.field, ": ", own.dextra.size(),
                                              " extra-input gradients for ",
                                              node.inputs.size() - 1, " extra inputs"));
    }
    din->push_back(own.dx);
    din->insert(din->end(), own.dextra.begin(), own.dextra.end());
    for (const auto& [key, g] : own.params) {
      RETURN_IF_ERROR(AddParamGrad(ops, Scoped(node.name, key), g, grads));
    }
    return absl::OkStatus();
  }

  // Adds `grad` to tensor `id`'s gradient, in the tensor's shape and dtype.
  static absl::Status Accumulate(Ops& ops, const Plan& plan, int id, Tensor grad,
                                 std::vector<Tensor>* slots) {
    const TensorInfo& info = plan.tensors[id];
    if (grad.shape() != info.shape) {
      if (grad.numel() != NumElements(info.shape)) {
        return absl::InternalError(absl::StrCat("a gradient ", ShapeString(grad.shape()),
                                                " for a tensor ", ShapeString(info.shape)));
      }
      grad = grad.Reshaped(info.shape);
    }
    ASSIGN_OR_RETURN(grad, CastTo(ops, grad, *info.dtype));
    Tensor& slot = (*slots)[id];
    if (!slot.defined()) {
      slot = std::move(grad);
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(Tensor sum, ops.Allocate(*info.dtype, info.shape));
    RETURN_IF_ERROR(ops.Axpby(1.0f, slot, 1.0f, grad, &sum));
    slot = std::move(sum);
    return absl::OkStatus();
  }

  static absl::StatusOr<Tensor> GradOrZeros(Ops& ops, const Tensor& grad, const TensorInfo& info) {
    if (grad.defined()) return grad;
    if (*info.dtype == DType::kI32) return IdGradient(ops, info.shape);  // token ids, labels
    return graph::Zeros(ops, *info.dtype, info.shape);
  }

  // An attend node's table: "params/<embed node>/embedding".
  std::string EmbeddingName(const Node& node) const {
    return Scoped(g_.nodes[node.embed].name, "params/embedding");
  }
  absl::StatusOr<Tensor> EmbeddingOf(const Variables& vars, const Node& node) const {
    auto it = vars.find(EmbeddingName(node));
    if (it == vars.end()) {
      return absl::FailedPreconditionError(absl::StrCat(node.field, ": no variable ",
                                                        EmbeddingName(node)));
    }
    return it->second;
  }

  // A parameter read by two nodes (an Embed and its attend) sums both
  // gradients, into a new tensor: the first may be a module's own.
  static absl::Status AddParamGrad(Ops& ops, const std::string& key, const Tensor& g,
                                   LayerGrads* grads) {
    auto it = grads->params.find(key);
    if (it == grads->params.end()) {
      grads->params[key] = g;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(Tensor sum, ops.Allocate(it->second.dtype(), it->second.shape()));
    RETURN_IF_ERROR(ops.Axpby(1.0f, it->second, 1.0f, g, &sum));
    it->second = std::move(sum);
    return absl::OkStatus();
  }

  Graph g_;
  std::optional<DeclaredExtras> extras_;  // one per extra input, or none declared
  bool takes_ids_ = false;
  bool returns_loss_ = false;
};

}  // namespace

Shape DeclaredExtraShape(const Shape& declared, const Shape& declared_x, const Shape& x) {
  Shape shape = declared;
  for (size_t d = 0; d < shape.size() && d < declared_x.size() && d < x.size(); ++d) {
    if (shape[d] != declared_x[d]) break;
    shape[d] = x[d];
  }
  return shape;
}

bool SameDeclaredExtras(const std::optional<DeclaredExtras>& a,
                        const std::optional<DeclaredExtras>& b) {
  if (!a || !b) return !a && !b;
  if (a->dtypes != b->dtypes || a->shapes.size() != b->shapes.size()) return false;
  for (size_t i = 0; i < a->shapes.size(); ++i) {
    if (DeclaredExtraShape(a->shapes[i], a->x, b->x) != b->shapes[i]) return false;
  }
  return true;
}

absl::Status CheckDeclaredExtra(const DeclaredExtras& extras, size_t i, DType dtype,
                                const Shape& shape, const Shape& x, const std::string& field) {
  if (i >= extras.dtypes.size()) return absl::OkStatus();  // the graph's count check refuses it
  if (dtype != extras.dtypes[i]) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ", DTypeName(dtype), ", but the graph's extra_inputs[", i,
                     "] was declared ", DTypeName(extras.dtypes[i])));
  }
  const Shape want = DeclaredExtraShape(extras.shapes[i], extras.x, x);
  if (shape != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape ", ShapeString(shape), ": want ", ShapeString(want), " beside x ",
        ShapeString(x), " (declared ", ShapeString(extras.shapes[i]), " beside x ",
        ShapeString(extras.x), "; its leading dims that are x's follow x's)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Layer>> MakeGraph(const te::v1::GraphSpec& spec,
                                                 std::optional<DeclaredExtras> extras) {
  ASSIGN_OR_RETURN(Graph graph, graph::BuildGraph(spec));
  if (extras) {
    const int count = static_cast<int>(extras->dtypes.size());
    if (count != graph.num_extra || extras->shapes.size() != extras->dtypes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: ", count, " declared, but the graph reads ",
          graph.num_extra == 0
              ? std::string("none")
              : absl::StrCat(graph.num_extra, " (extra_inputs[0] to [", graph.num_extra - 1, "])"),
          "; declare each one or none"));
    }
    for (int i = 0; i < count; ++i) {
      const DType d = extras->dtypes[i];
      if (!(IsFloating(d) && !IsFloat8(d)) && d != DType::kI32 && d != DType::kBool) {
        return absl::InvalidArgumentError(
            absl::StrCat("extra_inputs[", i, "].dtype: ", DTypeName(d),
                         "; a graph's extra input is float32, bfloat16, float16, int32 or bool"));
      }
    }
  }
  return std::unique_ptr<Layer>(new GraphLayer(std::move(graph), std::move(extras)));
}

}  // namespace te::layers
