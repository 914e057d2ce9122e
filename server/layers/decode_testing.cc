#include "server/layers/decode_testing.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::layers::testing {

absl::StatusOr<Tensor> TokenAt(Ops& ops, const Tensor& x, int64_t t) {
  if (x.rank() != 3 || t < 0 || t >= x.dim(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("TokenAt: position ", t, " of ", ShapeString(x.shape())));
  }
  const int64_t batch = x.dim(0), length = x.dim(1), features = x.dim(2);
  ASSIGN_OR_RETURN(Tensor token, ops.Allocate(x.dtype(), {batch, 1, features}));
  const Tensor rows = x.Reshaped({batch * length, features});
  const Tensor token_rows = token.Reshaped({batch, features});
  std::vector<Tensor> from, to;
  for (int64_t b = 0; b < batch; ++b) {
    from.push_back(rows.Slice0(b * length + t, b * length + t + 1));
    to.push_back(token_rows.Slice0(b, b + 1));
  }
  std::vector<const Tensor*> src;
  std::vector<Tensor*> dst;
  for (size_t i = 0; i < from.size(); ++i) {
    src.push_back(&from[i]);
    dst.push_back(&to[i]);
  }
  RETURN_IF_ERROR(ops.CopyAll(src, dst));
  return token;
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
                                         const SequenceFn& step) {
  const int64_t batch = x.dim(0), length = x.dim(1);
  ASSIGN_OR_RETURN(const Tensor y_full, full(x));
  if (y_full.rank() != 3 || y_full.dim(0) != batch || y_full.dim(1) != length) {
    return absl::InternalError(
        absl::StrCat("the forward's y is ", ShapeString(y_full.shape())));
  }
  const int64_t features = y_full.dim(2);
  ASSIGN_OR_RETURN(const std::vector<float> want, HostValues(ops, y_full));
  double worst = 0.0;
  for (int64_t t = 0; t < length; ++t) {
    ASSIGN_OR_RETURN(const Tensor token, TokenAt(ops, x, t));
    ASSIGN_OR_RETURN(const Tensor y, step(token));
    if (y.shape() != Shape{batch, 1, features}) {
      return absl::InternalError(absl::StrCat("decode step ", t, "'s y is ",
                                              ShapeString(y.shape())));
    }
    ASSIGN_OR_RETURN(const std::vector<float> got, HostValues(ops, y));
    for (int64_t b = 0; b < batch; ++b) {
      double diff = 0.0, norm = 0.0;
      for (int64_t f = 0; f < features; ++f) {
        const double w = want[(b * length + t) * features + f];
        const double g = got[b * features + f];
        diff += (g - w) * (g - w);
        norm += w * w;
      }
      const double error = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
      if (std::isnan(error)) return error;
      worst = std::max(worst, error);
    }
  }
  return worst;
}

}  // namespace te::layers::testing
