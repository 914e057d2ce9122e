// Inverted dropout. Element i is kept iff DropoutUniform(seed, i) >= rate
// (kernels/rng.h, the same function the CPU runs), so masks agree bit for bit
// across backends; kept elements are scaled by 1 / (1 - rate).
#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// mask may be null (no backward needed). kVec elements at a time where
// aligned (`vec`), then the tail.
template <typename In, typename Out>
__global__ void DropoutForwardKernel(const typename In::Storage* x, typename Out::Storage* y,
                                     uint8_t* mask, float rate, float kept_scale, uint64_t seed,
                                     int64_t n, bool vec) {
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  using MaskPack = Pack<uint8_t>;
  // Element i of y, and whether it was kept.
  auto drop = [&](float v, int64_t i, uint8_t* kept_out) {
    const bool kept = DropoutUniform(seed, static_cast<uint64_t>(i)) >= rate;
    *kept_out = kept ? 1 : 0;
    return Out::Store(kept ? v * kept_scale : 0.0f);
  };
  ForEachPackThenElement(
      n, vec,
      [&](int64_t k) {
        const InPack a = reinterpret_cast<const InPack*>(x)[k];
        OutPack o;
        MaskPack m;
#pragma unroll
        for (int j = 0; j < kVec; ++j) o.v[j] = drop(In::Load(a.v[j]), k * kVec + j, &m.v[j]);
        reinterpret_cast<OutPack*>(y)[k] = o;
        if (mask != nullptr) reinterpret_cast<MaskPack*>(mask)[k] = m;
      },
      [&](int64_t i) {
        uint8_t kept;
        y[i] = drop(In::Load(x[i]), i, &kept);
        if (mask != nullptr) mask[i] = kept;
      });
}

template <typename In, typename Out>
__global__ void DropoutBackwardKernel(const typename In::Storage* dy, const uint8_t* mask,
                                      typename Out::Storage* dx, float kept_scale, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dx[i] = Out::Store(mask[i] ? In::Load(dy[i]) * kept_scale : 0.0f);
  }
}

// rate 1 drops everything: kept elements (none) would need an infinite scale.
float KeptScale(float rate) { return rate >= 1.0f ? 0.0f : 1.0f / (1.0f - rate); }

}  // namespace

absl::Status CudaOps::DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                                     Tensor* mask) {
  RETURN_IF_ERROR(CheckDropoutForwardArgs(rate, x, y, mask));
  const bool want_mask = Wanted(mask);
  const int64_t n = x.numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const bool mask_aligned = !want_mask || PackAligned<uint8_t>(mask->data());
  DispatchFloatPair(x.dtype(), y->dtype(), [&](auto in, auto out) {
    using In = decltype(in);
    using Out = decltype(out);
    const bool vec = PackAligned<In, Out>(x, *y) && mask_aligned;
    DropoutForwardKernel<In, Out><<<GridFor(vec ? n / kVec : n), kThreads, 0, stream()>>>(
        static_cast<const typename In::Storage*>(x.data()),
        static_cast<typename Out::Storage*>(y->data()),
        want_mask ? mask->data_as<uint8_t>() : nullptr, rate, KeptScale(rate), seed, n, vec);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                                      Tensor* dx) {
  RETURN_IF_ERROR(CheckDropoutBackwardArgs(rate, dy, mask, dx));
  const int64_t n = dy.numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  DispatchFloatPair(dy.dtype(), dx->dtype(), [&](auto in, auto out) {
    using In = decltype(in);
    using Out = decltype(out);
    DropoutBackwardKernel<In, Out><<<GridFor(n), kThreads, 0, stream()>>>(
        static_cast<const typename In::Storage*>(dy.data()), mask.data_as<const uint8_t>(),
        static_cast<typename Out::Storage*>(dx->data()), KeptScale(rate), n);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
