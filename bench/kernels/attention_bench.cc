// Attention through CudaOps: the quickstart's causal self-attention (B4, S2048,
// H32, D128, bf16) forward and forward + backward, on cuDNN's fused path and
// on the unfused fallback, median of timed runs with CUDA events.
//
//   attention_bench [--batch=4] [--seq=2048] [--heads=32] [--dim=128] [--reps=10]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernels/bench_random.h"
#include "kernels/cuda/attention_internal.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace te {
namespace {

Tensor RandomBf16(cuda::CudaOps* ops, const Shape& shape, uint64_t seed) {
  Tensor t = *ops->Allocate(DType::kBF16, shape);
  std::vector<uint16_t> host(static_cast<size_t>(t.numel()));
  bench::LcgFloats random(seed * 0x9e3779b97f4a7c15ULL + 1);
  for (uint16_t& h : host) h = FloatToBf16(random.Next());
  if (!ops->Upload(host.data(), &t).ok()) std::abort();
  return t;
}

double MedianMs(cuda::CudaOps* ops, int reps, const std::function<absl::Status()>& step) {
  return bench::MedianMs(ops, 2, reps, step);
}

int Run(int64_t b, int64_t s, int64_t h, int64_t d, int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) return 1;
  auto owned = (*device)->NewOps(int64_t{64} << 30);
  if (!owned.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(owned->get());
  const Shape shape = {b, s, h, d};
  const Tensor q = RandomBf16(ops, shape, 1), k = RandomBf16(ops, shape, 2);
  const Tensor v = RandomBf16(ops, shape, 3), dout = RandomBf16(ops, shape, 4);
  Tensor out = *ops->Allocate(DType::kBF16, shape), lse = *ops->Allocate(DType::kF32, {b, h, s});
  Tensor dq = *ops->Allocate(DType::kBF16, shape), dk = *ops->Allocate(DType::kBF16, shape);
  Tensor dv = *ops->Allocate(DType::kBF16, shape);
  AttentionArgs args;
  args.mask = MaskType::kCausal;
  args.scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Causal: half the S x S scores; 4 matmuls of 2 S^2 D / 2 forward, 10 in total with backward
  // (two recomputed in backward), counting as FlashAttention does.
  const double fwd_flops = 4.0 * b * h * s * s * d / 2;
  const double step_flops = fwd_flops * 3.5;

  std::printf("\nAttention B%lld S%lld H%lld D%lld bf16 causal (median of %d)\n",
              static_cast<long long>(b), static_cast<long long>(s), static_cast<long long>(h),
              static_cast<long long>(d), reps);
  std::printf("| %-24s | %10s | %10s | %9s |\n", "path", "fwd ms", "fwd+bwd ms", "TFLOP/s");
  std::printf("|%s|%s|%s|%s|\n", std::string(26, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str(), std::string(11, '-').c_str());
  for (cuda::AttentionPath path : {cuda::AttentionPath::kAuto, cuda::AttentionPath::kFallbackOnly}) {
    cuda::SetAttentionPath(path);
    const int path_reps = path == cuda::AttentionPath::kAuto ? reps : 1;
    const int64_t before = cuda::CudnnAttentionCalls();
    const double fwd = MedianMs(ops, path_reps, [&] { return ops->AttentionForward(args, q, k, v, &out, &lse); });
    const double step = MedianMs(ops, path_reps, [&]() -> absl::Status {
      absl::Status st = ops->AttentionForward(args, q, k, v, &out, &lse);
      if (!st.ok()) return st;
      return ops->AttentionBackward(args, q, k, v, out, dout, lse, &dq, &dk, &dv, nullptr);
    });
    const bool fused = cuda::CudnnAttentionCalls() > before;
    std::printf("| %-24s | %10.3f | %10.3f | %9.1f |\n",
                path == cuda::AttentionPath::kAuto ? (fused ? "cuDNN fused" : "auto (fell back)")
                                                   : "unfused fallback",
                fwd, step, step_flops / (step * 1e-3) / 1e12);
  }
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  int64_t b = 4, s = 2048, h = 32, d = 128;
  int reps = 10;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--batch=", 8) == 0) b = std::atoll(argv[i] + 8);
    if (std::strncmp(argv[i], "--seq=", 6) == 0) s = std::atoll(argv[i] + 6);
    if (std::strncmp(argv[i], "--heads=", 8) == 0) h = std::atoll(argv[i] + 8);
    if (std::strncmp(argv[i], "--dim=", 6) == 0) d = std::atoll(argv[i] + 6);
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
  }
  return te::Run(b, s, h, d, reps);
}
