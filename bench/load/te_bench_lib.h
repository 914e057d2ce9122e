// te_bench: a load generator for te_server in the manner of Triton's
// perf_analyzer. For each point of a sweep over the number of concurrent
// clients it starts that many clients, each with its own Client (gRPC
// channel) and Session, uploads each client's inputs once as resident tensors,
// runs warm-up calls, then loops one operation (forward, forward + backward,
// put or get of a tensor) for a time or a count, all clients starting
// together. It reports throughput, latency percentiles, per-client fairness
// and errors by code, as a table and as JSON.
//
//   BenchOptions options;
//   options.server = "localhost:50051";
//   options.clients = {1, 2, 4};
//   BenchReport report = RunBench(options).value();
//   std::cout << FormatTable(report) << FormatJson(report);
//
// RunBench blocks until the sweep is done. Calls that fail are counted by
// status code and the run goes on (a load generator measures errors, it does
// not stop at the first); RunBench itself fails only for invalid options.
#ifndef TE_BENCH_LOAD_TE_BENCH_LIB_H_
#define TE_BENCH_LOAD_TE_BENCH_LIB_H_

#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/quickstart_layers.h"
#include "client/tensor.h"

namespace te::client::bench {

enum class BenchLayer {
  kDense,         // DenseGeneral(features=ffn, use_bias): hidden -> ffn
  kLayerNormMlp,  // LayerNormMLP(intermediate_dim=ffn, gelu, use_bias)
  kTransformer,   // TransformerLayer as the quickstart's variant 6 builds it
  kFlax,          // the quickstart's plain-Flax layer (variant 1)
};

enum class BenchOp {
  kForward,          // Forward of resident x; y stays resident (see fetch_outputs)
  kForwardBackward,  // ForwardBackward of resident x, dy; nothing comes back
  kPut,              // upload x (PutTensor stream)
  kGet,              // download resident x (GetTensor stream)
};

enum class Fp8Mode {
  kNone,
  kDelayed,  // DelayedScaling(HYBRID, amax_history_len=16, "max"): the quickstart's
  kCurrent,  // Float8CurrentScaling(HYBRID)
};

struct BenchOptions {
  std::string server = "localhost:50051";
  std::vector<int> clients = {1};  // the sweep: one point per entry
  BenchLayer layer = BenchLayer::kTransformer;
  LayerSize size;
  DType dtype = DType::kBF16;  // x's dtype
  BenchOp op = BenchOp::kForwardBackward;
  Fp8Mode fp8 = Fp8Mode::kNone;
  int micro_batches = 1;      // per ForwardBackward call (each is one step)
  bool deterministic = true;  // false: dropout on, a fresh seed per call

  // Each point runs for `duration`, or, when count > 0, until every client
  // has made `count` timed calls. Warm-up calls (per client, untimed) come
  // first.
  absl::Duration duration = absl::Seconds(10);
  int64_t count = 0;
  int warmup = 2;

  // forward: false leaves y resident and deletes it after each call (outside
  // the call's latency); true brings y back to the client inside it.
  bool fetch_outputs = false;
  std::string device;  // the sessions' device ("cpu", "cuda:0"); empty: the server's choice
  // Client i's session affinity key is affinity_keys[i % size] (empty: random
  // keys), so a run through a hashing balancer lands on chosen replicas.
  std::vector<std::string> affinity_keys;
  absl::Duration rpc_timeout = absl::Minutes(10);

  // A progress line every progress_interval while a point runs (elapsed,
  // completed calls, errors); null: silent. Not owned.
  std::ostream* progress = nullptr;
  absl::Duration progress_interval = absl::Seconds(1);
};

// Milliseconds; all zero when there were no successful calls.
struct LatencySummary {
  double p50 = 0, p90 = 0, p99 = 0;
  double mean = 0, min = 0, max = 0;
};

struct SweepPoint {
  int clients = 0;
  double seconds = 0;        // from the common start to the last client's end
  int64_t calls = 0;         // successful timed calls, all clients
  int64_t failed_calls = 0;  // timed calls that returned an error
  double calls_per_s = 0;
  double steps_per_s = 0;      // calls_per_s * micro_batches for forward_backward
  double megabytes_per_s = 0;  // put / get: tensor bytes moved per second (MB = 1e6 B)
  LatencySummary latency_ms;   // of the successful timed calls
  // Each client's successful calls over its own timed window; a client whose
  // setup failed has 0.
  std::vector<double> per_client_calls_per_s;
  double slowest_calls_per_s = 0;
  double fastest_calls_per_s = 0;
  double fairness = 0;  // slowest / fastest (1 = perfectly fair)
  // Status code name -> count, timed calls and setup alike ("setup
  // UNAVAILABLE" counts clients that never started).
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::string> error_examples;  // the same keys: the first message seen
};

struct BenchReport {
  BenchOptions options;
  std::string server_version;
  std::vector<std::string> devices;  // "cuda:0 (NVIDIA H200)"
  std::vector<SweepPoint> points;

  int64_t total_errors() const;
};

// INVALID_ARGUMENT naming the option when options cannot run (an empty or
// non-positive client list, sizes that are not positive or heads that do not
// divide hidden, neither a duration nor a count).
absl::Status Validate(const BenchOptions& options);

// Runs the sweep. INVALID_ARGUMENT from Validate; UNAVAILABLE when the server
// does not answer GetServerInfo. Failures after that are counted in the
// report, not returned.
absl::StatusOr<BenchReport> RunBench(const BenchOptions& options);

// The report as a fixed-width table (one row per point) and as JSON (an
// object with the options, the server and "points": one object per row).
std::string FormatTable(const BenchReport& report);
std::string FormatJson(const BenchReport& report);

// ---- Parsing (flags), each INVALID_ARGUMENT naming the flag and value ----------

// "1,2,4,8" -> {1, 2, 4, 8}; every entry a positive integer.
absl::StatusOr<std::vector<int>> ParseClientList(absl::string_view text);
absl::StatusOr<BenchLayer> ParseLayer(absl::string_view text);  // dense|layernorm_mlp|transformer|flax
absl::StatusOr<BenchOp> ParseOp(absl::string_view text);        // forward|forward_backward|put|get
absl::StatusOr<Fp8Mode> ParseFp8(absl::string_view text);       // none|delayed|current
// SizeForConfig ("small" / "quickstart"): client/quickstart_layers.h.

const char* LayerName(BenchLayer layer);
const char* OpName(BenchOp op);
const char* Fp8Name(Fp8Mode mode);

// Nearest-rank percentiles, mean, min and max of `ms` (any order).
LatencySummary SummarizeLatencies(std::vector<double> ms);

}  // namespace te::client::bench

#endif  // TE_BENCH_LOAD_TE_BENCH_LIB_H_
