#include "server/optim/optimizer.h"

#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::optim {
namespace {

absl::Status Invalid(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

absl::Status RequireFinite(double v, const std::string& field) {
  if (!std::isfinite(v)) return Invalid(field, absl::StrCat(v, " is not a finite number"));
  return absl::OkStatus();
}

// [0, 1): a decay rate whose bias correction 1 - b^t is never zero.
absl::Status RequireDecay(double v, const std::string& field) {
  RETURN_IF_ERROR(RequireFinite(v, field));
  if (!(v >= 0.0 && v < 1.0)) return Invalid(field, absl::StrCat(v, " is outside [0, 1)"));
  return absl::OkStatus();
}

absl::Status RequireNonNegative(double v, const std::string& field) {
  RETURN_IF_ERROR(RequireFinite(v, field));
  if (v < 0.0) return Invalid(field, absl::StrCat(v, " is negative"));
  return absl::OkStatus();
}

absl::StatusOr<Schedule> ResolveSchedule(const te::v1::LearningRate& lr, const std::string& field) {
  Schedule s;
  switch (lr.kind_case()) {
    case te::v1::LearningRate::kConstant:
      RETURN_IF_ERROR(RequireFinite(lr.constant(), field + ".constant"));
      s.value = lr.constant();
      return s;
    case te::v1::LearningRate::kWarmupCosineDecay: {
      const te::v1::WarmupCosineDecaySchedule& w = lr.warmup_cosine_decay();
      const std::string f = field + ".warmup_cosine_decay";
      RETURN_IF_ERROR(RequireFinite(w.init_value(), f + ".init_value"));
      RETURN_IF_ERROR(RequireFinite(w.peak_value(), f + ".peak_value"));
      RETURN_IF_ERROR(RequireFinite(w.end_value(), f + ".end_value"));
      const double exponent = w.has_exponent() ? w.exponent() : 1.0;
      RETURN_IF_ERROR(RequireFinite(exponent, f + ".exponent"));
      if (w.warmup_steps() < 0) {
        return Invalid(f + ".warmup_steps", absl::StrCat(w.warmup_steps(), " is negative"));
      }
      // optax's cosine_decay_schedule wants decay_steps - warmup_steps > 0.
      if (w.decay_steps() <= w.warmup_steps()) {
        return Invalid(f + ".decay_steps",
                       absl::StrCat(w.decay_steps(), " is not above warmup_steps (",
                                    w.warmup_steps(), "): it counts the warmup too"));
      }
      s.warmup_cosine = true;
      s.init_value = w.init_value();
      s.peak_value = w.peak_value();
      s.end_value = w.end_value();
      s.exponent = exponent;
      s.warmup_steps = w.warmup_steps();
      s.decay_steps = w.decay_steps();
      return s;
    }
    default:
      return Invalid(field, "required: a constant or a warmup_cosine_decay schedule");
  }
}

// b1, b2, eps, eps_root of adam and adamw, with optax's defaults.
template <typename AdamLike>
absl::Status ResolveAdam(const AdamLike& a, const std::string& field, OptimizerConfig* c) {
  c->b1 = a.has_b1() ? a.b1() : 0.9;
  c->b2 = a.has_b2() ? a.b2() : 0.999;
  c->eps = a.has_eps() ? a.eps() : 1e-8;
  c->eps_root = a.has_eps_root() ? a.eps_root() : 0.0;
  RETURN_IF_ERROR(RequireDecay(c->b1, field + ".b1"));
  RETURN_IF_ERROR(RequireDecay(c->b2, field + ".b2"));
  RETURN_IF_ERROR(RequireNonNegative(c->eps, field + ".eps"));
  RETURN_IF_ERROR(RequireNonNegative(c->eps_root, field + ".eps_root"));
  if (c->eps == 0.0 && c->eps_root == 0.0) {
    return Invalid(field + ".eps", "0 with eps_root 0 divides by zero where nu is 0");
  }
  ASSIGN_OR_RETURN(c->learning_rate, ResolveSchedule(a.learning_rate(), field + ".learning_rate"));
  return absl::OkStatus();
}

// "params/<path>" -> "<prefix>/<path>" under opt_state.
std::string StateName(const char* moment, const std::string& param_name) {
  return absl::StrCat(kOptState, "/", moment, param_name.substr(param_name.find('/')));
}

bool IsParam(const std::string& name) { return absl::StartsWith(name, "params/"); }

}  // namespace

const char* OptimizerConfig::name() const {
  switch (kind) {
    case Kind::kSgd: return "sgd";
    case Kind::kAdam: return "adam";
    case Kind::kAdamW: return "adamw";
  }
  return "unknown";
}

absl::StatusOr<OptimizerConfig> ResolveOptimizer(const te::v1::Optimizer& spec,
                                                 const std::string& field) {
  OptimizerConfig c;
  switch (spec.kind_case()) {
    case te::v1::Optimizer::kSgd: {
      const std::string f = field + ".sgd";
      c.kind = OptimizerConfig::Kind::kSgd;
      if (spec.sgd().has_momentum()) {
        RETURN_IF_ERROR(RequireFinite(spec.sgd().momentum(), f + ".momentum"));
        c.momentum = spec.sgd().momentum();
      }
      if (spec.sgd().nesterov() && !c.momentum) {
        return Invalid(f + ".nesterov", "needs a momentum (optax's trace)");
      }
      c.nesterov = spec.sgd().nesterov();
      ASSIGN_OR_RETURN(c.learning_rate,
                       ResolveSchedule(spec.sgd().learning_rate(), f + ".learning_rate"));
      break;
    }
    case te::v1::Optimizer::kAdam:
      c.kind = OptimizerConfig::Kind::kAdam;
      RETURN_IF_ERROR(ResolveAdam(spec.adam(), field + ".adam", &c));
      break;
    case te::v1::Optimizer::kAdamw:
      c.kind = OptimizerConfig::Kind::kAdamW;
      RETURN_IF_ERROR(ResolveAdam(spec.adamw(), field + ".adamw", &c));
      c.weight_decay = spec.adamw().has_weight_decay() ? spec.adamw().weight_decay() : 1e-4;
      RETURN_IF_ERROR(RequireFinite(c.weight_decay, field + ".adamw.weight_decay"));
      break;
    default:
      return Invalid(field, "no optimizer (or one this server does not know); set one of sgd, "
                            "adam, adamw");
  }
  if (spec.has_clip_by_global_norm()) {
    const double max_norm = spec.clip_by_global_norm();
    RETURN_IF_ERROR(RequireFinite(max_norm, field + ".clip_by_global_norm"));
    if (max_norm <= 0.0) {
      return Invalid(field + ".clip_by_global_norm", absl::StrCat(max_norm, " is not positive"));
    }
    c.max_norm = max_norm;
  }
  return c;
}

std::vector<layers::VariableSpec> StateSpecs(const OptimizerConfig& config,
                                             const layers::Variables& params) {
  std::vector<layers::VariableSpec> specs = {{kCount, {1}, DType::kI32},
                                             {kTotalNotfinite, {1}, DType::kI32}};
  std::vector<const char*> moments;
  if (config.kind == OptimizerConfig::Kind::kSgd) {
    if (config.momentum) moments = {"trace"};
  } else {
    moments = {"mu", "nu"};
  }
  for (const char* moment : moments) {
    for (const auto& [name, param] : params) {
      if (IsParam(name)) specs.push_back({StateName(moment, name), param.shape(), param.dtype()});
    }
  }
  return specs;
}

absl::StatusOr<layers::Variables> InitState(Ops& ops, const OptimizerConfig& config,
                                            const layers::Variables& params) {
  layers::Variables state;
  for (const layers::VariableSpec& spec : StateSpecs(config, params)) {
    ASSIGN_OR_RETURN(Tensor t, ops.Allocate(spec.dtype, spec.shape));
    if (spec.dtype == DType::kI32) {
      const int32_t zero = 0;
      RETURN_IF_ERROR(ops.Upload(&zero, &t));
    } else if (t.numel() > 0) {
      RETURN_IF_ERROR(ops.Fill(0.0f, &t));
    }
    state[spec.name] = std::move(t);
  }
  return state;
}

OptimizerHyperparams Hyperparams(const OptimizerConfig& config) {
  OptimizerHyperparams h;
  h.rule = config.kind == OptimizerConfig::Kind::kSgd ? OptimizerUpdateArgs::Rule::kSgd
                                                      : OptimizerUpdateArgs::Rule::kAdam;
  h.learning_rate = config.learning_rate;
  h.momentum = config.momentum.value_or(0.0);
  h.nesterov = config.nesterov;
  h.b1 = config.b1;
  h.b2 = config.b2;
  h.eps = config.eps;
  h.eps_root = config.eps_root;
  h.weight_decay = config.kind == OptimizerConfig::Kind::kSgd ? 0.0 : config.weight_decay;
  h.max_norm = config.max_norm.value_or(0.0);
  return h;
}

absl::Status Updater::Step(Ops& ops, const OptimizerConfig& config, const layers::Variables& grads,
                           layers::Variables* vars, layers::Variables* state,
                           const std::map<const void*, OptimizerFp8Copy>* fp8_copies) {
  auto find = [&](const std::string& name) -> absl::StatusOr<Tensor*> {
    auto it = state->find(name);
    if (it == state->end()) {
      return absl::InternalError(absl::StrCat(name, ": missing from the optimizer's state"));
    }
    return &it->second;
  };
  const bool adam = config.kind != OptimizerConfig::Kind::kSgd;
  std::vector<OptimizerSlot> slots;
  std::vector<Tensor> slot_grads;
  for (const auto& [name, param] : *vars) {
    if (!IsParam(name)) continue;
    OptimizerSlot slot;
    slot.param = param;
    if (adam) {
      ASSIGN_OR_RETURN(Tensor * mu, find(StateName("mu", name)));
      ASSIGN_OR_RETURN(Tensor * nu, find(StateName("nu", name)));
      slot.mu = *mu;
      slot.nu = *nu;
    } else if (config.momentum) {
      ASSIGN_OR_RETURN(Tensor * trace, find(StateName("trace", name)));
      slot.mu = *trace;
    }
    if (fp8_copies != nullptr) {
      auto copy = fp8_copies->find(param.data());
      if (copy != fp8_copies->end()) slot.fp8 = copy->second;
    }
    auto grad = grads.find(absl::StrCat("grads", name.substr(name.find('/'))));
    slot_grads.push_back(grad == grads.end() ? Tensor() : grad->second);
    slots.push_back(std::move(slot));
  }
  ASSIGN_OR_RETURN(Tensor * count, find(kCount));
  ASSIGN_OR_RETURN(Tensor * total_notfinite, find(kTotalNotfinite));
  if (plan_ == nullptr || !plan_->Matches(slots, *count, *total_notfinite)) {
    plan_.reset();
    ASSIGN_OR_RETURN(plan_, ops.NewOptimizerPlan(Hyperparams(config), slots, *count,
                                                 *total_notfinite));
  }
  // The params change in place: a copy derived from them is current after
  // this only if it was among fp8_copies (the caller drops the others).
  return ops.OptimizerStep(*plan_, slots, slot_grads, count, total_notfinite);
}

absl::StatusOr<OptimizerStepInfo> Updater::ReadInfo(Ops& ops) const {
  if (plan_ == nullptr) return absl::FailedPreconditionError("no optimizer step has run");
  OptimizerStepInfo info;
  RETURN_IF_ERROR(ops.Download(plan_->info(), &info));
  return info;
}

}  // namespace te::optim
