// The weights' casts to their compute dtype (LayerEntry::casts) for a
// bfloat16 graph of modules with float32 params, trained as the Python
// client's train_step trains one: one ForwardBackward with apply_update a
// step, reading the newest version. The first step casts each weight once;
// after it the update rewrites every cast as it writes the weight
// (OptimizerSlot::compute_copy), so no forward casts a weight again. The
// steps give, bit for bit, the values and variables of a session whose casts
// are dropped after every update, in the same memory step after step; a
// call that fails leaves the session's memory as it was, and SetVariables
// drops the casts.
#include <cstdint>
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

using testing::AddNode;
using testing::RandomFloats;

constexpr int64_t kBatch = 2, kSeq = 4, kHidden = 32, kFfn = 64;

// The CPU backend, counting the float32 -> bfloat16 casts that a forward
// runs (the casts an optimizer step writes are its own, not counted).
class CountingCpuOps : public CpuOps {
 public:
  explicit CountingCpuOps(int64_t* casts) : casts_(casts) {}

  absl::Status Cast(const Tensor& x, Tensor* y) override {
    if (!in_update_ && x.dtype() == DType::kF32 && y->dtype() == DType::kBF16) ++*casts_;
    return CpuOps::Cast(x, y);
  }
  absl::Status OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                             const std::vector<Tensor>& grads, Tensor* count,
                             Tensor* total_notfinite) override {
    in_update_ = true;
    absl::Status step = CpuOps::OptimizerStep(plan, slots, grads, count, total_notfinite);
    in_update_ = false;
    return step;
  }

 private:
  int64_t* casts_;
  bool in_update_ = false;
};

// x -> TransformerLayer_0 -> TransformerLayer_1 -> LayerNormMLP_0 -> y.
te::v1::LayerSpec GraphOfModules() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  testing::AddTransformerLayer(g, "TransformerLayer_0", "x", "h0", kHidden, kFfn);
  testing::AddTransformerLayer(g, "TransformerLayer_1", "h0", "h1", kHidden, kFfn);
  te::v1::LayerNormMLP* mlp =
      AddNode(g, "LayerNormMLP_0", {"h1"}, {"y"})->mutable_module()->mutable_layer_norm_mlp();
  mlp->set_intermediate_dim(kFfn);
  mlp->add_activations("gelu");
  mlp->set_intermediate_dropout_rate(0.0f);
  g->add_outputs("y");
  return spec;
}

class Bf16Training {
 public:
  Bf16Training() {
    device_ = *OpenCpuDevice();
    auto ops = std::make_unique<CountingCpuOps>(&casts_);
    ops->set_memory_limit(int64_t{1} << 30);
    session_ = std::make_unique<Session>("kept_casts", device_->info(), std::move(ops),
                                         SessionConfig(), te::v1::EMULATE, te::v1::Recipe());
    te::v1::InitLayerRequest init;
    init.set_seed(5);
    init.set_input_dtype(te::v1::BFLOAT16);
    for (int64_t d : {kBatch, kSeq, kHidden}) init.add_input_shape(d);
    *init.mutable_spec() = GraphOfModules();
    const absl::StatusOr<std::string> layer = testing::InitWithAdamW(*session_, init);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (layer.ok()) layer_id_ = *layer;
  }

  // train_step(state, x, dy=dy) on top of the step before: the newest
  // version (0), one micro-batch, apply_update, donating or not.
  absl::Status TrainStep(int step, te::v1::ForwardBackwardResponse* response, bool donate = true,
                         const CallContext& call = CallContext()) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    request.set_apply_update(true);
    request.set_donate(donate);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = RandomFloats({kBatch, kSeq, kHidden}, 100 * step, 1.0f, te::v1::BFLOAT16);
    *mb->mutable_dy() =
        RandomFloats({kBatch, kSeq, kHidden}, 100 * step + 50, 0.1f, te::v1::BFLOAT16);
    return session_->ForwardBackward(request, response, call);
  }
  te::v1::ForwardBackwardResponse Step(int step, bool donate = true) {
    te::v1::ForwardBackwardResponse response;
    const absl::Status ran = TrainStep(step, &response, donate);
    EXPECT_TRUE(ran.ok()) << ran;
    return response;
  }

  std::map<std::string, std::string> Variables() {
    absl::StatusOr<std::map<std::string, std::string>> bytes =
        testing::VariableBytes(*session_, layer_id_);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *std::move(bytes) : std::map<std::string, std::string>{};
  }

  // No number changes, and the kept casts go (SetVariables); the older
  // versions are released.
  void DropKeptCasts() {
    const absl::StatusOr<int64_t> rewritten =
        testing::RewriteFirstVariable(*session_, layer_id_, "params");
    ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  }

  // The step as the server runs a call whose answer is lost: committed,
  // then undone (BeginCall, EndCall(undo)).
  void UndoneStep(int step) {
    session_->BeginCall();
    Step(step, /*donate=*/false);
    session_->EndCall(/*undo=*/true);
  }

  // An inference forward of the newest version.
  void Forward(int seed) {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    *request.mutable_x() = RandomFloats({kBatch, kSeq, kHidden}, seed, 1.0f, te::v1::BFLOAT16);
    te::v1::ForwardResponse response;
    const absl::Status ran = session_->Forward(request, &response, CallContext());
    EXPECT_TRUE(ran.ok()) << ran;
  }

  int64_t casts() const { return casts_; }
  int64_t bytes_in_use() const { return session_->bytes_in_use(); }

 private:
  int64_t casts_ = 0;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

TEST(KeptCastsTest, AGraphsWeightsAreCastOnceAcrossSteps) {
  Bf16Training kept, dropped;
  kept.Step(0);
  dropped.Step(0);
  dropped.DropKeptCasts();
  // Each weight, norm scale and bias of the graph, cast by the first forward.
  const int64_t weights = kept.casts();
  ASSERT_GT(weights, 0);
  EXPECT_EQ(dropped.casts(), weights);
  int64_t held = 0;
  for (int step = 1; step < 5; ++step) {
    SCOPED_TRACE(step);
    const int64_t kept_before = kept.casts(), dropped_before = dropped.casts();
    const te::v1::ForwardBackwardResponse got = kept.Step(step);
    const te::v1::ForwardBackwardResponse want = dropped.Step(step);
    dropped.DropKeptCasts();
    // The update rewrote every cast: the forward casts nothing.
    EXPECT_EQ(kept.casts() - kept_before, 0);
    EXPECT_EQ(dropped.casts() - dropped_before, weights);
    if (step > 1) {
      EXPECT_EQ(kept.bytes_in_use(), held);
    }
    held = kept.bytes_in_use();
    // And the results are those of casting every weight every step.
    EXPECT_TRUE(got.update().applied());
    testing::ExpectSameStep(got, want);
    testing::ExpectSameVariables(kept.Variables(), dropped.Variables());
  }
}

// A step that does not donate makes a new version on the params' storage
// (the version it read gets copies): the casts follow it.
TEST(KeptCastsTest, StepsThatDoNotDonateKeepThemToo) {
  Bf16Training training;
  training.Step(0, /*donate=*/false);
  const int64_t weights = training.casts();
  ASSERT_GT(weights, 0);
  for (int step = 1; step < 3; ++step) {
    training.Step(step, /*donate=*/false);
    EXPECT_EQ(training.casts(), weights) << step;
  }
}

// An inference forward reads the casts a training step left, and one that
// comes first leaves its own for the training step after it.
TEST(KeptCastsTest, ForwardsShareThemWithTraining) {
  Bf16Training training;
  training.Step(0);
  const int64_t weights = training.casts();
  ASSERT_GT(weights, 0);
  training.Forward(7);
  EXPECT_EQ(training.casts(), weights);
  training.DropKeptCasts();
  training.Forward(8);
  EXPECT_EQ(training.casts(), 2 * weights);
  training.Step(1);
  training.Forward(9);
  EXPECT_EQ(training.casts(), 2 * weights);
}

// A step undone after it committed (its answer lost) leaves no cast of its
// weights behind: the session then trains and holds memory exactly as one
// that never ran it.
TEST(KeptCastsTest, AnUndoneStepLeavesNoCast) {
  Bf16Training undone, plain;
  undone.Step(0, /*donate=*/false);
  plain.Step(0, /*donate=*/false);
  undone.UndoneStep(1);
  // Each casts what it reads: the same bytes held.
  undone.Forward(3);
  plain.Forward(3);
  EXPECT_EQ(undone.bytes_in_use(), plain.bytes_in_use());
  for (int step = 1; step < 3; ++step) {
    SCOPED_TRACE(step);
    const te::v1::ForwardBackwardResponse got = undone.Step(step, /*donate=*/false);
    const te::v1::ForwardBackwardResponse want = plain.Step(step, /*donate=*/false);
    testing::ExpectSameStep(got, want);
    testing::ExpectSameVariables(undone.Variables(), plain.Variables());
  }
}

// A call cancelled once its forward has cast a weight keeps none of its
// casts; SetVariables drops the kept ones, and the next step casts again.
TEST(KeptCastsTest, AFailedCallAndSetVariablesLeaveNoCast) {
  Bf16Training training;
  const int64_t before = training.bytes_in_use();
  CallContext cancelled_after_a_cast;
  cancelled_after_a_cast.cancelled = [&] { return training.casts() > 0; };
  te::v1::ForwardBackwardResponse unused;
  const absl::Status ran = training.TrainStep(0, &unused, /*donate=*/false, cancelled_after_a_cast);
  EXPECT_EQ(ran.code(), absl::StatusCode::kCancelled) << ran;
  EXPECT_GT(training.casts(), 0);
  EXPECT_EQ(training.bytes_in_use(), before);

  const int64_t cancelled_casts = training.casts();
  training.Step(1);
  const int64_t weights = training.casts() - cancelled_casts;
  EXPECT_GE(weights, cancelled_casts);
  const int64_t with_casts = training.bytes_in_use();
  training.DropKeptCasts();
  EXPECT_LT(training.bytes_in_use(), with_casts);
  training.Step(2);
  EXPECT_EQ(training.casts() - cancelled_casts, 2 * weights);
  training.Step(3);
  EXPECT_EQ(training.casts() - cancelled_casts, 2 * weights);
}

}  // namespace
}  // namespace te::session
