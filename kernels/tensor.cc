#include "kernels/tensor.h"

#include <cassert>
#include <limits>
#include <utility>

namespace te {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kE4M3: return 1;
    case DType::kE5M2: return 1;
    case DType::kI32: return 4;
    case DType::kBool: return 1;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kE4M3: return "float8_e4m3fn";
    case DType::kE5M2: return "float8_e5m2";
    case DType::kI32: return "int32";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

bool IsFloat8(DType dtype) { return dtype == DType::kE4M3 || dtype == DType::kE5M2; }

bool IsFloating(DType dtype) { return dtype != DType::kI32 && dtype != DType::kBool; }

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    // Saturates instead of wrapping (undefined, and a wrapped count can look
    // small): a shape this large fits no limit, so every size check refuses it.
    if (__builtin_mul_overflow(n, d, &n)) return std::numeric_limits<int64_t>::max();
  }
  return n;
}

std::optional<int64_t> CheckedNumElements(const Shape& shape) {
  int64_t n = 1;
  bool overflow = false;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    // A zero dimension makes the count 0, but an overflow before it still
    // says the shape is out of range.
    overflow = overflow || __builtin_mul_overflow(n, d, &n);
  }
  if (overflow) return std::nullopt;
  return n;
}

std::optional<int64_t> CheckedNumBytes(const Shape& shape, DType dtype) {
  const std::optional<int64_t> n = CheckedNumElements(shape);
  int64_t bytes = 0;
  if (!n || __builtin_mul_overflow(*n, static_cast<int64_t>(DTypeSize(dtype)), &bytes)) {
    return std::nullopt;
  }
  return bytes;
}

std::string ShapeString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

Tensor::Tensor(std::shared_ptr<void> storage, void* data, DType dtype, Shape shape)
    : storage_(std::move(storage)),
      data_(data),
      dtype_(dtype),
      shape_(std::move(shape)),
      numel_(NumElements(shape_)) {}

Tensor Tensor::Reshaped(Shape shape) const {
  assert(NumElements(shape) == numel());
  return Tensor(storage_, data_, dtype_, std::move(shape));
}

Tensor Tensor::Slice0(int64_t begin, int64_t end) const {
  Shape shape = shape_;
  const int64_t row = shape.empty() ? 1 : numel() / (shape[0] == 0 ? 1 : shape[0]);
  shape[0] = end - begin;
  char* base = static_cast<char*>(data_) + begin * row * static_cast<int64_t>(DTypeSize(dtype_));
  return Tensor(storage_, base, dtype_, std::move(shape));
}

Tensor Tensor::As2D() const {
  const int64_t cols = shape_.empty() ? 1 : shape_.back();
  return Reshaped({cols == 0 ? 0 : numel() / cols, cols});
}

}  // namespace te
