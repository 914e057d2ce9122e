// A strict parser of Prometheus's text exposition format 0.0.4, written from
// the format's published rules, for tests: it accepts what Prometheus accepts
// and additionally demands what a well-formed exporter always provides.
//
// Checked, each a failure naming the line:
//  1. Lines end in '\n' (the text too); a line is blank, "# HELP name text",
//     "# TYPE name type", another "#" comment, or a sample
//     `name[{label="value",...}] value [timestamp_ms]` with single spaces.
//  2. Metric names match [a-zA-Z_:][a-zA-Z0-9_:]*; label names match
//     [a-zA-Z_][a-zA-Z0-9_]*, do not start with "__", and occur once per sample.
//  3. Label values escape only \\, \" and \n; help text only \\ and \n.
//  4. Values are decimal floats, "+Inf", "-Inf" or "NaN"; timestamps integers.
//  5. A family has at most one HELP and one TYPE, both before its first sample;
//     its samples are contiguous; no series (name + label set) repeats.
//     Stricter than Prometheus: every family has HELP and TYPE.
//  6. Counters are >= 0 (never NaN). Histograms have, per label set, _bucket
//     samples with an "le" label, le strictly increasing and ending at +Inf,
//     counts non-negative integers that never decrease, and a _sum and a
//     _count, with _count equal to the +Inf bucket; no other suffixes.
#ifndef TE_SERVER_METRICS_TEXT_FORMAT_PARSER_H_
#define TE_SERVER_METRICS_TEXT_FORMAT_PARSER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace te::metrics::testing {

struct ParsedSample {
  std::string name;                           // as written, with any _bucket / _sum / _count suffix
  std::map<std::string, std::string> labels;  // unescaped values
  double value = 0;
};

struct ParsedFamily {
  std::string name;
  std::string help;  // unescaped
  std::string type;  // counter, gauge, histogram, summary, untyped
  std::vector<ParsedSample> samples;
};

// The families in order of appearance, or INVALID_ARGUMENT naming the line and
// the rule it breaks.
absl::StatusOr<std::vector<ParsedFamily>> ParseTextFormat(absl::string_view text);

// The first sample named `name` with exactly `labels`, in any family; nullptr if none.
const ParsedSample* FindSample(const std::vector<ParsedFamily>& families, absl::string_view name,
                               const std::map<std::string, std::string>& labels);

}  // namespace te::metrics::testing

#endif  // TE_SERVER_METRICS_TEXT_FORMAT_PARSER_H_
