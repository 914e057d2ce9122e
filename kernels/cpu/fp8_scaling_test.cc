// FP8 scaling ops: Quantize, cast-transpose (with dbias), Dequantize, Amax,
// ScaleFromAmax, the delayed-scaling update (against hand-worked sequences),
// and emulated block scaling (MXFP8, NVFP4) against float64 references.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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
using testing::ScalarValue;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;

const Shape kShapes[] = {{7, 13}, {33, 65}, {2, 64}};

double MaxAbs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// ---- Quantize / Dequantize -------------------------------------------------------

class QuantizeTest
    : public ::testing::TestWithParam<std::tuple<DType /*x*/, DType /*fp8*/, Shape>> {};

TEST_P(QuantizeTest, ValuesAmaxAndScaleInv) {
  const auto [x_dtype, fp8_dtype, shape] = GetParam();
  CpuOps ops;
  Tensor x = MakeRandom(ops, x_dtype, shape, 21, -3.0f, 3.0f);
  const float scale = 37.5f;  // not a power of two: the product rounds
  Fp8Output fp8{Scalar(ops, scale), Scalar(ops, -1.0f), Scalar(ops, -1.0f)};
  Tensor y = MakeEmpty(ops, fp8_dtype, shape);
  ASSERT_TRUE(ops.Quantize(x, fp8, &y).ok());

  const std::vector<double> xv = ToDoubles(x);
  EXPECT_EQ(ScalarValue(fp8.amax), static_cast<float>(MaxAbs(xv)));
  EXPECT_EQ(ScalarValue(fp8.scale_inv), 1.0f / scale);
  // Each code is the format's cast of x * scale (the casts are checked
  // exhaustively in kernels/fp8_test.cc) ...
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float want = RoundTo(fp8_dtype, static_cast<float>(xv[i]) * scale);
    ASSERT_EQ(LoadAsFloat(y, i), want) << i;
  }
  // ... and dequantized it is x within the format's half ulp.
  std::vector<double> dequantized = ToDoubles(y);
  for (double& v : dequantized) v /= scale;
  EXPECT_LT(RelativeError(dequantized, xv), Tolerance(fp8_dtype));

  Tensor back = MakeEmpty(ops, x_dtype, shape);
  ASSERT_TRUE(ops.Dequantize(y, fp8.scale_inv, &back).ok());
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(LoadAsFloat(back, i), RoundTo(x_dtype, LoadAsFloat(y, i) * (1.0f / scale))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantizeTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16),
                                            ::testing::Values(DType::kE4M3, DType::kE5M2),
                                            ::testing::ValuesIn(kShapes)));

TEST(CpuQuantizeTest, SaturatesAndReportsAmaxBeforeScaling) {
  CpuOps ops;
  Tensor x = MakeTensor(ops, DType::kF32, {4}, {1.0f, -1000.0f, 3.0f, INFINITY});
  Fp8Output fp8{Scalar(ops, 2.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE4M3, {4});
  ASSERT_TRUE(ops.Quantize(x, fp8, &y).ok());
  EXPECT_EQ(LoadAsFloat(y, 0), 2.0f);
  EXPECT_EQ(LoadAsFloat(y, 1), -448.0f);
  EXPECT_EQ(LoadAsFloat(y, 2), 6.0f);
  EXPECT_EQ(LoadAsFloat(y, 3), 448.0f);
  EXPECT_EQ(ScalarValue(fp8.amax), INFINITY);
  EXPECT_EQ(ScalarValue(fp8.scale_inv), 0.5f);
}

// An amax left undefined is not recorded: the codes and scale_inv are those
// written with one, for Quantize, QuantizeTranspose and the fused producers
// (a norm, an activation); QuantizeTransposeKept, whose record keeps the
// amax, refuses it, naming fp8.amax.
TEST(CpuQuantizeTest, AnUnrecordedAmaxChangesNoCodeOrScaleInv) {
  CpuOps ops;
  const Shape shape = {6, 16};
  Tensor x = MakeRandom(ops, DType::kBF16, shape, 9, -3.0f, 3.0f);
  Tensor gamma = MakeRandom(ops, DType::kF32, {16}, 10, 0.5f, 1.5f);
  Tensor beta = MakeRandom(ops, DType::kF32, {16}, 11);
  using Run = std::function<absl::Status(const Fp8Output&, Tensor*, Tensor*)>;
  const std::vector<std::pair<std::string, Run>> runs = {
      {"Quantize", [&](const Fp8Output& f, Tensor* y, Tensor*) { return ops.Quantize(x, f, y); }},
      {"QuantizeTranspose",
       [&](const Fp8Output& f, Tensor* y, Tensor* y_t) {
         return ops.QuantizeTranspose(x, f, y, y_t);
       }},
      {"NormForwardTransposed",
       [&](const Fp8Output& f, Tensor* y, Tensor* y_t) {
         return ops.NormForwardTransposed(NormArgs(), x, gamma, beta, f, y, y_t, nullptr, nullptr);
       }},
      {"ActivationForwardTransposed",
       [&](const Fp8Output& f, Tensor* y, Tensor* y_t) {
         return ops.ActivationForwardTransposed({Activation::kGelu}, x, f, y, y_t);
       }},
  };
  for (const auto& [what, run] : runs) {
    SCOPED_TRACE(what);
    Fp8Output with{Scalar(ops, 37.5f), Scalar(ops, -1.0f), Scalar(ops, -1.0f)};
    Fp8Output without{Scalar(ops, 37.5f), Tensor(), Scalar(ops, -1.0f)};
    Tensor y = MakeEmpty(ops, DType::kE4M3, shape), y_t = MakeEmpty(ops, DType::kE4M3, {16, 6});
    Tensor z = MakeEmpty(ops, DType::kE4M3, shape), z_t = MakeEmpty(ops, DType::kE4M3, {16, 6});
    ASSERT_TRUE(run(with, &y, &y_t).ok());
    const absl::Status s = run(without, &z, &z_t);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_GT(ScalarValue(with.amax), 0.0f);
    EXPECT_EQ(0, std::memcmp(y.data(), z.data(), y.nbytes()));
    if (what != "Quantize") {
      EXPECT_EQ(0, std::memcmp(y_t.data(), z_t.data(), y_t.nbytes()));
    }
    EXPECT_EQ(ScalarValue(without.scale_inv), 1.0f / 37.5f);
  }
  Ops::KeptQuantization kept{Scalar(ops, NAN), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE4M3, shape), y_t = MakeEmpty(ops, DType::kE4M3, {16, 6});
  const absl::Status s = ops.QuantizeTransposeKept(
      x, Fp8Output{Scalar(ops, 2.0f), Tensor(), Scalar(ops, 0.0f)}, kept, &y, &y_t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("fp8.amax"), std::string::npos) << s;
}

// QuantizeTransposeKeptMany: each item as its own QuantizeTransposeKept
// gives it (a copy whose kept scale is the quantizer's left as it is, the
// others quantized and recorded); a bad item or an output two items share
// is refused, naming the item, before any item moves.
TEST(CpuQuantizeTransposeKeptManyTest, EachItemAsItsOwnCall) {
  CpuOps ops;
  const std::vector<std::tuple<Shape, DType, float, float>> cases = {
      // shape, x dtype, scale, kept scale (NaN: never made; equal: current)
      {{6, 10}, DType::kF32, 8.0f, NAN},
      {{12, 4}, DType::kBF16, 2.0f, 2.0f},
      {{8, 8}, DType::kF32, 0.5f, 4.0f}};
  auto make = [&](int seed) {
    std::vector<Ops::KeptQuantizeItem> items;
    for (const auto& [shape, dtype, scale, kept_scale] : cases) {
      Ops::KeptQuantizeItem item;
      item.x = MakeRandom(ops, dtype, shape, seed++, -3.0f, 3.0f);
      item.fp8 = Fp8Output{Scalar(ops, scale), Scalar(ops, -1.0f), Scalar(ops, -1.0f)};
      item.kept = Ops::KeptQuantization{Scalar(ops, kept_scale), Scalar(ops, 1.25f)};
      item.y = MakeRandom(ops, DType::kE4M3, shape, seed++);
      item.y_t = MakeRandom(ops, DType::kE4M3, {shape[1], shape[0]}, seed++);
      items.push_back(std::move(item));
    }
    return items;
  };
  const std::vector<Ops::KeptQuantizeItem> many = make(3), single = make(3);
  ASSERT_TRUE(ops.QuantizeTransposeKeptMany(many).ok());
  for (const Ops::KeptQuantizeItem& item : single) {
    Tensor y = item.y, y_t = item.y_t;
    ASSERT_TRUE(ops.QuantizeTransposeKept(item.x, item.fp8, item.kept, &y, &y_t).ok());
  }
  for (size_t i = 0; i < many.size(); ++i) {
    SCOPED_TRACE(i);
    const auto& a = many[i];
    const auto& b = single[i];
    EXPECT_EQ(0, std::memcmp(a.y.data(), b.y.data(), a.y.nbytes()));
    EXPECT_EQ(0, std::memcmp(a.y_t.data(), b.y_t.data(), a.y_t.nbytes()));
    for (const auto& [got, want] : {std::pair{a.fp8.amax, b.fp8.amax},
                                    {a.fp8.scale_inv, b.fp8.scale_inv},
                                    {a.kept.scale, b.kept.scale},
                                    {a.kept.amax, b.kept.amax}}) {
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), sizeof(float)));
    }
  }
  // The current copy kept its amax record and its old codes; the others moved.
  EXPECT_EQ(ScalarValue(many[1].fp8.amax), 1.25f);
  EXPECT_EQ(ScalarValue(many[0].kept.scale), 8.0f);
  EXPECT_EQ(ScalarValue(many[2].kept.scale), 0.5f);
  EXPECT_GT(ScalarValue(many[2].fp8.amax), 0.0f);
  EXPECT_NE(ScalarValue(many[2].fp8.amax), 1.25f);

  // A shared output or a bad item: refused, nothing moved.
  std::vector<Ops::KeptQuantizeItem> bad = make(30);
  const std::vector<double> first_y = ToDoubles(bad[0].y);
  bad[2].y_t = bad[1].y_t;
  absl::Status s = ops.QuantizeTransposeKeptMany(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("items[2]"), std::string::npos) << s;
  EXPECT_EQ(ToDoubles(bad[0].y), first_y);
  bad = make(30);
  bad[1].fp8.amax = Tensor();
  s = ops.QuantizeTransposeKeptMany(bad);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("items[1]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("fp8.amax"), std::string::npos) << s;
  EXPECT_EQ(ToDoubles(bad[0].y), first_y);
}

// Cast-transpose: y is Quantize's, y_t its transpose; amax and scale_inv as
// Quantize writes them. Bad shapes name the argument.
TEST(CpuQuantizeTransposeTest, BothLayoutsAndTheSideOutputs) {
  CpuOps ops;
  const Shape shape = {6, 10};
  Tensor x = MakeRandom(ops, DType::kBF16, shape, 5);
  Fp8Output a{Scalar(ops, 8.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Fp8Output b{Scalar(ops, 8.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor want = MakeEmpty(ops, DType::kE5M2, shape);
  ASSERT_TRUE(ops.Quantize(x, a, &want).ok());
  Tensor y = MakeEmpty(ops, DType::kE5M2, shape);
  Tensor y_t = MakeEmpty(ops, DType::kE5M2, {10, 6});
  ASSERT_TRUE(ops.QuantizeTranspose(x, b, &y, &y_t).ok());
  const uint8_t* w = want.data_as<uint8_t>();
  const uint8_t* g = y.data_as<uint8_t>();
  const uint8_t* t = y_t.data_as<uint8_t>();
  int nonzero = 0;
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t j = 0; j < 10; ++j) {
      EXPECT_EQ(g[i * 10 + j], w[i * 10 + j]) << i << "," << j;
      EXPECT_EQ(t[j * 6 + i], w[i * 10 + j]) << i << "," << j;
      nonzero += w[i * 10 + j] != 0;
    }
  }
  EXPECT_GT(nonzero, 30);
  EXPECT_EQ(ScalarValue(b.amax), ScalarValue(a.amax));
  EXPECT_EQ(ScalarValue(b.scale_inv), 0.125f);

  Tensor wrong = MakeEmpty(ops, DType::kE5M2, {6, 10});
  absl::Status bad = ops.QuantizeTranspose(x, b, &y, &wrong);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("y_t"), std::string::npos) << bad;
  Tensor other = MakeEmpty(ops, DType::kE4M3, {10, 6});
  EXPECT_EQ(ops.QuantizeTranspose(x, b, &y, &other).code(), absl::StatusCode::kInvalidArgument);
}

// Cast-transpose-dbias (the default: QuantizeTranspose, then SumRows): the
// same codes, amax and scale_inv as QuantizeTranspose, and dbias as SumRows
// gives it, in any float dtype.
TEST(CpuQuantizeTransposeDbiasTest, IsQuantizeTransposeAndSumRows) {
  CpuOps ops;
  const Shape shape = {37, 24};
  Tensor x = MakeRandom(ops, DType::kBF16, shape, 6, -3.0f, 3.0f);
  Fp8Output a{Scalar(ops, 20.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor want = MakeEmpty(ops, DType::kE4M3, shape);
  Tensor want_t = MakeEmpty(ops, DType::kE4M3, {24, 37});
  ASSERT_TRUE(ops.QuantizeTranspose(x, a, &want, &want_t).ok());
  for (DType dbias_dtype : {DType::kF32, DType::kBF16}) {
    Tensor want_dbias = MakeEmpty(ops, dbias_dtype, {24});
    ASSERT_TRUE(ops.SumRows(x, &want_dbias).ok());
    Fp8Output b{Scalar(ops, 20.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
    Tensor y = MakeEmpty(ops, DType::kE4M3, shape);
    Tensor y_t = MakeEmpty(ops, DType::kE4M3, {24, 37});
    Tensor dbias = MakeEmpty(ops, dbias_dtype, {24});
    const absl::Status s = ops.QuantizeTransposeDbias(x, b, &y, &y_t, &dbias);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), want.nbytes()));
    EXPECT_EQ(0, std::memcmp(y_t.data(), want_t.data(), want_t.nbytes()));
    EXPECT_EQ(ScalarValue(b.amax), ScalarValue(a.amax));
    EXPECT_EQ(ScalarValue(b.scale_inv), 0.05f);
    EXPECT_EQ(ToDoubles(dbias), ToDoubles(want_dbias));
    // Column sums of 37 values in [-3, 3]: a zero would mean nothing was summed.
    for (int64_t c = 0; c < 24; ++c) EXPECT_NE(LoadAsFloat(dbias, c), 0.0f) << c;
  }
  // Against a float64 sum, so a wrong default (say, row sums) fails too.
  Tensor dbias = MakeEmpty(ops, DType::kF32, {24});
  Fp8Output c{Scalar(ops, 20.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE4M3, shape);
  Tensor y_t = MakeEmpty(ops, DType::kE4M3, {24, 37});
  ASSERT_TRUE(ops.QuantizeTransposeDbias(x, c, &y, &y_t, &dbias).ok());
  const std::vector<double> xv = ToDoubles(x);
  std::vector<double> sums(24, 0.0);
  for (int64_t r = 0; r < 37; ++r) {
    for (int64_t col = 0; col < 24; ++col) sums[col] += xv[r * 24 + col];
  }
  EXPECT_LT(RelativeError(dbias, sums), testing::kF32Tolerance);
}

TEST(CpuQuantizeTransposeDbiasTest, BadArgumentsAreInvalidArgument) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {6, 10}, 7);
  Fp8Output fp8{Scalar(ops, 1.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE5M2, {6, 10});
  Tensor y_t = MakeEmpty(ops, DType::kE5M2, {10, 6});
  Tensor dbias = MakeEmpty(ops, DType::kF32, {10});
  ASSERT_TRUE(ops.QuantizeTransposeDbias(x, fp8, &y, &y_t, &dbias).ok());

  Tensor y_t_untransposed = MakeEmpty(ops, DType::kE5M2, {6, 10});
  absl::Status s = ops.QuantizeTransposeDbias(x, fp8, &y, &y_t_untransposed, &dbias);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y_t"), std::string::npos) << s;
  Tensor y_t_e4m3 = MakeEmpty(ops, DType::kE4M3, {10, 6});
  s = ops.QuantizeTransposeDbias(x, fp8, &y, &y_t_e4m3, &dbias);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y_t"), std::string::npos) << s;
  // dbias goes through SumRows' check, whose message calls it y.
  Tensor dbias_rows = MakeEmpty(ops, DType::kF32, {6});
  s = ops.QuantizeTransposeDbias(x, fp8, &y, &y_t, &dbias_rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[6]"), std::string::npos) << s;
  Tensor dbias_fp8 = MakeEmpty(ops, DType::kE4M3, {10});
  EXPECT_EQ(ops.QuantizeTransposeDbias(x, fp8, &y, &y_t, &dbias_fp8).code(),
            absl::StatusCode::kInvalidArgument);
}

// Dact-cast-transpose-dbias: the codes, amax and scale_inv of
// QuantizeTranspose on ActivationBackward's dx (in x's dtype), and dbias the
// column sums of that dx (not of dy), single and gated activations.
TEST(CpuActivationBackwardQuantizeTransposeTest, QuantizesActivationBackwardsDx) {
  CpuOps ops;
  const int64_t rows = 37, width = 24;
  for (const std::vector<Activation>& acts :
       {std::vector<Activation>{Activation::kGelu}, std::vector<Activation>{Activation::kSilu},
        std::vector<Activation>{Activation::kGelu, Activation::kLinear}}) {
    const int64_t cols = width * static_cast<int64_t>(acts.size());
    SCOPED_TRACE(cols);
    Tensor x = MakeRandom(ops, DType::kBF16, {rows, cols}, 21, -3.0f, 3.0f);
    Tensor dy = MakeRandom(ops, DType::kBF16, {rows, width}, 22, -2.0f, 2.0f);
    Tensor dx = MakeEmpty(ops, DType::kBF16, {rows, cols});
    ASSERT_TRUE(ops.ActivationBackward(acts, dy, x, &dx).ok());
    Fp8Output a{Scalar(ops, 30.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
    Tensor want = MakeEmpty(ops, DType::kE5M2, {rows, cols});
    Tensor want_t = MakeEmpty(ops, DType::kE5M2, {cols, rows});
    ASSERT_TRUE(ops.QuantizeTranspose(dx, a, &want, &want_t).ok());

    Fp8Output b{Scalar(ops, 30.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
    Tensor y = MakeEmpty(ops, DType::kE5M2, {rows, cols});
    Tensor y_t = MakeEmpty(ops, DType::kE5M2, {cols, rows});
    Tensor dbias = MakeEmpty(ops, DType::kF32, {cols});
    const absl::Status s =
        ops.ActivationBackwardQuantizeTranspose(acts, &dy, x, b, &y, &y_t, &dbias);
    ASSERT_TRUE(s.ok()) << s;
    // One activation: dx was written over dy, which the caller gave up (no
    // [N, I] tensor held beside dy, x and the codes).
    if (acts.size() == 1) EXPECT_EQ(ToDoubles(dy), ToDoubles(dx));
    EXPECT_EQ(0, std::memcmp(y.data(), want.data(), want.nbytes()));
    EXPECT_EQ(0, std::memcmp(y_t.data(), want_t.data(), want_t.nbytes()));
    EXPECT_EQ(ScalarValue(b.amax), ScalarValue(a.amax));
    EXPECT_GT(ScalarValue(b.amax), 0.0f);
    EXPECT_FLOAT_EQ(ScalarValue(b.scale_inv), 1.0f / 30.0f);
    const std::vector<double> dxv = ToDoubles(dx);
    std::vector<double> sums(static_cast<size_t>(cols), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) sums[c] += dxv[r * cols + c];
    }
    EXPECT_LT(RelativeError(dbias, sums), testing::kF32Tolerance);

    // Without dbias: the same codes.
    Fp8Output c{Scalar(ops, 30.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
    Tensor y2 = MakeEmpty(ops, DType::kE5M2, {rows, cols});
    Tensor y2_t = MakeEmpty(ops, DType::kE5M2, {cols, rows});
    Tensor dy2 = MakeRandom(ops, DType::kBF16, {rows, width}, 22, -2.0f, 2.0f);
    ASSERT_TRUE(
        ops.ActivationBackwardQuantizeTranspose(acts, &dy2, x, c, &y2, &y2_t, nullptr).ok());
    EXPECT_EQ(0, std::memcmp(y2.data(), want.data(), want.nbytes()));
    EXPECT_EQ(0, std::memcmp(y2_t.data(), want_t.data(), want_t.nbytes()));
  }
}

TEST(CpuActivationBackwardQuantizeTransposeTest, BadArgumentsNameTheField) {
  CpuOps ops;
  const std::vector<Activation> gelu = {Activation::kGelu};
  Tensor x = MakeRandom(ops, DType::kF32, {6, 10}, 23);
  Tensor dy = MakeRandom(ops, DType::kF32, {6, 10}, 24);
  Fp8Output fp8{Scalar(ops, 1.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE5M2, {6, 10});
  Tensor y_t = MakeEmpty(ops, DType::kE5M2, {10, 6});
  Tensor dbias = MakeEmpty(ops, DType::kF32, {10});
  ASSERT_TRUE(ops.ActivationBackwardQuantizeTranspose(gelu, &dy, x, fp8, &y, &y_t, &dbias).ok());
  auto expect_invalid = [](const absl::Status& s, const std::string& field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
    EXPECT_NE(s.message().find("ActivationBackwardQuantizeTranspose"), std::string::npos) << s;
  };
  Tensor dy_short = MakeRandom(ops, DType::kF32, {6, 9}, 25);
  expect_invalid(ops.ActivationBackwardQuantizeTranspose(gelu, &dy_short, x, fp8, &y, &y_t, &dbias),
                 "dy");
  Tensor x3 = MakeRandom(ops, DType::kF32, {2, 3, 10}, 26);
  expect_invalid(ops.ActivationBackwardQuantizeTranspose(gelu, &dy, x3, fp8, &y, &y_t, &dbias), "x");
  Tensor y_t_wrong = MakeEmpty(ops, DType::kE5M2, {6, 10});
  expect_invalid(
      ops.ActivationBackwardQuantizeTranspose(gelu, &dy, x, fp8, &y, &y_t_wrong, &dbias), "y_t");
  Tensor dbias_rows = MakeEmpty(ops, DType::kF32, {6});
  expect_invalid(
      ops.ActivationBackwardQuantizeTranspose(gelu, &dy, x, fp8, &y, &y_t, &dbias_rows), "[6]");
  expect_invalid(ops.ActivationBackwardQuantizeTranspose(gelu, nullptr, x, fp8, &y, &y_t, &dbias),
                 "dy");
}

TEST(CpuQuantizeTest, NanInputGivesNanAmax) {
  CpuOps ops;
  Tensor x = MakeTensor(ops, DType::kF32, {3}, {1.0f, NAN, 2.0f});
  Fp8Output fp8{Scalar(ops, 1.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor y = MakeEmpty(ops, DType::kE5M2, {3});
  ASSERT_TRUE(ops.Quantize(x, fp8, &y).ok());
  EXPECT_TRUE(std::isnan(ScalarValue(fp8.amax)));
  EXPECT_TRUE(std::isnan(LoadAsFloat(y, 1)));
}

TEST(CpuQuantizeTest, RejectsWrongOutputAndScale) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 4}, 22);
  Fp8Output fp8{Scalar(ops, 1.0f), Scalar(ops, 0.0f), Scalar(ops, 0.0f)};
  Tensor bf16 = MakeEmpty(ops, DType::kBF16, {4, 4});
  EXPECT_EQ(ops.Quantize(x, fp8, &bf16).code(), absl::StatusCode::kInvalidArgument);
  Tensor y = MakeEmpty(ops, DType::kE4M3, {4, 4});
  Fp8Output bad = fp8;
  bad.scale = MakeEmpty(ops, DType::kF32, {2});
  absl::Status s = ops.Quantize(x, bad, &y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("fp8.scale"), absl::string_view::npos) << s;
  Tensor x_fp8 = MakeEmpty(ops, DType::kE4M3, {4, 4});
  EXPECT_EQ(ops.Quantize(x_fp8, fp8, &y).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Amax, ScaleFromAmax ---------------------------------------------------------

TEST(CpuAmaxTest, MatchesReference) {
  CpuOps ops;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    Tensor x = MakeRandom(ops, dtype, {33, 65}, 23, -5.0f, 4.0f);
    Tensor amax = Scalar(ops, -1.0f);
    ASSERT_TRUE(ops.Amax(x, &amax).ok());
    EXPECT_EQ(ScalarValue(amax), static_cast<float>(MaxAbs(ToDoubles(x)))) << ShortName(dtype);
  }
  Tensor amax = Scalar(ops, 0.0f);
  Tensor wrong = MakeEmpty(ops, DType::kBF16, {1});
  EXPECT_EQ(ops.Amax(MakeRandom(ops, DType::kF32, {3}, 24), &wrong).code(),
            absl::StatusCode::kInvalidArgument);
}

struct ScaleCase {
  float amax, fp8_max, margin, epsilon, want_scale;
};

TEST(CpuScaleFromAmaxTest, HandWorkedCases) {
  const ScaleCase cases[] = {
      {3.5f, 448.0f, 1.0f, 0.0f, 64.0f},           // 448 / 2 / 3.5
      {2.0f, 57344.0f, 0.0f, 0.0f, 28672.0f},      // E5M2
      {0.0f, 448.0f, 0.0f, 1e-3f, 448.0f / 1e-3f},  // epsilon raises a zero amax
      {1e-5f, 448.0f, 0.0f, 1e-3f, 448.0f / 1e-3f},
      {0.0f, 448.0f, 0.0f, 0.0f, 1.0f},            // no scale from a zero amax
      {INFINITY, 448.0f, 0.0f, 0.0f, 1.0f},
      {NAN, 448.0f, 0.0f, 0.0f, 1.0f},
      {1e-45f, 448.0f, 0.0f, 0.0f, FLT_MAX},       // overflow is capped
  };
  CpuOps ops;
  for (const ScaleCase& c : cases) {
    Tensor amax = Scalar(ops, c.amax), scale = Scalar(ops, 0.0f), scale_inv = Scalar(ops, 0.0f);
    ASSERT_TRUE(ops.ScaleFromAmax(amax, c.fp8_max, c.margin, c.epsilon, &scale, &scale_inv).ok());
    EXPECT_EQ(ScalarValue(scale), c.want_scale) << "amax " << c.amax;
    EXPECT_EQ(ScalarValue(scale_inv), 1.0f / c.want_scale) << "amax " << c.amax;
  }
}

// ---- DelayedScalingUpdate ---------------------------------------------------------

// One quantizer's state; Step() writes this step's amax into history[0] (what
// Quantize does), runs the update and returns the new scale.
class DelayedScaling {
 public:
  DelayedScaling(CpuOps* ops, int length, float scale, DelayedScalingArgs args)
      : ops_(ops), args_(args) {
    history_ = MakeTensor(*ops, DType::kF32, {length}, std::vector<float>(length, 0.0f));
    scale_ = Scalar(*ops, scale);
    scale_inv_ = Scalar(*ops, 1.0f / scale);
  }
  float Step(float amax) {
    history_.data_as<float>()[0] = amax;
    EXPECT_TRUE(ops_->DelayedScalingUpdate(args_, &history_, &scale_, &scale_inv_).ok());
    EXPECT_EQ(ScalarValue(scale_inv_), 1.0f / ScalarValue(scale_));
    return ScalarValue(scale_);
  }
  std::vector<float> history() const { return ToFloatVector(history_); }

 private:
  CpuOps* ops_;
  DelayedScalingArgs args_;
  Tensor history_, scale_, scale_inv_;
};

TEST(CpuDelayedScalingTest, MaxOverTheWindowAsItRolls) {
  CpuOps ops;
  DelayedScaling q(&ops, 4, 1.0f, DelayedScalingArgs{});
  EXPECT_EQ(q.Step(2.0f), 224.0f);  // [2 0 0 0] -> max 2; rolled [0 0 0 2]
  EXPECT_EQ(q.history(), (std::vector<float>{0, 0, 0, 2}));
  EXPECT_EQ(q.Step(4.0f), 112.0f);  // [4 0 0 2] -> 4; [0 0 2 4]
  EXPECT_EQ(q.history(), (std::vector<float>{0, 0, 2, 4}));
  EXPECT_EQ(q.Step(1.0f), 112.0f);  // [1 0 2 4] -> 4; [0 2 4 1]
  EXPECT_EQ(q.history(), (std::vector<float>{0, 2, 4, 1}));
  EXPECT_EQ(q.Step(0.5f), 112.0f);  // [.5 2 4 1] -> 4; the 2 drops out: [0 4 1 .5]
  EXPECT_EQ(q.history(), (std::vector<float>{0, 4, 1, 0.5f}));
  EXPECT_EQ(q.Step(0.25f), 112.0f);  // [.25 4 1 .5] -> 4; [0 1 .5 .25]
  EXPECT_EQ(q.Step(0.125f), 448.0f);  // [.125 1 .5 .25] -> 1: the 4 has left
  EXPECT_EQ(q.history(), (std::vector<float>{0, 0.5f, 0.25f, 0.125f}));
}

TEST(CpuDelayedScalingTest, MostRecentUsesOnlyThisStep) {
  CpuOps ops;
  DelayedScalingArgs args;
  args.most_recent = true;
  DelayedScaling q(&ops, 4, 1.0f, args);
  EXPECT_EQ(q.Step(2.0f), 224.0f);
  EXPECT_EQ(q.Step(4.0f), 112.0f);
  EXPECT_EQ(q.Step(1.0f), 448.0f);  // the max algorithm would still say 4
  EXPECT_EQ(q.Step(0.5f), 896.0f);
  EXPECT_EQ(q.history(), (std::vector<float>{0, 4, 1, 0.5f}));  // still rolls
}

TEST(CpuDelayedScalingTest, MarginAndFormatMax) {
  CpuOps ops;
  DelayedScalingArgs args;
  args.fp8_max = 57344.0f;
  args.margin = 2.0f;
  DelayedScaling q(&ops, 2, 1.0f, args);
  EXPECT_EQ(q.Step(7.0f), 57344.0f / 4.0f / 7.0f);
  DelayedScalingArgs fractional;
  fractional.margin = 0.5f;
  DelayedScaling r(&ops, 1, 1.0f, fractional);
  EXPECT_FLOAT_EQ(r.Step(1.0f), 448.0f / std::sqrt(2.0f));
}

TEST(CpuDelayedScalingTest, ZeroAmaxKeepsTheOldScale) {
  CpuOps ops;
  DelayedScaling q(&ops, 3, 5.0f, DelayedScalingArgs{});
  EXPECT_EQ(q.Step(0.0f), 5.0f);  // the initial state: nothing seen yet
  EXPECT_EQ(q.Step(0.0f), 5.0f);
  EXPECT_EQ(q.Step(8.0f), 56.0f);
}

TEST(CpuDelayedScalingTest, InfKeepsTheOldScaleUntilItLeavesTheWindow) {
  CpuOps ops;
  DelayedScaling q(&ops, 3, 7.0f, DelayedScalingArgs{});
  EXPECT_EQ(q.Step(INFINITY), 7.0f);  // [inf 0 0]; rolled [0 0 inf]
  EXPECT_EQ(q.Step(2.0f), 7.0f);      // [2 0 inf]; [0 inf 2]
  EXPECT_EQ(q.Step(3.0f), 7.0f);      // [3 inf 2]; [0 2 3]
  EXPECT_EQ(q.Step(1.0f), 448.0f / 3.0f);  // [1 2 3]
}

TEST(CpuDelayedScalingTest, NanKeepsTheOldScale) {
  CpuOps ops;
  DelayedScaling q(&ops, 2, 3.0f, DelayedScalingArgs{});
  EXPECT_EQ(q.Step(NAN), 3.0f);  // [nan 0]; rolled [0 nan]
  EXPECT_EQ(q.Step(4.0f), 3.0f);  // [4 nan]: the window holds a NaN
  EXPECT_EQ(q.Step(4.0f), 112.0f);
  DelayedScalingArgs args;
  args.most_recent = true;
  DelayedScaling r(&ops, 2, 3.0f, args);
  EXPECT_EQ(r.Step(NAN), 3.0f);
  EXPECT_EQ(r.Step(4.0f), 112.0f);
}

TEST(CpuDelayedScalingTest, RejectsBadState) {
  CpuOps ops;
  Tensor history = MakeEmpty(ops, DType::kF32, {2, 2});
  Tensor scale = Scalar(ops, 1.0f), scale_inv = Scalar(ops, 1.0f);
  absl::Status s = ops.DelayedScalingUpdate(DelayedScalingArgs{}, &history, &scale, &scale_inv);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("amax_history"), absl::string_view::npos) << s;
  Tensor ok_history = MakeTensor(ops, DType::kF32, {2}, {1.0f, 0.0f});
  Tensor bf16_scale = MakeTensor(ops, DType::kBF16, {1}, {1.0f});
  EXPECT_EQ(ops.DelayedScalingUpdate(DelayedScalingArgs{}, &ok_history, &bf16_scale, &scale_inv)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ToFloatVector(ok_history), (std::vector<float>{1.0f, 0.0f}));  // untouched
}

// A step's updates in one call: each entry as its own DelayedScalingUpdate,
// and non_finite += the entries whose amax was inf or NaN (the ones that kept
// their scale for it; a zero window keeps its scale too but is not counted).
TEST(CpuDelayedScalingTest, UpdatesCountInfAndNanAmaxes) {
  CpuOps ops;
  struct Case {
    std::vector<float> history;
    bool most_recent;
    bool counted;
  };
  const std::vector<Case> cases = {
      {{2.0f, 1.0f, 0.5f}, false, false},
      {{0.0f, 0.0f}, false, false},             // zero: scale kept, not an overflow
      {{1.0f, INFINITY, 3.0f}, false, true},    // inf in the window
      {{1.0f, 2.0f, NAN}, false, true},         // NaN in the window
      {{4.0f, INFINITY}, true, false},          // most_recent reads history[0] only
      {{-INFINITY, 1.0f}, true, true},
      {{NAN}, true, true},
  };
  std::vector<Ops::DelayedScalingItem> items;
  std::vector<Tensor> histories, expected_histories, expected_scales;
  for (const Case& c : cases) {
    Ops::DelayedScalingItem item;
    item.args.most_recent = c.most_recent;
    item.amax_history = MakeTensor(ops, DType::kF32, {static_cast<int64_t>(c.history.size())},
                                   c.history);
    item.scale = Scalar(ops, 3.0f);
    items.push_back(item);
    Tensor h = MakeTensor(ops, DType::kF32, {static_cast<int64_t>(c.history.size())}, c.history);
    Tensor scale = Scalar(ops, 3.0f), scale_inv = Scalar(ops, 0.0f);
    ASSERT_TRUE(ops.DelayedScalingUpdate(item.args, &h, &scale, &scale_inv).ok());
    expected_histories.push_back(h);
    expected_scales.push_back(scale);
  }
  Tensor non_finite = Scalar(ops, 2.0f);  // added to, not overwritten
  ASSERT_TRUE(ops.DelayedScalingUpdates(items, &non_finite).ok());
  EXPECT_EQ(ScalarValue(non_finite), 2.0f + 4.0f);
  for (size_t i = 0; i < items.size(); ++i) {
    const std::vector<float> got = ToFloatVector(items[i].amax_history);
    const std::vector<float> want = ToFloatVector(expected_histories[i]);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << i;
    EXPECT_EQ(ScalarValue(items[i].scale), ScalarValue(expected_scales[i])) << i;
  }
  // Without a counter the updates are the same and nothing is counted.
  Tensor h = MakeTensor(ops, DType::kF32, {2}, {INFINITY, 1.0f});
  Ops::DelayedScalingItem item;
  item.amax_history = h;
  item.scale = Scalar(ops, 3.0f);
  ASSERT_TRUE(ops.DelayedScalingUpdates({item}, nullptr).ok());
  EXPECT_EQ(ScalarValue(item.scale), 3.0f);
}

TEST(CpuDelayedScalingTest, UpdatesRefuseABadCounterOrEntryBeforeAnyMoves) {
  CpuOps ops;
  Ops::DelayedScalingItem good;
  good.amax_history = MakeTensor(ops, DType::kF32, {2}, {2.0f, 1.0f});
  good.scale = Scalar(ops, 3.0f);
  Tensor wide = MakeTensor(ops, DType::kF32, {2}, {0.0f, 0.0f});
  absl::Status s = ops.DelayedScalingUpdates({good}, &wide);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("non_finite"), absl::string_view::npos) << s;
  Ops::DelayedScalingItem bad = good;
  bad.amax_history = MakeTensor(ops, DType::kBF16, {2}, {1.0f, 1.0f});
  Tensor non_finite = Scalar(ops, 0.0f);
  EXPECT_EQ(ops.DelayedScalingUpdates({good, bad}, &non_finite).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ToFloatVector(good.amax_history), (std::vector<float>{2.0f, 1.0f}));  // untouched
  EXPECT_EQ(ScalarValue(good.scale), 3.0f);
}

// ---- block scaling -----------------------------------------------------------------

// MXFP8 as TE scales it: block scale 2^ceil(log2(amax / 448)), values cast to E4M3.
std::vector<double> ReferenceMxfp8(const std::vector<double>& x) {
  std::vector<double> y(x.size(), 0.0);
  for (size_t b = 0; b < x.size(); b += 32) {
    double amax = 0.0;
    for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    if (amax == 0.0) continue;
    const double scale = std::exp2(std::ceil(std::log2(amax / 448.0)));
    for (size_t i = b; i < b + 32; ++i) {
      y[i] = RoundTo(DType::kE4M3, static_cast<float>(x[i] / scale)) * scale;
    }
  }
  return y;
}

// NVFP4: global scale amax / (448 * 6); per 16 values an E4M3 block scale
// block_amax / 6 / global; values rounded to E2M1.
std::vector<double> ReferenceNvfp4(const std::vector<double>& x) {
  const double global = MaxAbs(x) / (448.0 * 6.0);
  std::vector<double> y(x.size(), 0.0);
  for (size_t b = 0; b < x.size(); b += 16) {
    double amax = 0.0;
    for (size_t i = b; i < b + 16; ++i) amax = std::max(amax, std::fabs(x[i]));
    const double block_scale = RoundTo(DType::kE4M3, static_cast<float>(amax / 6.0 / global));
    if (block_scale == 0.0) continue;
    for (size_t i = b; i < b + 16; ++i) {
      const double s = block_scale * global;
      y[i] = RoundToE2M1(static_cast<float>(x[i] / s)) * s;
    }
  }
  return y;
}

// What the formats allow (relative): MXFP8 is E4M3 with the block max in
// [256, 512) after scaling, so at worst saturation of the top binade (448 vs
// 511) plus half an ulp; NVFP4's E2M1 has one mantissa bit.
constexpr double kMxfp8Tolerance = 0.07;
constexpr double kNvfp4Tolerance = 0.2;
// Against the float64 reference the emulation differs only where float32
// rounding moves a value across a rounding boundary.
constexpr double kBlockReferenceTolerance = 1e-2;

class BlockScalingTest
    : public ::testing::TestWithParam<std::tuple<BlockFormat, DType, Shape>> {};

TEST_P(BlockScalingTest, MatchesReference) {
  const auto [format, dtype, shape] = GetParam();
  CpuOps ops;
  // Rows of very different magnitude, so block scales differ.
  std::vector<float> values = testing::RandomValues(NumElements(shape), 25);
  for (size_t i = 0; i < values.size(); ++i) values[i] *= std::exp2(static_cast<int>(i / 16 % 9) - 4);
  Tensor x = MakeTensor(ops, dtype, shape, values);
  Tensor y = MakeEmpty(ops, dtype, shape);
  ASSERT_TRUE(ops.FakeQuantizeBlockScaled(format, x, &y).ok());
  const std::vector<double> xv = ToDoubles(x);
  const bool mx = format == BlockFormat::kMXFP8;
  std::vector<double> ref = mx ? ReferenceMxfp8(xv) : ReferenceNvfp4(xv);
  for (double& v : ref) v = RoundTo(dtype, static_cast<float>(v));
  EXPECT_LT(RelativeError(y, ref), kBlockReferenceTolerance);
  EXPECT_LT(RelativeError(y, xv), mx ? kMxfp8Tolerance : kNvfp4Tolerance);
  if (mx && dtype == DType::kF32) {
    // Every output is an E4M3 value times its block's power of two.
    std::vector<double> yv = ToDoubles(y);
    for (size_t b = 0; b < yv.size(); b += 32) {
      double amax = 0.0;
      for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(xv[i]));
      const double scale = std::exp2(std::ceil(std::log2(amax / 448.0)));
      for (size_t i = b; i < b + 32; ++i) {
        const float q = static_cast<float>(yv[i] / scale);
        ASSERT_EQ(RoundTo(DType::kE4M3, q), q) << "element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Formats, BlockScalingTest,
    ::testing::Combine(::testing::Values(BlockFormat::kMXFP8, BlockFormat::kNVFP4),
                       ::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(Shape{3, 64}, Shape{33, 96}, Shape{1, 32})));

TEST(CpuBlockScalingTest, HandWorkedMxfp8Block) {
  CpuOps ops;
  // amax 500: ceil(log2(500 / 448)) = 1, scale 2: 250 rounds to 256 (E4M3
  // step 16 there) -> 512; 1.0625 / 2 = 0.53125 is a tie between 0.5 and
  // 0.5625 and rounds to even 0.5 -> 1; -3.3 / 2 -> -1.625 -> -3.25; 0.0009 / 2
  // is under half of E4M3's smallest subnormal 2^-9 and underflows to 0.
  std::vector<float> v(32, 0.0f);
  v[0] = 500.0f;
  v[1] = 1.0625f;
  v[2] = -3.3f;
  v[3] = 0.0009f;
  Tensor x = MakeTensor(ops, DType::kF32, {1, 32}, v);
  Tensor y = MakeEmpty(ops, DType::kF32, {1, 32});
  ASSERT_TRUE(ops.FakeQuantizeBlockScaled(BlockFormat::kMXFP8, x, &y).ok());
  EXPECT_EQ(LoadAsFloat(y, 0), 512.0f);
  EXPECT_EQ(LoadAsFloat(y, 1), 1.0f);
  EXPECT_EQ(LoadAsFloat(y, 2), -3.25f);
  EXPECT_EQ(LoadAsFloat(y, 3), 0.0f);
}

TEST(CpuBlockScalingTest, ZeroBlocksStayZero) {
  CpuOps ops;
  for (BlockFormat format : {BlockFormat::kMXFP8, BlockFormat::kNVFP4}) {
    std::vector<float> v = testing::RandomValues(64, 26);
    for (int i = 0; i < 32; ++i) v[i] = 0.0f;  // first block(s) zero
    Tensor x = MakeTensor(ops, DType::kF32, {1, 64}, v);
    Tensor y = MakeEmpty(ops, DType::kF32, {1, 64});
    ASSERT_TRUE(ops.FakeQuantizeBlockScaled(format, x, &y).ok());
    for (int i = 0; i < 32; ++i) EXPECT_EQ(LoadAsFloat(y, i), 0.0f);
    double nonzero = 0.0;
    for (int i = 32; i < 64; ++i) nonzero += std::fabs(LoadAsFloat(y, i));
    EXPECT_GT(nonzero, 0.0);
  }
  Tensor zeros = MakeTensor(ops, DType::kF32, {2, 16}, std::vector<float>(32, 0.0f));
  Tensor y = MakeEmpty(ops, DType::kF32, {2, 16});
  ASSERT_TRUE(ops.FakeQuantizeBlockScaled(BlockFormat::kNVFP4, zeros, &y).ok());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(LoadAsFloat(y, i), 0.0f);
}

TEST(CpuBlockScalingTest, TheTensorMaxIsExactInNvfp4) {
  // The block holding the tensor's amax gets block scale 448 (exact in E4M3),
  // so its max maps to E2M1's 6 and back to itself.
  CpuOps ops;
  std::vector<float> v = testing::RandomValues(48, 27, -1.0f, 1.0f);
  v[20] = -5.75f;
  Tensor x = MakeTensor(ops, DType::kF32, {1, 48}, v);
  Tensor y = MakeEmpty(ops, DType::kF32, {1, 48});
  ASSERT_TRUE(ops.FakeQuantizeBlockScaled(BlockFormat::kNVFP4, x, &y).ok());
  EXPECT_FLOAT_EQ(LoadAsFloat(y, 20), -5.75f);
}

TEST(CpuBlockScalingTest, RejectsRaggedBlocks) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 48}, 28);
  Tensor y = MakeEmpty(ops, DType::kF32, {4, 48});
  absl::Status s = ops.FakeQuantizeBlockScaled(BlockFormat::kMXFP8, x, &y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("48"), absl::string_view::npos) << s;
  EXPECT_TRUE(ops.FakeQuantizeBlockScaled(BlockFormat::kNVFP4, x, &y).ok());
}

}  // namespace
}  // namespace te
