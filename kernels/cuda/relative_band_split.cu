// TE's relative position bias inside a causal self-attention without the
// dense bias [H, S, S]: the far/band split.
//
// Causal T5 buckets saturate: every key W (RelativeBuckets::uniform_from)
// or more positions before its query carries one bias value per head, c_h.
// So the attention splits exactly into
//   - far: queries W..S-1 against keys 0..S-W-1 under a top-left causal mask
//     on those views (key j <= i - W), no bias: cuDNN's bias-free kernels on
//     rows inside the full sequences (QkvMemory::batch_rows), its
//     log-sum-exp plus c_h;
//   - band: the W diagonals, each score's bias looked up by its distance:
//     the kernels here, on tensor cores (relative_band.cuh).
// Forward: cuDNN writes the far output into out's rows W.. and its
// log-sum-exp aside; the band kernel then merges both by their
// log-sum-exps, in place. Backward: cuDNN's bias-free backward on the far
// views with the merged output and stats lse - c_h (its recomputed P is then
// the merged softmax on the far keys: exact), and the band's dq, dk and dv
// added to it by two kernels. One per key tile forms each band pair's S and
// dP once: dk, dv, the table's gradient (as the band kernel of
// relative_bias_grad.cu forms it) and the pair's dS, which it leaves for one
// per query tile that adds dS k into dq. Each sums in a fixed order (the
// same bits every run).
// bench/results/2026-12-07-relative-band-split-plan/ checks the split in
// float64 against the dense bias.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cmath>
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

using band::AsOperandA;
using band::BiasAtDistance;
using band::kBlockRows;
using band::kStagePad;
using band::kTile;
using band::kWarps;
using band::Lanes;
using band::LoadMatrices;
using band::LoadMatricesTransposed;
using band::MmaAccumulate;
using band::Offsets;
using band::PackPair;
using band::ReachRows;
using band::StageRows;
using band::UnpackPair;

static_assert(kWarps * 32 == 2 * kBlockRows, "two threads a query row");

struct SplitParams {
  const void* q;  // batch 0, head 0 of each; tokens q_stride / kv_stride apart
  const void* k;
  const void* v;
  int64_t q_stride, kv_stride;
  int64_t o_stride;  // out, dout: [B, S, Hq, D]
  int batch, seq, heads, group, band, tiles;
  float scale;
  BandBias bias;
  // Forward.
  void* out;
  float* lse;            // [B, Hq, S]: written (forward), read (backward)
  const float* far_lse;  // [B, Hq, S - W], cuDNN's; null where S <= W
  // Backward: the gradients in q's (dq) and k's (dk, dv) layouts.
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* delta;     // [B, Hq, S]: rowsum(dout * out), RowStatsKernel's
  float* far_stats;  // [B, Hq, S - W]: lse - c_h for cuDNN's far backward; null where S <= W
  void* ds_pairs;   // each band pair's dS, the key kernel's, for the query kernel (PairIndex)
  float* partial;   // [B, Hq, tiles, W + 1]
  unsigned* heads_done;  // null: LaunchRelativeBandTable sums the partial rows
  const int32_t* buckets;
  float* dtable;
  int num_buckets;
};

constexpr float kNegInf = -INFINITY;

// ---- the work loop ------------------------------------------------------------
// Each kernel is persistent: its grid is the blocks the device holds at once,
// each walking work items (tile, head, batch), tile fastest, so the blocks in
// flight share their heads' band rows in L2. A block stages an item's rows,
// then computes on them; two blocks an SM (D <= 64) overlap one's staging
// with the other's compute. One block an SM with the next item's rows
// double-buffered measured slower on an H100
// (bench/results/2026-12-07-h100-relative-split-persistent/): the buffers and the
// backward kernels' registers (134 and 175 unbounded) left 8 warps an SM,
// too few to hide the compute's latencies.
struct Item {
  int tile, h, b;
};
__host__ __device__ __forceinline__ int Items(const SplitParams& p) {
  return p.tiles * p.heads * p.batch;
}
__device__ __forceinline__ Item ItemAt(int n, int tiles, int heads) {
  return Item{n % tiles, (n / tiles) % heads, n / (tiles * heads)};
}

// The bias at distances 0..W (W: the far keys' c_h) into shared memory.
template <typename T>
__device__ __forceinline__ void LoadBias(const SplitParams& p, int h, float* bias_at) {
  for (int d = threadIdx.x; d <= p.band; d += blockDim.x) {
    bias_at[d] = d < p.seq ? BiasAtDistance<T>(p.bias, h, p.seq, d) : 0.0f;
  }
}

// stage(item) issues an item's asynchronous copies (its head's bias goes
// into bias_at beside them); compute(item) works on them once they have
// landed. Every thread of the block calls it, and both may synchronise the
// block.
template <typename T, typename Stage, typename Compute>
__device__ __forceinline__ void ForEachItem(const SplitParams& p, float* bias_at, Stage stage,
                                            Compute compute) {
  const int items = Items(p);
  for (int n = blockIdx.x; n < items; n += gridDim.x) {
    const Item it = ItemAt(n, p.tiles, p.heads);
    stage(it);
    LoadBias<T>(p, it.h, bias_at);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    compute(it);
    __syncthreads();  // the stage is free for the next item
  }
}

// ---- forward ----------------------------------------------------------------
// An item is 128 queries of one (batch, head), a warp one 16-row tile: an
// online softmax over the key tiles its band reaches (the bias looked up by
// distance, keys outside the band masked), P V on tensor cores, then the
// merge with cuDNN's far rows.
template <int D>
__host__ __device__ constexpr int ForwardStageElements(int band) {
  return (kBlockRows + 2 * ReachRows(band)) * (D + kStagePad);
}

// Stage row 0 of k and v is key0, the band's reach behind i0; rows before
// the sequence are not loaded, and no tile reads them.
template <typename T, int D>
__device__ __forceinline__ void StageForward(const SplitParams& p, const Item& it, T* stage) {
  constexpr int kLdm = D + kStagePad;
  const int S = p.seq, offsets = Offsets(p.band);
  T* q_stage = stage;
  T* k_stage = q_stage + kBlockRows * kLdm;
  T* v_stage = k_stage + ReachRows(p.band) * kLdm;
  const int hk = it.h / p.group, i0 = it.tile * kBlockRows;
  const T* q = static_cast<const T*>(p.q) + static_cast<int64_t>(it.b) * S * p.q_stride + it.h * D;
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(it.b) * S * p.kv_stride + hk * D;
  const T* v = static_cast<const T*>(p.v) + static_cast<int64_t>(it.b) * S * p.kv_stride + hk * D;
  const int key0 = i0 - kTile * (offsets - 1);
  const int q_end = min(S, i0 + kBlockRows);
  const int kv_lo = max(0, key0);
  StageRows<T, D>(q_stage, q + static_cast<int64_t>(i0) * p.q_stride, p.q_stride, q_end - i0);
  StageRows<T, D>(k_stage + (kv_lo - key0) * kLdm, k + static_cast<int64_t>(kv_lo) * p.kv_stride,
                  p.kv_stride, q_end - kv_lo);
  StageRows<T, D>(v_stage + (kv_lo - key0) * kLdm, v + static_cast<int64_t>(kv_lo) * p.kv_stride,
                  p.kv_stride, q_end - kv_lo);
}

template <typename T, int D>
__device__ __forceinline__ void ForwardItem(const SplitParams& p, const Item& it, const T* stage,
                                            const float* bias_at) {
  constexpr int kLdm = D + kStagePad;
  const int W = p.band, S = p.seq, offsets = Offsets(W);
  const T* q_stage = stage;
  const T* k_stage = q_stage + kBlockRows * kLdm;
  const T* v_stage = k_stage + ReachRows(W) * kLdm;
  const int h = it.h, b = it.b;
  const int warp = threadIdx.x / 32;
  const Lanes l(threadIdx.x % 32);
  const int r0 = it.tile * kBlockRows + kTile * warp;
  if (r0 >= S) return;  // S is a multiple of 16: a tile is all inside or all past it
  uint32_t a_q[D / kTile][4];
#pragma unroll
  for (int kk = 0; kk < D / kTile; ++kk) {
    LoadMatrices(a_q[kk], q_stage + (kTile * warp + l.a_row) * kLdm + kk * kTile + l.a_col);
  }
  float o[D / 8][4] = {};
  float row_max[2] = {kNegInf, kNegInf};
  float row_sum[2] = {0.0f, 0.0f};  // this lane's columns; the quad's sum at the end
  // Offset 0 holds each row's diagonal: every row's maximum is finite after it.
  for (int m = 0; m < offsets && kTile * m <= r0; ++m) {
    const int key_row = kTile * (warp - m + offsets - 1);  // in the stage
    float s[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / kTile; ++kk) {
      uint32_t b_k[4];
      LoadMatrices(b_k, k_stage + (key_row + l.b_row) * kLdm + kk * kTile + l.b_col);
      MmaAccumulate<T>(s[0], a_q[kk], b_k[0], b_k[1]);
      MmaAccumulate<T>(s[1], a_q[kk], b_k[2], b_k[3]);
    }
    float tile_max[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int dist = kTile * m + l.g + 8 * (e >> 1) - (8 * nb + 2 * l.qd + (e & 1));
        s[nb][e] = dist >= 0 && dist < W ? s[nb][e] * p.scale + bias_at[dist] : kNegInf;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nb][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      tile_max[hi] = fmaxf(tile_max[hi], __shfl_xor_sync(0xffffffffu, tile_max[hi], 1));
      tile_max[hi] = fmaxf(tile_max[hi], __shfl_xor_sync(0xffffffffu, tile_max[hi], 2));
      const float new_max = fmaxf(row_max[hi], tile_max[hi]);
      alpha[hi] = __expf(row_max[hi] - new_max);  // 0 on the first tile
      row_max[hi] = new_max;
      row_sum[hi] *= alpha[hi];
    }
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nb][e] = __expf(s[nb][e] - row_max[e >> 1]);  // masked: exp(-inf) = 0
        row_sum[e >> 1] += s[nb][e];
      }
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    uint32_t a_p[4];
    AsOperandA<T>(s, 1.0f, a_p);
#pragma unroll
    for (int dd = 0; dd < D / kTile; ++dd) {
      uint32_t b_v[4];
      LoadMatricesTransposed(b_v, v_stage + (key_row + l.a_row) * kLdm + dd * kTile + l.a_col);
      MmaAccumulate<T>(o[2 * dd], a_p, b_v[0], b_v[1]);
      MmaAccumulate<T>(o[2 * dd + 1], a_p, b_v[2], b_v[3]);
    }
  }

  // Merge with the far part: out = w_far * out_far + w_band * o / row_sum,
  // the weights each part's share of the merged log-sum-exp.
  const int64_t row_base = (static_cast<int64_t>(b) * p.heads + h) * S;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * S * p.o_stride + h * D;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 1);
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 2);
    const int i = r0 + l.g + 8 * hi;
    const float lse_band = row_max[hi] + logf(row_sum[hi]);
    const bool far = p.far_lse != nullptr && i >= W;
    float lse = lse_band, w_far = 0.0f, w_band = 1.0f / row_sum[hi];
    if (far) {
      const float lse_far =
          p.far_lse[(static_cast<int64_t>(b) * p.heads + h) * (S - W) + (i - W)] + bias_at[W];
      const float top = fmaxf(lse_far, lse_band);
      lse = top + logf(expf(lse_far - top) + expf(lse_band - top));
      w_far = expf(lse_far - lse);
      w_band = expf(lse_band - lse) / row_sum[hi];
    }
    T* row = out + static_cast<int64_t>(i) * p.o_stride;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      uint32_t* at = reinterpret_cast<uint32_t*>(row + 8 * n + 2 * l.qd);
      float x0 = o[n][2 * hi] * w_band, x1 = o[n][2 * hi + 1] * w_band;
      if (far) {
        float f0, f1;
        UnpackPair<T>(*at, &f0, &f1);
        x0 += w_far * f0;
        x1 += w_far * f1;
      }
      *at = PackPair<T>(x0, x1);
    }
    if (l.qd == 0) p.lse[row_base + i] = lse;
  }
}

// ---- backward ---------------------------------------------------------------
// Each row's delta = rowsum(dout * out) for the key kernel (band::RowDelta:
// two threads a row) and, on rows W.., the far part's stats for cuDNN's
// backward: lse - c_h (its recomputed exp(S - stats) is then the merged
// softmax on the far keys). Threads past the last row take row S (a delta of
// 0), so every lane reaches RowDelta's shuffle.
template <typename T, int D>
__global__ void RowStatsKernel(SplitParams p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const int64_t x = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 2;
  const bool inside = x < rows;
  const int64_t plane = inside ? x / p.seq : 0;  // b * H + h
  const int i = inside ? static_cast<int>(x % p.seq) : p.seq;
  const int h = static_cast<int>(plane % p.heads);
  const int64_t base = plane / p.heads * p.seq * p.o_stride + h * D;
  const float delta = band::RowDelta<T, D>(static_cast<const T*>(p.out) + base,
                                           static_cast<const T*>(p.dout) + base, p.o_stride, i,
                                           p.seq);
  if (!inside || threadIdx.x % 2 != 0) return;
  p.delta[x] = delta;
  if (p.far_stats != nullptr && i >= p.band) {
    p.far_stats[plane * (p.seq - p.band) + (i - p.band)] =
        p.lse[x] - BiasAtDistance<T>(p.bias, h, p.seq, p.band);
  }
}

// Both backward kernels work on pairs of a 16-key tile and the query tile
// 16 m rows after it (m < Offsets(W)): the band's elements. The key kernel
// forms each pair's dS once and leaves it, scaled and transposed, as the
// query kernel's mma operand A: 32 lanes of 16 bytes, pair by pair in
// (batch, head, key tile, m) order.
// key_tile: the 16-key tile's index in its sequence.
__device__ __forceinline__ int64_t PairIndex(const SplitParams& p, int b, int h, int key_tile,
                                             int m) {
  return ((static_cast<int64_t>(b) * p.heads + h) * p.tiles * kWarps + key_tile) *
             Offsets(p.band) + m;
}

// A pair's dS (key rows, query columns: [16][17] floats) transposed, times
// scale, as operand A of dq's mma: rows g and g + 8 (queries), columns 2 qd,
// 2 qd + 1 and those 8 on (keys), rounded as AsOperandA rounds.
template <typename T>
__device__ __forceinline__ uint4 TransposedOperandA(const float* pair, const Lanes& l,
                                                    float scale) {
  const auto at = [&](int query, int key) { return pair[key * (kTile + 1) + query] * scale; };
  const int c = 2 * l.qd;
  uint4 a;
  a.x = PackPair<T>(at(l.g, c), at(l.g, c + 1));
  a.y = PackPair<T>(at(l.g + 8, c), at(l.g + 8, c + 1));
  a.z = PackPair<T>(at(l.g, c + 8), at(l.g, c + 9));
  a.w = PackPair<T>(at(l.g + 8, c + 8), at(l.g + 8, c + 9));
  return a;
}

// ---- backward, per key tile: dk, dv, dS and the table's gradient ------------
// An item is 128 keys of one (batch, head), a warp one 16-key tile, which
// walks the query tiles whose band reaches it: S^T = k q^T, dP^T = v dout^T,
// P^T and dS^T from the query rows' lse and delta, dv += P^T dout, dk +=
// dS^T q scale; then dk and dv added to cuDNN's far rows (j < S - W). Each
// pair's dS goes through the warp's own staged k rows (free once its
// fragments are in registers): its diagonals into per-distance sums in the
// warp's own staged v rows, and, transposed, out to the query kernel. The
// item's sums, in warp order, become one partial row of dtable, which the
// head's last item folds (relative_bias_grad.cu's SumHeadTable).
template <int D>
__host__ __device__ constexpr int KeyGradStageElements(int band) {
  return 2 * (kBlockRows + ReachRows(band)) * (D + kStagePad);  // k, v; q, dout
}

struct KeyRows {  // the lse and delta of the queries reaching the keys
  float lse[kBlockRows + kTile * (Offsets(kRelativeBandMax) - 1)];
  float delta[kBlockRows + kTile * (Offsets(kRelativeBandMax) - 1)];
};

template <typename T, int D>
__device__ __forceinline__ void StageKeyGrad(const SplitParams& p, const Item& it, T* stage,
                                             KeyRows* rows) {
  constexpr int kLdm = D + kStagePad;
  const int S = p.seq;
  T* k_stage = stage;
  T* v_stage = k_stage + kBlockRows * kLdm;
  T* q_stage = v_stage + kBlockRows * kLdm;
  T* dout_stage = q_stage + ReachRows(p.band) * kLdm;
  const int c0 = it.tile * kBlockRows;
  const int64_t q_base = static_cast<int64_t>(it.b) * S * p.q_stride + it.h * D;
  const int64_t kv_base = static_cast<int64_t>(it.b) * S * p.kv_stride + it.h * D;
  const int64_t o_base = static_cast<int64_t>(it.b) * S * p.o_stride + it.h * D;
  const int k_end = min(S, c0 + kBlockRows);
  const int q_end = min(S, c0 + ReachRows(p.band));  // the queries whose band reaches these keys
  StageRows<T, D>(k_stage, static_cast<const T*>(p.k) + kv_base + static_cast<int64_t>(c0) * p.kv_stride,
                  p.kv_stride, k_end - c0);
  StageRows<T, D>(v_stage, static_cast<const T*>(p.v) + kv_base + static_cast<int64_t>(c0) * p.kv_stride,
                  p.kv_stride, k_end - c0);
  StageRows<T, D>(q_stage, static_cast<const T*>(p.q) + q_base + static_cast<int64_t>(c0) * p.q_stride,
                  p.q_stride, q_end - c0);
  StageRows<T, D>(dout_stage,
                  static_cast<const T*>(p.dout) + o_base + static_cast<int64_t>(c0) * p.o_stride,
                  p.o_stride, q_end - c0);
  const int64_t row_base = (static_cast<int64_t>(it.b) * p.heads + it.h) * S + c0;
  for (int r = threadIdx.x; r < q_end - c0; r += blockDim.x) {
    __pipeline_memcpy_async(&rows->lse[r], p.lse + row_base + r, sizeof(float));
    __pipeline_memcpy_async(&rows->delta[r], p.delta + row_base + r, sizeof(float));
  }
}

template <typename T, int D>
__device__ __forceinline__ void KeyGradItem(const SplitParams& p, const Item& it, T* stage,
                                            const KeyRows& rows, const float* bias_at) {
  __shared__ float warp_far[kWarps];
  constexpr int kLdm = D + kStagePad;
  const int W = p.band, S = p.seq, offsets = Offsets(W);
  T* k_stage = stage;
  T* v_stage = k_stage + kBlockRows * kLdm;
  const T* q_stage = v_stage + kBlockRows * kLdm;
  const T* dout_stage = q_stage + ReachRows(W) * kLdm;
  const int h = it.h;
  const int64_t kv_base = static_cast<int64_t>(it.b) * S * p.kv_stride + h * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Lanes l(lane);
  const int j0 = it.tile * kBlockRows + kTile * warp;
  const bool active = j0 < S;  // S is a multiple of 16: a tile is all inside or all past it
  uint32_t a_k[D / kTile][4], a_v[D / kTile][4];
#pragma unroll
  for (int kk = 0; kk < D / kTile; ++kk) {
    LoadMatrices(a_k[kk], k_stage + (kTile * warp + l.a_row) * kLdm + kk * kTile + l.a_col);
    LoadMatrices(a_v[kk], v_stage + (kTile * warp + l.a_row) * kLdm + kk * kTile + l.a_col);
  }
  __syncwarp();
  // The warp's own staged rows, now free: dS of one pair [16][17] (padded:
  // the diagonals' reads in distinct banks), and the per-distance sums.
  float* pair = reinterpret_cast<float*>(k_stage + kTile * warp * kLdm);
  float* dist_sums = reinterpret_cast<float*>(v_stage + kTile * warp * kLdm);
  static_assert(kTile * (kTile + 1) * sizeof(float) <= kTile * (32 + kStagePad) * sizeof(uint16_t),
                "a pair's dS fits the warp's staged k rows");
  static_assert(kRelativeBandMax * sizeof(float) <= kTile * (32 + kStagePad) * sizeof(uint16_t),
                "the distances' sums fit the warp's staged v rows");
  for (int d = lane; d < kRelativeBandMax; d += 32) dist_sums[d] = 0.0f;
  uint4* ds_out = static_cast<uint4*>(p.ds_pairs) +
                  PairIndex(p, it.b, h, it.tile * kWarps + warp, 0) * 32 + lane;
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  float far = 0.0f;  // minus the far bucket's share: the band's dS of queries i >= W
  for (int m = 0; active && m < offsets && j0 + kTile * m < S; ++m) {
    const int query_row = kTile * (warp + m);  // in the stage
    float st[2][4] = {}, dst[2][4] = {};  // S^T = k q^T; dP^T = v dout^T
    band::TwoTileProducts<T, D>(a_k, q_stage + query_row * kLdm, a_v,
                                dout_stage + query_row * kLdm, l, st, dst);
    // Element (r, c): key j0 + r, query j0 + 16 m + c, at distance 16 m + c - r.
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = l.g + 8 * (e >> 1), c = 8 * nb + 2 * l.qd + (e & 1);
        const int dist = kTile * m + c - r;
        const bool in_band = dist >= 0 && dist < W;
        const int query = query_row + c;
        const float prob =
            in_band ? __expf(st[nb][e] * p.scale + bias_at[in_band ? dist : 0] - rows.lse[query])
                    : 0.0f;
        st[nb][e] = prob;
        dst[nb][e] = prob * (dst[nb][e] - rows.delta[query]);
        if (j0 + kTile * m + c >= W) far -= dst[nb][e];
        pair[r * (kTile + 1) + c] = dst[nb][e];
      }
    }
    __syncwarp();
    // Diagonal c - r = lane - 15 of the pair: distance 16 m + lane - 15.
    if (lane < 2 * kTile - 1) {
      const int diag = lane - (kTile - 1), dist = kTile * m + diag;
      if (dist >= 0 && dist < W) {
        float sum = 0.0f;
        for (int r = max(0, -diag); r < min(kTile, kTile - diag); ++r) {
          sum += pair[r * (kTile + 1) + r + diag];
        }
        dist_sums[dist] += sum;
      }
    }
    ds_out[m * 32] = TransposedOperandA<T>(pair, l, p.scale);
    __syncwarp();  // the pair is read: the next one may overwrite it
    uint32_t a_p[4], a_ds[4];
    AsOperandA<T>(st, 1.0f, a_p);
    AsOperandA<T>(dst, p.scale, a_ds);
#pragma unroll
    for (int dd = 0; dd < D / kTile; ++dd) {
      uint32_t b_dout[4], b_q[4];
      LoadMatricesTransposed(b_dout,
                             dout_stage + (query_row + l.a_row) * kLdm + dd * kTile + l.a_col);
      LoadMatricesTransposed(b_q, q_stage + (query_row + l.a_row) * kLdm + dd * kTile + l.a_col);
      MmaAccumulate<T>(dv[2 * dd], a_p, b_dout[0], b_dout[1]);
      MmaAccumulate<T>(dv[2 * dd + 1], a_p, b_dout[2], b_dout[3]);
      MmaAccumulate<T>(dk[2 * dd], a_ds, b_q[0], b_q[1]);
      MmaAccumulate<T>(dk[2 * dd + 1], a_ds, b_q[2], b_q[3]);
    }
  }
  if (active) {
    T* dk_rows = static_cast<T*>(p.dk) + kv_base;
    T* dv_rows = static_cast<T*>(p.dv) + kv_base;
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int j = j0 + l.g + 8 * hi;
      const bool add = p.far_lse != nullptr && j < S - W;
      const int64_t at_row = static_cast<int64_t>(j) * p.kv_stride;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t* at_k = reinterpret_cast<uint32_t*>(dk_rows + at_row + 8 * n + 2 * l.qd);
        uint32_t* at_v = reinterpret_cast<uint32_t*>(dv_rows + at_row + 8 * n + 2 * l.qd);
        float k0 = dk[n][2 * hi], k1 = dk[n][2 * hi + 1];
        float v0 = dv[n][2 * hi], v1 = dv[n][2 * hi + 1];
        if (add) {
          float f0, f1;
          UnpackPair<T>(*at_k, &f0, &f1);
          k0 += f0;
          k1 += f1;
          UnpackPair<T>(*at_v, &f0, &f1);
          v0 += f0;
          v1 += f1;
        }
        *at_k = PackPair<T>(k0, k1);
        *at_v = PackPair<T>(v0, v1);
      }
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) far += __shfl_xor_sync(0xffffffffu, far, offset);
  if (lane == 0) warp_far[warp] = far;
  __syncthreads();
  float* sums =
      p.partial + ((static_cast<int64_t>(it.b) * p.heads + h) * p.tiles + it.tile) * (W + 1);
  for (int d = threadIdx.x; d < W; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      sum += reinterpret_cast<const float*>(v_stage + kTile * w * kLdm)[d];
    }
    sums[d] = sum;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += warp_far[w];
    sums[W] = sum;
  }
  // The head's last item to finish sums its dtable column.
  if (p.heads_done == nullptr ||
      !band::LastBlockOfHead(p.heads_done, h, static_cast<unsigned>(p.tiles * p.batch))) {
    return;
  }
  // The staged k rows are free now (the distance sums live in v's).
  float* split_sums = reinterpret_cast<float*>(k_stage);
  int32_t* bucket_at =
      reinterpret_cast<int32_t*>(split_sums + band::kTableSplit * (kRelativeBandMax + 1));
  static_assert(band::kTableSplit * (kRelativeBandMax + 1) + kRelativeBandMax <=
                    kBlockRows * (32 + kStagePad) * sizeof(uint16_t) / sizeof(float),
                "the staged k rows hold the table's sums");
  band::SumHeadTable(p.partial, p.buckets, p.dtable, p.batch, p.heads, p.tiles, S, W,
                     p.num_buckets, h, split_sums, bucket_at);
  if (threadIdx.x == 0) p.heads_done[h] = 0;  // the next launch on this stream sees it
}

// ---- backward, per query tile: dq --------------------------------------------
// An item is 128 queries of one (batch, head), a warp one 16-row tile: dq =
// the sum over the key tiles its band reaches, offset by offset, of the key
// kernel's dS (scaled) times k; then added to cuDNN's far rows (i >= W). It
// stages only the keys.
template <int D>
__host__ __device__ constexpr int QueryGradStageElements(int band) {
  return ReachRows(band) * (D + kStagePad);
}

template <typename T, int D>
__device__ __forceinline__ void StageQueryGrad(const SplitParams& p, const Item& it, T* k_stage) {
  constexpr int kLdm = D + kStagePad;
  const int S = p.seq, i0 = it.tile * kBlockRows;
  const int key0 = i0 - kTile * (Offsets(p.band) - 1);
  const int kv_lo = max(0, key0);
  const T* k = static_cast<const T*>(p.k) + static_cast<int64_t>(it.b) * S * p.kv_stride + it.h * D;
  StageRows<T, D>(k_stage + (kv_lo - key0) * kLdm, k + static_cast<int64_t>(kv_lo) * p.kv_stride,
                  p.kv_stride, min(S, i0 + kBlockRows) - kv_lo);
}

template <typename T, int D>
__device__ __forceinline__ void QueryGradItem(const SplitParams& p, const Item& it,
                                              const T* k_stage) {
  constexpr int kLdm = D + kStagePad;
  constexpr int kMaxOffsets = Offsets(kRelativeBandMax);
  const int S = p.seq, offsets = Offsets(p.band);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Lanes l(lane);
  const int r0 = it.tile * kBlockRows + kTile * warp;
  if (r0 >= S) return;
  // Every pair's operand first: their loads in flight together.
  const uint4* ds_in = static_cast<const uint4*>(p.ds_pairs);
  uint4 a[kMaxOffsets];
#pragma unroll
  for (int m = 0; m < kMaxOffsets; ++m) {
    if (m < offsets && kTile * m <= r0) {
      a[m] = ds_in[PairIndex(p, it.b, it.h, (r0 - kTile * m) / kTile, m) * 32 + lane];
    }
  }
  float dq[D / 8][4] = {};
#pragma unroll
  for (int m = 0; m < kMaxOffsets; ++m) {
    if (m >= offsets || kTile * m > r0) break;
    const uint32_t a_ds[4] = {a[m].x, a[m].y, a[m].z, a[m].w};
    const int key_row = kTile * (warp - m + offsets - 1);
#pragma unroll
    for (int dd = 0; dd < D / kTile; ++dd) {
      uint32_t b_k[4];
      LoadMatricesTransposed(b_k, k_stage + (key_row + l.a_row) * kLdm + dd * kTile + l.a_col);
      MmaAccumulate<T>(dq[2 * dd], a_ds, b_k[0], b_k[1]);
      MmaAccumulate<T>(dq[2 * dd + 1], a_ds, b_k[2], b_k[3]);
    }
  }
  T* dq_rows = static_cast<T*>(p.dq) + static_cast<int64_t>(it.b) * S * p.q_stride + it.h * D;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int i = r0 + l.g + 8 * hi;
    const bool add = p.far_lse != nullptr && i >= p.band;
    T* row = dq_rows + static_cast<int64_t>(i) * p.q_stride;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      uint32_t* at = reinterpret_cast<uint32_t*>(row + 8 * n + 2 * l.qd);
      float x0 = dq[n][2 * hi], x1 = dq[n][2 * hi + 1];
      if (add) {
        float f0, f1;
        UnpackPair<T>(*at, &f0, &f1);
        x0 += f0;
        x1 += f1;
      }
      *at = PackPair<T>(x0, x1);
    }
  }
}

// ---- the kernels ----------------------------------------------------------------
// One persistent kernel per pass: the pass names the rows it stages beside
// the tensors' (each query's lse and delta, or none), how it stages an item
// and what it computes.
struct NoRows {};
struct ForwardPass {
  using Rows = NoRows;
  template <int D>
  __host__ __device__ static constexpr int StageElements(int band) {
    return ForwardStageElements<D>(band);
  }
  template <typename T, int D>
  __device__ static void Stage(const SplitParams& p, const Item& it, T* stage, NoRows*) {
    StageForward<T, D>(p, it, stage);
  }
  template <typename T, int D>
  __device__ static void Compute(const SplitParams& p, const Item& it, T* stage, const NoRows&,
                                 const float* bias_at) {
    ForwardItem<T, D>(p, it, stage, bias_at);
  }
};
struct KeyGradPass {
  using Rows = KeyRows;
  template <int D>
  __host__ __device__ static constexpr int StageElements(int band) {
    return KeyGradStageElements<D>(band);
  }
  template <typename T, int D>
  __device__ static void Stage(const SplitParams& p, const Item& it, T* stage, KeyRows* rows) {
    StageKeyGrad<T, D>(p, it, stage, rows);
  }
  template <typename T, int D>
  __device__ static void Compute(const SplitParams& p, const Item& it, T* stage,
                                 const KeyRows& rows, const float* bias_at) {
    KeyGradItem<T, D>(p, it, stage, rows, bias_at);
  }
};
struct QueryGradPass {
  using Rows = NoRows;
  template <int D>
  __host__ __device__ static constexpr int StageElements(int band) {
    return QueryGradStageElements<D>(band);
  }
  template <typename T, int D>
  __device__ static void Stage(const SplitParams& p, const Item& it, T* stage, NoRows*) {
    StageQueryGrad<T, D>(p, it, stage);
  }
  template <typename T, int D>
  __device__ static void Compute(const SplitParams& p, const Item& it, T* stage, const NoRows&,
                                 const float*) {
    QueryGradItem<T, D>(p, it, stage);
  }
};

template <typename T, int D, typename Pass>
__global__ void __launch_bounds__(kWarps * 32, D <= 64 ? 2 : 1)
    RelativeBandSplitKernel(SplitParams p) {
  __shared__ float bias_at[kRelativeBandMax + 1];
  __shared__ typename Pass::Rows rows;
  extern __shared__ __align__(128) unsigned char stage_bytes[];
  T* stage = reinterpret_cast<T*>(stage_bytes);
  ForEachItem<T>(
      p, bias_at, [&](const Item& it) { Pass::template Stage<T, D>(p, it, stage, &rows); },
      [&](const Item& it) { Pass::template Compute<T, D>(p, it, stage, rows, bias_at); });
}

// ---- launches -----------------------------------------------------------------
// Every configuration stages more than the default 48 KiB, so each kernel is
// opted in to its stage bytes. Two blocks an SM at D <= 64 (the largest, the
// key kernel at a band of 128, stages 108 KiB with 2.6 KiB of static arrays),
// one at D 128.
static_assert(2 * (KeyGradStageElements<64>(kRelativeBandMax) * sizeof(uint16_t) +
                   sizeof(KeyRows) + 1024) <= 228 * 1024,
              "two key-kernel blocks at D 64 fit an SM");
static_assert(KeyGradStageElements<128>(kRelativeBandMax) * sizeof(uint16_t) <= 227 * 1024 - 4096,
              "one block at D 128 fits an SM");

// A pass on a persistent grid: the blocks the device holds at once, at most
// one an item.
template <typename T, int D, typename Pass>
absl::Status LaunchPass(CudaOps* ops, const SplitParams& p) {
  const auto kernel = RelativeBandSplitKernel<T, D, Pass>;
  const size_t stage = Pass::template StageElements<D>(p.band) * sizeof(T);
  RETURN_IF_ERROR(AllowSharedBytes(ops->context(), kernel, stage,
                                   "cudaFuncSetAttribute(RelativeBandSplitKernel)"));
  const int blocks = static_cast<int>(
      std::min<int64_t>(Items(p), ResidentBlocks(ops->context(), kernel, kWarps * 32, stage)));
  kernel<<<blocks, kWarps * 32, stage, ops->stream()>>>(p);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename T, int D>
absl::Status LaunchBackward(CudaOps* ops, const SplitParams& p) {
  RETURN_IF_ERROR((LaunchPass<T, D, KeyGradPass>(ops, p)));
  if (p.heads_done == nullptr) {
    RETURN_IF_ERROR(LaunchRelativeBandTable(p.partial, p.buckets, p.dtable, p.batch, p.heads,
                                            p.tiles, p.seq, p.band, p.num_buckets,
                                            ops->stream()));
  }
  return LaunchPass<T, D, QueryGradPass>(ops, p);
}

template <typename T, int D>
absl::Status LaunchRowStats(CudaOps* ops, const SplitParams& p) {
  const int64_t threads = 2 * static_cast<int64_t>(p.batch) * p.heads * p.seq;
  constexpr int kThreads = 256;
  RowStatsKernel<T, D><<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0,
                         ops->stream()>>>(p);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

enum class Work { kForward, kRowStats, kBackward };

template <typename T, int D>
absl::Status LaunchWork(CudaOps* ops, const SplitParams& p, Work work) {
  switch (work) {
    case Work::kForward: return LaunchPass<T, D, ForwardPass>(ops, p);
    case Work::kRowStats: return LaunchRowStats<T, D>(ops, p);
    case Work::kBackward: return LaunchBackward<T, D>(ops, p);
  }
  return absl::InternalError("unknown work");
}

template <typename T>
absl::Status ForHeadDim(CudaOps* ops, const SplitParams& p, int head_dim, Work work) {
  switch (head_dim) {
    case 32: return LaunchWork<T, 32>(ops, p, work);
    case 64: return LaunchWork<T, 64>(ops, p, work);
    case 128: return LaunchWork<T, 128>(ops, p, work);
    default: break;
  }
  return absl::UnimplementedError(absl::StrCat("head_dim ", head_dim, " (32, 64 or 128)"));
}

absl::Status Launch(CudaOps* ops, DType dtype, const SplitParams& p, int head_dim, Work work) {
  return dtype == DType::kBF16 ? ForHeadDim<__nv_bfloat16>(ops, p, head_dim, work)
                               : ForHeadDim<__half>(ops, p, head_dim, work);
}

SplitParams MakeParams(const AttentionArgs& args, const AttentionShape& s, const QkvMemory& qkv,
                       const BandBias& bias, int64_t band) {
  SplitParams p = {};
  p.q = qkv.q;
  p.k = qkv.k;
  p.v = qkv.v;
  p.q_stride = qkv.q_token_stride;
  p.kv_stride = qkv.kv_token_stride;
  p.o_stride = s.q_heads * s.head_dim;
  p.batch = static_cast<int>(s.batch);
  p.seq = static_cast<int>(s.q_seq);
  p.heads = static_cast<int>(s.q_heads);
  p.group = static_cast<int>(s.q_heads / s.kv_heads);
  p.band = static_cast<int>(band);
  p.tiles = static_cast<int>((s.q_seq + kBlockRows - 1) / kBlockRows);
  p.scale = args.scale;
  p.bias = bias;
  return p;
}

// The far part's views: queries (and out, dout, dq) from row W, keys (and
// dk, dv) up to row S - W, each inside the full sequence.
struct FarViews {
  AttentionShape shape;
  QkvMemory qkv;
  AttentionArgs args;
  int64_t q_offset_bytes, o_offset_bytes;
};
FarViews MakeFarViews(const AttentionArgs& args, const AttentionShape& s, const QkvMemory& qkv,
                      int64_t band) {
  FarViews f;
  f.shape = s;
  f.shape.q_seq = f.shape.kv_seq = s.q_seq - band;
  f.qkv = qkv;
  f.qkv.batch_rows = s.q_seq;
  const int64_t element = static_cast<int64_t>(DTypeSize(qkv.dtype));
  f.q_offset_bytes = band * qkv.q_token_stride * element;
  f.o_offset_bytes = band * s.q_heads * s.head_dim * element;
  f.qkv.q = static_cast<const char*>(qkv.q) + f.q_offset_bytes;
  f.args.mask = MaskType::kCausal;
  f.args.scale = args.scale;
  return f;
}

Tensor View(const void* data, int64_t offset_bytes, DType dtype, const Shape& shape) {
  return Tensor(std::shared_ptr<void>(),
                const_cast<char*>(static_cast<const char*>(data)) + offset_bytes, dtype, shape);
}

}  // namespace

absl::Status RelativeSplitApplies(const AttentionArgs& args, const AttentionShape& s,
                                  const QkvMemory& qkv, int64_t band, bool backward) {
  if (GetAttentionPath() != AttentionPath::kAuto) {
    return absl::UnimplementedError("cuDNN attention is switched off");
  }
  RelativeBuckets relative;
  relative.uniform_from = band;
  RETURN_IF_ERROR(RelativeBandApplies(args, s, qkv, relative));  // causal, no padding
  if (backward && s.q_heads != s.kv_heads) {
    return absl::UnimplementedError("GQA (the key kernel takes one head's queries)");
  }
  return absl::OkStatus();
}

absl::Status RelativeSplitForward(CudaOps* ops, const AttentionArgs& args,
                                  const AttentionShape& s, const QkvMemory& qkv,
                                  const BandBias& bias, int64_t band, Tensor* out,
                                  Tensor* softmax_lse) {
  RETURN_IF_ERROR(RelativeSplitApplies(args, s, qkv, band, /*backward=*/false));
  if (out->dtype() != qkv.dtype) return absl::UnimplementedError("out not in q's dtype");
  SplitParams p = MakeParams(args, s, qkv, bias, band);
  p.out = out->data();
  p.lse = softmax_lse->data_as<float>();
  Tensor far_lse;
  if (s.q_seq > band) {
    const FarViews f = MakeFarViews(args, s, qkv, band);
    ASSIGN_OR_RETURN(far_lse,
                     ops->Allocate(DType::kF32, {s.batch, s.q_heads, f.shape.q_seq}));
    Tensor far_out = View(out->data(), f.o_offset_bytes, out->dtype(),
                          {s.batch, f.shape.q_seq, s.q_heads, s.head_dim});
    RETURN_IF_ERROR(CudnnAttentionForward(ops, f.args, f.shape, f.qkv, &far_out, &far_lse));
    p.far_lse = far_lse.data_as<const float>();
  }
  return Launch(ops, qkv.dtype, p, static_cast<int>(s.head_dim), Work::kForward);
}

absl::Status RelativeSplitBackward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& s, const QkvMemory& qkv,
                                   const Tensor& out, const Tensor& dout,
                                   const Tensor& softmax_lse, const BandBias& bias,
                                   const RelativeBuckets& relative, const DqkvMemory& grads,
                                   Tensor* dtable) {
  const int64_t band = relative.uniform_from;
  RETURN_IF_ERROR(RelativeSplitApplies(args, s, qkv, band, /*backward=*/true));
  if (out.dtype() != qkv.dtype || dout.dtype() != qkv.dtype || grads.dtype != qkv.dtype) {
    return absl::UnimplementedError("out, dout or the gradients not in q's dtype");
  }
  if (dtable->dtype() != DType::kF32) return absl::UnimplementedError("dtable is not float32");
  // The kernels read out's and dout's rows 16 bytes at a time.
  for (const void* rows : {out.data(), dout.data(), grads.dq, grads.dk, grads.dv}) {
    if (reinterpret_cast<uintptr_t>(rows) % 16 != 0) {
      return absl::UnimplementedError("out, dout or a gradient not 16-byte aligned");
    }
  }
  SplitParams p = MakeParams(args, s, qkv, bias, band);
  p.out = const_cast<void*>(out.data());
  p.dout = dout.data();
  p.lse = const_cast<float*>(softmax_lse.data_as<float>());
  p.dq = grads.dq;
  p.dk = grads.dk;
  p.dv = grads.dv;
  // Freed at return: the allocator orders their reuse after this stream's work.
  ASSIGN_OR_RETURN(const Tensor delta, ops->Allocate(DType::kF32, {s.batch, s.q_heads, s.q_seq}));
  p.delta = delta.data_as<float>();
  Tensor far_stats;
  if (s.q_seq > band) {
    ASSIGN_OR_RETURN(far_stats, ops->Allocate(DType::kF32, {s.batch, s.q_heads, s.q_seq - band}));
    p.far_stats = far_stats.data_as<float>();
  }
  RETURN_IF_ERROR(Launch(ops, qkv.dtype, p, static_cast<int>(s.head_dim), Work::kRowStats));
  if (s.q_seq > band) {
    const FarViews f = MakeFarViews(args, s, qkv, band);
    const Shape rows = {s.batch, f.shape.q_seq, s.q_heads, s.head_dim};
    const Tensor far_out = View(out.data(), f.o_offset_bytes, out.dtype(), rows);
    const Tensor far_dout = View(dout.data(), f.o_offset_bytes, dout.dtype(), rows);
    DqkvMemory far_grads = grads;
    far_grads.dq = static_cast<char*>(grads.dq) + f.q_offset_bytes;
    RETURN_IF_ERROR(CudnnAttentionBackward(ops, f.args, f.shape, f.qkv, far_out, far_dout,
                                           far_stats, far_grads, /*dbias=*/nullptr));
    p.far_lse = softmax_lse.data_as<float>();  // marks that cuDNN wrote the far rows
  }
  // Each band pair's dS from the key kernel to the query kernel: 512 bytes a
  // pair, 32 MiB at the 24 x 1024 LM's attention (B 8, H 16, S 1024, W 113: 8 offsets).
  ASSIGN_OR_RETURN(const Tensor ds_pairs,
                   ops->Allocate(qkv.dtype, {s.batch * s.q_heads * p.tiles * band::kWarps *
                                                 Offsets(static_cast<int>(band)),
                                             kTile * kTile}));
  ASSIGN_OR_RETURN(const Tensor partial,
                   ops->Allocate(DType::kF32, {s.batch * s.q_heads * p.tiles, band + 1}));
  p.ds_pairs = const_cast<void*>(ds_pairs.data());
  p.partial = partial.data_as<float>();
  p.buckets = relative.buckets.data_as<const int32_t>();
  p.dtable = dtable->data_as<float>();
  p.num_buckets = static_cast<int>(dtable->dim(1));
  p.heads_done = p.heads <= kFoldGroups ? ops->fold_groups() : nullptr;
  return Launch(ops, qkv.dtype, p, static_cast<int>(s.head_dim), Work::kBackward);
}

}  // namespace cuda
}  // namespace te
