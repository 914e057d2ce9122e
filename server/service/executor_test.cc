#include "server/service/executor.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace te::service {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);  // generous: a loaded CI machine

using Turn = DeviceExecutor::Turn;

// Submits a call that records its run, or its drop status.
struct Recorder {
  absl::Mutex mu;
  std::vector<std::string> ran;
  std::vector<absl::Status> dropped;

  DeviceExecutor::Call Make(const std::string& key, const std::string& name,
                            std::function<void()> body = nullptr,
                            absl::Time deadline = absl::InfiniteFuture()) {
    DeviceExecutor::Call call;
    call.key = key;
    call.deadline = deadline;
    call.run = [this, name, body](Turn) {
      if (body) body();
      absl::MutexLock lock(&mu);
      ran.push_back(name);
    };
    call.drop = [this](absl::Status status) {
      absl::MutexLock lock(&mu);
      dropped.push_back(std::move(status));
    };
    return call;
  }
  bool WaitForRuns(size_t n) {
    std::pair<Recorder*, size_t> args(this, n);
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<Recorder*, size_t>* a) { return a->first->ran.size() >= a->second; },
            &args),
        kWait);
  }
};

// Blocks a worker until released.
struct Gate {
  absl::Notification entered;
  absl::Notification open;
  std::function<void()> Body() {
    return [this] {
      entered.Notify();
      open.WaitForNotificationWithTimeout(kWait);
    };
  }
};

TEST(DeviceExecutorTest, CallsOfOneKeyRunInOrderOneAtATime) {
  DeviceExecutor executor({/*threads=*/4, /*max_queued=*/100, "test"});
  Recorder recorder;
  std::atomic<int> inside{0};
  std::atomic<int> overlap{0};
  for (int i = 0; i < 50; ++i) {
    auto body = [&] {
      if (inside.fetch_add(1) != 0) overlap.fetch_add(1);
      absl::SleepFor(absl::Microseconds(200));
      inside.fetch_sub(1);
    };
    ASSERT_TRUE(executor.Submit(recorder.Make("session", std::to_string(i), body)).ok());
  }
  ASSERT_TRUE(recorder.WaitForRuns(50));
  EXPECT_EQ(overlap.load(), 0);
  absl::MutexLock lock(&recorder.mu);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(recorder.ran[i], std::to_string(i));
}

TEST(DeviceExecutorTest, DifferentKeysRunConcurrently) {
  DeviceExecutor executor({/*threads=*/2, /*max_queued=*/10, "test"});
  Recorder recorder;
  // Each call waits for the other to have started: only concurrency finishes both.
  absl::Notification a_started, b_started;
  std::atomic<bool> a_saw_b{false}, b_saw_a{false};
  ASSERT_TRUE(executor
                  .Submit(recorder.Make("a", "a",
                                        [&] {
                                          a_started.Notify();
                                          a_saw_b = b_started.WaitForNotificationWithTimeout(kWait);
                                        }))
                  .ok());
  ASSERT_TRUE(executor
                  .Submit(recorder.Make("b", "b",
                                        [&] {
                                          b_started.Notify();
                                          b_saw_a = a_started.WaitForNotificationWithTimeout(kWait);
                                        }))
                  .ok());
  ASSERT_TRUE(recorder.WaitForRuns(2));
  EXPECT_TRUE(a_saw_b);
  EXPECT_TRUE(b_saw_a);
}

TEST(DeviceExecutorTest, FullQueueIsResourceExhaustedAtOnce) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/1, "cpu"});
  Recorder recorder;
  Gate gate;
  ASSERT_TRUE(executor.Submit(recorder.Make("a", "blocker", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(executor.Submit(recorder.Make("b", "queued")).ok());
  EXPECT_EQ(executor.queued(), 1);
  const absl::Time before = absl::Now();
  absl::StatusOr<DeviceExecutor::Handle> rejected = executor.Submit(recorder.Make("c", "rejected"));
  EXPECT_LT(absl::Now() - before, absl::Seconds(1));
  ASSERT_EQ(rejected.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(rejected.status().message().find("--executor_queue=1"), std::string::npos)
      << rejected.status();
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(2));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"blocker", "queued"}));
}

TEST(DeviceExecutorTest, CallsForAnIdleWorkerAreNotRefused) {
  // Back to back, before the worker wakes: the first is about to start, so
  // it does not hold the one place in the queue.
  for (int round = 0; round < 50; ++round) {
    DeviceExecutor executor({/*threads=*/1, /*max_queued=*/1, "test"});
    Recorder recorder;
    ASSERT_TRUE(executor.Submit(recorder.Make("a", "first")).ok());
    ASSERT_TRUE(executor.Submit(recorder.Make("b", "second")).ok()) << "round " << round;
    ASSERT_TRUE(recorder.WaitForRuns(2));
  }
}

TEST(DeviceExecutorTest, CancelDropsAWaitingCallAndFreesItsPlace) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/1, "test"});
  Recorder recorder;
  Gate gate;
  ASSERT_TRUE(executor.Submit(recorder.Make("a", "blocker", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  absl::StatusOr<DeviceExecutor::Handle> waiting = executor.Submit(recorder.Make("b", "cancelled"));
  ASSERT_TRUE(waiting.ok());
  EXPECT_TRUE(executor.Cancel(*waiting, absl::CancelledError("client went away")));
  EXPECT_FALSE(executor.Cancel(*waiting, absl::CancelledError("twice")));
  EXPECT_EQ(executor.queued(), 0);
  ASSERT_TRUE(executor.Submit(recorder.Make("b", "next")).ok());
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(2));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"blocker", "next"}));
  ASSERT_EQ(recorder.dropped.size(), 1u);
  EXPECT_EQ(recorder.dropped[0].code(), absl::StatusCode::kCancelled);
}

TEST(DeviceExecutorTest, CancelAfterStartDoesNothing) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/4, "test"});
  Recorder recorder;
  Gate gate;
  absl::StatusOr<DeviceExecutor::Handle> running =
      executor.Submit(recorder.Make("a", "running", gate.Body()));
  ASSERT_TRUE(running.ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  EXPECT_FALSE(executor.Cancel(*running, absl::CancelledError("late")));
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(1));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_TRUE(recorder.dropped.empty());
}

TEST(DeviceExecutorTest, ExpiredDeadlineDropsTheCallWhenItsTurnComes) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/4, "test"});
  Recorder recorder;
  Gate gate;
  ASSERT_TRUE(executor.Submit(recorder.Make("a", "blocker", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(
      executor.Submit(recorder.Make("b", "late", nullptr, absl::Now() + absl::Milliseconds(20)))
          .ok());
  ASSERT_TRUE(executor.Submit(recorder.Make("b", "on time")).ok());
  absl::SleepFor(absl::Milliseconds(50));
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(2));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"blocker", "on time"}));
  ASSERT_EQ(recorder.dropped.size(), 1u);
  EXPECT_EQ(recorder.dropped[0].code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(DeviceExecutorTest, HeldTurnRunsContinuationsBeforeTheKeysNextCall) {
  DeviceExecutor executor({/*threads=*/3, /*max_queued=*/4, "test"});
  absl::Mutex mu;
  std::vector<std::string> order;
  auto note = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    order.push_back(what);
  };
  // A stream: it keeps its turn, and the pieces arrive later from elsewhere.
  std::unique_ptr<Turn> stream_turn;
  absl::Notification started;
  DeviceExecutor::Call stream;
  stream.key = "s";
  stream.run = [&](Turn turn) {
    note("stream start");
    stream_turn = std::make_unique<Turn>(std::move(turn));
    started.Notify();
  };
  stream.drop = [](absl::Status) {};
  ASSERT_TRUE(executor.Submit(std::move(stream)).ok());
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(kWait));
  absl::Notification next_ran;
  DeviceExecutor::Call next;
  next.key = "s";
  next.run = [&](Turn) {
    note("next call");
    next_ran.Notify();
  };
  next.drop = [](absl::Status) {};
  ASSERT_TRUE(executor.Submit(std::move(next)).ok());
  for (int i = 0; i < 3; ++i) {
    stream_turn->Post([&, i] { note("piece " + std::to_string(i)); });
  }
  // The next call must not start while the stream holds the key.
  EXPECT_FALSE(next_ran.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  absl::Notification last_piece;
  stream_turn->Post([&] {
    note("stream end");
    stream_turn->Release();
    last_piece.Notify();
  });
  ASSERT_TRUE(next_ran.WaitForNotificationWithTimeout(kWait));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<std::string>{"stream start", "piece 0", "piece 1", "piece 2",
                                             "stream end", "next call"}));
}

// Contract 4: the key is free once the turn is released, even while the
// call's run goes on (a training step reading its loss after its turn): the
// key's next call starts on another worker meanwhile.
TEST(DeviceExecutorTest, AReleasedTurnLetsTheKeysNextCallStartWhileTheRunGoesOn) {
  // Declared before the executor, whose destructor waits for the runs that use them.
  absl::Notification first_released, next_ran, first_may_end, first_ended;
  std::atomic<bool> next_ran_before_first_ended{false};
  DeviceExecutor executor({/*threads=*/2, /*max_queued=*/4, "test"});
  DeviceExecutor::Call first;
  first.key = "s";
  first.run = [&](Turn turn) {
    turn.Release();
    first_released.Notify();
    next_ran_before_first_ended = next_ran.WaitForNotificationWithTimeout(kWait);
    first_may_end.WaitForNotificationWithTimeout(kWait);
    first_ended.Notify();
  };
  first.drop = [](absl::Status) {};
  DeviceExecutor::Call next;
  next.key = "s";
  next.run = [&](Turn) { next_ran.Notify(); };
  next.drop = [](absl::Status) {};
  ASSERT_TRUE(executor.Submit(std::move(first)).ok());
  ASSERT_TRUE(executor.Submit(std::move(next)).ok());
  ASSERT_TRUE(first_released.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(next_ran.WaitForNotificationWithTimeout(kWait));
  first_may_end.Notify();
  ASSERT_TRUE(first_ended.WaitForNotificationWithTimeout(kWait));
  EXPECT_TRUE(next_ran_before_first_ended.load());
}

// Until the release, the key's next call waits, even with workers idle.
TEST(DeviceExecutorTest, AHeldTurnKeepsTheKeysNextCallWaitingWithIdleWorkers) {
  Recorder recorder;
  Gate gate;
  DeviceExecutor executor({/*threads=*/3, /*max_queued=*/4, "test"});
  ASSERT_TRUE(executor.Submit(recorder.Make("s", "first", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  ASSERT_TRUE(executor.Submit(recorder.Make("s", "next")).ok());
  absl::SleepFor(absl::Milliseconds(100));
  {
    absl::MutexLock lock(&recorder.mu);
    EXPECT_TRUE(recorder.ran.empty()) << "the next call ran while the first held the key";
  }
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(2));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"first", "next"}));
}

TEST(DeviceExecutorTest, DestructorDropsWaitingCalls) {
  Recorder recorder;
  Gate gate;
  {
    DeviceExecutor executor({/*threads=*/1, /*max_queued=*/4, "test"});
    ASSERT_TRUE(executor.Submit(recorder.Make("a", "blocker", gate.Body())).ok());
    ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
    ASSERT_TRUE(executor.Submit(recorder.Make("b", "never")).ok());
    gate.open.Notify();  // the running call finishes; the waiting one may or may not start
  }
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran.size() + recorder.dropped.size(), 2u);
  for (const absl::Status& status : recorder.dropped) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  }
}

TEST(DeviceExecutorTest, BusyKeysTakeTurns) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/100, "test"});
  Recorder recorder;
  Gate gate;
  ASSERT_TRUE(executor.Submit(recorder.Make("x", "blocker", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(executor.Submit(recorder.Make("a", "a")).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(executor.Submit(recorder.Make("b", "b")).ok());
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(7));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"blocker", "a", "b", "a", "b", "a", "b"}));
}

// ---- numbered calls (contract 6) ----------------------------------------------

DeviceExecutor::Call Numbered(Recorder& recorder, const std::string& key, uint64_t number,
                              std::function<void()> body = nullptr) {
  DeviceExecutor::Call call = recorder.Make(key, std::to_string(number), std::move(body));
  call.sequence = number;
  return call;
}

TEST(DeviceExecutorTest, NumberedCallsRunInNumberOrderWhateverTheirArrival) {
  DeviceExecutor executor({/*threads=*/4, /*max_queued=*/100, "test"});
  executor.StartSequence("s", 1);
  Recorder recorder;
  // Arrival order 3, 1, 5, 2, 4, then 8, 7, 6.
  for (uint64_t n : {3, 1, 5, 2, 4, 8, 7, 6}) {
    ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", n)).ok()) << n;
  }
  ASSERT_TRUE(recorder.WaitForRuns(8));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"1", "2", "3", "4", "5", "6", "7", "8"}));
  EXPECT_TRUE(recorder.dropped.empty());
}

TEST(DeviceExecutorTest, ATakenNumberIsInvalidArgument) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/100, "test"});
  executor.StartSequence("s", 1);
  Recorder recorder;
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 1)).ok());
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 3)).ok());  // early
  ASSERT_TRUE(recorder.WaitForRuns(1));
  for (uint64_t n : {1, 3}) {
    absl::StatusOr<DeviceExecutor::Handle> again = executor.Submit(Numbered(recorder, "s", n));
    ASSERT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_NE(again.status().message().find("session.sequence"), std::string::npos);
  }
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 2)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(3));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"1", "2", "3"}));
}

TEST(DeviceExecutorTest, AGapIsAbortedAfterSequenceGapAndLaterNumbersRun) {
  ExecutorOptions options{/*threads=*/2, /*max_queued=*/100, "test"};
  options.sequence_gap = absl::Milliseconds(200);
  DeviceExecutor executor(options);
  executor.StartSequence("s", 1);
  Recorder recorder;
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 1)).ok());
  // 2 never comes: 3 and 4 wait for it, then are aborted.
  const absl::Time start = absl::Now();
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 3)).ok());
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 4)).ok());
  {
    absl::MutexLock lock(&recorder.mu);
    ASSERT_TRUE(recorder.mu.AwaitWithTimeout(
        absl::Condition(+[](Recorder* r) { return r->dropped.size() >= 2; }, &recorder), kWait));
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
    for (const absl::Status& status : recorder.dropped) {
      EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
      EXPECT_NE(status.message().find("call 2 of this session did not arrive"), std::string::npos)
          << status;
    }
    EXPECT_EQ(recorder.ran, (std::vector<std::string>{"1"}));
  }
  EXPECT_EQ(executor.queued(), 0);
  // The skipped and aborted numbers are taken; the next one runs at once.
  EXPECT_EQ(executor.Submit(Numbered(recorder, "s", 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 5)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(2));
}

TEST(DeviceExecutorTest, ACancelledOrRefusedCallStillUsesItsNumber) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/2, "test"});
  executor.StartSequence("s", 1);
  Recorder recorder;
  Gate gate;
  ASSERT_TRUE(executor.Submit(recorder.Make("other", "blocker", gate.Body())).ok());
  ASSERT_TRUE(gate.entered.WaitForNotificationWithTimeout(kWait));
  // 2 arrives early and is cancelled; 1 then fills the queue's 2 places with 3.
  absl::StatusOr<DeviceExecutor::Handle> two = executor.Submit(Numbered(recorder, "s", 2));
  ASSERT_TRUE(two.ok());
  EXPECT_TRUE(executor.Cancel(*two, absl::CancelledError("client went away")));
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 1)).ok());
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 3)).ok());
  // The queue is full: 4 is refused, but its number is used, so 5 does not wait for it.
  EXPECT_EQ(executor.Submit(Numbered(recorder, "s", 4)).status().code(),
            absl::StatusCode::kResourceExhausted);
  gate.open.Notify();
  ASSERT_TRUE(recorder.WaitForRuns(3));  // blocker, 1, 3
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 5)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(4));
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"blocker", "1", "3", "5"}));
}

TEST(DeviceExecutorTest, AKeyNeverStartedNumbersFromItsFirstCall) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/100, "test"});
  Recorder recorder;  // a session restored from a checkpoint: its count goes on
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "restored", 41)).ok());
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "restored", 43)).ok());
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "restored", 42)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(3));
  executor.ForgetKey("restored");
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"41", "42", "43"}));
}

// A restored session's client had 41 and 42 in flight when it sent 43,
// which arrives first: the order goes on from 41, so 41 and 42 still run,
// first. Without first_unanswered, 43 would set the count and 41 and 42 be
// refused as taken.
TEST(DeviceExecutorTest, AKeyNeverStartedNumbersFromItsFirstCallsFirstUnanswered) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/100, "test"});
  Recorder recorder;
  DeviceExecutor::Call third = Numbered(recorder, "restored", 43);
  third.first_unanswered = 41;
  ASSERT_TRUE(executor.Submit(std::move(third)).ok());
  DeviceExecutor::Call second = Numbered(recorder, "restored", 42);
  second.first_unanswered = 41;
  ASSERT_TRUE(executor.Submit(std::move(second)).ok());
  DeviceExecutor::Call first = Numbered(recorder, "restored", 41);
  first.first_unanswered = 41;
  ASSERT_TRUE(executor.Submit(std::move(first)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(3));
  {
    absl::MutexLock lock(&recorder.mu);
    EXPECT_EQ(recorder.ran, (std::vector<std::string>{"41", "42", "43"}));
    EXPECT_TRUE(recorder.dropped.empty());
  }
  // Above the call's own number: the client's mistake, named.
  DeviceExecutor::Call wrong = Numbered(recorder, "restored", 44);
  wrong.first_unanswered = 45;
  const absl::StatusOr<DeviceExecutor::Handle> refused = executor.Submit(std::move(wrong));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("session.first_unanswered"), std::string::npos);
  executor.ForgetKey("restored");
}

TEST(DeviceExecutorTest, AbandonedNumbersAreNotWaitedForAndRefusedLater) {
  DeviceExecutor executor({/*threads=*/1, /*max_queued=*/100, "test"});
  executor.StartSequence("s", 1);
  Recorder recorder;
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 1)).ok());
  // 2 and 3 ended at the client without an answer; 3 did arrive (early).
  ASSERT_TRUE(executor.Submit(Numbered(recorder, "s", 3)).ok());
  DeviceExecutor::Call four = Numbered(recorder, "s", 4);
  four.abandoned = {2, 3};
  ASSERT_TRUE(executor.Submit(std::move(four)).ok());
  ASSERT_TRUE(recorder.WaitForRuns(3));  // no wait for the gap (its timeout is 10 s)
  EXPECT_EQ(executor.Submit(Numbered(recorder, "s", 2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  DeviceExecutor::Call bad = Numbered(recorder, "s", 5);
  bad.abandoned = {5};
  EXPECT_EQ(executor.Submit(std::move(bad)).status().code(), absl::StatusCode::kInvalidArgument);
  absl::MutexLock lock(&recorder.mu);
  EXPECT_EQ(recorder.ran, (std::vector<std::string>{"1", "3", "4"}));
}

}  // namespace
}  // namespace te::service
