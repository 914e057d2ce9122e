#include "server/session/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace te::session {

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
    return absl::ResourceExhaustedError(
        absl::StrCat("device ", options_.name, " is at capacity: ", queued_,
                     " calls already wait for its workers (--executor_queue=", options_.max_queued,
                     "); retry later"));
  }
  const std::string& key = state->call.key;
  Strand& strand = strands_[key];
  strand.waiting.push_back(state);
  ++queued_;
  ScheduleLocked(key, strand);
  return state;
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
  it->second.held = false;
  ScheduleLocked(key, it->second);
  EraseIfIdleLocked(key);
}

bool DeviceExecutor::RunnableLocked(const Strand& strand) const {
  return !strand.continuations.empty() || (!strand.held && !strand.waiting.empty());
}

void DeviceExecutor::ScheduleLocked(const std::string& key, Strand& strand) {
  if (strand.scheduled || !RunnableLocked(strand)) return;
  strand.scheduled = true;
  ready_.push_back(key);
  work_available_.Signal();
}

void DeviceExecutor::EraseIfIdleLocked(const std::string& key) {
  auto it = strands_.find(key);
  if (it == strands_.end()) return;
  const Strand& strand = it->second;
  if (!strand.held && !strand.scheduled && strand.waiting.empty() && strand.continuations.empty()) {
    strands_.erase(it);
  }
}

void DeviceExecutor::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    while (ready_.empty() && !stopping_) work_available_.Wait(&mu_);
    if (ready_.empty()) return;  // stopping, and nothing left that may run
    const std::string key = std::move(ready_.front());
    ready_.pop_front();
    // A scheduled strand is never erased, so this reference stays valid while
    // the lock is dropped below.
    Strand& strand = strands_[key];
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
    Strand& after = strands_[key];
    after.scheduled = false;
    ScheduleLocked(key, after);
    EraseIfIdleLocked(key);
  }
}

}  // namespace te::session
