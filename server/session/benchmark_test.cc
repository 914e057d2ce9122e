// Session::Benchmark leaves the session as it was (session.h, contract 5):
// the version it read, bit for bit (its fp8_metas included), no new version,
// and the session's memory, which holds the layer's kept FP8 weight copies,
// unchanged, both on a layer's first step and after a step kept copies; and
// it stops at the call's deadline or cancellation (CallContext::StillWanted).
// On the CPU backend under FP8 DelayedScaling.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::DelayedScalingRecipe;
using testing::RandomFloats;

constexpr int64_t kBatch = 2, kSeq = 5, kHidden = 32, kFfn = 64;

class BenchmarkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = *OpenCpuDevice();
    session_ = std::make_unique<Session>("benchmark", device_->info(),
                                         *device_->NewOps(int64_t{1} << 30), SessionConfig(),
                                         te::v1::EMULATE, DelayedScalingRecipe());
    te::v1::InitLayerRequest init = testing::AutocastInitRequest(5, {kBatch, kSeq, kHidden});
    te::v1::LayerNormMLP* mlp = init.mutable_spec()->mutable_layer_norm_mlp();
    mlp->set_intermediate_dim(kFfn);
    mlp->add_activations("gelu");
    mlp->set_intermediate_dropout_rate(0.0f);
    te::v1::InitLayerResponse layer;
    const absl::Status initialised = session_->InitLayer(init, &layer);
    ASSERT_TRUE(initialised.ok()) << initialised;
    layer_id_ = layer.layer_id();
  }

  te::v1::MicroBatch Inputs(uint64_t seed) {
    te::v1::MicroBatch mb;
    *mb.mutable_x() = RandomFloats({kBatch, kSeq, kHidden}, seed, 1.0f);
    *mb.mutable_dy() = RandomFloats({kBatch, kSeq, kHidden}, seed + 1, 0.1f);
    return mb;
  }

  absl::Status Benchmark(bool forward_only, const CallContext& call = CallContext()) {
    te::v1::BenchmarkRequest request;
    request.set_layer_id(layer_id_);
    request.set_warmup_iters(2);
    request.set_timing_iters(3);
    request.set_forward_only(forward_only);
    request.mutable_autocast()->set_enabled(true);
    *request.mutable_inputs() = Inputs(7);
    te::v1::BenchmarkResponse response;
    return session_->Benchmark(request, call, &response);
  }

  // A ForwardBackward that keeps its gradients: a new version, and the
  // layer's FP8 weight copies kept for the next step.
  void Step() {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.mutable_autocast()->set_enabled(true);
    *request.add_micro_batches() = Inputs(11);
    te::v1::ForwardBackwardResponse response;
    const absl::Status ran = session_->ForwardBackward(request, &response);
    ASSERT_TRUE(ran.ok()) << ran;
  }

  // What Benchmark must not move: the newest version's number and every
  // variable's bytes, the session's memory and its counts.
  struct State {
    int64_t version = 0;
    std::map<std::string, std::string> variables;
    int64_t memory_bytes = 0;
    std::string info;
    bool operator==(const State& o) const {
      return version == o.version && variables == o.variables &&
             memory_bytes == o.memory_bytes && info == o.info;
    }
  };
  State Take() {
    State state;
    te::v1::GetVariablesRequest request;
    request.set_layer_id(layer_id_);
    te::v1::GetVariablesResponse response;
    const absl::Status got = session_->GetVariables(request, &response);
    EXPECT_TRUE(got.ok()) << got;
    state.version = response.version();
    for (const te::v1::Variable& v : response.variables()) {
      EXPECT_TRUE(v.value().resident_id().empty()) << "a variable came back resident";
      state.variables[v.collection() + "/" + v.path()] = v.value().inline_data();
    }
    te::v1::SessionInfo info;
    session_->GetSessionInfo(&info);
    state.memory_bytes = info.memory_bytes();
    state.info = absl::StrCat(info.layers(), " layers, ", info.saved_forwards(), " forwards, ",
                              info.resident_tensors(), " tensors");
    return state;
  }

  void ExpectUnchangedBy(bool forward_only) {
    const State before = Take();
    int fp8_metas = 0;
    for (const auto& [name, bytes] : before.variables) fp8_metas += name.rfind("fp8_metas/", 0) == 0;
    ASSERT_GT(fp8_metas, 0) << "the layer has no FP8 state to keep";
    const absl::Status ran = Benchmark(forward_only);
    ASSERT_TRUE(ran.ok()) << ran;
    const State after = Take();
    EXPECT_EQ(after.version, before.version);
    EXPECT_EQ(after.memory_bytes, before.memory_bytes)
        << "the benchmark left memory held: its FP8 weight copies kept as the layer's?";
    EXPECT_EQ(after.info, before.info);
    for (const auto& [name, bytes] : before.variables) {
      EXPECT_EQ(after.variables.at(name), bytes) << name << " moved";
    }
    EXPECT_TRUE(after == before);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

TEST_F(BenchmarkTest, TheLayersFirstStepLeavesTheSessionAsItWas) {
  ExpectUnchangedBy(/*forward_only=*/false);
  ExpectUnchangedBy(/*forward_only=*/true);
}

TEST_F(BenchmarkTest, AfterAStepKeptWeightCopiesLeavesTheSessionAsItWas) {
  Step();
  ExpectUnchangedBy(/*forward_only=*/false);
  ExpectUnchangedBy(/*forward_only=*/true);
}

// The FP8 state moves during the benchmark (its copy of it): the session's
// does not. A step after the benchmark gives what it gives without one.
TEST_F(BenchmarkTest, AStepAfterABenchmarkIsTheStepWithout) {
  Step();
  const State without = [&] {
    // The same session's next step, read and then undone.
    session_->BeginCall();
    Step();
    State state = Take();
    session_->EndCall(/*undo=*/true);
    return state;
  }();
  ASSERT_TRUE(Benchmark(false).ok());
  Step();
  const State with = Take();
  EXPECT_EQ(with.variables, without.variables);
}

TEST_F(BenchmarkTest, StopsAtTheDeadlineOrACancel) {
  const State before = Take();
  CallContext late;
  late.deadline = absl::Now() - absl::Milliseconds(1);
  absl::Status status = Benchmark(false, late);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("Benchmark"), std::string::npos) << status;
  CallContext cancelled;
  int checks = 0;
  cancelled.cancelled = [&checks] { return ++checks > 3; };
  status = Benchmark(false, cancelled);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE(Take() == before);
}

}  // namespace
}  // namespace te::session
