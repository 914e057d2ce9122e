// te_bench's server-free parts: flag parsing, option checks, latency
// statistics and the two report formats. (tests/integration/te_bench_test.cc
// runs it against a real server.)
#include "bench/load/te_bench_lib.h"

#include <random>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace te::client::bench {
namespace {

TEST(ParseTest, ClientList) {
  EXPECT_EQ(ParseClientList("1,2,4,8").value(), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(ParseClientList("3").value(), (std::vector<int>{3}));
  for (const char* bad : {"", "0", "1,-2", "1,x", "2.5"}) {
    absl::StatusOr<std::vector<int>> parsed = ParseClientList(bad);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(parsed.status().message().find("--clients"), std::string::npos) << bad;
  }
}

TEST(ParseTest, NamesRoundTrip) {
  for (BenchLayer l :
       {BenchLayer::kDense, BenchLayer::kLayerNormMlp, BenchLayer::kTransformer, BenchLayer::kFlax}) {
    EXPECT_EQ(ParseLayer(LayerName(l)).value(), l);
  }
  for (BenchOp op : {BenchOp::kForward, BenchOp::kForwardBackward, BenchOp::kPut, BenchOp::kGet}) {
    EXPECT_EQ(ParseOp(OpName(op)).value(), op);
  }
  for (Fp8Mode m : {Fp8Mode::kNone, Fp8Mode::kDelayed, Fp8Mode::kCurrent}) {
    EXPECT_EQ(ParseFp8(Fp8Name(m)).value(), m);
  }
  EXPECT_EQ(ParseLayer("mlp").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseOp("backward").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseFp8("mxfp8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseTest, Configs) {
  LayerSize q = SizeForConfig("quickstart").value();
  EXPECT_EQ(q.batch, 4);
  EXPECT_EQ(q.seq, 2048);
  EXPECT_EQ(q.hidden, 4096);
  EXPECT_EQ(q.ffn, 16384);
  EXPECT_EQ(q.heads, 32);
  EXPECT_EQ(SizeForConfig("small").value().hidden % SizeForConfig("small").value().heads, 0);
  EXPECT_EQ(SizeForConfig("large").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ValidateTest, RejectsWhatCannotRun) {
  EXPECT_TRUE(Validate(BenchOptions()).ok());
  auto expect_invalid = [](BenchOptions o, const std::string& field) {
    absl::Status status = Validate(o);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(status.message().find(field), std::string::npos) << status;
  };
  BenchOptions o;
  o.clients = {};
  expect_invalid(o, "clients");
  o = BenchOptions();
  o.size.heads = 3;  // does not divide hidden 64
  expect_invalid(o, "heads");
  o = BenchOptions();
  o.size.seq = 0;
  expect_invalid(o, "size");
  o = BenchOptions();
  o.duration = absl::ZeroDuration();
  expect_invalid(o, "duration");
  o.count = 5;  // a count alone is enough
  EXPECT_TRUE(Validate(o).ok());
  o = BenchOptions();
  o.micro_batches = 0;
  expect_invalid(o, "micro_batches");
  o = BenchOptions();
  o.dtype = DType::kE4M3;
  expect_invalid(o, "dtype");
}

TEST(LatencyTest, NearestRankPercentiles) {
  // 1..100 ms shuffled: the p-th percentile by nearest rank is p ms.
  std::vector<double> ms;
  for (int i = 1; i <= 100; ++i) ms.push_back(i);
  std::shuffle(ms.begin(), ms.end(), std::mt19937(7));
  LatencySummary s = SummarizeLatencies(ms);
  EXPECT_DOUBLE_EQ(s.p50, 50);
  EXPECT_DOUBLE_EQ(s.p90, 90);
  EXPECT_DOUBLE_EQ(s.p99, 99);
  EXPECT_DOUBLE_EQ(s.mean, 50.5);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 100);

  // Three values: p50 is the second, p90 and p99 the largest.
  s = SummarizeLatencies({3.0, 1.0, 2.0});
  EXPECT_DOUBLE_EQ(s.p50, 2.0);
  EXPECT_DOUBLE_EQ(s.p90, 3.0);
  EXPECT_DOUBLE_EQ(s.p99, 3.0);

  s = SummarizeLatencies({});
  EXPECT_DOUBLE_EQ(s.p99, 0.0);
}

BenchReport TwoPointReport() {
  BenchReport r;
  r.options.clients = {1, 2};
  r.options.op = BenchOp::kGet;
  r.server_version = "0.1";
  r.devices = {"cpu (x86_64)"};
  SweepPoint one;
  one.clients = 1;
  one.seconds = 2.0;
  one.calls = 100;
  one.calls_per_s = 50;
  one.steps_per_s = 50;
  one.megabytes_per_s = 1.6;
  one.latency_ms = SummarizeLatencies({10, 20, 30});
  one.per_client_calls_per_s = {50};
  one.slowest_calls_per_s = one.fastest_calls_per_s = 50;
  one.fairness = 1;
  SweepPoint two = one;
  two.clients = 2;
  two.calls = 150;
  two.failed_calls = 3;
  two.per_client_calls_per_s = {30, 45};
  two.slowest_calls_per_s = 30;
  two.fastest_calls_per_s = 45;
  two.fairness = 30.0 / 45.0;
  two.errors = {{"RESOURCE_EXHAUSTED", 3}};
  two.error_examples = {{"RESOURCE_EXHAUSTED", "queue full"}};
  r.points = {one, two};
  return r;
}

TEST(ReportTest, JsonHasEveryField) {
  BenchReport report = TwoPointReport();
  EXPECT_EQ(report.total_errors(), 3);
  nlohmann::json j = nlohmann::json::parse(FormatJson(report));
  EXPECT_EQ(j["tool"], "te_bench");
  EXPECT_EQ(j["op"], "get");
  EXPECT_EQ(j["size"]["hidden"], 64);
  EXPECT_EQ(j["total_errors"], 3);
  ASSERT_EQ(j["points"].size(), 2u);
  const nlohmann::json& p = j["points"][1];
  EXPECT_EQ(p["clients"], 2);
  EXPECT_EQ(p["calls"], 150);
  EXPECT_EQ(p["failed_calls"], 3);
  EXPECT_DOUBLE_EQ(p["latency_ms"]["p50"].get<double>(), 20.0);
  EXPECT_DOUBLE_EQ(p["fairness"]["slowest_over_fastest"].get<double>(), 30.0 / 45.0);
  EXPECT_EQ(p["per_client_calls_per_s"].size(), 2u);
  EXPECT_EQ(p["errors"]["RESOURCE_EXHAUSTED"], 3);
  EXPECT_EQ(p["error_examples"]["RESOURCE_EXHAUSTED"], "queue full");
  EXPECT_TRUE(p.contains("megabytes_per_s"));  // a get moves tensors
  EXPECT_TRUE(j["points"][0]["errors"].empty());
}

TEST(ReportTest, TableHasOneRowPerPoint) {
  const std::string table = FormatTable(TwoPointReport());
  EXPECT_NE(table.find("MB/s"), std::string::npos);
  EXPECT_NE(table.find("p99 ms"), std::string::npos);
  EXPECT_NE(table.find("30.00/45.00 calls/s = 0.67"), std::string::npos) << table;
  EXPECT_NE(table.find("RESOURCE_EXHAUSTED 3"), std::string::npos) << table;
  EXPECT_NE(table.find("2 clients, RESOURCE_EXHAUSTED: queue full"), std::string::npos) << table;
}

}  // namespace
}  // namespace te::client::bench
