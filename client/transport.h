// How tensors travel between the client library and te_server, and the
// client's side of same-host shared memory. Used by client.cc; callers pick a
// Transport through ClientOptions / SessionOptions.
//
//   kAuto          tensors under inline_tensor_bytes inline; larger ones
//                  through shared memory when the server is on this host and
//                  allows it (probed once per session, by registering a
//                  region), else through the PutTensor / GetTensor streams
//   kInline        inside the request and response messages (bounded by the
//                  message size limit)
//   kStream        the chunk streams, whatever the size
//   kSharedMemory  shared memory, whatever the size; FAILED_PRECONDITION
//                  when the server cannot use it
#ifndef TE_CLIENT_TRANSPORT_H_
#define TE_CLIENT_TRANSPORT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace te::client {

enum class Transport { kAuto, kInline, kStream, kSharedMemory };

// "auto", "inline", "stream", "shm".
const char* TransportName(Transport transport);
// The inverse; INVALID_ARGUMENT for another name.
absl::StatusOr<Transport> ParseTransport(const std::string& name);

// How one tensor of `bytes` goes, given the session's choice and whether
// shared memory works for it: kInline, kStream or kSharedMemory. For kAuto,
// `shm_usable` is asked only for tensors over `inline_bytes` (asking may
// register the session's first region).
Transport Choose(Transport chosen, size_t bytes, size_t inline_bytes,
                 const std::function<bool()>& shm_usable);

// Tensors moved by each transport (both directions), for callers and tests
// that want to see what kAuto chose.
struct TransportCounts {
  std::atomic<int64_t> inline_tensors{0};
  std::atomic<int64_t> streamed_tensors{0};
  std::atomic<int64_t> shm_tensors{0};
};

// One session's shared-memory regions on the client side: POSIX objects this
// client creates, registers with the server, and carves into blocks.
// Thread-safe.
//
// Contract:
//  1. A region is created when no region has room for a block: at least
//     min_region_bytes, its pages reserved up front (posix_fallocate, so a
//     small /dev/shm fails here, cleanly, not with SIGBUS on a later write),
//     registered, then unlinked: only the two mappings keep it, and nothing
//     is left behind if either process dies.
//  2. The first registration the server refuses (another host, no
//     --enable_shm, not permitted) makes the pool unavailable for good:
//     Allocate then answers FAILED_PRECONDITION with the server's reason, at
//     once. Other errors (a full queue, a lost connection) are returned as
//     they are, and a later Allocate tries again.
//  3. At most max_regions regions (the server allows 16 per session).
class SharedMemoryPool {
 public:
  // Registers a region (its object name and size) with the session; returns
  // the server's region id.
  using Registrar =
      std::function<absl::StatusOr<std::string>(const std::string& name, uint64_t size)>;

  SharedMemoryPool(Registrar registrar, size_t min_region_bytes, int max_regions = 8);
  ~SharedMemoryPool();  // unmaps; the server unmaps its side with the session
  SharedMemoryPool(const SharedMemoryPool&) = delete;
  SharedMemoryPool& operator=(const SharedMemoryPool&) = delete;

  struct Block {
    std::string region_id;
    uint64_t offset = 0;
    char* data = nullptr;
    size_t size = 0;
  };
  // A block of `bytes` (page-aligned). FAILED_PRECONDITION when shared
  // memory is unavailable (contract 2); RESOURCE_EXHAUSTED when no region
  // has room and no more may be made (the caller then streams).
  absl::StatusOr<Block> Allocate(size_t bytes);
  void Free(const Block& block);
  // The client's view of [offset, offset + bytes) of a region of this pool;
  // INVALID_ARGUMENT when it is not inside one.
  absl::StatusOr<const char*> View(const std::string& region_id, uint64_t offset,
                                   size_t bytes) const;

  // False once contract 2 applies.
  bool available() const;
  // Registers the first region if none exists yet: the probe of contract 2.
  absl::Status Probe();

 private:
  struct Region {
    std::string id;
    char* base = nullptr;
    size_t size = 0;
    std::map<uint64_t, size_t> free;  // offset -> bytes, coalesced
  };
  absl::StatusOr<Region*> NewRegionLocked(size_t at_least) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Registrar registrar_;
  const size_t min_region_bytes_;
  const int max_regions_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  absl::Status unavailable_ ABSL_GUARDED_BY(mu_);  // set by contract 2
};

}  // namespace te::client

#endif  // TE_CLIENT_TRANSPORT_H_
