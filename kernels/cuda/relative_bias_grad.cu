// The gradient of a T5 relative-position table through a causal
// self-attention, without the dense dbias [H, S, S].
//
// The table's gradient is the logits' gradient dS summed per bucket:
// dtable[h, n] = sum over b, i, j with bucket(i - j) = n of dS[b, h, i, j],
// where dS = P * (dP - delta), P = exp(scale q.k + bias - lse), dP = dout.v
// and delta = rowsum(dout * out). Forming it densely (cuDNN's dBias, then a
// scatter-add) costs a [B, H, S, S] pass and puts cuDNN on its slow dBias
// implementation. Two facts make a band of diagonals enough:
//   - causal T5 buckets saturate: every key `uniform_from` (W) or more
//     positions before its query shares one bucket (W is 113 for TE's 32
//     buckets over 128 positions);
//   - each row's dS sums to zero (sum_j P dP = delta without dropout), so
//     the far bucket's share of a row is minus its band's.
// So the kernel recomputes P and dP on the W diagonals only, on tensor cores
// (mma.m16n8k16 fed by ldmatrix), dS in f32 in registers, in a fixed order
// (no atomics in any sum: the same bits every run). The last block of each
// head to finish adds the head's blocks' sums into dtable (a kernel of its
// own when the stream's group counters cannot hold every head).
//
// A block takes 128 queries (eight 16-row tiles) of one (batch, head) and
// stages their q and dout, and the keys and values their band reaches, into
// shared memory with 16-byte asynchronous copies, all in flight at once.
// Warp m then takes the key tile m tiles behind each query tile: in such a
// pair the element at (r, c) always lies at distance 16 m + r - c, so the
// warp adds dS element-wise into its registers over the eight pairs and sums
// the diagonals once, at the block's end. On the H100 at the 24 x 1024 LM's
// shape this took the kernel from 0.084 to 0.075 ms a layer (one call)
// against a warp per query tile that summed each pair's diagonals through
// shared memory (WMMA, key tile by key tile). With the pairs' work left out
// it still takes 0.044 ms: staging the rows is most of it. Splitting the
// staging into groups that the pairs wait on one by one measured no faster.
//
// Cost per (batch, head): S * W scores, twice (q.k and dout.v), against the
// S^2 / 2 of the attention itself; no [H, S, S] memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/relative_band.cuh"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

using band::kStagePad;
using band::kTableSplit;
using band::kTableThreads;
using band::kTile;
using band::LoadMatrices;
using band::MmaAccumulate;
using band::RoundAsOperand;
using band::SumHeadTable;
using band::ToFloat;
constexpr int kBandWarps = band::kWarps;
constexpr int kBandQueries = band::kBlockRows;

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
  // Where the last block of each head folds the head's dtable column (null:
  // RelativeBandTableKernel does, launched after): the stream's group
  // counters, the buckets [S, S] and dtable [H, NB].
  unsigned* heads_done;
  const int32_t* buckets;
  float* dtable;
  int num_buckets;
};

// The bias at `at` as cuDNN added it: in T (cast once when it is float32).
template <typename T>
__device__ __forceinline__ float BiasAsOperand(const BandParams& p, int64_t at) {
  return p.bias_f32 ? RoundAsOperand<T>(static_cast<const float*>(p.bias)[at])
                    : ToFloat(static_cast<const T*>(p.bias)[at]);
}

__host__ __device__ constexpr int BandOffsets(int band) { return band::Offsets(band); }
// Each warp takes offsets warp and warp + kBandWarps.
static_assert(BandOffsets(kRelativeBandMax) <= 2 * kBandWarps, "two offsets a warp at most");
// Staged key rows: the band's reach behind the first query tile, then the
// block's own 128.
__host__ __device__ inline int BandKeyRows(int band) { return band::ReachRows(band); }
template <int D>
size_t StageBytes(int band) {
  return size_t{2} * (kBandQueries + BandKeyRows(band)) * (D + kStagePad) * sizeof(uint16_t);
}

struct BandShared {
  float bias_at[kRelativeBandMax];  // the bias at each distance
  float row_lse[kBandQueries];
  float row_delta[kBandQueries];
  float warp_far[kBandWarps];
};

// The table's gradient as a kernel of its own: one block per head, after the
// band kernel, where the stream's group counters cannot hold every head.
__global__ void __launch_bounds__(kTableThreads) RelativeBandTableKernel(
    const float* partial, const int32_t* buckets, float* dtable, int batch, int heads, int tiles,
    int seq, int band, int num_buckets) {
  __shared__ float split_sums[kTableSplit * (kRelativeBandMax + 1)];
  __shared__ int32_t bucket_at[kRelativeBandMax];
  SumHeadTable(partial, buckets, dtable, batch, heads, tiles, seq, band, num_buckets, blockIdx.x,
               split_sums, bucket_at);
}

// Two blocks an SM where their staged rows fit (D up to 64).
template <typename T, int D>
__global__ void __launch_bounds__(kBandWarps * 32, D <= 64 ? 2 : 1)
    RelativeBandKernel(BandParams p) {
  __shared__ BandShared sh;
  extern __shared__ __align__(128) unsigned char stage_bytes[];
  constexpr int kLdm = D + kStagePad;
  const int W = p.band, S = p.seq, offsets = BandOffsets(W);
  T* q_stage = reinterpret_cast<T*>(stage_bytes);
  T* dout_stage = q_stage + kBandQueries * kLdm;
  T* k_stage = dout_stage + kBandQueries * kLdm;
  T* v_stage = k_stage + BandKeyRows(W) * kLdm;

  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int i0 = tile * kBandQueries;
  const int hk = h / p.group;
  const T* q = static_cast<const T*>(p.q) + static_cast<int64_t>(b) * S * p.q_stride + h * D;
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(b) * S * p.kv_stride + hk * D;
  const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(b) * S * p.kv_stride + hk * D;
  const T* out = static_cast<const T*>(p.out) + static_cast<int64_t>(b) * S * p.o_stride + h * D;
  const T* dout =
      static_cast<const T*>(p.dout) + static_cast<int64_t>(b) * S * p.o_stride + h * D;

  // Staged rows, 16 bytes a copy (RelativeBandApplies checked the
  // alignment), left in flight while the rows' delta is formed: the queries
  // [i0, q_end) and their dout; the keys and values [key0, q_end), key0 the
  // band's reach behind i0 (stage row 0; rows before the sequence are not
  // loaded, and no pair reads them).
  const int key0 = i0 - kTile * (offsets - 1);
  const int q_end = min(S, i0 + kBandQueries);
  {
    constexpr int kPerCopy = 16 / static_cast<int>(sizeof(T));
    constexpr int kCopies = D / kPerCopy;  // per row
    const int q_copies = (q_end - i0) * kCopies;
    const int kv_lo = max(0, key0);
    const int kv_copies = (q_end - kv_lo) * kCopies;
    for (int c = threadIdx.x; c < 2 * (q_copies + kv_copies); c += blockDim.x) {
      const T* src;
      T* dst;
      if (c < 2 * q_copies) {
        const bool is_dout = c >= q_copies;
        const int n = is_dout ? c - q_copies : c, row = n / kCopies, at = n % kCopies * kPerCopy;
        src = is_dout ? dout + static_cast<int64_t>(i0 + row) * p.o_stride + at
                      : q + static_cast<int64_t>(i0 + row) * p.q_stride + at;
        dst = (is_dout ? dout_stage : q_stage) + row * kLdm + at;
      } else {
        const int kv = c - 2 * q_copies;
        const bool is_v = kv >= kv_copies;
        const int n = is_v ? kv - kv_copies : kv, row = n / kCopies, at = n % kCopies * kPerCopy;
        src = (is_v ? v : k) + static_cast<int64_t>(kv_lo + row) * p.kv_stride + at;
        dst = (is_v ? v_stage : k_stage) + (kv_lo - key0 + row) * kLdm + at;
      }
      __pipeline_memcpy_async(dst, src, 16);
    }
    __pipeline_commit();
  }

  // Each row's lse and delta = rowsum(dout * out): two threads a row, each
  // with its half's 16-byte loads all in flight at once. S is a multiple of
  // 16 (RelativeBandApplies): a query tile's rows are all inside or all past it.
  static_assert(kBandWarps * 32 == 2 * kBandQueries, "two threads a query row");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  {
    const int r = threadIdx.x / 2, i = i0 + r;
    const float part = band::RowDelta<T, D>(out, dout, p.o_stride, i, S);
    if (threadIdx.x % 2 == 0) {
      sh.row_delta[r] = part;
      sh.row_lse[r] = i < S ? p.lse[(static_cast<int64_t>(b) * p.heads + h) * S + i] : 0.0f;
    }
  }
  const int64_t last_row = (static_cast<int64_t>(h) * S + (S - 1)) * S;
  for (int d = threadIdx.x; d < kRelativeBandMax; d += blockDim.x) {
    sh.bias_at[d] = d < W && d < S ? BiasAsOperand<T>(p, last_row + S - 1 - d) : 0.0f;
  }
  __pipeline_wait_prior(0);
  __syncthreads();

  // mma.m16n8k16's accumulator: element e of n-block nb is row g + 8 (e / 2),
  // column 8 nb + 2 qd + e % 2 of the 16x16 pair. ldmatrix's row addresses:
  // a query tile's four 8x8 quarters in the A fragment's order, a key tile's
  // in the order of the two n-blocks' B fragments.
  const int g = lane / 4, qd = lane % 4;
  const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_col = (lane >> 4) * 8;
  const int b_row = (lane & 7) + (lane >> 4) * 8, b_col = ((lane >> 3) & 1) * 8;
  float far = 0.0f;  // minus the far bucket's share: the band's dS of rows i >= W
  float acc[2][2][4] = {};  // per offset the warp takes: dS summed over the query tiles
#pragma unroll
  for (int slot = 0; slot < 2; ++slot) {
    const int m = warp + slot * kBandWarps;
    if (m >= offsets) continue;
    // Each element's distance, so its band membership and bias, is the same
    // in every pair at this offset.
    bool in_band[2][4];
    float bias[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dist = kTile * m + g + 8 * (e >> 1) - (8 * nb + 2 * qd + (e & 1));
        in_band[nb][e] = dist >= 0 && dist < W;
        bias[nb][e] = in_band[nb][e] ? sh.bias_at[dist] : 0.0f;
      }
    }
    for (int qt = 0; qt < kBandWarps; ++qt) {
      const int row0 = i0 + kTile * qt;
      if (row0 >= S) break;
      if (row0 < kTile * m) continue;  // its key tile is before the sequence
      const T* q_tile = q_stage + (kTile * qt + a_row) * kLdm + a_col;
      const T* dout_tile = dout_stage + (kTile * qt + a_row) * kLdm + a_col;
      const int key_row = kTile * (qt - m + offsets - 1) + b_row;
      const T* k_tile = k_stage + key_row * kLdm + b_col;
      const T* v_tile = v_stage + key_row * kLdm + b_col;
      float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < D / kTile; ++kk) {
        uint32_t a_q[4], a_dout[4], b_k[4], b_v[4];
        LoadMatrices(a_q, q_tile + kk * kTile);
        LoadMatrices(a_dout, dout_tile + kk * kTile);
        LoadMatrices(b_k, k_tile + kk * kTile);
        LoadMatrices(b_v, v_tile + kk * kTile);
        MmaAccumulate<T>(s[0], a_q, b_k[0], b_k[1]);
        MmaAccumulate<T>(s[1], a_q, b_k[2], b_k[3]);
        MmaAccumulate<T>(dp[0], a_dout, b_v[0], b_v[1]);
        MmaAccumulate<T>(dp[1], a_dout, b_v[2], b_v[3]);
      }
      const int local = kTile * qt + g;
      const float lse[2] = {sh.row_lse[local], sh.row_lse[local + 8]};
      const float delta[2] = {sh.row_delta[local], sh.row_delta[local + 8]};
      const bool has_far[2] = {row0 + g >= W, row0 + g + 8 >= W};
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!in_band[nb][e]) continue;
          const int hi = e >> 1;
          const float prob = __expf(s[nb][e] * p.scale + bias[nb][e] - lse[hi]);
          const float ds = prob * (dp[nb][e] - delta[hi]);
          acc[slot][nb][e] += ds;
          if (has_far[hi]) far -= ds;
        }
      }
    }
  }
  __syncthreads();  // every warp is past the staged rows: their memory takes the sums
  float* sums_at = reinterpret_cast<float*>(stage_bytes);  // [offset][16 x 16]
  static_assert(kBandQueries * (32 + kStagePad) * sizeof(T) >=
                    BandOffsets(kRelativeBandMax) * kTile * kTile * sizeof(float),
                "the staged queries hold every offset's sums");
#pragma unroll
  for (int slot = 0; slot < 2; ++slot) {
    const int m = warp + slot * kBandWarps;
    if (m >= offsets) continue;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sums_at[m * kTile * kTile + (g + 8 * (e >> 1)) * kTile + 8 * nb + 2 * qd + (e & 1)] =
            acc[slot][nb][e];
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) far += __shfl_xor_sync(0xffffffffu, far, offset);
  if (lane == 0) sh.warp_far[warp] = far;
  __syncthreads();
  // Distance d: diagonal d - 16 m of each offset m's sums, in offset order.
  float* sums = p.partial + ((static_cast<int64_t>(b) * p.heads + h) * p.tiles + tile) * (W + 1);
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    float sum = 0.0f;
    for (int m = 0; m < offsets; ++m) {
      const int diag = d - kTile * m;
      if (diag <= -kTile || diag >= kTile) continue;
      for (int r = max(0, diag); r < min(kTile, kTile + diag); ++r) {
        sum += sums_at[m * kTile * kTile + r * kTile + r - diag];
      }
    }
    sums[d] = sum;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kBandWarps; ++w) sum += sh.warp_far[w];
    sums[W] = sum;
  }
  if (p.heads_done == nullptr) return;
  // The head's last block to finish sums its dtable column (as FoldAmax
  // does the amax): no second launch, and the other heads' blocks hide it.
  if (!band::LastBlockOfHead(p.heads_done, h, gridDim.x * gridDim.z)) return;
  static_assert(kTableSplit * (kRelativeBandMax + 1) + kRelativeBandMax <=
                    kBandQueries * (32 + kStagePad) * sizeof(T) / sizeof(float),
                "the staged rows hold the table's sums");
  float* split_sums = reinterpret_cast<float*>(stage_bytes);
  int32_t* bucket_at =
      reinterpret_cast<int32_t*>(split_sums + kTableSplit * (kRelativeBandMax + 1));
  SumHeadTable(p.partial, p.buckets, p.dtable, static_cast<int>(gridDim.z), p.heads, p.tiles, S,
               W, p.num_buckets, h, split_sums, bucket_at);
  if (threadIdx.x == 0) p.heads_done[h] = 0;  // the next launch on this stream sees it
}

template <typename T, int D>
absl::Status LaunchBand(CudaOps* ops, cudaStream_t stream, const BandParams& p, int batch) {
  const size_t stage = StageBytes<D>(p.band);
  // The static BandShared counts against the default 48 KiB too.
  RETURN_IF_ERROR(AllowSharedBytes(ops->context(), RelativeBandKernel<T, D>,
                                   stage + sizeof(BandShared),
                                   "cudaFuncSetAttribute(RelativeBandKernel)"));
  RelativeBandKernel<T, D>
      <<<dim3(p.tiles, p.heads, batch), kBandWarps * 32, stage, stream>>>(p);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchBandForHeadDim(CudaOps* ops, cudaStream_t stream, const BandParams& p,
                                  int batch, int head_dim) {
  switch (head_dim) {
    case 32: return LaunchBand<T, 32>(ops, stream, p, batch);
    case 64: return LaunchBand<T, 64>(ops, stream, p, batch);
    case 128: return LaunchBand<T, 128>(ops, stream, p, batch);
    default: break;
  }
  return absl::UnimplementedError(absl::StrCat("head_dim ", head_dim, " (32, 64 or 128)"));
}

}  // namespace

absl::Status LaunchRelativeBandTable(const float* partial, const int32_t* buckets, float* dtable,
                                     int batch, int heads, int tiles, int seq, int band,
                                     int num_buckets, cudaStream_t stream) {
  RelativeBandTableKernel<<<heads, kTableThreads, 0, stream>>>(partial, buckets, dtable, batch,
                                                               heads, tiles, seq, band,
                                                               num_buckets);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

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
  // Every row of q, k and v starts 16-byte aligned: the staging copies.
  for (const void* operand : {qkv.q, qkv.k, qkv.v}) {
    if (reinterpret_cast<uintptr_t>(operand) % 16 != 0) {
      return absl::UnimplementedError("q, k or v not 16-byte aligned");
    }
  }
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
  // Freed at return: the allocator orders its reuse after this stream's work.
  ASSIGN_OR_RETURN(const Tensor partial,
                   ops->Allocate(DType::kF32, {s.batch * s.q_heads * p.tiles, p.band + 1}));
  p.partial = partial.data_as<float>();
  p.buckets = relative.buckets.data_as<const int32_t>();
  p.dtable = dtable->data_as<float>();
  p.num_buckets = static_cast<int>(dtable->dim(1));  // [H, NB]
  const bool fold = p.heads <= kFoldGroups;
  p.heads_done = fold ? ops->fold_groups() : nullptr;
  const int head_dim = static_cast<int>(s.head_dim);
  cudaStream_t stream = ops->stream();
  RETURN_IF_ERROR(qkv.dtype == DType::kBF16
                      ? LaunchBandForHeadDim<__nv_bfloat16>(ops, stream, p, batch, head_dim)
                      : LaunchBandForHeadDim<__half>(ops, stream, p, batch, head_dim));
  if (fold) return absl::OkStatus();
  return LaunchRelativeBandTable(p.partial, p.buckets, p.dtable, batch, p.heads, p.tiles, p.seq,
                                 p.band, p.num_buckets, stream);
}

}  // namespace cuda
}  // namespace te
