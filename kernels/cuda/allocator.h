// A caching device allocator for one GPU. Thread-safe.
//
// cudaMalloc and cudaFree synchronise the device and cost tens of
// microseconds, so freed blocks are kept in size-bucketed free lists and
// handed out again: after the first step of a session, a step's allocations
// are all hits and no cudaMalloc runs.
//
// Blocks are stream-ordered: a block freed while kernels on stream S may still
// use it can be reused by S at once (S runs in order); before another stream T
// reuses it, T waits on an event recorded on S (no host sync).
//
// Under pressure the cache goes first: a miss that would take what the
// allocator holds from the driver past its `reserve_limit` gives back cached
// blocks, the largest first, until the request fits, before its cudaMalloc,
// so the cache never holds memory the device's other users (the libraries'
// own allocations, lazily loaded kernels) need. On a miss that cudaMalloc
// still cannot serve, every cached block goes back and the allocation is
// retried once; RESOURCE_EXHAUSTED if it still fails. Giving blocks back
// waits for the device (cudaFree does), but only the thread that needs the
// memory waits: the lock is not held meanwhile, so the other sessions'
// allocations and frees go on.
#ifndef TE_KERNELS_CUDA_ALLOCATOR_H_
#define TE_KERNELS_CUDA_ALLOCATOR_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <climits>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace te {
namespace cuda {

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  struct Stats {
    int64_t bytes_reserved = 0;  // held from cudaMalloc (in use + cached)
    int64_t bytes_in_use = 0;    // handed out, rounded sizes
    // The most of each since the allocator was made or ResetPeaks, as JAX's
    // device.memory_stats() peak_bytes_in_use / peak_bytes_reserved.
    int64_t peak_bytes_in_use = 0;
    int64_t peak_bytes_reserved = 0;
    int64_t cuda_mallocs = 0;    // misses served by cudaMalloc, ever
    int64_t cache_hits = 0;
    int64_t cache_releases = 0;  // times cached blocks were given back under pressure
  };

  // Make with std::make_shared: handed-out memory keeps its allocator alive.
  explicit CachingAllocator(int ordinal, int64_t reserve_limit = INT64_MAX)
      : ordinal_(ordinal), reserve_limit_(reserve_limit) {}
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // At least `bytes` (> 0) of device memory, 256-byte aligned, for use on
  // `stream` (kept alive until the block is freed). The memory returns to the
  // cache when the returned pointer's last copy goes away.
  // `recording`: `stream` is being recorded into a graph (between
  // BeginCapture and EndCapture), which can neither wait on other streams'
  // events nor survive a device synchronisation: take no cached block
  // another stream freed, and give nothing back under pressure
  // (RESOURCE_EXHAUSTED instead).
  absl::StatusOr<std::shared_ptr<void>> Allocate(size_t bytes,
                                                 std::shared_ptr<CUstream_st> stream,
                                                 bool recording = false);

  // Called once `stream` has no pending work (after a synchronize): its free
  // blocks then need no event before another stream reuses them.
  void ForgetStream(cudaStream_t stream);

  // Returns every cached (free) block to the driver.
  void ReleaseCached();

  // `stream` is being recorded into a graph between these two calls. Giving
  // blocks back synchronises the device, which would break the recording,
  // so the two never overlap: BeginCapture waits for a release in progress,
  // and a release waits for the recordings to end (each lasts one step's
  // host time). Meanwhile no other stream takes a block `stream` freed: the
  // event that would order it after `stream` would pull it into the
  // recording (cudaErrorStreamCaptureIsolation).
  void BeginCapture(cudaStream_t stream);
  void EndCapture(cudaStream_t stream);

  Stats stats() const;
  // Starts the peaks again from what is in use and reserved now (a
  // benchmark's timed steps).
  void ResetPeaks();

  // The size actually reserved for a request: buckets keep the number of
  // distinct sizes small so freed blocks fit later requests.
  static size_t RoundedSize(size_t bytes);

 private:
  struct FreeBlock {
    void* ptr;
    std::shared_ptr<CUstream_st> last_stream;  // null: no pending work
  };
  void Free(void* ptr, size_t size, std::shared_ptr<CUstream_st> stream);
  // Gives back cached blocks, the largest first, until at least `bytes`
  // went back or the cache is empty.
  void ReleaseCachedBytes(int64_t bytes);
  // Returns once no thread is between taking blocks out and freeing them.
  void WaitForReleases();
  void FreeBlocks(const std::vector<std::pair<void*, size_t>>& blocks);

  const int ordinal_;
  const int64_t reserve_limit_;
  mutable std::mutex mu_;
  // size -> free blocks of exactly that rounded size.
  std::map<size_t, std::vector<FreeBlock>> free_blocks_;
  int64_t releasing_ = 0;  // taken out of the cache, not yet freed
  std::condition_variable released_;
  int captures_ = 0;       // streams being recorded now
  std::set<cudaStream_t> capturing_streams_;  // which
  bool freeing_ = false;   // a thread is synchronising and freeing blocks
  std::condition_variable capture_or_free_done_;
  Stats stats_;
};

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ALLOCATOR_H_
