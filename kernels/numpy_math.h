// The scalar math of Ops::Binary / Unary and their backward (ops.h), one
// definition for the CPU reference and the CUDA kernels so both compute the
// same float32 expression for each element.
#ifndef TE_KERNELS_NUMPY_MATH_H_
#define TE_KERNELS_NUMPY_MATH_H_

#include <cmath>

#include "kernels/ops.h"
#include "kernels/rng.h"  // TE_HOST_DEVICE

namespace te::numpy_math {

TE_HOST_DEVICE inline bool IsNan(float v) { return v != v; }

// Comparisons give 1 or 0 (stored as bool).
TE_HOST_DEVICE inline float BinaryValue(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::kAdd: return a + b;
    case BinaryOp::kSubtract: return a - b;
    case BinaryOp::kMultiply: return a * b;
    case BinaryOp::kDivide: return a / b;
    case BinaryOp::kMaximum: return IsNan(a) || IsNan(b) ? a + b : (a >= b ? a : b);
    case BinaryOp::kMinimum: return IsNan(a) || IsNan(b) ? a + b : (a <= b ? a : b);
    case BinaryOp::kPower: return powf(a, b);
    case BinaryOp::kGreater: return a > b ? 1.0f : 0.0f;
    case BinaryOp::kGreaterEqual: return a >= b ? 1.0f : 0.0f;
    case BinaryOp::kLess: return a < b ? 1.0f : 0.0f;
    case BinaryOp::kLessEqual: return a <= b ? 1.0f : 0.0f;
    case BinaryOp::kEqual: return a == b ? 1.0f : 0.0f;
    case BinaryOp::kNotEqual: return a != b ? 1.0f : 0.0f;
  }
  return 0.0f;
}

// d op / d a and d op / d b at (a, b), as ops.h's BinaryBackward states.
// maximum and minimum follow jax.lax.max / min: the chosen operand gets the
// gradient, a tie gives each half, and a NaN operand (the output NaN) gives
// neither any.
TE_HOST_DEVICE inline float BinaryGradA(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::kAdd:
    case BinaryOp::kSubtract: return 1.0f;
    case BinaryOp::kMultiply: return b;
    case BinaryOp::kDivide: return 1.0f / b;
    case BinaryOp::kMaximum: return a > b ? 1.0f : (a == b ? 0.5f : 0.0f);
    case BinaryOp::kMinimum: return a < b ? 1.0f : (a == b ? 0.5f : 0.0f);
    case BinaryOp::kPower: return b == 0.0f ? 0.0f : b * powf(a, b - 1.0f);
    case BinaryOp::kGreater:
    case BinaryOp::kGreaterEqual:
    case BinaryOp::kLess:
    case BinaryOp::kLessEqual:
    case BinaryOp::kEqual:
    case BinaryOp::kNotEqual: return 0.0f;  // comparisons carry no gradient
  }
  return 0.0f;
}
TE_HOST_DEVICE inline float BinaryGradB(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::kAdd: return 1.0f;
    case BinaryOp::kSubtract: return -1.0f;
    case BinaryOp::kMultiply: return a;
    case BinaryOp::kDivide: return -a / (b * b);
    case BinaryOp::kMaximum: return b > a ? 1.0f : (a == b ? 0.5f : 0.0f);
    case BinaryOp::kMinimum: return b < a ? 1.0f : (a == b ? 0.5f : 0.0f);
    case BinaryOp::kPower: return a == 0.0f ? 0.0f : logf(a) * powf(a, b);
    case BinaryOp::kGreater:
    case BinaryOp::kGreaterEqual:
    case BinaryOp::kLess:
    case BinaryOp::kLessEqual:
    case BinaryOp::kEqual:
    case BinaryOp::kNotEqual: return 0.0f;  // comparisons carry no gradient
  }
  return 0.0f;
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

TE_HOST_DEVICE inline float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

TE_HOST_DEVICE inline float UnaryValue(UnaryOp op, float x) {
  switch (op) {
    case UnaryOp::kNegative: return -x;
    case UnaryOp::kExp: return expf(x);
    case UnaryOp::kLog: return logf(x);
    case UnaryOp::kTanh: return tanhf(x);
    case UnaryOp::kSqrt: return sqrtf(x);
    case UnaryOp::kRsqrt: return 1.0f / sqrtf(x);
    case UnaryOp::kAbs: return fabsf(x);
    case UnaryOp::kSquare: return x * x;
    case UnaryOp::kSigmoid: return Sigmoid(x);
    case UnaryOp::kRelu: return x > 0.0f ? x : (IsNan(x) ? x : 0.0f);
    case UnaryOp::kSilu: return x * Sigmoid(x);
    case UnaryOp::kGelu:
      return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
    case UnaryOp::kGeluExact: return 0.5f * x * (1.0f + erff(x * kInvSqrt2));
    case UnaryOp::kLogicalNot: return x != 0.0f ? 0.0f : 1.0f;
  }
  return 0.0f;
}

TE_HOST_DEVICE inline float UnaryDerivative(UnaryOp op, float x) {
  switch (op) {
    case UnaryOp::kNegative: return -1.0f;
    case UnaryOp::kExp: return expf(x);
    case UnaryOp::kLog: return 1.0f / x;
    case UnaryOp::kTanh: {
      const float t = tanhf(x);
      return 1.0f - t * t;
    }
    case UnaryOp::kSqrt: return 0.5f / sqrtf(x);
    case UnaryOp::kRsqrt: return -0.5f / (x * sqrtf(x));
    case UnaryOp::kAbs: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    case UnaryOp::kSquare: return 2.0f * x;
    case UnaryOp::kSigmoid: {
      const float s = Sigmoid(x);
      return s * (1.0f - s);
    }
    case UnaryOp::kRelu: return x > 0.0f ? 1.0f : 0.0f;
    case UnaryOp::kSilu: {
      const float s = Sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case UnaryOp::kGelu: {
      const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
      const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
      return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
    }
    case UnaryOp::kGeluExact:
      return 0.5f * (1.0f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
    case UnaryOp::kLogicalNot: return 0.0f;
  }
  return 0.0f;
}

}  // namespace te::numpy_math

#endif  // TE_KERNELS_NUMPY_MATH_H_
