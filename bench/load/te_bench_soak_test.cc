// The soak's server-free parts: memory slopes, the warm-up cut, the interval
// line, variable digests and their comparison, /proc sampling and option checks.
// (bench/soak.sh runs the whole soak against a real server.)
#include "bench/load/te_bench_soak.h"

#include <unistd.h>

#include <cmath>

#include "gtest/gtest.h"

namespace te::client::bench {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(SoakSlopeTest, LeastSquaresInMibPerMinute) {
  // 100 MiB + 3 MiB/min, exactly.
  std::vector<std::pair<double, int64_t>> points;
  for (int m = 1; m <= 8; ++m) points.push_back({m, 100 * kMiB + 3 * m * kMiB});
  EXPECT_NEAR(SlopeMibPerMinute(points), 3.0, 1e-9);
  // Flat with noise: the slope of the fit, near zero.
  const std::vector<std::pair<double, int64_t>> flat = {
      {1, 500 * kMiB}, {2, 501 * kMiB}, {3, 499 * kMiB}, {4, 500 * kMiB}};
  EXPECT_NEAR(SlopeMibPerMinute(flat), -0.2, 1e-9);
  EXPECT_TRUE(std::isnan(SlopeMibPerMinute({})));
  EXPECT_TRUE(std::isnan(SlopeMibPerMinute({{1, kMiB}})));
  EXPECT_TRUE(std::isnan(SlopeMibPerMinute({{2, kMiB}, {2, 5 * kMiB}})));
}

TEST(SoakSlopeTest, WarmupAndMissingSamplesAreLeftOut) {
  std::vector<SoakInterval> intervals(4);
  for (int i = 0; i < 4; ++i) {
    intervals[i].end_minutes = i + 1;
    intervals[i].device_in_use = (i + 1) * kMiB;
    intervals[i].host_rss = i == 2 ? -1 : 7 * kMiB;
  }
  const auto device = AfterWarmup(intervals, 1.0, &SoakInterval::device_in_use);
  ASSERT_EQ(device.size(), 3u);
  EXPECT_EQ(device[0].first, 2.0);
  const auto host = AfterWarmup(intervals, 1.0, &SoakInterval::host_rss);
  ASSERT_EQ(host.size(), 2u);  // minute 3's sample is missing
  EXPECT_EQ(host[1].first, 4.0);
  EXPECT_NEAR(SlopeMibPerMinute(device), 1.0, 1e-9);
}

TEST(SoakFormatTest, IntervalLine) {
  SoakInterval i;
  i.end_minutes = 2;
  i.calls = 120;
  i.failed = 1;
  i.step_ms["bf16"] = {17.25, 19.5};
  i.step_ms["fp8"] = {11.0, 12.0};
  i.device_in_use = 3 * kMiB;
  i.host_rss = 512 * kMiB;
  const std::string line = FormatInterval(i);
  EXPECT_NE(line.find("minute  2.00: 120 calls, 1 failed"), std::string::npos) << line;
  EXPECT_NE(line.find("bf16 17.2/19.5, fp8 11.0/12.0"), std::string::npos) << line;
  EXPECT_NE(line.find("device MiB in use 3, reserved -"), std::string::npos) << line;
  EXPECT_NE(line.find("host RSS MiB 512"), std::string::npos) << line;
}

TEST(SoakDigestTest, DigestsCompareByName) {
  EXPECT_EQ(Fnv1a64(""), 1469598103934665603ull);
  EXPECT_NE(Fnv1a64(std::string("\x00\x01", 2)), Fnv1a64(std::string("\x01\x00", 2)));
  const std::map<std::string, uint64_t> before = {{"params/a", 1}, {"params/b", 2}, {"opt_state/count", 3}};
  EXPECT_TRUE(CompareDigests(before, before).empty());
  std::map<std::string, uint64_t> after = before;
  after["params/b"] = 9;
  after.erase("opt_state/count");
  after["grads/a"] = 4;
  const std::vector<std::string> differ = CompareDigests(before, after);
  EXPECT_EQ(differ, (std::vector<std::string>{"opt_state/count (missing after)",
                                              "params/b (bytes differ)", "grads/a (new after)"}));
}

TEST(SoakHostMemoryTest, ReadsThisProcesssResidentMemory) {
  const int64_t rss = ResidentBytes(getpid());
  EXPECT_GT(rss, kMiB);
  EXPECT_EQ(ResidentBytes(0x7fffffff), -1);
}

TEST(SoakOptionsTest, RefusesWhatCannotRun) {
  SoakOptions o;
  EXPECT_TRUE(ValidateSoak(o).ok());
  o.duration = absl::ZeroDuration();
  EXPECT_EQ(ValidateSoak(o).code(), absl::StatusCode::kInvalidArgument);
  o = SoakOptions();
  o.size.heads = 3;  // does not divide 64
  EXPECT_EQ(ValidateSoak(o).code(), absl::StatusCode::kInvalidArgument);
  o = SoakOptions();
  o.churn_steps = 0;
  EXPECT_EQ(ValidateSoak(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SoakReportTest, OkMeansNoFailureAndEverySessionBack) {
  SoakReport r;
  r.held_sessions = 3;
  EXPECT_TRUE(r.ok());
  r.restore_checked = true;
  r.restored_identical = 2;
  EXPECT_FALSE(r.ok());
  r.restored_identical = 3;
  EXPECT_TRUE(r.ok());
  r.failed = 1;
  EXPECT_FALSE(r.ok());
}

}  // namespace
}  // namespace te::client::bench
