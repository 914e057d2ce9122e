// FifoTurns: hands out turns to run, one at a time, in arrival order (a ticket
// lock), with a bound on how many may wait and a deadline for each waiter.
// Thread-safe. A session's calls take turns on one.
#ifndef TE_SERVER_SESSION_FIFO_TURNS_H_
#define TE_SERVER_SESSION_FIFO_TURNS_H_

#include <cstdint>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace te::session {

class FifoTurns {
 public:
  explicit FifoTurns(int max_waiting) : max_waiting_(max_waiting) {}

  // Blocks until it is this caller's turn; OK means the caller holds the turn
  // and must call Done(). RESOURCE_EXHAUSTED when max_waiting callers already
  // wait (never an unbounded queue); DEADLINE_EXCEEDED when `deadline` passes
  // first (the caller then leaves the queue and later callers move up).
  absl::Status Wait(absl::Time deadline);
  void Done();

  int waiting() const;

 private:
  const int max_waiting_;
  mutable absl::Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<uint64_t> queue_ ABSL_GUARDED_BY(mu_);  // tickets waiting, oldest first
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_FIFO_TURNS_H_
