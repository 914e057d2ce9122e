#include "server/session/negotiation.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace te::session {

using te::v1::NegotiationPolicy;
using te::v1::Recipe;
using te::v1::RecipeKind;
using te::v1::Support;

RecipeKind KindOf(const Recipe& recipe) {
  switch (recipe.kind_case()) {
    case Recipe::kDelayedScaling: return te::v1::DELAYED_SCALING;
    case Recipe::kFloat8CurrentScaling: return te::v1::FLOAT8_CURRENT_SCALING;
    case Recipe::kMxfp8BlockScaling: return te::v1::MXFP8_BLOCK_SCALING;
    case Recipe::kNvfp4BlockScaling: return te::v1::NVFP4_BLOCK_SCALING;
    case Recipe::KIND_NOT_SET: break;
  }
  return te::v1::RECIPE_KIND_UNSPECIFIED;
}

const char* RecipeKindName(RecipeKind kind) {
  switch (kind) {
    case te::v1::DELAYED_SCALING: return "DelayedScaling";
    case te::v1::FLOAT8_CURRENT_SCALING: return "Float8CurrentScaling";
    case te::v1::MXFP8_BLOCK_SCALING: return "MXFP8BlockScaling";
    case te::v1::NVFP4_BLOCK_SCALING: return "NVFP4BlockScaling";
    default: return "unspecified recipe";
  }
}

namespace {

const char* SupportName(Support support) {
  switch (support) {
    case te::v1::NATIVE: return "native";
    case te::v1::EMULATED: return "emulated";
    default: return "unsupported";
  }
}

const char* PolicyName(NegotiationPolicy policy) {
  switch (EffectivePolicy(policy)) {
    case te::v1::STRICT: return "STRICT";
    case te::v1::EMULATE: return "EMULATE";
    default: return "FALLBACK";
  }
}

bool Acceptable(Support support, NegotiationPolicy policy) {
  return support == te::v1::NATIVE ||
         (support == te::v1::EMULATED && EffectivePolicy(policy) == te::v1::EMULATE);
}

}  // namespace

Support RecipeSupportOn(const DeviceInfo& device, RecipeKind kind) {
  // The CPU backend computes FP8 casts exactly: scaled FP8 is its own numerics.
  const bool reference_backend = device.name == "cpu";
  switch (kind) {
    case te::v1::DELAYED_SCALING:
    case te::v1::FLOAT8_CURRENT_SCALING:
      return (reference_backend || device.fp8_native) ? te::v1::NATIVE : te::v1::EMULATED;
    case te::v1::MXFP8_BLOCK_SCALING:
    case te::v1::NVFP4_BLOCK_SCALING:
      return device.block_scaling_native ? te::v1::NATIVE : te::v1::EMULATED;
    default:
      return te::v1::UNSUPPORTED;
  }
}

NegotiationPolicy EffectivePolicy(NegotiationPolicy policy) {
  return policy == te::v1::NEGOTIATION_POLICY_UNSPECIFIED ? te::v1::FALLBACK : policy;
}

absl::StatusOr<NegotiatedRecipe> NegotiateRecipe(
    const DeviceInfo& device, const google::protobuf::RepeatedPtrField<Recipe>& preferred,
    NegotiationPolicy policy) {
  if (!NegotiationPolicy_IsValid(policy)) {
    return absl::InvalidArgumentError(absl::StrCat("policy: unknown policy ", policy));
  }
  for (int i = 0; i < preferred.size(); ++i) {
    if (KindOf(preferred[i]) == te::v1::RECIPE_KIND_UNSPECIFIED) {
      return absl::InvalidArgumentError(
          absl::StrCat("preferred_recipes[", i, "]: no recipe kind is set"));
    }
  }
  NegotiatedRecipe result;
  if (preferred.empty()) {
    result.explanation = "no recipe requested: bf16 only";
    return result;
  }
  policy = EffectivePolicy(policy);
  if (policy == te::v1::STRICT) {
    const RecipeKind kind = KindOf(preferred[0]);
    const Support support = RecipeSupportOn(device, kind);
    if (support != te::v1::NATIVE) {
      return absl::FailedPreconditionError(absl::StrCat(
          "STRICT negotiation: preferred_recipes[0] ", RecipeKindName(kind), " is ",
          SupportName(support), " on ", device.name,
          ", not native; use policy FALLBACK or EMULATE, or another recipe"));
    }
  }
  std::vector<std::string> skipped;
  for (int i = 0; i < preferred.size(); ++i) {
    const RecipeKind kind = KindOf(preferred[i]);
    const Support support = RecipeSupportOn(device, kind);
    if (!Acceptable(support, policy)) {
      skipped.push_back(absl::StrCat(RecipeKindName(kind), " skipped: ", SupportName(support),
                                     " on ", device.name, ", not allowed under ",
                                     PolicyName(policy)));
      continue;
    }
    result.has_recipe = true;
    result.recipe = preferred[i];
    result.emulated = support == te::v1::EMULATED;
    skipped.push_back(absl::StrCat("chose ", RecipeKindName(kind), " (preferred_recipes[", i,
                                   "], ", SupportName(support), " on ", device.name, ")"));
    result.explanation = absl::StrJoin(skipped, "; ");
    return result;
  }
  skipped.push_back("no preferred recipe is usable: bf16 only");
  result.explanation = absl::StrJoin(skipped, "; ");
  return result;
}

absl::Status CheckRecipeAllowed(const DeviceInfo& device, const Recipe& recipe,
                                NegotiationPolicy policy, const std::string& field) {
  const RecipeKind kind = KindOf(recipe);
  if (kind == te::v1::RECIPE_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no recipe kind is set"));
  }
  const Support support = RecipeSupportOn(device, kind);
  if (Acceptable(support, policy)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      field, ": ", RecipeKindName(kind), " is ", SupportName(support), " on ", device.name,
      " and this session's policy is ", PolicyName(policy),
      (support == te::v1::EMULATED ? " (create the session with policy EMULATE to allow it)"
                                   : "")));
}

}  // namespace te::session
