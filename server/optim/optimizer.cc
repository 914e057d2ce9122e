#include "server/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::optim {
namespace {

using Link = OptimizerLink;

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

// [0, 1]: an interpolation or decay rate without bias correction.
absl::Status RequireUnit(double v, const std::string& field) {
  RETURN_IF_ERROR(RequireFinite(v, field));
  if (!(v >= 0.0 && v <= 1.0)) return Invalid(field, absl::StrCat(v, " is outside [0, 1]"));
  return absl::OkStatus();
}

absl::Status RequireNonNegative(double v, const std::string& field) {
  RETURN_IF_ERROR(RequireFinite(v, field));
  if (v < 0.0) return Invalid(field, absl::StrCat(v, " is negative"));
  return absl::OkStatus();
}

// Builds an OptimizerConfig: the links, their state and their schedules.
class Builder {
 public:
  explicit Builder(OptimizerConfig* config) : c_(*config), h_(config->hyperparams) {}

  // A schedule's node in the table (its children before it).
  absl::StatusOr<int32_t> Schedule(const te::v1::LearningRate& lr, const std::string& field) {
    ScheduleNode n;
    switch (lr.kind_case()) {
      case te::v1::LearningRate::kConstant:
        RETURN_IF_ERROR(RequireFinite(lr.constant(), field + ".constant"));
        n.init_value = lr.constant();
        return AddNode(n, field);
      case te::v1::LearningRate::kWarmupCosineDecay:
        return WarmupCosine(lr.warmup_cosine_decay(), field + ".warmup_cosine_decay");
      case te::v1::LearningRate::kLinear: {
        const te::v1::LinearSchedule& l = lr.linear();
        const std::string f = field + ".linear";
        RETURN_IF_ERROR(RequireFinite(l.init_value(), f + ".init_value"));
        RETURN_IF_ERROR(RequireFinite(l.end_value(), f + ".end_value"));
        // optax: transition_steps <= 0 holds init_value, a negative
        // transition_begin counts as 0 (the evaluator does both).
        n.kind = ScheduleNode::Kind::kPolynomial;
        n.init_value = l.init_value();
        n.end_value = l.end_value();
        n.power = 1.0;
        n.steps = l.transition_steps();
        n.begin = l.transition_begin();
        return AddNode(n, field);
      }
      case te::v1::LearningRate::kCosineDecay: {
        const te::v1::CosineDecaySchedule& cd = lr.cosine_decay();
        const std::string f = field + ".cosine_decay";
        RETURN_IF_ERROR(RequireFinite(cd.init_value(), f + ".init_value"));
        RETURN_IF_ERROR(RequireFinite(cd.alpha(), f + ".alpha"));
        const double exponent = cd.has_exponent() ? cd.exponent() : 1.0;
        RETURN_IF_ERROR(RequireFinite(exponent, f + ".exponent"));
        if (cd.decay_steps() <= 0) {
          return Invalid(f + ".decay_steps", absl::StrCat(cd.decay_steps(), " is not positive"));
        }
        n.kind = ScheduleNode::Kind::kCosineDecay;
        n.init_value = cd.init_value();
        n.steps = cd.decay_steps();
        n.alpha = cd.alpha();
        n.power = exponent;
        return AddNode(n, field);
      }
      case te::v1::LearningRate::kExponentialDecay: {
        const te::v1::ExponentialDecaySchedule& e = lr.exponential_decay();
        const std::string f = field + ".exponential_decay";
        RETURN_IF_ERROR(RequireFinite(e.init_value(), f + ".init_value"));
        RETURN_IF_ERROR(RequireFinite(e.decay_rate(), f + ".decay_rate"));
        if (e.has_end_value()) RETURN_IF_ERROR(RequireFinite(e.end_value(), f + ".end_value"));
        // optax: transition_steps <= 0 or decay_rate 0 hold init_value, a
        // negative transition_begin counts as 0 (the evaluator does all three).
        n.kind = ScheduleNode::Kind::kExponentialDecay;
        n.init_value = e.init_value();
        n.steps = e.transition_steps();
        n.rate = e.decay_rate();
        n.begin = e.transition_begin();
        n.staircase = e.staircase() ? 1 : 0;
        n.has_end = e.has_end_value() ? 1 : 0;
        n.end_value = e.end_value();
        return AddNode(n, field);
      }
      case te::v1::LearningRate::kPiecewiseConstant: {
        const te::v1::PiecewiseConstantSchedule& pc = lr.piecewise_constant();
        const std::string f = field + ".piecewise_constant";
        RETURN_IF_ERROR(RequireFinite(pc.init_value(), f + ".init_value"));
        std::vector<ScheduleKnot> knots;
        std::set<int64_t> steps;
        for (int i = 0; i < pc.boundaries_and_scales_size(); ++i) {
          const auto& b = pc.boundaries_and_scales(i);
          const std::string fb = absl::StrCat(f, ".boundaries_and_scales[", i, "]");
          // optax wants non-negative scales; a dict has one per step.
          RETURN_IF_ERROR(RequireNonNegative(b.scale(), fb + ".scale"));
          if (!steps.insert(b.step()).second) {
            return Invalid(fb + ".step", absl::StrCat(b.step(), " is given twice"));
          }
          ScheduleKnot k;
          k.step = b.step();
          k.scale = b.scale();
          knots.push_back(k);
        }
        std::sort(knots.begin(), knots.end(),
                  [](const ScheduleKnot& a, const ScheduleKnot& b) { return a.step < b.step; });
        n.kind = ScheduleNode::Kind::kPiecewiseConstant;
        n.init_value = pc.init_value();
        ASSIGN_OR_RETURN(n.first, AddKnots(knots, f + ".boundaries_and_scales"));
        n.num = static_cast<int32_t>(knots.size());
        return AddNode(n, field);
      }
      case te::v1::LearningRate::kJoin: {
        const te::v1::JoinSchedules& j = lr.join();
        const std::string f = field + ".join";
        if (j.schedules_size() == 0) return Invalid(f + ".schedules", "empty; want one or more");
        if (j.boundaries_size() != j.schedules_size() - 1) {
          return Invalid(f + ".boundaries",
                         absl::StrCat(j.boundaries_size(), " boundaries for ", j.schedules_size(),
                                      " schedules; want one fewer"));
        }
        std::vector<ScheduleKnot> knots(j.schedules_size());
        for (int i = 0; i < j.schedules_size(); ++i) {
          ASSIGN_OR_RETURN(knots[i].node,
                           Schedule(j.schedules(i), absl::StrCat(f, ".schedules[", i, "]")));
          if (i > 0) knots[i].step = j.boundaries(i - 1);
        }
        n.kind = ScheduleNode::Kind::kJoin;
        ASSIGN_OR_RETURN(n.first, AddKnots(knots, f));
        n.num = static_cast<int32_t>(knots.size());
        return AddNode(n, field);
      }
      case te::v1::LearningRate::KIND_NOT_SET:
        break;
    }
    return Invalid(field,
                   "required: a constant or a schedule (warmup_cosine_decay, linear, "
                   "cosine_decay, exponential_decay, piecewise_constant, join)");
  }

  // One optimizer (or link of a chain), its state named under `prefix`.
  absl::Status Sgd(const te::v1::Sgd& s, const std::string& f, const std::string& prefix) {
    if (s.has_momentum()) RETURN_IF_ERROR(RequireFinite(s.momentum(), f + ".momentum"));
    if (s.nesterov() && !s.has_momentum()) {
      return Invalid(f + ".nesterov", "needs a momentum (optax's trace)");
    }
    ASSIGN_OR_RETURN(const int32_t lr, Schedule(s.learning_rate(), f + ".learning_rate"));
    if (s.has_momentum()) Trace(s.momentum(), s.nesterov(), prefix);
    LearningRateLink(lr);
    return absl::OkStatus();
  }

  // adam and adamw: b1, b2, eps, eps_root with optax's defaults, then the
  // decoupled weight decay (adamw's; 0 for adam), then the learning rate.
  template <typename AdamLike>
  absl::Status Adam(const AdamLike& a, double weight_decay, const std::string& f,
                    const std::string& prefix) {
    Link l;
    l.kind = Link::Kind::kScaleByAdam;
    l.b1 = a.has_b1() ? a.b1() : 0.9;
    l.b2 = a.has_b2() ? a.b2() : 0.999;
    l.eps = a.has_eps() ? a.eps() : 1e-8;
    l.eps_root = a.has_eps_root() ? a.eps_root() : 0.0;
    RETURN_IF_ERROR(RequireDecay(l.b1, f + ".b1"));
    RETURN_IF_ERROR(RequireDecay(l.b2, f + ".b2"));
    RETURN_IF_ERROR(RequireNonNegative(l.eps, f + ".eps"));
    RETURN_IF_ERROR(RequireNonNegative(l.eps_root, f + ".eps_root"));
    if (l.eps == 0.0 && l.eps_root == 0.0) {
      return Invalid(f + ".eps", "0 with eps_root 0 divides by zero where nu is 0");
    }
    RETURN_IF_ERROR(RequireFinite(weight_decay, f + ".weight_decay"));
    ASSIGN_OR_RETURN(const int32_t lr, Schedule(a.learning_rate(), f + ".learning_rate"));
    Stateful(l, {{prefix + "mu", 0.0}, {prefix + "nu", 0.0}});
    DecayedWeights(weight_decay);
    LearningRateLink(lr);
    return absl::OkStatus();
  }

  // optax.rmsprop: scale_by_rms (or scale_by_stddev when centered), the
  // learning rate, then trace(momentum) when a momentum is set.
  absl::Status Rmsprop(const te::v1::Rmsprop& r, const std::string& f, const std::string& prefix) {
    Link l;
    l.kind = r.centered() ? Link::Kind::kScaleByStddev : Link::Kind::kScaleByRms;
    l.b2 = r.has_decay() ? r.decay() : 0.9;
    l.eps = r.has_eps() ? r.eps() : 1e-8;
    l.flag = !r.has_eps_in_sqrt() || r.eps_in_sqrt() ? 1 : 0;
    RETURN_IF_ERROR(RequireUnit(l.b2, f + ".decay"));
    RETURN_IF_ERROR(RequireNonNegative(l.eps, f + ".eps"));
    // nu is a second moment: below 0 its root is NaN.
    RETURN_IF_ERROR(RequireNonNegative(r.initial_scale(), f + ".initial_scale"));
    if (l.eps == 0.0 && (r.initial_scale() == 0.0 || r.centered())) {
      return Invalid(f + ".eps", r.centered()
                                     ? "0 divides by zero where the variance is 0"
                                     : "0 with initial_scale 0 divides by zero where nu is 0");
    }
    if (r.has_momentum()) RETURN_IF_ERROR(RequireFinite(r.momentum(), f + ".momentum"));
    if (r.nesterov() && !r.has_momentum()) {
      return Invalid(f + ".nesterov", "needs a momentum (optax's trace)");
    }
    ASSIGN_OR_RETURN(const int32_t lr, Schedule(r.learning_rate(), f + ".learning_rate"));
    if (r.centered()) {
      Stateful(l, {{prefix + "mu", 0.0}, {prefix + "nu", r.initial_scale()}});
    } else {
      Stateful(l, {{prefix + "nu", r.initial_scale()}});
    }
    LearningRateLink(lr);
    if (r.has_momentum()) Trace(r.momentum(), r.nesterov(), prefix);
    return absl::OkStatus();
  }

  // optax.lion: scale_by_lion, add_decayed_weights, the learning rate.
  absl::Status Lion(const te::v1::Lion& a, const std::string& f, const std::string& prefix) {
    Link l;
    l.kind = Link::Kind::kScaleByLion;
    l.b1 = a.has_b1() ? a.b1() : 0.9;
    l.b2 = a.has_b2() ? a.b2() : 0.99;
    RETURN_IF_ERROR(RequireUnit(l.b1, f + ".b1"));
    RETURN_IF_ERROR(RequireUnit(l.b2, f + ".b2"));
    const double weight_decay = a.has_weight_decay() ? a.weight_decay() : 1e-3;
    RETURN_IF_ERROR(RequireFinite(weight_decay, f + ".weight_decay"));
    ASSIGN_OR_RETURN(const int32_t lr, Schedule(a.learning_rate(), f + ".learning_rate"));
    Stateful(l, {{prefix + "mu", 0.0}});
    DecayedWeights(weight_decay);
    LearningRateLink(lr);
    return absl::OkStatus();
  }

  absl::Status ClipByGlobalNorm(double max_norm, const std::string& f) {
    RETURN_IF_ERROR(RequireFinite(max_norm, f));
    if (max_norm <= 0.0) return Invalid(f, absl::StrCat(max_norm, " is not positive"));
    Link l;
    l.kind = Link::Kind::kClipByGlobalNorm;
    l.value = max_norm;
    links_.push_back(l);
    return absl::OkStatus();
  }

  // One link of a chain; its state named "<index>/...".
  absl::Status Transform(const te::v1::Transform& t, int index, const std::string& field) {
    const std::string prefix = absl::StrCat(index, "/");
    Link l;
    switch (t.kind_case()) {
      case te::v1::Transform::kSgd:
        return Sgd(t.sgd(), field + ".sgd", prefix);
      case te::v1::Transform::kAdam:
        return Adam(t.adam(), 0.0, field + ".adam", prefix);
      case te::v1::Transform::kAdamw:
        return Adam(t.adamw(), AdamWDecay(t.adamw()), field + ".adamw", prefix);
      case te::v1::Transform::kRmsprop:
        return Rmsprop(t.rmsprop(), field + ".rmsprop", prefix);
      case te::v1::Transform::kLion:
        return Lion(t.lion(), field + ".lion", prefix);
      case te::v1::Transform::kClipByGlobalNorm:
        return ClipByGlobalNorm(t.clip_by_global_norm(), field + ".clip_by_global_norm");
      case te::v1::Transform::kClip:
        RETURN_IF_ERROR(RequireNonNegative(t.clip(), field + ".clip"));
        l.kind = Link::Kind::kClip;
        l.value = t.clip();
        links_.push_back(l);
        return absl::OkStatus();
      case te::v1::Transform::kScale:
        RETURN_IF_ERROR(RequireFinite(t.scale(), field + ".scale"));
        l.kind = Link::Kind::kScale;
        l.value = t.scale();
        links_.push_back(l);
        return absl::OkStatus();
      case te::v1::Transform::kAddDecayedWeights:
        RETURN_IF_ERROR(RequireFinite(t.add_decayed_weights(), field + ".add_decayed_weights"));
        DecayedWeights(t.add_decayed_weights());
        return absl::OkStatus();
      case te::v1::Transform::kScaleByLearningRate: {
        ASSIGN_OR_RETURN(const int32_t lr,
                         Schedule(t.scale_by_learning_rate(), field + ".scale_by_learning_rate"));
        LearningRateLink(lr);
        return absl::OkStatus();
      }
      case te::v1::Transform::KIND_NOT_SET:
        break;
    }
    return Invalid(field,
                   "no transform (or one this server does not know); set one of sgd, adam, "
                   "adamw, rmsprop, lion, clip_by_global_norm, clip, scale, "
                   "add_decayed_weights, scale_by_learning_rate");
  }

  // The links as a chain on the device.
  absl::Status FinishChain(const std::string& field) {
    if (links_.size() > static_cast<size_t>(kMaxOptimizerLinks)) {
      return Invalid(field, absl::StrCat("runs as ", links_.size(),
                                         " of optax's primitive transformations; at most ",
                                         kMaxOptimizerLinks));
    }
    if (c_.state.size() > static_cast<size_t>(kMaxSlotState)) {
      return Invalid(field, absl::StrCat("keeps ", c_.state.size(),
                                         " state tensors per parameter; at most ", kMaxSlotState));
    }
    h_.num_links = static_cast<int32_t>(links_.size());
    h_.num_state = static_cast<int32_t>(c_.state.size());
    std::copy(links_.begin(), links_.end(), h_.links);
    h_.learning_rate = first_learning_rate_;
    return absl::OkStatus();
  }

  // The links as the fused rule: [clip_by_global_norm], then sgd's
  // [trace], scale_by_learning_rate or adam's scale_by_adam,
  // [add_decayed_weights], scale_by_learning_rate. The state stays in the
  // order built: sgd's trace (mu), adam's mu, nu.
  void FinishFused() {
    size_t k = 0;
    if (links_[k].kind == Link::Kind::kClipByGlobalNorm) h_.max_norm = links_[k++].value;
    if (links_[k].kind == Link::Kind::kScaleByAdam) {
      const Link& a = links_[k++];
      h_.rule = OptimizerUpdateArgs::Rule::kAdam;
      h_.b1 = a.b1;
      h_.b2 = a.b2;
      h_.eps = a.eps;
      h_.eps_root = a.eps_root;
      if (links_[k].kind == Link::Kind::kAddDecayedWeights) h_.weight_decay = links_[k++].value;
    } else {
      h_.rule = OptimizerUpdateArgs::Rule::kSgd;
      if (links_[k].kind == Link::Kind::kTrace) {
        h_.momentum = links_[k].b1;
        h_.nesterov = links_[k].flag != 0;
        ++k;
      }
    }
    h_.learning_rate = links_[k].schedule;
    h_.num_links = 0;
    h_.num_state = 0;
  }

  static double AdamWDecay(const te::v1::AdamW& a) {
    return a.has_weight_decay() ? a.weight_decay() : 1e-4;
  }

 private:
  absl::StatusOr<int32_t> AddNode(const ScheduleNode& n, const std::string& field) {
    const int32_t index = h_.schedules.Add(n);
    if (index < 0) {
      return Invalid(field, absl::StrCat("the optimizer's schedules take more than ",
                                         kMaxScheduleNodes, " nodes"));
    }
    return index;
  }
  absl::StatusOr<int32_t> AddKnots(const std::vector<ScheduleKnot>& knots,
                                   const std::string& field) {
    ScheduleTable& t = h_.schedules;
    if (t.num_knots + static_cast<int64_t>(knots.size()) > kMaxScheduleKnots) {
      return Invalid(field, absl::StrCat("the optimizer's schedules take more than ",
                                         kMaxScheduleKnots, " boundaries"));
    }
    const int32_t first = t.num_knots;
    for (const ScheduleKnot& k : knots) t.knots[t.num_knots++] = k;
    return first;
  }
  // optax.warmup_cosine_decay_schedule: join_schedules([linear(init, peak,
  // warmup_steps), cosine_decay(peak, decay_steps - warmup_steps,
  // end / peak, exponent)], [warmup_steps]).
  absl::StatusOr<int32_t> WarmupCosine(const te::v1::WarmupCosineDecaySchedule& w,
                                       const std::string& f) {
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
                     absl::StrCat(w.decay_steps(), " is not above warmup_steps (", w.warmup_steps(),
                                  "): it counts the warmup too"));
    }
    ScheduleNode warmup;
    warmup.kind = ScheduleNode::Kind::kPolynomial;
    warmup.init_value = w.init_value();
    warmup.end_value = w.peak_value();
    warmup.power = 1.0;
    warmup.steps = w.warmup_steps();
    ScheduleNode cosine;
    cosine.kind = ScheduleNode::Kind::kCosineDecay;
    cosine.init_value = w.peak_value();
    cosine.steps = w.decay_steps() - w.warmup_steps();
    cosine.alpha = w.peak_value() == 0.0 ? 0.0 : w.end_value() / w.peak_value();
    cosine.power = exponent;
    std::vector<ScheduleKnot> knots(2);
    ASSIGN_OR_RETURN(knots[0].node, AddNode(warmup, f));
    ASSIGN_OR_RETURN(knots[1].node, AddNode(cosine, f));
    knots[1].step = w.warmup_steps();
    ScheduleNode join;
    join.kind = ScheduleNode::Kind::kJoin;
    ASSIGN_OR_RETURN(join.first, AddKnots(knots, f));
    join.num = 2;
    return AddNode(join, f);
  }
  void Stateful(Link l, std::vector<OptimizerConfig::State> state) {
    l.state = static_cast<int32_t>(c_.state.size());
    for (OptimizerConfig::State& s : state) c_.state.push_back(std::move(s));
    links_.push_back(l);
  }
  void Trace(double momentum, bool nesterov, const std::string& prefix) {
    Link l;
    l.kind = Link::Kind::kTrace;
    l.b1 = momentum;
    l.flag = nesterov ? 1 : 0;
    Stateful(l, {{prefix + "trace", 0.0}});
  }
  // optax skips add_decayed_weights with a constant 0.
  void DecayedWeights(double weight_decay) {
    if (weight_decay == 0.0) return;
    Link l;
    l.kind = Link::Kind::kAddDecayedWeights;
    l.value = weight_decay;
    links_.push_back(l);
  }
  void LearningRateLink(int32_t schedule) {
    Link l;
    l.kind = Link::Kind::kScaleByLearningRate;
    l.schedule = schedule;
    links_.push_back(l);
    if (first_learning_rate_ < 0) first_learning_rate_ = schedule;
  }

  OptimizerConfig& c_;
  OptimizerHyperparams& h_;
  std::vector<Link> links_;
  int32_t first_learning_rate_ = -1;
};

// True for the optimizers the fused rule runs: sgd, adam, adamw.
bool Fusable(const te::v1::Transform& t) { return t.has_sgd() || t.has_adam() || t.has_adamw(); }

// "params/<path>" -> "opt_state/<state>/<path>".
std::string StateName(const std::string& state, const std::string& param_name) {
  return absl::StrCat(kOptState, "/", state, param_name.substr(param_name.find('/')));
}

bool IsParam(const std::string& name) { return absl::StartsWith(name, "params/"); }

}  // namespace

double OptimizerConfig::LearningRateAt(int64_t count) const {
  return te::LearningRateAt(hyperparams.schedules, hyperparams.learning_rate, count);
}

absl::StatusOr<OptimizerConfig> ResolveOptimizer(const te::v1::Optimizer& spec,
                                                 const std::string& field) {
  OptimizerConfig c;
  Builder b(&c);
  if (spec.chain_size() > 0) {
    if (spec.kind_case() != te::v1::Optimizer::KIND_NOT_SET) {
      return Invalid(field + ".chain", "set with another optimizer; a chain stands alone");
    }
    if (spec.has_clip_by_global_norm()) {
      return Invalid(field + ".clip_by_global_norm",
                     "set with a chain; put optax.clip_by_global_norm in the chain");
    }
    c.kind = "chain";
    for (int i = 0; i < spec.chain_size(); ++i) {
      RETURN_IF_ERROR(b.Transform(spec.chain(i), i, absl::StrCat(field, ".chain[", i, "]")));
    }
    // chain(clip_by_global_norm, sgd | adam | adamw) or one of them alone is
    // the fused rule; its state keeps the chain's names.
    const int n = spec.chain_size();
    const bool fused =
        (n == 1 && Fusable(spec.chain(0))) ||
        (n == 2 && spec.chain(0).has_clip_by_global_norm() && Fusable(spec.chain(1)));
    if (fused) {
      b.FinishFused();
      return c;
    }
    RETURN_IF_ERROR(b.FinishChain(field + ".chain"));
    return c;
  }
  if (spec.has_clip_by_global_norm()) {
    RETURN_IF_ERROR(b.ClipByGlobalNorm(spec.clip_by_global_norm(), field + ".clip_by_global_norm"));
  }
  switch (spec.kind_case()) {
    case te::v1::Optimizer::kSgd:
      c.kind = "sgd";
      RETURN_IF_ERROR(b.Sgd(spec.sgd(), field + ".sgd", ""));
      b.FinishFused();
      return c;
    case te::v1::Optimizer::kAdam:
      c.kind = "adam";
      RETURN_IF_ERROR(b.Adam(spec.adam(), 0.0, field + ".adam", ""));
      b.FinishFused();
      return c;
    case te::v1::Optimizer::kAdamw:
      c.kind = "adamw";
      RETURN_IF_ERROR(
          b.Adam(spec.adamw(), Builder::AdamWDecay(spec.adamw()), field + ".adamw", ""));
      b.FinishFused();
      return c;
    case te::v1::Optimizer::kRmsprop:
      c.kind = "rmsprop";
      RETURN_IF_ERROR(b.Rmsprop(spec.rmsprop(), field + ".rmsprop", ""));
      RETURN_IF_ERROR(b.FinishChain(field));
      return c;
    case te::v1::Optimizer::kLion:
      c.kind = "lion";
      RETURN_IF_ERROR(b.Lion(spec.lion(), field + ".lion", ""));
      RETURN_IF_ERROR(b.FinishChain(field));
      return c;
    case te::v1::Optimizer::KIND_NOT_SET:
      break;
  }
  return Invalid(field,
                 "no optimizer (or one this server does not know); set one of sgd, "
                 "adam, adamw, rmsprop, lion, or a chain");
}

std::vector<layers::VariableSpec> StateSpecs(const OptimizerConfig& config,
                                             const layers::Variables& params) {
  std::vector<layers::VariableSpec> specs = {{kCount, {1}, DType::kI32},
                                             {kTotalNotfinite, {1}, DType::kI32}};
  for (const OptimizerConfig::State& state : config.state) {
    for (const auto& [name, param] : params) {
      if (IsParam(name)) {
        specs.push_back({StateName(state.name, name), param.shape(), param.dtype()});
      }
    }
  }
  return specs;
}

absl::StatusOr<layers::Variables> InitState(Ops& ops, const OptimizerConfig& config,
                                            const layers::Variables& params) {
  layers::Variables state;
  auto add = [&](const std::string& name, DType dtype, const Shape& shape,
                 double value) -> absl::Status {
    ASSIGN_OR_RETURN(Tensor t, ops.Allocate(dtype, shape));
    if (dtype == DType::kI32) {
      const int32_t zero = 0;
      RETURN_IF_ERROR(ops.Upload(&zero, &t));
    } else if (t.numel() > 0) {
      RETURN_IF_ERROR(ops.Fill(static_cast<float>(value), &t));
    }
    state[name] = std::move(t);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(add(kCount, DType::kI32, {1}, 0.0));
  RETURN_IF_ERROR(add(kTotalNotfinite, DType::kI32, {1}, 0.0));
  for (const OptimizerConfig::State& s : config.state) {
    for (const auto& [name, param] : params) {
      if (!IsParam(name)) continue;
      RETURN_IF_ERROR(add(StateName(s.name, name), param.dtype(), param.shape(), s.initial_value));
    }
  }
  return state;
}

absl::Status Updater::Step(Ops& ops, const OptimizerConfig& config, const layers::Variables& grads,
                           layers::Variables* vars, layers::Variables* state,
                           const std::map<const void*, OptimizerFp8Copy>* fp8_copies,
                           const std::map<const void*, Tensor>* compute_copies) {
  auto find = [&](const std::string& name) -> absl::StatusOr<Tensor*> {
    auto it = state->find(name);
    if (it == state->end()) {
      return absl::InternalError(absl::StrCat(name, ": missing from the optimizer's state"));
    }
    return &it->second;
  };
  const bool chain = config.hyperparams.num_links > 0;
  std::vector<OptimizerSlot> slots;
  std::vector<Tensor> slot_grads;
  for (const auto& [name, param] : *vars) {
    if (!IsParam(name)) continue;
    OptimizerSlot slot;
    slot.param = param;
    for (size_t j = 0; j < config.state.size(); ++j) {
      ASSIGN_OR_RETURN(Tensor * t, find(StateName(config.state[j].name, name)));
      if (chain) {
        slot.state.push_back(*t);
      } else {
        (j == 0 ? slot.mu : slot.nu) = *t;
      }
    }
    if (fp8_copies != nullptr) {
      auto copy = fp8_copies->find(param.data());
      if (copy != fp8_copies->end()) slot.fp8 = copy->second;
    }
    if (compute_copies != nullptr) {
      auto copy = compute_copies->find(param.data());
      if (copy != compute_copies->end()) slot.compute_copy = copy->second;
    }
    auto grad = grads.find(absl::StrCat("grads", name.substr(name.find('/'))));
    slot_grads.push_back(grad == grads.end() ? Tensor() : grad->second);
    slots.push_back(std::move(slot));
  }
  ASSIGN_OR_RETURN(Tensor * count, find(kCount));
  ASSIGN_OR_RETURN(Tensor * total_notfinite, find(kTotalNotfinite));
  if (plan_ == nullptr || !plan_->Matches(slots, *count, *total_notfinite)) {
    plan_.reset();
    ASSIGN_OR_RETURN(plan_,
                     ops.NewOptimizerPlan(config.hyperparams, slots, *count, *total_notfinite));
  }
  // The params change in place: a copy derived from them is current after
  // this only if it was among fp8_copies or compute_copies (the caller drops
  // the others).
  return ops.OptimizerStep(*plan_, slots, slot_grads, count, total_notfinite);
}

absl::StatusOr<OptimizerStepInfo> Updater::ReadInfo(Ops& ops) const {
  if (plan_ == nullptr) return absl::FailedPreconditionError("no optimizer step has run");
  OptimizerStepInfo info;
  RETURN_IF_ERROR(ops.Download(plan_->info(), &info));
  return info;
}

absl::Status Updater::ReadInfoAsync(Ops& ops, OptimizerStepInfo* dst, Ops::Completion* done) const {
  if (plan_ == nullptr) return absl::FailedPreconditionError("no optimizer step has run");
  return ops.DownloadAsync(plan_->info(), dst, done);
}

}  // namespace te::optim
