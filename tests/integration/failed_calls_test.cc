// A call that fails leaves its session byte for byte as it was, over real
// sockets against the real te_server: a step that runs out of the session's
// memory part way, one whose deadline passes while it runs, one its client
// cancels, one that ends too near its deadline for its answer, and hostile
// sizes. Each is checked through GetVariables (params,
// fp8_metas, grads) and GetSessionInfo; a retry after a failed step moves the
// FP8 state exactly once (equal to a session that ran the step once).
#include <grpcpp/grpcpp.h>

#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kHidden = 64;
// LayerNormMLP with a wide FC1: a micro-batch of 4096 tokens needs 1 GiB of
// float32 activations, more than the suite's 1 GiB session holds, while its
// x is 1 MiB and the parameters 32 MiB.
constexpr int64_t kIntermediate = 65536;
// The long step that a deadline or a cancel interrupts.
constexpr int kLongMicroBatches = 12;
constexpr int64_t kLongTokens = 16;

te::v1::Autocast Fp8() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  return autocast;
}

struct Snapshot {
  std::map<std::string, std::string> variables;  // name -> dtype, shape and bytes
  te::v1::SessionInfo info;
};

class FailedCallsTest : public ServerSuite {
 protected:
  void SetUp() override {
    ServerSuite::SetUp();
    if (HasFatalFailure()) return;
    layer_id_ = InitMlp(session_);
  }

  std::string InitMlp(const te::v1::SessionRef& session) {
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session;
    te::v1::LayerNormMLP* mlp = init.mutable_spec()->mutable_layer_norm_mlp();
    mlp->set_intermediate_dim(kIntermediate);
    mlp->add_activations("gelu");
    mlp->set_intermediate_dropout_rate(0.0f);
    init.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : {1, 8, static_cast<int>(kHidden)}) init.add_input_shape(d);
    init.set_seed(3);
    *init.mutable_autocast() = Fp8();
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, init, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response.layer_id();
  }

  static te::v1::MicroBatch MicroBatch(int64_t tokens, uint32_t seed) {
    te::v1::MicroBatch mb;
    *mb.mutable_x() =
        MakeTensor(te::v1::FLOAT32, {1, tokens, kHidden}, RandomFloats(tokens * kHidden, seed));
    *mb.mutable_dy() = MakeTensor(te::v1::FLOAT32, {1, tokens, kHidden},
                                  RandomFloats(tokens * kHidden, seed + 1000));
    return mb;
  }

  te::v1::ForwardBackwardRequest Step(const te::v1::SessionRef& session, const std::string& layer,
                                      const std::vector<int64_t>& tokens) const {
    te::v1::ForwardBackwardRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    request.set_deterministic(true);
    *request.mutable_autocast() = Fp8();
    for (size_t i = 0; i < tokens.size(); ++i) {
      *request.add_micro_batches() = MicroBatch(tokens[i], static_cast<uint32_t>(i + 1));
    }
    return request;
  }

  // Many micro-batches: seconds on the CPU, tens of milliseconds on a GPU.
  te::v1::ForwardBackwardRequest LongStep(const te::v1::SessionRef& session,
                                          const std::string& layer) const {
    return Step(session, layer, std::vector<int64_t>(kLongMicroBatches, kLongTokens));
  }
  absl::Duration TimeLongStep();

  grpc::Status Run(const te::v1::ForwardBackwardRequest& request,
                   absl::Duration deadline = absl::Minutes(5)) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    te::v1::ForwardBackwardResponse response;
    return stub_->ForwardBackward(&context, request, &response);
  }

  // A variable's dtype, shape and bytes; one too large to come inline is a
  // resident snapshot, fetched and then deleted so that taking a snapshot
  // leaves the session as it was.
  std::string Contents(const te::v1::SessionRef& session, const te::v1::Tensor& tensor) {
    std::string contents = absl::StrCat(tensor.dtype(), " ", absl::StrJoin(tensor.shape(), ","), " ");
    if (!tensor.has_resident_id()) return contents + tensor.inline_data();
    te::v1::GetTensorRequest get;
    *get.mutable_session() = session;
    get.set_tensor_id(tensor.resident_id());
    grpc::ClientContext context;
    auto reader = stub_->GetTensor(&context, get);
    te::v1::TensorChunk chunk;
    while (reader->Read(&chunk)) contents += chunk.data();
    const grpc::Status read = reader->Finish();
    EXPECT_TRUE(read.ok()) << Describe(read);
    te::v1::DeleteTensorRequest del;
    *del.mutable_session() = session;
    del.set_tensor_id(tensor.resident_id());
    grpc::ClientContext delete_context;
    te::v1::DeleteTensorResponse deleted;
    const grpc::Status status = stub_->DeleteTensor(&delete_context, del, &deleted);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return contents;
  }

  Snapshot Take(const te::v1::SessionRef& session, const std::string& layer) {
    Snapshot snapshot;
    for (const auto& [name, tensor] : GetAllVariables(*stub_, session, layer)) {
      snapshot.variables[name] = Contents(session, tensor);
    }
    te::v1::GetSessionInfoRequest request;
    *request.mutable_session() = session;
    grpc::ClientContext context;
    const grpc::Status status = stub_->GetSessionInfo(&context, request, &snapshot.info);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return snapshot;
  }

  // Waits until the session's earlier calls are done (a call takes its turn
  // after them), then compares.
  void ExpectUnchanged(const Snapshot& before, const std::string& after_what) {
    const Snapshot after = Take(session_, layer_id_);
    EXPECT_EQ(after.info.memory_bytes(), before.info.memory_bytes()) << after_what;
    EXPECT_EQ(after.info.saved_forwards(), before.info.saved_forwards()) << after_what;
    EXPECT_EQ(after.info.resident_tensors(), before.info.resident_tensors()) << after_what;
    ASSERT_EQ(after.variables.size(), before.variables.size()) << after_what;
    int fp8_metas = 0;
    for (const auto& [name, bytes] : before.variables) {
      EXPECT_EQ(after.variables.at(name), bytes) << after_what << ": " << name << " changed";
      fp8_metas += name.rfind("fp8_metas/", 0) == 0;
    }
    EXPECT_GT(fp8_metas, 0) << "the layer has no FP8 state to protect";
  }

  std::string layer_id_;
};

TEST_F(FailedCallsTest, OutOfMemoryPartWayMovesNothingAndARetryMovesOnce) {
  // One real step first, so the FP8 histories hold amaxes that a stray
  // update would roll.
  ASSERT_TRUE(Run(Step(session_, layer_id_, {8})).ok());
  const Snapshot before = Take(session_, layer_id_);
  // Micro-batch 0 runs (and, before, wrote its amaxes into the session's own
  // histories); micro-batch 1 cannot fit.
  const grpc::Status status = Run(Step(session_, layer_id_, {8, 4096}));
  ASSERT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(status);
  ExpectUnchanged(before, "after RESOURCE_EXHAUSTED");

  // The same failure through Forward + keep_for_backward.
  te::v1::ForwardRequest forward;
  *forward.mutable_session() = session_;
  forward.set_layer_id(layer_id_);
  forward.set_deterministic(true);
  forward.set_keep_for_backward(true);
  *forward.mutable_autocast() = Fp8();
  *forward.mutable_x() = MicroBatch(4096, 9).x();
  grpc::ClientContext context;
  te::v1::ForwardResponse y;
  const grpc::Status forward_status = stub_->Forward(&context, forward, &y);
  ASSERT_EQ(forward_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << Describe(forward_status);
  ExpectUnchanged(before, "after a Forward out of memory");

  // A retry that fits moves the state once: as a session that never failed.
  const te::v1::SessionRef twin = CreateSession(*stub_).session();
  const std::string twin_layer = InitMlp(twin);
  ASSERT_TRUE(Run(Step(twin, twin_layer, {8})).ok());
  ASSERT_TRUE(Run(Step(session_, layer_id_, {8, 16})).ok());
  ASSERT_TRUE(Run(Step(twin, twin_layer, {8, 16})).ok());
  const Snapshot mine = Take(session_, layer_id_);
  const Snapshot theirs = Take(twin, twin_layer);
  ASSERT_EQ(mine.variables.size(), theirs.variables.size());
  for (const auto& [name, bytes] : theirs.variables) {
    EXPECT_EQ(mine.variables.at(name), bytes) << name << " differs from the twin's";
  }
}

// How long the long step takes here, timed on a twin session so that the
// test's own is untouched: the deadline and the cancel below fall a third of
// the way in, on any backend.
absl::Duration FailedCallsTest::TimeLongStep() {
  const te::v1::SessionRef twin = CreateSession(*stub_).session();
  const std::string twin_layer = InitMlp(twin);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(Run(LongStep(twin, twin_layer)).ok());
  return absl::Now() - start;
}

TEST_F(FailedCallsTest, ADeadlineThatPassesWhileTheStepRunsMovesNothing) {
  ASSERT_TRUE(Run(Step(session_, layer_id_, {8})).ok());
  const absl::Duration full = TimeLongStep();
  const Snapshot before = Take(session_, layer_id_);
  const absl::Duration deadline = full / 3;
  const absl::Time start = absl::Now();
  const grpc::Status status = Run(LongStep(session_, layer_id_), deadline);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  // The server stopped at a micro-batch boundary rather than finishing the
  // call: a call queued behind it came back well before the whole step could
  // have run.
  te::v1::GetSessionInfoRequest info_request = WithSession(te::v1::GetSessionInfoRequest());
  grpc::ClientContext info_context;
  te::v1::SessionInfo info;
  ASSERT_TRUE(stub_->GetSessionInfo(&info_context, info_request, &info).ok());
  const absl::Duration waited = absl::Now() - start;
  EXPECT_LT(waited, deadline + (full - deadline) / 2 + absl::Milliseconds(5))
      << "the expired call ran on: " << waited << "; the whole step takes " << full;
  ExpectUnchanged(before, "after DEADLINE_EXCEEDED");
}

TEST_F(FailedCallsTest, ACancelledStepMovesNothing) {
  ASSERT_TRUE(Run(Step(session_, layer_id_, {8})).ok());
  const absl::Duration full = TimeLongStep();
  const Snapshot before = Take(session_, layer_id_);
  const te::v1::ForwardBackwardRequest request = LongStep(session_, layer_id_);
  grpc::ClientContext context;
  te::v1::ForwardBackwardResponse response;
  std::thread cancel([&context, full] {
    absl::SleepFor(full / 3);
    context.TryCancel();
  });
  const grpc::Status status = stub_->ForwardBackward(&context, request, &response);
  cancel.join();
  ASSERT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << Describe(status);
  ExpectUnchanged(before, "after CANCELLED");
}

// A call that ends with less of its deadline left than its answer is given
// to travel back (kAnswerTime, 10 ms) is undone and answered
// DEADLINE_EXCEEDED: its client may stop waiting before the answer, which
// alone names the call's resident output, arrives. A Forward of a tiny
// DenseGeneral (microseconds) with 5 ms to go ends that way however fast it
// runs; with time to spare it keeps its output.
TEST_F(FailedCallsTest, ACallWithNoTimeLeftForItsAnswerIsUndone) {
  te::v1::InitLayerRequest init;
  *init.mutable_session() = session_;
  init.mutable_spec()->mutable_dense_general()->add_features(8);
  init.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : {1, 4, static_cast<int>(kHidden)}) init.add_input_shape(d);
  init.set_seed(5);
  te::v1::InitLayerResponse dense;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->InitLayer(&context, init, &dense);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  te::v1::ForwardRequest forward;
  *forward.mutable_session() = session_;
  forward.set_layer_id(dense.layer_id());
  forward.set_deterministic(true);
  *forward.mutable_x() =
      MakeTensor(te::v1::FLOAT32, {1, 4, kHidden}, RandomFloats(4 * kHidden, 7));
  forward.set_keep_outputs(true);
  const Snapshot before = Take(session_, layer_id_);
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(5)));
    te::v1::ForwardResponse response;
    const grpc::Status status = stub_->Forward(&context, forward, &response);
    ASSERT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  }
  ExpectUnchanged(before, "after a Forward with 5 ms to go");
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  te::v1::ForwardResponse response;
  const grpc::Status status = stub_->Forward(&context, forward, &response);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_TRUE(response.y().has_resident_id());
}

TEST_F(FailedCallsTest, HostileSizesAreRefusedAndTheServerStays) {
  const Snapshot before = Take(session_, layer_id_);
  struct Hostile {
    std::string name;
    te::v1::LayerSpec spec;
    std::vector<int64_t> input_shape;
    grpc::StatusCode code;
  };
  std::vector<Hostile> cases;
  {
    Hostile h{"TransformerLayer hidden 2^20", {}, {1, 8, int64_t{1} << 20},
              grpc::StatusCode::RESOURCE_EXHAUSTED};
    te::v1::TransformerLayer* t = h.spec.mutable_transformer_layer();
    t->set_hidden_size(int64_t{1} << 20);
    t->set_mlp_hidden_size(int64_t{1} << 22);
    t->set_num_attention_heads(16);
    cases.push_back(h);
  }
  {
    Hostile h{"DenseGeneral features 2^31 - 1", {}, {2, kHidden},
              grpc::StatusCode::RESOURCE_EXHAUSTED};
    h.spec.mutable_dense_general()->add_features((int64_t{1} << 31) - 1);
    cases.push_back(h);
  }
  {
    Hostile h{"DenseGeneral features 2^40", {}, {2, kHidden}, grpc::StatusCode::INVALID_ARGUMENT};
    h.spec.mutable_dense_general()->add_features(int64_t{1} << 40);
    cases.push_back(h);
  }
  {
    // Each feature dimension in range, the kernel's size past 2^63.
    Hostile h{"DenseGeneral features [2^30, 2^30, 2^30]", {}, {2, kHidden},
              grpc::StatusCode::INVALID_ARGUMENT};
    for (int i = 0; i < 3; ++i) h.spec.mutable_dense_general()->add_features(int64_t{1} << 30);
    cases.push_back(h);
  }
  {
    // Products that wrap past 2^63 alike on both sides.
    Hostile h{"reshape past 2^63", {}, {2, kHidden}, grpc::StatusCode::INVALID_ARGUMENT};
    te::v1::GraphSpec* graph = h.spec.mutable_graph();
    te::v1::GraphSpec::Node* reshape = graph->add_nodes();
    reshape->set_name("reshape");
    reshape->add_inputs("x");
    reshape->add_outputs("r");
    for (int64_t d : {int64_t{2}, int64_t{4}, int64_t{4611686018427387904},
                      int64_t{1844674407370955161}}) {
      reshape->mutable_reshape()->add_shape(d);
    }
    te::v1::GraphSpec::Node* dense = graph->add_nodes();
    dense->set_name("DenseGeneral_0");
    dense->add_inputs("r");
    dense->add_outputs("y");
    dense->mutable_module()->mutable_dense_general()->add_features(4);
    graph->add_outputs("y");
    cases.push_back(h);
  }
  for (const Hostile& h : cases) {
    te::v1::InitLayerRequest init = WithSession(te::v1::InitLayerRequest());
    *init.mutable_spec() = h.spec;
    init.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : h.input_shape) init.add_input_shape(d);
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, init, &response);
    EXPECT_EQ(status.error_code(), h.code) << h.name << ": " << Describe(status);
    if (h.code == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_NE(status.error_message().find("session_memory_bytes"), std::string::npos)
          << h.name << ": " << Describe(status);
    }
  }
  // Far more micro-batches than one call may carry.
  te::v1::ForwardBackwardRequest many = Step(session_, layer_id_, {});
  for (int i = 0; i < 10000; ++i) *many.add_micro_batches() = MicroBatch(1, 5);
  const grpc::Status status = Run(many);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("--max_micro_batches"), std::string::npos)
      << Describe(status);
  ExpectUnchanged(before, "after the hostile sizes");
}

}  // namespace
}  // namespace te::testing
