// jax.numpy's ops on the CPU reference: broadcasting elementwise ops
// (Binary, Unary, Where and their backward), Reduce, Softmax and Slice, over
// kernels/broadcast.h's geometry and numpy_math.h's scalar math.
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/broadcast.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/numpy_math.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

using numpy_math::BinaryGradA;
using numpy_math::BinaryGradB;
using numpy_math::BinaryValue;

// The operands of a Binary with its scalar in place: (lhs, rhs) of the math.
struct Operands {
  float a, b;
};
Operands Order(const BinaryArgs& args, float tensor_a, float tensor_b) {
  if (!args.has_scalar) return {tensor_a, tensor_b};
  return args.scalar_first ? Operands{args.scalar, tensor_a} : Operands{tensor_a, args.scalar};
}

}  // namespace

absl::Status CpuOps::Binary(const BinaryArgs& args, const Tensor& a, const Tensor& b, Tensor* y) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckBinaryArgs(args, a, b, y));
  for (int64_t i = 0; i < y->numel(); ++i) {
    int64_t off[2];
    BroadcastOffsets<2>(g, i, off);
    const Operands v =
        Order(args, LoadAsFloat(a, off[0]), args.has_scalar ? 0.0f : LoadAsFloat(b, off[1]));
    StoreFromFloat(y, i, BinaryValue(args.op, v.a, v.b));
  }
  return absl::OkStatus();
}

absl::Status CpuOps::BinaryBackward(const BinaryArgs& args, const Tensor& dy, const Tensor& a,
                                    const Tensor& b, Tensor* da, Tensor* db) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckBinaryBackwardArgs(args, dy, a, b, da, db));
  for (int64_t i = 0; i < dy.numel(); ++i) {
    int64_t off[2];
    BroadcastOffsets<2>(g, i, off);
    const Operands v =
        Order(args, LoadAsFloat(a, off[0]), args.has_scalar ? 0.0f : LoadAsFloat(b, off[1]));
    const float g_out = LoadAsFloat(dy, i);
    if (da != nullptr) {
      // With a scalar first, the tensor is the math's right operand.
      const float d = args.has_scalar && args.scalar_first ? BinaryGradB(args.op, v.a, v.b)
                                                           : BinaryGradA(args.op, v.a, v.b);
      StoreFromFloat(da, i, g_out * d);
    }
    if (db != nullptr) StoreFromFloat(db, i, g_out * BinaryGradB(args.op, v.a, v.b));
  }
  return absl::OkStatus();
}

absl::Status CpuOps::Unary(UnaryOp op, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckUnaryArgs(op, x, y));
  for (int64_t i = 0; i < x.numel(); ++i) {
    StoreFromFloat(y, i, numpy_math::UnaryValue(op, LoadAsFloat(x, i)));
  }
  return absl::OkStatus();
}

absl::Status CpuOps::UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, Tensor* dx) {
  RETURN_IF_ERROR(CheckUnaryBackwardArgs(op, dy, x, dx));
  for (int64_t i = 0; i < x.numel(); ++i) {
    StoreFromFloat(dx, i, LoadAsFloat(dy, i) * numpy_math::UnaryDerivative(op, LoadAsFloat(x, i)));
  }
  return absl::OkStatus();
}

absl::Status CpuOps::Where(const WhereArgs& args, const Tensor& cond, const Tensor& x,
                           const Tensor& y, Tensor* out) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckWhereArgs(args, cond, x, y, out));
  for (int64_t i = 0; i < out->numel(); ++i) {
    int64_t off[3];
    BroadcastOffsets<3>(g, i, off);
    float v;
    if (cond.data_as<const uint8_t>()[off[0]] != 0) {
      v = args.has_x_scalar ? args.x_scalar : LoadAsFloat(x, off[1]);
    } else {
      v = args.has_y_scalar ? args.y_scalar : LoadAsFloat(y, off[2]);
    }
    StoreFromFloat(out, i, v);
  }
  return absl::OkStatus();
}

absl::Status CpuOps::Reduce(ReduceOp op, const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const ReduceGeometry g, CheckReduceArgs(op, x, y));
  for (int64_t j = 0; j < g.outputs; ++j) {
    const int64_t base = Unravel(g.out_rank, g.out_dims, g.out_strides, j);
    float acc = 0.0f;
    if (op == ReduceOp::kMax) acc = -std::numeric_limits<float>::infinity();
    if (op == ReduceOp::kMin) acc = std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < g.reduced; ++r) {
      const float v = LoadAsFloat(x, base + Unravel(g.red_rank, g.red_dims, g.red_strides, r));
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean: acc += v; break;
        case ReduceOp::kMax: acc = (v > acc || std::isnan(v)) && !std::isnan(acc) ? v : acc; break;
        case ReduceOp::kMin: acc = (v < acc || std::isnan(v)) && !std::isnan(acc) ? v : acc; break;
      }
    }
    if (op == ReduceOp::kMean) acc /= static_cast<float>(g.reduced);
    StoreFromFloat(y, j, acc);
  }
  return absl::OkStatus();
}

absl::Status CpuOps::Softmax(bool log, int axis, const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const SoftmaxGeometry g, CheckSoftmaxArgs(axis, x, y));
  for (int64_t o = 0; o < g.outer; ++o) {
    for (int64_t in = 0; in < g.inner; ++in) {
      const int64_t base = o * g.n * g.inner + in;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t k = 0; k < g.n; ++k) m = std::fmax(m, LoadAsFloat(x, base + k * g.inner));
      float sum = 0.0f;
      for (int64_t k = 0; k < g.n; ++k) sum += std::exp(LoadAsFloat(x, base + k * g.inner) - m);
      const float lse = m + std::log(sum);
      for (int64_t k = 0; k < g.n; ++k) {
        const float v = LoadAsFloat(x, base + k * g.inner);
        StoreFromFloat(y, base + k * g.inner, log ? v - lse : std::exp(v - m) / sum);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::SoftmaxBackward(bool log, int axis, const Tensor& dy, const Tensor& y,
                                     Tensor* dx) {
  ASSIGN_OR_RETURN(const SoftmaxGeometry g, CheckSoftmaxBackwardArgs(axis, dy, y, dx));
  for (int64_t o = 0; o < g.outer; ++o) {
    for (int64_t in = 0; in < g.inner; ++in) {
      const int64_t base = o * g.n * g.inner + in;
      float s = 0.0f;  // softmax: sum dy y; log_softmax: sum dy
      for (int64_t k = 0; k < g.n; ++k) {
        const int64_t i = base + k * g.inner;
        s += log ? LoadAsFloat(dy, i) : LoadAsFloat(dy, i) * LoadAsFloat(y, i);
      }
      for (int64_t k = 0; k < g.n; ++k) {
        const int64_t i = base + k * g.inner;
        const float yi = LoadAsFloat(y, i), dyi = LoadAsFloat(dy, i);
        StoreFromFloat(dx, i, log ? dyi - std::exp(yi) * s : yi * (dyi - s));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::Slice(const Tensor& x, const std::vector<int64_t>& start,
                           const std::vector<int64_t>& stride, Tensor* y) {
  ASSIGN_OR_RETURN(const SliceGeometry g, CheckSliceArgs("Slice", x, start, stride, y, false));
  const size_t elem = DTypeSize(x.dtype());
  const auto* from = static_cast<const uint8_t*>(x.data());
  auto* to = static_cast<uint8_t*>(y->data());
  for (int64_t i = 0; i < y->numel(); ++i) {
    const int64_t offset = g.x_offset + Unravel(g.rank, g.dims, g.x_strides, i);
    std::memcpy(to + i * elem, from + offset * elem, elem);
  }
  return absl::OkStatus();
}

absl::Status CpuOps::SliceBackward(const Tensor& dy, const std::vector<int64_t>& start,
                                   const std::vector<int64_t>& stride, Tensor* dx) {
  ASSIGN_OR_RETURN(const SliceGeometry g,
                   CheckSliceArgs("SliceBackward", *dx, start, stride, &dy, true));
  const size_t elem = DTypeSize(dx->dtype());
  if (dx->nbytes() > 0) std::memset(dx->data(), 0, dx->nbytes());
  const auto* from = static_cast<const uint8_t*>(dy.data());
  auto* to = static_cast<uint8_t*>(dx->data());
  for (int64_t i = 0; i < dy.numel(); ++i) {
    const int64_t offset = g.x_offset + Unravel(g.rank, g.dims, g.x_strides, i);
    std::memcpy(to + offset * elem, from + i * elem, elem);
  }
  return absl::OkStatus();
}

}  // namespace te
