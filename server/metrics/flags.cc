#include "server/metrics/flags.h"

#include <utility>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, metrics_port, -1,
          "HTTP port for Prometheus metrics (GET /metrics); -1 turns them off, 0 picks a free "
          "port");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0", "address the metrics exporter listens on");

namespace te::metrics {

absl::StatusOr<std::unique_ptr<Exporter>> StartExporterFromFlags(
    std::shared_ptr<prometheus::Registry> registry) {
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port == -1) return std::unique_ptr<Exporter>();
  if (port < -1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port=", port, ": outside [-1, 65535] (-1 turns metrics off)"));
  }
  ExporterOptions options;
  options.host = absl::GetFlag(FLAGS_metrics_host);
  options.port = port;
  return Exporter::Start(std::move(registry), options);
}

}  // namespace te::metrics
