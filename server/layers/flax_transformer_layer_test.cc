// The plain-Flax baseline layer: Flax's parameter names and shapes, the
// forward against a float64 reference from the same parameters (causal and
// padded), gradients against finite differences (also with dropout on), Flax's
// initialisers, and that FP8 autocast leaves it in high precision.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/layers/attention_layers.h"
#include "server/layers/attention_reference.h"
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

// float32 layer against a float64 reference (two norms, four GEMMs, softmax).
constexpr double kF32Tolerance = 2e-5;

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

Vec Var(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  EXPECT_NE(it, vars.end()) << name;
  return it == vars.end() ? Vec() : ToVec(it->second);
}

std::unique_ptr<Layer> Make(int64_t hidden, int64_t ffn, int heads, float attention_dropout = 0.1f,
                            float hidden_dropout = 0.1f) {
  te::v1::FlaxTransformerLayer spec;
  spec.set_hidden_size(hidden);
  spec.set_ffn_hidden_size(ffn);
  spec.set_num_attention_heads(heads);
  spec.set_attention_dropout(attention_dropout);
  spec.set_hidden_dropout(hidden_dropout);
  auto layer = MakeFlaxTransformerLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

TEST(FlaxTransformerLayerTest, FlaxNamesAndShapesWithoutFp8Metas) {
  auto layer = Make(16, 40, 4);
  Fp8Recipe fp8;
  auto specs = layer->VariableSpecs({2, 5, 16}, &fp8);
  ASSERT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, Shape> got;
  for (const VariableSpec& s : *specs) got[s.name] = s.shape;
  const std::map<std::string, Shape> want = {
      {"params/LayerNorm_0/scale", {16}},
      {"params/LayerNorm_0/bias", {16}},
      {"params/Dense_0/kernel", {16, 48}},
      {"params/Dense_1/kernel", {16, 16}},
      {"params/LayerNorm_1/scale", {16}},
      {"params/LayerNorm_1/bias", {16}},
      {"params/BasicMLP_0/Dense_0/kernel", {16, 40}},
      {"params/BasicMLP_0/Dense_0/bias", {40}},
      {"params/BasicMLP_0/Dense_1/kernel", {40, 16}},
      {"params/BasicMLP_0/Dense_1/bias", {16}},
  };
  EXPECT_EQ(got, want);
  EXPECT_EQ(layer->type_name(), "FlaxTransformerLayer");
}

Vec Reference(const Variables& vars, const Vec& x, int64_t b, int64_t s, int64_t hidden,
              int64_t ffn, int heads, const std::vector<int>& lens) {
  const int64_t n = b * s, d = hidden / heads;
  auto var = [&vars](const std::string& name) { return Var(vars, name); };
  const Vec ln0 = reference::Norm(x, n, hidden, var("params/LayerNorm_0/scale"),
                                  var("params/LayerNorm_0/bias"), 1e-5);
  const Vec qkv = reference::Matmul(ln0, var("params/Dense_0/kernel"), n, hidden, 3 * hidden);
  // [B, S, heads, 3 * D] split along the last axis: per head q | k | v.
  Vec q, k, v;
  for (int64_t row = 0; row < n * heads; ++row) {
    const auto base = qkv.begin() + row * 3 * d;
    q.insert(q.end(), base, base + d);
    k.insert(k.end(), base + d, base + 2 * d);
    v.insert(v.end(), base + 2 * d, base + 3 * d);
  }
  const Vec ctx = reference::Attention({b, s, s, heads, heads, d}, q, k, v,
                                       1.0 / std::sqrt(static_cast<double>(d)), true, lens, lens);
  const Vec h =
      reference::Add(x, reference::Matmul(ctx, var("params/Dense_1/kernel"), n, hidden, hidden));
  const Vec ln1 = reference::Norm(h, n, hidden, var("params/LayerNorm_1/scale"),
                                  var("params/LayerNorm_1/bias"), 1e-5);
  Vec f = reference::Matmul(ln1, var("params/BasicMLP_0/Dense_0/kernel"), n, hidden, ffn,
                            var("params/BasicMLP_0/Dense_0/bias"));
  for (double& value : f) value = reference::Gelu(value);
  return reference::Add(h, reference::Matmul(f, var("params/BasicMLP_0/Dense_1/kernel"), n, ffn,
                                             hidden, var("params/BasicMLP_0/Dense_1/bias")));
}

TEST(FlaxTransformerLayerTest, ForwardMatchesReferenceAndGradientsMatchDifferences) {
  const int64_t b = 2, s = 5, hidden = 12, ffn = 20;
  const int heads = 3;
  auto layer = Make(hidden, ffn, heads);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {b, s, hidden}, nullptr, 2);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 90);
  for (bool padded : {false, true}) {
    SCOPED_TRACE(padded ? "padded" : "causal");
    LayerInputs in;
    in.x = RandomTensor(*ops, {b, s, hidden}, DType::kF32, 91);
    std::vector<int> lens;
    if (padded) {
      lens = {4, 2};
      auto t = ops->Allocate(DType::kI32, {b});
      ASSERT_TRUE(t.ok());
      t->data_as<int32_t>()[0] = 4;
      t->data_as<int32_t>()[1] = 2;
      in.q_seqlens = *t;
    }
    LayerOutputs out;
    ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).ok());
    const Vec want = Reference(*vars, ToVec(in.x), b, s, hidden, ffn, heads, lens);
    EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);
    EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, {}));
  }
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, s, hidden}, DType::kF32, 92);
  ForwardOptions dropout;
  dropout.deterministic = false;
  dropout.dropout_seed = 17;
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, in, dropout));
}

double SampleStd(const Vec& v) {
  double sum = 0.0, sq = 0.0;
  for (double x : v) sum += x;
  for (double x : v) sq += (x - sum / v.size()) * (x - sum / v.size());
  return std::sqrt(sq / v.size());
}

TEST(FlaxTransformerLayerTest, FlaxInitialisers) {
  // lecun_normal: std sqrt(1 / fan_in); biases zeros; LayerNorm ones / zeros.
  auto layer = Make(128, 256, 4);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {1, 2, 128}, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const double want = 1.0 / std::sqrt(128.0);
  EXPECT_NEAR(SampleStd(Var(*vars, "params/Dense_0/kernel")), want, 0.05 * want);
  EXPECT_NEAR(SampleStd(Var(*vars, "params/BasicMLP_0/Dense_1/kernel")), 1.0 / 16.0, 0.05 / 16.0);
  for (double value : Var(*vars, "params/BasicMLP_0/Dense_0/bias")) ASSERT_EQ(value, 0.0);
  for (double value : Var(*vars, "params/LayerNorm_1/scale")) ASSERT_EQ(value, 1.0);
}

TEST(FlaxTransformerLayerTest, IgnoresFp8Autocast) {
  auto layer = Make(16, 32, 2, 0.0f, 0.0f);
  auto ops = NewCpuOps();
  Fp8Recipe fp8;
  auto vars = InitLayer(*ops, *layer, {2, 4, 16}, &fp8);
  ASSERT_TRUE(vars.ok()) << vars.status();
  for (const auto& [name, value] : *vars) EXPECT_EQ(name.rfind("params/", 0), 0u) << name;
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 4, 16}, DType::kF32, 93);
  ForwardOptions with_fp8;
  with_fp8.fp8 = &fp8;
  LayerOutputs a, b;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, with_fp8, &a, nullptr).ok());
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &b, nullptr).ok());
  EXPECT_EQ(Values(a.y), Values(b.y));
}

TEST(FlaxTransformerLayerTest, RejectsBadSpecs) {
  te::v1::FlaxTransformerLayer spec;
  spec.set_hidden_size(16);
  spec.set_num_attention_heads(4);
  auto bad = MakeFlaxTransformerLayer(spec);  // ffn_hidden_size missing
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("ffn_hidden_size"), std::string::npos);
  spec.set_ffn_hidden_size(32);
  spec.set_num_attention_heads(5);
  EXPECT_EQ(MakeFlaxTransformerLayer(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_num_attention_heads(4);
  spec.set_hidden_dropout(1.5f);
  bad = MakeFlaxTransformerLayer(spec);
  EXPECT_NE(bad.status().message().find("spec.flax_transformer_layer.hidden_dropout"),
            std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace te::layers
