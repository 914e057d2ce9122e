// A tiny decoder LM through a real te_server with the C++ client: one graph
// (Embed, two TE TransformerLayers, Flax's LayerNorm, the tied attend, the
// softmax cross-entropy loss), int32 tokens as x and int32 labels as
// extra_inputs[0], and ForwardBackward with apply_update and no dy: the loss
// falls from ~ln(256) on a repeated sentence. Then the same LM built with
// the C++ Graph builder (client/decoder_lm.h, train_lm.py's DecoderLM) and
// trained as train_lm.py trains it: AdamW under a warmup-cosine schedule with
// global-norm clipping, the update decided and applied on the server.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/decoder_lm.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kBatch = 4, kSeq = 16;
constexpr int kSteps = 200;
// ln(256) = 5.55 at the start; the sentence's bigrams alone give ~2.
constexpr double kFinalLoss = 2.0;

constexpr char kLm[] = R"pb(
  graph {
    nodes { name: "Embed_0" inputs: "x" outputs: "Embed_0" module { flax_embed { num_embeddings: 256 features: 32 } } }
    nodes { name: "TransformerLayer_0" inputs: "Embed_0" outputs: "TransformerLayer_0" module { transformer_layer { hidden_size: 32 mlp_hidden_size: 64 num_attention_heads: 4 hidden_dropout: 0 attention_dropout: 0 intermediate_dropout: 0 } } }
    nodes { name: "TransformerLayer_1" inputs: "TransformerLayer_0" outputs: "TransformerLayer_1" module { transformer_layer { hidden_size: 32 mlp_hidden_size: 64 num_attention_heads: 4 hidden_dropout: 0 attention_dropout: 0 intermediate_dropout: 0 } } }
    nodes { name: "LayerNorm_0" inputs: "TransformerLayer_1" outputs: "LayerNorm_0" module { flax_layer_norm {} } }
    nodes { name: "attend_0" inputs: "LayerNorm_0" outputs: "attend_0" attend { embed: "Embed_0" } }
    nodes { name: "softmax_cross_entropy_0" inputs: "attend_0" inputs: "extra_inputs[0]" outputs: "softmax_cross_entropy_0" softmax_cross_entropy {} }
    outputs: "softmax_cross_entropy_0"
  })pb";

te::v1::Tensor Ids(const std::vector<int32_t>& ids) {
  te::v1::Tensor t;
  t.set_dtype(te::v1::INT32);
  t.add_shape(kBatch);
  t.add_shape(kSeq);
  t.set_inline_data(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  return t;
}

// An LM's init: int32 token ids [kBatch, kSeq] in.
te::v1::InitLayerRequest IdsInit(const te::v1::LayerSpec& spec, int seed) {
  te::v1::InitLayerRequest init;
  *init.mutable_spec() = spec;
  init.set_seed(seed);
  init.set_input_dtype(te::v1::INT32);
  init.add_input_shape(kBatch);
  init.add_input_shape(kSeq);
  return init;
}

// Training step `step`: kBatch windows of a repeated sentence, x the bytes and
// the labels the bytes after them; the update applied on the server.
te::v1::ForwardBackwardRequest SentenceStep(const std::string& layer_id, int step) {
  const std::string text = "the quick brown fox jumps over the lazy dog; ";
  std::vector<int32_t> x, y;
  for (int64_t b = 0; b < kBatch; ++b) {
    const size_t start = (step * 7 + b * 11) % text.size();
    for (int64_t s = 0; s < kSeq; ++s) {
      x.push_back(static_cast<unsigned char>(text[(start + s) % text.size()]));
      y.push_back(static_cast<unsigned char>(text[(start + s + 1) % text.size()]));
    }
  }
  te::v1::ForwardBackwardRequest request;
  request.set_layer_id(layer_id);
  request.set_deterministic(true);
  request.set_apply_update(true);
  te::v1::MicroBatch* mb = request.add_micro_batches();
  *mb->mutable_x() = Ids(x);
  *mb->add_extra_inputs() = Ids(y);
  return request;
}

// A real te_server and one session on it.
class LmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = client::Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    auto session = client_->CreateSession();
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
};

TEST_F(LmTest, CppClientTrainsATinyLmWithOnlyIdsOnTheWire) {
  te::v1::LayerSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(kLm, &spec));
  auto layer = session_->InitLayer(IdsInit(spec, 1));
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->output_shape_size(), 0);  // the loss is a scalar
  client::Optimizer adam;
  adam.kind = client::Optimizer::Kind::kAdam;
  adam.learning_rate = 3e-3;
  ASSERT_TRUE(session_->SetOptimizer(layer->layer_id(), adam).ok());

  double first = 0, last = 0;
  for (int step = 0; step < kSteps; ++step) {
    const te::v1::ForwardBackwardRequest request = SentenceStep(layer->layer_id(), step);
    // Only the ids cross the wire: 2 x 4 x 16 int32 and the request's framing.
    EXPECT_LT(request.ByteSizeLong(), 2 * kBatch * kSeq * 4 + 128);
    auto response = session_->ForwardBackward(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ASSERT_TRUE(response->update().applied());
    last = response->values(0);
    if (step == 0) first = last;
  }
  EXPECT_NEAR(first, 5.55, 1.0);
  EXPECT_LT(last, kFinalLoss) << "first " << first;
}

// The builder's LM, 300 AdamW steps as train_lm.py takes them.
constexpr int kAdamWSteps = 300;
// The sentence is 45 bytes and each window of 16 starts anywhere in it: after
// 300 steps the model has memorised most of it (1.0 is well above what
// it reaches, and far below the ~2 of its bigrams alone).
constexpr double kAdamWFinalLoss = 1.0;

TEST_F(LmTest, CppGraphBuilderLmTrainsWithAdamWWarmupCosineAndClipping) {
  client::DecoderLmSize size;
  size.num_layers = 2;
  size.hidden = 32;
  size.heads = 4;
  size.batch = kBatch;
  size.seq = kSeq;
  size.compute_dtype = DType::kF32;  // the CPU backend's fast path
  absl::StatusOr<te::v1::LayerSpec> spec = client::DecoderLm(size).Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto layer = session_->InitLayer(IdsInit(*spec, 3));
  ASSERT_TRUE(layer.ok()) << layer.status();
  client::Optimizer adamw;  // train_lm.py's: clip 1.0, adamw(warmup_cosine, weight_decay=0.01)
  adamw.kind = client::Optimizer::Kind::kAdamW;
  te::v1::WarmupCosineDecaySchedule schedule;
  schedule.set_init_value(0.0);
  schedule.set_peak_value(1e-2);
  schedule.set_warmup_steps(30);
  schedule.set_decay_steps(kAdamWSteps);
  schedule.set_end_value(1e-3);
  adamw.schedule = schedule;
  adamw.weight_decay = 0.01;
  adamw.clip_by_global_norm = 1.0;
  ASSERT_TRUE(session_->SetOptimizer(layer->layer_id(), adamw).ok());

  double first = 0, last = 0;
  int clipped_or_not = 0;
  for (int step = 0; step < kAdamWSteps; ++step) {
    auto response = session_->ForwardBackward(SentenceStep(layer->layer_id(), step));
    ASSERT_TRUE(response.ok()) << response.status();
    const te::v1::UpdateInfo& update = response->update();
    ASSERT_TRUE(update.applied());
    EXPECT_EQ(update.count(), step + 1);
    // The server's learning rate is the schedule's at the count before the step.
    const double want_lr = step < 30 ? 1e-2 * step / 30.0
                                     : 1e-3 + (1e-2 - 1e-3) * 0.5 *
                                                  (1 + std::cos(M_PI * (step - 30) / (kAdamWSteps - 30.0)));
    EXPECT_NEAR(update.learning_rate(), want_lr, 1e-12) << step;
    EXPECT_GT(update.grad_norm(), 0.0);
    clipped_or_not += update.grad_norm() > 1.0 ? 1 : 0;
    last = response->values(0);
    if (step == 0) first = last;
  }
  EXPECT_NEAR(first, 5.55, 1.0);
  EXPECT_LT(last, kAdamWFinalLoss) << "first " << first;
  EXPECT_GT(clipped_or_not, 0) << "no step's gradient norm reached the clip";
}

}  // namespace
}  // namespace te::testing
