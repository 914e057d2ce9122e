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
// tile of 128 queries of one (batch, head), a warp's 16 rows each, q.k and
// dout.v on tensor cores (WMMA, 16x16 tiles along the band, two key tiles a
// step), dS in f32 in registers, summed per diagonal in a fixed order (no
// atomics: the same bits every run). A second kernel adds the tiles' sums
// into dtable.
//
// The work is latency-bound, not FLOP- or byte-bound, so the kernel is laid
// out to keep each warp's chains of dependent memory reads short and many
// warps resident. A block first stages the keys and values its queries' band
// reaches (at most 128 + W + 14 rows) into shared memory with 16-byte
// asynchronous copies, all in flight at once, and forms its rows' delta from
// 16-byte loads issued together; the warps' tile loop then reads only shared
// memory. On the H200 at the 24 x 1024 LM's shape (relative_bias_bench) this
// took the table's gradient from 0.187 to 0.116 ms a layer: a warp had walked
// its 16 rows' delta one row at a time, and loaded every fragment from global
// memory inside the loop. Then, on the H100: 0.120 ms with 64-query blocks
// of 4 warps (3 blocks, 12 warps an SM) and S and dP stored to shared memory
// for dS, against 0.104 in the same call with 128-query blocks of 8 warps
// (2 blocks, 16 warps an SM, a third fewer staged rows per query) and dS
// formed in registers; 0.098 in a later call with two key tiles a step.
//
// Cost per (batch, head): S * W scores, twice (q.k and dout.v), against the
// S^2 / 2 of the attention itself; no [H, S, S] memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
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

constexpr int kBandWarps = 8;
constexpr int kBandQueries = 16 * kBandWarps;  // query rows per block: a warp's tile of 16 each
constexpr int kTile = 16;  // WMMA's tile edge
constexpr int kKeyTilesPerStep = 2;  // key tiles a warp takes at once
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

// A block's shared memory: per-warp scratch and the rows' scalars (23 KB).
struct __align__(kFragmentAlignment) BandShared {
  float tiles[kBandWarps][kKeyTilesPerStep][kTile * kTile];  // per warp: its tiles' dS
  float index_tile[kTile * kTile];           // element e holds e: see element_at below
  float bins[kBandWarps][kRelativeBandMax];  // per warp: the sum at each distance
  float bias_at[kRelativeBandMax];            // the bias at each distance
  float row_lse[kBandQueries];
  float row_delta[kBandQueries];
  float warp_far[kBandWarps];
};

// The staged keys (then values) of a block: rows of D elements, kStagePad
// apart more (WMMA's ldm must be a multiple of 16 bytes; the pad spreads a
// fragment's rows over the shared-memory banks). A block's band reaches at
// most kBandQueries + band + 14 keys, from the first whole tile.
constexpr int kStagePad = 8;
__host__ __device__ inline int StageRows(int band) { return kBandQueries + band + kTile; }
template <int D>
size_t StageBytes(int band) {
  return size_t{2} * StageRows(band) * (D + kStagePad) * sizeof(uint16_t);
}

// Two blocks an SM where their staged rows fit (D up to 64): 128 registers.
template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32, D <= 64 ? 2 : 1)
    RelativeBandKernel(BandParams p) {
  using namespace nvcuda;
  __shared__ BandShared sh;
  extern __shared__ __align__(128) unsigned char stage_bytes[];
  constexpr int kLdm = D + kStagePad;
  T* k_stage = reinterpret_cast<T*>(stage_bytes);
  T* v_stage = k_stage + StageRows(p.band) * kLdm;
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

  // The keys the block's band reaches, from the first whole tile: rows
  // [key_lo, key_hi), 16 bytes a copy (RelativeBandApplies checked the
  // alignment), left in flight while the rows' delta is formed.
  const int key_lo = max(0, i0 - W + 1) / kTile * kTile;
  const int key_hi = min(S, i0 + kBandQueries);
  {
    constexpr int kChunks = D * static_cast<int>(sizeof(T)) / 16;  // per row
    const int copies = (key_hi - key_lo) * kChunks;
    for (int c = threadIdx.x; c < 2 * copies; c += blockDim.x) {
      const bool is_v = c >= copies;
      const int n = is_v ? c - copies : c;
      const int row = n / kChunks, chunk = n % kChunks;
      const T* src = (is_v ? v : k) + static_cast<int64_t>(key_lo + row) * p.kv_stride +
                     chunk * (16 / static_cast<int>(sizeof(T)));
      T* dst = (is_v ? v_stage : k_stage) + row * kLdm + chunk * (16 / static_cast<int>(sizeof(T)));
      __pipeline_memcpy_async(dst, src, 16);
    }
    __pipeline_commit();
  }

  // Each row's lse and delta = rowsum(dout * out): two threads a row, each
  // with its half's 16-byte loads all in flight at once (a warp walking its
  // rows one by one waited on memory sixteen times before its first tile).
  // S is a multiple of 16 (RelativeBandApplies): a warp's rows are all
  // inside or all past it.
  static_assert(kBandWarps * 32 == 2 * kBandQueries, "two threads a query row");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  {
    constexpr int kHalf = D / 2;                                    // elements a thread
    constexpr int kVectors = kHalf * static_cast<int>(sizeof(T)) / 16;  // 16-byte loads
    const int r = threadIdx.x / 2, half = threadIdx.x % 2, i = i0 + r;
    float part = 0.0f;
    if (i < S) {
      const uint4* o4 = reinterpret_cast<const uint4*>(out + i * p.o_stride + half * kHalf);
      const uint4* d4 = reinterpret_cast<const uint4*>(dout + i * p.o_stride + half * kHalf);
      uint4 o_vec[kVectors], d_vec[kVectors];
#pragma unroll
      for (int x = 0; x < kVectors; ++x) {
        o_vec[x] = o4[x];
        d_vec[x] = d4[x];
      }
#pragma unroll
      for (int x = 0; x < kVectors; ++x) {
        const T* o_el = reinterpret_cast<const T*>(&o_vec[x]);
        const T* d_el = reinterpret_cast<const T*>(&d_vec[x]);
#pragma unroll
        for (int e = 0; e < 8; ++e) part += ToFloat(d_el[e]) * ToFloat(o_el[e]);
      }
    }
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    if (half == 0) {
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
  for (int e = threadIdx.x; e < kTile * kTile; e += blockDim.x) sh.index_tile[e] = e;
  __pipeline_wait_prior(0);
  __syncthreads();

  const int r0 = i0 + warp * kTile;  // the warp's first query
  float far = 0.0f;                  // minus the far bucket's share, rows i >= W
  if (r0 < S) {
    float(*ds_tiles)[kTile * kTile] = sh.tiles[warp];
    float* my_bins = sh.bins[warp];
    // Which tile element each of this thread's accumulator slots holds:
    // WMMA leaves the mapping unspecified but fixed for a fragment type, so
    // a fragment loaded from a tile whose element e holds e names it. dS is
    // then formed in registers, straight from the products.
    using Accumulator = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;
    Accumulator element_at;
    wmma::load_matrix_sync(element_at, sh.index_tile, kTile, wmma::mem_row_major);
    int row_minus_col[Accumulator::num_elements];
    float lse_of[Accumulator::num_elements], delta_of[Accumulator::num_elements];
    bool past_band[Accumulator::num_elements];  // rows i >= W: their far keys share a bucket
#pragma unroll
    for (int t = 0; t < Accumulator::num_elements; ++t) {
      const int e = static_cast<int>(element_at.x[t]), r = e / kTile;
      row_minus_col[t] = r - e % kTile;
      lse_of[t] = row_lse[warp * kTile + r];
      delta_of[t] = row_delta[warp * kTile + r];
      past_band[t] = r0 + r >= W;  // every row < S: S is a multiple of 16
    }
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
    // kKeyTilesPerStep key tiles at once: their products issue together, then
    // their dS, then their diagonal sums, each in key order (the same sums,
    // in the same order, as one tile at a time).
    for (int kt0 = kt_lo; kt0 <= kt_hi; kt0 += kKeyTilesPerStep) {
      Accumulator s_acc[kKeyTilesPerStep], dp_acc[kKeyTilesPerStep];
#pragma unroll
      for (int u = 0; u < kKeyTilesPerStep; ++u) {
        wmma::fill_fragment(s_acc[u], 0.0f);
        wmma::fill_fragment(dp_acc[u], 0.0f);
      }
#pragma unroll
      for (int kk = 0; kk < D / kTile; ++kk) {
#pragma unroll
        for (int u = 0; u < kKeyTilesPerStep; ++u) {
          if (kt0 + u > kt_hi) continue;  // past the staged keys: dS stays 0 below
          const int row = (kt0 + u) * kTile - key_lo;
          wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> b_k, b_v;
          wmma::load_matrix_sync(b_k, k_stage + row * kLdm + kk * kTile,
                                 static_cast<unsigned>(kLdm));
          wmma::load_matrix_sync(b_v, v_stage + row * kLdm + kk * kTile,
                                 static_cast<unsigned>(kLdm));
          wmma::mma_sync(s_acc[u], a_q[kk], b_k, s_acc[u]);
          wmma::mma_sync(dp_acc[u], a_do[kk], b_v, dp_acc[u]);
        }
      }
      // dS of the tiles' band elements, in place of S (0 elsewhere; keys
      // past the query, as every key of a tile past kt_hi is, have dist < 0).
#pragma unroll
      for (int u = 0; u < kKeyTilesPerStep; ++u) {
        const int first_dist = r0 - (kt0 + u) * kTile;  // the distance at r == c
#pragma unroll
        for (int t = 0; t < Accumulator::num_elements; ++t) {
          const int dist = first_dist + row_minus_col[t];
          float ds = 0.0f;
          if (dist >= 0 && dist < W) {
            const float prob = __expf(s_acc[u].x[t] * p.scale + bias_at[dist] - lse_of[t]);
            ds = prob * (dp_acc[u].x[t] - delta_of[t]);
            if (past_band[t]) far -= ds;
          }
          s_acc[u].x[t] = ds;
        }
        wmma::store_matrix_sync(ds_tiles[u], s_acc[u], kTile, wmma::mem_row_major);
      }
      __syncwarp();
      // Lane l sums each tile's diagonal r - c = l - 15 (at most 16 elements).
      if (lane < 2 * kTile - 1) {
        const int diag = lane - (kTile - 1);
#pragma unroll
        for (int u = 0; u < kKeyTilesPerStep; ++u) {
          const int dist = r0 - (kt0 + u) * kTile + diag;
          if (dist >= 0 && dist < W) {
            float sum = 0.0f;
#pragma unroll
            for (int r = 0; r < kTile; ++r) {  // unrolled: the 16 loads issue together
              const int c = r - diag;
              if (c >= 0 && c < kTile) sum += ds_tiles[u][r * kTile + c];
            }
            my_bins[dist] += sum;
          }
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
  __shared__ int32_t bucket_at[kRelativeBandMax];  // each distance's bucket
  const int h = blockIdx.x;
  const int blocks = batch * tiles;  // the partial rows of this head
  for (int x = threadIdx.x; x < kTableSplit * (band + 1); x += blockDim.x) {
    const int d = x % (band + 1), part = x / (band + 1);
    float sum = 0.0f;
#pragma unroll 4
    for (int n = part; n < blocks; n += kTableSplit) {
      const int b = n / tiles, t = n % tiles;
      sum += partial[((static_cast<int64_t>(b) * heads + h) * tiles + t) * (band + 1) + d];
    }
    split_sums[part][d] = sum;
  }
  // The last query sees every distance d at key seq - 1 - d: read once here,
  // not once per bucket and distance from global memory.
  const int32_t* last = buckets + static_cast<int64_t>(seq - 1) * seq;
  for (int d = threadIdx.x; d < band && d < seq; d += blockDim.x) bucket_at[d] = last[seq - 1 - d];
  __syncthreads();
  const int far = band < seq ? last[seq - 1 - band] : -1;
  for (int n = threadIdx.x; n < num_buckets; n += blockDim.x) {
    float sum = 0.0f;
    for (int d = 0; d < band && d < seq; ++d) {
      if (bucket_at[d] == n) {
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
  const size_t stage = StageBytes<D>(p.band);
  // The static BandShared counts against the default 48 KiB too.
  RETURN_IF_ERROR(AllowSharedBytes(ops->context(), RelativeBandKernel<T, D>,
                                   stage + sizeof(BandShared),
                                   "cudaFuncSetAttribute(RelativeBandKernel)"));
  RelativeBandKernel<T, D>
      <<<dim3(p.tiles, p.heads, batch), kBandWarps * 32, stage, ops->stream()>>>(p);
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
  // Every row of q, k and v starts 16-byte aligned (WMMA's loads of q, the
  // staging copies of k and v).
  if (qkv.q_token_stride % 8 != 0 || qkv.kv_token_stride % 8 != 0) {
    return absl::UnimplementedError("q, k or v rows not 16-byte aligned");
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
