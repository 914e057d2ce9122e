// Activations, single and gated pairs, forward and backward against float64
// references: the forward from the formulas in ops.h, the derivative by
// central finite differences of that float64 forward. Also the FP8 output.
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::GeluTanhReference;
using testing::MakeEmpty;
using testing::MakeRandom;
using testing::RelativeError;
using testing::Scalar;
using testing::ScalarValue;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;

double Sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

double Reference(Activation act, double x) {
  switch (act) {
    case Activation::kGelu: {
      const double k = std::sqrt(2.0 / M_PI);
      return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
    }
    case Activation::kSilu: return x * Sigmoid(x);
    case Activation::kRelu: return std::max(x, 0.0);
    case Activation::kQuickGelu: return x * Sigmoid(1.702 * x);
    case Activation::kSquaredRelu: return std::max(x, 0.0) * std::max(x, 0.0);
    case Activation::kLinear: return x;
  }
  return x;
}

// Central difference; relu's kink at 0 is never hit by random floats.
double ReferenceDerivative(Activation act, double x) {
  const double h = 1e-6;
  return (Reference(act, x + h) - Reference(act, x - h)) / (2 * h);
}

const char* Name(Activation act) {
  switch (act) {
    case Activation::kGelu: return "gelu";
    case Activation::kSilu: return "silu";
    case Activation::kRelu: return "relu";
    case Activation::kQuickGelu: return "quick_gelu";
    case Activation::kSquaredRelu: return "squared_relu";
    case Activation::kLinear: return "linear";
  }
  return "?";
}

// TE JAX's activation lists: the single ones and the gated pairs.
const std::vector<std::vector<Activation>> kActivationLists = {
    {Activation::kGelu},
    {Activation::kSilu},
    {Activation::kRelu},
    {Activation::kQuickGelu},
    {Activation::kSquaredRelu},
    {Activation::kLinear},
    {Activation::kGelu, Activation::kLinear},
    {Activation::kSilu, Activation::kLinear},
    {Activation::kRelu, Activation::kLinear},
    {Activation::kQuickGelu, Activation::kLinear},
    {Activation::kSquaredRelu, Activation::kLinear},
};

class ActivationTest
    : public ::testing::TestWithParam<std::tuple<std::vector<Activation>, DType, Shape>> {
 protected:
  void SetUp() override {
    std::tie(acts_, dtype_, y_shape_) = GetParam();
    n_ = y_shape_[0];
    width_ = y_shape_[1];
    in_cols_ = width_ * static_cast<int64_t>(acts_.size());
    x_ = MakeRandom(ops_, dtype_, {n_, in_cols_}, 61, -4.0f, 4.0f);
    xv_ = ToDoubles(x_);
  }

  double X(int part, int64_t r, int64_t c) const { return xv_[r * in_cols_ + part * width_ + c]; }

  std::vector<double> ReferenceForward() const {
    std::vector<double> y(n_ * width_);
    for (int64_t r = 0; r < n_; ++r) {
      for (int64_t c = 0; c < width_; ++c) {
        double v = Reference(acts_[0], X(0, r, c));
        if (acts_.size() == 2) v *= Reference(acts_[1], X(1, r, c));
        y[r * width_ + c] = v;
      }
    }
    return y;
  }

  CpuOps ops_;
  std::vector<Activation> acts_;
  DType dtype_;
  Shape y_shape_;
  int64_t n_, width_, in_cols_;
  Tensor x_;
  std::vector<double> xv_;
};

TEST_P(ActivationTest, ForwardMatchesReference) {
  Tensor y = MakeEmpty(ops_, dtype_, y_shape_);
  ASSERT_TRUE(ops_.ActivationForward(acts_, x_, &y, nullptr).ok());
  EXPECT_LT(RelativeError(y, ReferenceForward()), Tolerance(dtype_));
}

TEST_P(ActivationTest, BackwardMatchesFiniteDifferences) {
  Tensor dy = MakeRandom(ops_, dtype_, y_shape_, 62);
  Tensor dx = MakeEmpty(ops_, dtype_, {n_, in_cols_});
  ASSERT_TRUE(ops_.ActivationBackward(acts_, dy, x_, &dx).ok());
  const std::vector<double> dyv = ToDoubles(dy);
  std::vector<double> ref(xv_.size());
  for (int64_t r = 0; r < n_; ++r) {
    for (int64_t c = 0; c < width_; ++c) {
      const double g = dyv[r * width_ + c];
      if (acts_.size() == 1) {
        ref[r * in_cols_ + c] = g * ReferenceDerivative(acts_[0], X(0, r, c));
        continue;
      }
      ref[r * in_cols_ + c] =
          g * ReferenceDerivative(acts_[0], X(0, r, c)) * Reference(acts_[1], X(1, r, c));
      ref[r * in_cols_ + width_ + c] =
          g * Reference(acts_[0], X(0, r, c)) * ReferenceDerivative(acts_[1], X(1, r, c));
    }
  }
  EXPECT_LT(RelativeError(dx, ref), Tolerance(dtype_));
}

TEST_P(ActivationTest, Fp8OutputIsTheFloatOutputQuantized) {
  for (DType fp8_dtype : {DType::kE4M3, DType::kE5M2}) {
    Tensor y32 = MakeEmpty(ops_, DType::kF32, y_shape_);
    ASSERT_TRUE(ops_.ActivationForward(acts_, x_, &y32, nullptr).ok());
    const float scale = 20.0f;
    Fp8Output fp8{Scalar(ops_, scale), Scalar(ops_, -1.0f), Scalar(ops_, -1.0f)};
    Tensor y8 = MakeEmpty(ops_, fp8_dtype, y_shape_);
    ASSERT_TRUE(ops_.ActivationForward(acts_, x_, &y8, &fp8).ok());
    float amax = 0.0f;
    for (int64_t i = 0; i < y8.numel(); ++i) {
      ASSERT_EQ(LoadAsFloat(y8, i), RoundTo(fp8_dtype, LoadAsFloat(y32, i) * scale)) << i;
      amax = std::max(amax, std::fabs(LoadAsFloat(y32, i)));
    }
    EXPECT_EQ(ScalarValue(fp8.amax), amax) << ShortName(fp8_dtype);
    EXPECT_EQ(ScalarValue(fp8.scale_inv), 1.0f / scale);
  }
}

std::string CaseName(
    const ::testing::TestParamInfo<std::tuple<std::vector<Activation>, DType, Shape>>& info) {
  const auto& [acts, dtype, shape] = info.param;
  std::string name;
  for (Activation a : acts) name += std::string(Name(a)) + "_";
  return name + ShortName(dtype) + "_" + std::to_string(shape[0]) + "x" +
         std::to_string(shape[1]);
}

INSTANTIATE_TEST_SUITE_P(
    ListsDTypesShapes, ActivationTest,
    ::testing::Combine(::testing::ValuesIn(kActivationLists),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(Shape{7, 13}, Shape{33, 65})),
    CaseName);

TEST(CpuActivationErrorsTest, GatedInputMustBeTwiceTheOutput) {
  CpuOps ops;
  const std::vector<Activation> gated = {Activation::kGelu, Activation::kLinear};
  Tensor x = MakeRandom(ops, DType::kF32, {4, 7}, 63);
  Tensor y = MakeEmpty(ops, DType::kF32, {4, 3});
  absl::Status s = ops.ActivationForward(gated, x, &y, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("7"), absl::string_view::npos) << s;
  Tensor x8 = MakeRandom(ops, DType::kF32, {4, 8}, 64);
  Tensor wide = MakeEmpty(ops, DType::kF32, {4, 8});
  s = ops.ActivationForward(gated, x8, &wide, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[4, 4]"), absl::string_view::npos) << s;
  EXPECT_EQ(ops.ActivationForward({}, x8, &wide, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// GELU's tanh form as the backends compute it (through the logistic
// function) keeps its negative tail: in float32 0.5 x (1 + tanh u) cancels to
// 0 from x of about -4, where GELU is still 1e-7 to 1e-35. Each value within
// 1e-4 of itself (double reference), down to 1e-35.
TEST(GeluTest, KeepsItsNegativeTail) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {4096}, 65, -12.0f, 0.0f);
  Tensor y = MakeEmpty(ops, DType::kF32, {4096});
  ASSERT_TRUE(ops.ActivationForward({Activation::kGelu}, x, &y, nullptr).ok());
  const std::vector<double> xs = ToDoubles(x), ys = ToDoubles(y);
  int tail = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const double want = GeluTanhReference(xs[i]);
    if (xs[i] < -5.0 && std::fabs(want) > 1e-35) ++tail;
    ASSERT_LE(std::fabs(ys[i] - want), 1e-4 * std::fabs(want) + 1e-35)
        << "gelu(" << xs[i] << ") = " << ys[i] << ", want " << want;
  }
  EXPECT_GT(tail, 500);
}

}  // namespace
}  // namespace te
