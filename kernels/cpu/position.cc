// CPU reference position encodings: rotary embedding and the T5 relative
// position bias (a gather from a [buckets, heads] table, and its scatter-add).
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

bool IsPlainFloat(DType dtype) { return IsFloating(dtype) && !IsFloat8(dtype); }

absl::Status CheckDType(const char* op, const char* name, const Tensor& t, bool f32_only) {
  if (f32_only ? t.dtype() == DType::kF32 : IsPlainFloat(t.dtype())) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", name, " has dtype ", DTypeName(t.dtype()), ", expected ",
                   f32_only ? "float32" : "float32, bfloat16 or float16"));
}

absl::Status CheckShape(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has shape ",
                                                 ShapeString(t.shape()), ", expected ",
                                                 ShapeString(shape)));
}

// Checks buckets (int32 [Sq, Skv], each in [0, num_buckets)) and returns its values.
absl::StatusOr<const int32_t*> CheckBuckets(const char* op, const Tensor& buckets,
                                            int64_t num_buckets) {
  if (buckets.dtype() != DType::kI32 || buckets.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": buckets must be int32 [Sq, Skv], got ",
                                                   DTypeName(buckets.dtype()), " ",
                                                   ShapeString(buckets.shape())));
  }
  const int32_t* values = buckets.data_as<const int32_t>();
  for (int64_t n = 0; n < buckets.numel(); ++n) {
    if (values[n] < 0 || values[n] >= num_buckets) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": buckets[", n / buckets.dim(1), ", ", n % buckets.dim(1), "] = ",
                       values[n], " is outside the table's [0, ", num_buckets, ")"));
    }
  }
  return values;
}

}  // namespace

// The angle is computed in double: near position 10^4 a float angle is already
// off by up to 5e-4 radians, far more than a float32 result can carry.
absl::Status CpuOps::Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) {
  constexpr const char* kOp = "Rotary";
  if (x.rank() != 4 || x.dim(3) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x must be [B, S, H, D] with D even, got ", ShapeString(x.shape())));
  }
  if (!(args.min_timescale > 0.0f && args.max_timescale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": timescales must be positive, got [",
                                                   args.min_timescale, ", ",
                                                   args.max_timescale, "]"));
  }
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, /*f32_only=*/false));
  RETURN_IF_ERROR(CheckShape(kOp, "y", *y, x.shape()));
  RETURN_IF_ERROR(CheckDType(kOp, "y", *y, /*f32_only=*/false));

  const int64_t seq = x.dim(1), heads = x.dim(2), dim = x.dim(3), half = dim / 2;
  // cos / sin of the angle of (position p, frequency i) at [p * half + i].
  std::vector<float> cos_table(static_cast<size_t>(seq * half));
  std::vector<float> sin_table(static_cast<size_t>(seq * half));
  const double ratio = static_cast<double>(args.max_timescale) / args.min_timescale;
  for (int64_t i = 0; i < half; ++i) {
    const double timescale = args.min_timescale * std::pow(ratio, 2.0 * i / dim);
    for (int64_t p = 0; p < seq; ++p) {
      const double angle = (args.inverse ? -p : p) / timescale;
      cos_table[p * half + i] = static_cast<float>(std::cos(angle));
      sin_table[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }

  // The row is read whole before it is written, so y may alias x.
  std::vector<float> row(static_cast<size_t>(dim));
  const int64_t rows = dim == 0 ? 0 : x.numel() / dim;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = (r / heads) % seq;
    const int64_t base = r * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = LoadAsFloat(x, base + d);
    for (int64_t i = 0; i < half; ++i) {
      // TE JAX: "consecutive" pairs (2i, 2i+1); "alternate" pairs (i, i + D/2).
      const int64_t first = args.consecutive ? 2 * i : i;
      const int64_t second = args.consecutive ? 2 * i + 1 : i + half;
      const float c = cos_table[p * half + i], s = sin_table[p * half + i];
      const float a = row[first], b = row[second];
      StoreFromFloat(y, base + first, a * c - b * s);
      StoreFromFloat(y, base + second, b * c + a * s);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                         Tensor* bias) {
  constexpr const char* kOp = "RelativeBiasForward";
  if (table.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": table must be [buckets, heads], got ",
                                                   ShapeString(table.shape())));
  }
  RETURN_IF_ERROR(CheckDType(kOp, "table", table, /*f32_only=*/false));
  const int64_t num_buckets = table.dim(0), heads = table.dim(1);
  ASSIGN_OR_RETURN(const int32_t* bucket_of, CheckBuckets(kOp, buckets, num_buckets));
  RETURN_IF_ERROR(CheckShape(kOp, "bias", *bias, {heads, buckets.dim(0), buckets.dim(1)}));
  RETURN_IF_ERROR(CheckDType(kOp, "bias", *bias, /*f32_only=*/true));

  const int64_t positions = buckets.numel();  // Sq * Skv
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t n = 0; n < positions; ++n) {
      StoreFromFloat(bias, h * positions + n, LoadAsFloat(table, bucket_of[n] * heads + h));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                          Tensor* dtable) {
  constexpr const char* kOp = "RelativeBiasBackward";
  if (dtable->rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": dtable must be [buckets, heads], got ", ShapeString(dtable->shape())));
  }
  RETURN_IF_ERROR(CheckDType(kOp, "dtable", *dtable, /*f32_only=*/false));
  const int64_t num_buckets = dtable->dim(0), heads = dtable->dim(1);
  ASSIGN_OR_RETURN(const int32_t* bucket_of, CheckBuckets(kOp, buckets, num_buckets));
  RETURN_IF_ERROR(CheckShape(kOp, "dbias", dbias, {heads, buckets.dim(0), buckets.dim(1)}));
  RETURN_IF_ERROR(CheckDType(kOp, "dbias", dbias, /*f32_only=*/true));

  const int64_t positions = buckets.numel();
  const float* grad = dbias.data_as<const float>();
  std::vector<float> sums(static_cast<size_t>(dtable->numel()), 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t n = 0; n < positions; ++n) {
      sums[bucket_of[n] * heads + h] += grad[h * positions + n];
    }
  }
  FromFloatVector(sums, dtable);
  return absl::OkStatus();
}

}  // namespace te
