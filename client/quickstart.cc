// quickstart: TE's JAX quickstart (docs/examples/quickstart_jax.ipynb)
// replayed through te_server with the client library.
//
// The notebook builds a GPT decoder layer six ways and times each with its
// speedometer (forward + backward, value_and_grad of vdot(y, dy)) on bf16
// inputs with a causal mask:
//   1. FlaxTransformerLayer: plain Flax (nn.LayerNorm, nn.Dense, dot-product
//      attention, gelu MLP).
//   2. TEUnfusedTransformerLayer(use_te_attention=False): te_flax LayerNorm,
//      DenseGeneral and activation, with Flax's attention.
//   3. TEUnfusedTransformerLayer: the same with te_flax.DotProductAttention.
//   4. 3 under te.autocast(DelayedScaling(HYBRID, amax_history_len=16, "max")).
//   5. TEFusedTransformerLayer: LayerNormDenseGeneral + LayerNormMLP, FP8.
//   6. te_flax.TransformerLayer, FP8.
// Variants 1 and 6 are single server modules. 2-5 compose modules in Flax:
// here they are a Sequential of server modules with the reshapes, the q/k/v
// split and the residual adds between them, sent as one te.v1.GraphSpec
// layer (ServerSequential: the activations stay on the device, as in the
// notebook's jitted step). --sequential_on_server=false runs the same chain
// from the client instead, one call per module with the glue on the host
// (the graph's reference; slow at full size).
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
#include "client/client.h"
#include "client/modules.h"
#include "client/quickstart_layers.h"
#include "client/sequential.h"
#include "client/speedometer.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051", "te_server address (host:port)");
ABSL_FLAG(std::string, config, "small",
          "small (batch 2, seq 32, hidden 64, ffn 256, 4 heads) or quickstart (batch 4, seq 2048, "
          "hidden 4096, ffn 16384, 32 heads)");
ABSL_FLAG(std::string, variants, "all", "which variants to run: all, or a list such as 1,4,6");
ABSL_FLAG(int, iters, 10, "timed steps per variant (the notebook uses 50)");
ABSL_FLAG(int, warmup, 3, "warm-up steps per variant (the notebook uses 50)");
ABSL_FLAG(bool, server_side, false, "time single-module variants on the server (Benchmark RPC)");
ABSL_FLAG(bool, sequential_on_server, true,
          "variants 2-5: the server runs the chain as one graph layer (false: one call per "
          "module, glue on the client)");

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
  return Speedometer(session, module, vars, in.x, in.dy, in.speed).status();
}

absl::Status RunSequential(Session& session, const Sequential& layer, const Inputs& in) {
  if (absl::GetFlag(FLAGS_sequential_on_server)) {
    return RunModule(session, ServerSequential(layer), in);
  }
  ASSIGN_OR_RETURN(SequentialVariables vars, layer.Init(session, /*key=*/42, in.x));
  std::cout << "Parameter shapes: " << ShapeTree(vars.variables) << "\n";
  ApplyOptions apply;
  apply.deterministic = true;
  ASSIGN_OR_RETURN(HostTensor y, layer.Apply(vars, in.x, apply));
  PrintApplied(in.x, y);
  SpeedometerOptions speed = in.speed;
  speed.server_side = false;  // several layers per step: only the client can time it
  // Unlike the notebook's jitted layer, each step here is a chain of server
  // calls whose activations all cross the network (at the quickstart's sizes,
  // gigabytes per step): its time measures the transport, not the layer.
  std::cout << "(timed client-side: a chain of server calls per step, every activation through the client)\n";
  return Speedometer(session, layer, vars, in.x, in.dy, speed).status();
}

absl::Status RunVariant(Client& client, int variant, const LayerSize& c, const Inputs& in) {
  static const char* const kTitles[] = {
      "",
      "Pure Flax FlaxTransformerLayer",
      "TE DenseGeneral + LayerNorm + activation, Flax attention",
      "TE DenseGeneral + LayerNorm + activation + DotProductAttention",
      "TE unfused layer under FP8 (DelayedScaling HYBRID, amax_history_len=16, max)",
      "TE fused LayerNormDenseGeneral + LayerNormMLP under FP8",
      "TE TransformerLayer under FP8",
  };
  std::cout << "\n== " << variant << ". " << kTitles[variant] << " ==\n";
  const bool fp8 = variant >= 4;
  SessionOptions options;
  if (fp8) {
    options.recipes = {QuickstartRecipe()};
    options.policy = NegotiationPolicy::kEmulate;  // FP8 also on devices without FP8 GEMMs (emulated)
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Session> session, client.CreateSession(options));
  if (fp8) {
    std::cout << "Session on " << session->device() << ", recipe "
              << (session->recipe() ? RecipeString(*session->recipe()) : "none")
              << (session->emulated() ? " (emulated)" : "") << "\n";
    if (!session->negotiation().empty()) std::cout << "Negotiation: " << session->negotiation() << "\n";
  }
  // te.autocast(enabled=True, recipe=fp8_recipe) around init, apply and the speedometer.
  Autocast autocast(fp8, QuickstartRecipe());
  switch (variant) {
    case 1: {
      return RunModule(*session, QuickstartFlaxLayer(c), in);
    }
    case 2:
    case 3:
    case 4: return RunSequential(*session, UnfusedLayer(c), in);
    case 5: return RunSequential(*session, FusedLayer(c), in);
    case 6: return RunModule(*session, QuickstartTransformerLayer(c), in);
  }
  return absl::InvalidArgumentError(absl::StrCat("variant ", variant));
}

absl::Status Main() {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(LayerSize c, SizeForConfig(absl::GetFlag(FLAGS_config)));
  ASSIGN_OR_RETURN(std::set<int> variants, ParseVariants(absl::GetFlag(FLAGS_variants)));
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(absl::GetFlag(FLAGS_server)));
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
