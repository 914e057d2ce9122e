// Sequential: a chain of server modules with client-side glue between them,
// for a layer the server has no single module for, such as the quickstart's
// TEUnfusedTransformerLayer (te_flax.LayerNorm, DenseGeneral, activation and
// DotProductAttention composed in Flax, with reshapes, a q/k/v split and
// residual adds between them).
//
// The value flowing between stages is a list of tensors: a module stage takes
// x (and its extra inputs, e.g. k and v) and gives y; a host step maps lists
// to lists on the client; Fork / Join wrap a residual connection. Apply
// chains the modules' forwards. ValueAndGrad keeps every module's forward on
// the server, computes vdot(y, dy) on the client, then runs the backwards in
// reverse with the glue's own backward on the client: jax.value_and_grad of
// the composed function. A Sequential is a configuration (thread-compatible);
// the variables live in the session.
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

// Client-side glue: a forward and the backward that maps the gradients of its
// outputs to the gradients of its inputs. Both must be pure functions.
struct HostStep {
  std::function<absl::StatusOr<Tensors>(const Tensors& inputs)> forward;
  std::function<absl::StatusOr<Tensors>(const Tensors& output_grads)> backward;
  // The same step as the server runs it (te.v1.SequentialSpec), when it has
  // one: then a chain of such steps can run on the server (ServerSequential).
  std::optional<te::v1::SequentialSpec::Stage> server_stage;
};

// Views one tensor's trailing dims `from` as `to` (same element count):
// ReshapeTrailing({3 * hidden}, {heads, 3 * head_dim}) is the quickstart's
// qkv.reshape(b, s, heads, 3 * kv_channels).
HostStep ReshapeTrailing(Shape from, Shape to);
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
  // (deterministic) to find it, as flax's init runs the module. Keys per
  // stage derive from `key`.
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

// A Sequential run by the server as one layer (te.v1.SequentialSpec): the
// tensors between its stages never leave the device, so a step is one call
// instead of one per module with every activation crossing the wire. Its
// variables are the same ("params/<stage>/...") and so are its numbers: the
// server derives each stage's seeds as Sequential does. Spec() answers
// UNIMPLEMENTED for a chain with a host step the server has no form of.
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
