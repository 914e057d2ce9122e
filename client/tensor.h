// HostTensor: a tensor in client memory (dtype, shape, little-endian bytes),
// the value type the client library sends to and receives from te_server.
// A HostTensor is a plain value: copies copy the bytes; it is thread-compatible.
#ifndef TE_CLIENT_TENSOR_H_
#define TE_CLIENT_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/tensor.h"  // te::DType, te::Shape: one enum for the whole project
#include "proto/dtype.h"    // te::DTypeToProto / DTypeFromProto: the wire's dtypes
#include "te/v1/tensor.pb.h"

namespace te::client {

using ::te::DType;  // kF32, kBF16, kF16, kE4M3, kE5M2, kI32, kBool
using ::te::Shape;

class HostTensor {
 public:
  HostTensor() = default;  // float32 [0]: empty

  // Takes `bytes` as the tensor's data. INVALID_ARGUMENT when a dim is
  // negative or the byte count is not numel * dtype size.
  static absl::StatusOr<HostTensor> FromBytes(DType dtype, Shape shape, std::string bytes);

  // Rounds each value to `dtype` with kernels/fp8.h's casts (nearest even;
  // FP8 saturates), as jnp.asarray(values).astype(dtype) does. Integer and
  // bool dtypes take rint(v) and v != 0. INVALID_ARGUMENT when values.size()
  // differs from the shape's element count.
  static absl::StatusOr<HostTensor> FromFloats(const Shape& shape, absl::Span<const float> values,
                                               DType dtype = DType::kF32);

  // Standard normal values (Box-Muller over a counter-based generator: the
  // same seed gives the same tensor on every platform), rounded to `dtype`:
  // jax.random.normal(key, shape).astype(dtype), with another generator.
  static HostTensor RandomNormal(const Shape& shape, DType dtype, uint64_t seed);

  // Every element `value` (rounded to dtype).
  static HostTensor Full(const Shape& shape, DType dtype, float value);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return NumElements(shape_); }
  const std::string& bytes() const { return bytes_; }

  // Every element as float32 (exact for every float dtype).
  std::vector<float> ToFloats() const;

  // The same bytes viewed with another shape. INVALID_ARGUMENT when the
  // element counts differ.
  absl::StatusOr<HostTensor> Reshaped(Shape shape) const;

  // "bfloat16[2, 32, 64]".
  std::string DebugString() const;

 private:
  HostTensor(DType dtype, Shape shape, std::string bytes)
      : dtype_(dtype), shape_(std::move(shape)), bytes_(std::move(bytes)) {}

  DType dtype_ = DType::kF32;
  Shape shape_ = {0};
  std::string bytes_;
};

// The causal mask in the API's convention (bool [batch, 1, seq, seq], true =
// masked out: key j > query i). Flax's nn.make_causal_mask is its negation.
HostTensor CausalMask(int64_t batch, int64_t seq);

// A te.v1.Tensor carrying `tensor` inline.
te::v1::Tensor ToInlineProto(const HostTensor& tensor);
// An inline te.v1.Tensor as a HostTensor. INVALID_ARGUMENT when it is not
// inline or its bytes do not match its shape; the message names `field`.
absl::StatusOr<HostTensor> FromInlineProto(const te::v1::Tensor& tensor, const std::string& field);

// Host arithmetic for glue that runs on the client (residual adds): f32
// accumulation, one rounding to a's dtype, as XLA computes a bf16 add.
// INVALID_ARGUMENT when the shapes differ.
absl::StatusOr<HostTensor> Add(const HostTensor& a, const HostTensor& b);

// Splits the last axis into `parts` equal pieces (jnp.split(t, parts, axis=-1)),
// and its inverse. INVALID_ARGUMENT when the axis does not divide, or when
// the tensors to join differ in dtype or leading dims.
absl::StatusOr<std::vector<HostTensor>> SplitLastAxis(const HostTensor& t, int parts);
absl::StatusOr<HostTensor> ConcatLastAxis(const std::vector<HostTensor>& parts);

// sum(a * b) in double: jnp.vdot for real tensors. INVALID_ARGUMENT when the
// element counts differ.
absl::StatusOr<double> Vdot(const HostTensor& a, const HostTensor& b);

}  // namespace te::client

#endif  // TE_CLIENT_TENSOR_H_
