#include "kernels/cuda/check.h"

#include <atomic>

#include "absl/strings/str_cat.h"

namespace te {
namespace cuda {
namespace {

constexpr int kMaxDevices = 64;

// One flag per device ordinal for the process (see check.h for why global).
std::atomic<bool>& UnhealthyFlag(int ordinal) {
  static std::atomic<bool> flags[kMaxDevices];
  static std::atomic<bool> out_of_range{false};
  return ordinal >= 0 && ordinal < kMaxDevices ? flags[ordinal] : out_of_range;
}

LaunchFaultCountdown& Countdown(int ordinal) {
  static LaunchFaultCountdown countdowns[kMaxDevices];
  static LaunchFaultCountdown out_of_range;
  return ordinal >= 0 && ordinal < kMaxDevices ? countdowns[ordinal] : out_of_range;
}

// Whether any device is armed: what keeps LaunchError to one load on the
// launch path of a server that injects nothing.
std::atomic<bool> any_fault_armed{false};

std::string Where(const char* expr, const char* file, int line) {
  return absl::StrCat(expr, " at ", file, ":", line);
}

}  // namespace

bool IsStickyError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

void MarkDeviceUnhealthy(int ordinal) { UnhealthyFlag(ordinal).store(true); }

bool DeviceHealthy(int ordinal) { return !UnhealthyFlag(ordinal).load(); }

void LaunchFaultCountdown::Arm(int64_t after_launches) {
  left_.store(after_launches < 0 ? -1 : after_launches);
}

bool LaunchFaultCountdown::CountLaunch() {
  int64_t left = left_.load();
  // Down by one per launch; the launch that finds 0 fails and disarms.
  while (left >= 0) {
    if (left_.compare_exchange_weak(left, left - 1)) return left == 0;
  }
  return false;
}

bool LaunchFaultCountdown::armed() const { return left_.load() >= 0; }

void InjectLaunchFault(int ordinal, int64_t after_launches) {
  Countdown(ordinal).Arm(after_launches);
  if (after_launches >= 0) any_fault_armed.store(true);
}

cudaError_t LaunchError() {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || !any_fault_armed.load(std::memory_order_relaxed)) return error;
  int ordinal = -1;
  if (cudaGetDevice(&ordinal) != cudaSuccess) return cudaSuccess;
  return Countdown(ordinal).CountLaunch() ? cudaErrorLaunchFailure : cudaSuccess;
}

absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file, int line) {
  const std::string message =
      absl::StrCat("CUDA error ", cudaGetErrorName(error), " (", cudaGetErrorString(error),
                   ") from ", Where(expr, file, line));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  if (IsStickyError(error)) {
    int ordinal = -1;
    // cudaGetDevice still answers after a sticky error: it reads host state.
    if (cudaGetDevice(&ordinal) == cudaSuccess) MarkDeviceUnhealthy(ordinal);
    return absl::InternalError(absl::StrCat(message, "; the device (cuda:", ordinal,
                                            ") is unusable until the server restarts"));
  }
  return absl::InternalError(message);
}

absl::Status CublasErrorToStatus(cublasStatus_t status, const char* expr, const char* file,
                                 int line) {
  const std::string message = absl::StrCat("cuBLAS error ", static_cast<int>(status), " (",
                                           cublasLtGetStatusString(status), ") from ",
                                           Where(expr, file, line));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) return absl::UnimplementedError(message);
  // A failed execution may hide a sticky fault: look at the runtime's error.
  if (status == CUBLAS_STATUS_EXECUTION_FAILED) {
    const cudaError_t error = cudaPeekAtLastError();
    if (IsStickyError(error)) return CudaErrorToStatus(error, expr, file, line);
  }
  return absl::InternalError(message);
}

absl::Status CudnnErrorToStatus(cudnnStatus_t status, const char* expr, const char* file,
                                int line) {
  const std::string message = absl::StrCat("cuDNN error ", static_cast<int>(status), " (",
                                           cudnnGetErrorString(status), ") from ",
                                           Where(expr, file, line));
  // cuDNN 9 codes are a category (thousands) plus a detail.
  const int category = static_cast<int>(status) / 1000 * 1000;
  if (status == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    return absl::ResourceExhaustedError(message);
  }
  if (category == CUDNN_STATUS_NOT_SUPPORTED) return absl::UnimplementedError(message);
  if (category == CUDNN_STATUS_EXECUTION_FAILED) {
    const cudaError_t error = cudaPeekAtLastError();
    if (IsStickyError(error)) return CudaErrorToStatus(error, expr, file, line);
  }
  return absl::InternalError(message);
}

}  // namespace cuda
}  // namespace te
