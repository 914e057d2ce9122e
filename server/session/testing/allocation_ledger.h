// An accounting view of a stream's memory for tests and investigations: a CPU
// backend (the reference CpuOps, unchanged) whose every allocation is also
// written into an AllocationLedger with its size and the call stack that made
// it, so a test can ask what was live when bytes_in_use peaked and which
// layer code holds it ("Dense::RunGemm < Mlp::Forward": the MLP's output).
// The session's own account (Ops::bytes_in_use, peak_bytes_in_use, what
// Benchmark reports) is untouched: the ledger watches the same allocations
// from below Ops::Allocate, so its peak equals the stream's.
//
// Thread-safe. Stacks are symbolized (addr2line on the test binary) only when
// a report is asked for.
#ifndef TE_SERVER_SESSION_TESTING_ALLOCATION_LEDGER_H_
#define TE_SERVER_SESSION_TESTING_ALLOCATION_LEDGER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/ops.h"

namespace te::session::testing {

class AllocationLedger {
 public:
  struct Allocation {
    int64_t bytes = 0;
    std::vector<void*> stack;  // return addresses, innermost first
  };
  // What was live at the peak, grouped by the layer code that allocated it.
  struct Site {
    std::string where;  // the innermost te:: frames past Ops::Allocate, "f < caller < ..."
    int64_t bytes = 0;
    int count = 0;
  };

  // Called by the ledger's Ops (below Ops::Allocate): returns the
  // allocation's id for Free.
  int64_t Add(int64_t bytes, std::vector<void*> stack);
  void Free(int64_t id);

  int64_t bytes_in_use() const;
  int64_t peak_bytes() const;
  // Starts the peak again from what is live now (as Ops::ResetPeakBytesInUse).
  void ResetPeak();
  // The live set at the peak, largest site first (frames symbolized).
  std::vector<Site> SitesAtPeak(int frames = 4) const;
  // Bytes live at the peak that a site naming `function` made
  // ("Fp8WeightCache::Quantize": the kept FP8 weight copies).
  int64_t BytesAtPeakFrom(const std::string& function, int frames = 4) const;
  // The same, as a table for a test's log: bytes, count, site.
  std::string ReportAtPeak(int frames = 4) const;
  // The peak since the last ResetPeak and its live set as they would be
  // without the allocations any of `functions` makes itself (the innermost
  // te:: frame past Ops::Allocate): "Ops::AttentionBackwardPacked", the
  // CPU's packed-attention scratch, which the CUDA backend keeps in its
  // workspace instead.
  std::vector<Site> SitesAtPeakWithout(const std::vector<std::string>& functions, int64_t* peak,
                                       int frames = 4) const;
  static std::string Report(int64_t peak, const std::vector<Site>& sites);

 private:
  mutable absl::Mutex mu_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  static std::vector<Site> Group(const std::vector<Allocation>& allocations, int frames);

  // Every allocation live at the last ResetPeak or made since (a test
  // tool: it grows with the allocations of the window).
  std::map<int64_t, Allocation> records_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, bool> live_ ABSL_GUARDED_BY(mu_);  // the live ids
  std::vector<int64_t> at_peak_ ABSL_GUARDED_BY(mu_);   // sorted
  std::vector<int64_t> at_reset_ ABSL_GUARDED_BY(mu_);
  // Since the last ResetPeak, in order: (id, +bytes) made, (id, -bytes) freed.
  std::vector<std::pair<int64_t, int64_t>> events_ ABSL_GUARDED_BY(mu_);
};

// A CPU stream (the reference backend) with `memory_limit` bytes whose
// allocations are also recorded in `ledger`.
std::unique_ptr<Ops> NewLedgerCpuOps(std::shared_ptr<AllocationLedger> ledger,
                                     int64_t memory_limit);

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_ALLOCATION_LEDGER_H_
