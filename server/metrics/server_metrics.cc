#include "server/metrics/server_metrics.h"

#include <exception>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

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
  const std::string method_label(method);
  rpc_requests->Add({{"method", method_label}, {"code", StatusCodeLabel(code)}}).Increment();
  // A NaN would turn the histogram's sum into NaN for good; a Duration never is one.
  rpc_latency->Add({{"method", method_label}}, RpcLatencyBoundsSeconds())
      .Observe(absl::ToDoubleSeconds(latency));
}

void ServerMetrics::AddReceivedBytes(absl::string_view method, int64_t bytes) const {
  if (bytes < 0) return;
  received_bytes->Add({{"method", std::string(method)}}).Increment(static_cast<double>(bytes));
}

void ServerMetrics::AddSentBytes(absl::string_view method, int64_t bytes) const {
  if (bytes < 0) return;
  sent_bytes->Add({{"method", std::string(method)}}).Increment(static_cast<double>(bytes));
}

void ServerMetrics::SetDeviceMemory(absl::string_view device, int64_t used_bytes,
                                    int64_t total_bytes) const {
  const std::string device_label(device);
  device_memory_used->Add({{"device", device_label}}).Set(static_cast<double>(used_bytes));
  device_memory_total->Add({{"device", device_label}}).Set(static_cast<double>(total_bytes));
}

void ServerMetrics::CountFp8AmaxOverflowsTo(int64_t total) const {
  const double missing = static_cast<double>(total) - fp8_amax_overflows->Value();
  if (missing > 0) fp8_amax_overflows->Increment(missing);
}

absl::StatusOr<ServerMetrics> RegisterServerMetrics(prometheus::Registry& registry) {
  ServerMetrics m;
  // prometheus-cpp reports a refused name by throwing; the error names the family.
  std::string name;
  auto named = [&name](auto builder, const char* family, const char* help) {
    name = family;
    return std::move(builder.Name(family).Help(help));
  };
  try {
    m.rpc_requests = &named(prometheus::BuildCounter(), "te_rpc_requests_total",
                            "RPCs finished, by method and gRPC status code.")
                          .Register(registry);
    m.rpc_latency = &named(prometheus::BuildHistogram(), "te_rpc_latency_seconds",
                           "Time from a call's arrival to its answer, in seconds, by method.")
                         .Register(registry);
    m.received_bytes = &named(prometheus::BuildCounter(), "te_rpc_received_bytes_total",
                              "Request payload bytes received, by method.")
                            .Register(registry);
    m.sent_bytes = &named(prometheus::BuildCounter(), "te_rpc_sent_bytes_total",
                          "Response payload bytes sent, by method.")
                        .Register(registry);
    m.queue_depth = &named(prometheus::BuildGauge(), "te_queue_depth",
                           "Calls waiting for their session's turn.")
                         .Register(registry)
                         .Add({});
    m.sessions_open =
        &named(prometheus::BuildGauge(), "te_sessions_open", "Sessions the server holds.")
             .Register(registry)
             .Add({});
    m.device_memory_used = &named(prometheus::BuildGauge(), "te_device_memory_used_bytes",
                                  "Device memory in use (sessions and caches), by device.")
                                .Register(registry);
    m.device_memory_total = &named(prometheus::BuildGauge(), "te_device_memory_total_bytes",
                                   "The device's memory, by device.")
                                 .Register(registry);
    m.fp8_amax_overflows = &named(prometheus::BuildCounter(), "te_fp8_amax_overflows_total",
                                  "FP8 delayed-scaling updates whose amax was inf or NaN, "
                                  "so the scale was kept, as TE keeps it.")
                                .Register(registry)
                                .Add({});
  } catch (const std::exception& error) {
    return absl::InternalError(absl::StrCat("registering ", name, ": ", error.what()));
  }
  return m;
}

}  // namespace te::metrics
