// An injected launch fault (CudaDeviceOptions::fault_after_launches, what
// te_server --inject_device_fault sets) takes the real path of a sticky
// error: the op that meets it gets INTERNAL naming the device, the device is
// unhealthy for the rest of the process, and every later op, allocation and
// new stream on it is UNAVAILABLE naming it. Its own binary: the health
// marking lasts as long as the process. Needs a GPU.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/check.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

TEST(FaultInjectionGpuTest, TheLaunchAfterTheCountFailsAsAStickyFaultWould) {
  CudaDeviceOptions options;
  options.fault_after_launches = 2;
  auto device = OpenCudaDevice(0, options);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops_or = (*device)->NewOps(int64_t{1} << 30);
  ASSERT_TRUE(ops_or.ok()) << ops_or.status();
  Ops& ops = **ops_or;
  auto t = ops.Allocate(DType::kF32, {1 << 20});
  ASSERT_TRUE(t.ok()) << t.status();

  // Fill is one launch: two pass, the third meets the fault.
  EXPECT_TRUE(ops.Fill(1.0f, &*t).ok());
  EXPECT_TRUE(ops.Fill(2.0f, &*t).ok());
  EXPECT_TRUE((*device)->healthy());
  const absl::Status fault = ops.Fill(3.0f, &*t);
  ASSERT_EQ(fault.code(), absl::StatusCode::kInternal) << fault;
  EXPECT_NE(fault.message().find("cudaErrorLaunchFailure"), std::string::npos) << fault;
  EXPECT_NE(fault.message().find("kernel launch"), std::string::npos) << fault;
  EXPECT_NE(fault.message().find("cuda:0"), std::string::npos) << fault;

  EXPECT_FALSE((*device)->healthy());
  EXPECT_FALSE(cuda::DeviceHealthy(0));
  for (const absl::Status& later :
       {ops.Fill(4.0f, &*t), ops.Synchronize(), ops.Allocate(DType::kF32, {16}).status(),
        (*device)->NewOps(int64_t{1} << 20).status()}) {
    EXPECT_EQ(later.code(), absl::StatusCode::kUnavailable) << later;
    EXPECT_NE(later.message().find("cuda:0"), std::string::npos) << later;
  }
  std::vector<float> host(1 << 20);
  EXPECT_EQ(ops.Download(*t, host.data()).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace te
