// The CPU device: one per process; each NewOps() is an independent stream with
// its own memory account.
#include <memory>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"

namespace te {
namespace {

class CpuDevice : public Device {
 public:
  DeviceInfo info() const override {
    DeviceInfo info;
    info.name = "cpu";
    info.description = "x86_64 CPU (reference backend)";
    info.compute_capability = 0;
    info.fp8_native = false;
    info.block_scaling_native = false;
    return info;
  }

  absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t memory_limit) override {
    if (memory_limit <= 0) {
      return absl::InvalidArgumentError(
          "NewOps: memory_limit must be positive, got " + std::to_string(memory_limit));
    }
    auto ops = std::make_unique<CpuOps>();
    ops->set_memory_limit(memory_limit);
    return std::unique_ptr<Ops>(std::move(ops));
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> OpenCpuDevice() {
  return std::unique_ptr<Device>(std::make_unique<CpuDevice>());
}

}  // namespace te
