#include "server/metrics/server_metrics.h"

#include <gtest/gtest.h>

#include <random>
#include <string>

#include "server/metrics/text_format_parser.h"

namespace te::metrics {
namespace {

using testing::FindSample;
using testing::ParsedFamily;
using testing::ParseTextFormat;

TEST(ServerMetricsTest, RegistersEveryNamedMetricOnce) {
  Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(&registry);
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
  EXPECT_EQ(RegisterServerMetrics(&registry).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(ServerMetricsTest, StatusCodeLabelsAreGrpcNames) {
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kOk), "OK");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeLabel(absl::StatusCode::kResourceExhausted), "RESOURCE_EXHAUSTED");
  // grpc::StatusCode 16 (UNAUTHENTICATED) passed through static_cast.
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(16)), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeLabel(static_cast<absl::StatusCode>(99)), "UNKNOWN");
}

// Random traffic through the helpers shows up, exactly, in a strict parse.
TEST(ServerMetricsTest, HelpersLandInTheExposition) {
  Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(&registry);
  ASSERT_TRUE(metrics.ok());
  const char* methods[] = {"Forward", "Backward", "PutTensor"};
  const absl::StatusCode codes[] = {absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument,
                                    absl::StatusCode::kDeadlineExceeded};
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> pick(0, 2);
  std::uniform_int_distribution<int64_t> bytes(1, int64_t{1} << 26);
  std::exponential_distribution<double> seconds(5);
  std::map<std::pair<std::string, std::string>, int> calls;
  std::map<std::string, int> latency_count;
  std::map<std::string, double> received, sent;
  for (int i = 0; i < 500; ++i) {
    const std::string method = methods[pick(rng)];
    const absl::StatusCode code = codes[pick(rng)];
    metrics->ObserveRpc(method, code, absl::Seconds(seconds(rng)));
    calls[{method, StatusCodeLabel(code)}]++;
    latency_count[method]++;
    const int64_t in = bytes(rng), out = bytes(rng);
    metrics->AddReceivedBytes(method, in);
    metrics->AddSentBytes(method, out);
    received[method] += in;
    sent[method] += out;
  }
  metrics->queue_depth->Add(3);
  metrics->sessions_open->Set(5);
  metrics->fp8_amax_overflows->Increment(2);
  metrics->SetDeviceMemory("cuda:0", 123456789, int64_t{150} << 30);

  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(registry.TextExposition());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (const auto& [key, n] : calls) {
    const testing::ParsedSample* sample =
        FindSample(*parsed, "te_rpc_requests_total", {{"method", key.first}, {"code", key.second}});
    ASSERT_NE(sample, nullptr) << key.first << " " << key.second;
    EXPECT_EQ(sample->value, n);
  }
  for (const auto& [method, n] : latency_count) {
    const testing::ParsedSample* count =
        FindSample(*parsed, "te_rpc_latency_seconds_count", {{"method", method}});
    ASSERT_NE(count, nullptr);
    EXPECT_EQ(count->value, n);
    EXPECT_EQ(FindSample(*parsed, "te_rpc_received_bytes_total", {{"method", method}})->value,
              received[method]);
    EXPECT_EQ(FindSample(*parsed, "te_rpc_sent_bytes_total", {{"method", method}})->value,
              sent[method]);
  }
  EXPECT_EQ(FindSample(*parsed, "te_queue_depth", {})->value, 3);
  EXPECT_EQ(FindSample(*parsed, "te_sessions_open", {})->value, 5);
  EXPECT_EQ(FindSample(*parsed, "te_fp8_amax_overflows_total", {})->value, 2);
  EXPECT_EQ(FindSample(*parsed, "te_device_memory_used_bytes", {{"device", "cuda:0"}})->value,
            123456789);
  EXPECT_EQ(FindSample(*parsed, "te_device_memory_total_bytes", {{"device", "cuda:0"}})->value,
            static_cast<double>(int64_t{150} << 30));
}

TEST(ServerMetricsTest, HelpersDropWhatTheRegistryRefuses) {
  Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(&registry);
  ASSERT_TRUE(metrics.ok());
  metrics->ObserveRpc("bad\xff", absl::StatusCode::kOk, absl::Milliseconds(1));  // not UTF-8
  metrics->ObserveRpc("Forward", absl::StatusCode::kOk, absl::Milliseconds(1));
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(registry.TextExposition());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(
      FindSample(*parsed, "te_rpc_requests_total", {{"method", "Forward"}, {"code", "OK"}})->value,
      1);
}

TEST(ServerMetricsTest, LatencyBoundsAreStrictlyIncreasing) {
  const std::vector<double>& bounds = RpcLatencyBoundsSeconds();
  ASSERT_GE(bounds.size(), 2u);
  for (size_t i = 1; i < bounds.size(); ++i) EXPECT_GT(bounds[i], bounds[i - 1]);
}

}  // namespace
}  // namespace te::metrics
