// A layer's versions and graphs (session.h, contracts 9 and 10) on the CPU
// backend: graphs added over a layer's variables for another batch size or a
// loss with aux outputs, an old version readable and usable bit for bit
// after steps, release and DeleteLayer giving the memory back, failed and
// cancelled calls leaving the versions as they were, and bad requests
// naming their field. The CPU backend is deterministic, so "the same" is
// bit for bit throughout.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::AddNode;

using testing::RandomFloats;

constexpr int64_t kSeq = 3, kHidden = 8, kFeatures = 6, kVocab = 11;

te::v1::Tensor Ids(const std::vector<int64_t>& shape, uint64_t seed) {
  return testing::RandomIds(shape, seed, kVocab);
}

std::vector<float> Floats(const te::v1::Tensor& t) {
  std::vector<float> v(t.inline_data().size() / sizeof(float));
  std::memcpy(v.data(), t.inline_data().data(), t.inline_data().size());
  return v;
}

te::v1::LayerSpec FlaxDense(int64_t features) {
  te::v1::LayerSpec spec;
  spec.mutable_flax_dense()->set_features(features);
  return spec;
}

// x [batch, seq, hidden] -> Dense_0 -> [batch, seq * features]: the reshape
// fixes the batch it was traced for, as a traced Flax module's does.
te::v1::GraphSpec DenseFlatten(int64_t batch) {
  te::v1::GraphSpec g;
  *AddNode(&g, "Dense_0", {"x"}, {"h"})->mutable_module() = FlaxDense(kFeatures);
  te::v1::GraphSpec::Reshape* reshape = AddNode(&g, "reshape_0", {"h"}, {"y"})->mutable_reshape();
  reshape->add_shape(batch);
  reshape->add_shape(kSeq * kFeatures);
  g.add_outputs("y");
  return g;
}

// ids [batch, seq] -> Embed_0 -> Dense_0 -> logits [batch, seq, vocab].
te::v1::GraphSpec Lm(bool with_loss) {
  te::v1::GraphSpec g;
  te::v1::FlaxEmbed* embed = AddNode(&g, "Embed_0", {"x"}, {"h"})->mutable_module()->mutable_flax_embed();
  embed->set_num_embeddings(kVocab);
  embed->set_features(kHidden);
  *AddNode(&g, "Dense_0", {"h"}, {"logits"})->mutable_module() = FlaxDense(kVocab);
  if (!with_loss) {
    g.add_outputs("logits");
    return g;
  }
  AddNode(&g, "softmax_cross_entropy_0", {"logits", "extra_inputs[0]"}, {"loss"})
      ->mutable_softmax_cross_entropy();
  g.add_outputs("loss");
  g.add_outputs("logits");  // aux
  return g;
}

te::v1::LayerSpec TeDense() {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(kFeatures);
  return spec;
}

class VersionsTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(int64_t{1} << 30); }

  void Open(int64_t memory) {
    if (device_ == nullptr) device_ = *OpenCpuDevice();
    std::unique_ptr<Ops> ops = *device_->NewOps(memory);
    ops_ = ops.get();
    session_ = std::make_unique<Session>("versions", device_->info(), std::move(ops),
                                         SessionConfig(), te::v1::EMULATE, std::nullopt);
  }

  std::string Init(const te::v1::LayerSpec& spec, std::vector<int64_t> shape, uint64_t seed,
                   te::v1::DType dtype = te::v1::FLOAT32) {
    te::v1::InitLayerRequest request;
    *request.mutable_spec() = spec;
    request.set_seed(seed);
    request.set_input_dtype(dtype);
    request.mutable_input_shape()->Assign(shape.begin(), shape.end());
    te::v1::InitLayerResponse response;
    const absl::Status status = session_->InitLayer(request, &response);
    EXPECT_TRUE(status.ok()) << status;
    return response.layer_id();
  }
  std::string InitGraph(const te::v1::GraphSpec& graph, std::vector<int64_t> shape, uint64_t seed,
                        te::v1::DType dtype = te::v1::FLOAT32) {
    te::v1::LayerSpec spec;
    *spec.mutable_graph() = graph;
    return Init(spec, shape, seed, dtype);
  }

  absl::StatusOr<te::v1::AddGraphResponse> AddGraph(const std::string& layer,
                                                    const te::v1::GraphSpec& graph,
                                                    std::vector<int64_t> shape,
                                                    te::v1::DType dtype = te::v1::FLOAT32) {
    te::v1::AddGraphRequest request;
    request.set_layer_id(layer);
    *request.mutable_graph() = graph;
    request.set_input_dtype(dtype);
    request.mutable_input_shape()->Assign(shape.begin(), shape.end());
    te::v1::AddGraphResponse response;
    RETURN_IF_ERROR(session_->AddGraph(request, &response));
    return response;
  }

  absl::StatusOr<te::v1::ForwardResponse> Forward(const std::string& layer, const te::v1::Tensor& x,
                                                  int graph = 0, int64_t version = 0,
                                                  std::vector<te::v1::Tensor> extra = {}) {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer);
    *request.mutable_x() = x;
    for (te::v1::Tensor& e : extra) *request.add_extra_inputs() = e;
    request.set_deterministic(true);
    request.set_graph(graph);
    request.set_version(version);
    te::v1::ForwardResponse response;
    RETURN_IF_ERROR(session_->Forward(request, &response));
    return response;
  }

  // One micro-batch; dy unset for a loss graph.
  te::v1::ForwardBackwardRequest Step(const std::string& layer, const te::v1::Tensor& x,
                                      const std::optional<te::v1::Tensor>& dy, bool update) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer);
    request.set_deterministic(true);
    request.set_apply_update(update);
    request.set_return_grads(!update);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = x;
    if (dy) *mb->mutable_dy() = *dy;
    return request;
  }
  absl::StatusOr<te::v1::ForwardBackwardResponse> Run(const te::v1::ForwardBackwardRequest& request) {
    te::v1::ForwardBackwardResponse response;
    RETURN_IF_ERROR(session_->ForwardBackward(request, &response));
    return response;
  }

  // SetVariables of layer `to` with every variable of `from`'s newest
  // version; the version made (0 on failure).
  int64_t SetFrom(const std::string& to, const std::string& from) {
    te::v1::GetVariablesRequest get;
    get.set_layer_id(from);
    te::v1::GetVariablesResponse got;
    const absl::Status read = session_->GetVariables(get, &got);
    EXPECT_TRUE(read.ok()) << read;
    te::v1::SetVariablesRequest set;
    set.set_layer_id(to);
    *set.mutable_variables() = got.variables();
    te::v1::SetVariablesResponse response;
    const absl::Status written = session_->SetVariables(set, &response);
    EXPECT_TRUE(written.ok()) << written;
    return written.ok() ? response.version() : 0;
  }

  void SetAdam(const std::string& layer) {
    te::v1::SetOptimizerRequest request;
    request.set_layer_id(layer);
    request.mutable_optimizer()->mutable_adam()->mutable_learning_rate()->set_constant(0.05);
    te::v1::SetOptimizerResponse response;
    const absl::Status status = session_->SetOptimizer(request, &response);
    ASSERT_TRUE(status.ok()) << status;
  }

  // "collection/path" -> bytes, of `version` (0: the newest).
  absl::StatusOr<std::map<std::string, std::string>> Values(const std::string& layer,
                                                           int64_t version = 0,
                                                           int64_t* read = nullptr) {
    te::v1::GetVariablesRequest request;
    request.set_layer_id(layer);
    request.set_version(version);
    te::v1::GetVariablesResponse response;
    RETURN_IF_ERROR(session_->GetVariables(request, &response));
    if (read != nullptr) *read = response.version();
    std::map<std::string, std::string> out;
    for (const te::v1::Variable& v : response.variables()) {
      out[v.collection() + "/" + v.path()] = v.value().inline_data();
    }
    return out;
  }
  int64_t Newest(const std::string& layer) {
    int64_t read = -1;
    EXPECT_TRUE(Values(layer, 0, &read).ok());
    return read;
  }

  absl::Status Release(const std::string& layer, const std::vector<int64_t>& versions) {
    te::v1::ReleaseVersionsRequest request;
    request.set_layer_id(layer);
    for (int64_t v : versions) request.add_versions(v);
    return session_->ReleaseVersions(request);
  }

  // How far `request` raises the session's bytes in use above what they
  // were before it, at its peak.
  int64_t PeakRise(const te::v1::ForwardBackwardRequest& request) {
    const int64_t before = session_->bytes_in_use();
    ops_->ResetPeakBytesInUse();
    const absl::Status status = Run(request).status();
    EXPECT_TRUE(status.ok()) << status;
    return ops_->peak_bytes_in_use() - before;
  }

  std::unique_ptr<Device> device_;
  Ops* ops_ = nullptr;  // the session's
  std::unique_ptr<Session> session_;
};

#define ASSERT_OK_AND_ASSIGN(lhs, expr)            \
  auto lhs##_or = (expr);                          \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status(); \
  auto lhs = *std::move(lhs##_or)

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& part) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(part), std::string::npos) << status << "\nwant: " << part;
}

// Flax applies a module inited on one batch to any: a graph traced for
// batch 4 refuses batch 2, and the graph traced for 2 over the same
// variables gives what a layer made for 2 with equal params gives.
TEST_F(VersionsTest, TwoBatchSizesThroughTwoGraphsOverOneLayersVariables) {
  const std::string a = InitGraph(DenseFlatten(4), {4, kSeq, kHidden}, 7);
  const te::v1::Tensor x2 = RandomFloats({2, kSeq, kHidden}, 1);
  ExpectError(Forward(a, x2).status(), absl::StatusCode::kInvalidArgument, "x.shape [2, 3, 8]");
  ASSERT_OK_AND_ASSIGN(added, AddGraph(a, DenseFlatten(2), {2, kSeq, kHidden}));
  EXPECT_EQ(added.graph(), 1);
  EXPECT_EQ(std::vector<int64_t>(added.output_shape().begin(), added.output_shape().end()),
            (std::vector<int64_t>{2, kSeq * kFeatures}));
  // Equal graphs are one graph.
  ASSERT_OK_AND_ASSIGN(again, AddGraph(a, DenseFlatten(2), {2, kSeq, kHidden}));
  EXPECT_EQ(again.graph(), 1);
  ASSERT_OK_AND_ASSIGN(first, AddGraph(a, DenseFlatten(4), {4, kSeq, kHidden}));
  EXPECT_EQ(first.graph(), 0);

  // Layer b: made for batch 2, then given a's params.
  const std::string b = InitGraph(DenseFlatten(2), {2, kSeq, kHidden}, 9);
  EXPECT_EQ(SetFrom(b, a), 2);

  ASSERT_OK_AND_ASSIGN(ya, Forward(a, x2, /*graph=*/1));
  ASSERT_OK_AND_ASSIGN(yb, Forward(b, x2));
  EXPECT_EQ(ya.y().inline_data(), yb.y().inline_data());
  EXPECT_EQ(ya.version(), 1);  // a forward changes nothing

  const te::v1::Tensor dy = RandomFloats({2, kSeq * kFeatures}, 2);
  te::v1::ForwardBackwardRequest step_a = Step(a, x2, dy, false);
  step_a.set_graph(1);
  ASSERT_OK_AND_ASSIGN(ga, Run(step_a));
  ASSERT_OK_AND_ASSIGN(gb, Run(Step(b, x2, dy, false)));
  EXPECT_EQ(ga.values(0), gb.values(0));
  ASSERT_EQ(ga.grads_size(), gb.grads_size());
  for (int i = 0; i < ga.grads_size(); ++i) {
    EXPECT_EQ(ga.grads(i).path(), gb.grads(i).path());
    EXPECT_EQ(ga.grads(i).value().inline_data(), gb.grads(i).value().inline_data()) << i;
  }
  // Batch 4 still runs through graph 0.
  EXPECT_TRUE(Forward(a, RandomFloats({4, kSeq, kHidden}, 3)).ok());
}

// A layer that is one module takes any batch, and a graph whose module node
// "" is that module reads its variables.
TEST_F(VersionsTest, OneModuleLayerTakesAnyBatchAndAGraphOverItsModule) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 5);
  EXPECT_TRUE(Forward(layer, RandomFloats({3, 5, kHidden}, 4)).ok());
  te::v1::GraphSpec g;
  *AddNode(&g, "", {"x"}, {"h"})->mutable_module() = TeDense();
  AddNode(&g, "scale_0", {"h"}, {"y"})->mutable_scale()->set_factor(2.0);
  g.add_outputs("y");
  ASSERT_OK_AND_ASSIGN(added, AddGraph(layer, g, {3, kSeq, kHidden}));
  const te::v1::Tensor x = RandomFloats({3, kSeq, kHidden}, 6);
  ASSERT_OK_AND_ASSIGN(plain, Forward(layer, x, 0));
  ASSERT_OK_AND_ASSIGN(doubled, Forward(layer, x, added.graph()));
  const std::vector<float> p = Floats(plain.y()), d = Floats(doubled.y());
  ASSERT_EQ(p.size(), d.size());
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(d[i], 2.0f * p[i]) << i;

  // Not the layer's module: by name, or by spec.
  te::v1::GraphSpec named = g;
  named.mutable_nodes(0)->set_name("DenseGeneral_0");
  ExpectError(AddGraph(layer, named, {3, kSeq, kHidden}).status(),
              absl::StatusCode::kInvalidArgument, "graph.nodes[0] (DenseGeneral_0): layer ");
  te::v1::GraphSpec other = g;
  other.mutable_nodes(0)->mutable_module()->mutable_dense_general()->set_features(0, kFeatures + 1);
  ExpectError(AddGraph(layer, other, {3, kSeq, kHidden}).status(),
              absl::StatusCode::kInvalidArgument, "graph.nodes[0] ().module: not the LayerSpec");
  // x that does not fit the module's kernel.
  ExpectError(AddGraph(layer, g, {3, kSeq, kHidden + 1}).status(),
              absl::StatusCode::kInvalidArgument, "graph: for x [3, 3, 9]");
}

// A layer remembers what each input shape needs of a version, up to a bound:
// a client sending ever new shapes (prompts of every length) keeps getting
// the same answers past it, and a shape seen before the memo started again
// still reads the same version the same way.
TEST_F(VersionsTest, ALayerTakesMoreInputShapesThanItRemembers) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 5);
  const te::v1::Tensor first = RandomFloats({1, kSeq, kHidden}, 4);
  ASSERT_OK_AND_ASSIGN(before, Forward(layer, first));
  for (int64_t batch = 2; batch <= static_cast<int64_t>(kMaxRememberedSpecs) + 10; ++batch) {
    const absl::StatusOr<te::v1::ForwardResponse> y =
        Forward(layer, RandomFloats({batch, kSeq, kHidden}, static_cast<uint64_t>(batch)));
    ASSERT_TRUE(y.ok()) << "batch " << batch << ": " << y.status();
    ASSERT_EQ(y->y().shape(0), batch);
  }
  ASSERT_OK_AND_ASSIGN(after, Forward(layer, first));
  EXPECT_EQ(Floats(after.y()), Floats(before.y()));
  // A shape the layer cannot take is still refused, naming x.
  ExpectError(Forward(layer, RandomFloats({1, kSeq, kHidden + 1}, 9)).status(),
              absl::StatusCode::kInvalidArgument, "x.shape [1, 3, 9]");
}

// jax.value_and_grad(loss_fn, has_aux=True): a graph over the layer's
// modules whose y is a float32 scalar needs no dy, returns its aux outputs,
// and trains the variables graph 0 applies.
TEST_F(VersionsTest, LossGraphWithAuxOutputsTrainsTheLayersVariables) {
  const std::vector<int64_t> shape = {2, kSeq};
  const std::string layer = InitGraph(Lm(false), shape, 3, te::v1::INT32);
  ASSERT_OK_AND_ASSIGN(loss_graph, AddGraph(layer, Lm(true), shape, te::v1::INT32));
  EXPECT_EQ(loss_graph.graph(), 1);
  EXPECT_EQ(loss_graph.output_shape_size(), 0);
  EXPECT_EQ(loss_graph.output_dtype(), te::v1::FLOAT32);
  SetAdam(layer);
  const te::v1::Tensor x = Ids(shape, 1), labels = Ids(shape, 2);

  ASSERT_OK_AND_ASSIGN(logits, Forward(layer, x, 0));
  ASSERT_OK_AND_ASSIGN(loss, Forward(layer, x, 1, 0, {labels}));
  ASSERT_EQ(loss.outputs_size(), 1);
  EXPECT_EQ(loss.outputs(0).inline_data(), logits.y().inline_data());
  EXPECT_FALSE(loss.has_ln_out());

  double first = 0.0, last = 0.0;
  for (int step = 0; step < 30; ++step) {
    te::v1::ForwardBackwardRequest request = Step(layer, x, std::nullopt, true);
    request.set_graph(1);
    request.set_return_outputs(true);
    *request.mutable_micro_batches(0)->add_extra_inputs() = labels;
    ASSERT_OK_AND_ASSIGN(done, Run(request));
    ASSERT_EQ(done.outputs_size(), 1);
    ASSERT_EQ(done.outputs(0).outputs_size(), 1);
    EXPECT_EQ(done.outputs(0).outputs(0).shape_size(), 3);
    EXPECT_EQ(done.version(), step + 2);
    if (step == 0) {
      first = done.values(0);
      EXPECT_FLOAT_EQ(static_cast<float>(first), Floats(loss.y())[0]);
      EXPECT_EQ(done.outputs(0).outputs(0).inline_data(), logits.y().inline_data());
    }
    last = done.values(0);
  }
  EXPECT_LT(last, 0.5 * first);
  // Graph 0 applies the trained params; version 1 still the initial ones.
  ASSERT_OK_AND_ASSIGN(trained, Forward(layer, x, 0));
  EXPECT_NE(trained.y().inline_data(), logits.y().inline_data());
  ASSERT_OK_AND_ASSIGN(initial, Forward(layer, x, 0, 1));
  EXPECT_EQ(initial.y().inline_data(), logits.y().inline_data());
  // A loss takes no target.
  te::v1::ForwardBackwardRequest bad = Step(layer, x, std::nullopt, true);
  bad.set_graph(1);
  *bad.mutable_micro_batches(0)->add_extra_inputs() = labels;
  *bad.mutable_micro_batches(0)->mutable_target() = RandomFloats({}, 1);
  ExpectError(Run(bad).status(), absl::StatusCode::kInvalidArgument, "micro_batches[0].target");
}

TEST_F(VersionsTest, OldVersionStaysReadableAndUsableAfterSteps) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 11);
  SetAdam(layer);
  const te::v1::Tensor x = RandomFloats({2, kSeq, kHidden}, 1);
  const te::v1::Tensor dy = RandomFloats({2, kSeq, kFeatures}, 2);
  ASSERT_OK_AND_ASSIGN(v1, Values(layer, 1));
  ASSERT_OK_AND_ASSIGN(y1, Forward(layer, x));
  std::map<std::string, std::string> v2;
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK_AND_ASSIGN(done, Run(Step(layer, x, dy, true)));
    EXPECT_EQ(done.version(), step + 2);
    if (step == 0) v2 = *Values(layer, 2);
  }
  EXPECT_EQ(Newest(layer), 4);
  ASSERT_OK_AND_ASSIGN(v1_after, Values(layer, 1));
  EXPECT_EQ(v1_after, v1);
  ASSERT_OK_AND_ASSIGN(y1_after, Forward(layer, x, 0, 1));
  EXPECT_EQ(y1_after.y().inline_data(), y1.y().inline_data());
  ASSERT_OK_AND_ASSIGN(newest, Forward(layer, x));
  EXPECT_NE(newest.y().inline_data(), y1.y().inline_data());
  // A step from version 1 again makes version 2's variables again.
  te::v1::ForwardBackwardRequest again = Step(layer, x, dy, true);
  again.set_version(1);
  ASSERT_OK_AND_ASSIGN(redo, Run(again));
  EXPECT_EQ(redo.version(), 5);
  EXPECT_EQ(*Values(layer, 5), v2);
  EXPECT_EQ(*Values(layer, 1), v1);
}

TEST_F(VersionsTest, ReleaseAndDeleteGiveTheMemoryBack) {
  const int64_t empty = session_->bytes_in_use();
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 11);
  SetAdam(layer);
  const te::v1::Tensor x = RandomFloats({2, kSeq, kHidden}, 1);
  const te::v1::Tensor dy = RandomFloats({2, kSeq, kFeatures}, 2);
  ASSERT_TRUE(Run(Step(layer, x, dy, true)).ok());
  ASSERT_TRUE(Release(layer, {1}).ok());
  const int64_t one_version = session_->bytes_in_use();
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(Run(Step(layer, x, dy, true)).ok());
  EXPECT_GT(session_->bytes_in_use(), one_version);
  // Unknown and released numbers are ignored.
  ASSERT_TRUE(Release(layer, {1, 2, 3, 4, 99}).ok());
  EXPECT_EQ(session_->bytes_in_use(), one_version);
  EXPECT_EQ(Newest(layer), 5);
  ExpectError(Forward(layer, x, 0, 3).status(), absl::StatusCode::kNotFound,
              "version: layer layer-1 has no version 3 (released)");
  // A kept forward holds what it read through a release.
  te::v1::ForwardRequest keep;
  keep.set_layer_id(layer);
  *keep.mutable_x() = x;
  keep.set_keep_for_backward(true);
  te::v1::ForwardResponse kept;
  ASSERT_TRUE(session_->Forward(keep, &kept).ok());
  EXPECT_EQ(kept.version(), 5);
  ASSERT_TRUE(Release(layer, {5}).ok());
  ExpectError(Forward(layer, x).status(), absl::StatusCode::kNotFound, "every version");
  te::v1::BackwardRequest backward;
  backward.set_forward_id(kept.forward_id());
  *backward.mutable_dy() = dy;
  backward.set_keep_grads(true);
  te::v1::BackwardResponse gradients;
  ASSERT_TRUE(session_->Backward(backward, &gradients).ok());
  EXPECT_EQ(gradients.version(), 6);
  ASSERT_OK_AND_ASSIGN(with_grads, Values(layer, 6));
  EXPECT_EQ(with_grads.count("grads/kernel"), 1u);
  // DeleteLayer frees every version, graph and optimizer state of it.
  te::v1::GraphSpec g;
  *AddNode(&g, "", {"x"}, {"h"})->mutable_module() = TeDense();
  AddNode(&g, "scale_0", {"h"}, {"y"})->mutable_scale()->set_factor(0.5);
  g.add_outputs("y");
  ASSERT_TRUE(AddGraph(layer, g, {2, kSeq, kHidden}).ok());
  ASSERT_TRUE(session_->Forward(keep, &kept).ok());
  te::v1::DeleteLayerRequest remove;
  remove.set_layer_id(layer);
  ASSERT_TRUE(session_->DeleteLayer(remove).ok());
  EXPECT_EQ(session_->bytes_in_use(), empty);
  te::v1::SessionInfo info;
  session_->GetSessionInfo(&info);
  EXPECT_EQ(info.layers(), 0);
  EXPECT_EQ(info.saved_forwards(), 0);
  ExpectError(session_->DeleteLayer(remove), absl::StatusCode::kNotFound, "layer_id");
  ExpectError(Release(layer, {6}), absl::StatusCode::kNotFound, "layer_id");
}

TEST_F(VersionsTest, FailedAndCancelledCallsLeaveTheVersionsAsTheyWere) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 11);
  SetAdam(layer);
  const te::v1::Tensor x = RandomFloats({2, kSeq, kHidden}, 1);
  const te::v1::Tensor dy = RandomFloats({2, kSeq, kFeatures}, 2);
  // A first step makes the optimizer's plan, which later steps keep.
  ASSERT_TRUE(Run(Step(layer, x, dy, true)).ok());
  ASSERT_TRUE(Release(layer, {1}).ok());
  ASSERT_OK_AND_ASSIGN(before, Values(layer));
  const int64_t bytes = session_->bytes_in_use();
  // A bad second micro-batch.
  te::v1::ForwardBackwardRequest bad = Step(layer, x, dy, true);
  *bad.add_micro_batches() = bad.micro_batches(0);
  *bad.mutable_micro_batches(1)->mutable_dy() = RandomFloats({2, kSeq, kFeatures + 1}, 3);
  ExpectError(Run(bad).status(), absl::StatusCode::kInvalidArgument, "micro_batches[1].dy");
  EXPECT_EQ(Newest(layer), 2);
  EXPECT_EQ(*Values(layer), before);
  EXPECT_EQ(session_->bytes_in_use(), bytes);
  // A step whose client went away after it succeeded is undone: its version goes.
  session_->BeginCall();
  ASSERT_OK_AND_ASSIGN(done, Run(Step(layer, x, dy, true)));
  EXPECT_EQ(done.version(), 3);
  session_->EndCall(/*undo=*/true);
  EXPECT_EQ(Newest(layer), 2);
  EXPECT_EQ(*Values(layer), before);
  EXPECT_EQ(session_->bytes_in_use(), bytes);
  ExpectError(Values(layer, 3).status(), absl::StatusCode::kNotFound, "version");
  // The next version number is not reused.
  ASSERT_OK_AND_ASSIGN(next, Run(Step(layer, x, dy, true)));
  EXPECT_EQ(next.version(), 4);
}

// ForwardBackwardRequest.donate: the step releases the version it read and
// its update copies nothing for it, with the same values a non-donating
// step makes; the other versions still get their copies; a step refused
// before its update releases nothing; an undone donating step keeps its new
// version; donate without apply_update is refused naming the field.
TEST_F(VersionsTest, ADonatingStepReleasesTheVersionItReadAndCopiesNothingForIt) {
  const te::v1::Tensor x = RandomFloats({2, kSeq, kHidden}, 1);
  const te::v1::Tensor dy = RandomFloats({2, kSeq, kFeatures}, 2);
  const std::string kept = Init(TeDense(), {2, kSeq, kHidden}, 11);
  const std::string donor = Init(TeDense(), {2, kSeq, kHidden}, 11);
  SetAdam(kept);
  SetAdam(donor);
  te::v1::ForwardBackwardRequest donate = Step(donor, x, dy, true);
  donate.set_donate(true);
  // A first step of each makes the optimizer's plan; version 1 is then released.
  ASSERT_TRUE(Run(Step(kept, x, dy, true)).ok());
  ASSERT_TRUE(Run(donate).ok());
  ASSERT_TRUE(Release(kept, {1}).ok());
  ExpectError(Values(donor, 1).status(), absl::StatusCode::kNotFound, "version");
  ASSERT_OK_AND_ASSIGN(v2, Values(donor, 2));
  EXPECT_EQ(*Values(kept, 2), v2);

  // The same step on each, version 2 read: the kept one copies its params and
  // moments for version 2, which it holds after, the donating one nothing,
  // and both make the same values.
  const int64_t before = session_->bytes_in_use();
  const int64_t kept_rise = PeakRise(Step(kept, x, dy, true));
  const int64_t copied = session_->bytes_in_use() - before;
  EXPECT_GT(copied, 0);
  const int64_t donated_rise = PeakRise(donate);
  EXPECT_EQ(session_->bytes_in_use() - before, copied);
  // At the kept step's peak its copies sit beside the gradients and the
  // update's; the donating step's peak is its forward's and backward's.
  EXPECT_LT(donated_rise, kept_rise);
  EXPECT_EQ(Newest(donor), 3);
  EXPECT_EQ(*Values(donor, 3), *Values(kept, 3));
  EXPECT_EQ(*Values(kept, 2), v2);
  ExpectError(Values(donor, 2).status(), absl::StatusCode::kNotFound,
              "layer layer-2 has no version 2 (released)");

  // An older version still held gets its copies from a donating step.
  ASSERT_OK_AND_ASSIGN(v3, Values(donor, 3));
  ASSERT_TRUE(Run(Step(donor, x, dy, true)).ok());  // 4, version 3 kept
  ASSERT_TRUE(Run(donate).ok());                     // 5 from 4, which goes
  EXPECT_EQ(*Values(donor, 3), v3);
  ExpectError(Values(donor, 4).status(), absl::StatusCode::kNotFound, "version");
  ASSERT_TRUE(Release(donor, {3}).ok());

  // Refused before its update: nothing released.
  te::v1::ForwardBackwardRequest bad = donate;
  *bad.mutable_micro_batches(0)->mutable_dy() = RandomFloats({2, kSeq, kFeatures + 1}, 3);
  ExpectError(Run(bad).status(), absl::StatusCode::kInvalidArgument, "micro_batches[0]");
  ASSERT_OK_AND_ASSIGN(v5, Values(donor, 5));

  // Undone (its client went away): the new version stays, as version 5 is gone.
  session_->BeginCall();
  ASSERT_OK_AND_ASSIGN(undone, Run(donate));
  session_->EndCall(/*undo=*/true);
  EXPECT_EQ(undone.version(), 6);
  EXPECT_EQ(Newest(donor), 6);
  ExpectError(Values(donor, 5).status(), absl::StatusCode::kNotFound, "version");
  EXPECT_NE(*Values(donor, 6), v5);

  te::v1::ForwardBackwardRequest no_update = Step(donor, x, dy, false);
  no_update.set_donate(true);
  ExpectError(Run(no_update).status(), absl::StatusCode::kInvalidArgument, "donate");
  EXPECT_EQ(Newest(donor), 6);
}

// The copies a step needs while older versions hold what it writes count
// against the session's memory: RESOURCE_EXHAUSTED naming the way out, and
// nothing changed. A step that makes no version still fits.
// Contract 6: a call's undo removes exactly what it created (a layer, a
// graph, a version, a kept forward, a resident output) and nothing it found;
// version numbers stay used.
TEST_F(VersionsTest, AnUndoneCallRemovesExactlyWhatItCreated) {
  const std::string a = InitGraph(DenseFlatten(4), {4, kSeq, kHidden}, 7);
  ASSERT_OK_AND_ASSIGN(values, Values(a));
  te::v1::SessionInfo before;
  session_->GetSessionInfo(&before);

  session_->BeginCall();
  const std::string b = InitGraph(DenseFlatten(2), {2, kSeq, kHidden}, 9);
  ASSERT_OK_AND_ASSIGN(added, AddGraph(a, DenseFlatten(2), {2, kSeq, kHidden}));
  EXPECT_EQ(added.graph(), 1);
  te::v1::ForwardRequest keep;
  keep.set_layer_id(a);
  *keep.mutable_x() = RandomFloats({4, kSeq, kHidden}, 1);
  keep.set_keep_for_backward(true);
  keep.set_keep_outputs(true);
  te::v1::ForwardResponse kept;
  ASSERT_TRUE(session_->Forward(keep, &kept).ok());
  ASSERT_FALSE(kept.y().resident_id().empty());
  EXPECT_EQ(SetFrom(a, a), 2);
  te::v1::SessionInfo during;
  session_->GetSessionInfo(&during);
  EXPECT_EQ(during.layers(), 2);
  EXPECT_EQ(during.saved_forwards(), 1);
  EXPECT_EQ(during.resident_tensors(), 1);
  session_->EndCall(/*undo=*/true);

  te::v1::SessionInfo after;
  session_->GetSessionInfo(&after);
  EXPECT_EQ(after.layers(), before.layers());
  EXPECT_EQ(after.saved_forwards(), before.saved_forwards());
  EXPECT_EQ(after.resident_tensors(), before.resident_tensors());
  EXPECT_EQ(after.memory_bytes(), before.memory_bytes());
  EXPECT_EQ(Newest(a), 1);
  EXPECT_EQ(*Values(a), values);
  ExpectError(Values(b).status(), absl::StatusCode::kNotFound, "layer_id");
  ExpectError(Forward(a, RandomFloats({2, kSeq, kHidden}, 1), /*graph=*/1).status(),
              absl::StatusCode::kInvalidArgument, "graph");
  // A call outside BeginCall and EndCall is kept; version 2 stays used.
  EXPECT_EQ(SetFrom(a, a), 3);
  session_->BeginCall();
  session_->EndCall(/*undo=*/true);  // records nothing from before it
  EXPECT_EQ(Newest(a), 3);
}

// A call that ended well but whose answer never reached its client (its
// deadline passed on the way) names its new layer, saved forward and
// resident output in that answer alone: the session forgets them after,
// and keeps what later calls built on (the version a step made).
TEST_F(VersionsTest, AnUnansweredCallsIdsAreForgottenAndItsVersionsKept) {
  const std::string a = InitGraph(DenseFlatten(4), {4, kSeq, kHidden}, 7);
  te::v1::SessionInfo before;
  session_->GetSessionInfo(&before);

  session_->BeginCall();
  const std::string b = InitGraph(DenseFlatten(2), {2, kSeq, kHidden}, 9);
  te::v1::ForwardRequest keep;
  keep.set_layer_id(a);
  *keep.mutable_x() = RandomFloats({4, kSeq, kHidden}, 1);
  keep.set_keep_for_backward(true);
  keep.set_keep_outputs(true);
  te::v1::ForwardResponse kept;
  ASSERT_TRUE(session_->Forward(keep, &kept).ok());
  EXPECT_EQ(SetFrom(a, a), 2);
  const std::vector<std::string> ids = session_->CallAnswerIds();
  EXPECT_EQ(ids, (std::vector<std::string>{b, kept.y().resident_id(), kept.forward_id()}));
  session_->EndCall(/*undo=*/false);

  session_->ForgetUnanswered(ids);
  te::v1::SessionInfo after;
  session_->GetSessionInfo(&after);
  EXPECT_EQ(after.layers(), before.layers());
  EXPECT_EQ(after.saved_forwards(), before.saved_forwards());
  EXPECT_EQ(after.resident_tensors(), before.resident_tensors());
  ExpectError(Values(b).status(), absl::StatusCode::kNotFound, "layer_id");
  EXPECT_EQ(Newest(a), 2);
  // Outside a call there is nothing to name.
  EXPECT_TRUE(session_->CallAnswerIds().empty());
}

// A backend whose library workspace grows on demand, as CUDA's does.
class ScratchOps : public CpuOps {
 public:
  absl::Status Grow(int64_t bytes) {
    ASSIGN_OR_RETURN(scratch_, Allocate(DType::kBool, {bytes}));
    return absl::OkStatus();
  }
  int64_t scratch_bytes() const override { return scratch_.defined() ? scratch_.dim(0) : 0; }
  absl::Status ShrinkScratch(int64_t bytes) override {
    if (bytes >= scratch_bytes()) return absl::OkStatus();
    scratch_ = Tensor();
    return bytes > 0 ? Grow(bytes) : absl::OkStatus();
  }

 private:
  Tensor scratch_;
};

// Contract 6: a workspace that an undone call grew goes back to its size
// before the call; one a kept call grew stays.
TEST(SessionUndoTest, AnUndoneCallGivesBackTheWorkspaceItGrew) {
  auto owned = std::make_unique<ScratchOps>();
  ScratchOps* ops = owned.get();
  ops->set_memory_limit(int64_t{1} << 30);
  auto device = *OpenCpuDevice();
  Session session("scratch", device->info(), std::move(owned), SessionConfig(), te::v1::EMULATE,
                  std::nullopt);
  ASSERT_TRUE(ops->Grow(1 << 10).ok());
  const int64_t before = session.bytes_in_use();
  session.BeginCall();
  ASSERT_TRUE(ops->Grow(1 << 20).ok());
  EXPECT_GT(session.bytes_in_use(), before);
  session.EndCall(/*undo=*/true);
  EXPECT_EQ(session.bytes_in_use(), before);
  EXPECT_EQ(ops->scratch_bytes(), 1 << 10);
  session.BeginCall();
  ASSERT_TRUE(ops->Grow(1 << 20).ok());
  session.EndCall(/*undo=*/false);
  EXPECT_EQ(ops->scratch_bytes(), 1 << 20);
}

TEST_F(VersionsTest, AStepWhoseVersionDoesNotFitIsResourceExhausted) {
  // Params and Adam's moments of 64 x 64 (48 KiB to copy); the step's own
  // tensors (its gradients, 16 KiB, and a few hundred bytes more) fit the
  // 24 KiB left.
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(64);
  const std::vector<int64_t> shape = {1, 1, 64};
  const std::string probe = Init(spec, shape, 11);
  SetAdam(probe);
  Open(session_->bytes_in_use() + (24 << 10));
  const std::string layer = Init(spec, shape, 11);
  SetAdam(layer);
  const te::v1::Tensor x = RandomFloats(shape, 1);
  const te::v1::Tensor dy = RandomFloats(shape, 2);
  ASSERT_OK_AND_ASSIGN(before, Values(layer));
  const int64_t bytes = session_->bytes_in_use();
  ExpectError(Run(Step(layer, x, dy, true)).status(), absl::StatusCode::kResourceExhausted,
              "release versions no longer used (ReleaseVersions)");
  EXPECT_EQ(Newest(layer), 1);
  EXPECT_EQ(*Values(layer), before);
  EXPECT_EQ(session_->bytes_in_use(), bytes);
  te::v1::ForwardBackwardRequest dropped = Step(layer, x, dy, false);
  dropped.set_return_grads(false);
  dropped.set_discard_grads(true);
  ASSERT_OK_AND_ASSIGN(ran, Run(dropped));
  EXPECT_EQ(ran.version(), 1);
}

TEST_F(VersionsTest, SetVariablesAndSetOptimizerAcrossVersions) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 11);
  ASSERT_OK_AND_ASSIGN(v1, Values(layer));
  te::v1::SetVariablesRequest set;
  set.set_layer_id(layer);
  te::v1::Variable* bias = set.add_variables();
  bias->set_collection("params");
  bias->set_path("bias");
  *bias->mutable_value() = RandomFloats({kFeatures}, 4);
  te::v1::SetVariablesResponse response;
  ASSERT_TRUE(session_->SetVariables(set, &response).ok());
  EXPECT_EQ(response.version(), 2);
  EXPECT_EQ(*Values(layer, 1), v1);
  EXPECT_EQ(Values(layer, 2)->at("params/bias"), bias->value().inline_data());
  EXPECT_EQ(Values(layer, 2)->at("params/kernel"), v1.at("params/kernel"));
  // From version 1 again: another version, version 2 as it was.
  set.set_version(1);
  *bias->mutable_value() = RandomFloats({kFeatures}, 5);
  ASSERT_TRUE(session_->SetVariables(set, &response).ok());
  EXPECT_EQ(response.version(), 3);
  EXPECT_NE(Values(layer, 2)->at("params/bias"), Values(layer, 3)->at("params/bias"));
  // tx.init gives every version the fresh state.
  SetAdam(layer);
  for (int64_t v : {1, 2, 3}) EXPECT_EQ(Values(layer, v)->count("opt_state/count"), 1u) << v;
}

TEST_F(VersionsTest, BadRequestsNameTheirField) {
  const std::string layer = Init(TeDense(), {2, kSeq, kHidden}, 11);
  const te::v1::Tensor x = RandomFloats({2, kSeq, kHidden}, 1);
  ExpectError(Forward(layer, x, 1).status(), absl::StatusCode::kInvalidArgument,
              "graph: 1; layer layer-1 has graphs 0 to 0");
  ExpectError(Forward(layer, x, -1).status(), absl::StatusCode::kInvalidArgument, "graph: -1");
  ExpectError(Forward(layer, x, 0, -2).status(), absl::StatusCode::kInvalidArgument, "version: -2");
  ExpectError(Forward(layer, x, 0, 7).status(), absl::StatusCode::kNotFound,
              "version: layer layer-1 has no version 7 (none made yet)");
  ExpectError(Values(layer, 7).status(), absl::StatusCode::kNotFound, "version");
  te::v1::GraphSpec g;
  *AddNode(&g, "", {"x"}, {"h"})->mutable_module() = TeDense();
  te::v1::GraphSpec::Param* w = AddNode(&g, "w", {}, {"w"})->mutable_param();
  w->add_shape(kFeatures);
  AddNode(&g, "add_0", {"h", "w"}, {"y"})->mutable_add();
  g.add_outputs("y");
  ExpectError(AddGraph(layer, g, {2, kSeq, kHidden}).status(), absl::StatusCode::kInvalidArgument,
              "graph.nodes[1] (w): layer layer-1 has no param params/w");
  g.mutable_nodes(1)->set_name("bias");
  g.mutable_nodes(1)->mutable_param()->set_shape(0, kFeatures + 1);
  ExpectError(AddGraph(layer, g, {2, kSeq, kHidden}).status(), absl::StatusCode::kInvalidArgument,
              "graph.nodes[1] (bias).param: [7] float32, but layer layer-1's params/bias is [6]");
  te::v1::GraphSpec cyclic;
  AddNode(&cyclic, "scale_0", {"y"}, {"z"})->mutable_scale()->set_factor(1.0);
  AddNode(&cyclic, "scale_1", {"z"}, {"y"})->mutable_scale()->set_factor(1.0);
  cyclic.add_outputs("y");
  ExpectError(AddGraph(layer, cyclic, {2, kSeq, kHidden}).status(),
              absl::StatusCode::kInvalidArgument, "graph.");
  ExpectError(AddGraph(layer, DenseFlatten(2), {}).status(), absl::StatusCode::kInvalidArgument,
              "graph.nodes[0] (Dense_0): layer layer-1 has no module named \"Dense_0\"");
  te::v1::GraphSpec own;
  *AddNode(&own, "", {"x"}, {"y"})->mutable_module() = TeDense();
  own.add_outputs("y");
  ExpectError(AddGraph(layer, own, {}).status(), absl::StatusCode::kInvalidArgument,
              "input_shape: empty");
  ExpectError(AddGraph("layer-9", own, {2, kSeq, kHidden}).status(), absl::StatusCode::kNotFound,
              "layer_id");
}

}  // namespace
}  // namespace te::session
