// Graphs with declared extra inputs (InitLayer / AddGraph's extra_inputs:
// int32 labels beside a float x), and graphs that read a module's parameter
// through a param node as well (an L2 penalty written in a loss): that
// parameter's gradient is the sum of both uses. On the CPU backend, against
// a float64 reference written here and finite differences.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/layers/graph.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;
using Spec = te::v1::GraphSpec;

// Float32 on the CPU against float64: a loss of ~100 float32 terms and
// gradients of a few terms each; relative L2 error well under 1e-5.
constexpr double kF32Tolerance = 1e-5;

constexpr int64_t kBatch = 6, kFeatures = 5, kClasses = 4;
constexpr double kPenalty = 0.05;  // loss = mean cross-entropy + kPenalty * sum(kernel^2)

#define EXPECT_INVALID(status, text)                                    \
  do {                                                                  \
    const absl::Status s_ = (status);                                   \
    EXPECT_EQ(s_.code(), absl::StatusCode::kInvalidArgument) << s_;     \
    EXPECT_TRUE(absl::StrContains(s_.message(), text)) << s_.message(); \
  } while (0)

Spec::Node* Add(Spec* g, const std::string& name, std::vector<std::string> in) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  node->add_outputs(name);
  return node;
}

// A Flax Dense without bias, "Dense_0": x [N, F] -> logits [N, V].
void AddDense(Spec* g, const std::string& input) {
  Spec::Node* dense = Add(g, "Dense_0", {input});
  dense->mutable_module()->mutable_flax_dense()->set_features(kClasses);
  dense->mutable_module()->mutable_flax_dense()->set_use_bias(false);
}

// kPenalty * sum(w^2) of the param node "Dense_0/kernel": the layer's own
// kernel, read directly (as a loss's L2 term over params does); "penalty".
void AddPenalty(Spec* g) {
  Spec::Node* w = Add(g, "Dense_0/kernel", {});
  w->mutable_param()->add_shape(kFeatures);
  w->mutable_param()->add_shape(kClasses);
  w->mutable_param()->set_dtype(te::v1::FLOAT32);
  Add(g, "square_0", {"Dense_0/kernel"})->mutable_unary()->set_op(Spec::Unary::SQUARE);
  Add(g, "sum_0", {"square_0"})->mutable_reduce()->set_op(Spec::Reduce::SUM);
  Add(g, "penalty", {"sum_0"})->mutable_scale()->set_factor(kPenalty);
}

// optax.softmax_cross_entropy_with_integer_labels(Dense_0(x), labels).mean()
// + kPenalty * sum(Dense_0.kernel^2), labels extra_inputs[0].
Spec LossGraph() {
  Spec g;
  AddDense(&g, "x");
  Add(&g, "ce", {"Dense_0", "extra_inputs[0]"})->mutable_softmax_cross_entropy();
  AddPenalty(&g);
  Add(&g, "loss", {"ce", "penalty"})->mutable_add();
  g.add_outputs("loss");
  return g;
}

DeclaredExtras Declared(DType dtype, Shape shape, Shape x = {kBatch, kFeatures}) {
  return DeclaredExtras{std::move(x), {dtype}, {std::move(shape)}};
}

class GraphExtrasTest : public ::testing::Test {
 protected:
  Tensor Labels(const std::vector<int32_t>& values) {
    Tensor t = *ops_->Allocate(DType::kI32, {static_cast<int64_t>(values.size())});
    EXPECT_TRUE(ops_->Upload(values.data(), &t).ok());
    return t;
  }

  // Forward (kept) and backward with dy = 1 of a scalar-output graph.
  absl::Status Step(const Layer& layer, Variables* vars, const LayerInputs& in, LayerOutputs* out,
                    LayerGrads* grads) {
    ForwardOptions opts;
    opts.keep_for_backward = true;
    std::unique_ptr<SavedForward> saved;
    absl::Status s = layer.Forward(*ops_, vars, in, opts, out, &saved);
    if (!s.ok()) return s;
    Tensor dy = *ops_->Allocate(DType::kF32, out->y.shape());
    testing::SetValues(std::vector<float>(static_cast<size_t>(dy.numel()), 1.0f), &dy);
    return layer.Backward(*ops_, vars, *saved, dy, grads);
  }

  std::unique_ptr<Ops> ops_ = NewCpuOps();
};

// The leading dims a declared extra input shares with x follow x's.
TEST(DeclaredExtraShapeTest, LeadingDimsThatAreXsFollowX) {
  EXPECT_EQ(DeclaredExtraShape({4}, {4, 16}, {2, 16}), (Shape{2}));
  EXPECT_EQ(DeclaredExtraShape({4, 7}, {4, 7, 16}, {2, 5, 16}), (Shape{2, 5}));
  EXPECT_EQ(DeclaredExtraShape({4, 3}, {4, 7, 16}, {2, 5, 16}), (Shape{2, 3}));
  EXPECT_EQ(DeclaredExtraShape({3, 4}, {4, 16}, {2, 16}), (Shape{3, 4}));  // none shared
  EXPECT_EQ(DeclaredExtraShape({}, {4, 16}, {2, 16}), (Shape{}));
  const DeclaredExtras a = Declared(DType::kI32, {kBatch});
  EXPECT_TRUE(SameDeclaredExtras(a, Declared(DType::kI32, {2}, {2, kFeatures})));
  EXPECT_FALSE(SameDeclaredExtras(a, Declared(DType::kI32, {3}, {2, kFeatures})));
  EXPECT_FALSE(SameDeclaredExtras(a, Declared(DType::kF32, {kBatch})));
  EXPECT_FALSE(SameDeclaredExtras(a, std::nullopt));
  EXPECT_TRUE(SameDeclaredExtras(std::nullopt, std::nullopt));
}

// int32 labels beside a float32 x: the loss and the kernel's gradient, the
// sum of the cross-entropy's (through the module) and the penalty's (through
// the param node), against float64; at the declared batch and another.
TEST_F(GraphExtrasTest, DeclaredInt32LabelsTrainALossThatReadsAParam) {
  auto layer = MakeGraph(LossGraph(), Declared(DType::kI32, {kBatch}));
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ((*layer)->OutputDType(DType::kF32), DType::kF32);
  for (const int64_t batch : {kBatch, int64_t{3}}) {
    SCOPED_TRACE(batch);
    auto vars = testing::InitLayer(*ops_, **layer, {batch, kFeatures}, nullptr);
    ASSERT_TRUE(vars.ok()) << vars.status();
    testing::RandomizeParams(*ops_, &*vars, 5);
    LayerInputs in;
    in.x = RandomTensor(*ops_, {batch, kFeatures}, DType::kF32, 1);
    std::vector<int32_t> labels;
    for (int64_t n = 0; n < batch; ++n) labels.push_back(static_cast<int32_t>((n * 3 + 1) % kClasses));
    in.extra.push_back(Labels(labels));
    LayerOutputs out;
    LayerGrads grads;
    ASSERT_TRUE(Step(**layer, &*vars, in, &out, &grads).ok());

    // float64: logits = x W, loss = mean(lse - logits[label]) + c sum W^2,
    // dW = x^T (softmax - onehot) / N + 2 c W.
    const std::vector<float> x = Values(in.x), w = Values(vars->at("params/Dense_0/kernel"));
    double loss = 0;
    std::vector<double> dw(w.size(), 0.0);
    for (int64_t n = 0; n < batch; ++n) {
      std::vector<double> logits(kClasses, 0.0);
      for (int64_t v = 0; v < kClasses; ++v) {
        for (int64_t f = 0; f < kFeatures; ++f) logits[v] += double(x[n * kFeatures + f]) * w[f * kClasses + v];
      }
      double top = logits[0], sum = 0;
      for (double l : logits) top = std::max(top, l);
      for (double l : logits) sum += std::exp(l - top);
      loss += (top + std::log(sum) - logits[labels[n]]) / batch;
      for (int64_t v = 0; v < kClasses; ++v) {
        const double d = (std::exp(logits[v] - top) / sum - (v == labels[n] ? 1.0 : 0.0)) / batch;
        for (int64_t f = 0; f < kFeatures; ++f) dw[f * kClasses + v] += x[n * kFeatures + f] * d;
      }
    }
    for (size_t i = 0; i < w.size(); ++i) {
      loss += kPenalty * w[i] * w[i];
      dw[i] += 2 * kPenalty * w[i];
    }
    EXPECT_NEAR(Values(out.y)[0], loss, kF32Tolerance * std::abs(loss));
    ASSERT_EQ(grads.params.count("params/Dense_0/kernel"), 1u);
    EXPECT_LT(RelativeError(Values(grads.params.at("params/Dense_0/kernel")),
                            std::vector<float>(dw.begin(), dw.end())),
              kF32Tolerance);
    // The labels get no gradient: int32 zeros of their shape.
    ASSERT_EQ(grads.dextra.size(), 1u);
    EXPECT_EQ(grads.dextra[0].dtype(), DType::kI32);
    EXPECT_EQ(grads.dextra[0].shape(), (Shape{batch}));
  }
}

// A call's extra input must have the declared dtype and the shape the
// declaration gives for its x; the graph's other checks are as before.
TEST_F(GraphExtrasTest, ForwardRefusesExtraInputsUnlikeTheDeclaration) {
  auto layer = *MakeGraph(LossGraph(), Declared(DType::kI32, {kBatch}));
  auto vars = *testing::InitLayer(*ops_, *layer, {kBatch, kFeatures}, nullptr);
  LayerInputs in;
  in.x = RandomTensor(*ops_, {kBatch, kFeatures}, DType::kF32, 1);
  in.extra.push_back(RandomTensor(*ops_, {kBatch}, DType::kF32, 2));
  LayerOutputs out;
  EXPECT_INVALID(layer->Forward(*ops_, &vars, in, {}, &out, nullptr),
                 "extra_inputs[0].dtype: float32, but the graph's extra_inputs[0] was declared int32");
  in.extra[0] = Labels({0, 1, 2, 3, 0, 1, 2});
  EXPECT_INVALID(layer->Forward(*ops_, &vars, in, {}, &out, nullptr),
                 "extra_inputs[0].shape [7]: want [6] beside x [6, 5]");
  in.extra.clear();
  EXPECT_INVALID(layer->Forward(*ops_, &vars, in, {}, &out, nullptr), "extra_inputs: the graph takes 1");

  // Undeclared, the graph takes extra inputs in x's dtype, as it always did.
  auto undeclared = *MakeGraph(LossGraph());
  in.extra.push_back(Labels({0, 1, 2, 3, 0, 1}));
  EXPECT_INVALID(undeclared->Forward(*ops_, &vars, in, {}, &out, nullptr),
                 "extra_inputs[0] must be float32, bfloat16 or float16, got int32");
}

// With the extra inputs declared, their shape and dtype errors come at init
// (VariableSpecs, what InitLayer and AddGraph run), naming the node.
TEST_F(GraphExtrasTest, InitCatchesErrorsOverDeclaredExtraInputs) {
  const Shape x = {kBatch, kFeatures};
  auto wrong_count = *MakeGraph(LossGraph(), Declared(DType::kI32, {kBatch + 1}));
  EXPECT_INVALID(wrong_count->VariableSpecs(x, nullptr).status(),
                 "spec.graph.nodes[1] (ce).inputs[1]: labels [7] do not fit logits [6, 4]");
  // Undeclared, the same graph passes init (the labels' shape is unknown there).
  EXPECT_TRUE((*MakeGraph(LossGraph()))->VariableSpecs(x, nullptr).ok());

  auto float_labels = *MakeGraph(LossGraph(), Declared(DType::kF32, {kBatch}));
  EXPECT_INVALID(float_labels->VariableSpecs(x, nullptr).status(),
                 "spec.graph.nodes[1] (ce).inputs[1]: labels are float32; want int32");

  // Arithmetic on int32 labels: the graph's float ops and casts refuse them.
  Spec g;
  Add(&g, "cast_0", {"extra_inputs[0]"})->mutable_cast()->set_dtype(te::v1::FLOAT32);
  Add(&g, "y", {"x", "cast_0"})->mutable_binary()->set_op(Spec::Binary::MULTIPLY);
  g.add_outputs("y");
  EXPECT_INVALID((*MakeGraph(g, Declared(DType::kI32, {kBatch, 1})))->VariableSpecs(x, nullptr).status(),
                 "spec.graph.nodes[0] (cast_0).inputs[0]: cast takes float32, bfloat16 or float16, got int32");
  // A float extra input of a shape that does not broadcast with x.
  g.mutable_nodes(0)->mutable_cast()->set_dtype(te::v1::FLOAT32);
  EXPECT_INVALID((*MakeGraph(g, Declared(DType::kF32, {kBatch, 3})))->VariableSpecs(x, nullptr).status(),
                 "spec.graph.nodes[1] (y): inputs[0] [6, 5], inputs[1] [6, 3] do not broadcast");

  EXPECT_INVALID(MakeGraph(LossGraph(), DeclaredExtras{x, {DType::kI32, DType::kI32}, {{kBatch}, {kBatch}}})
                     .status(),
                 "extra_inputs: 2 declared, but the graph reads 1 (extra_inputs[0] to [0])");
  EXPECT_INVALID(MakeGraph(LossGraph(), Declared(DType::kE4M3, {kBatch})).status(),
                 "extra_inputs[0].dtype: float8_e4m3");
}

// A module's parameter read again by a param node: the gradient is the sum
// of both uses. y = Dense_0(x) + c sum(kernel^2) (broadcast), checked
// against finite differences, and against the module-only graph's gradient
// plus 2 c kernel.
TEST_F(GraphExtrasTest, ModuleAndParamNodeGradientsSum) {
  Spec plain;
  AddDense(&plain, "x");
  plain.add_outputs("Dense_0");
  Spec penalised = plain;
  penalised.clear_outputs();
  AddPenalty(&penalised);
  Add(&penalised, "y", {"Dense_0", "penalty"})->mutable_binary()->set_op(Spec::Binary::ADD);
  penalised.add_outputs("y");

  auto with = *MakeGraph(penalised);
  auto without = *MakeGraph(plain);
  // One variable, the module's (its initializer, not the param node's).
  auto specs = with->VariableSpecs({kBatch, kFeatures}, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 1u);
  EXPECT_EQ((*specs)[0].name, "params/Dense_0/kernel");
  auto vars = *testing::InitLayer(*ops_, *with, {kBatch, kFeatures}, nullptr);
  testing::RandomizeParams(*ops_, &vars, 3);
  LayerInputs in;
  in.x = RandomTensor(*ops_, {kBatch, kFeatures}, DType::kF32, 1);
  EXPECT_TRUE(CheckGradients(*ops_, *with, &vars, in, {}));

  LayerOutputs out;
  LayerGrads g_with, g_without;
  ASSERT_TRUE(Step(*with, &vars, in, &out, &g_with).ok());
  ASSERT_TRUE(Step(*without, &vars, in, &out, &g_without).ok());
  const std::vector<float> w = Values(vars.at("params/Dense_0/kernel"));
  const std::vector<float> module = Values(g_without.params.at("params/Dense_0/kernel"));
  std::vector<float> want(w.size());
  // dy = 1 on every element of y: the penalty's gradient is N * V * 2 c w.
  for (size_t i = 0; i < w.size(); ++i) {
    want[i] = static_cast<float>(module[i] + kBatch * kClasses * 2 * kPenalty * double(w[i]));
  }
  EXPECT_LT(RelativeError(Values(g_with.params.at("params/Dense_0/kernel")), want), kF32Tolerance);
}

// A param node may sit in a module's scope, or beside the one module named ""
// (a graph added over a layer that is one module), only to read one of that
// module's params again; any other name there would mix their variables.
TEST_F(GraphExtrasTest, ParamNodesInAModulesScopeReadItsParamsOnly) {
  auto graph = [](const std::string& module, const std::string& param, Shape shape) {
    Spec g;
    Spec::Node* dense = Add(&g, module, {"x"});
    dense->set_outputs(0, "h");
    dense->mutable_module()->mutable_flax_dense()->set_features(kClasses);
    dense->mutable_module()->mutable_flax_dense()->set_use_bias(false);
    Spec::Node* p = Add(&g, param, {});
    for (int64_t d : shape) p->mutable_param()->add_shape(d);
    p->mutable_param()->mutable_initializer()->set_kind(te::v1::Initializer::ZEROS);
    Add(&g, "sum_0", {param})->mutable_reduce()->set_op(Spec::Reduce::SUM);
    Add(&g, "y", {"h", "sum_0"})->mutable_binary()->set_op(Spec::Binary::ADD);
    g.add_outputs("y");
    return g;
  };
  const Shape x = {kBatch, kFeatures};
  auto root = MakeGraph(graph("", "kernel", {kFeatures, kClasses}));
  ASSERT_TRUE(root.ok()) << root.status();
  auto specs = (*root)->VariableSpecs(x, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 1u);
  EXPECT_EQ((*specs)[0].name, "params/kernel");
  EXPECT_INVALID((*MakeGraph(graph("", "bias", {kClasses})))->VariableSpecs(x, nullptr).status(),
                 "spec.graph.nodes[1] (bias).name: lies inside the scope of module spec.graph.nodes[0] "
                 "(), which has no params/bias");
  EXPECT_INVALID((*MakeGraph(graph("Dense_0", "Dense_0/kernel", {kFeatures, 2})))
                     ->VariableSpecs(x, nullptr)
                     .status(),
                 "spec.graph.nodes[1] (Dense_0/kernel).param: [5, 2] float32, but params/Dense_0/kernel "
                 "is [5, 4] float32");
}

}  // namespace
}  // namespace te::layers
