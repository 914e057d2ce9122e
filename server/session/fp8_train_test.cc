// Training a session under FP8 DelayedScaling: ForwardBackward with
// apply_update, where the update rewrites the layer's kept FP8 weight copies
// instead of dropping them, against a second session whose copies are
// dropped after every update (a SetVariables of one of its fp8_metas to the
// value it has, which changes no number). Losses, update records and every
// variable (params, fp8_metas' amax histories and scales, opt_state) are
// bit for bit the same; the copies stay in the first session's memory across
// updates, and a bf16 update drops them as before.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "server/session/testing/session_calls.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::DelayedScalingRecipe;
using testing::RandomFloats;

constexpr int64_t kBatch = 2, kSeq = 5, kHidden = 32, kFfn = 64;

class TrainedSession {
 public:
  TrainedSession() {
    device_ = *OpenCpuDevice();
    session_ = std::make_unique<Session>("fp8_train", device_->info(),
                                         *device_->NewOps(int64_t{1} << 30), SessionConfig(),
                                         te::v1::EMULATE, DelayedScalingRecipe());
    te::v1::InitLayerRequest init = testing::AutocastInitRequest(3, {kBatch, kSeq, kHidden});
    te::v1::LayerNormMLP* mlp = init.mutable_spec()->mutable_layer_norm_mlp();
    mlp->set_intermediate_dim(kFfn);
    mlp->add_activations("gelu");
    mlp->set_use_bias(true);
    mlp->set_intermediate_dropout_rate(0.0f);
    const absl::StatusOr<std::string> layer = testing::InitWithAdamW(*session_, init);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (layer.ok()) layer_id_ = *layer;
  }

  // One ForwardBackward of two micro-batches with apply_update.
  te::v1::ForwardBackwardResponse TrainStep(int step, bool fp8) {
    te::v1::ForwardBackwardResponse response;
    TrainStepInto(step, fp8, nullptr, &response);
    return response;
  }
  // The same into `response`. `after_turn`: where given, the call may leave
  // the rest of its answer there, as it does under the service's reactor
  // (CallContext::after_turn); it is not run here.
  void TrainStepInto(int step, bool fp8, std::function<absl::Status()>* after_turn,
                     te::v1::ForwardBackwardResponse* response) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    request.set_apply_update(true);
    request.mutable_autocast()->set_enabled(fp8);
    for (int m = 0; m < 2; ++m) {
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = RandomFloats({kBatch, kSeq, kHidden}, 100 * step + m, 1.0f);
      *mb->mutable_dy() = RandomFloats({kBatch, kSeq, kHidden}, 100 * step + m + 50, 0.1f);
    }
    CallContext call;
    call.after_turn = after_turn;
    const absl::Status ran = session_->ForwardBackward(request, response, call);
    EXPECT_TRUE(ran.ok()) << ran;
    ReleaseAllBut(response->version());
  }

  // Every variable: "collection/path" -> its bytes.
  std::map<std::string, std::string> Variables() {
    absl::StatusOr<std::map<std::string, std::string>> bytes =
        testing::VariableBytes(*session_, layer_id_);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *std::move(bytes) : std::map<std::string, std::string>{};
  }

  // The kept FP8 copies go, as after any write to the variables; no number
  // changes. The replaced meta's old bytes stay in its step's block of
  // fp8_metas copies (StepTransaction::Open) until the block's last view goes.
  void DropKeptCopies() {
    absl::StatusOr<int64_t> meta_bytes =
        testing::RewriteFirstVariable(*session_, layer_id_, "fp8_metas");
    ASSERT_TRUE(meta_bytes.ok()) << meta_bytes.status();
    replaced_meta_bytes_ = *meta_bytes;
  }

  // A client that holds only the newest version (variables as values):
  // what it no longer holds goes.
  void ReleaseAllBut(int64_t newest) {
    te::v1::ReleaseVersionsRequest release;
    release.set_layer_id(layer_id_);
    for (int64_t v = 1; v < newest; ++v) release.add_versions(v);
    const absl::Status done = session_->ReleaseVersions(release);
    ASSERT_TRUE(done.ok()) << done;
  }

  int64_t bytes_in_use() const { return session_->bytes_in_use(); }
  int64_t replaced_meta_bytes() const { return replaced_meta_bytes_; }

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
  int64_t replaced_meta_bytes_ = 0;
};

// The FP8 copies of the MLP's two kernels ([32, 64] and [64, 32], E4M3): both
// layouts, scale_inv, and the kept scale and amax.
constexpr int64_t kKeptCopyBytes = 2 * (2 * kHidden * kFfn + 3 * 4);

TEST(Fp8TrainTest, UpdatesRewritingTheCopiesMatchDroppingThem) {
  TrainedSession kept, dropped;
  int64_t kept_bytes = 0;
  for (int step = 0; step < 5; ++step) {
    SCOPED_TRACE(step);
    const te::v1::ForwardBackwardResponse want = dropped.TrainStep(step, true);
    dropped.DropKeptCopies();
    const te::v1::ForwardBackwardResponse got = kept.TrainStep(step, true);
    ASSERT_EQ(got.values_size(), want.values_size());
    for (int i = 0; i < want.values_size(); ++i) EXPECT_EQ(got.values(i), want.values(i)) << i;
    EXPECT_TRUE(got.update().applied());
    EXPECT_EQ(got.update().count(), want.update().count());
    EXPECT_EQ(got.update().grad_norm(), want.update().grad_norm());
    const auto want_vars = dropped.Variables();
    const auto got_vars = kept.Variables();
    ASSERT_EQ(got_vars.size(), want_vars.size());
    for (const auto& [name, bytes] : want_vars) {
      EXPECT_TRUE(got_vars.at(name) == bytes) << name << " differs";
    }
    // The kept session holds its copies across the update, and nothing more
    // from one step to the next.
    EXPECT_EQ(kept.bytes_in_use() - dropped.bytes_in_use(),
              kKeptCopyBytes - dropped.replaced_meta_bytes());
    if (step > 0) { EXPECT_EQ(kept.bytes_in_use(), kept_bytes); }
    kept_bytes = kept.bytes_in_use();
  }
  // A bf16 update (autocast off) drops the copies, as every update did (the
  // fp8_metas, and the dropped session's replaced meta in their block, stay).
  kept.TrainStep(5, false);
  dropped.TrainStep(5, false);
  EXPECT_EQ(kept.bytes_in_use() + dropped.replaced_meta_bytes(), dropped.bytes_in_use());
}

// A step that leaves its device values for after the session's turn (the
// reactor then lets the session's next call issue its work first): the
// answer has no values or update record until that part runs, and the same
// ones as a step read in its turn once it has, in FP8 (whose read-back also
// carries the non-finite amax count) and in float32.
TEST(Fp8TrainTest, AnAnswerReadAfterTheTurnEqualsOneReadInIt) {
  for (const bool fp8 : {true, false}) {
    SCOPED_TRACE(fp8 ? "fp8" : "f32");
    TrainedSession in_turn, after;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(step);
      const te::v1::ForwardBackwardResponse want = in_turn.TrainStep(step, fp8);
      std::function<absl::Status()> rest;
      te::v1::ForwardBackwardResponse got;
      after.TrainStepInto(step, fp8, &rest, &got);
      ASSERT_TRUE(rest) << "the step read its answer in the turn";
      EXPECT_EQ(got.update().count(), 0);
      for (int i = 0; i < got.values_size(); ++i) EXPECT_EQ(got.values(i), 0.0) << i;
      // The session's next call could run here; the step's copies are queued.
      const absl::Status answered = rest();
      ASSERT_TRUE(answered.ok()) << answered;
      ASSERT_EQ(got.values_size(), want.values_size());
      for (int i = 0; i < want.values_size(); ++i) EXPECT_EQ(got.values(i), want.values(i)) << i;
      EXPECT_EQ(got.update().SerializeAsString(), want.update().SerializeAsString());
      EXPECT_EQ(got.update().count(), step + 1);
      EXPECT_EQ(after.Variables(), in_turn.Variables());
    }
  }
}

}  // namespace
}  // namespace te::session
