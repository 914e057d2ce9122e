#include "tests/metrics/prometheus_fixture.h"

#include <fcntl.h>
#include <httplib.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/ports.h"

extern char** environ;

namespace te::testing {
namespace {

std::string TempRoot() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

absl::StatusOr<std::string> MakeTempDir(const std::string& stem) {
  std::string path = absl::StrCat(TempRoot(), "/", stem, ".XXXXXX");
  if (mkdtemp(path.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", path, ": ", std::strerror(errno)));
  }
  return path;
}

// Starts `argv` with stdin from `in` ("" for /dev/null) and stdout and stderr
// into `log`, no signals blocked.
absl::StatusOr<pid_t> Spawn(std::vector<std::string> args, const std::string& in,
                            const std::string& log) {
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, in.empty() ? "/dev/null" : in.c_str(), O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, args[0].c_str(), &files, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&files);
  if (spawned != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", args[0], ": ", std::strerror(spawned)));
  }
  return pid;
}

// Percent-encodes everything but RFC 3986's unreserved characters.
std::string UrlEncode(const std::string& text) {
  static const char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out += {'%', kHex[c >> 4], kHex[c & 15]};
    }
  }
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Tail(const std::string& text, size_t lines) {
  std::vector<absl::string_view> all = absl::StrSplit(text, '\n');
  if (all.size() > lines) all.erase(all.begin(), all.end() - lines);
  return absl::StrJoin(all, "\n");
}

}  // namespace

absl::StatusOr<std::string> FindPrometheusTool(const std::string& tool) {
  const char* path_env = std::getenv("PATH");
  std::vector<std::string> dirs = absl::StrSplit(path_env != nullptr ? path_env : "", ':',
                                                 absl::SkipEmpty());
  dirs.push_back("/usr/bin");
  for (const std::string& dir : dirs) {
    const std::string candidate = absl::StrCat(dir, "/", tool);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return absl::FailedPreconditionError(
      absl::StrCat(tool, " not found on $PATH or in /usr/bin: install Debian's prometheus package "
                         "(deploy/install_deps.sh)"));
}

absl::Status PromtoolCheckMetrics(const std::string& exposition) {
  absl::StatusOr<std::string> promtool = FindPrometheusTool("promtool");
  if (!promtool.ok()) return promtool.status();
  absl::StatusOr<std::string> dir = MakeTempDir("promtool");
  if (!dir.ok()) return dir.status();
  const std::string input = *dir + "/scrape.txt", output = *dir + "/promtool.out";
  std::ofstream(input) << exposition;
  absl::StatusOr<pid_t> pid = Spawn({*promtool, "check", "metrics"}, input, output);
  if (!pid.ok()) return pid.status();
  int status = 0;
  waitpid(*pid, &status, 0);
  const std::string said = ReadFile(output);
  std::filesystem::remove_all(*dir);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("promtool check metrics: ", said));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PrometheusServer>> PrometheusServer::Start(
    const std::vector<std::string>& targets, const std::string& job) {
  absl::StatusOr<std::string> prometheus = FindPrometheusTool("prometheus");
  if (!prometheus.ok()) return prometheus.status();
  absl::StatusOr<std::string> dir = MakeTempDir("prometheus");
  if (!dir.ok()) return dir.status();
  std::vector<std::string> quoted;
  for (const std::string& target : targets) quoted.push_back(absl::StrCat("\"", target, "\""));
  std::ofstream(*dir + "/prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
      << "scrape_configs:\n  - job_name: " << job << "\n    static_configs:\n"
      << "      - targets: [" << absl::StrJoin(quoted, ", ") << "]\n";

  // The port is picked free and then handed over, so another process may
  // take it in between: a few tries.
  std::string last_error;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int port = FreeLoopbackPort();
    if (port <= 0) return absl::InternalError("no free loopback port for Prometheus");
    absl::StatusOr<pid_t> pid =
        Spawn({*prometheus, absl::StrCat("--config.file=", *dir, "/prometheus.yml"),
               absl::StrCat("--storage.tsdb.path=", *dir, "/data"),
               absl::StrCat("--web.listen-address=127.0.0.1:", port), "--log.level=warn"},
              "", *dir + "/prometheus.log");
    if (!pid.ok()) return pid.status();
    std::unique_ptr<PrometheusServer> server(new PrometheusServer(*pid, port, *dir));
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(*pid, &status, WNOHANG) == *pid) {
        server->pid_ = -1;  // exited (a taken port, or a bad config)
        break;
      }
      absl::StatusOr<std::string> ready = server->Get("/-/ready");
      if (ready.ok()) return server;
      absl::SleepFor(absl::Milliseconds(100));
    }
    last_error = server->LogTail();
    server->dir_.clear();  // kept for the next attempt
    if (server->pid_ > 0) {
      kill(server->pid_, SIGKILL);
      waitpid(server->pid_, nullptr, 0);
      server->pid_ = -1;
    }
  }
  std::filesystem::remove_all(*dir);
  return absl::UnavailableError(absl::StrCat("Prometheus did not become ready; its log:\n",
                                             last_error));
}

PrometheusServer::~PrometheusServer() {
  if (pid_ > 0) {
    kill(pid_, SIGTERM);
    bool exited = false;
    for (int i = 0; i < 100 && !exited; ++i) {
      exited = waitpid(pid_, nullptr, WNOHANG) == pid_;
      if (!exited) absl::SleepFor(absl::Milliseconds(100));
    }
    if (!exited) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  if (!dir_.empty()) std::filesystem::remove_all(dir_);
}

std::string PrometheusServer::LogTail() const { return Tail(ReadFile(dir_ + "/prometheus.log"), 20); }

absl::StatusOr<std::string> PrometheusServer::Get(const std::string& path_and_query) const {
  httplib::Client client("127.0.0.1", port_);
  client.set_connection_timeout(std::chrono::seconds(2));
  client.set_read_timeout(std::chrono::seconds(10));
  httplib::Result result = client.Get(path_and_query.c_str());
  if (!result) {
    return absl::UnavailableError(absl::StrCat("GET ", path_and_query, ": ",
                                               httplib::to_string(result.error())));
  }
  if (result->status != 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("GET ", path_and_query, ": HTTP ", result->status, ": ", result->body));
  }
  return result->body;
}

absl::StatusOr<std::vector<PromSample>> PrometheusServer::Query(const std::string& expr) const {
  absl::StatusOr<std::string> body =
      Get(absl::StrCat("/api/v1/query?query=", UrlEncode(expr)));
  if (!body.ok()) return body.status();
  const nlohmann::json answer = nlohmann::json::parse(*body, nullptr, /*allow_exceptions=*/false);
  if (answer.is_discarded() || answer.value("status", "") != "success" ||
      !answer.contains("data") || answer["data"].value("resultType", "") != "vector") {
    return absl::InvalidArgumentError(absl::StrCat("query ", expr, ": ", *body));
  }
  std::vector<PromSample> samples;
  for (const nlohmann::json& series : answer["data"]["result"]) {
    PromSample sample;
    for (const auto& [name, value] : series["metric"].items()) sample.labels[name] = value;
    // [ unix time, "value" ]: Prometheus spells values as strings.
    const std::string value = series["value"][1].get<std::string>();
    if (!absl::SimpleAtod(value, &sample.value)) {
      return absl::InvalidArgumentError(absl::StrCat("query ", expr, ": value ", value));
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

absl::StatusOr<double> PrometheusServer::WaitFor(const std::string& expr,
                                                  const std::function<bool(double)>& accept,
                                                  absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer";
  while (true) {
    absl::StatusOr<std::vector<PromSample>> samples = Query(expr);
    if (samples.ok()) {
      if (samples->size() == 1 && accept(samples->front().value)) return samples->front().value;
      std::vector<std::string> values;
      for (const PromSample& s : *samples) values.push_back(absl::StrCat(s.value));
      last = absl::StrCat(samples->size(), " series [", absl::StrJoin(values, ", "), "]");
    } else {
      last = samples.status().ToString();
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(expr, " never came as wanted; last answer: ", last));
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
}

absl::StatusOr<std::vector<std::string>> PrometheusServer::ScrapeErrors() const {
  absl::StatusOr<std::string> body = Get("/api/v1/targets");
  if (!body.ok()) return body.status();
  const nlohmann::json answer = nlohmann::json::parse(*body, nullptr, false);
  if (answer.is_discarded() || !answer.contains("data")) {
    return absl::InvalidArgumentError(absl::StrCat("/api/v1/targets: ", *body));
  }
  std::vector<std::string> errors;
  for (const nlohmann::json& target : answer["data"]["activeTargets"]) {
    const std::string error = target.value("lastError", "");
    if (!error.empty()) errors.push_back(absl::StrCat(target.value("scrapeUrl", "?"), ": ", error));
  }
  return errors;
}

}  // namespace te::testing
