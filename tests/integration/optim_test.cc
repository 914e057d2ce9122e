// Training through a real te_server over gRPC: SetOptimizer, then one
// ForwardBackward per step with apply_update, on a DenseGeneral fitting a
// fixed linear teacher (squared error against MicroBatch.target). The loss
// falls; a checkpointed, killed and restored server continues the same loss
// curve bit for bit; bad optimizer input is INVALID_ARGUMENT naming the field
// and changes nothing; a non-finite gradient skips the step and is counted.
#include <signal.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kBatch = 4, kSeq = 8, kIn = 16, kOut = 8;
constexpr int kMicroBatches = 2;  // the batch's halves: gradients accumulate over both
// What training must reach, and by when: the teacher is exactly linear, so
// the loss can go to 0; at the start it is ~4 (the target's variance).
constexpr int kSteps = 300;
constexpr double kFinalLoss = 1e-2;
constexpr int kShortSteps = 100;
constexpr double kShortRunFactor = 0.1;  // loss after kShortSteps below this x the first

// An inline int32 tensor's values (the optimizer's counters).
std::vector<int32_t> ToInts(const te::v1::Tensor& tensor) {
  std::vector<int32_t> values(tensor.inline_data().size() / sizeof(int32_t));
  std::memcpy(values.data(), tensor.inline_data().data(), values.size() * sizeof(int32_t));
  return values;
}

std::string NewStateDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  return dir;
}

// x [kBatch, kSeq, kIn] and its target x @ w + b (w, b the teacher's), split
// into kMicroBatches micro-batches along the batch.
struct Data {
  std::vector<te::v1::Tensor> x, target;
};
Data MakeData() {
  const std::vector<float> x = RandomFloats(kBatch * kSeq * kIn, 7);
  const std::vector<float> w = RandomFloats(kIn * kOut, 8, 0.5f);
  const std::vector<float> b = RandomFloats(kOut, 9, 0.5f);
  Data data;
  const int64_t rows = kBatch / kMicroBatches * kSeq;
  for (int m = 0; m < kMicroBatches; ++m) {
    std::vector<float> xs(x.begin() + m * rows * kIn, x.begin() + (m + 1) * rows * kIn);
    std::vector<float> t(rows * kOut);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < kOut; ++o) {
        double sum = b[o];
        for (int64_t i = 0; i < kIn; ++i) sum += double(xs[r * kIn + i]) * w[i * kOut + o];
        t[r * kOut + o] = static_cast<float>(sum);
      }
    }
    data.x.push_back(MakeTensor(te::v1::FLOAT32, {kBatch / kMicroBatches, kSeq, kIn}, xs));
    data.target.push_back(MakeTensor(te::v1::FLOAT32, {kBatch / kMicroBatches, kSeq, kOut}, t));
  }
  return data;
}

te::v1::Optimizer AdamWWithSchedule() {
  te::v1::Optimizer spec;
  auto* w = spec.mutable_adamw()->mutable_learning_rate()->mutable_warmup_cosine_decay();
  w->set_init_value(0.0);
  w->set_peak_value(0.05);
  w->set_warmup_steps(10);
  w->set_decay_steps(kSteps);
  w->set_end_value(0.001);
  spec.set_clip_by_global_norm(5.0);
  return spec;
}

class OptimTest : public ::testing::Test {
 protected:
  void Connect(ServerProcess& server) { stub_ = server.NewStub(); }

  std::string InitDense(const te::v1::SessionRef& session) {
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session;
    init.mutable_spec()->mutable_dense_general()->add_features(kOut);
    init.set_seed(42);
    init.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : {kBatch / kMicroBatches, kSeq, kIn}) init.add_input_shape(d);
    te::v1::InitLayerResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->InitLayer(&context, init, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response.layer_id();
  }

  grpc::Status SetOptimizer(const te::v1::SessionRef& session, const std::string& layer,
                            const te::v1::Optimizer& optimizer,
                            te::v1::SetOptimizerResponse* response = nullptr) {
    te::v1::SetOptimizerRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    *request.mutable_optimizer() = optimizer;
    te::v1::SetOptimizerResponse unused;
    grpc::ClientContext context;
    return stub_->SetOptimizer(&context, request, response ? response : &unused);
  }

  te::v1::ForwardBackwardRequest StepRequest(const te::v1::SessionRef& session,
                                             const std::string& layer, const Data& data) {
    te::v1::ForwardBackwardRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    request.set_deterministic(true);
    request.set_apply_update(true);
    for (int m = 0; m < kMicroBatches; ++m) {
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = data.x[m];
      *mb->mutable_target() = data.target[m];
    }
    return request;
  }

  // One training step; the loss (the values' sum) or NaN on failure.
  double Step(const te::v1::SessionRef& session, const std::string& layer, const Data& data,
              te::v1::UpdateInfo* info = nullptr) {
    te::v1::ForwardBackwardResponse response;
    grpc::ClientContext context;
    const grpc::Status status =
        stub_->ForwardBackward(&context, StepRequest(session, layer, data), &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    if (!status.ok()) return std::nan("");
    EXPECT_TRUE(response.update().applied());
    if (info != nullptr) *info = response.update();
    double loss = 0;
    for (double v : response.values()) loss += v;
    return loss;
  }

  std::vector<double> Train(const te::v1::SessionRef& session, const std::string& layer,
                            const Data& data, int steps) {
    std::vector<double> losses;
    for (int i = 0; i < steps; ++i) losses.push_back(Step(session, layer, data));
    return losses;
  }

  int64_t SessionMemory(const te::v1::SessionRef& session) {
    te::v1::GetSessionInfoRequest request;
    *request.mutable_session() = session;
    te::v1::SessionInfo info;
    grpc::ClientContext context;
    EXPECT_TRUE(stub_->GetSessionInfo(&context, request, &info).ok());
    return info.memory_bytes();
  }

  std::unique_ptr<te::v1::TeService::Stub> stub_;
};

void ExpectBitForBit(const std::map<std::string, te::v1::Tensor>& want,
                     const std::map<std::string, te::v1::Tensor>& got) {
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, tensor] : want) {
    ASSERT_EQ(got.count(name), 1u) << name;
    EXPECT_EQ(got.at(name).inline_data(), tensor.inline_data()) << name;
  }
}

TEST_F(OptimTest, AdamWWithScheduleAndClippingFitsTheTeacher) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  Connect(**server);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitDense(session);
  const int64_t before = SessionMemory(session);
  te::v1::SetOptimizerResponse set;
  ASSERT_TRUE(SetOptimizer(session, layer, AdamWWithSchedule(), &set).ok());
  // count, total_notfinite, and mu, nu for the kernel and the bias: in the
  // session's memory account.
  EXPECT_EQ(set.variables_size(), 6);
  EXPECT_EQ(SessionMemory(session) - before, 2 * 4 * (kIn * kOut + kOut) + 2 * 4);
  const Data data = MakeData();
  const std::vector<double> losses = Train(session, layer, data, kSteps);
  ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps));
  EXPECT_GT(losses.front(), 1.0);
  EXPECT_LT(losses.back(), kFinalLoss) << "first " << losses.front();
  const std::map<std::string, te::v1::Tensor> vars = GetAllVariables(*stub_, session, layer);
  ASSERT_EQ(vars.count("opt_state/count"), 1u);
  EXPECT_EQ(ToInts(vars.at("opt_state/count")), std::vector<int32_t>{kSteps});
  EXPECT_EQ(vars.count("grads/kernel"), 0u);  // consumed by the updates, not kept
}

// Every optimizer trains the same model; its loss falls by 10x in 100 steps.
TEST_F(OptimTest, EveryOptimizerTrains) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  Connect(**server);
  std::vector<std::pair<std::string, te::v1::Optimizer>> optimizers;
  te::v1::Optimizer sgd;
  sgd.mutable_sgd()->mutable_learning_rate()->set_constant(0.05);
  optimizers.push_back({"sgd", sgd});
  te::v1::Optimizer momentum = sgd;
  momentum.mutable_sgd()->set_momentum(0.9);
  optimizers.push_back({"sgd momentum", momentum});
  te::v1::Optimizer nesterov = momentum;
  nesterov.mutable_sgd()->set_nesterov(true);
  optimizers.push_back({"sgd nesterov", nesterov});
  te::v1::Optimizer adam;
  adam.mutable_adam()->mutable_learning_rate()->set_constant(0.05);
  optimizers.push_back({"adam", adam});
  const Data data = MakeData();
  for (const auto& [name, optimizer] : optimizers) {
    const te::v1::SessionRef session = CreateSession(*stub_).session();
    const std::string layer = InitDense(session);
    ASSERT_TRUE(SetOptimizer(session, layer, optimizer).ok()) << name;
    const std::vector<double> losses = Train(session, layer, data, kShortSteps);
    EXPECT_LT(losses.back(), kShortRunFactor * losses.front()) << name;
  }
}

// Checkpoint at step 20, train to 40, SIGKILL; the restored server trains
// 20 steps from the checkpoint: the same 20 losses and the same parameters
// and optimizer state, bit for bit.
TEST_F(OptimTest, CheckpointKillRestoreContinuesBitForBit) {
  const std::string state_dir = NewStateDir("optim_state");
  ServerProcess::Options options;
  options.flags = {"--state_dir=" + state_dir};
  absl::StatusOr<std::unique_ptr<ServerProcess>> first = ServerProcess::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  Connect(**first);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitDense(session);
  ASSERT_TRUE(SetOptimizer(session, layer, AdamWWithSchedule()).ok());
  const Data data = MakeData();
  Train(session, layer, data, 20);
  {
    te::v1::CheckpointRequest request;
    *request.mutable_session() = session;
    te::v1::CheckpointResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->Checkpoint(&context, request, &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  const std::vector<double> uninterrupted = Train(session, layer, data, 20);
  const std::map<std::string, te::v1::Tensor> end = GetAllVariables(*stub_, session, layer);
  kill((*first)->pid(), SIGKILL);
  EXPECT_FALSE((*first)->Stop().ok());

  absl::StatusOr<std::unique_ptr<ServerProcess>> second = ServerProcess::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  Connect(**second);
  const std::vector<double> resumed = Train(session, layer, data, 20);
  ASSERT_EQ(resumed.size(), uninterrupted.size());
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i], uninterrupted[i]) << "step " << 20 + i;  // bit for bit
  }
  ExpectBitForBit(end, GetAllVariables(*stub_, session, layer));
  ASSERT_TRUE((*second)->Stop().ok());
}

TEST_F(OptimTest, BadInputIsInvalidArgumentNamingTheFieldAndChangesNothing) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  Connect(**server);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitDense(session);
  const Data data = MakeData();
  {
    // An update before any optimizer: change state first.
    te::v1::ForwardBackwardResponse response;
    grpc::ClientContext context;
    const grpc::Status status =
        stub_->ForwardBackward(&context, StepRequest(session, layer, data), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(status);
  }
  ASSERT_TRUE(SetOptimizer(session, layer, AdamWWithSchedule()).ok());
  Train(session, layer, data, 3);
  const std::map<std::string, te::v1::Tensor> before = GetAllVariables(*stub_, session, layer);
  const int64_t memory = SessionMemory(session);

  te::v1::Optimizer unknown;  // no kind set: what a newer client's optimizer looks like here
  te::v1::Optimizer nan_lr;
  nan_lr.mutable_adamw()->mutable_learning_rate()->set_constant(std::nan(""));
  for (const auto& [spec, field] : {std::pair<te::v1::Optimizer, std::string>{unknown, "optimizer"},
                                    {nan_lr, "optimizer.adamw.learning_rate.constant"}}) {
    const grpc::Status status = SetOptimizer(session, layer, spec);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
    EXPECT_EQ(status.error_message().rfind(field + ":", 0), 0u) << Describe(status);
  }
  {
    // A state of the wrong shape.
    te::v1::SetVariablesRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    te::v1::Variable* v = request.add_variables();
    v->set_collection("opt_state");
    v->set_path("mu/kernel");
    *v->mutable_value() = MakeTensor(te::v1::FLOAT32, {kIn + 1, kOut}, RandomFloats((kIn + 1) * kOut, 3));
    te::v1::SetVariablesResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->SetVariables(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
    EXPECT_EQ(status.error_message().rfind("variables[0].value:", 0), 0u) << Describe(status);
  }
  {
    // A bad target in the second micro-batch: the first never runs.
    te::v1::ForwardBackwardRequest request = StepRequest(session, layer, data);
    *request.mutable_micro_batches(1)->mutable_target() =
        MakeTensor(te::v1::FLOAT32, {1, kSeq, kOut}, RandomFloats(kSeq * kOut, 4));
    te::v1::ForwardBackwardResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->ForwardBackward(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
    EXPECT_EQ(status.error_message().rfind("micro_batches[1].target.shape", 0), 0u)
        << Describe(status);
  }
  ExpectBitForBit(before, GetAllVariables(*stub_, session, layer));
  EXPECT_EQ(SessionMemory(session), memory);
}

TEST_F(OptimTest, NonFiniteGradientSkipsTheStepAndCountsIt) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  Connect(**server);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitDense(session);
  ASSERT_TRUE(SetOptimizer(session, layer, AdamWWithSchedule()).ok());
  const Data data = MakeData();
  Train(session, layer, data, 2);
  const std::map<std::string, te::v1::Tensor> before = GetAllVariables(*stub_, session, layer);
  Data bad = data;
  std::vector<float> x = ToFloats(bad.x[0]);
  x[5] = std::numeric_limits<float>::infinity();
  bad.x[0] = MakeTensor(te::v1::FLOAT32, ShapeOf(bad.x[0]), x);
  te::v1::ForwardBackwardResponse response;
  {
    grpc::ClientContext context;
    const grpc::Status status =
        stub_->ForwardBackward(&context, StepRequest(session, layer, bad), &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  EXPECT_FALSE(response.update().applied());
  EXPECT_EQ(response.update().count(), 2);
  EXPECT_EQ(response.update().total_notfinite(), 1);
  std::map<std::string, te::v1::Tensor> after = GetAllVariables(*stub_, session, layer);
  EXPECT_EQ(ToInts(after.at("opt_state/total_notfinite")), std::vector<int32_t>{1});
  after.erase("opt_state/total_notfinite");
  std::map<std::string, te::v1::Tensor> want = before;
  want.erase("opt_state/total_notfinite");
  ExpectBitForBit(want, after);
  te::v1::UpdateInfo info;
  Step(session, layer, data, &info);
  EXPECT_EQ(info.count(), 3);
}

// The C++ client's Optimizer and SetOptimizer: the same training as a
// library user writes it.
TEST_F(OptimTest, CppClientTrainsWithItsOptimizerOption) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<client::Client>> client = client::Client::Connect((*server)->address());
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::unique_ptr<client::Session>> session = (*client)->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(kOut);
  init.set_seed(42);
  init.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : {kBatch / kMicroBatches, kSeq, kIn}) init.add_input_shape(d);
  absl::StatusOr<te::v1::InitLayerResponse> layer = (*session)->InitLayer(init);
  ASSERT_TRUE(layer.ok()) << layer.status();
  client::Optimizer optimizer;  // optax.adamw(learning_rate=0.05, weight_decay=1e-4)
  optimizer.learning_rate = 0.05;
  absl::StatusOr<te::v1::SetOptimizerResponse> set =
      (*session)->SetOptimizer(layer->layer_id(), optimizer);
  ASSERT_TRUE(set.ok()) << set.status();
  optimizer.learning_rate = std::nan("");
  EXPECT_EQ((*session)->SetOptimizer(layer->layer_id(), optimizer).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Data data = MakeData();
  double first = 0, last = 0;
  for (int step = 0; step < kShortSteps; ++step) {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer->layer_id());
    request.set_deterministic(true);
    request.set_apply_update(true);
    for (int m = 0; m < kMicroBatches; ++m) {
      te::v1::MicroBatch* mb = request.add_micro_batches();
      *mb->mutable_x() = data.x[m];
      *mb->mutable_target() = data.target[m];
    }
    absl::StatusOr<te::v1::ForwardBackwardResponse> response = (*session)->ForwardBackward(request);
    ASSERT_TRUE(response.ok()) << response.status();
    last = response->values(0) + response->values(1);
    if (step == 0) first = last;
  }
  EXPECT_LT(last, kShortRunFactor * first);
}

// The C++ client's builders for rmsprop, lion, the schedules and chains: each
// trains the same layer through a real server, keeps the state SetOptimizer
// names, and a bad link is INVALID_ARGUMENT naming it.
TEST_F(OptimTest, CppClientBuildsRmspropLionSchedulesAndChains) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<client::Client>> client =
      client::Client::Connect((*server)->address());
  ASSERT_TRUE(client.ok()) << client.status();
  namespace s = client::schedules;
  struct Case {
    std::string name;
    client::Optimizer optimizer;
    std::vector<std::string> state;  // opt_state names for the kernel, besides the counters
  };
  client::Optimizer clipped_lion = client::Lion(s::Constant(1e-2), 0.9, 0.99, 1e-4);
  clipped_lion.clip_by_global_norm = 1.0;
  const std::vector<Case> cases = {
      {"rmsprop",
       client::Rmsprop(s::ExponentialDecay(0.03, 50, 0.5), 0.9, 1e-8, 0.0, true, true, 0.5),
       {"mu/kernel", "nu/kernel", "trace/kernel"}},
      {"lion", clipped_lion, {"mu/kernel"}},
      {"chain(adam, clip)",
       client::Chain({client::Link(client::Adam(s::WarmupCosineDecay(0.0, 0.05, 5, kShortSteps))),
                      client::ClipByGlobalNorm(0.1)}),
       {"0/mu/kernel", "0/nu/kernel"}},
      {"chain(clip, adam(-1), decay, lr)",
       client::Chain({client::ClipByGlobalNorm(5.0), client::Link(client::Adam(s::Constant(-1.0))),
                      client::AddDecayedWeights(1e-4),
                      client::ScaleByLearningRate(s::JoinSchedules(
                          {s::Linear(0.0, 0.05, 5), s::PiecewiseConstant(0.05, {{50, 0.5}}),
                           s::CosineDecay(0.025, 100)},
                          {5, 80}))}),
       {"1/mu/kernel", "1/nu/kernel"}},
  };
  const Data data = MakeData();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<std::unique_ptr<client::Session>> session = (*client)->CreateSession();
    ASSERT_TRUE(session.ok()) << session.status();
    te::v1::InitLayerRequest init;
    init.mutable_spec()->mutable_dense_general()->add_features(kOut);
    init.set_seed(42);
    init.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : {kBatch / kMicroBatches, kSeq, kIn}) init.add_input_shape(d);
    absl::StatusOr<te::v1::InitLayerResponse> layer = (*session)->InitLayer(init);
    ASSERT_TRUE(layer.ok()) << layer.status();
    absl::StatusOr<te::v1::SetOptimizerResponse> set =
        (*session)->SetOptimizer(layer->layer_id(), c.optimizer);
    ASSERT_TRUE(set.ok()) << set.status();
    std::vector<std::string> paths;
    for (const te::v1::VariableInfo& v : set->variables()) {
      EXPECT_EQ(v.collection(), "opt_state");
      if (absl::EndsWith(v.path(), "/kernel")) paths.push_back(v.path());
    }
    EXPECT_EQ(paths, c.state);
    double first = 0, last = 0;
    for (int step = 0; step < kShortSteps; ++step) {
      te::v1::ForwardBackwardRequest request;
      request.set_layer_id(layer->layer_id());
      request.set_deterministic(true);
      request.set_apply_update(true);
      for (int m = 0; m < kMicroBatches; ++m) {
        te::v1::MicroBatch* mb = request.add_micro_batches();
        *mb->mutable_x() = data.x[m];
        *mb->mutable_target() = data.target[m];
      }
      absl::StatusOr<te::v1::ForwardBackwardResponse> response =
          (*session)->ForwardBackward(request);
      ASSERT_TRUE(response.ok()) << response.status();
      EXPECT_TRUE(response->update().applied());
      EXPECT_EQ(response->update().count(), step + 1);
      last = response->values(0) + response->values(1);
      if (step == 0) first = last;
    }
    EXPECT_LT(last, kShortRunFactor * first) << "first " << first;
  }
  // A bad link: INVALID_ARGUMENT naming it.
  absl::StatusOr<std::unique_ptr<client::Session>> session = (*client)->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(kOut);
  init.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : {kBatch / kMicroBatches, kSeq, kIn}) init.add_input_shape(d);
  absl::StatusOr<te::v1::InitLayerResponse> layer = (*session)->InitLayer(init);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const absl::Status bad =
      (*session)
          ->SetOptimizer(layer->layer_id(),
                         client::Chain({client::ClipByGlobalNorm(1.0),
                                        client::Link(client::Lion(s::Constant(1e-3), 1.5))}))
          .status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("optimizer.chain[1].lion.b1: 1.5"), std::string::npos) << bad;
}

}  // namespace
}  // namespace te::testing
