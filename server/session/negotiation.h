// Recipe negotiation: which FP8 recipe a session runs, given the client's
// preferences in order, its policy, and what the session's device can do.
// Pure functions of their arguments (no state, thread-safe).
//
// Support table (RecipeSupportOn):
//   DelayedScaling, Float8CurrentScaling: NATIVE on the CPU reference backend
//     (exact FP8 emulation is its native numerics) and on GPUs with FP8 GEMMs
//     (sm_89+), else EMULATED.
//   MXFP8BlockScaling, NVFP4BlockScaling: NATIVE only with hardware block
//     scaling (sm_100+), else EMULATED.
// Policies (NegotiateRecipe):
//   STRICT: the first preferred recipe must be NATIVE, else FAILED_PRECONDITION.
//   FALLBACK (and UNSPECIFIED): the first NATIVE one; none: no recipe (bf16).
//   EMULATE: the first NATIVE or EMULATED one; none: no recipe.
#ifndef TE_SERVER_SESSION_NEGOTIATION_H_
#define TE_SERVER_SESSION_NEGOTIATION_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"
#include "kernels/ops.h"
#include "te/v1/recipe.pb.h"
#include "te/v1/service.pb.h"

namespace te::session {

// The recipe kind a Recipe message holds (RECIPE_KIND_UNSPECIFIED if none).
te::v1::RecipeKind KindOf(const te::v1::Recipe& recipe);

// TE's class name: "DelayedScaling", "Float8CurrentScaling", ...
const char* RecipeKindName(te::v1::RecipeKind kind);

// How `device` runs recipes of `kind` (UNSUPPORTED for an unspecified kind).
te::v1::Support RecipeSupportOn(const DeviceInfo& device, te::v1::RecipeKind kind);

// The policy with UNSPECIFIED resolved to FALLBACK.
te::v1::NegotiationPolicy EffectivePolicy(te::v1::NegotiationPolicy policy);

struct NegotiatedRecipe {
  bool has_recipe = false;  // false: no FP8 (bf16 only)
  te::v1::Recipe recipe;
  bool emulated = false;    // the chosen recipe runs emulated on this device
  std::string explanation;  // what was chosen and why each earlier one was skipped
};

// Chooses a recipe. INVALID_ARGUMENT ("preferred_recipes[i]: ...") when a
// preference sets no recipe kind; FAILED_PRECONDITION under STRICT when the
// first preference is not NATIVE (the message names it and its support).
absl::StatusOr<NegotiatedRecipe> NegotiateRecipe(
    const DeviceInfo& device,
    const google::protobuf::RepeatedPtrField<te::v1::Recipe>& preferred,
    te::v1::NegotiationPolicy policy);

// Whether a session under `policy` may run `recipe` on `device` (an autocast
// naming a recipe on a request): OK when NATIVE, or EMULATED under EMULATE;
// FAILED_PRECONDITION otherwise, naming the recipe, its support and the
// policy. `field` prefixes the message ("autocast.recipe").
absl::Status CheckRecipeAllowed(const DeviceInfo& device, const te::v1::Recipe& recipe,
                                te::v1::NegotiationPolicy policy, const std::string& field);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_NEGOTIATION_H_
