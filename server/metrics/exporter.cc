#include "server/metrics/exporter.h"

#include <httplib.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace te::metrics {

struct Exporter::Impl {
  std::shared_ptr<prometheus::Registry> registry;
  httplib::Server server;
  std::thread listener;
  std::atomic<bool> listener_done{false};

  ~Impl() {
    if (!listener.joinable()) return;
    // httplib's stop() does nothing until the accept loop has started, and
    // the thread may not have got there yet; a second stop() would trip
    // httplib's assert. So: stop once, as soon as the loop runs.
    while (!listener_done.load()) {
      if (server.is_running()) {
        server.stop();
        break;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    listener.join();
  }
};

Exporter::Exporter(std::unique_ptr<Impl> impl, int port) : impl_(std::move(impl)), port_(port) {}

Exporter::~Exporter() = default;

absl::StatusOr<std::unique_ptr<Exporter>> Exporter::Start(
    std::shared_ptr<prometheus::Registry> registry, const ExporterOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", options.port, ": outside [0, 65535]"));
  }
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics exporter threads ", options.threads, ": must be at least 1"));
  }
  auto impl = std::make_unique<Impl>();
  impl->registry = std::move(registry);
  httplib::Server& server = impl->server;
  const size_t threads = static_cast<size_t>(options.threads);
  server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  const auto timeout = absl::ToChronoMicroseconds(options.io_timeout);
  server.set_read_timeout(timeout);
  server.set_write_timeout(timeout);
  server.set_payload_max_length(64 * 1024);  // a scrape sends no body
  // httplib's default sets SO_REUSEPORT, which lets a second process bind the
  // same port and silently take half the scrapes. SO_REUSEADDR alone still
  // allows a quick restart past TIME_WAIT, and makes a taken port an error.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  const prometheus::Registry* served = impl->registry.get();
  server.Get(kMetricsPath, [served](const httplib::Request&, httplib::Response& response) {
    response.set_content(prometheus::TextSerializer().Serialize(served->Collect()),
                         kTextContentType);
  });

  int port = options.port;
  if (port == 0) {
    port = server.bind_to_any_port(options.host);
    if (port < 0) port = 0;
  } else if (!server.bind_to_port(options.host, port)) {
    port = 0;
  }
  if (port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind the metrics exporter to ", options.host, ":", options.port));
  }
  // The socket already listens: connections queue until the loop accepts them.
  Impl* raw = impl.get();
  raw->listener = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->listener_done.store(true);
  });
  return std::unique_ptr<Exporter>(new Exporter(std::move(impl), port));
}

}  // namespace te::metrics
