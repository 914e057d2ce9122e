// LayerNorm / RMSNorm over the last dimension of x [N, H].
//
// Two paths per op; both compute the statistics in float32 as the CPU
// reference does (the mean, then the second moment about it).
//
// Fast path, for rows that fit in registers (H % 8 == 0; H <= 8192 forward
// and 12288 backward for 16-bit inputs, half that for float32; tensors
// aligned for 16-byte access): a group of 1 to 12 warps holds a row in
// registers, read once with 16-byte loads, and sums it
// with warp shuffles plus one small shared-memory step between the group's
// warps (behind a barrier of that group alone, so groups never wait for each
// other). A block holds several groups; each walks rows grid-stride.
//   Forward: y (float, or FP8 with amax) from the registers.
//   NormForwardTransposed: the same, and the FP8 codes of a tile of rows also
//   go to shared memory, from where the tile leaves transposed as y_t.
//   Backward: x, dy and residual_grad read once; dgamma / dbeta sum in
//   registers (each thread owns fixed columns in every row); the block's
//   groups add theirs in group order into one partial row per block.
// General path (any H, any alignment): one block per row, the row cached in
// shared memory (or global scratch for very long rows), block reductions;
// backward partials per block in shared or global memory.
//
// Both backwards end with a second kernel that adds the partial rows in block
// order: dgamma / dbeta are deterministic, with no atomics.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/norm_fast.cuh"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// Shared memory limits: common.cuh's kDefaultSharedBytes (above it, an
// opt-in) and kMaxSharedBytes (above it, the row cache and the backward
// partials stay in global memory).

// The fast paths' kernels: norm_fast.cuh.

// ---- general path: one block per row -----------------------------------------------

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
// [rows] or null. FP8 y: scale, scale_inv non-null, amax recorded or not.
// The row is read from memory once, into `cache` (cols floats per block: shared
// memory, or a global scratch row [gridDim.x, cols] when it does not fit).
// Each thread only reads back the cache entries it wrote, so the cache needs no
// barriers. `vec`: cols % kVec == 0 and x, y aligned for Pack access.
template <typename In, typename G, typename Out>
__global__ void NormForwardKernel(const typename In::Storage* x, const typename G::Storage* gamma,
                                  const typename G::Storage* beta, typename Out::Storage* y,
                                  float* mu, float* rsigma, int64_t rows, int64_t cols,
                                  float epsilon, bool layernorm, bool zero_centered,
                                  const float* scale, AmaxOut amax, float* scale_inv,
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
  if (scale_inv != nullptr) {  // FP8 y; its amax may go unrecorded
    if (amax.amax != nullptr) amax_bits = BlockMaxBits(amax_bits, max_scratch);
    if (threadIdx.x == 0) {
      FoldAmax(amax, amax_bits);
      if (blockIdx.x == 0) *scale_inv = 1.0f / s;
    }
  }
}

// One row of NormBackwardKernel, N consecutive elements per access.
template <typename In, typename G, typename Out, int N>
__device__ __forceinline__ void NormBackwardRow(
    const typename In::Storage* dy_row, const typename In::Storage* x_row, float m, float rs,
    const typename G::Storage* gamma, const typename Out::Storage* residual_row,
    typename Out::Storage* dx_row, float* dgamma_acc, float* dbeta_acc, int64_t cols,
    bool layernorm, bool zero_centered, float* scratch) {
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
    OutPack rp;
    if (residual_row != nullptr) rp = *reinterpret_cast<const OutPack*>(residual_row + c);
    OutPack o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float g = G::Load(gamma[c + j]);
      if (zero_centered) g += 1.0f;
      const float xhat = (In::Load(xp.v[j]) - m) * rs;
      const float dxhat = In::Load(dp.v[j]) * g;
      float v = rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
      if (residual_row != nullptr) v += Out::Load(rp.v[j]);
      o.v[j] = Out::Store(v);
    }
    *reinterpret_cast<OutPack*>(dx_row + c) = o;
  }
}

// dx (+ residual where non-null) for each row; this block's dgamma / dbeta
// sums over its rows into partial[blockIdx.x] (dgamma) and
// partial[gridDim.x + blockIdx.x] (dbeta),
// each [cols]. With `shared_partials`, the sums accumulate in shared memory
// (2 * cols floats) and are copied out at the end. Each column's sums are
// touched by one thread only (the one that owns that column in every row): no
// races, no atomics, no barriers on the accumulators.
template <typename In, typename G, typename Out>
__global__ void NormBackwardKernel(const typename In::Storage* dy, const typename In::Storage* x,
                                   const float* mu, const float* rsigma,
                                   const typename G::Storage* gamma,
                                   const typename Out::Storage* residual,
                                   typename Out::Storage* dx, float* partial, int64_t rows,
                                   int64_t cols, bool layernorm, bool zero_centered,
                                   bool shared_partials, bool vec) {
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
    const typename Out::Storage* residual_row = residual != nullptr ? residual + r * cols : nullptr;
    if (vec) {
      NormBackwardRow<In, G, Out, kVec>(dy + r * cols, x + r * cols, m, rsigma[r], gamma,
                                        residual_row, dx + r * cols, dgamma_acc, dbeta_acc, cols,
                                        layernorm, zero_centered, scratch);
    } else {
      NormBackwardRow<In, G, Out, 1>(dy + r * cols, x + r * cols, m, rsigma[r], gamma,
                                     residual_row, dx + r * cols, dgamma_acc, dbeta_acc, cols,
                                     layernorm, zero_centered, scratch);
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

int RowThreads(int64_t cols) { return cols >= 1024 ? 256 : 128; }

// ---- host helpers -------------------------------------------------------------------

// Aligned for Pack access (8 elements of the tensor's dtype).
bool VecAligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data()) % (kVec * DTypeSize(t.dtype())) == 0;
}

// Warps per row of the fast paths for rows of `cols` elements of dtype `in`:
// the fewest of `choices` whose threads hold the row, or 0 where none does
// (cols % kVec != 0, or the row is too long).
constexpr int kForwardWarpChoices[] = {1, 2, 4, 8};
constexpr int kBackwardWarpChoices[] = {1, 2, 3, 4, 6, 12};
template <size_t kChoices>
int FastRowWarps(int64_t cols, DType in, const int (&choices)[kChoices]) {
  if (cols <= 0 || cols % kVec != 0) return 0;
  const int64_t packs_per_warp = int64_t{32} * RowPacksFor(DTypeSize(in));
  for (int warps : choices) {
    if (cols / kVec <= packs_per_warp * warps) return warps;
  }
  return 0;
}

// At most this many rows (a decode step's batch) take the few-rows choice below.
constexpr int64_t kFewRows = 64;

// The fast forward's warps per row for these tensors, or 0 (the general
// kernel). NormForward and NormForwardTransposed both decide with this, so
// they take the same path and compute the same bits. Few rows spread each
// row over as many warps as give every thread a pack (up to 8): with the
// fewest warps, 8 rows of 1024 bfloat16 were 8 warps on one SM, each walking
// 4 packs of loads, sums and stores in turn (4.0-4.4 us a LayerNorm in a
// decode step's trace on the H200), where the work is a few microseconds'
// worth of latency spread over any number of SMs.
int FastForwardWarps(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& y,
                     bool layernorm, int64_t rows, int64_t cols) {
  if (rows <= 0 || !VecAligned(x) || !VecAligned(gamma) || !VecAligned(y)) return 0;
  if (layernorm && !VecAligned(beta)) return 0;
  int warps = FastRowWarps(cols, x.dtype(), kForwardWarpChoices);
  if (warps == 0 || rows > kFewRows) return warps;
  while (warps < 8 && cols / kVec >= int64_t{32} * warps * 2) warps *= 2;
  return warps;
}

// CUDA only: the kernels read beta through gamma's dtype (one dispatch for both).
absl::Status CheckBetaLikeGamma(const char* op, bool layernorm, const Tensor& gamma,
                                const Tensor& beta) {
  if (layernorm && beta.dtype() != gamma.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": beta has dtype ",
                                                   DTypeName(beta.dtype()), ", want gamma's ",
                                                   DTypeName(gamma.dtype())));
  }
  return absl::OkStatus();
}

template <typename In, typename G, typename Out>
NormForwardParams<In, G, Out> ForwardParams(const NormArgs& args, const Tensor& x,
                                            const Tensor& gamma, const Tensor& beta, Tensor* y,
                                            Tensor* mu, Tensor* rsigma, const Fp8Output* fp8,
                                            AmaxOut amax, int64_t rows, int64_t cols) {
  const bool layernorm = args.type == NormType::kLayerNorm;
  NormForwardParams<In, G, Out> p;
  p.x = static_cast<const typename In::Storage*>(x.data());
  p.gamma = static_cast<const typename G::Storage*>(gamma.data());
  p.beta = layernorm ? static_cast<const typename G::Storage*>(beta.data()) : nullptr;
  p.y = static_cast<typename Out::Storage*>(y->data());
  p.mu = layernorm && Wanted(mu) ? mu->data_as<float>() : nullptr;
  p.rsigma = Wanted(rsigma) ? rsigma->data_as<float>() : nullptr;
  p.rows = rows;
  p.cols = cols;
  p.epsilon = args.epsilon;
  p.layernorm = layernorm;
  p.zero_centered = args.zero_centered_gamma;
  const bool quantized = fp8 != nullptr && IsFloat8(y->dtype());
  p.scale = quantized ? fp8->scale.data_as<const float>() : nullptr;
  p.amax = quantized ? amax : AmaxOut{};
  p.scale_inv = quantized ? fp8->scale_inv.data_as<float>() : nullptr;
  return p;
}

}  // namespace

absl::Status CudaOps::NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                                  const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormForwardArgs(args, x, gamma, beta, y, mu,
                                                              rsigma, fp8));
  const bool layernorm = args.type == NormType::kLayerNorm;
  RETURN_IF_ERROR(CheckBetaLikeGamma("NormForward", layernorm, gamma, beta));
  const int64_t cols = dims.hidden;
  const int64_t rows = dims.rows;
  RETURN_IF_ERROR(Enter());
  const bool quantized = IsFloat8(y->dtype());
  const AmaxOut amax = quantized ? AmaxOutFor(*fp8) : AmaxOut{};
  // An FP8 y with no rows still gets amax 0 and its scale_inv: one idle block.
  if (!quantized && (rows == 0 || cols == 0)) return absl::OkStatus();
  const int warps = FastForwardWarps(x, gamma, beta, *y, layernorm, rows, cols);
  const int sms = sm_count();
  const unsigned blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(rows, 16 * static_cast<int64_t>(sms))));
  const int threads = RowThreads(cols);
  // The general kernel's row cache: shared memory when it fits, else a global
  // scratch row per block.
  const size_t cache_bytes = static_cast<size_t>(cols) * sizeof(float);
  const bool shared_cache = cache_bytes <= kMaxSharedBytes;
  Tensor global_cache;
  if (warps == 0 && !shared_cache) {
    ASSIGN_OR_RETURN(global_cache, Allocate(DType::kF32, {static_cast<int64_t>(blocks), cols}));
  }
  absl::Status status;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloatOrFp8(y->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        const NormForwardParams<In, G, Out> p =
            ForwardParams<In, G, Out>(args, x, gamma, beta, y, mu, rsigma, fp8, amax, rows, cols);
        if (warps > 0) {
          auto kernel = NormForwardFastKernel<In, G, Out>;
          const int64_t groups = kForwardThreads / (32 * warps);
          const int64_t grid = std::min((rows + groups - 1) / groups,
                                        ResidentBlocks(context(), kernel, kForwardThreads, 0));
          kernel<<<static_cast<unsigned>(grid), kForwardThreads, 0, stream()>>>(p, warps);
          return;
        }
        auto kernel = NormForwardKernel<In, G, Out>;
        if (shared_cache) {
          status.Update(AllowSharedBytes(context(), kernel, cache_bytes,
                                         "cudaFuncSetAttribute(NormForwardKernel)"));
          if (!status.ok()) return;
        }
        const bool vec = cols % kVec == 0 && PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename Out::Storage>(y->data());
        kernel<<<blocks, threads, shared_cache ? cache_bytes : 0, stream()>>>(
            p.x, p.gamma, p.beta, p.y, p.mu, p.rsigma, rows, cols, args.epsilon, layernorm,
            args.zero_centered_gamma, p.scale, p.amax, p.scale_inv,
            shared_cache ? nullptr : global_cache.data_as<float>(), vec);
      });
    });
  });
  RETURN_IF_ERROR(status);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::NormForwardTransposed(const NormArgs& args, const Tensor& x,
                                            const Tensor& gamma, const Tensor& beta,
                                            const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                            Tensor* mu, Tensor* rsigma) {
  RETURN_IF_ERROR(
      CheckNormForwardTransposedArgs(args, x, gamma, beta, fp8, y, y_t, mu, rsigma));
  const bool layernorm = args.type == NormType::kLayerNorm;
  RETURN_IF_ERROR(CheckBetaLikeGamma("NormForwardTransposed", layernorm, gamma, beta));
  const int64_t cols = x.dim(-1);
  const int64_t rows = Rows(x);
  const int warps = FastForwardWarps(x, gamma, beta, *y, layernorm, rows, cols);
  // y_t is written in 4-byte words of 4 rows: rows % 4 == 0, y_t aligned.
  const bool fused = warps > 0 && rows % 4 == 0 &&
                     reinterpret_cast<uintptr_t>(y_t->data()) % 4 == 0;
  // Shapes the fused kernel cannot take: NormForward, then a transpose.
  if (!fused) return Ops::NormForwardTransposed(args, x, gamma, beta, fp8, y, y_t, mu, rsigma);
  RETURN_IF_ERROR(Enter());
  // A tile of codes is tile_rows x (cols + 4) bytes of shared memory, at most
  // ~128 KiB: 64 rows up to H = 1024 (each y_t row then gets 64-byte runs, two
  // sectors: 8% faster than 32 rows at [8192, 1024] on the H100), 32 up to
  // 4096 (32-byte runs, one sector; at H = 2048, 64 rows leave one block an SM
  // and take 6% longer), 16 rows above.
  const int tile_rows = cols <= 1024 ? 64 : (cols <= 4096 ? 32 : 16);
  const size_t tile_bytes = static_cast<size_t>(tile_rows) * static_cast<size_t>(cols + 4);
  // Groups of one warp sum with shuffles alone: a warp per row of the tile
  // (two rows each in a tile of 64), so a tile's rows load at once. Larger
  // groups: 8 groups of rows (4 of 8 warps), no more than the 15 named
  // barriers.
  const int threads =
      std::min(kTransposedMaxThreads, warps == 1 ? 32 * tile_rows : 256 * warps);
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  absl::Status status;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFp8(y->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        auto kernel = NormForwardTransposedKernel<In, G, Out>;
        status.Update(AllowSharedBytes(context(), kernel, tile_bytes,
                                       "cudaFuncSetAttribute(NormForwardTransposedKernel)"));
        if (!status.ok()) return;
        const int64_t grid =
            std::min(tiles, ResidentBlocks(context(), kernel, threads, tile_bytes));
        kernel<<<static_cast<unsigned>(grid), threads, tile_bytes, stream()>>>(
            ForwardParams<In, G, Out>(args, x, gamma, beta, y, mu, rsigma, &fp8, AmaxOutFor(fp8),
                                      rows, cols),
            static_cast<uint8_t*>(y_t->data()), warps, tile_rows);
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
  // residual_grad is added to dx in the same pass (dx's dtype, checked above).
  const bool has_residual = residual_grad.defined() && residual_grad.data() != nullptr;
  const int warps = rows > 0 && VecAligned(x) && VecAligned(dy) && VecAligned(gamma) &&
                            VecAligned(*dx) && (!has_residual || VecAligned(residual_grad))
                        ? FastRowWarps(cols, x.dtype(), kBackwardWarpChoices)
                        : 0;
  const int threads = RowThreads(cols);
  const size_t shared_bytes = 2 * static_cast<size_t>(cols) * sizeof(float);
  const bool shared_partials = shared_bytes <= kMaxSharedBytes;
  absl::Status status;
  // Partials live in a tensor sized by the grid, known once the kernel (and so
  // its occupancy) is chosen.
  Tensor partial;
  int64_t blocks = 1;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloat(dx->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        const auto* dy_data = static_cast<const typename In::Storage*>(dy.data());
        const auto* x_data = static_cast<const typename In::Storage*>(x.data());
        const float* mu_data = layernorm ? mu.data_as<const float>() : nullptr;
        const auto* gamma_data = static_cast<const typename G::Storage*>(gamma.data());
        const auto* residual_data =
            has_residual ? static_cast<const typename Out::Storage*>(residual_grad.data())
                         : nullptr;
        auto* dx_data = static_cast<typename Out::Storage*>(dx->data());
        auto allocate_partial = [&] {
          auto allocated = Allocate(DType::kF32, {2 * blocks, cols});
          if (!allocated.ok()) {
            status.Update(allocated.status());
            return false;
          }
          partial = *std::move(allocated);
          return true;
        };
        if (warps > 0) {
          // Column sums of the block: [2][cols] floats, 96 KiB at H = 12288.
          auto kernel = NormBackwardFastKernel<In, G, Out>;
          status.Update(AllowSharedBytes(context(), kernel, shared_bytes,
                                         "cudaFuncSetAttribute(NormBackwardFastKernel)"));
          if (!status.ok()) return;
          // As many blocks as fit at once (each adds one partial row), no more
          // than the rows need.
          const int64_t groups = kBackwardThreads / (32 * warps);
          blocks = std::min((rows + groups - 1) / groups,
                            ResidentBlocks(context(), kernel, kBackwardThreads, shared_bytes));
          if (!allocate_partial()) return;
          kernel<<<static_cast<unsigned>(blocks), kBackwardThreads, shared_bytes, stream()>>>(
              dy_data, x_data, mu_data, rsigma.data_as<const float>(), gamma_data, residual_data,
              dx_data, partial.data_as<float>(), rows, cols, layernorm, args.zero_centered_gamma,
              warps);
          return;
        }
        auto kernel = NormBackwardKernel<In, G, Out>;
        const size_t dynamic_shared = shared_partials ? shared_bytes : 0;
        status.Update(AllowSharedBytes(context(), kernel, dynamic_shared,
                                       "cudaFuncSetAttribute(NormBackwardKernel)"));
        if (!status.ok()) return;
        // As many blocks as can be resident at once: each then adds one partial row.
        blocks = std::max<int64_t>(
            1, std::min<int64_t>(rows, ResidentBlocks(context(), kernel, threads, dynamic_shared)));
        if (!allocate_partial()) return;
        const bool vec = cols % kVec == 0 && PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename In::Storage>(dy.data()) &&
                         PackAligned<typename Out::Storage>(dx->data()) &&
                         (!has_residual || PackAligned<typename Out::Storage>(residual_data));
        kernel<<<static_cast<unsigned>(blocks), threads, dynamic_shared, stream()>>>(
            dy_data, x_data, mu_data, rsigma.data_as<const float>(), gamma_data, residual_data,
            dx_data, partial.data_as<float>(), rows, cols, layernorm, args.zero_centered_gamma,
            shared_partials, vec);
      });
    });
  });
  RETURN_IF_ERROR(status);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  // dgamma from the first `blocks` partial rows, dbeta from the next.
  LaunchPartialColumnSums(partial.data_as<const float>(), blocks, cols, dgamma->dtype(),
                          dgamma->data(), stream());
  if (layernorm) {
    LaunchPartialColumnSums(partial.data_as<const float>() + blocks * cols, blocks, cols,
                            dbeta->dtype(), dbeta->data(), stream());
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
