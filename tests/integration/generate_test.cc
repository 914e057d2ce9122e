// Generate through a real te_server and the C++ client (client/generate.h),
// on the LM of client/python/examples/train_lm.py as its tracer builds it
// (nn.Embed, the cast to bfloat16, TE TransformerLayers: ENCODERs with a
// causal mask and rotary embedding, nn.LayerNorm, the tied attend, the
// loss), trained a few steps first so its parameters and FP8 scales are not
// init's:
//  - greedy tokens are those of re-running the full causal forward on the
//    growing prefix (its argmax each time), in bf16 and under FP8
//    DelayedScaling, and the layer's variables are bit for bit as before;
//  - sampling is reproducible for a seed and differs for another;
//  - stop tokens end each sequence; a deadline or a cancel mid-generation
//    ends the call after the tokens already sent, and the session's next
//    call runs at once; bad requests are INVALID_ARGUMENT naming the field.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/generate.h"
#include "client/recipe.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "tests/lm_graph_text.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kVocab = 256;
constexpr int64_t kTrainBatch = 4, kTrainSeq = 12;

// train_lm.py's DecoderLM at `hidden` x `layers`, as te_client's tracer
// writes it; `loss`: ending in the loss (as init traces it), else in the
// logits (a graph over the same variables for the reference forwards).
std::string LmGraph(int64_t hidden, int layers, bool loss) {
  LmGraphOptions options;
  options.vocab = kVocab;
  options.hidden = hidden;
  options.mlp_hidden = 4 * hidden;
  options.layers = layers;
  options.loss = loss;
  return LmGraphText(options);
}

te::v1::LayerSpec Spec(const std::string& text) {
  te::v1::LayerSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

te::v1::Tensor Ids(const std::vector<int32_t>& ids, int64_t batch) {
  te::v1::Tensor t;
  t.set_dtype(te::v1::INT32);
  t.add_shape(batch);
  t.add_shape(static_cast<int64_t>(ids.size()) / batch);
  t.set_inline_data(std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  return t;
}

client::HostTensor Prompt(const std::vector<int32_t>& ids, int64_t batch) {
  const int64_t length = static_cast<int64_t>(ids.size()) / batch;
  return *client::HostTensor::FromBytes(
      DType::kI32, {batch, length},
      std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
}

std::vector<int32_t> Text(const std::string& s) {
  return std::vector<int32_t>(s.begin(), s.end());
}

// The variables of every collection of the newest version, as bytes by name.
std::map<std::string, std::string> Snapshot(client::Session& session, const std::string& layer_id,
                                             int64_t* version) {
  te::v1::GetVariablesRequest request;
  request.set_layer_id(layer_id);
  auto got = session.GetVariables(request);
  EXPECT_TRUE(got.ok()) << got.status();
  std::map<std::string, std::string> bytes;
  if (!got.ok()) return bytes;
  *version = got->version();
  for (const te::v1::Variable& v : got->variables()) {
    auto value = session.Receive(v.value(), v.path());
    EXPECT_TRUE(value.ok()) << value.status();
    if (value.ok()) bytes[v.collection() + "/" + v.path()] = value->bytes();
  }
  return bytes;
}

class GenerateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = client::Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    client::SessionOptions options;
    options.recipes = {client::DelayedScaling{}};
    auto session = client_->CreateSession(options);
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = std::move(*session);
  }

  // The LM initialised under the current autocast and trained `steps` steps
  // (Adam, on a repeated sentence), so neither its parameters nor its FP8
  // scales are init's.
  client::Variables TrainedLm(int64_t hidden, int layers, int steps) {
    te::v1::InitLayerRequest init;
    *init.mutable_spec() = Spec(LmGraph(hidden, layers, true));
    init.set_seed(7);
    init.set_input_dtype(te::v1::INT32);
    init.add_input_shape(kTrainBatch);
    init.add_input_shape(kTrainSeq);
    *init.mutable_autocast() = client::ToProto(client::Autocast::Current());
    auto layer = session_->InitLayer(init);
    EXPECT_TRUE(layer.ok()) << layer.status();
    client::Variables vars;
    if (!layer.ok()) return vars;
    vars.session = session_.get();
    vars.layer_id = layer->layer_id();
    client::Optimizer adam;
    adam.kind = client::Optimizer::Kind::kAdam;
    adam.learning_rate = 1e-3;  // moves the parameters, not yet to the corpus's few commonest bytes
    EXPECT_TRUE(session_->SetOptimizer(vars.layer_id, adam).ok());
    const std::string text = "the quick brown fox jumps over the lazy dog; ";
    for (int step = 0; step < steps; ++step) {
      std::vector<int32_t> x, y;
      for (int64_t b = 0; b < kTrainBatch; ++b) {
        for (int64_t s = 0; s < kTrainSeq; ++s) {
          const size_t at = (step * 5 + b * 11 + s) % text.size();
          x.push_back(static_cast<unsigned char>(text[at]));
          y.push_back(static_cast<unsigned char>(text[(at + 1) % text.size()]));
        }
      }
      te::v1::ForwardBackwardRequest request;
      request.set_layer_id(vars.layer_id);
      request.set_deterministic(true);
      request.set_apply_update(true);
      *request.mutable_autocast() = client::ToProto(client::Autocast::Current());
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = Ids(x, kTrainBatch);
      *mb->add_extra_inputs() = Ids(y, kTrainBatch);
      auto stepped = session_->ForwardBackward(request);
      EXPECT_TRUE(stepped.ok()) << stepped.status();
    }
    return vars;
  }

  // Greedy by the full forward of the logits graph on each growing prefix:
  // one graph (AddGraph) and one Forward per new token.
  std::vector<std::vector<int32_t>> GreedyByFullForwards(const client::Variables& vars,
                                                         int64_t hidden, int layers,
                                                         std::vector<int32_t> prompt,
                                                         int64_t batch, int64_t new_tokens) {
    std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(batch)), made(seqs.size());
    const int64_t prompt_length = static_cast<int64_t>(prompt.size()) / batch;
    for (int64_t b = 0; b < batch; ++b) {
      seqs[b].assign(prompt.begin() + b * prompt_length, prompt.begin() + (b + 1) * prompt_length);
    }
    for (int64_t k = 0; k < new_tokens; ++k) {
      const int64_t n = prompt_length + k;
      te::v1::AddGraphRequest add;
      add.set_layer_id(vars.layer_id);
      *add.mutable_graph() = Spec(LmGraph(hidden, layers, false)).graph();
      add.set_input_dtype(te::v1::INT32);
      add.add_input_shape(batch);
      add.add_input_shape(n);
      auto graph = session_->AddGraph(add);
      EXPECT_TRUE(graph.ok()) << graph.status();
      if (!graph.ok()) return made;
      std::vector<int32_t> flat;
      for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
      te::v1::ForwardRequest forward;
      forward.set_layer_id(vars.layer_id);
      forward.set_graph(graph->graph());
      *forward.mutable_x() = Ids(flat, batch);
      forward.set_deterministic(true);
      *forward.mutable_autocast() = client::ToProto(client::Autocast::Current());
      auto y = session_->Forward(forward);
      EXPECT_TRUE(y.ok()) << y.status();
      if (!y.ok()) return made;
      auto logits = session_->Receive(y->y(), "y");
      EXPECT_TRUE(logits.ok()) << logits.status();
      EXPECT_EQ(logits->shape(), (Shape{batch, n, kVocab}));
      const std::vector<float> values = logits->ToFloats();
      for (int64_t b = 0; b < batch; ++b) {
        const float* row = values.data() + (b * n + n - 1) * kVocab;
        const int32_t best = static_cast<int32_t>(std::max_element(row, row + kVocab) - row);
        seqs[b].push_back(best);
        made[b].push_back(best);
      }
    }
    return made;
  }

  void GreedyIsTheFullForwards() {
    const int64_t hidden = 32, batch = 2, new_tokens = 7;
    const int layers = 2;
    client::Variables vars = TrainedLm(hidden, layers, 4);
    ASSERT_FALSE(vars.layer_id.empty());
    int64_t version_before = 0, version_after = 0;
    const auto before = Snapshot(*session_, vars.layer_id, &version_before);
    const std::vector<int32_t> prompt = Text("the qu" "lazy d");
    client::GenerateOptions options;
    options.max_new_tokens = new_tokens;
    std::vector<client::GenerateStep> steps;
    auto made = client::Generate(vars, Prompt(prompt, batch), options,
                                 [&](const client::GenerateStep& step) {
                                   steps.push_back(step);
                                   return absl::OkStatus();
                                 });
    ASSERT_TRUE(made.ok()) << made.status();
    // Generation changed nothing: the same version, the same bytes in every
    // collection (fp8_metas included: the steps' amaxes went into a copy).
    const auto after = Snapshot(*session_, vars.layer_id, &version_after);
    EXPECT_EQ(version_after, version_before);
    ASSERT_EQ(after.size(), before.size());
    for (const auto& [name, bytes] : before) EXPECT_TRUE(after.at(name) == bytes) << name;

    const auto want = GreedyByFullForwards(vars, hidden, layers, prompt, batch, new_tokens);
    EXPECT_EQ(made->tokens, want);
    // A comparison that could pass by accident would not test much: the
    // trained model's tokens vary.
    std::set<int32_t> distinct;
    for (const auto& seq : want) distinct.insert(seq.begin(), seq.end());
    EXPECT_GE(distinct.size(), 3u);
    ASSERT_EQ(steps.size(), static_cast<size_t>(new_tokens));
    for (int64_t k = 0; k < new_tokens; ++k) {
      EXPECT_EQ(steps[k].step, k);
      ASSERT_EQ(steps[k].tokens.size(), static_cast<size_t>(batch));
      for (int64_t b = 0; b < batch; ++b) EXPECT_EQ(steps[k].tokens[b], want[b][k]) << b << " " << k;
    }
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Session> session_;
};

TEST_F(GenerateTest, GreedyIsTheFullForwardOnTheGrowingPrefixInBf16) {
  GreedyIsTheFullForwards();
}

TEST_F(GenerateTest, GreedyIsTheFullForwardOnTheGrowingPrefixUnderFp8DelayedScaling) {
  client::DelayedScaling recipe;
  recipe.amax_history_len = 16;
  client::Autocast fp8(true, recipe);
  GreedyIsTheFullForwards();
}

TEST_F(GenerateTest, SamplingIsReproducibleForASeedAndDiffersForAnother) {
  client::Variables vars = TrainedLm(32, 2, 2);
  ASSERT_FALSE(vars.layer_id.empty());
  client::GenerateOptions options;
  options.max_new_tokens = 16;
  options.sample = true;
  options.temperature = 1.5f;  // flat enough that two seeds part early
  options.top_k = 50;
  options.top_p = 0.95f;
  options.seed = 3;
  const client::HostTensor prompt = Prompt(Text("def fdef g"), 2);
  auto a = client::Generate(vars, prompt, options);
  auto b = client::Generate(vars, prompt, options);
  options.seed = 4;
  auto c = client::Generate(vars, prompt, options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << a.status() << b.status() << c.status();
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NE(a->tokens, c->tokens);
  // top_k 1 is greedy, whatever the seed and temperature.
  options.top_k = 1;
  auto top1 = client::Generate(vars, prompt, options);
  client::GenerateOptions greedy;
  greedy.max_new_tokens = 16;
  auto argmax = client::Generate(vars, prompt, greedy);
  ASSERT_TRUE(top1.ok() && argmax.ok()) << top1.status() << argmax.status();
  EXPECT_EQ(top1->tokens, argmax->tokens);
}

TEST_F(GenerateTest, StopTokensEndEachSequence) {
  client::Variables vars = TrainedLm(32, 2, 2);
  ASSERT_FALSE(vars.layer_id.empty());
  const client::HostTensor prompt = Prompt(Text("abcxyz"), 2);
  client::GenerateOptions options;
  options.max_new_tokens = 10;
  auto greedy = client::Generate(vars, prompt, options);
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  // Sequence 0 stops at the first place it makes its fourth token (that
  // token may come earlier too); sequence 1 goes on unless it makes that
  // token too, and the call ends when both have stopped or at 10.
  const int32_t stop = greedy->tokens[0][3];
  const size_t first_stop =
      std::find(greedy->tokens[0].begin(), greedy->tokens[0].end(), stop) - greedy->tokens[0].begin();
  options.stop_tokens = {stop};
  std::vector<client::GenerateStep> steps;
  auto stopped = client::Generate(vars, prompt, options, [&](const client::GenerateStep& step) {
    steps.push_back(step);
    return absl::OkStatus();
  });
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  size_t longest = 0;
  for (int b = 0; b < 2; ++b) {
    std::vector<int32_t> want;
    for (int32_t t : greedy->tokens[b]) {
      want.push_back(t);
      if (t == stop) break;
    }
    EXPECT_EQ(stopped->tokens[b], want) << b;
    EXPECT_EQ(stopped->stopped[b], want.back() == stop) << b;
    longest = std::max(longest, want.back() == stop ? want.size() : size_t{10});
  }
  EXPECT_TRUE(stopped->stopped[0]);
  EXPECT_EQ(stopped->tokens[0].size(), first_stop + 1);
  ASSERT_EQ(steps.size(), longest);
  // A stopped sequence repeats its stop token, flagged.
  for (size_t k = 0; k < steps.size(); ++k) {
    EXPECT_EQ(steps[k].stopped[0], k >= first_stop) << k;
    if (k >= first_stop) {
      EXPECT_EQ(steps[k].tokens[0], stop) << k;
    }
  }
}

// A model slow enough on the CPU server that a generation of kLongRun tokens
// takes far longer than the deadlines below.
constexpr int64_t kSlowHidden = 256;
constexpr int kSlowLayers = 4;
constexpr int64_t kLongRun = 4000;

// The session answers at once: the generation was stopped, not left running
// in the session's turn.
void ExpectSessionFree(client::Session& session) {
  const absl::Time start = absl::Now();
  auto info = session.GetSessionInfo(absl::Seconds(20));
  EXPECT_TRUE(info.ok()) << info.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST_F(GenerateTest, DeadlineMidGenerationEndsAfterTheTokensSent) {
  client::Variables vars = TrainedLm(kSlowHidden, kSlowLayers, 0);
  ASSERT_FALSE(vars.layer_id.empty());
  client::GenerateOptions options;
  options.max_new_tokens = kLongRun;
  options.timeout = absl::Seconds(3);
  int64_t received = 0;
  const absl::Time start = absl::Now();
  auto made = client::Generate(vars, Prompt(Text("hello"), 1), options,
                               [&](const client::GenerateStep&) {
                                 ++received;
                                 return absl::OkStatus();
                               });
  EXPECT_EQ(made.status().code(), absl::StatusCode::kDeadlineExceeded) << made.status();
  EXPECT_GT(received, 0);
  EXPECT_LT(received, kLongRun);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ExpectSessionFree(*session_);
}

TEST_F(GenerateTest, CancellationStopsTheServer) {
  client::Variables vars = TrainedLm(kSlowHidden, kSlowLayers, 0);
  ASSERT_FALSE(vars.layer_id.empty());
  client::GenerateOptions options;
  options.max_new_tokens = kLongRun;
  int64_t received = 0;
  auto made = client::Generate(vars, Prompt(Text("hello"), 1), options,
                               [&](const client::GenerateStep&) {
                                 return ++received == 3 ? absl::CancelledError("enough")
                                                        : absl::OkStatus();
                               });
  EXPECT_EQ(made.status().code(), absl::StatusCode::kCancelled) << made.status();
  EXPECT_EQ(received, 3);
  ExpectSessionFree(*session_);
  // The session goes on: a short generation runs to its end.
  options.max_new_tokens = 2;
  auto again = client::Generate(vars, Prompt(Text("hello"), 1), options);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tokens[0].size(), 2u);
}

// INVALID_ARGUMENT (or the code given) naming `field`.
void ExpectRefused(const absl::Status& status, const std::string& field,
                   absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), field)) << field << ": " << status;
}

TEST_F(GenerateTest, BadRequestsNameTheirField) {
  client::Variables vars = TrainedLm(32, 1, 0);
  ASSERT_FALSE(vars.layer_id.empty());
  const client::HostTensor prompt = Prompt(Text("abc"), 1);
  client::GenerateOptions options;
  options.max_new_tokens = 4;

  auto floats = client::HostTensor::FromFloats({1, 3}, {1.0f, 2.0f, 3.0f});
  ExpectRefused(client::Generate(vars, *floats, options).status(), "prompt");
  ExpectRefused(client::Generate(vars, *Prompt(Text("abcd"), 1).Reshaped({4}), options).status(),
                "prompt");
  client::GenerateOptions bad = options;
  bad.max_new_tokens = 0;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "max_new_tokens");
  bad = options;
  bad.max_new_tokens = int64_t{1} << 40;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "max_new_tokens");
  bad = options;
  bad.max_new_tokens = int64_t{1} << 30;  // caches of 2^30 positions: beyond the session's memory
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "max_new_tokens",
                absl::StatusCode::kResourceExhausted);
  bad = options;
  bad.sample = true;
  bad.temperature = 0.0f;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "sampling.temperature");
  bad.temperature = -1.0f;
  bad.sample = false;  // checked whether or not the call samples
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "sampling.temperature");
  bad = options;
  bad.sample = true;
  bad.top_p = 0.0f;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "sampling.top_p");
  bad.top_p = 1.5f;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "sampling.top_p");
  bad = options;
  bad.sample = true;
  bad.top_k = -1;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "sampling.top_k");
  bad = options;
  bad.graph = 9;
  ExpectRefused(client::Generate(vars, prompt, bad).status(), "graph");
  client::Variables unknown = vars;
  unknown.layer_id = "layer-none";
  ExpectRefused(client::Generate(unknown, prompt, options).status(), "layer", absl::StatusCode::kNotFound);
  {
    // FP8 on a layer initialised without it: init under autocast (TE's
    // ScopeCollectionNotFound).
    client::Autocast fp8(true, client::DelayedScaling{});
    ExpectRefused(client::Generate(vars, prompt, options).status(), "fp8_metas",
                  absl::StatusCode::kFailedPrecondition);
  }

  // A model that does not take token ids, and one that cannot decode.
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(8);
  init.set_input_dtype(te::v1::FLOAT32);
  init.add_input_shape(1);
  init.add_input_shape(3);
  init.add_input_shape(8);
  auto dense = session_->InitLayer(init);
  ASSERT_TRUE(dense.ok()) << dense.status();
  client::Variables dense_vars = vars;
  dense_vars.layer_id = dense->layer_id();
  ExpectRefused(client::Generate(dense_vars, prompt, options).status(), "layer_id");
  std::string padding = LmGraph(32, 1, false);
  const std::string tl = "transformer_layer { hidden_size";
  padding.replace(padding.find(tl), tl.size(),
                  "transformer_layer { self_attn_mask_type: PADDING hidden_size");
  te::v1::InitLayerRequest lm;
  *lm.mutable_spec() = Spec(padding);
  lm.set_input_dtype(te::v1::INT32);
  lm.add_input_shape(1);
  lm.add_input_shape(4);
  auto padded = session_->InitLayer(lm);
  ASSERT_TRUE(padded.ok()) << padded.status();
  client::Variables padded_vars = vars;
  padded_vars.layer_id = padded->layer_id();
  const absl::Status not_causal = client::Generate(padded_vars, prompt, options).status();
  ExpectRefused(not_causal, "layer_id");
  ExpectRefused(not_causal, "TransformerLayer_0");

  // The session is as it was: generation still works.
  auto fine = client::Generate(vars, prompt, options);
  ASSERT_TRUE(fine.ok()) << fine.status();
}

}  // namespace
}  // namespace te::testing
