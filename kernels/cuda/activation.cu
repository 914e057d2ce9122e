// Activations, forward (optionally fused with FP8 quantize + amax) and
// backward, plain and gated: for x = [x_0 | x_1] (each [N, I]),
// y = act_0(x_0) * act_1(x_1). Formulas as in kernels/ops.h and the CPU
// reference.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kQuickGeluAlpha = 1.702f;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float ActivationValue(Activation act, float x) {
  switch (act) {
    case Activation::kGelu: {
      const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
      return 0.5f * x * (1.0f + t);
    }
    case Activation::kSilu: return x * Sigmoid(x);
    case Activation::kRelu: return x > 0.0f ? x : 0.0f;
    case Activation::kQuickGelu: return x * Sigmoid(kQuickGeluAlpha * x);
    case Activation::kSquaredRelu: return x > 0.0f ? x * x : 0.0f;
    case Activation::kLinear: return x;
  }
  return x;
}

__device__ __forceinline__ float ActivationDerivative(Activation act, float x) {
  switch (act) {
    case Activation::kGelu: {
      const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
      const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
      return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
    }
    case Activation::kSilu: {
      const float s = Sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kRelu: return x > 0.0f ? 1.0f : 0.0f;
    case Activation::kQuickGelu: {
      const float s = Sigmoid(kQuickGeluAlpha * x);
      return s + kQuickGeluAlpha * x * s * (1.0f - s);
    }
    case Activation::kSquaredRelu: return x > 0.0f ? 2.0f * x : 0.0f;
    case Activation::kLinear: return 1.0f;
  }
  return 1.0f;
}

// x: [rows, gated ? 2 * width : width]; y: [rows, width]. FP8 y: scale, amax
// (zeroed before) and scale_inv non-null. `vec`: width % kVec == 0 and x, y
// aligned for Pack access; each thread then handles kVec outputs of one row.
template <typename In, typename Out>
__global__ void ActivationForwardKernel(const typename In::Storage* x, typename Out::Storage* y,
                                        Activation act0, Activation act1, bool gated,
                                        int64_t rows, int64_t width, bool vec, const float* scale,
                                        float* amax, float* scale_inv) {
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  __shared__ unsigned scratch[32];
  const float s = scale != nullptr ? *scale : 1.0f;
  const int64_t in_cols = gated ? 2 * width : width;
  const int64_t step = vec ? kVec : 1;
  const int64_t per_row = width / step;
  const int64_t n = rows * per_row;
  unsigned amax_bits = 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / per_row, c = (k - r * per_row) * step;
    const int64_t at = r * in_cols + c;
    if (vec) {
      const InPack a = *reinterpret_cast<const InPack*>(x + at);
      InPack b = a;
      if (gated) b = *reinterpret_cast<const InPack*>(x + at + width);
      OutPack o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float v = ActivationValue(act0, In::Load(a.v[j]));
        if (gated) v *= ActivationValue(act1, In::Load(b.v[j]));
        amax_bits = max(amax_bits, AbsBits(v));
        o.v[j] = Out::Store(v * s);
      }
      *reinterpret_cast<OutPack*>(y + r * width + c) = o;
    } else {
      float v = ActivationValue(act0, In::Load(x[at]));
      if (gated) v *= ActivationValue(act1, In::Load(x[at + width]));
      amax_bits = max(amax_bits, AbsBits(v));
      y[r * width + c] = Out::Store(v * s);
    }
  }
  if (amax != nullptr) {
    amax_bits = BlockMaxBits(amax_bits, scratch);
    if (threadIdx.x == 0) {
      AtomicMaxAbsBits(amax, amax_bits);
      if (blockIdx.x == 0) *scale_inv = 1.0f / s;
    }
  }
}

// Gated: dx_0 = dy * act_1(x_1) * act_0'(x_0), dx_1 = dy * act_0(x_0) * act_1'(x_1).
__device__ __forceinline__ void ActivationGrad(Activation act0, Activation act1, bool gated,
                                               float g, float x0, float x1, float* dx0,
                                               float* dx1) {
  if (!gated) {
    *dx0 = g * ActivationDerivative(act0, x0);
    return;
  }
  *dx0 = g * ActivationValue(act1, x1) * ActivationDerivative(act0, x0);
  *dx1 = g * ActivationValue(act0, x0) * ActivationDerivative(act1, x1);
}

template <typename In, typename D, typename Out>
__global__ void ActivationBackwardKernel(const typename D::Storage* dy,
                                         const typename In::Storage* x, typename Out::Storage* dx,
                                         Activation act0, Activation act1, bool gated,
                                         int64_t rows, int64_t width, bool vec) {
  using InPack = Pack<typename In::Storage>;
  using DPack = Pack<typename D::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  const int64_t in_cols = gated ? 2 * width : width;
  const int64_t step = vec ? kVec : 1;
  const int64_t per_row = width / step;
  const int64_t n = rows * per_row;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / per_row, c = (k - r * per_row) * step;
    const int64_t at = r * in_cols + c;
    if (vec) {
      const DPack g = *reinterpret_cast<const DPack*>(dy + r * width + c);
      const InPack a = *reinterpret_cast<const InPack*>(x + at);
      InPack b = a;
      if (gated) b = *reinterpret_cast<const InPack*>(x + at + width);
      OutPack o0, o1;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float d0 = 0.0f, d1 = 0.0f;
        ActivationGrad(act0, act1, gated, D::Load(g.v[j]), In::Load(a.v[j]), In::Load(b.v[j]),
                       &d0, &d1);
        o0.v[j] = Out::Store(d0);
        o1.v[j] = Out::Store(d1);
      }
      *reinterpret_cast<OutPack*>(dx + at) = o0;
      if (gated) *reinterpret_cast<OutPack*>(dx + at + width) = o1;
    } else {
      const float x0 = In::Load(x[at]);
      const float x1 = gated ? In::Load(x[at + width]) : 0.0f;
      float d0 = 0.0f, d1 = 0.0f;
      ActivationGrad(act0, act1, gated, D::Load(dy[r * width + c]), x0, x1, &d0, &d1);
      dx[at] = Out::Store(d0);
      if (gated) dx[at + width] = Out::Store(d1);
    }
  }
}

}  // namespace

absl::Status CudaOps::ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                        Tensor* y, const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardArgs(acts, x, y, fp8));
  const bool quantized = IsFloat8(y->dtype());
  const int64_t rows = Rows(x);
  const int64_t n = rows * width;
  if (n == 0 && !quantized) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  if (quantized) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fp8->amax.data(), 0, sizeof(float), stream()));
  }
  const bool gated = acts.size() == 2;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloatOrFp8(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const bool vec = width % kVec == 0 && PackAligned<typename In::Storage>(x.data()) &&
                       PackAligned<typename Out::Storage>(y->data());
      ActivationForwardKernel<In, Out><<<GridFor(vec ? n / kVec : n), kThreads, 0, stream()>>>(
          static_cast<const typename In::Storage*>(x.data()),
          static_cast<typename Out::Storage*>(y->data()), acts[0], gated ? acts[1] : acts[0],
          gated, rows, width, vec, quantized ? fp8->scale.data_as<const float>() : nullptr,
          quantized ? fp8->amax.data_as<float>() : nullptr,
          quantized ? fp8->scale_inv.data_as<float>() : nullptr);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                         const Tensor& x, Tensor* dx) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationBackwardArgs(acts, dy, x, dx));
  const int64_t rows = Rows(x);
  const int64_t n = rows * width;
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const bool gated = acts.size() == 2;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(dy.dtype(), [&](auto d) {
      DispatchFloat(dx->dtype(), [&](auto out) {
        using In = decltype(in);
        using D = decltype(d);
        using Out = decltype(out);
        const bool vec = width % kVec == 0 && PackAligned<typename D::Storage>(dy.data()) &&
                         PackAligned<typename In::Storage>(x.data()) &&
                         PackAligned<typename Out::Storage>(dx->data());
        ActivationBackwardKernel<In, D, Out>
            <<<GridFor(vec ? n / kVec : n), kThreads, 0, stream()>>>(
                static_cast<const typename D::Storage*>(dy.data()),
                static_cast<const typename In::Storage*>(x.data()),
                static_cast<typename Out::Storage*>(dx->data()), acts[0],
                gated ? acts[1] : acts[0], gated, rows, width, vec);
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
