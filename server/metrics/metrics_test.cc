#include "server/metrics/metrics.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/metrics/text_format_parser.h"

namespace te::metrics {
namespace {

using testing::FindSample;
using testing::ParsedFamily;
using testing::ParseTextFormat;

// Sums of random doubles in a different order differ by rounding only.
constexpr double kSumRelativeTolerance = 1e-12;

TEST(CounterTest, SumsConcurrentIncrementsExactly) {
  Counter counter;
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<double> expected(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t + 1);
      std::uniform_int_distribution<int> delta(1, 1000);  // integers: sums are exact
      for (int i = 0; i < kPerThread; ++i) {
        const int d = delta(rng);
        counter.Increment(d);
        expected[t] += d;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  double total = 0;
  for (double e : expected) total += e;
  EXPECT_EQ(counter.Value(), total);
}

TEST(CounterTest, DropsNegativeAndNaNDeltas) {
  Counter counter;
  counter.Increment(2.5);
  counter.Increment(-1);
  counter.Increment(NAN);
  counter.Increment();
  EXPECT_EQ(counter.Value(), 3.5);
}

TEST(GaugeTest, ConcurrentAddsCancel) {
  Gauge gauge;
  gauge.Set(7);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        gauge.Add(3);
        gauge.Add(-3);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(gauge.Value(), 7);
  gauge.Add(-10.5);
  EXPECT_EQ(gauge.Value(), -3.5);
}

TEST(HistogramTest, BucketsMatchABruteForceCount) {
  const std::vector<double> bounds = {-1, 0, 0.001, 0.5, 1, 2.5, 100};
  Histogram histogram(bounds);
  std::mt19937 rng(42);
  std::uniform_real_distribution<double> uniform(-3, 120);
  std::vector<double> values;
  for (int i = 0; i < 5000; ++i) values.push_back(uniform(rng));
  // Exactly on a bound counts in that bound's bucket (le is "<=").
  values.insert(values.end(), bounds.begin(), bounds.end());
  values.push_back(INFINITY);
  values.push_back(-INFINITY);
  double sum = 0;
  for (double v : values) {
    histogram.Observe(v);
    if (std::isfinite(v)) sum += v;
  }
  const Histogram::Snapshot snapshot = histogram.Read();
  ASSERT_EQ(snapshot.cumulative_counts.size(), bounds.size() + 1);
  for (size_t b = 0; b < bounds.size(); ++b) {
    uint64_t expected = 0;
    for (double v : values) expected += v <= bounds[b] ? 1 : 0;
    EXPECT_EQ(snapshot.cumulative_counts[b], expected) << "le=" << bounds[b];
  }
  EXPECT_EQ(snapshot.cumulative_counts.back(), values.size());
  EXPECT_EQ(snapshot.count, values.size());
  // +Inf and -Inf observed: the sum is their sum, NaN.
  EXPECT_TRUE(std::isnan(snapshot.sum));

  Histogram finite(bounds);
  for (double v : values) {
    if (std::isfinite(v)) finite.Observe(v);
  }
  EXPECT_NEAR(finite.Read().sum, sum, std::abs(sum) * kSumRelativeTolerance);
}

TEST(HistogramTest, DropsNaN) {
  Histogram histogram({1, 2});
  histogram.Observe(NAN);
  histogram.Observe(1.5);
  const Histogram::Snapshot snapshot = histogram.Read();
  EXPECT_EQ(snapshot.count, 1u);
  EXPECT_EQ(snapshot.sum, 1.5);
  EXPECT_EQ(snapshot.cumulative_counts, (std::vector<uint64_t>{0, 1, 1}));
}

TEST(RegistryTest, RejectsNamesThatBreakPrometheusRules) {
  Registry registry;
  for (const char* name : {"", "1abc", "has-dash", "has space", "é_total"}) {
    EXPECT_EQ(registry.AddGaugeFamily(name, "h", {}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << name;
  }
  EXPECT_EQ(registry.AddCounter("requests", "h").status().code(),
            absl::StatusCode::kInvalidArgument);  // counters end in _total
  for (const char* label : {"", "1x", "a:b", "__reserved", "a-b"}) {
    EXPECT_EQ(registry.AddGaugeFamily("g", "h", {label}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << label;
  }
  EXPECT_EQ(registry.AddGaugeFamily("g", "h", {"a", "a"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogramFamily("h", "h", {"le"}, {1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogramFamily("h", "h", {}, {2, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogramFamily("h", "h", {}, {1, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogramFamily("h", "h", {}, {1, NAN}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogramFamily("h", "h", {}, {1, INFINITY}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Rejected registrations took no name.
  EXPECT_TRUE(registry.AddGaugeFamily("g", "h", {"a"}).ok());
  EXPECT_TRUE(registry.AddHistogramFamily("h", "h", {}, {}).ok());  // +Inf bucket only
}

TEST(RegistryTest, NamesAndHistogramSampleNamesAreUnique) {
  Registry registry;
  ASSERT_TRUE(registry.AddGauge("g", "h").ok());
  EXPECT_EQ(registry.AddGauge("g", "h").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddHistogramFamily("g", "h", {}, {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.AddHistogramFamily("latency", "h", {}, {1}).ok());
  EXPECT_EQ(registry.AddGauge("latency_count", "h").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddGauge("latency_bucket", "h").status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.AddGauge("size_sum", "h").ok());
  EXPECT_EQ(registry.AddHistogramFamily("size", "h", {}, {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(FamilyTest, WithLabelsChecksArityUtf8AndLimit) {
  Registry registry(RegistryOptions{.max_label_sets_per_family = 3});
  absl::StatusOr<CounterFamily*> family =
      registry.AddCounterFamily("calls_total", "h", {"method", "code"});
  ASSERT_TRUE(family.ok());
  EXPECT_EQ((*family)->WithLabels({"Forward"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*family)->WithLabels({"a", "b", "c"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"\xff", "\xc3", "\xc0\xaf", "\xed\xa0\x80", "ok\x80"}) {
    EXPECT_EQ((*family)->WithLabels({"Forward", bad}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << absl::CEscape(bad);
  }
  absl::StatusOr<Counter*> first = (*family)->WithLabels({"Forward", "OK"});
  ASSERT_TRUE(first.ok());
  absl::StatusOr<Counter*> again = (*family)->WithLabels({"Forward", "OK"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*first, *again);
  // Values are compared whole, not joined: ("a", "bc") differs from ("ab", "c").
  ASSERT_TRUE((*family)->WithLabels({"a", "bc"}).ok());
  ASSERT_TRUE((*family)->WithLabels({"ab", "c"}).ok());
  EXPECT_EQ((*family)->WithLabels({"ab", "d"}).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Existing label sets still work at the limit.
  EXPECT_TRUE((*family)->WithLabels({"Forward", "OK"}).ok());
}

TEST(FamilyTest, AcceptsMultibyteUtf8) {
  Registry registry;
  absl::StatusOr<GaugeFamily*> family = registry.AddGaugeFamily("g", "h", {"name"});
  ASSERT_TRUE(family.ok());
  EXPECT_TRUE((*family)->WithLabels({"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"}).ok());
}

TEST(ExpositionTest, MatchesTheTextFormatExactly) {
  Registry registry;
  absl::StatusOr<Counter*> requests = registry.AddCounter("app_requests_total", "Requests.");
  absl::StatusOr<GaugeFamily*> temperature =
      registry.AddGaugeFamily("app_temperature_celsius", "Line one\nback\\slash", {"room"});
  absl::StatusOr<HistogramFamily*> latency =
      registry.AddHistogramFamily("app_latency_seconds", "Latency.", {"method"}, {0.125, 1});
  absl::StatusOr<GaugeFamily*> unused = registry.AddGaugeFamily("app_unused", "Unused.", {"x"});
  ASSERT_TRUE(requests.ok() && temperature.ok() && latency.ok() && unused.ok());
  (*requests)->Increment(3);
  (*(*temperature)->WithLabels({"b\"\\\n"}))->Set(-1.5);
  (*(*temperature)->WithLabels({"a"}))->Set(1e21);
  Histogram* get = *(*latency)->WithLabels({"Get"});
  get->Observe(0.125);  // on a bound: counts in that bucket
  get->Observe(0.25);
  get->Observe(7);
  EXPECT_EQ(registry.TextExposition(),
            "# HELP app_requests_total Requests.\n"
            "# TYPE app_requests_total counter\n"
            "app_requests_total 3\n"
            "# HELP app_temperature_celsius Line one\\nback\\\\slash\n"
            "# TYPE app_temperature_celsius gauge\n"
            "app_temperature_celsius{room=\"a\"} 1e+21\n"
            "app_temperature_celsius{room=\"b\\\"\\\\\\n\"} -1.5\n"
            "# HELP app_latency_seconds Latency.\n"
            "# TYPE app_latency_seconds histogram\n"
            "app_latency_seconds_bucket{method=\"Get\",le=\"0.125\"} 1\n"
            "app_latency_seconds_bucket{method=\"Get\",le=\"1\"} 2\n"
            "app_latency_seconds_bucket{method=\"Get\",le=\"+Inf\"} 3\n"
            "app_latency_seconds_sum{method=\"Get\"} 7.375\n"
            "app_latency_seconds_count{method=\"Get\"} 3\n");
}

// Random label values, escapes and non-ASCII text included, survive the round
// trip through the exposition and the strict parser.
TEST(ExpositionTest, RandomLabelValuesRoundTripThroughTheStrictParser) {
  Registry registry;
  absl::StatusOr<GaugeFamily*> gauges = registry.AddGaugeFamily("values", "Values.", {"a", "b"});
  ASSERT_TRUE(gauges.ok());
  const std::vector<std::string> pieces = {"x", "\\", "\"",       "\n",           ",",  "}", "{",
                                           "=", " ",  "\xc3\xa9", "\xe2\x82\xac", "le", "#", "\t"};
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> pick(0, pieces.size() - 1);
  std::uniform_int_distribution<int> length(0, 6);
  std::normal_distribution<double> normal(0, 1e6);
  std::vector<std::pair<std::pair<std::string, std::string>, double>> written;
  for (int i = 0; i < 200; ++i) {
    std::string a, b;
    for (int k = length(rng); k > 0; --k) a += pieces[pick(rng)];
    for (int k = length(rng); k > 0; --k) b += pieces[pick(rng)];
    const double value = normal(rng);
    absl::StatusOr<Gauge*> gauge = (*gauges)->WithLabels({a, b});
    ASSERT_TRUE(gauge.ok());
    (*gauge)->Set(value);
    written.push_back({{a, b}, value});
  }
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(registry.TextExposition());
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (const auto& [labels, value] : written) {
    const testing::ParsedSample* sample =
        FindSample(*parsed, "values", {{"a", labels.first}, {"b", labels.second}});
    ASSERT_NE(sample, nullptr) << absl::CEscape(labels.first) << " / "
                               << absl::CEscape(labels.second);
    // A label set written twice keeps its last value.
    double last = 0;
    for (const auto& [other, v] : written) {
      if (other == labels) last = v;
    }
    EXPECT_EQ(sample->value, last);  // the shortest form reads back exactly
  }
}

// Scrapes taken while other threads observe are always well formed: buckets
// monotonic, _count equal to the +Inf bucket.
TEST(ExpositionTest, ScrapesDuringUpdatesParse) {
  Registry registry;
  absl::StatusOr<HistogramFamily*> latency =
      registry.AddHistogramFamily("latency_seconds", "Latency.", {"method"}, {0.001, 0.01, 0.1, 1});
  absl::StatusOr<CounterFamily*> calls = registry.AddCounterFamily("calls_total", "C.", {"m"});
  ASSERT_TRUE(latency.ok() && calls.ok());
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int t = 0; t < 3; ++t) {
    writers.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::exponential_distribution<double> seconds(20);
      const std::string method = absl::StrCat("M", t);
      while (!stop.load()) {
        (*(*latency)->WithLabels({method}))->Observe(seconds(rng));
        (*(*calls)->WithLabels({method}))->Increment();
      }
    });
  }
  for (int scrape = 0; scrape < 200; ++scrape) {
    absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(registry.TextExposition());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
  }
  stop.store(true);
  for (std::thread& writer : writers) writer.join();
}

TEST(FormatSampleValueTest, ShortestFormReadsBackExactly) {
  EXPECT_EQ(FormatSampleValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatSampleValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatSampleValue(NAN), "NaN");
  EXPECT_EQ(FormatSampleValue(0.1), "0.1");
  EXPECT_EQ(FormatSampleValue(42), "42");
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> exponent(-300, 300);
  std::uniform_real_distribution<double> mantissa(-1, 1);
  for (int i = 0; i < 10000; ++i) {
    const double value = mantissa(rng) * std::pow(10.0, exponent(rng));
    const std::string text = FormatSampleValue(value);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), value) << text;
  }
}

}  // namespace
}  // namespace te::metrics
