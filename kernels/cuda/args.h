// Argument checks for the CUDA ops, run on the host before any launch so a
// failing op writes nothing. Each failure is INVALID_ARGUMENT naming the op
// and the argument, as the CPU reference's checks do.
#ifndef TE_KERNELS_CUDA_ARGS_H_
#define TE_KERNELS_CUDA_ARGS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

bool IsComputeFloat(DType dtype);  // f32, bf16, f16

absl::Status RequireDefined(const char* op, const char* name, const Tensor* t);
// Defined, with dtype f32, bf16 or f16.
absl::Status RequireFloat(const char* op, const char* name, const Tensor* t);
absl::Status RequireDType(const char* op, const char* name, const Tensor* t, DType want);
// A [1] float32 tensor (scales, amaxes).
absl::Status RequireScalarF32(const char* op, const char* name, const Tensor* t);
absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want);
absl::Status RequireSameCount(const char* op, const char* name, const Tensor& t,
                              const char* other_name, const Tensor& other);
// y is float (and fp8 null), or FP8 with an Fp8Output of three [1] f32 tensors.
absl::Status CheckOutput(const char* op, const Tensor* y, const Fp8Output* fp8);

// Rows of a [..., H] tensor: prod(shape[:-1]).
int64_t Rows(const Tensor& t);
// An optional output the caller asked for: non-null with memory.
bool Wanted(const Tensor* t);

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ARGS_H_
