// te_server's named metrics, on prometheus-cpp (Debian's prometheus-cpp-dev):
// the families the service, the session layer and the device code update.
// Registered once at start (RegisterServerMetrics); every handle lives as long
// as the prometheus::Registry. prometheus-cpp's metrics are thread-safe, and so
// is everything here.
//
//   te_rpc_requests_total{method,code}       finished RPCs, by gRPC status code name
//   te_rpc_latency_seconds{method}           histogram of handler time, arrival to answer
//   te_rpc_received_bytes_total{method}      request payload bytes (every message of a call)
//   te_rpc_sent_bytes_total{method}          response payload bytes (every message of a call)
//   te_queue_depth                           calls waiting for their session's turn
//   te_sessions_open                         sessions held
//   te_device_memory_used_bytes{device}      device memory in use (sessions and caches)
//   te_device_memory_total_bytes{device}     the device's memory
//   te_fp8_amax_overflows_total              FP8 delayed-scaling updates whose amax was
//                                            inf or NaN (the scale was kept, as TE keeps it)
#ifndef TE_SERVER_METRICS_SERVER_METRICS_H_
#define TE_SERVER_METRICS_SERVER_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace te::metrics {

// Latency bucket bounds in seconds: from a GetServerInfo (~100 us) to a long
// Benchmark or a batch of quickstart-sized ForwardBackward steps (a minute).
const std::vector<double>& RpcLatencyBoundsSeconds();

struct ServerMetrics {
  prometheus::Family<prometheus::Counter>* rpc_requests = nullptr;
  prometheus::Family<prometheus::Histogram>* rpc_latency = nullptr;
  prometheus::Family<prometheus::Counter>* received_bytes = nullptr;
  prometheus::Family<prometheus::Counter>* sent_bytes = nullptr;
  prometheus::Gauge* queue_depth = nullptr;
  prometheus::Gauge* sessions_open = nullptr;
  prometheus::Family<prometheus::Gauge>* device_memory_used = nullptr;
  prometheus::Family<prometheus::Gauge>* device_memory_total = nullptr;
  prometheus::Counter* fp8_amax_overflows = nullptr;

  // The helpers below never fail a call: metrics must never turn a served
  // request into an error. Label values come from the server's own names (the
  // methods of te.v1.TeService, the devices it was started on), so a family
  // holds a bounded number of series.

  // One finished RPC: counts it under its status code's name ("OK",
  // "INVALID_ARGUMENT"...; gRPC and absl share the numbering, so a
  // grpc::StatusCode can be passed through static_cast) and observes its
  // latency.
  void ObserveRpc(absl::string_view method, absl::StatusCode code, absl::Duration latency) const;
  // Payload bytes of one message a call received or sent. Negative counts are
  // dropped (a counter only goes up).
  void AddReceivedBytes(absl::string_view method, int64_t bytes) const;
  void AddSentBytes(absl::string_view method, int64_t bytes) const;
  void SetDeviceMemory(absl::string_view device, int64_t used_bytes, int64_t total_bytes) const;
  // Brings te_fp8_amax_overflows_total up to `total`, the session layer's
  // running count (session::Fp8NonFiniteAmaxes): a counter never goes down,
  // so a smaller total changes nothing.
  void CountFp8AmaxOverflowsTo(int64_t total) const;
};

// Registers the metrics above in `registry` (which must outlive the result).
// The unlabelled ones show (as 0) from the first scrape on; a labelled one
// from its first series (prometheus-cpp leaves out a family with none, HELP
// and TYPE lines too). INTERNAL, naming the family, where prometheus-cpp
// refuses a registration (a name taken by a family of another type, or any
// name taken when the registry was made with InsertBehavior::Throw).
absl::StatusOr<ServerMetrics> RegisterServerMetrics(prometheus::Registry& registry);

// The label value for a status code: absl's (and gRPC's) canonical name.
std::string StatusCodeLabel(absl::StatusCode code);

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_SERVER_METRICS_H_
