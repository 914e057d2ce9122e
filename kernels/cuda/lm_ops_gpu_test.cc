// The language-model ops on the GPU against the CPU reference on random data:
// the softmax cross entropy with integer labels (forward loss and per-row
// logsumexp, backward dlogits) over f32 and bf16 logits, vocabularies from 2
// to GPT-2's 50257 (odd widths, one row and many), a label outside the
// vocabulary (NaN loss on both), nn.Embed's gather and deterministic
// scatter-add with ids that repeat, and greedy decoding's argmax (ties and
// NaN as jnp.argmax). Tolerances: kernels/cpu/test_util.h.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

using testing::RelativeError;
using testing::ToDoubles;
using testing::Tolerance;

class LmOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    gpu_ = *device_->NewOps(int64_t{4} << 30);
  }
  Tensor Upload(const Tensor& host) {
    Tensor t = *gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(gpu_->Upload(host.data(), &t).ok());
    return t;
  }
  Tensor Download(const Tensor& device) {
    Tensor t = *cpu_.Allocate(device.dtype(), device.shape());
    EXPECT_TRUE(gpu_->Download(device, t.data()).ok());
    return t;
  }
  // int32 [n] uniform in [0, vocab), reproducible from `seed`.
  Tensor Ids(int64_t n, int64_t vocab, uint32_t seed) {
    Tensor t = *cpu_.Allocate(DType::kI32, {n});
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
    for (int64_t i = 0; i < n; ++i) t.data_as<int32_t>()[i] = dist(gen);
    return t;
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

// (rows, vocab, logits dtype)
class SoftmaxCrossEntropyGpuTest
    : public LmOpsGpuTest,
      public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, DType>> {};

TEST_P(SoftmaxCrossEntropyGpuTest, ForwardAndBackwardMatchCpuReference) {
  const auto [rows, vocab, dtype] = GetParam();
  // Logits spread wide enough that the max subtraction matters.
  const Tensor logits = testing::MakeRandom(cpu_, dtype, {rows, vocab}, 7, -12.0f, 12.0f);
  const Tensor labels = Ids(rows, vocab, 8);
  Tensor loss = *cpu_.Allocate(DType::kF32, {1});
  Tensor lse = *cpu_.Allocate(DType::kF32, {rows});
  ASSERT_TRUE(cpu_.SoftmaxCrossEntropyForward(logits, labels, &loss, &lse).ok());
  const Tensor logits_gpu = Upload(logits), labels_gpu = Upload(labels);
  Tensor loss_gpu = *gpu_->Allocate(DType::kF32, {1});
  Tensor lse_gpu = *gpu_->Allocate(DType::kF32, {rows});
  ASSERT_TRUE(gpu_->SoftmaxCrossEntropyForward(logits_gpu, labels_gpu, &loss_gpu, &lse_gpu).ok());
  // Float32 accumulation on the GPU against the reference's float64.
  EXPECT_LT(RelativeError(Download(loss_gpu), ToDoubles(loss)), testing::kF32Tolerance);
  EXPECT_LT(RelativeError(Download(lse_gpu), ToDoubles(lse)), testing::kF32Tolerance);

  const Tensor dloss = testing::Scalar(cpu_, 0.7f);
  Tensor dlogits = *cpu_.Allocate(dtype, {rows, vocab});
  ASSERT_TRUE(cpu_.SoftmaxCrossEntropyBackward(logits, labels, lse, dloss, &dlogits).ok());
  Tensor dlogits_gpu = *gpu_->Allocate(dtype, {rows, vocab});
  // The GPU's own lse: the backward as a step runs it.
  ASSERT_TRUE(gpu_->SoftmaxCrossEntropyBackward(logits_gpu, labels_gpu, lse_gpu, Upload(dloss),
                                                &dlogits_gpu)
                  .ok());
  EXPECT_LT(RelativeError(Download(dlogits_gpu), ToDoubles(dlogits)), Tolerance(dtype));
  // Each row's gradient sums to 0 (softmax minus one-hot), on the GPU too.
  const std::vector<double> g = ToDoubles(Download(dlogits_gpu));
  const double scale = 0.7 / static_cast<double>(rows);
  for (int64_t n = 0; n < rows; n += std::max<int64_t>(1, rows / 7)) {
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += g[n * vocab + v];
    EXPECT_NEAR(sum, 0.0, 10 * Tolerance(dtype) * scale) << "row " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SoftmaxCrossEntropyGpuTest,
    ::testing::Combine(::testing::Values(int64_t{1}, int64_t{37}, int64_t{512}),
                       ::testing::Values(int64_t{2}, int64_t{256}, int64_t{1001},
                                         int64_t{50257}),
                       ::testing::Values(DType::kF32, DType::kBF16)),
    [](const auto& info) {
      return "rows" + std::to_string(std::get<0>(info.param)) + "_vocab" +
             std::to_string(std::get<1>(info.param)) + "_" +
             testing::ShortName(std::get<2>(info.param));
    });

TEST_F(LmOpsGpuTest, SoftmaxCrossEntropyLabelOutsideVocabIsNan) {
  const int64_t rows = 5, vocab = 33;
  const Tensor logits = testing::MakeRandom(cpu_, DType::kF32, {rows, vocab}, 3);
  Tensor labels = Ids(rows, vocab, 4);
  labels.data_as<int32_t>()[2] = static_cast<int32_t>(vocab);
  Tensor loss = *cpu_.Allocate(DType::kF32, {1});
  Tensor lse = *cpu_.Allocate(DType::kF32, {rows});
  ASSERT_TRUE(cpu_.SoftmaxCrossEntropyForward(logits, labels, &loss, &lse).ok());
  Tensor loss_gpu = *gpu_->Allocate(DType::kF32, {1});
  Tensor lse_gpu = *gpu_->Allocate(DType::kF32, {rows});
  ASSERT_TRUE(
      gpu_->SoftmaxCrossEntropyForward(Upload(logits), Upload(labels), &loss_gpu, &lse_gpu).ok());
  EXPECT_TRUE(std::isnan(testing::ScalarValue(loss)));
  EXPECT_TRUE(std::isnan(testing::ScalarValue(Download(loss_gpu))));
  // The rows' logsumexp does not depend on the labels.
  EXPECT_LT(RelativeError(Download(lse_gpu), ToDoubles(lse)), testing::kF32Tolerance);
}

// (tokens, vocab, features, dtype)
class EmbedGpuTest
    : public LmOpsGpuTest,
      public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, int64_t, DType>> {};

TEST_P(EmbedGpuTest, GatherAndScatterAddMatchCpuReference) {
  const auto [tokens, vocab, features, dtype] = GetParam();
  const Tensor table = testing::MakeRandom(cpu_, dtype, {vocab, features}, 11);
  const Tensor ids = Ids(tokens, vocab, 12);  // more tokens than rows: ids repeat
  Tensor y = *cpu_.Allocate(dtype, {tokens, features});
  ASSERT_TRUE(cpu_.EmbedForward(table, ids, &y).ok());
  const Tensor ids_gpu = Upload(ids);
  Tensor y_gpu = *gpu_->Allocate(dtype, {tokens, features});
  ASSERT_TRUE(gpu_->EmbedForward(Upload(table), ids_gpu, &y_gpu).ok());
  EXPECT_EQ(ToDoubles(Download(y_gpu)), ToDoubles(y));  // a gather: exact

  const Tensor dy = testing::MakeRandom(cpu_, dtype, {tokens, features}, 13);
  Tensor dtable = *cpu_.Allocate(dtype, {vocab, features});
  ASSERT_TRUE(cpu_.EmbedBackward(dy, ids, &dtable).ok());
  const Tensor dy_gpu = Upload(dy);
  Tensor dtable_gpu = *gpu_->Allocate(dtype, {vocab, features});
  ASSERT_TRUE(gpu_->EmbedBackward(dy_gpu, ids_gpu, &dtable_gpu).ok());
  const std::vector<double> first = ToDoubles(Download(dtable_gpu));
  EXPECT_LT(RelativeError(first, ToDoubles(dtable)), Tolerance(dtype));
  // Deterministic: the same sums on a second run.
  ASSERT_TRUE(gpu_->EmbedBackward(dy_gpu, ids_gpu, &dtable_gpu).ok());
  EXPECT_EQ(ToDoubles(Download(dtable_gpu)), first);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EmbedGpuTest,
    ::testing::Values(std::make_tuple(int64_t{1}, int64_t{3}, int64_t{5}, DType::kF32),
                      std::make_tuple(int64_t{2048}, int64_t{256}, int64_t{256}, DType::kF32),
                      std::make_tuple(int64_t{2048}, int64_t{256}, int64_t{256}, DType::kBF16),
                      std::make_tuple(int64_t{777}, int64_t{50257}, int64_t{33}, DType::kBF16)));

// (rows, vocab, logits dtype): greedy decoding's argmax, exact.
class ArgmaxLastGpuTest
    : public LmOpsGpuTest,
      public ::testing::WithParamInterface<std::tuple<int64_t, int64_t, DType>> {};

TEST_P(ArgmaxLastGpuTest, MatchesCpuReference) {
  const auto [rows, vocab, dtype] = GetParam();
  // A narrow range, so bf16 rounding makes ties the first index must win.
  Tensor x = testing::MakeRandom(cpu_, dtype, {rows, vocab}, 31, -2.0f, 2.0f);
  if (vocab > 3 && rows > 2) {
    // Row 1 gets a NaN past its maximum, row 2 a tie of two maxima.
    std::vector<float> values = ToFloatVector(x);
    values[1 * vocab + vocab - 2] = NAN;
    values[2 * vocab + 1] = values[2 * vocab + vocab - 1] = 3.0f;
    FromFloatVector(values, &x);
  }
  Tensor y = *cpu_.Allocate(DType::kI32, {rows});
  ASSERT_TRUE(cpu_.ArgmaxLast(x, &y).ok());
  Tensor y_gpu = *gpu_->Allocate(DType::kI32, {rows});
  ASSERT_TRUE(gpu_->ArgmaxLast(Upload(x), &y_gpu).ok());
  const Tensor got = Download(y_gpu);
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(got.data_as<int32_t>()[r], y.data_as<int32_t>()[r]) << "row " << r;
  }
  if (vocab > 3 && rows > 2) {
    EXPECT_EQ(y.data_as<int32_t>()[1], vocab - 2);
    EXPECT_EQ(y.data_as<int32_t>()[2], 1);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ArgmaxLastGpuTest,
    ::testing::Combine(::testing::Values(int64_t{1}, int64_t{8}, int64_t{777}),
                       ::testing::Values(int64_t{2}, int64_t{256}, int64_t{1001},
                                         int64_t{50257}),
                       ::testing::Values(DType::kF32, DType::kBF16, DType::kF16)),
    [](const auto& info) {
      return "rows" + std::to_string(std::get<0>(info.param)) + "_vocab" +
             std::to_string(std::get<1>(info.param)) + "_" +
             testing::ShortName(std::get<2>(info.param));
    });

}  // namespace
}  // namespace te
