// jax.numpy's reductions: Reduce over axes, and the fused, numerically
// stable Softmax / log_softmax with its backward (a reduction along one axis
// and an elementwise pass over it, in one kernel).
//
// Work split, both ops: an output (a reduced element, or a softmax row) of
// few terms gets one thread, which adds them in order; one of many terms gets
// a block of kBlock threads, each adding a strided share in order, then a
// fixed tree over the block. Either way every output is summed in a fixed
// order: the same result on every run (the CPU reference's sequential sums
// differ from the tree only by float32 rounding).
#include <cmath>

#include "kernels/broadcast.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/numpy_access.cuh"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr int kBlock = 256;  // a power of two: the tree halves it
// Outputs of at most this many terms get one thread each.
constexpr int64_t kThreadTerms = 64;

__device__ __forceinline__ float MaxNan(float a, float b) {
  return (a != a || b != b) ? a + b : fmaxf(a, b);
}
__device__ __forceinline__ float MinNan(float a, float b) {
  return (a != a || b != b) ? a + b : fminf(a, b);
}

__device__ __forceinline__ float Combine(ReduceOp op, float acc, float v) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return acc + v;
    case ReduceOp::kMax: return MaxNan(acc, v);
    case ReduceOp::kMin: return MinNan(acc, v);
  }
  return acc;
}

__device__ __forceinline__ float Identity(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return 0.0f;
    case ReduceOp::kMax: return -INFINITY;
    case ReduceOp::kMin: return INFINITY;
  }
  return 0.0f;
}

// The block's values combined by a fixed tree; every thread gets the result.
// `scratch`: kBlock floats of shared memory.
template <typename F>
__device__ __forceinline__ float BlockCombine(float v, float* scratch, F combine) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int s = kBlock / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s)
      scratch[threadIdx.x] = combine(scratch[threadIdx.x], scratch[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = scratch[0];
  __syncthreads();  // scratch is reused by the next call
  return r;
}

__device__ __forceinline__ float Finish(ReduceOp op, float acc, int64_t terms) {
  return op == ReduceOp::kMean ? acc / static_cast<float>(terms) : acc;
}

// One thread per output j.
__global__ void ReduceThreadKernel(ReduceOp op, ReduceGeometry g, Operand x, Output y) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < g.outputs;
       j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = Unravel(g.out_rank, g.out_dims, g.out_strides, j);
    float acc = Identity(op);
    for (int64_t r = 0; r < g.reduced; ++r) {
      acc = Combine(
          op, acc,
          LoadAt(x.data, x.dtype, base + Unravel(g.red_rank, g.red_dims, g.red_strides, r)));
    }
    StoreAt(y.data, y.dtype, j, Finish(op, acc, g.reduced));
  }
}

// One block per output j.
__global__ void ReduceBlockKernel(ReduceOp op, ReduceGeometry g, Operand x, Output y) {
  __shared__ float scratch[kBlock];
  for (int64_t j = blockIdx.x; j < g.outputs; j += gridDim.x) {
    const int64_t base = Unravel(g.out_rank, g.out_dims, g.out_strides, j);
    float acc = Identity(op);
    for (int64_t r = threadIdx.x; r < g.reduced; r += kBlock) {
      acc = Combine(
          op, acc,
          LoadAt(x.data, x.dtype, base + Unravel(g.red_rank, g.red_dims, g.red_strides, r)));
    }
    acc = BlockCombine(acc, scratch, [op](float a, float b) { return Combine(op, a, b); });
    if (threadIdx.x == 0) StoreAt(y.data, y.dtype, j, Finish(op, acc, g.reduced));
  }
}

// Softmax rows: row (o, i) holds elements o * n * inner + k * inner + i, k < n.
__device__ __forceinline__ int64_t RowBase(const SoftmaxGeometry& g, int64_t row) {
  const int64_t o = row / g.inner, i = row - o * g.inner;
  return o * g.n * g.inner + i;
}

__device__ __forceinline__ float SoftmaxValue(bool log, float v, float m, float sum) {
  return log ? v - m - logf(sum) : expf(v - m) / sum;
}

__global__ void SoftmaxThreadKernel(bool log, SoftmaxGeometry g, Operand x, Output y) {
  const int64_t rows = g.outer * g.inner;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = RowBase(g, row);
    float m = -INFINITY;
    for (int64_t k = 0; k < g.n; ++k) m = fmaxf(m, LoadAt(x.data, x.dtype, base + k * g.inner));
    float sum = 0.0f;
    for (int64_t k = 0; k < g.n; ++k) sum += expf(LoadAt(x.data, x.dtype, base + k * g.inner) - m);
    for (int64_t k = 0; k < g.n; ++k) {
      const int64_t at = base + k * g.inner;
      StoreAt(y.data, y.dtype, at, SoftmaxValue(log, LoadAt(x.data, x.dtype, at), m, sum));
    }
  }
}

__global__ void SoftmaxBlockKernel(bool log, SoftmaxGeometry g, Operand x, Output y) {
  __shared__ float scratch[kBlock];
  const int64_t rows = g.outer * g.inner;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = RowBase(g, row);
    float m = -INFINITY;
    for (int64_t k = threadIdx.x; k < g.n; k += kBlock) {
      m = fmaxf(m, LoadAt(x.data, x.dtype, base + k * g.inner));
    }
    m = BlockCombine(m, scratch, [](float a, float b) { return fmaxf(a, b); });
    float sum = 0.0f;
    for (int64_t k = threadIdx.x; k < g.n; k += kBlock) {
      sum += expf(LoadAt(x.data, x.dtype, base + k * g.inner) - m);
    }
    sum = BlockCombine(sum, scratch, [](float a, float b) { return a + b; });
    for (int64_t k = threadIdx.x; k < g.n; k += kBlock) {
      const int64_t at = base + k * g.inner;
      StoreAt(y.data, y.dtype, at, SoftmaxValue(log, LoadAt(x.data, x.dtype, at), m, sum));
    }
  }
}

// s: softmax sum(dy y), log_softmax sum(dy); then dx per element.
__device__ __forceinline__ float SoftmaxTerm(bool log, float dy, float y) {
  return log ? dy : dy * y;
}
__device__ __forceinline__ float SoftmaxGrad(bool log, float dy, float y, float s) {
  return log ? dy - expf(y) * s : y * (dy - s);
}

__global__ void SoftmaxBackwardThreadKernel(bool log, SoftmaxGeometry g, Operand dy, Operand y,
                                            Output dx) {
  const int64_t rows = g.outer * g.inner;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = RowBase(g, row);
    float s = 0.0f;
    for (int64_t k = 0; k < g.n; ++k) {
      const int64_t at = base + k * g.inner;
      s += SoftmaxTerm(log, LoadAt(dy.data, dy.dtype, at), LoadAt(y.data, y.dtype, at));
    }
    for (int64_t k = 0; k < g.n; ++k) {
      const int64_t at = base + k * g.inner;
      StoreAt(dx.data, dx.dtype, at,
              SoftmaxGrad(log, LoadAt(dy.data, dy.dtype, at), LoadAt(y.data, y.dtype, at), s));
    }
  }
}

__global__ void SoftmaxBackwardBlockKernel(bool log, SoftmaxGeometry g, Operand dy, Operand y,
                                           Output dx) {
  __shared__ float scratch[kBlock];
  const int64_t rows = g.outer * g.inner;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = RowBase(g, row);
    float s = 0.0f;
    for (int64_t k = threadIdx.x; k < g.n; k += kBlock) {
      const int64_t at = base + k * g.inner;
      s += SoftmaxTerm(log, LoadAt(dy.data, dy.dtype, at), LoadAt(y.data, y.dtype, at));
    }
    s = BlockCombine(s, scratch, [](float a, float b) { return a + b; });
    for (int64_t k = threadIdx.x; k < g.n; k += kBlock) {
      const int64_t at = base + k * g.inner;
      StoreAt(dx.data, dx.dtype, at,
              SoftmaxGrad(log, LoadAt(dy.data, dy.dtype, at), LoadAt(y.data, y.dtype, at), s));
    }
  }
}

// Blocks for `units` of work, one unit per block (grid-stride beyond the cap).
unsigned BlocksFor(int64_t units, SmCount sms) {
  const int64_t cap = 16 * static_cast<int64_t>(sms.value > 0 ? sms.value : 1);
  return static_cast<unsigned>(units < 1 ? 1 : (units < cap ? units : cap));
}

// ---- launchers: pointers, sizes and the stream ----------------------------------------

void LaunchReduce(ReduceOp op, const ReduceGeometry& g, Operand x, Output y, SmCount sms,
                  cudaStream_t stream) {
  if (g.reduced <= kThreadTerms) {
    ReduceThreadKernel<<<GridFor(g.outputs, sms), kThreads, 0, stream>>>(op, g, x, y);
  } else {
    ReduceBlockKernel<<<BlocksFor(g.outputs, sms), kBlock, 0, stream>>>(op, g, x, y);
  }
}

void LaunchSoftmax(bool log, const SoftmaxGeometry& g, Operand x, Output y, SmCount sms,
                   cudaStream_t stream) {
  const int64_t rows = g.outer * g.inner;
  if (g.n <= kThreadTerms) {
    SoftmaxThreadKernel<<<GridFor(rows, sms), kThreads, 0, stream>>>(log, g, x, y);
  } else {
    SoftmaxBlockKernel<<<BlocksFor(rows, sms), kBlock, 0, stream>>>(log, g, x, y);
  }
}

void LaunchSoftmaxBackward(bool log, const SoftmaxGeometry& g, Operand dy, Operand y, Output dx,
                           SmCount sms, cudaStream_t stream) {
  const int64_t rows = g.outer * g.inner;
  if (g.n <= kThreadTerms) {
    SoftmaxBackwardThreadKernel<<<GridFor(rows, sms), kThreads, 0, stream>>>(log, g, dy, y, dx);
  } else {
    SoftmaxBackwardBlockKernel<<<BlocksFor(rows, sms), kBlock, 0, stream>>>(log, g, dy, y, dx);
  }
}

}  // namespace

absl::Status CudaOps::Reduce(ReduceOp op, const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const ReduceGeometry g, CheckReduceArgs(op, x, y));
  if (y->numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchReduce(op, g, OperandOf(x), OutputOf(y), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Softmax(bool log, int axis, const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const SoftmaxGeometry g, CheckSoftmaxArgs(axis, x, y));
  if (x.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchSoftmax(log, g, OperandOf(x), OutputOf(y), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::SoftmaxBackward(bool log, int axis, const Tensor& dy, const Tensor& y,
                                      Tensor* dx) {
  ASSIGN_OR_RETURN(const SoftmaxGeometry g, CheckSoftmaxBackwardArgs(axis, dy, y, dx));
  if (y.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchSoftmaxBackward(log, g, OperandOf(dy), OperandOf(y), OutputOf(dx), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
