// LayerNorm / RMSNorm over the last dimension of x [N, H].
//
// Forward: one block per row, read once into a row cache; the row's statistics
// by block reduction (mean, then the centred second moment, as the CPU
// reference computes them), then y = (x - mu) * rsigma * g + beta, written as
// float or, fused, as FP8 with amax (TE's norm + quantize).
// Backward: one block per row again for dx; dgamma / dbeta are summed per block
// into a partial row [blocks, H] (shared memory, each column owned by one
// thread: no atomics), then a second kernel adds the partials in block order,
// so the result is deterministic.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// Shared memory above this needs an opt-in per kernel; above the second limit
// the backward partials stay in global memory instead.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// One row of NormForwardKernel, N consecutive elements per access (N = kVec
// for Pack access, else 1). Returns the row's max |v| bits folded into amax_bits.
template <typename In, typename G, typename Out, int N>
__device__ __forceinline__ void NormForwardRow(
    const typename In::Storage* row, const typename G::Storage* gamma,
    const typename G::Storage* beta, typename Out::Storage* out, float* cache, int64_t cols,
    float epsilon, bool layernorm, bool zero_centered, float s, float* mu, float* rsigma,
    float* sum_scratch, unsigned* amax_bits) {
  using InPack = Pack<typename In::Storage, N>;
  using OutPack = Pack<typename Out::Storage, N>;
  const int64_t first = threadIdx.x * int64_t(N), stride = int64_t(blockDim.x) * N;
  float sum = 0.0f;
  for (int64_t c = first; c < cols; c += stride) {
    const InPack p = *reinterpret_cast<const InPack*>(row + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      cache[c + j] = In::Load(p.v[j]);
      sum += cache[c + j];
    }
  }
  const float mean = layernorm ? BlockSum(sum, sum_scratch) / static_cast<float>(cols) : 0.0f;
  float sq = 0.0f;
  for (int64_t c = first; c < cols; c += stride) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float d = cache[c + j] - mean;
      sq += d * d;
    }
  }
  const float second_moment = BlockSum(sq, sum_scratch) / static_cast<float>(cols);
  const float rs = 1.0f / sqrtf(second_moment + epsilon);
  if (threadIdx.x == 0) {
    if (mu != nullptr) *mu = mean;
    if (rsigma != nullptr) *rsigma = rs;
  }
  unsigned bits = *amax_bits;
  for (int64_t c = first; c < cols; c += stride) {
    OutPack o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = G::Load(gamma[c + j]);
      if (zero_centered) g += 1.0f;
      float v = (cache[c + j] - mean) * rs * g;
      if (beta != nullptr) v += G::Load(beta[c + j]);
      bits = max(bits, AbsBits(v));
      o.v[j] = Out::Store(v * s);
    }
    *reinterpret_cast<OutPack*>(out + c) = o;
  }
  *amax_bits = bits;
}

// x, y: [rows, cols]; gamma, beta: [cols] (beta null for RMSNorm); mu, rsigma:
// [rows] or null. FP8 y: scale, amax (zeroed before), scale_inv non-null.
// The row is read from memory once, into `cache` (cols floats per block: shared
// memory, or a global scratch row [gridDim.x, cols] when it does not fit).
// Each thread only reads back the cache entries it wrote, so the cache needs no
// barriers. `vec`: cols % kVec == 0 and x, y aligned for Pack access.
template <typename In, typename G, typename Out>
__global__ void NormForwardKernel(const typename In::Storage* x, const typename G::Storage* gamma,
                                  const typename G::Storage* beta, typename Out::Storage* y,
                                  float* mu, float* rsigma, int64_t rows, int64_t cols,
                                  float epsilon, bool layernorm, bool zero_centered,
                                  const float* scale, float* amax, float* scale_inv,
                                  float* global_cache, bool vec) {
  extern __shared__ float shared_cache[];
  float* cache = global_cache != nullptr ? global_cache + blockIdx.x * cols : shared_cache;
  __shared__ float sum_scratch[32];
  __shared__ unsigned max_scratch[32];
  const float s = scale != nullptr ? *scale : 1.0f;
  unsigned amax_bits = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row_mu = mu != nullptr ? mu + r : nullptr;
    float* row_rsigma = rsigma != nullptr ? rsigma + r : nullptr;
    if (vec) {
      NormForwardRow<In, G, Out, kVec>(x + r * cols, gamma, beta, y + r * cols, cache, cols,
                                       epsilon, layernorm, zero_centered, s, row_mu, row_rsigma,
                                       sum_scratch, &amax_bits);
    } else {
      NormForwardRow<In, G, Out, 1>(x + r * cols, gamma, beta, y + r * cols, cache, cols,
                                    epsilon, layernorm, zero_centered, s, row_mu, row_rsigma,
                                    sum_scratch, &amax_bits);
    }
  }
  if (amax != nullptr) {
    amax_bits = BlockMaxBits(amax_bits, max_scratch);
    if (threadIdx.x == 0) {
      AtomicMaxAbsBits(amax, amax_bits);
      if (blockIdx.x == 0) *scale_inv = 1.0f / s;
    }
  }
}

// One row of NormBackwardKernel, N consecutive elements per access.
template <typename In, typename G, typename Out, int N>
__device__ __forceinline__ void NormBackwardRow(
    const typename In::Storage* dy_row, const typename In::Storage* x_row, float m, float rs,
    const typename G::Storage* gamma, typename Out::Storage* dx_row, float* dgamma_acc,
    float* dbeta_acc, int64_t cols, bool layernorm, bool zero_centered, float* scratch) {
  using InPack = Pack<typename In::Storage, N>;
  using OutPack = Pack<typename Out::Storage, N>;
  const int64_t first = threadIdx.x * int64_t(N), stride = int64_t(blockDim.x) * N;
  float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
  for (int64_t c = first; c < cols; c += stride) {
    const InPack xp = *reinterpret_cast<const InPack*>(x_row + c);
    const InPack dp = *reinterpret_cast<const InPack*>(dy_row + c);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = G::Load(gamma[c + j]);
      if (zero_centered) g += 1.0f;
      const float xhat = (In::Load(xp.v[j]) - m) * rs;
      const float d = In::Load(dp.v[j]);
      const float dxhat = d * g;
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      dgamma_acc[c + j] += d * xhat;
      dbeta_acc[c + j] += d;
    }
  }
  const float mean_dxhat =
      layernorm ? BlockSum(sum_dxhat, scratch) / static_cast<float>(cols) : 0.0f;
  const float mean_dxhat_xhat = BlockSum(sum_dxhat_xhat, scratch) / static_cast<float>(cols);
  // The second read of the row hits the cache: it was read a moment ago.
  for (int64_t c = first; c < cols; c += stride) {
    const InPack xp = *reinterpret_cast<const InPack*>(x_row + c);
    const InPack dp = *reinterpret_cast<const InPack*>(dy_row + c);
    OutPack o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = G::Load(gamma[c + j]);
      if (zero_centered) g += 1.0f;
      const float xhat = (In::Load(xp.v[j]) - m) * rs;
      const float dxhat = In::Load(dp.v[j]) * g;
      o.v[j] = Out::Store(rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
    *reinterpret_cast<OutPack*>(dx_row + c) = o;
  }
}

// dx for each row; this block's dgamma / dbeta sums over its rows into
// partial[blockIdx.x] (dgamma) and partial[gridDim.x + blockIdx.x] (dbeta),
// each [cols]. With `shared_partials`, the sums accumulate in shared memory
// (2 * cols floats) and are copied out at the end. Each column's sums are
// touched by one thread only (the one that owns that column in every row): no
// races, no atomics, no barriers on the accumulators.
template <typename In, typename G, typename Out>
__global__ void NormBackwardKernel(const typename In::Storage* dy, const typename In::Storage* x,
                                   const float* mu, const float* rsigma,
                                   const typename G::Storage* gamma, typename Out::Storage* dx,
                                   float* partial, int64_t rows, int64_t cols, bool layernorm,
                                   bool zero_centered, bool shared_partials, bool vec) {
  extern __shared__ float shared[];
  __shared__ float scratch[32];
  float* dgamma_acc = shared_partials ? shared : partial + blockIdx.x * cols;
  float* dbeta_acc = shared_partials ? shared + cols : partial + (gridDim.x + blockIdx.x) * cols;
  const int64_t step = vec ? kVec : 1;
  const int64_t first = threadIdx.x * step, stride = int64_t(blockDim.x) * step;
  for (int64_t c = first; c < cols; c += stride) {
    for (int j = 0; j < step; ++j) {
      dgamma_acc[c + j] = 0.0f;
      dbeta_acc[c + j] = 0.0f;
    }
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float m = layernorm ? mu[r] : 0.0f;
    if (vec) {
      NormBackwardRow<In, G, Out, kVec>(dy + r * cols, x + r * cols, m, rsigma[r], gamma,
                                        dx + r * cols, dgamma_acc, dbeta_acc, cols, layernorm,
                                        zero_centered, scratch);
    } else {
      NormBackwardRow<In, G, Out, 1>(dy + r * cols, x + r * cols, m, rsigma[r], gamma,
                                     dx + r * cols, dgamma_acc, dbeta_acc, cols, layernorm,
                                     zero_centered, scratch);
    }
  }
  if (shared_partials) {
    for (int64_t c = first; c < cols; c += stride) {
      for (int j = 0; j < step; ++j) {
        partial[blockIdx.x * cols + c + j] = dgamma_acc[c + j];
        partial[(gridDim.x + blockIdx.x) * cols + c + j] = dbeta_acc[c + j];
      }
    }
  }
}

// dgamma[c] = sum over blocks of partial[b, c]; dbeta likewise from the second
// half. Block (32 columns x 8 row groups): group k sums blocks k, k + 8, ...
// (many independent loads in flight), then the 8 group sums are added in
// group order: deterministic.
constexpr int kParamGradColumns = 32, kParamGradGroups = 8;
template <typename Out>
__global__ void NormParamGradKernel(const float* partial, int blocks, int64_t cols,
                                    typename Out::Storage* dgamma, typename Out::Storage* dbeta) {
  __shared__ float group_dg[kParamGradGroups][kParamGradColumns + 1];
  __shared__ float group_db[kParamGradGroups][kParamGradColumns + 1];
  const int64_t c = blockIdx.x * int64_t(kParamGradColumns) + threadIdx.x;
  float dg = 0.0f, db = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int b = threadIdx.y; b < blocks; b += kParamGradGroups) {
      dg += partial[b * cols + c];
      db += partial[(blocks + b) * cols + c];
    }
  }
  group_dg[threadIdx.y][threadIdx.x] = dg;
  group_db[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  dg = 0.0f;
  db = 0.0f;
  for (int k = 0; k < kParamGradGroups; ++k) {
    dg += group_dg[k][threadIdx.x];
    db += group_db[k][threadIdx.x];
  }
  dgamma[c] = Out::Store(dg);
  if (dbeta != nullptr) dbeta[c] = Out::Store(db);
}

int RowThreads(int64_t cols) { return cols >= 1024 ? 256 : 128; }

}  // namespace

absl::Status CudaOps::NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                                  const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormForwardArgs(args, x, gamma, beta, y, mu,
                                                              rsigma, fp8));
  const bool layernorm = args.type == NormType::kLayerNorm;
  // CUDA only: the kernel reads beta through gamma's dtype (one dispatch for both).
  if (layernorm && beta.dtype() != gamma.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("NormForward: beta has dtype ",
                                                   DTypeName(beta.dtype()), ", want gamma's ",
                                                   DTypeName(gamma.dtype())));
  }
  const int64_t cols = dims.hidden;
  const int64_t rows = dims.rows;
  const bool want_mu = layernorm && Wanted(mu);
  const bool want_rsigma = Wanted(rsigma);
  RETURN_IF_ERROR(Enter());
  const bool quantized = IsFloat8(y->dtype());
  if (quantized) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fp8->amax.data(), 0, sizeof(float), stream()));
  }
  // An FP8 y with no rows still gets amax 0 and its scale_inv: one idle block.
  if (!quantized && (rows == 0 || cols == 0)) return absl::OkStatus();
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 132 * 16)));
  const int threads = RowThreads(cols);
  // The row cache: shared memory when it fits, else a global scratch row per block.
  const size_t cache_bytes = static_cast<size_t>(cols) * sizeof(float);
  const bool shared_cache = cache_bytes <= kMaxSharedBytes;
  Tensor global_cache;
  if (!shared_cache) {
    ASSIGN_OR_RETURN(global_cache, Allocate(DType::kF32, {static_cast<int64_t>(blocks), cols}));
  }
  absl::Status status;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloatOrFp8(y->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        auto kernel = NormForwardKernel<In, G, Out>;
        if (shared_cache && cache_bytes > kDefaultSharedBytes) {
          const cudaError_t e = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cache_bytes));
          if (e != cudaSuccess) {
            status.Update(CudaErrorToStatus(e, "cudaFuncSetAttribute(NormForwardKernel)",
                                            __FILE__, __LINE__));
            return;
          }
        }
        const bool vec = cols % kVec == 0 && PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename Out::Storage>(y->data());
        kernel<<<blocks, threads, shared_cache ? cache_bytes : 0, stream()>>>(
            static_cast<const typename In::Storage*>(x.data()),
            static_cast<const typename G::Storage*>(gamma.data()),
            layernorm ? static_cast<const typename G::Storage*>(beta.data()) : nullptr,
            static_cast<typename Out::Storage*>(y->data()),
            want_mu ? mu->data_as<float>() : nullptr,
            want_rsigma ? rsigma->data_as<float>() : nullptr, rows, cols, args.epsilon,
            layernorm, args.zero_centered_gamma,
            quantized ? fp8->scale.data_as<const float>() : nullptr,
            quantized ? fp8->amax.data_as<float>() : nullptr,
            quantized ? fp8->scale_inv.data_as<float>() : nullptr,
            shared_cache ? nullptr : global_cache.data_as<float>(), vec);
      });
    });
  });
  RETURN_IF_ERROR(status);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                                   const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                                   Tensor* dx, Tensor* dgamma, Tensor* dbeta,
                                   const Tensor& residual_grad) {
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormBackwardArgs(args, dy, x, mu, rsigma, gamma,
                                                               dx, dgamma, dbeta, residual_grad));
  const bool layernorm = args.type == NormType::kLayerNorm;
  // CUDA only: the kernels are instantiated per dtype of x, gamma and the
  // outputs, so dy is read as x's dtype and dbeta written as dgamma's.
  if (dy.dtype() != x.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("NormBackward: dy has dtype ",
                                                   DTypeName(dy.dtype()), ", want x's ",
                                                   DTypeName(x.dtype())));
  }
  if (layernorm && dbeta->dtype() != dgamma->dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("NormBackward: dbeta has dtype ",
                                                   DTypeName(dbeta->dtype()), ", want dgamma's ",
                                                   DTypeName(dgamma->dtype())));
  }
  const int64_t cols = dims.hidden;
  const int64_t rows = dims.rows;
  if (cols == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const int threads = RowThreads(cols);
  const size_t shared_bytes = 2 * static_cast<size_t>(cols) * sizeof(float);
  const bool shared_partials = shared_bytes <= kMaxSharedBytes;
  const int sms = context().properties.multiProcessorCount;
  absl::Status status;
  // Partials live in a tensor sized by the grid, known once the kernel (and so
  // its occupancy) is chosen.
  Tensor partial;
  int blocks = 1;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloat(dx->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        auto kernel = NormBackwardKernel<In, G, Out>;
        const size_t dynamic_shared = shared_partials ? shared_bytes : 0;
        if (dynamic_shared > kDefaultSharedBytes) {
          const cudaError_t e = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
          if (e != cudaSuccess) {
            status.Update(CudaErrorToStatus(e, "cudaFuncSetAttribute(NormBackwardKernel)",
                                            __FILE__, __LINE__));
            return;
          }
        }
        // As many blocks as can be resident at once: each then adds one partial row.
        int per_sm = 1;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                          dynamic_shared) != cudaSuccess) {
          (void)cudaGetLastError();
          per_sm = 1;
        }
        blocks = static_cast<int>(std::max<int64_t>(
            1, std::min<int64_t>(rows, static_cast<int64_t>(std::max(per_sm, 1)) * sms)));
        auto allocated = Allocate(DType::kF32, {2 * static_cast<int64_t>(blocks), cols});
        if (!allocated.ok()) {
          status.Update(allocated.status());
          return;
        }
        partial = *std::move(allocated);
        const bool vec = cols % kVec == 0 && PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename In::Storage>(dy.data()) &&
                         PackAligned<typename Out::Storage>(dx->data());
        kernel<<<blocks, threads, dynamic_shared, stream()>>>(
            static_cast<const typename In::Storage*>(dy.data()),
            static_cast<const typename In::Storage*>(x.data()),
            layernorm ? mu.data_as<const float>() : nullptr, rsigma.data_as<const float>(),
            static_cast<const typename G::Storage*>(gamma.data()),
            static_cast<typename Out::Storage*>(dx->data()), partial.data_as<float>(), rows, cols,
            layernorm, args.zero_centered_gamma, shared_partials, vec);
      });
    });
  });
  RETURN_IF_ERROR(status);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  DispatchFloat(dgamma->dtype(), [&](auto out) {
    using Out = decltype(out);
    NormParamGradKernel<Out>
        <<<(cols + kParamGradColumns - 1) / kParamGradColumns,
           dim3(kParamGradColumns, kParamGradGroups), 0, stream()>>>(
        partial.data_as<const float>(), blocks, cols,
        static_cast<typename Out::Storage*>(dgamma->data()),
        layernorm ? static_cast<typename Out::Storage*>(dbeta->data()) : nullptr);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  if (residual_grad.defined()) return Axpby(1.0f, *dx, 1.0f, residual_grad, dx);
  return absl::OkStatus();
}

// Not yet fused: the default (NormForward, then a transpose).
absl::Status CudaOps::NormForwardTransposed(const NormArgs& args, const Tensor& x,
                                            const Tensor& gamma, const Tensor& beta,
                                            const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                            Tensor* mu, Tensor* rsigma) {
  return Ops::NormForwardTransposed(args, x, gamma, beta, fp8, y, y_t, mu, rsigma);
}

}  // namespace cuda
}  // namespace te
