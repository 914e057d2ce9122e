// The device constants a session layer keeps across calls
// (server/layers/device_constants.h, LayerEntry::constants): a graph of two
// TransformerLayers with the relative position bias (TE's default
// enable_relative_embedding), trained as the Python client's train_step
// trains one (one ForwardBackward with apply_update a step, reading the
// newest version and donating it, under FP8 DelayedScaling). Only the first
// step uploads the int32 [S, S] bucket table, which both layers share; the
// steps give, bit for bit, the values and variables of a session whose
// table goes between steps; and a call that fails after it made a table
// leaves the session's memory as it was (session.h contract 2), the table
// included.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "server/session/testing/session_calls.h"
#include "server/session/testing/step_expectations.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::DelayedScalingRecipe;
using testing::RandomFloats;

constexpr int64_t kBatch = 2, kSeq = 4, kOtherSeq = 8, kHidden = 32, kFfn = 64;

// The CPU backend, counting the uploads of a bucket table: int32 [S, S].
class CountingCpuOps : public CpuOps {
 public:
  explicit CountingCpuOps(int64_t* bucket_uploads) : bucket_uploads_(bucket_uploads) {}

  absl::Status Upload(const void* src, Tensor* dst) override {
    if (dst->dtype() == DType::kI32 && dst->rank() == 2 && dst->dim(0) == dst->dim(1)) {
      ++*bucket_uploads_;
    }
    return CpuOps::Upload(src, dst);
  }

 private:
  int64_t* bucket_uploads_;
};

// x -> TransformerLayer_0 -> TransformerLayer_1 -> y, each with the relative
// position bias.
te::v1::LayerSpec TwoRelativeLayers() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  for (int i = 0; i < 2; ++i) {
    testing::AddTransformerLayer(g, "TransformerLayer_" + std::to_string(i), i == 0 ? "x" : "h0",
                                 i == 0 ? "h0" : "y", kHidden, kFfn)
        ->set_enable_relative_embedding(true);
  }
  g->add_outputs("y");
  return spec;
}

class GraphTraining {
 public:
  GraphTraining() {
    device_ = *OpenCpuDevice();
    auto ops = std::make_unique<CountingCpuOps>(&bucket_uploads_);
    ops->set_memory_limit(int64_t{1} << 30);
    session_ = std::make_unique<Session>("kept_constants", device_->info(), std::move(ops),
                                         SessionConfig(), te::v1::EMULATE,
                                         DelayedScalingRecipe());
    te::v1::InitLayerRequest init = testing::AutocastInitRequest(5, {kBatch, kSeq, kHidden});
    *init.mutable_spec() = TwoRelativeLayers();
    const absl::StatusOr<std::string> layer = testing::InitWithAdamW(*session_, init);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (layer.ok()) layer_id_ = *layer;
  }

  // train_step(state, x, dy=dy, donate=True) on top of the step before, at
  // sequence length `seq`, as the server runs a call (BeginCall, EndCall
  // undoing a failed one). `call`: the client's deadline and cancellation.
  absl::Status TrainStep(int step, te::v1::ForwardBackwardResponse* response,
                         int64_t seq = kSeq, const CallContext& call = CallContext()) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    request.set_apply_update(true);
    request.set_donate(true);
    request.mutable_autocast()->set_enabled(true);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = RandomFloats({kBatch, seq, kHidden}, 100 * step, 1.0f);
    *mb->mutable_dy() = RandomFloats({kBatch, seq, kHidden}, 100 * step + 50, 0.1f);
    session_->BeginCall();
    const absl::Status ran = session_->ForwardBackward(request, response, call);
    session_->EndCall(/*undo=*/!ran.ok());
    return ran;
  }
  te::v1::ForwardBackwardResponse TrainStep(int step) {
    te::v1::ForwardBackwardResponse response;
    const absl::Status ran = TrainStep(step, &response);
    EXPECT_TRUE(ran.ok()) << ran;
    return response;
  }

  // The kept table goes: a call at another sequence length (a Forward
  // outside autocast, which changes no variable) keeps only its own, and
  // the next step at kSeq makes its table again, as every step did when
  // each call made its own.
  void DropKeptTable() {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    *request.mutable_x() = RandomFloats({kBatch, kOtherSeq, kHidden}, 7, 1.0f);
    te::v1::ForwardResponse response;
    session_->BeginCall();
    const absl::Status ran = session_->Forward(request, &response);
    session_->EndCall(/*undo=*/!ran.ok());
    EXPECT_TRUE(ran.ok()) << ran;
  }

  std::map<std::string, std::string> Variables() {
    absl::StatusOr<std::map<std::string, std::string>> bytes =
        testing::VariableBytes(*session_, layer_id_);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *std::move(bytes) : std::map<std::string, std::string>{};
  }

  int64_t bucket_uploads() const { return bucket_uploads_; }
  int64_t bytes_in_use() const { return session_->bytes_in_use(); }

 private:
  int64_t bucket_uploads_ = 0;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

TEST(KeptConstantsTest, OnlyTheFirstTrainingStepUploadsTheBucketTable) {
  GraphTraining kept, dropped;
  kept.TrainStep(0);
  dropped.TrainStep(0);
  // One table for both layers (the graph's nodes share it).
  EXPECT_EQ(kept.bucket_uploads(), 1);
  int64_t held = 0;
  for (int step = 1; step < 4; ++step) {
    SCOPED_TRACE(step);
    dropped.DropKeptTable();
    const int64_t kept_before = kept.bucket_uploads();
    const int64_t dropped_before = dropped.bucket_uploads();
    const te::v1::ForwardBackwardResponse got = kept.TrainStep(step);
    const te::v1::ForwardBackwardResponse want = dropped.TrainStep(step);
    EXPECT_EQ(kept.bucket_uploads() - kept_before, 0);
    EXPECT_EQ(dropped.bucket_uploads() - dropped_before, 1);
    // The kept table was held since the first step: the steps hold no more.
    // (From the second step on, as fp8_kept_copies_test says of its copies.)
    if (step > 1) { EXPECT_EQ(kept.bytes_in_use(), held); }
    held = kept.bytes_in_use();
    EXPECT_TRUE(got.update().applied());
    testing::ExpectSameStep(got, want);
    testing::ExpectSameVariables(kept.Variables(), dropped.Variables());
  }
}

TEST(KeptConstantsTest, AFailedCallKeepsNoTableItMade) {
  GraphTraining training;
  // Cancelled by its client once it has uploaded a table: the forward has
  // run on it, the call fails before it commits.
  int64_t uploads_at_call = 0;
  CallContext cancelled_after_upload;
  cancelled_after_upload.cancelled = [&] {
    return training.bucket_uploads() > uploads_at_call;
  };

  // The first call, before any table is kept.
  const int64_t initial = training.bytes_in_use();
  te::v1::ForwardBackwardResponse unused;
  uploads_at_call = training.bucket_uploads();
  absl::Status ran = training.TrainStep(0, &unused, kSeq, cancelled_after_upload);
  EXPECT_EQ(ran.code(), absl::StatusCode::kCancelled) << ran;
  EXPECT_EQ(training.bucket_uploads(), 1);
  EXPECT_EQ(training.bytes_in_use(), initial);

  // The next step makes its table again, and keeps it.
  training.TrainStep(1);
  EXPECT_EQ(training.bucket_uploads(), 2);
  training.TrainStep(2);
  EXPECT_EQ(training.bucket_uploads(), 2);

  // A call at another length makes that length's table, then fails: the
  // session holds what it held, the kept table of kSeq still serves.
  const int64_t held = training.bytes_in_use();
  uploads_at_call = training.bucket_uploads();
  ran = training.TrainStep(3, &unused, kOtherSeq, cancelled_after_upload);
  EXPECT_EQ(ran.code(), absl::StatusCode::kCancelled) << ran;
  EXPECT_EQ(training.bucket_uploads(), 3);
  EXPECT_EQ(training.bytes_in_use(), held);
  training.TrainStep(3);
  EXPECT_EQ(training.bucket_uploads(), 3);
  EXPECT_EQ(training.bytes_in_use(), held);
}

}  // namespace
}  // namespace te::session
