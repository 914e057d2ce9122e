// Prometheus metrics: counters, gauges and histograms, each a family of
// children keyed by label values, kept in a Registry that renders them in the
// text exposition format 0.0.4.
//
// Thread-safe throughout. Updating a metric is a few relaxed atomic operations
// and takes no lock. Finding a labelled child takes a reader lock; only the
// first use of a label set takes the writer lock. Child pointers stay valid for
// the registry's life, so a hot path may look a child up once and keep it.
#ifndef TE_SERVER_METRICS_METRICS_H_
#define TE_SERVER_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace te::metrics {

// A value that only goes up (requests served, bytes sent).
class Counter {
 public:
  // Adds `delta`. Negative and NaN deltas are dropped: a counter that went
  // down would read as a restart to Prometheus's rate().
  void Increment(double delta = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down (sessions open, bytes in use).
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta);
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into fixed buckets, plus their sum. A value v lands in
// the first bucket whose upper bound is >= v (Prometheus's "le"); values above
// every bound land in the implicit +Inf bucket.
class Histogram {
 public:
  // `upper_bounds` must be finite and strictly increasing (the Registry checks).
  explicit Histogram(std::vector<double> upper_bounds);

  // NaN observations are dropped: one would turn the sum into NaN for good.
  void Observe(double value);

  struct Snapshot {
    std::vector<uint64_t> cumulative_counts;  // one per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;  // equals cumulative_counts.back()
  };
  // Buckets are read one by one while others may observe: a snapshot is a
  // consistent histogram (monotonic, count == +Inf bucket) of a moment close
  // to the call, and the sum may lead or lag the counts by an observation.
  Snapshot Read() const;
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }

 private:
  const std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;  // not cumulative
  std::atomic<double> sum_{0.0};
};

enum class MetricType { kCounter, kGauge, kHistogram };

// What every family shares: a name, help text and label names, and the text
// rendering the Registry asks for.
class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  virtual MetricType type() const = 0;
  // Appends this family's HELP, TYPE and sample lines; nothing if no child exists yet.
  virtual void AppendText(std::string* out) const = 0;

 protected:
  FamilyBase(std::string name, std::string help, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), label_names_(std::move(label_names)) {}

 private:
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
};

// One metric per distinct set of label values. Made by the Registry.
template <typename Metric>
class Family final : public FamilyBase {
 public:
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> histogram_bounds, int max_label_sets);

  // The child for `label_values` (one per label name, in order), made on first
  // use. INVALID_ARGUMENT: the count differs from the label names', or a value
  // is not valid UTF-8. RESOURCE_EXHAUSTED: the family already holds its
  // maximum of label sets (a guard against labels that carry ids). The family
  // owns the child.
  absl::StatusOr<Metric*> WithLabels(absl::Span<const absl::string_view> label_values);

  MetricType type() const override;
  void AppendText(std::string* out) const override;

 private:
  struct Child {
    std::vector<std::string> label_values;
    std::unique_ptr<Metric> metric;
  };

  const std::vector<double> histogram_bounds_;  // histograms only
  const int max_label_sets_;
  // std::shared_mutex rather than absl::Mutex: Debian's abseil is not built
  // for ThreadSanitizer, which then cannot see absl::Mutex order anything.
  mutable std::shared_mutex mu_;  // guards children_ (not the metrics in it)
  absl::flat_hash_map<std::string, std::unique_ptr<Child>> children_;
};

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

struct RegistryOptions {
  // Label sets one family may hold; WithLabels answers RESOURCE_EXHAUSTED past it.
  int max_label_sets_per_family = 1000;
};

// Holds metric families and renders them all. Families live as long as the
// registry; registration order is exposition order.
class Registry {
 public:
  explicit Registry(RegistryOptions options = {});
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Each Add* returns the new family (owned by the registry), or
  // INVALID_ARGUMENT when a name breaks Prometheus's rules (metric names
  // [a-zA-Z_:][a-zA-Z0-9_:]*, label names [a-zA-Z_][a-zA-Z0-9_]* not starting
  // with "__", no label named twice), a counter's name does not end in
  // "_total", or histogram bounds are not finite and strictly increasing, or
  // use the label "le"; ALREADY_EXISTS when the name, or one of the sample
  // names a histogram adds (_bucket, _sum, _count), is taken.
  absl::StatusOr<CounterFamily*> AddCounterFamily(std::string name, std::string help,
                                                  std::vector<std::string> label_names);
  absl::StatusOr<GaugeFamily*> AddGaugeFamily(std::string name, std::string help,
                                              std::vector<std::string> label_names);
  absl::StatusOr<HistogramFamily*> AddHistogramFamily(std::string name, std::string help,
                                                      std::vector<std::string> label_names,
                                                      std::vector<double> upper_bounds);

  // Unlabelled metrics: the family and its one child, which shows (as 0) from
  // the first scrape on. Failures as above.
  absl::StatusOr<Counter*> AddCounter(std::string name, std::string help);
  absl::StatusOr<Gauge*> AddGauge(std::string name, std::string help);

  // Every family with at least one child, in the text format 0.0.4.
  std::string TextExposition() const;

 private:
  absl::Status Reserve(const std::string& name, MetricType type,
                       const std::vector<std::string>& label_names);

  const RegistryOptions options_;
  mutable std::shared_mutex mu_;  // guards the two below
  std::vector<std::unique_ptr<FamilyBase>> families_;
  absl::flat_hash_set<std::string> sample_names_;
};

// The content type of TextExposition()'s output, for an HTTP answer.
inline constexpr char kTextContentType[] = "text/plain; version=0.0.4; charset=utf-8";

// Exposed for the tests and the parser: Prometheus's spelling of a sample
// value ("+Inf", "-Inf", "NaN", else the shortest decimal that reads back
// exactly), and the escapes of label values and help text.
std::string FormatSampleValue(double value);
std::string EscapeLabelValue(absl::string_view value);
std::string EscapeHelp(absl::string_view help);

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_METRICS_H_
