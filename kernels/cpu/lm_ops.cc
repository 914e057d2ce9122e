// CPU reference language-model ops: nn.Embed's gather and its scatter-add,
// the softmax cross entropy with integer labels, and the argmax of greedy
// decoding (ops.h states the math).
// Sums run in double: this is the reference the CUDA kernels are held to.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {

absl::Status CpuOps::EmbedForward(const Tensor& table, const Tensor& ids, Tensor* y) {
  ASSIGN_OR_RETURN(const LmDims d, CheckEmbedForwardArgs(table, ids, y));
  const int32_t* id = ids.data_as<const int32_t>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n = 0; n < d.rows; ++n) {
    const bool valid = id[n] >= 0 && id[n] < d.vocab;
    for (int64_t f = 0; f < d.width; ++f) {
      StoreFromFloat(y, n * d.width + f, valid ? LoadAsFloat(table, id[n] * d.width + f) : nan);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::EmbedBackward(const Tensor& dy, const Tensor& ids, Tensor* dtable) {
  ASSIGN_OR_RETURN(const LmDims d, CheckEmbedBackwardArgs(dy, ids, dtable));
  const int32_t* id = ids.data_as<const int32_t>();
  std::vector<double> sums(static_cast<size_t>(d.vocab * d.width), 0.0);
  for (int64_t n = 0; n < d.rows; ++n) {
    if (id[n] < 0 || id[n] >= d.vocab) continue;
    double* row = &sums[static_cast<size_t>(id[n] * d.width)];
    for (int64_t f = 0; f < d.width; ++f) row[f] += LoadAsFloat(dy, n * d.width + f);
  }
  for (size_t i = 0; i < sums.size(); ++i) {
    StoreFromFloat(dtable, static_cast<int64_t>(i), static_cast<float>(sums[i]));
  }
  return absl::OkStatus();
}

absl::Status CpuOps::SoftmaxCrossEntropyForward(const Tensor& logits, const Tensor& labels,
                                                Tensor* loss, Tensor* lse) {
  ASSIGN_OR_RETURN(const LmDims d, CheckSoftmaxCrossEntropyForwardArgs(logits, labels, loss, lse));
  const int32_t* label = labels.data_as<const int32_t>();
  float* lse_out = lse->data_as<float>();
  double total = 0.0;
  for (int64_t n = 0; n < d.rows; ++n) {
    const int64_t base = n * d.width;
    double max = -std::numeric_limits<double>::infinity();
    for (int64_t v = 0; v < d.width; ++v) max = std::max<double>(max, LoadAsFloat(logits, base + v));
    double sum = 0.0;
    for (int64_t v = 0; v < d.width; ++v) sum += std::exp(LoadAsFloat(logits, base + v) - max);
    const double row_lse = max + std::log(sum);
    lse_out[n] = static_cast<float>(row_lse);
    const bool valid = label[n] >= 0 && label[n] < d.width;
    total += valid ? row_lse - LoadAsFloat(logits, base + label[n])
                   : std::numeric_limits<double>::quiet_NaN();
  }
  loss->data_as<float>()[0] = static_cast<float>(total / static_cast<double>(d.rows));
  return absl::OkStatus();
}

absl::Status CpuOps::SoftmaxCrossEntropyBackward(const Tensor& logits, const Tensor& labels,
                                                 const Tensor& lse, const Tensor& dloss,
                                                 Tensor* dlogits) {
  ASSIGN_OR_RETURN(const LmDims d,
                   CheckSoftmaxCrossEntropyBackwardArgs(logits, labels, lse, dloss, dlogits));
  const int32_t* label = labels.data_as<const int32_t>();
  const float* row_lse = lse.data_as<const float>();
  const double scale = static_cast<double>(dloss.data_as<const float>()[0]) / d.rows;
  for (int64_t n = 0; n < d.rows; ++n) {
    const int64_t base = n * d.width;
    for (int64_t v = 0; v < d.width; ++v) {
      const double p = std::exp(static_cast<double>(LoadAsFloat(logits, base + v)) - row_lse[n]);
      StoreFromFloat(dlogits, base + v,
                     static_cast<float>(scale * (p - (v == label[n] ? 1.0 : 0.0))));
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::ArgmaxLast(const Tensor& x, Tensor* y) {
  ASSIGN_OR_RETURN(const LmDims d, CheckArgmaxLastArgs(x, y));
  int32_t* out = y->data_as<int32_t>();
  for (int64_t r = 0; r < d.rows; ++r) {
    int64_t best = 0;
    float best_value = LoadAsFloat(x, r * d.width);
    for (int64_t v = 0; v < d.width && !std::isnan(best_value); ++v) {
      const float value = LoadAsFloat(x, r * d.width + v);
      if (std::isnan(value) || value > best_value) {
        best = v;
        best_value = value;
      }
    }
    out[r] = static_cast<int32_t>(best);
  }
  return absl::OkStatus();
}

}  // namespace te
