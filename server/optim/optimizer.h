// Optimizers for a layer's parameters, as optax defines them: sgd (momentum,
// nesterov), adam, adamw; learning rates constant or
// warmup_cosine_decay_schedule; clip_by_global_norm; and the step skipped
// when a gradient is inf or NaN (apply_if_finite). The elementwise math is
// Ops::OptimizerUpdate (kernels/ops.h); this file resolves the request,
// evaluates the step's scalars on the host, and lays out the state.
//
// Contract:
//  1. ResolveOptimizer checks everything (a kind set, finite hyperparameters
//     in optax's ranges, a valid schedule) and fills in optax's defaults;
//     its errors are INVALID_ARGUMENT naming the field under `field`.
//  2. The state is one Variables map, named like the collection the client
//     reads: "opt_state/count", "opt_state/total_notfinite" (int32 [1]) and
//     per parameter "opt_state/{mu,nu,trace}/<path>" in the parameter's
//     shape and dtype. InitState makes it (zeros: optax's init).
//  3. Update writes params and state in place and issues work only (no host
//     sync): the caller decides when it may change the layer (session.h,
//     contract 2) and reads GradNormSquared afterwards for what happened.
#ifndef TE_SERVER_OPTIM_OPTIMIZER_H_
#define TE_SERVER_OPTIM_OPTIMIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "te/v1/service.pb.h"

namespace te::optim {

inline constexpr char kOptState[] = "opt_state";
inline constexpr char kCount[] = "opt_state/count";
inline constexpr char kTotalNotfinite[] = "opt_state/total_notfinite";

// optax's constant learning rate or warmup_cosine_decay_schedule.
struct Schedule {
  bool warmup_cosine = false;
  double value = 0.0;  // constant
  double init_value = 0.0, peak_value = 0.0, end_value = 0.0, exponent = 1.0;
  int64_t warmup_steps = 0, decay_steps = 0;
  // The learning rate at step `count` (0 for the first update), in float64.
  double At(int64_t count) const;
};

struct OptimizerConfig {
  enum class Kind { kSgd, kAdam, kAdamW };
  Kind kind = Kind::kSgd;
  Schedule learning_rate;
  std::optional<double> momentum;  // sgd; none: no trace
  bool nesterov = false;
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  double weight_decay = 0.0;        // adamw only (1e-4 by default there)
  std::optional<double> max_norm;   // clip_by_global_norm
  const char* name() const;         // "sgd", "adam", "adamw"
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

// sum over `grads` of sum(g^2), f32 [1] on the device (optax.global_norm
// squared), float32 accumulation.
absl::StatusOr<Tensor> GradNormSquared(Ops& ops, const layers::Variables& grads);

// One step at `count` (the state's count before it): every "params/<path>"
// with a gradient "grads/<path>" in `grads` is updated in place in `vars`, and
// its moments in `state`. The kernels skip themselves when grad_norm_sq is not
// finite; the counters are the caller's (they are host-side decisions).
absl::Status Update(Ops& ops, const OptimizerConfig& config, int64_t count,
                    const layers::Variables& grads, const Tensor& grad_norm_sq,
                    layers::Variables* vars, layers::Variables* state);

// The scalars the kernels get for the step after `count` steps.
OptimizerUpdateArgs StepArgs(const OptimizerConfig& config, int64_t count);

}  // namespace te::optim

#endif  // TE_SERVER_OPTIM_OPTIMIZER_H_
