#include "server/service/device_pool.h"

#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kernels/status_macros.h"
#include "server/session/log.h"

namespace te::service {
namespace {

using session::Log;
using session::LogLevel;

// "all" probes ordinals until one fails; no host has more than this.
constexpr int kMaxCudaDevices = 64;

// The options for cuda:`ordinal`: the common ones, and its fault if armed.
CudaDeviceOptions CudaOptionsFor(int ordinal, const DeviceOpenOptions& open) {
  CudaDeviceOptions options = open.cuda;
  options.fault_after_launches = -1;
  for (const FaultInjection& fault : open.faults) {
    if (fault.device == absl::StrCat("cuda:", ordinal)) {
      options.fault_after_launches = fault.after_launches;
    }
  }
  return options;
}

absl::StatusOr<std::unique_ptr<Device>> OpenNamed(const std::string& name,
                                                  const DeviceOpenOptions& open) {
  if (name == "cpu") return OpenCpuDevice();
  int ordinal = -1;
  if (!absl::SimpleAtoi(name.substr(5), &ordinal)) {
    return absl::InvalidArgumentError(absl::StrCat("--device: bad entry '", name, "'"));
  }
  absl::StatusOr<std::unique_ptr<Device>> device =
      OpenCudaDevice(ordinal, CudaOptionsFor(ordinal, open));
  if (!device.ok()) {
    return absl::Status(device.status().code(),
                        absl::StrCat("--device: ", name, ": ", device.status().message()));
  }
  return device;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseDeviceList(const std::string& flag) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (absl::string_view entry : absl::StrSplit(flag, ',')) {
    const std::string name(absl::StripAsciiWhitespace(entry));
    int ordinal = -1;
    const bool cuda = absl::StartsWith(name, "cuda:") &&
                      absl::SimpleAtoi(name.substr(5), &ordinal) && ordinal >= 0 &&
                      name.substr(5) == absl::StrCat(ordinal);  // no "cuda:+1", "cuda:01"
    if (name != "cpu" && !cuda) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device=", flag, ": '", name,
                       "' is not a device; give auto, all, or a list of cpu and cuda:N"));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device=", flag, ": ", name, " is listed twice"));
    }
    names.push_back(name);
  }
  return names;
}

absl::StatusOr<std::vector<FaultInjection>> ParseFaultInjections(const std::string& flag) {
  std::vector<FaultInjection> faults;
  std::set<std::string> seen;
  for (absl::string_view entry : absl::StrSplit(flag, ',', absl::SkipWhitespace())) {
    const std::vector<std::string> parts =
        absl::StrSplit(absl::StripAsciiWhitespace(entry), absl::MaxSplits('@', 1));
    FaultInjection fault;
    fault.device = parts[0];
    const absl::StatusOr<std::vector<std::string>> name = ParseDeviceList(fault.device);
    if (parts.size() != 2 || !name.ok() || fault.device == "cpu" ||
        !absl::SimpleAtoi(parts[1], &fault.after_launches) || fault.after_launches < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--inject_device_fault=", flag, ": '", entry,
          "' is not cuda:N@LAUNCHES (a CUDA device and how many kernel launches pass first; the "
          "CPU has no launches to fail)"));
    }
    if (!seen.insert(fault.device).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--inject_device_fault=", flag, ": ", fault.device, " is listed twice"));
    }
    faults.push_back(fault);
  }
  return faults;
}

int LeastLoaded(const std::vector<DeviceLoad>& loads) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(loads.size()); ++i) {
    const DeviceLoad& a = loads[i];
    const DeviceLoad& b = loads[best];
    if (a.sessions < b.sessions || (a.sessions == b.sessions && a.bytes_in_use < b.bytes_in_use)) {
      best = i;
    }
  }
  return best;
}

absl::StatusOr<std::unique_ptr<DevicePool>> DevicePool::Open(
    const std::string& flag, const ExecutorOptions& executor,
    const DeviceOpenOptions& open) {
  std::vector<std::unique_ptr<Device>> devices;
  if (flag == "auto" || flag == "all") {
    if (CudaBackendBuilt()) {
      for (int ordinal = 0; ordinal < kMaxCudaDevices; ++ordinal) {
        absl::StatusOr<std::unique_ptr<Device>> cuda =
            OpenCudaDevice(ordinal, CudaOptionsFor(ordinal, open));
        if (!cuda.ok()) {
          if (ordinal == 0) {
            Log(LogLevel::kWarning,
                absl::StrCat("--device=", flag, ": cuda:0 unavailable (", cuda.status().ToString(),
                             "); using the CPU reference backend"));
          }
          break;
        }
        devices.push_back(*std::move(cuda));
        if (flag == "auto") break;
      }
    } else {
      Log(LogLevel::kInfo,
          absl::StrCat("--device=", flag, ": built without CUDA; using the CPU reference backend"));
    }
    if (devices.empty()) {
      ASSIGN_OR_RETURN(std::unique_ptr<Device> cpu, OpenCpuDevice());
      devices.push_back(std::move(cpu));
    }
  } else {
    ASSIGN_OR_RETURN(std::vector<std::string> names, ParseDeviceList(flag));
    for (const std::string& name : names) {
      ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenNamed(name, open));
      devices.push_back(std::move(device));
    }
  }
  auto pool = std::make_unique<DevicePool>(std::move(devices), executor);
  for (const FaultInjection& fault : open.faults) {
    if (pool->Find(fault.device) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--inject_device_fault: ", fault.device, " is not served here (",
                       pool->Names(), ")"));
    }
    Log(LogLevel::kWarning,
        absl::StrCat("--inject_device_fault: kernel launch ", fault.after_launches + 1, " on ",
                     fault.device, " will fail as a sticky fault would (testing only)"));
  }
  return pool;
}

DevicePool::DevicePool(std::vector<std::unique_ptr<Device>> devices,
                       const ExecutorOptions& executor) {
  for (std::unique_ptr<Device>& device : devices) {
    Slot slot;
    slot.name = device->info().name;
    ExecutorOptions options = executor;
    options.name = slot.name;
    slot.device = std::move(device);
    slot.executor = std::make_unique<DeviceExecutor>(options);
    slots_.push_back(std::move(slot));
  }
}

int DevicePool::Find(const std::string& name) const {
  for (int i = 0; i < size(); ++i) {
    if (slots_[i].name == name) return i;
  }
  return -1;
}

absl::StatusOr<int> DevicePool::Place(const std::string& requested,
                                      const std::vector<DeviceLoad>& loads) const {
  if (!requested.empty()) {
    const int index = Find(requested);
    if (index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("device: '", requested, "' is not served here; this server runs on ",
                       Names(), " (leave device empty for the server's choice)"));
    }
    if (!device(index).healthy()) {
      return absl::UnavailableError(
          absl::StrCat("device: ", requested,
                       " hit a sticky error and takes no new sessions until the server restarts"));
    }
    return index;
  }
  // The least loaded of the healthy devices (their indices kept for ties).
  std::vector<DeviceLoad> healthy_loads;
  std::vector<int> healthy;
  for (int i = 0; i < size(); ++i) {
    if (!device(i).healthy()) continue;
    healthy.push_back(i);
    healthy_loads.push_back(loads[i]);
  }
  if (healthy.empty()) {
    return absl::UnavailableError(absl::StrCat(
        "no device can take a new session: ", Names(), " hit sticky errors"));
  }
  return healthy[LeastLoaded(healthy_loads)];
}

std::vector<HealthEntry> DevicePool::Health(const std::string& service_name) const {
  std::vector<HealthEntry> entries;
  bool any = false;
  for (int i = 0; i < size(); ++i) {
    const bool serving = device(i).healthy();
    any = any || serving;
    entries.push_back({name(i), serving});
  }
  entries.push_back({"", any});
  entries.push_back({service_name, any});
  return entries;
}

std::string DevicePool::UnhealthyNames() const {
  std::vector<std::string> names;
  for (int i = 0; i < size(); ++i) {
    if (!device(i).healthy()) names.push_back(name(i));
  }
  return absl::StrJoin(names, ", ");
}

std::string DevicePool::Names() const {
  std::vector<std::string> names;
  for (const Slot& slot : slots_) names.push_back("'" + slot.name + "'");
  return absl::StrJoin(names, ", ");
}

}  // namespace te::service
