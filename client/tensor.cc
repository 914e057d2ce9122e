#include "client/tensor.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "kernels/rng.h"

namespace te::client {
namespace {

// Writes v as element i of `out` (dtype's encoding).
void StoreElement(DType dtype, float v, int64_t i, char* out) {
  switch (dtype) {
    case DType::kF32:
      memcpy(out + 4 * i, &v, 4);
      return;
    case DType::kBF16: {
      const uint16_t h = FloatToBf16(v);
      memcpy(out + 2 * i, &h, 2);
      return;
    }
    case DType::kF16: {
      const uint16_t h = FloatToFp16(v);
      memcpy(out + 2 * i, &h, 2);
      return;
    }
    case DType::kE4M3:
      out[i] = static_cast<char>(FloatToE4M3(v));
      return;
    case DType::kE5M2:
      out[i] = static_cast<char>(FloatToE5M2(v));
      return;
    case DType::kI32: {
      const int32_t n = static_cast<int32_t>(std::lrintf(v));
      memcpy(out + 4 * i, &n, 4);
      return;
    }
    case DType::kBool:
      out[i] = v != 0.0f ? 1 : 0;
      return;
  }
}

float LoadElement(DType dtype, int64_t i, const char* in) {
  switch (dtype) {
    case DType::kF32: {
      float v;
      memcpy(&v, in + 4 * i, 4);
      return v;
    }
    case DType::kBF16: {
      uint16_t h;
      memcpy(&h, in + 2 * i, 2);
      return Bf16ToFloat(h);
    }
    case DType::kF16: {
      uint16_t h;
      memcpy(&h, in + 2 * i, 2);
      return Fp16ToFloat(h);
    }
    case DType::kE4M3: return E4M3ToFloat(static_cast<uint8_t>(in[i]));
    case DType::kE5M2: return E5M2ToFloat(static_cast<uint8_t>(in[i]));
    case DType::kI32: {
      int32_t n;
      memcpy(&n, in + 4 * i, 4);
      return static_cast<float>(n);
    }
    case DType::kBool: return in[i] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

absl::Status CheckShape(const Shape& shape) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " has a negative dim"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostTensor> HostTensor::FromBytes(DType dtype, Shape shape, std::string bytes) {
  if (absl::Status s = CheckShape(shape); !s.ok()) return s;
  const size_t want = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  if (bytes.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("bytes: ", bytes.size(), " bytes for ", DTypeName(dtype),
                                                   ShapeString(shape), ", which needs ", want));
  }
  return HostTensor(dtype, std::move(shape), std::move(bytes));
}

absl::StatusOr<HostTensor> HostTensor::FromFloats(const Shape& shape, absl::Span<const float> values,
                                                  DType dtype) {
  if (absl::Status s = CheckShape(shape); !s.ok()) return s;
  const int64_t n = NumElements(shape);
  if (static_cast<int64_t>(values.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("values: ", values.size(), " values for shape ", ShapeString(shape), " (", n, " elements)"));
  }
  std::string bytes(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  for (int64_t i = 0; i < n; ++i) StoreElement(dtype, values[i], i, bytes.data());
  return HostTensor(dtype, shape, std::move(bytes));
}

HostTensor HostTensor::RandomNormal(const Shape& shape, DType dtype, uint64_t seed) {
  const int64_t n = NumElements(shape);
  std::string bytes(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  constexpr float kTwoPi = 6.28318530717958647692f;
  for (int64_t i = 0; i < n; i += 2) {
    // Box-Muller: two uniforms give two independent normals. 1 - u keeps the
    // log's argument in (0, 1].
    const float u1 = 1.0f - DropoutUniform(seed, static_cast<uint64_t>(i));
    const float u2 = DropoutUniform(seed, static_cast<uint64_t>(i) + 1);
    const float r = std::sqrt(-2.0f * std::log(u1));
    StoreElement(dtype, r * std::cos(kTwoPi * u2), i, bytes.data());
    if (i + 1 < n) StoreElement(dtype, r * std::sin(kTwoPi * u2), i + 1, bytes.data());
  }
  return HostTensor(dtype, shape, std::move(bytes));
}

HostTensor HostTensor::Full(const Shape& shape, DType dtype, float value) {
  const int64_t n = NumElements(shape);
  std::string bytes(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  for (int64_t i = 0; i < n; ++i) StoreElement(dtype, value, i, bytes.data());
  return HostTensor(dtype, shape, std::move(bytes));
}

std::vector<float> HostTensor::ToFloats() const {
  const int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = LoadElement(dtype_, i, bytes_.data());
  return out;
}

absl::StatusOr<HostTensor> HostTensor::Reshaped(Shape shape) const {
  if (absl::Status s = CheckShape(shape); !s.ok()) return s;
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape: cannot view ", DebugString(), " as ", ShapeString(shape)));
  }
  return HostTensor(dtype_, std::move(shape), bytes_);
}

std::string HostTensor::DebugString() const { return absl::StrCat(DTypeName(dtype_), ShapeString(shape_)); }

HostTensor CausalMask(int64_t batch, int64_t seq) {
  std::string bytes(static_cast<size_t>(batch * seq * seq), '\0');
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      for (int64_t j = i + 1; j < seq; ++j) bytes[(b * seq + i) * seq + j] = 1;
    }
  }
  return *HostTensor::FromBytes(DType::kBool, {batch, 1, seq, seq}, std::move(bytes));
}

te::v1::Tensor ToInlineProto(const HostTensor& tensor) {
  te::v1::Tensor proto;
  proto.set_dtype(DTypeToProto(tensor.dtype()));
  for (int64_t d : tensor.shape()) proto.add_shape(d);
  proto.set_inline_data(tensor.bytes());
  return proto;
}

absl::StatusOr<HostTensor> FromInlineProto(const te::v1::Tensor& tensor, const std::string& field) {
  if (tensor.data_case() != te::v1::Tensor::kInlineData) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected inline data"));
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(tensor.dtype(), field + ".dtype");
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<HostTensor> out =
      HostTensor::FromBytes(*dtype, Shape(tensor.shape().begin(), tensor.shape().end()), tensor.inline_data());
  if (!out.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ".", out.status().message()));
  return out;
}

absl::StatusOr<HostTensor> Add(const HostTensor& a, const HostTensor& b) {
  if (a.shape() != b.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("Add: shapes differ: ", a.DebugString(), " + ", b.DebugString()));
  }
  std::vector<float> x = a.ToFloats();
  const std::vector<float> y = b.ToFloats();
  for (size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  return HostTensor::FromFloats(a.shape(), x, a.dtype());
}

absl::StatusOr<std::vector<HostTensor>> SplitLastAxis(const HostTensor& t, int parts) {
  if (t.shape().empty() || parts <= 0 || t.shape().back() % parts != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SplitLastAxis: cannot split ", t.DebugString(), " into ", parts, " parts"));
  }
  const int64_t width = t.shape().back();
  const int64_t rows = width == 0 ? 0 : t.numel() / width;
  const size_t elem = DTypeSize(t.dtype());
  const size_t piece = static_cast<size_t>(width / parts) * elem;
  Shape shape = t.shape();
  shape.back() = width / parts;
  std::vector<HostTensor> out;
  for (int p = 0; p < parts; ++p) {
    std::string bytes(static_cast<size_t>(rows) * piece, '\0');
    for (int64_t r = 0; r < rows; ++r) {
      memcpy(bytes.data() + r * piece, t.bytes().data() + r * width * elem + p * piece, piece);
    }
    out.push_back(*HostTensor::FromBytes(t.dtype(), shape, std::move(bytes)));
  }
  return out;
}

absl::StatusOr<HostTensor> ConcatLastAxis(const std::vector<HostTensor>& parts) {
  if (parts.empty() || parts[0].shape().empty()) {
    return absl::InvalidArgumentError("ConcatLastAxis: needs at least one tensor of rank >= 1");
  }
  const HostTensor& first = parts[0];
  Shape lead(first.shape().begin(), first.shape().end() - 1);
  int64_t width = 0;
  for (const HostTensor& p : parts) {
    if (p.dtype() != first.dtype() || p.shape().empty() ||
        Shape(p.shape().begin(), p.shape().end() - 1) != lead) {
      return absl::InvalidArgumentError(absl::StrCat("ConcatLastAxis: ", p.DebugString(),
                                                     " does not fit beside ", first.DebugString()));
    }
    width += p.shape().back();
  }
  const int64_t rows = NumElements(lead);
  const size_t elem = DTypeSize(first.dtype());
  std::string bytes(static_cast<size_t>(rows * width) * elem, '\0');
  size_t offset = 0;
  for (const HostTensor& p : parts) {
    const size_t piece = static_cast<size_t>(p.shape().back()) * elem;
    for (int64_t r = 0; r < rows; ++r) {
      memcpy(bytes.data() + r * width * elem + offset, p.bytes().data() + r * piece, piece);
    }
    offset += piece;
  }
  Shape shape = lead;
  shape.push_back(width);
  return HostTensor::FromBytes(first.dtype(), std::move(shape), std::move(bytes));
}

absl::StatusOr<double> Vdot(const HostTensor& a, const HostTensor& b) {
  if (a.numel() != b.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("Vdot: ", a.DebugString(), " and ", b.DebugString()));
  }
  const std::vector<float> x = a.ToFloats();
  const std::vector<float> y = b.ToFloats();
  double sum = 0.0;
  for (size_t i = 0; i < x.size(); ++i) sum += static_cast<double>(x[i]) * y[i];
  return sum;
}

}  // namespace te::client
