// Infer: every tensor's shape and dtype from the graph's inputs, node by node
// in the graph's order, and each glue node's fields resolved against its
// input (axes made non-negative, reshape's -1 filled in). Run at init (x's
// shape only: the dtype is "the input's", and the extra inputs are as
// declared, or of unknown shape when they are not) and again at each forward
// with the request's tensors.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "server/layers/flax_modules.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

std::string DTypeString(const std::optional<DType>& dtype) {
  return dtype ? DTypeName(*dtype) : "the input dtype";
}

// Two dtypes that surely differ (one "the input's" and one concrete may still
// agree: decided at the forward, where all are concrete).
bool Differ(const std::optional<DType>& a, const std::optional<DType>& b) {
  return a && b && *a != *b;
}

// `axis` (negative counts from the end) in [0, rank), or INVALID_ARGUMENT.
absl::StatusOr<int> NormalizeAxis(int axis, int rank, const std::string& where) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank) {
    return Invalid(where, absl::StrCat(axis, " is out of range for rank ", rank));
  }
  return a;
}

class Inference {
 public:
  Inference(const Graph& g, const ModuleVisitor& on_module) : g_(g), on_module_(on_module) {
    plan_.tensors.resize(g.tensors.size());
    plan_.nodes.resize(g.nodes.size());
  }

  absl::StatusOr<Plan> Run(const TensorInfo& x, const std::vector<TensorInfo>& extras) {
    plan_.tensors[kX] = x;
    for (int i = 0; i < g_.num_extra; ++i) {
      if (g_.extras[i] < 0) continue;
      // Undeclared extra inputs arrive in x's dtype (the request's rule).
      plan_.tensors[g_.extras[i]] =
          extras.empty() ? TensorInfo{false, {}, x.dtype} : extras[static_cast<size_t>(i)];
    }
    for (int i : g_.order) RETURN_IF_ERROR(InferNode(g_.nodes[i], &plan_.nodes[i]));
    return std::move(plan_);
  }

 private:
  const TensorInfo& In(const Node& node, size_t j) const {
    return plan_.tensors[node.inputs[j]];
  }
  TensorInfo& Out(const Node& node, size_t j) { return plan_.tensors[node.outputs[j]]; }

  absl::Status InferNode(const Node& node, NodePlan* np) {
    switch (node.kind) {
      case NodeKind::kModule: return Module(node);
      case NodeKind::kReshape: return Reshape(node, np);
      case NodeKind::kSplit: return Split(node, np);
      case NodeKind::kConcatenate: return Concatenate(node, np);
      case NodeKind::kAdd: return Add(node);
      case NodeKind::kScale:
      case NodeKind::kDropout:
        Out(node, 0) = In(node, 0);
        return node.kind == NodeKind::kDropout ? Dropout(node, np) : absl::OkStatus();
      case NodeKind::kCast: return Cast(node);
      case NodeKind::kTranspose: return Transpose(node, np);
      case NodeKind::kCausalMask: return CausalMask(node);
      case NodeKind::kSoftmaxCrossEntropy: return Loss(node);
      case NodeKind::kAttend: return Attend(node);
      case NodeKind::kBinary:
      case NodeKind::kUnary:
      case NodeKind::kWhere:
      case NodeKind::kReduce:
      case NodeKind::kEinsum:
      case NodeKind::kSlice:
      case NodeKind::kSoftmax:
      case NodeKind::kParam:
        return Numpy(node, np);
    }
    return absl::InternalError(absl::StrCat(node.field, ": unhandled node kind"));
  }

  // jax.numpy's nodes: graph_numpy_infer.cc.
  absl::Status Numpy(const Node& node, NodePlan* np) {
    std::vector<TensorInfo> in;
    for (size_t j = 0; j < node.inputs.size(); ++j) in.push_back(In(node, j));
    std::vector<TensorInfo> out;
    RETURN_IF_ERROR(InferNumpyNode(node, in, &out, np));
    for (size_t j = 0; j < out.size(); ++j) Out(node, j) = out[j];
    return absl::OkStatus();
  }

  absl::Status Module(const Node& node) {
    const TensorInfo& x = In(node, 0);
    if (!x.known) {
      return Invalid(node.field,
                     "its x derives from an extra input whose shape was not declared "
                     "(InitLayerRequest / AddGraphRequest.extra_inputs); a module's x must "
                     "derive from the graph's x or a declared extra input");
    }
    // Token ids go to an Embed, float activations to every other module.
    const bool ids = node.module->TakesTokenIds();
    if (x.dtype && (*x.dtype == DType::kI32) != ids) {
      return Invalid(node.field, absl::StrCat(node.module->type_name(), " takes ",
                                              ids ? "int32 token ids" : "a float x", ", got ",
                                              DTypeName(*x.dtype)));
    }
    if (on_module_) {
      const absl::Status s = on_module_(node, x.shape);
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat(node.field, ": ", s.message()));
    }
    absl::StatusOr<Shape> y = node.module->OutputShape(x.shape);
    if (!y.ok()) {
      return absl::Status(y.status().code(), absl::StrCat(node.field, ": ", y.status().message()));
    }
    if (node.mask >= 0 && g_.tensors[node.mask].producer >= 0) {
      const TensorInfo& mask = plan_.tensors[node.mask];  // [B, 1, S, S]
      if (mask.known && (x.shape.size() < 2 || x.shape[0] != mask.shape[0] ||
                         x.shape[1] != mask.shape[2])) {
        return Invalid(node.field + ".mask",
                       absl::StrCat("the causal mask ", ShapeString(mask.shape),
                                    " does not fit x ", ShapeString(x.shape),
                                    ": want [batch, 1, seq, seq] of x's batch and seq"));
      }
    }
    // TE's modules return their input's dtype, Flax's promote it with their
    // parameters' (Layer::OutputDType).
    Out(node, 0) = TensorInfo{true, *y, ModuleDType(node, x.dtype)};
    if (node.outputs.size() > 1) Out(node, 1) = x;  // ln_out: the norm of x, x's shape
    return absl::OkStatus();
  }

  // A module's y dtype for an x of `x`'s. At init x's dtype is "the input's"
  // (nullopt): y's is then concrete when every float input gives the same
  // one (float32 params promote all to float32), and stays "the input's"
  // otherwise; that may be loose for a module that keeps some input dtypes
  // and promotes others, which only defers a dtype check to the forward,
  // where every dtype is concrete.
  static std::optional<DType> ModuleDType(const graph::Node& node, const std::optional<DType>& x) {
    if (x) return node.module->OutputDType(*x);
    const DType f32 = node.module->OutputDType(DType::kF32);
    const bool constant = node.module->OutputDType(DType::kBF16) == f32 &&
                          node.module->OutputDType(DType::kF16) == f32;
    return constant ? std::optional<DType>(f32) : std::nullopt;
  }

  // Between the float dtypes: Ops::Cast converts nothing else (int32 ids and
  // labels, bool masks).
  absl::Status Cast(const Node& node) {
    const TensorInfo& x = In(node, 0);
    if (x.dtype && (!IsFloating(*x.dtype) || IsFloat8(*x.dtype))) {
      return Invalid(node.field + ".inputs[0]",
                     absl::StrCat("cast takes float32, bfloat16 or float16, got ",
                                  DTypeName(*x.dtype)));
    }
    Out(node, 0) = x;
    Out(node, 0).dtype = node.dtype;
    return absl::OkStatus();
  }

  absl::Status Reshape(const Node& node, NodePlan* np) {
    const TensorInfo& x = In(node, 0);
    Shape to = node.shape;
    const auto wildcard = std::find(to.begin(), to.end(), int64_t{-1});
    Shape given = to;
    given.erase(std::remove(given.begin(), given.end(), int64_t{-1}), given.end());
    const int64_t product = *CheckedNumElements(given);  // BuildGraph checked it fits
    TensorInfo out{false, {}, x.dtype};
    if (x.known) {
      const int64_t n = NumElements(x.shape);
      if (wildcard != to.end()) {
        if (n % product != 0) {
          return Invalid(node.field + ".reshape.shape",
                         absl::StrCat(ShapeString(node.shape), " cannot hold x ",
                                      ShapeString(x.shape), " (", n, " elements)"));
        }
        *wildcard = n / product;
      } else if (product != n) {
        return Invalid(node.field + ".reshape.shape",
                       absl::StrCat(ShapeString(node.shape), " has ", product,
                                    " elements, x ", ShapeString(x.shape), " has ", n));
      }
      out.known = true;
    } else {
      out.known = wildcard == to.end();
    }
    if (out.known) out.shape = to;
    np->to = to;
    Out(node, 0) = out;
    return absl::OkStatus();
  }

  absl::Status Split(const Node& node, NodePlan* np) {
    const TensorInfo& x = In(node, 0);
    TensorInfo part{false, {}, x.dtype};
    if (x.known) {
      ASSIGN_OR_RETURN(np->axis, NormalizeAxis(node.axis, static_cast<int>(x.shape.size()),
                                               node.field + ".split.axis"));
      if (x.shape[np->axis] % node.parts != 0) {
        return Invalid(node.field + ".split.parts",
                       absl::StrCat(node.parts, " parts do not divide axis ", np->axis, " of x ",
                                    ShapeString(x.shape)));
      }
      part.known = true;
      part.shape = x.shape;
      part.shape[np->axis] /= node.parts;
    }
    for (size_t j = 0; j < node.outputs.size(); ++j) Out(node, j) = part;
    return absl::OkStatus();
  }

  absl::Status Concatenate(const Node& node, NodePlan* np) {
    TensorInfo out{true, {}, In(node, 0).dtype};
    for (size_t j = 0; j < node.inputs.size(); ++j) {
      const TensorInfo& in = In(node, j);
      if (Differ(in.dtype, out.dtype)) {
        return Invalid(node.field, absl::StrCat("inputs[", j, "] is ", DTypeString(in.dtype),
                                                ", inputs[0] ", DTypeString(out.dtype)));
      }
      out.known = out.known && in.known;
    }
    if (!out.known) {
      Out(node, 0) = out;
      return absl::OkStatus();
    }
    out.shape = In(node, 0).shape;
    ASSIGN_OR_RETURN(np->axis, NormalizeAxis(node.axis, static_cast<int>(out.shape.size()),
                                             node.field + ".concatenate.axis"));
    for (size_t j = 1; j < node.inputs.size(); ++j) {
      Shape a = In(node, 0).shape, b = In(node, j).shape;
      if (a.size() == b.size()) a[np->axis] = b[np->axis];
      if (a != b) {
        return Invalid(node.field,
                       absl::StrCat("inputs[", j, "] ", ShapeString(In(node, j).shape),
                                    " does not fit inputs[0] ", ShapeString(In(node, 0).shape),
                                    " but along axis ", np->axis));
      }
      out.shape[np->axis] += b[np->axis];
    }
    Out(node, 0) = out;
    return absl::OkStatus();
  }

  // Shapes agree where known: an input from an extra input is checked at
  // the forward.
  absl::Status Add(const Node& node) {
    TensorInfo out = In(node, 0);
    for (size_t j = 1; j < node.inputs.size(); ++j) {
      const TensorInfo& in = In(node, j);
      if (Differ(in.dtype, out.dtype)) {
        return Invalid(node.field, absl::StrCat("adds ", DTypeString(in.dtype), " (inputs[", j,
                                                "]) to ", DTypeString(out.dtype)));
      }
      if (in.known && out.known && in.shape != out.shape) {
        return Invalid(node.field, absl::StrCat("adds ", ShapeString(in.shape), " (inputs[", j,
                                                "]) to ", ShapeString(out.shape)));
      }
      if (!out.known) out = in;
    }
    Out(node, 0) = out;
    return absl::OkStatus();
  }

  absl::Status Transpose(const Node& node, NodePlan* np) {
    const TensorInfo& x = In(node, 0);
    Out(node, 0) = TensorInfo{false, {}, x.dtype};
    if (!x.known) return absl::OkStatus();
    const int rank = static_cast<int>(x.shape.size());
    const std::string where = node.field + ".transpose.axes";
    std::vector<int>& perm = np->perm;
    if (node.axes.empty()) {  // numpy: reversed
      for (int d = rank - 1; d >= 0; --d) perm.push_back(d);
    } else if (static_cast<int>(node.axes.size()) != rank) {
      return Invalid(where, absl::StrCat("[", absl::StrJoin(node.axes, ", "), "] for x of rank ",
                                         rank, " ", ShapeString(x.shape)));
    }
    std::vector<bool> seen(rank, false);
    for (int axis : node.axes) {
      ASSIGN_OR_RETURN(const int a, NormalizeAxis(axis, rank, where));
      if (seen[a]) {
        return Invalid(where, absl::StrCat("[", absl::StrJoin(node.axes, ", "),
                                           "] names axis ", a, " twice"));
      }
      seen[a] = true;
      perm.push_back(a);
    }
    if (MergedPermuteRank(x.shape, perm) > kPermuteMaxRank) {
      return Invalid(where, absl::StrCat("[", absl::StrJoin(perm, ", "), "] of x ",
                                         ShapeString(x.shape), " moves more than ",
                                         kPermuteMaxRank, " separate blocks of axes"));
    }
    Shape shape;
    for (int a : perm) shape.push_back(x.shape[a]);
    Out(node, 0) = TensorInfo{true, shape, x.dtype};
    return absl::OkStatus();
  }

  absl::Status Dropout(const Node& node, NodePlan* np) {
    const TensorInfo& x = In(node, 0);
    if (!x.known) return absl::OkStatus();
    const int rank = static_cast<int>(x.shape.size());
    const std::string where = node.field + ".dropout.broadcast_dims";
    for (int dim : node.broadcast_dims) {
      ASSIGN_OR_RETURN(const int d, NormalizeAxis(dim, rank, where));
      np->broadcast_dims.push_back(d);
    }
    std::sort(np->broadcast_dims.begin(), np->broadcast_dims.end());
    if (std::adjacent_find(np->broadcast_dims.begin(), np->broadcast_dims.end()) !=
        np->broadcast_dims.end()) {
      return Invalid(where, absl::StrCat("[", absl::StrJoin(node.broadcast_dims, ", "),
                                         "] names an axis twice"));
    }
    return absl::OkStatus();
  }

  // nn.make_causal_mask(x[..., 0]): bool [B, 1, S, S] from x [B, S, ...].
  absl::Status CausalMask(const Node& node) {
    const TensorInfo& x = In(node, 0);
    Out(node, 0) = TensorInfo{false, {}, DType::kBool};
    if (!x.known) return absl::OkStatus();
    if (x.shape.size() < 2) {
      return Invalid(node.field, absl::StrCat("x ", ShapeString(x.shape),
                                              " has no [batch, seq, ...] to make a mask of"));
    }
    Out(node, 0) = TensorInfo{true, {x.shape[0], 1, x.shape[1], x.shape[1]}, DType::kBool};
    return absl::OkStatus();
  }

  // optax's softmax cross entropy, averaged: logits [..., V] float, labels
  // int32 of logits' leading dims; the loss f32 [].
  absl::Status Loss(const Node& node) {
    const TensorInfo& logits = In(node, 0);
    const TensorInfo& labels = In(node, 1);
    if (logits.dtype && (*logits.dtype == DType::kI32 || *logits.dtype == DType::kBool)) {
      return Invalid(node.field + ".inputs[0]",
                     absl::StrCat("logits are ", DTypeName(*logits.dtype), "; want float"));
    }
    if (labels.dtype && *labels.dtype != DType::kI32) {
      return Invalid(node.field + ".inputs[1]",
                     absl::StrCat("labels are ", DTypeName(*labels.dtype), "; want int32"));
    }
    if (logits.known && (logits.shape.empty() || NumElements(logits.shape) == 0)) {
      return Invalid(node.field + ".inputs[0]",
                     absl::StrCat("logits ", ShapeString(logits.shape), "; want [..., vocab]"));
    }
    if (logits.known && labels.known &&
        Shape(logits.shape.begin(), logits.shape.end() - 1) != labels.shape) {
      return Invalid(node.field + ".inputs[1]",
                     absl::StrCat("labels ", ShapeString(labels.shape), " do not fit logits ",
                                  ShapeString(logits.shape), ": want logits' leading dims"));
    }
    Out(node, 0) = TensorInfo{true, {}, DType::kF32};
    return absl::OkStatus();
  }

  // x [..., features] -> [..., vocab] of the Embed node's table.
  absl::Status Attend(const Node& node) {
    const TensorInfo& x = In(node, 0);
    if (x.dtype && (*x.dtype == DType::kI32 || *x.dtype == DType::kBool)) {
      return Invalid(node.field, absl::StrCat("attend takes a float x, got ", DTypeName(*x.dtype)));
    }
    std::optional<DType> dtype = node.attend_dtype;
    if (!dtype && x.dtype) dtype = PromoteFloat(*x.dtype, node.param_dtype);
    if (!dtype && node.param_dtype == DType::kF32) dtype = DType::kF32;  // f32 promotes all
    TensorInfo out{false, {}, dtype};
    if (x.known) {
      if (x.shape.empty() || x.shape.back() != node.features) {
        return Invalid(node.field, absl::StrCat("x ", ShapeString(x.shape), ": attend wants [..., ",
                                                node.features, "] (",
                                                g_.nodes[node.embed].field, "'s features)"));
      }
      out.known = true;
      out.shape = x.shape;
      out.shape.back() = node.vocab;
    }
    Out(node, 0) = out;
    return absl::OkStatus();
  }

  const Graph& g_;
  const ModuleVisitor& on_module_;
  Plan plan_;
};

}  // namespace

absl::StatusOr<Plan> Infer(const Graph& graph, const TensorInfo& x,
                           const std::vector<TensorInfo>& extras, const ModuleVisitor& on_module) {
  if (!extras.empty() && static_cast<int>(extras.size()) != graph.num_extra) {
    return absl::InternalError(absl::StrCat("graph inference given ", extras.size(),
                                            " extra inputs for ", graph.num_extra));
  }
  return Inference(graph, on_module).Run(x, extras);
}

}  // namespace te::layers::graph
