#include "server/metrics/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace te::metrics {
namespace {

// Before C++20, std::atomic<double> has no fetch_add.
void AtomicAdd(std::atomic<double>& target, double delta) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + delta, std::memory_order_relaxed)) {
  }
}

bool IsMetricNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
}
bool IsMetricNameChar(char c) { return IsMetricNameStart(c) || (c >= '0' && c <= '9'); }
bool IsLabelNameStart(char c) { return IsMetricNameStart(c) && c != ':'; }
bool IsLabelNameChar(char c) { return IsMetricNameChar(c) && c != ':'; }

bool IsMetricName(absl::string_view name) {
  if (name.empty() || !IsMetricNameStart(name[0])) return false;
  return std::all_of(name.begin(), name.end(), IsMetricNameChar);
}

bool IsLabelName(absl::string_view name) {
  if (name.empty() || !IsLabelNameStart(name[0])) return false;
  return std::all_of(name.begin(), name.end(), IsLabelNameChar);
}

// Prometheus rejects a scrape whose label values are not UTF-8.
bool IsValidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char lead = static_cast<unsigned char>(text[i]);
    int extra = 0;
    uint32_t code = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      extra = 1;
      code = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      extra = 2;
      code = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      extra = 3;
      code = lead & 0x07;
    } else {
      return false;
    }
    if (i + extra >= text.size()) return false;  // truncated sequence
    for (int k = 1; k <= extra; ++k) {
      const unsigned char next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xC0) != 0x80) return false;
      code = (code << 6) | (next & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
    static constexpr uint32_t kMinForLength[] = {0, 0x80, 0x800, 0x10000};
    if (code < kMinForLength[extra] || (code >= 0xD800 && code <= 0xDFFF) || code > 0x10FFFF) {
      return false;
    }
    i += extra + 1;
  }
  return true;
}

// Label values joined by a byte that never occurs in UTF-8 text.
std::string ChildKey(absl::Span<const absl::string_view> label_values) {
  return absl::StrJoin(label_values, "\xff");
}

void AppendLabels(const std::vector<std::string>& names, const std::vector<std::string>& values,
                  absl::string_view extra_name, absl::string_view extra_value, std::string* out) {
  if (names.empty() && extra_name.empty()) return;
  out->push_back('{');
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out->push_back(',');
    absl::StrAppend(out, names[i], "=\"", EscapeLabelValue(values[i]), "\"");
  }
  if (!extra_name.empty()) {
    if (!names.empty()) out->push_back(',');
    absl::StrAppend(out, extra_name, "=\"", extra_value, "\"");
  }
  out->push_back('}');
}

void AppendSample(absl::string_view name, const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values, double value, std::string* out) {
  out->append(name.data(), name.size());
  AppendLabels(label_names, label_values, "", "", out);
  absl::StrAppend(out, " ", FormatSampleValue(value), "\n");
}

void AppendMetric(const FamilyBase& family, const std::vector<std::string>& label_values,
                  const Counter& counter, std::string* out) {
  AppendSample(family.name(), family.label_names(), label_values, counter.Value(), out);
}

void AppendMetric(const FamilyBase& family, const std::vector<std::string>& label_values,
                  const Gauge& gauge, std::string* out) {
  AppendSample(family.name(), family.label_names(), label_values, gauge.Value(), out);
}

void AppendMetric(const FamilyBase& family, const std::vector<std::string>& label_values,
                  const Histogram& histogram, std::string* out) {
  const Histogram::Snapshot snapshot = histogram.Read();
  const std::string bucket_name = absl::StrCat(family.name(), "_bucket");
  const std::vector<double>& bounds = histogram.upper_bounds();
  for (size_t i = 0; i <= bounds.size(); ++i) {
    out->append(bucket_name);
    const std::string le =
        i < bounds.size() ? FormatSampleValue(bounds[i]) : FormatSampleValue(INFINITY);
    AppendLabels(family.label_names(), label_values, "le", le, out);
    absl::StrAppend(out, " ", snapshot.cumulative_counts[i], "\n");
  }
  AppendSample(absl::StrCat(family.name(), "_sum"), family.label_names(), label_values,
               snapshot.sum, out);
  absl::StrAppend(out, family.name(), "_count");
  AppendLabels(family.label_names(), label_values, "", "", out);
  absl::StrAppend(out, " ", snapshot.count, "\n");
}

template <typename Metric>
std::unique_ptr<Metric> MakeMetric(const std::vector<double>& bounds);
template <>
std::unique_ptr<Counter> MakeMetric<Counter>(const std::vector<double>&) {
  return std::make_unique<Counter>();
}
template <>
std::unique_ptr<Gauge> MakeMetric<Gauge>(const std::vector<double>&) {
  return std::make_unique<Gauge>();
}
template <>
std::unique_ptr<Histogram> MakeMetric<Histogram>(const std::vector<double>& bounds) {
  return std::make_unique<Histogram>(bounds);
}

const char* TypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

void Counter::Increment(double delta) {
  if (!(delta >= 0)) return;  // also drops NaN
  AtomicAdd(value_, delta);
}

void Gauge::Add(double delta) { AtomicAdd(value_, delta); }

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      bucket_counts_(new std::atomic<uint64_t>[upper_bounds_.size() + 1]) {
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) bucket_counts_[i].store(0);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  const size_t bucket =
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  bucket_counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot snapshot;
  snapshot.cumulative_counts.resize(upper_bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    running += bucket_counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts[i] = running;
  }
  snapshot.count = running;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

template <typename Metric>
Family<Metric>::Family(std::string name, std::string help, std::vector<std::string> label_names,
                       std::vector<double> histogram_bounds, int max_label_sets)
    : FamilyBase(std::move(name), std::move(help), std::move(label_names)),
      histogram_bounds_(std::move(histogram_bounds)),
      max_label_sets_(max_label_sets) {}

template <typename Metric>
absl::StatusOr<Metric*> Family<Metric>::WithLabels(
    absl::Span<const absl::string_view> label_values) {
  if (label_values.size() != label_names().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": ", label_values.size(), " label values for ", label_names().size(),
                     " labels (", absl::StrJoin(label_names(), ", "), ")"));
  }
  const std::string key = ChildKey(label_values);
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto found = children_.find(key);
    if (found != children_.end()) return found->second->metric.get();
  }
  for (size_t i = 0; i < label_values.size(); ++i) {
    if (!IsValidUtf8(label_values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": the value of label ", label_names()[i], " is not valid UTF-8"));
    }
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  std::unique_ptr<Child>& child = children_[key];
  if (child == nullptr) {  // another thread may have made it since the reader lock
    if (static_cast<int>(children_.size()) > max_label_sets_) {
      children_.erase(key);
      return absl::ResourceExhaustedError(absl::StrCat(name(), ": already ", max_label_sets_,
                                                       " label sets; is a label carrying ids?"));
    }
    child = std::make_unique<Child>();
    for (absl::string_view value : label_values) child->label_values.emplace_back(value);
    child->metric = MakeMetric<Metric>(histogram_bounds_);
  }
  return child->metric.get();
}

template <>
MetricType Family<Counter>::type() const {
  return MetricType::kCounter;
}
template <>
MetricType Family<Gauge>::type() const {
  return MetricType::kGauge;
}
template <>
MetricType Family<Histogram>::type() const {
  return MetricType::kHistogram;
}

template <typename Metric>
void Family<Metric>::AppendText(std::string* out) const {
  std::vector<const Child*> sorted;
  {
    std::shared_lock<std::shared_mutex> lock(mu_);
    sorted.reserve(children_.size());
    for (const auto& entry : children_) sorted.push_back(entry.second.get());
  }
  if (sorted.empty()) return;
  // Children are never removed, so the pointers outlive the lock.
  std::sort(sorted.begin(), sorted.end(),
            [](const Child* a, const Child* b) { return a->label_values < b->label_values; });
  absl::StrAppend(out, "# HELP ", name(), " ", EscapeHelp(help()), "\n");
  absl::StrAppend(out, "# TYPE ", name(), " ", TypeName(type()), "\n");
  for (const Child* child : sorted) AppendMetric(*this, child->label_values, *child->metric, out);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Registry(RegistryOptions options) : options_(options) {}

absl::Status Registry::Reserve(const std::string& name, MetricType type,
                               const std::vector<std::string>& label_names) {
  if (!IsMetricName(name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric name \"", name, "\" does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  // promtool's lint, and every dashboard's assumption.
  if (type == MetricType::kCounter && !absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter name \"", name, "\" must end in _total"));
  }
  absl::flat_hash_set<absl::string_view> seen;
  for (const std::string& label : label_names) {
    if (!IsLabelName(label) || absl::StartsWith(label, "__")) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": label name \"", label,
                       "\" does not match [a-zA-Z_][a-zA-Z0-9_]* or starts with __ (reserved)"));
    }
    if (type == MetricType::kHistogram && label == "le") {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": \"le\" is the bucket label of a histogram"));
    }
    if (!seen.insert(label).second) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": label \"", label, "\" named twice"));
    }
  }
  std::vector<std::string> samples = {name};
  if (type == MetricType::kHistogram) {
    samples = {name, name + "_bucket", name + "_sum", name + "_count"};
  }
  for (const std::string& sample : samples) {
    if (sample_names_.contains(sample)) {
      return absl::AlreadyExistsError(
          absl::StrCat("metric \"", name, "\": the sample name ", sample, " is taken"));
    }
  }
  // A histogram's samples also clash with a later family named like them.
  sample_names_.insert(samples.begin(), samples.end());
  return absl::OkStatus();
}

absl::StatusOr<CounterFamily*> Registry::AddCounterFamily(std::string name, std::string help,
                                                          std::vector<std::string> label_names) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (absl::Status status = Reserve(name, MetricType::kCounter, label_names); !status.ok()) {
    return status;
  }
  auto family =
      std::make_unique<CounterFamily>(std::move(name), std::move(help), std::move(label_names),
                                      std::vector<double>{}, options_.max_label_sets_per_family);
  CounterFamily* result = family.get();
  families_.push_back(std::move(family));
  return result;
}

absl::StatusOr<GaugeFamily*> Registry::AddGaugeFamily(std::string name, std::string help,
                                                      std::vector<std::string> label_names) {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (absl::Status status = Reserve(name, MetricType::kGauge, label_names); !status.ok()) {
    return status;
  }
  auto family =
      std::make_unique<GaugeFamily>(std::move(name), std::move(help), std::move(label_names),
                                    std::vector<double>{}, options_.max_label_sets_per_family);
  GaugeFamily* result = family.get();
  families_.push_back(std::move(family));
  return result;
}

absl::StatusOr<HistogramFamily*> Registry::AddHistogramFamily(std::string name, std::string help,
                                                              std::vector<std::string> label_names,
                                                              std::vector<double> upper_bounds) {
  for (size_t i = 0; i < upper_bounds.size(); ++i) {
    if (!std::isfinite(upper_bounds[i]) || (i > 0 && !(upper_bounds[i] > upper_bounds[i - 1]))) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": bucket bound [", i, "] = ", FormatSampleValue(upper_bounds[i]),
                       "; bounds must be finite and strictly increasing (+Inf is implicit)"));
    }
  }
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (absl::Status status = Reserve(name, MetricType::kHistogram, label_names); !status.ok()) {
    return status;
  }
  auto family = std::make_unique<HistogramFamily>(std::move(name), std::move(help),
                                                  std::move(label_names), std::move(upper_bounds),
                                                  options_.max_label_sets_per_family);
  HistogramFamily* result = family.get();
  families_.push_back(std::move(family));
  return result;
}

absl::StatusOr<Counter*> Registry::AddCounter(std::string name, std::string help) {
  absl::StatusOr<CounterFamily*> family = AddCounterFamily(std::move(name), std::move(help), {});
  if (!family.ok()) return family.status();
  return (*family)->WithLabels({});
}

absl::StatusOr<Gauge*> Registry::AddGauge(std::string name, std::string help) {
  absl::StatusOr<GaugeFamily*> family = AddGaugeFamily(std::move(name), std::move(help), {});
  if (!family.ok()) return family.status();
  return (*family)->WithLabels({});
}

std::string Registry::TextExposition() const {
  std::string out;
  std::shared_lock<std::shared_mutex> lock(mu_);
  for (const auto& family : families_) family->AppendText(&out);
  return out;
}

std::string FormatSampleValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[32];
  const std::to_chars_result result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out.push_back(c);
    }
  }
  return out;
}

}  // namespace te::metrics
