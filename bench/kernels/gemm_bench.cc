// The GEMM ceiling through our own Gemm (cuBLASLt behind CudaOps): 8192^3 in
// bf16 and FP8 (E4M3 x E4M3, bf16 out), random data, median of timed runs with
// CUDA events on the op's stream. Prints one table.
//
//   gemm_bench [--size=8192] [--reps=20]
//
// FP8 rows: "TN" is the layout Hopper's FP8 kernels take (b given as [N, K]);
// "NN" includes the transposed copy of b that Gemm makes first.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "bench/kernels/bench_random.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace te {
namespace {

// Host bytes of n random values in [-1, 1) in `dtype` (a fast LCG: benchmark
// data need not be good randomness, only not constant).
std::vector<uint8_t> RandomBytes(DType dtype, int64_t n, uint64_t seed) {
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * DTypeSize(dtype));
  bench::LcgFloats random(seed * 6364136223846793005ULL + 1442695040888963407ULL);
  for (int64_t i = 0; i < n; ++i) {
    const float v = random.Next();
    switch (dtype) {
      case DType::kBF16: {
        const uint16_t h = FloatToBf16(v);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      case DType::kE4M3: bytes[i] = FloatToE4M3(v * 4.0f); break;
      default: std::memcpy(&bytes[i * 4], &v, 4); break;
    }
  }
  return bytes;
}

struct Row {
  std::string name;
  double ms = 0;
  double tflops = 0;
};

int Run(int64_t size, int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", std::string(device.status().message()).c_str());
    return 1;
  }
  auto ops_or = (*device)->NewOps(int64_t{64} << 30);
  if (!ops_or.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(ops_or->get());
  const int64_t m = size, n = size, k = size;
  const double flops = 2.0 * static_cast<double>(m) * n * k;

  auto upload = [&](DType dtype, Shape shape, uint64_t seed) {
    Tensor t = *ops->Allocate(dtype, shape);
    const std::vector<uint8_t> bytes = RandomBytes(dtype, t.numel(), seed);
    if (!ops->Upload(bytes.data(), &t).ok()) std::abort();
    return t;
  };
  const float one = 1.0f;
  Tensor scale_a = *ops->Allocate(DType::kF32, {1});
  Tensor scale_b = *ops->Allocate(DType::kF32, {1});
  (void)ops->Upload(&one, &scale_a);
  (void)ops->Upload(&one, &scale_b);

  std::vector<Row> rows;
  auto time_gemm = [&](const std::string& name, const Ops::GemmArgs& args, Tensor* out) {
    const double median = bench::MedianMs(ops, 3, reps, [&] { return ops->Gemm(args, out); });
    if (median < 0) {
      std::fprintf(stderr, "%s: failed (above)\n", name.c_str());
      return;
    }
    rows.push_back({name, median, flops / (median * 1e-3) / 1e12});
  };

  {
    Ops::GemmArgs args;
    args.a = upload(DType::kBF16, {m, k}, 1);
    args.b = upload(DType::kBF16, {k, n}, 2);
    Tensor out = *ops->Allocate(DType::kBF16, {m, n});
    time_gemm("bf16 NN (x[M,K] @ w[K,N])", args, &out);
    args.b = upload(DType::kBF16, {n, k}, 3);
    args.transpose_b = true;
    time_gemm("bf16 NT (x[M,K] @ w[N,K]^T)", args, &out);
  }
  {
    Ops::GemmArgs args;
    args.a = upload(DType::kE4M3, {m, k}, 4);
    args.a_scale_inv = scale_a;
    args.b = upload(DType::kE4M3, {n, k}, 5);
    args.b_scale_inv = scale_b;
    args.transpose_b = true;
    Tensor out = *ops->Allocate(DType::kBF16, {m, n});
    time_gemm("fp8 e4m3 TN, bf16 out", args, &out);
    args.b = upload(DType::kE4M3, {k, n}, 6);
    args.transpose_b = false;
    time_gemm("fp8 e4m3 NN (+ transpose of b)", args, &out);
  }

  std::printf("\nGEMM %lld^3 through CudaOps::Gemm (median of %d, random data)\n",
              static_cast<long long>(size), reps);
  std::printf("| %-34s | %9s | %8s |\n", "case", "ms", "TFLOP/s");
  std::printf("|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(11, '-').c_str(),
              std::string(10, '-').c_str());
  for (const Row& r : rows) {
    std::printf("| %-34s | %9.3f | %8.1f |\n", r.name.c_str(), r.ms, r.tflops);
  }
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  int64_t size = 8192;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--size=", 7) == 0) size = std::atoll(argv[i] + 7);
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
  }
  return te::Run(size, reps);
}
