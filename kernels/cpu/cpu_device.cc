// The CPU device: one per process; each NewOps() is an independent stream with
// its own memory account, and all of them draw on one account for the host's
// memory (three quarters of its RAM), so that sessions that each fit their
// limit cannot together drive the server into the OOM killer.
#include <unistd.h>

#include <memory>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"

namespace te {
namespace {

int64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return int64_t{8} << 30;  // unknown: a modest host
  return static_cast<int64_t>(pages) * page_size;
}

class CpuDevice : public Device {
 public:
  CpuDevice()
      : memory_(std::make_shared<SharedMemoryAccount>(HostMemoryBytes() / 4 * 3)) {}

  DeviceInfo info() const override {
    DeviceInfo info;
    info.name = "cpu";
    info.description = "x86_64 CPU (reference backend)";
    info.compute_capability = 0;
    info.fp8_native = false;
    info.block_scaling_native = false;
    info.memory_bytes = memory_->limit;
    return info;
  }

  absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t memory_limit) override {
    if (memory_limit <= 0) {
      return absl::InvalidArgumentError(
          "NewOps: memory_limit must be positive, got " + std::to_string(memory_limit));
    }
    auto ops = std::make_unique<CpuOps>();
    ops->set_memory_limit(memory_limit);
    ops->set_shared_account(memory_);
    return std::unique_ptr<Ops>(std::move(ops));
  }

 private:
  const std::shared_ptr<SharedMemoryAccount> memory_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> OpenCpuDevice() {
  return std::unique_ptr<Device>(std::make_unique<CpuDevice>());
}

}  // namespace te
