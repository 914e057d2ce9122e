// Shared by the CPU op tests: tolerances, random inputs, tensor building and
// the relative-error measure ||out - ref|| / ||ref||.
#ifndef TE_KERNELS_CPU_TEST_UTIL_H_
#define TE_KERNELS_CPU_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/fp8.h"

namespace te {
namespace testing {

// Relative error bounds, one per output dtype: a float64 reference rounded
// once to the dtype is within half an ulp (bf16 2^-9, f16 2^-11, E4M3 2^-4,
// E5M2 2^-3), and float32 arithmetic adds a little on top.
constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;
constexpr double kF16Tolerance = 1e-3;
constexpr double kE4M3Tolerance = 0.0625;  // 2^-4
constexpr double kE5M2Tolerance = 0.125;   // 2^-3

inline double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return kBf16Tolerance;
    case DType::kF16: return kF16Tolerance;
    case DType::kE4M3: return kE4M3Tolerance;
    case DType::kE5M2: return kE5M2Tolerance;
    default: return kF32Tolerance;
  }
}

// Uniform in [lo, hi), never all zeros, reproducible from `seed`.
inline std::vector<float> RandomValues(int64_t n, uint32_t seed, float lo = -2.0f,
                                       float hi = 2.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

// A tensor of `dtype` holding `values` rounded to it.
inline Tensor MakeTensor(Ops& ops, DType dtype, const Shape& shape,
                         const std::vector<float>& values) {
  auto t = ops.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  FromFloatVector(values, &*t);
  return *t;
}

inline Tensor MakeRandom(Ops& ops, DType dtype, const Shape& shape, uint32_t seed,
                         float lo = -2.0f, float hi = 2.0f) {
  return MakeTensor(ops, dtype, shape, RandomValues(NumElements(shape), seed, lo, hi));
}

inline Tensor MakeEmpty(Ops& ops, DType dtype, const Shape& shape) {
  auto t = ops.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  return *t;
}

inline Tensor Scalar(Ops& ops, float value) {
  return MakeTensor(ops, DType::kF32, {1}, {value});
}

inline float ScalarValue(const Tensor& t) { return LoadAsFloat(t, 0); }

// The tensor's values (as stored, so a reference reads exactly what the op reads).
inline std::vector<double> ToDoubles(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = LoadAsFloat(t, i);
  return v;
}

inline double RelativeError(const std::vector<double>& out, const std::vector<double>& ref) {
  EXPECT_EQ(out.size(), ref.size());
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size() && i < ref.size(); ++i) {
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
}

inline double RelativeError(const Tensor& out, const std::vector<double>& ref) {
  return RelativeError(ToDoubles(out), ref);
}

// GELU's tanh form, x / (1 + e^-2u) with u = sqrt(2 / pi) (x + 0.044715 x^3),
// and its derivative, in double: the reference both backends' float32 GELU is
// judged against, its negative tail included.
inline double GeluTanhLogistic(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 1.0 / (1.0 + std::exp(-2.0 * u));
}
inline double GeluTanhReference(double x) { return x * GeluTanhLogistic(x); }
inline double GeluTanhDerivativeReference(double x) {
  const double s = GeluTanhLogistic(x);
  return s + 2.0 * x * s * (1.0 - s) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * x * x);
}

inline const char* ShortName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kI32: return "i32";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

}  // namespace testing

// Readable GoogleTest parameter names ("bfloat16", not "2-byte object").
inline void PrintTo(DType dtype, std::ostream* os) { *os << DTypeName(dtype); }

}  // namespace te

#endif  // TE_KERNELS_CPU_TEST_UTIL_H_
