// Element access by a dtype known at run time, for jax.numpy's ops
// (numpy_elementwise.cu, numpy_reduce.cu): their operands may each be any
// float dtype, so one kernel reads each through a switch that every thread
// of a warp takes alike, instead of a template instance per dtype tuple.
// Loads and stores round as common.cuh's formats do (the CPU reference's
// casts).
#ifndef TE_KERNELS_CUDA_NUMPY_ACCESS_CUH_
#define TE_KERNELS_CUDA_NUMPY_ACCESS_CUH_

#include "kernels/cuda/common.cuh"

namespace te {
namespace cuda {

__device__ __forceinline__ float LoadAt(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return BF16::Load(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return F16::Load(static_cast<const uint16_t*>(p)[i]);
    case DType::kE4M3: return E4M3::Load(static_cast<const uint8_t*>(p)[i]);
    case DType::kE5M2: return E5M2::Load(static_cast<const uint8_t*>(p)[i]);
    case DType::kI32: return static_cast<float>(static_cast<const int32_t*>(p)[i]);
    case DType::kBool: return static_cast<const uint8_t*>(p)[i] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

__device__ __forceinline__ void StoreAt(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(p)[i] = v; return;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = BF16::Store(v); return;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = F16::Store(v); return;
    case DType::kE4M3: static_cast<uint8_t*>(p)[i] = E4M3::Store(v); return;
    case DType::kE5M2: static_cast<uint8_t*>(p)[i] = E5M2::Store(v); return;
    case DType::kI32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case DType::kBool: static_cast<uint8_t*>(p)[i] = v != 0.0f ? 1 : 0; return;
  }
}

// A pointer and its dtype, passed to kernels by value.
struct Operand {
  const void* data = nullptr;
  DType dtype = DType::kF32;
};
struct Output {
  void* data = nullptr;
  DType dtype = DType::kF32;
};
inline Operand OperandOf(const Tensor& t) { return Operand{t.data(), t.dtype()}; }
inline Output OutputOf(Tensor* t) {
  return t == nullptr ? Output{} : Output{t->data(), t->dtype()};
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_NUMPY_ACCESS_CUH_
