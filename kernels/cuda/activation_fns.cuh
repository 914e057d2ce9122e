// The activations as functors, Value(x) and Derivative(x), with the formulas
// of kernels/ops.h and the CPU reference: activation.cu's kernels take them
// as template parameters, so the compiler sees each formula whole.
#ifndef TE_KERNELS_CUDA_ACTIVATION_FNS_CUH_
#define TE_KERNELS_CUDA_ACTIVATION_FNS_CUH_

#include "kernels/cuda/common.cuh"
#include "kernels/ops.h"

namespace te {
namespace cuda {

constexpr float kQuickGeluAlpha = 1.702f;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- the activations as functors: Value(x) and Derivative(x) ----------------------

struct GeluFn {
  __device__ __forceinline__ float Value(float x) const { return GeluTanh(x); }
  __device__ __forceinline__ float Derivative(float x) const { return GeluTanhDerivative(x); }
};
struct SiluFn {
  __device__ __forceinline__ float Value(float x) const { return x * Sigmoid(x); }
  __device__ __forceinline__ float Derivative(float x) const {
    const float s = Sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
  }
};
struct ReluFn {
  __device__ __forceinline__ float Value(float x) const { return x > 0.0f ? x : 0.0f; }
  __device__ __forceinline__ float Derivative(float x) const { return x > 0.0f ? 1.0f : 0.0f; }
};
struct QuickGeluFn {
  __device__ __forceinline__ float Value(float x) const { return x * Sigmoid(kQuickGeluAlpha * x); }
  __device__ __forceinline__ float Derivative(float x) const {
    const float s = Sigmoid(kQuickGeluAlpha * x);
    return s + kQuickGeluAlpha * x * s * (1.0f - s);
  }
};
struct SquaredReluFn {
  __device__ __forceinline__ float Value(float x) const { return x > 0.0f ? x * x : 0.0f; }
  __device__ __forceinline__ float Derivative(float x) const { return x > 0.0f ? 2.0f * x : 0.0f; }
};
struct LinearFn {
  __device__ __forceinline__ float Value(float x) const { return x; }
  __device__ __forceinline__ float Derivative(float) const { return 1.0f; }
};

// GELU where the result becomes FP8 codes (the codes kernels' ValueOf and
// GradientOf): the tanh form as x * sigmoid(2u), since 0.5 (1 + tanh(u)) =
// sigmoid(2u), with the special-function unit's exp2 and reciprocal. Its
// error (a few float32 ulp, and 1.17 |2u| ulp more from __expf's argument)
// is far inside a code's rounding (2^-4 of its value at best), and it takes
// a third of tanhf's instructions, which those kernels spend per element
// beside their transposes. GeluFn stays wherever the output is float32 or
// bf16: with this form there, a float32 layer drifted past its 1e-4 bound
// from the CPU reference.
struct GeluForCodesFn {
  __device__ __forceinline__ float Value(float x) const { return x * Gate(x); }
  // d/dx x sigmoid(2u) = sigmoid(2u) + 2 x sigmoid(2u) (1 - sigmoid(2u)) u'.
  __device__ __forceinline__ float Derivative(float x) const {
    const float gate = Gate(x);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
    return gate + 2.0f * x * gate * (1.0f - gate) * du;
  }
  // sigmoid(2u), u = sqrt(2 / pi) (x + 0.044715 x^3); __fdividef gives 0 for
  // denominators past 2^126 (x << 0), GELU's limit.
  static __device__ __forceinline__ float Gate(float x) {
    const float two_u = 2.0f * kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    return __fdividef(1.0f, 1.0f + __expf(-two_u));
  }
};

// The functor a kernel writing FP8 codes takes for `act`: GELU's form for
// codes, every other activation as it is.
template <typename A>
A ForCodes(A act) {
  return act;
}
inline GeluForCodesFn ForCodes(GeluFn) { return {}; }

// f(x) = act.Value(x): an activation where a kernel takes a plain function.
template <typename A>
struct ValueOf {
  A act;
  __device__ __forceinline__ float operator()(float x) const { return act.Value(x); }
};

// f(x, dy) = dy * act'(x) rounded to In's dtype: the value ActivationBackward
// writes into a dx of x's dtype (the same expression), where a kernel
// quantizes it instead of writing it (cast_transpose.cuh's TakesGradient).
template <typename In, typename A>
struct GradientOf {
  static constexpr bool kTakesGradient = true;
  A act;
  __device__ __forceinline__ float operator()(float x, float dy) const {
    return In::Load(In::Store(dy * act.Derivative(x)));
  }
};

template <typename F>
void WithActivation(Activation act, F&& f) {
  switch (act) {
    case Activation::kGelu: f(GeluFn{}); return;
    case Activation::kSilu: f(SiluFn{}); return;
    case Activation::kRelu: f(ReluFn{}); return;
    case Activation::kQuickGelu: f(QuickGeluFn{}); return;
    case Activation::kSquaredRelu: f(SquaredReluFn{}); return;
    case Activation::kLinear: f(LinearFn{}); return;
  }
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ACTIVATION_FNS_CUH_
