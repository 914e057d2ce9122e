#include "client/tensor.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp8.h"

namespace te::client {
namespace {

// bf16 keeps 8 significant bits: round to nearest is within half an ulp, 2^-8 relative.
constexpr float kBf16RelativeBound = 1.0f / 256.0f;

TEST(HostTensorTest, Bf16RoundTripUsesTheExactCast) {
  const HostTensor f32 = HostTensor::RandomNormal({3, 5, 7}, DType::kF32, /*seed=*/11);
  const std::vector<float> values = f32.ToFloats();
  absl::StatusOr<HostTensor> bf16 = HostTensor::FromFloats({3, 5, 7}, values, DType::kBF16);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->dtype(), DType::kBF16);
  EXPECT_EQ(bf16->bytes().size(), 3u * 5 * 7 * 2);
  const std::vector<float> back = bf16->ToFloats();
  ASSERT_EQ(back.size(), values.size());
  int changed = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(back[i], RoundTo(DType::kBF16, values[i])) << i;
    EXPECT_LE(std::fabs(back[i] - values[i]), kBf16RelativeBound * std::fabs(values[i])) << i;
    changed += back[i] != values[i];
  }
  EXPECT_GT(changed, 0) << "random f32 values should not all be bf16 already";

  // Values on the bf16 grid survive a second trip bit for bit.
  absl::StatusOr<HostTensor> again = HostTensor::FromFloats({3, 5, 7}, back, DType::kBF16);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->bytes(), bf16->bytes());
}

TEST(HostTensorTest, Bf16RoundsTiesToEven) {
  const float halfway_down = 1.0f + std::ldexp(1.0f, -8);      // between 1 and 1 + 2^-7: to 1
  const float halfway_up = 1.0f + 3.0f * std::ldexp(1.0f, -8);  // between 1 + 2^-7 and 1 + 2^-6: to the even
  absl::StatusOr<HostTensor> t = HostTensor::FromFloats({2}, {halfway_down, halfway_up}, DType::kBF16);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->ToFloats(), (std::vector<float>{1.0f, 1.0f + std::ldexp(1.0f, -6)}));
}

TEST(HostTensorTest, Fp8SaturatesAndIntegersRound) {
  absl::StatusOr<HostTensor> e4m3 = HostTensor::FromFloats({3}, {1000.0f, -1000.0f, 0.3f}, DType::kE4M3);
  ASSERT_TRUE(e4m3.ok());
  const std::vector<float> v = e4m3->ToFloats();
  EXPECT_EQ(v[0], 448.0f);
  EXPECT_EQ(v[1], -448.0f);
  EXPECT_EQ(v[2], RoundTo(DType::kE4M3, 0.3f));
  absl::StatusOr<HostTensor> ints = HostTensor::FromFloats({2}, {2.6f, -1.2f}, DType::kI32);
  ASSERT_TRUE(ints.ok());
  EXPECT_EQ(ints->ToFloats(), (std::vector<float>{3.0f, -1.0f}));
}

TEST(HostTensorTest, BadSizesAreInvalidArgument) {
  EXPECT_EQ(HostTensor::FromFloats({2, 3}, std::vector<float>(5, 1.0f)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostTensor::FromBytes(DType::kBF16, {4}, std::string(7, '\0')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostTensor::FromBytes(DType::kF32, {-1}, "").status().code(), absl::StatusCode::kInvalidArgument);
  const HostTensor t = HostTensor::RandomNormal({4, 6}, DType::kF32, 1);
  EXPECT_EQ(t.Reshaped({5, 5}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(t.Reshaped({2, 12}).ok());
}

TEST(HostTensorTest, RandomNormalIsSeededAndStandard) {
  const HostTensor a = HostTensor::RandomNormal({64, 64}, DType::kF32, 42);
  const HostTensor b = HostTensor::RandomNormal({64, 64}, DType::kF32, 42);
  const HostTensor c = HostTensor::RandomNormal({64, 64}, DType::kF32, 43);
  EXPECT_EQ(a.bytes(), b.bytes());
  EXPECT_NE(a.bytes(), c.bytes());
  double sum = 0.0, sum_sq = 0.0;
  for (float v : a.ToFloats()) {
    sum += v;
    sum_sq += static_cast<double>(v) * v;
  }
  const double n = 64.0 * 64.0;
  EXPECT_NEAR(sum / n, 0.0, 0.05);            // 3 standard errors of the mean
  EXPECT_NEAR(sum_sq / n, 1.0, 0.07);
}

TEST(HostTensorTest, SplitAndConcatAreInverse) {
  const HostTensor qkv = HostTensor::RandomNormal({2, 3, 4, 6}, DType::kBF16, 5);
  absl::StatusOr<std::vector<HostTensor>> parts = SplitLastAxis(qkv, 3);
  ASSERT_TRUE(parts.ok());
  ASSERT_EQ(parts->size(), 3u);
  EXPECT_EQ((*parts)[1].shape(), (Shape{2, 3, 4, 2}));
  // Element [0,0,0,2] of the whole is element [0,0,0,0] of the second part.
  EXPECT_EQ((*parts)[1].ToFloats()[0], qkv.ToFloats()[2]);
  absl::StatusOr<HostTensor> joined = ConcatLastAxis(*parts);
  ASSERT_TRUE(joined.ok());
  EXPECT_EQ(joined->bytes(), qkv.bytes());
  EXPECT_EQ(SplitLastAxis(qkv, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(HostTensorTest, AddAndVdot) {
  const HostTensor a = HostTensor::RandomNormal({8, 3}, DType::kBF16, 1);
  const HostTensor b = HostTensor::RandomNormal({8, 3}, DType::kBF16, 2);
  absl::StatusOr<HostTensor> sum = Add(a, b);
  ASSERT_TRUE(sum.ok());
  const std::vector<float> x = a.ToFloats(), y = b.ToFloats(), s = sum->ToFloats();
  double dot = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(s[i], RoundTo(DType::kBF16, x[i] + y[i]));
    dot += static_cast<double>(x[i]) * y[i];
  }
  absl::StatusOr<double> vdot = Vdot(a, b);
  ASSERT_TRUE(vdot.ok());
  EXPECT_DOUBLE_EQ(*vdot, dot);
  EXPECT_EQ(Add(a, HostTensor::RandomNormal({3, 8}, DType::kBF16, 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostTensorTest, CausalMaskMasksTheFuture) {
  const HostTensor mask = CausalMask(2, 4);
  EXPECT_EQ(mask.dtype(), DType::kBool);
  EXPECT_EQ(mask.shape(), (Shape{2, 1, 4, 4}));
  const std::vector<float> m = mask.ToFloats();
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) EXPECT_EQ(m[(b * 4 + i) * 4 + j], j > i ? 1.0f : 0.0f);
}

TEST(HostTensorTest, InlineProtoRoundTrip) {
  const HostTensor t = HostTensor::RandomNormal({2, 5}, DType::kBF16, 9);
  const te::v1::Tensor proto = ToInlineProto(t);
  EXPECT_EQ(proto.dtype(), te::v1::BFLOAT16);
  absl::StatusOr<HostTensor> back = FromInlineProto(proto, "y");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->bytes(), t.bytes());
  EXPECT_EQ(back->shape(), t.shape());

  te::v1::Tensor truncated = proto;
  truncated.mutable_inline_data()->pop_back();
  absl::Status status = FromInlineProto(truncated, "y").status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("y"), std::string::npos) << status;
}

}  // namespace
}  // namespace te::client
