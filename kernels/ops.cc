#include "kernels/ops.h"

#include "absl/strings/str_cat.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {

absl::StatusOr<Tensor> Ops::Allocate(DType dtype, Shape shape) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeString(shape)));
  }
  const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  if (bytes == 0) return Tensor(nullptr, nullptr, dtype, std::move(shape));
  if (bytes_in_use_->load() + static_cast<int64_t>(bytes) > memory_limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("allocating ", bytes, " bytes for ", ShapeString(shape), " ", DTypeName(dtype),
                     " would exceed the memory limit of ", memory_limit_, " bytes (",
                     bytes_in_use_->load(), " in use)"));
  }
  auto raw = AllocateBytes(bytes);
  if (!raw.ok()) return raw.status();
  std::shared_ptr<void> memory = *std::move(raw);
  void* data = memory.get();
  *bytes_in_use_ += static_cast<int64_t>(bytes);
  // The account outlives this Ops if a tensor does.
  std::shared_ptr<std::atomic<int64_t>> account = bytes_in_use_;
  std::shared_ptr<void> storage(data, [memory, account, bytes](void*) mutable {
    *account -= static_cast<int64_t>(bytes);
    memory.reset();
  });
  return Tensor(std::move(storage), data, dtype, std::move(shape));
}

absl::Status Ops::QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y, Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(Quantize(x, fp8, y));
  return Permute(*y, {1, 0}, y_t);
}

}  // namespace te
