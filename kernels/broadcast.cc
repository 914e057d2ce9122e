#include "kernels/broadcast.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// Row-major element strides of `shape`.
std::vector<int64_t> Strides(const Shape& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

absl::Status RequireFloatOrNull(const char* op, const char* name, const Tensor* t) {
  return t == nullptr ? absl::OkStatus() : RequireFloat(op, name, t);
}

}  // namespace

absl::StatusOr<BroadcastGeometry> BroadcastTo(const char* op, const Shape& out,
                                              const char* out_name,
                                              const std::vector<const Shape*>& operands,
                                              const std::vector<const char*>& names) {
  const int rank = static_cast<int>(out.size());
  const int n = static_cast<int>(operands.size());
  // Per operand, its strides aligned to out's dims (0: repeated or a constant).
  std::vector<std::vector<int64_t>> strides(n, std::vector<int64_t>(rank, 0));
  for (int k = 0; k < n; ++k) {
    if (operands[k] == nullptr) continue;
    const Shape& s = *operands[k];
    const int lead = rank - static_cast<int>(s.size());
    bool fits = lead >= 0;
    for (int d = 0; fits && d < static_cast<int>(s.size()); ++d) {
      fits = s[d] == out[lead + d] || s[d] == 1;
    }
    if (!fits) {
      return Invalid(
          op, absl::StrCat(names[k], " has shape ", ShapeString(s),
                           ", which does not broadcast to ", out_name, " ", ShapeString(out)));
    }
    const std::vector<int64_t> own = Strides(s);
    for (int d = 0; d < static_cast<int>(s.size()); ++d) {
      strides[k][lead + d] = s[d] == 1 ? 0 : own[d];
    }
  }
  // Merge: drop out's dims of 1; a dim joins the one before it when every
  // operand either repeats both or steps through both contiguously.
  BroadcastGeometry g;
  int last = -1;  // the merged dim being built
  for (int d = 0; d < rank; ++d) {
    if (out[d] == 1) continue;
    bool joins = last >= 0;
    for (int k = 0; joins && k < n; ++k) {
      const int64_t outer = g.strides[k][last];
      joins = (outer == 0 && strides[k][d] == 0) ||
              (outer != 0 && strides[k][d] != 0 && outer == strides[k][d] * out[d]);
    }
    if (joins) {
      g.dims[last] *= out[d];
      for (int k = 0; k < n; ++k) g.strides[k][last] = strides[k][d];
      continue;
    }
    if (g.rank == kBroadcastMaxRank) {
      return Invalid(op, absl::StrCat(out_name, " ", ShapeString(out), " needs more than ",
                                      kBroadcastMaxRank, " dims after merging"));
    }
    last = g.rank++;
    g.dims[last] = out[d];
    for (int k = 0; k < n; ++k) g.strides[k][last] = strides[k][d];
  }
  return g;
}

absl::StatusOr<BroadcastGeometry> CheckBinaryArgs(const BinaryArgs& args, const Tensor& a,
                                                  const Tensor& b, const Tensor* y) {
  constexpr char kOp[] = "Binary";
  RETURN_IF_ERROR(RequireFloat(kOp, "a", &a));
  if (!args.has_scalar) {
    RETURN_IF_ERROR(RequireFloat(kOp, "b", &b));
    if (b.dtype() != a.dtype()) {
      return Invalid(kOp, absl::StrCat("b has dtype ", DTypeName(b.dtype()), ", want a's ",
                                       DTypeName(a.dtype())));
    }
  }
  if (IsComparison(args.op)) {
    RETURN_IF_ERROR(RequireDType(kOp, "y", y, DType::kBool));
  } else {
    RETURN_IF_ERROR(RequireFloat(kOp, "y", y));
  }
  return BroadcastTo(kOp, y->shape(), "y", {&a.shape(), args.has_scalar ? nullptr : &b.shape()},
                     {"a", "b"});
}

absl::StatusOr<BroadcastGeometry> CheckBinaryBackwardArgs(const BinaryArgs& args, const Tensor& dy,
                                                          const Tensor& a, const Tensor& b,
                                                          const Tensor* da, const Tensor* db) {
  constexpr char kOp[] = "BinaryBackward";
  if (IsComparison(args.op)) return Invalid(kOp, "a comparison has no gradient");
  RETURN_IF_ERROR(RequireFloat(kOp, "dy", &dy));
  RETURN_IF_ERROR(RequireFloat(kOp, "a", &a));
  if (!args.has_scalar) {
    RETURN_IF_ERROR(RequireFloat(kOp, "b", &b));
    if (b.dtype() != a.dtype()) {
      return Invalid(kOp, absl::StrCat("b has dtype ", DTypeName(b.dtype()), ", want a's ",
                                       DTypeName(a.dtype())));
    }
  } else if (db != nullptr) {
    return Invalid(kOp, "db with a scalar operand (its tensor operand is a)");
  }
  RETURN_IF_ERROR(RequireFloatOrNull(kOp, "da", da));
  RETURN_IF_ERROR(RequireFloatOrNull(kOp, "db", db));
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"da", da}, {"db", db}}) {
    if (t == nullptr) continue;
    if (t->dtype() != DType::kF32 && t->dtype() != a.dtype()) {
      return Invalid(kOp, absl::StrCat(name, " has dtype ", DTypeName(t->dtype()),
                                       ", want float32 or a's ", DTypeName(a.dtype())));
    }
    RETURN_IF_ERROR(RequireShape(kOp, name, *t, dy.shape(), "dy's shape"));
  }
  return BroadcastTo(kOp, dy.shape(), "dy", {&a.shape(), args.has_scalar ? nullptr : &b.shape()},
                     {"a", "b"});
}

absl::Status CheckUnaryArgs(UnaryOp op, const Tensor& x, const Tensor* y) {
  constexpr char kOp[] = "Unary";
  if (op == UnaryOp::kLogicalNot) {
    RETURN_IF_ERROR(RequireDType(kOp, "x", &x, DType::kBool));
    RETURN_IF_ERROR(RequireDType(kOp, "y", y, DType::kBool));
  } else {
    RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
    RETURN_IF_ERROR(RequireFloat(kOp, "y", y));
  }
  return RequireSameCount(kOp, "y", *y, "x", x);
}

absl::Status CheckUnaryBackwardArgs(UnaryOp op, const Tensor& dy, const Tensor& x,
                                    const Tensor* dx) {
  constexpr char kOp[] = "UnaryBackward";
  if (op == UnaryOp::kLogicalNot) return Invalid(kOp, "logical_not has no gradient");
  RETURN_IF_ERROR(RequireFloat(kOp, "dy", &dy));
  RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
  RETURN_IF_ERROR(RequireFloat(kOp, "dx", dx));
  RETURN_IF_ERROR(RequireSameCount(kOp, "dy", dy, "x", x));
  return RequireSameCount(kOp, "dx", *dx, "x", x);
}

absl::StatusOr<BroadcastGeometry> CheckWhereArgs(const WhereArgs& args, const Tensor& cond,
                                                 const Tensor& x, const Tensor& y,
                                                 const Tensor* out) {
  constexpr char kOp[] = "Where";
  RETURN_IF_ERROR(RequireDType(kOp, "cond", &cond, DType::kBool));
  if (!args.has_x_scalar) RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
  if (!args.has_y_scalar) RETURN_IF_ERROR(RequireFloat(kOp, "y", &y));
  RETURN_IF_ERROR(RequireFloat(kOp, "out", out));
  return BroadcastTo(kOp, out->shape(), "out",
                     {&cond.shape(), args.has_x_scalar ? nullptr : &x.shape(),
                      args.has_y_scalar ? nullptr : &y.shape()},
                     {"cond", "x", "y"});
}

absl::StatusOr<ReduceGeometry> CheckReduceArgs(ReduceOp op, const Tensor& x, const Tensor* y) {
  constexpr char kOp[] = "Reduce";
  RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
  RETURN_IF_ERROR(RequireFloat(kOp, "y", y));
  const Shape& xs = x.shape();
  const Shape& ys = y->shape();
  bool fits = xs.size() == ys.size();
  for (size_t d = 0; fits && d < xs.size(); ++d) fits = ys[d] == xs[d] || ys[d] == 1;
  if (!fits) {
    return Invalid(kOp, absl::StrCat("y has shape ", ShapeString(ys), ", want x's ",
                                     ShapeString(xs), " with the reduced dims 1"));
  }
  if (x.numel() == 0 && (op == ReduceOp::kMax || op == ReduceOp::kMin) && y->numel() > 0) {
    return Invalid(kOp, "max or min over no elements");
  }
  // Dims of x of size 1 move nothing; neighbouring dims of one kind merge.
  const std::vector<int64_t> strides = Strides(xs);
  ReduceGeometry g;
  int kind_last = -1;  // 0 kept, 1 reduced
  for (size_t d = 0; d < xs.size(); ++d) {
    if (xs[d] == 1) continue;
    const int kind = ys[d] == 1 ? 1 : 0;
    int& rank = kind == 1 ? g.red_rank : g.out_rank;
    int64_t* dims = kind == 1 ? g.red_dims : g.out_dims;
    int64_t* st = kind == 1 ? g.red_strides : g.out_strides;
    if (kind == kind_last && rank > 0) {
      dims[rank - 1] *= xs[d];
      st[rank - 1] = strides[d];
    } else {
      if (rank == kBroadcastMaxRank) {
        return Invalid(kOp, absl::StrCat("x ", ShapeString(xs),
                                         " alternates kept and reduced dims "
                                         "more than ",
                                         kBroadcastMaxRank, " times"));
      }
      dims[rank] = xs[d];
      st[rank] = strides[d];
      ++rank;
    }
    kind_last = kind;
  }
  g.outputs = y->numel();
  g.reduced = g.outputs > 0 ? x.numel() / g.outputs : 0;
  return g;
}

namespace {

absl::StatusOr<SoftmaxGeometry> SoftmaxGeometryOf(const char* op, int axis, const Tensor& x) {
  const int rank = x.rank();
  if (axis < 0 || axis >= rank) {
    return Invalid(op,
                   absl::StrCat("axis ", axis, " is out of range for x ", ShapeString(x.shape())));
  }
  SoftmaxGeometry g;
  for (int d = 0; d < axis; ++d) g.outer *= x.dim(d);
  g.n = x.dim(axis);
  for (int d = axis + 1; d < rank; ++d) g.inner *= x.dim(d);
  return g;
}

}  // namespace

absl::StatusOr<SoftmaxGeometry> CheckSoftmaxArgs(int axis, const Tensor& x, const Tensor* y) {
  constexpr char kOp[] = "Softmax";
  RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
  RETURN_IF_ERROR(RequireFloat(kOp, "y", y));
  RETURN_IF_ERROR(RequireShape(kOp, "y", *y, x.shape(), "x's shape"));
  return SoftmaxGeometryOf(kOp, axis, x);
}

absl::StatusOr<SoftmaxGeometry> CheckSoftmaxBackwardArgs(int axis, const Tensor& dy,
                                                         const Tensor& y, const Tensor* dx) {
  constexpr char kOp[] = "SoftmaxBackward";
  RETURN_IF_ERROR(RequireFloat(kOp, "dy", &dy));
  RETURN_IF_ERROR(RequireFloat(kOp, "y", &y));
  RETURN_IF_ERROR(RequireFloat(kOp, "dx", dx));
  RETURN_IF_ERROR(RequireShape(kOp, "dy", dy, y.shape(), "y's shape"));
  RETURN_IF_ERROR(RequireShape(kOp, "dx", *dx, y.shape(), "y's shape"));
  return SoftmaxGeometryOf(kOp, axis, y);
}

absl::StatusOr<SliceGeometry> CheckSliceArgs(const char* op, const Tensor& from,
                                             const std::vector<int64_t>& start,
                                             const std::vector<int64_t>& stride, const Tensor* to,
                                             bool backward) {
  const char* from_name = backward ? "dx" : "x";
  const char* to_name = backward ? "dy" : "y";
  RETURN_IF_ERROR(RequireDefined(op, from_name, &from));
  RETURN_IF_ERROR(RequireDefined(op, to_name, to));
  if (backward) {
    RETURN_IF_ERROR(RequireFloat(op, from_name, &from));
    RETURN_IF_ERROR(RequireFloat(op, to_name, to));
  }
  if (to->dtype() != from.dtype()) {
    return Invalid(op, absl::StrCat(to_name, " has dtype ", DTypeName(to->dtype()), ", want ",
                                    from_name, "'s ", DTypeName(from.dtype())));
  }
  const int rank = from.rank();
  if (to->rank() != rank || static_cast<int>(start.size()) != rank ||
      static_cast<int>(stride.size()) != rank) {
    return Invalid(op,
                   absl::StrCat(from_name, " ", ShapeString(from.shape()), ", ", to_name, " ",
                                ShapeString(to->shape()), ", start [", absl::StrJoin(start, ", "),
                                "] and stride [", absl::StrJoin(stride, ", "), "] differ in rank"));
  }
  if (rank > kBroadcastMaxRank) {
    return Invalid(op, absl::StrCat("rank ", rank, " is over ", kBroadcastMaxRank));
  }
  const std::vector<int64_t> strides = Strides(from.shape());
  SliceGeometry g;
  g.rank = rank;
  for (int d = 0; d < rank; ++d) {
    const int64_t n = to->dim(d);
    const bool fits =
        stride[d] >= 1 && start[d] >= 0 &&
        (n == 0 || (start[d] < from.dim(d) && (from.dim(d) - 1 - start[d]) / stride[d] >= n - 1));
    if (!fits) {
      return Invalid(
          op, absl::StrCat("dim ", d, ": ", n, " elements from ", start[d], " by ", stride[d],
                           " do not fit ", from_name, " ", ShapeString(from.shape())));
    }
    g.dims[d] = n;
    g.x_strides[d] = strides[d] * stride[d];
    g.x_offset += start[d] * strides[d];
  }
  return g;
}

}  // namespace te
