// Every cuDNN engine config that can run the LM's causal self-attention
// (packed qkv [B, S, 3, H, D] bf16, as train_lm.py's layers run it), timed
// against the one the product takes (heuristic mode A's first that
// finalizes): heuristic modes A, B and FALLBACK, then each knob of mode A's
// first config set in turn to its other values. Four graphs: forward and
// backward, without and with TE's dense relative bias (the backward reads
// it, and the band kernel, timed with every candidate, computes the table's
// gradient). Each candidate's outputs are
// checked against the product's plan (max |difference|), so a faster config
// that computes something else shows.
//
//   cudnn_engine_probe [--batch=8] [--seq=1024] [--heads=16] [--dim=64] [--reps=20]
//                      [--dropout=0]
// --dropout=0.1 times the graphs with attention dropout on the probabilities, as the
// quickstart's TransformerLayer runs them (its size: --batch=4 --seq=2048 --heads=32
// --dim=128); the dense-bias graphs are then skipped.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernels/attention_inputs.h"
#include "bench/kernels/median_ms.h"
#include "kernels/cuda/attention_cudnn_graph.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"  // Bf16ToFloat
#include "kernels/ops.h"
#include "server/layers/attention_core.h"

namespace te {
namespace {

std::vector<float> HostCopy(cuda::CudaOps* ops, const Tensor& t) {
  std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
  if (!ops->Download(t, bits.data()).ok()) return {};
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = Bf16ToFloat(bits[i]);
  return out;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || a.empty()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

int Run(int64_t b, int64_t s, int64_t h, int64_t d, int reps, float dropout) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) return 1;
  auto owned = (*device)->NewOps(int64_t{64} << 30);
  if (!owned.ok()) return 1;
  auto* ops = dynamic_cast<cuda::CudaOps*>(owned->get());
  const DType dtype = DType::kBF16;
  const Tensor qkv = bench::RandomTensor(ops, dtype, {b, s, 3, h, d}, 1);
  const Tensor dout = bench::RandomTensor(ops, dtype, {b, s, h, d}, 2);
  const Tensor bias = bench::RandomTensor(ops, dtype, {h, s, s}, 3);
  Tensor out = *ops->Allocate(dtype, {b, s, h, d});
  Tensor lse = *ops->Allocate(DType::kF32, {b, h, s});
  Tensor dqkv = *ops->Allocate(dtype, {b, s, 3, h, d});

  Tensor dtable = *ops->Allocate(DType::kF32, {h, 32});
  const std::vector<int32_t> host_buckets = layers::RelativePositionBuckets(
      s, s, /*bidirectional=*/false, /*num_buckets=*/32, /*max_distance=*/128);
  RelativeBuckets relative;
  relative.buckets = *ops->Allocate(DType::kI32, {s, s});
  if (!ops->Upload(host_buckets.data(), &relative.buckets).ok()) return 1;
  relative.uniform_from = layers::UniformBucketDistance(host_buckets, s);

  AttentionArgs plain;
  plain.mask = MaskType::kCausal;
  plain.scale = 1.0f / std::sqrt(static_cast<float>(d));
  plain.dropout_rate = dropout;
  plain.dropout_seed = 1234;
  AttentionArgs biased = plain;
  biased.bias = bias;

  std::printf("cuDNN engine configs, causal self-attention B%lld S%lld H%lld D%lld bf16, "
              "packed qkv, dropout %g (median ms of %d; cuDNN %zu)\n",
              static_cast<long long>(b), static_cast<long long>(s), static_cast<long long>(h),
              static_cast<long long>(d), dropout, reps, cudnnGetVersion());
  for (const bool backward : {false, true}) {
    for (const bool with_bias : {false, true}) {
      if (with_bias && dropout > 0.0f) continue;
      const AttentionArgs& args = with_bias ? biased : plain;
      auto forward = [&] { return ops->AttentionForwardPacked(args, qkv, &out, &lse); };
      auto step = [&]() -> absl::Status {
        if (!backward) return forward();
        return with_bias ? ops->AttentionBackwardPackedRelative(args, qkv, out, dout, lse,
                                                                relative, &dqkv, &dtable)
                         : ops->AttentionBackwardPacked(args, qkv, out, dout, lse, &dqkv, nullptr);
      };
      const Tensor& result = backward ? dqkv : out;
      std::printf("\n%s, %s\n| candidate | ms | vs product | max |diff| | config |\n"
                  "| ---: | ---: | ---: | ---: | --- |\n",
                  backward ? "backward" : "forward", with_bias ? "dense bias" : "no bias");
      cuda::cudnn_graph::SetEngineCandidate(-1);
      ops->attention_plans().reset();
      if (!forward().ok()) return 1;
      const double product_ms = bench::MedianMs(ops, 2, reps, step);
      const std::vector<float> expected = HostCopy(ops, result);
      std::printf("| product | %.4f | 1.000 | 0 | %s |\n", product_ms,
                  cuda::cudnn_graph::LastEngineChoice().description.c_str());
      int refused = 0;
      for (int i = 0;; ++i) {
        // The forward stays the product's: a backward candidate reads the
        // same out and lse.
        cuda::cudnn_graph::SetEngineCandidate(-1);
        ops->attention_plans().reset();
        if (!forward().ok()) return 1;
        cuda::cudnn_graph::SetEngineCandidate(i);
        ops->attention_plans().reset();
        const absl::Status first = step();
        const cuda::cudnn_graph::EngineChoice choice = cuda::cudnn_graph::LastEngineChoice();
        if (i >= choice.candidates) break;
        if (!first.ok() || choice.description.rfind("engine", 0) != 0) {
          ++refused;
          continue;
        }
        // The fallback kernels would answer if cuDNN refused mid-way: the
        // plan is cached, so every timed call runs candidate i.
        const double ms = bench::MedianMs(ops, 2, reps, step);
        const double diff = MaxDiff(expected, HostCopy(ops, result));
        std::printf("| %d | %.4f | %.3f | %.3g | %s |\n", i, ms, ms / product_ms, diff,
                    choice.description.c_str());
      }
      std::printf("(%d more candidates refused by cuDNN)\n", refused);
    }
  }
  cuda::cudnn_graph::SetEngineCandidate(-1);
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  te::bench::AttentionFlags f{8, 1024, 16, 64, 20};
  te::bench::ParseAttentionFlags(argc, argv, &f);
  return te::Run(f.batch, f.seq, f.heads, f.dim, f.reps, f.dropout);
}
