// The kernel benchmarks' inputs: a 64-bit LCG's high bits as floats in
// [-1, 1), one after another (benchmark data need not be good randomness,
// only not constant). Each benchmark seeds its state its own way.
#ifndef TE_BENCH_KERNELS_BENCH_RANDOM_H_
#define TE_BENCH_KERNELS_BENCH_RANDOM_H_

#include <cstdint>

namespace te::bench {

class LcgFloats {
 public:
  explicit LcgFloats(uint64_t state) : state_(state) {}
  float Next() {
    state_ = state_ * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<int64_t>(state_ >> 40) - (1 << 23)) / (1 << 23);
  }

 private:
  uint64_t state_;
};

}  // namespace te::bench

#endif  // TE_BENCH_KERNELS_BENCH_RANDOM_H_
