// A fake backend behind kernels/ops.h, for testing the session layer without
// kernels: FakeDevice makes streams (FakeOps) that record every op they are
// asked for, in order, on one FakeBackend shared by all of them, and compute
// nothing. Memory is real, zero-filled host memory, accounted as a real
// backend's is; Upload, Download, Copy and Fill move bytes, so requests and
// answers round-trip; every other op leaves its outputs as they were (zeros
// in fresh memory). Tests inject a failure into the n-th call of an op, hold
// an op until released (a call "running" for as long as the test wants), and
// read back the order of ops, which calls issued them, whether two ops of one
// stream ever overlapped, and how much memory is still held. Thread-safe.
#ifndef TE_SERVER_SESSION_TESTING_FAKE_OPS_H_
#define TE_SERVER_SESSION_TESTING_FAKE_OPS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/ops.h"

namespace te::session::testing {

// One op as the fake saw it.
struct FakeOpCall {
  int stream = 0;   // which FakeOps, numbered from 1 in creation order
  std::string op;   // "Gemm", "Upload", "Allocate", ...
  std::string tag;  // the issuing thread's CallTag when the op ran ("" for none)
};

class FakeBackend {
 public:
  // Names the ops the calling thread issues while it lives ("session a, call
  // 3"), so a test can tell which call issued which op. Nests.
  class CallTag {
   public:
    explicit CallTag(std::string tag);
    ~CallTag();
    CallTag(const CallTag&) = delete;
    CallTag& operator=(const CallTag&) = delete;

   private:
    std::string previous_;
  };

  // Every op issued so far, over all streams, in the order they ran.
  std::vector<FakeOpCall> calls() const;
  void ClearCalls();

  // The (skip + 1)-th call of `op` from now, on any stream, fails with
  // `status` and does nothing; later ones succeed. "Allocate" names memory
  // allocations. One failure armed per op name at a time.
  void FailOp(const std::string& op, absl::Status status, int skip = 0);
  // Whether an armed failure is still waiting for its call.
  bool failure_pending(const std::string& op) const;
  // Disarms every failure still waiting.
  void ClearFailures();

  // Calls of `op` (issued under CallTag `tag`; any tag when empty) wait,
  // counted in flight, before they do anything, until Unblock. WaitBlocked
  // returns once `n` calls wait (false if `timeout` passes first).
  void BlockOp(const std::string& op, const std::string& tag = "");
  void Unblock();
  bool WaitBlocked(int n, absl::Duration timeout = absl::Seconds(10)) const;

  // Bytes allocated by any stream and not yet freed (tensors may outlive
  // their stream: this counts until the last one goes).
  int64_t live_bytes() const;
  // The most ops ever running at once on one stream (1: a stream's ops never
  // overlapped), and the most streams ever running an op at once.
  int max_ops_in_flight_per_stream() const;
  int max_streams_in_flight() const;

 private:
  friend class FakeOps;
  friend class FakeDevice;
  int NewStream();
  // Records `op` on `stream`, waits while it is blocked, and returns its
  // armed failure (OK otherwise); every OK Enter is paired with an Exit.
  absl::Status Enter(int stream, const char* op);
  bool Blocks(const std::string& op, const std::string& tag) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Exit(int stream);
  void Allocated(int64_t bytes);
  void Freed(int64_t bytes);

  mutable absl::Mutex mu_;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<FakeOpCall> calls_ ABSL_GUARDED_BY(mu_);
  struct Failure {
    absl::Status status;
    int skip = 0;
  };
  std::map<std::string, Failure> failures_ ABSL_GUARDED_BY(mu_);
  std::string blocked_op_ ABSL_GUARDED_BY(mu_);
  std::string blocked_tag_ ABSL_GUARDED_BY(mu_);
  int blocked_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int> in_flight_ ABSL_GUARDED_BY(mu_);  // stream -> ops running
  int max_per_stream_ ABSL_GUARDED_BY(mu_) = 0;
  int max_streams_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// A Device whose streams are FakeOps on one FakeBackend. Its info is the
// CPU's ("cpu", no native FP8), so negotiation treats it as the CPU.
class FakeDevice : public Device {
 public:
  FakeDevice() : backend_(std::make_shared<FakeBackend>()) {}
  DeviceInfo info() const override;
  absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t memory_limit) override;
  FakeBackend& backend() const { return *backend_; }

 private:
  const std::shared_ptr<FakeBackend> backend_;
};

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_FAKE_OPS_H_
