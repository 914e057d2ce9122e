// The kernel benchmarks' one timing loop: `warmup` untimed calls of step(),
// then the median of `reps` calls, each between two CUDA events on ops'
// stream (ms). -1 when a warm-up call fails (its message on stderr). And the
// bandwidth ceiling their memory-bound floors are over (CopyBandwidth).
#ifndef TE_BENCH_KERNELS_MEDIAN_MS_H_
#define TE_BENCH_KERNELS_MEDIAN_MS_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
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

// Device-to-device copy bandwidth measured now, bytes read plus bytes
// written per second (1 GiB each way, median of 10).
inline double CopyBandwidth(cuda::CudaOps* ops) {
  const int64_t n = int64_t{256} << 20;  // floats
  Tensor a = *ops->Allocate(DType::kF32, {n}), b = *ops->Allocate(DType::kF32, {n});
  const double ms = MedianMs(ops, 1, 10, [&]() -> absl::Status {
    cudaMemcpyAsync(b.data(), a.data(), static_cast<size_t>(n) * 4, cudaMemcpyDeviceToDevice,
                    ops->stream());
    return absl::OkStatus();
  });
  return 2.0 * static_cast<double>(n) * 4 / (ms * 1e-3);
}

}  // namespace te::bench

#endif  // TE_BENCH_KERNELS_MEDIAN_MS_H_
