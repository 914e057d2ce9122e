// CPU reference position encodings: rotary embedding and the T5 relative
// position bias (a gather from a [heads, buckets] table, and its scatter-add).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

// Checks the values of buckets (shape and dtype checked by op_checks): each
// in [0, num_buckets). Returns them.
absl::StatusOr<const int32_t*> CheckBucketValues(const char* op, const Tensor& buckets,
                                                 int64_t num_buckets) {
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

// cos then sin of the angle of (row s along S, frequency i) at
// [s * half + i] and [seq * half + s * half + i]. The angle is computed in
// double: near position 10^4 a float angle is already off by up to 5e-4
// radians, far more than a float32 result can carry.
std::vector<float> CosSinTable(const RotaryArgs& args, int64_t seq, int64_t dim) {
  const int64_t half = dim / 2;
  std::vector<float> table(static_cast<size_t>(2 * seq * half));
  const double ratio = static_cast<double>(args.max_timescale) / args.min_timescale;
  // The CPU's "device" memory is host memory: the position is read here.
  const int64_t start = args.position_offset + (HasDevicePosition(args.position)
                                                     ? args.position.data_as<const int32_t>()[0]
                                                     : 0);
  for (int64_t i = 0; i < half; ++i) {
    const double timescale = args.min_timescale * std::pow(ratio, 2.0 * i / dim);
    for (int64_t s = 0; s < seq; ++s) {
      const double p = static_cast<double>(start + s);
      const double angle = (args.inverse ? -p : p) / timescale;
      const int64_t at = s * half + i;
      table[at] = static_cast<float>(std::cos(angle));
      table[seq * half + at] = static_cast<float>(std::sin(angle));
    }
  }
  return table;
}

}  // namespace

absl::StatusOr<Tensor> CpuOps::RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim) {
  RETURN_IF_ERROR(CheckRotaryTableArgs(args, seq, dim));
  const std::vector<float> values = CosSinTable(args, seq, dim);
  ASSIGN_OR_RETURN(Tensor table, Allocate(DType::kF32, {2, seq, dim / 2}));
  std::copy(values.begin(), values.end(), table.data_as<float>());
  return table;
}

absl::Status CpuOps::Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckRotaryArgs(args, x, y));
  const int64_t seq = x.dim(1), heads = x.dim(2), dim = x.dim(3), half = dim / 2;
  std::vector<float> made;
  if (!args.table.defined()) made = CosSinTable(args, seq, dim);
  const float* cos_table = args.table.defined() ? args.table.data_as<const float>() : made.data();
  const float* sin_table = cos_table + seq * half;

  // The row is read whole before it is written, so y may alias x.
  std::vector<float> row(static_cast<size_t>(dim));
  const int64_t rows = dim == 0 ? 0 : x.numel() / dim;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = (r / heads) % seq;
    const int64_t base = r * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = LoadAsFloat(x, base + d);
    for (int64_t i = 0; i < half; ++i) {
      // TE JAX: "consecutive" pairs (2i, 2i+1); "alternate" pairs (i, i + D/2).
      const int64_t first = args.consecutive ? 2 * i : i;
      const int64_t second = args.consecutive ? 2 * i + 1 : i + half;
      const float c = cos_table[s * half + i], sn = sin_table[s * half + i];
      const float a = row[first], b = row[second];
      StoreFromFloat(y, base + first, a * c - b * sn);
      StoreFromFloat(y, base + second, b * c + a * sn);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                         const Tensor& first_row, Tensor* bias) {
  ASSIGN_OR_RETURN(const RelativeBiasDims dims,
                   CheckRelativeBiasForwardArgs(table, buckets, first_row, bias));
  const int64_t heads = dims.heads, nb = dims.num_buckets;
  ASSIGN_OR_RETURN(const int32_t* bucket_of,
                   CheckBucketValues("RelativeBiasForward", buckets, dims.num_buckets));
  const int64_t rows = buckets.dim(0), cols = buckets.dim(1), q_rows = bias->dim(1);
  const int64_t r0 = HasDevicePosition(first_row) ? first_row.data_as<const int32_t>()[0] : 0;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < q_rows; ++i) {
      const int64_t r = r0 + i;
      for (int64_t j = 0; j < cols; ++j) {
        StoreFromFloat(
            bias, (h * q_rows + i) * cols + j,
            r >= 0 && r < rows ? LoadAsFloat(table, h * nb + bucket_of[r * cols + j]) : 0.0f);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                          Tensor* dtable) {
  ASSIGN_OR_RETURN(const RelativeBiasDims dims,
                   CheckRelativeBiasBackwardArgs(dbias, buckets, dtable));
  const int64_t heads = dims.heads;
  ASSIGN_OR_RETURN(const int32_t* bucket_of,
                   CheckBucketValues("RelativeBiasBackward", buckets, dims.num_buckets));
  const int64_t positions = buckets.numel();
  const float* grad = dbias.data_as<const float>();
  std::vector<float> sums(static_cast<size_t>(dtable->numel()), 0.0f);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t n = 0; n < positions; ++n) {
      sums[h * dims.num_buckets + bucket_of[n]] += grad[h * positions + n];
    }
  }
  FromFloatVector(sums, dtable);
  return absl::OkStatus();
}

}  // namespace te
