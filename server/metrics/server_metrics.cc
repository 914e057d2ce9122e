#include "server/metrics/server_metrics.h"

#include <string>

namespace te::metrics {

const std::vector<double>& RpcLatencyBoundsSeconds() {
  static const std::vector<double>* const bounds =
      new std::vector<double>{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                              0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
  return *bounds;
}

std::string StatusCodeLabel(absl::StatusCode code) {
  // absl spells them "INVALID_ARGUMENT"; unknown numbers come back as "".
  std::string name = absl::StatusCodeToString(code);
  if (name.empty()) return "UNKNOWN";
  return name;
}

void ServerMetrics::ObserveRpc(absl::string_view method, absl::StatusCode code,
                               absl::Duration latency) const {
  const std::string code_name = StatusCodeLabel(code);
  absl::StatusOr<Counter*> count = rpc_requests->WithLabels({method, code_name});
  if (count.ok()) (*count)->Increment();
  absl::StatusOr<Histogram*> histogram = rpc_latency->WithLabels({method});
  if (histogram.ok()) (*histogram)->Observe(absl::ToDoubleSeconds(latency));
}

void ServerMetrics::AddReceivedBytes(absl::string_view method, int64_t bytes) const {
  absl::StatusOr<Counter*> counter = received_bytes->WithLabels({method});
  if (counter.ok()) (*counter)->Increment(static_cast<double>(bytes));
}

void ServerMetrics::AddSentBytes(absl::string_view method, int64_t bytes) const {
  absl::StatusOr<Counter*> counter = sent_bytes->WithLabels({method});
  if (counter.ok()) (*counter)->Increment(static_cast<double>(bytes));
}

void ServerMetrics::SetDeviceMemory(absl::string_view device, int64_t used_bytes,
                                    int64_t total_bytes) const {
  absl::StatusOr<Gauge*> used = device_memory_used->WithLabels({device});
  if (used.ok()) (*used)->Set(static_cast<double>(used_bytes));
  absl::StatusOr<Gauge*> total = device_memory_total->WithLabels({device});
  if (total.ok()) (*total)->Set(static_cast<double>(total_bytes));
}

absl::StatusOr<ServerMetrics> RegisterServerMetrics(Registry* registry) {
  ServerMetrics m;
  absl::Status status;
  // Stores a registration's handle, or keeps its error for the return below.
  auto take = [&status](auto statusor, auto** handle) {
    if (!statusor.ok()) {
      status = statusor.status();
      return false;
    }
    *handle = *statusor;
    return true;
  };
  const bool ok =
      take(registry->AddCounterFamily("te_rpc_requests_total",
                                      "RPCs finished, by method and gRPC status code.",
                                      {"method", "code"}),
           &m.rpc_requests) &&
      take(registry->AddHistogramFamily(
               "te_rpc_latency_seconds",
               "Time from a call's arrival to its answer, in seconds, by method.", {"method"},
               RpcLatencyBoundsSeconds()),
           &m.rpc_latency) &&
      take(registry->AddCounterFamily("te_rpc_received_bytes_total",
                                      "Request payload bytes received, by method.", {"method"}),
           &m.received_bytes) &&
      take(registry->AddCounterFamily("te_rpc_sent_bytes_total",
                                      "Response payload bytes sent, by method.", {"method"}),
           &m.sent_bytes) &&
      take(registry->AddGauge("te_queue_depth", "Calls waiting for their session's turn."),
           &m.queue_depth) &&
      take(registry->AddGauge("te_sessions_open", "Sessions the server holds."),
           &m.sessions_open) &&
      take(registry->AddGaugeFamily("te_device_memory_used_bytes",
                                    "Device memory in use (sessions and caches), by device.",
                                    {"device"}),
           &m.device_memory_used) &&
      take(registry->AddGaugeFamily("te_device_memory_total_bytes",
                                    "The device's memory, by device.", {"device"}),
           &m.device_memory_total) &&
      take(registry->AddCounter("te_fp8_amax_overflows_total",
                                "FP8 amax readings that were inf or NaN, or past what the "
                                "scale in use can represent (the cast saturated)."),
           &m.fp8_amax_overflows);
  if (!ok) return status;
  return m;
}

}  // namespace te::metrics
