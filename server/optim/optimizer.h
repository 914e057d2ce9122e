// Optimizers for a layer's parameters, as optax defines them: sgd (momentum,
// nesterov), adam, adamw, rmsprop (centered, momentum, nesterov), lion;
// optax's learning-rate schedules (constant, linear, cosine_decay,
// warmup_cosine_decay, exponential_decay, piecewise_constant, join);
// clip_by_global_norm; optax.chain of these and of clip, scale,
// add_decayed_weights and scale_by_learning_rate in any order; and the step
// skipped when a gradient is inf or NaN (apply_if_finite). The math is
// Ops::OptimizerStep (kernels/ops.h) and kernels/optimizer_math.h; this file
// resolves the request, lays out the state and keeps the step's plan.
//
// Contract:
//  1. ResolveOptimizer checks everything (a kind set, finite hyperparameters
//     in optax's ranges, valid schedules) and fills in optax's defaults;
//     its errors are INVALID_ARGUMENT naming the field under `field`. sgd,
//     adam and adamw, alone or as chain(clip_by_global_norm, one of them),
//     run as the fused rule (OptimizerUpdate's); everything else as the
//     chain of optax's primitive links it is made of.
//  2. The state is one Variables map, named like the collection the client
//     reads: "opt_state/count", "opt_state/total_notfinite" (int32 [1]) and
//     per parameter "opt_state/<state>/<path>" in the parameter's shape and
//     dtype, <state> as SetOptimizerResponse documents (service.proto):
//     "mu", "nu", "trace" for one optimizer, "<i>/mu" etc. for link i of a
//     chain. InitState makes it (optax's init: zeros, rmsprop's nu at
//     initial_scale).
//  3. Updater::Step writes params and state in place and issues work only
//     (no host sync, no allocation once planned): the global norm, the skip,
//     the clip, the learning rate and the counters are decided on the device
//     from the state's count. The caller decides when it may change the
//     layer (session.h, contract 2) and reads what happened with ReadInfo,
//     after the step's other results.
#ifndef TE_SERVER_OPTIM_OPTIMIZER_H_
#define TE_SERVER_OPTIM_OPTIMIZER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/optimizer_math.h"
#include "server/layers/layer.h"
#include "te/v1/service.pb.h"

namespace te::optim {

inline constexpr char kOptState[] = "opt_state";
inline constexpr char kCount[] = "opt_state/count";
inline constexpr char kTotalNotfinite[] = "opt_state/total_notfinite";

struct OptimizerConfig {
  // "sgd", "adam", "adamw", "rmsprop", "lion" or "chain".
  std::string kind;
  // What the device runs: the fused rule, or the chain's links.
  OptimizerHyperparams hyperparams;
  // The per-parameter state, "opt_state/<name>/<path>" starting at
  // initial_value: for the fused rule mu then nu as the slots take them
  // (sgd's trace is its mu), for a chain OptimizerSlot::state in order.
  struct State {
    std::string name;
    double initial_value = 0.0;
  };
  std::vector<State> state;
  const char* name() const { return kind.c_str(); }
  // The learning rate the steps report (the fused rule's, or the first
  // scale_by_learning_rate link's; 0 without one) at step `count`, float64.
  double LearningRateAt(int64_t count) const;
};

absl::StatusOr<OptimizerConfig> ResolveOptimizer(const te::v1::Optimizer& spec,
                                                 const std::string& field);

// The state's variables for these params ("params/<path>" -> tensor).
std::vector<layers::VariableSpec> StateSpecs(const OptimizerConfig& config,
                                             const layers::Variables& params);
// Zero moments and counters, allocated on `ops` (RESOURCE_EXHAUSTED past its
// memory limit).
absl::StatusOr<layers::Variables> InitState(Ops& ops, const OptimizerConfig& config,
                                            const layers::Variables& params);

// One layer's updates. Not thread-safe (a session's calls never overlap).
class Updater {
 public:
  // Queues one step: every "params/<path>" of `vars` with a gradient
  // "grads/<path>" in `grads` is updated in place, and its moments in
  // `state`; a parameter no gradient reached keeps its value and moments.
  // The norm is over every gradient given. The first step, and any after
  // the params or the state were replaced (SetVariables, a restore), makes
  // the plan (device tables, one upload); the others only launch.
  // INTERNAL when `state` lacks a variable StateSpecs names. `fp8_copies`
  // (by the param's storage, may be null): FP8 copies of params that the
  // step rewrites as it writes them (OptimizerSlot::fp8); a plan is made for
  // them as for the params, so the same copies step after step cost nothing
  // more to plan. `compute_copies` (the same way): the params' casts to
  // their compute dtype that the step rewrites (OptimizerSlot::compute_copy).
  absl::Status Step(Ops& ops, const OptimizerConfig& config, const layers::Variables& grads,
                    layers::Variables* vars, layers::Variables* state,
                    const std::map<const void*, OptimizerFp8Copy>* fp8_copies = nullptr,
                    const std::map<const void*, Tensor>* compute_copies = nullptr);
  // What the last Step did: one 24-byte copy from the device, which waits
  // for the step (so read it with the call's other results, once).
  // FAILED_PRECONDITION before any step.
  absl::StatusOr<OptimizerStepInfo> ReadInfo(Ops& ops) const;
  // The same record, copied into `dst` behind the work issued so far
  // (Ops::DownloadAsync): there once done->Wait() has returned OK.
  absl::Status ReadInfoAsync(Ops& ops, OptimizerStepInfo* dst, Ops::Completion* done) const;

 private:
  std::unique_ptr<OptimizerPlan> plan_;
};

}  // namespace te::optim

#endif  // TE_SERVER_OPTIM_OPTIMIZER_H_
