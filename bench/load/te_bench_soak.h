// te_bench --soak_minutes: a long mixed run against one te_server, for
// leaks and drift rather than peak speed. Thread-safe where stated.
//
// The mix, all on the quickstart's layers (LayerSize):
//  - held sessions, open the whole run: a bf16 TransformerLayer, an FP8
//    (DelayedScaling) TransformerLayer and the quickstart's Flax layer (a
//    graph), each training with AdamW (ForwardBackward with apply_update),
//    releasing the version each step leaves behind;
//  - churners: clients that open a session (bf16 or FP8 in turn), run a few
//    steps and close it, over and over;
//  - a generating client: the decoder LM of train_lm.py (4 x 1024) in a
//    session of its own, one Generate call (64 new tokens for 2 prompts)
//    after another, closed at the end.
// Every interval (a minute) it prints the calls that succeeded and failed,
// step time p50/p99 per kind, and memory: the device's (bytes its sessions
// hold, bytes its allocator holds) from GetSessionInfo, the server's
// resident host memory from /proc (given its pid), each the lowest of the
// interval's samples (one every 2 s), since steps in flight hold activations
// that come and go with the instant sampled. At the end it prints the
// slope of each after the warm-up, and records a digest of every variable of
// the held sessions. With a restore check it then waits for the server to
// be restarted (SIGTERM with --state_dir, and a new server on the same
// address and state directory) and compares the restored sessions' variables
// with the digests, bit for bit.
#ifndef TE_BENCH_LOAD_TE_BENCH_SOAK_H_
#define TE_BENCH_LOAD_TE_BENCH_SOAK_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/quickstart_layers.h"

namespace te::client::bench {

struct SoakOptions {
  std::string server = "localhost:50051";
  LayerSize size;              // every layer's sizes
  absl::Duration duration = absl::Minutes(8);
  int churners = 2;            // clients opening and closing sessions
  int churn_steps = 4;         // steps per churned session
  bool generate = true;        // a client generating from an LM, call after call
  std::string device;          // the sessions' device; empty: the server's choice
  int server_pid = 0;          // for host memory samples (same host); 0: none
  absl::Duration interval = absl::Minutes(1);  // one stats line each
  absl::Duration warmup = absl::Minutes(1);    // slopes start after it
  // After the run: print "soak: ready for restart", create this file (when
  // set), and wait up to restart_wait for a restarted server that restored
  // the held sessions; then compare. Off when restart_wait is zero.
  std::string ready_file;
  absl::Duration restart_wait = absl::ZeroDuration();
  absl::Duration rpc_timeout = absl::Minutes(2);
  std::ostream* out = nullptr;  // the lines above; not owned
};

// One interval's figures.
struct SoakInterval {
  double end_minutes = 0;  // since the run began
  int64_t calls = 0, failed = 0;
  std::map<std::string, std::pair<double, double>> step_ms;  // kind -> (p50, p99)
  int64_t device_in_use = -1, device_reserved = -1;  // bytes; -1: not sampled
  int64_t host_rss = -1;                              // bytes; -1: not sampled
};

struct SoakReport {
  std::vector<SoakInterval> intervals;
  int64_t calls = 0, failed = 0;
  std::map<std::string, int64_t> errors;  // "kind CODE" -> count
  std::map<std::string, std::string> error_examples;
  int64_t sessions_opened = 0, sessions_closed = 0;
  // MiB per minute after the warm-up; NaN with fewer than two samples.
  double device_in_use_slope = 0, device_reserved_slope = 0, host_rss_slope = 0;
  int held_sessions = 0;
  bool restore_checked = false;
  int restored_identical = 0;  // held sessions whose variables came back bit for bit
  std::vector<std::string> restore_mismatches;
  bool ok() const;  // no failed call, and every held session restored when checked
};

absl::Status ValidateSoak(const SoakOptions& options);
// Runs the soak; INVALID_ARGUMENT from ValidateSoak, UNAVAILABLE when the
// held sessions cannot be set up. Failures after that are in the report.
absl::StatusOr<SoakReport> RunSoak(const SoakOptions& options);

// ---- pieces, tested on their own ---------------------------------------------------

// Least-squares slope of (minutes, bytes) points in MiB per minute; NaN for
// fewer than two points or a single x.
double SlopeMibPerMinute(const std::vector<std::pair<double, int64_t>>& points);
// The samples of `intervals` (field chosen by `bytes`) that end after
// `warmup_minutes` and were taken (not -1).
std::vector<std::pair<double, int64_t>> AfterWarmup(const std::vector<SoakInterval>& intervals,
                                                    double warmup_minutes,
                                                    int64_t SoakInterval::*bytes);
std::string FormatInterval(const SoakInterval& interval);
// FNV-1a 64 of `bytes`: variables' digests.
uint64_t Fnv1a64(const std::string& bytes);
// Names whose digests differ, or that one side lacks, "name (why)".
std::vector<std::string> CompareDigests(const std::map<std::string, uint64_t>& before,
                                        const std::map<std::string, uint64_t>& after);
// VmRSS of `pid` in bytes from /proc; -1 when unreadable.
int64_t ResidentBytes(int pid);

}  // namespace te::client::bench

#endif  // TE_BENCH_LOAD_TE_BENCH_SOAK_H_
