// The fault run's harness: clients that inject faults into a real
// te_server, run together for a while, and what they saw. Four kinds of
// client share the server:
//  - fault clients: among ordinary calls, cancel calls, let deadlines pass (in
//    flight, while queued behind their own session's call, and 1 ms deadlines
//    on Forward, ForwardBackward and InitLayer), cut PutTensor and GetTensor
//    streams, drop connections in the middle of a PutTensor (a child process
//    that dies), and close sessions with calls in flight; each checks its
//    session's parameters bit for bit after every fault;
//  - abandoners: start ForwardBackward calls that would take seconds on the
//    device and give up on them (cancel, or a short deadline); a run with as
//    many of them as the server has executor workers (kExecutorThreads) shows
//    whether a server that keeps running abandoned work has a worker left;
//  - hostile clients: valid, authenticated sessions asking for sizes no
//    server can honour (a TransformerLayer of hidden 2^20, a DenseGeneral of
//    2^31 and 2^40 features, PutTensor headers whose shape overflows int64 or
//    announces 2^40 bytes, a ForwardBackward of 10,000 micro-batches), and
//    steps with 1 ms deadlines or deadlines that pass mid-run. Every call on
//    these sessions must fail, so each session must end as it began
//    (FailedOnlyReport);
//  - bystanders: sessions that, throughout, call GetSessionInfo, a small
//    ForwardBackward and CreateSession with a kBystanderDeadline deadline.
// RunFaults starts the server, runs the clients, then checks what the run
// left: the server still serves, every surviving session's parameters are
// intact, a closed session is explicitly gone (NOT_FOUND), and after the
// sessions are closed the server's memory is back to its baseline. It prints
// the run's figures as a block for the README; the caller asserts on them.
#ifndef TE_TESTS_INTEGRATION_FAULT_HARNESS_H_
#define TE_TESTS_INTEGRATION_FAULT_HARNESS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "te/v1/service.pb.h"

namespace te::testing {

// The server's executor workers (--executor_threads).
inline constexpr int kExecutorThreads = 4;
// What a bystander may wait for any call; abandoned work must let go of its
// session within it too.
inline constexpr absl::Duration kBystanderDeadline = absl::Seconds(2);

// $FAULT_SECONDS, else 20.
int FaultSeconds();

const char* CodeName(grpc::StatusCode code);
// Milliseconds at the given quantile (0..1) of `values`; 0 when empty.
double Quantile(std::vector<double> values, double q);

// Everything the clients saw, merged at the end.
struct Figures {
  int64_t calls = 0;
  int64_t ordinary_failures = 0;          // calls without a fault that failed
  std::map<std::string, int64_t> faults;  // by kind
  std::map<grpc::StatusCode, int64_t> codes;
  // Codes by the kind of call, for the new fault kinds (hostile sizes, 1 ms
  // deadlines, abandoned calls).
  std::map<std::string, std::map<grpc::StatusCode, int64_t>> kind_codes;
  int64_t sessions_opened = 0;
  int64_t sessions_closed = 0;
  int64_t integrity_checks = 0;
  int64_t corrupted = 0;
  std::vector<std::string> unexpected;  // a few examples

  // Hostile sizes answered otherwise than RESOURCE_EXHAUSTED / INVALID_ARGUMENT.
  int64_t unclean = 0;
  std::vector<std::string> unclean_examples;
  // Calls on the failed-only sessions that succeeded: these sessions could
  // then rightly have changed, and their comparison says nothing.
  int64_t failed_only_succeeded = 0;
  std::vector<std::string> server_died_during;  // the hostile call in flight

  // Bystanders: latency by call, and every call that failed or passed its deadline.
  std::map<std::string, std::vector<double>> bystander_ms;
  int64_t bystander_calls = 0;
  int64_t bystander_misses = 0;
  std::vector<std::string> miss_examples;

  // Abandoners: how long the session stayed busy after its client gave up
  // (the session's next call, queued right behind, waits that long).
  std::vector<double> release_ms;
  std::vector<double> heavy_step_ms;
  std::vector<int> abandoned_micro_batches;
  std::vector<int> mid_run_micro_batches;  // of the failed-only sessions' expiring steps

  void Merge(const Figures& other) {
    calls += other.calls;
    ordinary_failures += other.ordinary_failures;
    for (const auto& [k, v] : other.faults) faults[k] += v;
    for (const auto& [k, v] : other.codes) codes[k] += v;
    for (const auto& [kind, by_code] : other.kind_codes) {
      for (const auto& [code, n] : by_code) kind_codes[kind][code] += n;
    }
    sessions_opened += other.sessions_opened;
    sessions_closed += other.sessions_closed;
    integrity_checks += other.integrity_checks;
    corrupted += other.corrupted;
    for (const std::string& u : other.unexpected) {
      if (unexpected.size() < 10) unexpected.push_back(u);
    }
    unclean += other.unclean;
    for (const std::string& u : other.unclean_examples) {
      if (unclean_examples.size() < 10) unclean_examples.push_back(u);
    }
    failed_only_succeeded += other.failed_only_succeeded;
    for (const std::string& d : other.server_died_during) server_died_during.push_back(d);
    for (const auto& [kind, ms] : other.bystander_ms) {
      bystander_ms[kind].insert(bystander_ms[kind].end(), ms.begin(), ms.end());
    }
    bystander_calls += other.bystander_calls;
    bystander_misses += other.bystander_misses;
    for (const std::string& m : other.miss_examples) {
      if (miss_examples.size() < 10) miss_examples.push_back(m);
    }
    release_ms.insert(release_ms.end(), other.release_ms.begin(), other.release_ms.end());
    heavy_step_ms.insert(heavy_step_ms.end(), other.heavy_step_ms.begin(),
                         other.heavy_step_ms.end());
    abandoned_micro_batches.insert(abandoned_micro_batches.end(),
                                   other.abandoned_micro_batches.begin(),
                                   other.abandoned_micro_batches.end());
    mid_run_micro_batches.insert(mid_run_micro_batches.end(), other.mid_run_micro_batches.begin(),
                                 other.mid_run_micro_batches.end());
  }
};

// What the run shares: when it ends, and whether the server is gone (then

// What became of one failed-only session.
struct FailedOnlyReport {
  bool read = false;  // both states could be read
  std::string read_error;
  int64_t variables_before = 0;
  std::map<std::string, int64_t> by_collection;  // variables before, per collection
  std::vector<std::string> changed;              // variables changed, appeared or gone
  // "<label>:<collection>" -> how many changed / appeared / went.
  std::map<std::string, std::map<std::string, int64_t>> change_counts;
  te::v1::SessionInfo before, after;

  // "heavy:fp8_metas 6 changed; heavy:grads 2 appeared; ..." (empty: none).
  std::string Summary() const {
    std::vector<std::string> parts;
    for (const auto& [where, counts] : change_counts) {
      std::vector<std::string> what;
      for (const auto& [how, n] : counts) what.push_back(absl::StrCat(n, " ", how));
      parts.push_back(absl::StrCat(where, " ", absl::StrJoin(what, ", ")));
    }
    return absl::StrJoin(parts, "; ");
  }
};

// Which clients share the server, and for how long.
struct FaultRunOptions {
  int fault_clients = 0;
  int abandoners = 0;
  int bystanders = 0;
  int hostile_clients = 0;
  int seconds = 20;
};

struct FaultRunResult {
  std::vector<std::string> setup_failures;  // the server or a client could not be set up
  bool alive = false;                       // the server outlived the run
  bool still_serves = false;                // a new session could init a layer afterwards
  absl::Status stopped = absl::UnknownError("not stopped");  // SIGTERM at the end: exit 0 in time
  Figures figures;                          // every client's, merged
  int64_t injected = 0;                     // faults of every kind
  std::vector<FailedOnlyReport> failed_only;  // one per hostile client
  // The server's stats before the run, at its end, and after the sessions closed.
  te::v1::ServerStats before, during, after;
};

// Runs `options`' clients against a fresh te_server (executor
// kExecutorThreads, warnings-only log) and prints the figures.
FaultRunResult RunFaults(const FaultRunOptions& options);

}  // namespace te::testing

#endif  // TE_TESTS_INTEGRATION_FAULT_HARNESS_H_
