// te_server's executor over real sockets: calls of one session stay in order
// while other sessions run, a full queue answers RESOURCE_EXHAUSTED at once,
// and a cancelled call or one whose deadline passes (waiting or running) frees
// what it held. Each test starts its own server with the executor it needs
// (--executor_threads, --executor_queue).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using te::v1::TeService;

constexpr absl::Duration kPatience = absl::Seconds(20);  // polls give up after this

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

class ConcurrencyTest : public ::testing::Test {
 protected:
  void StartServer(int threads, int queue) {
    ServerProcess::Options options;
    options.flags = {absl::StrCat("--executor_threads=", threads),
                     absl::StrCat("--executor_queue=", queue)};
    auto started = ServerProcess::Start(options);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    stub_ = server_->NewStub();
  }
  void TearDown() override {
    stub_.reset();  // an open channel would hold the graceful shutdown to its grace period
    if (server_ != nullptr) { EXPECT_TRUE(server_->Stop().ok()); }
  }

  te::v1::SessionRef NewSession() { return CreateSession(*stub_).session(); }

  std::string InitDense(const te::v1::SessionRef& session, int64_t batch, int64_t in, int64_t out) {
    te::v1::InitLayerRequest request = InitRequest(session, batch, in, out);
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, request, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response.layer_id();
  }
  static te::v1::InitLayerRequest InitRequest(const te::v1::SessionRef& session, int64_t batch,
                                              int64_t in, int64_t out) {
    te::v1::InitLayerRequest request;
    *request.mutable_session() = session;
    request.mutable_spec()->mutable_dense_general()->add_features(out);
    request.set_seed(3);
    request.set_input_dtype(te::v1::FLOAT32);
    request.add_input_shape(batch);
    request.add_input_shape(in);
    return request;
  }
  te::v1::ForwardRequest ForwardRequest(const te::v1::SessionRef& session, const std::string& layer,
                                        int64_t batch, int64_t in) {
    te::v1::ForwardRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer);
    *request.mutable_x() = MakeTensor(te::v1::FLOAT32, {batch, in}, RandomFloats(batch * in, 5));
    request.set_deterministic(true);
    return request;
  }

  te::v1::ServerInfo ServerInfo() {
    grpc::ClientContext context;
    te::v1::ServerInfo info;
    const grpc::Status status =
        stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return info;
  }
  int Queued() { return ServerInfo().devices(0).queued_calls(); }
  bool WaitForQueued(int n) {
    const absl::Time give_up = absl::Now() + kPatience;
    while (Queued() != n) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return true;
  }

  grpc::Status Info(const te::v1::SessionRef& session, te::v1::SessionInfo* info,
                    absl::Duration timeout = absl::Seconds(60)) {
    grpc::ClientContext context;
    context.set_deadline(In(timeout));
    te::v1::GetSessionInfoRequest request;
    *request.mutable_session() = session;
    return stub_->GetSessionInfo(&context, request, info);
  }

  // Occupies one executor worker with a long Benchmark on its own session
  // until Release(): the way to hold a queue still.
  class Blocker {
   public:
    explicit Blocker(ConcurrencyTest* test) : test_(test) {
      session_ = test->NewSession();
      const std::string layer = test->InitDense(session_, 256, 512, 512);
      te::v1::BenchmarkRequest request;
      *request.mutable_session() = session_;
      request.set_layer_id(layer);
      *request.mutable_inputs()->mutable_x() =
          MakeTensor(te::v1::FLOAT32, {256, 512}, RandomFloats(256 * 512, 6));
      *request.mutable_inputs()->mutable_dy() =
          MakeTensor(te::v1::FLOAT32, {256, 512}, RandomFloats(256 * 512, 7));
      request.set_warmup_iters(100000);
      request.set_timing_iters(100000);
      thread_ = std::thread([this, request] {
        for (;;) {
          grpc::ClientContext context;
          {
            absl::MutexLock lock(&mu_);
            if (released_) return;
            context_ = &context;
          }
          te::v1::BenchmarkResponse response;
          const grpc::Status status = test_->stub_->Benchmark(&context, request, &response);
          absl::MutexLock lock(&mu_);
          context_ = nullptr;
          status_ = status;
          // A probe of WaitUntilRunning can reach a one-place queue first and
          // turn the benchmark away (RESOURCE_EXHAUSTED, "retry later"): it
          // retries until admitted, as the queue's contract asks.
          if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED || released_) return;
        }
      });
    }
    // Returns once the benchmark runs: a call on another session then waits.
    bool WaitUntilRunning(const te::v1::SessionRef& probe_session) {
      const absl::Time give_up = absl::Now() + kPatience;
      while (absl::Now() < give_up) {
        te::v1::SessionInfo info;
        const grpc::Status probe = test_->Info(probe_session, &info, absl::Milliseconds(200));
        if (probe.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
          // The probe's place in the queue is freed when its deadline passes.
          return test_->WaitForQueued(0);
        }
      }
      return false;
    }
    grpc::Status Release() {
      {
        absl::MutexLock lock(&mu_);
        released_ = true;
        if (context_ != nullptr) context_->TryCancel();
      }
      thread_.join();
      absl::MutexLock lock(&mu_);
      return status_;
    }

   private:
    ConcurrencyTest* test_;
    te::v1::SessionRef session_;
    absl::Mutex mu_;
    grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the attempt in flight
    bool released_ ABSL_GUARDED_BY(mu_) = false;
    grpc::Status status_ ABSL_GUARDED_BY(mu_);
    std::thread thread_;
  };

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<TeService::Stub> stub_;
};

// The trailing number of an id the session handed out ("layer-7" -> 7): ids
// number a session's calls in the order they ran.
int64_t Serial(const std::string& id) {
  int64_t n = -1;
  EXPECT_TRUE(absl::SimpleAtoi(id.substr(id.rfind('-') + 1), &n)) << id;
  return n;
}

TEST_F(ConcurrencyTest, FullQueueAnswersResourceExhaustedAtOnce) {
  StartServer(/*threads=*/1, /*queue=*/1);
  const te::v1::SessionRef a = NewSession();
  const te::v1::SessionRef c = NewSession();
  Blocker blocker(this);
  ASSERT_TRUE(blocker.WaitUntilRunning(a));
  // One call fills the queue...
  grpc::Status queued_status;
  te::v1::InitLayerResponse queued_response;
  std::thread queued([&] {
    grpc::ClientContext context;
    queued_status = stub_->InitLayer(&context, InitRequest(a, 4, 8, 8), &queued_response);
  });
  ASSERT_TRUE(WaitForQueued(1));
  // ...and a flood behind it is turned away at once, every call of it.
  constexpr int kFlood = 16;
  std::vector<grpc::Status> flood(kFlood);
  std::vector<absl::Duration> took(kFlood);
  std::vector<std::thread> senders;
  for (int i = 0; i < kFlood; ++i) {
    senders.emplace_back([&, i] {
      const absl::Time start = absl::Now();
      te::v1::SessionInfo info;
      flood[i] = Info(i % 2 == 0 ? c : a, &info, absl::Seconds(30));
      took[i] = absl::Now() - start;
    });
  }
  for (std::thread& sender : senders) sender.join();
  for (int i = 0; i < kFlood; ++i) {
    EXPECT_EQ(flood[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << Describe(flood[i]);
    EXPECT_NE(flood[i].error_message().find("--executor_queue=1"), std::string::npos)
        << Describe(flood[i]);
    EXPECT_LT(took[i], absl::Seconds(5));
  }
  EXPECT_EQ(blocker.Release().error_code(), grpc::StatusCode::CANCELLED);
  queued.join();
  EXPECT_TRUE(queued_status.ok()) << Describe(queued_status);
  EXPECT_EQ(Queued(), 0);
}

TEST_F(ConcurrencyTest, CallsOfASessionRunInArrivalOrderBetweenOtherSessions) {
  StartServer(/*threads=*/1, /*queue=*/64);
  const te::v1::SessionRef a = NewSession();
  const te::v1::SessionRef b = NewSession();
  Blocker blocker(this);
  ASSERT_TRUE(blocker.WaitUntilRunning(a));
  // Each call is sent once the one before it is known to wait on the server,
  // so the arrival order is the order of this loop.
  constexpr int kCalls = 8;
  std::vector<te::v1::InitLayerResponse> responses(kCalls);
  std::vector<grpc::Status> statuses(kCalls);
  std::vector<std::thread> callers;
  for (int i = 0; i < kCalls; ++i) {
    const te::v1::SessionRef& session = i % 3 == 2 ? b : a;
    callers.emplace_back([&, i, session] {
      grpc::ClientContext context;
      statuses[i] = stub_->InitLayer(&context, InitRequest(session, 2, 4 + i, 3), &responses[i]);
    });
    ASSERT_TRUE(WaitForQueued(i + 1));
  }
  ASSERT_EQ(blocker.Release().error_code(), grpc::StatusCode::CANCELLED);
  for (std::thread& caller : callers) caller.join();
  int64_t last_a = 0, last_b = 0;
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(statuses[i].ok()) << Describe(statuses[i]);
    int64_t& last = i % 3 == 2 ? last_b : last_a;
    EXPECT_GT(Serial(responses[i].layer_id()), last) << "call " << i;
    last = Serial(responses[i].layer_id());
  }
}

TEST_F(ConcurrencyTest, ConcurrentCallsOnOneSessionNeverInterleave) {
  StartServer(/*threads=*/4, /*queue=*/256);
  const te::v1::SessionRef session = NewSession();
  const std::string layer = InitDense(session, 8, 32, 16);
  // Each thread keeps forwards for a backward: the session's saved forwards
  // are shared state that overlapping calls would corrupt.
  constexpr int kThreads = 8, kSteps = 10;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int step = 0; step < kSteps; ++step) {
        te::v1::ForwardRequest forward = ForwardRequest(session, layer, 8, 32);
        forward.set_keep_for_backward(true);
        te::v1::ForwardResponse y;
        grpc::ClientContext context;
        grpc::Status status = stub_->Forward(&context, forward, &y);
        if (!status.ok()) {
          ADD_FAILURE() << "thread " << t << ": " << Describe(status);
          ++failures;
          continue;
        }
        te::v1::BackwardRequest backward;
        *backward.mutable_session() = session;
        backward.set_forward_id(y.forward_id());
        *backward.mutable_dy() = MakeTensor(te::v1::FLOAT32, {8, 16}, RandomFloats(128, t));
        te::v1::BackwardResponse grads;
        grpc::ClientContext again;
        status = stub_->Backward(&again, backward, &grads);
        if (!status.ok()) {
          ADD_FAILURE() << "thread " << t << ": " << Describe(status);
          ++failures;
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  te::v1::SessionInfo info;
  ASSERT_TRUE(Info(session, &info).ok());
  EXPECT_EQ(info.saved_forwards(), 0);
}

TEST_F(ConcurrencyTest, DeadlineWhileWaitingDropsTheCallAndFreesItsPlace) {
  StartServer(/*threads=*/1, /*queue=*/1);
  const te::v1::SessionRef a = NewSession();
  const std::string layer = InitDense(a, 4, 8, 8);
  te::v1::SessionInfo before;
  ASSERT_TRUE(Info(a, &before).ok());
  Blocker blocker(this);
  ASSERT_TRUE(blocker.WaitUntilRunning(a));
  te::v1::ForwardRequest forward = ForwardRequest(a, layer, 4, 8);
  forward.set_keep_for_backward(true);
  forward.set_keep_outputs(true);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Milliseconds(300)));
  te::v1::ForwardResponse response;
  const grpc::Status late = stub_->Forward(&context, forward, &response);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(late);
  // Its place is free while the worker is still busy: another call queues.
  ASSERT_TRUE(WaitForQueued(0));
  grpc::Status next_status;
  te::v1::SessionInfo after;
  std::thread next([&] { next_status = Info(a, &after); });
  ASSERT_TRUE(WaitForQueued(1));
  EXPECT_EQ(blocker.Release().error_code(), grpc::StatusCode::CANCELLED);
  next.join();
  ASSERT_TRUE(next_status.ok()) << Describe(next_status);
  EXPECT_EQ(after.saved_forwards(), 0);
  EXPECT_EQ(after.resident_tensors(), 0);
  EXPECT_EQ(after.memory_bytes(), before.memory_bytes());
}

// A forward slow enough on the CPU backend for a deadline to pass inside
// it, on any machine: the layer's features grow (the forward's time with
// them, its x unchanged) until one forward takes kSlowForward, so a deadline
// or a cancel a third of the way in lands while the call runs.
class RunningCallTest : public ConcurrencyTest {
 protected:
  void SetUp() override {
    StartServer(/*threads=*/2, /*queue=*/8);
    session_ = NewSession();
    int64_t out = kOut;
    for (;;) {
      layer_ = InitDense(session_, kBatch, kIn, out);
      ASSERT_NO_FATAL_FAILURE(forward_time_ = TimeForward());
      if (forward_time_ >= kSlowForward || out >= kMaxOut) break;
      const double short_by = absl::FDivDuration(kSlowForward, forward_time_);
      out = std::min(kMaxOut, out * std::max<int64_t>(2, static_cast<int64_t>(std::ceil(1.5 * short_by))));
    }
    ASSERT_GE(forward_time_, kSlowForward)
        << "DenseGeneral(" << out << ") on [" << kBatch << ", " << kIn << "] runs in " << forward_time_;
    ASSERT_TRUE(Info(session_, &baseline_).ok());
  }
  // One forward of the layer, its y left resident (not sent) and then
  // deleted, so the session is as it was.
  absl::Duration TimeForward() {
    te::v1::ForwardRequest request = ForwardRequest(session_, layer_, kBatch, kIn);
    request.set_keep_outputs(true);
    const absl::Time start = absl::Now();
    grpc::ClientContext context;
    te::v1::ForwardResponse response;
    const grpc::Status status = stub_->Forward(&context, request, &response);
    const absl::Duration took = absl::Now() - start;
    EXPECT_TRUE(status.ok()) << Describe(status);
    te::v1::DeleteTensorRequest drop;
    *drop.mutable_session() = session_;
    drop.set_tensor_id(response.y().resident_id());
    grpc::ClientContext drop_context;
    te::v1::DeleteTensorResponse dropped;
    const grpc::Status deleted = stub_->DeleteTensor(&drop_context, drop, &dropped);
    EXPECT_TRUE(deleted.ok()) << Describe(deleted);
    return took;
  }
  // Forward keeping everything it can: a saved forward and a resident y.
  te::v1::ForwardRequest Keeping() {
    te::v1::ForwardRequest request = ForwardRequest(session_, layer_, kBatch, kIn);
    request.set_keep_for_backward(true);
    request.set_keep_outputs(true);
    return request;
  }
  void ExpectNothingKept() {
    te::v1::SessionInfo info;
    ASSERT_TRUE(Info(session_, &info).ok());
    EXPECT_EQ(info.saved_forwards(), 0);
    EXPECT_EQ(info.resident_tensors(), 0);
    EXPECT_EQ(info.memory_bytes(), baseline_.memory_bytes());
  }

  static constexpr int64_t kBatch = 512, kIn = 2048, kOut = 2048;
  static constexpr int64_t kMaxOut = 64 * kOut;  // a 512 MiB kernel
  static constexpr absl::Duration kSlowForward = absl::Milliseconds(150);
  te::v1::SessionRef session_;
  std::string layer_;
  absl::Duration forward_time_;
  te::v1::SessionInfo baseline_;
};

TEST_F(RunningCallTest, DeadlinePassingDuringTheCallUndoesIt) {
  grpc::ClientContext context;
  context.set_deadline(In(forward_time_ / 3));
  te::v1::ForwardResponse response;
  const grpc::Status status = stub_->Forward(&context, Keeping(), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << Describe(status);
  ExpectNothingKept();
}

TEST_F(RunningCallTest, CancelDuringTheCallUndoesIt) {
  grpc::ClientContext context;
  std::thread canceller([&] {
    absl::SleepFor(forward_time_ / 3);
    context.TryCancel();
  });
  te::v1::ForwardResponse response;
  const grpc::Status status = stub_->Forward(&context, Keeping(), &response);
  canceller.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << Describe(status);
  ExpectNothingKept();
}

TEST_F(RunningCallTest, AFinishedCallKeepsWhatItMade) {
  // The control: the same call, left to finish, keeps its forward and its y.
  grpc::ClientContext context;
  te::v1::ForwardResponse response;
  ASSERT_TRUE(stub_->Forward(&context, Keeping(), &response).ok());
  te::v1::SessionInfo info;
  ASSERT_TRUE(Info(session_, &info).ok());
  EXPECT_EQ(info.saved_forwards(), 1);
  EXPECT_EQ(info.resident_tensors(), 1);
  EXPECT_GT(info.memory_bytes(), baseline_.memory_bytes());
}

TEST_F(ConcurrencyTest, SessionsSayWhichDeviceTheyAreOn) {
  StartServer(/*threads=*/2, /*queue=*/8);
  const te::v1::CreateSessionResponse created = CreateSession(*stub_);
  const te::v1::ServerInfo info = ServerInfo();
  ASSERT_EQ(info.devices_size(), 1);
  EXPECT_EQ(created.device(), info.devices(0).name());
  EXPECT_EQ(info.devices(0).sessions(), 1);
  te::v1::CreateSessionRequest elsewhere;
  elsewhere.set_device("cuda:7");
  grpc::ClientContext context;
  te::v1::CreateSessionResponse response;
  const grpc::Status status = stub_->CreateSession(&context, elsewhere, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
}

}  // namespace
}  // namespace te::testing
