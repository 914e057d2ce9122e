// jax.numpy's broadcasting elementwise ops: Binary, BinaryBackward, Unary,
// UnaryBackward, Where. Each is one grid-stride kernel over the output: its
// element's operand offsets come from kernels/broadcast.h's merged geometry
// (the same one the CPU reference walks) and its value from numpy_math.h's
// scalar functions, so both backends compute the same float32 expression.
// Memory-bound: one read per operand element (repeated ones hit the cache),
// one write per output.
#include "kernels/broadcast.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/numpy_access.cuh"
#include "kernels/numpy_math.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// The math's (lhs, rhs) from the tensor operands and the scalar.
__device__ __forceinline__ void Order(const BinaryArgs& args, float a, float b, float* lhs,
                                      float* rhs) {
  if (!args.has_scalar) {
    *lhs = a;
    *rhs = b;
  } else if (args.scalar_first) {
    *lhs = args.scalar;
    *rhs = a;
  } else {
    *lhs = a;
    *rhs = args.scalar;
  }
}

__global__ void BinaryKernel(BinaryArgs args, BroadcastGeometry g, Operand a, Operand b, Output y,
                             int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    BroadcastOffsets<2>(g, i, off);
    float lhs, rhs;
    Order(args, LoadAt(a.data, a.dtype, off[0]),
          args.has_scalar ? 0.0f : LoadAt(b.data, b.dtype, off[1]), &lhs, &rhs);
    StoreAt(y.data, y.dtype, i, numpy_math::BinaryValue(args.op, lhs, rhs));
  }
}

// da / db null: not wanted.
__global__ void BinaryBackwardKernel(BinaryArgs args, BroadcastGeometry g, Operand dy, Operand a,
                                     Operand b, Output da, Output db, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2];
    BroadcastOffsets<2>(g, i, off);
    float lhs, rhs;
    Order(args, LoadAt(a.data, a.dtype, off[0]),
          args.has_scalar ? 0.0f : LoadAt(b.data, b.dtype, off[1]), &lhs, &rhs);
    const float grad = LoadAt(dy.data, dy.dtype, i);
    if (da.data != nullptr) {
      // With a scalar first, the tensor is the math's right operand.
      const float d = args.has_scalar && args.scalar_first
                          ? numpy_math::BinaryGradB(args.op, lhs, rhs)
                          : numpy_math::BinaryGradA(args.op, lhs, rhs);
      StoreAt(da.data, da.dtype, i, grad * d);
    }
    if (db.data != nullptr) {
      StoreAt(db.data, db.dtype, i, grad * numpy_math::BinaryGradB(args.op, lhs, rhs));
    }
  }
}

__global__ void UnaryKernel(UnaryOp op, Operand x, Output y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    StoreAt(y.data, y.dtype, i, numpy_math::UnaryValue(op, LoadAt(x.data, x.dtype, i)));
  }
}

__global__ void UnaryBackwardKernel(UnaryOp op, Operand dy, Operand x, Output dx, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    StoreAt(
        dx.data, dx.dtype, i,
        LoadAt(dy.data, dy.dtype, i) * numpy_math::UnaryDerivative(op, LoadAt(x.data, x.dtype, i)));
  }
}

__global__ void WhereKernel(WhereArgs args, BroadcastGeometry g, const uint8_t* cond, Operand x,
                            Operand y, Output out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[3];
    BroadcastOffsets<3>(g, i, off);
    float v;
    if (cond[off[0]] != 0) {
      v = args.has_x_scalar ? args.x_scalar : LoadAt(x.data, x.dtype, off[1]);
    } else {
      v = args.has_y_scalar ? args.y_scalar : LoadAt(y.data, y.dtype, off[2]);
    }
    StoreAt(out.data, out.dtype, i, v);
  }
}

// ---- launchers: pointers, sizes and the stream ----------------------------------------

void LaunchBinary(const BinaryArgs& args, const BroadcastGeometry& g, Operand a, Operand b,
                  Output y, int64_t n, SmCount sms, cudaStream_t stream) {
  BinaryKernel<<<GridFor(n, sms), kThreads, 0, stream>>>(args, g, a, b, y, n);
}

void LaunchBinaryBackward(const BinaryArgs& args, const BroadcastGeometry& g, Operand dy, Operand a,
                          Operand b, Output da, Output db, int64_t n, SmCount sms,
                          cudaStream_t stream) {
  BinaryBackwardKernel<<<GridFor(n, sms), kThreads, 0, stream>>>(args, g, dy, a, b, da, db, n);
}

void LaunchUnary(UnaryOp op, Operand x, Output y, int64_t n, SmCount sms, cudaStream_t stream) {
  UnaryKernel<<<GridFor(n, sms), kThreads, 0, stream>>>(op, x, y, n);
}

void LaunchUnaryBackward(UnaryOp op, Operand dy, Operand x, Output dx, int64_t n, SmCount sms,
                         cudaStream_t stream) {
  UnaryBackwardKernel<<<GridFor(n, sms), kThreads, 0, stream>>>(op, dy, x, dx, n);
}

void LaunchWhere(const WhereArgs& args, const BroadcastGeometry& g, const uint8_t* cond, Operand x,
                 Operand y, Output out, int64_t n, SmCount sms, cudaStream_t stream) {
  WhereKernel<<<GridFor(n, sms), kThreads, 0, stream>>>(args, g, cond, x, y, out, n);
}

}  // namespace

absl::Status CudaOps::Binary(const BinaryArgs& args, const Tensor& a, const Tensor& b, Tensor* y) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckBinaryArgs(args, a, b, y));
  if (y->numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchBinary(args, g, OperandOf(a), args.has_scalar ? Operand{} : OperandOf(b), OutputOf(y),
               y->numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::BinaryBackward(const BinaryArgs& args, const Tensor& dy, const Tensor& a,
                                     const Tensor& b, Tensor* da, Tensor* db) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckBinaryBackwardArgs(args, dy, a, b, da, db));
  if (dy.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchBinaryBackward(args, g, OperandOf(dy), OperandOf(a),
                       args.has_scalar ? Operand{} : OperandOf(b), OutputOf(da), OutputOf(db),
                       dy.numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Unary(UnaryOp op, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckUnaryArgs(op, x, y));
  if (x.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchUnary(op, OperandOf(x), OutputOf(y), x.numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, Tensor* dx) {
  RETURN_IF_ERROR(CheckUnaryBackwardArgs(op, dy, x, dx));
  if (x.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchUnaryBackward(op, OperandOf(dy), OperandOf(x), OutputOf(dx), x.numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Where(const WhereArgs& args, const Tensor& cond, const Tensor& x,
                            const Tensor& y, Tensor* out) {
  ASSIGN_OR_RETURN(const BroadcastGeometry g, CheckWhereArgs(args, cond, x, y, out));
  if (out->numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchWhere(args, g, cond.data_as<const uint8_t>(), args.has_x_scalar ? Operand{} : OperandOf(x),
              args.has_y_scalar ? Operand{} : OperandOf(y), OutputOf(out), out->numel(), sms(),
              stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
