// The sizing of a CUDA device's shared memory account (cuda_device.cc), apart
// from the driver so it is tested without a GPU.
#ifndef TE_KERNELS_CUDA_CUDA_DEVICE_H_
#define TE_KERNELS_CUDA_CUDA_DEVICE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace te {
namespace cuda {

// The bytes device `ordinal`'s sessions may hold together, given the bytes
// the driver reports free once the device is open: options.memory_bytes when
// set, else the free bytes less options.memory_reserve_bytes. UNAVAILABLE
// (the device is not opened) when nothing is left beyond the reserve or
// memory_bytes asks for more than that; INVALID_ARGUMENT for a negative size.
absl::StatusOr<int64_t> SessionsMemoryBytes(int ordinal, int64_t free_bytes,
                                            const CudaDeviceOptions& options);

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_CUDA_DEVICE_H_
