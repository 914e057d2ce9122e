#include "server/layers/variables.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace te::layers {

std::string JoinScope(absl::string_view parent, absl::string_view child) {
  if (parent.empty()) return std::string(child);
  if (child.empty()) return std::string(parent);
  return absl::StrCat(parent, "/", child);
}

std::string VariableName(absl::string_view collection, absl::string_view scope,
                         absl::string_view name) {
  return JoinScope(JoinScope(collection, scope), name);
}

absl::StatusOr<Tensor> GetVariable(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  if (it == vars.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("variable ", name, " is missing: initialise the layer (or set all of its "
                     "variables) before applying it"));
  }
  return it->second;
}

absl::Status CheckVariables(const Variables& vars, const std::vector<VariableSpec>& specs) {
  for (const VariableSpec& spec : specs) {
    auto it = vars.find(spec.name);
    if (it == vars.end()) {
      if (absl::StartsWith(spec.name, absl::StrCat(kFp8Metas, "/"))) {
        return absl::FailedPreconditionError(absl::StrCat(
            "layer was initialised without FP8 state (collection fp8_metas, missing ", spec.name,
            "): init under autocast with a DelayedScaling recipe"));
      }
      return GetVariable(vars, spec.name).status();
    }
    const Tensor& t = it->second;
    // An amax history keeps the length of the recipe the layer was initialised
    // under (TE reuses the existing variable), so any length >= 1 fits.
    const bool history_fits = absl::EndsWith(spec.name, "_amax_history") && t.rank() == 1 &&
                              t.dim(0) >= 1 && t.dtype() == spec.dtype;
    if (!history_fits && (t.shape() != spec.shape || t.dtype() != spec.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "variable ", spec.name, " is ", ShapeString(t.shape()), " ", DTypeName(t.dtype()),
          " but this input needs ", ShapeString(spec.shape), " ", DTypeName(spec.dtype),
          ": x does not fit the initialised layer"));
    }
  }
  return absl::OkStatus();
}

DType ParamDTypeOf(te::v1::ParamDType dtype) {
  return dtype == te::v1::PARAM_BFLOAT16 ? DType::kBF16 : DType::kF32;
}

}  // namespace te::layers
