// Forward and backward of jax.numpy's nodes on ops.h's Binary, Unary,
// Where, Reduce, Softmax and Slice (einsum: graph_einsum.cc), with the
// gradients JAX gives:
//  * a broadcast operand's gradient is the output's summed over the dims it
//    was repeated along (its partial computed in float32 first, then
//    Reduce'd to its shape and dtype);
//  * maximum / minimum send it to the chosen operand, half to each on a tie
//    (jax.lax.max and min; ops.h's BinaryBackward);
//    comparisons, logical_not and where's condition get none;
//  * max / min reductions share it equally among tied extrema: dx = dy / count
//    where x equals the extremum, 0 elsewhere;
//  * constants are rounded to the tensor operand's dtype first (JAX's weak
//    typing: `x + 1.0` on bfloat16 adds bfloat16(1.0)).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

// `shape` left-padded with 1s to `rank` dims: an operand's shape aligned
// with the broadcast output's.
Shape Padded(const Shape& shape, size_t rank) {
  Shape s(rank - shape.size(), 1);
  s.insert(s.end(), shape.begin(), shape.end());
  return s;
}

// The partial `full` (the output's shape) summed to an operand of `shape`
// and `dtype`: as it is when nothing was broadcast, else a Reduce over the
// repeated dims.
absl::StatusOr<Tensor> SumToShape(Ops& ops, const Tensor& full, const Shape& shape, DType dtype) {
  if (full.shape() == shape) return CastTo(ops, full, dtype);
  const Shape keep = Padded(shape, full.shape().size());
  ASSIGN_OR_RETURN(Tensor sum, ops.Allocate(dtype, keep));
  RETURN_IF_ERROR(ops.Reduce(ReduceOp::kSum, full, &sum));
  return sum.Reshaped(shape);
}

// The dtype of a partial gradient at the output's shape: float32 when it is
// summed down afterwards, so the sum rounds once.
DType PartialDType(const Shape& out, const Shape& operand, DType dtype) {
  return out == operand ? dtype : DType::kF32;
}

BinaryArgs ArgsOf(const Node& node, DType dtype) {
  BinaryArgs args;
  args.op = node.binary_op;
  if (node.scalar) {
    args.has_scalar = true;
    args.scalar = RoundTo(dtype, static_cast<float>(*node.scalar));
    args.scalar_first = node.scalar_first;
  }
  return args;
}

WhereArgs WhereArgsOf(const Node& node, DType dtype) {
  WhereArgs args;
  if (node.where_x) {
    args.has_x_scalar = true;
    args.x_scalar = RoundTo(dtype, static_cast<float>(*node.where_x));
  }
  if (node.where_y) {
    args.has_y_scalar = true;
    args.y_scalar = RoundTo(dtype, static_cast<float>(*node.where_y));
  }
  return args;
}

bool IsLinear(BinaryOp op) { return op == BinaryOp::kAdd || op == BinaryOp::kSubtract; }

bool IsFloatTensor(const TensorInfo& t) {
  return t.dtype &&
         (*t.dtype == DType::kF32 || *t.dtype == DType::kBF16 || *t.dtype == DType::kF16);
}

// max / min's gradient: dy [keep] shared among the elements of x equal to the
// extremum y [keep]: dx = where(x == y, dy / count, 0).
absl::StatusOr<Tensor> ExtremumGrad(Ops& ops, const Tensor& x, const Tensor& y, const Tensor& dy) {
  ASSIGN_OR_RETURN(Tensor ties, ops.Allocate(DType::kBool, x.shape()));
  RETURN_IF_ERROR(ops.Binary(BinaryArgs{BinaryOp::kEqual}, x, y, &ties));
  ASSIGN_OR_RETURN(Tensor ones, ops.Allocate(DType::kF32, x.shape()));
  RETURN_IF_ERROR(ops.Where(WhereArgs{true, 1.0f, true, 0.0f}, ties, Tensor(), Tensor(), &ones));
  ASSIGN_OR_RETURN(Tensor count, ops.Allocate(DType::kF32, y.shape()));
  RETURN_IF_ERROR(ops.Reduce(ReduceOp::kSum, ones, &count));
  ASSIGN_OR_RETURN(const Tensor dy32, CastTo(ops, dy, DType::kF32));
  ASSIGN_OR_RETURN(Tensor share, ops.Allocate(DType::kF32, y.shape()));
  RETURN_IF_ERROR(ops.Binary(BinaryArgs{BinaryOp::kDivide}, dy32, count, &share));
  ASSIGN_OR_RETURN(Tensor dx, ops.Allocate(x.dtype(), x.shape()));
  WhereArgs zero_else;
  zero_else.has_y_scalar = true;
  RETURN_IF_ERROR(ops.Where(zero_else, ties, share, Tensor(), &dx));
  return dx;
}

}  // namespace

int64_t NumpySaved::bytes() const {
  int64_t total = 0;
  for (const Tensor& t : kept) total += static_cast<int64_t>(t.nbytes());
  return total;
}

absl::Status NumpyForward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                          const std::vector<Tensor>& in, std::vector<Tensor>* out,
                          NumpySaved* saved) {
  out->assign(node.outputs.size(), Tensor());
  const TensorInfo& info = shapes.tensors[node.outputs[0]];
  Tensor& y = (*out)[0];
  switch (node.kind) {
    case NodeKind::kBinary: {
      ASSIGN_OR_RETURN(y, ops.Allocate(*info.dtype, info.shape));
      RETURN_IF_ERROR(
          ops.Binary(ArgsOf(node, in[0].dtype()), in[0], node.scalar ? Tensor() : in[1], &y));
      // add and subtract differentiate without their operands.
      if (!IsLinear(node.binary_op)) saved->kept = in;
      return absl::OkStatus();
    }
    case NodeKind::kUnary: {
      ASSIGN_OR_RETURN(y, ops.Allocate(*info.dtype, info.shape));
      RETURN_IF_ERROR(ops.Unary(node.unary_op, in[0], &y));
      saved->kept = in;
      return absl::OkStatus();
    }
    case NodeKind::kWhere: {
      ASSIGN_OR_RETURN(y, ops.Allocate(*info.dtype, info.shape));
      size_t j = 1;
      const Tensor x = node.where_x ? Tensor() : in[j++];
      const Tensor other = node.where_y ? Tensor() : in[j++];
      RETURN_IF_ERROR(ops.Where(WhereArgsOf(node, *info.dtype), in[0], x, other, &y));
      saved->kept = {in[0]};  // the condition: the backward routes dy by it
      return absl::OkStatus();
    }
    case NodeKind::kReduce: {
      ASSIGN_OR_RETURN(Tensor keep, ops.Allocate(*info.dtype, plan.keep));
      RETURN_IF_ERROR(ops.Reduce(node.reduce_op, in[0], &keep));
      y = keep.Reshaped(info.shape);
      if (node.reduce_op == ReduceOp::kMax || node.reduce_op == ReduceOp::kMin) {
        saved->kept = {in[0], keep};
      }
      return absl::OkStatus();
    }
    case NodeKind::kEinsum:
      return EinsumForward(ops, node, plan, in[0], in[1], info.shape, &y, saved);
    case NodeKind::kSlice: {
      ASSIGN_OR_RETURN(y, ops.Allocate(*info.dtype, info.shape));
      return ops.Slice(in[0], node.start, plan.stride, &y);
    }
    case NodeKind::kSoftmax: {
      ASSIGN_OR_RETURN(y, ops.Allocate(*info.dtype, info.shape));
      RETURN_IF_ERROR(ops.Softmax(node.log, plan.axis, in[0], &y));
      saved->kept = {y};
      return absl::OkStatus();
    }
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
    case NodeKind::kAttend:
    case NodeKind::kParam: break;
  }
  return absl::InternalError(absl::StrCat(node.field, ": not a jax.numpy node"));
}

absl::Status NumpyBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                           const NumpySaved& saved, const std::vector<Tensor>& dout,
                           std::vector<Tensor>* din) {
  din->assign(node.inputs.size(), Tensor());
  const Tensor& dy = dout[0];
  if (!dy.defined()) return absl::OkStatus();
  const TensorInfo& out = shapes.tensors[node.outputs[0]];
  auto input = [&](size_t j) -> const TensorInfo& { return shapes.tensors[node.inputs[j]]; };
  switch (node.kind) {
    case NodeKind::kBinary: {
      if (IsComparison(node.binary_op)) return absl::OkStatus();
      const size_t n = node.scalar ? 1 : 2;
      if (IsLinear(node.binary_op)) {
        // d(a + b) = dy, dy; d(a - b) = dy, -dy (and -dy for `scalar - x`).
        for (size_t j = 0; j < n; ++j) {
          const bool negated = node.binary_op == BinaryOp::kSubtract &&
                               (j == 1 || (node.scalar && node.scalar_first));
          Tensor partial = dy;
          if (negated) {
            ASSIGN_OR_RETURN(partial, ops.Allocate(dy.dtype(), dy.shape()));
            RETURN_IF_ERROR(ops.Axpby(-1.0f, dy, 0.0f, dy, &partial));
          }
          ASSIGN_OR_RETURN((*din)[j], SumToShape(ops, partial, input(j).shape, *input(j).dtype));
        }
        return absl::OkStatus();
      }
      const BinaryArgs args = ArgsOf(node, saved.kept[0].dtype());
      std::vector<Tensor> partial(2);
      for (size_t j = 0; j < n; ++j) {
        ASSIGN_OR_RETURN(
            partial[j],
            ops.Allocate(PartialDType(out.shape, input(j).shape, *input(j).dtype), out.shape));
      }
      RETURN_IF_ERROR(ops.BinaryBackward(args, dy, saved.kept[0], n > 1 ? saved.kept[1] : Tensor(),
                                         &partial[0], n > 1 ? &partial[1] : nullptr));
      for (size_t j = 0; j < n; ++j) {
        ASSIGN_OR_RETURN((*din)[j], SumToShape(ops, partial[j], input(j).shape, *input(j).dtype));
      }
      return absl::OkStatus();
    }
    case NodeKind::kUnary: {
      if (node.unary_op == UnaryOp::kLogicalNot) return absl::OkStatus();
      ASSIGN_OR_RETURN((*din)[0], ops.Allocate(*input(0).dtype, input(0).shape));
      return ops.UnaryBackward(node.unary_op, dy, saved.kept[0], &(*din)[0]);
    }
    case NodeKind::kWhere: {
      // x's gradient where the condition holds, y's where it does not.
      size_t j = 1;
      for (const bool is_x : {true, false}) {
        if (is_x ? node.where_x.has_value() : node.where_y.has_value()) continue;
        const TensorInfo& operand = input(j);
        ASSIGN_OR_RETURN(
            Tensor partial,
            ops.Allocate(PartialDType(out.shape, operand.shape, *operand.dtype), out.shape));
        WhereArgs args;
        (is_x ? args.has_y_scalar : args.has_x_scalar) = true;  // 0 on the other side
        RETURN_IF_ERROR(
            ops.Where(args, saved.kept[0], is_x ? dy : Tensor(), is_x ? Tensor() : dy, &partial));
        ASSIGN_OR_RETURN((*din)[j], SumToShape(ops, partial, operand.shape, *operand.dtype));
        ++j;
      }
      return absl::OkStatus();
    }
    case NodeKind::kReduce: {
      const TensorInfo& x = input(0);
      const Tensor dkeep = dy.Reshaped(plan.keep);
      if (node.reduce_op == ReduceOp::kMax || node.reduce_op == ReduceOp::kMin) {
        ASSIGN_OR_RETURN((*din)[0], ExtremumGrad(ops, saved.kept[0], saved.kept[1], dkeep));
        return absl::OkStatus();
      }
      // sum: dy repeated over the reduced dims; mean: divided by their count.
      BinaryArgs args;
      args.has_scalar = true;
      args.op = node.reduce_op == ReduceOp::kMean ? BinaryOp::kDivide : BinaryOp::kMultiply;
      args.scalar = node.reduce_op == ReduceOp::kMean
                        ? static_cast<float>(NumElements(x.shape) /
                                             std::max<int64_t>(1, NumElements(plan.keep)))
                        : 1.0f;
      ASSIGN_OR_RETURN((*din)[0], ops.Allocate(*x.dtype, x.shape));
      return ops.Binary(args, dkeep, Tensor(), &(*din)[0]);
    }
    case NodeKind::kEinsum: return EinsumBackward(ops, node, plan, shapes, saved, dy, din);
    case NodeKind::kSlice: {
      if (!IsFloatTensor(input(0))) return absl::OkStatus();  // ids, masks: no gradient
      ASSIGN_OR_RETURN((*din)[0], ops.Allocate(*input(0).dtype, input(0).shape));
      return ops.SliceBackward(dy, node.start, plan.stride, &(*din)[0]);
    }
    case NodeKind::kSoftmax: {
      ASSIGN_OR_RETURN((*din)[0], ops.Allocate(*input(0).dtype, input(0).shape));
      return ops.SoftmaxBackward(node.log, plan.axis, dy, saved.kept[0], &(*din)[0]);
    }
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
    case NodeKind::kAttend:
    case NodeKind::kParam: break;
  }
  return absl::InternalError(absl::StrCat(node.field, ": not a jax.numpy node"));
}

}  // namespace te::layers::graph
