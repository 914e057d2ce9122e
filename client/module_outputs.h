// What a module node gives in a client Graph: its outputs' shapes and dtype
// for its inputs', by the rules the server's graph inference applies (and
// the Python tracer's), so the builder can check the glue after it and
// promote dtypes as JAX does.
#ifndef TE_CLIENT_MODULE_OUTPUTS_H_
#define TE_CLIENT_MODULE_OUTPUTS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "client/tensor.h"
#include "te/v1/layers.pb.h"

namespace te::client {

struct ModuleOutputs {
  std::vector<Shape> shapes;  // y, then ln_out for a module that returns it
  DType dtype = DType::kF32;  // every output's
};

// jnp.result_type of float32, bfloat16, float16: equal stays, else float32.
DType PromoteFloat(DType a, DType b);

// `inputs`: x's shape, then the extra inputs' (k, v). INVALID_ARGUMENT when
// the shapes do not fit the module (the message names the field);
// UNIMPLEMENTED for a graph inside a graph.
absl::StatusOr<ModuleOutputs> InferModuleOutputs(const te::v1::LayerSpec& spec, const std::vector<Shape>& inputs,
                                                 DType x_dtype);

}  // namespace te::client

#endif  // TE_CLIENT_MODULE_OUTPUTS_H_
