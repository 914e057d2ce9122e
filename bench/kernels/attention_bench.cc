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

#include "bench/kernels/attention_inputs.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace te {
namespace {

double MedianMs(cuda::CudaOps* ops, int reps, const std::function<absl::Status()>& step) {
  return bench::MedianMs(ops, 2, reps, step);
}

int Run(int64_t b, int64_t s, int64_t h, int64_t d, int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) return 1;
  auto owned = (*device)->NewOps(int64_t{64} << 30);
  if (!owned.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(owned->get());
  bench::AttentionTensors t = bench::MakeAttentionTensors(ops, DType::kBF16, b, s, h, d);
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
    const double fwd = MedianMs(
        ops, path_reps, [&] { return ops->AttentionForward(args, t.q, t.k, t.v, &t.out, &t.lse); });
    const double step = MedianMs(ops, path_reps, [&]() -> absl::Status {
      absl::Status st = ops->AttentionForward(args, t.q, t.k, t.v, &t.out, &t.lse);
      if (!st.ok()) return st;
      return ops->AttentionBackward(args, t.q, t.k, t.v, t.out, t.dout, t.lse, &t.dq, &t.dk, &t.dv,
                                    nullptr);
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
  te::bench::AttentionFlags f{4, 2048, 32, 128, 10};
  te::bench::ParseAttentionFlags(argc, argv, &f);
  return te::Run(f.batch, f.seq, f.heads, f.dim, f.reps);
}
