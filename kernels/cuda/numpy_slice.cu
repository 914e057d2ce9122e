// Strided slices (numpy's basic slicing) and their gradient: a gather of the
// slice's elements in y's order (coalesced writes), and for the backward a
// zero fill of dx followed by the scatter of dy to the same places. Elements
// move as bytes of their size, so any dtype slices (token ids, masks).
#include "kernels/broadcast.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// y[i] = x[offset(i)] (gather), or x[offset(i)] = y[i] (scatter).
template <typename T, bool kScatter>
__global__ void SliceKernel(SliceGeometry g, T* x, T* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t at = g.x_offset + Unravel(g.rank, g.dims, g.x_strides, i);
    if (kScatter) {
      x[at] = y[i];
    } else {
      y[i] = x[at];
    }
  }
}

template <bool kScatter>
void LaunchSlice(const SliceGeometry& g, void* x, void* y, size_t element_bytes, int64_t n,
                 SmCount sms, cudaStream_t stream) {
  const unsigned blocks = GridFor(n, sms);
  switch (element_bytes) {
    case 1:
      SliceKernel<uint8_t, kScatter><<<blocks, kThreads, 0, stream>>>(g, static_cast<uint8_t*>(x),
                                                                      static_cast<uint8_t*>(y), n);
      break;
    case 2:
      SliceKernel<uint16_t, kScatter><<<blocks, kThreads, 0, stream>>>(
          g, static_cast<uint16_t*>(x), static_cast<uint16_t*>(y), n);
      break;
    default:
      SliceKernel<uint32_t, kScatter><<<blocks, kThreads, 0, stream>>>(
          g, static_cast<uint32_t*>(x), static_cast<uint32_t*>(y), n);
      break;
  }
}

}  // namespace

absl::Status CudaOps::Slice(const Tensor& x, const std::vector<int64_t>& start,
                            const std::vector<int64_t>& stride, Tensor* y) {
  ASSIGN_OR_RETURN(const SliceGeometry g, CheckSliceArgs("Slice", x, start, stride, y, false));
  if (y->numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  LaunchSlice<false>(g, x.data(), y->data(), DTypeSize(x.dtype()), y->numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::SliceBackward(const Tensor& dy, const std::vector<int64_t>& start,
                                    const std::vector<int64_t>& stride, Tensor* dx) {
  ASSIGN_OR_RETURN(const SliceGeometry g,
                   CheckSliceArgs("SliceBackward", *dx, start, stride, &dy, true));
  if (dx->numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dx->data(), 0, dx->nbytes(), stream()));
  if (dy.numel() == 0) return absl::OkStatus();
  LaunchSlice<true>(g, dx->data(), dy.data(), DTypeSize(dx->dtype()), dy.numel(), sms(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
