// The number formats of kernels/fp8.h at their edges: ties to even,
// subnormals, saturation (FP8) and overflow (bf16/fp16), NaN and inf, and
// exhaustive round trips of every code. Decoded values are checked against
// an independent float64 formula.
#include "kernels/fp8.h"

#include <cfloat>
#include <cmath>
#include <algorithm>
#include <cstdint>

#include "gtest/gtest.h"

namespace te {
namespace {

// The value of a sign/exponent/mantissa code, IEEE style (no inf/NaN here).
double DecodeReference(uint32_t code, int ebits, int mbits, int bias) {
  const uint32_t sign = code >> (ebits + mbits);
  const uint32_t exp = (code >> mbits) & ((1u << ebits) - 1);
  const uint32_t mant = code & ((1u << mbits) - 1);
  const double frac = static_cast<double>(mant) / (1u << mbits);
  const double v = exp == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, exp - bias);
  return sign ? -v : v;
}

// ---- bf16 ---------------------------------------------------------------------

TEST(Bf16Test, RoundsToNearestTiesToEven) {
  // Between 1 and 1 + 2^-7 (bf16's ulp at 1).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);  // tie -> even
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8))),
            1.0f + std::ldexp(1.0f, -6));  // tie -> even (up)
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));  // past the tie -> up
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-1.0f - std::ldexp(1.0f, -8))), -1.0f);
}

TEST(Bf16Test, SubnormalsInfNanAndOverflow) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(std::ldexp(1.0f, -133))), std::ldexp(1.0f, -133));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(INFINITY)), INFINITY);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-INFINITY)), -INFINITY);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(FLT_MAX)), INFINITY);  // rounds past bf16's max
  EXPECT_EQ(Bf16ToFloat(0x7f7f), 3.3895313892515355e38f);  // bf16's max is exact
}

TEST(Bf16Test, EveryCodeRoundTrips) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const float v = Bf16ToFloat(static_cast<uint16_t>(code));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(v))));
      continue;
    }
    ASSERT_EQ(FloatToBf16(v), code) << std::hex << code;
  }
}

// ---- fp16 ---------------------------------------------------------------------

TEST(Fp16Test, RoundsToNearestTiesToEven) {
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.0f + 3 * std::ldexp(1.0f, -11))),
            1.0f + std::ldexp(1.0f, -9));
  // Subnormals: quantum 2^-24.
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(std::ldexp(1.0f, -25))), 0.0f);  // tie -> even 0
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.5f * std::ldexp(1.0f, -24))),
            std::ldexp(1.0f, -23));  // tie between 1 and 2 quanta -> 2
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(0.75f * std::ldexp(1.0f, -24))), std::ldexp(1.0f, -24));
}

TEST(Fp16Test, OverflowsToInf) {
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65504.0f)), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65519.0f)), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65520.0f)), INFINITY);  // the tie rounds to even: inf
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(-1e6f)), -INFINITY);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(INFINITY)), INFINITY);
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(NAN))));
}

TEST(Fp16Test, EveryCodeRoundTripsAndDecodes) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const float v = Fp16ToFloat(static_cast<uint16_t>(code));
    const bool special = ((code >> 10) & 0x1f) == 0x1f;
    if (special) {
      EXPECT_EQ(std::isnan(v), (code & 0x3ff) != 0) << std::hex << code;
      if (!std::isnan(v)) {
        ASSERT_EQ(FloatToFp16(v), code);
      }
      continue;
    }
    ASSERT_EQ(static_cast<double>(v), DecodeReference(code, 5, 10, 15)) << std::hex << code;
    ASSERT_EQ(FloatToFp16(v), code) << std::hex << code;
  }
}

// ---- FP8 ----------------------------------------------------------------------

TEST(E4M3Test, EdgesTiesSubnormalsSaturation) {
  auto round = [](float x) { return E4M3ToFloat(FloatToE4M3(x)); };
  EXPECT_EQ(round(448.0f), 448.0f);
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7e);
  EXPECT_EQ(round(464.0f), 448.0f);  // past the max: saturates, never NaN
  EXPECT_EQ(round(1e9f), 448.0f);
  EXPECT_EQ(round(INFINITY), 448.0f);
  EXPECT_EQ(round(-INFINITY), -448.0f);
  EXPECT_EQ(FloatToE4M3(NAN), 0x7f);
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0xff)));
  EXPECT_EQ(round(1.0625f), 1.0f);   // tie between 1 and 1.125 -> even
  EXPECT_EQ(round(1.1875f), 1.25f);  // tie between 1.125 and 1.25 -> even
  EXPECT_EQ(round(1.07f), 1.125f);
  // Subnormals: quantum 2^-9.
  EXPECT_EQ(round(std::ldexp(1.0f, -9)), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(round(std::ldexp(1.0f, -10)), 0.0f);                       // tie -> 0
  EXPECT_EQ(round(1.5f * std::ldexp(1.0f, -9)), std::ldexp(1.0f, -8));  // tie -> 2 quanta
  EXPECT_EQ(round(0.75f * std::ldexp(1.0f, -9)), std::ldexp(1.0f, -9));
  EXPECT_EQ(round(std::ldexp(0.875f, -6)), std::ldexp(0.875f, -6));  // largest subnormal
  EXPECT_EQ(FloatToE4M3(-0.0f) & 0x7f, 0);
}

TEST(E5M2Test, EdgesTiesSubnormalsSaturation) {
  auto round = [](float x) { return E5M2ToFloat(FloatToE5M2(x)); };
  EXPECT_EQ(round(57344.0f), 57344.0f);
  EXPECT_EQ(FloatToE5M2(57344.0f), 0x7b);
  EXPECT_EQ(round(61440.0f), 57344.0f);  // the tie with 65536 saturates
  EXPECT_EQ(round(INFINITY), 57344.0f);
  EXPECT_EQ(round(-INFINITY), -57344.0f);
  EXPECT_EQ(E5M2ToFloat(0x7c), INFINITY);
  EXPECT_EQ(E5M2ToFloat(0xfc), -INFINITY);
  EXPECT_TRUE(std::isnan(round(NAN)));
  EXPECT_EQ(round(1.125f), 1.0f);   // tie between 1 and 1.25 -> even
  EXPECT_EQ(round(1.375f), 1.5f);   // tie between 1.25 and 1.5 -> even
  EXPECT_EQ(round(std::ldexp(1.0f, -16)), std::ldexp(1.0f, -16));
  EXPECT_EQ(FloatToE5M2(std::ldexp(1.0f, -16)), 0x01);
  EXPECT_EQ(round(std::ldexp(1.0f, -17)), 0.0f);
  EXPECT_EQ(round(1.5f * std::ldexp(1.0f, -16)), std::ldexp(1.0f, -15));
}

struct Fp8Format {
  const char* name;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
  int mbits, bias;
  float max;
};

const Fp8Format kE4M3{"e4m3", FloatToE4M3, E4M3ToFloat, 3, 7, kE4M3Max};
const Fp8Format kE5M2{"e5m2", FloatToE5M2, E5M2ToFloat, 2, 15, kE5M2Max};

class Fp8FormatTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8FormatTest, All256CodesDecodeAndRoundTrip) {
  const Fp8Format& f = GetParam();
  for (uint32_t code = 0; code < 256; ++code) {
    const float v = f.decode(static_cast<uint8_t>(code));
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(f.decode(f.encode(v)))) << std::hex << code;
      continue;
    }
    if (std::isinf(v)) {  // E5M2 only: saturates on the way back
      EXPECT_EQ(f.decode(f.encode(v)), std::copysign(f.max, v));
      continue;
    }
    ASSERT_EQ(static_cast<double>(v), DecodeReference(code, 7 - f.mbits, f.mbits, f.bias))
        << f.name << " code " << std::hex << code;
    if (v == 0.0f) {
      ASSERT_EQ(f.encode(v) & 0x7f, 0);
      continue;
    }
    ASSERT_EQ(f.encode(v), code) << f.name << " code " << std::hex << code;
  }
}

TEST_P(Fp8FormatTest, EveryMidpointRoundsToTheEvenNeighbour) {
  const Fp8Format& f = GetParam();
  // Positive finite codes are increasing; between each neighbour pair the
  // midpoint goes to the even code, and a nudge either side decides it.
  for (uint32_t code = 0; code + 1 < 0x7f; ++code) {
    const float lo = f.decode(static_cast<uint8_t>(code));
    const float hi = f.decode(static_cast<uint8_t>(code + 1));
    if (std::isinf(hi) || std::isnan(hi)) break;
    ASSERT_LT(lo, hi);
    const float mid = 0.5f * (lo + hi);  // exact: FP8 values have few bits
    const uint32_t even = (code % 2 == 0) ? code : code + 1;
    ASSERT_EQ(f.encode(mid), even) << f.name << " between codes " << code << ", " << code + 1;
    ASSERT_EQ(f.encode(-mid), even | 0x80);
    ASSERT_EQ(f.encode(std::nextafter(mid, 0.0f)), code);
    ASSERT_EQ(f.encode(std::nextafter(mid, INFINITY)), code + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8FormatTest, ::testing::Values(kE4M3, kE5M2),
                         [](const ::testing::TestParamInfo<Fp8Format>& info) {
                           return std::string(info.param.name);
                         });

// The grid value nearest |x| in float64 (ties to the even quantum count, which
// is the even code), before saturation or overflow: the formats' definition,
// apart from the bit arithmetic the casts use.
double NearestOnGrid(double a, int mbits, int bias) {
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
  const int exp = std::max(e - 1, 1 - bias);
  const double quantum = std::ldexp(1.0, exp - mbits);
  return std::nearbyint(a / quantum) * quantum;
}

// Every float whose exponent reaches the format's grid, down to the values
// that round to zero: each sign, each exponent, the top 14 mantissa bits in
// every combination (the kept bits and the rounding bit of every format here
// lie among them), and the 9 low bits all clear, only the lowest set, or all
// set (the sticky bits that break a tie).
template <typename Check>
void SweepFloats(int min_exp, int max_exp, Check check) {
  for (uint32_t sign : {0u, 1u}) {
    for (int exp = min_exp; exp <= max_exp; ++exp) {
      for (uint32_t top = 0; top < (1u << 14); ++top) {
        for (uint32_t low : {0u, 1u, 0x1ffu}) {
          const uint32_t bits = sign << 31 | static_cast<uint32_t>(exp + 127) << 23 | top << 9 | low;
          check(BitsFloat(bits));
        }
      }
    }
  }
}

TEST_P(Fp8FormatTest, EncodesEveryFloatToTheNearestGridValue) {
  const Fp8Format& f = GetParam();
  SweepFloats(-f.bias - f.mbits - 3, 17, [&](float x) {
    const double nearest = std::min(NearestOnGrid(std::fabs(x), f.mbits, f.bias),
                                    static_cast<double>(f.max));
    ASSERT_EQ(std::fabs(static_cast<double>(f.decode(f.encode(x)))), nearest)
        << f.name << " " << std::hexfloat << x;
    ASSERT_EQ(f.encode(x) >> 7, FloatBits(x) >> 31) << f.name << " sign of " << x;
  });
}

TEST(Fp16Test, EncodesEveryFloatToTheNearestGridValue) {
  SweepFloats(-28, 17, [](float x) {
    const double nearest = NearestOnGrid(std::fabs(x), 10, 15);
    const double want = nearest > kFp16Max ? INFINITY : nearest;
    ASSERT_EQ(std::fabs(static_cast<double>(Fp16ToFloat(FloatToFp16(x)))), want)
        << std::hexfloat << x;
    ASSERT_EQ(FloatToFp16(x) >> 15, FloatBits(x) >> 31) << x;
  });
}

// ---- E2M1 (NVFP4 values) -----------------------------------------------------------

TEST(E2M1Test, GridTiesAndSaturation) {
  for (float v : {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f}) {
    EXPECT_EQ(RoundToE2M1(v), v);
    EXPECT_EQ(RoundToE2M1(-v), -v);
  }
  EXPECT_EQ(RoundToE2M1(0.25f), 0.0f);  // ties to even
  EXPECT_EQ(RoundToE2M1(0.75f), 1.0f);
  EXPECT_EQ(RoundToE2M1(1.25f), 1.0f);
  EXPECT_EQ(RoundToE2M1(2.5f), 2.0f);
  EXPECT_EQ(RoundToE2M1(3.5f), 4.0f);
  EXPECT_EQ(RoundToE2M1(5.0f), 4.0f);
  EXPECT_EQ(RoundToE2M1(5.1f), 6.0f);
  EXPECT_EQ(RoundToE2M1(7.0f), 6.0f);  // saturates
  EXPECT_EQ(RoundToE2M1(-1e30f), -6.0f);
  EXPECT_EQ(RoundToE2M1(INFINITY), 6.0f);
  EXPECT_TRUE(std::isnan(RoundToE2M1(NAN)));
}

TEST(RoundToTest, DispatchesOnDType) {
  const float x = 1.0f + std::ldexp(1.0f, -9) + std::ldexp(1.0f, -12);
  EXPECT_EQ(RoundTo(DType::kF32, x), x);
  EXPECT_EQ(RoundTo(DType::kBF16, x), 1.0f);
  EXPECT_EQ(RoundTo(DType::kF16, x), 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(RoundTo(DType::kE4M3, 1000.0f), 448.0f);
  EXPECT_EQ(RoundTo(DType::kE5M2, 1e6f), 57344.0f);
  EXPECT_EQ(Fp8Max(DType::kE4M3), 448.0f);
  EXPECT_EQ(Fp8Max(DType::kE5M2), 57344.0f);
}

}  // namespace
}  // namespace te
