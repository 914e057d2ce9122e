// The cast-transpose kernel, shared by the FP8 quantizers (fp8.cu: f is the
// identity) and the activations that write their FP8 output in both layouts
// (activation.cu: f is the activation), so both make the same codes from the
// same float values.
#ifndef TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
#define TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

struct IdentityFn {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};

// ---- geometry --------------------------------------------------------------------
// One block per 128 x 128 tile of x (256 threads), so the launchers' grids and
// dbias's partial rows ([CastTransposeRowTiles(rows), cols] f32) follow these.
constexpr int kCastTransposeTile = 128;
constexpr int kCastTransposeThreads = 256;
inline int64_t CastTransposeRowTiles(int64_t rows) {
  return (rows + kCastTransposeTile - 1) / kCastTransposeTile;
}
inline dim3 CastTransposeGrid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>((cols + kCastTransposeTile - 1) / kCastTransposeTile),
              static_cast<unsigned>(CastTransposeRowTiles(rows)));
}

// Eight consecutive elements of a row of x from p into v: as 16-byte loads
// where `wide` (p 16-byte aligned, all eight inside the row), else as two
// 4-element words (TileKernelFits' alignment), the second only where `full`
// (the row may end after four: cols is a multiple of 4, not of 8).
template <typename T>
__device__ __forceinline__ void LoadEight(const T* p, bool wide, bool full, Pack<T, 8>& v) {
  constexpr int kPerLoad = 16 / sizeof(T);
  if (wide) {
#pragma unroll
    for (int k = 0; k < 8 / kPerLoad; ++k) {
      *reinterpret_cast<Pack<T, kPerLoad>*>(&v.v[k * kPerLoad]) =
          reinterpret_cast<const Pack<T, kPerLoad>*>(p)[k];
    }
  } else {
    *reinterpret_cast<Pack<T, 4>*>(&v.v[0]) = reinterpret_cast<const Pack<T, 4>*>(p)[0];
    if (full) *reinterpret_cast<Pack<T, 4>*>(&v.v[4]) = reinterpret_cast<const Pack<T, 4>*>(p)[1];
  }
}

// The column words of a 4 x 4 byte block: rows a..d hold 4 columns each (byte
// j = column j); word j of the result holds column j's 4 rows (byte k = row k).
__device__ __forceinline__ void TransposeBytes4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d,
                                                  uint32_t (&column)[4]) {
  const uint32_t ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const uint32_t cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  column[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  column[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  column[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  column[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

// Cast-transpose: y = FP8(f(x) * scale) and y_t = y^T, one 128 x 128 tile of
// x per block (256 threads).
//
// Reading x: thread (tx, ty) = (t % 16, t / 16) takes 8 consecutive elements
// (one 16-byte load of bf16 / f16, two of f32) of rows ty, ty + 16, ...,
// ty + 112, four rows' loads issued before any is converted, writes each
// row's 8 codes as one 8-byte word of y, and keeps
// them in shared memory as 32-bit words of 4 columns, word w of tile row r at
// w ^ (4 * (r / 16)): the swizzle that lets the transposed read below hit 32
// distinct banks (the row-major write keeps its 8-byte pairs, 2 wavefronts).
// Writing y_t: lane l of warp w takes columns 4 * (4w + l / 8) .. + 3 and
// rows 16 * (l % 8) .. + 15, reads them as 16 words, transposes 4 x 4 byte
// blocks in registers and writes each column's 16 rows as one 16-byte word of
// y_t: 8 lanes make one 128-byte line of a y_t row.
// Edges: rows and cols are multiples of 4 (TileKernelFits), so every 4-wide
// piece is inside or outside together; where a row of x, y or y_t is not
// 16-, 8- or 16-byte aligned, or a tile edge cuts a vector, the same thread
// moves 4-element / 4-byte words instead (the values and codes are the same).
// amax: max over the block, one atomic per block.
// With `column_partial` ([CastTransposeRowTiles(rows), cols] f32) the tile also
// sums its rows of f(x) per column (float32, in a fixed order: each thread its
// 8 rows in order, then the 16 threads of a column in order) into
// column_partial[blockIdx.y]: the dbias of cast-transpose-dbias, finished by
// PartialColumnSumsKernel.
//
// Napkin math (H200, ~4.0 TB/s copy bandwidth; bytes read + written, bf16 in,
// one FP8 byte out per layout, dbias partial rows of f32 written and read back):
//   [8192, 4096]:  64 + 32 + 32 MiB + 2 x 1 MiB = 136 MB -> floor 0.034 ms;
//                  expected ~0.043 ms for the op (0.060 ms with 64 x 64 tiles).
//   [8192, 16384]: 256 + 128 + 128 MiB + 2 x 4 MiB = 545 MB -> floor 0.136 ms;
//                  expected ~0.150 ms (0.192 ms with 64 x 64 tiles).
template <typename In, typename Out, typename F = IdentityFn>
__global__ void __launch_bounds__(kCastTransposeThreads)
    QuantizeTransposeKernel(const typename In::Storage* __restrict__ x, uint8_t* __restrict__ y,
                            uint8_t* __restrict__ y_t, const float* scale, float* amax,
                            float* scale_inv, float* __restrict__ column_partial, int64_t rows,
                            int64_t cols, const float* kept_scale, F f = F()) {
  using T = typename In::Storage;
  constexpr int kTile = kCastTransposeTile;
  constexpr int kRowsPerThread = kTile / 16;
  // Rows whose loads are in flight together before any is converted: 4 (64
  // bytes a thread of bf16, 128 of f32). All 8 rows of bf16 at once took 116
  // registers (2 blocks an SM) or spilled under 64; 4 keeps 64 (4 blocks).
  constexpr int kBatch = kRowsPerThread / 2;
  __shared__ uint32_t codes[kTile][kTile / 4];
  __shared__ float tile_column_sums[16][kTile];
  __shared__ unsigned scratch[32];
  const float s = *scale;
  // y and y_t already hold x quantized with s (QuantizeTransposeKept): every
  // block sees the same two values and leaves at once.
  if (kept_scale != nullptr && *kept_scale == s) return;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c = col0 + 8 * tx;
  // cols % 4 == 0: a row that reaches c holds at least 4 elements from it.
  const bool inside = c < cols, full = c + 8 <= cols;
  const bool wide_x = full && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                      (cols * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const bool wide_y = full && reinterpret_cast<uintptr_t>(y) % 8 == 0 && cols % 8 == 0;
  unsigned local = 0;
  float column_sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i0 = 0; i0 < kRowsPerThread; i0 += kBatch) {
    Pack<T, 8> in[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t r = row0 + ty + 16 * (i0 + b);
      if (inside && r < rows) LoadEight(x + r * cols + c, wide_x, full, in[b]);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b;
      const int64_t r = row0 + ty + 16 * i;
      if (!inside || r >= rows) continue;
      uint32_t word[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < 4 || full) {
          const float v = f(In::Load(in[b].v[j]));
          local = max(local, AbsBits(v));
          column_sum[j] += v;
          word[j / 4] |= static_cast<uint32_t>(Out::Store(v * s)) << (8 * (j % 4));
        }
      }
      uint8_t* row_y = y + r * cols + c;
      if (wide_y) {
        *reinterpret_cast<uint2*>(row_y) = make_uint2(word[0], word[1]);
      } else {
        *reinterpret_cast<uint32_t*>(row_y) = word[0];
        if (full) *reinterpret_cast<uint32_t*>(row_y + 4) = word[1];
      }
      // Tile row ty + 16 i: its swizzle is 4 i (even, so the pair stays 8-byte aligned).
      *reinterpret_cast<uint2*>(&codes[ty + 16 * i][(2 * tx) ^ (4 * i)]) =
          make_uint2(word[0], word[1]);
    }
  }
  if (column_partial != nullptr) {
#pragma unroll
    for (int j = 0; j < 8; ++j) tile_column_sums[ty][8 * tx + j] = column_sum[j];
  }
  __syncthreads();
  {
    const int lane = threadIdx.x % 32;
    const int row_group = lane % 8, column_group = (threadIdx.x / 32) * 4 + lane / 8;
    const int64_t r = row0 + 16 * row_group, c4 = col0 + 4 * column_group;
    // rows % 4 == 0 and cols % 4 == 0: the 4 columns, and each 4 rows, are
    // inside together.
    if (r < rows && c4 < cols) {
      uint32_t column_words[4][4];  // [column j][rows 4p .. 4p + 3]
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int tr = 16 * row_group + 4 * p;
        const int w = column_group ^ (4 * row_group);
        uint32_t column[4];
        TransposeBytes4x4(codes[tr][w], codes[tr + 1][w], codes[tr + 2][w], codes[tr + 3][w],
                          column);
#pragma unroll
        for (int j = 0; j < 4; ++j) column_words[j][p] = column[j];
      }
      const int64_t rows_left = rows - r;
      const bool wide_t =
          rows_left >= 16 && rows % 16 == 0 && reinterpret_cast<uintptr_t>(y_t) % 16 == 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint8_t* column_t = y_t + (c4 + j) * rows + r;
        if (wide_t) {
          *reinterpret_cast<uint4*>(column_t) = make_uint4(
              column_words[j][0], column_words[j][1], column_words[j][2], column_words[j][3]);
        } else {
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            if (4 * p < rows_left) {
              *reinterpret_cast<uint32_t*>(column_t + 4 * p) = column_words[j][p];
            }
          }
        }
      }
    }
  }
  // tile_column_sums was complete at the barrier above.
  if (column_partial != nullptr && threadIdx.x < kTile && col0 + threadIdx.x < cols) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 16; ++k) sum += tile_column_sums[k][threadIdx.x];
    column_partial[blockIdx.y * cols + col0 + threadIdx.x] = sum;
  }
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) {
    AtomicMaxAbsBits(amax, local);
    if (blockIdx.x == 0 && blockIdx.y == 0) *scale_inv = 1.0f / s;
  }
}

// Whether QuantizeTransposeKernel takes x [rows, cols]: 4-element words on
// every side, and a grid it can launch.
inline bool TileKernelFits(const Tensor& x, const Tensor& y, const Tensor& y_t) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  const size_t in_word = 4 * DTypeSize(x.dtype());
  return rows > 0 && cols > 0 && rows % 4 == 0 && cols % 4 == 0 &&
         reinterpret_cast<uintptr_t>(x.data()) % in_word == 0 &&
         reinterpret_cast<uintptr_t>(y.data()) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(y_t.data()) % 4 == 0 &&
         CastTransposeRowTiles(rows) <= 65535;
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
