// The exporter over a real loopback socket, scraped with httplib's client.
#include "server/metrics/http_exporter.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "server/metrics/flags.h"
#include "server/metrics/server_metrics.h"
#include "server/metrics/text_format_parser.h"

namespace te::metrics {
namespace {

using testing::FindSample;
using testing::ParsedFamily;
using testing::ParseTextFormat;

HttpExporterOptions Loopback() {
  HttpExporterOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  return options;
}

TEST(HttpExporterTest, ServesTheRegistryAtSlashMetrics) {
  Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(&registry);
  ASSERT_TRUE(metrics.ok());
  metrics->ObserveRpc("Forward", absl::StatusCode::kOk, absl::Milliseconds(3));
  metrics->sessions_open->Set(2);
  absl::StatusOr<std::unique_ptr<HttpExporter>> exporter =
      HttpExporter::Start(&registry, Loopback());
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  ASSERT_GT((*exporter)->port(), 0);

  httplib::Client client("127.0.0.1", (*exporter)->port());
  httplib::Result result = client.Get("/metrics");
  ASSERT_TRUE(result) << httplib::to_string(result.error());
  EXPECT_EQ(result->status, 200);
  EXPECT_EQ(result->get_header_value("Content-Type"), kTextContentType);
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(result->body);
  ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << result->body;
  EXPECT_EQ(FindSample(*parsed, "te_sessions_open", {})->value, 2);
  EXPECT_EQ(
      FindSample(*parsed, "te_rpc_requests_total", {{"method", "Forward"}, {"code", "OK"}})->value,
      1);

  // Later updates show in the next scrape.
  metrics->sessions_open->Set(7);
  result = client.Get("/metrics");
  ASSERT_TRUE(result);
  parsed = ParseTextFormat(result->body);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(FindSample(*parsed, "te_sessions_open", {})->value, 7);

  result = client.Get("/other");
  ASSERT_TRUE(result);
  EXPECT_EQ(result->status, 404);
  result = client.Post("/metrics", "x", "text/plain");
  ASSERT_TRUE(result);
  EXPECT_NE(result->status, 200);
}

TEST(HttpExporterTest, ConcurrentScrapesDuringUpdatesAllParse) {
  Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(&registry);
  ASSERT_TRUE(metrics.ok());
  absl::StatusOr<std::unique_ptr<HttpExporter>> exporter =
      HttpExporter::Start(&registry, Loopback());
  ASSERT_TRUE(exporter.ok());
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    int i = 0;
    while (!stop.load()) {
      metrics->ObserveRpc(i % 2 ? "Forward" : "Backward", absl::StatusCode::kOk,
                          absl::Microseconds(i % 5000));
      ++i;
    }
  });
  std::atomic<int> good{0};
  std::vector<std::thread> scrapers;
  for (int t = 0; t < 4; ++t) {
    scrapers.emplace_back([&] {
      httplib::Client client("127.0.0.1", (*exporter)->port());
      for (int k = 0; k < 25; ++k) {
        httplib::Result result = client.Get("/metrics");
        if (result && result->status == 200 && ParseTextFormat(result->body).ok()) ++good;
      }
    });
  }
  for (std::thread& scraper : scrapers) scraper.join();
  stop.store(true);
  writer.join();
  EXPECT_EQ(good.load(), 100);
}

TEST(HttpExporterTest, APortInUseIsUnavailable) {
  Registry registry;
  absl::StatusOr<std::unique_ptr<HttpExporter>> first = HttpExporter::Start(&registry, Loopback());
  ASSERT_TRUE(first.ok());
  HttpExporterOptions same = Loopback();
  same.port = (*first)->port();
  EXPECT_EQ(HttpExporter::Start(&registry, same).status().code(), absl::StatusCode::kUnavailable);
}

TEST(HttpExporterTest, RejectsBadOptions) {
  Registry registry;
  HttpExporterOptions options = Loopback();
  options.port = 70000;
  EXPECT_EQ(HttpExporter::Start(&registry, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.threads = 0;
  EXPECT_EQ(HttpExporter::Start(&registry, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = Loopback();
  options.host = "no.such.host.invalid";
  EXPECT_EQ(HttpExporter::Start(&registry, options).status().code(),
            absl::StatusCode::kUnavailable);
}

// Stopping right after starting must not hang (httplib ignores a stop that
// comes before its accept loop runs).
TEST(HttpExporterTest, StopsRightAfterStarting) {
  Registry registry;
  for (int i = 0; i < 50; ++i) {
    absl::StatusOr<std::unique_ptr<HttpExporter>> exporter =
        HttpExporter::Start(&registry, Loopback());
    ASSERT_TRUE(exporter.ok());
  }
}

TEST(HttpExporterTest, StopClosesThePort) {
  Registry registry;
  int port = 0;
  {
    absl::StatusOr<std::unique_ptr<HttpExporter>> exporter =
        HttpExporter::Start(&registry, Loopback());
    ASSERT_TRUE(exporter.ok());
    port = (*exporter)->port();
  }
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(std::chrono::seconds(2));
  EXPECT_FALSE(client.Get("/metrics"));
}

TEST(MetricsFlagsTest, StartsWhatTheFlagsAsk) {
  Registry registry;
  absl::SetFlag(&FLAGS_metrics_host, "127.0.0.1");
  absl::SetFlag(&FLAGS_metrics_port, -1);
  absl::StatusOr<std::unique_ptr<HttpExporter>> off = StartExporterFromFlags(&registry);
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(*off, nullptr);
  absl::SetFlag(&FLAGS_metrics_port, -2);
  EXPECT_EQ(StartExporterFromFlags(&registry).status().code(), absl::StatusCode::kInvalidArgument);
  absl::SetFlag(&FLAGS_metrics_port, 0);
  absl::StatusOr<std::unique_ptr<HttpExporter>> on = StartExporterFromFlags(&registry);
  ASSERT_TRUE(on.ok());
  ASSERT_NE(*on, nullptr);
  EXPECT_GT((*on)->port(), 0);
}

}  // namespace
}  // namespace te::metrics
