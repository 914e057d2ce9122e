// The session's call order from the client's side, against a fake TeService
// on loopback that records the SessionRef.sequence of every call: each call
// of a Session (unary, the PutTensor header, GetTensor, Close) takes the next
// number as it is sent, a repeated call a new one, concurrent callers unique
// ones, and the Async calls theirs in the caller's program order; a call that
// ended at the client without an answer is named abandoned by the later calls
// until one numbered above it is answered. Whether the real server runs calls
// in that order is tests/integration/pipelined_client_test.cc.
#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "client/modules.h"
#include "client/speedometer.h"
#include "client/tensor.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

struct Numbered {
  std::string method;
  uint64_t sequence = 0;
  std::vector<uint64_t> abandoned;
  uint64_t first_unanswered = 0;
};

// Answers every session call at once (GetVariables with one variable whose
// path is the number the request carried), except ForwardBackward, which
// waits until Release, or CloseSession arrives (when release_on_close), or
// the client cancels it.
class RecordingService final : public te::v1::TeService::Service {
 public:
  bool release_on_close = true;

  grpc::Status CreateSession(grpc::ServerContext*, const te::v1::CreateSessionRequest*,
                             te::v1::CreateSessionResponse* response) override {
    response->mutable_session()->set_session_id("s1");
    response->mutable_session()->set_token("t1");
    response->set_device("cpu");
    return grpc::Status::OK;
  }
  grpc::Status CloseSession(grpc::ServerContext*, const te::v1::CloseSessionRequest* request,
                            te::v1::CloseSessionResponse*) override {
    Record("CloseSession", request->session());
    if (release_on_close) Release();
    return grpc::Status::OK;
  }
  grpc::Status PutTensor(grpc::ServerContext*, grpc::ServerReader<te::v1::PutTensorChunk>* reader,
                         te::v1::PutTensorResponse* response) override {
    te::v1::PutTensorChunk chunk;
    while (reader->Read(&chunk)) {
      if (chunk.has_header()) Record("PutTensor", chunk.header().session());
    }
    response->set_tensor_id("r1");
    return grpc::Status::OK;
  }
  grpc::Status GetTensor(grpc::ServerContext*, const te::v1::GetTensorRequest* request,
                         grpc::ServerWriter<te::v1::TensorChunk>* writer) override {
    Record("GetTensor", request->session());
    te::v1::TensorChunk chunk;
    chunk.mutable_header()->set_dtype(te::v1::FLOAT32);
    chunk.mutable_header()->add_shape(1);
    writer->Write(chunk);
    chunk.Clear();
    chunk.set_data(std::string(4, '\0'));
    writer->Write(chunk);
    return grpc::Status::OK;
  }
  grpc::Status DeleteTensor(grpc::ServerContext*, const te::v1::DeleteTensorRequest* request,
                            te::v1::DeleteTensorResponse*) override {
    return Record("DeleteTensor", request->session());
  }
  grpc::Status InitLayer(grpc::ServerContext*, const te::v1::InitLayerRequest* request,
                         te::v1::InitLayerResponse*) override {
    return Record("InitLayer", request->session());
  }
  // Refused, as a bad request is: the number is spent all the same.
  grpc::Status Forward(grpc::ServerContext*, const te::v1::ForwardRequest* request,
                       te::v1::ForwardResponse*) override {
    Record("Forward", request->session());
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "x: missing");
  }
  grpc::Status Backward(grpc::ServerContext*, const te::v1::BackwardRequest* request,
                        te::v1::BackwardResponse*) override {
    return Record("Backward", request->session());
  }
  grpc::Status ForwardBackward(grpc::ServerContext* context,
                               const te::v1::ForwardBackwardRequest* request,
                               te::v1::ForwardBackwardResponse* response) override {
    Record("ForwardBackward", request->session());
    while (!released_.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
      if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    }
    response->add_values(1.0);
    return grpc::Status::OK;
  }
  grpc::Status GetVariables(grpc::ServerContext*, const te::v1::GetVariablesRequest* request,
                            te::v1::GetVariablesResponse* response) override {
    Record("GetVariables", request->session());
    response->add_variables()->set_path(std::to_string(request->session().sequence()));
    return grpc::Status::OK;
  }
  grpc::Status SetVariables(grpc::ServerContext*, const te::v1::SetVariablesRequest* request,
                            te::v1::SetVariablesResponse*) override {
    return Record("SetVariables", request->session());
  }
  grpc::Status Benchmark(grpc::ServerContext*, const te::v1::BenchmarkRequest* request,
                         te::v1::BenchmarkResponse*) override {
    return Record("Benchmark", request->session());
  }

  void Release() {
    absl::MutexLock lock(&mu_);
    if (!released_.HasBeenNotified()) released_.Notify();
  }

  std::vector<Numbered> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  // What the call numbered `sequence` named abandoned; nullopt when it never arrived.
  std::optional<std::vector<uint64_t>> abandoned_by(uint64_t sequence) {
    for (const Numbered& call : calls()) {
      if (call.sequence == sequence) return call.abandoned;
    }
    return std::nullopt;
  }
  // The first_unanswered the call numbered `sequence` carried; 0 when it never arrived.
  uint64_t first_unanswered_by(uint64_t sequence) {
    for (const Numbered& call : calls()) {
      if (call.sequence == sequence) return call.first_unanswered;
    }
    return 0;
  }
  std::vector<uint64_t> sorted_sequences() {
    std::vector<uint64_t> numbers;
    for (const Numbered& call : calls()) numbers.push_back(call.sequence);
    std::sort(numbers.begin(), numbers.end());
    return numbers;
  }

 private:
  grpc::Status Record(const std::string& method, const te::v1::SessionRef& ref) {
    absl::MutexLock lock(&mu_);
    calls_.push_back({method, ref.sequence(), {ref.abandoned().begin(), ref.abandoned().end()},
                      ref.first_unanswered()});
    if (ref.session_id() != "s1" || ref.token() != "t1") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad session reference");
    }
    return grpc::Status::OK;
  }

  absl::Notification released_;
  absl::Mutex mu_;
  std::vector<Numbered> calls_ ABSL_GUARDED_BY(mu_);
};

class PipelinedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.inline_tensor_bytes = 0;  // Send uploads, Receive fetches: the streams get numbers too
    options.transport = Transport::kStream;
    options.rpc_timeout = absl::Seconds(30);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect("127.0.0.1:" + std::to_string(port), options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
  }
  void TearDown() override {
    session_.reset();
    client_.reset();
    if (server_ != nullptr) server_->Shutdown();
  }

  static std::vector<uint64_t> OneTo(uint64_t n) {
    std::vector<uint64_t> numbers;
    for (uint64_t i = 1; i <= n; ++i) numbers.push_back(i);
    return numbers;
  }

  RecordingService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
};

TEST_F(PipelinedTest, EveryCallTakesTheNextNumberAsItIsSent) {
  absl::StatusOr<ResidentTensor> put = session_->Put(HostTensor::Full({1}, DType::kF32, 2.0f));
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE(session_->Get(put->id).ok());
  ASSERT_TRUE(session_->Delete(put->id).ok());
  ASSERT_TRUE(session_->InitLayer({}).ok());
  EXPECT_FALSE(session_->Forward({}).ok());
  EXPECT_FALSE(session_->Forward({}).ok());  // made again: a new number
  ASSERT_TRUE(session_->Backward({}).ok());
  ASSERT_TRUE(session_->SetVariables({}).ok());
  ASSERT_TRUE(session_->GetVariables({}).ok());
  ASSERT_TRUE(session_->Benchmark({}).ok());
  // Receive of a resident tensor: GetTensor, then DeleteTensor.
  te::v1::Tensor resident;
  resident.set_dtype(te::v1::FLOAT32);
  resident.add_shape(1);
  resident.set_resident_id("r1");
  ASSERT_TRUE(session_->Receive(resident, "y").ok());
  ASSERT_TRUE(session_->Close().ok());

  const std::vector<Numbered> calls = service_.calls();
  const std::vector<std::string> want = {"PutTensor",    "GetTensor",    "DeleteTensor", "InitLayer",
                                         "Forward",      "Forward",      "Backward",     "SetVariables",
                                         "GetVariables", "Benchmark",    "GetTensor",    "DeleteTensor",
                                         "CloseSession"};
  ASSERT_EQ(calls.size(), want.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(calls[i].method, want[i]) << i;
    EXPECT_EQ(calls[i].sequence, i + 1) << calls[i].method;
  }
}

TEST_F(PipelinedTest, AsyncCallsAreNumberedInProgramOrderBeforeAnyAnswer) {
  constexpr int kRounds = 50;
  std::vector<std::future<absl::StatusOr<te::v1::SetVariablesResponse>>> sets;
  std::vector<std::future<absl::StatusOr<te::v1::GetVariablesResponse>>> gets;
  for (int i = 0; i < kRounds; ++i) {
    sets.push_back(session_->SetVariablesAsync({}));
    gets.push_back(session_->GetVariablesAsync({}));
  }
  for (int i = 0; i < kRounds; ++i) {
    absl::StatusOr<te::v1::SetVariablesResponse> set = sets[i].get();
    ASSERT_TRUE(set.ok()) << set.status();
    absl::StatusOr<te::v1::GetVariablesResponse> got = gets[i].get();
    ASSERT_TRUE(got.ok()) << got.status();
    // The i-th pair took 2i+1 and 2i+2, whatever order they reached the fake in.
    ASSERT_EQ(got->variables_size(), 1);
    EXPECT_EQ(got->variables(0).path(), std::to_string(2 * i + 2));
  }
  EXPECT_EQ(service_.sorted_sequences(), OneTo(2 * kRounds));
  // A synchronous call continues the same order.
  ASSERT_TRUE(session_->SetVariables({}).ok());
  EXPECT_EQ(service_.calls().back().sequence, 2 * kRounds + 1u);
}

TEST_F(PipelinedTest, AsyncFailuresArriveThroughTheFuture) {
  absl::StatusOr<te::v1::ForwardResponse> forward = session_->ForwardAsync({}).get();
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(forward.status().message(), "x: missing");
  ASSERT_TRUE(session_->BackwardAsync({}).get().ok());
  EXPECT_EQ(service_.sorted_sequences(), OneTo(2));
}

TEST_F(PipelinedTest, ConcurrentCallersGetUniqueNumbers) {
  constexpr int kThreads = 8, kCalls = 25;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([this, t] {
      for (int i = 0; i < kCalls; ++i) {
        if ((t + i) % 2 == 0) {
          EXPECT_TRUE(session_->SetVariables({}).ok());
        } else {
          EXPECT_TRUE(session_->GetVariablesAsync({}).get().ok());
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(service_.sorted_sequences(), OneTo(kThreads * kCalls));
}

TEST_F(PipelinedTest, DestroyingTheSessionAwaitsCallsTheServerAnswers) {
  // The fake holds ForwardBackward until the close arrives, as the server
  // runs the close after every lower number.
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> step =
      session_->ForwardBackwardAsync({});
  session_.reset();
  absl::StatusOr<te::v1::ForwardBackwardResponse> done = step.get();
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->values_size(), 1);
  // Either may reach the fake first (the server orders them by number).
  std::vector<Numbered> calls = service_.calls();
  ASSERT_EQ(calls.size(), 2u);
  std::sort(calls.begin(), calls.end(),
            [](const Numbered& a, const Numbered& b) { return a.sequence < b.sequence; });
  EXPECT_EQ(calls[0].method, "ForwardBackward");
  EXPECT_EQ(calls[0].sequence, 1u);
  EXPECT_EQ(calls[1].method, "CloseSession");
  EXPECT_EQ(calls[1].sequence, 2u);
}

TEST_F(PipelinedTest, DestroyingTheSessionCancelsCallsLeftUnanswered) {
  service_.release_on_close = false;
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> step =
      session_->ForwardBackwardAsync({});
  session_.reset();  // the close, then the destructor's 10 s wait, then the cancel
  EXPECT_EQ(step.get().status().code(), absl::StatusCode::kCancelled);
}

TEST_F(PipelinedTest, ACallEndedAtTheClientIsNamedAbandonedUntilALaterCallIsAnswered) {
  // A deadline already past when the call starts: gRPC ends it here without
  // sending it. (One a microsecond ahead is not enough: gRPC rounds it up to
  // its millisecond clock, and the call may be sent and answered in time.)
  const absl::Duration expired = -absl::Seconds(1);
  EXPECT_EQ(session_->SetVariables({}, expired).status().code(), absl::StatusCode::kDeadlineExceeded);  // 1
  EXPECT_EQ(session_->GetVariablesAsync({}, expired).get().status().code(),
            absl::StatusCode::kDeadlineExceeded);  // 2
  absl::StatusOr<ResidentTensor> put =
      session_->Put(HostTensor::Full({1}, DType::kF32, 2.0f));  // 3
  ASSERT_TRUE(put.ok()) << put.status();
  ASSERT_TRUE(session_->Get(put->id).ok());  // 4
  EXPECT_EQ(session_->Forward({}, expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);  // 5
  // Refused by the fake: still the server's answer.
  EXPECT_EQ(session_->Forward({}).status().code(), absl::StatusCode::kInvalidArgument);  // 6
  ASSERT_TRUE(session_->Backward({}).ok());  // 7
  EXPECT_EQ(session_->InitLayer({}, expired).status().code(),
            absl::StatusCode::kDeadlineExceeded);  // 8
  ASSERT_TRUE(session_->Close().ok());  // 9

  using Numbers = std::vector<uint64_t>;
  EXPECT_EQ(service_.abandoned_by(3), Numbers({1, 2})) << "the PutTensor header";
  EXPECT_EQ(service_.abandoned_by(4), Numbers()) << "GetTensor, after the PutTensor's answer";
  EXPECT_EQ(service_.abandoned_by(6), Numbers({5})) << "Forward";
  EXPECT_EQ(service_.abandoned_by(7), Numbers()) << "Backward, after Forward's refusal";
  EXPECT_EQ(service_.abandoned_by(9), Numbers({8})) << "CloseSession";
}

TEST_F(PipelinedTest, AnAnswerForgetsOnlyTheAbandonedNumbersBelowIt) {
  service_.release_on_close = false;
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> step =
      session_->ForwardBackwardAsync({});  // 1, held by the fake
  EXPECT_EQ(session_->SetVariables({}, /*timeout=*/-absl::Seconds(1)).status().code(),
            absl::StatusCode::kDeadlineExceeded);  // 2, its deadline already past
  service_.Release();
  ASSERT_TRUE(step.get().ok());  // 1's answer says nothing of 2
  ASSERT_TRUE(session_->GetVariablesAsync({}).get().ok());  // 3
  ASSERT_TRUE(session_->SetVariables({}).ok());  // 4

  using Numbers = std::vector<uint64_t>;
  EXPECT_EQ(service_.abandoned_by(1), Numbers());
  EXPECT_EQ(service_.abandoned_by(3), Numbers({2}));
  EXPECT_EQ(service_.abandoned_by(4), Numbers());
}

// Each call names the lowest number still in flight, its own included
// (SessionRef.first_unanswered: where a restored session's order goes on);
// a call that ended without an answer is no longer in flight.
TEST_F(PipelinedTest, EachCallNamesTheLowestNumberStillInFlight) {
  service_.release_on_close = false;
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> step =
      session_->ForwardBackwardAsync({});  // 1, held by the fake
  ASSERT_TRUE(session_->SetVariables({}).ok());  // 2
  ASSERT_TRUE(session_->GetVariablesAsync({}).get().ok());  // 3
  EXPECT_EQ(session_->SetVariables({}, /*timeout=*/-absl::Seconds(1)).status().code(),
            absl::StatusCode::kDeadlineExceeded);  // 4, never sent
  service_.Release();
  ASSERT_TRUE(step.get().ok());
  ASSERT_TRUE(session_->SetVariables({}).ok());  // 5

  EXPECT_EQ(service_.first_unanswered_by(1), 1u);
  EXPECT_EQ(service_.first_unanswered_by(2), 1u) << "1 is held";
  EXPECT_EQ(service_.first_unanswered_by(3), 1u) << "1 is held";
  EXPECT_EQ(service_.first_unanswered_by(5), 5u) << "1 answered, 4 abandoned";
}


// The speedometer's client-side loop keeps pipeline_depth steps in flight:
// with ForwardBackward held unanswered, that many reach the server and no
// more; once answered, every timed step runs.
class SpeedometerPipelineTest : public PipelinedTest,
                                public ::testing::WithParamInterface<int> {
 protected:
  int ForwardBackwardCalls() {
    int n = 0;
    for (const Numbered& call : service_.calls()) n += call.method == "ForwardBackward";
    return n;
  }
};

TEST_P(SpeedometerPipelineTest, KeepsDepthStepsInFlight) {
  const int depth = GetParam();
  Variables vars;
  vars.session = session_.get();
  vars.layer_id = "layer-1";
  SpeedometerOptions options;
  options.warmup_iters = 0;
  options.timing_iters = 4;
  options.pipeline_depth = depth;
  options.print = false;
  const HostTensor x = HostTensor::Full({2, 4}, DType::kF32, 1.0f);
  const DenseGeneral module({4});
  std::future<absl::StatusOr<SpeedometerResult>> timed = std::async(std::launch::async, [&] {
    return Speedometer(*session_, module, vars, x, x, options);
  });
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (ForwardBackwardCalls() < depth && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(ForwardBackwardCalls(), depth);
  // Time enough for a step beyond the depth to arrive, were one sent.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(ForwardBackwardCalls(), depth);
  service_.Release();
  const absl::StatusOr<SpeedometerResult> result = timed.get();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->steps, 4);
  EXPECT_GT(result->mean_ms, 0.0);
  EXPECT_EQ(ForwardBackwardCalls(), 4);
}

INSTANTIATE_TEST_SUITE_P(Depths, SpeedometerPipelineTest, ::testing::Values(1, 2, 3));

TEST_F(PipelinedTest, SpeedometerRefusesADepthBelowOne) {
  Variables vars;
  vars.session = session_.get();
  vars.layer_id = "layer-1";
  SpeedometerOptions options;
  options.pipeline_depth = 0;
  options.print = false;
  const HostTensor x = HostTensor::Full({2, 4}, DType::kF32, 1.0f);
  const absl::StatusOr<SpeedometerResult> result =
      Speedometer(*session_, DenseGeneral({4}), vars, x, x, options);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("options.pipeline_depth"), std::string::npos)
      << result.status();
}

}  // namespace
}  // namespace te::client
