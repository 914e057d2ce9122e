// te.v1.DType (the wire's element types) <-> te::DType (the op library's):
// one mapping for the server and both C++ clients, so a dtype added to the
// API is added here once. Thread-safe (pure functions).
#ifndef TE_PROTO_DTYPE_H_
#define TE_PROTO_DTYPE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/tensor.h"
#include "te/v1/tensor.pb.h"

namespace te {

// The wire value of `dtype`. Every te::DType has one.
te::v1::DType DTypeToProto(DType dtype);

// The te::DType of wire value `dtype`. INVALID_ARGUMENT naming `field` (e.g.
// "x.dtype") for DTYPE_UNSPECIFIED or a value this build does not know (a
// newer peer's).
absl::StatusOr<DType> DTypeFromProto(te::v1::DType dtype, absl::string_view field);

// The te::DType of a wire value that must be a non-FP8 float (a computation
// or parameter dtype): FLOAT32, BFLOAT16 or FLOAT16. INVALID_ARGUMENT
// "<field>: <NAME> (<value>); want FLOAT32, BFLOAT16 or FLOAT16" otherwise.
absl::StatusOr<DType> FloatDTypeFromProto(te::v1::DType dtype, absl::string_view field);

}  // namespace te

#endif  // TE_PROTO_DTYPE_H_
