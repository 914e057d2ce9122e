// Gemm against a float64 reference: every transpose combination, float dtypes,
// bias, accumulate, FP8 operands with their scale_inv, and argument errors.
#include <cmath>
#include <ostream>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::MakeTensor;
using testing::RelativeError;
using testing::Scalar;
using testing::ToDoubles;
using testing::Tolerance;

struct GemmShape {
  int64_t m, k, n;
};
void PrintTo(const GemmShape& s, std::ostream* os) {
  *os << "M=" << s.m << " K=" << s.k << " N=" << s.n;
}

// A stored [rows, cols] operand: element (i, j) of op(t), where op(t) = t^T if
// transposed.
double OpElement(const std::vector<double>& t, int64_t cols, bool transposed, int64_t i,
                 int64_t j) {
  return transposed ? t[j * cols + i] : t[i * cols + j];
}

// out = op(a) * sa @ op(b) * sb + bias (+ out0), in float64.
std::vector<double> ReferenceGemm(const Tensor& a, bool ta, double sa, const Tensor& b, bool tb,
                                  double sb, const GemmShape& s,
                                  const std::vector<double>& bias = {},
                                  const std::vector<double>& out0 = {}) {
  const std::vector<double> av = ToDoubles(a), bv = ToDoubles(b);
  std::vector<double> out(s.m * s.n);
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < s.n; ++j) {
      double acc = 0.0;
      for (int64_t p = 0; p < s.k; ++p) {
        acc += OpElement(av, a.dim(1), ta, i, p) * sa * OpElement(bv, b.dim(1), tb, p, j) * sb;
      }
      if (!bias.empty()) acc += bias[j];
      if (!out0.empty()) acc += out0[i * s.n + j];
      out[i * s.n + j] = acc;
    }
  }
  return out;
}

Shape OperandShape(int64_t rows, int64_t cols, bool transposed) {
  return transposed ? Shape{cols, rows} : Shape{rows, cols};
}

class GemmTest
    : public ::testing::TestWithParam<std::tuple<bool, bool, DType, GemmShape>> {};

TEST_P(GemmTest, MatchesReference) {
  const auto [ta, tb, dtype, s] = GetParam();
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, dtype, OperandShape(s.m, s.k, ta), 31);
  args.transpose_a = ta;
  args.b = MakeRandom(ops, dtype, OperandShape(s.k, s.n, tb), 32);
  args.transpose_b = tb;
  Tensor out = MakeEmpty(ops, dtype, {s.m, s.n});
  ASSERT_TRUE(ops.Gemm(args, &out).ok());
  EXPECT_LT(RelativeError(out, ReferenceGemm(args.a, ta, 1, args.b, tb, 1, s)),
            Tolerance(dtype));
}

TEST_P(GemmTest, BiasThenAccumulate) {
  const auto [ta, tb, dtype, s] = GetParam();
  CpuOps ops;
  Ops::GemmArgs args;
  // Positive values: the sum of two GEMMs must not cancel (at 1x1x1 it could,
  // and the relative error of a near-zero sum says nothing).
  args.a = MakeRandom(ops, dtype, OperandShape(s.m, s.k, ta), 33, 0.5f, 2.0f);
  args.transpose_a = ta;
  args.b = MakeRandom(ops, dtype, OperandShape(s.k, s.n, tb), 34, 0.5f, 2.0f);
  args.transpose_b = tb;
  args.bias = MakeRandom(ops, dtype, {s.n}, 35, 0.5f, 2.0f);
  // A float32 output keeps the reference of the second step exact to compare.
  Tensor out = MakeEmpty(ops, DType::kF32, {s.m, s.n});
  ASSERT_TRUE(ops.Gemm(args, &out).ok());
  const std::vector<double> first =
      ReferenceGemm(args.a, ta, 1, args.b, tb, 1, s, ToDoubles(args.bias));
  EXPECT_LT(RelativeError(out, first), testing::kF32Tolerance);

  // A second micro-batch adds into out (the gradient-accumulation pattern).
  const std::vector<double> out0 = ToDoubles(out);
  args.a = MakeRandom(ops, dtype, OperandShape(s.m, s.k, ta), 36, 0.5f, 2.0f);
  args.bias = Tensor();
  args.accumulate = true;
  ASSERT_TRUE(ops.Gemm(args, &out).ok());
  EXPECT_LT(RelativeError(out, ReferenceGemm(args.a, ta, 1, args.b, tb, 1, s, {}, out0)),
            testing::kF32Tolerance);
}

INSTANTIATE_TEST_SUITE_P(
    TransposesDTypesShapes, GemmTest,
    ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(GemmShape{7, 13, 5}, GemmShape{33, 65, 17},
                                         GemmShape{1, 1, 1}, GemmShape{16, 64, 8})));

class Fp8GemmTest
    : public ::testing::TestWithParam<std::tuple<bool, bool, DType /*a*/, DType /*b*/>> {};

TEST_P(Fp8GemmTest, OperandsAreDequantizedWithTheirScaleInv) {
  const auto [ta, tb, a_dtype, b_dtype] = GetParam();
  const GemmShape s{9, 48, 11};
  CpuOps ops;
  Ops::GemmArgs args;
  // Random FP8 codes: values drawn in range, rounded to the format.
  args.a = MakeRandom(ops, a_dtype, OperandShape(s.m, s.k, ta), 37, -400.0f, 400.0f);
  args.a_scale_inv = Scalar(ops, 0.01f);
  args.transpose_a = ta;
  args.b = MakeRandom(ops, b_dtype, OperandShape(s.k, s.n, tb), 38, -4e4f, 4e4f);
  args.b_scale_inv = Scalar(ops, 3e-5f);
  args.transpose_b = tb;
  args.bias = MakeRandom(ops, DType::kF32, {s.n}, 39);
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    Tensor out = MakeEmpty(ops, out_dtype, {s.m, s.n});
    ASSERT_TRUE(ops.Gemm(args, &out).ok());
    EXPECT_LT(RelativeError(out, ReferenceGemm(args.a, ta, 0.01f, args.b, tb, 3e-5f, s,
                                               ToDoubles(args.bias))),
              Tolerance(out_dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(TransposesAndFormats, Fp8GemmTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(DType::kE4M3, DType::kE5M2),
                                            ::testing::Values(DType::kE4M3, DType::kE5M2)));

// ---- fused epilogues: a float64 reference of each --------------------------------

double GeluRef(double x) {
  const double t = std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x));
  return 0.5 * x * (1.0 + t);
}
class GemmEpilogueTest : public ::testing::TestWithParam<DType> {};

TEST_P(GemmEpilogueTest, ResidualIsAddedAfterTheBias) {
  const DType dtype = GetParam();
  const GemmShape s{9, 12, 6};
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, dtype, {s.m, s.k}, 50);
  args.b = MakeRandom(ops, dtype, {s.k, s.n}, 51);
  args.bias = MakeRandom(ops, dtype, {s.n}, 52);
  args.residual = MakeRandom(ops, dtype, {s.m, s.n}, 53);
  Tensor out = MakeEmpty(ops, dtype, {s.m, s.n});
  ASSERT_TRUE(ops.Gemm(args, &out).ok());
  std::vector<double> ref =
      ReferenceGemm(args.a, false, 1, args.b, false, 1, s, ToDoubles(args.bias));
  const std::vector<double> residual = ToDoubles(args.residual);
  for (size_t i = 0; i < ref.size(); ++i) ref[i] += residual[i];
  EXPECT_LT(RelativeError(out, ref), Tolerance(dtype));
}

TEST_P(GemmEpilogueTest, GeluAuxKeepsTheInputAndAppliesGelu) {
  const DType dtype = GetParam();
  const GemmShape s{10, 8, 7};
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, dtype, {s.m, s.k}, 54);
  args.b = MakeRandom(ops, dtype, {s.k, s.n}, 55);
  args.bias = MakeRandom(ops, dtype, {s.n}, 56);
  args.epilogue = Ops::GemmEpilogue::kGeluAux;
  args.aux = MakeEmpty(ops, dtype, {s.m, s.n});
  Tensor out = MakeEmpty(ops, dtype, {s.m, s.n});
  ASSERT_TRUE(ops.Gemm(args, &out).ok());
  const std::vector<double> pre =
      ReferenceGemm(args.a, false, 1, args.b, false, 1, s, ToDoubles(args.bias));
  std::vector<double> post(pre.size());
  for (size_t i = 0; i < pre.size(); ++i) post[i] = GeluRef(pre[i]);
  EXPECT_LT(RelativeError(args.aux, pre), Tolerance(dtype));
  EXPECT_LT(RelativeError(out, post), Tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(FloatDTypes, GemmEpilogueTest,
                         ::testing::Values(DType::kF32, DType::kBF16));

TEST(CpuGemmErrorsTest, EpilogueArgumentsAreNamed) {
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, DType::kF32, {4, 3}, 60);
  args.b = MakeRandom(ops, DType::kF32, {3, 2}, 61);
  Tensor out = MakeEmpty(ops, DType::kF32, {4, 2});
  auto expect_named = [&](const Ops::GemmArgs& bad, const char* name) {
    const absl::Status s = ops.Gemm(bad, &out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(s.message().find(name), absl::string_view::npos) << s;
  };
  Ops::GemmArgs bad = args;
  bad.residual = MakeRandom(ops, DType::kF32, {2, 4}, 62);
  expect_named(bad, "residual");
  bad.residual = MakeRandom(ops, DType::kBF16, {4, 2}, 63);
  expect_named(bad, "residual");
  bad.residual = MakeRandom(ops, DType::kF32, {4, 2}, 64);
  bad.accumulate = true;
  expect_named(bad, "residual");
  bad = args;
  bad.epilogue = Ops::GemmEpilogue::kGeluAux;
  expect_named(bad, "aux");
  bad.aux = MakeEmpty(ops, DType::kF32, {4, 3});
  expect_named(bad, "aux");
  bad = args;
  bad.aux = MakeEmpty(ops, DType::kF32, {4, 2});
  expect_named(bad, "aux");  // only with kGeluAux
  bad.epilogue = Ops::GemmEpilogue::kGeluAux;
  bad.accumulate = true;
  expect_named(bad, "accumulate");
}

// Dot's default: the [1, n] x [n, 1] Gemm, against float64.
TEST(CpuDotTest, MatchesTheFloat64SumOfProducts) {
  CpuOps ops;
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const Tensor a = MakeRandom(ops, dtype, {3, 7, 5}, 70);
    const Tensor b = MakeRandom(ops, dtype, {105}, 71);
    Tensor out = MakeEmpty(ops, DType::kF32, {1, 1});
    ASSERT_TRUE(ops.Dot(a, b, &out).ok());
    const std::vector<double> av = ToDoubles(a), bv = ToDoubles(b);
    double ref = 0.0;
    for (size_t i = 0; i < av.size(); ++i) ref += av[i] * bv[i];
    EXPECT_LT(RelativeError(out, {ref}), testing::kF32Tolerance);
  }
  Tensor out = MakeEmpty(ops, DType::kF32, {1});
  const absl::Status s = ops.Dot(MakeRandom(ops, DType::kF32, {4}, 72),
                                 MakeRandom(ops, DType::kBF16, {4}, 73), &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("b"), absl::string_view::npos) << s;
  Tensor two = MakeEmpty(ops, DType::kF32, {2});
  EXPECT_EQ(ops.Dot(MakeRandom(ops, DType::kF32, {4}, 74), MakeRandom(ops, DType::kF32, {4}, 75),
                    &two)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuGemmErrorsTest, NamesTheArgumentAndTheWantedShape) {
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, DType::kF32, {2, 5}, 40);
  args.b = MakeRandom(ops, DType::kF32, {3, 4}, 41);
  Tensor out = MakeEmpty(ops, DType::kF32, {2, 4});
  absl::Status s = ops.Gemm(args, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "Gemm: b has shape [3, 4], want [K=5, N]");

  args.b = MakeRandom(ops, DType::kF32, {5, 4}, 42);
  Tensor wrong_out = MakeEmpty(ops, DType::kF32, {4, 2});
  s = ops.Gemm(args, &wrong_out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("out"), absl::string_view::npos) << s;

  Ops::GemmArgs with_bias = args;
  with_bias.bias = MakeRandom(ops, DType::kF32, {4}, 43);
  with_bias.accumulate = true;
  EXPECT_EQ(ops.Gemm(with_bias, &out).code(), absl::StatusCode::kInvalidArgument);
  with_bias.accumulate = false;
  with_bias.bias = MakeRandom(ops, DType::kF32, {5}, 44);
  EXPECT_EQ(ops.Gemm(with_bias, &out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuGemmErrorsTest, Fp8NeedsBothOperandsAndScales) {
  CpuOps ops;
  Ops::GemmArgs args;
  args.a = MakeRandom(ops, DType::kE4M3, {2, 5}, 45);
  args.a_scale_inv = Scalar(ops, 1.0f);
  args.b = MakeRandom(ops, DType::kBF16, {5, 4}, 46);
  Tensor out = MakeEmpty(ops, DType::kF32, {2, 4});
  EXPECT_EQ(ops.Gemm(args, &out).code(), absl::StatusCode::kInvalidArgument);  // mixed
  args.b = MakeRandom(ops, DType::kE4M3, {5, 4}, 47);
  absl::Status s = ops.Gemm(args, &out);  // b_scale_inv missing
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("b_scale_inv"), absl::string_view::npos) << s;
  args.b_scale_inv = Scalar(ops, 1.0f);
  EXPECT_TRUE(ops.Gemm(args, &out).ok());
  Tensor fp8_out = MakeEmpty(ops, DType::kE4M3, {2, 4});
  EXPECT_EQ(ops.Gemm(args, &fp8_out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te
