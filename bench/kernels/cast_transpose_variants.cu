#include "bench/kernels/cast_transpose_variants.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/activation_fns.cuh"
#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/common.cuh"

namespace te::bench {
namespace {

using cuda::AbsBits;
using cuda::AmaxOut;
using cuda::BF16;
using cuda::ByteTile;
using cuda::E4M3;
using cuda::Pack;

constexpr int kThreads = 256;

// The product's tile loop (64 x 64 tiles, 16 x 16 threads, 4 elements a
// thread a row), with tile t + gridDim.x's loads issued between the barrier
// and the transposed stores of tile t.
__global__ void __launch_bounds__(kThreads)
    PrefetchKernel(const uint16_t* __restrict__ x, uint8_t* __restrict__ y,
                   uint8_t* __restrict__ y_t, const float* scale, AmaxOut amax, float* scale_inv,
                   int64_t rows, int64_t cols) {
  using InPack = Pack<uint16_t, 4>;
  __shared__ ByteTile tile;
  __shared__ unsigned scratch[32];
  const float s = *scale;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t col_tiles = cols / 64;
  const int64_t tiles = col_tiles * (rows / 64);
  unsigned local = 0;
  InPack next[4];
  auto load = [&](int64_t t) {
    const int64_t row0 = t / col_tiles * 64, col0 = t % col_tiles * 64;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      next[i] = *reinterpret_cast<const InPack*>(x + (row0 + ty + 16 * i) * cols + col0 + tx * 4);
    }
  };
  if (blockIdx.x < tiles) load(blockIdx.x);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row0 = t / col_tiles * 64, col0 = t % col_tiles * 64;
    InPack cur[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) cur[i] = next[i];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 16 * i;
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = BF16::Load(cur[i].v[j]);
        local = max(local, AbsBits(v));
        const uint8_t code = E4M3::Store(v * s);
        tile[r][tx * 4 + j] = code;
        word |= static_cast<uint32_t>(code) << (8 * j);
      }
      *reinterpret_cast<uint32_t*>(y + (row0 + r) * cols + col0 + tx * 4) = word;
    }
    __syncthreads();
    if (t + gridDim.x < tiles) load(t + gridDim.x);
    cuda::StoreTileTransposed(tile, y_t, rows, cols, row0, col0, tx, ty);
    __syncthreads();
  }
  cuda::FinishQuantization(local, scratch, amax, s, scale_inv, nullptr, nullptr);
}

// The wide kernel (128 x 64 tiles) as the product ran it before column
// words: thread (lx, ly) takes rows ly, ly + 32, ly + 64 and ly + 96, each
// code a byte store to shared memory and a conversion. F as the product's
// (GradientOf reads dy).
template <typename Out, typename F>
__global__ void __launch_bounds__(kThreads)
    WideBytesKernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy,
                    uint8_t* __restrict__ y, uint8_t* __restrict__ y_t, const float* scale,
                    AmaxOut amax, float* scale_inv, int64_t rows, int64_t cols, F f = F()) {
  using InPack = Pack<uint16_t, 8>;
  constexpr int kRows = cuda::kWideTileRows, kCols = cuda::kWideTileCols, kPitch = kRows + 4;
  __shared__ __align__(16) uint8_t codes[kCols][kPitch];
  __shared__ unsigned scratch[32];
  const float s = *scale;
  const int lx = threadIdx.x % 8, ly = threadIdx.x / 8;
  const int64_t col_tiles = cols / kCols;
  const int64_t tiles = col_tiles * (rows / kRows);
  unsigned local = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row0 = t / col_tiles * kRows, col0 = t % col_tiles * kCols;
    InPack in[4], grad[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (row0 + ly + 32 * i) * cols + col0 + lx * 8;
      in[i] = *reinterpret_cast<const InPack*>(x + at);
      if constexpr (cuda::TakesGradient<F>::value) {
        grad[i] = *reinterpret_cast<const InPack*>(dy + at);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ly + 32 * i;
      uint32_t word[2] = {0, 0};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = cuda::TileValue<BF16>(f, in[i], grad[i], j);
        local = max(local, AbsBits(v));
        const uint8_t code = Out::Store(v * s);
        codes[lx * 8 + j][r] = code;
        word[j / 4] |= static_cast<uint32_t>(code) << (8 * (j % 4));
      }
      *reinterpret_cast<uint2*>(y + (row0 + r) * cols + col0 + lx * 8) =
          make_uint2(word[0], word[1]);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int c = ly + 32 * k;
      const uint32_t* src = reinterpret_cast<const uint32_t*>(&codes[c][lx * 16]);
      *reinterpret_cast<uint4*>(y_t + (col0 + c) * rows + row0 + lx * 16) =
          make_uint4(src[0], src[1], src[2], src[3]);
    }
    __syncthreads();
  }
  cuda::FinishQuantization(local, scratch, amax, s, scale_inv, nullptr, nullptr);
}

template <typename Out, typename F>
void LaunchWideBytes(cuda::CudaOps& ops, const uint16_t* x, const uint16_t* dy, uint8_t* y,
                     uint8_t* y_t, const float* scale, AmaxOut amax, float* scale_inv,
                     int64_t rows, int64_t cols) {
  auto kernel = WideBytesKernel<Out, F>;
  const int64_t tiles = (rows / cuda::kWideTileRows) * (cols / cuda::kWideTileCols);
  const int64_t grid = std::min(tiles, cuda::ResidentBlocks(ops.context(), kernel, kThreads, 0));
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, ops.stream()>>>(x, dy, y, y_t, scale, amax,
                                                                     scale_inv, rows, cols, F());
}

absl::Status LaunchStatus(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace

const char* VariantName(CastTransposeVariant variant) {
  switch (variant) {
    case CastTransposeVariant::kGeneralTilePerBlock: return "64x64 kernel, a tile a block";
    case CastTransposeVariant::kGeneralEightPerSm: return "64x64 kernel, 8 blocks an SM";
    case CastTransposeVariant::kGeneralResident: return "64x64 kernel, blocks that fit";
    case CastTransposeVariant::kPrefetch: return "64x64 prefetch: next tile's loads in flight";
    case CastTransposeVariant::kWideBytes: return "wide, byte stores (before column words)";
  }
  return "?";
}

bool VariantFits(CastTransposeVariant variant, int64_t rows, int64_t cols) {
  switch (variant) {
    case CastTransposeVariant::kGeneralTilePerBlock:
    case CastTransposeVariant::kGeneralEightPerSm:
    case CastTransposeVariant::kGeneralResident: return rows % 4 == 0 && cols % 4 == 0;
    case CastTransposeVariant::kPrefetch: return rows % 64 == 0 && cols % 64 == 0;
    case CastTransposeVariant::kWideBytes:
      return rows % cuda::kWideTileRows == 0 && cols % cuda::kWideTileCols == 0;
  }
  return false;
}

absl::Status LaunchCastTransposeVariant(CastTransposeVariant variant, cuda::CudaOps& ops,
                                        const Tensor& x, const Fp8Output& fp8,
                                        cuda::GridFoldSlot* slot, Tensor* y, Tensor* y_t) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  if (x.dtype() != DType::kBF16 || y->dtype() != DType::kE4M3 || y_t->dtype() != DType::kE4M3 ||
      !VariantFits(variant, rows, cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat(VariantName(variant), ": takes bf16 -> E4M3 in whole tiles"));
  }
  const auto* xs = static_cast<const uint16_t*>(x.data());
  auto* ys = static_cast<uint8_t*>(y->data());
  auto* yts = static_cast<uint8_t*>(y_t->data());
  const float* scale = fp8.scale.data_as<const float>();
  float* scale_inv = fp8.scale_inv.data_as<float>();
  const AmaxOut amax{fp8.amax.data_as<float>(), slot};
  const int64_t sms = ops.sm_count();
  cudaStream_t stream = ops.stream();
  switch (variant) {
    case CastTransposeVariant::kGeneralTilePerBlock:
    case CastTransposeVariant::kGeneralEightPerSm:
    case CastTransposeVariant::kGeneralResident: {
      auto kernel = cuda::QuantizeTransposeKernel<BF16, E4M3>;
      const int64_t tiles = ((rows + 63) / 64) * ((cols + 63) / 64);
      const int64_t grid =
          variant == CastTransposeVariant::kGeneralTilePerBlock ? tiles
          : variant == CastTransposeVariant::kGeneralEightPerSm
              ? std::min(tiles, 8 * sms)
              : std::min(tiles, cuda::ResidentBlocks(ops.context(), kernel, kThreads, 0));
      kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
          xs, ys, yts, scale, amax, scale_inv, nullptr, rows, cols, nullptr, nullptr,
          cuda::IdentityFn{});
      break;
    }
    case CastTransposeVariant::kPrefetch: {
      const int64_t tiles = (rows / 64) * (cols / 64);
      const int64_t grid =
          std::min(tiles, cuda::ResidentBlocks(ops.context(), PrefetchKernel, kThreads, 0));
      PrefetchKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
          xs, ys, yts, scale, amax, scale_inv, rows, cols);
      break;
    }
    case CastTransposeVariant::kWideBytes:
      LaunchWideBytes<E4M3, cuda::IdentityFn>(ops, xs, nullptr, ys, yts, scale, amax, scale_inv,
                                              rows, cols);
      break;
  }
  return LaunchStatus(VariantName(variant));
}

const char* GeluGradKernelName(GeluGradKernel kernel) {
  switch (kernel) {
    case GeluGradKernel::kWide: return "product kernel";
    case GeluGradKernel::kWideBytes: return VariantName(CastTransposeVariant::kWideBytes);
  }
  return "?";
}

absl::Status LaunchGeluGradCastTranspose(GeluGradKernel kernel, cuda::CudaOps& ops, const Tensor& x,
                                         const Tensor& dy, const Fp8Output& fp8,
                                         cuda::GridFoldSlot* slot, Tensor* y, Tensor* y_t) {
  const int64_t rows = x.dim(0), cols = x.dim(1);
  if (x.dtype() != DType::kBF16 || dy.dtype() != DType::kBF16 || dy.shape() != x.shape() ||
      y->dtype() != DType::kE5M2 || y_t->dtype() != DType::kE5M2 ||
      rows % cuda::kWideTileRows != 0 || cols % cuda::kWideTileCols != 0) {
    return absl::InvalidArgumentError("GELU grad cast-transpose: bf16 x, dy -> E5M2, whole tiles");
  }
  using Grad = cuda::GradientOf<BF16, cuda::GeluForCodesFn>;
  const float* scale = fp8.scale.data_as<const float>();
  float* scale_inv = fp8.scale_inv.data_as<float>();
  const AmaxOut amax{fp8.amax.data_as<float>(), slot};
  const auto* xs = static_cast<const uint16_t*>(x.data());
  const auto* dys = static_cast<const uint16_t*>(dy.data());
  auto* ys = static_cast<uint8_t*>(y->data());
  auto* yts = static_cast<uint8_t*>(y_t->data());
  switch (kernel) {
    case GeluGradKernel::kWide:
      cuda::LaunchCastTranspose<BF16, cuda::E5M2, false>(ops.context(), ops.stream(), x, y, y_t,
                                                        scale, amax, scale_inv, nullptr, nullptr,
                                                        nullptr, Grad{}, &dy);
      break;
    case GeluGradKernel::kWideBytes:
      LaunchWideBytes<cuda::E5M2, Grad>(ops, xs, dys, ys, yts, scale, amax, scale_inv, rows, cols);
      break;
  }
  return LaunchStatus(GeluGradKernelName(kernel));
}

}  // namespace te::bench
