// TE's relative-position bias through one causal self-attention as the LM of
// train_lm.py runs it (packed qkv [B, S, 3, H, D] bf16, TE's 32 causal T5
// buckets over 128 positions, the bias written in bf16): each piece the bias
// adds, timed alone (CUDA events, median), with its floor next to it.
//
//   bias written       RelativeBiasForward, [H, S, S] bf16 from the table
//   attention fwd      cuDNN, without and with the bias
//   attention bwd      the same, the table's gradient included (band kernel)
//   band kernel        RelativeBandTableGrad alone
//   split fwd, bwd     the far/band split: cuDNN bias-free on the far part, the
//                      band by distance (relative_band_split.cu)
//
//   relative_bias_bench [--batch=8] [--seq=1024] [--heads=16] [--dim=64] [--reps=20]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "bench/kernels/attention_inputs.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "server/layers/attention_core.h"

namespace te {
namespace {

constexpr int kNumBuckets = 32;  // TE's RelativePositionBiases defaults
constexpr int kMaxDistance = 128;

int Run(int64_t b, int64_t s, int64_t h, int64_t d, int reps) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) return 1;
  auto owned = (*device)->NewOps(int64_t{64} << 30);
  if (!owned.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(owned->get());
  const DType dtype = DType::kBF16;
  const Tensor qkv = bench::RandomTensor(ops, dtype, {b, s, 3, h, d}, 1);
  const Tensor dout = bench::RandomTensor(ops, dtype, {b, s, h, d}, 2);
  Tensor out = *ops->Allocate(dtype, {b, s, h, d});
  Tensor lse = *ops->Allocate(DType::kF32, {b, h, s});
  Tensor dqkv = *ops->Allocate(dtype, {b, s, 3, h, d});
  const Tensor table = bench::RandomTensor(ops, DType::kF32, {h, kNumBuckets}, 3);
  Tensor dtable = *ops->Allocate(DType::kF32, {h, kNumBuckets});

  // The buckets the LM's causal TransformerLayers make (the server's own
  // function), and where they settle.
  const std::vector<int32_t> host_buckets =
      layers::RelativePositionBuckets(s, s, /*bidirectional=*/false, kNumBuckets, kMaxDistance);
  RelativeBuckets relative;
  relative.buckets = *ops->Allocate(DType::kI32, {s, s});
  if (!ops->Upload(host_buckets.data(), &relative.buckets).ok()) return 1;
  relative.uniform_from = layers::UniformBucketDistance(host_buckets, s);
  Tensor bias = *ops->Allocate(dtype, {h, s, s});

  AttentionArgs plain;
  plain.mask = MaskType::kCausal;
  plain.scale = 1.0f / std::sqrt(static_cast<float>(d));
  AttentionArgs biased = plain;
  biased.bias = bias;

  const double bandwidth = bench::CopyBandwidth(ops);
  auto time = [&](const std::function<absl::Status()>& step) {
    return bench::MedianMs(ops, 2, reps, step);
  };
  auto forward = [&](const AttentionArgs& args) {
    return time([&] { return ops->AttentionForwardPacked(args, qkv, &out, &lse); });
  };
  auto backward = [&](const AttentionArgs& args, bool with_table) {
    if (!ops->AttentionForwardPacked(args, qkv, &out, &lse).ok()) return -1.0;
    return time([&]() -> absl::Status {
      if (with_table) {
        return ops->AttentionBackwardPackedRelative(args, qkv, out, dout, lse, relative, &dqkv,
                                                    &dtable);
      }
      return ops->AttentionBackwardPacked(args, qkv, out, dout, lse, &dqkv, nullptr);
    });
  };

  std::printf("\nRelative bias, causal self-attention B%lld S%lld H%lld D%lld bf16, packed qkv, "
              "band %lld (median of %d; copy bandwidth %.0f GB/s)\n",
              static_cast<long long>(b), static_cast<long long>(s), static_cast<long long>(h),
              static_cast<long long>(d), static_cast<long long>(relative.uniform_from), reps,
              bandwidth / 1e9);
  std::printf("| %-44s | %9s | %9s |\n", "what", "ms", "floor ms");
  std::printf("|%s|%s|%s|\n", std::string(46, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str());
  auto row = [](const char* what, double ms, double floor_ms) {
    if (floor_ms > 0) {
      std::printf("| %-44s | %9.4f | %9.4f |\n", what, ms, floor_ms);
    } else {
      std::printf("| %-44s | %9.4f | %9s |\n", what, ms, "-");
    }
  };

  // The bias: H S^2 bf16 written, the [S, S] int32 buckets read once per head
  // (from L2 after the first).
  const double bias_ms = time([&] {
    return ops->RelativeBiasForward(table, relative.buckets, Tensor(), &bias);
  });
  row("bias written (RelativeBiasForward)", bias_ms,
      static_cast<double>(h * s * s * 2 + s * s * 4) / bandwidth * 1e3);

  const double fwd_plain = forward(plain);
  const double fwd_biased = forward(biased);
  const double bwd_plain = backward(plain, false);
  const double bwd_biased = backward(biased, true);
  // The bias's bytes, read once: the causal half of [H, S, S] bf16.
  const double bias_read_ms = static_cast<double>(h * s * s) / bandwidth * 1e3;
  row("attention fwd, no bias", fwd_plain, -1);
  row("attention fwd, bias", fwd_biased, fwd_plain + bias_read_ms);
  row("attention bwd, no bias", bwd_plain, -1);
  row("attention bwd, bias, + table gradient", bwd_biased, bwd_plain + bias_read_ms);

  // The band kernel alone: S x band scores and dP recomputed per (b, h) on
  // tensor cores; it reads q, k, v, out and dout once (k, v over the band).
  cuda::QkvMemory memory;
  const int64_t row_elements = 3 * h * d;
  memory.q = qkv.data();
  memory.k = static_cast<const char*>(qkv.data()) + h * d * 2;
  memory.v = static_cast<const char*>(qkv.data()) + 2 * h * d * 2;
  memory.dtype = dtype;
  memory.q_token_stride = row_elements;
  memory.kv_token_stride = row_elements;
  AttentionShape shape;
  shape.batch = b;
  shape.q_seq = s;
  shape.kv_seq = s;
  shape.q_heads = h;
  shape.kv_heads = h;
  shape.head_dim = d;
  const absl::Status applies = cuda::RelativeBandApplies(biased, shape, memory, relative);
  if (!applies.ok()) {
    std::printf("band kernel does not apply: %s\n", std::string(applies.message()).c_str());
    return 1;
  }
  const double band_ms = time([&] {
    return cuda::RelativeBandTableGrad(ops, biased, shape, memory, out, dout, lse, relative,
                                       &dtable);
  });
  row("band kernel (table gradient)", band_ms,
      static_cast<double>(b * s * h * d * 2 * 5) / bandwidth * 1e3);

  // The far/band split (relative_band_split.cu): the bias named by its table,
  // applied by distance; nothing [H, S, S] made. Floors: the band kernels'
  // bytes, each row of q, k, v, out and dout read once, out (forward), dq,
  // dk and dv (backward) read and written once, on top of cuDNN's bias-free
  // pass.
  AttentionArgs by_table = plain;
  by_table.relative_bias.table = table;
  by_table.relative_bias.buckets = relative.buckets;
  by_table.relative_bias.uniform_from = relative.uniform_from;
  cuda::SetRelativeSplit(true);
  const int64_t split_calls = cuda::RelativeSplitCalls();
  const double fwd_split = forward(by_table);
  const double bwd_split = backward(by_table, true);
  cuda::SetRelativeSplit(false);
  if (cuda::RelativeSplitCalls() == split_calls) {
    std::printf("the split did not run\n");
    return 1;
  }
  const double plane_ms = static_cast<double>(b * s * h * d * 2) / bandwidth * 1e3;
  row("split fwd (cuDNN far + band)", fwd_split, fwd_plain + 5 * plane_ms);
  row("split bwd (cuDNN far + band + table)", bwd_split, bwd_plain + 11 * plane_ms);
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  te::bench::AttentionFlags f{8, 1024, 16, 64, 20};
  te::bench::ParseAttentionFlags(argc, argv, &f);
  return te::Run(f.batch, f.seq, f.heads, f.dim, f.reps);
}
