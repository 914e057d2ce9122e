// Inverted dropout: the kept mask is exactly DropoutUniform(seed, i) >= rate,
// reproducible per seed, dropping about `rate`; kept values scaled by 1/(1-rate).
#include <cmath>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/rng.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::RelativeError;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;

std::vector<uint8_t> MaskBytes(const Tensor& mask) {
  const uint8_t* p = mask.data_as<const uint8_t>();
  return std::vector<uint8_t>(p, p + mask.numel());
}

TEST(CpuDropoutTest, MaskIsTheSharedRngExactly) {
  CpuOps ops;
  const float rate = 0.3f;
  const uint64_t seed = 0x1234abcdULL;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    Tensor x = MakeRandom(ops, dtype, {33, 65}, 71);
    Tensor y = MakeEmpty(ops, dtype, {33, 65});
    Tensor mask = MakeEmpty(ops, DType::kBool, {33, 65});
    ASSERT_TRUE(ops.DropoutForward(rate, seed, x, &y, &mask).ok());
    const std::vector<double> xv = ToDoubles(x);
    std::vector<double> ref(xv.size());
    for (int64_t i = 0; i < x.numel(); ++i) {
      const bool kept = DropoutUniform(seed, i) >= rate;
      ASSERT_EQ(mask.data_as<uint8_t>()[i], kept ? 1 : 0) << i;
      ref[i] = kept ? xv[i] / (1.0 - rate) : 0.0;
      if (!kept) {
        ASSERT_EQ(LoadAsFloat(y, i), 0.0f) << i;
      }
    }
    EXPECT_LT(RelativeError(y, ref), Tolerance(dtype)) << ShortName(dtype);
  }
}

TEST(CpuDropoutTest, SameSeedSameMaskOtherSeedOtherMask) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {7, 13}, 72);
  Tensor y = MakeEmpty(ops, DType::kF32, {7, 13});
  Tensor a = MakeEmpty(ops, DType::kBool, {7, 13});
  Tensor b = MakeEmpty(ops, DType::kBool, {7, 13});
  Tensor c = MakeEmpty(ops, DType::kBool, {7, 13});
  ASSERT_TRUE(ops.DropoutForward(0.5f, 1, x, &y, &a).ok());
  ASSERT_TRUE(ops.DropoutForward(0.5f, 1, x, &y, &b).ok());
  ASSERT_TRUE(ops.DropoutForward(0.5f, 2, x, &y, &c).ok());
  EXPECT_EQ(MaskBytes(a), MaskBytes(b));
  EXPECT_NE(MaskBytes(a), MaskBytes(c));
}

TEST(CpuDropoutTest, DropsAboutRate) {
  CpuOps ops;
  const int64_t n = 1 << 16;
  Tensor x = MakeRandom(ops, DType::kF32, {n}, 73);
  Tensor y = MakeEmpty(ops, DType::kF32, {n});
  Tensor mask = MakeEmpty(ops, DType::kBool, {n});
  for (float rate : {0.1f, 0.5f, 0.9f}) {
    ASSERT_TRUE(ops.DropoutForward(rate, 99, x, &y, &mask).ok());
    int64_t dropped = 0;
    for (uint8_t m : MaskBytes(mask)) dropped += m == 0;
    // Binomial: 5 standard deviations of n * rate * (1 - rate).
    const double sigma = std::sqrt(n * rate * (1.0 - rate));
    EXPECT_NEAR(static_cast<double>(dropped), n * rate, 5 * sigma) << "rate " << rate;
  }
}

TEST(CpuDropoutTest, RateZeroKeepsAllRateOneDropsAll) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {7, 13}, 74);
  Tensor y = MakeEmpty(ops, DType::kF32, {7, 13});
  Tensor mask = MakeEmpty(ops, DType::kBool, {7, 13});
  ASSERT_TRUE(ops.DropoutForward(0.0f, 5, x, &y, &mask).ok());
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(LoadAsFloat(y, i), LoadAsFloat(x, i));
    ASSERT_EQ(mask.data_as<uint8_t>()[i], 1);
  }
  ASSERT_TRUE(ops.DropoutForward(1.0f, 5, x, &y, &mask).ok());
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(LoadAsFloat(y, i), 0.0f);
}

TEST(CpuDropoutTest, BackwardAppliesTheSameMaskAndScale) {
  CpuOps ops;
  const float rate = 0.25f;
  Tensor x = MakeRandom(ops, DType::kBF16, {33, 65}, 75);
  Tensor y = MakeEmpty(ops, DType::kBF16, {33, 65});
  Tensor mask = MakeEmpty(ops, DType::kBool, {33, 65});
  ASSERT_TRUE(ops.DropoutForward(rate, 6, x, &y, &mask).ok());
  Tensor dy = MakeRandom(ops, DType::kBF16, {33, 65}, 76);
  Tensor dx = MakeEmpty(ops, DType::kBF16, {33, 65});
  ASSERT_TRUE(ops.DropoutBackward(rate, dy, mask, &dx).ok());
  const std::vector<double> dyv = ToDoubles(dy);
  std::vector<double> ref(dyv.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    ref[i] = mask.data_as<uint8_t>()[i] ? dyv[i] / (1.0 - rate) : 0.0;
  }
  EXPECT_LT(RelativeError(dx, ref), testing::kBf16Tolerance);
}

TEST(CpuDropoutTest, RejectsBadRateAndMask) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 4}, 77);
  Tensor y = MakeEmpty(ops, DType::kF32, {4, 4});
  Tensor mask = MakeEmpty(ops, DType::kBool, {4, 4});
  EXPECT_EQ(ops.DropoutForward(-0.1f, 1, x, &y, &mask).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.DropoutForward(NAN, 1, x, &y, &mask).code(), absl::StatusCode::kInvalidArgument);
  Tensor f32_mask = MakeEmpty(ops, DType::kF32, {4, 4});
  absl::Status s = ops.DropoutForward(0.1f, 1, x, &y, &f32_mask);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("mask"), absl::string_view::npos) << s;
  EXPECT_TRUE(ops.DropoutForward(0.1f, 1, x, &y, nullptr).ok());  // no mask wanted
}

}  // namespace
}  // namespace te
