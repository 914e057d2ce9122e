// The activation's backward that hands an FP8 Dense backward its output
// gradient: dx = dy * act'(x) in float32, quantized straight into both FP8
// layouts with its amax and column sums (TE's dact-cast-transpose-dbias).
// One pass reads dy and x (2 + 2 bytes an element in bf16) and writes the
// two FP8 layouts (1 + 1), where ActivationBackward then
// QuantizeTransposeDbias also write dx in bf16 and read it back: 6 bytes an
// element against 10, and the bf16 dx (the MLP backward's largest tensor)
// is never allocated.
#include "kernels/cuda/activation_fns.cuh"
#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// f(dy, x) = dy * act'(x): ActivationBackward's float expression.
template <typename A>
struct GradientOf {
  A act;
  __device__ __forceinline__ float operator()(float dy, float x) const {
    return dy * act.Derivative(x);
  }
};

}  // namespace

absl::Status CudaOps::ActivationBackwardQuantizeTranspose(const std::vector<Activation>& acts,
                                                          const Tensor& dy, const Tensor& x,
                                                          const Fp8Output& fp8, Tensor* y,
                                                          Tensor* y_t, Tensor* dbias) {
  RETURN_IF_ERROR(CheckActivationBackwardQuantizeTransposeArgs(acts, dy, x, fp8, y, y_t, dbias));
  // A gated pair (dy narrower than x) and shapes or alignments the tile kernel
  // cannot take: the reference's ActivationBackward, then the cast-transpose.
  if (acts.size() != 1 || !TileKernelFits(dy, *y, *y_t) ||
      reinterpret_cast<uintptr_t>(x.data()) % (4 * DTypeSize(x.dtype())) != 0) {
    return Ops::ActivationBackwardQuantizeTranspose(acts, dy, x, fp8, y, y_t, dbias);
  }
  RETURN_IF_ERROR(Enter());
  const int64_t rows = x.dim(0), cols = x.dim(1);
  // One partial row of column sums per 64-row tile, as QuantizeTransposeDbias.
  const int64_t row_tiles = (rows + 63) / 64;
  Tensor partial;
  if (dbias != nullptr) {
    ASSIGN_OR_RETURN(partial, Allocate(DType::kF32, {row_tiles, cols}));
  }
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fp8.amax.data(), 0, sizeof(float), stream()));
  const dim3 grid(static_cast<unsigned>((cols + 63) / 64), static_cast<unsigned>(row_tiles));
  DispatchFloat(dy.dtype(), [&](auto d) {
    DispatchFloat(x.dtype(), [&](auto in) {
      DispatchFp8(y->dtype(), [&](auto out) {
        using D = decltype(d);
        using In = decltype(in);
        using Out = decltype(out);
        WithActivation(acts[0], [&](auto act) {
          using F = GradientOf<decltype(act)>;
          QuantizeTransposeKernel<D, Out, F, In><<<grid, 256, 0, stream()>>>(
              static_cast<const typename D::Storage*>(dy.data()),
              static_cast<uint8_t*>(y->data()), static_cast<uint8_t*>(y_t->data()),
              fp8.scale.data_as<const float>(), fp8.amax.data_as<float>(),
              fp8.scale_inv.data_as<float>(),
              dbias != nullptr ? partial.data_as<float>() : nullptr, rows, cols, nullptr, F{act},
              static_cast<const typename In::Storage*>(x.data()));
        });
      });
    });
  });
  if (dbias != nullptr) {
    LaunchPartialColumnSums(partial.data_as<const float>(), row_tiles, cols, dbias->dtype(),
                            dbias->data(), stream());
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
