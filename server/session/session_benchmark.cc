// Session::Benchmark: a layer's step timed on the device, in a
// StepTransaction that is never committed (session.h, contract 5).
#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"
#include "server/session/step_transaction.h"

namespace te::session {
namespace {

constexpr int kDefaultWarmupIters = 5;
constexpr int kDefaultTimingIters = 20;
constexpr int kMaxBenchmarkIters = 100000;

}  // namespace

absl::Status Session::Benchmark(const te::v1::BenchmarkRequest& request, const CallContext& call,
                                te::v1::BenchmarkResponse* response) {
  ASSIGN_OR_RETURN(const Target run,
                   Resolve(request.layer_id(), request.graph(), request.version()));
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  ASSIGN_OR_RETURN(const bool tf32,
                   layers::MatmulTf32(request.matmul_precision(), "matmul_precision"));
  const int warmup =
      request.warmup_iters() == 0 ? kDefaultWarmupIters : request.warmup_iters();
  const int timing =
      request.timing_iters() == 0 ? kDefaultTimingIters : request.timing_iters();
  if (warmup < 0 || warmup > kMaxBenchmarkIters) {
    return absl::InvalidArgumentError(absl::StrCat("warmup_iters: ", request.warmup_iters(),
                                                   " is outside [0, ", kMaxBenchmarkIters, "]"));
  }
  if (timing < 0 || timing > kMaxBenchmarkIters) {
    return absl::InvalidArgumentError(absl::StrCat("timing_iters: ", request.timing_iters(),
                                                   " is outside [0, ", kMaxBenchmarkIters, "]"));
  }
  const te::v1::MicroBatch& mb = request.inputs();
  if (mb.has_target()) {
    return absl::InvalidArgumentError(
        "inputs.target: the benchmark's step is vdot(y, dy); give dy instead");
  }
  ASSIGN_OR_RETURN(CheckedInputs checked,
                   CheckInputs(run, fp8 ? &*fp8 : nullptr, mb.x(), mb.extra_inputs(),
                               mb.has_attention_mask() ? &mb.attention_mask() : nullptr,
                               "inputs."));
  std::optional<CheckedTensor> dy_checked;
  if (!request.forward_only()) {
    if (!mb.has_dy()) {
      return absl::InvalidArgumentError("inputs.dy: required unless forward_only");
    }
    ASSIGN_OR_RETURN(dy_checked, CheckDy(checked, mb.dy(), "inputs.dy"));
  }
  ASSIGN_OR_RETURN(layers::LayerInputs inputs, MaterializeInputs(checked));
  Tensor dy;
  if (dy_checked) {
    ASSIGN_OR_RETURN(dy, Materialize(*ops_, *dy_checked));
  }
  // The benchmark's steps move a copy of the FP8 state and FP8 weight
  // copies of their own, and the transaction is never committed: the
  // session stays as it was (contract 5).
  ASSIGN_OR_RETURN(std::unique_ptr<StepTransaction> tx,
                   StepTransaction::Open(*this, StepTransaction::ReadOf(run), fp8, call,
                                         "Benchmark", StepTransaction::WeightCopies::kOwn));
  layers::ForwardOptions& opts = tx->options();
  opts.deterministic = request.deterministic();
  opts.dropout_seed = mb.dropout_seed();
  opts.tf32 = tf32;

  // Queued: the timed steps leave their values on the device (Step's
  // pending_value), so nothing waits for the device between them.
  const bool queued = request.queued();
  std::chrono::steady_clock::time_point timed_start;
  std::vector<double> step_ms;
  for (int it = 0; it < warmup + timing; ++it) {
    RETURN_IF_ERROR(call.StillWanted(
        absl::StrCat("Benchmark, after ", it, " of ", warmup + timing, " steps")));
    const bool timed_alone = !queued || it < warmup;
    if (timed_alone || it == warmup) RETURN_IF_ERROR(ops_->Synchronize());
    if (it == warmup) {
      // The memory figures cover the timed steps only, as JAX's peak after
      // a warmed-up loop: what the inputs and variables hold now, and the
      // most each step adds.
      ops_->ResetPeakBytesInUse();
      ops_->ResetDevicePeaks();
      timed_start = std::chrono::steady_clock::now();
    }
    const auto start = std::chrono::steady_clock::now();
    if (request.forward_only()) {
      layers::LayerOutputs out;
      std::unique_ptr<layers::SavedForward> unused;
      RETURN_IF_ERROR(tx->Forward(inputs, &out, &unused));
      RETURN_IF_ERROR(tx->EndStep());
    } else {
      // The same work as a ForwardBackward step, value included, so the
      // client's time per step compares with this one.
      double value = 0.0;
      layers::LayerGrads grads;
      Tensor pending_value;
      RETURN_IF_ERROR(tx->Step(inputs, dy, &value, &grads, /*target=*/nullptr,
                               /*loss_scale=*/1.0, timed_alone ? nullptr : &pending_value));
    }
    if (!timed_alone) continue;
    RETURN_IF_ERROR(ops_->Synchronize());
    const auto end = std::chrono::steady_clock::now();
    if (it >= warmup) {
      step_ms.push_back(std::chrono::duration<double, std::milli>(end - start).count());
    }
  }
  double queued_ms = 0.0;
  if (queued && timing > 0) {
    RETURN_IF_ERROR(ops_->Synchronize());
    queued_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                          timed_start).count();
  }
  response->set_steps(timing);
  response->set_device(device_.name);
  if (timing > 0) {
    const DeviceMemoryStats device = ops_->device_memory_stats();
    response->set_peak_bytes_in_use(ops_->peak_bytes_in_use());
    response->set_device_peak_bytes_in_use(device.peak_bytes_in_use);
    response->set_bytes_reserved(device.bytes_reserved);
    response->set_peak_bytes_reserved(device.peak_bytes_reserved);
  }
  if (queued && timing > 0) {
    response->set_mean_ms(queued_ms / timing);
    return absl::OkStatus();
  }
  if (step_ms.empty()) return absl::OkStatus();
  std::vector<double> sorted = step_ms;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  response->set_mean_ms(std::accumulate(sorted.begin(), sorted.end(), 0.0) / n);
  response->set_median_ms(n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]));
  response->set_min_ms(sorted.front());
  return absl::OkStatus();
}

}  // namespace te::session
