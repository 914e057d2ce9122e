// The glue ops of a graph (reshape, split, concatenate, add, scale, cast,
// transpose, dropout, causal_mask): forward and backward on kernels/ops.h
// alone (Permute, Copy, Axpby, Cast, Fill, the dropout ops), so they run on
// every backend. Concatenation and splits along an inner axis move that axis
// outermost with Permute, where each part is one contiguous block.
#include <algorithm>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

// A permutation with size-1 dims dropped and runs of dims that stay
// neighbours merged: the same data movement at the smallest rank.
struct MergedPermute {
  Shape x;                // merged dims, in x's order
  std::vector<int> perm;  // y's merged dims as indices into x
  Shape y;
};

MergedPermute Merge(const Shape& shape, const std::vector<int>& perm) {
  std::vector<int> kept_index(shape.size(), -1);
  int kept = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1) kept_index[d] = kept++;
  }
  std::vector<int> order;  // y's kept dims, as kept indices of x
  for (int p : perm) {
    if (kept_index[p] >= 0) order.push_back(kept_index[p]);
  }
  std::vector<int> kept_dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1) kept_dims.push_back(static_cast<int>(d));
  }
  // Groups of y's dims that are consecutive in x: [first kept index, last].
  std::vector<std::pair<int, int>> groups;
  for (int k : order) {
    if (!groups.empty() && groups.back().second + 1 == k) {
      groups.back().second = k;
    } else {
      groups.push_back({k, k});
    }
  }
  std::vector<int> by_start(groups.size());
  std::iota(by_start.begin(), by_start.end(), 0);
  std::sort(by_start.begin(), by_start.end(),
            [&](int a, int b) { return groups[a].first < groups[b].first; });
  std::vector<int> x_position(groups.size());
  MergedPermute m;
  for (size_t i = 0; i < by_start.size(); ++i) {
    const auto [first, last] = groups[by_start[i]];
    int64_t size = 1;
    for (int k = first; k <= last; ++k) size *= shape[kept_dims[k]];
    m.x.push_back(size);
    x_position[by_start[i]] = static_cast<int>(i);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    m.perm.push_back(x_position[g]);
    m.y.push_back(m.x[x_position[g]]);
  }
  return m;
}

// Dims before and after `axis`, flattened: x as [outer, x.dim(axis), inner].
std::pair<int64_t, int64_t> OuterInner(const Shape& shape, int axis) {
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < axis; ++d) outer *= shape[d];
  for (size_t d = axis + 1; d < shape.size(); ++d) inner *= shape[d];
  return {outer, inner};
}

absl::StatusOr<Tensor> Allocated(Ops& ops, DType dtype, const Shape& shape) {
  return ops.Allocate(dtype, shape);
}

// Inverted dropout with a mask shared along `dims` (nn.Dropout's
// broadcast_dims): the mask is drawn for x's shape with those dims set to 1
// (element i of that shape kept iff DropoutUniform(seed, i) >= rate, as
// Ops::DropoutForward draws it), repeated along them, and applied as
// DropoutBackward applies a mask: y = x * mask / (1 - rate).
absl::Status BroadcastDropout(Ops& ops, float rate, uint64_t seed, const std::vector<int>& dims,
                              const Tensor& x, Tensor* y, DropoutSaved* saved) {
  const Shape& shape = x.shape();
  Shape drawn = shape;
  for (int d : dims) drawn[d] = 1;
  ASSIGN_OR_RETURN(Tensor ones, Allocated(ops, DType::kF32, drawn));
  RETURN_IF_ERROR(ops.Fill(1.0f, &ones));
  ASSIGN_OR_RETURN(Tensor scaled, Allocated(ops, DType::kF32, drawn));
  ASSIGN_OR_RETURN(Tensor drawn_mask, Allocated(ops, DType::kBool, drawn));
  RETURN_IF_ERROR(ops.DropoutForward(rate, seed, ones, &scaled, &drawn_mask));

  // Laid out as [broadcast dims..., other dims...], the drawn mask (size 1 on
  // the broadcast dims, so moving them is free) repeats `copies` times as
  // whole blocks: copied by doubling, log2(copies) copies.
  std::vector<int> front = dims;  // x's dims in that layout
  for (int d = 0; d < static_cast<int>(shape.size()); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) front.push_back(d);
  }
  const int64_t block = drawn_mask.numel();
  const int64_t copies = x.numel() / block;
  ASSIGN_OR_RETURN(Tensor repeated, Allocated(ops, DType::kBool, {x.numel()}));
  Tensor first = repeated.Slice0(0, block);
  RETURN_IF_ERROR(ops.Copy(drawn_mask.Reshaped({block}), &first));
  for (int64_t have = 1; have < copies;) {
    const int64_t more = std::min(have, copies - have);
    Tensor to = repeated.Slice0(have * block, (have + more) * block);
    RETURN_IF_ERROR(ops.Copy(repeated.Slice0(0, more * block), &to));
    have += more;
  }
  Shape front_shape;
  for (int d : front) front_shape.push_back(shape[d]);
  std::vector<int> back(shape.size());  // mask.dim(i) = front_shape[back[i]]
  for (size_t i = 0; i < front.size(); ++i) back[front[i]] = static_cast<int>(i);
  ASSIGN_OR_RETURN(Tensor mask, Allocated(ops, DType::kBool, shape));
  RETURN_IF_ERROR(PermuteAnyRank(ops, repeated.Reshaped(front_shape), back, &mask));

  ASSIGN_OR_RETURN(*y, Allocated(ops, x.dtype(), shape));
  RETURN_IF_ERROR(ops.DropoutBackward(rate, x, mask, y));
  saved->rate = rate;
  saved->mask = std::move(mask);
  return absl::OkStatus();
}

absl::Status DropoutForwardNode(Ops& ops, const Node& node, const NodePlan& plan, const Tensor& x,
                                bool deterministic, uint64_t seed, Tensor* y,
                                DropoutSaved* saved) {
  std::vector<int> dims;  // broadcast dims that repeat anything
  for (int d : plan.broadcast_dims) {
    if (x.dim(d) > 1) dims.push_back(d);
  }
  if (dims.empty() || deterministic || node.rate <= 0.0f) {
    return Dropout(ops, node.rate, deterministic, seed, x, y, saved);
  }
  return BroadcastDropout(ops, node.rate, seed, dims, x, y, saved);
}

}  // namespace

int MergedPermuteRank(const Shape& shape, const std::vector<int>& perm) {
  return static_cast<int>(Merge(shape, perm).x.size());
}

absl::Status PermuteAnyRank(Ops& ops, const Tensor& x, const std::vector<int>& perm, Tensor* y) {
  const MergedPermute m = Merge(x.shape(), perm);
  if (m.x.empty()) return ops.Copy(x, y);  // one element
  Tensor out = y->Reshaped(m.y);
  return ops.Permute(x.Reshaped(m.x), m.perm, &out);
}

absl::StatusOr<Tensor> Zeros(Ops& ops, DType dtype, const Shape& shape) {
  ASSIGN_OR_RETURN(Tensor t, Allocated(ops, dtype, shape));
  RETURN_IF_ERROR(ops.Fill(0.0f, &t));
  return t;
}

absl::StatusOr<std::vector<Tensor>> SplitAlong(Ops& ops, const Tensor& x, int axis,
                                               const std::vector<int64_t>& sizes) {
  const auto [outer, inner] = OuterInner(x.shape(), axis);
  auto part_shape = [&](int64_t size) {
    Shape s = x.shape();
    s[axis] = size;
    return s;
  };
  std::vector<Tensor> parts;
  if (outer == 1) {  // each part is a contiguous block of x: views
    const Tensor flat = x.Reshaped({x.numel()});
    int64_t offset = 0;
    for (int64_t size : sizes) {
      parts.push_back(flat.Slice0(offset * inner, (offset + size) * inner).Reshaped(part_shape(size)));
      offset += size;
    }
    return parts;
  }
  const bool equal = std::all_of(sizes.begin(), sizes.end(),
                                 [&](int64_t s) { return s == sizes[0]; });
  if (equal) {  // [outer, n, size, inner] -> n parts in one Permute
    const int64_t n = static_cast<int64_t>(sizes.size());
    ASSIGN_OR_RETURN(std::vector<Tensor> pieces,
                     SplitAxis(ops, x.Reshaped({outer, n, sizes[0], inner}), 1));
    for (Tensor& p : pieces) parts.push_back(p.Reshaped(part_shape(sizes[0])));
    return parts;
  }
  // [outer, total, inner] -> [total, outer, inner], then each row block back.
  const int64_t total = x.dim(axis);
  ASSIGN_OR_RETURN(Tensor front, Allocated(ops, x.dtype(), {total, outer, inner}));
  RETURN_IF_ERROR(PermuteAnyRank(ops, x.Reshaped({outer, total, inner}), {1, 0, 2}, &front));
  int64_t offset = 0;
  for (int64_t size : sizes) {
    ASSIGN_OR_RETURN(Tensor part, Allocated(ops, x.dtype(), part_shape(size)));
    RETURN_IF_ERROR(
        PermuteAnyRank(ops, front.Slice0(offset, offset + size), {1, 0, 2}, &part));
    parts.push_back(std::move(part));
    offset += size;
  }
  return parts;
}

absl::StatusOr<Tensor> Concatenate(Ops& ops, const std::vector<Tensor>& parts, int axis) {
  Shape shape = parts[0].shape();
  int64_t total = 0;
  for (const Tensor& p : parts) {
    Shape want = shape;
    want[axis] = p.rank() == parts[0].rank() ? p.dim(axis) : -1;
    if (p.shape() != want || p.dtype() != parts[0].dtype()) {
      return absl::InternalError(absl::StrCat("concatenate: part ", ShapeString(p.shape()), " ",
                                              DTypeName(p.dtype()), " does not fit ",
                                              ShapeString(shape)));
    }
    total += p.dim(axis);
  }
  shape[axis] = total;
  const auto [outer, inner] = OuterInner(shape, axis);
  ASSIGN_OR_RETURN(Tensor out, Allocated(ops, parts[0].dtype(), shape));
  if (outer == 1) {  // each part fills one contiguous block
    Tensor flat = out.Reshaped({out.numel()});
    int64_t offset = 0;
    for (const Tensor& p : parts) {
      Tensor slot = flat.Slice0(offset * inner, (offset + p.dim(axis)) * inner);
      RETURN_IF_ERROR(ops.Copy(p, &slot));
      offset += p.dim(axis);
    }
    return out;
  }
  // Each part [outer, a, inner] lands as rows of front [total, outer, inner].
  ASSIGN_OR_RETURN(Tensor front, Allocated(ops, parts[0].dtype(), {total, outer, inner}));
  int64_t offset = 0;
  for (const Tensor& p : parts) {
    const int64_t a = p.dim(axis);
    Tensor slot = front.Slice0(offset, offset + a);
    RETURN_IF_ERROR(PermuteAnyRank(ops, p.Reshaped({outer, a, inner}), {1, 0, 2}, &slot));
    offset += a;
  }
  RETURN_IF_ERROR(PermuteAnyRank(ops, front, {1, 0, 2}, &out));
  return out;
}

absl::Status GlueForward(Ops& ops, const Node& node, const NodePlan& plan,
                         const std::vector<Tensor>& in, bool deterministic, uint64_t seed,
                         std::vector<Tensor>* out, DropoutSaved* dropout) {
  out->assign(node.outputs.size(), Tensor());
  const Tensor& x = in[0];
  switch (node.kind) {
    case NodeKind::kReshape:
      (*out)[0] = x.Reshaped(plan.to);
      return absl::OkStatus();
    case NodeKind::kSplit: {
      const std::vector<int64_t> sizes(node.parts, x.dim(plan.axis) / node.parts);
      ASSIGN_OR_RETURN(*out, SplitAlong(ops, x, plan.axis, sizes));
      return absl::OkStatus();
    }
    case NodeKind::kConcatenate: {
      ASSIGN_OR_RETURN((*out)[0], Concatenate(ops, in, plan.axis));
      return absl::OkStatus();
    }
    case NodeKind::kAdd: {
      ASSIGN_OR_RETURN(Tensor sum, Allocated(ops, x.dtype(), x.shape()));
      RETURN_IF_ERROR(ops.Axpby(1.0f, x, 1.0f, in[1], &sum));
      for (size_t j = 2; j < in.size(); ++j) RETURN_IF_ERROR(ops.Axpby(1.0f, sum, 1.0f, in[j], &sum));
      (*out)[0] = std::move(sum);
      return absl::OkStatus();
    }
    case NodeKind::kScale: {
      // A Python scalar times an array takes the array's dtype (JAX's weak
      // typing): the factor is rounded to it first.
      ASSIGN_OR_RETURN((*out)[0], Allocated(ops, x.dtype(), x.shape()));
      return ops.Axpby(RoundTo(x.dtype(), node.factor), x, 0.0f, x, &(*out)[0]);
    }
    case NodeKind::kCast: {
      ASSIGN_OR_RETURN((*out)[0], CastTo(ops, x, node.dtype));
      return absl::OkStatus();
    }
    case NodeKind::kTranspose: {
      Shape shape;
      for (int a : plan.perm) shape.push_back(x.dim(a));
      ASSIGN_OR_RETURN((*out)[0], Allocated(ops, x.dtype(), shape));
      return PermuteAnyRank(ops, x, plan.perm, &(*out)[0]);
    }
    case NodeKind::kDropout:
      return DropoutForwardNode(ops, node, plan, x, deterministic, seed, &(*out)[0], dropout);
    case NodeKind::kCausalMask:  // read by its modules as "causal, no padding"
      return absl::OkStatus();
    case NodeKind::kModule:  // these hold variables: graph.cc runs them itself
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend:
    case NodeKind::kBinary:  // jax.numpy's: graph_numpy.cc
    case NodeKind::kUnary:
    case NodeKind::kWhere:
    case NodeKind::kReduce:
    case NodeKind::kEinsum:
    case NodeKind::kSlice:
    case NodeKind::kSoftmax:
    case NodeKind::kParam:
      break;
  }
  return absl::InternalError(absl::StrCat(node.field, ": not a glue node"));
}

absl::Status GlueBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                          const DropoutSaved& dropout, const std::vector<Tensor>& dout,
                          std::vector<Tensor>* din) {
  din->assign(node.inputs.size(), Tensor());
  const TensorInfo& x = shapes.tensors[node.inputs[0]];
  const Tensor& dy = dout[0];
  switch (node.kind) {
    case NodeKind::kSplit: {  // the parts' gradients side by side; a missing one is zeros
      if (std::none_of(dout.begin(), dout.end(), [](const Tensor& t) { return t.defined(); })) {
        return absl::OkStatus();
      }
      std::vector<Tensor> parts = dout;
      for (size_t j = 0; j < parts.size(); ++j) {
        if (parts[j].defined()) continue;
        const TensorInfo& part = shapes.tensors[node.outputs[j]];
        ASSIGN_OR_RETURN(parts[j], Zeros(ops, *part.dtype, part.shape));
      }
      ASSIGN_OR_RETURN((*din)[0], Concatenate(ops, parts, plan.axis));
      return absl::OkStatus();
    }
    case NodeKind::kCausalMask:  // a mask has no gradient
      return absl::OkStatus();
    case NodeKind::kReshape:  // these map dy alone: below, once there is one
    case NodeKind::kConcatenate:
    case NodeKind::kAdd:
    case NodeKind::kScale:
    case NodeKind::kCast:
    case NodeKind::kTranspose:
    case NodeKind::kDropout:
    case NodeKind::kModule:  // not glue: graph.cc runs these itself
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend:
    case NodeKind::kBinary:
    case NodeKind::kUnary:
    case NodeKind::kWhere:
    case NodeKind::kReduce:
    case NodeKind::kEinsum:
    case NodeKind::kSlice:
    case NodeKind::kSoftmax:
    case NodeKind::kParam:
      break;
  }
  if (!dy.defined()) return absl::OkStatus();
  switch (node.kind) {
    case NodeKind::kReshape:
      (*din)[0] = dy.Reshaped(x.shape);
      return absl::OkStatus();
    case NodeKind::kConcatenate: {
      std::vector<int64_t> sizes;
      for (int id : node.inputs) sizes.push_back(shapes.tensors[id].shape[plan.axis]);
      ASSIGN_OR_RETURN(*din, SplitAlong(ops, dy, plan.axis, sizes));
      return absl::OkStatus();
    }
    case NodeKind::kAdd:  // d(a + b)/da = d(a + b)/db = 1
      din->assign(node.inputs.size(), dy);
      return absl::OkStatus();
    case NodeKind::kScale: {
      ASSIGN_OR_RETURN((*din)[0], Allocated(ops, *x.dtype, x.shape));
      return ops.Axpby(RoundTo(*x.dtype, node.factor), dy, 0.0f, dy, &(*din)[0]);
    }
    case NodeKind::kCast: {
      ASSIGN_OR_RETURN((*din)[0], CastTo(ops, dy, *x.dtype));
      return absl::OkStatus();
    }
    case NodeKind::kTranspose: {  // the inverse permutation
      std::vector<int> inverse(plan.perm.size());
      for (size_t i = 0; i < plan.perm.size(); ++i) inverse[plan.perm[i]] = static_cast<int>(i);
      ASSIGN_OR_RETURN((*din)[0], Allocated(ops, dy.dtype(), x.shape));
      return PermuteAnyRank(ops, dy, inverse, &(*din)[0]);
    }
    case NodeKind::kDropout:
      return DropoutGrad(ops, dropout, dy, &(*din)[0]);
    case NodeKind::kSplit:  // answered above
    case NodeKind::kCausalMask:
    case NodeKind::kModule:  // not glue: graph.cc runs these itself
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend:
    case NodeKind::kBinary:
    case NodeKind::kUnary:
    case NodeKind::kWhere:
    case NodeKind::kReduce:
    case NodeKind::kEinsum:
    case NodeKind::kSlice:
    case NodeKind::kSoftmax:
    case NodeKind::kParam:
      break;
  }
  return absl::InternalError(absl::StrCat(node.field, ": not a glue node"));
}

}  // namespace te::layers::graph
