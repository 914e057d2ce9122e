// The CUDA backend's host-side behaviour, which needs no GPU and so runs in CI:
// opening a device where there is none, error-to-status mapping, device health
// and the allocator's size buckets. The staged-upload tests need a GPU and skip
// without one (run them there: deploy/bundle.sh, then run.sh cuda_backend_test).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/ops.h"

namespace te {
namespace cuda {
namespace {

TEST(CudaBackendTest, BuiltAndOpensOrSaysUnavailable) {
  EXPECT_TRUE(CudaBackendBuilt());
  auto device = OpenCudaDevice(0);
  if (device.ok()) {
    EXPECT_EQ((*device)->info().name, "cuda:0");
  } else {
    // No driver or no GPU (CI, the build machine): the server falls back to the CPU.
    EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
  }
  auto absent = OpenCudaDevice(4096);
  ASSERT_FALSE(absent.ok());
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kUnavailable);
}

TEST(CudaBackendTest, CudaErrorsBecomeStatuses) {
  const absl::Status oom = CudaErrorToStatus(cudaErrorMemoryAllocation, "cudaMalloc(p, n)",
                                             "file.cc", 7);
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(oom.message().find("cudaMalloc(p, n)"), std::string::npos) << oom;
  EXPECT_EQ(CudaErrorToStatus(cudaErrorInvalidValue, "f()", "file.cc", 1).code(),
            absl::StatusCode::kInternal);
  EXPECT_TRUE(IsStickyError(cudaErrorIllegalAddress));
  EXPECT_TRUE(IsStickyError(cudaErrorLaunchFailure));
  EXPECT_FALSE(IsStickyError(cudaErrorMemoryAllocation));
  EXPECT_FALSE(IsStickyError(cudaErrorInvalidValue));
}

TEST(CudaBackendTest, LaunchFaultCountdownFiresOnceAfterItsLaunches) {
  LaunchFaultCountdown countdown;
  EXPECT_FALSE(countdown.armed());
  EXPECT_FALSE(countdown.CountLaunch());
  countdown.Arm(3);
  EXPECT_TRUE(countdown.armed());
  EXPECT_FALSE(countdown.CountLaunch());
  EXPECT_FALSE(countdown.CountLaunch());
  EXPECT_FALSE(countdown.CountLaunch());
  EXPECT_TRUE(countdown.CountLaunch());  // the fourth launch fails
  EXPECT_FALSE(countdown.armed());
  EXPECT_FALSE(countdown.CountLaunch());
  countdown.Arm(0);
  EXPECT_TRUE(countdown.CountLaunch());
  countdown.Arm(5);
  countdown.Arm(-1);
  EXPECT_FALSE(countdown.CountLaunch());
}

TEST(CudaBackendTest, LaunchFaultCountdownFiresExactlyOnceAcrossThreads) {
  LaunchFaultCountdown countdown;
  countdown.Arm(999);
  std::atomic<int> fired{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i) fired += countdown.CountLaunch() ? 1 : 0;
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(fired.load(), 1);
}

TEST(CudaBackendTest, AnInjectedFaultIsStickyAndNamesTheDevice) {
  // The status the injected launch error becomes: the same as a real fault.
  const absl::Status status =
      CudaErrorToStatus(cudaErrorLaunchFailure, "kernel launch", "norm.cu", 382);
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_NE(status.message().find("unusable until the server restarts"), std::string::npos)
      << status;
}

TEST(CudaBackendTest, SessionsMemoryIsFreeMemoryLessTheReserve) {
  CudaDeviceOptions options;
  options.memory_reserve_bytes = int64_t{4} << 30;
  EXPECT_EQ(*SessionsMemoryBytes(0, int64_t{140} << 30, options), int64_t{136} << 30);
  options.memory_bytes = int64_t{10} << 30;  // an operator's share of a GPU
  EXPECT_EQ(*SessionsMemoryBytes(0, int64_t{140} << 30, options), int64_t{10} << 30);
  options.memory_bytes = int64_t{137} << 30;  // more than is free beyond the reserve
  const absl::Status over = SessionsMemoryBytes(1, int64_t{140} << 30, options).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kUnavailable) << over;
  EXPECT_NE(over.message().find("cuda:1"), std::string::npos) << over;
  options.memory_bytes = 0;
  const absl::Status full = SessionsMemoryBytes(0, int64_t{3} << 30, options).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kUnavailable) << full;
  EXPECT_NE(full.message().find("memory reserve"), std::string::npos) << full;
  options.memory_reserve_bytes = -1;
  EXPECT_EQ(SessionsMemoryBytes(0, int64_t{3} << 30, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaBackendTest, LibraryErrorsBecomeStatuses) {
  EXPECT_EQ(CublasErrorToStatus(CUBLAS_STATUS_NOT_SUPPORTED, "m()", "f.cc", 1).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(CublasErrorToStatus(CUBLAS_STATUS_ALLOC_FAILED, "m()", "f.cc", 1).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CublasErrorToStatus(CUBLAS_STATUS_INVALID_VALUE, "m()", "f.cc", 1).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(CudnnErrorToStatus(CUDNN_STATUS_NOT_SUPPORTED_SHAPE, "g()", "f.cc", 1).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(
      CudnnErrorToStatus(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED, "g()", "f.cc", 1)
          .code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CudnnErrorToStatus(CUDNN_STATUS_BAD_PARAM, "g()", "f.cc", 1).code(),
            absl::StatusCode::kInternal);
}

TEST(CudaBackendTest, UnhealthyIsPerDeviceAndSticks) {
  EXPECT_TRUE(DeviceHealthy(7));
  MarkDeviceUnhealthy(7);
  EXPECT_FALSE(DeviceHealthy(7));
  EXPECT_TRUE(DeviceHealthy(6));
}

TEST(CudaBackendTest, AllocatorBuckets) {
  EXPECT_EQ(CachingAllocator::RoundedSize(1), 512u);
  EXPECT_EQ(CachingAllocator::RoundedSize(513), 1024u);
  EXPECT_EQ(CachingAllocator::RoundedSize(1 << 20), size_t{2} << 20);
  EXPECT_EQ(CachingAllocator::RoundedSize((2 << 20) + 1), size_t{4} << 20);
}

// ---- staged uploads (need a GPU) -------------------------------------------

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string bytes(n, '\0');
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

// A byte view of `tensor` at [offset, offset + size), as TensorUpload makes.
Tensor ByteWindow(const Tensor& tensor, size_t offset, size_t size) {
  return Tensor(nullptr, static_cast<char*>(tensor.data()) + offset, DType::kBool,
                {static_cast<int64_t>(size)});
}

class CudaStagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) GTEST_SKIP() << "no GPU: " << device.status();
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{1} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    ops_ = *std::move(ops);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> ops_;
};

TEST_F(CudaStagingTest, StagingIsPageLockedPooledAndNotAccounted) {
  const size_t bytes = (size_t{3} << 20) + 5;
  const int64_t in_use = ops_->bytes_in_use();
  auto staging = ops_->AllocateStaging(bytes);
  ASSERT_TRUE(staging.ok()) << staging.status();
  void* first = staging->get();
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, first), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
  std::memset(first, 0x5a, bytes);  // the whole size is writable
  EXPECT_EQ(ops_->bytes_in_use(), in_use);

  staging->reset();
  auto again = ops_->AllocateStaging(bytes);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->get(), first) << "a released buffer of the same size is reused";
  // Held at once, two requests get two buffers.
  auto second = ops_->AllocateStaging(bytes);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE(second->get(), first);
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, second->get()), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
}

// As TensorUpload does: random bytes gather in two alternating staging halves,
// each full half goes up with UploadAsync into its window of one tensor, and a
// half is refilled only after a Synchronize since its copy was issued.
TEST_F(CudaStagingTest, UploadAsyncThroughAlternatingHalvesReproducesBytes) {
  const size_t half = (size_t{1} << 20) + 3;  // odd, so windows are unaligned
  const size_t total = 5 * half / 2 + 17;      // not a multiple of the half
  const std::string bytes = RandomBytes(total, 11);
  auto tensor = ops_->Allocate(DType::kBool, {static_cast<int64_t>(total)});
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  auto staging = ops_->AllocateStaging(2 * half);
  ASSERT_TRUE(staging.ok()) << staging.status();
  char* halves[2] = {static_cast<char*>(staging->get()),
                     static_cast<char*>(staging->get()) + half};

  bool in_flight[2] = {false, false};
  int uploads = 0;
  for (size_t offset = 0; offset < total; offset += half) {
    const int h = uploads % 2;
    if (in_flight[h]) {
      ASSERT_TRUE(ops_->Synchronize().ok());
      in_flight[0] = in_flight[1] = false;
    }
    const size_t n = std::min(half, total - offset);
    std::memcpy(halves[h], bytes.data() + offset, n);
    Tensor window = ByteWindow(*tensor, offset, n);
    ASSERT_TRUE(ops_->UploadAsync(halves[h], &window).ok());
    in_flight[h] = true;
    ++uploads;
  }
  EXPECT_EQ(uploads, 3);
  ASSERT_TRUE(ops_->Synchronize().ok());
  std::string got(total, '\0');
  ASSERT_TRUE(ops_->Download(*tensor, got.data()).ok());
  EXPECT_TRUE(got == bytes) << "first difference at byte "
                            << (std::mismatch(got.begin(), got.end(), bytes.begin()).first -
                                got.begin());
}

TEST_F(CudaStagingTest, UploadAsyncChecksArgumentsAsUploadDoes) {
  auto tensor = ops_->Allocate(DType::kF32, {8});
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  const absl::Status null_src = ops_->UploadAsync(nullptr, &*tensor);
  EXPECT_EQ(null_src.code(), absl::StatusCode::kInvalidArgument) << null_src;
  EXPECT_EQ(ops_->UploadAsync(nullptr, nullptr).code(), absl::StatusCode::kInvalidArgument);
  Tensor empty = ByteWindow(*tensor, 0, 0);
  EXPECT_TRUE(ops_->UploadAsync(nullptr, &empty).ok());
}

}  // namespace
}  // namespace cuda
}  // namespace te
