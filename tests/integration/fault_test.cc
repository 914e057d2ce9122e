// Fault test: clients that inject faults into a real te_server
// (fault_harness.h), one kind at a time with bystanders watching, then all
// 32 together for FAULT_SECONDS (default 20). Each run prints its figures;
// every run must leave the server serving and, once its sessions close, back
// at its baseline (no sessions, no bytes held).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/integration/fault_harness.h"

namespace te::testing {
namespace {

// The whole run: 32 clients, as many abandoners as the server has executor
// workers, so abandoned work that keeps running holds every worker.
constexpr int kAbandoners = kExecutorThreads;
constexpr int kBystanders = 4;
constexpr int kHostileClients = 2;
constexpr int kFaultClients = 32 - kAbandoners - kBystanders - kHostileClients;

// One kind of fault with bystanders: a quarter of the whole run's time.
int KindSeconds() { return std::max(2, FaultSeconds() / 4); }

// The server outlived the run, still serves, answered no call with a server
// fault, failed no call that carried no fault, and is back to its baseline once the sessions closed.
void ExpectServerReturnedToBaseline(const FaultRunResult& r) {
  EXPECT_TRUE(r.setup_failures.empty())
      << "could not set up: " << absl::StrJoin(r.setup_failures, "; ");
  ASSERT_TRUE(r.alive) << "the server died during the run; during: "
                       << absl::StrJoin(r.figures.server_died_during, "; ");
  EXPECT_TRUE(r.still_serves);
  for (grpc::StatusCode code : {grpc::StatusCode::UNKNOWN, grpc::StatusCode::INTERNAL,
                                grpc::StatusCode::DATA_LOSS, grpc::StatusCode::UNAVAILABLE}) {
    EXPECT_EQ(r.figures.codes.count(code), 0u) << "server fault: " << CodeName(code);
  }
  EXPECT_TRUE(r.figures.unexpected.empty());
  EXPECT_EQ(r.figures.ordinary_failures, 0) << "calls without a fault failed";
  EXPECT_EQ(r.after.sessions_open(), r.before.sessions_open());
  EXPECT_EQ(r.after.bytes_in_use(), r.before.bytes_in_use());
  EXPECT_TRUE(r.stopped.ok()) << "the server must still stop cleanly: " << r.stopped;
}

// Cancels, deadlines, cut streams, dropped connections, closes in flight:
// injected, and no session's parameters changed under them.
void ExpectFaultsLeftSessionsIntact(const FaultRunResult& r) {
  EXPECT_GT(r.injected, 0);
  EXPECT_GT(r.figures.integrity_checks, 0);
  EXPECT_EQ(r.figures.corrupted, 0) << "a session's parameters changed under faults";
}

// Abandoned work lets go of its session (and its worker) soon, so no
// bystander waits behind it.
void ExpectAbandonedWorkReleased(const FaultRunResult& r) {
  EXPECT_FALSE(r.figures.release_ms.empty());
  EXPECT_LE(Quantile(r.figures.release_ms, 1.0), absl::ToDoubleMilliseconds(kBystanderDeadline))
      << "the server kept running abandoned work";
}

void ExpectBystandersServed(const FaultRunResult& r) {
  EXPECT_GT(r.figures.bystander_calls, 0);
  EXPECT_EQ(r.figures.bystander_misses, 0) << "bystander calls failed or missed their deadline";
  const auto creates = r.figures.bystander_ms.find("CreateSession");
  EXPECT_TRUE(creates != r.figures.bystander_ms.end() && !creates->second.empty());
}

// Hostile sizes refused by name every time, and the failed-only sessions as
// they were, bit for bit.
void ExpectHostileCallsChangedNothing(const FaultRunResult& r, int hostile_clients) {
  EXPECT_GT(r.injected, 0);
  const auto sizes = r.figures.faults.find("hostile_size");
  EXPECT_TRUE(sizes != r.figures.faults.end() && sizes->second > 0);
  EXPECT_EQ(r.figures.unclean, 0)
      << "hostile sizes not refused with RESOURCE_EXHAUSTED / INVALID_ARGUMENT";
  EXPECT_EQ(r.figures.failed_only_succeeded, 0)
      << "calls meant to fail succeeded: the failed-only sessions may rightly have changed";
  ASSERT_EQ(r.failed_only.size(), static_cast<size_t>(hostile_clients));
  for (const FailedOnlyReport& report : r.failed_only) {
    ASSERT_TRUE(report.read) << report.read_error;
    EXPECT_GT(report.by_collection.count("fp8_metas"), 0u) << "no fp8_metas to compare";
    EXPECT_TRUE(report.changed.empty())
        << "failed calls changed the session: " << report.Summary() << " ("
        << absl::StrJoin(report.changed, ", ") << ")";
    EXPECT_EQ(report.after.memory_bytes(), report.before.memory_bytes());
    EXPECT_EQ(report.after.layers(), report.before.layers());
    EXPECT_EQ(report.after.saved_forwards(), report.before.saved_forwards());
    EXPECT_EQ(report.after.resident_tensors(), report.before.resident_tensors());
  }
}

TEST(FaultTest, InjectedFaultsLeaveSessionsIntact) {
  FaultRunOptions options;
  options.fault_clients = kFaultClients;
  options.bystanders = 2;
  options.seconds = KindSeconds();
  const FaultRunResult r = RunFaults(options);
  ExpectServerReturnedToBaseline(r);
  ExpectFaultsLeftSessionsIntact(r);
  ExpectBystandersServed(r);
}

TEST(FaultTest, AbandonedWorkLetsGoOfEveryWorker) {
  FaultRunOptions options;
  options.abandoners = kAbandoners;
  options.bystanders = kBystanders;
  options.seconds = KindSeconds();
  const FaultRunResult r = RunFaults(options);
  ExpectServerReturnedToBaseline(r);
  EXPECT_GT(r.injected, 0);
  ExpectAbandonedWorkReleased(r);
  ExpectBystandersServed(r);
}

TEST(FaultTest, HostileSizesAndDeadlinesChangeNothing) {
  FaultRunOptions options;
  options.hostile_clients = kHostileClients;
  options.bystanders = 2;
  options.seconds = KindSeconds();
  const FaultRunResult r = RunFaults(options);
  ExpectServerReturnedToBaseline(r);
  ExpectHostileCallsChangedNothing(r, kHostileClients);
  ExpectBystandersServed(r);
}

TEST(FaultTest, ServerSurvivesEveryFaultAtOnceAndReturnsToBaseline) {
  FaultRunOptions options;
  options.fault_clients = kFaultClients;
  options.abandoners = kAbandoners;
  options.bystanders = kBystanders;
  options.hostile_clients = kHostileClients;
  options.seconds = FaultSeconds();
  const FaultRunResult r = RunFaults(options);
  ExpectServerReturnedToBaseline(r);
  ExpectFaultsLeftSessionsIntact(r);
  ExpectHostileCallsChangedNothing(r, kHostileClients);
  ExpectAbandonedWorkReleased(r);
  ExpectBystandersServed(r);
}

}  // namespace
}  // namespace te::testing
