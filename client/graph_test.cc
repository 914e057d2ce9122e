// The graph builder without a server: the Python tracer's names, JAX's dtype
// promotion, Flax's automatic module names, glue the output does not read
// left out, and a bad use reported as the error of Spec() naming the node.
#include "client/graph.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te::client {
namespace {

const Shape kX = {2, 8, 16};

std::vector<std::string> NodeNames(const te::v1::GraphSpec& g) {
  std::vector<std::string> names;
  for (const te::v1::GraphSpec::Node& n : g.nodes()) names.push_back(n.name());
  return names;
}

te::v1::GraphSpec SpecOf(const Graph& g) {
  absl::StatusOr<te::v1::LayerSpec> spec = g.Spec();
  EXPECT_TRUE(spec.ok()) << spec.status();
  return spec.ok() ? spec->graph() : te::v1::GraphSpec();
}

DenseGeneral TeDense(int64_t features) { return DenseGeneral({features}); }

TEST(GraphTest, ModulesTakeFlaxsAutomaticNamesPerScopeAndType) {
  Graph g("Block", kX, DType::kBF16);
  Graph::Edge x = g.Call(LayerNorm(), {g.x()});      // TE's LayerNorm
  x = g.Call(FlaxLayerNorm(), {x});                   // Flax's: the same class name, the same counter
  x = g.Call(TeDense(16), {x});
  x = g.Call(TeDense(16), {x}, {}, "proj");           // an explicit name takes no number
  {
    Graph::Scope mlp = g.Submodule("Mlp");
    x = g.Call(TeDense(16), {x});
  }
  {
    Graph::Scope mlp = g.Submodule("Mlp");
    x = g.Call(TeDense(16), {x});
  }
  x = g.Call(TeDense(16), {x});
  g.SetOutput(x);
  EXPECT_EQ(NodeNames(SpecOf(g)), (std::vector<std::string>{"LayerNorm_0", "LayerNorm_1", "DenseGeneral_0", "proj",
                                                             "Mlp_0/DenseGeneral_0", "Mlp_1/DenseGeneral_0",
                                                             "DenseGeneral_1"}));
}

TEST(GraphTest, DropoutUsersAreTheNodesThatDrawDropout) {
  Graph g("Block", kX, DType::kF32);
  Graph::Edge x = g.Dropout(g.x(), 0.0f);  // rate 0: the identity, no node
  LayerNormMLP mlp;
  x = g.Call(mlp, {x});
  mlp.intermediate_dropout_rate = 0.0f;
  x = g.Call(mlp, {x});
  {
    Graph::Scope block = g.Submodule("Block");
    x = g.Dropout(x, 0.5f);
  }
  g.SetOutput(x);
  EXPECT_EQ(g.DropoutUsers(), (std::vector<std::string>{"LayerNormMLP_0", "Block_0/Dropout_0"}));
  Graph plain("Plain", kX, DType::kF32);
  plain.SetOutput(plain.Call(TeDense(16), {plain.x()}));
  EXPECT_TRUE(plain.DropoutUsers().empty());
}

TEST(GraphTest, GlueIsNamedByOpAndScopeAndItsEdgesAsTheNode) {
  Graph g("Block", kX, DType::kBF16);
  // A module holding "reshape_0" makes the first reshape "reshape_1".
  Graph::Edge x = g.Call(TeDense(16), {g.x()}, {}, "reshape_0");
  x = g.Reshape(x, {2, 8, 4, 4});
  std::vector<Graph::Edge> parts = g.Split(x, 2, -1);  // axis -1 is recorded as 3
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(g.shape(parts[1]), (Shape{2, 8, 4, 2}));
  x = g.Concatenate({parts[1], parts[0]}, 3);
  x = g.Reshape(x, {2, 8, -1});
  {
    Graph::Scope inner = g.Submodule("Inner");
    x = g.Reshape(x, {2, 8, 1, 16});  // counted in its own scope
    x = g.Reshape(x, {2, 8, 16});
  }
  g.SetOutput(g.Add(x, g.x()));
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec), (std::vector<std::string>{"reshape_0", "reshape_1", "split_0", "concatenate_0",
                                                        "reshape_2", "Inner_0/reshape_0", "Inner_0/reshape_1", "add_0"}));
  EXPECT_EQ(spec.nodes(2).split().axis(), 3);
  EXPECT_EQ(spec.nodes(2).outputs(1), "split_0:1");
  EXPECT_EQ(spec.nodes(3).inputs(0), "split_0:1");
  EXPECT_EQ(spec.nodes(4).reshape().shape(2), 16);  // the -1, resolved
  EXPECT_EQ(spec.nodes(7).inputs(0), "Inner_0/reshape_1");
  EXPECT_EQ(spec.nodes(7).inputs(1), "x");
  ASSERT_EQ(spec.outputs_size(), 1);
  EXPECT_EQ(spec.outputs(0), "add_0");
}

TEST(GraphTest, IdentityGlueRecordsNothing) {
  Graph g("Block", kX, DType::kBF16);
  EXPECT_EQ(g.Reshape(g.x(), kX).id, g.x().id);
  EXPECT_EQ(g.Cast(g.x(), DType::kBF16).id, g.x().id);
  EXPECT_EQ(g.Transpose(g.x(), {0, 1, 2}).id, g.x().id);
  EXPECT_EQ(g.Dropout(g.x(), 0.0f).id, g.x().id);
  g.SetOutput(g.x());
  EXPECT_EQ(SpecOf(g).nodes_size(), 0);
}

// JAX promotes bfloat16 + float32 to float32: the bfloat16 operand is cast
// first, in the add's scope, and the sum is float32.
TEST(GraphTest, AddOfBf16AndFloat32CastsTheBf16Operand) {
  Graph g("Block", kX, DType::kBF16);
  const Graph::Edge h = g.Call(FlaxDense(16), {g.x()});
  EXPECT_EQ(g.dtype(h), DType::kF32);  // Flax: bf16 x with float32 params
  const Graph::Edge y = g.Add(g.x(), h);
  EXPECT_EQ(g.dtype(y), DType::kF32);
  g.SetOutput(y);
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec), (std::vector<std::string>{"Dense_0", "cast_0", "add_0"}));
  EXPECT_EQ(spec.nodes(1).inputs(0), "x");
  EXPECT_EQ(spec.nodes(1).cast().dtype(), te::v1::FLOAT32);
  EXPECT_EQ(spec.nodes(2).inputs(0), "cast_0");
  EXPECT_EQ(spec.nodes(2).inputs(1), "Dense_0");
}

TEST(GraphTest, ModuleOutputDTypes) {
  Graph g("Block", kX, DType::kBF16);
  EXPECT_EQ(g.dtype(g.Call(TeDense(16), {g.x()})), DType::kBF16);  // TE: the input's
  FlaxDense bf16(16);
  bf16.dtype = DType::kBF16;
  EXPECT_EQ(g.dtype(g.Call(bf16, {g.x()})), DType::kBF16);  // Flax: dtype when set
  FlaxLayerNorm bare;
  bare.use_bias = false;
  bare.use_scale = false;
  EXPECT_EQ(g.dtype(g.Call(bare, {g.x()})), DType::kBF16);  // no params: nothing to promote with
  FlaxDense half_params(16);
  half_params.param_dtype = DType::kF16;
  EXPECT_EQ(g.dtype(g.Call(half_params, {g.x()})), DType::kF32);  // bf16 with f16 gives f32
  EXPECT_EQ(g.shape(g.Call(FlaxDenseGeneral({4, 8}), {g.x()})), (Shape{2, 8, 4, 8}));
}

// Glue the output does not read is left out, and not counted; module nodes
// stay (their variables exist whether or not y reads them).
TEST(GraphTest, UnreadGlueIsLeftOutAndModulesStay) {
  Graph g("Block", kX, DType::kBF16);
  const Graph::Edge mask = g.CausalMask(g.x());
  (void)mask;
  const Graph::Edge unread = g.Reshape(g.x(), {2, 8, 2, 8});
  (void)unread;
  g.Call(TeDense(4), {g.x()});  // its output is not read either
  g.SetOutput(g.Reshape(g.x(), {16, 16}));
  EXPECT_EQ(NodeNames(SpecOf(g)), (std::vector<std::string>{"DenseGeneral_0", "reshape_0"}));
}

TEST(GraphTest, MasksAndGraphInputs) {
  Graph g("Block", kX, DType::kF32);
  const Graph::Edge k = g.ExtraInput(0, kX, DType::kF32);
  const Graph::Edge padding = g.AttentionMask({2, 1, 8, 8});
  FlaxMultiHeadDotProductAttention attention(2);
  Graph::Edge y = g.Call(attention, {g.x(), k, k}, padding);
  const Graph::Edge causal = g.CausalMask(g.x());
  y = g.Call(attention, {y}, causal);
  g.SetOutput(y);
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec), (std::vector<std::string>{"MultiHeadDotProductAttention_0", "causal_mask_0",
                                                        "MultiHeadDotProductAttention_1"}));
  EXPECT_EQ(spec.nodes(0).inputs(1), "extra_inputs[0]");
  EXPECT_EQ(spec.nodes(0).mask(), "attention_mask");
  EXPECT_EQ(spec.nodes(2).mask(), "causal_mask_0");
  EXPECT_EQ(spec.nodes(1).inputs(0), "x");
}

// te.activation.activation takes TE's [..., 1, I]: a reshape to the server's
// [..., I] first; nn.gelu is a glue-named activation node.
TEST(GraphTest, ActivationAndGelu) {
  Graph g("Block", kX, DType::kBF16);
  Graph::Edge x = g.Reshape(g.x(), {2, 8, 1, 16});
  x = g.Activation(x, {"gelu"});
  EXPECT_EQ(g.shape(x), kX);
  x = g.Gelu(x);
  g.SetOutput(x);
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec), (std::vector<std::string>{"reshape_0", "reshape_1", "activation_0", "gelu_0"}));
  EXPECT_EQ(spec.nodes(3).module().activation().activations(0), "gelu");
}

// The first bad use is Spec()'s error, INVALID_ARGUMENT naming the node.
void ExpectError(const Graph& g, const std::string& names) {
  absl::Status status = g.Spec().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(names), std::string::npos) << status;
}

TEST(GraphTest, BadUsesNameTheNode) {
  {
    Graph g("Block", kX, DType::kBF16);
    g.Reshape(g.x(), {2, 8, 4});  // a quarter of the elements
    g.SetOutput(g.Reshape(g.x(), {3, -1}));  // after an error: nothing recorded
    ExpectError(g, "reshape_0: cannot reshape [2, 8, 16] into [2, 8, 4]");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    g.Call(TeDense(4), {g.x()});
    g.Call(TeDense(4), {g.x()}, {}, "DenseGeneral_0");
    ExpectError(g, "DenseGeneral_0 (DenseGeneral): the name is already used");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    const Graph::Edge mask = g.CausalMask(g.x());
    g.Add(g.x(), g.Reshape(g.x(), kX));
    g.Call(TeDense(4), {mask});
    ExpectError(g, "DenseGeneral_0 (DenseGeneral): reads an attention mask as data");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    g.Call(FlaxMultiHeadDotProductAttention(2), {g.x()}, g.x());
    ExpectError(g, "MultiHeadDotProductAttention_0 (MultiHeadDotProductAttention): its mask is not a mask");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    g.Add(g.x(), g.Reshape(g.x(), {2, 16, 8}));
    ExpectError(g, "add_0: shapes [2, 8, 16] and [2, 16, 8] differ");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    g.Split(g.x(), 3, -1);
    ExpectError(g, "split_0: 3 parts do not divide axis 2");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    DenseGeneral dense({4});
    dense.axis = {5};
    g.Call(dense, {g.x()});
    ExpectError(g, "DenseGeneral_0 (DenseGeneral): dense_general.axis: 5 is out of range");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    g.Call(TeDense(4), {g.x()}, {}, "x");
    ExpectError(g, "x (DenseGeneral): a module's output would be named like the graph input");
  }
  {
    Graph g("Block", kX, DType::kBF16);
    ExpectError(g, "Block: no output set");
  }
}

// ---- jax.numpy's nodes -------------------------------------------------------------

using Spec = te::v1::GraphSpec;

TEST(GraphTest, NumpyNodesRecordTheirOpShapesAndDTypes) {
  Graph g("Block", kX, DType::kBF16);
  const Graph::Edge bias = g.Param("bias", {16}, {}, DType::kF32);  // float32 param
  const Graph::Edge sum = g.Binary(Spec::Binary::ADD, g.x(), bias);  // bf16 + f32: a cast first
  EXPECT_EQ(g.shape(sum), kX);
  EXPECT_EQ(g.dtype(sum), DType::kF32);
  const Graph::Edge half = g.Binary(Spec::Binary::SUBTRACT, sum, 1.0, /*scalar_first=*/true);
  const Graph::Edge positive = g.Binary(Spec::Binary::GREATER, half, 0.0);
  EXPECT_EQ(g.dtype(positive), DType::kBool);
  const Graph::Edge kept = g.Where(g.Unary(Spec::Unary::LOGICAL_NOT, positive), half, 0.0);
  const Graph::Edge mean = g.Reduce(Spec::Reduce::MEAN, kept, {-1}, /*keepdims=*/true);
  EXPECT_EQ(g.shape(mean), (Shape{2, 8, 1}));
  const Graph::Edge all = g.Reduce(Spec::Reduce::SUM, kept);
  EXPECT_EQ(g.shape(all), Shape{});
  const Graph::Edge scores = g.Einsum("bqd,bkd->bqk", kept, kept);
  EXPECT_EQ(g.shape(scores), (Shape{2, 8, 8}));
  const Graph::Edge p = g.Softmax(scores, -1, /*log=*/true);
  const Graph::Edge first = g.Slice(p, {0, 0, 0}, {2, 1, 8}, {1, 1, 2});
  EXPECT_EQ(g.shape(first), (Shape{2, 1, 4}));
  const Graph::Edge tanh = g.Unary(Spec::Unary::TANH, first);
  g.SetOutput(g.Binary(Spec::Binary::MULTIPLY, tanh, mean));  // [2, 1, 4] * [2, 8, 1]
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec),
            (std::vector<std::string>{"bias", "cast_0", "binary_0", "binary_1", "binary_2", "unary_0",
                                      "where_0", "reduce_0", "einsum_0", "softmax_0", "slice_0", "unary_1",
                                      "binary_3"}));
  EXPECT_EQ(spec.nodes(0).param().shape_size(), 1);
  EXPECT_EQ(spec.nodes(0).param().dtype(), te::v1::FLOAT32);
  EXPECT_TRUE(spec.nodes(3).binary().has_scalar());
  EXPECT_TRUE(spec.nodes(3).binary().scalar_first());
  EXPECT_EQ(spec.nodes(6).inputs_size(), 2);  // the condition and x; y the constant
  EXPECT_TRUE(spec.nodes(6).where().has_y_scalar());
  EXPECT_EQ(spec.nodes(7).reduce().axes(0), 2);
  EXPECT_EQ(spec.nodes(8).einsum().equation(), "bqd,bkd->bqk");
  EXPECT_TRUE(spec.nodes(9).softmax().log());
  EXPECT_EQ(spec.nodes(10).slice().stride(2), 2);
  EXPECT_EQ(spec.outputs(0), "binary_3");
}

TEST(GraphTest, ParamsTakeTheScopeAndStayUnread) {
  Graph g("Block", kX, DType::kF32);
  {
    Graph::Scope mlp = g.Submodule("Mlp");
    g.Param("unused", {3, 4});
  }
  g.SetOutput(g.Einsum("...d,df->...f", g.x(), g.Param("kernel", {16, 4})));
  const te::v1::GraphSpec spec = SpecOf(g);
  EXPECT_EQ(NodeNames(spec), (std::vector<std::string>{"Mlp_0/unused", "kernel", "einsum_0"}));
}

TEST(GraphTest, EinsumShapes) {
  Graph g("Block", kX, DType::kF32);
  EXPECT_EQ(g.shape(g.Einsum("...d,df->...f", g.x(), g.Param("k", {16, 3}))), (Shape{2, 8, 3}));
  EXPECT_EQ(g.shape(g.Einsum("bsd,bsd->bs", g.x(), g.x())), (Shape{2, 8}));
  // Implicit output: the indices that appear once, sorted; b is summed.
  EXPECT_EQ(g.shape(g.Einsum("bsd,bte", g.x(), g.x())), (Shape{16, 16, 8, 8}));
}

TEST(GraphTest, NumpyBadUsesNameTheNode) {
  {
    Graph g("Block", kX, DType::kF32);
    g.Binary(Spec::Binary::ADD, g.x(), g.Reshape(g.x(), {2, 16, 8}));
    ExpectError(g, "binary_0: shapes [2, 8, 16], [2, 16, 8] do not broadcast together");
  }
  {
    Graph g("Block", kX, DType::kF32);
    g.Reduce(Spec::Reduce::SUM, g.x(), {3});
    ExpectError(g, "reduce_0: axis 3 is out of range for [2, 8, 16]");
  }
  {
    Graph g("Block", kX, DType::kF32);
    g.Einsum("bsd,de->bse", g.x(), g.x());
    ExpectError(g, "einsum_0: \"bsd,de->bse\": operand 1 [2, 8, 16] does not fit \"de\"");
  }
  {
    Graph g("Block", kX, DType::kF32);
    g.Slice(g.x(), {0, 0, 0}, {2, 9, 16});
    ExpectError(g, "slice_0: axis 1: 0:9:1 is not within 0:8");
  }
  {
    Graph g("Block", kX, DType::kF32);
    g.Where(g.x(), g.x(), 0.0);
    ExpectError(g, "where_0: the condition is float32; want bool");
  }
  {
    Graph g("Block", kX, DType::kF32);
    g.Param("p", {4});
    g.Param("p", {4});
    ExpectError(g, "p (param): the name is already used");
  }
}

}  // namespace
}  // namespace te::client
