#include "kernels/op_checks.h"

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

std::string Describe(const Tensor& t) {
  return absl::StrCat(DTypeName(t.dtype()), " ", ShapeString(t.shape()));
}

}  // namespace

// ---- building blocks --------------------------------------------------------

bool IsComputeFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

absl::Status RequireDefined(const char* op, const char* name, const Tensor* t) {
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  if (t->numel() > 0 && t->data() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is undefined"));
  }
  return absl::OkStatus();
}

absl::Status RequireFloat(const char* op, const char* name, const Tensor* t) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (!IsComputeFloat(t->dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ",
                                                   DTypeName(t->dtype()),
                                                   ", want float32, bfloat16 or float16"));
  }
  return absl::OkStatus();
}

absl::Status RequireDType(const char* op, const char* name, const Tensor* t, DType want) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (t->dtype() != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ",
                                                   DTypeName(t->dtype()), ", want ",
                                                   DTypeName(want)));
  }
  return absl::OkStatus();
}

absl::Status RequireScalarF32(const char* op, const char* name, const Tensor* t) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (t->dtype() != DType::kF32 || t->numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", Describe(*t), ", want float32 [1]"));
  }
  return absl::OkStatus();
}

absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want,
                          const std::string& want_text) {
  if (t.shape() != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has shape ",
                                                   ShapeString(t.shape()), ", want ", want_text));
  }
  return absl::OkStatus();
}

absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  return RequireShape(op, name, t, want, ShapeString(want));
}

absl::Status RequireSameCount(const char* op, const char* name, const Tensor& t,
                              const char* other_name, const Tensor& other) {
  if (t.numel() != other.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has ", t.numel(),
                                                   " elements ", ShapeString(t.shape()), ", want ",
                                                   other.numel(), " like ", other_name, " ",
                                                   ShapeString(other.shape())));
  }
  return absl::OkStatus();
}

absl::Status CheckOutput(const char* op, const Tensor* y, const Fp8Output* fp8) {
  RETURN_IF_ERROR(RequireDefined(op, "y", y));
  if (IsFloat8(y->dtype())) {
    if (fp8 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": y has dtype ", DTypeName(y->dtype()), " but no Fp8Output (scale, amax) is given"));
    }
    RETURN_IF_ERROR(RequireScalarF32(op, "fp8.scale", &fp8->scale));
    RETURN_IF_ERROR(RequireScalarF32(op, "fp8.amax", &fp8->amax));
    RETURN_IF_ERROR(RequireScalarF32(op, "fp8.scale_inv", &fp8->scale_inv));
    return absl::OkStatus();
  }
  if (!IsComputeFloat(y->dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": y has dtype ", DTypeName(y->dtype()),
                                                   ", want float32, bfloat16, float16 or FP8"));
  }
  if (fp8 != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": an Fp8Output is given but y has dtype ", DTypeName(y->dtype()), ", not FP8"));
  }
  return absl::OkStatus();
}

int64_t Rows(const Tensor& t) {
  const int64_t cols = t.rank() == 0 ? 1 : t.dim(-1);
  return cols == 0 ? 0 : t.numel() / cols;
}

bool Wanted(const Tensor* t) { return t != nullptr && t->data() != nullptr; }

}  // namespace te
