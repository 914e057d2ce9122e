#include "proto/dtype.h"

#include "gtest/gtest.h"

namespace te {
namespace {

TEST(DTypeProtoTest, EveryDTypeRoundTrips) {
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kE4M3, DType::kE5M2,
                      DType::kI32, DType::kBool}) {
    const te::v1::DType wire = DTypeToProto(dtype);
    EXPECT_NE(wire, te::v1::DTYPE_UNSPECIFIED) << DTypeName(dtype);
    absl::StatusOr<DType> back = DTypeFromProto(wire, "x.dtype");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, dtype);
  }
}

TEST(DTypeProtoTest, EveryWireValueMapsOrIsRejected) {
  for (int v = te::v1::DType_MIN; v <= te::v1::DType_MAX; ++v) {
    const auto wire = static_cast<te::v1::DType>(v);
    absl::StatusOr<DType> dtype = DTypeFromProto(wire, "x.dtype");
    if (wire == te::v1::DTYPE_UNSPECIFIED) {
      EXPECT_FALSE(dtype.ok());
    } else {
      ASSERT_TRUE(dtype.ok()) << te::v1::DType_Name(wire) << " has no te::DType";
      EXPECT_EQ(DTypeToProto(*dtype), wire);
    }
  }
}

TEST(DTypeProtoTest, FloatDTypesMapAndOthersAreRejectedNamingTheField) {
  EXPECT_EQ(*FloatDTypeFromProto(te::v1::FLOAT32, "f"), DType::kF32);
  EXPECT_EQ(*FloatDTypeFromProto(te::v1::BFLOAT16, "f"), DType::kBF16);
  EXPECT_EQ(*FloatDTypeFromProto(te::v1::FLOAT16, "f"), DType::kF16);
  absl::StatusOr<DType> fp8 = FloatDTypeFromProto(te::v1::FLOAT8_E4M3, "spec.dtype");
  EXPECT_EQ(fp8.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fp8.status().message(),
            "spec.dtype: FLOAT8_E4M3 (4); want FLOAT32, BFLOAT16 or FLOAT16");
  absl::StatusOr<DType> unknown = FloatDTypeFromProto(static_cast<te::v1::DType>(99), "g");
  EXPECT_EQ(unknown.status().message(), "g:  (99); want FLOAT32, BFLOAT16 or FLOAT16");
}

TEST(DTypeProtoTest, RejectsUnspecifiedAndUnknownNamingTheField) {
  absl::StatusOr<DType> unspecified = DTypeFromProto(te::v1::DTYPE_UNSPECIFIED, "x.dtype");
  EXPECT_EQ(unspecified.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unspecified.status().message(), "x.dtype: dtype is unspecified");
  absl::StatusOr<DType> unknown = DTypeFromProto(static_cast<te::v1::DType>(99), "y.dtype");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(), "y.dtype: unknown dtype 99");
}

}  // namespace
}  // namespace te
