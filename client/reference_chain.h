// ReferenceChain (tests only): a chain of server modules with glue between
// them run from the client, one call per module with the glue and its
// backward on the host. A client's composite is a Graph (graph.h), which the
// server runs as one layer; this chain computes the same thing by another
// route, so tests check the Graphs against it. Every activation crosses the
// wire, so it is slow at full size.
//
// The value flowing between stages is a list of tensors: a module stage takes
// x (and its extra inputs, e.g. k and v) and gives y; a glue step maps lists
// to lists; Fork / Join wrap a residual connection. A ReferenceChain is a
// configuration (thread-compatible); the variables live in the session.
// A module's init key and dropout seed are DeriveSeed(key, stage name)
// (kernels/rng.h), as a graph seeds a module node of that name.
#ifndef TE_CLIENT_REFERENCE_CHAIN_H_
#define TE_CLIENT_REFERENCE_CHAIN_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/modules.h"
#include "client/quickstart_layers.h"

namespace te::client {

using Tensors = std::vector<HostTensor>;

// Glue: its forward and the backward that maps the gradients of its outputs
// to the gradients of its inputs, on the host (both pure functions).
struct HostStep {
  std::function<absl::StatusOr<Tensors>(const Tensors& inputs)> forward;
  std::function<absl::StatusOr<Tensors>(const Tensors& output_grads)> backward;
};

// Views one tensor's trailing dims `from` as `to` (same element count):
// ReshapeTrailing({3 * hidden}, {heads, 3 * head_dim}) is the quickstart's
// qkv.reshape(b, s, heads, 3 * kv_channels).
HostStep ReshapeTrailing(Shape from, Shape to);
// jnp.split(t, parts, axis=-1) on one tensor; its backward concatenates.
HostStep SplitLastAxisStep(int parts);

struct ReferenceChainVariables {
  std::vector<Variables> stages;        // per stage; empty for glue stages
  std::vector<VariableInfo> variables;  // every module's, paths under its stage name
};

class ReferenceChain {
 public:
  // A server module named `name` (its variables appear as "params/<name>/...").
  // With pass_attention_mask it receives ApplyOptions::attention_mask.
  ReferenceChain& Add(std::string name, std::shared_ptr<const Module> module, bool pass_attention_mask = false);
  ReferenceChain& AddHost(std::string name, HostStep step);
  // Fork remembers the current (single) tensor; the next Join adds it back:
  // res = x; x = f(x); x = x + res. Forks nest.
  ReferenceChain& Fork();
  ReferenceChain& Join();

  // Inits each module with the input it sees, running the chain forward
  // (deterministic) to find it, as flax's init runs the module. A module's
  // key is DeriveSeed(key, stage name).
  absl::StatusOr<ReferenceChainVariables> Init(Session& session, uint64_t key, const HostTensor& x) const;

  absl::StatusOr<HostTensor> Apply(const ReferenceChainVariables& vars, const HostTensor& x,
                                   const ApplyOptions& options = {}) const;

  // value, dx and every module's parameter gradients ("params/<name>/<path>").
  // With return_grads false the gradients stay on the server (each layer's
  // "grads" collection) and only the activations' gradients travel, as a
  // timed training step wants.
  absl::StatusOr<ValueAndGradResult> ValueAndGrad(const ReferenceChainVariables& vars, const HostTensor& x,
                                                  const HostTensor& dy, const ApplyOptions& options = {},
                                                  bool return_grads = true) const;

 private:
  enum class Kind { kModule, kHost, kFork, kJoin };
  struct Stage {
    Kind kind;
    std::string name;
    std::shared_ptr<const Module> module;
    bool pass_attention_mask = false;
    HostStep step;
  };

  // Runs the chain forward. With `vars` null, inits each module first (into
  // *inited); with forward_ids non-null, keeps each module's forward.
  absl::StatusOr<HostTensor> Run(Session* session, uint64_t key, const ReferenceChainVariables* vars,
                                 const HostTensor& x, const ApplyOptions& options,
                                 ReferenceChainVariables* inited, std::vector<std::string>* forward_ids) const;

  std::vector<Stage> stages_;

};

// The quickstart's sections 3 and 5 (UnfusedLayer, FusedLayer in
// quickstart_layers.h) as chains: the same module names, so the same
// DeriveSeed-derived parameters; without the dropout after the attention's
// projection, so they agree with deterministic applies only.
ReferenceChain UnfusedChain(const LayerSize& c);
ReferenceChain FusedChain(const LayerSize& c);

}  // namespace te::client

#endif  // TE_CLIENT_REFERENCE_CHAIN_H_
