// Flax's modules on the server (flax_modules.h): Flax's parameter names and
// shapes, the quickstart's plain-Flax layer as a hand-built GraphSpec with
// Flax's parameter tree and a float32 output for a bfloat16 input, Flax's
// initialisers (variance over the contracted axes), the dtype rules, forward
// and backward against a float64 reference and finite differences, and the
// specs and inputs that are refused.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/rng.h"
#include "server/layers/flax_modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomizeParams;
using testing::RandomTensor;
using testing::Values;
using Spec = te::v1::GraphSpec;
using Vec = std::vector<double>;

// float32 modules against a float64 reference: a few GEMMs and a softmax
// over O(1) data, each float32 rounding ~6e-8 relative.
constexpr double kF32Tolerance = 2e-5;
// A computation in bfloat16 (8 mantissa bits) against the same in float32.
constexpr double kBF16Tolerance = 1e-2;
// Init statistics over a few thousand samples: the sample variance of a
// truncated normal is within a few percent of its variance; 10% still tells
// fan_in F from F * heads (a factor of 4 here).
constexpr double kInitVarianceTolerance = 0.1;

te::v1::LayerSpec DenseSpec(int64_t features) {
  te::v1::LayerSpec spec;
  spec.mutable_flax_dense()->set_features(features);
  return spec;
}
te::v1::LayerSpec LayerNormSpec(float epsilon = 1e-6f) {
  te::v1::LayerSpec spec;
  spec.mutable_flax_layer_norm()->set_epsilon(epsilon);
  return spec;
}
te::v1::LayerSpec MhaSpec(int heads, int64_t qkv_features = 0, float dropout = 0.0f) {
  te::v1::LayerSpec spec;
  auto* m = spec.mutable_flax_multi_head_dot_product_attention();
  m->set_num_heads(heads);
  if (qkv_features > 0) m->set_qkv_features(qkv_features);
  m->set_dropout_rate(dropout);
  return spec;
}
te::v1::LayerSpec GeluSpec() {
  te::v1::LayerSpec spec;
  spec.mutable_activation()->add_activations("gelu");
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::LayerSpec& spec) {
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

std::map<std::string, Shape> ShapesOf(const Layer& layer, const Shape& x) {
  std::map<std::string, Shape> shapes;
  auto specs = layer.VariableSpecs(x, nullptr);
  EXPECT_TRUE(specs.ok()) << specs.status();
  if (!specs.ok()) return shapes;
  for (const VariableSpec& v : *specs) {
    EXPECT_EQ(v.dtype, DType::kF32) << v.name << ": Flax's param_dtype defaults to float32";
    shapes[v.name] = v.shape;
  }
  return shapes;
}

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

Vec Var(const Variables& vars, const std::string& name) {
  auto it = vars.find(name);
  EXPECT_NE(it, vars.end()) << name;
  return it == vars.end() ? Vec() : ToVec(it->second);
}

double RelErr(const Vec& got, const Vec& want) {
  double diff = 0.0, norm = 0.0;
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / norm);
}

void ExpectInvalid(const absl::Status& status, const std::string& names) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(names), std::string::npos)
      << "want \"" << names << "\" in: " << status.message();
}

struct StepResult {
  Tensor y;
  LayerGrads grads;
};

// A forward (kept) and its backward with dy of y's shape and `dy_dtype`.
StepResult Step(Ops& ops, const Layer& layer, Variables* vars, const LayerInputs& in,
         std::optional<DType> dy_dtype = std::nullopt, ForwardOptions opts = {}) {
  opts.keep_for_backward = true;
  StepResult run;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  const absl::Status f = layer.Forward(ops, vars, in, opts, &out, &saved);
  EXPECT_TRUE(f.ok()) << f;
  if (!f.ok()) return run;
  run.y = out.y;
  const Tensor dy = RandomTensor(ops, out.y.shape(), dy_dtype.value_or(out.y.dtype()), 77);
  const absl::Status b = layer.Backward(ops, vars, *saved, dy, &run.grads);
  EXPECT_TRUE(b.ok()) << b;
  return run;
}

// The key projection's bias adds q.b_k to every logit of a query row, which
// softmax ignores: its gradient is zero (in Flax too), and finite
// differences of it measure rounding noise alone. CheckGradientsOf checks
// every other gradient against finite differences, with these variables held
// out of its probes by this wrapper, and that theirs is zero to rounding.
class Holding : public Layer {
 public:
  Holding(const Layer& inner, Variables held) : inner_(inner), held_(std::move(held)) {}
  std::string type_name() const override { return inner_.type_name(); }
  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& x,
                                                          const Fp8Recipe* fp8) const override {
    return inner_.VariableSpecs(x, fp8);
  }
  absl::StatusOr<Shape> OutputShape(const Shape& x) const override { return inner_.OutputShape(x); }
  DType OutputDType(DType x) const override { return inner_.OutputDType(x); }
  absl::Status Init(Ops& ops, uint64_t seed, const Shape& x, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    return inner_.Init(ops, seed, x, fp8, vars);
  }
  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    Variables all = With(*vars);
    return inner_.Forward(ops, &all, in, opts, out, saved);
  }
  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    Variables all = With(*vars);
    const absl::Status s = inner_.Backward(ops, &all, saved, dy, grads);
    for (const auto& [name, t] : held_) grads->params.erase(name);
    return s;
  }

 private:
  // The same tensors (handles), so the probes' in-place changes are seen.
  Variables With(const Variables& vars) const {
    Variables all = vars;
    all.insert(held_.begin(), held_.end());
    return all;
  }
  const Layer& inner_;
  Variables held_;
};

double Rms(const Tensor& t) {
  double sum = 0.0;
  const std::vector<float> v = Values(t);
  for (float x : v) sum += static_cast<double>(x) * x / static_cast<double>(v.size());
  return std::sqrt(sum);
}

::testing::AssertionResult CheckGradientsOf(Ops& ops, const Layer& layer, Variables* vars,
                                            const LayerInputs& in, const ForwardOptions& opts) {
  Variables held, rest;
  for (const auto& [name, t] : *vars) {
    (name.size() >= 8 && name.compare(name.size() - 8, 8, "key/bias") == 0 ? held : rest)[name] = t;
  }
  ForwardOptions keep = opts;
  keep.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = layer.Forward(ops, vars, in, keep, &out, &saved);
  if (!s.ok()) return ::testing::AssertionFailure() << "forward: " << s;
  LayerGrads grads;
  s = layer.Backward(ops, vars, *saved, RandomTensor(ops, out.y.shape(), out.y.dtype(), 5), &grads);
  if (!s.ok()) return ::testing::AssertionFailure() << "backward: " << s;
  for (const auto& [name, t] : held) {
    const std::string value = name.substr(0, name.size() - 8) + "value/bias";
    const double ratio = Rms(grads.params.at(name)) / Rms(grads.params.at(value));
    if (!(ratio < 1e-4)) {
      return ::testing::AssertionFailure() << name << "'s gradient is not zero to rounding: RMS "
                                           << ratio << " of " << value << "'s";
    }
  }
  return CheckGradients(ops, Holding(layer, held), &rest, in, opts);
}

// ---- parameter names and shapes ---------------------------------------------------

TEST(FlaxModulesTest, DenseAndLayerNormHaveFlaxsNames) {
  EXPECT_EQ(ShapesOf(*Make(DenseSpec(48)), {2, 5, 16}),
            (std::map<std::string, Shape>{{"params/kernel", {16, 48}}, {"params/bias", {48}}}));
  EXPECT_EQ(ShapesOf(*Make(LayerNormSpec()), {2, 5, 16}),
            (std::map<std::string, Shape>{{"params/scale", {16}}, {"params/bias", {16}}}));
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(4);
  general.mutable_flax_dense_general()->add_features(3);
  general.mutable_flax_dense_general()->add_axis(1);
  EXPECT_EQ(ShapesOf(*Make(general), {2, 5, 16}),
            (std::map<std::string, Shape>{{"params/kernel", {5, 4, 3}}, {"params/bias", {4, 3}}}));
  te::v1::LayerSpec bare = LayerNormSpec();
  bare.mutable_flax_layer_norm()->set_use_bias(false);
  bare.mutable_flax_layer_norm()->set_use_scale(false);
  EXPECT_TRUE(ShapesOf(*Make(bare), {2, 16}).empty());
  te::v1::LayerSpec no_bias = DenseSpec(8);
  no_bias.mutable_flax_dense()->set_use_bias(false);
  EXPECT_EQ(ShapesOf(*Make(no_bias), {3, 16}),
            (std::map<std::string, Shape>{{"params/kernel", {16, 8}}}));
}

TEST(FlaxModulesTest, MultiHeadDotProductAttentionHasFlaxsNames) {
  // The quickstart's call at hidden 64, 4 heads: qkv_features = kv_channels
  // = 16, so head_dim 4, and out_features = q's features.
  const std::map<std::string, Shape> want = {
      {"params/query/kernel", {64, 4, 4}}, {"params/query/bias", {4, 4}},
      {"params/key/kernel", {64, 4, 4}},   {"params/key/bias", {4, 4}},
      {"params/value/kernel", {64, 4, 4}}, {"params/value/bias", {4, 4}},
      {"params/out/kernel", {4, 4, 64}},   {"params/out/bias", {64}},
  };
  auto layer = Make(MhaSpec(4, 16));
  EXPECT_EQ(ShapesOf(*layer, {2, 8, 64}), want);
  EXPECT_EQ(*layer->OutputShape({2, 8, 64}), (Shape{2, 8, 64}));
  // Flax's defaults: qkv_features and out_features are q's features.
  te::v1::LayerSpec defaults = MhaSpec(4);
  defaults.mutable_flax_multi_head_dot_product_attention()->set_out_features(10);
  auto shapes = ShapesOf(*Make(defaults), {2, 8, 64});
  EXPECT_EQ(shapes["params/query/kernel"], (Shape{64, 4, 16}));
  EXPECT_EQ(shapes["params/out/kernel"], (Shape{4, 16, 10}));
  EXPECT_EQ(shapes["params/out/bias"], (Shape{10}));
}

// ---- the quickstart's plain-Flax layer as a graph -------------------------------------

Spec::Node* Add(Spec* g, const std::string& name, std::vector<std::string> in,
                std::vector<std::string> out) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  for (const std::string& s : out) node->add_outputs(s);
  return node;
}

struct Quickstart {
  int64_t batch = 2, seq = 6, hidden = 64, ffn = 256;
  int heads = 4;
  float attention_dropout = 0.1f, hidden_dropout = 0.1f;
  float layernorm_eps = 1e-5f;
  int64_t kv_channels() const { return hidden / heads; }
};

// TE's quickstart FlaxTransformerLayer, node for node as a tracer records it:
//   LayerNorm -> Dense(3H) -> reshape/split q, k, v -> MultiHeadDotProductAttention
//   (causal) -> Dropout -> + res -> LayerNorm -> FlaxMLP -> Dropout -> + res.
// `res + x` with res bfloat16 and x float32 is jnp's promotion: a cast, then
// the add.
Spec QuickstartGraph(const Quickstart& q) {
  Spec g;
  const int64_t kv = q.kv_channels();
  Add(&g, "causal_mask", {"x"}, {"mask"})->mutable_causal_mask();
  Add(&g, "LayerNorm_0", {"x"}, {"ln0"})->mutable_module()->CopyFrom(LayerNormSpec(q.layernorm_eps));
  Add(&g, "Dense_0", {"ln0"}, {"qkv"})->mutable_module()->CopyFrom(DenseSpec(3 * q.hidden));
  auto* heads = Add(&g, "reshape_qkv", {"qkv"}, {"qkv4"})->mutable_reshape();
  for (int64_t d : {q.batch, q.seq, int64_t{q.heads}, 3 * kv}) heads->add_shape(d);
  auto* split = Add(&g, "split_qkv", {"qkv4"}, {"q4", "k4", "v4"})->mutable_split();
  split->set_axis(3);
  split->set_parts(3);
  for (const char* t : {"q", "k", "v"}) {
    auto* flat = Add(&g, std::string("reshape_") + t, {std::string(t) + "4"}, {t})->mutable_reshape();
    for (int64_t d : {q.batch, q.seq, q.hidden}) flat->add_shape(d);
  }
  Spec::Node* attention = Add(&g, "MultiHeadDotProductAttention_0", {"q", "k", "v"}, {"attn"});
  *attention->mutable_module() = MhaSpec(q.heads, kv, q.attention_dropout);
  attention->set_mask("mask");
  Add(&g, "Dropout_0", {"attn"}, {"attn_d"})->mutable_dropout()->set_rate(q.hidden_dropout);
  Add(&g, "cast_res", {"x"}, {"res0"})->mutable_cast()->set_dtype(te::v1::FLOAT32);
  Add(&g, "add_0", {"res0", "attn_d"}, {"h"})->mutable_add();
  Add(&g, "LayerNorm_1", {"h"}, {"ln1"})->mutable_module()->CopyFrom(LayerNormSpec(q.layernorm_eps));
  Add(&g, "FlaxMLP_0/Dense_0", {"ln1"}, {"f1"})->mutable_module()->CopyFrom(DenseSpec(q.ffn));
  Add(&g, "FlaxMLP_0/gelu", {"f1"}, {"g"})->mutable_module()->CopyFrom(GeluSpec());
  Add(&g, "FlaxMLP_0/Dense_1", {"g"}, {"f2"})->mutable_module()->CopyFrom(DenseSpec(q.hidden));
  Add(&g, "Dropout_1", {"f2"}, {"f2_d"})->mutable_dropout()->set_rate(q.hidden_dropout);
  Add(&g, "add_1", {"h", "f2_d"}, {"y"})->mutable_add();
  g.add_outputs("y");
  return g;
}

std::unique_ptr<Layer> MakeGraph(const Spec& graph) {
  te::v1::LayerSpec spec;
  *spec.mutable_graph() = graph;
  return Make(spec);
}

TEST(FlaxModulesTest, QuickstartGraphHasFlaxsParameterTree) {
  const Quickstart q;
  auto layer = MakeGraph(QuickstartGraph(q));
  ASSERT_NE(layer, nullptr);
  // The tree at 4096 / 32 heads, scaled to 64 / 4 heads (head_dim 16 / 4 = 4).
  const std::map<std::string, Shape> want = {
      {"params/Dense_0/bias", {192}},
      {"params/Dense_0/kernel", {64, 192}},
      {"params/FlaxMLP_0/Dense_0/bias", {256}},
      {"params/FlaxMLP_0/Dense_0/kernel", {64, 256}},
      {"params/FlaxMLP_0/Dense_1/bias", {64}},
      {"params/FlaxMLP_0/Dense_1/kernel", {256, 64}},
      {"params/LayerNorm_0/bias", {64}},
      {"params/LayerNorm_0/scale", {64}},
      {"params/LayerNorm_1/bias", {64}},
      {"params/LayerNorm_1/scale", {64}},
      {"params/MultiHeadDotProductAttention_0/key/bias", {4, 4}},
      {"params/MultiHeadDotProductAttention_0/key/kernel", {64, 4, 4}},
      {"params/MultiHeadDotProductAttention_0/out/bias", {64}},
      {"params/MultiHeadDotProductAttention_0/out/kernel", {4, 4, 64}},
      {"params/MultiHeadDotProductAttention_0/query/bias", {4, 4}},
      {"params/MultiHeadDotProductAttention_0/query/kernel", {64, 4, 4}},
      {"params/MultiHeadDotProductAttention_0/value/bias", {4, 4}},
      {"params/MultiHeadDotProductAttention_0/value/kernel", {64, 4, 4}},
  };
  EXPECT_EQ(ShapesOf(*layer, {q.batch, q.seq, q.hidden}), want);
  EXPECT_EQ(layer->OutputDType(DType::kBF16), DType::kF32);
  EXPECT_EQ(layer->OutputDType(DType::kF32), DType::kF32);
}

TEST(FlaxModulesTest, QuickstartGraphReturnsFloat32ForBfloat16AsItsFloat32ValuesWould) {
  const Quickstart q;
  auto layer = MakeGraph(QuickstartGraph(q));
  ASSERT_NE(layer, nullptr);
  auto ops = NewCpuOps();
  const Shape shape = {q.batch, q.seq, q.hidden};
  auto vars = InitLayer(*ops, *layer, shape, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Tensor x16 = RandomTensor(*ops, shape, DType::kBF16, 5);
  Tensor x32 = RandomTensor(*ops, shape, DType::kF32, 0);
  testing::SetValues(Values(x16), &x32);  // the same values, exactly
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 11;
  const StepResult from16 = Step(*ops, *layer, &*vars, {x16}, DType::kF32, opts);
  const StepResult from32 = Step(*ops, *layer, &*vars, {x32}, DType::kF32, opts);
  ASSERT_TRUE(from16.y.defined() && from32.y.defined());
  EXPECT_EQ(from16.y.dtype(), DType::kF32);
  EXPECT_EQ(from16.y.shape(), shape);
  // bfloat16 x with float32 params computes in float32 from its first
  // module on: the same numbers as its float32 values give.
  EXPECT_EQ(Values(from16.y), Values(from32.y));
  EXPECT_EQ(from16.grads.dx.dtype(), DType::kBF16);
  EXPECT_EQ(from16.grads.params.size(), 18u);
  for (const auto& [name, g] : from16.grads.params) {
    EXPECT_EQ(g.dtype(), DType::kF32) << name;
    EXPECT_EQ(Values(g), Values(from32.grads.params.at(name))) << name;
  }
}

TEST(FlaxModulesTest, QuickstartGraphGradientsMatchFiniteDifferences) {
  Quickstart q;
  q.batch = 2;
  q.seq = 4;
  q.hidden = 16;
  q.ffn = 24;
  q.heads = 2;
  auto layer = MakeGraph(QuickstartGraph(q));
  ASSERT_NE(layer, nullptr);
  auto ops = NewCpuOps();
  const Shape shape = {q.batch, q.seq, q.hidden};
  auto vars = InitLayer(*ops, *layer, shape, nullptr, 4);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 21);
  for (bool deterministic : {true, false}) {
    ForwardOptions opts;
    opts.deterministic = deterministic;
    opts.dropout_seed = 8;
    EXPECT_TRUE(CheckGradientsOf(*ops, *layer, &*vars, {RandomTensor(*ops, shape, DType::kF32, 6)},
                                 opts))
        << "deterministic " << deterministic;
  }
}

TEST(FlaxModulesTest, GraphNodesInitAsTheModulesUnderDerivedSeeds) {
  const Quickstart q;
  auto layer = MakeGraph(QuickstartGraph(q));
  ASSERT_NE(layer, nullptr);
  auto ops = NewCpuOps();
  const Shape shape = {q.batch, q.seq, q.hidden};
  auto vars = InitLayer(*ops, *layer, shape, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const std::string node = "MultiHeadDotProductAttention_0";
  auto alone = InitLayer(*ops, *Make(MhaSpec(q.heads, q.kv_channels())), shape, nullptr,
                         DeriveSeed(3, node));
  ASSERT_TRUE(alone.ok()) << alone.status();
  for (const char* p : {"query/kernel", "key/kernel", "value/kernel", "out/kernel"}) {
    EXPECT_EQ(Var(*vars, "params/" + node + "/" + p), Var(*alone, std::string("params/") + p)) << p;
  }
}

// ---- initialisers -------------------------------------------------------------------

struct Moments {
  double mean = 0.0, variance = 0.0, max_abs = 0.0;
};
Moments MomentsOf(const Vec& v) {
  Moments m;
  for (double x : v) m.mean += x / static_cast<double>(v.size());
  for (double x : v) {
    m.variance += (x - m.mean) * (x - m.mean) / static_cast<double>(v.size());
    m.max_abs = std::max(m.max_abs, std::abs(x));
  }
  return m;
}

// lecun_normal: variance 1 / fan_in, a normal truncated at two of its own
// standard deviations (JAX rescales by 0.8796... so the result has the
// variance asked for).
void ExpectLecunNormal(const Vec& v, double fan_in, const std::string& name) {
  const Moments m = MomentsOf(v);
  const double want = 1.0 / fan_in;
  EXPECT_NEAR(m.variance / want, 1.0, kInitVarianceTolerance) << name << " fan_in " << fan_in;
  EXPECT_LT(std::abs(m.mean), 0.1 * std::sqrt(want)) << name;
  EXPECT_LE(m.max_abs, 2.0 * std::sqrt(want) / 0.87962566103423978 * (1 + 1e-6)) << name;
}

void ExpectAll(const Vec& v, double value, const std::string& name) {
  for (double x : v) {
    ASSERT_EQ(x, value) << name;
  }
}

TEST(FlaxModulesTest, KernelsAreLecunNormalOverTheContractedAxes) {
  auto ops = NewCpuOps();
  auto dense = InitLayer(*ops, *Make(DenseSpec(512)), {4, 256}, nullptr, 1);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ExpectLecunNormal(Var(*dense, "params/kernel"), 256, "Dense kernel");
  ExpectAll(Var(*dense, "params/bias"), 0.0, "Dense bias");

  // DenseGeneral draws its kernel as [prod(in), prod(features)]: fan_in is
  // 64, not the 64 * 4 of variance_scaling on (64, 4, 8) itself.
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(4);
  general.mutable_flax_dense_general()->add_features(8);
  auto g = InitLayer(*ops, *Make(general), {3, 64}, nullptr, 2);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectLecunNormal(Var(*g, "params/kernel"), 64, "DenseGeneral kernel");

  // Attention: query/key/value contract F = 128; out contracts heads *
  // head_dim = 4 * 8.
  auto mha = InitLayer(*ops, *Make(MhaSpec(4, 32)), {2, 3, 128}, nullptr, 3);
  ASSERT_TRUE(mha.ok()) << mha.status();
  for (const char* p : {"query", "key", "value"}) {
    ExpectLecunNormal(Var(*mha, std::string("params/") + p + "/kernel"), 128, p);
    ExpectAll(Var(*mha, std::string("params/") + p + "/bias"), 0.0, p);
  }
  ExpectLecunNormal(Var(*mha, "params/out/kernel"), 32, "out");
  ExpectAll(Var(*mha, "params/out/bias"), 0.0, "out bias");
  // Each kernel draws its own values (seeded by its name).
  EXPECT_NE(Var(*mha, "params/query/kernel"), Var(*mha, "params/key/kernel"));

  auto norm = InitLayer(*ops, *Make(LayerNormSpec()), {2, 32}, nullptr, 4);
  ASSERT_TRUE(norm.ok()) << norm.status();
  ExpectAll(Var(*norm, "params/scale"), 1.0, "scale");
  ExpectAll(Var(*norm, "params/bias"), 0.0, "bias");
}

TEST(FlaxModulesTest, InitIsDeterministicFromTheSeed) {
  auto ops = NewCpuOps();
  auto layer = Make(MhaSpec(2, 8));
  auto a = InitLayer(*ops, *layer, {1, 2, 8}, nullptr, 9);
  auto b = InitLayer(*ops, *layer, {1, 2, 8}, nullptr, 9);
  auto c = InitLayer(*ops, *layer, {1, 2, 8}, nullptr, 10);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(Var(*a, "params/out/kernel"), Var(*b, "params/out/kernel"));
  EXPECT_NE(Var(*a, "params/out/kernel"), Var(*c, "params/out/kernel"));
}

// ---- dtype rules ----------------------------------------------------------------------

TEST(FlaxModulesTest, PromoteFloatIsJaxsResultType) {
  const DType f32 = DType::kF32, bf16 = DType::kBF16, f16 = DType::kF16;
  EXPECT_EQ(PromoteFloat(bf16, bf16), bf16);
  EXPECT_EQ(PromoteFloat(f16, f16), f16);
  EXPECT_EQ(PromoteFloat(bf16, f32), f32);
  EXPECT_EQ(PromoteFloat(f32, f16), f32);
  EXPECT_EQ(PromoteFloat(bf16, f16), f32);
}

struct DTypeCase {
  DType x;
  te::v1::DType param_dtype;
  te::v1::DType dtype;
  DType y;
};

TEST(FlaxModulesTest, ModulesComputeInThePromotedDTypeOrTheirDtype) {
  const std::vector<DTypeCase> cases = {
      {DType::kBF16, te::v1::DTYPE_UNSPECIFIED, te::v1::DTYPE_UNSPECIFIED, DType::kF32},
      {DType::kF32, te::v1::DTYPE_UNSPECIFIED, te::v1::DTYPE_UNSPECIFIED, DType::kF32},
      {DType::kBF16, te::v1::BFLOAT16, te::v1::DTYPE_UNSPECIFIED, DType::kBF16},
      {DType::kF16, te::v1::BFLOAT16, te::v1::DTYPE_UNSPECIFIED, DType::kF32},
      {DType::kF16, te::v1::FLOAT16, te::v1::DTYPE_UNSPECIFIED, DType::kF16},
      {DType::kF32, te::v1::DTYPE_UNSPECIFIED, te::v1::BFLOAT16, DType::kBF16},
      {DType::kBF16, te::v1::DTYPE_UNSPECIFIED, te::v1::FLOAT16, DType::kF16},
  };
  auto ops = NewCpuOps();
  for (const DTypeCase& c : cases) {
    te::v1::LayerSpec dense = DenseSpec(6), norm = LayerNormSpec(), mha = MhaSpec(2, 4);
    dense.mutable_flax_dense()->set_param_dtype(c.param_dtype);
    dense.mutable_flax_dense()->set_dtype(c.dtype);
    norm.mutable_flax_layer_norm()->set_param_dtype(c.param_dtype);
    norm.mutable_flax_layer_norm()->set_dtype(c.dtype);
    mha.mutable_flax_multi_head_dot_product_attention()->set_param_dtype(c.param_dtype);
    mha.mutable_flax_multi_head_dot_product_attention()->set_dtype(c.dtype);
    for (const te::v1::LayerSpec& spec : {dense, norm, mha}) {
      auto layer = Make(spec);
      const std::string what = absl::StrCat(layer->type_name(), " x ", DTypeName(c.x), " param ",
                                            te::v1::DType_Name(c.param_dtype), " dtype ",
                                            te::v1::DType_Name(c.dtype));
      EXPECT_EQ(layer->OutputDType(c.x), c.y) << what;
      const Shape shape = {2, 3, 8};
      auto vars = InitLayer(*ops, *layer, shape, nullptr);
      ASSERT_TRUE(vars.ok()) << vars.status();
      const DType param = c.param_dtype == te::v1::DTYPE_UNSPECIFIED ? DType::kF32
                          : c.param_dtype == te::v1::BFLOAT16      ? DType::kBF16
                                                                   : DType::kF16;
      for (const auto& [name, t] : *vars) EXPECT_EQ(t.dtype(), param) << what << " " << name;
      const StepResult run = Step(*ops, *layer, &*vars, {RandomTensor(*ops, shape, c.x, 1)});
      ASSERT_TRUE(run.y.defined()) << what;
      EXPECT_EQ(run.y.dtype(), c.y) << what;
      EXPECT_EQ(run.grads.dx.dtype(), c.x) << what << ": dx in x's dtype";
      for (const auto& [name, g] : run.grads.params) {
        EXPECT_EQ(g.dtype(), param) << what << " " << name;
      }
    }
  }
}

TEST(FlaxModulesTest, LayerNormWithoutParamsKeepsXsDType) {
  te::v1::LayerSpec spec = LayerNormSpec();
  spec.mutable_flax_layer_norm()->set_use_scale(false);
  spec.mutable_flax_layer_norm()->set_use_bias(false);
  EXPECT_EQ(Make(spec)->OutputDType(DType::kBF16), DType::kBF16);
}

TEST(FlaxModulesTest, ABfloat16DtypeComputesInBfloat16) {
  auto ops = NewCpuOps();
  te::v1::LayerSpec half = DenseSpec(32);
  half.mutable_flax_dense()->set_dtype(te::v1::BFLOAT16);
  auto layer16 = Make(half);
  auto layer32 = Make(DenseSpec(32));
  const Shape shape = {8, 64};
  auto vars = InitLayer(*ops, *layer32, shape, nullptr);
  ASSERT_TRUE(vars.ok());
  const Tensor x = RandomTensor(*ops, shape, DType::kF32, 2);
  const StepResult y16 = Step(*ops, *layer16, &*vars, {x});
  const StepResult y32 = Step(*ops, *layer32, &*vars, {x});
  EXPECT_EQ(y16.y.dtype(), DType::kBF16);
  const double err = RelErr(ToVec(y16.y), ToVec(y32.y));
  EXPECT_GT(err, 0.0) << "bfloat16 compute rounds";
  EXPECT_LT(err, kBF16Tolerance);
}

// ---- forward against float64, backward against finite differences -----------------

struct MhaCase {
  int64_t batch = 2, q_len = 5, kv_len = 5, features = 12;
  int heads = 2;
  int64_t qkv = 8, out = 12;
  bool causal = false;
  std::vector<int> q_lens, kv_lens;  // padding; empty: none
};

// y = out(softmax(q k^T / sqrt(D) + mask) v), q/k/v/out as Flax's DenseGeneral
// (kernel [in, heads, D] + bias [heads, D]; out [heads, D, out] + bias [out]).
// A query row with no visible key gives context zeros.
Vec ReferenceMha(const Variables& vars, const MhaCase& c, const Vec& xq, const Vec& xk,
                 const Vec& xv) {
  const int64_t h_n = c.heads, d_n = c.qkv / c.heads;
  auto project = [&](const std::string& name, const Vec& x, int64_t len) {
    const Vec w = Var(vars, "params/" + name + "/kernel"), b = Var(vars, "params/" + name + "/bias");
    Vec y(static_cast<size_t>(c.batch * len * c.qkv));
    for (int64_t r = 0; r < c.batch * len; ++r) {
      for (int64_t o = 0; o < c.qkv; ++o) {
        double sum = b[o];
        for (int64_t f = 0; f < c.features; ++f) sum += x[r * c.features + f] * w[f * c.qkv + o];
        y[r * c.qkv + o] = sum;
      }
    }
    return y;  // [B, len, heads, D]
  };
  const Vec q = project("query", xq, c.q_len), k = project("key", xk, c.kv_len),
            v = project("value", xv, c.kv_len);
  Vec context(static_cast<size_t>(c.batch * c.q_len * c.qkv), 0.0);
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t q_valid = c.q_lens.empty() ? c.q_len : c.q_lens[b];
    const int64_t kv_valid = c.kv_lens.empty() ? c.kv_len : c.kv_lens[b];
    for (int64_t h = 0; h < h_n; ++h) {
      for (int64_t i = 0; i < q_valid; ++i) {
        std::vector<double> p;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < kv_valid; ++j) {
          if (c.causal && j > i) continue;
          double dot = 0.0;
          for (int64_t e = 0; e < d_n; ++e) {
            dot += q[((b * c.q_len + i) * h_n + h) * d_n + e] *
                   k[((b * c.kv_len + j) * h_n + h) * d_n + e];
          }
          p.push_back(dot / std::sqrt(static_cast<double>(d_n)));
          keys.push_back(j);
        }
        if (p.empty()) continue;
        const double max = *std::max_element(p.begin(), p.end());
        double sum = 0.0;
        for (double& l : p) sum += (l = std::exp(l - max));
        for (size_t t = 0; t < keys.size(); ++t) {
          for (int64_t e = 0; e < d_n; ++e) {
            context[((b * c.q_len + i) * h_n + h) * d_n + e] +=
                p[t] / sum * v[((b * c.kv_len + keys[t]) * h_n + h) * d_n + e];
          }
        }
      }
    }
  }
  const Vec wo = Var(vars, "params/out/kernel"), bo = Var(vars, "params/out/bias");
  Vec y(static_cast<size_t>(c.batch * c.q_len * c.out));
  for (int64_t r = 0; r < c.batch * c.q_len; ++r) {
    for (int64_t o = 0; o < c.out; ++o) {
      double sum = bo[o];
      for (int64_t m = 0; m < c.qkv; ++m) sum += context[r * c.qkv + m] * wo[m * c.out + o];
      y[r * c.out + o] = sum;
    }
  }
  return y;
}

std::unique_ptr<Layer> MakeMha(const MhaCase& c, float dropout = 0.0f) {
  te::v1::FlaxMultiHeadDotProductAttention spec;
  spec.set_num_heads(c.heads);
  spec.set_qkv_features(c.qkv);
  spec.set_out_features(c.out);
  spec.set_dropout_rate(dropout);
  auto layer = MakeFlaxMultiHeadDotProductAttention(spec, c.causal);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

Tensor Lengths(Ops& ops, const std::vector<int>& lens) {
  if (lens.empty()) return Tensor();
  auto t = ops.Allocate(DType::kI32, {static_cast<int64_t>(lens.size())});
  EXPECT_TRUE(t.ok());
  EXPECT_TRUE(ops.Upload(lens.data(), &*t).ok());
  return *t;
}

class MhaReferenceTest : public ::testing::TestWithParam<MhaCase> {};

TEST_P(MhaReferenceTest, MatchesFloat64AndFiniteDifferences) {
  const MhaCase c = GetParam();
  auto ops = NewCpuOps();
  auto layer = MakeMha(c);
  ASSERT_NE(layer, nullptr);
  const Shape q_shape = {c.batch, c.q_len, c.features}, kv_shape = {c.batch, c.kv_len, c.features};
  auto vars = InitLayer(*ops, *layer, q_shape, nullptr, 5);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 30);
  LayerInputs in;
  in.x = RandomTensor(*ops, q_shape, DType::kF32, 1);
  const bool cross = c.kv_len != c.q_len;
  if (cross) {
    in.extra = {RandomTensor(*ops, kv_shape, DType::kF32, 2), RandomTensor(*ops, kv_shape, DType::kF32, 3)};
  }
  in.q_seqlens = Lengths(*ops, c.q_lens);
  in.kv_seqlens = Lengths(*ops, c.kv_lens);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, &saved).ok());
  const Vec xq = ToVec(in.x);
  const Vec xk = cross ? ToVec(in.extra[0]) : xq, xv = cross ? ToVec(in.extra[1]) : xq;
  EXPECT_EQ(out.y.shape(), (Shape{c.batch, c.q_len, c.out}));
  EXPECT_LT(RelErr(ToVec(out.y), ReferenceMha(*vars, c, xq, xk, xv)), kF32Tolerance);
  EXPECT_TRUE(CheckGradientsOf(*ops, *layer, &*vars, in, {}));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MhaReferenceTest,
    ::testing::Values(MhaCase{},                                      // self, no mask
                      MhaCase{2, 5, 5, 12, 2, 8, 12, /*causal=*/true},  // the quickstart's
                      MhaCase{2, 4, 6, 8, 4, 8, 5},                   // cross, out_features 5
                      MhaCase{2, 5, 5, 12, 2, 6, 12, false, {3, 5}, {4, 2}}));  // padded

TEST(FlaxModulesTest, MhaTakesInputsKAndVAsFlaxDefaultsThem) {
  // k alone: v = k; neither: k = v = q. The gradient of a shared input sums.
  MhaCase c;
  auto ops = NewCpuOps();
  auto layer = MakeMha(c);
  const Shape shape = {c.batch, c.q_len, c.features};
  auto vars = InitLayer(*ops, *layer, shape, nullptr, 5);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 31);
  const Tensor q = RandomTensor(*ops, shape, DType::kF32, 1);
  const Tensor k = RandomTensor(*ops, shape, DType::kF32, 2);
  LayerOutputs one, two;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {q, {k}}, {}, &one, nullptr).ok());
  EXPECT_LT(RelErr(ToVec(one.y), ReferenceMha(*vars, c, ToVec(q), ToVec(k), ToVec(k))),
            kF32Tolerance);
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {q, {k, k}}, {}, &two, nullptr).ok());
  EXPECT_EQ(Values(one.y), Values(two.y));
  EXPECT_TRUE(CheckGradientsOf(*ops, *layer, &*vars, {q, {k}}, {}));
  EXPECT_TRUE(CheckGradientsOf(*ops, *layer, &*vars, {q}, {}));
}

TEST(FlaxModulesTest, MhaDropoutDropsAttentionWeightsReproducibly) {
  MhaCase c;
  c.causal = true;
  auto ops = NewCpuOps();
  auto layer = MakeMha(c, 0.3f);
  const Shape shape = {c.batch, c.q_len, c.features};
  auto vars = InitLayer(*ops, *layer, shape, nullptr, 5);
  ASSERT_TRUE(vars.ok());
  const Tensor x = RandomTensor(*ops, shape, DType::kF32, 1);
  ForwardOptions on;
  on.deterministic = false;
  on.dropout_seed = 3;
  LayerOutputs off, a, b;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {x}, {}, &off, nullptr).ok());
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {x}, on, &a, nullptr).ok());
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {x}, on, &b, nullptr).ok());
  EXPECT_EQ(Values(a.y), Values(b.y));
  EXPECT_NE(Values(a.y), Values(off.y));
  EXPECT_LT(RelErr(ToVec(off.y), ReferenceMha(*vars, c, ToVec(x), ToVec(x), ToVec(x))),
            kF32Tolerance);
  EXPECT_TRUE(CheckGradientsOf(*ops, *layer, &*vars, {x}, on));
}

TEST(FlaxModulesTest, DenseGeneralAndLayerNormGradients) {
  auto ops = NewCpuOps();
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(2);
  general.mutable_flax_dense_general()->add_features(3);
  general.mutable_flax_dense_general()->add_axis(1);  // not trailing: a permutation
  te::v1::LayerSpec bare = LayerNormSpec();
  bare.mutable_flax_layer_norm()->set_use_scale(false);
  for (const te::v1::LayerSpec& spec : {DenseSpec(7), general, LayerNormSpec(), bare}) {
    auto layer = Make(spec);
    const Shape shape = {2, 3, 4};
    auto vars = InitLayer(*ops, *layer, shape, nullptr);
    ASSERT_TRUE(vars.ok());
    RandomizeParams(*ops, &*vars, 40);
    EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, {RandomTensor(*ops, shape, DType::kF32, 1)}, {}))
        << layer->type_name();
  }
}

TEST(FlaxModulesTest, LayerNormMatchesFloat64) {
  auto ops = NewCpuOps();
  auto layer = Make(LayerNormSpec(1e-5f));
  const Shape shape = {3, 10};
  auto vars = InitLayer(*ops, *layer, shape, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 41);
  const Tensor x = RandomTensor(*ops, shape, DType::kBF16, 1);
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, {x}, {}, &out, nullptr).ok());
  EXPECT_EQ(out.y.dtype(), DType::kF32);
  const Vec xv = ToVec(x), scale = Var(*vars, "params/scale"), bias = Var(*vars, "params/bias");
  Vec want;
  for (int64_t r = 0; r < 3; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t f = 0; f < 10; ++f) mean += xv[r * 10 + f] / 10.0;
    for (int64_t f = 0; f < 10; ++f) var += (xv[r * 10 + f] - mean) * (xv[r * 10 + f] - mean) / 10.0;
    for (int64_t f = 0; f < 10; ++f) {
      want.push_back((xv[r * 10 + f] - mean) / std::sqrt(var + 1e-5) * scale[f] + bias[f]);
    }
  }
  EXPECT_LT(RelErr(ToVec(out.y), want), kF32Tolerance);
}

// ---- masks in a graph ---------------------------------------------------------------

TEST(FlaxModulesTest, GraphMaskChoosesCausalPaddingOrNone) {
  MhaCase c;
  auto ops = NewCpuOps();
  const Shape shape = {c.batch, c.q_len, c.features};
  const Tensor x = RandomTensor(*ops, shape, DType::kF32, 1);
  for (const std::string mask : {"", "attention_mask", "causal"}) {
    Spec g;
    Add(&g, "make_causal", {"x"}, {"causal"})->mutable_causal_mask();
    Spec::Node* node = Add(&g, "MultiHeadDotProductAttention_0", {"x", "x", "x"}, {"y"});
    *node->mutable_module() = MhaSpec(c.heads, c.qkv);
    node->mutable_module()->mutable_flax_multi_head_dot_product_attention()->set_out_features(c.out);
    node->set_mask(mask);
    g.add_outputs("y");
    auto layer = MakeGraph(g);
    ASSERT_NE(layer, nullptr) << mask;
    auto vars = InitLayer(*ops, *layer, shape, nullptr, 2);
    ASSERT_TRUE(vars.ok());
    LayerInputs in{x};
    MhaCase want = c;
    want.causal = mask == "causal";
    if (mask == "attention_mask") {
      want.q_lens = want.kv_lens = {3, 5};
      in.q_seqlens = in.kv_seqlens = Lengths(*ops, want.q_lens);
    }
    Variables own;
    for (const auto& [key, t] : *vars) {
      own["params/" + key.substr(std::string("params/MultiHeadDotProductAttention_0/").size())] = t;
    }
    LayerOutputs out;
    ASSERT_TRUE(layer->Forward(*ops, &*vars, in, {}, &out, nullptr).ok()) << mask;
    EXPECT_LT(RelErr(ToVec(out.y), ReferenceMha(own, want, ToVec(x), ToVec(x), ToVec(x))),
              kF32Tolerance)
        << "mask \"" << mask << "\"";
  }
}

// ---- refused specs and inputs ---------------------------------------------------------

TEST(FlaxModulesTest, BadSpecsNameTheirField) {
  te::v1::LayerSpec spec = DenseSpec(0);
  ExpectInvalid(CreateLayer(spec).status(), "spec.flax_dense.features");
  spec = DenseSpec(4);
  spec.mutable_flax_dense()->set_dtype(te::v1::FLOAT8_E4M3);
  ExpectInvalid(CreateLayer(spec).status(), "spec.flax_dense.dtype");
  spec = LayerNormSpec();
  spec.mutable_flax_layer_norm()->set_param_dtype(te::v1::INT32);
  ExpectInvalid(CreateLayer(spec).status(), "spec.flax_layer_norm.param_dtype");
  ExpectInvalid(CreateLayer(MhaSpec(0)).status(), "spec.flax_multi_head_dot_product_attention.num_heads");
  ExpectInvalid(CreateLayer(MhaSpec(3, 8)).status(), "qkv_features");
  ExpectInvalid(CreateLayer(MhaSpec(2, 8, 1.0f)).status(), "dropout_rate");
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(4);
  general.mutable_flax_dense_general()->add_axis(2);
  ExpectInvalid(Make(general)->VariableSpecs({3, 4}, nullptr).status(),
                "spec.flax_dense_general.axis");
  // Unset qkv_features is x's features, which must divide by the heads.
  ExpectInvalid(Make(MhaSpec(3))->VariableSpecs({2, 4, 8}, nullptr).status(), "qkv_features");
  ExpectInvalid(Make(MhaSpec(2))->VariableSpecs({2, 8}, nullptr).status(), "input_shape");
  spec = DenseSpec(4);
  spec.mutable_flax_dense()->set_precision(static_cast<te::v1::Precision>(7));
  ExpectInvalid(CreateLayer(spec).status(), "spec.flax_dense.precision");
  te::v1::LayerSpec mha = MhaSpec(2);
  mha.mutable_flax_multi_head_dot_product_attention()->set_precision(
      static_cast<te::v1::Precision>(-1));
  ExpectInvalid(CreateLayer(mha).status(), "spec.flax_multi_head_dot_product_attention.precision");
}

TEST(FlaxModulesTest, MhaRefusesKeysThatDoNotFit) {
  auto ops = NewCpuOps();
  auto layer = Make(MhaSpec(2, 4));
  const Shape shape = {2, 3, 8};
  auto vars = InitLayer(*ops, *layer, shape, nullptr);
  ASSERT_TRUE(vars.ok());
  const Tensor q = RandomTensor(*ops, shape, DType::kF32, 1);
  LayerOutputs out;
  ExpectInvalid(layer->Forward(*ops, &*vars, {q, {RandomTensor(*ops, {2, 3, 6}, DType::kF32, 2)}},
                               {}, &out, nullptr),
                "extra_inputs[0]");
  ExpectInvalid(layer->Forward(*ops, &*vars, {q, {RandomTensor(*ops, shape, DType::kBF16, 2)}}, {},
                               &out, nullptr),
                "extra_inputs[0].dtype");
  ExpectInvalid(layer->Forward(*ops, &*vars,
                               {q, {RandomTensor(*ops, {2, 4, 8}, DType::kF32, 2),
                                    RandomTensor(*ops, {2, 5, 8}, DType::kF32, 3)}},
                               {}, &out, nullptr),
                "extra_inputs[1]");
  ExpectInvalid(layer->Forward(*ops, &*vars, {q, {q, q, q}}, {}, &out, nullptr), "extra_inputs");
}

TEST(FlaxModulesTest, GraphMhaNodeTakesQKV) {
  Spec g;
  Spec::Node* node = Add(&g, "MultiHeadDotProductAttention_0", {"x"}, {"y"});
  *node->mutable_module() = MhaSpec(2, 4);
  g.add_outputs("y");
  te::v1::LayerSpec spec;
  *spec.mutable_graph() = g;
  ExpectInvalid(CreateLayer(spec).status(), "takes 3 inputs");
}

}  // namespace
}  // namespace te::layers
