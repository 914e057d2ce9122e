// The kernel benchmarks' one timing loop: `warmup` untimed calls of step(),
// then the median of `reps` calls, each between two CUDA events on ops'
// stream (ms). -1 when a warm-up call fails (its message on stderr).
#ifndef TE_BENCH_KERNELS_MEDIAN_MS_H_
#define TE_BENCH_KERNELS_MEDIAN_MS_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_ops.h"

namespace te::bench {

inline double MedianMs(cuda::CudaOps* ops, int warmup, int reps,
                       const std::function<absl::Status()>& step) {
  for (int i = 0; i < warmup; ++i) {
    const absl::Status s = step();
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
      return -1;
    }
  }
  if (!ops->Synchronize().ok()) return -1;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    cudaEventRecord(start, ops->stream());
    (void)step();
    cudaEventRecord(stop, ops->stream());
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace te::bench

#endif  // TE_BENCH_KERNELS_MEDIAN_MS_H_
