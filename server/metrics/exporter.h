// Exporter: serves a prometheus::Registry at GET /metrics over plain HTTP, for
// Prometheus to scrape: prometheus-cpp's TextSerializer (the text format
// 0.0.4) behind cpp-httplib, on its own small thread pool. Stops and joins its
// threads when destroyed.
//
// Not prometheus-cpp's own Exposer: Debian 12 builds its civetweb with 100 KiB
// thread stacks (USE_STACK_SIZE), and glibc puts a process's static TLS on
// every thread's stack; te_server's, with cuBLASLt's 92 KiB, leaves them too
// small, so civetweb cannot start a single thread in te_server ("Cannot create
// threads"). httplib's threads get the default stack.
#ifndef TE_SERVER_METRICS_EXPORTER_H_
#define TE_SERVER_METRICS_EXPORTER_H_

#include <prometheus/registry.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace te::metrics {

// The path Prometheus scrapes (deploy/k8s's prometheus.io/path says the same).
inline constexpr char kMetricsPath[] = "/metrics";
// The text format's content type.
inline constexpr char kTextContentType[] = "text/plain; version=0.0.4; charset=utf-8";

struct ExporterOptions {
  std::string host = "0.0.0.0";  // address to listen on
  int port = 9090;               // 0 picks a free port (see Exporter::port())
  // Scrapes are rare and small: two threads keep a slow client from blocking
  // the next scrape without costing the server cores.
  int threads = 2;
  absl::Duration io_timeout = absl::Seconds(5);  // per read / write on a connection
};

class Exporter {
 public:
  // Binds and starts serving `registry` (kept alive by the exporter).
  // INVALID_ARGUMENT: port outside [0, 65535] or threads < 1.
  // UNAVAILABLE: the address cannot be bound (in use, or not an address here).
  static absl::StatusOr<std::unique_ptr<Exporter>> Start(
      std::shared_ptr<prometheus::Registry> registry, const ExporterOptions& options);
  ~Exporter();
  Exporter(const Exporter&) = delete;
  Exporter& operator=(const Exporter&) = delete;

  // The bound port (the chosen one when options.port was 0).
  int port() const { return port_; }

 private:
  struct Impl;
  Exporter(std::unique_ptr<Impl> impl, int port);

  std::unique_ptr<Impl> impl_;  // holds the registry too
  const int port_;
};

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_EXPORTER_H_
