// LayerNorm / RMSNorm forward and backward against float64 references: the
// forward from its definition, dx from central finite differences of the
// float64 forward, dgamma / dbeta from their sums. Also the fused FP8 output,
// and the defaults of kernels/ops.cc built on these (NormForwardTransposed,
// NormBackward's residual_grad).
#include <cmath>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::RelativeError;
using testing::Scalar;
using testing::ScalarValue;
using testing::ToDoubles;
using testing::Tolerance;

constexpr float kEpsilon = 1e-5f;

struct RowStats {
  double mean, rsigma;
};

RowStats Stats(const double* row, int64_t h, bool layernorm) {
  double mean = 0.0;
  if (layernorm) {
    for (int64_t c = 0; c < h; ++c) mean += row[c];
    mean /= h;
  }
  double m2 = 0.0;
  for (int64_t c = 0; c < h; ++c) m2 += (row[c] - mean) * (row[c] - mean);
  return {mean, 1.0 / std::sqrt(m2 / h + kEpsilon)};
}

// One row's output, float64.
void ReferenceRow(const double* row, int64_t h, bool layernorm, const std::vector<double>& g,
                  const std::vector<double>& beta, double* y) {
  const RowStats s = Stats(row, h, layernorm);
  for (int64_t c = 0; c < h; ++c) {
    y[c] = (row[c] - s.mean) * s.rsigma * g[c] + (layernorm ? beta[c] : 0.0);
  }
}

class NormTest : public ::testing::TestWithParam<std::tuple<NormType, bool, DType, Shape>> {
 protected:
  void SetUp() override {
    std::tie(type_, args_.zero_centered_gamma, dtype_, shape_) = GetParam();
    args_.type = type_;
    args_.epsilon = kEpsilon;
    layernorm_ = type_ == NormType::kLayerNorm;
    n_ = shape_[0];
    h_ = shape_[1];
    // Rows with an offset, so LayerNorm's mean matters.
    x_ = MakeRandom(ops_, dtype_, shape_, 51, -1.0f, 3.0f);
    gamma_ = MakeRandom(ops_, dtype_, {h_}, 52, args_.zero_centered_gamma ? -0.5f : 0.5f,
                        args_.zero_centered_gamma ? 0.5f : 1.5f);
    if (layernorm_) beta_ = MakeRandom(ops_, dtype_, {h_}, 53);
    g_ = ToDoubles(gamma_);
    if (args_.zero_centered_gamma) {
      for (double& v : g_) v += 1.0;
    }
    if (layernorm_) beta_v_ = ToDoubles(beta_);
    xv_ = ToDoubles(x_);
  }

  std::vector<double> ReferenceForward(const std::vector<double>& x) const {
    std::vector<double> y(x.size());
    for (int64_t r = 0; r < n_; ++r) {
      ReferenceRow(&x[r * h_], h_, layernorm_, g_, beta_v_, &y[r * h_]);
    }
    return y;
  }

  CpuOps ops_;
  NormArgs args_;
  NormType type_;
  DType dtype_;
  Shape shape_;
  bool layernorm_;
  int64_t n_, h_;
  Tensor x_, gamma_, beta_;
  std::vector<double> g_, beta_v_, xv_;
};

TEST_P(NormTest, ForwardMatchesReference) {
  Tensor y = MakeEmpty(ops_, dtype_, shape_);
  Tensor mu = layernorm_ ? MakeEmpty(ops_, DType::kF32, {n_}) : Tensor();
  Tensor rsigma = MakeEmpty(ops_, DType::kF32, {n_});
  ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &y, &mu, &rsigma, nullptr).ok());
  EXPECT_LT(RelativeError(y, ReferenceForward(xv_)), Tolerance(dtype_));

  std::vector<double> ref_mu(n_), ref_rsigma(n_);
  for (int64_t r = 0; r < n_; ++r) {
    const RowStats s = Stats(&xv_[r * h_], h_, layernorm_);
    ref_mu[r] = s.mean;
    ref_rsigma[r] = s.rsigma;
  }
  if (layernorm_) {
    EXPECT_LT(RelativeError(mu, ref_mu), testing::kF32Tolerance);
  }
  EXPECT_LT(RelativeError(rsigma, ref_rsigma), testing::kF32Tolerance);
}

TEST_P(NormTest, Fp8OutputIsTheFloatOutputQuantized) {
  Tensor y32 = MakeEmpty(ops_, DType::kF32, shape_);
  ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &y32, nullptr, nullptr, nullptr).ok());
  const float scale = 60.0f;
  Fp8Output fp8{Scalar(ops_, scale), Scalar(ops_, -1.0f), Scalar(ops_, -1.0f)};
  Tensor y8 = MakeEmpty(ops_, DType::kE4M3, shape_);
  ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &y8, nullptr, nullptr, &fp8).ok());

  const std::vector<double> ref = ReferenceForward(xv_);
  double ref_amax = 0.0;
  for (double v : ref) ref_amax = std::max(ref_amax, std::fabs(v));
  EXPECT_NEAR(ScalarValue(fp8.amax), ref_amax, ref_amax * testing::kF32Tolerance);
  EXPECT_EQ(ScalarValue(fp8.scale_inv), 1.0f / scale);
  std::vector<double> dequantized = ToDoubles(y8);
  for (int64_t i = 0; i < y8.numel(); ++i) {
    ASSERT_EQ(LoadAsFloat(y8, i), RoundTo(DType::kE4M3, LoadAsFloat(y32, i) * scale)) << i;
    dequantized[i] /= scale;
  }
  EXPECT_LT(RelativeError(dequantized, ref), testing::kE4M3Tolerance);
}

TEST_P(NormTest, BackwardMatchesFiniteDifferences) {
  Tensor y = MakeEmpty(ops_, DType::kF32, shape_);
  Tensor mu = layernorm_ ? MakeEmpty(ops_, DType::kF32, {n_}) : Tensor();
  Tensor rsigma = MakeEmpty(ops_, DType::kF32, {n_});
  ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &y, &mu, &rsigma, nullptr).ok());
  Tensor dy = MakeRandom(ops_, dtype_, shape_, 54);
  Tensor dx = MakeEmpty(ops_, dtype_, shape_);
  Tensor dgamma = MakeEmpty(ops_, dtype_, {h_});
  Tensor dbeta = layernorm_ ? MakeEmpty(ops_, dtype_, {h_}) : Tensor();
  ASSERT_TRUE(
      ops_.NormBackward(args_, dy, x_, mu, rsigma, gamma_, &dx, &dgamma, &dbeta).ok());

  // dx: d/dx of loss = sum dy * y, one row at a time (rows are independent).
  const std::vector<double> dyv = ToDoubles(dy);
  std::vector<double> ref_dx(xv_.size());
  std::vector<double> row(h_), y_plus(h_), y_minus(h_);
  for (int64_t r = 0; r < n_; ++r) {
    for (int64_t c = 0; c < h_; ++c) {
      std::copy(&xv_[r * h_], &xv_[r * h_] + h_, row.begin());
      const double step = 1e-5 * std::max(1.0, std::fabs(row[c]));
      row[c] += step;
      ReferenceRow(row.data(), h_, layernorm_, g_, beta_v_, y_plus.data());
      row[c] -= 2 * step;
      ReferenceRow(row.data(), h_, layernorm_, g_, beta_v_, y_minus.data());
      double d = 0.0;
      for (int64_t k = 0; k < h_; ++k) d += dyv[r * h_ + k] * (y_plus[k] - y_minus[k]);
      ref_dx[r * h_ + c] = d / (2 * step);
    }
  }
  EXPECT_LT(RelativeError(dx, ref_dx), Tolerance(dtype_));

  std::vector<double> ref_dgamma(h_, 0.0), ref_dbeta(h_, 0.0);
  for (int64_t r = 0; r < n_; ++r) {
    const RowStats s = Stats(&xv_[r * h_], h_, layernorm_);
    for (int64_t c = 0; c < h_; ++c) {
      ref_dgamma[c] += dyv[r * h_ + c] * (xv_[r * h_ + c] - s.mean) * s.rsigma;
      ref_dbeta[c] += dyv[r * h_ + c];
    }
  }
  EXPECT_LT(RelativeError(dgamma, ref_dgamma), Tolerance(dtype_));
  if (layernorm_) {
    EXPECT_LT(RelativeError(dbeta, ref_dbeta), Tolerance(dtype_));
  }
}

// The defaults in kernels/ops.cc, which the CUDA backend's fused kernels
// must match.

// NormForwardTransposed: y is NormForward's FP8 y, code for code, and y_t its
// transpose; amax, scale_inv, mu and rsigma as NormForward writes them.
TEST_P(NormTest, ForwardTransposedIsForwardAndItsTranspose) {
  for (DType fp8_dtype : {DType::kE4M3, DType::kE5M2}) {
    const float scale = fp8_dtype == DType::kE4M3 ? 60.0f : 3000.0f;
    Fp8Output want_fp8{Scalar(ops_, scale), Scalar(ops_, -1.0f), Scalar(ops_, -1.0f)};
    Tensor want = MakeEmpty(ops_, fp8_dtype, shape_);
    Tensor want_mu = layernorm_ ? MakeEmpty(ops_, DType::kF32, {n_}) : Tensor();
    Tensor want_rsigma = MakeEmpty(ops_, DType::kF32, {n_});
    ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &want, &want_mu, &want_rsigma,
                                 &want_fp8).ok());

    Fp8Output fp8{Scalar(ops_, scale), Scalar(ops_, -1.0f), Scalar(ops_, -1.0f)};
    Tensor y = MakeEmpty(ops_, fp8_dtype, shape_);
    Tensor y_t = MakeEmpty(ops_, fp8_dtype, {h_, n_});
    Tensor mu = layernorm_ ? MakeEmpty(ops_, DType::kF32, {n_}) : Tensor();
    Tensor rsigma = MakeEmpty(ops_, DType::kF32, {n_});
    const absl::Status s =
        ops_.NormForwardTransposed(args_, x_, gamma_, beta_, fp8, &y, &y_t, &mu, &rsigma);
    ASSERT_TRUE(s.ok()) << s;

    const uint8_t* w = want.data_as<const uint8_t>();
    const uint8_t* g = y.data_as<const uint8_t>();
    const uint8_t* t = y_t.data_as<const uint8_t>();
    int64_t distinct_from_first = 0;
    for (int64_t r = 0; r < n_; ++r) {
      for (int64_t c = 0; c < h_; ++c) {
        ASSERT_EQ(g[r * h_ + c], w[r * h_ + c]) << DTypeName(fp8_dtype) << " y " << r << "," << c;
        ASSERT_EQ(t[c * n_ + r], w[r * h_ + c]) << DTypeName(fp8_dtype) << " y_t " << c << "," << r;
        distinct_from_first += w[r * h_ + c] != w[0];
      }
    }
    EXPECT_GT(distinct_from_first, n_ * h_ / 2) << "codes too uniform for the test to mean much";
    EXPECT_GT(ScalarValue(fp8.amax), 0.0f);
    EXPECT_EQ(ScalarValue(fp8.amax), ScalarValue(want_fp8.amax));
    EXPECT_EQ(ScalarValue(fp8.scale_inv), 1.0f / scale);
    EXPECT_EQ(ToDoubles(rsigma), ToDoubles(want_rsigma));
    if (layernorm_) {
      EXPECT_EQ(ToDoubles(mu), ToDoubles(want_mu));
    }
  }
}

// NormBackward with residual_grad: dx is the plain backward's dx (float32)
// plus residual_grad, rounded once to dx's dtype; dgamma and dbeta do not
// change.
TEST_P(NormTest, BackwardAddsResidualGrad) {
  Tensor y = MakeEmpty(ops_, DType::kF32, shape_);
  Tensor mu = layernorm_ ? MakeEmpty(ops_, DType::kF32, {n_}) : Tensor();
  Tensor rsigma = MakeEmpty(ops_, DType::kF32, {n_});
  ASSERT_TRUE(ops_.NormForward(args_, x_, gamma_, beta_, &y, &mu, &rsigma, nullptr).ok());
  Tensor dy = MakeRandom(ops_, dtype_, shape_, 60);
  Tensor residual = MakeRandom(ops_, dtype_, shape_, 61);

  Tensor plain_dx = MakeEmpty(ops_, DType::kF32, shape_);
  Tensor plain_dgamma = MakeEmpty(ops_, dtype_, {h_});
  Tensor plain_dbeta = layernorm_ ? MakeEmpty(ops_, dtype_, {h_}) : Tensor();
  ASSERT_TRUE(ops_.NormBackward(args_, dy, x_, mu, rsigma, gamma_, &plain_dx, &plain_dgamma,
                                &plain_dbeta).ok());
  Tensor dx = MakeEmpty(ops_, dtype_, shape_);
  Tensor dgamma = MakeEmpty(ops_, dtype_, {h_});
  Tensor dbeta = layernorm_ ? MakeEmpty(ops_, dtype_, {h_}) : Tensor();
  const absl::Status s =
      ops_.NormBackward(args_, dy, x_, mu, rsigma, gamma_, &dx, &dgamma, &dbeta, residual);
  ASSERT_TRUE(s.ok()) << s;

  int64_t moved = 0;  // elements where the residual changes the rounded dx
  for (int64_t i = 0; i < dx.numel(); ++i) {
    const float sum = LoadAsFloat(plain_dx, i) + LoadAsFloat(residual, i);
    ASSERT_EQ(LoadAsFloat(dx, i), RoundTo(dtype_, sum)) << i;
    moved += RoundTo(dtype_, LoadAsFloat(plain_dx, i)) != RoundTo(dtype_, sum);
  }
  EXPECT_GT(moved, dx.numel() / 2);
  EXPECT_EQ(ToDoubles(dgamma), ToDoubles(plain_dgamma));
  if (layernorm_) {
    EXPECT_EQ(ToDoubles(dbeta), ToDoubles(plain_dbeta));
  }
}

INSTANTIATE_TEST_SUITE_P(
    TypesDTypesShapes, NormTest,
    ::testing::Combine(::testing::Values(NormType::kLayerNorm, NormType::kRMSNorm),
                       ::testing::Bool(),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(Shape{7, 13}, Shape{33, 65}, Shape{2, 256})));

TEST(CpuNormErrorsTest, NamesTheArgument) {
  CpuOps ops;
  NormArgs args;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 8}, 55);
  Tensor gamma = MakeRandom(ops, DType::kF32, {7}, 56);
  Tensor beta = MakeRandom(ops, DType::kF32, {8}, 57);
  Tensor y = MakeEmpty(ops, DType::kF32, {4, 8});
  absl::Status s = ops.NormForward(args, x, gamma, beta, &y, nullptr, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "NormForward: gamma has shape [7], want [H=8]");

  gamma = MakeRandom(ops, DType::kF32, {8}, 58);
  Tensor y8 = MakeEmpty(ops, DType::kE4M3, {4, 8});
  s = ops.NormForward(args, x, gamma, beta, &y8, nullptr, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("Fp8Output"), absl::string_view::npos) << s;

  Tensor rsigma_bf16 = MakeEmpty(ops, DType::kBF16, {4});
  s = ops.NormForward(args, x, gamma, beta, &y, nullptr, &rsigma_bf16, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rsigma"), absl::string_view::npos) << s;

  NormArgs rms;
  rms.type = NormType::kRMSNorm;
  EXPECT_EQ(ops.NormForward(rms, x, gamma, beta, &y, nullptr, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // RMSNorm has no beta
  EXPECT_TRUE(ops.NormForward(rms, x, gamma, Tensor(), &y, nullptr, nullptr, nullptr).ok());
}

TEST(CpuNormErrorsTest, TransposedOutputNamesTheArgument) {
  CpuOps ops;
  NormArgs args;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 8}, 62);
  Tensor gamma = MakeRandom(ops, DType::kF32, {8}, 63);
  Tensor beta = MakeRandom(ops, DType::kF32, {8}, 64);
  Fp8Output fp8{Scalar(ops, 1.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE4M3, {4, 8});
  Tensor y_t = MakeEmpty(ops, DType::kE4M3, {8, 4});
  ASSERT_TRUE(ops.NormForwardTransposed(args, x, gamma, beta, fp8, &y, &y_t, nullptr, nullptr)
                  .ok());

  Tensor y_t_untransposed = MakeEmpty(ops, DType::kE4M3, {4, 8});
  absl::Status s = ops.NormForwardTransposed(args, x, gamma, beta, fp8, &y, &y_t_untransposed,
                                             nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "NormForwardTransposed: y_t has shape [4, 8], want [8, 4]");

  Tensor y_t_e5m2 = MakeEmpty(ops, DType::kE5M2, {8, 4});
  s = ops.NormForwardTransposed(args, x, gamma, beta, fp8, &y, &y_t_e5m2, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y_t has dtype"), absl::string_view::npos) << s;

  s = ops.NormForwardTransposed(args, x, gamma, beta, fp8, &y, nullptr, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y_t"), absl::string_view::npos) << s;

  Tensor y_f32 = MakeEmpty(ops, DType::kF32, {4, 8});
  Tensor y_t_f32 = MakeEmpty(ops, DType::kF32, {8, 4});
  s = ops.NormForwardTransposed(args, x, gamma, beta, fp8, &y_f32, &y_t_f32, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y has dtype"), absl::string_view::npos) << s;
}

TEST(CpuNormErrorsTest, ResidualGradNamesTheArgument) {
  CpuOps ops;
  NormArgs args;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 8}, 65);
  Tensor dy = MakeRandom(ops, DType::kF32, {4, 8}, 66);
  Tensor gamma = MakeRandom(ops, DType::kF32, {8}, 67);
  Tensor mu = MakeRandom(ops, DType::kF32, {4}, 68);
  Tensor rsigma = MakeRandom(ops, DType::kF32, {4}, 69, 0.5f, 1.5f);
  Tensor dx = MakeEmpty(ops, DType::kF32, {4, 8});
  Tensor dgamma = MakeEmpty(ops, DType::kF32, {8});
  Tensor dbeta = MakeEmpty(ops, DType::kF32, {8});
  Tensor good = MakeRandom(ops, DType::kF32, {4, 8}, 70);
  ASSERT_TRUE(ops.NormBackward(args, dy, x, mu, rsigma, gamma, &dx, &dgamma, &dbeta, good).ok());

  Tensor bf16 = MakeRandom(ops, DType::kBF16, {4, 8}, 71);
  absl::Status s = ops.NormBackward(args, dy, x, mu, rsigma, gamma, &dx, &dgamma, &dbeta, bf16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "NormBackward: residual_grad has dtype bfloat16, want dx's float32");

  Tensor wide = MakeRandom(ops, DType::kF32, {4, 9}, 72);
  s = ops.NormBackward(args, dy, x, mu, rsigma, gamma, &dx, &dgamma, &dbeta, wide);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("residual_grad has shape [4, 9]"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace te
