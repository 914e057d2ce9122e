#include "server/layers/sequential.h"

#include "gtest/gtest.h"
#include "kernels/rng.h"
#include "server/layers/fp8_state.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::RandomizeParams;
using testing::Values;

constexpr int64_t kBatch = 2, kSeq = 6, kHidden = 8, kHeads = 2, kFfn = 12;

te::v1::SequentialSpec::Stage Module(const std::string& name, const te::v1::LayerSpec& spec) {
  te::v1::SequentialSpec::Stage s;
  s.set_name(name);
  *s.mutable_module() = spec;
  return s;
}
te::v1::SequentialSpec::Stage Residual(te::v1::SequentialSpec::Residual r) {
  te::v1::SequentialSpec::Stage s;
  s.set_residual(r);
  return s;
}
te::v1::SequentialSpec::Stage Reshape(std::vector<int64_t> from, std::vector<int64_t> to) {
  te::v1::SequentialSpec::Stage s;
  for (int64_t d : from) s.mutable_reshape()->add_from(d);
  for (int64_t d : to) s.mutable_reshape()->add_to(d);
  return s;
}
te::v1::LayerSpec Dense(int64_t features) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(features);
  spec.mutable_dense_general()->set_use_bias(true);
  return spec;
}
te::v1::LayerSpec Norm() {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm();
  return spec;
}

// The quickstart's TEUnfusedTransformerLayer at a small size: LayerNorm,
// DenseGeneral(3H), reshape, split, attention, reshape, DenseGeneral(H) in a
// residual, then LayerNorm, DenseGeneral(FFN), gelu, DenseGeneral(H) in another.
te::v1::SequentialSpec UnfusedLayer() {
  const int64_t d = kHidden / kHeads;
  te::v1::SequentialSpec spec;
  *spec.add_stages() = Residual(te::v1::SequentialSpec::FORK);
  *spec.add_stages() = Module("LayerNorm_0", Norm());
  *spec.add_stages() = Module("DenseGeneral_0", Dense(3 * kHidden));
  *spec.add_stages() = Reshape({3 * kHidden}, {kHeads, 3 * d});
  spec.add_stages()->set_split_last_axis(3);
  te::v1::LayerSpec attention;
  attention.mutable_dot_product_attention()->set_head_dim(d);
  attention.mutable_dot_product_attention()->set_num_attention_heads(kHeads);
  attention.mutable_dot_product_attention()->set_attn_mask_type(te::v1::CAUSAL);
  *spec.add_stages() = Module("DotProductAttention_0", attention);
  *spec.add_stages() = Reshape({kHeads, d}, {kHidden});
  *spec.add_stages() = Module("DenseGeneral_1", Dense(kHidden));
  *spec.add_stages() = Residual(te::v1::SequentialSpec::JOIN);
  *spec.add_stages() = Residual(te::v1::SequentialSpec::FORK);
  *spec.add_stages() = Module("LayerNorm_1", Norm());
  *spec.add_stages() = Module("TEUnfusedMLP_0/DenseGeneral_0", Dense(kFfn));
  te::v1::LayerSpec gelu;
  gelu.mutable_activation()->add_activations("gelu");
  *spec.add_stages() = Module("TEUnfusedMLP_0/activation", gelu);
  *spec.add_stages() = Module("TEUnfusedMLP_0/DenseGeneral_1", Dense(kHidden));
  *spec.add_stages() = Residual(te::v1::SequentialSpec::JOIN);
  return spec;
}

TEST(SequentialTest, VariablesAreTheModulesUnderStageNames) {
  auto layer = MakeSequential(UnfusedLayer());
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto specs = (*layer)->VariableSpecs({kBatch, kSeq, kHidden}, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, Shape> shapes;
  for (const VariableSpec& v : *specs) shapes[v.name] = v.shape;
  EXPECT_EQ(shapes["params/LayerNorm_0/scale"], (Shape{kHidden}));
  EXPECT_EQ(shapes["params/DenseGeneral_0/kernel"], (Shape{kHidden, 3 * kHidden}));
  EXPECT_EQ(shapes["params/TEUnfusedMLP_0/DenseGeneral_0/kernel"], (Shape{kHidden, kFfn}));
  EXPECT_EQ(shapes["params/TEUnfusedMLP_0/DenseGeneral_1/bias"], (Shape{kHidden}));
  EXPECT_EQ(shapes.size(), 12u);  // 2 norms x 2, 4 dense x 2
  auto out = (*layer)->OutputShape({kBatch, kSeq, kHidden});
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, (Shape{kBatch, kSeq, kHidden}));
  // Under DelayedScaling each DenseGeneral has its fp8_metas, scoped too.
  const Fp8Recipe fp8 = testing::DelayedRecipe();
  auto with_fp8 = (*layer)->VariableSpecs({kBatch, kSeq, kHidden}, &fp8);
  ASSERT_TRUE(with_fp8.ok());
  bool found = false;
  for (const VariableSpec& v : *with_fp8) found |= v.name == "fp8_metas/DenseGeneral_1/x_scale";
  EXPECT_TRUE(found);
}

// Init gives each module the variables its own Init would give with
// NodeSeed(seed, stage name), and the forward equals the modules run by hand in order.
TEST(SequentialTest, ForwardEqualsTheModulesChainedByHand) {
  auto ops = NewCpuOps();
  te::v1::SequentialSpec spec;
  *spec.add_stages() = Residual(te::v1::SequentialSpec::FORK);
  *spec.add_stages() = Module("LayerNorm_0", Norm());
  *spec.add_stages() = Module("DenseGeneral_0", Dense(kHidden));
  *spec.add_stages() = Residual(te::v1::SequentialSpec::JOIN);
  auto layer = MakeSequential(spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Shape shape = {kBatch, kSeq, kHidden};
  auto vars = InitLayer(*ops, **layer, shape, nullptr, /*seed=*/7);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 3);

  auto norm = CreateLayer(Norm());
  auto dense = CreateLayer(Dense(kHidden));
  ASSERT_TRUE(norm.ok() && dense.ok());
  auto dense_vars = InitLayer(*ops, **dense, shape, nullptr, NodeSeed(7, "DenseGeneral_0", 14));
  ASSERT_TRUE(dense_vars.ok());
  // Same initial kernel as the stage's (before RandomizeParams replaced both).
  auto fresh = InitLayer(*ops, **layer, shape, nullptr, 7);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(Values(fresh->at("params/DenseGeneral_0/kernel")),
            Values(dense_vars->at("params/kernel")));

  Variables norm_vars = {{"params/scale", vars->at("params/LayerNorm_0/scale")},
                         {"params/ln_bias", vars->at("params/LayerNorm_0/ln_bias")}};
  Variables dvars = {{"params/kernel", vars->at("params/DenseGeneral_0/kernel")},
                     {"params/bias", vars->at("params/DenseGeneral_0/bias")}};
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kF32, 11);
  LayerOutputs ln, dn, whole;
  std::unique_ptr<SavedForward> unused;
  ASSERT_TRUE((*norm)->Forward(*ops, &norm_vars, in, {}, &ln, &unused).ok());
  LayerInputs dense_in;
  dense_in.x = ln.y;
  ASSERT_TRUE((*dense)->Forward(*ops, &dvars, dense_in, {}, &dn, &unused).ok());
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, {}, &whole, &unused).ok());
  const std::vector<float> x = Values(in.x), f = Values(dn.y), y = Values(whole.y);
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], f[i] + x[i]) << "element " << i;
}

TEST(SequentialTest, GradientsMatchFiniteDifferences) {
  auto ops = NewCpuOps();
  auto layer = MakeSequential(UnfusedLayer());
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Shape shape = {kBatch, kSeq, kHidden};
  auto vars = InitLayer(*ops, **layer, shape, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 5);
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kF32, 13);
  EXPECT_TRUE(CheckGradients(*ops, **layer, &*vars, in, {}));
}

TEST(SequentialTest, Fp8StepRecordsEveryModulesAmax) {
  auto ops = NewCpuOps();
  auto layer = MakeSequential(UnfusedLayer());
  ASSERT_TRUE(layer.ok());
  const Fp8Recipe fp8 = testing::DelayedRecipe();
  const Shape shape = {kBatch, kSeq, kHidden};
  auto vars = InitLayer(*ops, **layer, shape, &fp8);
  ASSERT_TRUE(vars.ok()) << vars.status();
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kF32, 17);
  ForwardOptions opts;
  opts.fp8 = &fp8;
  opts.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
  LayerGrads grads;
  ASSERT_TRUE((*layer)->Backward(*ops, &*vars, *saved, RandomTensor(*ops, shape, DType::kF32, 19),
                                 &grads)
                  .ok());
  for (const char* name : {"fp8_metas/DenseGeneral_0/x_amax_history",
                           "fp8_metas/TEUnfusedMLP_0/DenseGeneral_1/grad_amax_history"}) {
    ASSERT_TRUE(vars->count(name)) << name;
    EXPECT_GT(Values(vars->at(name))[0], 0.0f) << name << ": no amax recorded";
  }
  EXPECT_EQ(grads.params.size(), 12u);
}

TEST(SequentialTest, BadSpecsNameTheField) {
  te::v1::SequentialSpec empty;
  EXPECT_EQ(MakeSequential(empty).status().code(), absl::StatusCode::kInvalidArgument);

  te::v1::SequentialSpec unbalanced;
  *unbalanced.add_stages() = Residual(te::v1::SequentialSpec::JOIN);
  auto status = MakeSequential(unbalanced).status();
  EXPECT_NE(status.message().find("stages[0].residual"), std::string::npos) << status;

  te::v1::SequentialSpec duplicate;
  *duplicate.add_stages() = Module("a", Norm());
  *duplicate.add_stages() = Module("a", Norm());
  status = MakeSequential(duplicate).status();
  EXPECT_NE(status.message().find("stages[1].name"), std::string::npos) << status;

  te::v1::SequentialSpec bad_reshape;
  *bad_reshape.add_stages() = Reshape({6}, {4});
  status = MakeSequential(bad_reshape).status();
  EXPECT_NE(status.message().find("stages[0].reshape"), std::string::npos) << status;

  te::v1::SequentialSpec bad_module;
  *bad_module.add_stages() = Module("m", te::v1::LayerSpec());
  status = MakeSequential(bad_module).status();
  EXPECT_NE(status.message().find("stages[0].module"), std::string::npos) << status;

  // A split's parts feed the next module (x, k, v at most).
  te::v1::SequentialSpec many_parts;
  many_parts.add_stages()->set_split_last_axis(1 << 30);
  *many_parts.add_stages() = Module("a", Norm());
  status = MakeSequential(many_parts).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("stages[0].split_last_axis"), std::string::npos) << status;

  // A reshape of one tensor after a split into three is a structure error,
  // found at creation.
  te::v1::SequentialSpec split;
  split.add_stages()->set_split_last_axis(3);
  *split.add_stages() = Reshape({2}, {2});
  status = MakeSequential(split).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("spec.sequential.stages[1]: takes one tensor"), std::string::npos)
      << status;

  // A shape the chain cannot take names the stage: 8 features do not split
  // in 3, and a tensor [2, 8] does not end in [6].
  te::v1::SequentialSpec thirds;
  thirds.add_stages()->set_split_last_axis(3);
  te::v1::LayerSpec qkv_attention;
  qkv_attention.mutable_dot_product_attention()->set_head_dim(4);
  qkv_attention.mutable_dot_product_attention()->set_num_attention_heads(2);
  *thirds.add_stages() = Module("a", qkv_attention);
  te::v1::SequentialSpec sixes;
  *sixes.add_stages() = Module("a", Norm());
  *sixes.add_stages() = Reshape({6}, {2, 3});
  for (const auto& [chain, stage] : {std::pair{thirds, "spec.sequential.stages[0]"},
                                     std::pair{sixes, "spec.sequential.stages[1]"}}) {
    auto layer = MakeSequential(chain);
    ASSERT_TRUE(layer.ok()) << layer.status();
    status = (*layer)->OutputShape({2, 8}).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find(stage), std::string::npos) << status;
  }

  // What the graph finds of the structure names the stage too: attention on
  // q, k, v after a split into two parts has one input too few.
  te::v1::SequentialSpec two_parts;
  two_parts.add_stages()->set_split_last_axis(2);
  te::v1::LayerSpec attention;
  attention.mutable_dot_product_attention()->set_head_dim(4);
  attention.mutable_dot_product_attention()->set_num_attention_heads(2);
  *two_parts.add_stages() = Module("DotProductAttention_0", attention);
  status = MakeSequential(two_parts).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("spec.sequential.stages[1]"), std::string::npos) << status;
  EXPECT_EQ(status.message().find("spec.graph"), std::string::npos) << status;
}

// The chain is the graph it translates to: module nodes under the stage
// names, each reshape to the full shape for this x, the split, and one add per
// JOIN of the current tensor and the forked one.
TEST(SequentialTest, TranslatesToTheEquivalentGraph) {
  auto graph = SequentialAsGraph(UnfusedLayer(), {kBatch, kSeq, kHidden});
  ASSERT_TRUE(graph.ok()) << graph.status();
  std::vector<std::string> names;
  for (const te::v1::GraphSpec::Node& n : graph->nodes()) names.push_back(n.name());
  EXPECT_EQ(names, (std::vector<std::string>{
                       "LayerNorm_0", "DenseGeneral_0", "stages[3]", "stages[4]",
                       "DotProductAttention_0", "stages[6]", "DenseGeneral_1", "stages[8]",
                       "LayerNorm_1", "TEUnfusedMLP_0/DenseGeneral_0", "TEUnfusedMLP_0/activation",
                       "TEUnfusedMLP_0/DenseGeneral_1", "stages[14]"}));
  const int64_t d = kHidden / kHeads;
  const auto shape_of = [&](int k) {
    const auto& s = graph->nodes(k).reshape().shape();
    return Shape(s.begin(), s.end());
  };
  EXPECT_EQ(shape_of(2), (Shape{kBatch, kSeq, kHeads, 3 * d}));
  EXPECT_EQ(shape_of(5), (Shape{kBatch, kSeq, kHidden}));
  EXPECT_EQ(graph->nodes(3).split().axis(), -1);
  EXPECT_EQ(graph->nodes(3).split().parts(), 3);
  EXPECT_EQ(graph->nodes(4).inputs_size(), 3);
  ASSERT_EQ(graph->nodes(7).inputs_size(), 2);
  EXPECT_TRUE(graph->nodes(7).has_add());
  EXPECT_EQ(graph->nodes(7).inputs(0), "DenseGeneral_1:y");
  EXPECT_EQ(graph->nodes(7).inputs(1), "x");
  EXPECT_EQ(graph->nodes(12).inputs(1), "stages[8]:y");
  EXPECT_EQ(graph->outputs(0), "stages[14]:y");
}

// One chain takes any leading dims, as a module does: the graph is built per
// x shape, and each gives what the graph built for it gives.
TEST(SequentialTest, TakesAnyBatchSize) {
  auto ops = NewCpuOps();
  auto layer = MakeSequential(UnfusedLayer());
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto vars = InitLayer(*ops, **layer, {kBatch, kSeq, kHidden}, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  for (int64_t batch : {int64_t{1}, int64_t{3}}) {
    const Shape shape = {batch, kSeq, kHidden};
    auto graph_spec = SequentialAsGraph(UnfusedLayer(), shape);
    ASSERT_TRUE(graph_spec.ok()) << graph_spec.status();
    te::v1::LayerSpec spec;
    *spec.mutable_graph() = *graph_spec;
    auto graph = CreateLayer(spec);
    ASSERT_TRUE(graph.ok()) << graph.status();
    LayerInputs in;
    in.x = RandomTensor(*ops, shape, DType::kF32, 23);
    LayerOutputs a, b;
    std::unique_ptr<SavedForward> unused;
    ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, {}, &a, &unused).ok());
    ASSERT_TRUE((*graph)->Forward(*ops, &*vars, in, {}, &b, &unused).ok());
    EXPECT_EQ(a.y.shape(), shape);
    EXPECT_EQ(Values(a.y), Values(b.y)) << "batch " << batch;
  }
}

}  // namespace
}  // namespace te::layers
