#include "client/speedometer.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

absl::Status CheckIters(const SpeedometerOptions& options) {
  if (options.warmup_iters < 0 || options.timing_iters <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("options: warmup_iters ", options.warmup_iters,
                                                   " must be >= 0 and timing_iters ", options.timing_iters,
                                                   " must be > 0"));
  }
  if (options.pipeline_depth < 1) {
    return absl::InvalidArgumentError(absl::StrCat("options.pipeline_depth: ", options.pipeline_depth,
                                                   " steps in flight; give at least 1"));
  }
  if (options.queued && !options.server_side) {
    return absl::InvalidArgumentError("options.queued: steps are queued on the server; set server_side too");
  }
  return absl::OkStatus();
}

// One step sent; waiting on it returns the server's status for it.
using SentStep = std::function<absl::Status()>;

// Runs warmup, then the timed steps, up to pipeline_depth in flight (the
// warmup's all answered before the clock starts), timed with the wall clock
// as the quickstart's time.time() around its loop: the mean is the loop's
// time over the steps, the median that of the intervals between answers.
absl::StatusOr<SpeedometerResult> TimeSteps(const SpeedometerOptions& options,
                                            const std::function<SentStep(int step)>& send) {
  const size_t depth = static_cast<size_t>(options.pipeline_depth);
  std::deque<SentStep> in_flight;
  int n = 0;
  auto wait_oldest = [&]() -> absl::Status {
    SentStep oldest = std::move(in_flight.front());
    in_flight.pop_front();
    return oldest();
  };
  for (int i = 0; i < options.warmup_iters; ++i) {
    if (in_flight.size() >= depth) RETURN_IF_ERROR(wait_oldest());
    in_flight.push_back(send(n++));
  }
  while (!in_flight.empty()) RETURN_IF_ERROR(wait_oldest());
  std::vector<double> ms;
  const absl::Time start = absl::Now();
  absl::Time last = start;
  auto answered = [&]() -> absl::Status {
    RETURN_IF_ERROR(wait_oldest());
    const absl::Time now = absl::Now();
    ms.push_back(absl::ToDoubleMilliseconds(now - last));
    last = now;
    return absl::OkStatus();
  };
  for (int i = 0; i < options.timing_iters; ++i) {
    if (in_flight.size() >= depth) RETURN_IF_ERROR(answered());
    in_flight.push_back(send(n++));
  }
  while (!in_flight.empty()) RETURN_IF_ERROR(answered());
  SpeedometerResult result;
  result.mean_ms = absl::ToDoubleMilliseconds(last - start) / options.timing_iters;
  std::sort(ms.begin(), ms.end());
  result.median_ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  result.steps = options.timing_iters;
  result.timed_by = "client";
  return result;
}

void Report(const SpeedometerOptions& options, const SpeedometerResult& result) {
  if (!options.print) return;
  std::cout << "Mean time: " << result.mean_ms << " ms" << std::endl;
  if (options.server_side) {
    constexpr double kMiB = 1 << 20;
    std::cout << "Peak memory: " << result.peak_bytes_in_use / kMiB << " MiB in use, "
              << result.peak_bytes_reserved / kMiB << " MiB reserved" << std::endl;
  }
}

absl::StatusOr<SpeedometerResult> TimeModule(Session& session, const Variables& vars, const HostTensor& x,
                                             const HostTensor& dy, const SpeedometerOptions& options,
                                             std::vector<std::string>* uploaded) {
  ASSIGN_OR_RETURN(ResidentTensor x_resident, session.Put(x));
  uploaded->push_back(x_resident.id);
  ASSIGN_OR_RETURN(ResidentTensor dy_resident, session.Put(dy));
  uploaded->push_back(dy_resident.id);
  te::v1::MicroBatch batch;
  *batch.mutable_x() = x_resident.ToProto();
  *batch.mutable_dy() = dy_resident.ToProto();
  if (options.attention_mask.has_value()) {
    ASSIGN_OR_RETURN(ResidentTensor mask, session.Put(*options.attention_mask));
    uploaded->push_back(mask.id);
    *batch.mutable_attention_mask() = mask.ToProto();
  }
  const te::v1::Autocast autocast = ToProto(Autocast::Current());
  const te::v1::Precision precision = ToProto(DefaultMatmulPrecision::Current());

  if (options.server_side) {
    te::v1::BenchmarkRequest request;
    request.set_layer_id(vars.layer_id);
    batch.set_dropout_seed(options.dropout_seed);
    *request.mutable_inputs() = batch;
    request.set_deterministic(options.deterministic);
    *request.mutable_autocast() = autocast;
    request.set_matmul_precision(precision);
    // 0 means the server's default; ask for exactly what was asked of us.
    request.set_warmup_iters(std::max(options.warmup_iters, 1));
    request.set_timing_iters(options.timing_iters);
    request.set_queued(options.queued);
    ASSIGN_OR_RETURN(te::v1::BenchmarkResponse response, session.Benchmark(std::move(request)));
    SpeedometerResult result;
    result.mean_ms = response.mean_ms();
    result.median_ms = response.median_ms();
    result.steps = response.steps();
    result.timed_by = response.device();
    result.peak_bytes_in_use = response.peak_bytes_in_use();
    result.bytes_reserved = response.bytes_reserved();
    result.peak_bytes_reserved = response.peak_bytes_reserved();
    return result;
  }

  te::v1::ForwardBackwardRequest request;
  request.set_layer_id(vars.layer_id);
  *request.add_micro_batches() = batch;
  request.set_deterministic(options.deterministic);
  *request.mutable_autocast() = autocast;
  request.set_matmul_precision(precision);
  request.set_return_dx(false);
  request.set_return_grads(false);
  request.set_discard_grads(true);  // as JAX's speedometer drops them
  return TimeSteps(options, [&](int step) -> SentStep {
    request.mutable_micro_batches(0)->set_dropout_seed(DeriveSeed(options.dropout_seed, absl::StrCat("step/", step)));
    auto answer = std::make_shared<std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>>>(
        session.ForwardBackwardAsync(request));
    return [answer] { return answer->get().status(); };
  });
}

}  // namespace

absl::StatusOr<SpeedometerResult> Speedometer(Session& session, const Module& module, const Variables& vars,
                                              const HostTensor& x, const HostTensor& dy,
                                              const SpeedometerOptions& options) {
  (void)module;  // the layer is named by vars; the module is taken to mirror the quickstart's call
  RETURN_IF_ERROR(CheckIters(options));
  if (vars.session != &session || vars.layer_id.empty()) {
    return absl::InvalidArgumentError("vars: not initialised in this session");
  }
  std::vector<std::string> uploaded;
  absl::StatusOr<SpeedometerResult> result = TimeModule(session, vars, x, dy, options, &uploaded);
  absl::Status deleted = session.DeleteAll(uploaded);
  if (!result.ok()) return result.status();
  if (!deleted.ok()) return deleted;
  Report(options, *result);
  return result;
}

}  // namespace te::client
