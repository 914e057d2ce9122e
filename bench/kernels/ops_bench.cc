// Bandwidth of the memory-bound CUDA ops at the quickstart's sizes (tokens
// 8192 = 4 x 2048, hidden 4096, MLP 16384), and the norms' and FP8
// activations' at the 24 x 1024 LM's (tokens 8192, hidden 1024, MLP 4096; rows
// named "LM"), bf16, random data. Each row: the
// median of timed runs of kBatch back-to-back calls (CUDA events on the op's
// stream around the batch, divided by kBatch: one call alone between events
// also timed its host-side launch work, several microseconds that a step
// overlaps with the previous kernel and that doubled the LM's 20 us norms),
// the floor (the bytes
// the op must move at least, inputs read once and outputs written once, at
// the ~4000 GB/s the H200's device-to-device copy reaches, ../shared/ENV.md),
// and the GB/s that time makes of those bytes.
//
//   ops_bench [--reps=50]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernels/bench_random.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"

namespace te {
namespace {

constexpr int64_t kTokens = 8192, kHidden = 4096, kMlp = 16384;
constexpr int kBatch = 10;

Tensor Random(Ops& ops, DType dtype, const Shape& shape, uint64_t seed) {
  Tensor t = *ops.Allocate(dtype, shape);
  std::vector<uint8_t> bytes(t.nbytes());
  bench::LcgFloats random(seed * 6364136223846793005ULL + 1);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = random.Next();
    if (dtype == DType::kBF16) {
      const uint16_t h = FloatToBf16(2.0f * v);
      std::memcpy(&bytes[i * 2], &h, 2);
    } else {
      const float f = 2.0f * v;
      std::memcpy(&bytes[i * 4], &f, 4);
    }
  }
  (void)ops.Upload(bytes.data(), &t);
  return t;
}

double MedianMs(cuda::CudaOps& ops, int reps, const std::function<absl::Status()>& op) {
  for (int i = 0; i < 3; ++i) {
    const absl::Status s = op();
    if (!s.ok()) {
      std::fprintf(stderr, "op failed: %s\n", s.ToString().c_str());
      return -1;
    }
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start, ops.stream());
    for (int k = 0; k < kBatch; ++k) (void)op();
    cudaEventRecord(stop, ops.stream());
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t / kBatch);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int Run(int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) {
    std::fprintf(stderr, "no GPU: %s\n", device.status().ToString().c_str());
    return 1;
  }
  auto ops_or = (*device)->NewOps(int64_t{64} << 30);
  if (!ops_or.ok()) return 1;
  Ops& ops = **ops_or;
  auto& cuda_ops = static_cast<cuda::CudaOps&>(ops);
  const DType bf16 = DType::kBF16;

  Tensor x = Random(ops, bf16, {kTokens, kHidden}, 1);
  Tensor dy = Random(ops, bf16, {kTokens, kHidden}, 2);
  Tensor gamma = Random(ops, bf16, {kHidden}, 3), beta = Random(ops, bf16, {kHidden}, 4);
  Tensor y = *ops.Allocate(bf16, {kTokens, kHidden});
  Tensor y8 = *ops.Allocate(DType::kE4M3, {kTokens, kHidden});
  Tensor mu = *ops.Allocate(DType::kF32, {kTokens}), rs = *ops.Allocate(DType::kF32, {kTokens});
  Tensor dx = *ops.Allocate(bf16, {kTokens, kHidden});
  Tensor dgamma = *ops.Allocate(bf16, {kHidden}), dbeta = *ops.Allocate(bf16, {kHidden});
  Tensor scale = *ops.Allocate(DType::kF32, {1}), amax = *ops.Allocate(DType::kF32, {1});
  Tensor scale_inv = *ops.Allocate(DType::kF32, {1});
  (void)ops.Fill(1.0f, &scale);
  const Fp8Output fp8{scale, amax, scale_inv};
  Tensor h = Random(ops, bf16, {kTokens, kMlp}, 5);
  Tensor h2 = Random(ops, bf16, {kTokens, 2 * kMlp}, 6);
  Tensor act = *ops.Allocate(bf16, {kTokens, kMlp});
  Tensor act8 = *ops.Allocate(DType::kE4M3, {kTokens, kMlp});
  Tensor act8_t = *ops.Allocate(DType::kE4M3, {kMlp, kTokens});
  Tensor dact = Random(ops, bf16, {kTokens, kMlp}, 7);
  Tensor dh = *ops.Allocate(bf16, {kTokens, kMlp});
  Tensor dh2 = *ops.Allocate(bf16, {kTokens, 2 * kMlp});
  Tensor mask = *ops.Allocate(DType::kBool, {kTokens, kHidden});
  Tensor bias_grad = *ops.Allocate(bf16, {kHidden});
  Tensor xt = *ops.Allocate(bf16, {kHidden, kTokens});
  Tensor y8_t = *ops.Allocate(DType::kE4M3, {kHidden, kTokens});
  Tensor residual_grad = Random(ops, bf16, {kTokens, kHidden}, 8);
  // Cast-transpose-dbias of a Dense backward's dy: [tokens, hidden] and [tokens, mlp].
  Tensor q5 = *ops.Allocate(DType::kE5M2, {kTokens, kHidden});
  Tensor q5_t = *ops.Allocate(DType::kE5M2, {kHidden, kTokens});
  Tensor q5_mlp = *ops.Allocate(DType::kE5M2, {kTokens, kMlp});
  Tensor q5_mlp_t = *ops.Allocate(DType::kE5M2, {kMlp, kTokens});
  Tensor dbias = *ops.Allocate(bf16, {kHidden}), dbias_mlp = *ops.Allocate(bf16, {kMlp});
  Tensor dbias_mlp_f32 = *ops.Allocate(DType::kF32, {kMlp});
  // The 24 x 1024 LM's q (or k), rotated in place as its attention does.
  Tensor rq = Random(ops, bf16, {8, 1024, 16, 64}, 9);
  const double rq_bytes = static_cast<double>(rq.nbytes()) * 2;
  // Its packed qkv, whose q and k the attention rotates in place.
  Tensor rqkv = Random(ops, bf16, {8, 1024, 3, 16, 64}, 10);
  const double rqk_bytes = static_cast<double>(rqkv.nbytes()) * 2 / 3 * 2;
  // The 24 x 1024 LM's norms and MLP activation.
  constexpr int64_t kLmHidden = 1024, kLmMlp = 4096;
  Tensor lx = Random(ops, bf16, {kTokens, kLmHidden}, 11);
  Tensor ldy = Random(ops, bf16, {kTokens, kLmHidden}, 12);
  Tensor lresidual = Random(ops, bf16, {kTokens, kLmHidden}, 13);
  Tensor lgamma = Random(ops, bf16, {kLmHidden}, 14), lbeta = Random(ops, bf16, {kLmHidden}, 15);
  Tensor ly = *ops.Allocate(bf16, {kTokens, kLmHidden});
  Tensor ly8 = *ops.Allocate(DType::kE4M3, {kTokens, kLmHidden});
  Tensor ly8_t = *ops.Allocate(DType::kE4M3, {kLmHidden, kTokens});
  Tensor ldx = *ops.Allocate(bf16, {kTokens, kLmHidden});
  Tensor ldgamma = *ops.Allocate(bf16, {kLmHidden}), ldbeta = *ops.Allocate(bf16, {kLmHidden});
  Tensor lh = Random(ops, bf16, {kTokens, kLmMlp}, 16);
  Tensor ldact = Random(ops, bf16, {kTokens, kLmMlp}, 17);
  Tensor lact8 = *ops.Allocate(DType::kE4M3, {kTokens, kLmMlp});
  Tensor lact8_t = *ops.Allocate(DType::kE4M3, {kLmMlp, kTokens});
  Tensor lq5 = *ops.Allocate(DType::kE5M2, {kTokens, kLmMlp});
  Tensor lq5_t = *ops.Allocate(DType::kE5M2, {kLmMlp, kTokens});
  Tensor ldbias = *ops.Allocate(DType::kF32, {kLmMlp});
  // The LM's dqkv [8192, 3 * 1024] in E5M2, both layouts.
  Tensor lq5_qkv = *ops.Allocate(DType::kE5M2, {kTokens, 3 * kLmHidden});
  Tensor lq5_qkv_t = *ops.Allocate(DType::kE5M2, {3 * kLmHidden, kTokens});
  const Tensor rqkv_rows = rqkv.Reshaped({kTokens, 3 * kLmHidden});
  // The 24 x 2048 LM's norm input, with its codes in both layouts.
  constexpr int64_t kWideLmHidden = 2048;
  Tensor wx = Random(ops, bf16, {kTokens, kWideLmHidden}, 18);
  Tensor wgamma = Random(ops, bf16, {kWideLmHidden}, 19);
  Tensor wbeta = Random(ops, bf16, {kWideLmHidden}, 20);
  Tensor wy8 = *ops.Allocate(DType::kE4M3, {kTokens, kWideLmHidden});
  Tensor wy8_t = *ops.Allocate(DType::kE4M3, {kWideLmHidden, kTokens});
  Tensor wmu = *ops.Allocate(DType::kF32, {kTokens}), wrs = *ops.Allocate(DType::kF32, {kTokens});
  RotaryArgs inverse;
  inverse.consecutive = true;
  inverse.inverse = true;
  const double lm_hid = static_cast<double>(kTokens) * kLmHidden;
  const double lm_mlp = static_cast<double>(kTokens) * kLmMlp;
  RotaryArgs alternate, consecutive;
  consecutive.consecutive = true;
  NormArgs ln;
  NormArgs rms;
  rms.type = NormType::kRMSNorm;

  struct Row {
    const char* name;
    double bytes;
    std::function<absl::Status()> op;
  };
  const double tok_hid = static_cast<double>(kTokens) * kHidden;
  const double tok_mlp = static_cast<double>(kTokens) * kMlp;
  const std::vector<Row> rows = {
      {"LayerNorm fwd bf16 -> bf16", tok_hid * 4,
       [&] { return ops.NormForward(ln, x, gamma, beta, &y, &mu, &rs, nullptr); }},
      {"LayerNorm fwd bf16 -> e4m3 + amax", tok_hid * 3,
       [&] { return ops.NormForward(ln, x, gamma, beta, &y8, &mu, &rs, &fp8); }},
      {"LayerNorm fwd bf16 -> e4m3 + y_t (NormForwardTransposed)", tok_hid * 4,
       [&] { return ops.NormForwardTransposed(ln, x, gamma, beta, fp8, &y8, &y8_t, &mu, &rs); }},
      {"LayerNorm bwd bf16", tok_hid * 6,
       [&] { return ops.NormBackward(ln, dy, x, mu, rs, gamma, &dx, &dgamma, &dbeta); }},
      {"LayerNorm bwd bf16 + residual_grad", tok_hid * 8,
       [&] {
         return ops.NormBackward(ln, dy, x, mu, rs, gamma, &dx, &dgamma, &dbeta, residual_grad);
       }},
      {"RMSNorm fwd bf16 -> bf16", tok_hid * 4,
       [&] { return ops.NormForward(rms, x, gamma, Tensor(), &y, nullptr, &rs, nullptr); }},
      {"RMSNorm bwd bf16", tok_hid * 6,
       [&] { return ops.NormBackward(rms, dy, x, Tensor(), rs, gamma, &dx, &dgamma, nullptr); }},
      {"GELU fwd bf16 [8192,16384]", tok_mlp * 4,
       [&] { return ops.ActivationForward({Activation::kGelu}, h, &act, nullptr); }},
      {"GELU fwd -> e4m3 + amax", tok_mlp * 3,
       [&] { return ops.ActivationForward({Activation::kGelu}, h, &act8, &fp8); }},
      {"GELU fwd -> e4m3 + y_t (ActivationForwardTransposed)", tok_mlp * 4,
       [&] {
         return ops.ActivationForwardTransposed({Activation::kGelu}, h, fp8, &act8, &act8_t);
       }},
      {"GELU bwd bf16", tok_mlp * 6,
       [&] { return ops.ActivationBackward({Activation::kGelu}, dact, h, &dh); }},
      // The CUDA kernel reads dy and writes no dx, so dact stays as it was.
      {"GELU bwd -> e5m2 + y_t + dbias (ActivationBackwardQuantizeTranspose)", tok_mlp * 6,
       [&] {
         return ops.ActivationBackwardQuantizeTranspose({Activation::kGelu}, &dact, h, fp8,
                                                        &q5_mlp, &q5_mlp_t, &dbias_mlp_f32);
       }},
      {"SwiGLU fwd bf16 [8192,2x16384]", tok_mlp * 6,
       [&] {
         return ops.ActivationForward({Activation::kSilu, Activation::kLinear}, h2, &act, nullptr);
       }},
      {"SwiGLU bwd bf16", tok_mlp * 10,
       [&] {
         return ops.ActivationBackward({Activation::kSilu, Activation::kLinear}, dact, h2, &dh2);
       }},
      {"Quantize bf16 -> e4m3 + amax", tok_hid * 3, [&] { return ops.Quantize(x, fp8, &y8); }},
      {"QuantizeTranspose bf16 -> e5m2 + y_t", tok_hid * 4,
       [&] { return ops.QuantizeTranspose(dy, fp8, &q5, &q5_t); }},
      {"QuantizeTransposeDbias bf16 -> e5m2 + y_t + dbias", tok_hid * 4,
       [&] { return ops.QuantizeTransposeDbias(dy, fp8, &q5, &q5_t, &dbias); }},
      {"QuantizeTransposeDbias [8192,16384] bf16 -> e5m2", tok_mlp * 4,
       [&] { return ops.QuantizeTransposeDbias(dact, fp8, &q5_mlp, &q5_mlp_t, &dbias_mlp); }},
      {"Cast bf16 -> bf16", tok_hid * 4, [&] { return ops.Cast(x, &y); }},
      {"Dropout fwd 0.1 + mask", tok_hid * 5,
       [&] { return ops.DropoutForward(0.1f, 42, x, &y, &mask); }},
      {"SumRows (dbias) bf16", tok_hid * 2, [&] { return ops.SumRows(dx, &bias_grad); }},
      {"Permute [8192,4096] -> [4096,8192]", tok_hid * 4,
       [&] { return ops.Permute(x, {1, 0}, &xt); }},
      {"Rotary bf16 [8,1024,16,64] alternate, in place", rq_bytes,
       [&] { return ops.Rotary(alternate, rq, &rq); }},
      {"Rotary bf16 [8,1024,16,64] consecutive, in place", rq_bytes,
       [&] { return ops.Rotary(consecutive, rq, &rq); }},
      {"RotaryQkInPlace bf16 [8,1024,3,16,64] alternate", rqk_bytes,
       [&] { return ops.RotaryQkInPlace(alternate, &rqkv); }},
      {"LM LayerNorm fwd bf16 -> bf16 [8192,1024]", lm_hid * 4,
       [&] { return ops.NormForward(ln, lx, lgamma, lbeta, &ly, &mu, &rs, nullptr); }},
      {"LM LayerNorm fwd bf16 -> e4m3 + y_t (NormForwardTransposed)", lm_hid * 4,
       [&] {
         return ops.NormForwardTransposed(ln, lx, lgamma, lbeta, fp8, &ly8, &ly8_t, &mu, &rs);
       }},
      {"LM 2048 LayerNorm fwd bf16 -> e4m3 + y_t [8192,2048]", lm_hid * 2 * 4,
       [&] {
         return ops.NormForwardTransposed(ln, wx, wgamma, wbeta, fp8, &wy8, &wy8_t, &wmu, &wrs);
       }},
      {"LM LayerNorm bwd bf16 + residual_grad", lm_hid * 8,
       [&] {
         return ops.NormBackward(ln, ldy, lx, mu, rs, lgamma, &ldx, &ldgamma, &ldbeta,
                                 lresidual);
       }},
      {"LM GELU fwd -> e4m3 + y_t [8192,4096]", lm_mlp * 4,
       [&] {
         return ops.ActivationForwardTransposed({Activation::kGelu}, lh, fp8, &lact8, &lact8_t);
       }},
      {"LM dqkv: RotaryQkInPlace, then QuantizeTranspose -> e5m2 + y_t", lm_hid * 3 * 4,
       [&] {
         const absl::Status s = ops.RotaryQkInPlace(inverse, &rqkv);
         return s.ok() ? ops.QuantizeTranspose(rqkv_rows, fp8, &lq5_qkv, &lq5_qkv_t) : s;
       }},
      {"LM dqkv: RotaryQkQuantizeTranspose -> e5m2 + y_t (one pass)", lm_hid * 3 * 4,
       [&] {
         return ops.RotaryQkQuantizeTranspose(inverse, &rqkv, fp8, &lq5_qkv, &lq5_qkv_t,
                                              nullptr);
       }},
      {"LM GELU bwd -> e5m2 + y_t + dbias", lm_mlp * 6,
       [&] {
         return ops.ActivationBackwardQuantizeTranspose({Activation::kGelu}, &ldact, lh, fp8,
                                                        &lq5, &lq5_t, &ldbias);
       }},
  };
  std::printf(
      "| op | ms | floor ms (min bytes at 4000 GB/s) | GB/s (min bytes) | of 4000 GB/s |\n"
      "| --- | --- | --- | --- | --- |\n");
  for (const Row& row : rows) {
    const double ms = MedianMs(cuda_ops, reps, row.op);
    const double gbs = row.bytes / (ms * 1e-3) / 1e9;
    const double floor_ms = row.bytes / 4000e9 * 1e3;
    std::printf("| %s | %.4f | %.4f | %.0f | %.0f%% |\n", row.name, ms, floor_ms, gbs,
                gbs / 40.0);
  }
  return 0;
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
