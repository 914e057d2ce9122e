// Language-model ops: nn.Embed's gather and its deterministic scatter-add,
// the softmax cross entropy with integer labels, and greedy decoding's
// argmax. Semantics as in the CPU reference (kernels/cpu/lm_ops.cc); ops.h
// states the math.
//
// EmbedBackward sorts the ids (cub's radix sort is stable, so equal ids keep
// their token order), then a block per vocabulary row adds the dy rows of its
// segment in that order: no atomics, the same sums on every run. Napkin math
// for a byte-level LM step (N = 16 x 128 tokens, F = 256, bf16 dy): sorting
// 2K ints is a few microseconds; the gather reads N x F x 2 = 1 MB once.
#include <cmath>
#include <cub/device/device_radix_sort.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// y [rows, width] = table[ids[n]] [vocab, width]; NaN rows for ids outside.
template <typename T, typename Y>
__global__ void EmbedForwardKernel(const typename T::Storage* table, const int32_t* ids,
                                   typename Y::Storage* y, int64_t rows, int64_t width,
                                   int64_t vocab) {
  const int64_t total = rows * width;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / width, f = k - n * width;
    const int32_t id = ids[n];
    y[k] = Y::Store(id >= 0 && id < vocab ? T::Load(table[id * width + f]) : NAN);
  }
}

__global__ void IotaKernel(int32_t* out, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    out[k] = static_cast<int32_t>(k);
  }
}

// The first k in [0, n) with sorted[k] >= v.
__device__ int64_t LowerBound(const int32_t* sorted, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (sorted[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Block per vocabulary row v: dtable[v, f] = sum of dy[order[k], f] over the
// segment of v in sorted_ids, in token order (the sort is stable).
template <typename D, typename T>
__global__ void EmbedBackwardKernel(const typename D::Storage* dy, const int32_t* sorted_ids,
                                    const int32_t* order, typename T::Storage* dtable,
                                    int64_t rows, int64_t width, int64_t vocab) {
  __shared__ int64_t segment[2];
  for (int64_t v = blockIdx.x; v < vocab; v += gridDim.x) {
    if (threadIdx.x == 0) {
      segment[0] = LowerBound(sorted_ids, rows, v);
      segment[1] = LowerBound(sorted_ids, rows, v + 1);
    }
    __syncthreads();
    const int64_t begin = segment[0], end = segment[1];
    for (int64_t f = threadIdx.x; f < width; f += blockDim.x) {
      float sum = 0.0f;
      for (int64_t k = begin; k < end; ++k) sum += D::Load(dy[int64_t(order[k]) * width + f]);
      dtable[v * width + f] = T::Store(sum);
    }
    __syncthreads();  // segment is rewritten for the next row
  }
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Block per row n of logits [rows, vocab]: lse[n], and term[n] = lse[n] -
// logits[n, labels[n]] (NaN for a label outside [0, vocab)).
template <typename L>
__global__ void CrossEntropyRowKernel(const typename L::Storage* logits, const int32_t* labels,
                                      float* lse, float* term, int64_t rows, int64_t vocab) {
  __shared__ float scratch[32];
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const typename L::Storage* row = logits + n * vocab;
    float max = -INFINITY;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) max = fmaxf(max, L::Load(row[v]));
    max = BlockMax(max, scratch);
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) sum += expf(L::Load(row[v]) - max);
    sum = BlockSum(sum, scratch);
    if (threadIdx.x == 0) {
      const float row_lse = max + logf(sum);
      const int32_t label = labels[n];
      lse[n] = row_lse;
      term[n] = label >= 0 && label < vocab ? row_lse - L::Load(row[label]) : NAN;
    }
  }
}

// One block: loss[0] = sum(term) / rows, each thread's strided part then the
// block's tree (a fixed order for a fixed block size).
__global__ void MeanKernel(const float* term, float* loss, int64_t rows) {
  __shared__ float scratch[32];
  float sum = 0.0f;
  for (int64_t n = threadIdx.x; n < rows; n += blockDim.x) sum += term[n];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) loss[0] = sum / static_cast<float>(rows);
}

// A candidate of an argmax as one integer whose order is jnp.argmax's
// preference: any NaN above every number, then larger values, then (low 32
// bits) lower indices. -0 counts as +0, so equal zeros go by index.
__device__ __forceinline__ unsigned long long ArgmaxKey(float value, int64_t index) {
  unsigned order;
  if (isnan(value)) {
    order = 0xffffffffu;
  } else {
    const unsigned bits = __float_as_uint(value == 0.0f ? 0.0f : value);
    order = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  }
  return (static_cast<unsigned long long>(order) << 32) |
         (0xffffffffu - static_cast<unsigned>(index));
}

// A block per row: y[r] = argmax of x[r, :].
template <typename L>
__global__ void ArgmaxLastKernel(const typename L::Storage* x, int32_t* y, int64_t rows,
                                 int64_t width) {
  __shared__ unsigned long long scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const typename L::Storage* row = x + r * width;
    unsigned long long best = 0;
    for (int64_t v = threadIdx.x; v < width; v += blockDim.x) {
      best = max(best, ArgmaxKey(L::Load(row[v]), v));
    }
    best = BlockMaxU64(best, scratch);
    if (threadIdx.x == 0) {
      y[r] = static_cast<int32_t>(0xffffffffu - static_cast<unsigned>(best & 0xffffffffu));
    }
  }
}

template <typename L, typename G>
__global__ void CrossEntropyBackwardKernel(const typename L::Storage* logits, const int32_t* labels,
                                           const float* lse, const float* dloss,
                                           typename G::Storage* dlogits, int64_t rows,
                                           int64_t vocab) {
  const float scale = dloss[0] / static_cast<float>(rows);
  const int64_t total = rows * vocab;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = k / vocab, v = k - n * vocab;
    const float p = expf(L::Load(logits[k]) - lse[n]);
    dlogits[k] = G::Store(scale * (p - (v == labels[n] ? 1.0f : 0.0f)));
  }
}

constexpr int64_t kMaxRowBlocks = 65535;

}  // namespace

absl::Status CudaOps::EmbedForward(const Tensor& table, const Tensor& ids, Tensor* y) {
  ASSIGN_OR_RETURN(const LmDims d, CheckEmbedForwardArgs(table, ids, y));
  const int64_t total = d.rows * d.width;
  if (total == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  DispatchFloat(table.dtype(), [&](auto t) {
    DispatchFloat(y->dtype(), [&](auto out) {
      using T = decltype(t);
      using Y = decltype(out);
      EmbedForwardKernel<T, Y><<<GridFor(total), kThreads, 0, stream()>>>(
          static_cast<const typename T::Storage*>(table.data()), ids.data_as<const int32_t>(),
          static_cast<typename Y::Storage*>(y->data()), d.rows, d.width, d.vocab);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::EmbedBackward(const Tensor& dy, const Tensor& ids, Tensor* dtable) {
  constexpr const char* kOp = "EmbedBackward";
  ASSIGN_OR_RETURN(const LmDims d, CheckEmbedBackwardArgs(dy, ids, dtable));
  if (d.vocab * d.width == 0) return absl::OkStatus();
  if (d.rows > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", d.rows, " ids; at most 2^31 - 1"));
  }
  RETURN_IF_ERROR(Enter());
  const int n = static_cast<int>(d.rows);
  // sorted ids, their token order, and the token indices 0..n-1 to sort.
  ASSIGN_OR_RETURN(Tensor keys, Allocate(DType::kI32, {3, std::max<int64_t>(d.rows, 1)}));
  int32_t* sorted_ids = keys.data_as<int32_t>();
  int32_t* order = sorted_ids + keys.dim(1);
  int32_t* iota = order + keys.dim(1);
  if (n > 0) {
    IotaKernel<<<GridFor(n), kThreads, 0, stream()>>>(iota, n);
    CUDA_RETURN_IF_LAUNCH_ERROR();
    size_t temp_bytes = 0;
    CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, ids.data_as<const int32_t>(), sorted_ids, iota, order, n, 0, 32,
        stream()));
    ASSIGN_OR_RETURN(Tensor temp,
                     Allocate(DType::kI32, {static_cast<int64_t>((temp_bytes + 3) / 4 + 1)}));
    CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(
        temp.data(), temp_bytes, ids.data_as<const int32_t>(), sorted_ids, iota, order, n, 0, 32,
        stream()));
  }
  const int threads = d.width >= 256 ? 256 : (d.width >= 128 ? 128 : 64);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(d.vocab, kMaxRowBlocks));
  DispatchFloat(dy.dtype(), [&](auto g) {
    DispatchFloat(dtable->dtype(), [&](auto t) {
      using D = decltype(g);
      using T = decltype(t);
      EmbedBackwardKernel<D, T><<<blocks, threads, 0, stream()>>>(
          static_cast<const typename D::Storage*>(dy.data()), sorted_ids, order,
          static_cast<typename T::Storage*>(dtable->data()), d.rows, d.width, d.vocab);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::SoftmaxCrossEntropyForward(const Tensor& logits, const Tensor& labels,
                                                 Tensor* loss, Tensor* lse) {
  ASSIGN_OR_RETURN(const LmDims d, CheckSoftmaxCrossEntropyForwardArgs(logits, labels, loss, lse));
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(Tensor term, Allocate(DType::kF32, {d.rows}));
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(d.rows, kMaxRowBlocks));
  DispatchFloat(logits.dtype(), [&](auto l) {
    using L = decltype(l);
    CrossEntropyRowKernel<L><<<blocks, kThreads, 0, stream()>>>(
        static_cast<const typename L::Storage*>(logits.data()), labels.data_as<const int32_t>(),
        lse->data_as<float>(), term.data_as<float>(), d.rows, d.vocab);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  MeanKernel<<<1, 1024, 0, stream()>>>(term.data_as<const float>(), loss->data_as<float>(), d.rows);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ArgmaxLast(const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const LmDims d, CheckArgmaxLastArgs(x, y));
  if (d.rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(d.rows, kMaxRowBlocks));
  DispatchFloat(x.dtype(), [&](auto l) {
    using L = decltype(l);
    ArgmaxLastKernel<L><<<blocks, kThreads, 0, stream()>>>(
        static_cast<const typename L::Storage*>(x.data()), y->data_as<int32_t>(), d.rows,
        d.width);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::SoftmaxCrossEntropyBackward(const Tensor& logits, const Tensor& labels,
                                                  const Tensor& lse, const Tensor& dloss,
                                                  Tensor* dlogits) {
  ASSIGN_OR_RETURN(const LmDims d,
                   CheckSoftmaxCrossEntropyBackwardArgs(logits, labels, lse, dloss, dlogits));
  RETURN_IF_ERROR(Enter());
  const int64_t total = d.rows * d.vocab;
  DispatchFloat(logits.dtype(), [&](auto l) {
    DispatchFloat(dlogits->dtype(), [&](auto g) {
      using L = decltype(l);
      using G = decltype(g);
      CrossEntropyBackwardKernel<L, G><<<GridFor(total), kThreads, 0, stream()>>>(
          static_cast<const typename L::Storage*>(logits.data()), labels.data_as<const int32_t>(),
          lse.data_as<const float>(), dloss.data_as<const float>(),
          static_cast<typename G::Storage*>(dlogits->data()), d.rows, d.vocab);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
