// The FP8 cast-transpose (bf16 -> E4M3 in both layouts, with its amax) at
// the LM's and the quickstart's shapes: the product op (Ops::QuantizeTranspose:
// the wide 128 x 64 kernel at these shapes) against the candidates of
// cast_transpose_variants.h, in one process. Each candidate's y, y^T and
// amax are first checked byte for byte against the product op's; its time
// counts only if they match. Inputs rotate over enough copies (>= 512 MiB in
// all) that no launch finds its input in L2, as a training step's don't.
//
// Each row: the median of `reps` launches (CUDA events), GB/s of the bytes
// the op must move (2 read + 2 written an element), and that against the
// device-to-device copy bandwidth measured in the same run: the floor.
//
//   cast_transpose_bench [--reps=50]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/kernels/bench_random.h"
#include "bench/kernels/cast_transpose_variants.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace te {
namespace {

Tensor RandomBf16(Ops& ops, const Shape& shape, uint64_t seed) {
  Tensor t = *ops.Allocate(DType::kBF16, shape);
  std::vector<uint16_t> host(static_cast<size_t>(t.numel()));
  bench::LcgFloats random(seed * 6364136223846793005ULL + 1);
  for (uint16_t& h : host) h = FloatToBf16(4.0f * random.Next());
  (void)ops.Upload(host.data(), &t);
  return t;
}

struct Result {
  std::vector<uint8_t> y, y_t;
  float amax = 0, scale_inv = 0;
};

Result Read(Ops& ops, const Tensor& y, const Tensor& y_t, const Fp8Output& fp8) {
  Result r;
  r.y.resize(y.nbytes());
  r.y_t.resize(y_t.nbytes());
  (void)ops.Download(y, r.y.data());
  (void)ops.Download(y_t, r.y_t.data());
  (void)ops.Download(fp8.amax, &r.amax);
  (void)ops.Download(fp8.scale_inv, &r.scale_inv);
  return r;
}

bool Same(const Result& a, const Result& b) {
  return a.y == b.y && a.y_t == b.y_t && a.amax == b.amax && a.scale_inv == b.scale_inv;
}

int Run(int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", device.status().ToString().c_str());
    return 1;
  }
  auto ops_or = (*device)->NewOps(int64_t{64} << 30);
  if (!ops_or.ok()) return 1;
  auto& ops = static_cast<cuda::CudaOps&>(**ops_or);
  const double copy_gbs = bench::CopyBandwidth(&ops) / 1e9;
  std::printf("FP8 cast-transpose, bf16 -> E4M3, y and y^T and amax (median of %d; copy %.0f GB/s)\n",
              reps, copy_gbs);
  std::printf("| x shape | what | ms | GB/s | of copy | same bytes |\n");
  std::printf("|---|---|---:|---:|---:|---|\n");

  Tensor scale = *ops.Allocate(DType::kF32, {1});
  (void)ops.Fill(96.0f, &scale);  // some of |4 x| * 96 passes 448: saturation is exercised
  Tensor amax = *ops.Allocate(DType::kF32, {1}), scale_inv = *ops.Allocate(DType::kF32, {1});
  const Fp8Output fp8{scale, amax, scale_inv};
  cuda::GridFoldSlot* slot = nullptr;
  if (cudaMalloc(&slot, sizeof(*slot)) != cudaSuccess ||
      cudaMemset(slot, 0, sizeof(*slot)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc of the amax slot failed\n");
    return 1;
  }

  // The LM's (8192 tokens; hidden 1024, its qkv 3072, its MLP 4096) and the
  // quickstart's MLP output gradient (8192 x 16384).
  const std::vector<Shape> shapes = {{8192, 1024}, {8192, 3072}, {8192, 4096}, {8192, 16384}};
  int failures = 0;
  for (const Shape& shape : shapes) {
    const int64_t bytes = shape[0] * shape[1] * 2;
    const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{512} << 20) / bytes));
    std::vector<Tensor> xs;
    for (int i = 0; i < copies; ++i) xs.push_back(RandomBf16(ops, shape, 17 + i));
    Tensor y = *ops.Allocate(DType::kE4M3, shape);
    Tensor y_t = *ops.Allocate(DType::kE4M3, {shape[1], shape[0]});
    const std::string name = std::to_string(shape[0]) + " x " + std::to_string(shape[1]);
    const double moved = 4.0 * static_cast<double>(shape[0] * shape[1]);
    auto report = [&](const char* what, double ms, const char* same) {
      const double gbs = moved / (ms * 1e6);
      std::printf("| %s | %s | %.4f | %.0f | %.2f | %s |\n", name.c_str(), what, ms, gbs,
                  gbs / copy_gbs, same);
    };

    (void)ops.Fill(0.0f, &amax);
    if (!ops.QuantizeTranspose(xs[0], fp8, &y, &y_t).ok()) return 1;
    const Result want = Read(ops, y, y_t, fp8);
    int next = 0;
    report("product op (wide 128x64 tiles)", bench::MedianMs(&ops, 3, reps, [&] {
             return ops.QuantizeTranspose(xs[next++ % copies], fp8, &y, &y_t);
           }),
           "reference");

    for (bench::CastTransposeVariant v : bench::kCastTransposeVariants) {
      if (!bench::VariantFits(v, shape[0], shape[1])) continue;
      (void)ops.Fill(0.0f, &amax);
      (void)ops.Fill(0.0f, &y);
      (void)ops.Fill(0.0f, &y_t);
      const absl::Status s = bench::LaunchCastTransposeVariant(v, ops, xs[0], fp8, slot, &y, &y_t);
      if (!s.ok()) {
        std::fprintf(stderr, "%s\n", s.ToString().c_str());
        ++failures;
        continue;
      }
      const bool same = Same(Read(ops, y, y_t, fp8), want);
      if (!same) ++failures;
      report(bench::VariantName(v), bench::MedianMs(&ops, 3, reps, [&] {
               return bench::LaunchCastTransposeVariant(v, ops, xs[next++ % copies], fp8, slot,
                                                        &y, &y_t);
             }),
             same ? "yes" : "NO");
    }
  }
  // GELU's gradient to E5M2 in both layouts, as the FP8 MLP's backward makes
  // it: x the pre-activation, dy the gradient of GELU's output (the LM's MLP
  // at hidden 1024 and 2048, the quickstart's). 3 bytes read and 2 written
  // an element.
  std::printf("\nGELU gradient cast-transpose, bf16 x and dy -> E5M2 y and y^T and amax\n");
  std::printf("| x shape | what | ms | GB/s | of copy | same bytes |\n");
  std::printf("|---|---|---:|---:|---:|---|\n");
  for (const Shape& shape : std::vector<Shape>{{8192, 4096}, {8192, 8192}, {8192, 16384}}) {
    const int64_t bytes = shape[0] * shape[1] * 4;
    const int copies = static_cast<int>(std::max<int64_t>(2, (int64_t{512} << 20) / bytes));
    std::vector<Tensor> xs, dys;
    for (int i = 0; i < copies; ++i) {
      xs.push_back(RandomBf16(ops, shape, 101 + i));
      dys.push_back(RandomBf16(ops, shape, 303 + i));
    }
    Tensor y = *ops.Allocate(DType::kE5M2, shape);
    Tensor y_t = *ops.Allocate(DType::kE5M2, {shape[1], shape[0]});
    const std::string name = std::to_string(shape[0]) + " x " + std::to_string(shape[1]);
    const double moved = 5.0 * static_cast<double>(shape[0] * shape[1]);
    Result want;
    for (bench::GeluGradKernel kernel :
         {bench::GeluGradKernel::kWide, bench::GeluGradKernel::kWideBytes}) {
      const bool reference = kernel == bench::GeluGradKernel::kWide;
      (void)ops.Fill(0.0f, &amax);
      (void)ops.Fill(0.0f, &y);
      (void)ops.Fill(0.0f, &y_t);
      if (!bench::LaunchGeluGradCastTranspose(kernel, ops, xs[0], dys[0], fp8, slot, &y, &y_t)
               .ok()) {
        ++failures;
        continue;
      }
      const Result got = Read(ops, y, y_t, fp8);
      const bool same = reference || Same(got, want);
      if (reference) want = got;
      if (!same) ++failures;
      int next = 0;
      const double ms = bench::MedianMs(&ops, 3, reps, [&] {
        const int k = next++ % copies;
        return bench::LaunchGeluGradCastTranspose(kernel, ops, xs[k], dys[k], fp8, slot, &y, &y_t);
      });
      const double gbs = moved / (ms * 1e6);
      std::printf("| %s | %s | %.4f | %.0f | %.2f | %s |\n", name.c_str(),
                  bench::GeluGradKernelName(kernel), ms, gbs, gbs / copy_gbs,
                  reference ? "reference" : (same ? "yes" : "NO"));
    }
  }
  cudaFree(slot);
  if (failures > 0) std::printf("%d candidate(s) failed or wrote other bytes\n", failures);
  return failures > 0 ? 1 : 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  int reps = 50;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--reps=", 7) == 0) reps = std::atoi(argv[i] + 7);
  }
  return te::Run(reps);
}
