// client/train_steps.h against a real te_server: a loop of TrainSteps, with
// several steps in flight and no loss read until the end, against the
// synchronous loop (Module::LossValueAndGrad with apply_update, each answer
// read before the next step is sent): the same losses, update counts and
// learning rates, and the same final variables (params, opt_state and, under
// FP8 DelayedScaling, the fp8_metas every step moves), bit for bit, in the
// order sent. A step the server fails reports its status; the steps sent on
// top of it report the same code and change nothing: variables() stays the
// last good step's, and the loop goes on from it as the synchronous one would.
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "client/client.h"
#include "client/decoder_lm.h"
#include "client/modules.h"
#include "client/train_steps.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::testing {
namespace {

using client::DType;
using client::HostTensor;

constexpr int64_t kBatch = 4, kSeq = 16;
constexpr int kSteps = 8;
constexpr int kDepth = 4;

struct Batch {
  HostTensor tokens, labels;
};

// Step i's windows of a repeated sentence: tokens and the next bytes.
Batch SentenceBatch(int step, int64_t seq = kSeq) {
  const std::string text = "the quick brown fox jumps over the lazy dog; ";
  std::vector<float> x, y;
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const size_t at = (step * 7 + b * 11 + s) % text.size();
      x.push_back(static_cast<unsigned char>(text[at]));
      y.push_back(static_cast<unsigned char>(text[(at + 1) % text.size()]));
    }
  }
  return {*HostTensor::FromFloats({kBatch, seq}, x, DType::kI32),
          *HostTensor::FromFloats({kBatch, seq}, y, DType::kI32)};
}

// The loop's kSteps batches.
std::vector<Batch> SentenceBatches() {
  std::vector<Batch> batches;
  for (int i = 0; i < kSteps; ++i) batches.push_back(SentenceBatch(i));
  return batches;
}

client::Graph SmallLm() {
  client::DecoderLmSize size;
  size.num_layers = 1;
  size.hidden = 32;
  size.heads = 4;
  size.batch = kBatch;
  size.seq = kSeq;
  size.compute_dtype = DType::kF32;
  return client::DecoderLm(size);
}

client::Optimizer AdamWWarmupCosine() {
  client::Optimizer adamw;
  adamw.kind = client::Optimizer::Kind::kAdamW;
  te::v1::WarmupCosineDecaySchedule schedule;
  schedule.set_init_value(0.0);
  schedule.set_peak_value(1e-2);
  schedule.set_warmup_steps(3);
  schedule.set_decay_steps(kSteps);
  schedule.set_end_value(1e-3);
  adamw.schedule = schedule;
  adamw.weight_decay = 0.01;
  adamw.clip_by_global_norm = 1.0;
  return adamw;
}

struct Row {
  double loss = 0;
  int64_t count = 0;
  double learning_rate = 0;
  bool operator==(const Row& o) const {
    return loss == o.loss && count == o.count && learning_rate == o.learning_rate;
  }
};

class PipelinedTrainStepsTest : public client::testing::SuiteServerTest<::testing::TestWithParam<bool>> {
 protected:
  static void SetUpTestSuite() { StartSuiteServer({"--enable_shm"}); }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = client::Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  bool fp8() const { return GetParam(); }

  std::unique_ptr<client::Session> Open(client::Transport transport = client::Transport::kAuto) {
    client::SessionOptions options;
    options.transport = transport;
    if (fp8()) options.recipes = {client::DelayedScaling{}};
    auto session = client_->CreateSession(options);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *std::move(session) : nullptr;
  }

  // A session with the LM initialised in it (under FP8 DelayedScaling when
  // the parameter asks, the autocast held as long as the run), with its
  // optimizer. Members go in reverse: the variables before the session.
  struct LmRun {
    std::unique_ptr<client::Session> session;
    std::optional<client::Autocast> scope;
    client::Graph lm = SmallLm();
    std::optional<client::Variables> start;
  };
  std::unique_ptr<LmRun> StartLm(client::Transport transport = client::Transport::kAuto) {
    auto run = std::make_unique<LmRun>();
    run->session = Open(transport);
    if (run->session == nullptr) return nullptr;
    if (fp8()) run->scope.emplace(true, client::DelayedScaling{});
    absl::StatusOr<client::Variables> vars = run->lm.Init(*run->session, /*key=*/5, SentenceBatch(0).tokens);
    EXPECT_TRUE(vars.ok()) << vars.status();
    if (!vars.ok()) return nullptr;
    absl::Status set = run->session->SetOptimizer(vars->layer_id, AdamWWarmupCosine()).status();
    EXPECT_TRUE(set.ok()) << set;
    if (!set.ok()) return nullptr;
    run->start = vars->Pinned();
    return run;
  }

  static std::map<std::string, std::vector<float>> Values(const client::Variables& vars) {
    std::map<std::string, std::vector<float>> out;
    auto got = client::GetVariables(vars);
    EXPECT_TRUE(got.ok()) << got.status();
    if (got.ok()) {
      for (const auto& [name, value] : *got) out[name] = value.ToFloats();
    }
    return out;
  }

  static client::ApplyOptions WithLabels(const Batch& batch) {
    client::ApplyOptions options;
    options.extra_inputs = {batch.labels};
    return options;
  }

  // The synchronous loop over `batches`: rows and final variables.
  void Synchronous(const std::vector<Batch>& batches, std::vector<Row>* rows,
                   std::map<std::string, std::vector<float>>* final_values) {
    std::unique_ptr<LmRun> run = StartLm();
    ASSERT_NE(run, nullptr);
    std::optional<client::Variables> vars = run->start;
    for (const Batch& batch : batches) {
      client::ApplyOptions options = WithLabels(batch);
      options.apply_update = true;
      auto step = run->lm.LossValueAndGrad(*vars, batch.tokens, options);
      ASSERT_TRUE(step.ok()) << step.status();
      rows->push_back({step->value, step->update->count(), step->update->learning_rate()});
      vars = *step->variables;
    }
    *final_values = Values(*vars);
  }

  std::unique_ptr<client::Client> client_;
};

TEST_P(PipelinedTrainStepsTest, EqualTheSynchronousLoopBitForBitInTheOrderSent) {
  const std::vector<Batch> batches = SentenceBatches();
  std::vector<Row> want;
  std::map<std::string, std::vector<float>> want_values;
  Synchronous(batches, &want, &want_values);

  std::unique_ptr<LmRun> run = StartLm();
  ASSERT_NE(run, nullptr);
  const client::Graph& lm = run->lm;
  const client::Variables& start = *run->start;
  const std::map<std::string, std::vector<float>> start_values = Values(start);

  client::TrainSteps steps(lm, start, kDepth);
  std::vector<client::PendingStep> sent;
  int sent_before_the_last_answered = 0;
  for (const Batch& batch : batches) {
    const bool last_open = !sent.empty() && !sent.back().Ready();
    auto step = steps.Step(batch.tokens, WithLabels(batch));
    ASSERT_TRUE(step.ok()) << step.status();
    sent.push_back(*step);
    sent_before_the_last_answered += last_open ? 1 : 0;
  }
  std::vector<Row> rows;
  for (const client::PendingStep& step : sent) {
    auto metrics = step.Get();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    rows.push_back({metrics->loss, metrics->update.count(), metrics->update.learning_rate()});
  }
  auto trained = steps.Wait();
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_FALSE(trained->live());

  ASSERT_EQ(rows.size(), want.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].count, static_cast<int64_t>(i) + 1) << "step " << i;
    EXPECT_TRUE(rows[i] == want[i]) << "step " << i << ": loss " << rows[i].loss << " vs " << want[i].loss
                                    << ", lr " << rows[i].learning_rate << " vs " << want[i].learning_rate;
  }
  const std::map<std::string, std::vector<float>> values = Values(*trained);
  ASSERT_EQ(values.size(), want_values.size());
  int moved = 0, moved_metas = 0;
  for (const auto& [name, value] : want_values) {
    ASSERT_EQ(values.count(name), 1u) << name;
    EXPECT_EQ(values.at(name), value) << name;
    if (start_values.count(name) && start_values.at(name) != value) {
      ++moved;
      moved_metas += absl::StartsWith(name, "fp8_metas/") ? 1 : 0;
    }
  }
  EXPECT_GT(moved, 0);
  if (fp8()) EXPECT_GT(moved_metas, 0) << "no fp8_meta moved: the FP8 state was not exercised";
  // Pipelining happened: some step went out while the one before was unanswered.
  EXPECT_GT(sent_before_the_last_answered, 0);
}

// Donating steps (ForwardBackwardRequest.donate): the same numbers as the
// synchronous loop that keeps every version, the version each step read
// released (the start's among them, though the program still holds it), so
// the session's memory after the last step is what it was after the first.
TEST_P(PipelinedTrainStepsTest, DonatingStepsEqualTheSynchronousLoopAndReleaseWhatTheyRead) {
  const std::vector<Batch> batches = SentenceBatches();
  std::vector<Row> want;
  std::map<std::string, std::vector<float>> want_values;
  Synchronous(batches, &want, &want_values);

  std::unique_ptr<LmRun> run = StartLm();
  ASSERT_NE(run, nullptr);
  client::Session* session = run->session.get();
  const client::Graph& lm = run->lm;
  const client::Variables& start = *run->start;
  client::TrainSteps steps(lm, start, kDepth, /*donate=*/true);
  std::vector<client::PendingStep> sent;
  int64_t one_version = 0;  // after the first step: its version alone
  for (const Batch& batch : batches) {
    auto step = steps.Step(batch.tokens, WithLabels(batch));
    ASSERT_TRUE(step.ok()) << step.status();
    sent.push_back(*step);
    if (sent.size() == 1) {
      ASSERT_TRUE(sent[0].Get().ok());
      auto info = session->GetSessionInfo();
      ASSERT_TRUE(info.ok()) << info.status();
      one_version = info->memory_bytes();
    }
  }
  for (size_t i = 0; i < sent.size(); ++i) {
    auto metrics = sent[i].Get();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    const Row row{metrics->loss, metrics->update.count(), metrics->update.learning_rate()};
    EXPECT_TRUE(row == want[i]) << "step " << i;
  }
  auto trained = steps.Wait();
  ASSERT_TRUE(trained.ok()) << trained.status();
  EXPECT_EQ(Values(*trained), want_values);
  // `start` is still held here, yet the first step released its version.
  auto read = client::GetVariables(start);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound) << read.status();
  auto after = session->GetSessionInfo();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->memory_bytes(), one_version);
}

// Each step's batch in a shared-memory block (freed once the step has
// answered: the next batch must not overwrite it before the server read it)
// or uploaded (deleted by calls numbered after the step): the same numbers.
TEST_P(PipelinedTrainStepsTest, InputsInSharedMemoryOrUploadedStayUntilTheirStepHasRun) {
  const std::vector<Batch> batches = SentenceBatches();
  std::vector<Row> want;
  std::map<std::string, std::vector<float>> want_values;
  Synchronous(batches, &want, &want_values);
  for (client::Transport transport : {client::Transport::kSharedMemory, client::Transport::kStream}) {
    SCOPED_TRACE(client::TransportName(transport));
    std::unique_ptr<LmRun> run = StartLm(transport);
    ASSERT_NE(run, nullptr);
    client::Session* session = run->session.get();
    const client::Graph& lm = run->lm;
    const client::Variables& start = *run->start;
    client::TrainSteps steps(lm, start, kDepth);
    std::vector<client::PendingStep> sent;
    for (const Batch& batch : batches) {
      auto step = steps.Step(batch.tokens, WithLabels(batch));
      ASSERT_TRUE(step.ok()) << step.status();
      sent.push_back(*step);
    }
    auto trained = steps.Wait();
    ASSERT_TRUE(trained.ok()) << trained.status();
    for (size_t i = 0; i < sent.size(); ++i) {
      auto metrics = sent[i].Get();
      ASSERT_TRUE(metrics.ok()) << metrics.status();
      EXPECT_TRUE((Row{metrics->loss, metrics->update.count(), metrics->update.learning_rate()}) == want[i])
          << "step " << i;
    }
    EXPECT_EQ(Values(*trained), want_values);
    const client::TransportCounts& counts = session->transport_counts();
    const int64_t moved = transport == client::Transport::kStream ? counts.streamed_tensors.load()
                                                                   : counts.shm_tensors.load();
    EXPECT_GE(moved, 2 * kSteps);  // each step's tokens and labels went that way
  }
}

TEST_P(PipelinedTrainStepsTest, AFailedStepStopsTheStepsSentOnTopOfIt) {
  std::vector<Batch> good;
  for (int i = 0; i < kSteps; ++i) good.push_back(SentenceBatch(i));
  // Reference: the good steps 0, 1, then 2, 3 (the failed one never sent).
  std::vector<Row> want;
  std::map<std::string, std::vector<float>> want_values;
  Synchronous({good[0], good[1], good[2], good[3]}, &want, &want_values);

  std::unique_ptr<LmRun> run = StartLm();
  ASSERT_NE(run, nullptr);
  const client::Graph& lm = run->lm;
  const client::Variables& start = *run->start;

  client::TrainSteps steps(lm, start, kDepth);
  std::vector<client::PendingStep> sent;
  for (int i = 0; i < 2; ++i) sent.push_back(*steps.Step(good[i].tokens, WithLabels(good[i])));
  // Labels of another shape than the tokens': the server refuses the step.
  const Batch bad = SentenceBatch(9, kSeq / 2);
  auto failed = steps.Step(good[2].tokens, WithLabels(bad));
  ASSERT_TRUE(failed.ok()) << failed.status();
  std::vector<client::PendingStep> on_top;
  for (int i = 2; i < 4; ++i) {
    auto step = steps.Step(good[i].tokens, WithLabels(good[i]));
    if (!step.ok()) {   // the failure was already known: refused at once, with its code
      EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
      break;
    }
    on_top.push_back(*step);
  }
  std::vector<Row> rows;
  for (const client::PendingStep& step : sent) {
    auto metrics = step.Get();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    rows.push_back({metrics->loss, metrics->update.count(), metrics->update.learning_rate()});
  }
  const absl::Status own = failed->Get().status();
  EXPECT_EQ(own.code(), absl::StatusCode::kInvalidArgument) << own;
  EXPECT_FALSE(absl::StrContains(own.message(), "continues from")) << own;
  for (const client::PendingStep& step : on_top) {
    const absl::Status status = step.Get().status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_TRUE(absl::StrContains(status.message(), "continues from")) << status;
  }
  auto waited = steps.Wait();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(steps.Step(good[2].tokens, WithLabels(good[2])).status().code(),
            absl::StatusCode::kInvalidArgument);

  // variables() is the last good step's: the loop goes on from it as the synchronous one did.
  client::TrainSteps resumed(lm, steps.variables(), kDepth);
  std::vector<client::PendingStep> more;
  for (int i = 2; i < 4; ++i) more.push_back(*resumed.Step(good[i].tokens, WithLabels(good[i])));
  for (const client::PendingStep& step : more) {
    auto metrics = step.Get();
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    rows.push_back({metrics->loss, metrics->update.count(), metrics->update.learning_rate()});
  }
  auto trained = resumed.Wait();
  ASSERT_TRUE(trained.ok()) << trained.status();
  ASSERT_EQ(rows.size(), want.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE(rows[i] == want[i]) << "step " << i << ": loss " << rows[i].loss << " vs " << want[i].loss;
  }
  EXPECT_EQ(Values(*trained), want_values);
}

INSTANTIATE_TEST_SUITE_P(Recipes, PipelinedTrainStepsTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Fp8DelayedScaling" : "Float32";
                         });

}  // namespace
}  // namespace te::testing
