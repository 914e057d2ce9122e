#include "server/optim/optimizer.h"

#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::optim {
namespace {

constexpr double kPi = 3.14159265358979323846;

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

double Schedule::At(int64_t count) const {
  if (!warmup_cosine) return value;
  const double step = static_cast<double>(count);
  if (step < static_cast<double>(warmup_steps)) {
    // optax.linear_schedule(init_value, peak_value, warmup_steps).
    const double frac = 1.0 - step / static_cast<double>(warmup_steps);
    return (init_value - peak_value) * frac + peak_value;
  }
  // optax.cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent).
  const double span = static_cast<double>(decay_steps - warmup_steps);
  const double t = std::min(step - static_cast<double>(warmup_steps), span);
  const double alpha = peak_value == 0.0 ? 0.0 : end_value / peak_value;
  const double cosine = 0.5 * (1.0 + std::cos(kPi * t / span));
  return peak_value * ((1.0 - alpha) * std::pow(cosine, exponent) + alpha);
}

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

absl::StatusOr<Tensor> GradNormSquared(Ops& ops, const layers::Variables& grads) {
  ASSIGN_OR_RETURN(Tensor sum, ops.Allocate(DType::kF32, {1}));
  RETURN_IF_ERROR(ops.Fill(0.0f, &sum));
  ASSIGN_OR_RETURN(Tensor part, ops.Allocate(DType::kF32, {1}));
  for (const auto& [name, grad] : grads) {
    if (grad.numel() == 0) continue;
    RETURN_IF_ERROR(ops.Dot(grad, grad, &part));
    RETURN_IF_ERROR(ops.Axpby(1.0f, sum, 1.0f, part, &sum));
  }
  return sum;
}

OptimizerUpdateArgs StepArgs(const OptimizerConfig& config, int64_t count) {
  OptimizerUpdateArgs args;
  args.learning_rate = static_cast<float>(config.learning_rate.At(count));
  if (config.kind == OptimizerConfig::Kind::kSgd) {
    args.rule = OptimizerUpdateArgs::Rule::kSgd;
    args.momentum = static_cast<float>(config.momentum.value_or(0.0));
    args.nesterov = config.nesterov;
  } else {
    // optax's bias correction uses the count after this step.
    const double t = static_cast<double>(count) + 1.0;
    args.rule = OptimizerUpdateArgs::Rule::kAdam;
    args.b1 = static_cast<float>(config.b1);
    args.b2 = static_cast<float>(config.b2);
    args.eps = static_cast<float>(config.eps);
    args.eps_root = static_cast<float>(config.eps_root);
    args.bias_correction1 = static_cast<float>(1.0 - std::pow(config.b1, t));
    args.bias_correction2 = static_cast<float>(1.0 - std::pow(config.b2, t));
    args.weight_decay = static_cast<float>(config.weight_decay);
  }
  args.max_norm = static_cast<float>(config.max_norm.value_or(0.0));
  return args;
}

absl::Status Update(Ops& ops, const OptimizerConfig& config, int64_t count,
                    const layers::Variables& grads, const Tensor& grad_norm_sq,
                    layers::Variables* vars, layers::Variables* state) {
  const OptimizerUpdateArgs args = StepArgs(config, count);
  const bool adam = config.kind != OptimizerConfig::Kind::kSgd;
  for (auto& [name, param] : *vars) {
    if (!IsParam(name)) continue;
    // A parameter no gradient reached keeps its value and its moments.
    auto grad = grads.find(absl::StrCat("grads", name.substr(name.find('/'))));
    if (grad == grads.end()) continue;
    Tensor* mu = nullptr;
    Tensor* nu = nullptr;
    // A named copy: C++17 lambdas may not capture a structured binding (clang refuses).
    const std::string& param_name = name;
    auto find = [&](const char* moment) -> absl::StatusOr<Tensor*> {
      auto it = state->find(StateName(moment, param_name));
      if (it == state->end()) {
        return absl::InternalError(absl::StrCat(StateName(moment, param_name), ": missing from the state"));
      }
      return &it->second;
    };
    if (adam) {
      ASSIGN_OR_RETURN(mu, find("mu"));
      ASSIGN_OR_RETURN(nu, find("nu"));
    } else if (config.momentum) {
      ASSIGN_OR_RETURN(mu, find("trace"));
    }
    RETURN_IF_ERROR(ops.OptimizerUpdate(args, grad->second, grad_norm_sq, &param, mu, nu));
  }
  return absl::OkStatus();
}

}  // namespace te::optim
