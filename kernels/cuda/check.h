// CUDA, cuBLASLt and cuDNN errors as absl::Status, and device health.
//
//   CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p, 0, n, stream));
//   CUDA_RETURN_IF_ERROR(cudaGetLastError());  // after a kernel launch
//   CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(...));
//   CUDNN_RETURN_IF_ERROR(cudnnBackendFinalize(...));
//
// Codes: cudaErrorMemoryAllocation (and the libraries' alloc failures) ->
// RESOURCE_EXHAUSTED; a sticky error (the context is corrupted: illegal
// address, launch failure, ECC...) -> INTERNAL, and the current device is
// marked unhealthy for the life of the process, since no later call on that
// context can succeed; a library's "not supported" (a configuration cuBLASLt
// or cuDNN has no kernel for) -> UNIMPLEMENTED, so a caller can fall back;
// anything else -> INTERNAL.
#ifndef TE_KERNELS_CUDA_CHECK_H_
#define TE_KERNELS_CUDA_CHECK_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"

namespace te {
namespace cuda {

// True for errors after which the CUDA context of the device is unusable.
bool IsStickyError(cudaError_t error);

// Device health, per ordinal, for the whole process: a sticky error corrupts
// the process's context on that device, which every stream on it shares.
void MarkDeviceUnhealthy(int ordinal);
bool DeviceHealthy(int ordinal);

// Fault injection, for testing how the server meets a sticky error (te_server
// --inject_device_fault; never reachable from the API). Once armed for a
// device, `after_launches` kernel launches on it pass their check and the
// next one fails with cudaErrorLaunchFailure, as a kernel that faulted would:
// the same status, the same health marking, through the same macro as every
// launch. Fires once. Negative: disarmed.
void InjectLaunchFault(int ordinal, int64_t after_launches);
// What a launch check sees: cudaGetLastError(), or the injected fault on the
// current device. One relaxed atomic load when nothing is armed.
cudaError_t LaunchError();

// The countdown behind InjectLaunchFault, per device; host logic alone, so
// it is tested without a GPU. Thread-safe.
class LaunchFaultCountdown {
 public:
  // Arms (after_launches >= 0) or disarms (negative).
  void Arm(int64_t after_launches);
  // Counts one launch; true for the one that must fail.
  bool CountLaunch();
  bool armed() const;

 private:
  std::atomic<int64_t> left_{-1};  // launches still to pass; -1: disarmed
};

absl::Status CudaErrorToStatus(cudaError_t error, const char* expr, const char* file, int line);
absl::Status CublasErrorToStatus(cublasStatus_t status, const char* expr, const char* file,
                                 int line);
absl::Status CudnnErrorToStatus(cudnnStatus_t status, const char* expr, const char* file,
                                int line);

}  // namespace cuda
}  // namespace te

#define CUDA_RETURN_IF_ERROR(expr)                                                       \
  do {                                                                                   \
    const cudaError_t _te_cuda_error = (expr);                                           \
    if (_te_cuda_error != cudaSuccess) {                                                 \
      return ::te::cuda::CudaErrorToStatus(_te_cuda_error, #expr, __FILE__, __LINE__);   \
    }                                                                                    \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(expr)                                                     \
  do {                                                                                   \
    const cublasStatus_t _te_cublas_status = (expr);                                     \
    if (_te_cublas_status != CUBLAS_STATUS_SUCCESS) {                                    \
      return ::te::cuda::CublasErrorToStatus(_te_cublas_status, #expr, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)

#define CUDNN_RETURN_IF_ERROR(expr)                                                      \
  do {                                                                                   \
    const cudnnStatus_t _te_cudnn_status = (expr);                                       \
    if (_te_cudnn_status != CUDNN_STATUS_SUCCESS) {                                      \
      return ::te::cuda::CudnnErrorToStatus(_te_cudnn_status, #expr, __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)

// After a kernel launch: reports a bad launch configuration at once (faults
// inside the kernel surface later, from a synchronising call), or the fault
// InjectLaunchFault armed.
#define CUDA_RETURN_IF_LAUNCH_ERROR()                                                    \
  do {                                                                                   \
    const cudaError_t _te_launch_error = ::te::cuda::LaunchError();                      \
    if (_te_launch_error != cudaSuccess) {                                               \
      return ::te::cuda::CudaErrorToStatus(_te_launch_error, "kernel launch", __FILE__,  \
                                           __LINE__);                                    \
    }                                                                                    \
  } while (0)

#endif  // TE_KERNELS_CUDA_CHECK_H_
