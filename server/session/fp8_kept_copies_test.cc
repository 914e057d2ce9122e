// The kept FP8 weight copies (server/layers/fp8_weight_cache.h) of a graph
// of modules trained as the Python client's train_step trains one: one
// ForwardBackward with apply_update a step, reading the newest version
// (version 0, as a pipelined step reads it) and donating it, under FP8
// DelayedScaling. After the first step every copy is kept across steps and
// rewritten by the update: no step makes a copy again (the NaN fill of a new
// copy's kept scale) and no forward quantizes a weight again (a
// QuantizeTransposeKept whose kept scale is not the quantizer's), and the
// forward checks every copy at its start in one QuantizeTransposeKeptMany
// (no check of its own at each read). The steps
// give, bit for bit, the values and variables of a session whose copies are
// dropped after every update.
//
// A graph's modules run on a view of the layer's variables under their own
// names ("fp8_metas/mlp/wi_kernel_scale" for the layer's
// "fp8_metas/TransformerLayer_0/mlp/wi_kernel_scale"): a copy must be known
// to the update by the layer's names, or the update drops it and the next
// forward makes and quantizes every copy again (99 new copies and 97
// weight quantizations a step for the 24-layer LM).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/kept_check_counting_ops.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "server/session/testing/session_calls.h"
#include "server/session/testing/step_expectations.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::AddNode;
using testing::DelayedScalingRecipe;
using testing::RandomFloats;

constexpr int64_t kBatch = 2, kSeq = 4, kHidden = 32, kFfn = 64;

// The CPU backend, counting what the weight cache does on it: the copies it
// makes (Fp8WeightCache::Quantize fills a new copy's kept scale with NaN) and
// the weight quantizations its QuantizeTransposeKept runs (the kept scale is
// not the quantizer's; the reference decides on the host, as here).
struct Counts {
  int64_t new_copies = 0;
  int64_t quantized = 0;
  KeptChecks checks;
};

class CountingCpuOps : public KeptCheckCountingOps {
 public:
  explicit CountingCpuOps(Counts* counts)
      : KeptCheckCountingOps(&counts->checks), counts_(counts) {}

  absl::Status Fill(float value, Tensor* y) override {
    if (std::isnan(value) && y->dtype() == DType::kF32 && y->numel() == 1) ++counts_->new_copies;
    return CpuOps::Fill(value, y);
  }
  absl::Status QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                     const KeptQuantization& kept, Tensor* y,
                                     Tensor* y_t) override {
    float kept_scale = 0.0f, scale = 0.0f;
    std::memcpy(&kept_scale, kept.scale.data(), sizeof(float));
    std::memcpy(&scale, fp8.scale.data(), sizeof(float));
    if (!(kept_scale == scale)) ++counts_->quantized;
    return KeptCheckCountingOps::QuantizeTransposeKept(x, fp8, kept, y, y_t);
  }

 private:
  Counts* counts_;
};

// x -> TransformerLayer_0 -> TransformerLayer_1 -> LayerNormMLP_0 -> y, as
// the client traces Flax code that calls TE's modules.
te::v1::LayerSpec GraphOfModules() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  for (int i = 0; i < 2; ++i) {
    testing::AddTransformerLayer(g, "TransformerLayer_" + std::to_string(i), i == 0 ? "x" : "h0",
                                 i == 0 ? "h0" : "h1", kHidden, kFfn)
        ->set_enable_rotary_pos_emb(true);
  }
  te::v1::LayerNormMLP* mlp =
      AddNode(g, "LayerNormMLP_0", {"h1"}, {"y"})->mutable_module()->mutable_layer_norm_mlp();
  mlp->set_intermediate_dim(kFfn);
  mlp->add_activations("gelu");
  mlp->set_intermediate_dropout_rate(0.0f);
  g->add_outputs("y");
  return spec;
}

class GraphTraining {
 public:
  GraphTraining() {
    device_ = *OpenCpuDevice();
    auto ops = std::make_unique<CountingCpuOps>(&counts_);
    ops->set_memory_limit(int64_t{1} << 30);
    session_ = std::make_unique<Session>("fp8_kept_copies", device_->info(), std::move(ops),
                                         SessionConfig(), te::v1::EMULATE,
                                         DelayedScalingRecipe());
    te::v1::InitLayerRequest init = testing::AutocastInitRequest(5, {kBatch, kSeq, kHidden});
    *init.mutable_spec() = GraphOfModules();
    const absl::StatusOr<std::string> layer = testing::InitWithAdamW(*session_, init);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (layer.ok()) layer_id_ = *layer;
  }

  // train_step(state, x, dy=dy, donate=True) sent on top of the step before:
  // the newest version (0), donated, one micro-batch, apply_update.
  te::v1::ForwardBackwardResponse TrainStep(int step) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    request.set_apply_update(true);
    request.set_donate(true);
    request.mutable_autocast()->set_enabled(true);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = RandomFloats({kBatch, kSeq, kHidden}, 100 * step, 1.0f);
    *mb->mutable_dy() = RandomFloats({kBatch, kSeq, kHidden}, 100 * step + 50, 0.1f);
    te::v1::ForwardBackwardResponse response;
    const absl::Status ran = session_->ForwardBackward(request, &response, CallContext());
    EXPECT_TRUE(ran.ok()) << ran;
    return response;
  }

  // Every variable: "collection/path" -> its bytes.
  std::map<std::string, std::string> Variables() {
    absl::StatusOr<std::map<std::string, std::string>> bytes =
        testing::VariableBytes(*session_, layer_id_);
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    return bytes.ok() ? *std::move(bytes) : std::map<std::string, std::string>{};
  }

  // No number changes, and the kept copies go (SetVariables); the older
  // versions are released.
  void DropKeptCopies() {
    const absl::StatusOr<int64_t> rewritten =
        testing::RewriteFirstVariable(*session_, layer_id_, "fp8_metas");
    ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  }

  const Counts& counts() const { return counts_; }
  int64_t bytes_in_use() const { return session_->bytes_in_use(); }

 private:
  Counts counts_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

// Two TransformerLayers (qkv, out, wi, wo) and an MLP (wi, wo).
constexpr int64_t kKernels = 2 * 4 + 2;

TEST(Fp8KeptCopiesTest, AGraphsCopiesAreKeptAcrossDonatingSteps) {
  GraphTraining kept, dropped;
  kept.TrainStep(0);
  dropped.TrainStep(0);
  dropped.DropKeptCopies();
  EXPECT_EQ(kept.counts().new_copies, kKernels);
  EXPECT_EQ(kept.counts().quantized, kKernels);
  int64_t held = 0;
  for (int step = 1; step < 5; ++step) {
    SCOPED_TRACE(step);
    const Counts before = kept.counts();
    const te::v1::ForwardBackwardResponse got = kept.TrainStep(step);
    const te::v1::ForwardBackwardResponse want = dropped.TrainStep(step);
    dropped.DropKeptCopies();
    // Every copy was kept and rewritten by the update: none made, no weight
    // quantized by the forward.
    EXPECT_EQ(kept.counts().new_copies - before.new_copies, 0);
    EXPECT_EQ(kept.counts().quantized - before.quantized, 0);
    // And checked at the forward's start, all in one QuantizeTransposeKeptMany.
    EXPECT_EQ(kept.counts().checks.at_once - before.checks.at_once, kKernels);
    EXPECT_EQ(kept.counts().checks.alone - before.checks.alone, 0);
    if (step > 1) { EXPECT_EQ(kept.bytes_in_use(), held); }
    held = kept.bytes_in_use();
    // The session that drops its copies makes and quantizes them every step.
    EXPECT_GE(dropped.counts().new_copies, (step + 1) * kKernels);
    // And the results are those of quantizing every weight every step.
    EXPECT_TRUE(got.update().applied());
    testing::ExpectSameStep(got, want);
    testing::ExpectSameVariables(kept.Variables(), dropped.Variables());
  }
}

}  // namespace
}  // namespace te::session
