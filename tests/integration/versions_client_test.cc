// Variables as values, graphs over a layer's variables and DeleteLayer
// through the C++ client (//client:te_client) and a real te_server: a live
// handle follows the steps while a pinned value stays bit for bit, and its
// version goes from the server when its last copy does; a loss graph with aux
// outputs trains the variables Init made; a layer that is one module takes
// a graph around it; DeleteLayer gives the session's memory back.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/graph.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

constexpr int64_t kBatch = 2, kSeq = 3, kHidden = 8, kFeatures = 6, kVocab = 11;

class VersionsClientTest : public testing::ClientSessionTest {
 protected:
  int64_t Memory() {
    absl::StatusOr<te::v1::SessionInfo> info = session_->GetSessionInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->memory_bytes() : -1;
  }

  void SetAdam(const Variables& vars) {
    Optimizer adam;
    adam.kind = Optimizer::Kind::kAdam;
    adam.learning_rate = 0.05;
    ASSERT_TRUE(session_->SetOptimizer(vars.layer_id, adam).ok());
  }

  static HostTensor Ids(uint64_t seed, int64_t batch = kBatch) {
    std::vector<float> ids(static_cast<size_t>(batch * kSeq));
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<float>((seed * 7 + i * 5) % kVocab);
    return *HostTensor::FromFloats({batch, kSeq}, ids, DType::kI32);
  }

  // ids -> Embed_0 -> Dense_0 -> logits; with the loss, softmax cross
  // entropy against extra_inputs[0] as y and the logits as an aux output.
  static Graph Lm(int64_t batch, bool with_loss) {
    Graph g("Lm", {batch, kSeq}, DType::kI32);
    const Graph::Edge h = g.Embed(g.x(), kVocab, kHidden);
    FlaxDense dense(kVocab);
    const Graph::Edge logits = g.Call(dense, {h});
    if (!with_loss) {
      g.SetOutput(logits);
      return g;
    }
    const Graph::Edge labels = g.ExtraInput(0, {batch, kSeq}, DType::kI32);
    g.SetOutputs({g.SoftmaxCrossEntropyWithIntegerLabels(logits, labels), logits});
    return g;
  }
};

TEST_F(VersionsClientTest, ALiveHandleFollowsTheStepsAndAValueStaysAsItWas) {
  DenseGeneral dense({kFeatures});
  const HostTensor x = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kF32, 1);
  const HostTensor dy = HostTensor::RandomNormal({kBatch, kSeq, kFeatures}, DType::kF32, 2);
  absl::StatusOr<Variables> vars = dense.Init(*session_, 3, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  EXPECT_TRUE(vars->live());
  EXPECT_EQ(vars->version(), 1);
  SetAdam(*vars);
  ApplyOptions train;
  train.apply_update = true;
  // A first step makes the optimizer's plan, which the layer keeps.
  ASSERT_TRUE(dense.ValueAndGrad(*vars, x, dy, train).ok());
  EXPECT_EQ(vars->version(), 2);
  const int64_t one_version = Memory();
  std::optional<Variables> initial = vars->Pinned();
  EXPECT_FALSE(initial->live());
  absl::StatusOr<HostTensor> y1 = dense.Apply(*initial, x);
  ASSERT_TRUE(y1.ok()) << y1.status();
  absl::StatusOr<std::map<std::string, HostTensor>> params1 = GetVariables(*initial, {"params"});
  ASSERT_TRUE(params1.ok()) << params1.status();

  for (int step = 0; step < 3; ++step) {
    absl::StatusOr<ValueAndGradResult> done = dense.ValueAndGrad(*vars, x, dy, train);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_TRUE(done->update.has_value());
    EXPECT_TRUE(done->update->applied());
    EXPECT_TRUE(done->grads.empty());
    ASSERT_TRUE(done->variables.has_value());
    EXPECT_TRUE(done->variables->live());
    EXPECT_EQ(vars->version(), step + 3);  // every copy of the live handle moved
  }
  // The live handle holds its newest version, the value version 2: two.
  EXPECT_GT(Memory(), one_version);
  absl::StatusOr<HostTensor> y_trained = dense.Apply(*vars, x);
  ASSERT_TRUE(y_trained.ok());
  EXPECT_NE(y_trained->bytes(), y1->bytes());
  absl::StatusOr<HostTensor> y1_again = dense.Apply(*initial, x);
  ASSERT_TRUE(y1_again.ok());
  EXPECT_EQ(y1_again->bytes(), y1->bytes());
  absl::StatusOr<std::map<std::string, HostTensor>> params1_again = GetVariables(*initial, {"params"});
  ASSERT_TRUE(params1_again.ok());
  for (const auto& [name, t] : *params1) EXPECT_EQ(params1_again->at(name).bytes(), t.bytes()) << name;

  // A step through the value makes another value; the value itself stays.
  absl::StatusOr<ValueAndGradResult> branch = dense.ValueAndGrad(*initial, x, dy, train);
  ASSERT_TRUE(branch.ok()) << branch.status();
  ASSERT_TRUE(branch->variables.has_value());
  EXPECT_FALSE(branch->variables->live());
  EXPECT_EQ(branch->variables->version(), 6);
  EXPECT_EQ(initial->version(), 2);
  EXPECT_EQ(vars->version(), 5);
  // Dropped values go from the server: back to one version's memory.
  branch = absl::UnknownError("dropped");
  initial.reset();
  EXPECT_EQ(Memory(), one_version);
}

TEST_F(VersionsClientTest, ALossGraphWithAuxOutputsTrainsWhatInitMade) {
  const Graph lm = Lm(kBatch, false);
  absl::StatusOr<Variables> vars = lm.Init(*session_, 4, Ids(0));
  ASSERT_TRUE(vars.ok()) << vars.status();
  // The same modules for another batch: no reshape fixes the batch, so the
  // graph is Init's own.
  absl::StatusOr<AddedGraph> any_batch = AddGraph(*vars, Lm(3, false), {3, kSeq}, DType::kI32);
  ASSERT_TRUE(any_batch.ok()) << any_batch.status();
  EXPECT_EQ(any_batch->graph, 0);
  EXPECT_TRUE(lm.Apply(*vars, Ids(5, 3)).ok());

  absl::StatusOr<AddedGraph> loss = AddGraph(*vars, Lm(kBatch, true), {kBatch, kSeq}, DType::kI32);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_EQ(loss->graph, 1);
  EXPECT_TRUE(loss->output_shape.empty());
  EXPECT_EQ(loss->output_dtype, DType::kF32);
  SetAdam(*vars);
  ApplyOptions train;
  train.graph = loss->graph;
  train.extra_inputs = {Ids(9)};
  train.apply_update = true;
  absl::StatusOr<HostTensor> logits = lm.Apply(*vars, Ids(0));
  ASSERT_TRUE(logits.ok()) << logits.status();
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 30; ++step) {
    absl::StatusOr<ValueAndGradResult> done = lm.LossValueAndGrad(*vars, Ids(0), train);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_EQ(done->aux.size(), 1u);
    EXPECT_EQ(done->aux[0].shape(), (Shape{kBatch, kSeq, kVocab}));
    if (step == 0) {
      first = done->value;
      EXPECT_EQ(done->aux[0].bytes(), logits->bytes());
    }
    last = done->value;
  }
  EXPECT_LT(last, 0.5 * first);
  // Without the optimizer step: the gradients come back, of every param.
  train.apply_update = false;
  absl::StatusOr<ValueAndGradResult> grads = lm.LossValueAndGrad(*vars, Ids(0), train);
  ASSERT_TRUE(grads.ok()) << grads.status();
  EXPECT_EQ(grads->grads.count("params/Embed_0/embedding"), 1u);
  EXPECT_EQ(grads->grads.count("params/Dense_0/kernel"), 1u);
  // Graph 0's y is no loss: it needs a dy.
  train.graph = 0;
  EXPECT_EQ(lm.LossValueAndGrad(*vars, Ids(0), train).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(VersionsClientTest, ALayerThatIsOneModuleTakesAGraphAroundIt) {
  DenseGeneral dense({kFeatures});
  const HostTensor x = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kF32, 1);
  absl::StatusOr<Variables> vars = dense.Init(*session_, 3, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  Graph scaled("Scaled", {kBatch, kSeq, kHidden}, DType::kF32);
  scaled.SetOutput(scaled.Scale(scaled.CallLayer(dense, {scaled.x()}), 2.0));
  absl::StatusOr<AddedGraph> added = AddGraph(*vars, scaled, {kBatch, kSeq, kHidden}, DType::kF32);
  ASSERT_TRUE(added.ok()) << added.status();
  ApplyOptions through;
  through.graph = added->graph;
  absl::StatusOr<HostTensor> plain = dense.Apply(*vars, x);
  absl::StatusOr<HostTensor> doubled = dense.Apply(*vars, x, through);
  ASSERT_TRUE(plain.ok() && doubled.ok());
  const std::vector<float> p = plain->ToFloats(), d = doubled->ToFloats();
  ASSERT_EQ(p.size(), d.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(d[i], 2.0f * p[i]) << i;
  // Another module is not the layer's.
  DenseGeneral wider({kFeatures + 1});
  Graph other("Other", {kBatch, kSeq, kHidden}, DType::kF32);
  other.SetOutput(other.CallLayer(wider, {other.x()}));
  absl::Status refused = AddGraph(*vars, other, {kBatch, kSeq, kHidden}, DType::kF32).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("graph.nodes[0] ().module"), std::string::npos) << refused;
}

TEST_F(VersionsClientTest, DeleteLayerGivesTheMemoryBack) {
  const int64_t empty = Memory();
  DenseGeneral dense({kFeatures});
  const HostTensor x = HostTensor::RandomNormal({kBatch, kSeq, kHidden}, DType::kF32, 1);
  absl::StatusOr<Variables> vars = dense.Init(*session_, 3, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  SetAdam(*vars);
  Variables kept = vars->Pinned();
  ApplyOptions train;
  train.apply_update = true;
  const HostTensor dy = HostTensor::RandomNormal({kBatch, kSeq, kFeatures}, DType::kF32, 2);
  ASSERT_TRUE(dense.ValueAndGrad(*vars, x, dy, train).ok());
  EXPECT_GT(Memory(), empty);
  ASSERT_TRUE(DeleteLayer(*vars).ok());
  EXPECT_EQ(Memory(), empty);
  EXPECT_EQ(dense.Apply(*vars, x).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(DeleteLayer(*vars).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace te::client
