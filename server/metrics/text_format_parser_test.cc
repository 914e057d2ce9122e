// The strict parser is what the exporter's tests trust, so it is tested on
// its own: good text parses to the right values, and each rule, broken once,
// fails with INVALID_ARGUMENT naming the line.
#include "server/metrics/text_format_parser.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "absl/strings/match.h"

namespace te::metrics::testing {
namespace {

constexpr char kGood[] =
    "# A comment that is neither HELP nor TYPE.\n"
    "# HELP http_requests_total The total number of HTTP requests.\n"
    "# TYPE http_requests_total counter\n"
    "http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000\n"
    "http_requests_total{method=\"post\",code=\"400\",} 3 1395066363000\n"
    "\n"
    "# TYPE msdos_file_access_time_seconds gauge\n"
    "# HELP msdos_file_access_time_seconds Escapes: \\\\ and \\n.\n"
    "msdos_file_access_time_seconds{path=\"C:\\\\DIR\\\\FILE.TXT\",error=\"Cannot find "
    "file:\\n\\\"FILE.TXT\\\"\"} 1.458255915e9\n"
    "# HELP metric_without_labels_or_timestamp A gauge.\n"
    "# TYPE metric_without_labels_or_timestamp gauge\n"
    "metric_without_labels_or_timestamp -Inf\n"
    "# HELP a_nan A gauge.\n"
    "# TYPE a_nan gauge\n"
    "a_nan NaN\n"
    "# HELP http_request_duration_seconds A histogram of the request duration.\n"
    "# TYPE http_request_duration_seconds histogram\n"
    "http_request_duration_seconds_bucket{le=\"0.05\"} 24054\n"
    "http_request_duration_seconds_bucket{le=\"0.1\"} 33444\n"
    "http_request_duration_seconds_bucket{le=\"0.2\"} 100392\n"
    "http_request_duration_seconds_bucket{le=\"+Inf\"} 144320\n"
    "http_request_duration_seconds_sum 53423\n"
    "http_request_duration_seconds_count 144320\n";

TEST(ParseTextFormatTest, ParsesTheFormatsOwnExample) {
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(kGood);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 5u);
  EXPECT_EQ((*parsed)[0].name, "http_requests_total");
  EXPECT_EQ((*parsed)[0].type, "counter");
  EXPECT_EQ((*parsed)[1].help, "Escapes: \\ and \n.");
  EXPECT_EQ((*parsed)[4].type, "histogram");
  EXPECT_EQ((*parsed)[4].samples.size(), 6u);

  const ParsedSample* post_400 =
      FindSample(*parsed, "http_requests_total", {{"method", "post"}, {"code", "400"}});
  ASSERT_NE(post_400, nullptr);
  EXPECT_EQ(post_400->value, 3);
  const ParsedSample* file =
      FindSample(*parsed, "msdos_file_access_time_seconds",
                 {{"path", "C:\\DIR\\FILE.TXT"}, {"error", "Cannot find file:\n\"FILE.TXT\""}});
  ASSERT_NE(file, nullptr);
  EXPECT_EQ(file->value, 1.458255915e9);
  const ParsedSample* minus_inf = FindSample(*parsed, "metric_without_labels_or_timestamp", {});
  ASSERT_NE(minus_inf, nullptr);
  EXPECT_EQ(minus_inf->value, -INFINITY);
  EXPECT_TRUE(std::isnan(FindSample(*parsed, "a_nan", {})->value));
  EXPECT_EQ(FindSample(*parsed, "http_request_duration_seconds_bucket", {{"le", "0.1"}})->value,
            33444);
}

TEST(ParseTextFormatTest, EmptyTextHasNoFamilies) {
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat("");
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->empty());
}

struct BadCase {
  const char* rule;
  const char* text;
  const char* line;  // the "line N" the error must name
};

constexpr char kGaugeHead[] = "# HELP g G.\n# TYPE g gauge\n";
constexpr char kHistogramHead[] = "# HELP h H.\n# TYPE h histogram\n";

class RejectsTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(RejectsTest, FailsWithInvalidArgumentNamingTheLine) {
  const BadCase& bad = GetParam();
  absl::StatusOr<std::vector<ParsedFamily>> parsed = ParseTextFormat(bad.text);
  ASSERT_FALSE(parsed.ok()) << bad.rule;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(parsed.status().message(), bad.line))
      << bad.rule << ": " << parsed.status();
}

std::string With(const char* head, const char* body) { return std::string(head) + body; }

const BadCase kBadCases[] = {
    {"no final line feed", "# HELP g G.\n# TYPE g gauge\ng 1", "line feed"},
    {"metric name starts with a digit", "1g 1\n", "line 1"},
    {"metric name with a dash", "# HELP g G.\n# TYPE g gauge\ng-x 1\n", "line 3"},
    {"two spaces before the value", "# HELP g G.\n# TYPE g gauge\ng  1\n", "line 3"},
    {"no value", "# HELP g G.\n# TYPE g gauge\ng\n", "line 3"},
    {"a value that is a word", "# HELP g G.\n# TYPE g gauge\ng one\n", "line 3"},
    {"a hex value", "# HELP g G.\n# TYPE g gauge\ng 0x10\n", "line 3"},
    {"lowercase inf", "# HELP g G.\n# TYPE g gauge\ng inf\n", "line 3"},
    {"a fractional timestamp", "# HELP g G.\n# TYPE g gauge\ng 1 2.5\n", "line 3"},
    {"a third field", "# HELP g G.\n# TYPE g gauge\ng 1 2 3\n", "line 3"},
    {"an unknown escape in a label", "# HELP g G.\n# TYPE g gauge\ng{a=\"\\t\"} 1\n", "line 3"},
    {"an unterminated label value", "# HELP g G.\n# TYPE g gauge\ng{a=\"x} 1\n", "line 3"},
    {"an unquoted label value", "# HELP g G.\n# TYPE g gauge\ng{a=x} 1\n", "line 3"},
    {"a space after a comma", "# HELP g G.\n# TYPE g gauge\ng{a=\"x\", b=\"y\"} 1\n", "line 3"},
    {"a label named twice", "# HELP g G.\n# TYPE g gauge\ng{a=\"x\",a=\"y\"} 1\n", "line 3"},
    {"a reserved label name", "# HELP g G.\n# TYPE g gauge\ng{__a=\"x\"} 1\n", "line 3"},
    {"a label name with a colon", "# HELP g G.\n# TYPE g gauge\ng{a:b=\"x\"} 1\n", "line 3"},
    {"an unknown escape in help", "# HELP g a\\tb\n# TYPE g gauge\ng 1\n", "line 1"},
    {"an unknown type", "# HELP g G.\n# TYPE g meter\ng 1\n", "line 2"},
    {"a second TYPE", "# HELP g G.\n# TYPE g gauge\n# TYPE g gauge\ng 1\n", "line 3"},
    {"a second HELP", "# HELP g G.\n# HELP g G.\n# TYPE g gauge\ng 1\n", "line 2"},
    {"TYPE after samples", "# HELP g G.\ng 1\n# TYPE g gauge\n", "line 3"},
    {"no TYPE", "# HELP g G.\ng 1\n", "line 2"},
    {"no HELP", "# TYPE g gauge\ng 1\n", "line 2"},
    {"a repeated series", "# HELP g G.\n# TYPE g gauge\ng{a=\"1\"} 1\ng{a=\"1\"} 2\n", "line 4"},
    {"families interleaved",
     "# HELP g G.\n# TYPE g gauge\n# HELP f F.\n# TYPE f gauge\ng{a=\"1\"} 1\nf 1\n"
     "g{a=\"2\"} 1\n",
     "line 7"},
    {"a negative counter", "# HELP c_total C.\n# TYPE c_total counter\nc_total -1\n", "line 3"},
    {"a NaN counter", "# HELP c_total C.\n# TYPE c_total counter\nc_total NaN\n", "line 3"},
    {"buckets decrease",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 5\n"
     "h_bucket{le=\"+Inf\"} 4\nh_sum 1\nh_count 4\n",
     "line 4"},
    {"le does not increase",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"2\"} 1\n"
     "h_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
     "line 4"},
    {"no +Inf bucket",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\n"
     "h_count 1\n",
     "line 5"},
    {"count differs from +Inf",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\n"
     "h_sum 1\nh_count 2\n",
     "line 5"},
    {"no _sum", "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 3\nh_count 3\n", "line 4"},
    {"a fractional bucket count",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1.5\n"
     "h_sum 1\nh_count 1.5\n",
     "line 3"},
    {"a bucket without le", "# HELP h H.\n# TYPE h histogram\nh_bucket 1\nh_sum 1\nh_count 1\n",
     "line 3"},
    {"le that is not a float",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"big\"} 1\n"
     "h_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
     "line 3"},
    {"a bare histogram sample", "# HELP h H.\n# TYPE h histogram\nh 1\n", "line 3"},
    {"le on _count",
     "# HELP h H.\n# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\n"
     "h_count{le=\"+Inf\"} 1\n",
     "line 5"},
};

INSTANTIATE_TEST_SUITE_P(Rules, RejectsTest, ::testing::ValuesIn(kBadCases));

// Series of a histogram are checked one by one, by their labels less le.
TEST(ParseTextFormatTest, HistogramSeriesAreCheckedPerLabelSet) {
  const std::string good = With(kHistogramHead,
                                "h_bucket{m=\"a\",le=\"1\"} 1\n"
                                "h_bucket{m=\"a\",le=\"+Inf\"} 2\n"
                                "h_sum{m=\"a\"} 3\n"
                                "h_count{m=\"a\"} 2\n"
                                "h_bucket{m=\"b\",le=\"1\"} 0\n"
                                "h_bucket{m=\"b\",le=\"+Inf\"} 0\n"
                                "h_sum{m=\"b\"} 0\n"
                                "h_count{m=\"b\"} 0\n");
  EXPECT_TRUE(ParseTextFormat(good).ok()) << ParseTextFormat(good).status();
  const std::string mixed = With(kHistogramHead,
                                 "h_bucket{m=\"a\",le=\"1\"} 1\n"
                                 "h_bucket{m=\"a\",le=\"+Inf\"} 2\n"
                                 "h_sum{m=\"a\"} 3\n"
                                 "h_count{m=\"b\"} 2\n"
                                 "h_sum{m=\"b\"} 3\n");
  EXPECT_EQ(ParseTextFormat(mixed).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ParseTextFormat(With(kGaugeHead, "g{a=\"x\",} 1\n")).ok());
}

}  // namespace
}  // namespace te::metrics::testing
