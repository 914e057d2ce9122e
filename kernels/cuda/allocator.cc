#include "kernels/cuda/allocator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"

namespace te {
namespace cuda {
namespace {

constexpr size_t kSmallQuantum = 512;             // below 1 MiB
constexpr size_t kLargeThreshold = 1 << 20;
constexpr size_t kLargeQuantum = 2 << 20;         // 2 MiB from 1 MiB up
// A cached block may serve a request up to this many times smaller, so a
// large block is not tied up by a small tensor.
constexpr size_t kMaxWasteFactor = 2;

}  // namespace

size_t CachingAllocator::RoundedSize(size_t bytes) {
  const size_t quantum = bytes < kLargeThreshold ? kSmallQuantum : kLargeQuantum;
  return (bytes + quantum - 1) / quantum * quantum;
}

CachingAllocator::~CachingAllocator() { ReleaseCached(); }

absl::StatusOr<std::shared_ptr<void>> CachingAllocator::Allocate(
    size_t bytes, std::shared_ptr<CUstream_st> stream, bool recording) {
  const size_t size = RoundedSize(bytes == 0 ? 1 : bytes);
  void* ptr = nullptr;
  size_t block_size = size;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Smallest cached size that fits; among its blocks, prefer one last used
    // on this stream (reusable with no event).
    auto it = free_blocks_.lower_bound(size);
    std::vector<FreeBlock>* blocks = nullptr;
    size_t pick = 0;
    if (it != free_blocks_.end() && it->first <= size * kMaxWasteFactor && !it->second.empty()) {
      std::vector<FreeBlock>& candidates = it->second;
      // Newest first: one of this stream's (or idle) needs no event. One of
      // another stream's is ordered after that stream by an event, unless
      // that stream is being recorded (waiting on its event would pull this
      // stream into the recording) or this one is (it cannot wait on
      // others' work).
      size_t other = candidates.size();
      for (size_t i = candidates.size(); i-- > 0;) {
        const std::shared_ptr<CUstream_st>& last = candidates[i].last_stream;
        if (last == nullptr || last == stream) {
          blocks = &candidates;
          pick = i;
          break;
        }
        if (other == candidates.size() && !recording && capturing_streams_.count(last.get()) == 0) {
          other = i;
        }
      }
      if (blocks == nullptr && other < candidates.size()) {
        blocks = &candidates;
        pick = other;
      }
    }
    if (blocks != nullptr) {
      FreeBlock block = std::move((*blocks)[pick]);
      blocks->erase(blocks->begin() + static_cast<std::ptrdiff_t>(pick));
      block_size = it->first;
      if (blocks->empty()) free_blocks_.erase(it);
      if (block.last_stream != nullptr && block.last_stream != stream) {
        // Work queued on the old stream may still touch the block: order this
        // stream after it, on the device.
        cudaEvent_t event;
        CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        CUDA_RETURN_IF_ERROR(cudaEventRecord(event, block.last_stream.get()));
        CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream.get(), event, 0));
        CUDA_RETURN_IF_ERROR(cudaEventDestroy(event));  // released once it fires
      }
      ptr = block.ptr;
      ++stats_.cache_hits;
    }
  }
  if (ptr == nullptr) {
    // Under pressure, give back just enough of the cache for this request
    // (the largest blocks first): the other sessions' hot blocks stay.
    int64_t over = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      over = static_cast<int64_t>(size) - (reserve_limit_ - (stats_.bytes_reserved - releasing_));
    }
    // A recording stream gives nothing back: that synchronises the device.
    if (over > 0 && !recording) ReleaseCachedBytes(over);
    cudaError_t error = cudaMalloc(&ptr, size);
    if (error == cudaErrorMemoryAllocation && !recording) {
      (void)cudaGetLastError();  // clear the non-sticky error
      // Another thread's release may not have reached the driver yet: wait
      // for it, then give back what is left before the one retry.
      WaitForReleases();
      ReleaseCachedBytes(INT64_MAX);
      error = cudaMalloc(&ptr, size);
    }
    if (error == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      const Stats now = stats();
      return absl::ResourceExhaustedError(absl::StrCat(
          "cuda:", ordinal_, " is out of memory: cudaMalloc of ", size, " bytes failed with ",
          now.bytes_reserved, " bytes reserved by this process (", now.bytes_in_use, " in use)"));
    }
    CUDA_RETURN_IF_ERROR(error);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_reserved += static_cast<int64_t>(size);
    stats_.peak_bytes_reserved = std::max(stats_.peak_bytes_reserved, stats_.bytes_reserved);
    ++stats_.cuda_mallocs;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_in_use += static_cast<int64_t>(block_size);
    stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  }
  std::shared_ptr<CachingAllocator> self = shared_from_this();
  return std::shared_ptr<void>(ptr, [self, block_size, stream](void* p) mutable {
    self->Free(p, block_size, std::move(stream));
  });
}

void CachingAllocator::Free(void* ptr, size_t size, std::shared_ptr<CUstream_st> stream) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_in_use -= static_cast<int64_t>(size);
  free_blocks_[size].push_back(FreeBlock{ptr, std::move(stream)});
}

void CachingAllocator::ForgetStream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [size, blocks] : free_blocks_) {
    for (FreeBlock& block : blocks) {
      if (block.last_stream.get() == stream) block.last_stream.reset();
    }
  }
}

void CachingAllocator::ReleaseCached() { ReleaseCachedBytes(INT64_MAX); }

void CachingAllocator::ReleaseCachedBytes(int64_t bytes) {
  // Taken out of the cache under the lock; synchronised and freed outside it,
  // so the other sessions' allocations and frees never wait for the device.
  std::vector<std::pair<void*, size_t>> taken;
  int64_t released = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_blocks_.rbegin(); it != free_blocks_.rend() && released < bytes; ++it) {
      std::vector<FreeBlock>& blocks = it->second;
      while (!blocks.empty() && released < bytes) {
        taken.emplace_back(blocks.back().ptr, it->first);
        released += static_cast<int64_t>(it->first);
        blocks.pop_back();
      }
    }
    for (auto it = free_blocks_.begin(); it != free_blocks_.end();) {
      it = it->second.empty() ? free_blocks_.erase(it) : std::next(it);
    }
    if (taken.empty()) return;
    releasing_ += released;
    ++stats_.cache_releases;
  }
  FreeBlocks(taken);
  {
    std::lock_guard<std::mutex> lock(mu_);
    releasing_ -= released;
    stats_.bytes_reserved -= released;
  }
  released_.notify_all();
}

void CachingAllocator::WaitForReleases() {
  std::unique_lock<std::mutex> lock(mu_);
  released_.wait(lock, [this] { return releasing_ == 0; });
}

void CachingAllocator::FreeBlocks(const std::vector<std::pair<void*, size_t>>& blocks) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    capture_or_free_done_.wait(lock, [this] { return captures_ == 0 && !freeing_; });
    freeing_ = true;
  }
  // cudaFree does not wait for queued kernels that may still use a block.
  int previous = -1;
  (void)cudaGetDevice(&previous);
  (void)cudaSetDevice(ordinal_);
  (void)cudaDeviceSynchronize();
  for (const auto& block : blocks) (void)cudaFree(block.first);
  if (previous >= 0) (void)cudaSetDevice(previous);
  {
    std::lock_guard<std::mutex> lock(mu_);
    freeing_ = false;
  }
  capture_or_free_done_.notify_all();
}

void CachingAllocator::BeginCapture(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(mu_);
  capture_or_free_done_.wait(lock, [this] { return !freeing_; });
  ++captures_;
  capturing_streams_.insert(stream);
}

void CachingAllocator::EndCapture(cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    --captures_;
    capturing_streams_.erase(stream);
  }
  capture_or_free_done_.notify_all();
}

void CachingAllocator::ResetPeaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
  stats_.peak_bytes_reserved = stats_.bytes_reserved;
}

CachingAllocator::Stats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace cuda
}  // namespace te
