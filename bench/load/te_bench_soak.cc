// te_bench --soak_minutes (te_bench_soak.h): the held sessions, the
// churners, the per-interval sampler and the restore check.
#include "bench/load/te_bench_soak.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "bench/load/te_bench_lib.h"
#include "client/client.h"
#include "client/decoder_lm.h"
#include "client/generate.h"
#include "client/recipe.h"
#include "kernels/status_macros.h"

namespace te::client::bench {

bool SoakReport::ok() const {
  return failed == 0 && (!restore_checked || restored_identical == held_sessions);
}

double SlopeMibPerMinute(const std::vector<std::pair<double, int64_t>>& points) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (points.size() < 2) return nan;
  double mx = 0, my = 0;
  for (const auto& [x, y] : points) {
    mx += x;
    my += static_cast<double>(y) / (1 << 20);
  }
  mx /= static_cast<double>(points.size());
  my /= static_cast<double>(points.size());
  double sxy = 0, sxx = 0;
  for (const auto& [x, y] : points) {
    sxy += (x - mx) * (static_cast<double>(y) / (1 << 20) - my);
    sxx += (x - mx) * (x - mx);
  }
  return sxx > 0 ? sxy / sxx : nan;
}

std::vector<std::pair<double, int64_t>> AfterWarmup(const std::vector<SoakInterval>& intervals,
                                                    double warmup_minutes,
                                                    int64_t SoakInterval::*bytes) {
  std::vector<std::pair<double, int64_t>> points;
  for (const SoakInterval& i : intervals) {
    if (i.end_minutes > warmup_minutes && i.*bytes >= 0) points.push_back({i.end_minutes, i.*bytes});
  }
  return points;
}

std::string FormatInterval(const SoakInterval& i) {
  auto mib = [](int64_t bytes) {
    return bytes < 0 ? std::string("-") : absl::StrFormat("%.0f", static_cast<double>(bytes) / (1 << 20));
  };
  std::vector<std::string> steps;
  for (const auto& [kind, p] : i.step_ms) {
    steps.push_back(absl::StrFormat("%s %.1f/%.1f", kind, p.first, p.second));
  }
  return absl::StrFormat(
      "minute %5.2f: %d calls, %d failed | step ms p50/p99: %s | device MiB in use %s, reserved "
      "%s | host RSS MiB %s",
      i.end_minutes, i.calls, i.failed, steps.empty() ? "-" : absl::StrJoin(steps, ", "),
      mib(i.device_in_use), mib(i.device_reserved), mib(i.host_rss));
}

uint64_t Fnv1a64(const std::string& bytes) {
  uint64_t hash = 1469598103934665603ull;
  for (unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

std::vector<std::string> CompareDigests(const std::map<std::string, uint64_t>& before,
                                        const std::map<std::string, uint64_t>& after) {
  std::vector<std::string> differ;
  for (const auto& [name, hash] : before) {
    auto it = after.find(name);
    if (it == after.end()) {
      differ.push_back(name + " (missing after)");
    } else if (it->second != hash) {
      differ.push_back(name + " (bytes differ)");
    }
  }
  for (const auto& [name, hash] : after) {
    if (before.count(name) == 0) differ.push_back(name + " (new after)");
  }
  return differ;
}

int64_t ResidentBytes(int pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmRSS:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kib = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) return kib * 1024;
  }
  return -1;
}

absl::Status ValidateSoak(const SoakOptions& o) {
  if (o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--soak_minutes must be positive");
  }
  if (o.interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--soak_interval_s must be positive");
  }
  if (o.churners < 0 || o.churn_steps < 1) {
    return absl::InvalidArgumentError("--soak_churners >= 0 and --soak_churn_steps >= 1");
  }
  if (o.size.batch < 1 || o.size.seq < 1 || o.size.hidden < 1 || o.size.ffn < 1 ||
      o.size.heads < 1 || o.size.hidden % o.size.heads != 0) {
    return absl::InvalidArgumentError("layer sizes must be positive and heads divide hidden");
  }
  return absl::OkStatus();
}

namespace {

// What kind of work a session does.
enum class Kind { kBf16, kFp8, kGraph };

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kBf16:
      return "bf16";
    case Kind::kFp8:
      return "fp8";
    case Kind::kGraph:
      return "graph";
  }
  return "?";
}

// Calls and their times, per interval. Thread-safe.
class Collector {
 public:
  void Add(const std::string& kind, const absl::Status& status, double ms) {
    absl::MutexLock lock(&mu_);
    ++calls_;
    if (status.ok()) {
      if (ms >= 0) step_ms_[kind].push_back(ms);
      return;
    }
    ++failed_;
    const std::string key = absl::StrCat(kind, " ", absl::StatusCodeToString(status.code()));
    ++errors_[key];
    if (examples_.count(key) == 0) examples_[key] = std::string(status.message());
  }
  void Opened() { ++opened_; }
  void Closed() { ++closed_; }

  // The interval's calls and step times, starting the next.
  SoakInterval Take(double end_minutes) {
    absl::MutexLock lock(&mu_);
    SoakInterval i;
    i.end_minutes = end_minutes;
    i.calls = calls_;
    i.failed = failed_;
    for (auto& [kind, ms] : step_ms_) {
      const LatencySummary s = SummarizeLatencies(ms);
      i.step_ms[kind] = {s.p50, s.p99};
    }
    total_calls_ += calls_;
    total_failed_ += failed_;
    calls_ = failed_ = 0;
    step_ms_.clear();
    return i;
  }
  void Fill(SoakReport* report) {
    absl::MutexLock lock(&mu_);
    report->calls = total_calls_ + calls_;
    report->failed = total_failed_ + failed_;
    report->errors = errors_;
    report->error_examples = examples_;
    report->sessions_opened = opened_;
    report->sessions_closed = closed_;
  }

 private:
  absl::Mutex mu_;
  int64_t calls_ = 0, failed_ = 0, total_calls_ = 0, total_failed_ = 0;
  std::map<std::string, std::vector<double>> step_ms_;
  std::map<std::string, int64_t> errors_;
  std::map<std::string, std::string> examples_;
  std::atomic<int64_t> opened_{0}, closed_{0};
};

// A session with one layer set up for training or stepping.
struct Trainee {
  std::unique_ptr<Session> session;
  std::string layer_id;
  Kind kind = Kind::kBf16;
  te::v1::ForwardBackwardRequest step;
  int64_t version = 0;  // the newest, released when the next step replaces it
};

absl::StatusOr<te::v1::LayerSpec> SpecFor(Kind kind, const LayerSize& size) {
  switch (kind) {
    case Kind::kBf16:
    case Kind::kFp8:
      return QuickstartTransformerLayer(size).Spec();
    case Kind::kGraph:
      return QuickstartFlaxLayer(size).Spec();
  }
  return absl::InvalidArgumentError("kind");
}

absl::StatusOr<Trainee> Open(Client& client, const SoakOptions& o, Kind kind, bool train,
                             uint64_t seed, Collector* collector) {
  Trainee t;
  t.kind = kind;
  SessionOptions session_options;
  const bool fp8 = kind == Kind::kFp8;
  if (fp8) session_options.recipes = {QuickstartRecipe()};
  session_options.policy = NegotiationPolicy::kEmulate;
  session_options.device = o.device;
  ASSIGN_OR_RETURN(t.session, client.CreateSession(session_options));
  collector->Opened();
  const te::v1::Autocast autocast =
      ToProto(AutocastState{fp8, fp8 ? std::optional<Recipe>(QuickstartRecipe()) : std::nullopt});
  const Shape shape = {o.size.batch, o.size.seq, o.size.hidden};
  ASSIGN_OR_RETURN(ResidentTensor x, t.session->Put(HostTensor::RandomNormal(shape, DType::kBF16, seed)));
  te::v1::InitLayerRequest init;
  ASSIGN_OR_RETURN(*init.mutable_spec(), SpecFor(kind, o.size));
  init.set_seed(seed);
  init.set_input_dtype(te::v1::BFLOAT16);
  for (int64_t d : shape) init.add_input_shape(d);
  *init.mutable_autocast() = autocast;
  ASSIGN_OR_RETURN(te::v1::InitLayerResponse layer, t.session->InitLayer(init));
  t.layer_id = layer.layer_id();
  ASSIGN_OR_RETURN(DType y_dtype, DTypeFromProto(layer.output_dtype(), "output_dtype"));
  const Shape y_shape(layer.output_shape().begin(), layer.output_shape().end());
  ASSIGN_OR_RETURN(ResidentTensor dy,
                   t.session->Put(HostTensor::RandomNormal(y_shape, y_dtype, seed + 1)));
  if (train) {
    // A small learning rate: thousands of steps on one batch stay finite.
    RETURN_IF_ERROR(t.session->SetOptimizer(t.layer_id, AdamW(schedules::Constant(1e-5))).status());
  }
  t.step.set_layer_id(t.layer_id);
  t.step.set_deterministic(false);  // dropout on, a fresh seed per step
  *t.step.mutable_autocast() = autocast;
  if (train) {
    t.step.set_apply_update(true);
  } else {
    t.step.set_discard_grads(true);
  }
  te::v1::MicroBatch* mb = t.step.add_micro_batches();
  *mb->mutable_x() = x.ToProto();
  *mb->mutable_dy() = dy.ToProto();
  return t;
}

// One step; the version it replaced goes (a long run holds one per layer).
absl::Status Step(Trainee& t, uint64_t seed, Collector* collector) {
  t.step.mutable_micro_batches(0)->set_dropout_seed(seed);
  const absl::Time start = absl::Now();
  absl::StatusOr<te::v1::ForwardBackwardResponse> stepped = t.session->ForwardBackward(t.step);
  const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  collector->Add(KindName(t.kind), stepped.status(), ms);
  if (!stepped.ok()) return stepped.status();
  if (t.version != 0 && stepped->version() != t.version) {
    te::v1::ReleaseVersionsRequest release;
    release.set_layer_id(t.layer_id);
    release.add_versions(t.version);
    const absl::Status released = t.session->ReleaseVersions(release);
    collector->Add("release", released, -1);
  }
  t.version = stepped->version();
  return absl::OkStatus();
}

// The generating client: the decoder LM of train_lm.py (client/decoder_lm.h:
// 4 TE TransformerLayers of the layers' width up to 1024, relative bias,
// bf16 compute) in a session
// of its own, one Generate of kGenerateNew greedy tokens after another from
// a prompt of kGeneratePrompt bytes for each of 2 sequences, each call timed
// as the kind "generate". Its session closes when the run ends.
constexpr int64_t kGeneratePrompt = 64, kGenerateNew = 64, kGenerateBatch = 2;

void GenerateUntil(Client& client, const SoakOptions& o, absl::Time until, Collector* collector) {
  SessionOptions session_options;
  session_options.device = o.device;
  absl::StatusOr<std::unique_ptr<Session>> session = client.CreateSession(session_options);
  collector->Add("generate open", session.status(), -1);
  if (!session.ok()) return;
  collector->Opened();
  DecoderLmSize size;
  size.num_layers = 4;
  size.hidden = std::min<int64_t>(1024, o.size.hidden);
  size.heads = size.hidden % o.size.heads == 0 ? o.size.heads : 1;
  size.batch = kGenerateBatch;
  size.seq = kGeneratePrompt + kGenerateNew;
  const Graph lm = DecoderLm(size);
  static constexpr char kText[] = "the quick brown fox jumps over the lazy dog. ";
  std::vector<float> prompt_ids;
  for (int64_t i = 0; i < kGenerateBatch * kGeneratePrompt; ++i) {
    prompt_ids.push_back(static_cast<unsigned char>(kText[i % (sizeof(kText) - 1)]));
  }
  const HostTensor prompt =
      *HostTensor::FromFloats({kGenerateBatch, kGeneratePrompt}, prompt_ids, DType::kI32);
  const HostTensor init_x = HostTensor::Full({size.batch, size.seq}, DType::kI32, 0.0f);
  absl::StatusOr<Variables> vars = lm.Init(**session, /*key=*/5, init_x);
  collector->Add("generate init", vars.status(), -1);
  if (vars.ok()) {
    GenerateOptions options;
    options.max_new_tokens = kGenerateNew;
    while (absl::Now() < until) {
      const absl::Time start = absl::Now();
      absl::StatusOr<GenerateResult> made = Generate(*vars, prompt, options);
      collector->Add("generate", made.status(),
                     absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  }
  collector->Add("generate close", (*session)->Close(), -1);
  collector->Closed();
}

absl::StatusOr<std::map<std::string, uint64_t>> Digest(Session& session, const std::string& layer_id) {
  te::v1::GetVariablesRequest request;
  request.set_layer_id(layer_id);
  request.set_keep_outputs(true);  // snapshots, streamed back one by one
  ASSIGN_OR_RETURN(te::v1::GetVariablesResponse response, session.GetVariables(request));
  std::map<std::string, uint64_t> digest;
  for (const te::v1::Variable& v : response.variables()) {
    const std::string name = absl::StrCat(v.collection(), "/", v.path());
    ASSIGN_OR_RETURN(HostTensor host, session.Receive(v.value(), name));
    digest[name] = Fnv1a64(host.bytes());
  }
  return digest;
}

void Print(const SoakOptions& o, const std::string& line) {
  if (o.out == nullptr) return;
  *o.out << line << std::endl;
}

// Waits for a server that restored sessions (a restart), or the deadline.
absl::Status AwaitRestart(const SoakOptions& o) {
  const absl::Time deadline = absl::Now() + o.restart_wait;
  absl::Status last = absl::DeadlineExceededError("no restarted server answered");
  while (absl::Now() < deadline) {
    ClientOptions options;
    options.connect_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o.server, options);
    if (client.ok()) {
      absl::StatusOr<te::v1::ServerInfo> info = (*client)->GetServerInfo();
      if (info.ok() && info->stats().sessions_restored() > 0) return absl::OkStatus();
      last = info.ok() ? absl::UnavailableError("the server answering restored no session")
                       : info.status();
    } else {
      last = client.status();
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
  return last;
}

constexpr absl::Duration kMemorySampleEvery = absl::Seconds(2);

// The lowest of an interval's memory samples; -1 while none was taken.
struct MemoryFloor {
  int64_t device_in_use = -1, device_reserved = -1, host_rss = -1;
  static void Lower(int64_t sample, int64_t* floor) {
    if (sample >= 0 && (*floor < 0 || sample < *floor)) *floor = sample;
  }
  void Add(int64_t in_use, int64_t reserved) {
    Lower(in_use, &device_in_use);
    Lower(reserved, &device_reserved);
  }
  void AddHost(int64_t rss) { Lower(rss, &host_rss); }
};

}  // namespace

absl::StatusOr<SoakReport> RunSoak(const SoakOptions& o) {
  RETURN_IF_ERROR(ValidateSoak(o));
  Collector collector;
  ClientOptions client_options;
  client_options.rpc_timeout = o.rpc_timeout;

  // The held sessions, each on a connection of its own.
  std::vector<std::unique_ptr<Client>> clients;
  std::vector<Trainee> held;
  uint64_t seed = 1;
  for (Kind kind : {Kind::kBf16, Kind::kFp8, Kind::kGraph}) {
    ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(o.server, client_options));
    absl::StatusOr<Trainee> t = Open(*client, o, kind, /*train=*/true, seed += 10, &collector);
    if (!t.ok()) {
      return absl::UnavailableError(
          absl::StrCat("setting up the held ", KindName(kind), " session: ", t.status().ToString()));
    }
    held.push_back(*std::move(t));
    clients.push_back(std::move(client));
  }
  Print(o, absl::StrCat("soak: ", held.size(), " held sessions (bf16, fp8, graph; AdamW), ",
                        o.churners, " churners",
                        o.generate ? ", a generating client (a 4-layer LM)" : "", "; batch ",
                        o.size.batch, ", seq ", o.size.seq,
                        ", hidden ", o.size.hidden, ", ffn ", o.size.ffn, ", heads ", o.size.heads,
                        "; ", absl::FormatDuration(o.duration)));

  std::unique_ptr<Client> generating_client;
  if (o.generate) {
    ASSIGN_OR_RETURN(generating_client, Client::Connect(o.server, client_options));
  }

  const absl::Time start = absl::Now();
  const absl::Time until = start + o.duration;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < held.size(); ++i) {
    threads.emplace_back([&, i] {
      uint64_t step = 0;
      while (absl::Now() < until) (void)Step(held[i], 1000 * (i + 1) + ++step, &collector);
    });
  }
  for (int c = 0; c < o.churners; ++c) {
    threads.emplace_back([&, c] {
      absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o.server, client_options);
      if (!client.ok()) {
        collector.Add("churn connect", client.status(), -1);
        return;
      }
      uint64_t round = 0;
      while (absl::Now() < until) {
        const Kind kind = (c + round) % 2 == 0 ? Kind::kBf16 : Kind::kFp8;
        absl::StatusOr<Trainee> t =
            Open(**client, o, kind, /*train=*/false, 100000 * (c + 1) + ++round, &collector);
        collector.Add("churn open", t.status(), -1);
        if (!t.ok()) {
          absl::SleepFor(absl::Milliseconds(200));
          continue;
        }
        t->kind = kind;
        for (int s = 0; s < o.churn_steps && absl::Now() < until; ++s) {
          (void)Step(*t, round * 100 + s, &collector);
        }
        collector.Add("churn close", t->session->Close(), -1);
        collector.Closed();
      }
    });
  }

  if (generating_client != nullptr) {
    threads.emplace_back([&] { GenerateUntil(*generating_client, o, until, &collector); });
  }

  // The sampler: one line per interval.
  SoakReport report;
  report.held_sessions = static_cast<int>(held.size());
  {
    ClientOptions sampler_options = client_options;
    absl::StatusOr<std::unique_ptr<Client>> sampler = Client::Connect(o.server, sampler_options);
    absl::Time next = start + o.interval;
    while (true) {
      // The device's memory as the server sees it (every session on it),
      // sampled every kMemorySampleEvery; an interval reports its lowest
      // samples: the activations of steps in flight come and go with the
      // instant sampled, and only what stays raises the floor.
      MemoryFloor floor;
      const absl::Time wake = std::min(next, until);
      do {
        const absl::Duration left = wake - absl::Now();
        if (left > absl::ZeroDuration()) absl::SleepFor(std::min(kMemorySampleEvery, left));
        absl::StatusOr<te::v1::SessionInfo> info =
            held[0].session->GetSessionInfo(absl::Seconds(30));
        if (info.ok()) floor.Add(info->device_bytes_in_use(), info->device_bytes_reserved());
        if (o.server_pid > 0) floor.AddHost(ResidentBytes(o.server_pid));
      } while (absl::Now() < wake);
      const bool last = absl::Now() >= until;
      SoakInterval interval = collector.Take(absl::ToDoubleMinutes(absl::Now() - start));
      interval.device_in_use = floor.device_in_use;
      interval.device_reserved = floor.device_reserved;
      interval.host_rss = floor.host_rss;
      Print(o, FormatInterval(interval));
      report.intervals.push_back(interval);
      if (last) break;
      next += o.interval;
    }
  }
  for (std::thread& t : threads) t.join();
  collector.Fill(&report);

  const double warmup = absl::ToDoubleMinutes(o.warmup);
  report.device_in_use_slope =
      SlopeMibPerMinute(AfterWarmup(report.intervals, warmup, &SoakInterval::device_in_use));
  report.device_reserved_slope =
      SlopeMibPerMinute(AfterWarmup(report.intervals, warmup, &SoakInterval::device_reserved));
  report.host_rss_slope =
      SlopeMibPerMinute(AfterWarmup(report.intervals, warmup, &SoakInterval::host_rss));
  Print(o, absl::StrFormat(
               "soak: %d calls, %d failed; sessions opened %d, closed %d; slopes after %s of "
               "warm-up (MiB/min): device in use %.2f, device reserved %.2f, host RSS %.2f",
               report.calls, report.failed, report.sessions_opened, report.sessions_closed,
               absl::FormatDuration(o.warmup), report.device_in_use_slope,
               report.device_reserved_slope, report.host_rss_slope));
  for (const auto& [key, n] : report.errors) {
    Print(o, absl::StrCat("  failed: ", key, " x", n, ": ", report.error_examples[key]));
  }

  if (o.restart_wait <= absl::ZeroDuration()) return report;

  // The held sessions' variables now, then after the restart.
  std::vector<std::map<std::string, uint64_t>> before;
  for (Trainee& t : held) {
    absl::StatusOr<std::map<std::string, uint64_t>> digest = Digest(*t.session, t.layer_id);
    if (!digest.ok()) {
      report.restore_mismatches.push_back(
          absl::StrCat(KindName(t.kind), ": reading its variables before: ", digest.status().ToString()));
    }
    before.push_back(digest.ok() ? *digest : std::map<std::string, uint64_t>());
  }
  size_t variables = 0;
  for (const auto& d : before) variables += d.size();
  Print(o, absl::StrCat("soak: ready for restart (", held.size(), " held sessions, ", variables,
                        " variables recorded)"));
  if (!o.ready_file.empty()) std::ofstream(o.ready_file) << "ready\n";
  report.restore_checked = true;
  if (absl::Status restarted = AwaitRestart(o); !restarted.ok()) {
    report.restore_mismatches.push_back(absl::StrCat("no restart: ", restarted.ToString()));
    Print(o, absl::StrCat("restore: ", report.restore_mismatches.back()));
    return report;
  }
  for (size_t i = 0; i < held.size(); ++i) {
    // The session's own channel reconnects to the new server; a call in its
    // reconnection backoff is retried (reading changes nothing).
    absl::StatusOr<std::map<std::string, uint64_t>> after = absl::UnavailableError("not read");
    for (int attempt = 0; attempt < 30; ++attempt) {
      after = Digest(*held[i].session, held[i].layer_id);
      if (after.ok() || after.status().code() != absl::StatusCode::kUnavailable) break;
      absl::SleepFor(absl::Seconds(1));
    }
    if (!after.ok()) {
      report.restore_mismatches.push_back(
          absl::StrCat(KindName(held[i].kind), ": ", after.status().ToString()));
      continue;
    }
    const std::vector<std::string> differ = CompareDigests(before[i], *after);
    if (differ.empty() && !before[i].empty()) {
      ++report.restored_identical;
    } else {
      report.restore_mismatches.push_back(
          absl::StrCat(KindName(held[i].kind), ": ", absl::StrJoin(differ, ", ")));
    }
  }
  Print(o, absl::StrCat("restore: ", report.restored_identical, " of ", held.size(),
                        " held sessions' variables bit for bit after the restart",
                        report.restore_mismatches.empty()
                            ? ""
                            : absl::StrCat("; ", absl::StrJoin(report.restore_mismatches, "; "))));
  // Done with them: the new server frees them now.
  for (Trainee& t : held) (void)t.session->Close();
  return report;
}

}  // namespace te::client::bench
