// Sessions survive a restart (--state_dir): a real te_server trains a layer
// under FP8 delayed scaling, is stopped with SIGTERM (drain, then save) and
// started again on the same directory; the session comes back under its id,
// answers its old token and no other, and its parameters, FP8 state and kept
// gradients match bit for bit. A closed session does not come back; a
// Checkpoint RPC survives even SIGKILL; a restored session's numbered calls
// sent together run in their order whichever arrives first.
#include <signal.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kHidden = 32;
const std::vector<int64_t> kInputShape = {2, 8, kHidden};

std::string NewStateDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  return dir;
}

te::v1::Autocast Fp8() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  te::v1::DelayedScaling* recipe = autocast.mutable_recipe()->mutable_delayed_scaling();
  recipe->set_fp8_format(te::v1::HYBRID);
  recipe->set_amax_history_len(8);
  return autocast;
}

class RestartTest : public ::testing::Test {
 protected:
  std::unique_ptr<ServerProcess> Start(const std::string& state_dir) {
    ServerProcess::Options options;
    options.flags = {"--state_dir=" + state_dir};
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    stub_ = (*server)->NewStub();
    return *std::move(server);
  }

  // A LayerNormMLP (two FP8 GEMMs) initialised under autocast, then trained
  // `steps` ForwardBackward steps with gradients kept on the server.
  std::string InitAndTrain(const te::v1::SessionRef& session, int steps) {
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session;
    te::v1::LayerNormMLP* mlp = init.mutable_spec()->mutable_layer_norm_mlp();
    mlp->set_intermediate_dim(64);
    mlp->add_activations("gelu");
    mlp->set_use_bias(true);
    init.set_seed(1234);
    init.set_input_dtype(te::v1::FLOAT32);
    init.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
    *init.mutable_autocast() = Fp8();
    te::v1::InitLayerResponse initialised;
    {
      grpc::ClientContext context;
      grpc::Status status = stub_->InitLayer(&context, init, &initialised);
      EXPECT_TRUE(status.ok()) << Describe(status);
    }
    Train(session, initialised.layer_id(), steps, 10);
    return initialised.layer_id();
  }

  void Train(const te::v1::SessionRef& session, const std::string& layer_id, int steps,
             uint32_t seed) {
    for (int step = 0; step < steps; ++step) {
      te::v1::ForwardBackwardRequest request;
      *request.mutable_session() = session;
      request.set_layer_id(layer_id);
      request.set_deterministic(true);
      *request.mutable_autocast() = Fp8();
      te::v1::MicroBatch* batch = request.add_micro_batches();
      const size_t n = static_cast<size_t>(kInputShape[0] * kInputShape[1] * kHidden);
      *batch->mutable_x() =
          MakeTensor(te::v1::FLOAT32, kInputShape, RandomFloats(n, seed + 2 * step, 3.0f));
      *batch->mutable_dy() =
          MakeTensor(te::v1::FLOAT32, kInputShape, RandomFloats(n, seed + 2 * step + 1));
      te::v1::ForwardBackwardResponse response;
      grpc::ClientContext context;
      grpc::Status status = stub_->ForwardBackward(&context, request, &response);
      ASSERT_TRUE(status.ok()) << Describe(status);
    }
  }

  // The Checkpoint RPC's bytes written, or -1 when it fails (the failure added).
  int64_t Checkpoint(const te::v1::SessionRef& session) {
    te::v1::CheckpointRequest request;
    *request.mutable_session() = session;
    te::v1::CheckpointResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->Checkpoint(&context, request, &response);
    if (!status.ok()) {
      ADD_FAILURE() << "Checkpoint: " << Describe(status);
      return -1;
    }
    return response.bytes();
  }

  te::v1::ServerStats Stats() {
    grpc::ClientContext context;
    te::v1::ServerInfo info;
    EXPECT_TRUE(stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info).ok());
    return info.stats();
  }

  grpc::StatusCode GetVariablesCode(const te::v1::SessionRef& session, const std::string& layer) {
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    te::v1::GetVariablesResponse response;
    grpc::ClientContext context;
    return stub_->GetVariables(&context, request, &response).error_code();
  }

  static void ExpectBitForBit(const std::map<std::string, te::v1::Tensor>& before,
                              const std::map<std::string, te::v1::Tensor>& after) {
    ASSERT_EQ(before.size(), after.size());
    for (const auto& [name, tensor] : before) {
      ASSERT_GT(after.count(name), 0u) << name << " is missing after the restart";
      const te::v1::Tensor& restored = after.at(name);
      EXPECT_EQ(restored.dtype(), tensor.dtype()) << name;
      EXPECT_EQ(ShapeOf(restored), ShapeOf(tensor)) << name;
      EXPECT_TRUE(restored.inline_data() == tensor.inline_data()) << name << " differs";
    }
  }

  std::unique_ptr<te::v1::TeService::Stub> stub_;
};

TEST_F(RestartTest, SigtermSavesAndARestartRestoresBitForBit) {
  const std::string state_dir = NewStateDir("state_sigterm");
  std::unique_ptr<ServerProcess> first = Start(state_dir);
  ASSERT_NE(first, nullptr);
  const te::v1::SessionRef kept = CreateSession(*stub_).session();
  const std::string layer = InitAndTrain(kept, 3);
  const te::v1::SessionRef closed = CreateSession(*stub_).session();
  InitAndTrain(closed, 1);
  {
    // Saved on request, then closed: its checkpoint must go with it.
    te::v1::CheckpointRequest request;
    *request.mutable_session() = closed;
    te::v1::CheckpointResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Checkpoint(&context, request, &response).ok());
    EXPECT_EQ(response.path(), closed.session_id() + "/session.pb");
    EXPECT_TRUE(std::filesystem::exists(state_dir + "/" + response.path()));
    grpc::ClientContext close_context;
    te::v1::CloseSessionRequest close;
    *close.mutable_session() = closed;
    te::v1::CloseSessionResponse close_response;
    ASSERT_TRUE(stub_->CloseSession(&close_context, close, &close_response).ok());
    EXPECT_FALSE(std::filesystem::exists(state_dir + "/" + closed.session_id()));
  }
  const std::map<std::string, te::v1::Tensor> before = GetAllVariables(*stub_, kept, layer);
  ASSERT_GT(before.count("fp8_metas/kernel_0_amax_history"), 0u);
  ASSERT_GT(before.count("grads/wi_kernel"), 0u);
  ASSERT_TRUE(first->Stop().ok()) << "SIGTERM must drain, save and exit 0";
  EXPECT_TRUE(std::filesystem::exists(state_dir + "/" + kept.session_id() + "/session.pb"));

  std::unique_ptr<ServerProcess> second = Start(state_dir);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(Stats().sessions_restored(), 1);
  EXPECT_EQ(Stats().sessions_open(), 1);
  te::v1::SessionRef wrong = kept;
  wrong.set_token(std::string(32, 'a'));
  EXPECT_EQ(GetVariablesCode(wrong, layer), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetVariablesCode(closed, layer), grpc::StatusCode::NOT_FOUND);
  ExpectBitForBit(before, GetAllVariables(*stub_, kept, layer));

  // The restored session trains on from its FP8 state.
  Train(kept, layer, 1, 99);
  EXPECT_NE(
      GetAllVariables(*stub_, kept, layer).at("fp8_metas/kernel_0_amax_history").inline_data(),
      before.at("fp8_metas/kernel_0_amax_history").inline_data());
  ASSERT_TRUE(second->Stop().ok());
}

TEST_F(RestartTest, CheckpointRpcSurvivesSigkill) {
  const std::string state_dir = NewStateDir("state_sigkill");
  std::unique_ptr<ServerProcess> first = Start(state_dir);
  ASSERT_NE(first, nullptr);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitAndTrain(session, 2);
  const std::map<std::string, te::v1::Tensor> checkpointed =
      GetAllVariables(*stub_, session, layer);
  ASSERT_GT(Checkpoint(session), 0);
  Train(session, layer, 1, 50);  // after the checkpoint: lost with the crash
  kill(first->pid(), SIGKILL);
  EXPECT_FALSE(first->Stop().ok());  // reaps it; it was killed, not stopped

  std::unique_ptr<ServerProcess> second = Start(state_dir);
  ASSERT_NE(second, nullptr);
  ExpectBitForBit(checkpointed, GetAllVariables(*stub_, session, layer));
  ASSERT_TRUE(second->Stop().ok());
}

// After a restart the session's numbered calls go on from the lowest number
// their client still had in flight (SessionRef.first_unanswered), whichever
// reaches the server first: a client sends SetVariables (6) and GetVariables
// (7) together, and 7 arrives first. 7 waits for 6 and reads what 6 set;
// without first_unanswered, 7 would have set the count and run at once, and
// 6 been refused as already taken.
TEST_F(RestartTest, ARestoredSessionRunsCallsSentTogetherInTheirOrder) {
  const std::string state_dir = NewStateDir("state_order");
  std::unique_ptr<ServerProcess> first = Start(state_dir);
  ASSERT_NE(first, nullptr);
  const te::v1::SessionRef session = CreateSession(*stub_).session();
  const std::string layer = InitAndTrain(session, 1);
  ASSERT_GT(Checkpoint(session), 0);
  kill(first->pid(), SIGKILL);
  EXPECT_FALSE(first->Stop().ok());
  std::unique_ptr<ServerProcess> second = Start(state_dir);
  ASSERT_NE(second, nullptr);

  // A parameter of the layer, every element 0.25 (values the layer never had).
  std::map<std::string, te::v1::Tensor> variables = GetAllVariables(*stub_, session, layer);
  auto param = variables.begin();
  while (param != variables.end() && param->first.rfind("params/", 0) != 0) ++param;
  ASSERT_NE(param, variables.end());
  te::v1::Tensor written = param->second;
  ASSERT_EQ(written.dtype(), te::v1::FLOAT32);
  const std::vector<float> quarter(written.inline_data().size() / sizeof(float), 0.25f);
  written.set_inline_data(std::string(reinterpret_cast<const char*>(quarter.data()),
                                      quarter.size() * sizeof(float)));

  te::v1::SessionRef read_ref = session;
  read_ref.set_sequence(7);
  read_ref.set_first_unanswered(6);
  te::v1::GetVariablesResponse read;
  grpc::Status read_status;
  std::thread reader([&] {
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = read_ref;
    request.set_layer_id(layer);
    grpc::ClientContext context;
    read_status = stub_->GetVariables(&context, request, &read);
  });
  absl::SleepFor(absl::Milliseconds(300));  // 7 is at the server, waiting
  te::v1::SetVariablesRequest set;
  *set.mutable_session() = session;
  set.mutable_session()->set_sequence(6);
  set.mutable_session()->set_first_unanswered(6);
  set.set_layer_id(layer);
  te::v1::Variable* variable = set.add_variables();
  const size_t slash = param->first.find('/');
  variable->set_collection(param->first.substr(0, slash));
  variable->set_path(param->first.substr(slash + 1));
  *variable->mutable_value() = written;
  {
    te::v1::SetVariablesResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->SetVariables(&context, set, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
  }
  reader.join();
  ASSERT_TRUE(read_status.ok()) << Describe(read_status);
  bool found = false;
  for (const te::v1::Variable& v : read.variables()) {
    if (v.collection() + "/" + v.path() != param->first) continue;
    found = true;
    EXPECT_EQ(v.value().inline_data(), written.inline_data()) << "7 ran before 6";
  }
  EXPECT_TRUE(found) << param->first;
  ASSERT_TRUE(second->Stop().ok());
}

TEST_F(RestartTest, CheckpointWithoutStateDirIsFailedPrecondition) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  stub_ = (*server)->NewStub();
  te::v1::CheckpointRequest request;
  *request.mutable_session() = CreateSession(*stub_).session();
  te::v1::CheckpointResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->Checkpoint(&context, request, &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace te::testing
