// te_bench (bench/load/te_bench_lib.h) against the real te_server on loopback:
// a 2-client sweep point at the small config yields a complete JSON report
// with throughput and no errors; put/get move bytes; a server that admits
// one session shows the second client's failure in the errors and fairness;
// a long FP8 run holds one version of its layer.
#include <memory>
#include <string>

#include "bench/load/te_bench_lib.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/server_fixture.h"

namespace te::client::bench {
namespace {

using ::te::testing::ServerProcess;

BenchOptions SmallOptions(const ServerProcess& server) {
  BenchOptions o;
  o.server = server.address();
  o.size = SizeForConfig("small").value();
  o.layer = BenchLayer::kTransformer;
  o.op = BenchOp::kForwardBackward;
  o.warmup = 1;
  return o;
}

TEST(TeBenchTest, TwoClientsForTwoSecondsReportEverything) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  BenchOptions o = SmallOptions(**server);
  o.clients = {2};
  o.duration = absl::Seconds(2);

  absl::StatusOr<BenchReport> report = RunBench(o);
  ASSERT_TRUE(report.ok()) << report.status();
  const nlohmann::json j = nlohmann::json::parse(FormatJson(*report));

  for (const char* field :
       {"tool", "server", "server_version", "devices", "layer", "op", "fp8", "dtype", "size", "micro_batches",
        "duration_s", "count", "warmup", "total_errors", "points"}) {
    EXPECT_TRUE(j.contains(field)) << field;
  }
  EXPECT_EQ(j["layer"], "transformer");
  EXPECT_EQ(j["op"], "forward_backward");
  EXPECT_EQ(j["total_errors"], 0);
  ASSERT_EQ(j["points"].size(), 1u);
  const nlohmann::json& p = j["points"][0];
  EXPECT_EQ(p["clients"], 2);
  EXPECT_TRUE(p["errors"].empty()) << p["errors"].dump() << " " << p["error_examples"].dump();
  EXPECT_EQ(p["failed_calls"], 0);
  EXPECT_GT(p["calls"].get<int64_t>(), 0);
  EXPECT_GT(p["calls_per_s"].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(p["steps_per_s"].get<double>(), p["calls_per_s"].get<double>());  // 1 micro-batch
  // The point ran for its duration (plus the last calls in flight).
  EXPECT_GE(p["seconds"].get<double>(), 2.0);
  EXPECT_LT(p["seconds"].get<double>(), 30.0);

  const nlohmann::json& latency = p["latency_ms"];
  EXPECT_GT(latency["p50"].get<double>(), 0.0);
  EXPECT_LE(latency["min"].get<double>(), latency["p50"].get<double>());
  EXPECT_LE(latency["p50"].get<double>(), latency["p90"].get<double>());
  EXPECT_LE(latency["p90"].get<double>(), latency["p99"].get<double>());
  EXPECT_LE(latency["p99"].get<double>(), latency["max"].get<double>());

  ASSERT_EQ(p["per_client_calls_per_s"].size(), 2u);
  for (const auto& rate : p["per_client_calls_per_s"]) EXPECT_GT(rate.get<double>(), 0.0);
  const nlohmann::json& fairness = p["fairness"];
  EXPECT_GT(fairness["slowest_over_fastest"].get<double>(), 0.0);
  EXPECT_LE(fairness["slowest_over_fastest"].get<double>(), 1.0);
  EXPECT_LE(fairness["slowest_calls_per_s"].get<double>(), fairness["fastest_calls_per_s"].get<double>());

  EXPECT_NE(FormatTable(*report).find("transformer forward_backward"), std::string::npos);
  EXPECT_TRUE((*server)->Stop().ok());
}

TEST(TeBenchTest, PutAndGetMoveBytesAndForwardRuns) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  for (BenchOp op : {BenchOp::kPut, BenchOp::kGet, BenchOp::kForward}) {
    BenchOptions o = SmallOptions(**server);
    o.op = op;
    o.fp8 = op == BenchOp::kForward ? Fp8Mode::kDelayed : Fp8Mode::kNone;
    o.clients = {1, 2};
    o.count = 5;
    absl::StatusOr<BenchReport> report = RunBench(o);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->total_errors(), 0) << FormatTable(*report);
    ASSERT_EQ(report->points.size(), 2u);
    for (const SweepPoint& p : report->points) {
      EXPECT_EQ(p.calls, 5 * p.clients) << OpName(op);  // a count is per client
      if (op != BenchOp::kForward) {
        EXPECT_GT(p.megabytes_per_s, 0.0) << OpName(op);
      }
    }
  }
  EXPECT_TRUE((*server)->Stop().ok());
}

TEST(TeBenchTest, ASessionLimitShowsAsSetupErrorsAndUnfairness) {
  ServerProcess::Options server_options;
  server_options.flags = {"--max_sessions=1"};
  auto server = ServerProcess::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  BenchOptions o = SmallOptions(**server);
  o.clients = {2};
  o.count = 3;
  absl::StatusOr<BenchReport> report = RunBench(o);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->points.size(), 1u);
  const SweepPoint& p = report->points[0];
  EXPECT_EQ(p.errors.count("setup RESOURCE_EXHAUSTED"), 1u) << FormatTable(*report);
  EXPECT_EQ(p.calls, 3);  // the client that got the session made its calls
  EXPECT_DOUBLE_EQ(p.slowest_calls_per_s, 0.0);
  EXPECT_DOUBLE_EQ(p.fairness, 0.0);
  EXPECT_TRUE((*server)->Stop().ok());
}

// A step under DelayedScaling makes a version (its FP8 state moves). A long
// run must hold one, not one per step: 400 steps whose kept gradients
// (about 200 KB each at the small size) would overflow a 16 MiB session.
TEST(TeBenchTest, ALongFp8RunKeepsNothingPerStep) {
  ServerProcess::Options server_options;
  server_options.flags = {"--session_memory_bytes=16777216"};
  auto server = ServerProcess::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  BenchOptions o = SmallOptions(**server);
  o.fp8 = Fp8Mode::kDelayed;
  o.count = 400;
  absl::StatusOr<BenchReport> report = RunBench(o);
  ASSERT_TRUE(report.ok()) << report.status();
  ASSERT_EQ(report->points.size(), 1u);
  const SweepPoint& p = report->points[0];
  EXPECT_EQ(p.calls, 400) << FormatTable(*report);
  EXPECT_TRUE(p.errors.empty()) << FormatTable(*report);
  EXPECT_TRUE((*server)->Stop().ok());
}

}  // namespace
}  // namespace te::client::bench
