#include "server/session/negotiation.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te::session {
namespace {

using te::v1::NegotiationPolicy;
using te::v1::Recipe;
using te::v1::RecipeKind;
using te::v1::Support;

DeviceInfo Cpu() {
  DeviceInfo d;
  d.name = "cpu";
  return d;
}
DeviceInfo Ampere() {  // no FP8 hardware
  DeviceInfo d;
  d.name = "cuda:0";
  d.compute_capability = 80;
  return d;
}
DeviceInfo Hopper() {
  DeviceInfo d = Ampere();
  d.compute_capability = 90;
  d.fp8_native = true;
  return d;
}
DeviceInfo Blackwell() {
  DeviceInfo d = Hopper();
  d.compute_capability = 100;
  d.block_scaling_native = true;
  return d;
}

Recipe Make(RecipeKind kind) {
  Recipe r;
  switch (kind) {
    case te::v1::DELAYED_SCALING: r.mutable_delayed_scaling()->set_amax_history_len(16); break;
    case te::v1::FLOAT8_CURRENT_SCALING: r.mutable_float8_current_scaling(); break;
    case te::v1::MXFP8_BLOCK_SCALING: r.mutable_mxfp8_block_scaling(); break;
    case te::v1::NVFP4_BLOCK_SCALING: r.mutable_nvfp4_block_scaling(); break;
    default: break;
  }
  return r;
}

google::protobuf::RepeatedPtrField<Recipe> List(std::vector<RecipeKind> kinds) {
  google::protobuf::RepeatedPtrField<Recipe> list;
  for (RecipeKind k : kinds) *list.Add() = Make(k);
  return list;
}

constexpr RecipeKind kDS = te::v1::DELAYED_SCALING;
constexpr RecipeKind kCS = te::v1::FLOAT8_CURRENT_SCALING;
constexpr RecipeKind kMX = te::v1::MXFP8_BLOCK_SCALING;
constexpr RecipeKind kNV = te::v1::NVFP4_BLOCK_SCALING;
constexpr Support N = te::v1::NATIVE;
constexpr Support E = te::v1::EMULATED;

TEST(RecipeSupportOn, Table) {
  struct Row {
    const char* device;
    DeviceInfo info;
    Support ds, cs, mx, nv;
  };
  const std::vector<Row> rows = {
      {"cpu", Cpu(), N, N, E, E},
      {"ampere", Ampere(), E, E, E, E},
      {"hopper", Hopper(), N, N, E, E},
      {"blackwell", Blackwell(), N, N, N, N},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.device);
    EXPECT_EQ(RecipeSupportOn(row.info, kDS), row.ds);
    EXPECT_EQ(RecipeSupportOn(row.info, kCS), row.cs);
    EXPECT_EQ(RecipeSupportOn(row.info, kMX), row.mx);
    EXPECT_EQ(RecipeSupportOn(row.info, kNV), row.nv);
    EXPECT_EQ(RecipeSupportOn(row.info, te::v1::RECIPE_KIND_UNSPECIFIED), te::v1::UNSUPPORTED);
  }
}

// Every policy against every device, for preference lists that exercise the
// first-choice, skip and nothing-usable paths.
TEST(NegotiateRecipe, PolicyTable) {
  constexpr RecipeKind kNone = te::v1::RECIPE_KIND_UNSPECIFIED;
  constexpr auto kOk = absl::StatusCode::kOk;
  constexpr auto kFP = absl::StatusCode::kFailedPrecondition;
  struct Row {
    const char* device_name;
    DeviceInfo device;
    NegotiationPolicy policy;
    std::vector<RecipeKind> preferred;
    absl::StatusCode code;
    RecipeKind chosen;  // kNone: no recipe
    bool emulated;
  };
  const std::vector<Row> rows = {
      // STRICT: the first must be native.
      {"cpu", Cpu(), te::v1::STRICT, {kDS, kCS}, kOk, kDS, false},
      {"cpu", Cpu(), te::v1::STRICT, {kMX, kDS}, kFP, kNone, false},
      {"ampere", Ampere(), te::v1::STRICT, {kDS}, kFP, kNone, false},
      {"hopper", Hopper(), te::v1::STRICT, {kCS, kDS}, kOk, kCS, false},
      {"hopper", Hopper(), te::v1::STRICT, {kNV}, kFP, kNone, false},
      {"blackwell", Blackwell(), te::v1::STRICT, {kMX}, kOk, kMX, false},
      {"cpu", Cpu(), te::v1::STRICT, {}, kOk, kNone, false},
      // FALLBACK: the first native one, else none.
      {"cpu", Cpu(), te::v1::FALLBACK, {kMX, kNV, kCS, kDS}, kOk, kCS, false},
      {"cpu", Cpu(), te::v1::FALLBACK, {kMX, kNV}, kOk, kNone, false},
      {"ampere", Ampere(), te::v1::FALLBACK, {kDS, kMX}, kOk, kNone, false},
      {"hopper", Hopper(), te::v1::FALLBACK, {kMX, kDS}, kOk, kDS, false},
      {"blackwell", Blackwell(), te::v1::FALLBACK, {kNV, kDS}, kOk, kNV, false},
      {"cpu", Cpu(), te::v1::NEGOTIATION_POLICY_UNSPECIFIED, {kMX, kDS}, kOk, kDS, false},
      {"cpu", Cpu(), te::v1::FALLBACK, {}, kOk, kNone, false},
      // EMULATE: the first native or emulated one.
      {"cpu", Cpu(), te::v1::EMULATE, {kMX, kDS}, kOk, kMX, true},
      {"ampere", Ampere(), te::v1::EMULATE, {kDS}, kOk, kDS, true},
      {"hopper", Hopper(), te::v1::EMULATE, {kNV, kDS}, kOk, kNV, true},
      {"hopper", Hopper(), te::v1::EMULATE, {kDS, kNV}, kOk, kDS, false},
      {"blackwell", Blackwell(), te::v1::EMULATE, {kMX}, kOk, kMX, false},
      {"cpu", Cpu(), te::v1::EMULATE, {}, kOk, kNone, false},
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& row = rows[i];
    SCOPED_TRACE(::testing::Message() << "row " << i << " (" << row.device_name << ")");
    auto result = NegotiateRecipe(row.device, List(row.preferred), row.policy);
    ASSERT_EQ(result.status().code(), row.code) << result.status();
    if (!result.ok()) {
      // The message names the recipe that could not be had.
      EXPECT_NE(result.status().message().find(RecipeKindName(row.preferred[0])),
                std::string::npos)
          << result.status();
      continue;
    }
    EXPECT_EQ(result->has_recipe, row.chosen != kNone);
    if (row.chosen != kNone) {
      EXPECT_EQ(KindOf(result->recipe), row.chosen);
      EXPECT_NE(result->explanation.find(std::string("chose ") + RecipeKindName(row.chosen)),
                std::string::npos)
          << result->explanation;
    } else {
      EXPECT_NE(result->explanation.find("bf16 only"), std::string::npos)
          << result->explanation;
    }
    EXPECT_EQ(result->emulated, row.emulated);
    // Every preference before the chosen one is explained as skipped.
    size_t skipped = 0;
    for (size_t p = 0; p < result->explanation.size();) {
      const size_t at = result->explanation.find(" skipped: ", p);
      if (at == std::string::npos) break;
      ++skipped;
      p = at + 1;
    }
    size_t chosen_index = row.preferred.size();
    for (size_t k = 0; k < row.preferred.size(); ++k) {
      if (row.chosen != kNone && row.preferred[k] == row.chosen) {
        chosen_index = k;
        break;
      }
    }
    EXPECT_EQ(skipped, chosen_index) << result->explanation;
  }
}

TEST(NegotiateRecipe, KeepsTheRecipesFields) {
  auto result = NegotiateRecipe(Cpu(), List({kDS}), te::v1::FALLBACK);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->recipe.delayed_scaling().amax_history_len(), 16);
}

TEST(NegotiateRecipe, RejectsAnEmptyRecipe) {
  auto list = List({kDS});
  list.Add();  // no kind set
  auto result = NegotiateRecipe(Cpu(), list, te::v1::FALLBACK);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("preferred_recipes[1]"), std::string::npos);
}

TEST(NegotiateRecipe, RejectsAnUnknownPolicy) {
  auto result = NegotiateRecipe(Cpu(), List({kDS}), static_cast<NegotiationPolicy>(42));
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CheckRecipeAllowed, Table) {
  struct Row {
    DeviceInfo device;
    RecipeKind kind;
    NegotiationPolicy policy;
    absl::StatusCode code;
  };
  const std::vector<Row> rows = {
      {Cpu(), kDS, te::v1::FALLBACK, absl::StatusCode::kOk},
      {Cpu(), kDS, te::v1::STRICT, absl::StatusCode::kOk},
      {Cpu(), kMX, te::v1::FALLBACK, absl::StatusCode::kFailedPrecondition},
      {Cpu(), kMX, te::v1::STRICT, absl::StatusCode::kFailedPrecondition},
      {Cpu(), kMX, te::v1::EMULATE, absl::StatusCode::kOk},
      {Ampere(), kCS, te::v1::NEGOTIATION_POLICY_UNSPECIFIED,
       absl::StatusCode::kFailedPrecondition},
      {Hopper(), kNV, te::v1::EMULATE, absl::StatusCode::kOk},
      {Blackwell(), kNV, te::v1::STRICT, absl::StatusCode::kOk},
      {Cpu(), te::v1::RECIPE_KIND_UNSPECIFIED, te::v1::EMULATE,
       absl::StatusCode::kInvalidArgument},
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "row " << i);
    const absl::Status status =
        CheckRecipeAllowed(rows[i].device, Make(rows[i].kind), rows[i].policy, "autocast.recipe");
    EXPECT_EQ(status.code(), rows[i].code) << status;
    if (!status.ok()) {
      EXPECT_NE(status.message().find("autocast.recipe"), std::string::npos) << status;
    }
  }
}

}  // namespace
}  // namespace te::session
