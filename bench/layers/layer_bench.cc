// layer_bench: the quickstart's variants timed through te_server, for the GPU
// benchmark harness (bench/harness/run_gpu_bench.sh, summarize.py).
//
// Each variant runs in its own session: its layer(s) are initialised, x and
// dy are uploaded once as resident tensors, and a forward + backward step
// (value_and_grad of vdot(y, dy), dropout on as the quickstart times it) is
// timed two ways:
//   server: the Benchmark RPC (the server's own clock, no network), each
//           step timed alone, and queued back to back (BenchmarkRequest.queued:
//           one wait after the timed steps, as JAX's and PyTorch's loops time);
//   client: the wall time the client observes per step, inputs resident,
//           nothing brought back: serially (each step waits for the last's
//           answer) and pipelined (--client_depth steps in flight, the next
//           one queued on the server while one runs).
// Every variant is one server module: 1-6 are the quickstart's sections as
// client/quickstart_layers builds them (1-5 Graphs: the notebook's composed
// classes node for node, run by the server as one layer, so a step is one
// call and every tensor stays on the device; 6 te_flax.TransformerLayer),
// and 7 is section 6 without FP8.
//
// Output, one line per variant (times are means per step in ms; "-" where
// not measured):
//   OURS <variant> <server ms> <client ms> <peak device MiB>
//   OURS <variant> FAILED <message>
//   OURSMEM <variant> peak <MiB> reserved <MiB> (peak <MiB>)
//   OURSPIPE <variant> depth <n> <ms> serial <ms> server <ms> (<ratio>x)
//   OURSQUEUED <variant> <ms> (steps timed alone: <ms> ms)
//   OURSROUND <variant> <k> server <ms> pipelined <ms> (<ratio>x)
//   OURSROUNDS <variant> median <ratio>x over <n> rounds
//
// --rounds=N (N > 0, both sides timed) then times the server and the
// pipelined client N more times each, alternating which goes first, so a
// drift of the GPU's clocks over the call weighs on both alike; the median
// of the per-round ratios is the client's overhead.
//   layer_bench --server=localhost:50051 --config=quickstart --variants=all
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/modules.h"
#include "client/quickstart_layers.h"
#include "client/recipe.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051", "te_server address (host:port)");
ABSL_FLAG(std::string, config, "quickstart",
          "quickstart (batch 4, seq 2048, hidden 4096, ffn 16384, 32 heads) or small (batch 2, seq 32, "
          "hidden 64, ffn 256, 4 heads)");
ABSL_FLAG(std::string, variants, "all", "all, or a list such as 1,4,6 (7: TransformerLayer in bf16)");
ABSL_FLAG(int, warmup, 5, "untimed steps before each timing");
ABSL_FLAG(int, iters, 20, "timed steps per timing");
ABSL_FLAG(bool, deterministic, false, "true: dropout off (the quickstart times with dropout on)");
ABSL_FLAG(bool, server_side, true, "time with the Benchmark RPC");
ABSL_FLAG(bool, client_side, true, "time client-observed steps");
ABSL_FLAG(int, client_depth, 2,
          "steps the pipelined client-observed timing keeps in flight (ForwardBackwardAsync): the next "
          "step waits queued on the server while one runs; 1 times only the serial loop");
ABSL_FLAG(bool, queued, true,
          "with server_side: also the Benchmark with its timed steps queued back to back (OURSQUEUED)");
ABSL_FLAG(int, rounds, 0,
          "with both sides timed: N more rounds of server and pipelined client timings, alternating "
          "which goes first, and the median of their ratios (OURSROUND, OURSROUNDS)");
ABSL_FLAG(std::string, memory_probe, "",
          "a command printing the device's used memory in MiB (e.g. nvidia-smi --query-gpu=memory.used "
          "--format=csv,noheader,nounits -i 0); read before the variant's session allocates and after "
          "its client-side steps. The server's caching allocator keeps what it reserved, so the "
          "difference is the variant's peak only when the server ran nothing before it");

namespace te::client {
namespace {

constexpr int kVariants = 7;

absl::StatusOr<std::set<int>> ParseVariants(const std::string& text) {
  std::set<int> out;
  if (text == "all") {
    for (int v = 1; v <= kVariants; ++v) out.insert(v);
    return out;
  }
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1 || v > kVariants) {
      return absl::InvalidArgumentError(absl::StrCat("--variants: \"", part, "\" is not a variant 1-7"));
    }
    out.insert(v);
  }
  return out;
}

// ---- the variants -------------------------------------------------------------------

struct Variant {
  std::string name;  // the OURS line's key; "fp8" in it marks an FP8 variant for summarize.py
  bool fp8 = false;
  std::shared_ptr<const Module> module;
  std::string note;
};

template <typename M>
std::shared_ptr<const Module> Shared(M module) {
  return std::make_shared<M>(std::move(module));
}

// 1-6: the quickstart's sections (client/quickstart_layers' SectionFor), 7
// an extra row.
absl::StatusOr<Variant> MakeVariant(int number, const LayerSize& c) {
  static const char* const kNames[] = {"",
                                       "v1_flax_bf16",
                                       "v2_te_unfused_flax_attn_bf16",
                                       "v3_te_unfused_bf16",
                                       "v4_te_unfused_fp8",
                                       "v5_te_fused_fp8",
                                       "v6_te_transformer_fp8"};
  if (number == 7) {
    return Variant{"v7_te_transformer_bf16", false, Shared(QuickstartTransformerLayer(c)),
                   "not a quickstart variant: variant 6 without FP8"};
  }
  ASSIGN_OR_RETURN(QuickstartSection section, SectionFor(number, c));
  return Variant{kNames[number], section.fp8, section.layer, ""};
}

// ---- running one ---------------------------------------------------------------------

struct Options {
  int warmup = 5;
  int iters = 20;
  bool deterministic = false;
  bool server_side = true;
  bool client_side = true;
  int client_depth = 2;
  bool queued = true;
  int rounds = 0;
  std::string memory_probe;
};

// The device's used memory in MiB from the probe command; nullopt when there
// is none or it printed no number.
std::optional<double> ProbeMemoryMiB(const std::string& command) {
  if (command.empty()) return std::nullopt;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  char line[256] = {0};
  const bool read = fgets(line, sizeof(line), pipe) != nullptr;
  pclose(pipe);
  double mib = 0;
  if (!read || !absl::SimpleAtod(absl::StripAsciiWhitespace(line), &mib)) return std::nullopt;
  return mib;
}

double MeanMs(const std::vector<double>& ms) {
  double sum = 0;
  for (double t : ms) sum += t;
  return ms.empty() ? 0 : sum / ms.size();
}

// Runs `step` warmup + iters times; the mean wall time of the timed steps.
absl::StatusOr<double> TimeSteps(const Options& o, const std::function<absl::Status(uint64_t step)>& step) {
  uint64_t n = 0;
  for (int i = 0; i < o.warmup; ++i) RETURN_IF_ERROR(step(n++));
  std::vector<double> ms;
  for (int i = 0; i < o.iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(step(n++));
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return MeanMs(ms);
}

class VariantRun {
 public:
  VariantRun(Session& session, const Options& options, te::v1::Autocast autocast)
      : session_(session), o_(options), autocast_(std::move(autocast)) {}

  // Inits the layer; uploads x and dy.
  absl::Status Init(const Variant& v, const LayerSize& c) {
    const Shape shape = {c.batch, c.seq, c.hidden};
    const DType dtype = DType::kBF16;
    te::v1::InitLayerRequest request;
    ASSIGN_OR_RETURN(*request.mutable_spec(), v.module->Spec());
    request.set_seed(42);
    request.set_input_dtype(DTypeToProto(dtype));
    for (int64_t d : shape) request.add_input_shape(d);
    *request.mutable_autocast() = autocast_;
    ASSIGN_OR_RETURN(te::v1::InitLayerResponse response, session_.InitLayer(std::move(request)));
    layer_id_ = response.layer_id();
    const Shape y_shape(response.output_shape().begin(), response.output_shape().end());
    ASSIGN_OR_RETURN(const DType y_dtype, DTypeFromProto(response.output_dtype(), "InitLayerResponse.output_dtype"));
    ASSIGN_OR_RETURN(ResidentTensor x_resident, session_.Put(HostTensor::RandomNormal(shape, dtype, 42)));
    x_ = x_resident.ToProto();
    ASSIGN_OR_RETURN(ResidentTensor dy_resident, session_.Put(HostTensor::RandomNormal(y_shape, y_dtype, 43)));
    dy_ = dy_resident.ToProto();
    return absl::OkStatus();
  }

  // Client-observed mean ms per step.
  absl::StatusOr<double> TimeClient() {
    te::v1::ForwardBackwardRequest request = StepRequest();
    return TimeSteps(o_, [&](uint64_t step) {
      request.mutable_micro_batches(0)->set_dropout_seed(MixBits(step + 1));
      return session_.ForwardBackward(request).status();
    });
  }

  // Client-observed mean ms per step with `depth` steps in flight: each step
  // is sent before the last one's answer arrives, so the wire and the
  // request's decoding overlap the device's work on the step before. The
  // steps' results are those of the serial loop (the session runs them in
  // the order they were sent).
  absl::StatusOr<double> TimeClientPipelined(int depth) {
    te::v1::ForwardBackwardRequest request = StepRequest();
    std::deque<std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>>> in_flight;
    uint64_t n = 0;
    auto send = [&] {
      request.mutable_micro_batches(0)->set_dropout_seed(MixBits(++n));
      in_flight.push_back(session_.ForwardBackwardAsync(request));
    };
    auto wait_oldest = [&]() -> absl::Status {
      absl::Status status = in_flight.front().get().status();
      in_flight.pop_front();
      return status;
    };
    for (int i = 0; i < o_.warmup; ++i) {
      send();
      RETURN_IF_ERROR(wait_oldest());
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status status;
    for (int i = 0; i < o_.iters && status.ok(); ++i) {
      send();
      if (static_cast<int>(in_flight.size()) >= depth) status = wait_oldest();
    }
    while (!in_flight.empty()) status.Update(wait_oldest());
    RETURN_IF_ERROR(status);
    const double total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return total / std::max(o_.iters, 1);
  }

  // Server-side mean ms per step: the Benchmark RPC.
  absl::StatusOr<double> TimeServer() { return Benchmark(layer_id_, x_, dy_, /*queued=*/false); }
  absl::StatusOr<double> TimeServerQueued() { return Benchmark(layer_id_, x_, dy_, /*queued=*/true); }

 private:
  // One step of the layer on the resident x and dy, nothing sent back.
  te::v1::ForwardBackwardRequest StepRequest() const {
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(layer_id_);
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = x_;
    *mb->mutable_dy() = dy_;
    request.set_deterministic(o_.deterministic);
    *request.mutable_autocast() = autocast_;
    request.set_return_dx(false);
    request.set_return_grads(false);
    request.set_discard_grads(true);  // as the Benchmark's steps drop them
    return request;
  }

  absl::StatusOr<double> Benchmark(const std::string& layer_id, const te::v1::Tensor& x,
                                   const te::v1::Tensor& dy, bool queued) {
    te::v1::BenchmarkRequest request;
    request.set_layer_id(layer_id);
    *request.mutable_inputs()->mutable_x() = x;
    *request.mutable_inputs()->mutable_dy() = dy;
    request.mutable_inputs()->set_dropout_seed(7);
    request.set_deterministic(o_.deterministic);
    *request.mutable_autocast() = autocast_;
    request.set_warmup_iters(std::max(o_.warmup, 1));  // 0 would mean the server's default
    request.set_timing_iters(o_.iters);
    request.set_queued(queued);
    ASSIGN_OR_RETURN(te::v1::BenchmarkResponse response, session_.Benchmark(std::move(request)));
    if (!queued) last_response_ = response;
    return response.mean_ms();
  }

 public:
  // The last Benchmark's answer (its timed steps' memory included).
  const te::v1::BenchmarkResponse& last_response() const { return last_response_; }

 private:
  te::v1::BenchmarkResponse last_response_;

  Session& session_;
  const Options& o_;
  const te::v1::Autocast autocast_;
  std::string layer_id_;
  te::v1::Tensor x_, dy_;
};

// The server's step and the pipelined client's, o.rounds times, alternating
// which runs first; prints each round and the median ratio.
absl::Status TimeInterleaved(VariantRun& run, const Variant& v, const Options& o) {
  std::vector<double> ratios;
  for (int k = 0; k < o.rounds; ++k) {
    double server_ms = 0, client_ms = 0;
    for (int side = 0; side < 2; ++side) {
      if ((side + k) % 2 == 0) {
        ASSIGN_OR_RETURN(server_ms, run.TimeServer());
      } else {
        ASSIGN_OR_RETURN(client_ms, run.TimeClientPipelined(o.client_depth));
      }
    }
    ratios.push_back(client_ms / server_ms);
    std::cout << absl::StrFormat("OURSROUND %s %d server %.3f pipelined %.3f (%.3fx)\n", v.name, k,
                                 server_ms, client_ms, ratios.back())
              << std::flush;
  }
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  const double median = n % 2 ? ratios[n / 2] : (ratios[n / 2 - 1] + ratios[n / 2]) / 2;
  std::cout << absl::StrFormat("OURSROUNDS %s median %.3fx over %d rounds\n", v.name, median, o.rounds)
            << std::flush;
  return absl::OkStatus();
}

std::string Ms(const std::optional<double>& ms) { return ms ? absl::StrFormat("%.3f", *ms) : "-"; }

absl::Status RunVariant(Client& client, const Variant& v, const LayerSize& c, const Options& o) {
  SessionOptions session_options;
  if (v.fp8) {
    session_options.recipes = {QuickstartRecipe()};
    session_options.policy = NegotiationPolicy::kEmulate;
  }
  const std::optional<double> memory_before = ProbeMemoryMiB(o.memory_probe);
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client.CreateSession(session_options));
  std::cerr << "layer_bench: " << v.name << " on " << session->device()
            << (v.fp8 && session->recipe() ? " with " + RecipeString(*session->recipe()) : "")
            << (session->emulated() ? " (emulated)" : "") << ", " << v.module->type_name()
            << (v.note.empty() ? "" : "; " + v.note) << std::endl;
  VariantRun run(*session, o, ToProto(AutocastState{v.fp8, QuickstartRecipe()}));
  RETURN_IF_ERROR(run.Init(v, c));

  std::optional<double> client_ms, pipelined_ms, server_ms, queued_ms, peak_mib;
  // The Benchmark RPC first, so its peak is the step's own whatever the
  // client steps leave behind (they drop their gradients: discard_grads, so
  // they do the Benchmark's work and keep nothing).
  if (o.server_side) {
    ASSIGN_OR_RETURN(server_ms, run.TimeServer());
    if (o.queued) {
      ASSIGN_OR_RETURN(queued_ms, run.TimeServerQueued());
    }
  }
  if (o.client_side) {
    ASSIGN_OR_RETURN(client_ms, run.TimeClient());
    if (o.client_depth > 1) {
      ASSIGN_OR_RETURN(pipelined_ms, run.TimeClientPipelined(o.client_depth));
    }
  }
  // The caching allocator keeps what it reserved, so the probe's difference is
  // the most the variant held at once.
  const std::optional<double> memory_after = ProbeMemoryMiB(o.memory_probe);
  if (memory_before && memory_after) peak_mib = *memory_after - *memory_before;
  std::cout << "OURS " << v.name << " " << Ms(server_ms) << " " << Ms(client_ms) << " "
            << (peak_mib ? absl::StrFormat("%.0f", *peak_mib) : "-") << std::endl;
  if (server_ms) {
    // The server's own account of the timed steps (JAX's peak_bytes_in_use /
    // bytes_reserved), beside the external probe's peak in the OURS line.
    const te::v1::BenchmarkResponse& r = run.last_response();
    constexpr double kMiB = 1 << 20;
    std::cout << absl::StrFormat("OURSMEM %s peak %.1f MiB reserved %.1f MiB (peak %.1f)\n", v.name,
                                 r.peak_bytes_in_use() / kMiB, r.bytes_reserved() / kMiB,
                                 r.peak_bytes_reserved() / kMiB)
              << std::flush;
  }
  if (queued_ms) {
    // The steps queued back to back on the server, as the peers time theirs.
    std::cout << absl::StrFormat("OURSQUEUED %s %.3f ms (steps timed alone: %s ms)\n", v.name, *queued_ms,
                                 Ms(server_ms))
              << std::flush;
  }
  if (pipelined_ms) {
    // The client-observed step with the next one queued, against the serial
    // loop and the server's own time.
    std::cout << absl::StrFormat("OURSPIPE %s depth %d %.3f ms serial %s ms", v.name, o.client_depth,
                                 *pipelined_ms, Ms(client_ms));
    if (server_ms) std::cout << absl::StrFormat(" server %.3f ms (%.3fx)", *server_ms, *pipelined_ms / *server_ms);
    std::cout << std::endl;
  }
  if (o.rounds > 0 && o.server_side && o.client_side && o.client_depth > 1) {
    RETURN_IF_ERROR(TimeInterleaved(run, v, o));
  }
  return session->Close();
}

int Main() {
  absl::StatusOr<LayerSize> config = SizeForConfig(absl::GetFlag(FLAGS_config));
  absl::StatusOr<std::set<int>> variants = ParseVariants(absl::GetFlag(FLAGS_variants));
  if (!config.ok() || !variants.ok()) {
    std::cerr << "layer_bench: " << (config.ok() ? variants.status() : config.status()) << std::endl;
    return 2;
  }
  Options o;
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.iters = absl::GetFlag(FLAGS_iters);
  o.deterministic = absl::GetFlag(FLAGS_deterministic);
  o.server_side = absl::GetFlag(FLAGS_server_side);
  o.client_side = absl::GetFlag(FLAGS_client_side);
  o.client_depth = absl::GetFlag(FLAGS_client_depth);
  o.memory_probe = absl::GetFlag(FLAGS_memory_probe);
  o.rounds = absl::GetFlag(FLAGS_rounds);
  o.queued = absl::GetFlag(FLAGS_queued);
  if (o.warmup < 0 || o.iters <= 0 || o.rounds < 0) {
    std::cerr << "layer_bench: --warmup " << o.warmup << " and --rounds " << o.rounds
              << " must be >= 0 and --iters " << o.iters << " > 0\n";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(absl::GetFlag(FLAGS_server));
  if (!client.ok()) {
    std::cerr << "layer_bench: " << client.status() << std::endl;
    return 2;
  }
  const LayerSize& c = *config;
  std::cout
      << absl::StrFormat(
             "CONFIG batch %d seq %d hidden %d ffn %d heads %d bf16 causal dropout %s warmup %d iters %d\n",
             c.batch, c.seq, c.hidden, c.ffn, c.heads, o.deterministic ? "off" : "on", o.warmup, o.iters)
      << std::flush;
  int failed = 0;
  for (int number : *variants) {
    absl::StatusOr<Variant> v = MakeVariant(number, c);
    absl::Status status = v.ok() ? RunVariant(**client, *v, c, o) : v.status();
    if (!status.ok()) {
      ++failed;
      std::cout << "OURS " << (v.ok() ? v->name : absl::StrCat("v", number)) << " FAILED " << status << std::endl;
    }
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace te::client

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return te::client::Main();
}
