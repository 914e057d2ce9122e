#include "bench/kernels/cast_transpose_variants.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/common.cuh"

namespace te::bench {
namespace {

using cuda::AbsBits;
using cuda::AmaxOut;
using cuda::BF16;
using cuda::BlockMaxBits;
using cuda::ByteTile;
using cuda::E4M3;
using cuda::FoldAmax;
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
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) {
    FoldAmax(amax, local);
    if (blockIdx.x == 0) *scale_inv = 1.0f / s;
  }
}

}  // namespace

const char* VariantName(CastTransposeVariant variant) {
  switch (variant) {
    case CastTransposeVariant::kGeneralTilePerBlock: return "64x64 kernel, a tile a block";
    case CastTransposeVariant::kGeneralEightPerSm: return "64x64 kernel, 8 blocks an SM";
    case CastTransposeVariant::kGeneralResident: return "64x64 kernel, blocks that fit";
    case CastTransposeVariant::kPrefetch: return "64x64 prefetch: next tile's loads in flight";
  }
  return "?";
}

bool VariantFits(CastTransposeVariant variant, int64_t rows, int64_t cols) {
  switch (variant) {
    case CastTransposeVariant::kGeneralTilePerBlock:
    case CastTransposeVariant::kGeneralEightPerSm:
    case CastTransposeVariant::kGeneralResident: return rows % 4 == 0 && cols % 4 == 0;
    case CastTransposeVariant::kPrefetch: return rows % 64 == 0 && cols % 64 == 0;
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
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat(VariantName(variant), ": launch failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace te::bench
