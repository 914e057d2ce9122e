// The small-head attention kernels against the general unfused fallback at
// Flax's quickstart attention (MultiHeadDotProductAttention, qkv_features 128
// over 32 heads: D 4, computed in float32, causal, dropout 0.1 on the
// weights), which cuDNN declines. Times forward and backward apart (CUDA
// events, median), next to two floors: the scores' FLOPs over the CUDA-core
// FP32 rate, and the bytes each pass must move over a device-to-device copy's
// bandwidth measured here. Also checks the two paths agree at this size.
//
//   attention_small_head_bench [--batch=4] [--seq=2048] [--heads=32] [--dim=4]
//                              [--dropout=0.1] [--reps=20] [--general_reps=1]
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
#include "kernels/ops.h"

namespace te {
namespace {

std::vector<float> Download(cuda::CudaOps* ops, const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.numel()));
  if (!ops->Download(t, host.data()).ok()) std::abort();
  return host;
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && a[i] == b[i]) continue;  // lse of rows with no key
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

double MedianMs(cuda::CudaOps* ops, int reps, const std::function<absl::Status()>& step) {
  return bench::MedianMs(ops, 1, reps, step);
}

int Run(int64_t b, int64_t s, int64_t h, int64_t d, float dropout, int reps, int general_reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) return 1;
  auto owned = (*device)->NewOps(int64_t{64} << 30);
  if (!owned.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(owned->get());

  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  // Hopper: 128 FP32 lanes per SM, an FMA counted as 2 FLOPs.
  const double fp32_rate = prop.multiProcessorCount * 128.0 * 2.0 * clock_khz * 1e3;
  const double bandwidth = bench::CopyBandwidth(ops);

  bench::AttentionTensors t = bench::MakeAttentionTensors(ops, DType::kF32, b, s, h, d);
  AttentionArgs args;
  args.mask = MaskType::kCausal;
  args.scale = 1.0f / std::sqrt(static_cast<float>(d));
  args.dropout_rate = dropout;
  args.dropout_seed = 42;

  // Causal: S (S + 1) / 2 visible scores per head. Forward: q.k and p.v, 2
  // FMAs of D each per score; backward: q.k, dout.v, dv, dk, dq, 5.
  const double scores = static_cast<double>(b) * h * s * (s + 1) / 2;
  const double fwd_flops = scores * 2 * 2 * d;
  const double bwd_flops = scores * 5 * 2 * d;
  const double tensor_bytes = static_cast<double>(b) * s * h * d * 4;
  const double rows_bytes = static_cast<double>(b) * h * s * 4;
  const double fwd_bytes = 4 * tensor_bytes + rows_bytes;  // q, k, v in; out, lse out
  // q, k, v, out, dout, lse in; dq, dk, dv out; row_dot out and in.
  const double bwd_bytes = 8 * tensor_bytes + 3 * rows_bytes;
  const double fwd_floor = std::max(fwd_flops / fp32_rate, fwd_bytes / bandwidth) * 1e3;
  const double bwd_floor = std::max(bwd_flops / fp32_rate, bwd_bytes / bandwidth) * 1e3;

  std::printf("\nAttention B%lld S%lld H%lld D%lld f32 causal dropout %.2f, %s (%d SMs, %.2f "
              "GHz)\n",
              static_cast<long long>(b), static_cast<long long>(s), static_cast<long long>(h),
              static_cast<long long>(d), dropout, prop.name, prop.multiProcessorCount,
              clock_khz * 1e-6);
  std::printf("FP32 CUDA-core rate %.1f TFLOP/s, copy bandwidth %.2f TB/s\n", fp32_rate * 1e-12,
              bandwidth * 1e-12);
  std::printf("floor: forward %.4f ms (%.2f GFLOP, %.1f MB), backward %.4f ms (%.2f GFLOP, "
              "%.1f MB)\n",
              fwd_floor, fwd_flops * 1e-9, fwd_bytes * 1e-6, bwd_floor, bwd_flops * 1e-9,
              bwd_bytes * 1e-6);

  struct Result {
    double fwd = -1, bwd = -1;
    std::vector<float> out, lse, dq, dk, dv;
    int64_t small_head_calls = 0, cudnn_calls = 0;
  };
  auto measure = [&](cuda::AttentionPath path, int path_reps) {
    cuda::SetAttentionPath(path);
    Result r;
    const int64_t small_before = cuda::SmallHeadAttentionCalls();
    const int64_t cudnn_before = cuda::CudnnAttentionCalls();
    r.fwd = MedianMs(ops, path_reps,
                     [&] { return ops->AttentionForward(args, t.q, t.k, t.v, &t.out, &t.lse); });
    r.bwd = MedianMs(ops, path_reps, [&] {
      return ops->AttentionBackward(args, t.q, t.k, t.v, t.out, t.dout, t.lse, &t.dq, &t.dk, &t.dv,
                                    nullptr);
    });
    r.small_head_calls = cuda::SmallHeadAttentionCalls() - small_before;
    r.cudnn_calls = cuda::CudnnAttentionCalls() - cudnn_before;
    r.out = Download(ops, t.out);
    r.lse = Download(ops, t.lse);
    r.dq = Download(ops, t.dq);
    r.dk = Download(ops, t.dk);
    r.dv = Download(ops, t.dv);
    return r;
  };
  // kAuto: cuDNN declines float32, so the dispatch's own choice is timed.
  const Result fast = measure(cuda::AttentionPath::kAuto, reps);
  const Result general = measure(cuda::AttentionPath::kGeneralFallbackOnly, general_reps);
  // Once more, for the spread between two measurements of the same code.
  const Result again = measure(cuda::AttentionPath::kAuto, reps);

  std::printf("| %-26s | %10s | %10s | %10s | %10s |\n", "path", "fwd ms", "bwd ms",
              "fwd/floor", "bwd/floor");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(28, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str());
  std::printf("| %-26s | %10.4f | %10.4f | %10s | %10s |\n", "floor", fwd_floor, bwd_floor, "1",
              "1");
  const char* fast_name = fast.small_head_calls > 0 ? "small-head (auto dispatch)"
                          : fast.cudnn_calls > 0    ? "cuDNN fused (auto)"
                                                    : "auto: general fallback";
  std::printf("| %-26s | %10.4f | %10.4f | %10.1f | %10.1f |\n", fast_name, fast.fwd, fast.bwd,
              fast.fwd / fwd_floor, fast.bwd / bwd_floor);
  std::printf("| %-26s | %10.4f | %10.4f | %10.1f | %10.1f |\n", "(the same, measured again)",
              again.fwd, again.bwd, again.fwd / fwd_floor, again.bwd / bwd_floor);
  std::printf("| %-26s | %10.4f | %10.4f | %10.1f | %10.1f |\n", "general unfused fallback",
              general.fwd, general.bwd, general.fwd / fwd_floor, general.bwd / bwd_floor);
  std::printf("speedup over the general fallback: forward %.1fx, backward %.1fx, both %.1fx\n",
              general.fwd / fast.fwd, general.bwd / fast.bwd,
              (general.fwd + general.bwd) / (fast.fwd + fast.bwd));
  std::printf("small-head vs general fallback, relative error: out %.2e lse %.2e dq %.2e dk %.2e "
              "dv %.2e\n",
              RelativeError(fast.out, general.out), RelativeError(fast.lse, general.lse),
              RelativeError(fast.dq, general.dq), RelativeError(fast.dk, general.dk),
              RelativeError(fast.dv, general.dv));
  cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  te::bench::AttentionFlags f{4, 2048, 32, 4, 20};
  te::bench::ParseAttentionFlags(argc, argv, &f);
  float dropout = 0.1f;
  int general_reps = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--dropout=", 10) == 0) dropout = std::atof(argv[i] + 10);
    if (std::strncmp(argv[i], "--general_reps=", 15) == 0) general_reps = std::atoi(argv[i] + 15);
  }
  return te::Run(f.batch, f.seq, f.heads, f.dim, dropout, f.reps, general_reps);
}
