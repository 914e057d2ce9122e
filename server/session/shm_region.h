// ShmRegion: a same-host client's POSIX shared-memory object, opened by name
// and mapped read-write (te_server --enable_shm). A session owns its regions;
// a region is unmapped when the last owner lets it go. Thread-compatible.
//
// Contract:
//  1. Names are names, never paths: "/" followed by 1-200 of [A-Za-z0-9_.-],
//     with no ".." (CheckShmName). The object is opened without O_CREAT and
//     without following links; it must be a regular object of at least the
//     size asked for, which is what is mapped.
//  2. Every access goes through Read / Write, whose ranges the caller has
//     checked (CheckRange). A copy is guarded: if the client shrinks the
//     object under the mapping, the copy fails with FAILED_PRECONDITION
//     instead of the server dying of SIGBUS.
#ifndef TE_SERVER_SESSION_SHM_REGION_H_
#define TE_SERVER_SESSION_SHM_REGION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace te::session {

// OK for a valid object name; INVALID_ARGUMENT naming `field` otherwise.
absl::Status CheckShmName(const std::string& name, const std::string& field);

class ShmRegion {
 public:
  // Opens and maps `size` bytes of the object `name`. INVALID_ARGUMENT for a
  // bad name, a zero size, or an object smaller than `size` or not a plain
  // shared-memory object; NOT_FOUND when no such object exists on this host
  // (the client may be on another host); PERMISSION_DENIED when the server
  // may not open it; INTERNAL for a failed mapping.
  static absl::StatusOr<std::unique_ptr<ShmRegion>> Open(const std::string& name, uint64_t size);
  ~ShmRegion();
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }

  // OK when [offset, offset + bytes) lies inside the region; INVALID_ARGUMENT
  // naming `field` otherwise (without overflow for any offset).
  absl::Status CheckRange(uint64_t offset, uint64_t bytes, const std::string& field) const;

  // Guarded copies out of and into the region (contract 2); the range must
  // have passed CheckRange.
  absl::Status Read(uint64_t offset, void* dst, size_t bytes) const;
  absl::Status Write(uint64_t offset, const void* src, size_t bytes);

 private:
  ShmRegion(std::string name, void* base, uint64_t size)
      : name_(std::move(name)), base_(static_cast<char*>(base)), size_(size) {}

  const std::string name_;
  char* const base_;
  const uint64_t size_;
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_SHM_REGION_H_
