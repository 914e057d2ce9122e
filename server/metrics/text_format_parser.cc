#include "server/metrics/text_format_parser.h"

#include <cmath>
#include <cstdlib>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace te::metrics::testing {
namespace {

bool IsMetricNameChar(char c, bool first) {
  if (absl::ascii_isalpha(c) || c == '_' || c == ':') return true;
  return !first && absl::ascii_isdigit(c);
}

bool IsLabelNameChar(char c, bool first) { return c != ':' && IsMetricNameChar(c, first); }

bool IsMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    if (!IsMetricNameChar(name[i], i == 0)) return false;
  }
  return true;
}

// Decimal floats as Go's ParseFloat reads them, without hex or underscores:
// [+-]? (digits [. digits?] | . digits) ([eE] [+-]? digits)?, or the specials.
bool ParseValue(absl::string_view token, double* value) {
  if (token == "+Inf" || token == "Inf") {
    *value = INFINITY;
    return true;
  }
  if (token == "-Inf") {
    *value = -INFINITY;
    return true;
  }
  if (token == "NaN") {
    *value = NAN;
    return true;
  }
  size_t i = 0;
  if (i < token.size() && (token[i] == '+' || token[i] == '-')) ++i;
  size_t digits = 0;
  while (i < token.size() && absl::ascii_isdigit(token[i])) ++i, ++digits;
  if (i < token.size() && token[i] == '.') {
    ++i;
    while (i < token.size() && absl::ascii_isdigit(token[i])) ++i, ++digits;
  }
  if (digits == 0) return false;
  if (i < token.size() && (token[i] == 'e' || token[i] == 'E')) {
    ++i;
    if (i < token.size() && (token[i] == '+' || token[i] == '-')) ++i;
    size_t exponent_digits = 0;
    while (i < token.size() && absl::ascii_isdigit(token[i])) ++i, ++exponent_digits;
    if (exponent_digits == 0) return false;
  }
  if (i != token.size()) return false;
  *value = std::strtod(std::string(token).c_str(), nullptr);
  return true;
}

bool ParseTimestamp(absl::string_view token) {
  size_t i = (!token.empty() && token[0] == '-') ? 1 : 0;
  if (i == token.size()) return false;
  for (; i < token.size(); ++i) {
    if (!absl::ascii_isdigit(token[i])) return false;
  }
  return true;
}

// Help text: only \\ and \n are escapes.
bool UnescapeHelp(absl::string_view text, std::string* out) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\') {
      out->push_back(text[i]);
      continue;
    }
    if (++i == text.size()) return false;
    if (text[i] == '\\') {
      out->push_back('\\');
    } else if (text[i] == 'n') {
      out->push_back('\n');
    } else {
      return false;
    }
  }
  return true;
}

struct SampleAt {
  ParsedSample sample;
  int line = 0;
};

struct FamilyState {
  ParsedFamily family;
  std::vector<int> sample_lines;
  bool has_help = false;
  bool has_type = false;
};

class Parser {
 public:
  absl::StatusOr<std::vector<ParsedFamily>> Run(absl::string_view text) {
    if (!text.empty() && text.back() != '\n') {
      return absl::InvalidArgumentError("the text does not end with a line feed");
    }
    std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
    lines.pop_back();  // the empty piece after the final '\n'
    for (size_t i = 0; i < lines.size(); ++i) {
      line_number_ = static_cast<int>(i) + 1;
      line_ = lines[i];
      if (absl::Status status = ParseLine(); !status.ok()) return status;
    }
    std::vector<ParsedFamily> result;
    for (FamilyState& state : families_) {
      if (absl::Status status = CheckFamily(state); !status.ok()) return status;
      result.push_back(std::move(state.family));
    }
    return result;
  }

 private:
  absl::Status Error(absl::string_view rule) const {
    return absl::InvalidArgumentError(
        absl::StrCat("line ", line_number_, ": ", rule, ": `", line_, "`"));
  }
  static absl::Status ErrorAt(int line, absl::string_view family, absl::string_view rule) {
    return absl::InvalidArgumentError(absl::StrCat("line ", line, ": ", family, ": ", rule));
  }

  FamilyState& Family(const std::string& name) {
    auto [it, inserted] = index_.try_emplace(name, families_.size());
    if (inserted) {
      families_.emplace_back();
      families_.back().family.name = name;
    }
    return families_[it->second];
  }

  absl::Status ParseLine() {
    if (line_.empty()) return absl::OkStatus();
    if (line_[0] == '#') return ParseComment();
    return ParseSample();
  }

  absl::Status ParseComment() {
    std::vector<absl::string_view> parts = absl::StrSplit(line_, absl::MaxSplits(' ', 3));
    if (parts.size() < 2 || parts[0] != "#" || (parts[1] != "HELP" && parts[1] != "TYPE")) {
      return absl::OkStatus();  // a plain comment
    }
    if (parts.size() < 3 || !IsMetricName(parts[2])) {
      return Error("HELP / TYPE needs a valid metric name");
    }
    const std::string name(parts[2]);
    FamilyState& state = Family(name);
    if (!state.family.samples.empty()) return Error("HELP / TYPE after the family's samples");
    if (parts[1] == "HELP") {
      if (state.has_help) return Error("a second HELP for the family");
      state.has_help = true;
      if (parts.size() == 4 && !UnescapeHelp(parts[3], &state.family.help)) {
        return Error("help text escapes only \\\\ and \\n");
      }
      return absl::OkStatus();
    }
    if (state.has_type) return Error("a second TYPE for the family");
    static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                                 "untyped"};
    if (parts.size() != 4 || !kTypes.count(std::string(parts[3]))) {
      return Error("TYPE must be counter, gauge, histogram, summary or untyped");
    }
    state.has_type = true;
    state.family.type = std::string(parts[3]);
    return absl::OkStatus();
  }

  // The family a sample name belongs to: a histogram's or summary's suffixed
  // samples belong to the declared base name.
  std::string FamilyNameOf(const std::string& sample_name) const {
    for (absl::string_view suffix : {"_bucket", "_sum", "_count"}) {
      if (!absl::EndsWith(sample_name, suffix)) continue;
      const std::string base = sample_name.substr(0, sample_name.size() - suffix.size());
      auto found = index_.find(base);
      if (found == index_.end()) continue;
      const std::string& type = families_[found->second].family.type;
      if (type == "histogram" || (type == "summary" && suffix != "_bucket")) return base;
    }
    return sample_name;
  }

  absl::Status ParseSample() {
    ParsedSample sample;
    size_t i = 0;
    while (i < line_.size() && IsMetricNameChar(line_[i], i == 0)) ++i;
    if (i == 0) return Error("a sample starts with a metric name [a-zA-Z_:][a-zA-Z0-9_:]*");
    sample.name = std::string(line_.substr(0, i));
    if (i < line_.size() && line_[i] == '{') {
      ++i;
      if (absl::Status status = ParseLabels(&i, &sample.labels); !status.ok()) return status;
    }
    if (i >= line_.size() || line_[i] != ' ') return Error("one space before the value");
    std::vector<absl::string_view> rest = absl::StrSplit(line_.substr(i + 1), ' ');
    if (rest.size() > 2 || rest[0].empty()) return Error("a value and an optional timestamp");
    if (!ParseValue(rest[0], &sample.value)) {
      return Error("the value is not a float, +Inf, -Inf or NaN");
    }
    if (rest.size() == 2 && !ParseTimestamp(rest[1])) {
      return Error("the timestamp is not an integer");
    }

    std::string series = sample.name;
    for (const auto& [name, value] : sample.labels) {
      absl::StrAppend(&series, "\xff", name, "\xff", value);
    }
    if (!series_.insert(series).second) return Error("a series that appeared before");

    const std::string family_name = FamilyNameOf(sample.name);
    auto found = index_.find(family_name);
    const bool had_samples =
        found != index_.end() && !families_[found->second].family.samples.empty();
    if (had_samples && family_name != current_family_) {
      return Error("the family's samples are not contiguous");
    }
    current_family_ = family_name;
    FamilyState& state = Family(family_name);
    state.family.samples.push_back(std::move(sample));
    state.sample_lines.push_back(line_number_);
    return absl::OkStatus();
  }

  absl::Status ParseLabels(size_t* at, std::map<std::string, std::string>* labels) {
    size_t& i = *at;
    while (true) {
      if (i < line_.size() && line_[i] == '}') {  // also after a trailing comma
        ++i;
        return absl::OkStatus();
      }
      const size_t start = i;
      while (i < line_.size() && IsLabelNameChar(line_[i], i == start)) ++i;
      const std::string name(line_.substr(start, i - start));
      if (name.empty()) return Error("a label name [a-zA-Z_][a-zA-Z0-9_]*");
      if (absl::StartsWith(name, "__")) return Error("label names starting with __ are reserved");
      if (i + 1 >= line_.size() || line_[i] != '=' || line_[i + 1] != '"') {
        return Error("a label is name=\"value\"");
      }
      i += 2;
      std::string value;
      while (true) {
        if (i >= line_.size()) return Error("an unterminated label value");
        const char c = line_[i++];
        if (c == '"') break;
        if (c != '\\') {
          value.push_back(c);
          continue;
        }
        if (i >= line_.size()) return Error("an unterminated escape");
        const char escaped = line_[i++];
        if (escaped == '\\' || escaped == '"') {
          value.push_back(escaped);
        } else if (escaped == 'n') {
          value.push_back('\n');
        } else {
          return Error("label values escape only \\\\, \\\" and \\n");
        }
      }
      if (!labels->emplace(name, std::move(value)).second) {
        return Error(absl::StrCat("label ", name, " twice"));
      }
      if (i < line_.size() && line_[i] == ',') {
        ++i;
      } else if (i >= line_.size() || line_[i] != '}') {
        return Error("labels are separated by , and closed by }");
      }
    }
  }

  static absl::Status CheckFamily(const FamilyState& state) {
    const ParsedFamily& family = state.family;
    const int first_line = state.sample_lines.empty() ? 0 : state.sample_lines[0];
    if (!state.has_help || !state.has_type) {
      return ErrorAt(first_line, family.name, "a family without HELP or TYPE");
    }
    if (family.type == "counter") {
      for (size_t i = 0; i < family.samples.size(); ++i) {
        if (!(family.samples[i].value >= 0)) {
          return ErrorAt(state.sample_lines[i], family.name, "a counter below 0 or NaN");
        }
      }
    }
    if (family.type == "histogram") return CheckHistogram(state);
    if (family.type == "summary") return absl::OkStatus();  // never exported here
    for (size_t i = 0; i < family.samples.size(); ++i) {
      if (family.samples[i].name != family.name) {
        return ErrorAt(state.sample_lines[i], family.name, "a sample of another name");
      }
    }
    return absl::OkStatus();
  }

  struct HistogramSeries {
    std::vector<std::pair<double, double>> buckets;  // (le, cumulative count)
    int sums = 0;
    int counts = 0;
    double count = 0;
    int last_line = 0;
  };

  static absl::Status CheckHistogram(const FamilyState& state) {
    const ParsedFamily& family = state.family;
    std::map<std::map<std::string, std::string>, HistogramSeries> series;
    for (size_t i = 0; i < family.samples.size(); ++i) {
      const ParsedSample& sample = family.samples[i];
      const int line = state.sample_lines[i];
      std::map<std::string, std::string> labels = sample.labels;
      auto le = labels.find("le");
      const bool is_bucket = sample.name == family.name + "_bucket";
      if (is_bucket != (le != labels.end())) {
        return ErrorAt(line, family.name, "\"le\" is on every _bucket sample and only there");
      }
      if (is_bucket) {
        double bound = 0;
        if (!ParseValue(le->second, &bound) || std::isnan(bound)) {
          return ErrorAt(line, family.name, "le is not a float");
        }
        labels.erase(le);
        HistogramSeries& s = series[labels];
        if (!s.buckets.empty() && !(bound > s.buckets.back().first)) {
          return ErrorAt(line, family.name, "le does not increase");
        }
        if (!(sample.value >= 0) || sample.value != std::floor(sample.value) ||
            std::isinf(sample.value)) {
          return ErrorAt(line, family.name, "a bucket count that is not a non-negative integer");
        }
        if (!s.buckets.empty() && sample.value < s.buckets.back().second) {
          return ErrorAt(line, family.name, "bucket counts decrease");
        }
        s.buckets.emplace_back(bound, sample.value);
        s.last_line = line;
      } else if (sample.name == family.name + "_sum") {
        series[labels].sums++;
      } else if (sample.name == family.name + "_count") {
        HistogramSeries& s = series[labels];
        s.counts++;
        s.count = sample.value;
        s.last_line = line;
      } else {
        return ErrorAt(line, family.name, "a histogram sample not _bucket, _sum or _count");
      }
    }
    for (const auto& [labels, s] : series) {
      if (s.buckets.empty() || !std::isinf(s.buckets.back().first)) {
        return ErrorAt(s.last_line, family.name, "no le=\"+Inf\" bucket last");
      }
      if (s.sums != 1 || s.counts != 1) {
        return ErrorAt(s.last_line, family.name, "not exactly one _sum and one _count");
      }
      if (s.count != s.buckets.back().second) {
        return ErrorAt(s.last_line, family.name, "_count differs from the +Inf bucket");
      }
    }
    return absl::OkStatus();
  }

  std::vector<FamilyState> families_;
  absl::flat_hash_map<std::string, size_t> index_;
  std::set<std::string> series_;
  std::string current_family_;
  absl::string_view line_;
  int line_number_ = 0;
};

}  // namespace

absl::StatusOr<std::vector<ParsedFamily>> ParseTextFormat(absl::string_view text) {
  return Parser().Run(text);
}

const ParsedSample* FindSample(const std::vector<ParsedFamily>& families, absl::string_view name,
                               const std::map<std::string, std::string>& labels) {
  for (const ParsedFamily& family : families) {
    for (const ParsedSample& sample : family.samples) {
      if (sample.name == name && sample.labels == labels) return &sample;
    }
  }
  return nullptr;
}

}  // namespace te::metrics::testing
