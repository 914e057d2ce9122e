// The exporter over a real loopback socket, scraped with httplib's client.
// What a scrape says, line by line, is prometheus-cpp's TextSerializer; the
// format itself is checked by promtool and a real Prometheus
// (//tests/metrics:promtool_check, //tests/integration:metrics_test).
#include "server/metrics/exporter.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "server/metrics/flags.h"
#include "server/metrics/server_metrics.h"

namespace te::metrics {
namespace {

ExporterOptions Loopback() {
  ExporterOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  return options;
}

// Whether `body` holds the sample line `line` whole ("name{labels} value").
bool HasLine(const std::string& body, const std::string& line) {
  return absl::StartsWith(body, line + "\n") || absl::StrContains(body, "\n" + line + "\n");
}

TEST(ExporterTest, ServesTheRegistryAtSlashMetrics) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(*registry);
  ASSERT_TRUE(metrics.ok());
  metrics->sessions_open->Set(2);
  metrics->ObserveRpc("Forward", absl::StatusCode::kOk, absl::Milliseconds(3));
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  ASSERT_GT((*exporter)->port(), 0);

  httplib::Client client("127.0.0.1", (*exporter)->port());
  httplib::Result result = client.Get(kMetricsPath);
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"), kTextContentType);
  EXPECT_TRUE(HasLine(result->body, "# TYPE te_sessions_open gauge")) << result->body;
  EXPECT_TRUE(HasLine(result->body, "te_sessions_open 2")) << result->body;
  EXPECT_TRUE(HasLine(result->body, "# TYPE te_rpc_requests_total counter")) << result->body;
  EXPECT_TRUE(HasLine(result->body, "te_rpc_requests_total{code=\"OK\",method=\"Forward\"} 1"))
      << result->body;
  EXPECT_TRUE(HasLine(result->body, "te_rpc_latency_seconds_count{method=\"Forward\"} 1"))
      << result->body;

  // Each scrape reads the registry anew.
  metrics->sessions_open->Set(7);
  result = client.Get(kMetricsPath);
  ASSERT_TRUE(result);
  EXPECT_TRUE(HasLine(result->body, "te_sessions_open 7")) << result->body;
  result = client.Get("/other");
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 404);
}

TEST(ExporterTest, ConcurrentScrapesDuringUpdatesAllAnswer) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(*registry);
  ASSERT_TRUE(metrics.ok());
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
  ASSERT_TRUE(exporter.ok());
  // One observation before the scrapes start: a histogram with no
  // observation yet has no buckets, so a scrape that came first (a slow
  // machine, a sanitizer build) would find no le="+Inf" line to check.
  metrics->ObserveRpc("Forward", absl::StatusCode::kOk, absl::Microseconds(1));
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    int i = 0;
    while (!stop.load()) {
      metrics->ObserveRpc(i % 2 ? "Forward" : "Backward", absl::StatusCode::kOk,
                          absl::Microseconds(i % 5000));
      metrics->AddSentBytes("GetTensor", i);
      ++i;
    }
  });
  std::atomic<int> good{0};
  std::vector<std::thread> scrapers;
  for (int t = 0; t < 4; ++t) {
    scrapers.emplace_back([&] {
      httplib::Client client("127.0.0.1", (*exporter)->port());
      for (int k = 0; k < 25; ++k) {
        httplib::Result result = client.Get(kMetricsPath);
        if (result && result->status == 200 &&
            absl::StrContains(result->body, "le=\"+Inf\"} ")) {
          ++good;
        }
      }
    });
  }
  for (std::thread& scraper : scrapers) scraper.join();
  stop.store(true);
  writer.join();
  EXPECT_EQ(good.load(), 100);
}

TEST(ExporterTest, APortInUseIsUnavailable) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<std::unique_ptr<Exporter>> first = Exporter::Start(registry, Loopback());
  ASSERT_TRUE(first.ok());
  ExporterOptions same = Loopback();
  same.port = (*first)->port();
  const absl::Status second = Exporter::Start(registry, same).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kUnavailable) << second;
}

TEST(ExporterTest, RejectsBadOptions) {
  auto registry = std::make_shared<prometheus::Registry>();
  ExporterOptions options = Loopback();
  options.port = 70000;
  EXPECT_EQ(Exporter::Start(registry, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.threads = 0;
  EXPECT_EQ(Exporter::Start(registry, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.host = "no.such.host.invalid";
  EXPECT_EQ(Exporter::Start(registry, options).status().code(), absl::StatusCode::kUnavailable);
  options = Loopback();
  options.host = "192.0.2.1";  // TEST-NET-1: not an address of this machine
  EXPECT_EQ(Exporter::Start(registry, options).status().code(), absl::StatusCode::kUnavailable);
}

TEST(ExporterTest, ServesOnIpv6Loopback) {
  auto registry = std::make_shared<prometheus::Registry>();
  ASSERT_TRUE(RegisterServerMetrics(*registry).ok());
  ExporterOptions options = Loopback();
  options.host = "::1";
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, options);
  if (!exporter.ok()) GTEST_SKIP() << "no IPv6 loopback here: " << exporter.status();
  httplib::Client client("::1", (*exporter)->port());
  httplib::Result result = client.Get(kMetricsPath);
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_TRUE(HasLine(result->body, "te_sessions_open 0")) << result->body;
}

// te_server's static TLS is large (cuBLASLt alone holds 92 KiB of it), and
// glibc carves it out of every thread's stack: the exporter's threads must
// start and serve in such a process (civetweb's 100 KiB stacks did not).
thread_local char large_static_tls[256 * 1024];

TEST(ExporterTest, ServesInAProcessWithLargeStaticTls) {
  large_static_tls[0] = 1;
  std::thread([] { large_static_tls[sizeof(large_static_tls) - 1] = 2; }).join();
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(*registry);
  ASSERT_TRUE(metrics.ok());
  metrics->queue_depth->Set(9);
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  httplib::Client client("127.0.0.1", (*exporter)->port());
  httplib::Result result = client.Get(kMetricsPath);
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_TRUE(HasLine(result->body, "te_queue_depth 9")) << result->body;
}

TEST(ExporterTest, StopsRightAfterStarting) {
  auto registry = std::make_shared<prometheus::Registry>();
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
    ASSERT_TRUE(exporter.ok());
  }
}

TEST(ExporterTest, StopClosesThePort) {
  auto registry = std::make_shared<prometheus::Registry>();
  int port = 0;
  {
    absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
    ASSERT_TRUE(exporter.ok());
    port = (*exporter)->port();
  }
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(std::chrono::seconds(2));
  EXPECT_FALSE(client.Get(kMetricsPath));
}

// The exporter keeps the registry alive: main's own handle may go first.
TEST(ExporterTest, OutlivesTheCallersRegistryHandle) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(*registry);
  ASSERT_TRUE(metrics.ok());
  metrics->sessions_open->Set(4);
  absl::StatusOr<std::unique_ptr<Exporter>> exporter = Exporter::Start(registry, Loopback());
  ASSERT_TRUE(exporter.ok());
  registry.reset();
  httplib::Client client("127.0.0.1", (*exporter)->port());
  httplib::Result result = client.Get(kMetricsPath);
  ASSERT_TRUE(result);
  EXPECT_TRUE(HasLine(result->body, "te_sessions_open 4")) << result->body;
}

TEST(MetricsFlagsTest, StartsWhatTheFlagsAsk) {
  auto registry = std::make_shared<prometheus::Registry>();
  absl::SetFlag(&FLAGS_metrics_host, "127.0.0.1");
  absl::SetFlag(&FLAGS_metrics_port, -1);
  absl::StatusOr<std::unique_ptr<Exporter>> off = StartExporterFromFlags(registry);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, nullptr);
  absl::SetFlag(&FLAGS_metrics_port, -2);
  EXPECT_EQ(StartExporterFromFlags(registry).status().code(), absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_metrics_port, 65536);
  EXPECT_EQ(StartExporterFromFlags(registry).status().code(), absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_metrics_port, 0);
  absl::StatusOr<std::unique_ptr<Exporter>> on = StartExporterFromFlags(registry);
  ASSERT_TRUE(on.ok());
  ASSERT_NE(*on, nullptr);
  EXPECT_GT((*on)->port(), 0);
}

}  // namespace
}  // namespace te::metrics
