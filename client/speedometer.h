// Speedometer: the quickstart's speedometer (quickstart_jax_utils.py) over
// te_server. It times forward + backward steps, value_and_grad of
// vdot(apply(x), dy), with dropout on and the calling thread's Autocast, and
// prints "Mean time: X ms" (server-side, also the steps' peak and reserved
// memory in MiB).
//
// Unlike the quickstart's, whose jitted step throws its updated fp8_metas
// away, each step here ends a real training step on the server: under
// DelayedScaling the session's FP8 scales move from step to step.
#ifndef TE_CLIENT_SPEEDOMETER_H_
#define TE_CLIENT_SPEEDOMETER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "client/modules.h"

namespace te::client {

struct SpeedometerOptions {
  int warmup_iters = 3;   // the quickstart uses 50 on a GPU; a CPU server needs fewer
  int timing_iters = 10;
  // Time on the server (the Benchmark RPC): the network is out of the loop.
  // Client-side timing (pipeline_depth) hides each step's round trip behind
  // the step before it, but not the first.
  bool server_side = false;
  // With server_side: the timed steps queued back to back on the server, as
  // JAX's and PyTorch's timing loops run them (BenchmarkRequest.queued); the
  // mean is then the loop's wall time over timing_iters and median_ms is 0.
  bool queued = false;
  // Client-side timing: steps in flight at once. 2 (the default) sends the
  // next step while the last one's answer comes back, as JAX's async
  // dispatch runs the quickstart's loop, so the server queues it and the
  // device does not idle for the round trip; the mean is the timed loop's
  // wall time over timing_iters (the last answer awaited), the median that
  // of the intervals between answers. 1: each step waits for the last.
  int pipeline_depth = 2;
  bool deterministic = false;  // the quickstart times with dropout on
  uint64_t dropout_seed = 0;   // a fresh seed per step derives from it (jax.random.split)
  std::optional<HostTensor> attention_mask;
  bool print = true;           // "Mean time: X ms" on stdout
};

struct SpeedometerResult {
  double mean_ms = 0.0;
  double median_ms = 0.0;
  int steps = 0;
  std::string timed_by;  // "client" or the server's device ("cpu", "cuda:0")
  // Server-side timing only (0 otherwise): the Benchmark's memory over the
  // timed steps, as JAX's device.memory_stats() reports it.
  int64_t peak_bytes_in_use = 0;    // the session's
  int64_t bytes_reserved = 0;       // the device allocator's, after the steps
  int64_t peak_bytes_reserved = 0;  // and at its most during them
};

// A module (a Graph included: one call per step): x and dy are uploaded once as resident tensors (deleted at
// the end), then each step is one ForwardBackward call that returns neither dx
// nor gradients and drops the gradients (discard_grads), as JAX's speedometer
// does, so only the step travels and the session keeps nothing. With server_side, one Benchmark call.
absl::StatusOr<SpeedometerResult> Speedometer(Session& session, const Module& module, const Variables& vars,
                                              const HostTensor& x, const HostTensor& dy,
                                              const SpeedometerOptions& options = {});

}  // namespace te::client

#endif  // TE_CLIENT_SPEEDOMETER_H_
