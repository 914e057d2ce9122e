// sample_exporter: te_server's metrics, filled with made-up traffic, served
// until SIGTERM or SIGINT, so that real Prometheus tools can be pointed at the
// exporter without a server (tests/metrics/promtool_check.sh).
//   sample_exporter --port_file=FILE [--port=0] [--host=127.0.0.1]
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/exporter.h"
#include "server/metrics/server_metrics.h"

ABSL_FLAG(int, port, 0, "port to serve on; 0 picks a free one");
ABSL_FLAG(std::string, host, "127.0.0.1", "address to serve on");
ABSL_FLAG(std::string, port_file, "", "where to write the bound port once serving");

namespace te::metrics {
namespace {

void FillWithTraffic(const ServerMetrics& metrics) {
  const char* methods[] = {"CreateSession", "InitLayer", "Forward", "Backward", "PutTensor"};
  const absl::StatusCode codes[] = {absl::StatusCode::kOk, absl::StatusCode::kOk,
                                    absl::StatusCode::kInvalidArgument,
                                    absl::StatusCode::kUnauthenticated};
  std::mt19937 rng(2024);
  std::lognormal_distribution<double> seconds(-5, 1.5);
  for (int i = 0; i < 1000; ++i) {
    const char* method = methods[i % 5];
    metrics.ObserveRpc(method, codes[rng() % 4], absl::Seconds(seconds(rng)));
    metrics.AddReceivedBytes(method, 1000 + rng() % 4000000);
    metrics.AddSentBytes(method, 100 + rng() % 100000);
  }
  metrics.queue_depth->Set(3);
  metrics.sessions_open->Set(12);
  metrics.SetDeviceMemory("cuda:0", int64_t{3} << 30, int64_t{140} << 30);
  metrics.fp8_amax_overflows->Increment(4);
}

int Run() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);  // before the exporter's threads

  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(*registry);
  if (!metrics.ok()) {
    std::fprintf(stderr, "sample_exporter: %s\n", metrics.status().ToString().c_str());
    return 1;
  }
  FillWithTraffic(*metrics);
  ExporterOptions options;
  options.host = absl::GetFlag(FLAGS_host);
  options.port = absl::GetFlag(FLAGS_port);
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, options);
  if (!exporter.ok()) {
    std::fprintf(stderr, "sample_exporter: %s\n", exporter.status().ToString().c_str());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    // Written whole, then renamed: a poller never reads half a number.
    const std::string temp = port_file + ".tmp";
    std::ofstream(temp) << (*exporter)->port() << "\n";
    if (std::rename(temp.c_str(), port_file.c_str()) != 0) {
      std::fprintf(stderr, "sample_exporter: cannot write %s\n", port_file.c_str());
      return 1;
    }
  }
  std::fprintf(stderr, "sample_exporter: serving on %s:%d\n", options.host.c_str(),
               (*exporter)->port());
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  return 0;
}

}  // namespace
}  // namespace te::metrics

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return te::metrics::Run();
}
