// Index geometry and argument checks of ops.h's jax.numpy ops (Binary,
// Unary, Where, Reduce, Softmax, Slice and their backward), shared by the CPU
// reference and the CUDA launchers: both walk the same merged dims, and both
// reject the same calls with the same message (op_checks.h's wording).
//
// The geometries are plain structs of fixed-size arrays, so a CUDA launcher
// passes them to its kernel by value.
#ifndef TE_KERNELS_BROADCAST_H_
#define TE_KERNELS_BROADCAST_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/rng.h"  // TE_HOST_DEVICE
#include "kernels/tensor.h"

namespace te {

// Up to three operands (Where's cond, x, y) broadcast to an output. Output
// element i, unravelled over dims[0..rank) (row-major), reads operand k at
// sum_d index_d * strides[k][d]; a broadcast (repeated) dim has stride 0.
// Neighbouring dims that every operand broadcasts alike are merged and
// output dims of 1 dropped, so rank is the smallest that says the same.
struct BroadcastGeometry {
  static constexpr int kMaxOperands = 3;
  int rank = 0;
  int64_t dims[kBroadcastMaxRank] = {};
  int64_t strides[kMaxOperands][kBroadcastMaxRank] = {};
};

// Operand offsets of output element i: off[k] for k < n.
template <int N>
TE_HOST_DEVICE inline void BroadcastOffsets(const BroadcastGeometry& g, int64_t i, int64_t* off) {
  for (int k = 0; k < N; ++k) off[k] = 0;
  for (int d = g.rank - 1; d >= 0; --d) {
    const int64_t index = i % g.dims[d];
    i /= g.dims[d];
    for (int k = 0; k < N; ++k) off[k] += index * g.strides[k][d];
  }
}

// The geometry of `operands` (shapes; null: a constant, strides 0) broadcast
// to `out`. INVALID_ARGUMENT "<op>: <names[k]> has shape [..], which does not
// broadcast to <out_name> [..]", or past kBroadcastMaxRank merged dims.
absl::StatusOr<BroadcastGeometry> BroadcastTo(const char* op, const Shape& out,
                                              const char* out_name,
                                              const std::vector<const Shape*>& operands,
                                              const std::vector<const char*>& names);

// Reduce: output j (y's elements in order, over the kept dims) sums x at
// x_offset(j) + red_offset(r) for r over the reduced dims in row-major order.
struct ReduceGeometry {
  int out_rank = 0;
  int64_t out_dims[kBroadcastMaxRank] = {};
  int64_t out_strides[kBroadcastMaxRank] = {};  // x's strides along the kept dims
  int red_rank = 0;
  int64_t red_dims[kBroadcastMaxRank] = {};
  int64_t red_strides[kBroadcastMaxRank] = {};  // x's strides along the reduced dims
  int64_t outputs = 1;                          // numel(y)
  int64_t reduced = 1;                          // x's elements per output
};

TE_HOST_DEVICE inline int64_t Unravel(int rank, const int64_t* dims, const int64_t* strides,
                                      int64_t i) {
  int64_t offset = 0;
  for (int d = rank - 1; d >= 0; --d) {
    offset += (i % dims[d]) * strides[d];
    i /= dims[d];
  }
  return offset;
}

// Slice: y element i (unravelled over y's dims) is x[x_offset + sum index_d * x_strides[d]].
struct SliceGeometry {
  int rank = 0;
  int64_t dims[kBroadcastMaxRank] = {};
  int64_t x_strides[kBroadcastMaxRank] = {};  // x's stride times the slice's step
  int64_t x_offset = 0;
};

// Softmax's view of x: [outer, n, inner] around the axis.
struct SoftmaxGeometry {
  int64_t outer = 1, n = 1, inner = 1;
};

// ---- checks: each op's arguments, then its geometry ------------------------------
absl::StatusOr<BroadcastGeometry> CheckBinaryArgs(const BinaryArgs& args, const Tensor& a,
                                                  const Tensor& b, const Tensor* y);
absl::StatusOr<BroadcastGeometry> CheckBinaryBackwardArgs(const BinaryArgs& args, const Tensor& dy,
                                                          const Tensor& a, const Tensor& b,
                                                          const Tensor* da, const Tensor* db);
absl::Status CheckUnaryArgs(UnaryOp op, const Tensor& x, const Tensor* y);
absl::Status CheckUnaryBackwardArgs(UnaryOp op, const Tensor& dy, const Tensor& x,
                                    const Tensor* dx);
absl::StatusOr<BroadcastGeometry> CheckWhereArgs(const WhereArgs& args, const Tensor& cond,
                                                 const Tensor& x, const Tensor& y,
                                                 const Tensor* out);
absl::StatusOr<ReduceGeometry> CheckReduceArgs(ReduceOp op, const Tensor& x, const Tensor* y);
absl::StatusOr<SoftmaxGeometry> CheckSoftmaxArgs(int axis, const Tensor& x, const Tensor* y);
absl::StatusOr<SoftmaxGeometry> CheckSoftmaxBackwardArgs(int axis, const Tensor& dy,
                                                         const Tensor& y, const Tensor* dx);
// For Slice, `from` is x and `to` y; for SliceBackward, `from` is dx and `to` dy.
absl::StatusOr<SliceGeometry> CheckSliceArgs(const char* op, const Tensor& from,
                                             const std::vector<int64_t>& start,
                                             const std::vector<int64_t>& stride, const Tensor* to,
                                             bool backward);

}  // namespace te

#endif  // TE_KERNELS_BROADCAST_H_
