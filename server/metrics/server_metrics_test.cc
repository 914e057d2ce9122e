#include "server/metrics/server_metrics.h"

#include <gtest/gtest.h>
#include <prometheus/metric_family.h>

#include <cmath>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace te::metrics {
namespace {

using Labels = std::map<std::string, std::string>;

// The series of `family` whose labels are exactly `labels`, from
// prometheus-cpp's own collection (what its serializer writes); nullptr if
// there is none.
const prometheus::ClientMetric* Find(const std::vector<prometheus::MetricFamily>& families,
                                     const std::string& family, const Labels& labels) {
  for (const prometheus::MetricFamily& f : families) {
    if (f.name != family) continue;
    for (const prometheus::ClientMetric& metric : f.metric) {
      Labels got;
      for (const prometheus::ClientMetric::Label& label : metric.label) got[label.name] = label.value;
      if (got == labels) return &metric;
    }
  }
  return nullptr;
}

const prometheus::MetricFamily* FindFamily(const std::vector<prometheus::MetricFamily>& families,
                                           const std::string& name) {
  for (const prometheus::MetricFamily& f : families) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

TEST(ServerMetricsTest, RegistersEveryNamedMetricWithItsType) {
  prometheus::Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(registry);
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_NE(metrics->rpc_requests, nullptr);
  EXPECT_NE(metrics->rpc_latency, nullptr);
  EXPECT_NE(metrics->received_bytes, nullptr);
  EXPECT_NE(metrics->sent_bytes, nullptr);
  EXPECT_NE(metrics->queue_depth, nullptr);
  EXPECT_NE(metrics->sessions_open, nullptr);
  EXPECT_NE(metrics->device_memory_used, nullptr);
  EXPECT_NE(metrics->device_memory_total, nullptr);
  EXPECT_NE(metrics->fp8_amax_overflows, nullptr);

  // The names, types and help texts OPERATIONS.md lists and dashboards query.
  // A labelled family shows from its first series on.
  metrics->ObserveRpc("Forward", absl::StatusCode::kOk, absl::Milliseconds(1));
  metrics->AddReceivedBytes("Forward", 1);
  metrics->AddSentBytes("Forward", 1);
  metrics->SetDeviceMemory("cpu", 1, 2);
  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  const std::vector<std::pair<std::string, prometheus::MetricType>> want = {
      {"te_rpc_requests_total", prometheus::MetricType::Counter},
      {"te_rpc_latency_seconds", prometheus::MetricType::Histogram},
      {"te_rpc_received_bytes_total", prometheus::MetricType::Counter},
      {"te_rpc_sent_bytes_total", prometheus::MetricType::Counter},
      {"te_queue_depth", prometheus::MetricType::Gauge},
      {"te_sessions_open", prometheus::MetricType::Gauge},
      {"te_device_memory_used_bytes", prometheus::MetricType::Gauge},
      {"te_device_memory_total_bytes", prometheus::MetricType::Gauge},
      {"te_fp8_amax_overflows_total", prometheus::MetricType::Counter},
  };
  EXPECT_EQ(families.size(), want.size());
  EXPECT_EQ(prometheus::Registry().Collect().size(), 0u);
  for (const auto& [name, type] : want) {
    const prometheus::MetricFamily* family = FindFamily(families, name);
    ASSERT_NE(family, nullptr) << name;
    EXPECT_EQ(family->type, type) << name;
    EXPECT_FALSE(family->help.empty()) << name;
  }
  // Unlabelled metrics show as 0 before their first update.
  prometheus::Registry fresh;
  ASSERT_TRUE(RegisterServerMetrics(fresh).ok());
  const std::vector<prometheus::MetricFamily> before = fresh.Collect();
  EXPECT_EQ(before.size(), 3u);
  for (const char* name : {"te_queue_depth", "te_sessions_open"}) {
    const prometheus::ClientMetric* metric = Find(before, name, {});
    ASSERT_NE(metric, nullptr) << name;
    EXPECT_EQ(metric->gauge.value, 0) << name;
  }
  ASSERT_NE(Find(before, "te_fp8_amax_overflows_total", {}), nullptr);
  EXPECT_EQ(Find(before, "te_fp8_amax_overflows_total", {})->counter.value, 0);
}

TEST(ServerMetricsTest, ARegistryThatRefusesNamesTakenIsAnError) {
  prometheus::Registry registry(prometheus::Registry::InsertBehavior::Throw);
  ASSERT_TRUE(RegisterServerMetrics(registry).ok());
  const absl::Status again = RegisterServerMetrics(registry).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kInternal) << again;
  EXPECT_NE(again.message().find("te_rpc_requests_total"), std::string::npos) << again;
}

TEST(ServerMetricsTest, StatusCodeLabelsAreGrpcNames) {
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  // grpc::StatusCode 16 (UNAUTHENTICATED) passed through static_cast.
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(16)), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(99)), "UNKNOWN");
}

// Random traffic through the helpers lands, exactly, in the series they name.
TEST(ServerMetricsTest, HelpersLandInTheirSeries) {
  prometheus::Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(registry);
  ASSERT_TRUE(metrics.ok());
  const char* methods[] = {"Forward", "Backward", "PutTensor"};
  const absl::StatusCode codes[] = {absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument,
                                    absl::StatusCode::kDeadlineExceeded};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(0, 2);
  std::uniform_int_distribution<int64_t> bytes(1, int64_t{1} << 26);
  std::exponential_distribution<double> seconds(5);
  std::map<std::pair<std::string, std::string>, int> calls;
  std::map<std::string, std::vector<double>> latencies;
  std::map<std::string, double> received, sent;
  for (int i = 0; i < 500; ++i) {
    const std::string method = methods[pick(rng)];
    const absl::StatusCode code = codes[pick(rng)];
    // Whole microseconds: the Duration round trip is then exact.
    const double latency = std::round(seconds(rng) * 1e6) / 1e6;
    metrics->ObserveRpc(method, code, absl::Microseconds(std::llround(latency * 1e6)));
    calls[{method, StatusCodeLabel(code)}]++;
    latencies[method].push_back(latency);
    const int64_t in = bytes(rng), out = bytes(rng);
    metrics->AddReceivedBytes(method, in);
    metrics->AddSentBytes(method, out);
    received[method] += in;
    sent[method] += out;
  }
  metrics->AddReceivedBytes("Forward", -5);  // dropped
  metrics->queue_depth->Increment(3);
  metrics->sessions_open->Set(5);
  // The session layer's running count, published twice and once behind
  // (a counter does not go down).
  metrics->CountFp8AmaxOverflowsTo(1);
  metrics->CountFp8AmaxOverflowsTo(2);
  metrics->CountFp8AmaxOverflowsTo(1);
  metrics->SetDeviceMemory("cuda:0", 123456789, int64_t{150} << 30);

  const std::vector<prometheus::MetricFamily> families = registry.Collect();
  for (const auto& [key, n] : calls) {
    const prometheus::ClientMetric* metric =
        Find(families, "te_rpc_requests_total", {{"method", key.first}, {"code", key.second}});
    ASSERT_NE(metric, nullptr) << key.first << " " << key.second;
    EXPECT_EQ(metric->counter.value, n);
  }
  const std::vector<double>& bounds = RpcLatencyBoundsSeconds();
  for (const auto& [method, observed] : latencies) {
    const prometheus::ClientMetric* latency =
        Find(families, "te_rpc_latency_seconds", {{"method", method}});
    ASSERT_NE(latency, nullptr) << method;
    EXPECT_EQ(latency->histogram.sample_count, observed.size());
    double sum = 0;
    for (double v : observed) sum += v;
    EXPECT_NEAR(latency->histogram.sample_sum, sum, 1e-9 * observed.size());
    // One bucket per bound plus +Inf, cumulative: Prometheus's "le".
    ASSERT_EQ(latency->histogram.bucket.size(), bounds.size() + 1);
    for (size_t b = 0; b < bounds.size(); ++b) {
      uint64_t at_most = 0;
      for (double v : observed) at_most += v <= bounds[b] ? 1 : 0;
      EXPECT_EQ(latency->histogram.bucket[b].upper_bound, bounds[b]);
      EXPECT_EQ(latency->histogram.bucket[b].cumulative_count, at_most) << method << " le " << bounds[b];
    }
    EXPECT_TRUE(std::isinf(latency->histogram.bucket.back().upper_bound));
    EXPECT_EQ(latency->histogram.bucket.back().cumulative_count, observed.size());
    EXPECT_EQ(Find(families, "te_rpc_received_bytes_total", {{"method", method}})->counter.value,
              received[method]);
    EXPECT_EQ(Find(families, "te_rpc_sent_bytes_total", {{"method", method}})->counter.value,
              sent[method]);
  }
  EXPECT_EQ(Find(families, "te_queue_depth", {})->gauge.value, 3);
  EXPECT_EQ(Find(families, "te_sessions_open", {})->gauge.value, 5);
  EXPECT_EQ(Find(families, "te_fp8_amax_overflows_total", {})->counter.value, 2);
  EXPECT_EQ(Find(families, "te_device_memory_used_bytes", {{"device", "cuda:0"}})->gauge.value,
            123456789);
  EXPECT_EQ(Find(families, "te_device_memory_total_bytes", {{"device", "cuda:0"}})->gauge.value,
            static_cast<double>(int64_t{150} << 30));
}

TEST(ServerMetricsTest, LatencyBoundsAreStrictlyIncreasing) {
  const std::vector<double>& bounds = RpcLatencyBoundsSeconds();
  ASSERT_GE(bounds.size(), 2u);
  for (size_t i = 1; i < bounds.size(); ++i) EXPECT_GT(bounds[i], bounds[i - 1]);
}

}  // namespace
}  // namespace te::metrics
