#include "server/session/shm_region.h"

#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace te::session {
namespace {

constexpr size_t kMaxNameChars = 200;

// ---- SIGBUS guard ----------------------------------------------------------------
// A client may ftruncate its object while the server has it mapped; touching
// the lost pages raises SIGBUS on the touching thread. A guarded copy marks
// its thread; the handler jumps back out of the copy, which then fails.
// Faults outside a guarded copy get the previous disposition (for SIGBUS
// that is the default: the process dies as it would without us).

thread_local sigjmp_buf* t_guarded_copy = nullptr;
struct sigaction g_previous_sigbus;

void OnSigbus(int, siginfo_t*, void*) {
  if (t_guarded_copy != nullptr) siglongjmp(*t_guarded_copy, 1);
  // Returning re-runs the faulting instruction under the previous action.
  sigaction(SIGBUS, &g_previous_sigbus, nullptr);
}

void InstallSigbusGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &g_previous_sigbus);
  });
}

absl::Status GuardedCopy(void* dst, const void* src, size_t bytes, const std::string& name) {
  sigjmp_buf jump;
  // savemask = 1: the jump restores the signal mask (SIGBUS is blocked inside
  // the handler).
  if (sigsetjmp(jump, 1) != 0) {
    t_guarded_copy = nullptr;
    return absl::FailedPreconditionError(
        absl::StrCat("shared memory ", name,
                     " shrank under its mapping (was it truncated?); register it "
                     "again at its new size"));
  }
  t_guarded_copy = &jump;
  // The fences keep the compiler from moving the copy out of the guard.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, bytes);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guarded_copy = nullptr;
  return absl::OkStatus();
}

bool IsNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || c == '-';
}

}  // namespace

absl::Status CheckShmName(const std::string& name, const std::string& field) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", name.substr(0, 64), name.size() > 64 ? "...'" : "'", " ", why,
                     "; a shared-memory name is '/' then 1-200 of [A-Za-z0-9_.-], never a path"));
  };
  if (name.empty() || name[0] != '/') return bad("does not start with '/'");
  if (name.size() < 2 || name.size() > 1 + kMaxNameChars) return bad("has a bad length");
  for (size_t i = 1; i < name.size(); ++i) {
    if (name[i] == '/') return bad("has a '/' after the first character");
    if (!IsNameChar(name[i])) return bad(absl::StrCat("has a character outside the set at ", i));
  }
  if (absl::StrContains(name, "..") || name == "/.") return bad("names a directory");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ShmRegion>> ShmRegion::Open(const std::string& name, uint64_t size) {
  if (absl::Status valid = CheckShmName(name, "name"); !valid.ok()) return valid;
  if (size == 0) return absl::InvalidArgumentError("size: 0; map at least one byte");
  // No O_CREAT: only an object the client made. O_NOFOLLOW: a link planted in
  // /dev/shm cannot point the server at a file of its own.
  const int fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) {
      return absl::NotFoundError(absl::StrCat(
          "name: no shared-memory object ", name,
          " on the server's host (a client on another host cannot use shared memory)"));
    }
    if (error == EACCES || error == EPERM) {
      return absl::PermissionDeniedError(
          absl::StrCat("name: the server may not open ", name, " read-write"));
    }
    if (error == ELOOP) {
      return absl::InvalidArgumentError(absl::StrCat("name: ", name, " is a link"));
    }
    return absl::InternalError(absl::StrCat("shm_open(", name, "): ", std::strerror(error)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("fstat(", name, "): ", std::strerror(error)));
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", name, " is not a plain shared-memory object"));
  }
  if (static_cast<uint64_t>(st.st_size) < size) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("size: ", size, " bytes, but ", name, " holds only ", st.st_size));
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  close(fd);  // the mapping keeps the object
  if (base == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("mmap(", name, ", ", size, " bytes): ", std::strerror(error)));
  }
  InstallSigbusGuard();
  return std::unique_ptr<ShmRegion>(new ShmRegion(name, base, size));
}

ShmRegion::~ShmRegion() { munmap(base_, size_); }

absl::Status ShmRegion::CheckRange(uint64_t offset, uint64_t bytes,
                                   const std::string& field) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", bytes, " bytes at offset ", offset,
                                                   " pass the end of region ", name_, " (", size_,
                                                   " bytes)"));
  }
  return absl::OkStatus();
}

absl::Status ShmRegion::Read(uint64_t offset, void* dst, size_t bytes) const {
  if (bytes == 0) return absl::OkStatus();
  return GuardedCopy(dst, base_ + offset, bytes, name_);
}

absl::Status ShmRegion::Write(uint64_t offset, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return GuardedCopy(base_ + offset, src, bytes, name_);
}

}  // namespace te::session
