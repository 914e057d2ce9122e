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
//     index. A device that hit a sticky error (Device::healthy() false) takes
//     no new session: asked for by name it is UNAVAILABLE naming it, and it
//     is never chosen; UNAVAILABLE when no device is healthy.
//  3. Every device has its own executor (executor.h) with the same
//     thread count and queue bound.
//  4. Health (grpc.health.v1): each device under its own name ("cuda:0"),
//     SERVING while healthy; the server ("" and the TeService name) SERVING
//     while any device is, since the healthy ones go on serving their
//     sessions and taking new ones. A one-device server is NOT_SERVING as
//     soon as its device is not.
//  5. Every CUDA device is opened with the same CudaDeviceOptions (its
//     sessions' shared memory account); --inject_device_fault arms a fault
//     on one named CUDA device (testing only).
#ifndef TE_SERVER_SERVICE_DEVICE_POOL_H_
#define TE_SERVER_SERVICE_DEVICE_POOL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/service/executor.h"

namespace te::service {

// The device names an explicit --device list stands for, in order ("auto"
// and "all" are resolved by DevicePool::Open). INVALID_ARGUMENT for an empty,
// malformed or repeated entry.
absl::StatusOr<std::vector<std::string>> ParseDeviceList(const std::string& flag);

// --inject_device_fault: "cuda:N@LAUNCHES" (comma-separated, each device
// at most once): after LAUNCHES kernel launches on cuda:N the next fails as
// a sticky fault would (CudaDeviceOptions::fault_after_launches). Empty: none.
// INVALID_ARGUMENT naming the entry for anything else (the CPU has no
// kernel launches to fail).
struct FaultInjection {
  std::string device;
  int64_t after_launches = 0;
};
absl::StatusOr<std::vector<FaultInjection>> ParseFaultInjections(const std::string& flag);

// How DevicePool::Open opens the devices (contract 5).
struct DeviceOpenOptions {
  CudaDeviceOptions cuda;  // fault_after_launches comes from `faults`
  std::vector<FaultInjection> faults;
};

// One grpc.health.v1 entry (contract 4).
struct HealthEntry {
  std::string service;
  bool serving = false;
};

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
  // INVALID_ARGUMENT when a fault names a device the pool does not open.
  static absl::StatusOr<std::unique_ptr<DevicePool>> Open(const std::string& flag,
                                                          const ExecutorOptions& executor,
                                                          const DeviceOpenOptions& open = {});
  // A pool over devices already open (tests).
  DevicePool(std::vector<std::unique_ptr<Device>> devices,
             const ExecutorOptions& executor);

  int size() const { return static_cast<int>(slots_.size()); }
  Device& device(int index) const { return *slots_[index].device; }
  DeviceExecutor& executor(int index) const { return *slots_[index].executor; }
  const std::string& name(int index) const { return slots_[index].name; }
  // The index of the device called `name`, or -1.
  int Find(const std::string& name) const;
  // Contract 2: `requested` is CreateSessionRequest.device; `loads` has one
  // entry per device.
  absl::StatusOr<int> Place(const std::string& requested,
                            const std::vector<DeviceLoad>& loads) const;
  // "cpu", "cuda:0, cuda:1": for messages.
  std::string Names() const;
  // Contract 4: the devices' entries, then "" and `service_name`.
  std::vector<HealthEntry> Health(const std::string& service_name) const;
  // The names of the devices that are not healthy ("" when all are).
  std::string UnhealthyNames() const;

 private:
  struct Slot {
    std::unique_ptr<Device> device;
    std::string name;
    std::unique_ptr<DeviceExecutor> executor;
  };
  std::vector<Slot> slots_;
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_DEVICE_POOL_H_
