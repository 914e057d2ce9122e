// The backends target answers the CUDA entry points whether or not the build
// has the CUDA backend, and the CPU device always opens.
#include "gtest/gtest.h"
#include "kernels/ops.h"

namespace te {
namespace {

TEST(BackendsTest, CudaBackendBuiltMatchesTheBuild) {
  EXPECT_EQ(CudaBackendBuilt(), TE_EXPECT_CUDA_BACKEND == 1);
}

TEST(BackendsTest, OpenCudaDeviceFailsCleanlyWithoutAGpu) {
  absl::StatusOr<std::unique_ptr<Device>> device = OpenCudaDevice(0);
  // On a GPU machine this opens; elsewhere (CI, a CPU-only build) it must say
  // UNAVAILABLE rather than crash.
  if (!device.ok()) {
    EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
  }
  EXPECT_FALSE(OpenCudaDevice(-1).ok());
}

TEST(BackendsTest, CpuDeviceOpens) {
  absl::StatusOr<std::unique_ptr<Device>> device = OpenCpuDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((*device)->info().name, "cpu");
}

}  // namespace
}  // namespace te
