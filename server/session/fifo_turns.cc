#include "server/session/fifo_turns.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace te::session {

absl::Status FifoTurns::Wait(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int>(queue_.size()) >= max_waiting_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        queue_.size(), " calls already wait on this session (the limit); retry later"));
  }
  const uint64_t ticket = next_ticket_++;
  queue_.push_back(ticket);
  struct Args {
    FifoTurns* self;
    uint64_t ticket;
  } args{this, ticket};
  const absl::Condition my_turn(
      +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return !a->self->busy_ && a->self->queue_.front() == a->ticket;
      },
      &args);
  if (!mu_.AwaitWithDeadline(my_turn, deadline)) {
    queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
    return absl::DeadlineExceededError(
        "deadline passed while waiting for earlier calls on this session");
  }
  queue_.pop_front();
  busy_ = true;
  return absl::OkStatus();
}

void FifoTurns::Done() {
  absl::MutexLock lock(&mu_);
  busy_ = false;
}

int FifoTurns::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

}  // namespace te::session
