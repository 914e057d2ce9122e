// Staged copies on CUDA: page-locked host buffers (pooled per device),
// host-to-device copies that run on the session's stream while the host
// gathers the next piece, and device-to-host copies that the host collects
// later through an event (Ops::DownloadAsync).
//
// Why page-locked: cudaMemcpyAsync from pageable memory first copies through a
// driver bounce buffer and returns only after that, so the host cannot do
// anything else meanwhile; from page-locked memory the DMA engine reads the
// buffer directly and the call returns at once.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// Released buffers kept per size: a few sessions' PutTensors at once take one
// each (TensorUpload's two halves are one buffer).
constexpr size_t kMaxPooledPerSize = 4;
// Pinned memory is taken from the OS's unswappable pages: past this many
// pooled bytes, a released buffer goes back to the driver instead.
constexpr size_t kMaxPooledBytes = size_t{256} << 20;

}  // namespace

class PinnedStagingPool : public std::enable_shared_from_this<PinnedStagingPool> {
 public:
  PinnedStagingPool() = default;
  ~PinnedStagingPool() {
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseAllLocked();
  }
  PinnedStagingPool(const PinnedStagingPool&) = delete;
  PinnedStagingPool& operator=(const PinnedStagingPool&) = delete;

  // `bytes` (> 0) of page-locked memory; the caller has made the device current.
  absl::StatusOr<std::shared_ptr<void>> Take(size_t bytes) {
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        ptr = it->second.back();
        it->second.pop_back();
        pooled_bytes_ -= bytes;
      }
    }
    if (ptr == nullptr) {
      cudaError_t error = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
      if (error == cudaErrorMemoryAllocation) {
        // Pooled buffers of other sizes may be what stands in the way.
        (void)cudaGetLastError();
        {
          std::lock_guard<std::mutex> lock(mu_);
          ReleaseAllLocked();
        }
        error = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
      }
      CUDA_RETURN_IF_ERROR(error);
    }
    std::shared_ptr<PinnedStagingPool> pool = shared_from_this();
    return std::shared_ptr<void>(ptr, [pool, bytes](void* p) { pool->Give(p, bytes); });
  }

 private:
  void Give(void* ptr, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<void*>& same_size = free_[bytes];
      if (same_size.size() < kMaxPooledPerSize && pooled_bytes_ + bytes <= kMaxPooledBytes) {
        same_size.push_back(ptr);
        pooled_bytes_ += bytes;
        return;
      }
    }
    (void)cudaFreeHost(ptr);
  }

  void ReleaseAllLocked() {
    for (auto& [bytes, buffers] : free_) {
      for (void* ptr : buffers) (void)cudaFreeHost(ptr);
    }
    free_.clear();
    pooled_bytes_ = 0;
  }

  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // exact size -> released buffers
  size_t pooled_bytes_ = 0;
};

std::shared_ptr<PinnedStagingPool> NewPinnedStagingPool() {
  return std::make_shared<PinnedStagingPool>();
}

// Events for NewCompletion, kept for the next: a training step answered
// after its turn takes one a step, and creating and destroying a CUDA event
// each time is setup on the step's path. A Completion may outlive its
// CudaOps (a late answer), so it holds the pool, not the ops.
class CompletionEventPool {
 public:
  explicit CompletionEventPool(int ordinal) : ordinal_(ordinal) {}
  ~CompletionEventPool() {
    (void)cudaSetDevice(ordinal_);
    for (cudaEvent_t event : idle_) (void)cudaEventDestroy(event);
  }
  CompletionEventPool(const CompletionEventPool&) = delete;
  CompletionEventPool& operator=(const CompletionEventPool&) = delete;

  // The caller has made the device current.
  absl::StatusOr<cudaEvent_t> Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        cudaEvent_t event = idle_.back();
        idle_.pop_back();
        return event;
      }
    }
    cudaEvent_t event = nullptr;
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  // A recorded event may still be pending: the next DownloadAsync records it
  // again behind later work, which is what its next Wait() waits for.
  void Give(cudaEvent_t event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_.size() < kMaxIdle) {
        idle_.push_back(event);
        return;
      }
    }
    (void)cudaSetDevice(ordinal_);
    (void)cudaEventDestroy(event);
  }

 private:
  static constexpr size_t kMaxIdle = 16;  // a few completions in flight a stream
  const int ordinal_;
  std::mutex mu_;
  std::vector<cudaEvent_t> idle_;
};

namespace {

class EventCompletion final : public Ops::Completion {
 public:
  EventCompletion(std::shared_ptr<CompletionEventPool> pool, cudaEvent_t event)
      : pool_(std::move(pool)), event_(event) {}
  ~EventCompletion() override { pool_->Give(event_); }
  EventCompletion(const EventCompletion&) = delete;
  EventCompletion& operator=(const EventCompletion&) = delete;

  // An event never recorded, or recorded and done, counts as done.
  absl::Status Wait() override {
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return absl::OkStatus();
  }
  cudaEvent_t event() const { return event_; }

 private:
  const std::shared_ptr<CompletionEventPool> pool_;
  cudaEvent_t event_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Ops::Completion>> CudaOps::NewCompletion() {
  RETURN_IF_ERROR(Enter());
  if (completion_events_ == nullptr) {
    completion_events_ = std::make_shared<CompletionEventPool>(ordinal());
  }
  ASSIGN_OR_RETURN(cudaEvent_t event, completion_events_->Take());
  return std::make_unique<EventCompletion>(completion_events_, event);
}

absl::Status CudaOps::DownloadAsync(const Tensor& src, void* dst, Completion* done) {
  RETURN_IF_ERROR(CheckDownloadArgs(src, dst));
  auto* event = dynamic_cast<EventCompletion*>(done);
  if (event == nullptr) {
    return absl::InvalidArgumentError(
        "DownloadAsync: done must come from this backend's NewCompletion()");
  }
  RETURN_IF_ERROR(NotRecording("DownloadAsync"));
  RETURN_IF_ERROR(Enter());
  if (src.nbytes() > 0) {
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, stream()));
  }
  CUDA_RETURN_IF_ERROR(cudaEventRecord(event->event(), stream()));
  return absl::OkStatus();
}

// Small host-to-device copies through page-locked buffers of the stream's
// own. From pageable memory, cudaMemcpyAsync may synchronize with the stream
// before it stages the bytes (CUDA's API synchronization behavior): each
// training step's token and label uploads made the host wait for the step
// before it to finish, so the step's first launches found the GPU idle and
// the host was never ahead of it again (0.5-0.7 ms of idle at each 24-layer
// step's start on the H200, and launch gaps after it). Here the bytes are
// copied into a buffer, the DMA engine reads it in stream order, and the
// buffer is taken again once the event recorded behind its copy has fired.
// Used by one thread at a time, as its CudaOps is.
class StagedUploads {
 public:
  explicit StagedUploads(std::shared_ptr<PinnedStagingPool> pool) : pool_(std::move(pool)) {}
  // The owner has synchronized the stream: no copy reads a buffer.
  ~StagedUploads() {
    for (std::deque<Buffer>* buffers : {&idle_, &in_flight_}) {
      for (Buffer& b : *buffers) (void)cudaEventDestroy(b.event);
    }
  }
  StagedUploads(const StagedUploads&) = delete;
  StagedUploads& operator=(const StagedUploads&) = delete;

  // Copies `bytes` of `src` to device memory `dst` on `stream`, behind the
  // work queued there; `src` may be reused at once. False (nothing done)
  // when it is over kMaxBytes: the caller copies another way.
  absl::StatusOr<bool> Upload(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
    if (bytes > kMaxBytes) return false;
    RETURN_IF_ERROR(Reclaim(/*wait_for_one=*/in_flight_.size() >= kMaxInFlight));
    ASSIGN_OR_RETURN(Buffer buffer, TakeAtLeast(bytes));
    std::memcpy(buffer.memory.get(), src, bytes);
    if (cudaError_t queued =
            cudaMemcpyAsync(dst, buffer.memory.get(), bytes, cudaMemcpyHostToDevice, stream);
        queued != cudaSuccess) {
      (void)cudaEventDestroy(buffer.event);  // nothing queued reads the buffer
      held_bytes_ -= buffer.capacity;
      CUDA_RETURN_IF_ERROR(queued);
    }
    if (cudaError_t recorded = cudaEventRecord(buffer.event, stream); recorded != cudaSuccess) {
      // The copy is queued with nothing to say when it has read the buffer:
      // wait for the stream (or its failure) before the buffer can go.
      (void)cudaStreamSynchronize(stream);
      (void)cudaEventDestroy(buffer.event);
      held_bytes_ -= buffer.capacity;
      CUDA_RETURN_IF_ERROR(recorded);
    }
    in_flight_.push_back(std::move(buffer));
    return true;
  }

 private:
  // Small enough that a step's inputs go this way (a 24-layer LM's tokens:
  // 32 KiB), large enough for a relative-position bucket table at S 1024.
  static constexpr size_t kMaxBytes = size_t{4} << 20;
  // Page-locked bytes a stream keeps at most (idle and in flight); past
  // them the oldest copy is waited for.
  static constexpr size_t kMaxHeldBytes = size_t{16} << 20;
  // Copies queued at once before the oldest is waited for (the bytes bound
  // them first for all but the smallest).
  static constexpr size_t kMaxInFlight = 256;
  static constexpr size_t kMinCapacity = size_t{64} << 10;

  struct Buffer {
    std::shared_ptr<void> memory;
    size_t capacity = 0;
    cudaEvent_t event = nullptr;
  };

  // Moves the copies that have finished to idle_, in issue order (events on
  // one stream fire in order); with `wait_for_one`, waits for the oldest.
  absl::Status Reclaim(bool wait_for_one) {
    while (!in_flight_.empty()) {
      cudaError_t done = wait_for_one ? cudaEventSynchronize(in_flight_.front().event)
                                      : cudaEventQuery(in_flight_.front().event);
      wait_for_one = false;
      if (done == cudaErrorNotReady) {
        (void)cudaGetLastError();  // not an error: the copy is still queued
        break;
      }
      CUDA_RETURN_IF_ERROR(done);
      idle_.push_back(std::move(in_flight_.front()));
      in_flight_.pop_front();
    }
    return absl::OkStatus();
  }

  // An idle buffer of at least `bytes`, or a new one; idle buffers too small
  // go back to the pool when the stream would hold too much.
  absl::StatusOr<Buffer> TakeAtLeast(size_t bytes) {
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->capacity < bytes) continue;
      Buffer buffer = std::move(*it);
      idle_.erase(it);
      return buffer;
    }
    size_t capacity = kMinCapacity;
    while (capacity < bytes) capacity *= 2;
    while (held_bytes_ + capacity > kMaxHeldBytes) {
      if (!idle_.empty()) {
        Drop(&idle_);
      } else if (!in_flight_.empty()) {
        RETURN_IF_ERROR(Reclaim(/*wait_for_one=*/true));
      } else {
        break;  // one buffer over the budget: kMaxBytes is under it
      }
    }
    Buffer buffer;
    ASSIGN_OR_RETURN(buffer.memory, pool_->Take(capacity));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&buffer.event, cudaEventDisableTiming));
    buffer.capacity = capacity;
    held_bytes_ += capacity;
    return buffer;
  }

  void Drop(std::deque<Buffer>* from) {
    (void)cudaEventDestroy(from->front().event);
    held_bytes_ -= from->front().capacity;
    from->pop_front();
  }

  const std::shared_ptr<PinnedStagingPool> pool_;
  std::deque<Buffer> idle_;
  std::deque<Buffer> in_flight_;  // in issue order
  size_t held_bytes_ = 0;
};

std::shared_ptr<StagedUploads> NewStagedUploads(std::shared_ptr<PinnedStagingPool> pool) {
  return std::make_shared<StagedUploads>(std::move(pool));
}

absl::StatusOr<bool> StageUpload(StagedUploads& uploads, const void* src, void* dst, size_t bytes,
                                 cudaStream_t stream) {
  return uploads.Upload(src, dst, bytes, stream);
}

absl::StatusOr<std::shared_ptr<void>> CudaOps::AllocateStaging(size_t bytes) {
  RETURN_IF_ERROR(Enter());
  // As the host default, zero bytes still gives a distinct, freeable buffer.
  return context_->staging_pool->Take(bytes == 0 ? 1 : bytes);
}

}  // namespace cuda
}  // namespace te
