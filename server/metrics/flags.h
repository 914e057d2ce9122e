// te_server's metrics flags, and starting the exporter they describe.
//   --metrics_port=-1      off (the default); 0 picks a free port; N serves on N
//   --metrics_host=0.0.0.0 the address the exporter listens on
#ifndef TE_SERVER_METRICS_FLAGS_H_
#define TE_SERVER_METRICS_FLAGS_H_

#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "server/metrics/exporter.h"

ABSL_DECLARE_FLAG(int, metrics_port);
ABSL_DECLARE_FLAG(std::string, metrics_host);

namespace te::metrics {

// The exporter the flags ask for, serving `registry` at /metrics; nullptr
// when --metrics_port=-1. INVALID_ARGUMENT: --metrics_port outside
// [-1, 65535]. UNAVAILABLE: the address cannot be bound.
absl::StatusOr<std::unique_ptr<Exporter>> StartExporterFromFlags(
    std::shared_ptr<prometheus::Registry> registry);

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_FLAGS_H_
