#include "server/session/tensor_upload.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"

namespace te::session {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string bytes(n, '\0');
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

// A device that is not the CPU, as far as TensorUpload can tell: UploadAsync
// copies only at the next Synchronize (as a DMA engine may), so a staging
// half refilled too early would corrupt the result.
class DeferredOps : public CpuOps {
 public:
  std::string device_name() const override { return "fake:0"; }
  absl::Status UploadAsync(const void* src, Tensor* dst) override {
    pending_.push_back({src, *dst});
    ++async_uploads;
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    for (const Pending& p : pending_) std::memcpy(p.dst.data(), p.src, p.dst.nbytes());
    pending_.clear();
    ++synchronizes;
    return absl::OkStatus();
  }
  int async_uploads = 0;
  int synchronizes = 0;

 private:
  struct Pending {
    const void* src;
    Tensor dst;
  };
  std::vector<Pending> pending_;
};

std::string Contents(Ops& ops, const Tensor& tensor) {
  std::string bytes(tensor.nbytes(), '\0');
  EXPECT_TRUE(ops.Download(tensor, bytes.data()).ok());
  return bytes;
}

// Uploads `bytes` as a float32 tensor in pieces of `piece` bytes.
absl::StatusOr<Tensor> UploadInPieces(Ops& ops, const std::string& bytes, size_t piece) {
  absl::StatusOr<Tensor> destination =
      ops.Allocate(DType::kF32, {static_cast<int64_t>(bytes.size() / 4)});
  if (!destination.ok()) return destination.status();
  absl::StatusOr<std::unique_ptr<TensorUpload>> upload = TensorUpload::Start(ops, *destination);
  if (!upload.ok()) return upload.status();
  for (size_t offset = 0; offset < bytes.size(); offset += piece) {
    const size_t n = std::min(piece, bytes.size() - offset);
    absl::Status appended = (*upload)->Append(bytes.data() + offset, n);
    if (!appended.ok()) return appended;
  }
  return (*upload)->Finish();
}

class TensorUploadTest : public ::testing::TestWithParam<size_t> {};

TEST_P(TensorUploadTest, CpuWritesPiecesInPlace) {
  CpuOps ops;
  const std::string bytes = RandomBytes(4 * 300001, 1);  // not a multiple of any piece
  absl::StatusOr<Tensor> tensor = UploadInPieces(ops, bytes, GetParam());
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(Contents(ops, *tensor), bytes);
}

TEST_P(TensorUploadTest, StagedDeviceGetsEveryByteOnce) {
  DeferredOps ops;
  // Several staging halves' worth, ending part way into a half.
  const std::string bytes =
      RandomBytes(4 * ((5 * TensorUpload::kStagingHalfBytes / 2 + 12) / 4), 2);
  absl::StatusOr<Tensor> tensor = UploadInPieces(ops, bytes, GetParam());
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(Contents(ops, *tensor), bytes);
  EXPECT_EQ(ops.async_uploads, 3);  // two full halves and the tail
}

// Pieces smaller than, equal to and larger than a staging half; odd sizes.
INSTANTIATE_TEST_SUITE_P(PieceSizes, TensorUploadTest,
                         ::testing::Values(size_t{1} << 20, size_t{3} * 1000 * 1000 + 7,
                                           TensorUpload::kStagingHalfBytes,
                                           TensorUpload::kStagingHalfBytes * 3 + 5, 4099));

TEST(TensorUploadTest, TooManyBytesIsInvalidAndWritesNothing) {
  CpuOps ops;
  absl::StatusOr<Tensor> destination = ops.Allocate(DType::kF32, {4});
  ASSERT_TRUE(destination.ok());
  auto upload = TensorUpload::Start(ops, *destination);
  ASSERT_TRUE(upload.ok());
  const std::string bytes = RandomBytes(20, 3);
  ASSERT_TRUE((*upload)->Append(bytes.data(), 12).ok());
  const absl::Status over = (*upload)->Append(bytes.data() + 12, 8);
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("more than the 16 bytes"), std::string::npos) << over;
  EXPECT_EQ((*upload)->received(), 12);
}

TEST(TensorUploadTest, TooFewBytesIsInvalidAtFinish) {
  DeferredOps ops;
  absl::StatusOr<Tensor> destination = ops.Allocate(DType::kBF16, {2, 3});
  ASSERT_TRUE(destination.ok());
  auto upload = TensorUpload::Start(ops, *destination);
  ASSERT_TRUE(upload.ok());
  const std::string bytes = RandomBytes(11, 4);
  ASSERT_TRUE((*upload)->Append(bytes.data(), bytes.size()).ok());
  const absl::Status short_by_one = (*upload)->Finish().status();
  EXPECT_EQ(short_by_one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(short_by_one.message().find("add up to 11,"), std::string::npos) << short_by_one;
  // The two fields that disagree, by name.
  EXPECT_EQ(short_by_one.message().rfind("data: ", 0), 0u) << short_by_one;
  EXPECT_NE(short_by_one.message().find("header.tensor.shape"), std::string::npos) << short_by_one;
}

TEST(TensorUploadTest, DroppingAnUploadFreesItsTensor) {
  CpuOps ops;
  const int64_t before = ops.bytes_in_use();
  {
    absl::StatusOr<Tensor> destination = ops.Allocate(DType::kF32, {1 << 16});
    ASSERT_TRUE(destination.ok());
    auto upload = TensorUpload::Start(ops, *std::move(destination));
    ASSERT_TRUE(upload.ok());
    const std::string bytes = RandomBytes(1000, 5);
    ASSERT_TRUE((*upload)->Append(bytes.data(), bytes.size()).ok());
    EXPECT_GT(ops.bytes_in_use(), before);
  }
  EXPECT_EQ(ops.bytes_in_use(), before);
}

}  // namespace
}  // namespace te::session
