// CpuOps::Rotary and the T5 relative position bias against plain float64
// references, plus the identities they must satisfy (inverse rotation, adjoint).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"

namespace te {
namespace {

// Tolerances, as relative error = max |got - want| / max |want| over a tensor.
constexpr double kF32Tol = 1e-5;
constexpr double kBf16Tol = 1e-2;

double Tolerance(DType dtype) { return dtype == DType::kF32 ? kF32Tol : kBf16Tol; }

template <typename T>
double RelativeError(const std::vector<T>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double max_err = 0.0, max_want = 0.0;
  for (size_t n = 0; n < got.size() && n < want.size(); ++n) {
    max_err = std::max(max_err, std::abs(static_cast<double>(got[n]) - want[n]));
    max_want = std::max(max_want, std::abs(want[n]));
  }
  return max_want == 0.0 ? max_err : max_err / max_want;
}

std::vector<float> RandomValues(int64_t n, std::mt19937* rng) {
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = uniform(*rng);
  return v;
}

Tensor MakeTensor(CpuOps* ops, DType dtype, const Shape& shape, const std::vector<float>& values) {
  Tensor t = ops->Allocate(dtype, shape).value();
  FromFloatVector(values, &t);
  return t;
}

// ---- rotary ---------------------------------------------------------------------

// The rotation written out from the formula, in double. TE JAX's group methods:
// "consecutive" pairs (2i, 2i+1), "alternate" pairs (i, i + D/2).
std::vector<double> ReferenceRotary(const RotaryArgs& args, const std::vector<float>& x,
                                    const Shape& shape) {
  const int64_t B = shape[0], S = shape[1], H = shape[2], D = shape[3];
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < S; ++p)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * S + p) * H + h) * D;
        for (int64_t i = 0; i < D / 2; ++i) {
          const double timescale = static_cast<double>(args.min_timescale) *
                                   std::pow(static_cast<double>(args.max_timescale) /
                                                args.min_timescale,
                                            2.0 * i / D);
          const double position = static_cast<double>(args.position_offset + p);
          const double angle = (args.inverse ? -1.0 : 1.0) * position / timescale;
          const int64_t first = base + (args.consecutive ? 2 * i : i);
          const int64_t second = base + (args.consecutive ? 2 * i + 1 : i + D / 2);
          const double a = x[first], c = x[second];
          y[first] = a * std::cos(angle) - c * std::sin(angle);
          y[second] = c * std::cos(angle) + a * std::sin(angle);
        }
      }
  return y;
}

struct RotaryCase {
  Shape shape;
  bool consecutive;
  bool inverse;
  DType dtype;
  int64_t position_offset = 0;  // a decode step's token sits at its cache index
};

class RotaryTest : public ::testing::TestWithParam<RotaryCase> {};

TEST_P(RotaryTest, MatchesReference) {
  const RotaryCase& c = GetParam();
  CpuOps ops;
  std::mt19937 rng(static_cast<uint32_t>(NumElements(c.shape)));
  const Tensor x = MakeTensor(&ops, c.dtype, c.shape, RandomValues(NumElements(c.shape), &rng));
  Tensor y = ops.Allocate(c.dtype, c.shape).value();
  RotaryArgs args;
  args.consecutive = c.consecutive;
  args.inverse = c.inverse;
  args.position_offset = c.position_offset;
  ASSERT_TRUE(ops.Rotary(args, x, &y).ok());
  EXPECT_LE(RelativeError(ToFloatVector(y), ReferenceRotary(args, ToFloatVector(x), c.shape)),
            Tolerance(c.dtype));
}

TEST_P(RotaryTest, InverseUndoesForward) {
  const RotaryCase& c = GetParam();
  CpuOps ops;
  std::mt19937 rng(7);
  const std::vector<float> values = RandomValues(NumElements(c.shape), &rng);
  const Tensor x = MakeTensor(&ops, c.dtype, c.shape, values);
  Tensor y = ops.Allocate(c.dtype, c.shape).value();
  Tensor back = ops.Allocate(c.dtype, c.shape).value();
  RotaryArgs args;
  args.consecutive = c.consecutive;
  args.inverse = c.inverse;
  args.position_offset = c.position_offset;
  ASSERT_TRUE(ops.Rotary(args, x, &y).ok());
  args.inverse = !c.inverse;
  ASSERT_TRUE(ops.Rotary(args, y, &back).ok());
  const std::vector<float> x_rounded = ToFloatVector(x);
  EXPECT_LE(RelativeError(ToFloatVector(back),
                          std::vector<double>(x_rounded.begin(), x_rounded.end())),
            // bf16: y was rounded once more before the way back.
            c.dtype == DType::kF32 ? kF32Tol : 2 * kBf16Tol);
}

// y may alias x: a layer rotates q and k in place.
TEST_P(RotaryTest, InPlaceEqualsOutOfPlace) {
  const RotaryCase& c = GetParam();
  CpuOps ops;
  std::mt19937 rng(11);
  const std::vector<float> values = RandomValues(NumElements(c.shape), &rng);
  const Tensor x = MakeTensor(&ops, c.dtype, c.shape, values);
  Tensor y = ops.Allocate(c.dtype, c.shape).value();
  Tensor in_place = MakeTensor(&ops, c.dtype, c.shape, values);
  RotaryArgs args;
  args.consecutive = c.consecutive;
  args.inverse = c.inverse;
  args.position_offset = c.position_offset;
  ASSERT_TRUE(ops.Rotary(args, x, &y).ok());
  ASSERT_TRUE(ops.Rotary(args, in_place, &in_place).ok());
  EXPECT_EQ(ToFloatVector(in_place), ToFloatVector(y));
}

std::vector<RotaryCase> RotaryCases() {
  std::vector<RotaryCase> cases;
  for (const Shape& shape : std::vector<Shape>{{2, 7, 3, 8}, {1, 13, 2, 16}, {3, 5, 1, 6},
                                               {1, 300, 2, 64}}) {
    for (bool consecutive : {true, false}) {
      for (bool inverse : {false, true}) {
        for (DType dtype : {DType::kF32, DType::kBF16}) {
          cases.push_back({shape, consecutive, inverse, dtype});
        }
      }
    }
  }
  for (const Shape& shape : std::vector<Shape>{{2, 7, 3, 8}, {3, 1, 2, 64}}) {
    for (int64_t offset : {1, 4093}) {
      cases.push_back({shape, true, false, DType::kF32, offset});
      cases.push_back({shape, false, true, DType::kBF16, offset});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, RotaryTest, ::testing::ValuesIn(RotaryCases()),
    [](const ::testing::TestParamInfo<RotaryCase>& info) {
      const RotaryCase& c = info.param;
      std::string name;
      for (int64_t d : c.shape) name += std::to_string(d) + "x";
      name.pop_back();
      return name + (c.consecutive ? "_consecutive" : "_alternate") +
             (c.inverse ? "_inverse_" : "_") + DTypeName(c.dtype) +
             (c.position_offset > 0 ? "_from" + std::to_string(c.position_offset) : "");
    });

// Position 0 is not rotated; position 1 of the first pair turns by exactly 1
// radian (timescale_0 = min = 1): pins which elements pair up in each mode.
TEST(RotaryPairingTest, FirstPairTurnsByOneRadianPerPosition) {
  CpuOps ops;
  const Shape shape = {1, 2, 1, 4};
  const std::vector<float> values = {0.5f, -1.25f, 2.0f, 0.75f, 0.5f, -1.25f, 2.0f, 0.75f};
  const Tensor x = MakeTensor(&ops, DType::kF32, shape, values);
  Tensor y = ops.Allocate(DType::kF32, shape).value();
  for (bool consecutive : {true, false}) {
    RotaryArgs args;
    args.consecutive = consecutive;
    ASSERT_TRUE(ops.Rotary(args, x, &y).ok());
    const std::vector<float> got = ToFloatVector(y);
    for (int d = 0; d < 4; ++d) EXPECT_EQ(got[d], values[d]) << "position 0, element " << d;
    const int first = 4, second = consecutive ? 5 : 6;  // position 1, frequency 0
    const double a = values[first], b = values[second];
    EXPECT_NEAR(got[first], a * std::cos(1.0) - b * std::sin(1.0), 1e-6) << consecutive;
    EXPECT_NEAR(got[second], b * std::cos(1.0) + a * std::sin(1.0), 1e-6) << consecutive;
  }
}

TEST(RotaryErrorTest, RejectsBadArguments) {
  CpuOps ops;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  RotaryArgs args;
  Tensor odd = ops.Allocate(DType::kF32, {1, 2, 2, 5}).value();
  EXPECT_EQ(ops.Rotary(args, odd, &odd).code(), kInvalid);
  Tensor x = ops.Allocate(DType::kF32, {1, 2, 2, 4}).value();
  Tensor wrong_shape = ops.Allocate(DType::kF32, {1, 2, 4, 2}).value();
  EXPECT_EQ(ops.Rotary(args, x, &wrong_shape).code(), kInvalid);
  Tensor fp8 = ops.Allocate(DType::kE4M3, {1, 2, 2, 4}).value();
  EXPECT_EQ(ops.Rotary(args, x, &fp8).code(), kInvalid);
  args.min_timescale = 0.0f;
  EXPECT_EQ(ops.Rotary(args, x, &x).code(), kInvalid);
}

// A table made once (RotaryTable) and handed to Rotary gives the bits Rotary
// gives making its own, forward and inverse, from a position offset.
TEST(RotaryTableTest, RotaryWithTheTableEqualsRotaryWithout) {
  CpuOps ops;
  const int64_t b = 2, s = 7, h = 3, d = 10;
  std::mt19937 gen(43);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (const bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "inverse" : "forward");
    RotaryArgs args;
    args.inverse = inverse;
    args.position_offset = 5;
    args.max_timescale = 500.0f;
    Tensor x = ops.Allocate(DType::kF32, {b, s, h, d}).value();
    for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = dist(gen);
    Tensor plain = ops.Allocate(DType::kF32, x.shape()).value();
    ASSERT_TRUE(ops.Rotary(args, x, &plain).ok());
    absl::StatusOr<Tensor> table = ops.RotaryTable(args, s, d);
    ASSERT_TRUE(table.ok()) << table.status();
    EXPECT_EQ(table->shape(), (Shape{2, s, d / 2}));
    RotaryArgs with_table = args;
    with_table.table = *table;
    Tensor tabled = ops.Allocate(DType::kF32, x.shape()).value();
    ASSERT_TRUE(ops.Rotary(with_table, x, &tabled).ok());
    for (int64_t i = 0; i < x.numel(); ++i) {
      ASSERT_EQ(tabled.data_as<float>()[i], plain.data_as<float>()[i]) << "element " << i;
    }
    // Its values: cos then sin of each (row, frequency)'s angle.
    const double angle = (inverse ? -1.0 : 1.0) * (5 + 2);  // row 2, frequency 0: timescale 1
    EXPECT_FLOAT_EQ(table->data_as<float>()[2 * (d / 2)], static_cast<float>(std::cos(angle)));
    EXPECT_FLOAT_EQ(table->data_as<float>()[s * (d / 2) + 2 * (d / 2)],
                    static_cast<float>(std::sin(angle)));
  }
}

// A table of the wrong shape or dtype, or beside a device position, is
// refused naming it; RotaryTable refuses odd dims and args with a position.
TEST(RotaryTableTest, RejectsBadTablesNamingThem) {
  CpuOps ops;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor x = ops.Allocate(DType::kF32, {1, 4, 2, 6}).value();
  Tensor y = ops.Allocate(DType::kF32, x.shape()).value();
  RotaryArgs args;
  args.table = ops.Allocate(DType::kF32, {2, 5, 3}).value();  // 5 rows for S 4
  absl::Status s = ops.Rotary(args, x, &y);
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_NE(s.message().find("table"), std::string::npos) << s;
  args.table = ops.Allocate(DType::kBF16, {2, 4, 3}).value();
  EXPECT_EQ(ops.Rotary(args, x, &y).code(), kInvalid);
  args.table = *ops.RotaryTable(RotaryArgs(), 4, 6);
  EXPECT_TRUE(ops.Rotary(args, x, &y).ok());
  args.position = ops.Allocate(DType::kI32, {1}).value();
  args.position.data_as<int32_t>()[0] = 0;
  s = ops.Rotary(args, x, &y);
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_NE(s.message().find("table"), std::string::npos) << s;
  EXPECT_EQ(ops.RotaryTable(RotaryArgs(), 4, 5).status().code(), kInvalid);
  RotaryArgs positioned;
  positioned.position = args.position;
  EXPECT_EQ(ops.RotaryTable(positioned, 4, 6).status().code(), kInvalid);
}

// RotaryQkInPlace rotates q and k inside the packed qkv exactly as Rotary
// rotates them split out, and leaves v as it was (random data, both pair
// orders, forward and inverse).
TEST(RotaryQkInPlaceTest, EqualsRotaryOfTheSplitParts) {
  CpuOps ops;
  const int64_t b = 2, s = 5, h = 3, d = 8;
  std::mt19937 gen(41);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  for (const bool consecutive : {false, true}) {
    for (const bool inverse : {false, true}) {
      SCOPED_TRACE(std::string(consecutive ? "consecutive" : "alternate") +
                   (inverse ? " inverse" : ""));
      RotaryArgs args;
      args.consecutive = consecutive;
      args.inverse = inverse;
      args.position_offset = 3;
      Tensor qkv = ops.Allocate(DType::kF32, {b, s, 3, h, d}).value();
      for (int64_t i = 0; i < qkv.numel(); ++i) qkv.data_as<float>()[i] = dist(gen);
      const std::vector<float> before(qkv.data_as<float>(), qkv.data_as<float>() + qkv.numel());
      ASSERT_TRUE(ops.RotaryQkInPlace(args, &qkv).ok());
      for (int part = 0; part < 3; ++part) {
        Tensor split = ops.Allocate(DType::kF32, {b, s, h, d}).value();
        for (int64_t t = 0; t < b * s; ++t) {
          std::copy_n(before.data() + (t * 3 + part) * h * d, h * d,
                      split.data_as<float>() + t * h * d);
        }
        if (part < 2) ASSERT_TRUE(ops.Rotary(args, split, &split).ok());
        for (int64_t t = 0; t < b * s; ++t) {
          for (int64_t e = 0; e < h * d; ++e) {
            ASSERT_EQ(qkv.data_as<float>()[(t * 3 + part) * h * d + e],
                      split.data_as<float>()[t * h * d + e])
                << "part " << part << " token " << t << " element " << e;
          }
        }
      }
    }
  }
}

TEST(RotaryQkInPlaceTest, RejectsBadArguments) {
  CpuOps ops;
  RotaryArgs args;
  Tensor not_packed = ops.Allocate(DType::kF32, {1, 2, 2, 2, 4}).value();
  EXPECT_EQ(ops.RotaryQkInPlace(args, &not_packed).code(), absl::StatusCode::kInvalidArgument);
  Tensor odd = ops.Allocate(DType::kF32, {1, 2, 3, 2, 5}).value();
  EXPECT_EQ(ops.RotaryQkInPlace(args, &odd).code(), absl::StatusCode::kInvalidArgument);
  Tensor qkv = ops.Allocate(DType::kF32, {1, 2, 3, 2, 4}).value();
  args.min_timescale = 0.0f;
  EXPECT_EQ(ops.RotaryQkInPlace(args, &qkv).code(), absl::StatusCode::kInvalidArgument);
}

// RotaryQkQuantizeTranspose is RotaryQkInPlace, then QuantizeTranspose(Dbias)
// of the packed qkv's rows [B * S, 3 * H * D]: the same codes, transposed
// codes, amax, scale_inv and column sums, bit for bit (random bf16 data, with
// and without dbias).
TEST(RotaryQkQuantizeTransposeTest, EqualsRotationThenQuantization) {
  CpuOps ops;
  const int64_t b = 2, s = 6, h = 2, d = 8, rows = b * s, cols = 3 * h * d;
  std::mt19937 gen(43);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  auto scalar = [&](float v) {
    Tensor t = ops.Allocate(DType::kF32, {1}).value();
    t.data_as<float>()[0] = v;
    return t;
  };
  for (const bool with_dbias : {true, false}) {
    SCOPED_TRACE(with_dbias ? "dbias" : "no dbias");
    RotaryArgs args;
    args.consecutive = true;
    args.inverse = true;
    Tensor x = ops.Allocate(DType::kF32, {b, s, 3, h, d}).value();
    for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = dist(gen);
    Tensor fused = ops.Allocate(DType::kBF16, x.shape()).value();
    Tensor apart = ops.Allocate(DType::kBF16, x.shape()).value();
    ASSERT_TRUE(ops.Cast(x, &fused).ok());
    ASSERT_TRUE(ops.Cast(x, &apart).ok());
    struct Outputs {
      Tensor y, y_t, dbias, amax, scale_inv;
    };
    auto outputs = [&] {
      return Outputs{ops.Allocate(DType::kE5M2, {rows, cols}).value(),
                     ops.Allocate(DType::kE5M2, {cols, rows}).value(),
                     ops.Allocate(DType::kBF16, {cols}).value(), scalar(0.0f), scalar(0.0f)};
    };
    Outputs one = outputs(), two = outputs();
    const Tensor scale = scalar(900.0f);
    ASSERT_TRUE(ops.RotaryQkQuantizeTranspose(args, &fused, {scale, one.amax, one.scale_inv},
                                              &one.y, &one.y_t,
                                              with_dbias ? &one.dbias : nullptr)
                    .ok());
    ASSERT_TRUE(ops.RotaryQkInPlace(args, &apart).ok());
    const Tensor apart_rows = apart.Reshaped({rows, cols});
    const Fp8Output fp8{scale, two.amax, two.scale_inv};
    ASSERT_TRUE((with_dbias
                     ? ops.QuantizeTransposeDbias(apart_rows, fp8, &two.y, &two.y_t, &two.dbias)
                     : ops.QuantizeTranspose(apart_rows, fp8, &two.y, &two.y_t))
                    .ok());
    for (auto [a, c] : {std::pair{&one.y, &two.y}, std::pair{&one.y_t, &two.y_t},
                        std::pair{&one.amax, &two.amax},
                        std::pair{&one.scale_inv, &two.scale_inv}}) {
      ASSERT_EQ(0, std::memcmp(a->data(), c->data(), a->nbytes()));
    }
    if (with_dbias) ASSERT_EQ(0, std::memcmp(one.dbias.data(), two.dbias.data(), cols * 2));
    EXPECT_GT(one.amax.data_as<float>()[0], 0.0f);
  }
}

// Bad arguments are refused before qkv is rotated: INVALID_ARGUMENT naming
// the op, qkv as it was.
TEST(RotaryQkQuantizeTransposeTest, RejectsBadArgumentsAndLeavesQkv) {
  CpuOps ops;
  Tensor qkv = ops.Allocate(DType::kF32, {1, 4, 3, 2, 4}).value();
  for (int64_t i = 0; i < qkv.numel(); ++i) qkv.data_as<float>()[i] = 0.25f * (i % 7) - 0.5f;
  const std::vector<float> before(qkv.data_as<float>(), qkv.data_as<float>() + qkv.numel());
  Tensor scale = ops.Allocate(DType::kF32, {1}).value();
  scale.data_as<float>()[0] = 1.0f;
  Tensor amax = ops.Allocate(DType::kF32, {1}).value();
  Tensor scale_inv = ops.Allocate(DType::kF32, {1}).value();
  const Fp8Output fp8{scale, amax, scale_inv};
  Tensor y = ops.Allocate(DType::kE5M2, {4, 24}).value();
  Tensor y_t = ops.Allocate(DType::kE5M2, {24, 4}).value();
  Tensor wrong_y_t = ops.Allocate(DType::kE5M2, {4, 24}).value();
  Tensor wrong_dbias = ops.Allocate(DType::kF32, {23}).value();
  RotaryArgs args;
  absl::Status s = ops.RotaryQkQuantizeTranspose(args, &qkv, fp8, &y, &wrong_y_t, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("RotaryQkQuantizeTranspose"), std::string::npos) << s;
  s = ops.RotaryQkQuantizeTranspose(args, &qkv, fp8, &y, &y_t, &wrong_dbias);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  Tensor not_packed = ops.Allocate(DType::kF32, {1, 4, 2, 3, 4}).value();
  EXPECT_EQ(ops.RotaryQkQuantizeTranspose(args, &not_packed, fp8, &y, &y_t, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.RotaryQkQuantizeTranspose(args, nullptr, fp8, &y, &y_t, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  for (int64_t i = 0; i < qkv.numel(); ++i) ASSERT_EQ(qkv.data_as<float>()[i], before[i]) << i;
}

Tensor DevicePosition(CpuOps* ops, int32_t value) {
  Tensor t = ops->Allocate(DType::kI32, {1}).value();
  t.data_as<int32_t>()[0] = value;
  return t;
}

// A position on the device adds to position_offset: the same rotation as the
// sum given as position_offset alone.
TEST(RotaryDevicePositionTest, AddsToPositionOffset) {
  CpuOps ops;
  const Shape shape = {2, 5, 3, 16};
  std::mt19937 rng(31);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (bool consecutive : {true, false}) {
      const Tensor x = MakeTensor(&ops, dtype, shape, RandomValues(NumElements(shape), &rng));
      Tensor from_tensor = ops.Allocate(dtype, shape).value();
      Tensor from_offset = ops.Allocate(dtype, shape).value();
      RotaryArgs args;
      args.consecutive = consecutive;
      args.position_offset = 93;
      args.position = DevicePosition(&ops, 4000);
      ASSERT_TRUE(ops.Rotary(args, x, &from_tensor).ok());
      args.position = Tensor();
      args.position_offset = 4093;
      ASSERT_TRUE(ops.Rotary(args, x, &from_offset).ok());
      EXPECT_EQ(ToFloatVector(from_tensor), ToFloatVector(from_offset))
          << DTypeName(dtype) << (consecutive ? " consecutive" : " alternate");
    }
  }
}

TEST(RotaryErrorTest, RejectsABadPositionTensor) {
  CpuOps ops;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor x = ops.Allocate(DType::kF32, {1, 2, 2, 4}).value();
  RotaryArgs args;
  args.position = MakeTensor(&ops, DType::kF32, {1}, {3.0f});
  EXPECT_EQ(ops.Rotary(args, x, &x).code(), kInvalid);
  args.position = ops.Allocate(DType::kI32, {2}).value();
  EXPECT_EQ(ops.Rotary(args, x, &x).code(), kInvalid);
  args.position = DevicePosition(&ops, 3);
  EXPECT_TRUE(ops.Rotary(args, x, &x).ok());
}

// ---- a decode step's rows out of the packed qkv -----------------------------------

// DecodeQkvRows (Ops' default on the CPU) against the float64 rotation and
// plain copies: q is part 0 rotated, the cache rows p .. p + T - 1 hold part 1
// rotated and part 2 as it is, every other cache row keeps its value, and rows
// past the cache's end are skipped.
TEST(DecodeQkvRowsTest, SplitsRotatesAndWritesTheCacheRows) {
  CpuOps ops;
  std::mt19937 rng(41);
  const int64_t B = 2, T = 3, H = 2, D = 8, L = 9;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t p : {int64_t{2}, int64_t{7}}) {  // 7: the last token falls past L
      for (bool rotate : {true, false}) {
        SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << " p " << p << " rotate "
                                          << rotate);
        const Shape packed = {B, T, 3, H, D}, part = {B, T, H, D}, cache = {B, L, H, D};
        const std::vector<float> qkv_values = RandomValues(NumElements(packed), &rng);
        const std::vector<float> key_before = RandomValues(NumElements(cache), &rng);
        const std::vector<float> value_before = RandomValues(NumElements(cache), &rng);
        const Tensor qkv = MakeTensor(&ops, dtype, packed, qkv_values);
        Tensor q = ops.Allocate(dtype, part).value();
        Tensor key = MakeTensor(&ops, dtype, cache, key_before);
        Tensor value = MakeTensor(&ops, dtype, cache, value_before);
        RotaryArgs rotary;
        rotary.position_offset = 0;
        rotary.position = DevicePosition(&ops, static_cast<int32_t>(p));
        ASSERT_TRUE(ops.DecodeQkvRows(qkv, rotate ? &rotary : nullptr,
                                      DevicePosition(&ops, static_cast<int32_t>(p)), &q, &key,
                                      &value)
                        .ok());
        // The parts as stored (rounded to dtype), then the expectations.
        const std::vector<float> stored = ToFloatVector(qkv);
        std::vector<float> parts[3];
        for (int64_t n = 0; n < NumElements(part); ++n) {
          const int64_t bt = n / (H * D), hd = n % (H * D);
          for (int k = 0; k < 3; ++k) parts[k].push_back(stored[(bt * 3 + k) * H * D + hd]);
        }
        RotaryArgs at_p = rotary;
        at_p.position = Tensor();
        at_p.position_offset = p;
        const auto turned = [&](const std::vector<float>& x) {
          if (rotate) return ReferenceRotary(at_p, x, part);
          return std::vector<double>(x.begin(), x.end());
        };
        EXPECT_LT(RelativeError(ToFloatVector(q), turned(parts[0])), Tolerance(dtype)) << "q";
        const std::vector<double> new_keys = turned(parts[1]);
        const std::vector<float> key_after = ToFloatVector(key);
        const std::vector<float> value_after = ToFloatVector(value);
        const std::vector<float> key_kept = ToFloatVector(MakeTensor(&ops, dtype, cache, key_before));
        const std::vector<float> value_kept =
            ToFloatVector(MakeTensor(&ops, dtype, cache, value_before));
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t row = 0; row < L; ++row) {
            const int64_t t = row - p;
            for (int64_t hd = 0; hd < H * D; ++hd) {
              const int64_t at = (b * L + row) * H * D + hd;
              if (t < 0 || t >= T) {
                EXPECT_EQ(key_after[at], key_kept[at]) << "key row " << row << " changed";
                EXPECT_EQ(value_after[at], value_kept[at]) << "value row " << row << " changed";
                continue;
              }
              const int64_t from = (b * T + t) * H * D + hd;
              EXPECT_NEAR(key_after[at], new_keys[from], 2 * Tolerance(dtype)) << "key " << at;
              EXPECT_EQ(value_after[at], parts[2][from]) << "value " << at;
            }
          }
        }
      }
    }
  }
}

TEST(DecodeQkvRowsTest, RejectsMismatchedTensorsNamingThem) {
  CpuOps ops;
  const Tensor qkv = ops.Allocate(DType::kF32, {1, 1, 3, 2, 4}).value();
  Tensor q = ops.Allocate(DType::kF32, {1, 1, 2, 4}).value();
  Tensor key = ops.Allocate(DType::kF32, {1, 5, 2, 4}).value();
  Tensor value = ops.Allocate(DType::kF32, {1, 5, 2, 4}).value();
  Tensor bad_value = ops.Allocate(DType::kF32, {1, 5, 3, 4}).value();
  Tensor bad_q = ops.Allocate(DType::kBF16, {1, 1, 2, 4}).value();
  const Tensor position = DevicePosition(&ops, 0);
  const absl::Status value_status =
      ops.DecodeQkvRows(qkv, nullptr, position, &q, &key, &bad_value);
  EXPECT_EQ(value_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(value_status.message().find("value_cache"), std::string::npos) << value_status;
  const absl::Status q_status = ops.DecodeQkvRows(qkv, nullptr, position, &bad_q, &key, &value);
  EXPECT_EQ(q_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(q_status.message().find("q"), std::string::npos) << q_status;
  const Tensor not_packed = ops.Allocate(DType::kF32, {1, 1, 2, 2, 4}).value();
  EXPECT_EQ(ops.DecodeQkvRows(not_packed, nullptr, position, &q, &key, &value).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ops.DecodeQkvRows(qkv, nullptr, position, &q, &key, &value).ok());
}

// ---- T5 relative position bias -------------------------------------------------------

struct BiasSetup {
  int64_t num_buckets, heads, q_seq, kv_seq;
  Tensor table, buckets, dbias;
  std::vector<int32_t> bucket_of;  // [Sq * Skv]
  std::vector<float> table_values, dbias_values;
};

BiasSetup MakeBiasSetup(CpuOps* ops, DType table_dtype) {
  std::mt19937 rng(23);
  BiasSetup s{32, 3, 7, 13};
  s.table = MakeTensor(ops, table_dtype, {s.heads, s.num_buckets},
                       RandomValues(s.num_buckets * s.heads, &rng));
  s.table_values = ToFloatVector(s.table);
  s.buckets = ops->Allocate(DType::kI32, {s.q_seq, s.kv_seq}).value();
  std::uniform_int_distribution<int32_t> bucket(0, static_cast<int32_t>(s.num_buckets) - 1);
  for (int64_t n = 0; n < s.q_seq * s.kv_seq; ++n) {
    s.bucket_of.push_back(bucket(rng));
    s.buckets.data_as<int32_t>()[n] = s.bucket_of.back();
  }
  s.dbias = MakeTensor(ops, DType::kF32, {s.heads, s.q_seq, s.kv_seq},
                       RandomValues(s.heads * s.q_seq * s.kv_seq, &rng));
  s.dbias_values = ToFloatVector(s.dbias);
  return s;
}

class RelativeBiasTest : public ::testing::TestWithParam<DType> {};

TEST_P(RelativeBiasTest, ForwardGathersTableRows) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, GetParam());
  Tensor bias = ops.Allocate(DType::kF32, {s.heads, s.q_seq, s.kv_seq}).value();
  ASSERT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).ok());
  const std::vector<float> got = ToFloatVector(bias);
  for (int64_t h = 0; h < s.heads; ++h)
    for (int64_t n = 0; n < s.q_seq * s.kv_seq; ++n) {
      ASSERT_EQ(got[h * s.q_seq * s.kv_seq + n], s.table_values[h * s.num_buckets + s.bucket_of[n]])
          << "h " << h << " position " << n;
    }
}

// The bias in bf16 or f16 (an attention's operands' dtype) holds the float32
// bias rounded once.
TEST_P(RelativeBiasTest, ForwardWritesAnyFloatDtype) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, GetParam());
  Tensor bias = ops.Allocate(DType::kF32, {s.heads, s.q_seq, s.kv_seq}).value();
  ASSERT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).ok());
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    Tensor narrow = ops.Allocate(dtype, bias.shape()).value();
    ASSERT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &narrow).ok());
    Tensor rounded = ops.Allocate(dtype, bias.shape()).value();
    ASSERT_TRUE(ops.Cast(bias, &rounded).ok());
    EXPECT_EQ(ToFloatVector(narrow), ToFloatVector(rounded)) << DTypeName(dtype);
  }
}

TEST_P(RelativeBiasTest, BackwardScatterAddsGradients) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, GetParam());
  Tensor dtable = ops.Allocate(GetParam(), {s.heads, s.num_buckets}).value();
  ASSERT_TRUE(ops.RelativeBiasBackward(s.dbias, s.buckets, &dtable).ok());
  std::vector<double> want(static_cast<size_t>(s.num_buckets * s.heads), 0.0);
  for (int64_t h = 0; h < s.heads; ++h)
    for (int64_t n = 0; n < s.q_seq * s.kv_seq; ++n) {
      want[h * s.num_buckets + s.bucket_of[n]] += s.dbias_values[h * s.q_seq * s.kv_seq + n];
    }
  EXPECT_LE(RelativeError(ToFloatVector(dtable), want), Tolerance(GetParam()));
}

// Backward is the adjoint of forward: <forward(t), g> == <t, backward(g)>.
TEST_P(RelativeBiasTest, BackwardIsAdjointOfForward) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, DType::kF32);
  Tensor bias = ops.Allocate(DType::kF32, {s.heads, s.q_seq, s.kv_seq}).value();
  Tensor dtable = ops.Allocate(GetParam(), {s.heads, s.num_buckets}).value();
  ASSERT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).ok());
  ASSERT_TRUE(ops.RelativeBiasBackward(s.dbias, s.buckets, &dtable).ok());
  const std::vector<float> bias_values = ToFloatVector(bias), dtable_values = ToFloatVector(dtable);
  // Each side's rounding error scales with the sum of |terms|, not with the
  // (cancelling) sum itself.
  double forward_side = 0.0, backward_side = 0.0, magnitude = 0.0;
  for (size_t n = 0; n < bias_values.size(); ++n) {
    const double term = static_cast<double>(bias_values[n]) * s.dbias_values[n];
    forward_side += term;
    magnitude += std::abs(term);
  }
  for (size_t n = 0; n < dtable_values.size(); ++n) {
    backward_side += static_cast<double>(s.table_values[n]) * dtable_values[n];
  }
  EXPECT_LE(std::abs(forward_side - backward_side) / magnitude, Tolerance(GetParam()))
      << forward_side << " vs " << backward_side;
}

// With first_row r0, the rows r0 .. r0 + Sq - 1 of the bias computed from the
// whole bucket table, i.e. the bias of those buckets rows alone; rows at or
// past the table's R rows are 0.
TEST_P(RelativeBiasTest, ForwardFromAFirstRowReadsThoseRows) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, GetParam());
  const int64_t rows = s.q_seq, cols = s.kv_seq;
  for (const auto& [r0, q_rows] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {3, 1}, {6, 1}, {2, 4}, {5, 4}, {7, 2}, {0, 7}}) {
    Tensor bias = ops.Allocate(DType::kF32, {s.heads, q_rows, cols}).value();
    ASSERT_TRUE(ops.Fill(NAN, &bias).ok());
    ASSERT_TRUE(ops.RelativeBiasForward(s.table, s.buckets,
                                        DevicePosition(&ops, static_cast<int32_t>(r0)), &bias)
                    .ok());
    const std::vector<float> got = ToFloatVector(bias);
    const int64_t valid = std::max<int64_t>(0, std::min(q_rows, rows - r0));
    std::vector<float> want;
    if (valid > 0) {
      Tensor part = ops.Allocate(DType::kF32, {s.heads, valid, cols}).value();
      ASSERT_TRUE(
          ops.RelativeBiasForward(s.table, s.buckets.Slice0(r0, r0 + valid), Tensor(), &part).ok());
      want = ToFloatVector(part);
    }
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < q_rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const float expected = i < valid ? want[(h * valid + i) * cols + j] : 0.0f;
          ASSERT_EQ(got[(h * q_rows + i) * cols + j], expected)
              << "r0 " << r0 << " h " << h << " i " << i << " j " << j;
        }
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, RelativeBiasTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(RelativeBiasErrorTest, RejectsBadArguments) {
  CpuOps ops;
  BiasSetup s = MakeBiasSetup(&ops, DType::kF32);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor bias = ops.Allocate(DType::kF32, {s.heads, s.q_seq, s.kv_seq}).value();
  Tensor dtable = ops.Allocate(DType::kF32, {s.heads, s.num_buckets}).value();
  s.buckets.data_as<int32_t>()[5] = static_cast<int32_t>(s.num_buckets);  // one past the table
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).code(), kInvalid);
  EXPECT_EQ(ops.RelativeBiasBackward(s.dbias, s.buckets, &dtable).code(), kInvalid);
  s.buckets.data_as<int32_t>()[5] = 0;
  Tensor bias_int = ops.Allocate(DType::kI32, {s.heads, s.q_seq, s.kv_seq}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias_int).code(), kInvalid);
  Tensor dbias_bf16 = ops.Allocate(DType::kBF16, {s.heads, s.q_seq, s.kv_seq}).value();
  EXPECT_EQ(ops.RelativeBiasBackward(dbias_bf16, s.buckets, &dtable).code(), kInvalid);
  Tensor bias_wrong = ops.Allocate(DType::kF32, {s.heads, s.kv_seq, s.q_seq}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias_wrong).code(), kInvalid);
  Tensor dtable_wrong = ops.Allocate(DType::kF32, {s.heads + 1, s.num_buckets}).value();
  EXPECT_EQ(ops.RelativeBiasBackward(s.dbias, s.buckets, &dtable_wrong).code(), kInvalid);
  EXPECT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).ok());
}

TEST(RelativeBiasErrorTest, RejectsABadFirstRow) {
  CpuOps ops;
  const BiasSetup s = MakeBiasSetup(&ops, DType::kF32);
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  Tensor bias = ops.Allocate(DType::kF32, {s.heads, 1, s.kv_seq}).value();
  const Tensor f32_row = MakeTensor(&ops, DType::kF32, {1}, {2.0f});
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, f32_row, &bias).code(), kInvalid);
  const Tensor two_rows = ops.Allocate(DType::kI32, {2}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, two_rows, &bias).code(), kInvalid);
  const Tensor first_row = DevicePosition(&ops, 2);
  Tensor wrong_heads = ops.Allocate(DType::kF32, {s.heads + 1, 1, s.kv_seq}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, first_row, &wrong_heads).code(), kInvalid);
  Tensor wrong_keys = ops.Allocate(DType::kF32, {s.heads, 1, s.kv_seq + 1}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, first_row, &wrong_keys).code(), kInvalid);
  Tensor bias_int = ops.Allocate(DType::kI32, {s.heads, 1, s.kv_seq}).value();
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, first_row, &bias_int).code(), kInvalid);
  // Without first_row, Sq must be the bucket table's row count.
  EXPECT_EQ(ops.RelativeBiasForward(s.table, s.buckets, Tensor(), &bias).code(), kInvalid);
  EXPECT_TRUE(ops.RelativeBiasForward(s.table, s.buckets, first_row, &bias).ok());
}

}  // namespace
}  // namespace te
