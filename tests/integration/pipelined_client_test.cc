// Pipelined calls through the client library against a real te_server: a
// session's Async calls are all sent before any answer is read, and the
// server runs them in the order the client numbered them (SessionRef.sequence),
// so each GetVariables / Forward sees exactly the SetVariables sent just
// before it, and the session ends in the last one's state. A call that
// expires at the client does not hold up the session's next one: that one
// names it abandoned. The numbering itself is client/pipelined_test.cc's.
#include <cmath>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using client::Client;
using client::DType;
using client::HostTensor;
using client::Session;

constexpr int64_t kHidden = 8;

class PipelinedClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Every call is sent before any answer is read: room for all of them in
    // the device's queue, whose default (64) would refuse the excess with
    // RESOURCE_EXHAUSTED, the server's back-pressure rather than its order.
    ServerProcess::Options options;
    options.flags = {"--executor_queue=1024"};
    auto started = ServerProcess::Start(options);
    if (!started.ok()) {
      start_error_ = new std::string(started.status().ToString());
      return;
    }
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) { EXPECT_TRUE(server_->Stop().ok()); }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr) << *start_error_;
    auto client = Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::unique_ptr<Session> Open() {
    auto session = client_->CreateSession();
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *std::move(session) : nullptr;
  }

  static ServerProcess* server_;
  static std::string* start_error_;
  std::unique_ptr<Client> client_;
};

ServerProcess* PipelinedClientTest::server_ = nullptr;
std::string* PipelinedClientTest::start_error_ = nullptr;

// A LayerNorm over kHidden features: params/scale [kHidden] and params/bias.
absl::StatusOr<client::Variables> InitLayerNorm(Session& session, const HostTensor& x) {
  client::LayerNorm layer;
  return layer.Init(session, /*key=*/1, x);
}

te::v1::SetVariablesRequest SetScale(const std::string& layer_id, float value) {
  te::v1::SetVariablesRequest request;
  request.set_layer_id(layer_id);
  te::v1::Variable* variable = request.add_variables();
  variable->set_collection("params");
  variable->set_path("scale");
  *variable->mutable_value() = client::ToInlineProto(HostTensor::Full({kHidden}, DType::kF32, value));
  return request;
}

te::v1::GetVariablesRequest GetParams(const std::string& layer_id) {
  te::v1::GetVariablesRequest request;
  request.set_layer_id(layer_id);
  request.add_collections("params");
  return request;
}

// params/scale's values in a GetVariables answer (empty when it is missing).
std::vector<float> ScaleOf(const te::v1::GetVariablesResponse& response) {
  for (const te::v1::Variable& variable : response.variables()) {
    if (variable.collection() != "params" || variable.path() != "scale") continue;
    absl::StatusOr<HostTensor> value = client::FromInlineProto(variable.value(), "params/scale");
    return value.ok() ? value->ToFloats() : std::vector<float>();
  }
  return {};
}

// `rounds` of SetVariables(scale = i) then GetVariables, all sent before any
// answer is read; each read must see its own round's value, and the session
// must end with the last one.
void PipelineSetThenGet(Session& session, int rounds) {
  const HostTensor x = HostTensor::RandomNormal({2, kHidden}, DType::kF32, 3);
  absl::StatusOr<client::Variables> vars = InitLayerNorm(session, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  std::vector<std::future<absl::StatusOr<te::v1::SetVariablesResponse>>> sets;
  std::vector<std::future<absl::StatusOr<te::v1::GetVariablesResponse>>> gets;
  for (int i = 1; i <= rounds; ++i) {
    sets.push_back(session.SetVariablesAsync(SetScale(vars->layer_id, static_cast<float>(i))));
    gets.push_back(session.GetVariablesAsync(GetParams(vars->layer_id)));
  }
  for (int i = 1; i <= rounds; ++i) {
    absl::StatusOr<te::v1::SetVariablesResponse> set = sets[i - 1].get();
    EXPECT_TRUE(set.ok()) << "SetVariables " << i << ": " << set.status();
    absl::StatusOr<te::v1::GetVariablesResponse> got = gets[i - 1].get();
    ASSERT_TRUE(got.ok()) << "GetVariables " << i << ": " << got.status();
    EXPECT_EQ(ScaleOf(*got), std::vector<float>(kHidden, static_cast<float>(i)))
        << "the GetVariables sent after SetVariables(" << i << ")";
  }
  absl::StatusOr<te::v1::GetVariablesResponse> last = session.GetVariables(GetParams(vars->layer_id));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(ScaleOf(*last), std::vector<float>(kHidden, static_cast<float>(rounds)));
}

TEST_F(PipelinedClientTest, EachGetVariablesReadsTheSetVariablesJustBeforeIt) {
  std::unique_ptr<Session> session = Open();
  ASSERT_NE(session, nullptr);
  PipelineSetThenGet(*session, /*rounds=*/50);
}

TEST_F(PipelinedClientTest, SessionsPipelinedAtOnceKeepTheirOwnOrder) {
  constexpr int kSessions = 4;
  std::vector<std::unique_ptr<Session>> sessions;
  for (int s = 0; s < kSessions; ++s) {
    sessions.push_back(Open());
    ASSERT_NE(sessions.back(), nullptr);
  }
  std::vector<std::thread> threads;
  for (int s = 0; s < kSessions; ++s) {
    threads.emplace_back([&, s] { PipelineSetThenGet(*sessions[s], /*rounds=*/25); });
  }
  for (std::thread& thread : threads) thread.join();
}

TEST_F(PipelinedClientTest, EachForwardUsesTheScaleSetJustBeforeIt) {
  std::unique_ptr<Session> session = Open();
  ASSERT_NE(session, nullptr);
  const HostTensor x = HostTensor::RandomNormal({2, kHidden}, DType::kF32, 4);
  absl::StatusOr<client::Variables> vars = InitLayerNorm(*session, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  // y = normalized(x) * scale + bias, with bias 0 from init: y(scale s) = s * y(scale 1).
  ASSERT_TRUE(session->SetVariables(SetScale(vars->layer_id, 1.0f)).ok());
  te::v1::ForwardRequest forward;
  forward.set_layer_id(vars->layer_id);
  *forward.mutable_x() = client::ToInlineProto(x);
  forward.set_deterministic(true);
  absl::StatusOr<te::v1::ForwardResponse> base = session->Forward(forward);
  ASSERT_TRUE(base.ok()) << base.status();
  absl::StatusOr<HostTensor> y1 = client::FromInlineProto(base->y(), "y");
  ASSERT_TRUE(y1.ok()) << y1.status();

  constexpr int kRounds = 20;
  std::vector<std::future<absl::StatusOr<te::v1::SetVariablesResponse>>> sets;
  std::vector<std::future<absl::StatusOr<te::v1::ForwardResponse>>> ys;
  for (int i = 1; i <= kRounds; ++i) {
    sets.push_back(session->SetVariablesAsync(SetScale(vars->layer_id, static_cast<float>(i))));
    ys.push_back(session->ForwardAsync(forward));
  }
  const std::vector<float> unit = y1->ToFloats();
  for (int i = 1; i <= kRounds; ++i) {
    ASSERT_TRUE(sets[i - 1].get().ok()) << i;
    absl::StatusOr<te::v1::ForwardResponse> y = ys[i - 1].get();
    ASSERT_TRUE(y.ok()) << "Forward " << i << ": " << y.status();
    absl::StatusOr<HostTensor> got = client::FromInlineProto(y->y(), "y");
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> values = got->ToFloats();
    ASSERT_EQ(values.size(), unit.size());
    for (size_t k = 0; k < values.size(); ++k) {
      EXPECT_NEAR(values[k], i * unit[k], 1e-5f * i * (1.0f + std::abs(unit[k])))
          << "the Forward sent after SetVariables(" << i << "), element " << k;
    }
  }
}

TEST_F(PipelinedClientTest, ACallThatExpiresAtTheClientDoesNotHoldUpTheNextOne) {
  std::unique_ptr<Session> session = Open();
  ASSERT_NE(session, nullptr);
  const HostTensor x = HostTensor::RandomNormal({2, kHidden}, DType::kF32, 5);
  absl::StatusOr<client::Variables> vars = InitLayerNorm(*session, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  ASSERT_TRUE(session->SetVariables(SetScale(vars->layer_id, 2.0f)).ok());
  // A deadline already past when the call starts: gRPC ends it here without
  // sending it (one a microsecond ahead is rounded up to gRPC's millisecond
  // clock, and the call may still be sent and run in time). Had the next call
  // waited for its number, it would have waited the server's
  // --sequence_gap_seconds (10 s) and ended ABORTED.
  const absl::Duration expired = -absl::Seconds(1);
  const absl::Duration prompt = absl::Seconds(5);
  EXPECT_EQ(session->SetVariables(SetScale(vars->layer_id, 5.0f), expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  absl::Time start = absl::Now();
  absl::StatusOr<te::v1::GetVariablesResponse> got = session->GetVariables(GetParams(vars->layer_id));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LT(absl::Now() - start, prompt);
  EXPECT_EQ(ScaleOf(*got), std::vector<float>(kHidden, 2.0f)) << "the expired SetVariables ran";

  // The same through the Async calls.
  EXPECT_EQ(session->SetVariablesAsync(SetScale(vars->layer_id, 6.0f), expired).get().status().code(),
            absl::StatusCode::kDeadlineExceeded);
  start = absl::Now();
  std::future<absl::StatusOr<te::v1::SetVariablesResponse>> set =
      session->SetVariablesAsync(SetScale(vars->layer_id, 3.0f));
  std::future<absl::StatusOr<te::v1::GetVariablesResponse>> read =
      session->GetVariablesAsync(GetParams(vars->layer_id));
  absl::StatusOr<te::v1::SetVariablesResponse> set_done = set.get();
  ASSERT_TRUE(set_done.ok()) << set_done.status();
  got = read.get();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LT(absl::Now() - start, prompt);
  EXPECT_EQ(ScaleOf(*got), std::vector<float>(kHidden, 3.0f));

  // The PutTensor and GetTensor streams, after a read that expired.
  EXPECT_EQ(session->GetVariables(GetParams(vars->layer_id), expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  start = absl::Now();
  const HostTensor tensor = HostTensor::RandomNormal({4, kHidden}, DType::kF32, 6);
  absl::StatusOr<client::ResidentTensor> put = session->Put(tensor);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_LT(absl::Now() - start, prompt);
  EXPECT_EQ(session->GetVariables(GetParams(vars->layer_id), expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  start = absl::Now();
  absl::StatusOr<HostTensor> fetched = session->Get(put->id);
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_LT(absl::Now() - start, prompt);
  EXPECT_EQ(fetched->ToFloats(), tensor.ToFloats());

  // And the close, after a read that expired.
  EXPECT_EQ(session->GetVariables(GetParams(vars->layer_id), expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  start = absl::Now();
  EXPECT_TRUE(session->Close().ok());
  EXPECT_LT(absl::Now() - start, prompt);
}

}  // namespace
}  // namespace te::testing
