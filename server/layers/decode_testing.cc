#include "server/layers/decode_testing.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::layers::testing {

absl::StatusOr<Tensor> PositionsOf(Ops& ops, const Tensor& x, int64_t t, int64_t n) {
  if (x.rank() < 2 || t < 0 || n < 1 || t + n > x.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PositionsOf: positions ", t, "..", t + n - 1, " of ", ShapeString(x.shape())));
  }
  const int64_t batch = x.dim(0), length = x.dim(1);
  const int64_t features = length == 0 ? 0 : x.numel() / (batch * length);
  Shape shape = x.shape();
  shape[1] = n;
  ASSIGN_OR_RETURN(Tensor part, ops.Allocate(x.dtype(), shape));
  const Tensor rows = x.Reshaped({batch * length, features});
  const Tensor part_rows = part.Reshaped({batch * n, features});
  std::vector<Tensor> from, to;
  for (int64_t b = 0; b < batch; ++b) {
    from.push_back(rows.Slice0(b * length + t, b * length + t + n));
    to.push_back(part_rows.Slice0(b * n, (b + 1) * n));
  }
  std::vector<const Tensor*> src;
  std::vector<Tensor*> dst;
  for (size_t i = 0; i < from.size(); ++i) {
    src.push_back(&from[i]);
    dst.push_back(&to[i]);
  }
  RETURN_IF_ERROR(ops.CopyAll(src, dst));
  return part;
}

absl::StatusOr<std::vector<float>> HostValues(Ops& ops, const Tensor& t) {
  std::vector<float> values(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kI32) {
    std::vector<int32_t> ints(values.size());
    RETURN_IF_ERROR(ops.Download(t, ints.data()));
    std::copy(ints.begin(), ints.end(), values.begin());
    return values;
  }
  ASSIGN_OR_RETURN(Tensor f32, ops.Allocate(DType::kF32, t.shape()));
  if (t.dtype() == DType::kF32) {
    RETURN_IF_ERROR(ops.Copy(t, &f32));
  } else {
    RETURN_IF_ERROR(ops.Cast(t, &f32));
  }
  RETURN_IF_ERROR(ops.Download(f32, values.data()));
  return values;
}

absl::StatusOr<double> MaxDecodeRowError(Ops& ops, const Tensor& x, const SequenceFn& full,
                                         const SequenceFn& step,
                                         const std::vector<int64_t>& chunks) {
  const int64_t batch = x.dim(0), length = x.dim(1);
  std::vector<int64_t> sizes = chunks;
  if (sizes.empty()) sizes.assign(static_cast<size_t>(length), 1);
  int64_t total = 0;
  for (int64_t n : sizes) total += n;
  if (total != length) {
    return absl::InvalidArgumentError(
        absl::StrCat("MaxDecodeRowError: chunks sum to ", total, ", not ", length));
  }
  ASSIGN_OR_RETURN(const Tensor y_full, full(x));
  if (y_full.rank() != 3 || y_full.dim(0) != batch || y_full.dim(1) != length) {
    return absl::InternalError(
        absl::StrCat("the forward's y is ", ShapeString(y_full.shape())));
  }
  const int64_t features = y_full.dim(2);
  ASSIGN_OR_RETURN(const std::vector<float> want, HostValues(ops, y_full));
  double worst = 0.0;
  int64_t t = 0;
  for (int64_t n : sizes) {
    ASSIGN_OR_RETURN(const Tensor part, PositionsOf(ops, x, t, n));
    ASSIGN_OR_RETURN(const Tensor y, step(part));
    if (y.shape() != Shape{batch, n, features}) {
      return absl::InternalError(absl::StrCat("decode step at ", t, ": y is ",
                                              ShapeString(y.shape())));
    }
    ASSIGN_OR_RETURN(const std::vector<float> got, HostValues(ops, y));
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        double diff = 0.0, norm = 0.0;
        for (int64_t f = 0; f < features; ++f) {
          const double w = want[(b * length + t + i) * features + f];
          const double g = got[(b * n + i) * features + f];
          diff += (g - w) * (g - w);
          norm += w * w;
        }
        const double error = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
        if (std::isnan(error)) return error;
        worst = std::max(worst, error);
      }
    }
    t += n;
  }
  return worst;
}

}  // namespace te::layers::testing
