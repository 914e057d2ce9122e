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

#include "absl/status/status.h"

namespace te {
namespace cuda {

// True for errors after which the CUDA context of the device is unusable.
bool IsStickyError(cudaError_t error);

// Device health, per ordinal, for the whole process: a sticky error corrupts
// the process's context on that device, which every stream on it shares.
void MarkDeviceUnhealthy(int ordinal);
bool DeviceHealthy(int ordinal);

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
// inside the kernel surface later, from a synchronising call).
#define CUDA_RETURN_IF_LAUNCH_ERROR() CUDA_RETURN_IF_ERROR(cudaGetLastError())

#endif  // TE_KERNELS_CUDA_CHECK_H_
