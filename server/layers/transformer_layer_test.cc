// TE's TransformerLayer: variable and fp8_metas names as TE names them, the
// forward against a float64 reference built from the same parameters
// (relative position bias, GQA, rotary, biases, padding, gated MLP), every
// gradient against finite differences (also with all dropouts on), dropout
// seeding, the relative-embedding initialiser, FP8 against bf16, and spec
// validation.
#include <cmath>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/layers/attention_core.h"
#include "server/layers/attention_layers.h"
#include "server/layers/attention_reference.h"
#include "server/layers/fp8_state.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using reference::Vec;
using testing::CheckGradients;
using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomizeParams;
using testing::RandomTensor;
using testing::Values;

// float32 layer against a float64 reference (norms, four GEMMs, softmax).
constexpr double kF32Tolerance = 2e-5;
// FP8 (E4M3 forward) against bf16, on the layer's update y - x. One E4M3
// rounding is ~2.6% relative RMS (3 mantissa bits), a GEMM with both operands
// rounded ~4%; the attention branch chains qkv -> softmax -> out (~6%,
// measured 6.2% for MultiHeadAttention alone) and the MLP adds two more GEMMs:
// measured 6.9% here, so 12% leaves room for other seeds and shapes.
constexpr double kFp8UpdateTolerance = 0.12;

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

Vec Var(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  EXPECT_NE(it, vars.end()) << name;
  return it == vars.end() ? Vec() : ToVec(it->second);
}

std::unique_ptr<Layer> Make(const te::v1::TransformerLayer& spec) {
  auto layer = MakeTransformerLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

std::map<std::string, Shape> SpecMap(const Layer& layer, const Shape& input,
                                     const Fp8Recipe* fp8 = nullptr) {
  auto specs = layer.VariableSpecs(input, fp8);
  EXPECT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, Shape> m;
  if (specs.ok()) {
    for (const VariableSpec& s : *specs) m[s.name] = s.shape;
  }
  return m;
}

te::v1::TransformerLayer SmallSpec() {
  te::v1::TransformerLayer spec;
  spec.set_hidden_size(16);
  spec.set_mlp_hidden_size(24);
  spec.set_num_attention_heads(4);
  return spec;
}

TEST(TransformerLayerSpecsTest, TeDefaultsNamesAndShapes) {
  auto layer = Make(SmallSpec());
  const std::map<std::string, Shape> want = {
      {"params/attention/qkv/scale", {16}},
      {"params/attention/qkv/ln_bias", {16}},
      {"params/attention/qkv/kernel", {16, 3, 16}},
      {"params/attention/out/kernel", {16, 16}},
      {"params/mlp/scale", {16}},
      {"params/mlp/ln_bias", {16}},
      {"params/mlp/wi_kernel", {16, 1, 24}},
      {"params/mlp/wo_kernel", {24, 16}},
      {"params/relpos_bias/rel_embedding", {4, 32}},
  };
  EXPECT_EQ(SpecMap(*layer, {2, 5, 16}), want);
  EXPECT_EQ(layer->type_name(), "TransformerLayer");
}

TEST(TransformerLayerSpecsTest, QuickstartConfigurationWithFp8Metas) {
  // TE's quickstart: mlp_activations ("gelu",), use_bias, layernorm_epsilon
  // 1e-5, no relative embedding, self_attn_bias_type no_bias, no dropout.
  te::v1::TransformerLayer spec;
  spec.set_hidden_size(32);
  spec.set_mlp_hidden_size(128);
  spec.set_num_attention_heads(4);
  spec.add_mlp_activations("gelu");
  spec.set_self_attn_mask_type(te::v1::CAUSAL);
  spec.set_layernorm_epsilon(1e-5f);
  spec.set_use_bias(true);
  spec.set_intermediate_dropout(0.0f);
  spec.set_enable_relative_embedding(false);
  spec.set_self_attn_bias_type(te::v1::NO_BIAS);
  spec.set_hidden_dropout(0.0f);
  spec.set_dtype(te::v1::PARAM_BFLOAT16);
  auto layer = Make(spec);
  Fp8Recipe fp8;
  fp8.amax_history_len = 16;
  std::map<std::string, Shape> want = {
      {"params/attention/qkv/scale", {32}},
      {"params/attention/qkv/ln_bias", {32}},
      {"params/attention/qkv/kernel", {32, 3, 32}},
      {"params/attention/qkv/bias", {3, 32}},
      {"params/attention/out/kernel", {32, 32}},
      {"params/attention/out/bias", {32}},
      {"params/mlp/scale", {32}},
      {"params/mlp/ln_bias", {32}},
      {"params/mlp/wi_kernel", {32, 1, 128}},
      {"params/mlp/wi_bias", {1, 128}},
      {"params/mlp/wo_kernel", {128, 32}},
      {"params/mlp/wo_bias", {32}},
  };
  for (const char* q : {"x", "kernel", "grad"}) {
    for (const char* gemm : {"attention/qkv", "attention/out"}) {
      want[absl::StrCat("fp8_metas/", gemm, "/", q, "_scale")] = {1};
      want[absl::StrCat("fp8_metas/", gemm, "/", q, "_amax_history")] = {16};
    }
    for (const char* postfix : {"_0", "_1"}) {
      want[absl::StrCat("fp8_metas/mlp/", q, postfix, "_scale")] = {1};
      want[absl::StrCat("fp8_metas/mlp/", q, postfix, "_amax_history")] = {16};
    }
  }
  EXPECT_EQ(SpecMap(*layer, {4, 8, 32}, &fp8), want);
  auto specs = layer->VariableSpecs({4, 8, 32}, &fp8);
  ASSERT_TRUE(specs.ok());
  for (const VariableSpec& s : *specs) {
    EXPECT_EQ(s.dtype, s.name.rfind("params/", 0) == 0 ? DType::kBF16 : DType::kF32) << s.name;
  }
}

struct TlCase {
  std::string name;
  int heads = 4, groups = 4;
  bool relpos = true, bias = false, rotary = false, rms = false, padded = false;
  std::vector<std::string> activations = {"gelu"};
  te::v1::AttnMaskType mask = te::v1::CAUSAL;
  // Off for relu: finite differences straddle its kink for some of the
  // hundreds of pre-activations and then disagree by a few percent.
  bool check_gradients = true;
};
void PrintTo(const TlCase& c, std::ostream* os) { *os << c.name; }

te::v1::TransformerLayer SpecOf(const TlCase& c) {
  te::v1::TransformerLayer spec = SmallSpec();
  spec.set_num_attention_heads(c.heads);
  spec.set_num_gqa_groups(c.groups);
  spec.set_enable_relative_embedding(c.relpos);
  spec.set_use_bias(c.bias);
  spec.set_enable_rotary_pos_emb(c.rotary);
  if (c.rms) spec.set_layernorm_type(te::v1::RMSNORM);
  for (const std::string& a : c.activations) spec.add_mlp_activations(a);
  spec.set_self_attn_mask_type(c.mask);
  return spec;
}

double Act(const std::string& name, double x) {
  if (name == "gelu") return reference::Gelu(x);
  if (name == "relu") return reference::Relu(x);
  if (name == "silu") return x / (1.0 + std::exp(-x));
  return x;  // linear
}

Vec ReferenceLayer(const TlCase& c, const Variables& vars, const Vec& x, int64_t b, int64_t s,
                   const std::vector<int>& lens) {
  const int64_t hidden = 16, inter = 24, n = b * s;
  auto var = [&vars](const std::string& name) { return Var(vars, name); };
  Vec bias;
  if (c.relpos) {
    const Vec table = var("params/relpos_bias/rel_embedding");  // [heads, 32]
    const std::vector<int32_t> buckets = RelativePositionBuckets(s, s, true, 32, 128);
    for (int h = 0; h < c.heads; ++h) {
      for (int32_t bucket : buckets) bias.push_back(table[h * 32 + bucket]);
    }
  }
  reference::MhaShape m;
  m.scope = "attention";
  m.batch = b;
  m.seq = s;
  m.hidden = hidden;
  m.heads = c.heads;
  m.groups = c.groups;
  m.head_dim = static_cast<int>(hidden / c.heads);
  m.bias = c.bias;
  m.rotary = c.rotary;
  m.rms = c.rms;
  m.causal = c.mask == te::v1::CAUSAL || c.mask == te::v1::PADDING_CAUSAL;
  const Vec h = reference::Add(x, reference::MultiHeadAttention(m, var, x, lens, bias));

  const Vec ln = reference::Norm(h, n, hidden, var("params/mlp/scale"),
                                 c.rms ? Vec() : var("params/mlp/ln_bias"), 1e-6, c.rms);
  const int64_t acts = static_cast<int64_t>(c.activations.size());
  const Vec pre = reference::Matmul(ln, var("params/mlp/wi_kernel"), n, hidden, acts * inter,
                                    c.bias ? var("params/mlp/wi_bias") : Vec());
  Vec a(static_cast<size_t>(n * inter));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < inter; ++i) {
      double value = 1.0;
      for (int64_t k = 0; k < acts; ++k) {
        value *= Act(c.activations[k], pre[r * acts * inter + k * inter + i]);
      }
      a[r * inter + i] = value;
    }
  }
  return reference::Add(h, reference::Matmul(a, var("params/mlp/wo_kernel"), n, inter, hidden,
                                             c.bias ? var("params/mlp/wo_bias") : Vec()));
}

class TransformerLayerCaseTest : public ::testing::TestWithParam<TlCase> {};

TEST_P(TransformerLayerCaseTest, ForwardMatchesReferenceAndGradientsMatchDifferences) {
  const TlCase c = GetParam();
  const int64_t b = 2, s = 5;
  auto ops = NewCpuOps();
  auto layer = Make(SpecOf(c));
  auto vars = InitLayer(*ops, *layer, {b, s, 16}, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 60);
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, s, 16}, DType::kF32, 61);
  std::vector<int> lens;
  if (c.padded) {
    lens = {5, 2};
    auto t = ops->Allocate(DType::kI32, {b});
    ASSERT_TRUE(t.ok());
    t->data_as<int32_t>()[0] = 5;
    t->data_as<int32_t>()[1] = 2;
    in.q_seqlens = *t;
  }
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).ok());
  const Vec want = ReferenceLayer(c, *vars, ToVec(in.x), b, s, lens);
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);

  if (c.check_gradients) { EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {})); }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, TransformerLayerCaseTest,
    ::testing::Values(
        TlCase{"relpos_causal"}, TlCase{"relpos_gqa_rotary_bias", 4, 2, true, true, true},
        TlCase{
            "no_relpos_rmsnorm_swiglu", 4, 4, false, false, false, true, false, {"silu", "linear"}},
        TlCase{"relpos_padding_no_mask_mqa",
               2,
               1,
               true,
               true,
               false,
               false,
               true,
               {"gelu"},
               te::v1::PADDING},
        TlCase{"relpos_relu",
               4,
               4,
               true,
               false,
               false,
               false,
               false,
               {"relu"},
               te::v1::CAUSAL,
               /*check_gradients=*/false}),
    [](const ::testing::TestParamInfo<TlCase>& info) { return info.param.name; });

TEST(TransformerLayerTest, GradientsWithEveryDropoutOn) {
  te::v1::TransformerLayer spec = SmallSpec();
  spec.add_mlp_activations("gelu");
  spec.set_hidden_dropout(0.2f);
  spec.set_attention_dropout(0.2f);
  spec.set_intermediate_dropout(0.2f);
  auto layer = Make(spec);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {2, 4, 16}, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 70);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 4, 16}, DType::kF32, 71);
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 5;
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, opts));

  auto run = [&](bool deterministic, uint64_t seed) {
    ForwardOptions o;
    o.deterministic = deterministic;
    o.dropout_seed = seed;
    LayerOutputs out;
    EXPECT_TRUE(layer->Forward(*ops, &*vars, in, o, &out, nullptr).ok());
    return Values(out.y);
  };
  const std::vector<float> a = run(false, 5);
  EXPECT_EQ(run(false, 5), a);
  EXPECT_NE(run(false, 6), a);
  EXPECT_NE(run(true, 5), a);
  EXPECT_EQ(run(true, 5), run(true, 6));
}

TEST(TransformerLayerTest, RelativeEmbeddingInitIsFanAvgUniform) {
  auto layer = Make(SmallSpec());
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {1, 3, 16}, nullptr, 8);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Vec table = Var(*vars, "params/relpos_bias/rel_embedding");
  const double limit = std::sqrt(3.0 / ((4 + 32) / 2.0));
  double max_abs = 0.0;
  for (double v : table) max_abs = std::max(max_abs, std::abs(v));
  EXPECT_LE(max_abs, limit);
  EXPECT_GT(max_abs, 0.5 * limit);  // spread over the range, not zeros
}

TEST(TransformerLayerTest, Fp8ForwardCloseToBf16) {
  te::v1::TransformerLayer spec;
  spec.set_hidden_size(64);
  spec.set_mlp_hidden_size(128);
  spec.set_num_attention_heads(4);
  spec.add_mlp_activations("gelu");
  spec.set_enable_relative_embedding(false);
  auto layer = Make(spec);
  auto ops = NewCpuOps();
  Fp8Recipe fp8;  // DelayedScaling, HYBRID
  fp8.amax_history_len = 16;
  const Shape shape = {2, 16, 64};
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kBF16, 80);

  auto plain = InitLayer(*ops, *layer, shape, nullptr, 4);
  ASSERT_TRUE(plain.ok());
  ForwardOptions fp8_opts;
  fp8_opts.fp8 = &fp8;
  LayerOutputs out;
  EXPECT_EQ(layer->Forward(*ops, &*plain, in, fp8_opts, &out, nullptr).code(),
            absl::StatusCode::kFailedPrecondition);

  auto vars = InitLayer(*ops, *layer, shape, &fp8, 4);
  ASSERT_TRUE(vars.ok()) << vars.status();
  LayerOutputs bf16;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &bf16, nullptr).ok());
  EXPECT_EQ(bf16.y.dtype(), DType::kBF16);
  // First step records amaxes; after the update the scales fit the data.
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, fp8_opts, &out, nullptr).ok());
  for (const char* name :
       {"fp8_metas/attention/qkv/x_amax_history", "fp8_metas/attention/out/kernel_amax_history",
        "fp8_metas/mlp/x_0_amax_history", "fp8_metas/mlp/kernel_1_amax_history"}) {
    EXPECT_GT(Values(vars->at(name))[0], 0.0f) << name;
  }
  ASSERT_TRUE(UpdateFp8Metas(*ops, fp8, &*vars).ok());
  EXPECT_NE(Values(vars->at("fp8_metas/attention/qkv/x_scale"))[0], 1.0f);
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, fp8_opts, &out, nullptr).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  // The residual path carries x unchanged, so compare the layer's update
  // y - x, where the FP8 GEMMs' error shows undiluted.
  const std::vector<float> x = Values(in.x), y8 = Values(out.y), y16 = Values(bf16.y);
  std::vector<float> d8(x.size()), d16(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    d8[i] = y8[i] - x[i];
    d16[i] = y16[i] - x[i];
  }
  const double error = testing::RelativeError(d8, d16);
  EXPECT_LT(error, kFp8UpdateTolerance);
  EXPECT_GT(error, 0.0);

  // A backward under FP8 fills the grad quantizers' amax.
  ForwardOptions keep = fp8_opts;
  keep.keep_for_backward = true;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, keep, &out, &saved).ok());
  LayerGrads grads;
  ASSERT_TRUE(
      layer->Backward(*ops, &*vars, *saved, RandomTensor(*ops, shape, DType::kBF16, 81), &grads)
          .ok());
  EXPECT_EQ(grads.dx.shape(), shape);
  EXPECT_GT(Values(vars->at("fp8_metas/attention/qkv/grad_amax_history"))[0], 0.0f);
  EXPECT_GT(Values(vars->at("fp8_metas/mlp/grad_1_amax_history"))[0], 0.0f);
}

TEST(TransformerLayerTest, RejectsContradictorySpecs) {
  te::v1::TransformerLayer spec = SmallSpec();
  spec.set_self_attn_bias_type(te::v1::NO_BIAS);  // relative embedding defaults on
  auto bad = MakeTransformerLayer(spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("self_attn_bias_type"), std::string::npos);

  spec = SmallSpec();
  spec.set_enable_relative_embedding(false);
  spec.set_self_attn_bias_type(te::v1::POST_SCALE_BIAS);
  EXPECT_EQ(MakeTransformerLayer(spec).status().code(), absl::StatusCode::kInvalidArgument);

  spec = SmallSpec();
  spec.set_num_attention_heads(5);
  bad = MakeTransformerLayer(spec);
  EXPECT_NE(bad.status().message().find("hidden_size"), std::string::npos) << bad.status();

  spec = SmallSpec();
  spec.add_mlp_activations("tanh");
  bad = MakeTransformerLayer(spec);
  EXPECT_NE(bad.status().message().find("spec.transformer_layer.mlp_activations"),
            std::string::npos)
      << bad.status();

  auto layer = Make(SmallSpec());
  EXPECT_EQ(layer->VariableSpecs({2, 5, 8}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
