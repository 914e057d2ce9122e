// The memory a training step holds, through the session's own account (the
// Benchmark answer's peak_bytes_in_use, JAX's peak_bytes_in_use): the
// quickstart's TransformerLayer (section 6) at a reduced size with the
// quickstart's ratios (ffn = 4 hidden, head dim 64, causal, GELU, biases,
// bf16 params and input, attention dropout on), under FP8 DelayedScaling
// (layer_bench variant 6) and in bf16 (variant 7). Apart from the kept FP8
// weight copies (server/layers/fp8_weight_cache.h: both layouts of every
// kernel, one byte each, held across steps) and the MLP's fused gradient
// codes (below), an FP8 step must not hold more than the bf16 step: its activations are saved in one byte where bf16
// saves two, each in the one layout its backward reads, and go as the
// backward reads them. The copies themselves are two bytes per parameter
// for the whole step, more than this layer's activations save at any
// point (DISABLED_Fp8StepPeaksNoHigherThanBf16, the target).
//
// Why a smaller weight cache alone cannot reach the target (as measured
// before wi's output gradient was quantized in the GELU's backward pass,
// which now adds dh's codes, two bytes per [N, ffn] element, at the FP8
// peak): both steps peak in the MLP's backward, FP8 at wo's dgrad (dx [N,
// ffn] next to the pre-activation h, which TE too keeps in the compute dtype). There the
// one-byte codes of the two norms' outputs pay exactly for dy's codes and
// the attention output's transposed codes, so without any weight code at
// all the FP8 step peaks where bf16 does: at batch 4 (the quickstart's
// tokens-to-hidden ratio) 25.062 MiB against 25.061, the difference being
// FP8's scales and amax histories (SitesAtPeakWithout the
// "Fp8WeightCache::Quantize" allocations). That dgrad must read wo's codes
// in its own layout (ffn x hidden bytes), so FP8 stays above bf16 by at
// least those unless the MLP's backward holds less too (for instance wo's
// dgrad and the activation's backward in row blocks written over h, and dh
// quantized in one layout before the other is made from the codes); and no
// kept copy may live through that dgrad, which under Benchmark (no update)
// means quantizing every weight every step again. Each of these is a pass
// or a launch the step does not make today.
//
// The allocation ledger (testing/allocation_ledger.h) says what was live at
// each peak and which code made it; the test logs both tables.
#include <cstdint>
#include <cstring>
#include <iostream>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/testing/allocation_ledger.h"
#include "server/session/testing/requests.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::AllocationLedger;
using testing::NewLedgerCpuOps;

// Hidden 512 (quickstart 4096), ffn 2048 (16384), 8 heads of 64 (32 of
// 128), seq 256 (2048), batch 2 (4). Tokens per hidden unit are half the
// quickstart's (512 / 512 against 8192 / 4096), so weight-sized tensors
// weigh twice as much here as there; at batch 4 every tensor is 1/64 of
// the quickstart's: the peaks without the CPU's attention scratch (bf16
// 25.061, FP8 31.062 MiB) times 64 are 1604 and 1988 MiB, the quickstart's
// measured 1734 and 2114 less about 130 MiB that the GPU's account holds
// besides (its libraries' workspace).
struct StepSize {
  int64_t batch = 2, seq = 256, hidden = 512, ffn = 2048;
  int heads = 8;
};

te::v1::LayerSpec QuickstartTransformerLayer(const StepSize& c) {
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* t = spec.mutable_transformer_layer();
  t->set_hidden_size(c.hidden);
  t->set_mlp_hidden_size(c.ffn);
  t->set_num_attention_heads(c.heads);
  t->add_mlp_activations("gelu");
  t->set_self_attn_mask_type(te::v1::CAUSAL);
  t->set_layernorm_epsilon(1e-5f);
  t->set_use_bias(true);
  t->set_intermediate_dropout(0.0f);
  t->set_enable_relative_embedding(false);
  t->set_self_attn_bias_type(te::v1::NO_BIAS);
  t->set_hidden_dropout(0.0f);
  t->set_dtype(te::v1::PARAM_BFLOAT16);
  return spec;
}

te::v1::Recipe QuickstartRecipe() {
  te::v1::Recipe recipe;
  te::v1::DelayedScaling* d = recipe.mutable_delayed_scaling();
  d->set_fp8_format(te::v1::HYBRID);
  d->set_amax_history_len(16);
  d->set_amax_compute_algo("max");
  return recipe;
}

te::v1::Tensor RandomBf16(const std::vector<int64_t>& shape, uint64_t seed) {
  return testing::RandomFloats(shape, seed, 1.0f, te::v1::BFLOAT16);
}

struct StepMemory {
  int64_t peak = 0;         // Benchmark's peak_bytes_in_use over its timed steps
  int64_t ledger_peak = 0;  // the ledger's, over a second Benchmark's steps
  int64_t held = 0;         // what the session holds between calls
  int64_t kept_weights = 0; // the kept FP8 weight copies, live at the peak
  std::string report;       // the live set at the ledger's peak
  // The same without the CPU's packed-attention scratch (Ops' default
  // AttentionForwardPacked / AttentionBackwardPacked copies), which the CUDA
  // backend does not allocate (its attention scratch is the op workspace):
  // the step as the GPU's account would see it, workspace aside.
  int64_t device_like_peak = 0;
  std::string device_like_report;
};

// One session on the ledger's CPU stream: Init, then Benchmark twice (the
// first leaves the FP8 weight copies made, as any trained session has them).
StepMemory MeasureStep(bool fp8, const StepSize& c = StepSize()) {
  auto ledger = std::make_shared<AllocationLedger>();
  std::unique_ptr<Device> device = *OpenCpuDevice();
  Session session("step_memory", device->info(), NewLedgerCpuOps(ledger, int64_t{8} << 30),
                  SessionConfig(), te::v1::EMULATE,
                  fp8 ? std::optional<te::v1::Recipe>(QuickstartRecipe()) : std::nullopt);
  te::v1::Autocast autocast;
  autocast.set_enabled(fp8);

  te::v1::InitLayerRequest init;
  *init.mutable_spec() = QuickstartTransformerLayer(c);
  init.set_seed(42);
  init.set_input_dtype(te::v1::BFLOAT16);
  for (int64_t d : {c.batch, c.seq, c.hidden}) init.add_input_shape(d);
  *init.mutable_autocast() = autocast;
  te::v1::InitLayerResponse layer;
  const absl::Status initialised = session.InitLayer(init, &layer);
  EXPECT_TRUE(initialised.ok()) << initialised;

  te::v1::BenchmarkRequest bench;
  bench.set_layer_id(layer.layer_id());
  *bench.mutable_inputs()->mutable_x() = RandomBf16({c.batch, c.seq, c.hidden}, 42);
  *bench.mutable_inputs()->mutable_dy() = RandomBf16({c.batch, c.seq, c.hidden}, 43);
  bench.mutable_inputs()->set_dropout_seed(7);
  bench.set_deterministic(false);  // attention dropout on, as the quickstart times it
  *bench.mutable_autocast() = autocast;
  bench.set_warmup_iters(1);
  bench.set_timing_iters(1);

  StepMemory m;
  te::v1::BenchmarkResponse first, second;
  const absl::Status ran = session.Benchmark(bench, CallContext(), &first);
  EXPECT_TRUE(ran.ok()) << ran;
  m.held = session.bytes_in_use();
  ledger->ResetPeak();
  const absl::Status again = session.Benchmark(bench, CallContext(), &second);
  EXPECT_TRUE(again.ok()) << again;
  m.peak = second.peak_bytes_in_use();
  m.ledger_peak = ledger->peak_bytes();
  m.report = ledger->ReportAtPeak();
  m.kept_weights = ledger->BytesAtPeakFrom("Fp8WeightCache::Quantize");
  const std::vector<AllocationLedger::Site> sites = ledger->SitesAtPeakWithout(
      {"Ops::AttentionForwardPacked", "Ops::AttentionBackwardPacked"}, &m.device_like_peak);
  m.device_like_report = AllocationLedger::Report(m.device_like_peak, sites);
  EXPECT_EQ(first.peak_bytes_in_use(), second.peak_bytes_in_use())
      << "the steps after the first should be alike";
  return m;
}

std::string MiB(int64_t bytes) { return absl::StrFormat("%.3f MiB", bytes / 1048576.0); }

TEST(StepMemoryTest, LedgerSeesTheSessionsPeak) {
  const StepMemory bf16 = MeasureStep(/*fp8=*/false);
  // The ledger watches the same allocations as the session's account.
  EXPECT_EQ(bf16.ledger_peak, bf16.peak);
  EXPECT_GT(bf16.peak, bf16.held);
}

TEST(StepMemoryTest, Fp8StepHoldsNoMoreThanBf16BesidesKeptWeights) {
  const StepMemory bf16 = MeasureStep(/*fp8=*/false);
  const StepMemory fp8 = MeasureStep(/*fp8=*/true);
  std::cout << "bf16 step: held " << MiB(bf16.held) << ", " << bf16.report << "\n"
            << "FP8 step: held " << MiB(fp8.held) << ", kept weight copies "
            << MiB(fp8.kept_weights) << ", " << fp8.report << "\n"
            << "bf16 step without the CPU's attention scratch: " << bf16.device_like_report << "\n"
            << "FP8 step without the CPU's attention scratch: " << fp8.device_like_report
            << std::endl;
  EXPECT_EQ(fp8.ledger_peak, fp8.peak);
  // Both layouts of the four kernels: 2 bytes per parameter.
  const StepSize c;
  const int64_t params = c.hidden * 3 * c.hidden + c.hidden * c.hidden + 2 * c.hidden * c.ffn;
  EXPECT_EQ(fp8.kept_weights, 2 * params + 4 * 3 * 4);  // + scale_inv, scale, amax (f32) each
  EXPECT_LE(fp8.peak - fp8.kept_weights, bf16.peak)
      << "FP8 " << MiB(fp8.peak) << " (" << MiB(fp8.kept_weights) << " kept weight copies) against bf16 "
      << MiB(bf16.peak);
  // As the GPU's account sees the step: its peak is then in the MLP's
  // backward, where wi's output gradient is quantized straight from the
  // GELU's inputs (TE's dact-cast-transpose-dbias, Ops::
  // ActivationBackwardQuantizeTranspose): dact and the pre-activation h
  // beside dh's codes in both layouts, one byte each per [N, ffn] element,
  // where quantizing a bf16 dh written over dact held only two of the three.
  // Those codes are the FP8 step's price for two passes over [N, ffn] fewer
  // (1.1 to 1.5 ms of a 24 x 1024 LM step on the H100,
  // bench/results/2026-12-06-h100-final-2a4bad7/); past them the
  // activations' one-byte codes still pay for dy's.
  const int64_t dh_codes = 2 * c.batch * c.seq * c.ffn;
  EXPECT_LE(fp8.device_like_peak - fp8.kept_weights - dh_codes, bf16.device_like_peak)
      << "FP8 " << MiB(fp8.device_like_peak) << " against bf16 " << MiB(bf16.device_like_peak)
      << " without the CPU's attention scratch";
}

// The target: the whole FP8 step no higher than bf16, kept copies included.
// Needs no kept copy through the MLP's backward and less held there besides
// (see the top of this file); run with --gtest_also_run_disabled_tests.
TEST(StepMemoryTest, DISABLED_Fp8StepPeaksNoHigherThanBf16) {
  const StepMemory bf16 = MeasureStep(/*fp8=*/false);
  const StepMemory fp8 = MeasureStep(/*fp8=*/true);
  EXPECT_LE(fp8.peak, bf16.peak) << "FP8 " << MiB(fp8.peak) << " against bf16 " << MiB(bf16.peak);
}

}  // namespace
}  // namespace te::session
