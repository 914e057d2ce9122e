// The layer runs that the backend comparisons (layers_gpu_test and
// layers_backend_consistency_test) go through: every module of te.v1.LayerSpec
// at small, odd sizes (batch 2, seq 37: 74 tokens, not a multiple of 128;
// hidden 96 or 100, not a multiple of 64; 4 heads of head_dim 24, which
// cuDNN's head_dim % 8 == 0 allows; ffn 160), in f32 and bf16, and the modules
// with GEMMs also under DelayedScaling.
#ifndef TE_TESTS_GPU_LAYER_CASES_H_
#define TE_TESTS_GPU_LAYER_CASES_H_

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers::compare {

// One module configuration and the shapes of its inputs.
struct LayerCase {
  std::string name;  // "DotProductAttention_gqa": a test-name part
  te::v1::LayerSpec spec;
  Shape x_shape;
  std::vector<Shape> extra_shapes;  // k, v of bshd_bshd_bshd attention
  // Padding masks as valid lengths per batch row; empty: no mask.
  std::vector<int32_t> q_seqlens;
  std::vector<int32_t> kv_seqlens;
  // Several ops chained (norm + GEMM, attention + projections...): rounding
  // differences compound, so the comparison allows more (see the tests).
  bool composed = false;
  // Has GEMMs: also run under DelayedScaling.
  bool has_gemms = false;
  // Run at JAX's default matmul precision (ForwardOptions::tf32; the other
  // cases run HIGHEST): its float32 GEMMs are TensorFloat-32 on the GPU
  // against the CPU's exact float32: 10 mantissa bits, so its float32 runs
  // are judged by the bfloat16 tolerances.
  bool tf32 = false;
  // > 0: x is int32 token ids in [0, token_vocab) (an Embed), and the run's
  // dtype is the embedding's param_dtype; ids have no gradient to compare.
  int64_t token_vocab = 0;
};

// A case, the input dtype, whether FP8 (DelayedScaling, HYBRID, amax history
// 16) is on, and how many ForwardBackward steps to compare.
struct CaseRun {
  LayerCase layer_case;
  DType dtype = DType::kF32;
  bool fp8 = false;
  int steps = 1;
  std::string name() const;  // "TransformerLayer_default_bf16_fp8"
};

// Readable GoogleTest parameter printouts (the run's name).
void PrintTo(const CaseRun& run, std::ostream* os);

// Every case in f32 and bf16 (one step); the ones with GEMMs under FP8 too
// (two steps, so the second runs on updated scales).
std::vector<CaseRun> AllCaseRuns();

// The FP8 state check: small TransformerLayers (the default and the
// quickstart's arguments), bf16, FP8, 20 steps on the same inputs.
constexpr int kFp8StateSteps = 20;
std::vector<CaseRun> Fp8StateRuns();

// DelayedScaling(margin 0, HYBRID, amax_history_len, "max").
Fp8Recipe HybridDelayedScaling(int amax_history_len = 16);

}  // namespace te::layers::compare

#endif  // TE_TESTS_GPU_LAYER_CASES_H_
