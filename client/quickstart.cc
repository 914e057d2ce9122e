// quickstart: TE's JAX quickstart (docs/examples/quickstart_jax.ipynb)
// replayed through te_server with the client library.
//
// The notebook builds a GPT decoder layer six ways and times each with its
// speedometer (forward + backward, value_and_grad of vdot(y, dy)) on bf16
// inputs with a causal mask:
//   1. FlaxTransformerLayer: plain Flax (nn.LayerNorm, nn.Dense,
//      nn.MultiHeadDotProductAttention, a gelu MLP).
//   2. TEUnfusedTransformerLayer(use_te_attention=False): te_flax LayerNorm,
//      DenseGeneral and activation, with Flax's attention.
//   3. TEUnfusedTransformerLayer: the same with te_flax.DotProductAttention.
//   4. 3 under te.autocast(DelayedScaling(HYBRID, amax_history_len=16, "max")).
//   5. TEFusedTransformerLayer: LayerNormDenseGeneral + LayerNormMLP, FP8.
//   6. te_flax.TransformerLayer, FP8.
// Sections 1-5 compose modules in Flax: each is a Graph (client/graph.h)
// built node for node as the notebook's class writes it, the spec the Python
// client traces from the same class, which the server runs as one layer (the
// activations stay on the device, as in the notebook's jitted step). Section
// 6 is one module. Each prints its parameter tree, its output's shape and
// dtype (section 1's is float32: Flax's modules promote the bf16 x with
// their float32 parameters), and the speedometer's mean step time.
//
//   quickstart --server=localhost:50051 --config=small --variants=all --iters=10
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/modules.h"
#include "client/quickstart_layers.h"
#include "client/speedometer.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051", "te_server address (host:port)");
ABSL_FLAG(std::string, config, "small",
          "small (batch 2, seq 32, hidden 64, ffn 256, 4 heads) or quickstart (batch 4, seq 2048, "
          "hidden 4096, ffn 16384, 32 heads)");
ABSL_FLAG(std::string, variants, "all", "which variants to run: all, or a list such as 1,4,6");
ABSL_FLAG(int, iters, 10, "timed steps per variant (the notebook uses 50)");
ABSL_FLAG(int, warmup, 3, "warm-up steps per variant (the notebook uses 50)");
ABSL_FLAG(bool, server_side, false, "time the steps on the server (Benchmark RPC)");
ABSL_FLAG(absl::Duration, rpc_timeout, te::client::ClientOptions().rpc_timeout,
          "deadline of each call (a CPU server at --config=quickstart needs more than the default)");

namespace te::client {
namespace {

absl::StatusOr<std::set<int>> ParseVariants(const std::string& text) {
  if (text == "all") return std::set<int>{1, 2, 3, 4, 5, 6};
  std::set<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1 || v > 6) {
      return absl::InvalidArgumentError(absl::StrCat("--variants: \"", part, "\" is not a variant 1-6"));
    }
    out.insert(v);
  }
  return out;
}

std::string PythonShape(const Shape& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

struct Inputs {
  HostTensor x, dy;
  SpeedometerOptions speed;
};

void PrintApplied(const HostTensor& x, const HostTensor& y) {
  std::cout << "Input shape: " << PythonShape(x.shape()) << "\n"
            << "Output shape: " << PythonShape(y.shape()) << "\n"
            << "Output dtype: " << DTypeName(y.dtype()) << "\n";
}

// init (under the current autocast), apply (deterministic), speedometer: the
// notebook's three cells per variant.
absl::Status RunModule(Session& session, const Module& module, const Inputs& in) {
  ASSIGN_OR_RETURN(Variables vars, module.Init(session, /*key=*/42, in.x));
  std::cout << "Parameter shapes: " << ShapeTree(vars.variables) << "\n";
  ApplyOptions apply;
  apply.deterministic = true;
  ASSIGN_OR_RETURN(HostTensor y, module.Apply(vars, in.x, apply));
  PrintApplied(in.x, y);
  // The step's dy comes in y's dtype (float32 for the Flax-attention
  // sections), holding the same bf16 values.
  HostTensor dy = in.dy;
  if (dy.dtype() != y.dtype()) {
    ASSIGN_OR_RETURN(dy, HostTensor::FromFloats(in.dy.shape(), in.dy.ToFloats(), y.dtype()));
  }
  return Speedometer(session, module, vars, in.x, dy, in.speed).status();
}

absl::Status RunVariant(Client& client, int variant, const LayerSize& c, const Inputs& in) {
  ASSIGN_OR_RETURN(QuickstartSection section, SectionFor(variant, c));
  std::cout << "\n== " << variant << ". " << section.title << " ==\n";
  SessionOptions options;
  if (section.fp8) {
    options.recipes = {QuickstartRecipe()};
    options.policy = NegotiationPolicy::kEmulate;  // FP8 also on devices without FP8 GEMMs (emulated)
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client.CreateSession(options));
  if (section.fp8) {
    std::cout << "Session on " << session->device() << ", recipe "
              << (session->recipe() ? RecipeString(*session->recipe()) : "none")
              << (session->emulated() ? " (emulated)" : "") << "\n";
    if (!session->negotiation().empty()) std::cout << "Negotiation: " << session->negotiation() << "\n";
  }
  // te.autocast(enabled=True, recipe=fp8_recipe) around init, apply and the speedometer.
  Autocast autocast(section.fp8, QuickstartRecipe());
  return RunModule(*session, *section.layer, in);
}

absl::Status Main() {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(LayerSize c, SizeForConfig(absl::GetFlag(FLAGS_config)));
  ASSIGN_OR_RETURN(std::set<int> variants, ParseVariants(absl::GetFlag(FLAGS_variants)));
  ClientOptions client_options;
  client_options.rpc_timeout = absl::GetFlag(FLAGS_rpc_timeout);
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(absl::GetFlag(FLAGS_server), client_options));
  ASSIGN_OR_RETURN(te::v1::ServerInfo info, client->GetServerInfo());
  std::cout << "te_server " << info.version();
  for (const te::v1::DeviceInfo& d : info.devices()) std::cout << " | " << d.name() << ": " << d.description();
  std::cout << "\nConfig " << absl::GetFlag(FLAGS_config) << ": batch " << c.batch << ", seq " << c.seq
            << ", hidden " << c.hidden << ", ffn " << c.ffn << ", heads " << c.heads << ", bf16 inputs\n";

  // The notebook draws x and dy from one key (so dy == x); distinct seeds here.
  Inputs in;
  const Shape shape = {c.batch, c.seq, c.hidden};
  in.x = HostTensor::RandomNormal(shape, DType::kBF16, /*seed=*/42);
  in.dy = HostTensor::RandomNormal(shape, DType::kBF16, /*seed=*/43);
  in.speed.warmup_iters = absl::GetFlag(FLAGS_warmup);
  in.speed.timing_iters = absl::GetFlag(FLAGS_iters);
  in.speed.server_side = absl::GetFlag(FLAGS_server_side);
  in.speed.deterministic = false;  // forward_kwargs={"deterministic": False}
  in.speed.dropout_seed = 7;       // the notebook's dropout_key

  for (int variant : variants) RETURN_IF_ERROR(RunVariant(*client, variant, c, in));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "\nTotal wall time: " << seconds << " s\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace te::client

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = te::client::Main();
  if (!status.ok()) {
    std::cerr << "quickstart failed: " << status << std::endl;
    return 1;
  }
  return 0;
}
