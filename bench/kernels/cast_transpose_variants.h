// Candidate layouts of the FP8 cast-transpose (bf16 x -> E4M3 y and y^T, the
// amax folded, scale_inv written), for cast_transpose_bench to time against
// the product's kernel (kernels/cuda/cast_transpose.cuh) in one process. A
// candidate that wins there, and writes the same bytes, replaces the
// product's; the others stay here as the record of what was tried.
#ifndef TE_BENCH_KERNELS_CAST_TRANSPOSE_VARIANTS_H_
#define TE_BENCH_KERNELS_CAST_TRANSPOSE_VARIANTS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"

namespace te::bench {

enum class CastTransposeVariant {
  // The product's general 64 x 64 QuantizeTransposeKernel (the op's kernel
  // for every shape until the wide kernel took whole 128 x 64 tiles) on the
  // grids it has had: a tile a block (before b48762b), eight blocks an SM
  // (b48762b to d72f792), and the blocks that fit (d72f792 on).
  kGeneralTilePerBlock,
  kGeneralEightPerSm,
  kGeneralResident,
  // The 64 x 64 loop, with the next tile's loads issued before the current
  // tile leaves transposed (in flight while it does).
  kPrefetch,
  // The wide kernel (128 x 64 tiles) before 4-row column words and paired
  // conversions: a byte store to shared memory and a conversion a code.
  kWideBytes,
};
inline constexpr CastTransposeVariant kCastTransposeVariants[] = {
    CastTransposeVariant::kGeneralTilePerBlock, CastTransposeVariant::kGeneralEightPerSm,
    CastTransposeVariant::kGeneralResident, CastTransposeVariant::kPrefetch,
    CastTransposeVariant::kWideBytes};
const char* VariantName(CastTransposeVariant variant);

// Whether `variant` takes x [rows, cols] (the candidates handle whole tiles only).
bool VariantFits(CastTransposeVariant variant, int64_t rows, int64_t cols);

// One launch on `ops`' stream: x bf16 [rows, cols] -> y E4M3 [rows, cols],
// y_t [cols, rows], fp8.amax = max |x| (through `slot`, a zeroed
// cuda::GridFoldSlot of the caller's), fp8.scale_inv = 1 / fp8.scale.
absl::Status LaunchCastTransposeVariant(CastTransposeVariant variant, cuda::CudaOps& ops,
                                        const Tensor& x, const Fp8Output& fp8,
                                        cuda::GridFoldSlot* slot, Tensor* y, Tensor* y_t);

// GELU's gradient (GradientOf<BF16, GeluForCodesFn>: x the pre-activation,
// dy the gradient of GELU's output) quantized to E5M2 in both layouts, as the
// FP8 MLP's backward makes it: the product's launcher (kWide), or the kernel
// of kWideBytes on the same function.
enum class GeluGradKernel { kWide, kWideBytes };
const char* GeluGradKernelName(GeluGradKernel kernel);
absl::Status LaunchGeluGradCastTranspose(GeluGradKernel kernel, cuda::CudaOps& ops, const Tensor& x,
                                         const Tensor& dy, const Fp8Output& fp8,
                                         cuda::GridFoldSlot* slot, Tensor* y, Tensor* y_t);

}  // namespace te::bench

#endif  // TE_BENCH_KERNELS_CAST_TRANSPOSE_VARIANTS_H_
