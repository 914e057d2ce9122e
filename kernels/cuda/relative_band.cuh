// Device pieces the relative bias's band kernels share (relative_bias_grad.cu,
// relative_band_split.cu): tiles of 16 queries or keys on tensor cores
// (mma.m16n8k16 fed by ldmatrix), rows staged into shared memory, the bias
// at each distance, and the fold of a head's per-distance sums into dtable.
//
// The band: causal T5 buckets saturate, so every key W (uniform_from) or
// more positions before its query carries one bias value per head; the W
// diagonals nearer the query are the band, where the bias varies.
#ifndef TE_KERNELS_CUDA_RELATIVE_BAND_CUH_
#define TE_KERNELS_CUDA_RELATIVE_BAND_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>

#include "kernels/cuda/attention_internal.h"  // kRelativeBandMax
#include "kernels/cuda/common.cuh"

namespace te {
namespace cuda {
namespace band {

constexpr int kWarps = 8;
constexpr int kTile = 16;                    // mma.m16n8k16's rows; a query or key tile
constexpr int kBlockRows = kTile * kWarps;   // query (or key) rows per block: eight tiles
constexpr int kStagePad = 8;  // elements after each staged row: ldmatrix's rows in distinct banks

// Key tiles behind a query tile that hold band elements: distances up to
// W - 1 reach 16 (offsets - 1) - 15.
__host__ __device__ constexpr int Offsets(int band) { return (band + kTile - 2) / kTile + 1; }
// Rows a block's band reaches: its own 128, and the band's reach past them.
__host__ __device__ constexpr int ReachRows(int band) { return kTile * (Offsets(band) - 1) + kBlockRows; }

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
// A bias value as cuDNN reads it: rounded once to the operands' dtype.
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
// Two floats as one register of two T (lo in the low half: the lower column).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <typename T>
__device__ __forceinline__ void UnpackPair(uint32_t bits, float* lo, float* hi) {
  const T* v = reinterpret_cast<const T*>(&bits);
  *lo = ToFloat(v[0]);
  *hi = ToFloat(v[1]);
}

// Four 8x8 b16 matrices from shared memory, each lane giving one row's address.
__device__ __forceinline__ void LoadMatrices(uint32_t r[4], const void* row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}
// The same, each matrix transposed.
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t r[4], const void* row) {
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(at));
}
// d += a (16x16, row-major) * b (16x8, column-major), f32 accumulators.
template <typename T>
__device__ __forceinline__ void MmaAccumulate(float d[4], const uint32_t a[4], uint32_t b0,
                                              uint32_t b1);
template <>
__device__ __forceinline__ void MmaAccumulate<__nv_bfloat16>(float d[4], const uint32_t a[4],
                                                             uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void MmaAccumulate<__half>(float d[4], const uint32_t a[4], uint32_t b0,
                                                      uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A 16x16 tile's accumulators (two n-blocks of mma's C fragment) as the A
// fragment of the next product: P (or dS) times V (or K, Q, dout).
template <typename T>
__device__ __forceinline__ void AsOperandA(const float c[2][4], float scale, uint32_t a[4]) {
  a[0] = PackPair<T>(c[0][0] * scale, c[0][1] * scale);
  a[1] = PackPair<T>(c[0][2] * scale, c[0][3] * scale);
  a[2] = PackPair<T>(c[1][0] * scale, c[1][1] * scale);
  a[3] = PackPair<T>(c[1][2] * scale, c[1][3] * scale);
}

// Lane roles in mma.m16n8k16 and ldmatrix.x4 (lane = 4 g + qd): the
// accumulator's element e of n-block nb is row g + 8 (e / 2), column
// 8 nb + 2 qd + e % 2 of a 16x16 tile. Row addresses for ldmatrix: a tile as
// the A operand (and, transposed, as the B operand of a product over its
// rows), or as the B operand of a product over its columns.
struct Lanes {
  int g, qd;
  int a_row, a_col;
  int b_row, b_col;
  __device__ explicit Lanes(int lane)
      : g(lane / 4),
        qd(lane % 4),
        a_row((lane & 7) + ((lane >> 3) & 1) * 8),
        a_col((lane >> 4) * 8),
        b_row((lane & 7) + (lane >> 4) * 8),
        b_col(((lane >> 3) & 1) * 8) {}
};

// The bias of head h at distance d (< S) from the last query of S, as cuDNN
// adds it: in T.
template <typename T>
__device__ __forceinline__ float BiasAtDistance(const BandBias& b, int h, int seq, int d) {
  int64_t at;
  if (b.dense != nullptr) {
    at = (static_cast<int64_t>(h) * seq + (seq - 1)) * seq + (seq - 1 - d);
  } else {
    const int bucket = b.buckets[static_cast<int64_t>(seq - 1) * seq + (seq - 1 - d)];
    at = static_cast<int64_t>(h) * b.num_buckets + bucket;
  }
  const void* from = b.dense != nullptr ? b.dense : b.table;
  return b.f32 ? RoundAsOperand<T>(static_cast<const float*>(from)[at])
               : ToFloat(static_cast<const T*>(from)[at]);
}

// `rows` rows of D elements, `stride` elements apart from `src`, into shared
// memory rows of D + kStagePad from `dst`: 16-byte asynchronous copies,
// committed by the caller.
template <typename T, int D>
__device__ __forceinline__ void StageRows(T* dst, const T* src, int64_t stride, int rows) {
  constexpr int kPerCopy = 16 / static_cast<int>(sizeof(T));
  constexpr int kCopies = D / kPerCopy;  // per row
  for (int c = threadIdx.x; c < rows * kCopies; c += blockDim.x) {
    const int row = c / kCopies, at = c % kCopies * kPerCopy;
    __pipeline_memcpy_async(dst + row * (D + kStagePad) + at, src + row * stride + at, 16);
  }
}

// delta = rowsum(dout * out) of row i of a block's rows, two threads a row
// (threads 2 r and 2 r + 1 take row r's halves, their 16-byte loads all in
// flight at once); both threads get the row's sum. 0 past the sequence.
template <typename T, int D>
__device__ __forceinline__ float RowDelta(const T* out, const T* dout, int64_t stride, int i,
                                          int seq) {
  constexpr int kHalf = D / 2;                                        // elements a thread
  constexpr int kVectors = kHalf * static_cast<int>(sizeof(T)) / 16;  // 16-byte loads
  const int half = threadIdx.x % 2;
  float part = 0.0f;
  if (i < seq) {
    const uint4* o4 = reinterpret_cast<const uint4*>(out + i * stride + half * kHalf);
    const uint4* d4 = reinterpret_cast<const uint4*>(dout + i * stride + half * kHalf);
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
  return part + __shfl_xor_sync(0xffffffffu, part, 1);
}

// Two 16x16 tiles over D: x += a_x rows(x_stage)^T and y += a_y
// rows(y_stage)^T, the B operands the 16 staged rows from x_rows and
// y_rows (rows D + kStagePad apart): S = q k^T with dP = dout v^T, or their
// transposes.
template <typename T, int D>
__device__ __forceinline__ void TwoTileProducts(const uint32_t (*a_x)[4], const T* x_rows,
                                                const uint32_t (*a_y)[4], const T* y_rows,
                                                const Lanes& l, float x[2][4], float y[2][4]) {
  constexpr int kLdm = D + kStagePad;
#pragma unroll
  for (int kk = 0; kk < D / kTile; ++kk) {
    uint32_t b_x[4], b_y[4];
    LoadMatrices(b_x, x_rows + l.b_row * kLdm + kk * kTile + l.b_col);
    LoadMatrices(b_y, y_rows + l.b_row * kLdm + kk * kTile + l.b_col);
    MmaAccumulate<T>(x[0], a_x[kk], b_x[0], b_x[1]);
    MmaAccumulate<T>(x[1], a_x[kk], b_x[2], b_x[3]);
    MmaAccumulate<T>(y[0], a_y[kk], b_y[0], b_y[1]);
    MmaAccumulate<T>(y[1], a_y[kk], b_y[2], b_y[3]);
  }
}

// After a block has written one of head h's `per_head` partial rows (one
// per tile and batch): whether it was the head's last to be written (the
// stream's group counter for head h; the caller resets it once it has
// folded). Every thread of the block calls it.
__device__ __forceinline__ bool LastBlockOfHead(unsigned* heads_done, int h, unsigned per_head) {
  __shared__ bool last_of_head;
  __threadfence();  // this block's sums land before its count
  __syncthreads();
  if (threadIdx.x == 0) last_of_head = atomicAdd(&heads_done[h], 1u) == per_head - 1;
  __syncthreads();
  if (last_of_head) __threadfence();  // every block's sums are in: read them after the count
  return last_of_head;
}

// dtable[:, h]: the head's distances' sums over batches and tiles, each
// added to its bucket; the far bucket (the one at distance W) also takes
// minus the band's sum of every row with far keys. kTableSplit threads per
// distance, their sums added in a fixed order: the same bits whichever block
// runs it. `split_sums` holds kTableSplit * (kRelativeBandMax + 1) floats and
// `bucket_at` kRelativeBandMax ints of shared memory. The partial rows are
// other blocks' writes: read past L1.
constexpr int kTableSplit = 4;
constexpr int kTableThreads = kTableSplit * (kRelativeBandMax + kTableSplit);

__device__ __forceinline__ void SumHeadTable(const float* partial, const int32_t* buckets,
                                             float* dtable, int batch, int heads, int tiles,
                                             int seq, int band, int num_buckets, int h,
                                             float* split_sums, int32_t* bucket_at) {
  const int blocks = batch * tiles;  // the partial rows of this head
  for (int x = threadIdx.x; x < kTableSplit * (band + 1); x += blockDim.x) {
    const int d = x % (band + 1), part = x / (band + 1);
    float sum = 0.0f;
#pragma unroll 4
    for (int n = part; n < blocks; n += kTableSplit) {
      const int b = n / tiles, t = n % tiles;
      sum += __ldcg(&partial[((static_cast<int64_t>(b) * heads + h) * tiles + t) * (band + 1) + d]);
    }
    split_sums[part * (kRelativeBandMax + 1) + d] = sum;
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
        for (int part = 0; part < kTableSplit; ++part) {
          sum += split_sums[part * (kRelativeBandMax + 1) + d];
        }
      }
    }
    if (n == far) {
      for (int part = 0; part < kTableSplit; ++part) {
        sum += split_sums[part * (kRelativeBandMax + 1) + band];
      }
    }
    dtable[static_cast<int64_t>(h) * num_buckets + n] = sum;
  }
}

}  // namespace band
}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_RELATIVE_BAND_CUH_
