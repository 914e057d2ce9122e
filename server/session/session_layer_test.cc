// The session layer (Session, SessionManager, DeviceExecutor) on a fake
// backend (testing/fake_ops.h): the order calls reach a session's ops in,
// cancellation, deadlines and Close while calls wait, a failure injected at
// every op of a call, and the memory account, with no kernel computing
// anything. Calls run as the service runs them: submitted to the executor
// under the session's id, holding the session's Lease in the turn.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/service/executor.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "server/session/testing/fake_ops.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using service::DeviceExecutor;
using service::ExecutorOptions;

using testing::FakeBackend;
using testing::FakeDevice;
using testing::FakeOpCall;

constexpr int64_t kHidden = 16;
constexpr int64_t kFeatures = 8;
const std::vector<int64_t> kInputShape = {2, 4, kHidden};

te::v1::Tensor Floats(const std::vector<int64_t>& shape, float first) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = first + 0.25f * static_cast<float>(i % 9);
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_inline_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

te::v1::Autocast DelayedScaling() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  return autocast;
}

// What a call could change in a session, to compare before and after. (Not
// the id counter: ids are never reused, so a failed call may use some up.)
struct Snapshot {
  std::string counts;     // GetSessionInfo's layers, saved forwards, resident tensors, regions
  std::string variables;  // every collection of the layer, values included
  int64_t bytes_in_use = 0;
  int64_t device_bytes = 0;  // every stream's memory on the fake device
  bool operator==(const Snapshot& o) const {
    return counts == o.counts && variables == o.variables && bytes_in_use == o.bytes_in_use &&
           device_bytes == o.device_bytes;
  }
};

std::ostream& operator<<(std::ostream& os, const Snapshot& s) {
  return os << "{bytes_in_use " << s.bytes_in_use << ", device bytes " << s.device_bytes
            << ", " << s.counts << ", variables " << s.variables.size() << " B}";
}

class SessionLayerTest : public ::testing::Test {
 protected:
  using Work = std::function<absl::Status(Session& session)>;

  // One submitted call: done once its work ran or it was dropped.
  struct Pending {
    absl::Notification done;
    absl::Status status;
    // Weak: the executor's record of the call holds the Pending.
    std::weak_ptr<DeviceExecutor::CallState> handle;
  };

  SessionLayerTest() {
    config_.session_memory_bytes = 64 << 20;
    manager_ = std::make_unique<SessionManager>(SessionManagerOptions{});
    ExecutorOptions options;
    options.threads = 4;
    options.name = "fake";
    executor_ = std::make_unique<DeviceExecutor>(options);
  }

  ~SessionLayerTest() override {
    backend().Unblock();
    executor_.reset();  // its calls hold leases on the manager's sessions
  }

  FakeBackend& backend() { return device_.backend(); }

  te::v1::SessionRef Open() {
    te::v1::CreateSessionRequest request;
    te::v1::CreateSessionResponse response;
    const absl::Status opened = OpenSession(request, &device_, config_, manager_.get(), &response);
    EXPECT_TRUE(opened.ok()) << opened;
    executor_->StartSequence(response.session().session_id(), 1);
    return response.session();
  }

  // Submits `work` as the service does: under the session's key, with the
  // session's Lease held for it in the turn, its ops tagged `tag`.
  std::shared_ptr<Pending> Submit(const te::v1::SessionRef& ref, std::string tag, Work work,
                                  absl::Time deadline = absl::InfiniteFuture()) {
    auto pending = std::make_shared<Pending>();
    DeviceExecutor::Call call;
    call.key = ref.session_id();
    call.deadline = deadline;
    SessionManager* manager = manager_.get();
    call.run = [manager, ref, tag, work = std::move(work), pending](DeviceExecutor::Turn turn) {
      {
        FakeBackend::CallTag tagged(tag);
        absl::StatusOr<SessionManager::Lease> lease =
            manager->Acquire(ref.session_id(), ref.token());
        pending->status = lease.ok() ? work(lease->session()) : lease.status();
      }
      turn.Release();
      pending->done.Notify();
    };
    call.drop = [pending](absl::Status reason) {
      pending->status = std::move(reason);
      pending->done.Notify();
    };
    absl::StatusOr<DeviceExecutor::Handle> handle = executor_->Submit(std::move(call));
    if (!handle.ok()) {
      pending->status = handle.status();
      pending->done.Notify();
    } else {
      pending->handle = *handle;
    }
    return pending;
  }

  absl::Status Run(const te::v1::SessionRef& ref, const std::string& tag, Work work) {
    std::shared_ptr<Pending> pending = Submit(ref, tag, std::move(work));
    pending->done.WaitForNotification();
    return pending->status;
  }

  // A DenseGeneral initialised under FP8 delayed scaling (so it has FP8 state).
  std::string InitDense(const te::v1::SessionRef& ref) {
    std::string layer_id;
    const absl::Status status = Run(ref, "init", [&](Session& s) -> absl::Status {
      te::v1::InitLayerRequest init;
      init.mutable_spec()->mutable_dense_general()->add_features(kFeatures);
      init.set_seed(7);
      init.set_input_dtype(te::v1::FLOAT32);
      init.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
      *init.mutable_autocast() = DelayedScaling();
      te::v1::InitLayerResponse response;
      absl::Status initialised = s.InitLayer(init, &response);
      layer_id = response.layer_id();
      return initialised;
    });
    EXPECT_TRUE(status.ok()) << status;
    return layer_id;
  }

  static absl::Status Forward(Session& s, const std::string& layer_id, float first,
                              bool keep = false, std::string* forward_id = nullptr,
                              const CallContext& call = CallContext()) {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer_id);
    *request.mutable_x() = Floats(kInputShape, first);
    *request.mutable_autocast() = DelayedScaling();
    request.set_keep_for_backward(keep);
    request.set_keep_outputs(keep);
    te::v1::ForwardResponse response;
    absl::Status status = s.Forward(request, &response, call);
    if (forward_id != nullptr) *forward_id = response.forward_id();
    return status;
  }

  Snapshot Take(const te::v1::SessionRef& ref, const std::string& layer_id) {
    Snapshot snapshot;
    const absl::Status status = Run(ref, "snapshot", [&](Session& s) -> absl::Status {
      te::v1::SessionInfo info;
      s.GetSessionInfo(&info);
      snapshot.counts = absl::StrCat("layers ", info.layers(), " saved_forwards ",
                                     info.saved_forwards(), " resident_tensors ",
                                     info.resident_tensors(), " shm_regions ", info.shm_regions(),
                                     " memory_bytes ", info.memory_bytes());
      te::v1::GetVariablesRequest request;
      request.set_layer_id(layer_id);
      te::v1::GetVariablesResponse variables;
      absl::Status got = s.GetVariables(request, &variables);
      snapshot.variables = variables.SerializeAsString();
      snapshot.bytes_in_use = s.bytes_in_use();
      return got;
    });
    EXPECT_TRUE(status.ok()) << status;
    snapshot.device_bytes = backend().live_bytes();
    return snapshot;
  }

  // The ops issued under `tag`, in order.
  std::vector<std::string> OpsOf(const std::string& tag) {
    std::vector<std::string> ops;
    for (const FakeOpCall& call : backend().calls()) {
      if (call.tag == tag) ops.push_back(call.op);
    }
    return ops;
  }

  FakeDevice device_;
  SessionConfig config_;
  std::unique_ptr<SessionManager> manager_;
  std::unique_ptr<DeviceExecutor> executor_;
};

// ---- order and concurrency ---------------------------------------------------------

TEST_F(SessionLayerTest, CallsOfOneSessionRunInOrderAloneWhileOtherSessionsRun) {
  const te::v1::SessionRef a = Open();
  const te::v1::SessionRef b = Open();
  const std::string layer_a = InitDense(a);
  const std::string layer_b = InitDense(b);
  backend().ClearCalls();

  // a's first call holds a's turn inside its GEMM.
  backend().BlockOp("Gemm", "a0");
  std::vector<std::shared_ptr<Pending>> calls_a;
  absl::Mutex mu;
  std::vector<std::string> events;  // "start a1", "end a1", ...
  auto logged = [&](std::string tag, std::string layer, float first) -> Work {
    return [&, tag, layer, first](Session& s) {
      {
        absl::MutexLock lock(&mu);
        events.push_back("start " + tag);
      }
      absl::Status status = Forward(s, layer, first);
      absl::MutexLock lock(&mu);
      events.push_back("end " + tag);
      return status;
    };
  };
  calls_a.push_back(Submit(a, "a0", logged("a0", layer_a, 0.0f)));
  ASSERT_TRUE(backend().WaitBlocked(1));
  for (int i = 1; i < 5; ++i) {
    calls_a.push_back(Submit(a, absl::StrCat("a", i), logged(absl::StrCat("a", i), layer_a, i)));
  }
  // Session b is not held up by a: its five calls finish while a0 is stuck.
  for (int i = 0; i < 5; ++i) {
    const std::string tag = absl::StrCat("b", i);
    const absl::Status status = Run(b, tag, logged(tag, layer_b, i));
    ASSERT_TRUE(status.ok()) << status;
  }
  for (int i = 1; i < 5; ++i) {
    EXPECT_TRUE(OpsOf(absl::StrCat("a", i)).empty()) << "a" << i << " ran before a0 ended";
    EXPECT_FALSE(calls_a[i]->done.HasBeenNotified());
  }
  EXPECT_EQ(backend().max_streams_in_flight(), 2);  // b's ops ran while a0's GEMM was in flight

  backend().Unblock();
  for (const auto& call : calls_a) {
    call->done.WaitForNotification();
    EXPECT_TRUE(call->status.ok()) << call->status;
  }
  // a's calls started in submit order, each after the previous one ended.
  std::vector<std::string> a_events;
  for (const std::string& e : events) {
    if (e.find(" a") != std::string::npos) a_events.push_back(e);
  }
  std::vector<std::string> expected;
  for (int i = 0; i < 5; ++i) {
    expected.push_back(absl::StrCat("start a", i));
    expected.push_back(absl::StrCat("end a", i));
  }
  EXPECT_EQ(a_events, expected);
  // On the device, too: a's ops come call by call, never two at once on a stream.
  std::vector<std::string> tags_in_op_order;
  int stream_a = 0;
  for (const FakeOpCall& call : backend().calls()) {
    if (call.tag.empty() || call.tag[0] != 'a') continue;
    if (stream_a == 0) stream_a = call.stream;
    EXPECT_EQ(call.stream, stream_a) << call.tag << " " << call.op;
    if (tags_in_op_order.empty() || tags_in_op_order.back() != call.tag) {
      tags_in_op_order.push_back(call.tag);
    }
  }
  EXPECT_EQ(tags_in_op_order, (std::vector<std::string>{"a0", "a1", "a2", "a3", "a4"}));
  EXPECT_EQ(backend().max_ops_in_flight_per_stream(), 1);
}

TEST_F(SessionLayerTest, CancelledAndExpiredWaitingCallsNeverReachTheSession) {
  const te::v1::SessionRef a = Open();
  const std::string layer = InitDense(a);
  backend().BlockOp("Gemm", "running");
  std::shared_ptr<Pending> running = Submit(a, "running", [&](Session& s) {
    return Forward(s, layer, 0.0f);
  });
  ASSERT_TRUE(backend().WaitBlocked(1));
  std::shared_ptr<Pending> cancelled = Submit(a, "cancelled", [&](Session& s) {
    return Forward(s, layer, 1.0f, /*keep=*/true);
  });
  std::shared_ptr<Pending> expired = Submit(
      a, "expired", [&](Session& s) { return Forward(s, layer, 2.0f, /*keep=*/true); },
      absl::Now() + absl::Milliseconds(50));
  std::shared_ptr<Pending> later = Submit(a, "later", [&](Session& s) {
    return Forward(s, layer, 3.0f);
  });
  EXPECT_TRUE(
      executor_->Cancel(cancelled->handle.lock(), absl::CancelledError("client cancelled")));
  EXPECT_TRUE(cancelled->done.HasBeenNotified());  // dropped at once, not at its turn
  absl::SleepFor(absl::Milliseconds(100));
  backend().Unblock();
  for (const auto& call : {running, expired, later}) call->done.WaitForNotification();
  EXPECT_TRUE(running->status.ok()) << running->status;
  EXPECT_EQ(cancelled->status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(expired->status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(later->status.ok()) << later->status;
  EXPECT_TRUE(OpsOf("cancelled").empty());
  EXPECT_TRUE(OpsOf("expired").empty());
  EXPECT_FALSE(OpsOf("later").empty());
  te::v1::SessionInfo info;
  ASSERT_TRUE(Run(a, "info", [&](Session& s) {
                s.GetSessionInfo(&info);
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(info.saved_forwards(), 0);  // the dropped calls kept nothing
  EXPECT_EQ(info.resident_tensors(), 0);
}

TEST_F(SessionLayerTest, CallsQueuedBehindACloseAreNotFoundAndTheMemoryGoes) {
  const te::v1::SessionRef a = Open();
  const std::string layer = InitDense(a);
  EXPECT_GT(backend().live_bytes(), 0);
  backend().BlockOp("Gemm", "running");
  std::string forward_id;
  std::shared_ptr<Pending> running = Submit(a, "running", [&](Session& s) {
    return Forward(s, layer, 0.0f, /*keep=*/true, &forward_id);
  });
  ASSERT_TRUE(backend().WaitBlocked(1));
  SessionManager* manager = manager_.get();
  // The close queues behind the running call like any call of the session.
  auto close = std::make_shared<Pending>();
  DeviceExecutor::Call call;
  call.key = a.session_id();
  call.run = [manager, a, close](DeviceExecutor::Turn turn) {
    close->status = manager->Close(a.session_id(), a.token());
    turn.Release();
    close->done.Notify();
  };
  call.drop = [close](absl::Status reason) {
    close->status = reason;
    close->done.Notify();
  };
  ASSERT_TRUE(executor_->Submit(std::move(call)).ok());
  std::shared_ptr<Pending> behind = Submit(a, "behind", [&](Session& s) {
    return Forward(s, layer, 1.0f);
  });
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(close->done.HasBeenNotified());  // it waits for the running call
  EXPECT_EQ(manager_->live_sessions(), 1);
  backend().Unblock();
  for (const auto& p : {running, close, behind}) p->done.WaitForNotification();
  EXPECT_TRUE(running->status.ok()) << running->status;
  EXPECT_FALSE(forward_id.empty());
  EXPECT_TRUE(close->status.ok()) << close->status;
  EXPECT_EQ(behind->status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(behind->status.message(), "session " + a.session_id() + " was closed");
  EXPECT_TRUE(OpsOf("behind").empty());
  // Variables, the saved forward and its resident output went with the session.
  EXPECT_EQ(manager_->live_sessions(), 0);
  EXPECT_EQ(backend().live_bytes(), 0);
}

// ---- failures ----------------------------------------------------------------------

// Runs `step` once on a session (after `setup`) to learn the ops it issues,
// then, for each of those ops, on a fresh session with the same history with
// that op failing (an allocation with RESOURCE_EXHAUSTED, any other op with
// INTERNAL): every try fails with the injected code, and the session, its
// memory and the device's stay as they were. A clean run then changes the
// session, so the comparison could fail.
class FailureAtEveryOpTest : public SessionLayerTest {
 protected:
  using Step = std::function<absl::Status(Session& s, const std::string& layer)>;
  using Setup = std::function<void(const te::v1::SessionRef& ref, const std::string& layer)>;

  void ExpectEveryFailureLeavesTheSessionAsItWas(const Setup& setup, const Step& step) {
    std::vector<std::string> ops;
    {
      const te::v1::SessionRef probe = Open();
      const std::string layer = InitDense(probe);
      setup(probe, layer);
      ASSERT_TRUE(Run(probe, "probe", [&](Session& s) { return step(s, layer); }).ok());
      ops = OpsOf("probe");
      ASSERT_TRUE(manager_->Close(probe.session_id(), probe.token()).ok());
    }
    ASSERT_GT(ops.size(), 3u);
    std::map<std::string, int> seen;
    for (size_t k = 0; k < ops.size(); ++k) {
      const std::string& op = ops[k];
      const te::v1::SessionRef ref = Open();
      const std::string layer = InitDense(ref);
      setup(ref, layer);
      const Snapshot before = Take(ref, layer);
      const absl::StatusCode code = op == "Allocate" ? absl::StatusCode::kResourceExhausted
                                                     : absl::StatusCode::kInternal;
      backend().FailOp(op, absl::Status(code, absl::StrCat("injected into ", op)), seen[op]++);
      const absl::Status status =
          Run(ref, absl::StrCat("try ", k), [&](Session& s) { return step(s, layer); });
      EXPECT_EQ(status.code(), code) << "op " << k << " (" << op << "): " << status;
      EXPECT_FALSE(backend().failure_pending(op)) << "op " << k << " (" << op << ") never ran";
      backend().ClearFailures();  // should it not have fired
      EXPECT_EQ(Take(ref, layer), before) << "after a failure at op " << k << " (" << op << ")";
      if (k + 1 == ops.size()) {
        ASSERT_TRUE(Run(ref, "clean", [&](Session& s) { return step(s, layer); }).ok());
        EXPECT_FALSE(Take(ref, layer) == before) << "a clean run changed nothing";
      }
      ASSERT_TRUE(manager_->Close(ref.session_id(), ref.token()).ok());
    }
    EXPECT_EQ(backend().live_bytes(), 0);
  }
};

TEST_F(FailureAtEveryOpTest, ForwardKeepingItsActivationsAndOutputs) {
  ExpectEveryFailureLeavesTheSessionAsItWas(
      [](const te::v1::SessionRef&, const std::string&) {},
      [](Session& s, const std::string& layer) { return Forward(s, layer, 0.5f, /*keep=*/true); });
}

TEST_F(FailureAtEveryOpTest, BackwardKeepingItsGradients) {
  std::map<std::string, std::string> forward_of;  // session id -> its saved forward
  ExpectEveryFailureLeavesTheSessionAsItWas(
      [&](const te::v1::SessionRef& ref, const std::string& layer) {
        std::string id;
        ASSERT_TRUE(Run(ref, "setup", [&](Session& s) {
                      return Forward(s, layer, 0.5f, /*keep=*/true, &id);
                    }).ok());
        forward_of[ref.session_id()] = id;
      },
      [&](Session& s, const std::string&) {
        te::v1::BackwardRequest request;
        request.set_forward_id(forward_of.at(s.id()));
        *request.mutable_dy() = Floats({2, 4, kFeatures}, -1.0f);
        request.set_keep_grads(true);
        te::v1::BackwardResponse response;
        return s.Backward(request, &response);
      });
}

TEST_F(FailureAtEveryOpTest, ForwardBackwardOverMicroBatches) {
  ExpectEveryFailureLeavesTheSessionAsItWas(
      [](const te::v1::SessionRef&, const std::string&) {},
      [](Session& s, const std::string& layer) {
        te::v1::ForwardBackwardRequest request;
        request.set_layer_id(layer);
        *request.mutable_autocast() = DelayedScaling();
        for (int i = 0; i < 2; ++i) {
          te::v1::MicroBatch* batch = request.add_micro_batches();
          *batch->mutable_x() = Floats(kInputShape, static_cast<float>(i));
          *batch->mutable_dy() = Floats({2, 4, kFeatures}, -1.0f);
        }
        te::v1::ForwardBackwardResponse response;
        return s.ForwardBackward(request, &response);
      });
}

// A client that goes away part way, at any op, as the service sees it: the
// call stops at its next check, or, if it got past its last one, is undone
// (EndCall with undo) because nobody took its answer. Either way it moves nothing.
TEST_F(SessionLayerTest, ACallCancelledAtAnyOpMovesNothing) {
  const te::v1::SessionRef ref = Open();
  const std::string layer = InitDense(ref);
  ASSERT_TRUE(Run(ref, "probe", [&](Session& s) { return Forward(s, layer, 0.5f, true); }).ok());
  const size_t ops = OpsOf("probe").size();
  const Snapshot before = Take(ref, layer);
  int stopped = 0;
  for (size_t k = 0; k < ops; ++k) {
    const std::string tag = absl::StrCat("try ", k);
    CallContext call;
    call.cancelled = [this, tag, k] { return OpsOf(tag).size() >= k; };
    bool cancelled = false;
    const absl::Status status = Run(ref, tag, [&](Session& s) {
      s.BeginCall();
      absl::Status result = Forward(s, layer, 0.5f, true, nullptr, call);
      cancelled = call.cancelled();
      s.EndCall(/*undo=*/!result.ok() || cancelled);
      return result;
    });
    // A later call may issue fewer ops than the first (what it can reuse):
    // past its last op nothing cancels it, and it keeps what it made.
    if (!cancelled) break;
    if (!status.ok()) {
      EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << "at op " << k << ": " << status;
      ++stopped;
    }
    EXPECT_EQ(Take(ref, layer), before) << "cancelled at op " << k;
  }
  EXPECT_GT(stopped, 0);  // the call did look, before it committed
}

// ---- memory ------------------------------------------------------------------------

TEST_F(SessionLayerTest, MemoryReturnsToWhereItWasAndToZeroWithTheSession) {
  const te::v1::SessionRef ref = Open();
  const std::string layer = InitDense(ref);
  const Snapshot initialised = Take(ref, layer);
  EXPECT_GT(initialised.bytes_in_use, 0);
  EXPECT_EQ(initialised.bytes_in_use, initialised.device_bytes);

  std::string forward_id;
  std::string resident_y;
  ASSERT_TRUE(Run(ref, "forward", [&](Session& s) -> absl::Status {
                te::v1::ForwardRequest request;
                request.set_layer_id(layer);
                *request.mutable_x() = Floats(kInputShape, 0.0f);
                request.set_keep_for_backward(true);
                request.set_keep_outputs(true);
                te::v1::ForwardResponse response;
                absl::Status status = s.Forward(request, &response);
                forward_id = response.forward_id();
                resident_y = response.y().resident_id();
                return status;
              }).ok());
  ASSERT_FALSE(resident_y.empty());
  EXPECT_GT(Take(ref, layer).bytes_in_use, initialised.bytes_in_use);
  ASSERT_TRUE(Run(ref, "backward", [&](Session& s) {
                te::v1::BackwardRequest request;
                request.set_forward_id(forward_id);
                *request.mutable_dy() = Floats({2, 4, kFeatures}, 1.0f);
                te::v1::BackwardResponse response;
                return s.Backward(request, &response);
              }).ok());
  ASSERT_TRUE(Run(ref, "delete", [&](Session& s) {
                te::v1::DeleteTensorRequest request;
                request.set_tensor_id(resident_y);
                return s.DeleteTensor(request);
              }).ok());
  // The saved forward went with its backward, the output with its delete.
  const Snapshot after = Take(ref, layer);
  EXPECT_EQ(after.bytes_in_use, initialised.bytes_in_use);
  EXPECT_EQ(after.device_bytes, initialised.device_bytes);

  // An allocation refused part way frees what the call had allocated.
  backend().FailOp("Allocate", absl::ResourceExhaustedError("injected"), 2);
  EXPECT_EQ(Run(ref, "refused", [&](Session& s) { return Forward(s, layer, 0.0f, true); }).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(backend().failure_pending("Allocate"));
  EXPECT_EQ(Take(ref, layer).device_bytes, initialised.device_bytes);

  ASSERT_TRUE(manager_->Close(ref.session_id(), ref.token()).ok());
  EXPECT_EQ(backend().live_bytes(), 0);
}

}  // namespace
}  // namespace te::session
