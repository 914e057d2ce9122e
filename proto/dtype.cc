#include "proto/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace te {

te::v1::DType DTypeToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32: return te::v1::FLOAT32;
    case DType::kBF16: return te::v1::BFLOAT16;
    case DType::kF16: return te::v1::FLOAT16;
    case DType::kE4M3: return te::v1::FLOAT8_E4M3;
    case DType::kE5M2: return te::v1::FLOAT8_E5M2;
    case DType::kI32: return te::v1::INT32;
    case DType::kBool: return te::v1::BOOL;
  }
  return te::v1::DTYPE_UNSPECIFIED;  // not reached: the switch covers DType
}

absl::StatusOr<DType> DTypeFromProto(te::v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case te::v1::FLOAT32: return DType::kF32;
    case te::v1::BFLOAT16: return DType::kBF16;
    case te::v1::FLOAT16: return DType::kF16;
    case te::v1::FLOAT8_E4M3: return DType::kE4M3;
    case te::v1::FLOAT8_E5M2: return DType::kE5M2;
    case te::v1::INT32: return DType::kI32;
    case te::v1::BOOL: return DType::kBool;
    case te::v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(field, ": dtype is unspecified"));
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": unknown dtype ", static_cast<int>(dtype)));
}

absl::StatusOr<DType> FloatDTypeFromProto(te::v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case te::v1::FLOAT32:
      return DType::kF32;
    case te::v1::BFLOAT16:
      return DType::kBF16;
    case te::v1::FLOAT16:
      return DType::kF16;
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", te::v1::DType_IsValid(dtype) ? te::v1::DType_Name(dtype) : "", " (",
                   static_cast<int>(dtype), "); want FLOAT32, BFLOAT16 or FLOAT16"));
}

}  // namespace te
