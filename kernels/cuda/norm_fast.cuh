// The register-resident fast paths of LayerNorm / RMSNorm (norm.cu's
// launchers pick them; the general kernels stay in norm.cu). Included by
// norm.cu only: everything here is in its anonymous namespace.
#ifndef TE_KERNELS_CUDA_NORM_FAST_CUH_
#define TE_KERNELS_CUDA_NORM_FAST_CUH_

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace te {
namespace cuda {
namespace {

// ---- fast paths: rows held in registers ---------------------------------------------
//
// A row is held by a group of `warps` warps (forward: 1, 2, 4 or 8; backward:
// 1, 2, 3, 4, 6 or 12; `threads` = 32 * warps). Thread t of the group holds
// the row's 8-element packs t, t + threads, t + 2 * threads, ... (at most
// RowPacksFor(input element size) of them), so each warp's loads are
// contiguous. A block holds several groups; the row sums of a group are warp
// shuffles, then (warps > 1) one shared-memory step behind a named barrier of
// that group alone.
//
// The reduction tree depends only on `warps`, which depends only on H and the
// input's element size (FastRowWarps), and the arithmetic spells out its
// roundings (no contraction left to the compiler): NormForward's fast path
// and NormForwardTransposed compute bit-identical statistics, hence codes.

// Packs of 8 elements per thread at most: 32 bytes of 16-bit input, 64 of
// float32, so backward's x, dy and column sums stay in registers.
constexpr int RowPacksFor(size_t in_bytes) { return in_bytes == 4 ? 2 : 4; }
constexpr int kForwardThreads = 256;
constexpr int kTransposedMaxThreads = 1024;
// Backward needs ~150 registers a thread (64 of them column sums): 384
// threads a block keep it under the 170 that one block per SM allows, and 12
// warps split into groups of 1, 2, 3, 4, 6 or 12.
constexpr int kBackwardThreads = 384;

struct RowGroup {
  int warps;       // per row
  int threads;     // 32 * warps
  int index;       // this group within the block
  int count;       // groups in the block
  int lane;        // this thread within the group
  int first_warp;  // the block-wide index of the group's warp 0
};

__device__ __forceinline__ RowGroup MakeRowGroup(int warps) {
  RowGroup g;
  g.warps = warps;
  g.threads = 32 * warps;
  g.index = threadIdx.x / g.threads;
  g.count = blockDim.x / g.threads;
  g.lane = threadIdx.x % g.threads;
  g.first_warp = g.index * warps;
  return g;
}

// Barrier of one group's threads: ids 1.. (0 is __syncthreads'), so at most 15
// groups of more than one warp per block (the launchers keep to 8, backward
// to 6).
__device__ __forceinline__ void GroupBarrier(const RowGroup& g) {
  asm volatile("bar.sync %0, %1;" : : "r"(g.index + 1), "r"(g.threads) : "memory");
}

// Sum over the group; every thread of the group gets the same value (the same
// additions in the same order). `slot`: one float per warp of the block. A
// warp may read the slot after a faster warp of its group has left the
// barrier, so consecutive sums must alternate between two slots: the next
// write to this one then waits behind the next sum's barrier, which the
// reader reaches only after reading.
__device__ __forceinline__ float GroupSum(float v, const RowGroup& g, float* slot) {
  v = WarpSum(v);
  if (g.warps == 1) return v;
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) slot[warp] = v;
  GroupBarrier(g);
  float total = 0.0f;
  for (int w = 0; w < g.warps; ++w) total += slot[g.first_warp + w];
  return total;
}

__device__ __forceinline__ float4 Add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Two sums at once (backward's), with GroupSum's slot rule.
__device__ __forceinline__ float2 GroupSum2(float2 v, const RowGroup& g, float2* slot) {
  v.x = WarpSum(v.x);
  v.y = WarpSum(v.y);
  if (g.warps == 1) return v;
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) slot[warp] = v;
  GroupBarrier(g);
  float2 total = make_float2(0.0f, 0.0f);
  for (int w = 0; w < g.warps; ++w) {
    const float2 s = slot[g.first_warp + w];
    total.x += s.x;
    total.y += s.y;
  }
  return total;
}

// This thread's packs of `row` (`packs` in all); packs past the end are left
// unset and never read (every use checks p < packs).
template <typename T, int kPacks>
__device__ __forceinline__ void LoadRowPacks(const T* row, int packs, const RowGroup& g,
                                             Pack<T> (&out)[kPacks]) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = g.lane + k * g.threads;
    if (p < packs) out[k] = reinterpret_cast<const Pack<T>*>(row)[p];
  }
}

// Asks L2 for this thread's packs of `row` (as LoadRowPacks reads them)
// without waiting: issued for a row the group reads later (the next one, or
// backward's residual after the row sums), so that read waits on L2 instead
// of on DRAM. A group holds one row at a time, so without it each row's
// loads began only when the last row's work was done.
template <typename T, int kPacks>
__device__ __forceinline__ void PrefetchRowL2(const T* row, int packs, const RowGroup& g) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = g.lane + k * g.threads;
    if (p < packs) {
      asm volatile("prefetch.global.L2 [%0];" : : "l"(reinterpret_cast<const Pack<T>*>(row) + p));
    }
  }
}

// mean (0 for RMSNorm), then the second moment about it, as the CPU reference
// computes them; rsigma = 1 / sqrt(m2 + epsilon). `slots`: [2][slot_stride],
// one per warp of the block; each GroupSum takes the slot after the previous
// one's (`turn` counts them), which is what makes one barrier per sum enough.
template <typename In, int kPacks>
__device__ __forceinline__ void RowStatistics(const Pack<typename In::Storage> (&xr)[kPacks],
                                              int packs, int64_t cols, bool layernorm,
                                              float epsilon, const RowGroup& g, float* slots,
                                              int slot_stride, int* turn, float* mean,
                                              float* rsigma) {
  float m = 0.0f;
  if (layernorm) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      if (g.lane + k * g.threads < packs) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum += In::Load(xr[k].v[j]);
      }
    }
    m = GroupSum(sum, g, slots + (*turn & 1) * slot_stride) / static_cast<float>(cols);
    ++*turn;
  }
  float sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (g.lane + k * g.threads < packs) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float d = In::Load(xr[k].v[j]) - m;
        sq = __fmaf_rn(d, d, sq);
      }
    }
  }
  const float second_moment =
      GroupSum(sq, g, slots + (*turn & 1) * slot_stride) / static_cast<float>(cols);
  ++*turn;
  *mean = m;
  *rsigma = 1.0f / sqrtf(second_moment + epsilon);
}

// y of one pack: (x - mean) * rsigma * g + beta, then scaled (FP8) and
// rounded to the output, with every float rounding spelled out so that each
// kernel calling this gives the same bits.
// gp, bp: gamma's and beta's pack (bp unread without beta).
template <typename In, typename G, typename Out>
__device__ __forceinline__ Pack<typename Out::Storage> NormPack(
    const Pack<typename In::Storage>& xp, const Pack<typename G::Storage>& gp,
    const Pack<typename G::Storage>& bp, bool has_beta, float mean, float rsigma,
    bool zero_centered, float scale, unsigned* amax_bits) {
  Pack<typename Out::Storage> o;
  unsigned bits = *amax_bits;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    float gj = G::Load(gp.v[j]);
    if (zero_centered) gj += 1.0f;
    const float b = has_beta ? G::Load(bp.v[j]) : 0.0f;
    const float v = __fmaf_rn(__fmul_rn(In::Load(xp.v[j]) - mean, rsigma), gj, b);
    bits = max(bits, AbsBits(v));
    o.v[j] = Out::Store(__fmul_rn(v, scale));
  }
  *amax_bits = bits;
  return o;
}

// The same, gamma's and beta's pack p read here.
template <typename In, typename G, typename Out>
__device__ __forceinline__ Pack<typename Out::Storage> NormPack(
    const Pack<typename In::Storage>& xp, const typename G::Storage* gamma,
    const typename G::Storage* beta, int p, float mean, float rsigma, bool zero_centered,
    float scale, unsigned* amax_bits) {
  using GPack = Pack<typename G::Storage>;
  const GPack gp = reinterpret_cast<const GPack*>(gamma)[p];
  GPack bp;
  if (beta != nullptr) bp = reinterpret_cast<const GPack*>(beta)[p];
  return NormPack<In, G, Out>(xp, gp, bp, beta != nullptr, mean, rsigma, zero_centered, scale,
                              amax_bits);
}

// The pointers and sizes of one NormForward, for the fast kernels. x, y:
// [rows, cols]; gamma, beta: [cols] (beta null for RMSNorm); mu, rsigma: [rows]
// or null. FP8 y: scale and scale_inv non-null, amax recorded or not; a float
// y: all three null.
template <typename In, typename G, typename Out>
struct NormForwardParams {
  const typename In::Storage* x;
  const typename G::Storage* gamma;
  const typename G::Storage* beta;
  typename Out::Storage* y;
  float* mu;
  float* rsigma;
  int64_t rows;
  int64_t cols;
  float epsilon;
  bool layernorm;
  bool zero_centered;
  const float* scale;
  AmaxOut amax;
  float* scale_inv;
};

// Folds the block's amax into the global one, when it is recorded, and
// writes scale_inv (FP8 y only).
__device__ __forceinline__ void FinishAmax(unsigned bits, const AmaxOut& amax, float* scale_inv,
                                           float s, unsigned* scratch) {
  if (scale_inv == nullptr) return;
  if (amax.amax != nullptr) bits = BlockMaxBits(bits, scratch);
  if (threadIdx.x == 0) {
    FoldAmax(amax, bits);
    if (blockIdx.x == 0) *scale_inv = 1.0f / s;
  }
}

// Forward, fast path: each group normalises rows grid-stride.
template <typename In, typename G, typename Out>
__global__ void __launch_bounds__(kForwardThreads)
    NormForwardFastKernel(NormForwardParams<In, G, Out> a, int warps_per_row) {
  constexpr int kPacks = RowPacksFor(sizeof(typename In::Storage));
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  __shared__ float slots[2][kForwardThreads / 32];
  __shared__ unsigned max_scratch[32];
  const RowGroup g = MakeRowGroup(warps_per_row);
  const int packs = static_cast<int>(a.cols / kVec);  // <= 1024 on this path
  const float s = a.scale != nullptr ? *a.scale : 1.0f;
  unsigned bits = 0;
  int turn = 0;
  // A thread's packs of gamma and beta are the same for every row it takes:
  // read once, in flight with the first row's x. (Read next to each store,
  // they were a dependent L2 round trip per pack, which a few rows, a decode
  // step's, could not hide: 5.5 us for 8 rows of 1024 on the H200.)
  using GPack = Pack<typename G::Storage>;
  GPack gr[kPacks], br[kPacks];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int p = g.lane + k * g.threads;
    if (p < packs) {
      gr[k] = reinterpret_cast<const GPack*>(a.gamma)[p];
      if (a.beta != nullptr) br[k] = reinterpret_cast<const GPack*>(a.beta)[p];
    }
  }
  const int64_t step = int64_t(gridDim.x) * g.count;
  for (int64_t r = int64_t(blockIdx.x) * g.count + g.index; r < a.rows; r += step) {
    InPack xr[kPacks];
    LoadRowPacks(a.x + r * a.cols, packs, g, xr);
    if (r + step < a.rows) {
      PrefetchRowL2<typename In::Storage, kPacks>(a.x + (r + step) * a.cols, packs, g);
    }
    float mean, rsigma;
    RowStatistics<In>(xr, packs, a.cols, a.layernorm, a.epsilon, g, &slots[0][0],
                      kForwardThreads / 32, &turn, &mean, &rsigma);
    if (g.lane == 0) {
      if (a.mu != nullptr) a.mu[r] = mean;
      if (a.rsigma != nullptr) a.rsigma[r] = rsigma;
    }
    OutPack* y_row = reinterpret_cast<OutPack*>(a.y + r * a.cols);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = g.lane + k * g.threads;
      if (p < packs) {
        y_row[p] = NormPack<In, G, Out>(xr[k], gr[k], br[k], a.beta != nullptr, mean, rsigma,
                                        a.zero_centered, s, &bits);
      }
    }
  }
  FinishAmax(bits, a.amax, a.scale_inv, s, max_scratch);
}

// Forward with y FP8 [rows, cols] and y_t [cols, rows] = y^T, fast path. A
// block takes tiles of `tile_rows` rows (a multiple of 4; rows % 4 == 0): its
// groups normalise the tile's rows as NormForwardFastKernel does, writing y
// from registers and the codes into `tile` ([tile_rows][cols + 4] bytes in
// shared memory); then the block writes the tile transposed, each thread a 4 x
// 4 block of codes (4 words read, transposed in registers, 4 words written:
// 4 rows of one column each). The +4 bytes per tile row spread those reads
// over the banks.
template <typename In, typename G, typename Out>
__global__ void __launch_bounds__(kTransposedMaxThreads)
    NormForwardTransposedKernel(NormForwardParams<In, G, Out> a, uint8_t* y_t, int warps_per_row,
                                int tile_rows) {
  constexpr int kPacks = RowPacksFor(sizeof(typename In::Storage));
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<uint8_t>;
  extern __shared__ uint32_t tile_words[];
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_words);
  __shared__ float slots[2][kTransposedMaxThreads / 32];
  __shared__ unsigned max_scratch[32];
  const RowGroup g = MakeRowGroup(warps_per_row);
  const int64_t rows = a.rows, cols = a.cols;
  const int packs = static_cast<int>(cols / kVec);  // <= 1024 on this path
  const int64_t stride = cols + 4;
  const float s = *a.scale;
  unsigned bits = 0;
  int turn = 0;
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const int row_words = tile_rows / 4;  // 4-row words per column of a full tile
  const int64_t word_blocks = int64_t(row_words) * (cols / 4);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t * tile_rows;
    const int n = static_cast<int>(min(int64_t(tile_rows), rows - r0));
    for (int i = g.index; i < n; i += g.count) {
      const int64_t r = r0 + i;
      InPack xr[kPacks];
      LoadRowPacks(a.x + r * cols, packs, g, xr);
      // The group's next row: in this tile, else in the block's next tile
      // (its load then overlaps this tile's transposed writes).
      const int64_t next =
          i + g.count < n ? r + g.count : (t + gridDim.x) * tile_rows + g.index;
      if (next < rows) PrefetchRowL2<typename In::Storage, kPacks>(a.x + next * cols, packs, g);
      float mean, rsigma;
      RowStatistics<In>(xr, packs, cols, a.layernorm, a.epsilon, g, &slots[0][0],
                        kTransposedMaxThreads / 32, &turn, &mean, &rsigma);
      if (g.lane == 0) {
        if (a.mu != nullptr) a.mu[r] = mean;
        if (a.rsigma != nullptr) a.rsigma[r] = rsigma;
      }
      OutPack* y_row = reinterpret_cast<OutPack*>(a.y + r * cols);
      uint8_t* tile_row = tile + i * stride;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = g.lane + k * g.threads;
        if (p < packs) {
          const OutPack o = NormPack<In, G, Out>(xr[k], a.gamma, a.beta, p, mean, rsigma,
                                                 a.zero_centered, s, &bits);
          y_row[p] = o;
          // stride is 4 (mod 8): two 4-byte stores.
          uint32_t lo = 0, hi = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            lo |= static_cast<uint32_t>(o.v[j]) << (8 * j);
            hi |= static_cast<uint32_t>(o.v[4 + j]) << (8 * j);
          }
          reinterpret_cast<uint32_t*>(tile_row + 8 * p)[0] = lo;
          reinterpret_cast<uint32_t*>(tile_row + 8 * p)[1] = hi;
        }
      }
    }
    __syncthreads();  // the tile is complete
    // Word block b: rows 4w..4w+3 of the tile, columns 4q..4q+3; w varies
    // fastest, so a warp writes whole runs of one y_t row.
    for (int64_t b = threadIdx.x; b < word_blocks; b += blockDim.x) {
      const int w = static_cast<int>(b % row_words);
      const int64_t q = b / row_words;
      if (4 * w >= n) continue;
      const uint8_t* src = tile + 4 * w * stride + 4 * q;
      const uint32_t in0 = *reinterpret_cast<const uint32_t*>(src);
      const uint32_t in1 = *reinterpret_cast<const uint32_t*>(src + stride);
      const uint32_t in2 = *reinterpret_cast<const uint32_t*>(src + 2 * stride);
      const uint32_t in3 = *reinterpret_cast<const uint32_t*>(src + 3 * stride);
      // in_i holds row i's codes of columns 0..3; out_j column j's codes of rows 0..3.
      const uint32_t lo01 = __byte_perm(in0, in1, 0x5140);  // r0c0 r1c0 r0c1 r1c1
      const uint32_t hi01 = __byte_perm(in0, in1, 0x7362);  // r0c2 r1c2 r0c3 r1c3
      const uint32_t lo23 = __byte_perm(in2, in3, 0x5140);
      const uint32_t hi23 = __byte_perm(in2, in3, 0x7362);
      uint8_t* dst = y_t + 4 * q * rows + r0 + 4 * w;
      *reinterpret_cast<uint32_t*>(dst) = __byte_perm(lo01, lo23, 0x5410);
      *reinterpret_cast<uint32_t*>(dst + rows) = __byte_perm(lo01, lo23, 0x7632);
      *reinterpret_cast<uint32_t*>(dst + 2 * rows) = __byte_perm(hi01, hi23, 0x5410);
      *reinterpret_cast<uint32_t*>(dst + 3 * rows) = __byte_perm(hi01, hi23, 0x7632);
    }
    __syncthreads();  // the tile may be overwritten
  }
  FinishAmax(bits, a.amax, a.scale_inv, s, max_scratch);
}

// Backward, fast path. dx = rsigma * (dxhat - mean(dxhat) - xhat *
// mean(dxhat * xhat)) + residual (residual null: none). Each group walks rows
// grid-stride, summing dy * xhat and dy into registers for the columns its
// threads own; at the end the block's groups add theirs in group order into
// shared memory ([2][cols]: dgamma, dbeta), which becomes this block's
// partial rows partial[blockIdx.x] and partial[gridDim.x + blockIdx.x].
template <typename In, typename G, typename Out>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    NormBackwardFastKernel(const typename In::Storage* dy, const typename In::Storage* x,
                           const float* mu, const float* rsigma, const typename G::Storage* gamma,
                           const typename Out::Storage* residual, typename Out::Storage* dx,
                           float* partial, int64_t rows, int64_t cols, bool layernorm,
                           bool zero_centered, int warps_per_row) {
  constexpr int kPacks = RowPacksFor(sizeof(typename In::Storage));
  using InPack = Pack<typename In::Storage>;
  using GPack = Pack<typename G::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  extern __shared__ float4 column_sums4[];
  float* column_sums = reinterpret_cast<float*>(column_sums4);
  __shared__ float2 slots[2][kBackwardThreads / 32];
  const RowGroup g = MakeRowGroup(warps_per_row);
  const int packs = static_cast<int>(cols / kVec);  // <= 1024 on this path
  float dgamma_acc[kPacks][kVec], dbeta_acc[kPacks][kVec];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) dgamma_acc[k][j] = dbeta_acc[k][j] = 0.0f;
  }
  int parity = 0;
  const int64_t step = int64_t(gridDim.x) * g.count;
  for (int64_t r = int64_t(blockIdx.x) * g.count + g.index; r < rows; r += step, parity ^= 1) {
    InPack xr[kPacks], dyr[kPacks];
    LoadRowPacks(x + r * cols, packs, g, xr);
    LoadRowPacks(dy + r * cols, packs, g, dyr);
    // The residual, read after the row sums, and the group's next row.
    if (residual != nullptr) {
      PrefetchRowL2<typename Out::Storage, kPacks>(residual + r * cols, packs, g);
    }
    if (r + step < rows) {
      PrefetchRowL2<typename In::Storage, kPacks>(x + (r + step) * cols, packs, g);
      PrefetchRowL2<typename In::Storage, kPacks>(dy + (r + step) * cols, packs, g);
    }
    const float m = layernorm ? mu[r] : 0.0f;
    const float rs = rsigma[r];
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = g.lane + k * g.threads;
      if (p < packs) {
        const GPack gp = reinterpret_cast<const GPack*>(gamma)[p];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float gj = G::Load(gp.v[j]);
          if (zero_centered) gj += 1.0f;
          const float xhat = (In::Load(xr[k].v[j]) - m) * rs;
          const float d = In::Load(dyr[k].v[j]);
          const float dxhat = d * gj;
          sum_dxhat += dxhat;
          sum_dxhat_xhat += dxhat * xhat;
          dgamma_acc[k][j] += d * xhat;
          dbeta_acc[k][j] += d;
        }
      }
    }
    const float2 sums = GroupSum2(make_float2(sum_dxhat, sum_dxhat_xhat), g, slots[parity]);
    const float mean_dxhat = layernorm ? sums.x / static_cast<float>(cols) : 0.0f;
    const float mean_dxhat_xhat = sums.y / static_cast<float>(cols);
    const OutPack* residual_row =
        residual != nullptr ? reinterpret_cast<const OutPack*>(residual + r * cols) : nullptr;
    OutPack* dx_row = reinterpret_cast<OutPack*>(dx + r * cols);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = g.lane + k * g.threads;
      if (p < packs) {
        const GPack gp = reinterpret_cast<const GPack*>(gamma)[p];
        OutPack rp;
        if (residual_row != nullptr) rp = residual_row[p];
        OutPack o;
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          float gj = G::Load(gp.v[j]);
          if (zero_centered) gj += 1.0f;
          const float xhat = (In::Load(xr[k].v[j]) - m) * rs;
          const float dxhat = In::Load(dyr[k].v[j]) * gj;
          float v = rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
          if (residual_row != nullptr) v += Out::Load(rp.v[j]);
          o.v[j] = Out::Store(v);
        }
        dx_row[p] = o;
      }
    }
  }
  // The block's column sums, group 0 first: each column is owned by the same
  // lane in every group, so one barrier per group orders the additions.
  for (int turn = 0; turn < g.count; ++turn) {
    if (g.index == turn) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = g.lane + k * g.threads;
        if (p < packs) {
          float4* dg = column_sums4 + 2 * p;
          float4* db = column_sums4 + (cols / 4) + 2 * p;
          float4 dg0 = make_float4(dgamma_acc[k][0], dgamma_acc[k][1], dgamma_acc[k][2],
                                   dgamma_acc[k][3]);
          float4 dg1 = make_float4(dgamma_acc[k][4], dgamma_acc[k][5], dgamma_acc[k][6],
                                   dgamma_acc[k][7]);
          float4 db0 = make_float4(dbeta_acc[k][0], dbeta_acc[k][1], dbeta_acc[k][2],
                                   dbeta_acc[k][3]);
          float4 db1 = make_float4(dbeta_acc[k][4], dbeta_acc[k][5], dbeta_acc[k][6],
                                   dbeta_acc[k][7]);
          if (turn > 0) {
            dg0 = Add4(dg[0], dg0);
            dg1 = Add4(dg[1], dg1);
            db0 = Add4(db[0], db0);
            db1 = Add4(db[1], db1);
          }
          dg[0] = dg0;
          dg[1] = dg1;
          db[0] = db0;
          db[1] = db1;
        }
      }
    }
    __syncthreads();
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    partial[blockIdx.x * cols + c] = column_sums[c];
    partial[(gridDim.x + blockIdx.x) * cols + c] = column_sums[cols + c];
  }
}

}  // namespace
}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_NORM_FAST_CUH_
