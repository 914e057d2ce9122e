// TE's MultiHeadAttention: variable names and shapes as TE names them, the
// forward against a float64 reference computed from the same parameters (fused
// qkv, GQA query/kv, rotary, bias, rmsnorm, no input layernorm, padding), the
// gradients of x and every parameter against finite differences, TE's
// initialiser statistics, and FP8.
#include <cmath>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/layers/attention_layers.h"
#include "server/layers/attention_reference.h"
#include "server/layers/fp8_state.h"
#include "server/layers/multi_head_attention.h"
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

// float32 layer against a float64 reference: a few float32 roundings per
// stage (norm, two GEMMs, softmax) on O(1) data.
constexpr double kF32Tolerance = 1e-5;
// Initialiser statistics: the sample std of n ~ 16k normals is within ~1% of
// the true std; 5% leaves room.
constexpr double kStdTolerance = 0.05;
// FP8 (E4M3 forward) against float32: two chained FP8 GEMMs around the
// attention (each ~4% relative RMS with both operands rounded to 3 mantissa
// bits, compounded through the softmax): measured 6.2%; bound 10%.
constexpr double kFp8Tolerance = 0.10;

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

Vec Var(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  EXPECT_NE(it, vars.end()) << name;
  return it == vars.end() ? Vec() : ToVec(it->second);
}

te::v1::MultiHeadAttention BaseSpec(int heads, int groups, int head_dim) {
  te::v1::MultiHeadAttention spec;
  spec.set_head_dim(head_dim);
  spec.set_num_attention_heads(heads);
  spec.set_num_gqa_groups(groups);
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::MultiHeadAttention& spec) {
  auto layer = MakeMultiHeadAttention(spec);
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

TEST(MultiHeadAttentionSpecsTest, FusedQkvNamesAndShapes) {
  auto layer = Make(BaseSpec(4, 4, 8));
  const std::map<std::string, Shape> want = {
      {"params/qkv/scale", {48}},
      {"params/qkv/ln_bias", {48}},
      {"params/qkv/kernel", {48, 3, 32}},
      {"params/out/kernel", {32, 48}},
  };
  EXPECT_EQ(SpecMap(*layer, {2, 5, 48}), want);
  auto output = layer->OutputShape({2, 5, 48});
  ASSERT_TRUE(output.ok());
  EXPECT_EQ(*output, (Shape{2, 5, 48}));
}

TEST(MultiHeadAttentionSpecsTest, GqaBiasRmsNormAndFp8Metas) {
  te::v1::MultiHeadAttention spec = BaseSpec(4, 2, 8);
  spec.set_use_bias(true);
  spec.set_layernorm_type(te::v1::RMSNORM);
  auto layer = Make(spec);
  std::map<std::string, Shape> want = {
      {"params/query/scale", {48}}, {"params/query/kernel", {48, 32}},
      {"params/query/bias", {32}},  {"params/kv/kernel", {48, 2, 16}},
      {"params/kv/bias", {2, 16}},  {"params/out/kernel", {32, 48}},
      {"params/out/bias", {48}},
  };
  EXPECT_EQ(SpecMap(*layer, {2, 5, 48}), want);

  Fp8Recipe fp8;
  fp8.amax_history_len = 16;
  for (const char* gemm : {"query", "kv", "out"}) {
    for (const char* q : {"x", "kernel", "grad"}) {
      want[absl::StrCat("fp8_metas/", gemm, "/", q, "_scale")] = {1};
      want[absl::StrCat("fp8_metas/", gemm, "/", q, "_amax_history")] = {16};
    }
  }
  EXPECT_EQ(SpecMap(*layer, {2, 5, 48}, &fp8), want);

  spec.set_input_layernorm(false);
  const auto no_norm = SpecMap(*Make(spec), {2, 5, 48});
  EXPECT_EQ(no_norm.count("params/query/scale"), 0u);
  EXPECT_EQ(no_norm.count("params/query/kernel"), 1u);
}

// What MultiHeadAttention computes, from its parameters, in float64.
struct MhaCase {
  std::string name;
  int heads = 4, groups = 4, head_dim = 4;
  bool bias = false, rotary = false, rms = false, zero_centered = false;
  bool input_layernorm = true, scale_logits = false, padded = false;
  te::v1::AttnMaskType mask = te::v1::CAUSAL;
};
void PrintTo(const MhaCase& c, std::ostream* os) { *os << c.name; }

te::v1::MultiHeadAttention SpecOf(const MhaCase& c) {
  te::v1::MultiHeadAttention spec = BaseSpec(c.heads, c.groups, c.head_dim);
  spec.set_use_bias(c.bias);
  spec.set_enable_rotary_pos_emb(c.rotary);
  if (c.rms) spec.set_layernorm_type(te::v1::RMSNORM);
  spec.set_zero_centered_gamma(c.zero_centered);
  spec.set_input_layernorm(c.input_layernorm);
  spec.set_scale_attn_logits(c.scale_logits);
  spec.set_attn_mask_type(c.mask);
  return spec;
}

Vec ReferenceMha(const MhaCase& c, const Variables& vars, const Vec& x, int64_t b, int64_t s,
                 int64_t hidden, const std::vector<int>& lens) {
  reference::MhaShape shape;
  shape.batch = b;
  shape.seq = s;
  shape.hidden = hidden;
  shape.heads = c.heads;
  shape.groups = c.groups;
  shape.head_dim = c.head_dim;
  shape.bias = c.bias;
  shape.rotary = c.rotary;
  shape.rms = c.rms;
  shape.zero_centered = c.zero_centered;
  shape.input_layernorm = c.input_layernorm;
  shape.scale_logits = c.scale_logits;
  shape.causal = c.mask == te::v1::CAUSAL || c.mask == te::v1::PADDING_CAUSAL;
  return reference::MultiHeadAttention(
      shape, [&vars](const std::string& name) { return Var(vars, name); }, x, lens);
}

class MultiHeadAttentionCaseTest : public ::testing::TestWithParam<MhaCase> {};

TEST_P(MultiHeadAttentionCaseTest, ForwardMatchesReferenceAndGradientsMatchDifferences) {
  const MhaCase c = GetParam();
  const int64_t b = 2, s = 5, hidden = 12;
  auto ops = NewCpuOps();
  auto layer = Make(SpecOf(c));
  auto vars = InitLayer(*ops, *layer, {b, s, hidden}, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 20);
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, s, hidden}, DType::kF32, 21);
  std::vector<int> lens;
  if (c.padded) {
    lens = {5, 3};
    auto t = ops->Allocate(DType::kI32, {b});
    ASSERT_TRUE(t.ok());
    t->data_as<int32_t>()[0] = 5;
    t->data_as<int32_t>()[1] = 3;
    in.q_seqlens = *t;
  }
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).ok());
  ASSERT_EQ(out.y.shape(), (Shape{b, s, hidden}));
  const Vec want = ReferenceMha(c, *vars, ToVec(in.x), b, s, hidden, lens);
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);

  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, MultiHeadAttentionCaseTest,
    ::testing::Values(MhaCase{"fused_default"}, MhaCase{"fused_bias_rotary", 4, 4, 4, true, true},
                      MhaCase{"gqa_bias_rotary", 4, 2, 4, true, true},
                      MhaCase{"mqa_rms_zero_centered_scaled", 4, 1, 4, false, false, true, true,
                              true, true},
                      MhaCase{"fused_no_layernorm_no_mask", 2, 2, 6, false, false, false, false,
                              false, false, false, te::v1::NO_MASK},
                      MhaCase{"gqa_no_layernorm", 4, 2, 4, true, false, false, false, false},
                      MhaCase{"padding_causal", 3, 3, 4, false, true, false, false, true, false,
                              true, te::v1::PADDING_CAUSAL},
                      // Packed qkv attention (no rotary) with a padding mask.
                      MhaCase{"fused_padding_causal_bias", 3, 3, 4, true, false, false, false,
                              true, true, true, te::v1::PADDING_CAUSAL}),
    [](const ::testing::TestParamInfo<MhaCase>& info) { return info.param.name; });

TEST(MultiHeadAttentionTest, DropoutGradientsAndLayernormOutput) {
  te::v1::MultiHeadAttention spec = BaseSpec(2, 2, 4);
  spec.set_attention_dropout(0.3f);
  spec.set_return_layernorm_output(true);
  auto layer = Make(spec);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {2, 4, 8}, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 30);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 4, 8}, DType::kF32, 31);
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 77;
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, opts));

  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).ok());
  ASSERT_EQ(out.ln_out.shape(), (Shape{2, 4, 8}));
  const Vec want = reference::Norm(ToVec(in.x), 8, 8, Var(*vars, "params/qkv/scale"),
                                   Var(*vars, "params/qkv/ln_bias"), 1e-6);
  EXPECT_LT(reference::RelativeError(ToVec(out.ln_out), want), kF32Tolerance);
}

double SampleStd(const Vec& v) {
  double sum = 0.0, sq = 0.0;
  for (double x : v) sum += x;
  const double mean = sum / v.size();
  for (double x : v) sq += (x - mean) * (x - mean);
  return std::sqrt(sq / v.size());
}

TEST(MultiHeadAttentionTest, InitialisesAsTe) {
  // hidden 256, 4 heads of 16: q part std 1/sqrt(256)/sqrt(16), k and v
  // 1/sqrt(256), out 1/sqrt(64); LayerNorm scale ones, bias zeros.
  const int64_t hidden = 256;
  auto layer = Make(BaseSpec(4, 4, 16));
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {1, 2, hidden}, nullptr, 5);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Vec kernel = Var(*vars, "params/qkv/kernel");
  const double want_q = 1.0 / 16.0 / 4.0, want_kv = 1.0 / 16.0;
  EXPECT_NEAR(SampleStd(reference::Columns(kernel, 192, 0, 64)), want_q, kStdTolerance * want_q);
  EXPECT_NEAR(SampleStd(reference::Columns(kernel, 192, 64, 64)), want_kv, kStdTolerance * want_kv);
  EXPECT_NEAR(SampleStd(reference::Columns(kernel, 192, 128, 64)), want_kv,
              kStdTolerance * want_kv);
  EXPECT_NEAR(SampleStd(Var(*vars, "params/out/kernel")), 0.125, kStdTolerance * 0.125);
  for (double g : Var(*vars, "params/qkv/scale")) ASSERT_EQ(g, 1.0);
  for (double beta : Var(*vars, "params/qkv/ln_bias")) ASSERT_EQ(beta, 0.0);

  auto again = InitLayer(*ops, *layer, {1, 2, hidden}, nullptr, 5);
  auto other = InitLayer(*ops, *layer, {1, 2, hidden}, nullptr, 6);
  ASSERT_TRUE(again.ok() && other.ok());
  EXPECT_EQ(Var(*again, "params/qkv/kernel"), kernel);
  EXPECT_NE(Var(*other, "params/qkv/kernel"), kernel);

  te::v1::MultiHeadAttention unscaled = BaseSpec(4, 4, 16);
  unscaled.set_scaled_query_init(false);
  auto plain = InitLayer(*ops, *Make(unscaled), {1, 2, hidden}, nullptr, 5);
  ASSERT_TRUE(plain.ok());
  EXPECT_NEAR(SampleStd(reference::Columns(Var(*plain, "params/qkv/kernel"), 192, 0, 64)), want_kv,
              kStdTolerance * want_kv);
}

TEST(MultiHeadAttentionTest, Fp8ForwardNeedsMetasAndStaysClose) {
  auto layer = Make(BaseSpec(4, 4, 8));
  auto ops = NewCpuOps();
  Fp8Recipe fp8;
  fp8.amax_history_len = 16;
  const Shape shape = {2, 8, 32};
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kF32, 40);

  auto plain = InitLayer(*ops, *layer, shape, nullptr, 9);
  ASSERT_TRUE(plain.ok());
  ForwardOptions fp8_opts;
  fp8_opts.fp8 = &fp8;
  LayerOutputs out;
  const absl::Status missing = layer->Forward(*ops, &*plain, in, fp8_opts, &out, nullptr);
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition) << missing;

  auto vars = InitLayer(*ops, *layer, shape, &fp8, 9);
  ASSERT_TRUE(vars.ok()) << vars.status();
  LayerOutputs reference_out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &reference_out, nullptr).ok());
  // Step 1 records the amaxes (scales are still 1); after the update the
  // scales fit the tensors, as in training after the first step.
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, fp8_opts, &out, nullptr).ok());
  EXPECT_GT(Values(vars->at("fp8_metas/qkv/x_amax_history"))[0], 0.0f);
  EXPECT_GT(Values(vars->at("fp8_metas/out/kernel_amax_history"))[0], 0.0f);
  ASSERT_TRUE(UpdateFp8Metas(*ops, fp8, &*vars).ok());
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, fp8_opts, &out, nullptr).ok());
  const double error = testing::RelativeError(Values(out.y), Values(reference_out.y));
  EXPECT_LT(error, kFp8Tolerance);
  EXPECT_GT(error, 0.0);  // the GEMMs really ran in FP8
}

TEST(MultiHeadAttentionTest, RejectsBadSpecsAndInputs) {
  te::v1::MultiHeadAttention spec = BaseSpec(4, 3, 8);
  auto bad = MakeMultiHeadAttention(spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("spec.multi_head_attention.num_gqa_groups"),
            std::string::npos);
  spec = BaseSpec(4, 4, 7);
  spec.set_enable_rotary_pos_emb(true);
  EXPECT_EQ(MakeMultiHeadAttention(spec).status().code(), absl::StatusCode::kInvalidArgument);

  auto layer = Make(BaseSpec(2, 2, 4));
  EXPECT_EQ(layer->VariableSpecs({2, 8}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {1, 3, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, {1, 3, 10}, DType::kF32, 50);  // hidden differs from init
  LayerOutputs out;
  EXPECT_EQ(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  auto fp8_x = ops->Allocate(DType::kE4M3, {1, 3, 8});
  ASSERT_TRUE(fp8_x.ok());
  in.x = *fp8_x;
  const absl::Status status = layer->Forward(*ops, &*vars, in, {}, &out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("x has dtype"), std::string::npos) << status;
}

// Fused qkv: attention runs on the packed qkv and keeps it alone, with rotary
// too (q and k rotated in place in it, RotaryQkInPlace).
TEST(MultiHeadAttentionTest, FusedQkvAttentionKeepsThePackedQkv) {
  auto ops = NewCpuOps();
  for (bool rotary : {false, true}) {
    SCOPED_TRACE(rotary ? "rotary" : "no rotary");
    MhaOptions options;
    options.num_heads = 2;
    options.num_gqa_groups = 2;
    options.head_dim = 4;
    options.rotary = rotary;
    const MhaBlock block(options, 8);
    Variables vars;
    ASSERT_TRUE(block.Init(*ops, 1, nullptr, &vars).ok());
    const Tensor x = RandomTensor(*ops, {2, 3, 8}, DType::kF32, 60);
    MhaBlock::Saved saved;
    Tensor y;
    ASSERT_TRUE(block.Forward(*ops, &vars, x, SeqLens{}, Tensor(), ForwardOptions{}, &y, nullptr,
                              &saved)
                    .ok());
    EXPECT_TRUE(saved.attention.packed());
    EXPECT_FALSE(saved.attention.q.defined());
    EXPECT_EQ(saved.attention.qkv.shape(), (Shape{2, 3, 3, 2, 4}));
    Variables grads;
    Tensor dx;
    ASSERT_TRUE(block.Backward(*ops, &vars, saved, RandomTensor(*ops, {2, 3, 8}, DType::kF32, 61),
                               &dx, nullptr, &grads)
                    .ok());
    EXPECT_EQ(dx.shape(), x.shape());
    EXPECT_EQ(grads.at("params/qkv/kernel").shape(), (Shape{8, 3, 8}));
  }
}

TEST(MultiHeadAttentionTest, Bf16ForwardTakesAFloat32Gradient) {
  auto layer = Make(BaseSpec(2, 1, 4));
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {2, 3, 8}, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 3, 8}, DType::kBF16, 51);
  ForwardOptions keep;
  keep.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, keep, &out, &saved).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  LayerGrads grads;
  const Tensor dy = RandomTensor(*ops, {2, 3, 8}, DType::kF32, 52);
  ASSERT_TRUE(layer->Backward(*ops, &*vars, *saved, dy, &grads).ok());
  EXPECT_EQ(grads.dx.dtype(), DType::kBF16);
  EXPECT_EQ(grads.params.at("params/kv/kernel").dtype(), DType::kF32);
  const Tensor wrong = RandomTensor(*ops, {2, 4, 8}, DType::kF32, 53);
  EXPECT_EQ(layer->Backward(*ops, &*vars, *saved, wrong, &grads).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
