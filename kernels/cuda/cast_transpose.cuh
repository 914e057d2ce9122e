// The cast-transpose kernel, shared by the FP8 quantizers (fp8.cu: f is the
// identity) and the activations that write their FP8 output in both layouts
// (activation.cu: f is the activation), so both make the same codes from the
// same float values.
#ifndef TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
#define TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

struct IdentityFn {
  __device__ __forceinline__ float operator()(float x) const { return x; }
};

// Whether f takes a second input, the gradient dy beside x (f(x, dy): an
// activation's backward, activation_fns.cuh's GradientOf); f(x) otherwise.
template <typename F, typename = void>
struct TakesGradient : std::false_type {};
template <typename F>
struct TakesGradient<F, std::void_t<decltype(F::kTakesGradient)>>
    : std::bool_constant<F::kTakesGradient> {};

// Whether f also transforms each row's 8 values of the wide kernel before
// they are quantized: f.TransformPack<In>(row, col, v), v the values of x's
// [row, col .. col + 7] (f(x) of each), changed in place (rotary.cuh's
// rotation of a packed qkv's q and k). Such an f takes the wide kernel only.
template <typename F, typename = void>
struct TransformsPacks : std::false_type {};
template <typename F>
struct TransformsPacks<F, std::void_t<decltype(F::kTransformsPacks)>>
    : std::bool_constant<F::kTransformsPacks> {};

// The value f makes of element j of the packs it reads.
template <typename In, typename F, typename P>
__device__ __forceinline__ float TileValue(const F& f, const P& x, const P& dy, int j) {
  if constexpr (TakesGradient<F>::value) {
    return f(In::Load(x.v[j]), In::Load(dy.v[j]));
  } else {
    return f(In::Load(x.v[j]));
  }
}

// Both cast-transpose kernels' kept-scale rule: where the kept scale is s,
// y and y_t already hold x quantized with s, so every block sees the same
// two values and leaves at once, and the amax is the kept one. (The last
// block of a launch that quantizes writes *kept_scale only after every
// block has read it.)
__device__ __forceinline__ bool QuantizationKept(float s, const AmaxOut& amax,
                                                 const float* kept_scale,
                                                 const float* kept_amax) {
  if (kept_scale == nullptr || *kept_scale != s) return false;
  if (amax.amax != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *amax.amax = *kept_amax;
  return true;
}

// Both cast-transpose kernels' end: the block's amax folded into the
// output, the last block to finish recording the scale and the amax it
// quantized with, and scale_inv written once.
__device__ __forceinline__ void FinishQuantization(unsigned local, unsigned* scratch,
                                                   const AmaxOut& amax, float s,
                                                   float* scale_inv, float* kept_scale,
                                                   float* kept_amax) {
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) {
    if (FoldAmax(amax, local) && kept_scale != nullptr) {
      *kept_scale = s;
      *kept_amax = *amax.amax;
    }
    if (blockIdx.x == 0) *scale_inv = 1.0f / s;
  }
}

// Cast-transpose: y = FP8(f(x) * scale) and y_t = y^T, 64 x 64 tiles of x,
// a block (256 threads, 16 x 16) taking tiles blockIdx.x, + gridDim.x, ...
// (LaunchCastTranspose's grid of resident blocks: the amax's fold at each
// block's end, a fence and a returning atomic, then costs once a block, not
// once a tile). The general kernel: shapes of whole 128 x 64 tiles take
// QuantizeTransposeWideKernel below.
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
  if (QuantizationKept(s, amax, kept_scale, kept_amax)) return;
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
  FinishQuantization(local, scratch, amax, s, scale_inv, kept_scale, kept_amax);
}

// The cast-transpose of whole 128 x 64 tiles: the same codes and amax as
// QuantizeTransposeKernel (bit for bit in y and y_t; column_partial per 128
// rows, not 64) with wider memory accesses and fewer instructions an
// element, for shapes WideTilesFit takes.
// Thread (lx, ly) = (tid % 8, tid / 8) takes 8 elements (16 bytes of bf16)
// of each of rows 4 ly .. 4 ly + 3, and writes each row's 8 codes to y as one
// 8-byte store. Its 4 x 8 codes are regrouped in registers (byte permutes)
// into 8 words of one column's 4 consecutive rows, stored to shared memory
// column-major as words (rows 132 bytes apart: conflict-free), so y^T leaves
// as 16 consecutive rows of one column a 16-byte store. Codes are made two
// at a time (one conversion for a pair). Each tile's loads are issued at its
// turn: issuing the next tile's before this one's arithmetic took 126
// registers and made the GELU gradient's 35% slower on the H100
// (bench/results/2026-12-07-h100-cast-transpose-prefetch-loses). kSums:
// whether to write column_partial (a template flag, so the kernel without it
// keeps no sums).
// Where f takes a gradient (TakesGradient), dy [rows, cols] is read beside x,
// pack for pack, and quantized is f(x, dy): dy is null otherwise. Where f
// transforms packs (TransformsPacks), each row's 8 values go through it
// before they are quantized.
constexpr int kWideTileRows = 128, kWideTileCols = 64;

// Byte b of each of the four words, as one word (w[0]'s in its low byte):
// one column of a thread's 4 rows of codes.
__device__ __forceinline__ uint32_t ColumnOfWords(uint32_t w0, uint32_t w1, uint32_t w2,
                                                  uint32_t w3, int b) {
  const unsigned pick = b | (b + 4) << 4;  // w_lo's byte b, then w_hi's
  return __byte_perm(__byte_perm(w0, w1, pick), __byte_perm(w2, w3, pick), 0x5410);
}

// The wide kernel's tiles first_tile, + tile_step, ... of x [rows, cols]
// quantized with scale s into y and y_t (and their column sums where kSums);
// returns the largest |f(x)| met, as AbsBits. Every thread of the block calls
// it (it synchronises the block).
template <typename In, typename Out, typename F, bool kSums>
__device__ __forceinline__ unsigned QuantizeWideTiles(
    const typename In::Storage* __restrict__ x, const typename In::Storage* __restrict__ dy,
    uint8_t* __restrict__ y, uint8_t* __restrict__ y_t, float s,
    float* __restrict__ column_partial, int64_t rows, int64_t cols, int64_t first_tile,
    int64_t tile_step, const F& f) {
  using InPack = Pack<typename In::Storage, 8>;
  constexpr bool kGrad = TakesGradient<F>::value;
  constexpr int kPitch = kWideTileRows + 4;
  __shared__ __align__(16) uint8_t codes[kWideTileCols][kPitch];
  __shared__ float tile_column_sums[kSums ? 32 : 1][kWideTileCols + 1];
  const int lx = threadIdx.x % 8, ly = threadIdx.x / 8;
  const int64_t col_tiles = cols / kWideTileCols;
  const int64_t tiles = col_tiles * (rows / kWideTileRows);
  unsigned local = 0;
  for (int64_t t = first_tile; t < tiles; t += tile_step) {
    const int64_t tile_row = t / col_tiles;
    const int64_t row0 = tile_row * kWideTileRows;
    const int64_t col0 = (t - tile_row * col_tiles) * kWideTileCols;
    InPack in[4], grad[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (row0 + 4 * ly + i) * cols + col0 + lx * 8;
      in[i] = *reinterpret_cast<const InPack*>(x + at);
      if constexpr (kGrad) grad[i] = *reinterpret_cast<const InPack*>(dy + at);
    }
    float column_sum[8] = {};
    uint32_t word[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 4 * ly + i;
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = TileValue<In>(f, in[i], grad[i], j);
      if constexpr (TransformsPacks<F>::value) {
        f.template TransformPack<In>(row0 + r, col0 + lx * 8, v);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        local = max(local, AbsBits(v[j]));
        if (kSums) column_sum[j] += v[j];
      }
#pragma unroll
      for (int w = 0; w < 2; ++w) {
        word[i][w] = uint32_t(Out::Store2(v[4 * w] * s, v[4 * w + 1] * s)) |
                     uint32_t(Out::Store2(v[4 * w + 2] * s, v[4 * w + 3] * s)) << 16;
      }
      *reinterpret_cast<uint2*>(y + (row0 + r) * cols + col0 + lx * 8) =
          make_uint2(word[i][0], word[i][1]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      *reinterpret_cast<uint32_t*>(&codes[lx * 8 + j][4 * ly]) =
          ColumnOfWords(word[0][j / 4], word[1][j / 4], word[2][j / 4], word[3][j / 4], j % 4);
      if (kSums) tile_column_sums[ly][lx * 8 + j] = column_sum[j];
    }
    __syncthreads();
    // y^T rows col0 .. col0 + 63, bytes row0 .. row0 + 127 of each: 64 x 8
    // chunks of 16 bytes, two a thread.
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = ly + 32 * k;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(&codes[c][lx * 16]);
      *reinterpret_cast<uint4*>(y_t + (col0 + c) * rows + row0 + lx * 16) =
          make_uint4(src[0], src[1], src[2], src[3]);
    }
    // The 32 threads of a column in order (rows in order): a fixed order.
    if (kSums && threadIdx.x < kWideTileCols) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < 32; ++k) sum += tile_column_sums[k][threadIdx.x];
      column_partial[tile_row * cols + col0 + threadIdx.x] = sum;
    }
    __syncthreads();  // the next tile overwrites both shared arrays
  }
  return local;
}

template <typename In, typename Out, typename F, bool kSums>
__global__ void __launch_bounds__(256)
    QuantizeTransposeWideKernel(const typename In::Storage* __restrict__ x,
                                const typename In::Storage* __restrict__ dy,
                                uint8_t* __restrict__ y, uint8_t* __restrict__ y_t,
                                const float* scale, AmaxOut amax, float* scale_inv,
                                float* __restrict__ column_partial, int64_t rows, int64_t cols,
                                float* kept_scale, float* kept_amax, F f = F()) {
  __shared__ unsigned scratch[32];
  const float s = *scale;
  if (QuantizationKept(s, amax, kept_scale, kept_amax)) return;
  const unsigned local = QuantizeWideTiles<In, Out, F, kSums>(
      x, dy, y, y_t, s, column_partial, rows, cols, blockIdx.x, gridDim.x, f);
  FinishQuantization(local, scratch, amax, s, scale_inv, kept_scale, kept_amax);
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

// Whether QuantizeTransposeWideKernel takes x [rows, cols]: whole 128 x 64
// tiles, 8-element loads of x, 8-byte stores to y and 16-byte ones to y_t.
inline bool WideTilesFit(const Tensor& x, const Tensor& y, const Tensor& y_t) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  return rows > 0 && cols > 0 && rows % kWideTileRows == 0 && cols % kWideTileCols == 0 &&
         reinterpret_cast<uintptr_t>(x.data()) % (8 * DTypeSize(x.dtype())) == 0 &&
         reinterpret_cast<uintptr_t>(y.data()) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(y_t.data()) % 16 == 0;
}

// Rows of column partials the cast-transpose of x writes (one per tile row
// of the kernel LaunchCastTranspose picks); x must fit TileKernelFits.
inline int64_t CastTransposePartialRows(const Tensor& x, const Tensor& y, const Tensor& y_t) {
  const int64_t tile_rows = WideTilesFit(x, y, y_t) ? kWideTileRows : 64;
  return (x.dim(0) + tile_rows - 1) / tile_rows;
}

// One cast-transpose of x [rows, cols] (TileKernelFits) into y and y_t:
// the wide kernel on whole tiles, else the 64 x 64 one. Either runs on the
// blocks that fit the device at once (ResidentBlocks of the instance
// launched, whose registers decide it: 5-6 blocks of 256 threads an SM for
// the 64 x 64 kernel on sm_90a), at most a tile each: blocks past those
// would not run beside them but after them, each with its full share of the
// tiles and most of its SM idle. column_partial: null, or
// [CastTransposePartialRows, cols] f32 (kColumnSums: whether it is given);
// kept_scale and kept_amax: null, or QuantizeTransposeKept's record of y's
// scale and amax. An f that takes a gradient reads dy (x's shape and dtype,
// 16-byte aligned) and takes the wide kernel only, as does an f that
// transforms packs: the caller checks WideTilesFit.
template <typename In, typename Out, bool kColumnSums = false, typename F = IdentityFn>
void LaunchCastTranspose(const CudaContext& device, cudaStream_t stream, const Tensor& x,
                         Tensor* y, Tensor* y_t, const float* scale, AmaxOut amax,
                         float* scale_inv, float* column_partial, float* kept_scale,
                         float* kept_amax, F f = F(), const Tensor* dy = nullptr) {
  using Storage = typename In::Storage;
  const int64_t rows = x.dim(0), cols = x.dim(1);
  const auto* xs = static_cast<const Storage*>(x.data());
  const auto* dys = dy != nullptr ? static_cast<const Storage*>(dy->data()) : nullptr;
  auto* ys = static_cast<uint8_t*>(y->data());
  auto* yts = static_cast<uint8_t*>(y_t->data());
  auto grid = [&](auto kernel, int64_t tiles) {
    return static_cast<unsigned>(
        std::max<int64_t>(1, std::min(tiles, ResidentBlocks(device, kernel, 256, 0))));
  };
  if (TakesGradient<F>::value || TransformsPacks<F>::value || WideTilesFit(x, *y, *y_t)) {
    const int64_t tiles = (rows / kWideTileRows) * (cols / kWideTileCols);
    auto kernel = QuantizeTransposeWideKernel<In, Out, F, kColumnSums>;
    kernel<<<grid(kernel, tiles), 256, 0, stream>>>(xs, dys, ys, yts, scale, amax, scale_inv,
                                                     column_partial, rows, cols, kept_scale,
                                                     kept_amax, f);
    return;
  }
  if constexpr (!TakesGradient<F>::value && !TransformsPacks<F>::value) {
    auto kernel = QuantizeTransposeKernel<In, Out, F>;
    kernel<<<grid(kernel, ((cols + 63) / 64) * ((rows + 63) / 64)), 256, 0, stream>>>(
        xs, ys, yts, scale, amax, scale_inv, column_partial, rows, cols, kept_scale, kept_amax,
        f);
  }
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_CAST_TRANSPOSE_CUH_
