// DeviceExecutor: the worker threads that run one device's session work, with
// a bounded queue in front of them. Thread-safe.
//
// Contract:
//  1. Calls with the same key (a session id) run one at a time, in the order
//     Submit accepted them; calls with different keys run concurrently, on up
//     to `threads` workers. Keys that have work take turns (round robin), so
//     one busy session does not starve the others.
//  2. At most `max_queued` accepted calls wait for a busy device, over all
//     keys (calls that idle workers are about to take do not count). Submit
//     answers RESOURCE_EXHAUSTED at once beyond that: never an unbounded wait.
//  3. A waiting call that is cancelled (Cancel), or whose deadline has passed
//     when its turn comes, is dropped: its `drop` runs once, with CANCELLED or
//     DEADLINE_EXCEEDED, instead of `run`, and its place in the queue is free
//     at once. Exactly one of `run` and `drop` runs for every accepted call.
//  4. A started call holds its key until the Turn it was given is released
//     (destroyed or Release()). Until then it may Post continuations (the later
//     pieces of a stream): they run on the workers in posting order, before
//     the key's next call, and do not count against max_queued.
//  5. The destructor drops the calls still waiting (UNAVAILABLE) and joins the
//     workers once the work already started is done; every Turn must have
//     been released by then.
//  6. Numbered calls (Call.sequence > 0, a session's SessionRef.sequence) of
//     a key start in the order of their numbers, not of their Submits: one
//     that arrives early waits (counted against max_queued) until every lower
//     number has been accepted, dropped or refused. A key's numbering starts
//     at StartSequence's number, or, for a key never started (a session
//     restored from a checkpoint), at the first_unanswered of the first
//     numbered call that arrives (the lowest number its client still had in
//     flight; its own number when not given), so calls sent before it that
//     arrive after it still run in their order. Submit
//     refuses a number already taken (INVALID_ARGUMENT). When the lowest
//     early call has waited `sequence_gap` for a number that never came, the
//     missing numbers are skipped and every early call of the key is dropped
//     with ABORTED naming the first missing one: it was sent to run after a
//     call that never ran. A refused or dropped call still uses its number,
//     and so do the numbers a call names as abandoned (Call.abandoned) that
//     have not arrived. Unnumbered calls keep Submit order among themselves.
#ifndef TE_SERVER_SERVICE_EXECUTOR_H_
#define TE_SERVER_SERVICE_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace te::service {

struct ExecutorOptions {
  int threads = 4;
  int max_queued = 64;
  std::string name = "executor";  // for messages ("cpu", "cuda:0")
  absl::Duration sequence_gap = absl::Seconds(10);  // contract 6
};

class DeviceExecutor {
 public:
  explicit DeviceExecutor(ExecutorOptions options);
  ~DeviceExecutor();
  DeviceExecutor(const DeviceExecutor&) = delete;
  DeviceExecutor& operator=(const DeviceExecutor&) = delete;

  // The right to run on a key (contract 4). Move-only; empty when moved from.
  class Turn {
   public:
    Turn() = default;
    Turn(Turn&& other) noexcept;
    Turn& operator=(Turn&& other) noexcept;
    ~Turn() { Release(); }
    // Runs `fn` on a worker, after what was posted before on this key.
    // Requires a held turn.
    void Post(std::function<void()> fn) const;
    // Lets the key's next call start (after the posted continuations).
    void Release();
    bool held() const { return executor_ != nullptr; }

   private:
    friend class DeviceExecutor;
    Turn(DeviceExecutor* executor, std::string key) : executor_(executor), key_(std::move(key)) {}
    DeviceExecutor* executor_ = nullptr;
    std::string key_;
  };

  struct Call {
    std::string key;
    uint64_t sequence = 0;  // contract 6; 0: unnumbered
    std::vector<uint64_t> abandoned;  // contract 6: lower numbers not to wait for
    // Contract 6: the lowest number the client had in flight (<= sequence;
    // 0: sequence), where a never-started key's numbering begins.
    uint64_t first_unanswered = 0;
    absl::Time deadline = absl::InfiniteFuture();
    std::function<void(Turn)> run;
    std::function<void(absl::Status)> drop;
  };
  struct CallState;
  using Handle = std::shared_ptr<CallState>;

  // Accepts `call` (contract 2), or UNAVAILABLE once shutting down. The
  // handle is for Cancel.
  absl::StatusOr<Handle> Submit(Call call);
  // Drops the call with `reason` if it is still waiting; does nothing once it
  // has started or been dropped. True if it dropped it.
  bool Cancel(const Handle& handle, const absl::Status& reason);

  // Contract 6: `key`'s numbered calls start from `first`; ForgetKey drops
  // what the executor remembers of a key (its session has gone).
  void StartSequence(const std::string& key, uint64_t first);
  void ForgetKey(const std::string& key);

  int queued() const;   // accepted calls waiting to start
  int running() const;  // workers busy now
  const ExecutorOptions& options() const { return options_; }

 private:
  struct Strand {
    std::deque<Handle> waiting;
    // Numbered calls that arrived before their turn, by number; a dropped
    // one stays as a marker until its number comes up (contract 6).
    std::map<uint64_t, Handle> early;
    absl::Time gap_since;  // when the wait for the key's next number began
    std::deque<std::function<void()>> continuations;
    bool held = false;    // a started call holds the key
    bool queued = false;  // in ready_
    // A worker runs the key's work (a call until it releases its turn, or a
    // continuation): the key's next work waits for it. A call that releases
    // its turn inside its run (QueuedCall: the answer's device values are
    // read after it) lets the key's next call start on another worker
    // meanwhile, so a pipelined client's next step is queued on the device
    // while this one's loss is read.
    bool running = false;
    std::thread::id runner;  // the worker, while running
  };

  void WorkerLoop();
  // Takes `state`'s number (contract 6): queues it in `strand` when its turn
  // has come, else keeps it early. INVALID_ARGUMENT for a number taken.
  absl::Status AcceptNumberedLocked(const std::string& key, Strand& strand, Handle state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves early calls whose numbers have come up into `strand.waiting`.
  void ReleaseEarlyLocked(const std::string& key, Strand& strand)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops (into `dropped`) the early calls of keys whose gap has lasted
  // sequence_gap; returns when the next such gap would expire.
  absl::Time ExpireGapsLocked(absl::Time now, std::vector<std::pair<Handle, absl::Status>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Post(const std::string& key, std::function<void()> fn);
  void ReleaseKey(const std::string& key);
  bool RunnableLocked(const Strand& strand) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ScheduleLocked(const std::string& key, Strand& strand) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseIfIdleLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ExecutorOptions options_;
  mutable absl::Mutex mu_;
  absl::CondVar work_available_;
  std::map<std::string, Strand> strands_ ABSL_GUARDED_BY(mu_);
  // Each numbered key's next number to start (contract 6); outlives idle strands.
  std::map<std::string, uint64_t> next_sequence_ ABSL_GUARDED_BY(mu_);
  int early_calls_ ABSL_GUARDED_BY(mu_) = 0;  // live (not dropped) early calls
  absl::Time next_gap_check_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::deque<std::string> ready_ ABSL_GUARDED_BY(mu_);  // keys with runnable work
  int queued_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_EXECUTOR_H_
