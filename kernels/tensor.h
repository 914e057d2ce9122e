// Tensor: a typed, shaped view of memory owned by one backend (host memory for
// the CPU backend, device memory for CUDA). Copies share storage, like a
// shared_ptr; Reshaped() and Slice0() make views. Not thread-safe to mutate
// concurrently; sessions never share tensors.
#ifndef TE_KERNELS_TENSOR_H_
#define TE_KERNELS_TENSOR_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <memory>
#include <string>
#include <vector>

namespace te {

enum class DType : int {
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kE4M3 = 3,  // FP8 E4M3 (max 448), OCP "fn" variant: no inf, one NaN pattern
  kE5M2 = 4,  // FP8 E5M2 (max 57344), IEEE-like with inf
  kI32 = 5,
  kBool = 6,  // one byte per element
};

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);  // "float32", "bfloat16", ... (numpy / JAX names)
bool IsFloat8(DType dtype);
bool IsFloating(DType dtype);  // f32, bf16, f16, e4m3, e5m2

using Shape = std::vector<int64_t>;
// The element count; INT64_MAX when the product overflows (for shapes that
// may come from requests, CheckedNumElements says so instead).
int64_t NumElements(const Shape& shape);
// The element count and byte size of a shape, or nullopt when a dimension is
// negative or the count or size does not fit in int64: for shapes that come
// from requests, before anything is allocated.
std::optional<int64_t> CheckedNumElements(const Shape& shape);
std::optional<int64_t> CheckedNumBytes(const Shape& shape, DType dtype);
std::string ShapeString(const Shape& shape);  // "[4, 2048, 4096]"

class Tensor {
 public:
  Tensor() = default;
  // `storage` keeps the memory alive; `data` points inside it.
  Tensor(std::shared_ptr<void> storage, void* data, DType dtype, Shape shape);

  bool defined() const { return data_ != nullptr || numel_ == 0; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_[i < 0 ? i + rank() : i]; }
  // Made once with the shape: the CPU reference's element loops test it at
  // every element.
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }

  // A view with another shape and the same number of elements.
  Tensor Reshaped(Shape shape) const;
  // A view of rows [begin, end) along dimension 0.
  Tensor Slice0(int64_t begin, int64_t end) const;
  // Rows as [prod(shape[:-1]), shape[-1]].
  Tensor As2D() const;

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Shape shape_;
  int64_t numel_ = 1;  // NumElements(shape_); a scalar's 1
};

}  // namespace te

#endif  // TE_KERNELS_TENSOR_H_
