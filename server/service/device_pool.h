// DevicePool: the devices a server runs on (--device), each with its bounded
// executor, and the placement of new sessions. Thread-safe once built.
//
// Contract:
//  1. --device takes "auto" (CUDA device 0 when there is one, else the CPU),
//     "all" (every CUDA device, else the CPU), or a comma-separated list of
//     "cpu" and "cuda:N", each at most once.
//  2. A new session goes where its request asks (INVALID_ARGUMENT naming the
//     devices served when that is not one of them), else to the device with
//     the fewest sessions, then the least session memory, then the lowest
//     index.
//  3. Every device has its own executor (session/executor.h) with the same
//     thread count and queue bound.
#ifndef TE_SERVER_SERVICE_DEVICE_POOL_H_
#define TE_SERVER_SERVICE_DEVICE_POOL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/session/executor.h"

namespace te::service {

// The device names an explicit --device list stands for, in order ("auto"
// and "all" are resolved by DevicePool::Open). INVALID_ARGUMENT for an empty,
// malformed or repeated entry.
absl::StatusOr<std::vector<std::string>> ParseDeviceList(const std::string& flag);

// What a device holds now, for placement.
struct DeviceLoad {
  int sessions = 0;
  int64_t bytes_in_use = 0;
};
// The index contract 2 picks among `loads` (which must not be empty).
int LeastLoaded(const std::vector<DeviceLoad>& loads);

class DevicePool {
 public:
  // Opens the devices `flag` names (contract 1) with an executor each.
  static absl::StatusOr<std::unique_ptr<DevicePool>> Open(const std::string& flag,
                                                          const session::ExecutorOptions& executor);
  // A pool over devices already open (tests).
  DevicePool(std::vector<std::unique_ptr<Device>> devices,
             const session::ExecutorOptions& executor);

  int size() const { return static_cast<int>(slots_.size()); }
  Device& device(int index) const { return *slots_[index].device; }
  session::DeviceExecutor& executor(int index) const { return *slots_[index].executor; }
  const std::string& name(int index) const { return slots_[index].name; }
  // The index of the device called `name`, or -1.
  int Find(const std::string& name) const;
  // Contract 2: `requested` is CreateSessionRequest.device; `loads` has one
  // entry per device.
  absl::StatusOr<int> Place(const std::string& requested,
                            const std::vector<DeviceLoad>& loads) const;
  // "cpu", "cuda:0, cuda:1": for messages.
  std::string Names() const;

 private:
  struct Slot {
    std::unique_ptr<Device> device;
    std::string name;
    std::unique_ptr<session::DeviceExecutor> executor;
  };
  std::vector<Slot> slots_;
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_DEVICE_POOL_H_
