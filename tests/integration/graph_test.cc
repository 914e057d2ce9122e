// A te.v1.GraphSpec through the real te_server: InitLayer names the module
// nodes' variables under the node names with DeriveSeed init keys, Forward
// (with a padding mask) and ForwardBackward over micro-batches run the whole
// graph in one call, DelayedScaling moves each node's own fp8_metas, and a
// bad graph is INVALID_ARGUMENT naming its node.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/rng.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kBatch = 2, kSeq = 4, kHidden = 16, kHeads = 2, kHeadDim = kHidden / kHeads;
const std::vector<int64_t> kShape = {kBatch, kSeq, kHidden};
constexpr uint64_t kSeed = 42;

using Spec = te::v1::GraphSpec;

Spec::Node* AddNode(Spec* g, const std::string& name, std::vector<std::string> in,
                    std::vector<std::string> out) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  for (const std::string& s : out) node->add_outputs(s);
  return node;
}

te::v1::LayerSpec Dense(int64_t features) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(features);
  return spec;
}

// LayerNorm, DenseGeneral(3H), reshape, split, padding-causal attention
// under the request's mask, reshape, DenseGeneral(H), residual add.
te::v1::LayerSpec AttentionBlock() {
  te::v1::LayerSpec spec;
  Spec* g = spec.mutable_graph();
  AddNode(g, "LayerNorm_0", {"x"}, {"ln"})->mutable_module()->mutable_layer_norm();
  *AddNode(g, "DenseGeneral_0", {"ln"}, {"qkv"})->mutable_module() = Dense(3 * kHidden);
  auto* reshape = AddNode(g, "reshape", {"qkv"}, {"qkv4"})->mutable_reshape();
  for (int64_t d : {kBatch, kSeq, kHeads, 3 * kHeadDim}) reshape->add_shape(d);
  auto* split = AddNode(g, "split", {"qkv4"}, {"q", "k", "v"})->mutable_split();
  split->set_axis(-1);
  split->set_parts(3);
  Spec::Node* attention = AddNode(g, "DotProductAttention_0", {"q", "k", "v"}, {"a"});
  auto* dpa = attention->mutable_module()->mutable_dot_product_attention();
  dpa->set_head_dim(kHeadDim);
  dpa->set_num_attention_heads(kHeads);
  dpa->set_attn_mask_type(te::v1::PADDING_CAUSAL);
  attention->set_mask("attention_mask");
  auto* back = AddNode(g, "merge", {"a"}, {"a3"})->mutable_reshape();
  for (int64_t d : {kBatch, kSeq, int64_t{-1}}) back->add_shape(d);
  *AddNode(g, "TEUnfusedMLP_0/DenseGeneral_1", {"a3"}, {"p"})->mutable_module() = Dense(kHidden);
  AddNode(g, "residual", {"p", "x"}, {"y"})->mutable_add();
  g->add_outputs("y");
  return spec;
}

// bool [B, 1, S, S], true = masked out: batch 1's last key is padding.
te::v1::Tensor PaddingMask() {
  te::v1::Tensor mask;
  mask.set_dtype(te::v1::BOOL);
  for (int64_t d : {kBatch, int64_t{1}, kSeq, kSeq}) mask.add_shape(d);
  std::string bytes(kBatch * kSeq * kSeq, '\0');
  for (int64_t i = 0; i < kSeq; ++i) bytes[kSeq * kSeq + i * kSeq + (kSeq - 1)] = 1;
  mask.set_inline_data(bytes);
  return mask;
}

class GraphServiceTest : public ServerSuite {
 protected:
  grpc::Status Init(const te::v1::LayerSpec& spec, const te::v1::Autocast& autocast,
                    te::v1::InitLayerResponse* response) {
    te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
    *request.mutable_spec() = spec;
    request.set_seed(kSeed);
    request.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : kShape) request.add_input_shape(d);
    *request.mutable_autocast() = autocast;
    grpc::ClientContext context;
    return stub_->InitLayer(&context, request, response);
  }

  te::v1::ForwardBackwardResponse Step(const std::string& layer_id, int micro_batches,
                                       const te::v1::Autocast& autocast = {}) {
    te::v1::ForwardBackwardRequest request = WithSession(te::v1::ForwardBackwardRequest());
    request.set_layer_id(layer_id);
    request.set_deterministic(true);
    request.set_return_dx(true);
    request.set_return_grads(true);
    *request.mutable_autocast() = autocast;
    for (int i = 0; i < micro_batches; ++i) {
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = MakeTensor(te::v1::FLOAT32, kShape, RandomFloats(kBatch * kSeq * kHidden, 10 + i));
      *mb->mutable_dy() = MakeTensor(te::v1::FLOAT32, kShape, RandomFloats(kBatch * kSeq * kHidden, 20 + i));
      *mb->mutable_attention_mask() = PaddingMask();
    }
    grpc::ClientContext context;
    te::v1::ForwardBackwardResponse response;
    const grpc::Status status = stub_->ForwardBackward(&context, request, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response;
  }
};

TEST_F(GraphServiceTest, InitNamesNodeVariablesAndSeedsThemByName) {
  te::v1::InitLayerResponse init;
  ASSERT_TRUE(Init(AttentionBlock(), {}, &init).ok());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& v : init.variables()) {
    shapes[v.collection() + "/" + v.path()] = {v.shape().begin(), v.shape().end()};
  }
  EXPECT_EQ(shapes.size(), 6u);
  EXPECT_EQ(shapes["params/LayerNorm_0/scale"], std::vector<int64_t>({kHidden}));
  EXPECT_EQ(shapes["params/DenseGeneral_0/kernel"], std::vector<int64_t>({kHidden, 3 * kHidden}));
  EXPECT_EQ(shapes["params/TEUnfusedMLP_0/DenseGeneral_1/bias"], std::vector<int64_t>({kHidden}));
  EXPECT_EQ(std::vector<int64_t>(init.output_shape().begin(), init.output_shape().end()), kShape);

  // The node's init key is DeriveSeed(seed, name): its kernel equals a lone
  // DenseGeneral's initialised with that seed.
  te::v1::InitLayerRequest alone = WithSession(te::v1::InitLayerRequest());
  *alone.mutable_spec() = Dense(3 * kHidden);
  const std::string name = "DenseGeneral_0";
  alone.set_seed(DeriveSeed(kSeed, name));
  alone.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : kShape) alone.add_input_shape(d);
  te::v1::InitLayerResponse dense;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->InitLayer(&context, alone, &dense).ok());
  const auto graph_vars = GetAllVariables(*stub_, session_, init.layer_id());
  const auto dense_vars = GetAllVariables(*stub_, session_, dense.layer_id());
  EXPECT_EQ(ToFloats(graph_vars.at("params/DenseGeneral_0/kernel")),
            ToFloats(dense_vars.at("params/kernel")));
}

TEST_F(GraphServiceTest, ForwardAndForwardBackwardRunTheGraph) {
  te::v1::InitLayerResponse init;
  ASSERT_TRUE(Init(AttentionBlock(), {}, &init).ok());
  te::v1::ForwardRequest forward = WithSession(te::v1::ForwardRequest());
  forward.set_layer_id(init.layer_id());
  *forward.mutable_x() = MakeTensor(te::v1::FLOAT32, kShape, RandomFloats(kBatch * kSeq * kHidden, 10));
  *forward.mutable_attention_mask() = PaddingMask();
  forward.set_deterministic(true);
  te::v1::ForwardResponse y;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Forward(&context, forward, &y);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  EXPECT_EQ(ShapeOf(y.y()), kShape);

  // One step over two micro-batches: values, dx per micro-batch, and a
  // gradient for every parameter under its node's name. The first
  // micro-batch is the forward above: its value is vdot(y, dy).
  const te::v1::ForwardBackwardResponse step = Step(init.layer_id(), 2);
  ASSERT_EQ(step.values_size(), 2);
  const std::vector<float> yv = ToFloats(y.y());
  const std::vector<float> dy = Rounded(te::v1::FLOAT32, RandomFloats(yv.size(), 20));
  double vdot = 0.0;
  for (size_t i = 0; i < yv.size(); ++i) vdot += double(yv[i]) * dy[i];
  EXPECT_NEAR(step.values(0), vdot, 1e-4 * std::abs(vdot) + 1e-5);
  ASSERT_EQ(step.dx_size(), 2);
  EXPECT_EQ(ShapeOf(step.dx(1)), kShape);
  std::map<std::string, std::vector<int64_t>> grads;
  for (const auto& g : step.grads()) grads[g.path()] = ShapeOf(g.value());
  EXPECT_EQ(grads.size(), 6u);
  EXPECT_EQ(grads["DenseGeneral_0/kernel"], std::vector<int64_t>({kHidden, 3 * kHidden}));
  EXPECT_EQ(grads["TEUnfusedMLP_0/DenseGeneral_1/kernel"], std::vector<int64_t>({kHidden, kHidden}));
}

TEST_F(GraphServiceTest, DelayedScalingMovesEachNodesOwnFp8Metas) {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  te::v1::InitLayerResponse init;
  ASSERT_TRUE(Init(AttentionBlock(), autocast, &init).ok());
  Step(init.layer_id(), 1, autocast);
  const auto vars = GetAllVariables(*stub_, session_, init.layer_id());
  for (const std::string node : {"DenseGeneral_0", "TEUnfusedMLP_0/DenseGeneral_1"}) {
    const std::string scale = "fp8_metas/" + node + "/x_scale";
    ASSERT_TRUE(vars.count(scale)) << scale;
    // The step ended with TE's update: the history rolled and the scale moved.
    EXPECT_NE(ToFloats(vars.at(scale))[0], 1.0f) << scale;
    EXPECT_GT(ToFloats(vars.at("fp8_metas/" + node + "/x_amax_history")).back(), 0.0f) << node;
  }
  EXPECT_NE(ToFloats(vars.at("fp8_metas/DenseGeneral_0/x_scale")),
            ToFloats(vars.at("fp8_metas/TEUnfusedMLP_0/DenseGeneral_1/x_scale")));
}

TEST_F(GraphServiceTest, BadGraphIsInvalidArgumentNamingTheNode) {
  te::v1::LayerSpec spec = AttentionBlock();
  spec.mutable_graph()->mutable_nodes(3)->mutable_split()->set_axis(1);  // seq 4 % 3 != 0
  te::v1::InitLayerResponse init;
  const grpc::Status status = Init(spec, {}, &init);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("spec.graph.nodes[3] (split)"), std::string::npos)
      << status.error_message();
}

}  // namespace
}  // namespace te::testing
