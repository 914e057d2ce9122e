// te_bench: running a sweep point. Each client is a thread with its own
// Client (channel) and Session; a PointControl starts the timed loops of all
// clients together and lets the calling thread print progress.
#include "bench/load/te_bench_lib.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/modules.h"
#include "client/recipe.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te::client::bench {
namespace {

// ---- what a client runs ---------------------------------------------------------

std::optional<Recipe> RecipeFor(Fp8Mode mode) {
  switch (mode) {
    case Fp8Mode::kNone:
      return std::nullopt;
    case Fp8Mode::kDelayed:
      return QuickstartRecipe();
    case Fp8Mode::kCurrent:
      return Float8CurrentScaling{};
  }
  return std::nullopt;
}

// The layers as the quickstart configures them (client/quickstart_layers).
absl::StatusOr<te::v1::LayerSpec> LayerSpecFor(BenchLayer layer, const LayerSize& s) {
  switch (layer) {
    case BenchLayer::kDense: {
      DenseGeneral dense({s.ffn});
      dense.use_bias = true;
      return dense.Spec();
    }
    case BenchLayer::kLayerNormMlp: {
      LayerNormMLP mlp;
      mlp.intermediate_dim = s.ffn;
      mlp.activations = {"gelu"};
      mlp.epsilon = 1e-5f;
      mlp.use_bias = true;
      mlp.intermediate_dropout_rate = 0.0f;
      mlp.return_layernorm_output = false;
      return mlp.Spec();
    }
    case BenchLayer::kTransformer:
      return QuickstartTransformerLayer(s).Spec();
    case BenchLayer::kFlax:
      return QuickstartFlaxLayer(s).Spec();
  }
  return absl::InvalidArgumentError("layer: unknown");
}

std::string CodeName(const absl::Status& status) { return absl::StatusCodeToString(status.code()); }

// One client's connection, session, layer and resident inputs.
struct Prepared {
  std::unique_ptr<Client> client;
  std::unique_ptr<Session> session;
  std::string layer_id;
  HostTensor x_host;     // put uploads it on every call
  te::v1::Tensor x, dy;  // resident
  te::v1::Autocast autocast;
  te::v1::ForwardRequest forward;
  te::v1::ForwardBackwardRequest forward_backward;
  int64_t version = 0;  // the layer's version the last step made or read
};

absl::StatusOr<std::unique_ptr<Prepared>> Prepare(const BenchOptions& o, int index) {
  auto p = std::make_unique<Prepared>();
  ClientOptions client_options;
  client_options.rpc_timeout = o.rpc_timeout;
  ASSIGN_OR_RETURN(p->client, Client::Connect(o.server, client_options));
  SessionOptions session_options;
  const std::optional<Recipe> recipe = RecipeFor(o.fp8);
  if (recipe.has_value()) session_options.recipes = {*recipe};
  // FP8 also where the device emulates it (a CPU server): numbers, not speed, differ.
  session_options.policy = NegotiationPolicy::kEmulate;
  session_options.device = o.device;
  if (!o.affinity_keys.empty()) {
    session_options.affinity_key = o.affinity_keys[index % o.affinity_keys.size()];
  }
  ASSIGN_OR_RETURN(p->session, p->client->CreateSession(session_options));
  p->autocast = ToProto(AutocastState{recipe.has_value(), recipe});

  const Shape x_shape = {o.size.batch, o.size.seq, o.size.hidden};
  p->x_host = HostTensor::RandomNormal(x_shape, o.dtype, /*seed=*/1000 + index);
  if (o.op == BenchOp::kPut) return p;
  ASSIGN_OR_RETURN(ResidentTensor x, p->session->Put(p->x_host));
  p->x = x.ToProto();
  if (o.op == BenchOp::kGet) return p;

  te::v1::InitLayerRequest init;
  ASSIGN_OR_RETURN(*init.mutable_spec(), LayerSpecFor(o.layer, o.size));
  init.set_seed(42 + index);
  init.set_input_dtype(DTypeToProto(o.dtype));
  for (int64_t d : x_shape) init.add_input_shape(d);
  *init.mutable_autocast() = p->autocast;
  ASSIGN_OR_RETURN(te::v1::InitLayerResponse layer, p->session->InitLayer(std::move(init)));
  p->layer_id = layer.layer_id();

  if (o.op == BenchOp::kForward) {
    te::v1::ForwardRequest& f = p->forward;
    f.set_layer_id(p->layer_id);
    *f.mutable_x() = p->x;
    f.set_deterministic(o.deterministic);
    *f.mutable_autocast() = p->autocast;
    f.set_keep_for_backward(false);
    f.set_keep_outputs(!o.fetch_outputs);
    return p;
  }
  ASSIGN_OR_RETURN(DType y_dtype, DTypeFromProto(layer.output_dtype(), "InitLayerResponse.output_dtype"));
  const Shape y_shape(layer.output_shape().begin(), layer.output_shape().end());
  ASSIGN_OR_RETURN(ResidentTensor dy,
                   p->session->Put(HostTensor::RandomNormal(y_shape, y_dtype, /*seed=*/2000 + index)));
  p->dy = dy.ToProto();
  te::v1::ForwardBackwardRequest& fb = p->forward_backward;
  fb.set_layer_id(p->layer_id);
  for (int i = 0; i < o.micro_batches; ++i) {
    te::v1::MicroBatch* mb = fb.add_micro_batches();
    *mb->mutable_x() = p->x;
    *mb->mutable_dy() = p->dy;
  }
  fb.set_deterministic(o.deterministic);
  *fb.mutable_autocast() = p->autocast;
  fb.set_return_dx(false);
  fb.set_return_grads(false);
  // A benchmark step keeps nothing: kept grads would make a version per step.
  fb.set_discard_grads(true);
  return p;
}

double MillisecondsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

// One call of the operation; *latency_ms covers what the client waits for
// (cleanup of resident outputs it did not ask for comes after, untimed).
absl::Status OneCall(const BenchOptions& o, Prepared& p, uint64_t call, double* latency_ms) {
  const uint64_t seed = MixBits(call + 1);
  switch (o.op) {
    case BenchOp::kForward: {
      p.forward.set_dropout_seed(seed);
      const absl::Time start = absl::Now();
      ASSIGN_OR_RETURN(te::v1::ForwardResponse response, p.session->Forward(p.forward));
      const bool resident = response.y().data_case() == te::v1::Tensor::kResidentId;
      if (o.fetch_outputs) {
        RETURN_IF_ERROR(p.session->Receive(response.y(), "y").status());
        *latency_ms = MillisecondsSince(start);
        return absl::OkStatus();
      }
      *latency_ms = MillisecondsSince(start);
      return resident ? p.session->Delete(response.y().resident_id()) : absl::OkStatus();
    }
    case BenchOp::kForwardBackward: {
      for (int i = 0; i < p.forward_backward.micro_batches_size(); ++i) {
        p.forward_backward.mutable_micro_batches(i)->set_dropout_seed(MixBits(seed + i));
      }
      const absl::Time start = absl::Now();
      ASSIGN_OR_RETURN(te::v1::ForwardBackwardResponse response,
                       p.session->ForwardBackward(p.forward_backward));
      *latency_ms = MillisecondsSince(start);
      // Under DelayedScaling each step makes a version (its FP8 state): the
      // one before it goes, so a long run holds one version, not one a step.
      const int64_t before = p.version;
      p.version = response.version();
      if (before == 0 || before == p.version) return absl::OkStatus();
      te::v1::ReleaseVersionsRequest release;
      release.set_layer_id(p.layer_id);
      release.add_versions(before);
      return p.session->ReleaseVersions(release);
    }
    case BenchOp::kPut: {
      const absl::Time start = absl::Now();
      ASSIGN_OR_RETURN(ResidentTensor put, p.session->Put(p.x_host));
      *latency_ms = MillisecondsSince(start);
      return p.session->Delete(put.id);
    }
    case BenchOp::kGet: {
      const absl::Time start = absl::Now();
      RETURN_IF_ERROR(p.session->Get(p.x.resident_id()).status());
      *latency_ms = MillisecondsSince(start);
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError("op: unknown");
}

// ---- one sweep point ----------------------------------------------------------------

// Starts the clients' timed loops together and counts completed calls for
// the progress line. Thread-safe.
class PointControl {
 public:
  explicit PointControl(int clients) : clients_(clients) {}

  // Each client calls this once, ready or not; the last arrival sets the
  // common start. Returns the start.
  absl::Time ArriveAndWait() {
    absl::MutexLock lock(&mu_);
    if (++arrived_ == clients_) start_ = absl::Now();
    mu_.Await(absl::Condition(this, &PointControl::AllArrived));
    return start_;
  }

  void Finished() {
    absl::MutexLock lock(&mu_);
    ++finished_;
  }
  void WaitAllFinished() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &PointControl::AllFinished));
  }
  // True when every client has finished; false after `timeout`.
  bool WaitAllFinishedFor(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(this, &PointControl::AllFinished), timeout);
  }

  std::optional<absl::Time> start() {
    absl::MutexLock lock(&mu_);
    if (!AllArrived()) return std::nullopt;
    return start_;
  }
  int arrived() {
    absl::MutexLock lock(&mu_);
    return arrived_;
  }

  std::atomic<int64_t> completed{0};
  std::atomic<int64_t> failed{0};

 private:
  bool AllArrived() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return arrived_ == clients_; }
  bool AllFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ == clients_; }

  const int clients_;
  absl::Mutex mu_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time start_ ABSL_GUARDED_BY(mu_);
};

struct ClientResult {
  bool started = false;  // setup succeeded
  absl::Time start, end;
  int64_t ok = 0;
  int64_t failed = 0;
  std::vector<double> latencies_ms;
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::string> error_examples;

  void Error(const std::string& key, const absl::Status& status) {
    ++errors[key];
    error_examples.emplace(key, std::string(status.message()));
  }
};

void RunClient(const BenchOptions& o, int index, PointControl* control, ClientResult* result) {
  absl::StatusOr<std::unique_ptr<Prepared>> prepared = Prepare(o, index);
  uint64_t call = static_cast<uint64_t>(index) << 40;  // distinct dropout seeds per client
  if (prepared.ok()) {
    result->started = true;
    for (int i = 0; i < o.warmup; ++i) {
      double unused_ms = 0;
      absl::Status status = OneCall(o, **prepared, call++, &unused_ms);
      if (!status.ok()) result->Error("warmup " + CodeName(status), status);
    }
  } else {
    result->Error("setup " + CodeName(prepared.status()), prepared.status());
  }
  result->start = control->ArriveAndWait();
  if (result->started) {
    const absl::Time deadline = result->start + o.duration;
    for (int64_t i = 0; o.count > 0 ? i < o.count : absl::Now() < deadline; ++i) {
      double ms = 0;
      absl::Status status = OneCall(o, **prepared, call++, &ms);
      if (status.ok()) {
        ++result->ok;
        result->latencies_ms.push_back(ms);
        control->completed.fetch_add(1, std::memory_order_relaxed);
      } else {
        ++result->failed;
        result->Error(CodeName(status), status);
        control->failed.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  result->end = absl::Now();
  control->Finished();
  // Sessions close only once every client is done, so a closing session
  // never competes with another client's timed calls.
  control->WaitAllFinished();
}

void PrintProgress(const BenchOptions& o, int clients, PointControl& control) {
  if (o.progress == nullptr) return;
  std::optional<absl::Time> start = control.start();
  if (!start.has_value()) {
    *o.progress << absl::StrFormat("te_bench [%d clients] setting up: %d of %d ready\n", clients,
                                   control.arrived(), clients);
  } else {
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - *start);
    const int64_t done = control.completed.load();
    *o.progress << absl::StrFormat("te_bench [%d clients] %6.1f s: %d calls (%.1f/s), %d errors\n", clients,
                                   elapsed, done, elapsed > 0 ? done / elapsed : 0.0, control.failed.load());
  }
  o.progress->flush();
}

SweepPoint Summarize(const BenchOptions& o, int clients, const std::vector<ClientResult>& results,
                     size_t x_bytes) {
  SweepPoint p;
  p.clients = clients;
  absl::Time start = results.front().start, end = start;
  std::vector<double> latencies;
  for (const ClientResult& r : results) {
    end = std::max(end, r.end);
    p.calls += r.ok;
    p.failed_calls += r.failed;
    latencies.insert(latencies.end(), r.latencies_ms.begin(), r.latencies_ms.end());
    for (const auto& [code, n] : r.errors) p.errors[code] += n;
    for (const auto& [code, message] : r.error_examples) p.error_examples.emplace(code, message);
    const double seconds = absl::ToDoubleSeconds(r.end - r.start);
    p.per_client_calls_per_s.push_back(r.started && seconds > 0 ? r.ok / seconds : 0.0);
  }
  p.seconds = absl::ToDoubleSeconds(end - start);
  if (p.seconds > 0) p.calls_per_s = p.calls / p.seconds;
  p.steps_per_s = p.calls_per_s * (o.op == BenchOp::kForwardBackward ? o.micro_batches : 1);
  if (o.op == BenchOp::kPut || o.op == BenchOp::kGet) p.megabytes_per_s = p.calls_per_s * x_bytes / 1e6;
  p.latency_ms = SummarizeLatencies(std::move(latencies));
  const auto [slowest, fastest] =
      std::minmax_element(p.per_client_calls_per_s.begin(), p.per_client_calls_per_s.end());
  p.slowest_calls_per_s = *slowest;
  p.fastest_calls_per_s = *fastest;
  p.fairness = *fastest > 0 ? *slowest / *fastest : 0.0;
  return p;
}

SweepPoint RunPoint(const BenchOptions& o, int clients) {
  PointControl control(clients);
  std::vector<ClientResult> results(clients);
  std::vector<std::thread> threads;
  threads.reserve(clients);
  for (int i = 0; i < clients; ++i) threads.emplace_back(RunClient, std::cref(o), i, &control, &results[i]);
  while (!control.WaitAllFinishedFor(o.progress_interval)) PrintProgress(o, clients, control);
  PrintProgress(o, clients, control);
  for (std::thread& t : threads) t.join();
  const size_t x_bytes = static_cast<size_t>(o.size.batch * o.size.seq * o.size.hidden) * DTypeSize(o.dtype);
  return Summarize(o, clients, results, x_bytes);
}

}  // namespace

absl::StatusOr<BenchReport> RunBench(const BenchOptions& options) {
  RETURN_IF_ERROR(Validate(options));
  BenchReport report;
  report.options = options;
  {
    ClientOptions client_options;
    client_options.rpc_timeout = absl::Seconds(30);
    ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(options.server, client_options));
    ASSIGN_OR_RETURN(te::v1::ServerInfo info, client->GetServerInfo());
    report.server_version = info.version();
    for (const te::v1::DeviceInfo& d : info.devices()) {
      report.devices.push_back(absl::StrCat(d.name(), " (", d.description(), ")"));
    }
  }
  for (int clients : options.clients) report.points.push_back(RunPoint(options, clients));
  return report;
}

}  // namespace te::client::bench
