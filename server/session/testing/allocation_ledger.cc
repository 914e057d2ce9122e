#include "server/session/testing/allocation_ledger.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "kernels/cpu/cpu_ops.h"

namespace te::session::testing {
namespace {

class LedgerCpuOps : public CpuOps {
 public:
  explicit LedgerCpuOps(std::shared_ptr<AllocationLedger> ledger) : ledger_(std::move(ledger)) {}

 protected:
  absl::StatusOr<std::shared_ptr<void>> AllocateBytes(size_t bytes) override {
    void* frames[32];
    const int n = backtrace(frames, 32);
    absl::StatusOr<std::shared_ptr<void>> memory = CpuOps::AllocateBytes(bytes);
    if (!memory.ok()) return memory;
    const int64_t id = ledger_->Add(static_cast<int64_t>(bytes),
                                    std::vector<void*>(frames + 1, frames + std::max(n, 1)));
    std::shared_ptr<void> held = *std::move(memory);
    void* data = held.get();
    return std::shared_ptr<void>(data, [held, id, ledger = ledger_](void*) mutable {
      ledger->Free(id);
      held.reset();
    });
  }

 private:
  std::shared_ptr<AllocationLedger> ledger_;
};

void* ModuleBase(const void* address) {
  Dl_info info;
  if (dladdr(address, &info) == 0) return nullptr;
  return info.dli_fbase;
}

// The main executable is position-independent (ET_DYN): addr2line wants
// offsets from its load address then, absolute addresses otherwise.
bool ExecutableIsPie() {
  std::ifstream exe("/proc/self/exe", std::ios::binary);
  char header[18] = {0};
  exe.read(header, sizeof(header));
  return exe.gcount() == sizeof(header) && header[16] == 3;  // e_type, little-endian
}

// "te::layers::Dense::RunGemm(te::Ops&, ...) const" -> "Dense::RunGemm".
std::string ShortName(std::string name) {
  name = absl::StrReplaceAll(name, {{"(anonymous namespace)::", ""}});
  const size_t paren = name.find('(');
  if (paren != std::string::npos) name.resize(paren);
  for (const char* prefix : {"te::layers::", "te::session::", "te::"}) {
    if (name.rfind(prefix, 0) == 0) {
      name = name.substr(std::string(prefix).size());
      break;
    }
  }
  return name;
}

// Function names for the executable's return addresses ("" where unknown).
std::map<void*, std::string> Symbolize(const std::set<void*>& addresses) {
  std::map<void*, std::string> names;
  void* const base = ModuleBase(reinterpret_cast<const void*>(&ModuleBase));
  if (base == nullptr) return names;
  const bool pie = ExecutableIsPie();
  // The binary's own path: in addr2line's process /proc/self is addr2line.
  char exe[4096] = {0};
  if (readlink("/proc/self/exe", exe, sizeof(exe) - 1) <= 0) return names;
  std::vector<void*> ours;
  std::string command = absl::StrCat("addr2line -C -f -e '", exe, "'");
  for (void* a : addresses) {
    if (ModuleBase(a) != base) continue;
    // The call instruction, not the one after it.
    const uintptr_t at = reinterpret_cast<uintptr_t>(a) - 1 -
                         (pie ? reinterpret_cast<uintptr_t>(base) : 0);
    absl::StrAppendFormat(&command, " 0x%x", at);
    ours.push_back(a);
  }
  if (ours.empty()) return names;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return names;
  char line[4096];
  for (void* a : ours) {
    if (fgets(line, sizeof(line), pipe) == nullptr) break;
    std::string function(line);
    while (!function.empty() && (function.back() == '\n' || function.back() == '\r')) {
      function.pop_back();
    }
    if (fgets(line, sizeof(line), pipe) == nullptr) break;  // file:line
    names[a] = function == "??" ? "" : function;
  }
  pclose(pipe);
  return names;
}

bool Skipped(const std::string& full) {
  return full.empty() || full.rfind("te::", 0) != 0 || full.find("AllocationLedger") != std::string::npos ||
         full.find("LedgerCpuOps") != std::string::npos || full.rfind("te::Ops::Allocate", 0) == 0;
}

}  // namespace

int64_t AllocationLedger::Add(int64_t bytes, std::vector<void*> stack) {
  absl::MutexLock lock(&mu_);
  const int64_t id = next_id_++;
  records_[id] = Allocation{bytes, std::move(stack)};
  live_[id] = true;
  events_.push_back({id, bytes});
  in_use_ += bytes;
  if (in_use_ > peak_) {
    peak_ = in_use_;
    at_peak_.clear();
    for (const auto& [live_id, live] : live_) at_peak_.push_back(live_id);
  }
  return id;
}

void AllocationLedger::Free(int64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(id);
  if (it == records_.end() || live_.erase(id) == 0) return;
  in_use_ -= it->second.bytes;
  events_.push_back({id, -it->second.bytes});
}

int64_t AllocationLedger::bytes_in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

int64_t AllocationLedger::peak_bytes() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

void AllocationLedger::ResetPeak() {
  absl::MutexLock lock(&mu_);
  peak_ = in_use_;
  at_peak_.clear();
  for (const auto& [id, live] : live_) at_peak_.push_back(id);
  at_reset_ = at_peak_;
  events_.clear();
  // What is neither live nor named by the new window is of no more use.
  for (auto it = records_.begin(); it != records_.end();) {
    it = live_.count(it->first) != 0 ? std::next(it) : records_.erase(it);
  }
}

std::vector<AllocationLedger::Site> AllocationLedger::Group(
    const std::vector<Allocation>& allocations, int frames) {
  std::set<void*> addresses;
  for (const Allocation& a : allocations) addresses.insert(a.stack.begin(), a.stack.end());
  const std::map<void*, std::string> names = Symbolize(addresses);
  std::map<std::string, Site> sites;
  for (const Allocation& a : allocations) {
    std::vector<std::string> chain;
    for (void* frame : a.stack) {
      auto name = names.find(frame);
      if (name == names.end() || Skipped(name->second)) continue;
      const std::string shown = ShortName(name->second);
      if (!chain.empty() && chain.back() == shown) continue;  // a lambda inside its function
      chain.push_back(shown);
      if (static_cast<int>(chain.size()) == frames) break;
    }
    const std::string where = chain.empty() ? "(outside te::)" : absl::StrJoin(chain, " < ");
    Site& site = sites[where];
    site.where = where;
    site.bytes += a.bytes;
    ++site.count;
  }
  std::vector<Site> out;
  for (auto& [where, site] : sites) out.push_back(std::move(site));
  std::sort(out.begin(), out.end(), [](const Site& a, const Site& b) {
    return a.bytes != b.bytes ? a.bytes > b.bytes : a.where < b.where;
  });
  return out;
}

std::vector<AllocationLedger::Site> AllocationLedger::SitesAtPeakWithout(
    const std::vector<std::string>& functions, int64_t* peak, int frames) const {
  std::map<int64_t, Allocation> records;
  std::vector<int64_t> at_reset;
  std::vector<std::pair<int64_t, int64_t>> events;
  {
    absl::MutexLock lock(&mu_);
    records = records_;
    at_reset = at_reset_;
    events = events_;
  }
  // An allocation is left out when the innermost te:: frame past
  // Ops::Allocate is one of `functions`.
  std::set<void*> addresses;
  for (const auto& [id, a] : records) addresses.insert(a.stack.begin(), a.stack.end());
  const std::map<void*, std::string> names = Symbolize(addresses);
  std::set<int64_t> left_out;
  for (const auto& [id, a] : records) {
    for (void* frame : a.stack) {
      auto name = names.find(frame);
      if (name == names.end() || Skipped(name->second)) continue;
      const std::string shown = ShortName(name->second);
      for (const std::string& f : functions) {
        if (shown == f) left_out.insert(id);
      }
      break;
    }
  }
  std::set<int64_t> live;
  int64_t in_use = 0;
  for (int64_t id : at_reset) {
    if (left_out.count(id) != 0) continue;
    live.insert(id);
    in_use += records.at(id).bytes;
  }
  int64_t best = in_use;
  std::set<int64_t> at_best = live;
  for (const auto& [id, delta] : events) {
    if (left_out.count(id) != 0) continue;
    if (delta > 0) {
      live.insert(id);
    } else {
      live.erase(id);
    }
    in_use += delta;
    if (in_use > best) {
      best = in_use;
      at_best = live;
    }
  }
  *peak = best;
  std::vector<Allocation> peak_set;
  for (int64_t id : at_best) peak_set.push_back(records.at(id));
  return Group(peak_set, frames);
}

std::vector<AllocationLedger::Site> AllocationLedger::SitesAtPeak(int frames) const {
  std::vector<Allocation> peak;
  {
    absl::MutexLock lock(&mu_);
    for (int64_t id : at_peak_) peak.push_back(records_.at(id));
  }
  return Group(peak, frames);
}

int64_t AllocationLedger::BytesAtPeakFrom(const std::string& function, int frames) const {
  int64_t bytes = 0;
  for (const Site& s : SitesAtPeak(frames)) {
    if (s.where.find(function) != std::string::npos) bytes += s.bytes;
  }
  return bytes;
}

std::string AllocationLedger::Report(int64_t peak, const std::vector<Site>& sites) {
  std::string out = absl::StrFormat("peak %d bytes (%.3f MiB) live:\n", peak, peak / 1048576.0);
  for (const Site& s : sites) {
    absl::StrAppendFormat(&out, "  %12d B  %3d x  %s\n", s.bytes, s.count, s.where);
  }
  return out;
}

std::string AllocationLedger::ReportAtPeak(int frames) const {
  return Report(peak_bytes(), SitesAtPeak(frames));
}

std::unique_ptr<Ops> NewLedgerCpuOps(std::shared_ptr<AllocationLedger> ledger,
                                     int64_t memory_limit) {
  auto ops = std::make_unique<LedgerCpuOps>(std::move(ledger));
  ops->set_memory_limit(memory_limit);
  return ops;
}

}  // namespace te::session::testing
