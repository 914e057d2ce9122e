// TE's JAX quickstart through the client library against the real te_server
// (CPU backend, loopback), at small sizes: the six sections' init / apply /
// value_and_grad, their variable trees, the graphs against the same modules
// chained from the client, FP8 state that moves with the steps, the
// speedometer, the large-tensor transport, and the ScopeCollectionNotFound
// error case.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/graph.h"
#include "client/modules.h"
#include "client/quickstart_layers.h"
#include "client/reference_chain.h"
#include "client/speedometer.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"
#include "tests/server_fixture.h"

namespace te::client {
namespace {

// The small config (the quickstart's layer, scaled down).
constexpr int64_t kBatch = 2, kSeq = 16, kHidden = 32, kFfn = 64;
constexpr int kHeads = 2;
// Relative tolerance for comparing two float32 paths that should agree up to
// the rounding of one host-side add.
constexpr double kF32AddTolerance = 1e-6;

std::set<std::string> Names(const std::vector<VariableInfo>& vars, const std::string& collection) {
  std::set<std::string> out;
  for (const VariableInfo& v : vars) {
    if (v.collection == collection) out.insert(v.path);
  }
  return out;
}

bool AllFinite(const HostTensor& t) {
  for (float v : t.ToFloats()) {
    if (!std::isfinite(v)) return false;
  }
  return true;
}

bool AnyNonzero(const HostTensor& t) {
  for (float v : t.ToFloats()) {
    if (v != 0.0f) return true;
  }
  return false;
}

double RelativeDifference(const HostTensor& got, const HostTensor& want) {
  const std::vector<float> a = got.ToFloats(), b = want.ToFloats();
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// value_and_grad's invariants: a finite value, dx like x, one finite, nonzero
// gradient per parameter with the parameter's shape.
void ExpectGoodValueAndGrad(const ValueAndGradResult& result, const HostTensor& x,
                            const std::vector<VariableInfo>& vars) {
  EXPECT_TRUE(std::isfinite(result.value));
  EXPECT_EQ(result.dx.shape(), x.shape());
  EXPECT_TRUE(AllFinite(result.dx));
  EXPECT_TRUE(AnyNonzero(result.dx));
  int params = 0;
  for (const VariableInfo& v : vars) {
    if (v.collection != "params") continue;
    ++params;
    auto it = result.grads.find("params/" + v.path);
    ASSERT_NE(it, result.grads.end()) << "no gradient for params/" << v.path;
    EXPECT_EQ(it->second.shape(), v.shape) << v.path;
    EXPECT_TRUE(AllFinite(it->second)) << v.path;
    EXPECT_TRUE(AnyNonzero(it->second)) << v.path;
  }
  EXPECT_EQ(result.grads.size(), static_cast<size_t>(params));
}

// The quickstart's own layers (client/quickstart_layers) at a small size.
const LayerSize kSize{kBatch, kSeq, kHidden, kFfn, kHeads};

class QuickstartTest : public testing::SuiteServerTest<> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    client_ = Connect(ClientOptions());
    ASSERT_NE(client_, nullptr);
    SessionOptions options;
    options.recipes = {QuickstartRecipe()};
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession(options);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
  }

  static std::unique_ptr<Client> Connect(const ClientOptions& options) {
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(server_->address(), options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  // Scalar FP8 state of a layer: "fp8_metas/<path>" -> its values.
  static std::map<std::string, std::vector<float>> Fp8Metas(const Variables& vars) {
    absl::StatusOr<std::map<std::string, HostTensor>> got = GetVariables(vars, {"fp8_metas"});
    EXPECT_TRUE(got.ok()) << got.status();
    std::map<std::string, std::vector<float>> out;
    if (got.ok()) {
      for (const auto& [name, t] : *got) out[name] = t.ToFloats();
    }
    return out;
  }

  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
  const HostTensor x_ = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kBF16, 42);
  const HostTensor dy_ = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kBF16, 43);
};


TEST_F(QuickstartTest, ServerInfoAndNegotiatedRecipe) {
  absl::StatusOr<te::v1::ServerInfo> info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_FALSE(info->version().empty());
  ASSERT_GT(info->devices_size(), 0);
  EXPECT_EQ(session_->device(), "cpu");
  ASSERT_TRUE(session_->recipe().has_value());
  const DelayedScaling* recipe = std::get_if<DelayedScaling>(&*session_->recipe());
  ASSERT_NE(recipe, nullptr) << session_->negotiation();
  EXPECT_EQ(recipe->amax_history_len, 16);
  EXPECT_FALSE(session_->negotiation().empty());
}

// Every section as the quickstart runs it: init (under FP8 for 4-6), a
// deterministic apply, and a training step with dropout on. Sections 1 and 2
// end in Flax's float32 (their attention promotes the bf16 x with float32
// parameters, and the residual add promotes x with it); TE's keep bf16.
TEST_F(QuickstartTest, EverySectionInitsAppliesAndTrains) {
  for (int number = 1; number <= 6; ++number) {
    SCOPED_TRACE(absl::StrCat("section ", number));
    absl::StatusOr<QuickstartSection> section = SectionFor(number, kSize);
    ASSERT_TRUE(section.ok()) << section.status();
    Autocast autocast(section->fp8, QuickstartRecipe());
    absl::StatusOr<Variables> vars = section->layer->Init(*session_, 42, x_);
    ASSERT_TRUE(vars.ok()) << vars.status();
    EXPECT_EQ(vars->HasCollection("fp8_metas"), number >= 4 && number <= 6);
    const DType want = number <= 2 ? DType::kF32 : DType::kBF16;
    EXPECT_EQ(vars->output_dtype, want);

    absl::StatusOr<HostTensor> y = section->layer->Apply(*vars, x_);
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->shape(), x_.shape());
    EXPECT_EQ(y->dtype(), want);
    EXPECT_TRUE(AllFinite(*y));

    const HostTensor dy = HostTensor::RandomNormal(x_.shape(), want, 43);
    ApplyOptions train;
    train.deterministic = false;
    train.dropout_seed = 7;
    absl::StatusOr<ValueAndGradResult> vg = section->layer->ValueAndGrad(*vars, x_, dy, train);
    ASSERT_TRUE(vg.ok()) << vg.status();
    ExpectGoodValueAndGrad(*vg, x_, vars->variables);
  }
}

// Section 1 is the notebook's FlaxTransformerLayer: Flax's names and shapes
// (MultiHeadDotProductAttention's head_dim is qkv_features / heads =
// kv_channels / heads, as the notebook configures it) and no FP8 state.
TEST_F(QuickstartTest, Section1HasTheNotebooksParameterTree) {
  const Graph layer = QuickstartFlaxLayer(kSize);
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  std::map<std::string, Shape> shapes;
  for (const VariableInfo& v : vars->variables) shapes[v.collection + "/" + v.path] = v.shape;
  const int64_t head_dim = kHidden / kHeads / kHeads;
  const std::map<std::string, Shape> want = {
      {"params/LayerNorm_0/scale", {kHidden}},
      {"params/LayerNorm_0/bias", {kHidden}},
      {"params/Dense_0/kernel", {kHidden, 3 * kHidden}},
      {"params/Dense_0/bias", {3 * kHidden}},
      {"params/MultiHeadDotProductAttention_0/query/kernel", {kHidden, kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/query/bias", {kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/key/kernel", {kHidden, kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/key/bias", {kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/value/kernel", {kHidden, kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/value/bias", {kHeads, head_dim}},
      {"params/MultiHeadDotProductAttention_0/out/kernel", {kHeads, head_dim, kHidden}},
      {"params/MultiHeadDotProductAttention_0/out/bias", {kHidden}},
      {"params/LayerNorm_1/scale", {kHidden}},
      {"params/LayerNorm_1/bias", {kHidden}},
      {"params/FlaxMLP_0/Dense_0/kernel", {kHidden, kFfn}},
      {"params/FlaxMLP_0/Dense_0/bias", {kFfn}},
      {"params/FlaxMLP_0/Dense_1/kernel", {kFfn, kHidden}},
      {"params/FlaxMLP_0/Dense_1/bias", {kHidden}},
  };
  EXPECT_EQ(shapes, want) << ShapeTree(vars->variables);
  for (const VariableInfo& v : vars->variables) EXPECT_EQ(v.dtype, DType::kF32) << v.path;
  absl::StatusOr<HostTensor> y = layer.Apply(*vars, x_);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->dtype(), DType::kF32);
}

// Sections 3-5 as one graph give the numbers of the same modules chained
// from the client (ReferenceChain, glue on the host): the same names, so the
// same parameters; the same ops in the same order, and glue that rounds
// identically. Deterministic, since the chain has no dropout node; under
// FP8 the state the step leaves behind must agree too.
TEST_F(QuickstartTest, GraphsGiveTheClientChainsNumbers) {
  struct Case {
    const char* name;
    Graph graph;
    ReferenceChain chain;
    bool fp8;
  };
  const std::vector<Case> cases = {
      {"section 3", UnfusedLayer(kSize), UnfusedChain(kSize), false},
      {"section 4", UnfusedLayer(kSize), UnfusedChain(kSize), true},
      {"section 5", FusedLayer(kSize), FusedChain(kSize), true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Autocast autocast(c.fp8, QuickstartRecipe());
    absl::StatusOr<ReferenceChainVariables> chain_vars = c.chain.Init(*session_, 42, x_);
    ASSERT_TRUE(chain_vars.ok()) << chain_vars.status();
    absl::StatusOr<Variables> graph_vars = c.graph.Init(*session_, 42, x_);
    ASSERT_TRUE(graph_vars.ok()) << graph_vars.status();
    std::set<std::string> chain_names, graph_names;
    for (const VariableInfo& v : chain_vars->variables) chain_names.insert(v.collection + "/" + v.path);
    for (const VariableInfo& v : graph_vars->variables) graph_names.insert(v.collection + "/" + v.path);
    EXPECT_EQ(chain_names, graph_names);

    absl::StatusOr<HostTensor> chain_y = c.chain.Apply(*chain_vars, x_);
    absl::StatusOr<HostTensor> graph_y = c.graph.Apply(*graph_vars, x_);
    ASSERT_TRUE(chain_y.ok()) << chain_y.status();
    ASSERT_TRUE(graph_y.ok()) << graph_y.status();
    EXPECT_EQ(chain_y->bytes(), graph_y->bytes());

    absl::StatusOr<ValueAndGradResult> a = c.chain.ValueAndGrad(*chain_vars, x_, dy_);
    absl::StatusOr<ValueAndGradResult> b = c.graph.ValueAndGrad(*graph_vars, x_, dy_);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->dx.bytes(), b->dx.bytes());
    ASSERT_EQ(a->grads.size(), b->grads.size());
    for (const auto& [name, g] : a->grads) {
      auto it = b->grads.find(name);
      ASSERT_NE(it, b->grads.end()) << name;
      EXPECT_EQ(g.bytes(), it->second.bytes()) << name;
    }
    EXPECT_NEAR(a->value, b->value, 1e-6 * std::fabs(a->value));
    if (c.fp8) {
      // Every quantizer's amax history and scale after the steps, as a
      // multiset (the chain's stages name them without the stage prefix).
      std::vector<std::vector<float>> chain_metas, graph_metas;
      for (const Variables& stage : chain_vars->stages) {
        if (stage.session == nullptr) continue;
        for (auto& [name, values] : Fp8Metas(stage)) chain_metas.push_back(values);
      }
      for (auto& [name, values] : Fp8Metas(*graph_vars)) graph_metas.push_back(values);
      std::sort(chain_metas.begin(), chain_metas.end());
      std::sort(graph_metas.begin(), graph_metas.end());
      EXPECT_FALSE(chain_metas.empty());
      EXPECT_EQ(chain_metas, graph_metas);
    }
  }
}

TEST_F(QuickstartTest, Section4UnfusedLayerUnderFp8HasEachGemmsState) {
  const Graph layer = UnfusedLayer(kSize);
  Autocast autocast(true, QuickstartRecipe());
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const std::set<std::string> metas = Names(vars->variables, "fp8_metas");
  for (const char* dense : {"DenseGeneral_0", "DenseGeneral_1", "TEUnfusedMLP_0/DenseGeneral_0",
                            "TEUnfusedMLP_0/DenseGeneral_1"}) {
    for (const char* q : {"x", "kernel", "grad"}) {
      EXPECT_TRUE(metas.count(std::string(dense) + "/" + q + "_scale")) << dense << " " << q;
      EXPECT_TRUE(metas.count(std::string(dense) + "/" + q + "_amax_history")) << dense << " " << q;
    }
  }
  for (const VariableInfo& v : vars->variables) {
    if (v.collection == "fp8_metas" && v.path.find("amax_history") != std::string::npos) {
      EXPECT_EQ(v.shape, (Shape{16})) << v.path;
    }
  }
}

TEST_F(QuickstartTest, Section5FusedLayerNames) {
  const Graph layer = FusedLayer(kSize);
  Autocast autocast(true, QuickstartRecipe());
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const std::set<std::string> params = Names(vars->variables, "params");
  for (const char* name : {"LayerNormDenseGeneral_0/kernel", "LayerNormDenseGeneral_0/scale", "DenseGeneral_0/kernel",
                           "LayerNormMLP_0/wi_kernel", "LayerNormMLP_0/wo_kernel"}) {
    EXPECT_TRUE(params.count(name)) << name << " in " << ShapeTree(vars->variables);
  }
  const std::set<std::string> metas = Names(vars->variables, "fp8_metas");
  for (const char* name : {"LayerNormDenseGeneral_0/x_scale", "LayerNormMLP_0/kernel_0_scale",
                           "LayerNormMLP_0/grad_1_amax_history"}) {
    EXPECT_TRUE(metas.count(name)) << name << " in " << ShapeTree(vars->variables);
  }
}

TEST_F(QuickstartTest, Section6TransformerLayerScalesMoveWithTheSteps) {
  const TransformerLayer layer = QuickstartTransformerLayer(kSize);
  Autocast autocast(true, QuickstartRecipe());
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const std::set<std::string> metas = Names(vars->variables, "fp8_metas");
  for (const char* name : {"attention/qkv/x_scale", "attention/qkv/kernel_amax_history", "attention/out/grad_scale",
                           "mlp/x_0_scale", "mlp/kernel_1_amax_history"}) {
    EXPECT_TRUE(metas.count(name)) << name << " in " << ShapeTree(vars->variables);
  }
  const std::string x_scale = "fp8_metas/attention/qkv/x_scale";
  const std::string x_history = "fp8_metas/attention/qkv/x_amax_history";
  const std::string grad_scale = "fp8_metas/attention/out/grad_scale";
  const std::string grad_history = "fp8_metas/attention/out/grad_amax_history";
  // TE's update at a step's end: scale = fp8_max / max(amax_history).
  auto expect_scale = [](const std::vector<float>& scale, const std::vector<float>& history, float fp8_max) {
    float amax = 0.0f;
    for (float a : history) amax = std::max(amax, a);
    ASSERT_GT(amax, 0.0f);
    EXPECT_NEAR(scale[0], fp8_max / amax, 1e-6 * fp8_max / amax);
  };

  // Init: scales 1, histories zero.
  std::map<std::string, std::vector<float>> initial = Fp8Metas(*vars);
  ASSERT_EQ(initial.count(x_scale), 1u);
  ASSERT_EQ(initial.count(grad_scale), 1u);
  EXPECT_EQ(initial[x_scale][0], 1.0f);
  EXPECT_EQ(initial[grad_scale][0], 1.0f);

  // Apply is functional (TE's: only a step moves the FP8 state): every
  // fp8_metas value is as init left it.
  absl::StatusOr<HostTensor> y = layer.Apply(*vars, x_);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape(), x_.shape());
  EXPECT_EQ(y->dtype(), DType::kBF16);
  EXPECT_EQ(Fp8Metas(*vars), initial);

  // Asked to, a forward ends its step: the forward quantizers' scales move,
  // the gradient's cannot yet. A twin layer, so the steps below start from init.
  absl::StatusOr<Variables> twin = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(twin.ok()) << twin.status();
  ApplyOptions inference;
  inference.update_fp8_metas = true;
  ASSERT_TRUE(layer.Apply(*twin, x_, inference).ok());
  std::map<std::string, std::vector<float>> applied = Fp8Metas(*twin);
  EXPECT_NE(applied[x_scale][0], 1.0f);
  expect_scale(applied[x_scale], applied[x_history], 448.0f);  // E4M3 forward
  EXPECT_EQ(applied[grad_scale][0], 1.0f);

  absl::StatusOr<ValueAndGradResult> vg = layer.ValueAndGrad(*vars, x_, dy_);
  ASSERT_TRUE(vg.ok()) << vg.status();
  ExpectGoodValueAndGrad(*vg, x_, vars->variables);
  std::map<std::string, std::vector<float>> step1 = Fp8Metas(*vars);
  EXPECT_NE(step1[grad_scale][0], 1.0f);
  expect_scale(step1[grad_scale], step1[grad_history], 57344.0f);  // E5M2 gradients (HYBRID)

  // A step with 8x the gradient: the gradient's amax grows and its scale falls.
  std::vector<float> big = dy_.ToFloats();
  for (float& v : big) v *= 8.0f;
  absl::StatusOr<HostTensor> dy_big = HostTensor::FromFloats(dy_.shape(), big, DType::kBF16);
  ASSERT_TRUE(dy_big.ok());
  ASSERT_TRUE(layer.ValueAndGrad(*vars, x_, *dy_big).ok());
  std::map<std::string, std::vector<float>> step2 = Fp8Metas(*vars);
  EXPECT_LT(step2[grad_scale][0], step1[grad_scale][0]);
  expect_scale(step2[grad_scale], step2[grad_history], 57344.0f);
}

TEST_F(QuickstartTest, Fp8ApplyOnALayerInitialisedWithoutAutocastFails) {
  const TransformerLayer layer = QuickstartTransformerLayer(kSize);
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);  // no autocast: no fp8_metas
  ASSERT_TRUE(vars.ok()) << vars.status();
  EXPECT_FALSE(vars->HasCollection("fp8_metas"));
  Autocast autocast(true, QuickstartRecipe());
  absl::Status status = layer.Apply(*vars, x_).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("fp8_metas"), std::string::npos) << status;
  EXPECT_NE(status.message().find("init under autocast"), std::string::npos) << status;
  // The session is still usable: with FP8 off the same layer applies.
  Autocast off(false);
  EXPECT_TRUE(layer.Apply(*vars, x_).ok());
}

TEST_F(QuickstartTest, SpeedometerClientAndServerSide) {
  const TransformerLayer layer = QuickstartTransformerLayer(kSize);
  Autocast autocast(true, QuickstartRecipe());
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  SpeedometerOptions options;
  options.warmup_iters = 1;
  options.timing_iters = 3;
  options.print = false;
  absl::StatusOr<SpeedometerResult> client_side = Speedometer(*session_, layer, *vars, x_, dy_, options);
  ASSERT_TRUE(client_side.ok()) << client_side.status();
  EXPECT_GT(client_side->mean_ms, 0.0);
  EXPECT_EQ(client_side->steps, 3);
  EXPECT_EQ(client_side->timed_by, "client");
  // The steps dropped their gradients, as JAX's speedometer does: no "grads"
  // are kept in the session.
  absl::StatusOr<te::v1::GetVariablesResponse> kept = session_->GetVariables([&] {
    te::v1::GetVariablesRequest request;
    request.set_layer_id(vars->layer_id);
    return request;
  }());
  ASSERT_TRUE(kept.ok()) << kept.status();
  for (const auto& v : kept->variables()) EXPECT_NE(v.collection(), "grads") << v.path();
  options.server_side = true;
  absl::StatusOr<SpeedometerResult> server_side = Speedometer(*session_, layer, *vars, x_, dy_, options);
  ASSERT_TRUE(server_side.ok()) << server_side.status();
  EXPECT_GT(server_side->mean_ms, 0.0);
  EXPECT_EQ(server_side->steps, 3);
  // Queued on the server: the loop's mean alone, the same memory.
  options.queued = true;
  absl::StatusOr<SpeedometerResult> queued = Speedometer(*session_, layer, *vars, x_, dy_, options);
  ASSERT_TRUE(queued.ok()) << queued.status();
  EXPECT_GT(queued->mean_ms, 0.0);
  EXPECT_EQ(queued->median_ms, 0.0);
  EXPECT_EQ(queued->steps, 3);
  EXPECT_EQ(queued->peak_bytes_in_use, server_side->peak_bytes_in_use);
  options.server_side = false;
  EXPECT_EQ(Speedometer(*session_, layer, *vars, x_, dy_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.queued = false;

  // A graph is one layer: timed by the client or on the server alike.
  const Graph fused = FusedLayer(kSize);
  absl::StatusOr<Variables> fused_vars = fused.Init(*session_, 42, x_);
  ASSERT_TRUE(fused_vars.ok()) << fused_vars.status();
  options.server_side = false;
  absl::StatusOr<SpeedometerResult> graph_client = Speedometer(*session_, fused, *fused_vars, x_, dy_, options);
  ASSERT_TRUE(graph_client.ok()) << graph_client.status();
  EXPECT_GT(graph_client->mean_ms, 0.0);
  options.server_side = true;
  absl::StatusOr<SpeedometerResult> graph_server = Speedometer(*session_, fused, *fused_vars, x_, dy_, options);
  ASSERT_TRUE(graph_server.ok()) << graph_server.status();
  EXPECT_EQ(graph_server->steps, 3);
}

// A residual ReferenceChain around one module: value and dx are the module's
// (from ForwardBackward) plus the residual's, so the Forward/Backward chain
// and the host glue agree with the server's own step.
TEST_F(QuickstartTest, ReferenceChainMatchesTheModulesOwnStep) {
  const HostTensor x = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kF32, 5);
  const HostTensor dy = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kF32, 6);
  auto mlp = std::make_shared<LayerNormMLP>();
  mlp->intermediate_dim = kFfn;
  mlp->activations = {"gelu"};
  mlp->intermediate_dropout_rate = 0.0f;
  absl::StatusOr<Variables> module_vars = mlp->Init(*session_, 1, x);
  ASSERT_TRUE(module_vars.ok()) << module_vars.status();
  absl::StatusOr<ValueAndGradResult> direct = mlp->ValueAndGrad(*module_vars, x, dy);
  ASSERT_TRUE(direct.ok()) << direct.status();

  ReferenceChain residual;
  residual.Fork().Add("mlp", mlp).Join();
  ReferenceChainVariables vars;
  vars.stages = {Variables(), *module_vars, Variables()};
  absl::StatusOr<ValueAndGradResult> chained = residual.ValueAndGrad(vars, x, dy);
  ASSERT_TRUE(chained.ok()) << chained.status();

  absl::StatusOr<double> residual_value = Vdot(x, dy);
  ASSERT_TRUE(residual_value.ok());
  EXPECT_NEAR(chained->value, direct->value + *residual_value,
              1e-5 * (std::fabs(direct->value) + std::fabs(*residual_value)));
  absl::StatusOr<HostTensor> want_dx = Add(direct->dx, dy);
  ASSERT_TRUE(want_dx.ok());
  EXPECT_LT(RelativeDifference(chained->dx, *want_dx), kF32AddTolerance);
  for (const auto& [name, g] : direct->grads) {
    const std::string scoped = "params/mlp/" + name.substr(std::string("params/").size());
    ASSERT_EQ(chained->grads.count(scoped), 1u) << scoped;
    EXPECT_LT(RelativeDifference(chained->grads.at(scoped), g), kF32AddTolerance) << scoped;
  }

  // A training step that leaves the gradients on the server: same dx, none sent back.
  absl::StatusOr<ValueAndGradResult> kept = residual.ValueAndGrad(vars, x, dy, {}, /*return_grads=*/false);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->grads.empty());
  EXPECT_EQ(kept->dx.bytes(), chained->dx.bytes());
  absl::StatusOr<std::map<std::string, HostTensor>> on_server = GetVariables(*module_vars, {"grads"});
  ASSERT_TRUE(on_server.ok()) << on_server.status();
  EXPECT_FALSE(on_server->empty());
}

// ReferenceChain::Apply is functional under DelayedScaling as a module's Apply
// is, and ApplyOptions::update_fp8_metas reaches each stage's forward.
TEST_F(QuickstartTest, ReferenceChainApplyMovesFp8MetasOnlyWhenAsked) {
  ReferenceChain chain;
  chain.Add("dense", std::make_shared<DenseGeneral>(std::vector<int64_t>{kHidden}));
  Autocast autocast(true, QuickstartRecipe());
  absl::StatusOr<ReferenceChainVariables> vars = chain.Init(*session_, 3, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Variables& dense = vars->stages[0];
  const std::map<std::string, std::vector<float>> initial = Fp8Metas(dense);
  ASSERT_EQ(initial.count("fp8_metas/x_scale"), 1u);
  ASSERT_TRUE(chain.Apply(*vars, x_).ok());
  EXPECT_EQ(Fp8Metas(dense), initial);

  ApplyOptions inference;
  inference.update_fp8_metas = true;
  ASSERT_TRUE(chain.Apply(*vars, x_, inference).ok());
  std::map<std::string, std::vector<float>> moved = Fp8Metas(dense);
  EXPECT_NE(moved["fp8_metas/x_scale"], initial.at("fp8_metas/x_scale"));
  EXPECT_NE(moved["fp8_metas/x_amax_history"], initial.at("fp8_metas/x_amax_history"));
  EXPECT_EQ(moved["fp8_metas/grad_scale"], initial.at("fp8_metas/grad_scale"));  // no backward ran
}

// Flax's make_rng("dropout") without the key: a call whose dropout runs
// (deterministic false, a rate above 0) and has no dropout seed is refused
// before anything is sent, naming what draws dropout; where no dropout runs
// no seed is needed.
TEST_F(QuickstartTest, DropoutWithoutASeedIsRefusedAsFlaxRefusesIt) {
  const TransformerLayer layer = QuickstartTransformerLayer(kSize);  // TE's dropout rates, 0.1
  ASSERT_FALSE(layer.DropoutUsers().empty());
  absl::StatusOr<Variables> vars = layer.Init(*session_, 42, x_);
  ASSERT_TRUE(vars.ok()) << vars.status();
  ApplyOptions train;
  train.deterministic = false;
  absl::Status status = layer.Apply(*vars, x_, train).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("TransformerLayer needs PRNG for \"dropout\""), absl::string_view::npos)
      << status;
  status = layer.ValueAndGrad(*vars, x_, dy_, train).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  train.dropout_seed = 0;  // any key, 0 included
  EXPECT_TRUE(layer.ValueAndGrad(*vars, x_, dy_, train).ok());
  EXPECT_TRUE(layer.Apply(*vars, x_).ok());  // deterministic: no key needed

  // A graph names its nodes; a chain's stage is refused as the module is.
  const Graph unfused = UnfusedLayer(kSize);
  absl::StatusOr<Variables> graph_vars = unfused.Init(*session_, 42, x_);
  ASSERT_TRUE(graph_vars.ok()) << graph_vars.status();
  ApplyOptions no_seed;
  no_seed.deterministic = false;
  status = unfused.Apply(*graph_vars, x_, no_seed).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(unfused.DropoutUsers().front() + ", "), absl::string_view::npos) << status;
  ReferenceChain chain;
  chain.Add("layer", std::make_shared<TransformerLayer>(layer));
  absl::StatusOr<ReferenceChainVariables> chain_vars = chain.Init(*session_, 42, x_);
  ASSERT_TRUE(chain_vars.ok()) << chain_vars.status();
  EXPECT_EQ(chain.Apply(*chain_vars, x_, no_seed).status().code(), absl::StatusCode::kInvalidArgument);

  // No dropout rate above 0: deterministic false runs without a key.
  TransformerLayer no_dropout = layer;
  no_dropout.hidden_dropout = no_dropout.attention_dropout = no_dropout.intermediate_dropout = 0.0f;
  absl::StatusOr<Variables> plain = no_dropout.Init(*session_, 42, x_);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(no_dropout.Apply(*plain, x_, no_seed).ok());
}

// With a tiny inline limit every tensor travels through PutTensor / GetTensor
// and resident outputs; the results are the same bytes as inline transport.
TEST_F(QuickstartTest, StreamedTransportGivesTheSameResults) {
  ClientOptions streamed_options;
  streamed_options.inline_tensor_bytes = 256;
  streamed_options.chunk_bytes = 1000;  // several chunks per tensor
  std::unique_ptr<Client> streamed_client = Connect(streamed_options);
  ASSERT_NE(streamed_client, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> streamed = streamed_client->CreateSession();
  ASSERT_TRUE(streamed.ok()) << streamed.status();

  const ReferenceChain layer = FusedChain(kSize);  // many calls, each streamed
  absl::StatusOr<ReferenceChainVariables> inline_vars = layer.Init(*session_, 42, x_);
  absl::StatusOr<ReferenceChainVariables> streamed_vars = layer.Init(**streamed, 42, x_);
  ASSERT_TRUE(inline_vars.ok()) << inline_vars.status();
  ASSERT_TRUE(streamed_vars.ok()) << streamed_vars.status();
  absl::StatusOr<ValueAndGradResult> a = layer.ValueAndGrad(*inline_vars, x_, dy_);
  absl::StatusOr<ValueAndGradResult> b = layer.ValueAndGrad(*streamed_vars, x_, dy_);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->value, b->value);
  EXPECT_EQ(a->dx.bytes(), b->dx.bytes());
  ASSERT_EQ(a->grads.size(), b->grads.size());
  for (const auto& [name, g] : a->grads) EXPECT_EQ(g.bytes(), b->grads.at(name).bytes()) << name;

  // A resident tensor round trip through the streams.
  const HostTensor big = HostTensor::RandomNormal({300, 70}, DType::kF32, 8);
  absl::StatusOr<ResidentTensor> put = (*streamed)->Put(big);
  ASSERT_TRUE(put.ok()) << put.status();
  absl::StatusOr<HostTensor> got = (*streamed)->Get(put->id);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes(), big.bytes());
  EXPECT_TRUE((*streamed)->Delete(put->id).ok());
  EXPECT_EQ((*streamed)->Get(put->id).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace te::client
