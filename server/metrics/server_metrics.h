// te_server's named metrics: the handles the service, the session layer and
// the device code update. Made once at start (RegisterServerMetrics); every
// handle lives as long as the Registry. Thread-safe, like metrics.h.
//
//   te_rpc_requests_total{method,code}       finished RPCs, by gRPC status code name
//   te_rpc_latency_seconds{method}           histogram of handler time, arrival to answer
//   te_rpc_received_bytes_total{method}      request payload bytes (messages or chunks)
//   te_rpc_sent_bytes_total{method}          response payload bytes
//   te_queue_depth                           calls waiting for their session's turn
//   te_sessions_open                         sessions held
//   te_device_memory_used_bytes{device}      device memory in use (sessions and caches)
//   te_device_memory_total_bytes{device}     the device's memory
//   te_fp8_amax_overflows_total              FP8 amax readings that were inf/NaN, or
//                                            past what the scale in use can represent
#ifndef TE_SERVER_METRICS_SERVER_METRICS_H_
#define TE_SERVER_METRICS_SERVER_METRICS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"

namespace te::metrics {

// Latency bucket bounds in seconds: from a GetServerInfo (~100 us) to a long
// Benchmark or a batch of quickstart-sized ForwardBackward steps (a minute).
const std::vector<double>& RpcLatencyBoundsSeconds();

struct ServerMetrics {
  CounterFamily* rpc_requests = nullptr;
  HistogramFamily* rpc_latency = nullptr;
  CounterFamily* received_bytes = nullptr;
  CounterFamily* sent_bytes = nullptr;
  Gauge* queue_depth = nullptr;
  Gauge* sessions_open = nullptr;
  GaugeFamily* device_memory_used = nullptr;
  GaugeFamily* device_memory_total = nullptr;
  Counter* fp8_amax_overflows = nullptr;

  // The helpers below drop an update rather than fail a call: metrics must
  // never turn a served request into an error. A failure can only come from a
  // label value that is not UTF-8 or a family past its label-set limit.

  // One finished RPC: counts it under its status code's name ("OK",
  // "INVALID_ARGUMENT"...; gRPC and absl share the numbering, so a
  // grpc::StatusCode can be passed through static_cast) and observes its
  // latency.
  void ObserveRpc(absl::string_view method, absl::StatusCode code, absl::Duration latency) const;
  void AddReceivedBytes(absl::string_view method, int64_t bytes) const;
  void AddSentBytes(absl::string_view method, int64_t bytes) const;
  void SetDeviceMemory(absl::string_view device, int64_t used_bytes, int64_t total_bytes) const;
};

// Registers the metrics above in `registry` (which must outlive the result).
// ALREADY_EXISTS when called twice on one registry.
absl::StatusOr<ServerMetrics> RegisterServerMetrics(Registry* registry);

// The label value for a status code: absl's (and gRPC's) canonical name.
std::string StatusCodeLabel(absl::StatusCode code);

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_SERVER_METRICS_H_
