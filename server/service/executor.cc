#include "server/service/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace te::service {

struct DeviceExecutor::CallState {
  enum class Phase { kWaiting, kStarted, kDropped };
  Call call;
  Phase phase = Phase::kWaiting;  // guarded by the executor's mu_
};

// ---- Turn ----------------------------------------------------------------------

DeviceExecutor::Turn::Turn(Turn&& other) noexcept
    : executor_(other.executor_), key_(std::move(other.key_)) {
  other.executor_ = nullptr;
}

DeviceExecutor::Turn& DeviceExecutor::Turn::operator=(Turn&& other) noexcept {
  if (this != &other) {
    Release();
    executor_ = other.executor_;
    key_ = std::move(other.key_);
    other.executor_ = nullptr;
  }
  return *this;
}

void DeviceExecutor::Turn::Post(std::function<void()> fn) const {
  if (executor_ != nullptr) executor_->Post(key_, std::move(fn));
}

void DeviceExecutor::Turn::Release() {
  if (executor_ == nullptr) return;
  DeviceExecutor* executor = executor_;
  executor_ = nullptr;
  executor->ReleaseKey(key_);
}

// ---- DeviceExecutor ----------------------------------------------------------------

DeviceExecutor::DeviceExecutor(ExecutorOptions options) : options_(std::move(options)) {
  const int threads = std::max(1, options_.threads);
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

DeviceExecutor::~DeviceExecutor() {
  std::vector<Handle> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [key, strand] : strands_) {
      for (Handle& waiting : strand.waiting) {
        waiting->phase = CallState::Phase::kDropped;
        dropped.push_back(std::move(waiting));
      }
      strand.waiting.clear();
      for (auto& [number, early] : strand.early) {
        if (early->phase != CallState::Phase::kWaiting) continue;
        early->phase = CallState::Phase::kDropped;
        dropped.push_back(std::move(early));
      }
      strand.early.clear();
    }
    queued_ = 0;
    work_available_.SignalAll();
  }
  for (const Handle& call : dropped) {
    call->call.drop(absl::UnavailableError("the server is shutting down"));
  }
  for (std::thread& worker : workers_) worker.join();
}

absl::StatusOr<DeviceExecutor::Handle> DeviceExecutor::Submit(Call call) {
  auto state = std::make_shared<CallState>();
  state->call = std::move(call);
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  // Calls an idle worker is about to take are not waiting for the device:
  // they do not count against the bound (else a call could be refused while
  // a worker sits idle, between a Submit and the worker's wake-up).
  const int idle_workers = static_cast<int>(workers_.size()) - running_;
  const int about_to_start = std::min(idle_workers, static_cast<int>(ready_.size()));
  if (queued_ - about_to_start >= options_.max_queued) {
    if (state->call.sequence != 0) {
      // Its number is used all the same, so the session's later calls do not
      // wait for it.
      state->phase = CallState::Phase::kDropped;
      Strand& strand = strands_[state->call.key];
      AcceptNumberedLocked(state->call.key, strand, state).IgnoreError();
      ScheduleLocked(state->call.key, strand);
      EraseIfIdleLocked(state->call.key);
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("device ", options_.name, " is at capacity: ", queued_,
                     " calls already wait for its workers (--executor_queue=", options_.max_queued,
                     "); retry later"));
  }
  const std::string& key = state->call.key;
  Strand& strand = strands_[key];
  if (state->call.sequence == 0) {
    strand.waiting.push_back(state);
  } else if (absl::Status taken = AcceptNumberedLocked(key, strand, state); !taken.ok()) {
    EraseIfIdleLocked(key);
    return taken;
  }
  ++queued_;
  ScheduleLocked(key, strand);
  return state;
}

absl::Status DeviceExecutor::AcceptNumberedLocked(const std::string& key, Strand& strand,
                                                  Handle state) {
  const uint64_t number = state->call.sequence;
  const uint64_t first_unanswered = state->call.first_unanswered;
  if (first_unanswered > number) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session.first_unanswered: ", first_unanswered, " is above the call's sequence ", number,
        " (the lowest number its client has in flight, this call's included)"));
  }
  // A key never started numbers from the lowest call its first numbered
  // call's client still had in flight.
  uint64_t& next =
      next_sequence_.try_emplace(key, first_unanswered > 0 ? first_unanswered : number)
          .first->second;
  if (number < next || strand.early.count(number) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session.sequence: ", number, " is already taken on this session (its next is ", next,
        "); give every call, retries included, a number of its own"));
  }
  for (uint64_t lost : state->call.abandoned) {
    if (lost >= number) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session.abandoned: ", lost, " is not below the call's sequence ", number));
    }
  }
  for (uint64_t lost : state->call.abandoned) {
    // One that arrived (it waits early, or ran) keeps its place; one not
    // seen is marked used, so nothing waits for it.
    if (lost < next || strand.early.count(lost) > 0) continue;
    auto marker = std::make_shared<CallState>();
    marker->call.sequence = lost;
    marker->phase = CallState::Phase::kDropped;
    strand.early.emplace(lost, std::move(marker));
  }
  ReleaseEarlyLocked(key, strand);
  const bool live = state->phase == CallState::Phase::kWaiting;
  if (number > next) {
    if (strand.early.empty()) strand.gap_since = absl::Now();
    strand.early.emplace(number, std::move(state));
    if (live) {
      ++early_calls_;
      next_gap_check_ = std::min(next_gap_check_, strand.gap_since + options_.sequence_gap);
      work_available_.Signal();  // an idle worker sets its timer for the gap
    }
    return absl::OkStatus();
  }
  ++next;
  if (live) strand.waiting.push_back(std::move(state));
  ReleaseEarlyLocked(key, strand);
  return absl::OkStatus();
}

void DeviceExecutor::ReleaseEarlyLocked(const std::string& key, Strand& strand) {
  uint64_t& next = next_sequence_[key];
  bool released = false;
  for (auto it = strand.early.begin(); it != strand.early.end() && it->first == next;
       it = strand.early.erase(it), ++next) {
    released = true;
    if (it->second->phase != CallState::Phase::kWaiting) continue;  // a dropped call's number
    strand.waiting.push_back(std::move(it->second));
    --early_calls_;
  }
  if (released && !strand.early.empty()) strand.gap_since = absl::Now();
}

absl::Time DeviceExecutor::ExpireGapsLocked(
    absl::Time now, std::vector<std::pair<Handle, absl::Status>>* dropped) {
  absl::Time next_check = absl::InfiniteFuture();
  std::vector<std::string> emptied;
  for (auto& [key, strand] : strands_) {
    if (strand.early.empty()) continue;
    const bool live = std::any_of(strand.early.begin(), strand.early.end(), [](const auto& e) {
      return e.second->phase == CallState::Phase::kWaiting;
    });
    if (!live) continue;  // nothing waits on this gap
    const absl::Time expiry = strand.gap_since + options_.sequence_gap;
    if (now < expiry) {
      next_check = std::min(next_check, expiry);
      continue;
    }
    uint64_t& next = next_sequence_[key];
    const absl::Status aborted = absl::AbortedError(absl::StrCat(
        "session.sequence: call ", next, " of this session did not arrive within ",
        absl::FormatDuration(options_.sequence_gap),
        " (--sequence_gap_seconds); the calls numbered after it (", strand.early.begin()->first,
        " to ", strand.early.rbegin()->first, ") were not run"));
    for (auto& [number, call] : strand.early) {
      if (call->phase != CallState::Phase::kWaiting) continue;
      call->phase = CallState::Phase::kDropped;
      --early_calls_;
      --queued_;
      dropped->emplace_back(std::move(call), aborted);
    }
    next = strand.early.rbegin()->first + 1;  // the missing numbers are skipped
    strand.early.clear();
    emptied.push_back(key);
  }
  for (const std::string& key : emptied) EraseIfIdleLocked(key);
  return next_check;
}

void DeviceExecutor::StartSequence(const std::string& key, uint64_t first) {
  absl::MutexLock lock(&mu_);
  next_sequence_[key] = first;
}

void DeviceExecutor::ForgetKey(const std::string& key) {
  absl::MutexLock lock(&mu_);
  next_sequence_.erase(key);
  auto it = strands_.find(key);
  if (it == strands_.end()) return;
  // Markers of dropped calls: nothing live waits on them once the key has gone.
  std::map<uint64_t, Handle>& early = it->second.early;
  if (std::none_of(early.begin(), early.end(), [](const auto& e) {
        return e.second->phase == CallState::Phase::kWaiting;
      })) {
    early.clear();
    EraseIfIdleLocked(key);
  }
}

bool DeviceExecutor::Cancel(const Handle& handle, const absl::Status& reason) {
  if (handle == nullptr) return false;
  {
    absl::MutexLock lock(&mu_);
    if (handle->phase != CallState::Phase::kWaiting) return false;
    handle->phase = CallState::Phase::kDropped;
    auto it = strands_.find(handle->call.key);
    if (it != strands_.end()) {
      std::deque<Handle>& waiting = it->second.waiting;
      waiting.erase(std::remove(waiting.begin(), waiting.end(), handle), waiting.end());
      // An early call stays in `early`, dropped, as the marker of its number.
      auto early = it->second.early.find(handle->call.sequence);
      if (handle->call.sequence != 0 && early != it->second.early.end() &&
          early->second == handle) {
        --early_calls_;
      }
      EraseIfIdleLocked(handle->call.key);
    }
    --queued_;
  }
  handle->call.drop(reason);
  return true;
}

int DeviceExecutor::queued() const {
  absl::MutexLock lock(&mu_);
  return queued_;
}

int DeviceExecutor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

void DeviceExecutor::Post(const std::string& key, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  Strand& strand = strands_[key];
  strand.continuations.push_back(std::move(fn));
  ScheduleLocked(key, strand);
}

void DeviceExecutor::ReleaseKey(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = strands_.find(key);
  if (it == strands_.end()) return;
  Strand& strand = it->second;
  strand.held = false;
  // Released by the worker running the call: the rest of its run is not the
  // key's work (contract 4).
  if (strand.running && strand.runner == std::this_thread::get_id()) strand.running = false;
  ScheduleLocked(key, strand);
  EraseIfIdleLocked(key);
}

bool DeviceExecutor::RunnableLocked(const Strand& strand) const {
  return !strand.continuations.empty() || (!strand.held && !strand.waiting.empty());
}

void DeviceExecutor::ScheduleLocked(const std::string& key, Strand& strand) {
  if (strand.queued || strand.running || !RunnableLocked(strand)) return;
  strand.queued = true;
  ready_.push_back(key);
  work_available_.Signal();
}

void DeviceExecutor::EraseIfIdleLocked(const std::string& key) {
  auto it = strands_.find(key);
  if (it == strands_.end()) return;
  const Strand& strand = it->second;
  if (!strand.held && !strand.queued && !strand.running && strand.waiting.empty() &&
      strand.early.empty() &&
      strand.continuations.empty()) {
    strands_.erase(it);
  }
}

void DeviceExecutor::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    while (true) {
      if (early_calls_ > 0 && absl::Now() >= next_gap_check_) {
        std::vector<std::pair<Handle, absl::Status>> dropped;
        next_gap_check_ = ExpireGapsLocked(absl::Now(), &dropped);
        if (!dropped.empty()) {
          mu_.Unlock();
          for (auto& [call, reason] : dropped) call->call.drop(reason);
          dropped.clear();
          mu_.Lock();
        }
      }
      if (!ready_.empty() || stopping_) break;
      work_available_.WaitWithDeadline(
          &mu_, early_calls_ > 0 ? next_gap_check_ : absl::InfiniteFuture());
    }
    if (ready_.empty()) return;  // stopping, and nothing left that may run
    const std::string key = std::move(ready_.front());
    ready_.pop_front();
    Strand& strand = strands_[key];
    strand.queued = false;
    strand.running = true;
    strand.runner = std::this_thread::get_id();
    std::function<void()> work;
    if (!strand.continuations.empty()) {
      work = std::move(strand.continuations.front());
      strand.continuations.pop_front();
    } else if (!strand.held && !strand.waiting.empty()) {
      Handle call = std::move(strand.waiting.front());
      strand.waiting.pop_front();
      --queued_;
      if (absl::Now() >= call->call.deadline) {
        call->phase = CallState::Phase::kDropped;
        work = [call] {
          call->call.drop(absl::DeadlineExceededError(
              "the deadline passed while the call waited for the device"));
        };
      } else {
        call->phase = CallState::Phase::kStarted;
        strand.held = true;
        work = [this, call, key] { call->call.run(Turn(this, key)); };
      }
    }
    if (work) {
      ++running_;
      mu_.Unlock();
      work();
      work = nullptr;  // what it captured goes before the lock is taken again
      mu_.Lock();
      --running_;
    }
    // The strand may have been released and erased meanwhile, or taken by
    // another worker after the call released its turn: then it is not ours.
    Strand& after = strands_[key];
    if (after.running && after.runner == std::this_thread::get_id()) after.running = false;
    ScheduleLocked(key, after);
    EraseIfIdleLocked(key);
  }
}

}  // namespace te::service
