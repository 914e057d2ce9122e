// Ops::CaptureStep / Replay on CUDA: a recorded step runs nothing while it is
// recorded, each replay reads its inputs as they are then, its memory stays
// the record's (and charged) until the record goes, and a step that waits
// for the host fails to record, leaving the stream usable.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

class StepRecordGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{1} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    ops_ = *std::move(ops);
  }

  Tensor Upload(const std::vector<float>& values) {
    auto t = ops_->Allocate(DType::kF32, {static_cast<int64_t>(values.size())});
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(ops_->Upload(values.data(), &*t).ok());
    return *t;
  }

  std::vector<float> Download(const Tensor& t) {
    std::vector<float> host(static_cast<size_t>(t.numel()));
    EXPECT_TRUE(ops_->Download(t, host.data()).ok());
    return host;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> ops_;
};

TEST_F(StepRecordGpuTest, ReplaysReadTheirInputsAsTheyAreThen) {
  if (ops_ == nullptr) GTEST_SKIP();
  Tensor x = Upload({1.5f, -2.0f, 3.25f, 0.5f});
  const int64_t before = ops_->bytes_in_use();
  Tensor y;
  // y = 2x + x: two ops, and a temporary the step frees.
  auto record = ops_->CaptureStep([&]() -> absl::Status {
    auto twice = ops_->Allocate(DType::kF32, x.shape());
    if (!twice.ok()) return twice.status();
    absl::Status s = ops_->Axpby(2.0f, x, 0.0f, x, &*twice);
    if (!s.ok()) return s;
    auto out = ops_->Allocate(DType::kF32, x.shape());
    if (!out.ok()) return out.status();
    y = *out;
    return ops_->Axpby(1.0f, *twice, 1.0f, x, &y);
  });
  ASSERT_TRUE(record.ok()) << record.status();
  // Recording ran nothing: y was never written, so no replay has been made.
  // The temporary stays the record's: both tensors are still charged.
  EXPECT_EQ(ops_->bytes_in_use() - before, 2 * 4 * static_cast<int64_t>(sizeof(float)));
  ASSERT_TRUE(ops_->Replay(**record).ok());
  EXPECT_EQ(Download(y), (std::vector<float>{4.5f, -6.0f, 9.75f, 1.5f}));
  const std::vector<float> next = {-1.0f, 2.0f, 0.25f, 8.0f};
  ASSERT_TRUE(ops_->Upload(next.data(), &x).ok());
  ASSERT_TRUE(ops_->Replay(**record).ok());
  EXPECT_EQ(Download(y), (std::vector<float>{-3.0f, 6.0f, 0.75f, 24.0f}));
  y = Tensor();
  record->reset();
  EXPECT_EQ(ops_->bytes_in_use(), before);
}

TEST_F(StepRecordGpuTest, AStepThatCopiesFromTheHostDoesNotRecordAndTheStreamGoesOn) {
  if (ops_ == nullptr) GTEST_SKIP();
  Tensor x = Upload({1.0f, 2.0f});
  const int64_t before = ops_->bytes_in_use();
  auto record = ops_->CaptureStep([&]() -> absl::Status {
    const std::vector<float> host = {5.0f, 6.0f};
    return ops_->Upload(host.data(), &x);
  });
  ASSERT_FALSE(record.ok());
  EXPECT_NE(record.status().message().find("recording a step on cuda:0 failed"),
            std::string::npos)
      << record.status();
  EXPECT_EQ(ops_->bytes_in_use(), before);
  // The stream still runs work, and x is as it was.
  EXPECT_EQ(Download(x), (std::vector<float>{1.0f, 2.0f}));
  Tensor y = Upload({0.0f, 0.0f});
  ASSERT_TRUE(ops_->Axpby(1.0f, x, 1.0f, x, &y).ok());
  EXPECT_EQ(Download(y), (std::vector<float>{2.0f, 4.0f}));
}

}  // namespace
}  // namespace te
