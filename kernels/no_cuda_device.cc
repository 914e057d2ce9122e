// The CUDA entry points of kernels/ops.h in a build without the CUDA toolkit.
#include <string>

#include "kernels/ops.h"

namespace te {

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal, const CudaDeviceOptions&) {
  return absl::UnavailableError("cuda:" + std::to_string(ordinal) +
                                " unavailable: te_server was built without CUDA");
}

bool CudaBackendBuilt() { return false; }

}  // namespace te
