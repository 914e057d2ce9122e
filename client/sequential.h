// Sequential: a chain of server modules with glue between them, for a layer
// the server has no single module for, such as the quickstart's
// TEUnfusedTransformerLayer (te_flax.LayerNorm, DenseGeneral, activation and
// DotProductAttention composed in Flax, with reshapes, a q/k/v split and
// residual adds between them).
//
// The value flowing between stages is a list of tensors: a module stage takes
// x (and its extra inputs, e.g. k and v) and gives y; a glue step maps lists
// to lists; Fork / Join wrap a residual connection. A Sequential is a
// configuration (thread-compatible); the variables live in the session.
//
// Two ways to run one chain, with the same variables and the same numbers:
//  * ServerSequential (what the quickstart runs): the chain as one
//    te.v1.GraphSpec layer, the server's composite mechanism (DESIGN.md
//    section 11): one call per step, no activation crosses the wire.
//  * Sequential's own Init / Apply / ValueAndGrad: one call per module with
//    the glue and its backward on the host. It is the reference the graph is
//    tested against (and --sequential_on_server=false of the quickstart);
//    every activation crosses the wire, so it is slow at full size.
// A module's init key and dropout seed are NodeSeed(key, stage name)
// (kernels/rng.h) in both, as for every graph node.
#ifndef TE_CLIENT_SEQUENTIAL_H_
#define TE_CLIENT_SEQUENTIAL_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/modules.h"

namespace te::client {

using Tensors = std::vector<HostTensor>;

// Glue: its forward and the backward that maps the gradients of its outputs
// to the gradients of its inputs, on the host (both pure functions), and the
// same step as a graph node, when it has one.
struct HostStep {
  std::function<absl::StatusOr<Tensors>(const Tensors& inputs)> forward;
  std::function<absl::StatusOr<Tensors>(const Tensors& output_grads)> backward;
  // The op of the te.v1.GraphSpec node (name, inputs and outputs are the
  // chain's); a chain whose steps all have one runs on the server
  // (ServerSequential).
  std::optional<te::v1::GraphSpec::Node> graph_node;
};

// Views one tensor's trailing dims `from` as `to` (same element count):
// ReshapeTrailing({3 * hidden}, {heads, 3 * head_dim}, {-1, seq}) is the
// quickstart's qkv.reshape(b, s, heads, 3 * kv_channels). A graph reshape
// names the whole new shape, so its graph form is `leading` then `to`, with
// one -1 in `leading` at most (numpy's); without `leading` it has none.
HostStep ReshapeTrailing(Shape from, Shape to, Shape leading = {});
// jnp.split(t, parts, axis=-1) on one tensor; its backward concatenates.
HostStep SplitLastAxisStep(int parts);

struct SequentialVariables {
  std::vector<Variables> stages;        // per stage; empty for glue stages
  std::vector<VariableInfo> variables;  // every module's, paths under its stage name
};

class Sequential {
 public:
  // A server module named `name` (its variables appear as "params/<name>/...").
  // With pass_attention_mask it receives ApplyOptions::attention_mask.
  Sequential& Add(std::string name, std::shared_ptr<const Module> module, bool pass_attention_mask = false);
  Sequential& AddHost(std::string name, HostStep step);
  // Fork remembers the current (single) tensor; the next Join adds it back:
  // res = x; x = f(x); x = x + res. Forks nest.
  Sequential& Fork();
  Sequential& Join();

  // Inits each module with the input it sees, running the chain forward
  // (deterministic) to find it, as flax's init runs the module. A module's
  // key is NodeSeed(key, stage name).
  absl::StatusOr<SequentialVariables> Init(Session& session, uint64_t key, const HostTensor& x) const;

  absl::StatusOr<HostTensor> Apply(const SequentialVariables& vars, const HostTensor& x,
                                   const ApplyOptions& options = {}) const;

  // value, dx and every module's parameter gradients ("params/<name>/<path>").
  // With return_grads false the gradients stay on the server (each layer's
  // "grads" collection) and only the activations' gradients travel, as a
  // timed training step wants.
  absl::StatusOr<ValueAndGradResult> ValueAndGrad(const SequentialVariables& vars, const HostTensor& x,
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
  absl::StatusOr<HostTensor> Run(Session* session, uint64_t key, const SequentialVariables* vars,
                                 const HostTensor& x, const ApplyOptions& options,
                                 SequentialVariables* inited, std::vector<std::string>* forward_ids) const;

  std::vector<Stage> stages_;

  friend class ServerSequential;
};

// A Sequential run by the server as one layer, a te.v1.GraphSpec: module
// nodes named by the stage names (their variables "params/<stage>/...", as
// Flax scopes a composite's submodules: "params/DenseGeneral_0/kernel"), the
// glue steps' graph nodes under their names, and an add node
// "residual_add_<k>" for the k-th Join of the current tensor and the forked
// one; a module with pass_attention_mask reads "attention_mask". The tensors
// between the stages never leave the device, so a step is one call. Its
// numbers are the client chain's: the graph seeds its nodes with NodeSeed as
// Sequential does. Spec() answers UNIMPLEMENTED for a chain with a glue step
// that has no graph node.
class ServerSequential : public Module {
 public:
  explicit ServerSequential(Sequential chain) : chain_(std::move(chain)) {}
  std::string type_name() const override { return "Sequential"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;

 private:
  Sequential chain_;
};

}  // namespace te::client

#endif  // TE_CLIENT_SEQUENTIAL_H_
