// Unfused attention for small head_dim (D <= 32, no bias): Flax's
// MultiHeadDotProductAttention in float32 at qkv_features 128 over 32 heads
// (D 4), which cuDNN declines (float32, D not a multiple of 8). The general
// fallback puts a warp across head_dim (28 of 32 lanes idle at D 4) and a
// block on every query row; here one thread owns one row instead:
//
//   forward  one thread per query row: q and the output accumulator in
//            registers, k/v tiles in shared memory shared by the block's 128
//            rows, online softmax (running max and sum) in base 2, lse out.
//   dq       one thread per query row over k/v tiles. rowsum(P * dP) first:
//            rowsum(dout * out) for f32 out, else a sweep recomputing P.
//   dk, dv   one thread per key row over q/dout tiles (and the query heads
//            of its GQA group): each dk/dv element has one writer, so no
//            atomics and the results do not depend on scheduling.
//
// With dropout the dq pass stores its draws, one bit per score, in the
// caller's scratch, and the dk/dv pass reads them instead of hashing again
// (the hash is about half of each pass at D 4); past a size limit both passes
// hash.
//
// Causal: blocks stop at their last row's visible key, and the heaviest
// blocks are issued first. Dropout draws DropoutUniform with ops.h's element
// index, as the CPU reference and the general fallback do; the integer
// comparison in Kept() is that float comparison exactly.
//
// Cost at B4 H32 S2048 D4 causal, dropout 0.1 (per visible score: 8 FMAs in
// the forward, 16 in the backward, one exp2 and one dropout hash of about 20
// integer instructions per pass): issue-bound on the hash and the exp, not on
// memory (the tensors are 4 MiB each and stay in L2).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_elem.cuh"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/fp8.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr int kRows = 128;   // threads per block: one query (or key) row each
constexpr int kStage = 64;   // keys (or queries) staged in shared memory at a time
constexpr int kChunk = 16;   // forward: scores per online-softmax update (registers)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

std::atomic<int64_t> small_head_calls{0};
// The most workspace the backward takes to keep the dq pass's dropout bits for
// the dk/dv pass (one bit per score: 64 MiB at B4 H32 S2048). Past it each
// pass draws the bits itself.
std::atomic<int64_t> dropout_bits_limit{int64_t{256} << 20};

// What every kernel reads besides its tensors.
struct SmallHeadParams {
  AttentionProblem p;
  float scale_log2 = 0.0f;  // scale * log2(e): scores in base 2, so exp is one exp2
  float keep_scale = 1.0f;  // 1 / (1 - dropout_rate)
  uint64_t dropout_key = 0;  // DropoutUniform's seed mix, once per call
  uint32_t keep_threshold = 0;  // kept iff the 24 random bits are >= this
  int64_t tiles = 0;  // blocks of kRows rows per (batch, head)
};

__device__ __forceinline__ int64_t ClampedLength(const int32_t* lengths, int64_t b, int64_t max) {
  if (lengths == nullptr) return max;
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > max ? max : len);
}

// One past the last key query i sees (a prefix); 0 when it sees none.
__device__ __forceinline__ int64_t VisibleEnd(bool causal, int64_t q_len, int64_t kv_len,
                                              int64_t i) {
  if (i >= q_len) return 0;
  return causal && i + 1 < kv_len ? i + 1 : kv_len;
}

// DropoutUniform(seed, index) >= rate, in integers. DropoutUniform is
// (MixBits(key ^ index) >> 40) / 2^24 with key = MixBits(seed + golden ratio);
// MixBits' last step (z ^= z >> 31) leaves bits 33..63 as they are, so it
// drops out, and u / 2^24 >= rate exactly when u >= ceil(rate * 2^24) (a
// power-of-two scaling, exact in float).
__device__ __forceinline__ bool Kept(uint64_t key, uint64_t index, uint32_t threshold) {
  uint64_t z = key ^ index;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return static_cast<uint32_t>(z >> 40) >= threshold;
}

// 2^x in one MUFU instruction. Flushing results under 2^-126 to zero drops
// probabilities below 1e-38 (exp2f would keep them as denormals, at the cost
// of a range fix-up on every score); 2^-inf is 0, as masked scores need.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// x . row, row a kD-float row of a shared-memory tile.
template <int kD>
__device__ __forceinline__ float Dot(const float (&x)[kD], const float4* row) {
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < kD / 4; ++c) {
    const float4 t = row[c];
    sum = fmaf(x[4 * c], t.x, sum);
    sum = fmaf(x[4 * c + 1], t.y, sum);
    sum = fmaf(x[4 * c + 2], t.z, sum);
    sum = fmaf(x[4 * c + 3], t.w, sum);
  }
  return sum;
}

// acc += w * row.
template <int kD>
__device__ __forceinline__ void Axpy(float w, const float4* row, float (&acc)[kD]) {
#pragma unroll
  for (int c = 0; c < kD / 4; ++c) {
    const float4 t = row[c];
    acc[4 * c] = fmaf(w, t.x, acc[4 * c]);
    acc[4 * c + 1] = fmaf(w, t.y, acc[4 * c + 1]);
    acc[4 * c + 2] = fmaf(w, t.z, acc[4 * c + 2]);
    acc[4 * c + 3] = fmaf(w, t.w, acc[4 * c + 3]);
  }
}

// tile[r][:] = src rows first + r (n of them, `stride` elements apart) as
// float; rows past n and columns past dim are zero, so that the padded lanes
// add nothing and a masked score (weight 0) never meets a NaN left in
// shared memory.
template <int kD>
__device__ __forceinline__ void StageRows(const void* src, DType dtype, int64_t first,
                                          int64_t stride, int n, int dim,
                                          float4 (*tile)[kD / 4]) {
  float* flat = reinterpret_cast<float*>(tile);
  for (int e = threadIdx.x; e < kStage * kD; e += kRows) {
    const int r = e / kD;
    const int d = e % kD;
    flat[e] = r < n && d < dim ? LoadElem(src, dtype, first + r * stride + d) : 0.0f;
  }
}

// x[d] = src[offset + d] * factor for d < dim, else 0.
template <int kD>
__device__ __forceinline__ void LoadRow(const void* src, DType dtype, int64_t offset, int dim,
                                        float factor, float (&x)[kD]) {
#pragma unroll
  for (int d = 0; d < kD; ++d) x[d] = d < dim ? LoadElem(src, dtype, offset + d) * factor : 0.0f;
}

template <int kD>
__device__ __forceinline__ void StoreRow(void* dst, DType dtype, int64_t offset, int dim,
                                         float factor, const float (&x)[kD]) {
#pragma unroll
  for (int d = 0; d < kD; ++d) {
    if (d < dim) StoreElem(dst, dtype, offset + d, x[d] * factor);
  }
}

// The query rows of one block: (b, h) and rows [i0, i0 + kRows). Blocks run
// from the last row tile to the first, the heaviest first under causal.
struct QueryBlock {
  int64_t b, h, kvh, i0, q_len, kv_len;
  bool causal;
  __device__ explicit QueryBlock(const SmallHeadParams& sp) {
    const AttentionShape& s = sp.p.shape;
    // 32-bit: the grid has fewer than 2^31 blocks (SmallHeadAttentionFits),
    // and a 64-bit division is a subroutine call.
    const uint32_t heads = static_cast<uint32_t>(s.batch * s.q_heads);
    const uint32_t bh = blockIdx.x % heads;
    b = bh / static_cast<uint32_t>(s.q_heads);
    h = bh % static_cast<uint32_t>(s.q_heads);
    const uint32_t group = static_cast<uint32_t>(s.q_heads) / static_cast<uint32_t>(s.kv_heads);
    kvh = static_cast<uint32_t>(h) / group;
    i0 = (sp.tiles - 1 - static_cast<int64_t>(blockIdx.x / heads)) * kRows;
    q_len = ClampedLength(sp.p.q_seqlens, b, s.q_seq);
    kv_len = ClampedLength(sp.p.kv_seqlens, b, s.kv_seq);
    causal = sp.p.causal;
  }
  // One past the last key row i sees.
  __device__ int64_t End(int64_t i) const { return VisibleEnd(causal, q_len, kv_len, i); }
  // Keys [0, BlockEnd()) hold every key a row of this block sees: its last
  // valid row sees the most.
  __device__ int64_t BlockEnd() const {
    const int64_t last = (i0 + kRows < q_len ? i0 + kRows : q_len) - 1;
    return last < i0 ? 0 : End(last);
  }
};

// out [B, Sq, Hq, D], lse [B, Hq, Sq]. Shared memory: k and v tiles [kStage, kD].
template <int kD, bool kDropout>
__global__ void __launch_bounds__(kRows)
    SmallHeadForwardKernel(SmallHeadParams sp, void* out, DType out_dtype, float* lse_out) {
  __shared__ float4 k_tile[kStage][kD / 4];
  __shared__ float4 v_tile[kStage][kD / 4];
  const AttentionProblem& p = sp.p;
  const AttentionShape& s = p.shape;
  const QueryBlock blk(sp);
  const int64_t i = blk.i0 + threadIdx.x;
  const int64_t end = blk.End(i);
  const int64_t block_end = blk.BlockEnd();
  // Keys below block_full are visible to every row of the block that has any.
  const int64_t block_full = blk.End(blk.i0);
  const int dim = static_cast<int>(s.head_dim);
  const int64_t q_offset = ((blk.b * s.q_seq + i) * s.q_heads + blk.h) * s.head_dim;
  const int64_t kv_stride = s.kv_heads * s.head_dim;
  const int64_t kv_first = (blk.b * s.kv_seq * s.kv_heads + blk.kvh) * s.head_dim;
  const int64_t row = (blk.b * s.q_heads + blk.h) * s.q_seq + i;
  const uint64_t drop_base = static_cast<uint64_t>(row * s.kv_seq);

  float q[kD];
  if (end > 0) {
    LoadRow<kD>(p.q, p.q_dtype, q_offset, dim, sp.scale_log2, q);
  } else {
#pragma unroll
    for (int d = 0; d < kD; ++d) q[d] = 0.0f;
  }
  float acc[kD];
#pragma unroll
  for (int d = 0; d < kD; ++d) acc[d] = 0.0f;
  float running_max = -INFINITY;  // base 2
  float running_sum = 0.0f;       // of the undropped probabilities

  for (int64_t s0 = 0; s0 < block_end; s0 += kStage) {
    const int n = static_cast<int>(block_end - s0 < kStage ? block_end - s0 : kStage);
    __syncthreads();  // the previous tiles are consumed
    StageRows<kD>(p.k, p.k_dtype, kv_first + s0 * kv_stride, kv_stride, n, dim, k_tile);
    StageRows<kD>(p.v, p.v_dtype, kv_first + s0 * kv_stride, kv_stride, n, dim, v_tile);
    __syncthreads();
    for (int c0 = 0; c0 < n; c0 += kChunk) {
      const int64_t j0 = s0 + c0;
      if (j0 >= end) break;
      float score[kChunk];
#pragma unroll
      for (int u = 0; u < kChunk; ++u) score[u] = Dot<kD>(q, k_tile[c0 + u]);
      if (j0 + kChunk > block_full) {
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (j0 + u >= end) score[u] = -INFINITY;
        }
      }
      float chunk_max = score[0];  // key j0 < end is visible: finite
#pragma unroll
      for (int u = 1; u < kChunk; ++u) chunk_max = fmaxf(chunk_max, score[u]);
      if (chunk_max > running_max) {
        const float correction = Exp2(running_max - chunk_max);  // 0 at the first chunk
        running_sum *= correction;
#pragma unroll
        for (int d = 0; d < kD; ++d) acc[d] *= correction;
        running_max = chunk_max;
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        float prob = Exp2(score[u] - running_max);
        running_sum += prob;
        if (kDropout && !Kept(sp.dropout_key, drop_base + j0 + u, sp.keep_threshold)) {
          prob = 0.0f;
        }
        Axpy<kD>(prob, v_tile[c0 + u], acc);
      }
    }
  }
  if (i >= s.q_seq) return;
  // A row with no visible key outputs zeros and gets lse = +inf.
  float lse = INFINITY;
  float factor = 0.0f;
  if (end > 0) {
    lse = (running_max + log2f(running_sum)) * kLn2;
    factor = (kDropout ? sp.keep_scale : 1.0f) / running_sum;
  }
  StoreRow<kD>(out, out_dtype, q_offset, dim, factor, acc);
  lse_out[row] = lse;
}

// One sweep of a dq thread over the keys it sees. With P = exp2(score - lse2)
// and dP = (dout . v_j) * M_j: kRowDot adds P dP to row_dot; else
// dq += P (dP - row_dot) k_j (scale applied by the caller). kWriteBits: also
// stores the row's dropout bits for the dk/dv pass, bit j % 32 of word
// bits[(j / 32) * rows + row] (rows = B*Hq*Sq: a warp's 32 rows store 32
// consecutive words).
template <int kD, bool kDropout, bool kRowDot, bool kWriteBits = false>
__device__ __forceinline__ void DqSweep(const SmallHeadParams& sp, const QueryBlock& blk,
                                        int64_t end, int64_t block_end, float lse2,
                                        uint64_t drop_base, const float (&q)[kD],
                                        const float (&g)[kD], float4 (*k_tile)[kD / 4],
                                        float4 (*v_tile)[kD / 4], float* row_dot,
                                        float (&dq)[kD], uint32_t* bits = nullptr,
                                        int64_t row = 0) {
  const AttentionProblem& p = sp.p;
  const AttentionShape& s = p.shape;
  const int dim = static_cast<int>(s.head_dim);
  const int64_t kv_stride = s.kv_heads * s.head_dim;
  const int64_t kv_first = (blk.b * s.kv_seq * s.kv_heads + blk.kvh) * s.head_dim;
  const float rd = *row_dot;
  float sum = 0.0f;
  for (int64_t s0 = 0; s0 < block_end; s0 += kStage) {
    const int n = static_cast<int>(block_end - s0 < kStage ? block_end - s0 : kStage);
    __syncthreads();
    StageRows<kD>(p.k, p.k_dtype, kv_first + s0 * kv_stride, kv_stride, n, dim, k_tile);
    StageRows<kD>(p.v, p.v_dtype, kv_first + s0 * kv_stride, kv_stride, n, dim, v_tile);
    __syncthreads();
    const int stop = static_cast<int>(end - s0 < n ? (end - s0 > 0 ? end - s0 : 0) : n);
    for (int w0 = 0; w0 < stop; w0 += 32) {  // 32 keys: one word of dropout bits
      const int w_stop = stop - w0 < 32 ? stop - w0 : 32;
      uint32_t word = 0;
#pragma unroll 4
      for (int u = 0; u < w_stop; ++u) {
        const int jj = w0 + u;
        const float prob = Exp2(Dot<kD>(q, k_tile[jj]) - lse2);
        float dprob = Dot<kD>(g, v_tile[jj]);
        if (kDropout) {
          const bool kept = Kept(sp.dropout_key, drop_base + s0 + jj, sp.keep_threshold);
          dprob = kept ? dprob * sp.keep_scale : 0.0f;
          if (kWriteBits) word |= static_cast<uint32_t>(kept) << u;
        }
        if (kRowDot) {
          sum = fmaf(prob, dprob, sum);
        } else {
          Axpy<kD>(prob * (dprob - rd), k_tile[jj], dq);
        }
      }
      if (kWriteBits) {
        const int64_t rows = s.batch * s.q_heads * s.q_seq;
        bits[(s0 + w0) / 32 * rows + row] = word;
      }
    }
  }
  if (kRowDot) *row_dot = sum;
}

// dq [B, Sq, Hq, D] and row_dot [B, Hq, Sq] (what the dk/dv pass reads).
// kRowDotFromOut: rowsum(dout * out) (f32 out); else a first sweep over the
// keys recomputes rowsum(P * dP) as the CPU reference does.
template <int kD, bool kDropout, bool kRowDotFromOut>
__global__ void __launch_bounds__(kRows)
    SmallHeadDqKernel(SmallHeadParams sp, const void* out, DType out_dtype, const void* dout,
                      DType dout_dtype, const float* lse_in, void* dq_out, DType dq_dtype,
                      float* row_dot_out, uint32_t* dropout_bits) {
  __shared__ float4 k_tile[kStage][kD / 4];
  __shared__ float4 v_tile[kStage][kD / 4];
  const AttentionProblem& p = sp.p;
  const AttentionShape& s = p.shape;
  const QueryBlock blk(sp);
  const int64_t i = blk.i0 + threadIdx.x;
  const int64_t row = (blk.b * s.q_heads + blk.h) * s.q_seq + i;
  const float lse = i < s.q_seq ? lse_in[row] : INFINITY;
  const int64_t end = isfinite(lse) ? blk.End(i) : 0;
  const int64_t block_end = blk.BlockEnd();
  const int dim = static_cast<int>(s.head_dim);
  const int64_t q_offset = ((blk.b * s.q_seq + i) * s.q_heads + blk.h) * s.head_dim;
  const uint64_t drop_base = static_cast<uint64_t>(row * s.kv_seq);
  const float lse2 = lse * kLog2e;

  float q[kD], g[kD], dq[kD];
#pragma unroll
  for (int d = 0; d < kD; ++d) q[d] = g[d] = dq[d] = 0.0f;
  float row_dot = 0.0f;
  if (end > 0) {
    LoadRow<kD>(p.q, p.q_dtype, q_offset, dim, sp.scale_log2, q);
    LoadRow<kD>(dout, dout_dtype, q_offset, dim, 1.0f, g);
    if (kRowDotFromOut) {
#pragma unroll
      for (int d = 0; d < kD; ++d) {
        if (d < dim) row_dot = fmaf(g[d], LoadElem(out, out_dtype, q_offset + d), row_dot);
      }
    }
  }
  if (!kRowDotFromOut) {
    DqSweep<kD, kDropout, true>(sp, blk, end, block_end, lse2, drop_base, q, g, k_tile, v_tile,
                                &row_dot, dq);
  }
  if (kDropout && dropout_bits != nullptr) {  // uniform
    DqSweep<kD, kDropout, false, true>(sp, blk, end, block_end, lse2, drop_base, q, g, k_tile,
                                       v_tile, &row_dot, dq, dropout_bits, row);
  } else {
    DqSweep<kD, kDropout, false>(sp, blk, end, block_end, lse2, drop_base, q, g, k_tile, v_tile,
                                 &row_dot, dq);
  }
  if (i >= s.q_seq) return;
  StoreRow<kD>(dq_out, dq_dtype, q_offset, dim, p.scale, dq);
  row_dot_out[row] = row_dot;
}

// One q/dout tile against a dk/dv thread's key j. kMasked: the tile holds
// queries before j (causal), whose weights are zero. kBits: the dropout bits
// come from the dq pass (bit `lane` of bits_row[ii]) instead of the hash.
template <int kD, bool kDropout, bool kMasked, bool kBits>
__device__ __forceinline__ void DkDvTile(const SmallHeadParams& sp, int n, int first_visible,
                                         uint64_t drop_index, uint64_t drop_step,
                                         const uint32_t* bits_row, int lane,
                                         const float (&k)[kD], const float (&v)[kD],
                                         const float4 (*q_tile)[kD / 4],
                                         const float4 (*g_tile)[kD / 4], const float2* row_tile,
                                         float (&dk)[kD], float (&dv)[kD]) {
#pragma unroll 4
  for (int ii = 0; ii < n; ++ii) {
    const float2 lse2_and_dot = row_tile[ii];
    float prob = Exp2(Dot<kD>(k, q_tile[ii]) - lse2_and_dot.x);
    if (kMasked && ii < first_visible) prob = 0.0f;
    float dprob = Dot<kD>(v, g_tile[ii]);
    float dropped = prob;  // P * M / keep_scale (the caller scales dv)
    if (kDropout) {
      const bool kept = kBits ? ((bits_row[ii] >> lane) & 1u) != 0
                              : Kept(sp.dropout_key, drop_index + ii * drop_step,
                                     sp.keep_threshold);
      dropped = kept ? prob : 0.0f;
      dprob = kept ? dprob * sp.keep_scale : 0.0f;
    }
    Axpy<kD>(dropped, g_tile[ii], dv);
    Axpy<kD>(prob * (dprob - lse2_and_dot.y), q_tile[ii], dk);
  }
}

// dk, dv [B, Skv, Hkv, D]: one thread per key row, over the queries that see
// it in every query head of its GQA group. Blocks run from the first key tile
// (the heaviest under causal). Shared memory: q and dout tiles [kStage, kD]
// and (lse * log2 e, row_dot) per staged query.
template <int kD, bool kDropout>
__global__ void __launch_bounds__(kRows)
    SmallHeadDkDvKernel(SmallHeadParams sp, const void* dout, DType dout_dtype,
                        const float* lse_in, const float* row_dot,
                        const uint32_t* dropout_bits, void* dk_out, DType dk_dtype,
                        void* dv_out, DType dv_dtype) {
  __shared__ float4 q_tile[kStage][kD / 4];
  __shared__ float4 g_tile[kStage][kD / 4];
  __shared__ float2 row_tile[kStage];
  // The dq pass's dropout bits of the staged queries: word w holds keys
  // j0 + 32 w .. j0 + 32 w + 31, the keys of warp w.
  __shared__ uint32_t bits_tile[kDropout ? kRows / 32 : 1][kStage];
  const AttentionProblem& p = sp.p;
  const AttentionShape& s = p.shape;
  const uint32_t kv_heads = static_cast<uint32_t>(s.batch * s.kv_heads);  // as QueryBlock
  const uint32_t bkh = blockIdx.x % kv_heads;
  const int64_t b = bkh / static_cast<uint32_t>(s.kv_heads);
  const int64_t kvh = bkh % static_cast<uint32_t>(s.kv_heads);
  const int64_t j0 = static_cast<int64_t>(blockIdx.x / kv_heads) * kRows;
  const int64_t group = static_cast<uint32_t>(s.q_heads) / static_cast<uint32_t>(s.kv_heads);
  const int64_t j = j0 + threadIdx.x;
  const int64_t q_len = ClampedLength(p.q_seqlens, b, s.q_seq);
  const int64_t kv_len = ClampedLength(p.kv_seqlens, b, s.kv_seq);
  const bool key_valid = j < kv_len;
  const int dim = static_cast<int>(s.head_dim);
  const int64_t kv_offset = ((b * s.kv_seq + j) * s.kv_heads + kvh) * s.head_dim;
  const int64_t q_stride = s.q_heads * s.head_dim;
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  const int64_t words_per_row = (s.kv_seq + 31) / 32;

  float k[kD], v[kD], dk[kD], dv[kD];
#pragma unroll
  for (int d = 0; d < kD; ++d) k[d] = v[d] = dk[d] = dv[d] = 0.0f;
  if (key_valid) {
    LoadRow<kD>(p.k, p.k_dtype, kv_offset, dim, sp.scale_log2, k);
    LoadRow<kD>(p.v, p.v_dtype, kv_offset, dim, 1.0f, v);
  }

  if (j0 < kv_len) {  // block-uniform: some key of the block is valid
    // Rows that see key j: i < q_len and, under causal, i >= j.
    const int64_t first_row = p.causal ? j0 : 0;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      const int64_t row_base = (b * s.q_heads + h) * s.q_seq;
      const int64_t q_first = (b * s.q_seq * s.q_heads + h) * s.head_dim;
      for (int64_t i0 = first_row; i0 < q_len; i0 += kStage) {
        const int n = static_cast<int>(q_len - i0 < kStage ? q_len - i0 : kStage);
        __syncthreads();
        StageRows<kD>(p.q, p.q_dtype, q_first + i0 * q_stride, q_stride, n, dim, q_tile);
        StageRows<kD>(dout, dout_dtype, q_first + i0 * q_stride, q_stride, n, dim, g_tile);
        for (int r = threadIdx.x; r < kStage; r += kRows) {
          row_tile[r] = r < n ? make_float2(lse_in[row_base + i0 + r] * kLog2e,
                                            row_dot[row_base + i0 + r])
                              : make_float2(INFINITY, 0.0f);
        }
        if (kDropout && dropout_bits != nullptr) {
          for (int e = threadIdx.x; e < kRows / 32 * kStage; e += kRows) {
            const int w = e / kStage;
            const int r = e % kStage;
            const int64_t word = j0 / 32 + w;
            bits_tile[w][r] = r < n && word < words_per_row
                                  ? dropout_bits[word * rows + row_base + i0 + r]
                                  : 0u;
          }
        }
        __syncthreads();
        if (!key_valid) continue;
        const uint64_t drop_index = static_cast<uint64_t>((row_base + i0) * s.kv_seq + j);
        const uint64_t drop_step = static_cast<uint64_t>(s.kv_seq);
        const uint32_t* bits_row = bits_tile[kDropout ? threadIdx.x / 32 : 0];
        const int lane = static_cast<int>(threadIdx.x % 32);
        const bool with_bits = kDropout && dropout_bits != nullptr;  // uniform
        if (p.causal && i0 < j0 + kRows) {  // block-uniform: a diagonal tile
          const int64_t first = j - i0;
          if (first >= n) continue;
          if (with_bits) {
            DkDvTile<kD, kDropout, true, true>(sp, n, static_cast<int>(first), drop_index,
                                               drop_step, bits_row, lane, k, v, q_tile, g_tile,
                                               row_tile, dk, dv);
          } else {
            DkDvTile<kD, kDropout, true, false>(sp, n, static_cast<int>(first), drop_index,
                                                drop_step, bits_row, lane, k, v, q_tile, g_tile,
                                                row_tile, dk, dv);
          }
        } else if (with_bits) {
          DkDvTile<kD, kDropout, false, true>(sp, n, 0, drop_index, drop_step, bits_row, lane, k,
                                              v, q_tile, g_tile, row_tile, dk, dv);
        } else {
          DkDvTile<kD, kDropout, false, false>(sp, n, 0, drop_index, drop_step, bits_row, lane,
                                               k, v, q_tile, g_tile, row_tile, dk, dv);
        }
      }
    }
  }
  if (j >= s.kv_seq) return;
  StoreRow<kD>(dk_out, dk_dtype, kv_offset, dim, p.scale, dk);
  StoreRow<kD>(dv_out, dv_dtype, kv_offset, dim, kDropout ? sp.keep_scale : 1.0f, dv);
}

SmallHeadParams MakeParams(const AttentionProblem& problem, int64_t rows_per_head) {
  SmallHeadParams sp;
  sp.p = problem;
  sp.scale_log2 = problem.scale * kLog2e;
  if (problem.dropout_rate > 0.0f) {
    sp.keep_scale = 1.0f / (1.0f - problem.dropout_rate);
    sp.dropout_key = MixBits(problem.dropout_seed + 0x9e3779b97f4a7c15ULL);  // as DropoutUniform
    sp.keep_threshold =
        static_cast<uint32_t>(std::ceil(static_cast<double>(problem.dropout_rate) * 16777216.0));
  }
  sp.tiles = (rows_per_head + kRows - 1) / kRows;
  return sp;
}

// Calls f(std::integral_constant<int, kD>) with kD the padded head_dim: the
// smallest of 4, 8, 16, 32 that holds it (padded lanes are zero).
template <typename F>
absl::Status WithPaddedHeadDim(int64_t head_dim, F&& f) {
  if (head_dim <= 4) return f(std::integral_constant<int, 4>());
  if (head_dim <= 8) return f(std::integral_constant<int, 8>());
  if (head_dim <= 16) return f(std::integral_constant<int, 16>());
  return f(std::integral_constant<int, 32>());
}

unsigned Blocks(int64_t heads, int64_t tiles) { return static_cast<unsigned>(heads * tiles); }

}  // namespace

bool SmallHeadAttentionFits(const AttentionProblem& problem) {
  const AttentionShape& s = problem.shape;
  if (problem.bias != nullptr || problem.mask != nullptr || problem.bottom_right ||
      s.head_dim < 1 || s.head_dim > kSmallHeadMaxHeadDim) {
    return false;
  }
  // The grids are 1-D: (batch * heads) x row tiles blocks.
  const int64_t max_blocks = std::numeric_limits<int32_t>::max();
  return s.batch * s.q_heads * ((s.q_seq + kRows - 1) / kRows) <= max_blocks &&
         s.batch * s.kv_heads * ((s.kv_seq + kRows - 1) / kRows) <= max_blocks;
}

int64_t SmallHeadAttentionCalls() { return small_head_calls.load(); }

int64_t SetSmallHeadDropoutBitsLimit(int64_t bytes) { return dropout_bits_limit.exchange(bytes); }

size_t SmallHeadDropoutBitsBytes(const AttentionProblem& problem) {
  if (problem.dropout_rate == 0.0f) return 0;
  const AttentionShape& s = problem.shape;
  const int64_t bytes = (s.kv_seq + 31) / 32 * s.batch * s.q_heads * s.q_seq * 4;
  return bytes <= dropout_bits_limit.load() ? static_cast<size_t>(bytes) : 0;
}

namespace {

// INVALID_ARGUMENT unless SmallHeadAttentionFits(problem).
absl::Status CheckSmallHeadFits(const AttentionProblem& problem) {
  if (SmallHeadAttentionFits(problem)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "attention: the small-head kernels take head_dim <= ", kSmallHeadMaxHeadDim,
      " without a bias, got head_dim ", problem.shape.head_dim));
}

}  // namespace

absl::Status SmallHeadAttentionForward(const AttentionProblem& problem, void* out,
                                       DType out_dtype, float* lse, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckSmallHeadFits(problem));
  const AttentionShape& s = problem.shape;
  small_head_calls.fetch_add(1);
  if (s.batch * s.q_heads * s.q_seq == 0) return absl::OkStatus();
  const SmallHeadParams sp = MakeParams(problem, s.q_seq);
  const unsigned blocks = Blocks(s.batch * s.q_heads, sp.tiles);
  return WithPaddedHeadDim(s.head_dim, [&](auto padded) -> absl::Status {
    constexpr int kD = decltype(padded)::value;
    if (problem.dropout_rate > 0.0f) {
      SmallHeadForwardKernel<kD, true><<<blocks, kRows, 0, stream>>>(sp, out, out_dtype, lse);
    } else {
      SmallHeadForwardKernel<kD, false><<<blocks, kRows, 0, stream>>>(sp, out, out_dtype, lse);
    }
    CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  });
}

absl::Status SmallHeadAttentionBackward(const AttentionProblem& problem, const void* out,
                                        DType out_dtype, const void* dout, DType dout_dtype,
                                        const float* lse, void* dq, DType dq_dtype, void* dk,
                                        DType dk_dtype, void* dv, DType dv_dtype,
                                        float* row_dot, uint32_t* dropout_bits,
                                        cudaStream_t stream) {
  RETURN_IF_ERROR(CheckSmallHeadFits(problem));
  const AttentionShape& s = problem.shape;
  small_head_calls.fetch_add(1);
  const bool dropout = problem.dropout_rate > 0.0f;
  const bool row_dot_from_out = out_dtype == DType::kF32;
  return WithPaddedHeadDim(s.head_dim, [&](auto padded) -> absl::Status {
    constexpr int kD = decltype(padded)::value;
    // dq first: it writes the row_dot the dk/dv pass reads.
    if (s.batch * s.q_heads * s.q_seq > 0) {
      const SmallHeadParams sp = MakeParams(problem, s.q_seq);
      const unsigned blocks = Blocks(s.batch * s.q_heads, sp.tiles);
      auto launch = [&](auto kernel) {
        kernel<<<blocks, kRows, 0, stream>>>(sp, out, out_dtype, dout, dout_dtype, lse, dq,
                                             dq_dtype, row_dot, dropout_bits);
      };
      if (dropout) {
        row_dot_from_out ? launch(SmallHeadDqKernel<kD, true, true>)
                         : launch(SmallHeadDqKernel<kD, true, false>);
      } else {
        row_dot_from_out ? launch(SmallHeadDqKernel<kD, false, true>)
                         : launch(SmallHeadDqKernel<kD, false, false>);
      }
      CUDA_RETURN_IF_LAUNCH_ERROR();
    }
    if (s.batch * s.kv_heads * s.kv_seq > 0) {
      const SmallHeadParams sp = MakeParams(problem, s.kv_seq);
      const unsigned blocks = Blocks(s.batch * s.kv_heads, sp.tiles);
      if (dropout) {
        SmallHeadDkDvKernel<kD, true><<<blocks, kRows, 0, stream>>>(
            sp, dout, dout_dtype, lse, row_dot, dropout_bits, dk, dk_dtype, dv, dv_dtype);
      } else {
        SmallHeadDkDvKernel<kD, false><<<blocks, kRows, 0, stream>>>(
            sp, dout, dout_dtype, lse, row_dot, dropout_bits, dk, dk_dtype, dv, dv_dtype);
      }
      CUDA_RETURN_IF_LAUNCH_ERROR();
    }
    return absl::OkStatus();
  });
}

}  // namespace cuda
}  // namespace te
