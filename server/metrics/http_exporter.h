// HttpExporter: serves a Registry's metrics at GET /metrics over plain HTTP
// (cpp-httplib), on its own small thread pool, for Prometheus to scrape.
// Thread-safe; stops and joins its threads when destroyed.
#ifndef TE_SERVER_METRICS_HTTP_EXPORTER_H_
#define TE_SERVER_METRICS_HTTP_EXPORTER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/metrics/metrics.h"

namespace te::metrics {

struct HttpExporterOptions {
  std::string host = "0.0.0.0";  // address to listen on
  int port = 9090;               // 0 picks a free port (see HttpExporter::port())
  // Scrapes are rare and small: two threads keep a slow client from blocking
  // the next scrape without costing the server cores.
  int threads = 2;
  absl::Duration io_timeout = absl::Seconds(5);  // per read / write on a connection
};

class HttpExporter {
 public:
  // Binds and starts serving `registry` (which must outlive the exporter).
  // INVALID_ARGUMENT: port outside [0, 65535] or threads < 1.
  // UNAVAILABLE: the address cannot be bound (in use, or not an address here).
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const Registry* registry,
                                                             HttpExporterOptions options);
  ~HttpExporter();
  HttpExporter(const HttpExporter&) = delete;
  HttpExporter& operator=(const HttpExporter&) = delete;

  // The bound port (the chosen one when options.port was 0).
  int port() const { return port_; }

 private:
  struct Impl;
  HttpExporter(std::unique_ptr<Impl> impl, int port);

  std::unique_ptr<Impl> impl_;
  const int port_;
};

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_HTTP_EXPORTER_H_
