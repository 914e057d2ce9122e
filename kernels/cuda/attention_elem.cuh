// Element access for the unfused attention kernels (attention_fallback.cu,
// attention_small_head.cu): q, k, v, out and their gradients are f32, bf16 or
// f16, chosen at run time, and every kernel computes in float32.
#ifndef TE_KERNELS_CUDA_ATTENTION_ELEM_CUH_
#define TE_KERNELS_CUDA_ATTENTION_ELEM_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8.h"  // FloatToBf16 / FloatToFp16: the CPU reference's casts
#include "kernels/tensor.h"

namespace te {
namespace cuda {

// Element i of p (f32, bf16 or f16; the caller has checked the dtype) as float.
__device__ __forceinline__ float LoadElem(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(p)[i];
    case DType::kBF16:
      return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
    default:  // kF16 (checked by the caller)
      return __half2float(__ushort_as_half(static_cast<const uint16_t*>(p)[i]));
  }
}

// Stores v as element i of p, rounding once, to nearest even, with the CPU
// reference's casts (kernels/fp8.h), so both backends write the same bits.
__device__ __forceinline__ void StoreElem(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16(v);
      break;
    default:
      static_cast<uint16_t*>(p)[i] = FloatToFp16(v);
      break;
  }
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ATTENTION_ELEM_CUH_
