// Variable names and checks shared by every module.
//
// Names follow Flax: "<collection>/<scope>/<name>", where scope is the module
// path inside the layer ("" for a standalone module, "qkv", "mlp"...):
//   VariableName("params", "qkv", "kernel")     == "params/qkv/kernel"
//   VariableName("fp8_metas", "", "x_scale")    == "fp8_metas/x_scale"
#ifndef TE_SERVER_LAYERS_VARIABLES_H_
#define TE_SERVER_LAYERS_VARIABLES_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

inline constexpr char kParams[] = "params";
inline constexpr char kFp8Metas[] = "fp8_metas";

// Joins non-empty parts with '/'.
std::string JoinScope(absl::string_view parent, absl::string_view child);
std::string VariableName(absl::string_view collection, absl::string_view scope,
                         absl::string_view name);

// The variable `name`, or FAILED_PRECONDITION naming it (the layer was not
// initialised, or its variables were replaced by an incomplete set).
absl::StatusOr<Tensor> GetVariable(const Variables& vars, const std::string& name);

// Every spec is present with its shape and dtype. A missing fp8_metas
// variable is FAILED_PRECONDITION with TE's ScopeCollectionNotFound advice
// (init under autocast with a DelayedScaling recipe); a missing param is
// FAILED_PRECONDITION; a shape or dtype that differs is INVALID_ARGUMENT naming
// the variable and both shapes (usually x does not fit the initialised layer).
// An amax_history may have any length (the one chosen at init).
absl::Status CheckVariables(const Variables& vars, const std::vector<VariableSpec>& specs);

// te.v1.ParamDType -> DType (unspecified: float32, TE's default).
DType ParamDTypeOf(te::v1::ParamDType dtype);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_VARIABLES_H_
