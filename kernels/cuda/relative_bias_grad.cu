// The gradient of a T5 relative-position table through a causal
// self-attention, without the dense dbias [H, S, S].
//
// The table's gradient is the logits' gradient dS summed per bucket:
// dtable[n, h] = sum over b, i, j with bucket(i - j) = n of dS[b, h, i, j],
// where dS = P * (dP - delta), P = exp(scale q.k + bias - lse), dP = dout.v
// and delta = rowsum(dout * out). Forming it densely (cuDNN's dBias, then a
// scatter-add) costs a [B, H, S, S] pass and puts cuDNN on its slow dBias
// implementation. Two facts make a band of diagonals enough:
//   - causal T5 buckets saturate: every key `uniform_from` (W) or more
//     positions before its query shares one bucket (W is 113 for TE's 32
//     buckets over 128 positions);
//   - each row's dS sums to zero (sum_j P dP = delta without dropout), so
//     the far bucket's share of a row is minus its band's.
// So the kernel recomputes P and dP on the W diagonals only: per block a
// tile of 64 queries of one (batch, head), q.k and dout.v on tensor cores
// (WMMA, 16x16 tiles along the band), dS in f32, summed per diagonal in a
// fixed order (no atomics: the same bits every run). A second kernel adds the
// tiles' sums into dtable. The fragments load straight from global memory
// (neighbouring warps' key tiles overlap, so L1/L2 serve most of them):
// shared memory holds only per-warp scratch, so many blocks share an SM and
// hide each other's load latency; the work is latency-bound, not FLOP-bound.
//
// Cost per (batch, head): S * W scores, twice (q.k and dout.v), against the
// S^2 / 2 of the attention itself; no [H, S, S] memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr int kBandQueries = 64;  // query rows per block: 4 warps of 16
constexpr int kBandWarps = 4;
constexpr int kTile = 16;  // WMMA's tile edge
// WMMA's loads want 256-bit aligned tile starts.
constexpr uintptr_t kFragmentAlignment = 32;

struct BandParams {
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const void* dout;
  int64_t q_stride, kv_stride, o_stride;  // elements between tokens
  const float* lse;                       // [B, H, S]
  const void* bias;                       // [H, S, S], float32 or T: row S-1 holds each distance's
  bool bias_f32;
  float* partial;                         // [B, H, tiles, W + 1]
  int seq, heads, group, band, tiles;
  float scale;
};

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float ToFloat(__half x) {
  return __half2float(x);
}
// The bias as cuDNN reads it: rounded once to the operands' dtype.
template <typename T>
__device__ __forceinline__ float RoundAsOperand(float x);
template <>
__device__ __forceinline__ float RoundAsOperand<__nv_bfloat16>(float x) {
  return BF16::Load(BF16::Store(x));
}
template <>
__device__ __forceinline__ float RoundAsOperand<__half>(float x) {
  return F16::Load(F16::Store(x));
}

// The bias at `at` as cuDNN added it: in T (cast once when it is float32).
template <typename T>
__device__ __forceinline__ float BiasAsOperand(const BandParams& p, int64_t at) {
  return p.bias_f32 ? RoundAsOperand<T>(static_cast<const float*>(p.bias)[at])
                    : ToFloat(static_cast<const T*>(p.bias)[at]);
}

// A block's shared memory: per-warp scratch and the rows' scalars (11 KB).
struct __align__(kFragmentAlignment) BandShared {
  float tiles[kBandWarps][2][kTile * kTile];  // per warp: S (then dS), dP
  float bins[kBandWarps][kRelativeBandMax];   // per warp: the sum at each distance
  float bias_at[kRelativeBandMax];            // the bias at each distance
  float row_lse[kBandQueries];
  float row_delta[kBandQueries];
  float warp_far[kBandWarps];
};

template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32) RelativeBandKernel(BandParams p) {
  using namespace nvcuda;
  __shared__ BandShared sh;
  float* bias_at = sh.bias_at;
  float* row_lse = sh.row_lse;
  float* row_delta = sh.row_delta;

  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int S = p.seq, W = p.band;
  const int i0 = tile * kBandQueries;
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q) + static_cast<int64_t>(b) * S * p.q_stride + h * D;
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(b) * S * p.kv_stride + hk * D;
  const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(b) * S * p.kv_stride + hk * D;
  const T* out = static_cast<const T*>(p.out) + static_cast<int64_t>(b) * S * p.o_stride + h * D;
  const T* dout =
      static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * S * p.o_stride + h * D;

  // Each warp reads its 16 rows' lse and delta = rowsum(dout * out)
  // (coalesced: the lanes split a row). S is a multiple of 16
  // (RelativeBandApplies): a warp's rows are all inside or all past it.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int rr = 0; rr < kTile; ++rr) {
    const int r = warp * kTile + rr, i = i0 + r;
    float part = 0.0f;
    if (i < S) {
#pragma unroll
      for (int e = lane; e < D; e += 32) {
        part += ToFloat(dout[i * p.o_stride + e]) * ToFloat(out[i * p.o_stride + e]);
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      part += __shfl_xor_sync(0xffffffffu, part, offset);
    }
    if (lane == 0) {
      row_delta[r] = part;
      row_lse[r] = i < S ? p.lse[(static_cast<int64_t>(b) * p.heads + h) * S + i] : 0.0f;
    }
  }
  const int64_t last_row = (static_cast<int64_t>(h) * S + (S - 1)) * S;
  for (int d = threadIdx.x; d < kRelativeBandMax; d += blockDim.x) {
    bias_at[d] = d < W && d < S ? BiasAsOperand<T>(p, last_row + S - 1 - d) : 0.0f;
  }
  for (int x = threadIdx.x; x < kBandWarps * kRelativeBandMax; x += blockDim.x) {
    sh.bins[x / kRelativeBandMax][x % kRelativeBandMax] = 0.0f;
  }
  __syncthreads();

  const int r0 = i0 + warp * kTile;  // the warp's first query
  float far = 0.0f;                  // minus the far bucket's share, rows i >= W
  if (r0 < S) {
    float* s_tile = sh.tiles[warp][0];
    float* dp_tile = sh.tiles[warp][1];
    float* my_bins = sh.bins[warp];
    wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> a_q[D / kTile],
        a_do[D / kTile];
#pragma unroll
    for (int kk = 0; kk < D / kTile; ++kk) {
      wmma::load_matrix_sync(a_q[kk], q + r0 * p.q_stride + kk * kTile,
                             static_cast<unsigned>(p.q_stride));
      wmma::load_matrix_sync(a_do[kk], dout + r0 * p.o_stride + kk * kTile,
                             static_cast<unsigned>(p.o_stride));
    }
    const int kt_lo = max(0, r0 - W + 1) / kTile;
    const int kt_hi = min(r0 + kTile - 1, S - 1) / kTile;
    for (int kt = kt_lo; kt <= kt_hi; ++kt) {
      const T* k_tile = k + static_cast<int64_t>(kt) * kTile * p.kv_stride;
      const T* v_tile = v + static_cast<int64_t>(kt) * kTile * p.kv_stride;
      wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> s_acc, dp_acc;
      wmma::fill_fragment(s_acc, 0.0f);
      wmma::fill_fragment(dp_acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / kTile; ++kk) {
        wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> b_k, b_v;
        wmma::load_matrix_sync(b_k, k_tile + kk * kTile, static_cast<unsigned>(p.kv_stride));
        wmma::load_matrix_sync(b_v, v_tile + kk * kTile, static_cast<unsigned>(p.kv_stride));
        wmma::mma_sync(s_acc, a_q[kk], b_k, s_acc);
        wmma::mma_sync(dp_acc, a_do[kk], b_v, dp_acc);
      }
      wmma::store_matrix_sync(s_tile, s_acc, kTile, wmma::mem_row_major);
      wmma::store_matrix_sync(dp_tile, dp_acc, kTile, wmma::mem_row_major);
      __syncwarp();
      // dS of the tile's band elements, in place of S (0 elsewhere).
#pragma unroll
      for (int m = 0; m < kTile * kTile / 32; ++m) {
        const int e = lane + 32 * m, r = e / kTile, c = e % kTile;
        const int i = r0 + r, dist = i - (kt * kTile + c);
        float ds = 0.0f;
        if (i < S && dist >= 0 && dist < W) {
          const int row = warp * kTile + r;
          const float prob = __expf(s_tile[e] * p.scale + bias_at[dist] - row_lse[row]);
          ds = prob * (dp_tile[e] - row_delta[row]);
          if (i >= W) far -= ds;
        }
        s_tile[e] = ds;
      }
      __syncwarp();
      // Lane l sums the tile's diagonal r - c = l - 15 (at most 16 elements).
      if (lane < 2 * kTile - 1) {
        const int diag = lane - (kTile - 1);
        const int dist = r0 - kt * kTile + diag;
        if (dist >= 0 && dist < W) {
          float sum = 0.0f;
          for (int r = max(0, diag); r < min(kTile, kTile + diag); ++r) {
            sum += s_tile[r * kTile + (r - diag)];
          }
          my_bins[dist] += sum;
        }
      }
      __syncwarp();
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) far += __shfl_xor_sync(0xffffffffu, far, offset);
  if (lane == 0) sh.warp_far[warp] = far;
  __syncthreads();
  float* sums = p.partial + ((static_cast<int64_t>(b) * p.heads + h) * p.tiles + tile) * (W + 1);
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kBandWarps; ++w) sum += sh.bins[w][d];
    sums[d] = sum;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kBandWarps; ++w) sum += sh.warp_far[w];
    sums[W] = sum;
  }
}

// dtable [NB, H]: per head, the distances' sums over batches and tiles, each
// added to its bucket; the far bucket (the one at distance W) also takes
// minus the band's sum of every row with far keys. One block per head,
// kTableSplit threads per distance, their sums added in a fixed order.
constexpr int kTableSplit = 4;
constexpr int kTableThreads = kTableSplit * (kRelativeBandMax + kTableSplit);

__global__ void __launch_bounds__(kTableThreads) RelativeBandTableKernel(
    const float* partial, const int32_t* buckets, float* dtable, int batch, int heads, int tiles,
    int seq, int band, int num_buckets) {
  __shared__ float split_sums[kTableSplit][kRelativeBandMax + 1];
  const int h = blockIdx.x;
  const int blocks = batch * tiles;  // the partial rows of this head
  for (int x = threadIdx.x; x < kTableSplit * (band + 1); x += blockDim.x) {
    const int d = x % (band + 1), part = x / (band + 1);
    float sum = 0.0f;
    for (int n = part; n < blocks; n += kTableSplit) {
      const int b = n / tiles, t = n % tiles;
      sum += partial[((static_cast<int64_t>(b) * heads + h) * tiles + t) * (band + 1) + d];
    }
    split_sums[part][d] = sum;
  }
  __syncthreads();
  // The last query sees every distance d at key seq - 1 - d.
  const int32_t* last = buckets + static_cast<int64_t>(seq - 1) * seq;
  const int far = band < seq ? last[seq - 1 - band] : -1;
  for (int n = threadIdx.x; n < num_buckets; n += blockDim.x) {
    float sum = 0.0f;
    for (int d = 0; d < band && d < seq; ++d) {
      if (last[seq - 1 - d] == n) {
        for (int part = 0; part < kTableSplit; ++part) sum += split_sums[part][d];
      }
    }
    if (n == far) {
      for (int part = 0; part < kTableSplit; ++part) sum += split_sums[part][band];
    }
    dtable[static_cast<int64_t>(n) * heads + h] = sum;
  }
}

template <typename T, int D>
absl::Status LaunchBand(CudaOps* ops, const BandParams& p, int batch) {
  RelativeBandKernel<T, D><<<dim3(p.tiles, p.heads, batch), kBandWarps * 32, 0, ops->stream()>>>(p);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchBandForHeadDim(CudaOps* ops, const BandParams& p, int batch, int head_dim) {
  switch (head_dim) {
    case 32: return LaunchBand<T, 32>(ops, p, batch);
    case 64: return LaunchBand<T, 64>(ops, p, batch);
    case 128: return LaunchBand<T, 128>(ops, p, batch);
    default: break;
  }
  return absl::UnimplementedError(absl::StrCat("head_dim ", head_dim, " (32, 64 or 128)"));
}

}  // namespace

absl::Status RelativeBandApplies(const AttentionArgs& args, const AttentionShape& s,
                                 const QkvMemory& qkv, const RelativeBuckets& relative) {
  const bool top_left = args.mask == MaskType::kCausal ||
                        (args.mask == MaskType::kCausalBottomRight && s.q_seq == s.kv_seq);
  if (!top_left) return absl::UnimplementedError("the band needs a causal mask without padding");
  if (s.q_seq != s.kv_seq) return absl::UnimplementedError("cross-attention lengths");
  if (args.dropout_rate > 0.0f) {
    return absl::UnimplementedError("dropout (a row's logit gradients no longer sum to zero)");
  }
  if (args.elementwise_mask.defined()) return absl::UnimplementedError("an elementwise mask");
  if (relative.uniform_from <= 0 || relative.uniform_from > kRelativeBandMax) {
    return absl::UnimplementedError(absl::StrCat("buckets uniform from distance ",
                                                 relative.uniform_from, " (the band holds ",
                                                 kRelativeBandMax, ")"));
  }
  if (qkv.dtype != DType::kBF16 && qkv.dtype != DType::kF16) {
    return absl::UnimplementedError("operands not bf16 or f16");
  }
  if (s.q_seq % kTile != 0) {
    return absl::UnimplementedError(absl::StrCat("sequence ", s.q_seq, " (a multiple of 16)"));
  }
  for (const void* operand : {qkv.q, qkv.k, qkv.v}) {
    if (reinterpret_cast<uintptr_t>(operand) % kFragmentAlignment != 0) {
      return absl::UnimplementedError("q, k or v not 32-byte aligned");
    }
  }
  if (s.head_dim != 32 && s.head_dim != 64 && s.head_dim != 128) {
    return absl::UnimplementedError(absl::StrCat("head_dim ", s.head_dim));
  }
  return absl::OkStatus();
}

absl::Status RelativeBandTableGrad(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& s, const QkvMemory& qkv,
                                   const Tensor& out, const Tensor& dout,
                                   const Tensor& softmax_lse, const RelativeBuckets& relative,
                                   Tensor* dtable) {
  BandParams p;
  p.q = qkv.q;
  p.k = qkv.k;
  p.v = qkv.v;
  p.out = out.data();
  p.dout = dout.data();
  p.q_stride = qkv.q_token_stride;
  p.kv_stride = qkv.kv_token_stride;
  p.o_stride = s.q_heads * s.head_dim;
  p.lse = softmax_lse.data_as<const float>();
  p.bias = args.bias.data();
  p.bias_f32 = args.bias.dtype() == DType::kF32;
  p.seq = static_cast<int>(s.q_seq);
  p.heads = static_cast<int>(s.q_heads);
  p.group = static_cast<int>(s.q_heads / s.kv_heads);
  p.band = static_cast<int>(relative.uniform_from);
  p.tiles = static_cast<int>((s.q_seq + kBandQueries - 1) / kBandQueries);
  p.scale = args.scale;
  const int batch = static_cast<int>(s.batch);
  ASSIGN_OR_RETURN(Tensor partial,
                   ops->Allocate(DType::kF32, {s.batch * s.q_heads * p.tiles, p.band + 1}));
  p.partial = partial.data_as<float>();
  const int head_dim = static_cast<int>(s.head_dim);
  RETURN_IF_ERROR(qkv.dtype == DType::kBF16
                      ? LaunchBandForHeadDim<__nv_bfloat16>(ops, p, batch, head_dim)
                      : LaunchBandForHeadDim<__half>(ops, p, batch, head_dim));
  RelativeBandTableKernel<<<p.heads, kTableThreads, 0, ops->stream()>>>(
      p.partial, relative.buckets.data_as<const int32_t>(), dtable->data_as<float>(), batch,
      p.heads, p.tiles, p.seq, p.band, static_cast<int>(dtable->dim(0)));
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
