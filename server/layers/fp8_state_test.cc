#include "server/layers/fp8_state.h"

#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CompareWithFp8;
using testing::InitLayer;
using testing::RandomTensor;
using testing::RandomizeParams;
using testing::Values;

TEST(ResolveRecipeTest, DelayedScalingDefaultsAreTe) {
  te::v1::Recipe proto;
  proto.mutable_delayed_scaling();
  auto r = ResolveRecipe(proto);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kind, Fp8Recipe::Kind::kDelayedScaling);
  EXPECT_EQ(r->format, Fp8Recipe::Format::kHybrid);
  EXPECT_EQ(r->margin, 0.0f);
  EXPECT_EQ(r->amax_history_len, 1024);
  EXPECT_FALSE(r->most_recent);
  EXPECT_EQ(r->forward_dtype(), DType::kE4M3);
  EXPECT_EQ(r->backward_dtype(), DType::kE5M2);
}

TEST(ResolveRecipeTest, DelayedScalingFields) {
  te::v1::Recipe proto;
  auto* d = proto.mutable_delayed_scaling();
  d->set_margin(1.0f);
  d->set_fp8_format(te::v1::E4M3);
  d->set_amax_history_len(16);
  d->set_amax_compute_algo("most_recent");
  auto r = ResolveRecipe(proto);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->margin, 1.0f);
  EXPECT_EQ(r->amax_history_len, 16);
  EXPECT_TRUE(r->most_recent);
  EXPECT_EQ(r->backward_dtype(), DType::kE4M3);
}

TEST(ResolveRecipeTest, OtherRecipesDefaults) {
  te::v1::Recipe current;
  current.mutable_float8_current_scaling();
  auto c = ResolveRecipe(current);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->kind, Fp8Recipe::Kind::kCurrentScaling);
  EXPECT_EQ(c->format, Fp8Recipe::Format::kHybrid);
  EXPECT_EQ(c->amax_epsilon, 0.0f);

  te::v1::Recipe mx;
  mx.mutable_mxfp8_block_scaling();
  auto m = ResolveRecipe(mx);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->kind, Fp8Recipe::Kind::kMXFP8);
  EXPECT_EQ(m->format, Fp8Recipe::Format::kE4M3);

  te::v1::Recipe nv;
  nv.mutable_nvfp4_block_scaling();
  ASSERT_TRUE(ResolveRecipe(nv).ok());
}

void ExpectInvalid(const te::v1::Recipe& proto, const std::string& field) {
  auto r = ResolveRecipe(proto);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_NE(r.status().message().find(field), std::string::npos) << r.status();
}

TEST(ResolveRecipeTest, RejectsBadFields) {
  te::v1::Recipe proto;
  ExpectInvalid(proto, "recipe");
  proto.mutable_delayed_scaling()->set_amax_history_len(0);
  ExpectInvalid(proto, "recipe.delayed_scaling.amax_history_len");
  proto.mutable_delayed_scaling()->set_amax_history_len(65537);
  ExpectInvalid(proto, "recipe.delayed_scaling.amax_history_len");
  proto.mutable_delayed_scaling()->set_amax_history_len(65536);
  EXPECT_TRUE(ResolveRecipe(proto).ok());
  proto.mutable_delayed_scaling()->set_amax_compute_algo("mean");
  ExpectInvalid(proto, "recipe.delayed_scaling.amax_compute_algo");
  proto.mutable_delayed_scaling()->set_amax_compute_algo("max");
  proto.mutable_delayed_scaling()->set_margin(-1.0f);
  ExpectInvalid(proto, "recipe.delayed_scaling.margin");
  te::v1::Recipe current;
  current.mutable_float8_current_scaling()->set_amax_epsilon(NAN);
  ExpectInvalid(current, "recipe.float8_current_scaling.amax_epsilon");
  te::v1::Recipe mx;
  mx.mutable_mxfp8_block_scaling()->set_fp8_format(te::v1::E5M2);
  ExpectInvalid(mx, "recipe.mxfp8_block_scaling.fp8_format");
}

TEST(QuantizerSetTest, NamesFollowTe) {
  QuantizerSet set{"mlp", "_1"};
  EXPECT_EQ(set.ScaleName(QuantizerRole::kX), "fp8_metas/mlp/x_1_scale");
  EXPECT_EQ(set.HistoryName(QuantizerRole::kGrad), "fp8_metas/mlp/grad_1_amax_history");
  QuantizerSet top{"", ""};
  EXPECT_EQ(top.ScaleName(QuantizerRole::kKernel), "fp8_metas/kernel_scale");
  const Fp8Recipe delayed = testing::DelayedRecipe(8);
  const auto defs = QuantizerSetDefs(set, &delayed);
  ASSERT_EQ(defs.size(), 6u);
  const Fp8Recipe current = testing::CurrentScalingRecipe();
  EXPECT_TRUE(QuantizerSetDefs(set, &current).empty());
  EXPECT_TRUE(QuantizerSetDefs(set, nullptr).empty());
}

TEST(UpdateFp8MetasTest, RollsHistoryAndSetsScalePerFormat) {
  auto ops = testing::NewCpuOps();
  const Fp8Recipe recipe = testing::DelayedRecipe(4);
  Variables vars;
  ASSERT_TRUE(InitVariables(*ops, 0, QuantizerSetDefs({"", ""}, &recipe), &vars).ok());
  testing::SetValues({2.0f, 0.0f, 0.0f, 8.0f}, &vars["fp8_metas/x_amax_history"]);
  testing::SetValues({0.5f, 0.0f, 0.0f, 0.0f}, &vars["fp8_metas/grad_amax_history"]);
  ASSERT_TRUE(UpdateFp8Metas(*ops, recipe, &vars).ok());
  // max over the window; the history rolls left by one (the newest amax moves
  // to the end) and the slot for the next step, history[0], is zeroed.
  EXPECT_FLOAT_EQ(Values(vars["fp8_metas/x_scale"])[0], 448.0f / 8.0f);
  EXPECT_EQ(Values(vars["fp8_metas/x_amax_history"]), (std::vector<float>{0, 0, 8, 2}));
  // grad quantizers use E5M2 under HYBRID.
  EXPECT_FLOAT_EQ(Values(vars["fp8_metas/grad_scale"])[0], 57344.0f / 0.5f);
  // amax 0 keeps the previous scale (1).
  EXPECT_FLOAT_EQ(Values(vars["fp8_metas/kernel_scale"])[0], 1.0f);
}

TEST(UpdateFp8MetasTest, MostRecentAndMargin) {
  auto ops = testing::NewCpuOps();
  Fp8Recipe recipe = testing::DelayedRecipe(3);
  recipe.most_recent = true;
  recipe.margin = 1.0f;
  Variables vars;
  ASSERT_TRUE(InitVariables(*ops, 0, QuantizerSetDefs({"", "_0"}, &recipe), &vars).ok());
  testing::SetValues({2.0f, 100.0f, 0.0f}, &vars["fp8_metas/x_0_amax_history"]);
  ASSERT_TRUE(UpdateFp8Metas(*ops, recipe, &vars).ok());
  EXPECT_FLOAT_EQ(Values(vars["fp8_metas/x_0_scale"])[0], 448.0f / 2.0f / 2.0f);
}

TEST(UpdateFp8MetasTest, NoOpWithoutStateAndFailsOnIncompleteMetas) {
  auto ops = testing::NewCpuOps();
  Variables vars;
  const Fp8Recipe current = testing::CurrentScalingRecipe();
  EXPECT_TRUE(UpdateFp8Metas(*ops, current, &vars).ok());
  const Fp8Recipe recipe = testing::DelayedRecipe(4);
  ASSERT_TRUE(InitVariables(*ops, 0, QuantizerSetDefs({"", ""}, &recipe), &vars).ok());
  vars.erase("fp8_metas/x_scale");
  EXPECT_EQ(UpdateFp8Metas(*ops, recipe, &vars).code(), absl::StatusCode::kFailedPrecondition);
}

std::unique_ptr<Layer> Dense32() {
  te::v1::DenseGeneral spec;
  spec.add_features(32);
  auto layer = MakeDenseGeneral(spec);
  EXPECT_TRUE(layer.ok());
  return std::move(*layer);
}

TEST(DelayedScalingTest, StepsRecordAmaxesAndMoveScales) {
  auto ops = testing::NewCpuOps();
  auto layer = Dense32();
  const Fp8Recipe recipe = testing::DelayedRecipe(4);
  auto vars = InitLayer(*ops, *layer, {8, 32}, &recipe);
  ASSERT_TRUE(vars.ok());
  std::vector<float> x_amaxes, dy_amaxes;
  for (int step = 0; step < 3; ++step) {
    const float scale = step == 1 ? 10.0f : 1.0f;  // a spike in step 1
    LayerInputs in;
    in.x = RandomTensor(*ops, {8, 32}, DType::kF32, 10 + step, scale);
    const auto xs = Values(in.x);
    float amax = 0.0f;
    for (float v : xs) amax = std::max(amax, std::fabs(v));
    x_amaxes.push_back(amax);

    ForwardOptions opts;
    opts.fp8 = &recipe;
    opts.keep_for_backward = true;
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE(layer->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
    EXPECT_FLOAT_EQ(Values(vars->at("fp8_metas/x_amax_history"))[0], amax);
    const Tensor dy = RandomTensor(*ops, {8, 32}, DType::kF32, 50 + step, 0.01f);
    LayerGrads grads;
    ASSERT_TRUE(layer->Backward(*ops, &*vars, *saved, dy, &grads).ok());
    float dy_amax = 0.0f;
    for (float v : Values(dy)) dy_amax = std::max(dy_amax, std::fabs(v));
    EXPECT_FLOAT_EQ(Values(vars->at("fp8_metas/grad_amax_history"))[0], dy_amax);
    dy_amaxes.push_back(dy_amax);

    ASSERT_TRUE(UpdateFp8Metas(*ops, recipe, &*vars).ok());
    // "max" over the window of the last 4 steps.
    const float window_max = *std::max_element(x_amaxes.begin(), x_amaxes.end());
    EXPECT_FLOAT_EQ(Values(vars->at("fp8_metas/x_scale"))[0], 448.0f / window_max);
    EXPECT_FLOAT_EQ(Values(vars->at("fp8_metas/grad_scale"))[0],
                    57344.0f / *std::max_element(dy_amaxes.begin(), dy_amaxes.end()));
  }
  const float kernel_scale = Values(vars->at("fp8_metas/kernel_scale"))[0];
  float w_amax = 0.0f;
  for (float v : Values(vars->at("params/kernel"))) w_amax = std::max(w_amax, std::fabs(v));
  EXPECT_FLOAT_EQ(kernel_scale, 448.0f / w_amax);
}

TEST(DelayedScalingTest, ApplyingWithoutFp8MetasIsFailedPrecondition) {
  auto ops = testing::NewCpuOps();
  auto layer = Dense32();
  auto vars = InitLayer(*ops, *layer, {8, 32}, nullptr);  // init without autocast
  ASSERT_TRUE(vars.ok());
  const Fp8Recipe recipe = testing::DelayedRecipe();
  ForwardOptions opts;
  opts.fp8 = &recipe;
  LayerInputs in;
  in.x = RandomTensor(*ops, {8, 32}, DType::kF32, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = layer->Forward(*ops, &*vars, in, opts, &out, &saved);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("fp8_metas"), std::string::npos) << s;
  EXPECT_NE(s.message().find("autocast"), std::string::npos) << s;
  // Current scaling needs no state.
  const Fp8Recipe current = testing::CurrentScalingRecipe();
  opts.fp8 = &current;
  EXPECT_TRUE(layer->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
}

TEST(Fp8GemmTest, EveryRecipeStaysCloseToHighPrecision) {
  auto ops = testing::NewCpuOps();
  auto layer = Dense32();
  struct Case {
    Fp8Recipe recipe;
    double fwd_tol, bwd_tol;
  };
  const Case cases[] = {
      {testing::DelayedRecipe(), testing::kFp8ForwardTolerance, testing::kFp8BackwardTolerance},
      {testing::CurrentScalingRecipe(), testing::kFp8ForwardTolerance,
       testing::kFp8BackwardTolerance},
      {testing::Mxfp8Recipe(), testing::kBlockScaledForwardTolerance,
       testing::kBlockScaledForwardTolerance},
      {testing::Nvfp4Recipe(), testing::kNvfp4ForwardTolerance, testing::kNvfp4ForwardTolerance},
  };
  for (const Case& c : cases) {
    auto vars = InitLayer(*ops, *layer, {32, 32}, &c.recipe);
    ASSERT_TRUE(vars.ok());
    LayerInputs in;
    in.x = RandomTensor(*ops, {32, 32}, DType::kF32, 4);
    auto cmp = CompareWithFp8(*ops, *layer, &*vars, in, c.recipe);
    ASSERT_TRUE(cmp.ok()) << cmp.status();
    SCOPED_TRACE(static_cast<int>(c.recipe.kind));
    EXPECT_LT(cmp->y, c.fwd_tol);
    EXPECT_GT(cmp->y, 0.0);  // FP8 really ran
    EXPECT_LT(cmp->dx, c.bwd_tol);
    EXPECT_LT(cmp->params.at("params/kernel"), c.bwd_tol);
  }
}

TEST(Fp8GemmTest, BlockScalingNeedsWholeBlocks) {
  auto ops = testing::NewCpuOps();
  const Fp8Recipe mx = testing::Mxfp8Recipe();
  const Tensor x = RandomTensor(*ops, {4, 48}, DType::kF32, 1);
  auto q = QuantizeGemmOperand(*ops, mx, {"", ""}, QuantizerRole::kX, x, GemmSide::kA, false,
                               nullptr);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  // Contracting over 64 rows (x^T as a): transposed first, blocks along the rows.
  const Tensor tall = RandomTensor(*ops, {64, 3}, DType::kF32, 1);
  auto t = QuantizeGemmOperand(*ops, mx, {"", ""}, QuantizerRole::kX, tall, GemmSide::kA, true,
                               nullptr);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->data.shape(), (Shape{3, 64}));
  EXPECT_FALSE(t->transpose);
}

}  // namespace
}  // namespace te::layers
