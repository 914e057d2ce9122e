// Inference for jax.numpy's nodes: each output's shape and dtype from its
// inputs', numpy's rules (broadcasting aligned from the right; reductions
// with keepdims; basic slicing), and the node's plan (axes resolved). Every
// error is INVALID_ARGUMENT naming the node and its field:
// "spec.graph.nodes[3] (mean_0).reduce.axes[0]: 4 is out of range for rank 3".
// An input whose shape derives from an extra input (unknown at init) makes
// the outputs unknown: the check runs at the forward.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

bool IsFloatDType(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// inputs[j] is float where its dtype is known (the graph's input dtype is float or ids).
absl::Status RequireFloat(const Node& node, const std::vector<TensorInfo>& in, size_t j,
                          const std::string& what) {
  const std::optional<DType>& d = in[j].dtype;
  if (d && !IsFloatDType(*d)) {
    return Invalid(absl::StrCat(node.field, ".inputs[", j, "]"),
                   absl::StrCat(what, " takes float32, bfloat16 or float16, got ", DTypeName(*d)));
  }
  return absl::OkStatus();
}

// The dtype the float inputs `js` share (INVALID_ARGUMENT where two known ones differ).
absl::StatusOr<std::optional<DType>> SharedDType(const Node& node,
                                                 const std::vector<TensorInfo>& in,
                                                 const std::vector<size_t>& js) {
  std::optional<DType> shared;
  size_t first = 0;
  for (size_t j : js) {
    if (!in[j].dtype) continue;
    if (shared && *shared != *in[j].dtype) {
      return Invalid(
          node.field,
          absl::StrCat("inputs[", j, "] is ", DTypeName(*in[j].dtype), ", inputs[", first, "] ",
                       DTypeName(*shared), "; cast one first (JAX promotes, the graph does not)"));
    }
    if (!shared) first = j;
    shared = in[j].dtype;
  }
  return shared;
}

// numpy's broadcast of the inputs `js`' shapes, or nullopt when one is unknown.
absl::StatusOr<std::optional<Shape>> Broadcast(const Node& node, const std::vector<TensorInfo>& in,
                                               const std::vector<size_t>& js) {
  Shape out;
  for (size_t j : js) {
    if (!in[j].known) return std::optional<Shape>();
    const Shape& s = in[j].shape;
    if (s.size() > out.size()) out.insert(out.begin(), s.size() - out.size(), 1);
    const size_t lead = out.size() - s.size();
    for (size_t d = 0; d < s.size(); ++d) {
      int64_t& o = out[lead + d];
      if (s[d] == o || s[d] == 1) continue;
      if (o != 1) {
        std::vector<std::string> shapes;
        for (size_t k : js)
          shapes.push_back(absl::StrCat("inputs[", k, "] ", ShapeString(in[k].shape)));
        return Invalid(node.field, absl::StrCat(absl::StrJoin(shapes, ", "),
                                                " do not broadcast together (numpy's rule: aligned "
                                                "from the right, each dim equal or 1)"));
      }
      o = s[d];
    }
  }
  return std::optional<Shape>(out);
}

absl::StatusOr<int> Axis(int axis, int rank, const std::string& where) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    return Invalid(where, absl::StrCat(axis, " is out of range for rank ", rank));
  return a;
}

// Every input broadcast together; the output in `dtype`.
absl::Status Elementwise(const Node& node, const std::vector<TensorInfo>& in,
                         std::optional<DType> dtype, std::vector<TensorInfo>* out) {
  std::vector<size_t> all(in.size());
  for (size_t j = 0; j < in.size(); ++j) all[j] = j;
  ASSIGN_OR_RETURN(const std::optional<Shape> shape, Broadcast(node, in, all));
  (*out)[0] = TensorInfo{shape.has_value(), shape.value_or(Shape{}), dtype};
  return absl::OkStatus();
}

absl::Status Reduce(const Node& node, const TensorInfo& x, TensorInfo* out, NodePlan* plan) {
  out->dtype = x.dtype;
  if (!x.known) return absl::OkStatus();
  const int rank = static_cast<int>(x.shape.size());
  std::vector<bool> reduced(rank, node.axes.empty());
  for (size_t j = 0; j < node.axes.size(); ++j) {
    const std::string where = absl::StrCat(node.field, ".reduce.axes[", j, "]");
    ASSIGN_OR_RETURN(const int a, Axis(node.axes[j], rank, where));
    if (reduced[a]) return Invalid(where, absl::StrCat(node.axes[j], " names axis ", a, " twice"));
    reduced[a] = true;
  }
  plan->keep = x.shape;
  Shape shape;
  for (int d = 0; d < rank; ++d) {
    if (reduced[d]) {
      if (x.shape[d] == 0 &&
          (node.reduce_op == ReduceOp::kMax || node.reduce_op == ReduceOp::kMin)) {
        return Invalid(node.field, absl::StrCat("max or min over axis ", d, " of x ",
                                                ShapeString(x.shape), ", which is empty"));
      }
      plan->keep[d] = 1;
    }
    if (!reduced[d] || node.keepdims) shape.push_back(plan->keep[d]);
  }
  *out = TensorInfo{true, shape, x.dtype};
  return absl::OkStatus();
}

absl::Status Slice(const Node& node, const TensorInfo& x, TensorInfo* out, NodePlan* plan) {
  out->dtype = x.dtype;
  if (!x.known) return absl::OkStatus();
  const size_t rank = x.shape.size();
  const std::string f = node.field + ".slice";
  if (node.start.size() != rank || node.limit.size() != rank ||
      (!node.stride.empty() && node.stride.size() != rank)) {
    return Invalid(f,
                   absl::StrCat("start [", absl::StrJoin(node.start, ", "), "], limit [",
                                absl::StrJoin(node.limit, ", "), "] and stride [",
                                absl::StrJoin(node.stride, ", "), "] want one entry per axis of x ",
                                ShapeString(x.shape), " (stride may be empty)"));
  }
  plan->stride = node.stride.empty() ? std::vector<int64_t>(rank, 1) : node.stride;
  Shape shape(rank);
  for (size_t d = 0; d < rank; ++d) {
    const int64_t dim = x.shape[d], start = node.start[d], limit = node.limit[d];
    if (start < 0 || start > dim) {
      return Invalid(absl::StrCat(f, ".start[", d, "]"),
                     absl::StrCat(start, " is outside [0, ", dim, "] (axis ", d, " of x ",
                                  ShapeString(x.shape), "; bounds are resolved by the client)"));
    }
    if (limit < start || limit > dim) {
      return Invalid(absl::StrCat(f, ".limit[", d, "]"),
                     absl::StrCat(limit, " is outside [start ", start, ", ", dim, "] (axis ", d,
                                  " of x ", ShapeString(x.shape), ")"));
    }
    shape[d] = (limit - start + plan->stride[d] - 1) / plan->stride[d];
  }
  *out = TensorInfo{true, shape, x.dtype};
  return absl::OkStatus();
}

}  // namespace

absl::Status InferNumpyNode(const Node& node, const std::vector<TensorInfo>& in,
                            std::vector<TensorInfo>* out, NodePlan* plan) {
  out->assign(node.outputs.size(), TensorInfo{});
  switch (node.kind) {
    case NodeKind::kBinary: {
      std::vector<size_t> js = {0};
      if (!node.scalar) js.push_back(1);
      for (size_t j : js) RETURN_IF_ERROR(RequireFloat(node, in, j, "binary"));
      ASSIGN_OR_RETURN(const std::optional<DType> dtype, SharedDType(node, in, js));
      return Elementwise(
          node, in, IsComparison(node.binary_op) ? std::optional<DType>(DType::kBool) : dtype, out);
    }
    case NodeKind::kUnary: {
      if (node.unary_op == UnaryOp::kLogicalNot) {
        if (in[0].dtype && *in[0].dtype != DType::kBool) {
          return Invalid(node.field + ".inputs[0]",
                         absl::StrCat("logical_not takes bool, got ", DTypeName(*in[0].dtype)));
        }
        (*out)[0] = in[0];
        (*out)[0].dtype = DType::kBool;
        return absl::OkStatus();
      }
      RETURN_IF_ERROR(RequireFloat(node, in, 0, "unary"));
      (*out)[0] = in[0];
      return absl::OkStatus();
    }
    case NodeKind::kWhere: {
      if (in[0].dtype && *in[0].dtype != DType::kBool) {
        return Invalid(
            node.field + ".inputs[0]",
            absl::StrCat("where's condition must be bool, got ", DTypeName(*in[0].dtype)));
      }
      std::vector<size_t> js;
      for (size_t j = 1; j < in.size(); ++j) {
        RETURN_IF_ERROR(RequireFloat(node, in, j, "where"));
        js.push_back(j);
      }
      ASSIGN_OR_RETURN(std::optional<DType> dtype, SharedDType(node, in, js));
      if (js.empty()) dtype = DType::kF32;  // two constants: JAX's float32
      return Elementwise(node, in, dtype, out);
    }
    case NodeKind::kReduce:
      RETURN_IF_ERROR(RequireFloat(node, in, 0, "reduce"));
      return Reduce(node, in[0], &(*out)[0], plan);
    case NodeKind::kEinsum:
      RETURN_IF_ERROR(RequireFloat(node, in, 0, "einsum"));
      RETURN_IF_ERROR(RequireFloat(node, in, 1, "einsum"));
      RETURN_IF_ERROR(SharedDType(node, in, {0, 1}).status());
      return InferEinsum(node, in[0], in[1], &(*out)[0], plan);
    case NodeKind::kSlice: return Slice(node, in[0], &(*out)[0], plan);
    case NodeKind::kSoftmax: {
      RETURN_IF_ERROR(RequireFloat(node, in, 0, "softmax"));
      (*out)[0] = in[0];
      if (!in[0].known) return absl::OkStatus();
      ASSIGN_OR_RETURN(plan->axis, Axis(node.axis, static_cast<int>(in[0].shape.size()),
                                        node.field + ".softmax.axis"));
      return absl::OkStatus();
    }
    case NodeKind::kParam:
      (*out)[0] = TensorInfo{true, node.shape, node.dtype};
      return absl::OkStatus();
    case NodeKind::kModule:
    case NodeKind::kReshape:
    case NodeKind::kSplit:
    case NodeKind::kConcatenate:
    case NodeKind::kAdd:
    case NodeKind::kScale:
    case NodeKind::kCast:
    case NodeKind::kTranspose:
    case NodeKind::kDropout:
    case NodeKind::kCausalMask:
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend: break;
  }
  return absl::InternalError(absl::StrCat(node.field, ": not a jax.numpy node"));
}

DType NumpyOutputDType(const Node& node, const std::vector<DType>& in) {
  switch (node.kind) {
    case NodeKind::kBinary: return IsComparison(node.binary_op) ? DType::kBool : in[0];
    case NodeKind::kUnary: return node.unary_op == UnaryOp::kLogicalNot ? DType::kBool : in[0];
    case NodeKind::kWhere: return in.size() > 1 ? in[1] : DType::kF32;
    case NodeKind::kParam: return node.dtype;
    case NodeKind::kReduce:
    case NodeKind::kEinsum:
    case NodeKind::kSlice:
    case NodeKind::kSoftmax:
    case NodeKind::kModule:
    case NodeKind::kReshape:
    case NodeKind::kSplit:
    case NodeKind::kConcatenate:
    case NodeKind::kAdd:
    case NodeKind::kScale:
    case NodeKind::kCast:
    case NodeKind::kTranspose:
    case NodeKind::kDropout:
    case NodeKind::kCausalMask:
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend: break;
  }
  return in.empty() ? DType::kF32 : in[0];
}

}  // namespace te::layers::graph
