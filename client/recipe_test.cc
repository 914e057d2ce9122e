#include "client/recipe.h"

#include <thread>

#include "gtest/gtest.h"

namespace te::client {
namespace {

TEST(RecipeTest, DelayedScalingDefaultsAreTEs) {
  const te::v1::Recipe proto = ToProto(DelayedScaling{});
  ASSERT_TRUE(proto.has_delayed_scaling());
  const te::v1::DelayedScaling& p = proto.delayed_scaling();
  // Written explicitly, so the server never relies on its own defaults.
  EXPECT_TRUE(p.has_margin());
  EXPECT_EQ(p.margin(), 0.0f);
  EXPECT_EQ(p.fp8_format(), te::v1::HYBRID);
  EXPECT_TRUE(p.has_amax_history_len());
  EXPECT_EQ(p.amax_history_len(), 1024);
  EXPECT_EQ(p.amax_compute_algo(), "max");
}

TEST(RecipeTest, QuickstartRecipe) {
  DelayedScaling recipe;
  recipe.fp8_format = Format::kHybrid;
  recipe.amax_history_len = 16;
  recipe.amax_compute_algo = "max";
  const te::v1::Recipe proto = ToProto(recipe);
  EXPECT_EQ(proto.delayed_scaling().amax_history_len(), 16);
  absl::StatusOr<Recipe> back = FromProto(proto);
  ASSERT_TRUE(back.ok());
  const DelayedScaling* ds = std::get_if<DelayedScaling>(&*back);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(ds->amax_history_len, 16);
  EXPECT_EQ(RecipeString(*back),
            "DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=16, amax_compute_algo=max)");
}

TEST(RecipeTest, UnsetProtoFieldsTakeTEDefaults) {
  te::v1::Recipe proto;
  proto.mutable_delayed_scaling();
  absl::StatusOr<Recipe> ds = FromProto(proto);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(std::get<DelayedScaling>(*ds).amax_history_len, 1024);
  EXPECT_EQ(std::get<DelayedScaling>(*ds).fp8_format, Format::kHybrid);
  EXPECT_EQ(std::get<DelayedScaling>(*ds).amax_compute_algo, "max");

  proto.mutable_mxfp8_block_scaling();
  absl::StatusOr<Recipe> mx = FromProto(proto);
  ASSERT_TRUE(mx.ok());
  EXPECT_EQ(std::get<MXFP8BlockScaling>(*mx).fp8_format, Format::kE4M3);

  EXPECT_EQ(FromProto(te::v1::Recipe()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RecipeTest, OtherRecipesConvert) {
  const te::v1::Recipe current = ToProto(Float8CurrentScaling{});
  ASSERT_TRUE(current.has_float8_current_scaling());
  EXPECT_EQ(current.float8_current_scaling().fp8_format(), te::v1::HYBRID);
  EXPECT_TRUE(current.float8_current_scaling().has_amax_epsilon());
  EXPECT_EQ(ToProto(MXFP8BlockScaling{}).mxfp8_block_scaling().fp8_format(), te::v1::E4M3);
  EXPECT_TRUE(ToProto(NVFP4BlockScaling{}).has_nvfp4_block_scaling());
}

int HistoryLen() {
  const AutocastState& s = Autocast::Current();
  return s.recipe.has_value() ? std::get<DelayedScaling>(*s.recipe).amax_history_len : -1;
}

TEST(AutocastTest, GuardsNestAndRestore) {
  EXPECT_FALSE(Autocast::Current().enabled);
  {
    DelayedScaling outer_recipe;
    outer_recipe.amax_history_len = 16;
    Autocast outer(true, outer_recipe);
    EXPECT_TRUE(Autocast::Current().enabled);
    EXPECT_EQ(HistoryLen(), 16);
    {
      Autocast off(false);
      EXPECT_FALSE(Autocast::Current().enabled);
      EXPECT_FALSE(Autocast::Current().recipe.has_value());
      {
        Autocast inner(true, DelayedScaling{});
        EXPECT_EQ(HistoryLen(), 1024);
      }
      EXPECT_FALSE(Autocast::Current().enabled);
    }
    EXPECT_TRUE(Autocast::Current().enabled);
    EXPECT_EQ(HistoryLen(), 16);

    // Another thread has its own (disabled) autocast.
    bool other_enabled = true;
    std::thread([&] { other_enabled = Autocast::Current().enabled; }).join();
    EXPECT_FALSE(other_enabled);
  }
  EXPECT_FALSE(Autocast::Current().enabled);
}

TEST(AutocastTest, ProtoCarriesRecipeOnlyWhenEnabled) {
  {
    Autocast autocast(true);
    const te::v1::Autocast proto = ToProto(Autocast::Current());
    EXPECT_TRUE(proto.enabled());
    EXPECT_FALSE(proto.has_recipe());  // the session's negotiated recipe
  }
  {
    Autocast autocast(false, DelayedScaling{});
    EXPECT_FALSE(ToProto(Autocast::Current()).has_recipe());
  }
  Autocast autocast(true, Float8CurrentScaling{});
  EXPECT_TRUE(ToProto(Autocast::Current()).recipe().has_float8_current_scaling());
}

}  // namespace
}  // namespace te::client
