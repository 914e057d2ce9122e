// Declared extra inputs through the session (CPU backend): a loss graph over
// int32 labels beside a float32 x, declared at InitLayer and at AddGraph,
// trains in a ForwardBackward; labels of another dtype or shape are
// INVALID_ARGUMENT naming the micro-batch's extra_inputs[i] and leave the
// session as it was; a declaration on a module that is no graph is refused;
// a checkpoint keeps the declarations of graph 0 and of the added graphs.
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/session/checkpoint.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

constexpr int64_t kBatch = 4, kFeatures = 6, kClasses = 3;

te::v1::Tensor Floats(const std::vector<int64_t>& shape, float first) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = first + 0.25f * static_cast<float>(i % 7);
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_inline_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

te::v1::Tensor Labels(int64_t batch) {
  std::vector<int32_t> values;
  for (int64_t n = 0; n < batch; ++n) values.push_back(static_cast<int32_t>(n % kClasses));
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::INT32);
  tensor.add_shape(batch);
  tensor.set_inline_data(values.data(), values.size() * sizeof(int32_t));
  return tensor;
}

te::v1::TensorHeader LabelsHeader(int64_t batch) {
  te::v1::TensorHeader header;
  header.set_dtype(te::v1::INT32);
  header.add_shape(batch);
  return header;
}

// cross_entropy(Dense_0(x), extra_inputs[0]).mean().
te::v1::GraphSpec LossGraph() {
  te::v1::GraphSpec g;
  te::v1::GraphSpec::Node* dense = g.add_nodes();
  dense->set_name("Dense_0");
  dense->add_inputs("x");
  dense->add_outputs("logits");
  dense->mutable_module()->mutable_flax_dense()->set_features(kClasses);
  te::v1::GraphSpec::Node* loss = g.add_nodes();
  loss->set_name("loss");
  loss->add_inputs("logits");
  loss->add_inputs("extra_inputs[0]");
  loss->add_outputs("loss");
  loss->mutable_softmax_cross_entropy();
  g.add_outputs("loss");
  return g;
}

class ExtraInputsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCpuDevice();
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    config_.session_memory_bytes = 64 << 20;
    manager_ = std::make_unique<SessionManager>(SessionManagerOptions{});
    te::v1::CreateSessionResponse created;
    ASSERT_TRUE(OpenSession(te::v1::CreateSessionRequest(), device_.get(), config_, manager_.get(),
                            &created)
                    .ok());
    ref_ = created.session();
  }

  // InitLayer of the loss graph with the labels declared.
  std::string InitLossLayer(Session& session) {
    te::v1::InitLayerRequest init;
    *init.mutable_spec()->mutable_graph() = LossGraph();
    init.set_seed(3);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(kBatch);
    init.add_input_shape(kFeatures);
    *init.add_extra_inputs() = LabelsHeader(kBatch);
    te::v1::InitLayerResponse response;
    const absl::Status s = session.InitLayer(init, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.layer_id();
  }

  // One ForwardBackward of `graph` on a batch of `batch` with `labels`.
  absl::Status Step(Session& session, const std::string& layer, int graph, int64_t batch,
                    const te::v1::Tensor& labels, te::v1::ForwardBackwardResponse* response) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer);
    request.set_graph(graph);
    request.set_return_grads(true);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = Floats({batch, kFeatures}, -0.5f);
    *mb->add_extra_inputs() = labels;
    return session.ForwardBackward(request, response);
  }

  std::unique_ptr<Device> device_;
  SessionConfig config_;
  std::unique_ptr<SessionManager> manager_;
  te::v1::SessionRef ref_;
};

TEST_F(ExtraInputsTest, DeclaredInt32LabelsTrainAndOthersAreRefused) {
  auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  Session& session = lease->session();
  const std::string layer = InitLossLayer(session);
  te::v1::ForwardBackwardResponse response;
  absl::Status s = Step(session, layer, 0, kBatch, Labels(kBatch), &response);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(response.values_size(), 1);
  EXPECT_GT(response.values(0), 0.0f);
  EXPECT_EQ(response.grads_size(), 2);  // Dense_0's kernel and bias

  // Leading dims follow x's: another batch with its own labels.
  s = Step(session, layer, 0, 2, Labels(2), &response);
  ASSERT_TRUE(s.ok()) << s;
  const int64_t version = response.version();

  s = Step(session, layer, 0, kBatch, Floats({kBatch}, 1.0f), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "micro_batches[0].extra_inputs[0].dtype: float32")) << s;
  s = Step(session, layer, 0, kBatch, Labels(kBatch + 1), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "micro_batches[0].extra_inputs[0].shape [5]: want [4]"))
      << s;
  // The refused steps made no version.
  te::v1::GetVariablesRequest get;
  get.set_layer_id(layer);
  te::v1::GetVariablesResponse got;
  ASSERT_TRUE(session.GetVariables(get, &got).ok());
  EXPECT_EQ(got.version(), version);
  te::v1::SessionInfo info;
  session.GetSessionInfo(&info);
  EXPECT_EQ(info.saved_forwards(), 0);
}

TEST_F(ExtraInputsTest, InitLayerAndAddGraphCheckTheDeclaration) {
  auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  Session& session = lease->session();
  // A module that is no graph takes its extra inputs in x's dtype.
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(kClasses);
  init.set_input_dtype(te::v1::FLOAT32);
  init.add_input_shape(kBatch);
  init.add_input_shape(kFeatures);
  *init.add_extra_inputs() = LabelsHeader(kBatch);
  te::v1::InitLayerResponse initialised;
  absl::Status s = session.InitLayer(init, &initialised);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "extra_inputs: declares a graph's extra inputs")) << s;
  init.mutable_extra_inputs(0)->set_dtype(te::v1::DTYPE_UNSPECIFIED);
  *init.mutable_spec()->mutable_graph() = LossGraph();
  s = session.InitLayer(init, &initialised);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "extra_inputs[0].dtype")) << s;

  // AddGraph: the labels declared for a batch of 2 over the same layer.
  const std::string layer = InitLossLayer(session);
  te::v1::AddGraphRequest add;
  add.set_layer_id(layer);
  *add.mutable_graph() = LossGraph();
  add.set_input_dtype(te::v1::FLOAT32);
  add.add_input_shape(2);
  add.add_input_shape(kFeatures);
  *add.add_extra_inputs() = LabelsHeader(3);
  te::v1::AddGraphResponse added;
  s = session.AddGraph(add, &added);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "graph.nodes[1] (loss).inputs[1]: labels [3] do not fit"))
      << s;
  // Declared as graph 0's at another batch: graph 0 itself.
  add.mutable_extra_inputs(0)->set_shape(0, 2);
  ASSERT_TRUE(session.AddGraph(add, &added).ok());
  EXPECT_EQ(added.graph(), 0);
  // Undeclared: another graph (its labels would have x's dtype).
  add.clear_extra_inputs();
  ASSERT_TRUE(session.AddGraph(add, &added).ok());
  EXPECT_EQ(added.graph(), 1);
  te::v1::ForwardBackwardResponse response;
  s = Step(session, layer, 1, 2, Labels(2), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "extra_inputs[0].dtype: int32, but x is float32")) << s;
}

TEST_F(ExtraInputsTest, ACheckpointKeepsTheDeclarations) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/extra_inputs_state");
  std::filesystem::remove_all(dir);
  absl::StatusOr<std::unique_ptr<CheckpointStore>> store = CheckpointStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  std::string layer;
  {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok()) << lease.status();
    layer = InitLossLayer(lease->session());
    // Graph 1: the same loss with one more node, its labels declared too.
    te::v1::AddGraphRequest add;
    add.set_layer_id(layer);
    *add.mutable_graph() = LossGraph();
    te::v1::GraphSpec::Node* scale = add.mutable_graph()->add_nodes();
    scale->set_name("scale_0");
    scale->add_inputs("loss");
    scale->add_outputs("y");
    scale->mutable_scale()->set_factor(2.0);
    add.mutable_graph()->set_outputs(0, "y");
    add.set_input_dtype(te::v1::FLOAT32);
    add.add_input_shape(kBatch);
    add.add_input_shape(kFeatures);
    *add.add_extra_inputs() = LabelsHeader(kBatch);
    te::v1::AddGraphResponse added;
    ASSERT_TRUE(lease->session().AddGraph(add, &added).ok());
    ASSERT_EQ(added.graph(), 1);
    ASSERT_TRUE((*store)->Save(*lease).ok());
  }
  SessionManager restarted{SessionManagerOptions{}};
  ASSERT_EQ((*store)->RestoreAll(device_.get(), config_, &restarted).restored, 1);
  auto lease = restarted.Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  for (int graph : {0, 1}) {
    SCOPED_TRACE(graph);
    te::v1::ForwardBackwardResponse response;
    absl::Status s = Step(lease->session(), layer, graph, kBatch, Labels(kBatch), &response);
    EXPECT_TRUE(s.ok()) << s;
    s = Step(lease->session(), layer, graph, kBatch, Floats({kBatch}, 1.0f), &response);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "was declared int32")) << s;
  }
}

}  // namespace
}  // namespace te::session
