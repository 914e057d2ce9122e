// A ForwardBackward that answers only its values (no dx, outputs or
// gradients returned; no update) leaves reading them to the reactor's
// after_turn, so a client's next queued step issues its work while this one
// finishes on the device. The values, the FP8 scaling state and every
// variable come out bit for bit as a session that reads them in its turn;
// a call that returns more reads everything in its turn.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "server/session/testing/session_calls.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

constexpr int64_t kBatch = 2, kSeq = 5, kHidden = 32, kFfn = 64;

class MlpSession {
 public:
  MlpSession() {
    device_ = *OpenCpuDevice();
    session_ = std::make_unique<Session>("values_after_turn", device_->info(),
                                         *device_->NewOps(int64_t{1} << 30), SessionConfig(),
                                         te::v1::EMULATE, testing::DelayedScalingRecipe());
    te::v1::InitLayerRequest init = testing::AutocastInitRequest(3, {kBatch, kSeq, kHidden});
    te::v1::LayerNormMLP* mlp = init.mutable_spec()->mutable_layer_norm_mlp();
    mlp->set_intermediate_dim(kFfn);
    mlp->add_activations("gelu");
    mlp->set_intermediate_dropout_rate(0.0f);
    te::v1::InitLayerResponse layer;
    const absl::Status made = session_->InitLayer(init, &layer);
    EXPECT_TRUE(made.ok()) << made;
    layer_id_ = layer.layer_id();
  }

  // The speedometer's step under FP8 (two micro-batches, gradients dropped);
  // `after_turn` as the service's reactor passes it (null: none).
  te::v1::ForwardBackwardRequest Step(int step, bool return_dx) const {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    request.set_discard_grads(true);
    request.set_return_dx(return_dx);
    request.mutable_autocast()->set_enabled(true);
    for (int m = 0; m < 2; ++m) {
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = testing::RandomFloats({kBatch, kSeq, kHidden}, 100 * step + m, 1.0f);
      *mb->mutable_dy() = testing::RandomFloats({kBatch, kSeq, kHidden}, 100 * step + m + 50, 0.1f);
    }
    return request;
  }

  te::v1::ForwardBackwardResponse Run(const te::v1::ForwardBackwardRequest& request,
                                      std::function<absl::Status()>* after_turn) {
    te::v1::ForwardBackwardResponse response;
    CallContext call;
    call.after_turn = after_turn;
    const absl::Status ran = session_->ForwardBackward(request, &response, call);
    EXPECT_TRUE(ran.ok()) << ran;
    return response;
  }

  absl::StatusOr<std::map<std::string, std::string>> Variables() {
    return testing::VariableBytes(*session_, layer_id_);
  }

 private:
  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

TEST(ValuesAfterTurnTest, ValuesAndStateMatchASessionThatReadsThemInItsTurn) {
  MlpSession in_turn, later;
  for (int step = 0; step < 3; ++step) {
    const te::v1::ForwardBackwardResponse expected = in_turn.Run(in_turn.Step(step, false), nullptr);
    std::function<absl::Status()> after_turn;
    te::v1::ForwardBackwardResponse got = later.Run(later.Step(step, false), &after_turn);
    ASSERT_TRUE(after_turn) << "step " << step << ": the values were read in the turn";
    ASSERT_EQ(got.values_size(), 2);
    const absl::Status answered = after_turn();
    ASSERT_TRUE(answered.ok()) << answered;
    ASSERT_EQ(expected.values_size(), 2);
    for (int m = 0; m < 2; ++m) {
      EXPECT_NE(expected.values(m), 0.0) << "step " << step;
      EXPECT_EQ(got.values(m), expected.values(m)) << "step " << step << " micro-batch " << m;
    }
    EXPECT_EQ(got.version(), expected.version());
  }
  // The FP8 scaling state (amax histories, scales) each step wrote.
  const auto got = later.Variables(), expected = in_turn.Variables();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(*got, *expected);
}

TEST(ValuesAfterTurnTest, ACallThatReturnsGradientsReadsEverythingInItsTurn) {
  MlpSession session, reference;
  const te::v1::ForwardBackwardResponse expected =
      reference.Run(reference.Step(0, true), nullptr);
  std::function<absl::Status()> after_turn;
  const te::v1::ForwardBackwardResponse got = session.Run(session.Step(0, true), &after_turn);
  EXPECT_FALSE(after_turn);
  ASSERT_EQ(got.values_size(), 2);
  EXPECT_EQ(got.values(0), expected.values(0));
  EXPECT_EQ(got.values(1), expected.values(1));
  EXPECT_EQ(got.dx_size(), 2);
}

}  // namespace
}  // namespace te::session
