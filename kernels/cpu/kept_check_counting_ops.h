// Test-only: the CPU backend, counting the kept FP8 weight-copy checks it is
// asked for (Ops::QuantizeTransposeKept): those that come as items of one
// QuantizeTransposeKeptMany (a forward's checks at its start) and those that
// come alone (a weight checked at its read).
#ifndef TE_KERNELS_CPU_KEPT_CHECK_COUNTING_OPS_H_
#define TE_KERNELS_CPU_KEPT_CHECK_COUNTING_OPS_H_

#include <cstdint>
#include <vector>

#include "kernels/cpu/cpu_ops.h"

namespace te {

struct KeptChecks {
  int64_t at_once = 0;  // QuantizeTransposeKeptMany's items
  int64_t alone = 0;    // QuantizeTransposeKept calls outside it
};

class KeptCheckCountingOps : public CpuOps {
 public:
  explicit KeptCheckCountingOps(KeptChecks* checks) : checks_(checks) {}

  absl::Status QuantizeTransposeKeptMany(const std::vector<KeptQuantizeItem>& items) override {
    checks_->at_once += static_cast<int64_t>(items.size());
    in_many_ = true;
    const absl::Status s = CpuOps::QuantizeTransposeKeptMany(items);
    in_many_ = false;
    return s;
  }
  absl::Status QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                     const KeptQuantization& kept, Tensor* y,
                                     Tensor* y_t) override {
    if (!in_many_) ++checks_->alone;
    return CpuOps::QuantizeTransposeKept(x, fp8, kept, y, y_t);
  }

 private:
  KeptChecks* checks_;
  bool in_many_ = false;
};

}  // namespace te

#endif  // TE_KERNELS_CPU_KEPT_CHECK_COUNTING_OPS_H_
