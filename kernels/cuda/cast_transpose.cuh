// The cast-transpose kernel, shared by the FP8 quantizers (fp8.cu: f is the
// identity) and the activations that write their FP8 output in both layouts
// (activation.cu: f is the activation), so both make the same codes from the
// same float values.
#ifndef TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
#define TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

struct IdentityFn {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};

// Cast-transpose: y = FP8(f(x) * scale) and y_t = y^T, 64 x 64 tiles of x,
// a block (256 threads, 16 x 16) taking tiles blockIdx.x, + gridDim.x, ...
// (QuantizeTransposeGrid blocks: the amax's fold at each block's end, a
// fence and a returning atomic, then costs once a block, not once a tile).
// Each thread reads 4 consecutive elements of a row, writes their FP8 codes
// as one 4-byte word of y, and keeps them in shared memory; the tile then
// leaves transposed as 4-byte words of y_t (4 consecutive rows of one
// column), as gemm.cu's byte transpose does. Needs rows and cols multiples
// of 4 and 4-element-aligned rows (the launcher checks).
// With `column_partial` ([ceil(rows / 64), cols] f32) each tile also sums its rows
// of x per column (float32, in a fixed order: each thread its 4 rows, then
// the 16 threads of a column in order) into column_partial[tile row]: the
// dbias of cast-transpose-dbias, finished by PartialColumnSumsKernel.
// With `kept_scale` and `kept_amax` (QuantizeTransposeKept's record of the
// scale y holds x at, and that quantization's amax): where the scale is the
// kept one every block leaves at once and the amax is the kept one; else the
// last block to finish records this scale and amax.
template <typename In, typename Out, typename F = IdentityFn>
__global__ void QuantizeTransposeKernel(const typename In::Storage* __restrict__ x,
                                        uint8_t* __restrict__ y, uint8_t* __restrict__ y_t,
                                        const float* scale, AmaxOut amax, float* scale_inv,
                                        float* __restrict__ column_partial, int64_t rows,
                                        int64_t cols, float* kept_scale, float* kept_amax,
                                        F f = F()) {
  using InPack = Pack<typename In::Storage, 4>;
  __shared__ ByteTile tile;
  __shared__ float tile_column_sums[16][64 + 1];
  __shared__ unsigned scratch[32];
  const float s = *scale;
  // y and y_t already hold x quantized with s: every block sees the same two
  // values and leaves at once. (The last block of a launch that quantizes
  // writes *kept_scale only after every block has read it.)
  if (kept_scale != nullptr && *kept_scale == s) {
    if (amax.amax != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      *amax.amax = *kept_amax;
    }
    return;
  }
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t col_tiles = (cols + 63) / 64;
  const int64_t tiles = col_tiles * ((rows + 63) / 64);
  unsigned local = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t tile_row = t / col_tiles;
    const int64_t col0 = (t - tile_row * col_tiles) * 64;
    const int64_t row0 = tile_row * 64;
    float column_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 16 * i;
      const int64_t c = col0 + tx * 4;
      if (row0 + r < rows && c < cols) {
        const InPack p = *reinterpret_cast<const InPack*>(x + (row0 + r) * cols + c);
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float v = f(In::Load(p.v[j]));
          local = max(local, AbsBits(v));
          column_sum[j] += v;
          const uint8_t code = Out::Store(v * s);
          tile[r][tx * 4 + j] = code;
          word |= static_cast<uint32_t>(code) << (8 * j);
        }
        *reinterpret_cast<uint32_t*>(y + (row0 + r) * cols + c) = word;
      }
    }
    if (column_partial != nullptr) {
#pragma unroll
      for (int j = 0; j < 4; ++j) tile_column_sums[ty][tx * 4 + j] = column_sum[j];
    }
    __syncthreads();
    StoreTileTransposed(tile, y_t, rows, cols, row0, col0, tx, ty);
    // tile_column_sums was complete at the barrier above.
    if (column_partial != nullptr && threadIdx.x < 64 && col0 + threadIdx.x < cols) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 16; ++k) sum += tile_column_sums[k][threadIdx.x];
      column_partial[tile_row * cols + col0 + threadIdx.x] = sum;
    }
    __syncthreads();  // the next tile overwrites both shared arrays
  }
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) {
    if (FoldAmax(amax, local) && kept_scale != nullptr) {
      *kept_scale = s;
      *kept_amax = *amax.amax;
    }
    if (blockIdx.x == 0) *scale_inv = 1.0f / s;
  }
}

// QuantizeTransposeKernel's blocks for x [rows, cols]: a tile each, up to as
// many as the device holds at once (`resident`: ResidentBlocks of the
// instance launched, whose registers decide it: 38 a thread for bf16 -> E4M3
// on sm_90a, 40-48 with an activation, so 5-6 blocks of 256 threads an SM,
// not the 8 its threads would allow). Blocks past those would not run beside
// them but after them, each with its full share of the tiles and most of its
// SM idle.
inline unsigned QuantizeTransposeGrid(int64_t rows, int64_t cols, int64_t resident) {
  const int64_t tiles = ((cols + 63) / 64) * ((rows + 63) / 64);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(tiles, resident)));
}

// Whether QuantizeTransposeKernel takes x [rows, cols]: 4-element words on
// every side.
inline bool TileKernelFits(const Tensor& x, const Tensor& y, const Tensor& y_t) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  const size_t in_word = 4 * DTypeSize(x.dtype());
  return rows > 0 && cols > 0 && rows % 4 == 0 && cols % 4 == 0 &&
         reinterpret_cast<uintptr_t>(x.data()) % in_word == 0 &&
         reinterpret_cast<uintptr_t>(y.data()) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(y_t.data()) % 4 == 0;
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
