// The CUDA backend's host-side behaviour, which needs no GPU and so runs in CI:
// opening a device where there is none, error-to-status mapping, device health
// and the allocator's size buckets.
#include "gtest/gtest.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/check.h"
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

}  // namespace
}  // namespace cuda
}  // namespace te
