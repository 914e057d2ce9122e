// Prometheus's own tools for tests of te_server's /metrics endpoint (Debian's
// prometheus package: /usr/bin/prometheus and /usr/bin/promtool):
//   PrometheusServer  a real Prometheus, started on a loopback port with a
//                     config that scrapes the given targets every second, and
//                     queried through its HTTP API (/api/v1/query);
//   PromtoolCheckMetrics  `promtool check metrics` over one scrape.
// A missing tool is an error (FAILED_PRECONDITION), never a pass: the tests
// that use these run in CI, where deploy/install_deps.sh installs them.
#ifndef TE_TESTS_METRICS_PROMETHEUS_FIXTURE_H_
#define TE_TESTS_METRICS_PROMETHEUS_FIXTURE_H_

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace te::testing {

// One series of an instant query's answer.
struct PromSample {
  std::map<std::string, std::string> labels;
  double value = 0;
};

class PrometheusServer {
 public:
  // Starts Prometheus scraping `targets` ("127.0.0.1:PORT", at /metrics) as
  // job `job`, and waits until it answers /-/ready. Its data and log go to a
  // temporary folder, removed when it stops.
  static absl::StatusOr<std::unique_ptr<PrometheusServer>> Start(
      const std::vector<std::string>& targets, const std::string& job = "te_server");
  ~PrometheusServer();  // SIGTERM, then SIGKILL after 10 s; removes its folder
  PrometheusServer(const PrometheusServer&) = delete;
  PrometheusServer& operator=(const PrometheusServer&) = delete;

  // The instant vector `expr` evaluates to now. INVALID_ARGUMENT: Prometheus
  // refused the query; UNAVAILABLE: no answer.
  absl::StatusOr<std::vector<PromSample>> Query(const std::string& expr) const;

  // Polls `expr` (every 250 ms) until it is one series whose value `accept`s,
  // and returns that value. DEADLINE_EXCEEDED, with the last answer, after
  // `timeout`.
  absl::StatusOr<double> WaitFor(const std::string& expr, const std::function<bool(double)>& accept,
                                 absl::Duration timeout = absl::Seconds(30)) const;

  // The targets' scrape errors as Prometheus reports them (/api/v1/targets);
  // empty when every scrape so far succeeded.
  absl::StatusOr<std::vector<std::string>> ScrapeErrors() const;

  int port() const { return port_; }
  // The last lines of Prometheus's log, for failure messages.
  std::string LogTail() const;

 private:
  PrometheusServer(pid_t pid, int port, std::string dir) : pid_(pid), port_(port), dir_(std::move(dir)) {}
  absl::StatusOr<std::string> Get(const std::string& path_and_query) const;

  pid_t pid_;
  int port_;
  std::string dir_;
};

// `promtool check metrics` over `exposition` (one scrape's body): OK, or
// INVALID_ARGUMENT with promtool's complaints (format errors and lint
// problems alike: promtool exits non-zero on either).
absl::Status PromtoolCheckMetrics(const std::string& exposition);

// Where `tool` is on $PATH (or /usr/bin); FAILED_PRECONDITION naming the
// Debian package when it is nowhere.
absl::StatusOr<std::string> FindPrometheusTool(const std::string& tool);

}  // namespace te::testing

#endif  // TE_TESTS_METRICS_PROMETHEUS_FIXTURE_H_
