// rmsprop, lion, every optax schedule and optax.chain in several orders,
// through ResolveOptimizer and Updater on the CPU backend, against optax's
// math written out here in float64 (the reference knows nothing of the
// server's links: it follows optax's alias and transform definitions).
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "server/optim/optimizer.h"

namespace te::optim {
namespace {

// A step's change of the params and the state after it, float32 kernels
// against float64, relative (root mean square over the tensor).
constexpr double kUpdateTolerance = 2e-5;
// Schedules are float64 on both sides.
constexpr double kScheduleTolerance = 1e-12;

using v1Lr = te::v1::LearningRate;

// ---- the float64 reference ---------------------------------------------------------

double RefSchedule(const v1Lr& lr, int64_t count) {
  const double pi = std::acos(-1.0);
  const double step = static_cast<double>(count);
  switch (lr.kind_case()) {
    case v1Lr::kConstant:
      return lr.constant();
    case v1Lr::kLinear: {
      const auto& l = lr.linear();
      if (l.transition_steps() <= 0) return l.init_value();
      const double begin = std::max<int64_t>(l.transition_begin(), 0);
      const double c = std::clamp(step - begin, 0.0, double(l.transition_steps()));
      const double frac = 1 - c / l.transition_steps();
      return (l.init_value() - l.end_value()) * frac + l.end_value();
    }
    case v1Lr::kCosineDecay: {
      const auto& c = lr.cosine_decay();
      const double t = std::min<double>(step, c.decay_steps());
      const double cosine = 0.5 * (1 + std::cos(pi * t / c.decay_steps()));
      const double exponent = c.has_exponent() ? c.exponent() : 1.0;
      return c.init_value() * ((1 - c.alpha()) * std::pow(cosine, exponent) + c.alpha());
    }
    case v1Lr::kWarmupCosineDecay: {
      // optax: join_schedules([linear, cosine_decay], [warmup_steps]).
      const auto& w = lr.warmup_cosine_decay();
      v1Lr joined;
      auto* j = joined.mutable_join();
      auto* warm = j->add_schedules()->mutable_linear();
      warm->set_init_value(w.init_value());
      warm->set_end_value(w.peak_value());
      warm->set_transition_steps(w.warmup_steps());
      auto* cos = j->add_schedules()->mutable_cosine_decay();
      cos->set_init_value(w.peak_value());
      cos->set_decay_steps(w.decay_steps() - w.warmup_steps());
      cos->set_alpha(w.peak_value() == 0 ? 0 : w.end_value() / w.peak_value());
      cos->set_exponent(w.has_exponent() ? w.exponent() : 1.0);
      j->add_boundaries(w.warmup_steps());
      return RefSchedule(joined, count);
    }
    case v1Lr::kExponentialDecay: {
      const auto& e = lr.exponential_decay();
      if (e.transition_steps() <= 0 || e.decay_rate() == 0) return e.init_value();
      const double decreased = step - std::max<int64_t>(e.transition_begin(), 0);
      double p = decreased / e.transition_steps();
      if (e.staircase()) p = std::floor(p);
      double v = decreased <= 0 ? e.init_value() : e.init_value() * std::pow(e.decay_rate(), p);
      if (e.has_end_value()) {
        v = e.decay_rate() < 1 ? std::max(v, e.end_value()) : std::min(v, e.end_value());
      }
      return v;
    }
    case v1Lr::kPiecewiseConstant: {
      const auto& pc = lr.piecewise_constant();
      std::map<int64_t, double> sorted;
      for (const auto& b : pc.boundaries_and_scales()) sorted[b.step()] = b.scale();
      double v = pc.init_value();
      for (const auto& [threshold, scale] : sorted) {
        const double indicator =
            std::max(0.0, double((threshold - step) > 0) - double((threshold - step) < 0));
        v = v * indicator + (1 - indicator) * scale * v;
      }
      return v;
    }
    case v1Lr::kJoin: {
      const auto& j = lr.join();
      double out = RefSchedule(j.schedules(0), count);
      for (int i = 1; i < j.schedules_size(); ++i) {
        const int64_t boundary = j.boundaries(i - 1);
        if (!(count < boundary)) out = RefSchedule(j.schedules(i), count - boundary);
      }
      return out;
    }
    case v1Lr::KIND_NOT_SET:
      break;
  }
  ADD_FAILURE() << "no schedule";
  return 0;
}

using Tree = std::map<std::string, std::vector<double>>;  // by param path

// optax's state for one optimizer: its moments by name ("mu", "1/nu", ...).
struct RefState {
  std::map<std::string, Tree> moments;
  Tree& Get(const std::string& name, const Tree& like, double initial = 0.0) {
    auto it = moments.find(name);
    if (it != moments.end()) return it->second;
    Tree& t = moments[name];
    for (const auto& [path, v] : like) t[path].assign(v.size(), initial);
    return t;
  }
};

template <typename F>
void Map(Tree& u, F f) {
  for (auto& [path, v] : u) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = f(path, i, v[i]);
  }
}

double GlobalNorm(const Tree& u) {
  double sum = 0;
  for (const auto& [path, v] : u) {
    for (double x : v) sum += x * x;
  }
  return std::sqrt(sum);
}

void RefTrace(double decay, bool nesterov, const std::string& name, Tree& u, RefState& s) {
  Tree& t = s.Get(name, u);
  Map(u, [&](const std::string& p, size_t i, double g) {
    const double nt = g + decay * t[p][i];
    t[p][i] = nt;
    return nesterov ? g + decay * nt : nt;
  });
}

void RefScaleByLr(const v1Lr& lr, int64_t count, Tree& u) {
  const double step_size = -RefSchedule(lr, count);
  Map(u, [&](const std::string&, size_t, double g) { return step_size * g; });
}

void RefDecayedWeights(double wd, const Tree& params, Tree& u) {
  if (wd == 0) return;
  Map(u, [&](const std::string& p, size_t i, double g) { return g + wd * params.at(p)[i]; });
}

template <typename AdamLike>
void RefAdam(const AdamLike& a, double wd, const std::string& prefix, const Tree& params,
             int64_t count, Tree& u, RefState& s) {
  const double b1 = a.has_b1() ? a.b1() : 0.9, b2 = a.has_b2() ? a.b2() : 0.999;
  const double eps = a.has_eps() ? a.eps() : 1e-8, eps_root = a.has_eps_root() ? a.eps_root() : 0;
  Tree& mu = s.Get(prefix + "mu", u);
  Tree& nu = s.Get(prefix + "nu", u);
  const double t = count + 1.0;
  Map(u, [&](const std::string& p, size_t i, double g) {
    mu[p][i] = (1 - b1) * g + b1 * mu[p][i];
    nu[p][i] = (1 - b2) * g * g + b2 * nu[p][i];
    const double m_hat = mu[p][i] / (1 - std::pow(b1, t));
    const double v_hat = nu[p][i] / (1 - std::pow(b2, t));
    return m_hat / (std::sqrt(v_hat + eps_root) + eps);
  });
  RefDecayedWeights(wd, params, u);
  RefScaleByLr(a.learning_rate(), count, u);
}

// optax.rmsprop: scale_by_rms / scale_by_stddev, scale_by_learning_rate, trace.
void RefRmsprop(const te::v1::Rmsprop& r, const std::string& prefix, int64_t count, Tree& u,
                RefState& s) {
  const double decay = r.has_decay() ? r.decay() : 0.9, eps = r.has_eps() ? r.eps() : 1e-8;
  const bool in_sqrt = !r.has_eps_in_sqrt() || r.eps_in_sqrt();
  Tree& nu = s.Get(prefix + "nu", u, r.initial_scale());
  if (r.centered()) {
    Tree& mu = s.Get(prefix + "mu", u);
    Map(u, [&](const std::string& p, size_t i, double g) {
      mu[p][i] = (1 - decay) * g + decay * mu[p][i];
      nu[p][i] = (1 - decay) * g * g + decay * nu[p][i];
      const double var = nu[p][i] - mu[p][i] * mu[p][i];
      const double scaling = in_sqrt ? 1 / std::sqrt(var + eps) : 1 / (std::sqrt(var) + eps);
      return scaling * g;
    });
  } else {
    Map(u, [&](const std::string& p, size_t i, double g) {
      nu[p][i] = (1 - decay) * g * g + decay * nu[p][i];
      const double scaling =
          in_sqrt ? 1 / std::sqrt(nu[p][i] + eps) : 1 / (std::sqrt(nu[p][i]) + eps);
      return scaling * g;
    });
  }
  RefScaleByLr(r.learning_rate(), count, u);
  if (r.has_momentum()) RefTrace(r.momentum(), r.nesterov(), prefix + "trace", u, s);
}

// optax.lion: scale_by_lion, add_decayed_weights, scale_by_learning_rate.
void RefLion(const te::v1::Lion& l, const std::string& prefix, const Tree& params, int64_t count,
             Tree& u, RefState& s) {
  const double b1 = l.has_b1() ? l.b1() : 0.9, b2 = l.has_b2() ? l.b2() : 0.99;
  Tree& mu = s.Get(prefix + "mu", u);
  Map(u, [&](const std::string& p, size_t i, double g) {
    const double x = (1 - b1) * g + b1 * mu[p][i];
    mu[p][i] = (1 - b2) * g + b2 * mu[p][i];
    return double((x > 0) - (x < 0));
  });
  RefDecayedWeights(l.has_weight_decay() ? l.weight_decay() : 1e-3, params, u);
  RefScaleByLr(l.learning_rate(), count, u);
}

void RefTransform(const te::v1::Transform& t, const std::string& prefix, const Tree& params,
                  int64_t count, Tree& u, RefState& s) {
  switch (t.kind_case()) {
    case te::v1::Transform::kSgd:
      if (t.sgd().has_momentum()) {
        RefTrace(t.sgd().momentum(), t.sgd().nesterov(), prefix + "trace", u, s);
      }
      RefScaleByLr(t.sgd().learning_rate(), count, u);
      return;
    case te::v1::Transform::kAdam:
      return RefAdam(t.adam(), 0.0, prefix, params, count, u, s);
    case te::v1::Transform::kAdamw:
      return RefAdam(t.adamw(), t.adamw().has_weight_decay() ? t.adamw().weight_decay() : 1e-4,
                     prefix, params, count, u, s);
    case te::v1::Transform::kRmsprop:
      return RefRmsprop(t.rmsprop(), prefix, count, u, s);
    case te::v1::Transform::kLion:
      return RefLion(t.lion(), prefix, params, count, u, s);
    case te::v1::Transform::kClipByGlobalNorm: {
      const double n = GlobalNorm(u), max_norm = t.clip_by_global_norm();
      if (!(n < max_norm)) {
        Map(u, [&](const std::string&, size_t, double g) { return g / n * max_norm; });
      }
      return;
    }
    case te::v1::Transform::kClip:
      Map(u,
          [&](const std::string&, size_t, double g) { return std::clamp(g, -t.clip(), t.clip()); });
      return;
    case te::v1::Transform::kScale:
      Map(u, [&](const std::string&, size_t, double g) { return t.scale() * g; });
      return;
    case te::v1::Transform::kAddDecayedWeights:
      return RefDecayedWeights(t.add_decayed_weights(), params, u);
    case te::v1::Transform::kScaleByLearningRate:
      return RefScaleByLr(t.scale_by_learning_rate(), count, u);
    case te::v1::Transform::KIND_NOT_SET:
      break;
  }
  ADD_FAILURE() << "no transform";
}

// optax.apply_if_finite(chain(...)) for an Optimizer as service.proto
// defines it: the updates (params += updates) from the gradients.
Tree RefUpdates(const te::v1::Optimizer& spec, const Tree& params, const Tree& grads, int64_t count,
                RefState& s) {
  Tree u = grads;
  if (spec.chain_size() > 0) {
    for (int i = 0; i < spec.chain_size(); ++i) {
      RefTransform(spec.chain(i), std::to_string(i) + "/", params, count, u, s);
    }
    return u;
  }
  te::v1::Transform t;
  if (spec.has_clip_by_global_norm()) {
    t.set_clip_by_global_norm(spec.clip_by_global_norm());
    RefTransform(t, "", params, count, u, s);
  }
  switch (spec.kind_case()) {
    case te::v1::Optimizer::kSgd:
      *t.mutable_sgd() = spec.sgd();
      break;
    case te::v1::Optimizer::kAdam:
      *t.mutable_adam() = spec.adam();
      break;
    case te::v1::Optimizer::kAdamw:
      *t.mutable_adamw() = spec.adamw();
      break;
    case te::v1::Optimizer::kRmsprop:
      *t.mutable_rmsprop() = spec.rmsprop();
      break;
    case te::v1::Optimizer::kLion:
      *t.mutable_lion() = spec.lion();
      break;
    case te::v1::Optimizer::KIND_NOT_SET:
      ADD_FAILURE() << "no optimizer";
      break;
  }
  RefTransform(t, "", params, count, u, s);
  return u;
}

// ---- the cases ---------------------------------------------------------------------

v1Lr Constant(double v) {
  v1Lr lr;
  lr.set_constant(v);
  return lr;
}

v1Lr WarmupCosine() {
  v1Lr lr;
  auto* w = lr.mutable_warmup_cosine_decay();
  w->set_init_value(0.001);
  w->set_peak_value(0.02);
  w->set_warmup_steps(2);
  w->set_decay_steps(5);
  w->set_end_value(0.004);
  return lr;
}

v1Lr Exponential() {
  v1Lr lr;
  auto* e = lr.mutable_exponential_decay();
  e->set_init_value(0.02);
  e->set_transition_steps(2);
  e->set_decay_rate(0.5);
  e->set_transition_begin(1);
  return lr;
}

v1Lr Piecewise() {
  v1Lr lr;
  auto* pc = lr.mutable_piecewise_constant();
  pc->set_init_value(0.05);
  auto* b = pc->add_boundaries_and_scales();
  b->set_step(3);
  b->set_scale(0.1);
  b = pc->add_boundaries_and_scales();
  b->set_step(1);
  b->set_scale(0.5);
  return lr;
}

struct Case {
  std::string name;
  te::v1::Optimizer spec;
  // State names (under opt_state, before the param path) the server must keep.
  std::vector<std::string> state;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  {
    Case c{"rmsprop_defaults", {}, {"nu"}};
    *c.spec.mutable_rmsprop()->mutable_learning_rate() = Constant(0.01);
    cases.push_back(c);
  }
  {
    Case c{"rmsprop_options", {}, {"nu", "trace"}};
    auto* r = c.spec.mutable_rmsprop();
    *r->mutable_learning_rate() = Exponential();
    r->set_decay(0.8);
    r->set_eps(1e-3);
    r->set_initial_scale(0.5);
    r->set_eps_in_sqrt(false);
    r->set_momentum(0.9);
    r->set_nesterov(true);
    cases.push_back(c);
  }
  {
    Case c{"rmsprop_centered_clipped", {}, {"mu", "nu", "trace"}};
    auto* r = c.spec.mutable_rmsprop();
    *r->mutable_learning_rate() = WarmupCosine();
    r->set_centered(true);
    r->set_initial_scale(1.0);
    r->set_momentum(0.5);
    r->set_eps(1e-4);
    c.spec.set_clip_by_global_norm(1.0);
    cases.push_back(c);
  }
  {
    Case c{"lion_defaults", {}, {"mu"}};
    *c.spec.mutable_lion()->mutable_learning_rate() = Constant(1e-3);
    cases.push_back(c);
  }
  {
    Case c{"lion_options_clipped", {}, {"mu"}};
    auto* l = c.spec.mutable_lion();
    *l->mutable_learning_rate() = Piecewise();
    l->set_b1(0.8);
    l->set_b2(0.95);
    l->set_weight_decay(0.1);
    c.spec.set_clip_by_global_norm(0.5);
    cases.push_back(c);
  }
  {
    // chain(adam, clip_by_global_norm): the clip sees adam's updates.
    Case c{"adam_then_clip", {}, {"0/mu", "0/nu"}};
    *c.spec.add_chain()->mutable_adam()->mutable_learning_rate() = Constant(0.05);
    c.spec.add_chain()->set_clip_by_global_norm(0.03);
    cases.push_back(c);
  }
  {
    // adamw spelled out: chain(clip_by_global_norm, adam(-1) as scale_by_adam,
    // add_decayed_weights, scale_by_learning_rate(schedule)).
    Case c{"clip_adam_decay_lr", {}, {"1/mu", "1/nu"}};
    c.spec.add_chain()->set_clip_by_global_norm(0.7);
    auto* a = c.spec.add_chain()->mutable_adam();
    *a->mutable_learning_rate() = Constant(-1.0);
    a->set_b1(0.8);
    a->set_eps_root(1e-6);
    c.spec.add_chain()->set_add_decayed_weights(0.01);
    *c.spec.add_chain()->mutable_scale_by_learning_rate() = WarmupCosine();
    cases.push_back(c);
  }
  {
    // Fused (chain(clip_by_global_norm, adamw)), its state under the chain's names.
    Case c{"clip_adamw_fused", {}, {"1/mu", "1/nu"}};
    c.spec.add_chain()->set_clip_by_global_norm(1.5);
    auto* a = c.spec.add_chain()->mutable_adamw();
    *a->mutable_learning_rate() = Constant(0.01);
    a->set_weight_decay(0.05);
    cases.push_back(c);
  }
  {
    Case c{"clip_sgd_scale", {}, {"1/trace"}};
    c.spec.add_chain()->set_clip(0.6);
    auto* s = c.spec.add_chain()->mutable_sgd();
    *s->mutable_learning_rate() = Piecewise();
    s->set_momentum(0.9);
    s->set_nesterov(true);
    c.spec.add_chain()->set_scale(0.5);
    cases.push_back(c);
  }
  {
    // Two optimizers' state side by side and two clips after them.
    Case c{"rmsprop_lion_two_clips", {}, {"0/mu", "0/nu", "1/mu"}};
    auto* r = c.spec.add_chain()->mutable_rmsprop();
    *r->mutable_learning_rate() = Constant(-1.0);
    r->set_centered(true);
    r->set_initial_scale(0.1);
    auto* l = c.spec.add_chain()->mutable_lion();
    *l->mutable_learning_rate() = Constant(0.02);
    c.spec.add_chain()->set_clip_by_global_norm(0.05);
    c.spec.add_chain()->set_clip_by_global_norm(0.03);
    cases.push_back(c);
  }
  {
    Case c{"stateless", {}, {}};
    v1Lr lr;
    auto* linear = lr.mutable_linear();
    linear->set_init_value(0.1);
    linear->set_end_value(0.01);
    linear->set_transition_steps(3);
    *c.spec.add_chain()->mutable_scale_by_learning_rate() = lr;
    c.spec.add_chain()->set_add_decayed_weights(0.1);
    cases.push_back(c);
  }
  return cases;
}

class ChainTest : public ::testing::TestWithParam<int> {};

// Steps over three params of random values: the params' changes and every
// state tensor (under the names the case expects) against the reference. The
// reference restarts each step from what the server holds, so the check is
// each step's math, not float32 drift.
TEST_P(ChainTest, StepsMatchFloat64Optax) {
  const Case c = Cases()[GetParam()];
  SCOPED_TRACE(c.name);
  CpuOps ops;
  absl::StatusOr<OptimizerConfig> config = ResolveOptimizer(c.spec, "optimizer");
  ASSERT_TRUE(config.ok()) << config.status();
  std::mt19937 gen(11 + GetParam());
  std::uniform_real_distribution<float> dist(-1.5f, 1.5f);
  auto random = [&](const Shape& shape) {
    Tensor t = *ops.Allocate(DType::kF32, shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(gen);
    return t;
  };
  const std::map<std::string, Shape> shapes = {
      {"a/kernel", {6, 5}}, {"a/bias", {5}}, {"b/scale", {3, 4}}};
  layers::Variables vars;
  for (const auto& [path, shape] : shapes) vars["params/" + path] = random(shape);
  layers::Variables state = *InitState(ops, *config, vars);
  ASSERT_EQ(state.size(), 2 + c.state.size() * shapes.size());
  auto read = [](const Tensor& t) {
    return std::vector<double>(t.data_as<float>(), t.data_as<float>() + t.numel());
  };
  RefState ref;
  Updater updater;
  for (int64_t count = 0; count < 6; ++count) {
    // The reference starts from the server's params and state.
    Tree params, grads;
    for (const auto& [path, shape] : shapes) params[path] = read(vars.at("params/" + path));
    for (const std::string& name : c.state) {
      for (const auto& [path, shape] : shapes) {
        const std::string full = "opt_state/" + name + "/" + path;
        ASSERT_EQ(state.count(full), 1u) << full;
        ref.moments[name][path] = read(state.at(full));
      }
    }
    layers::Variables grad_vars;
    for (const auto& [path, shape] : shapes) {
      grad_vars["grads/" + path] = random(shape);
      grads[path] = read(grad_vars.at("grads/" + path));
    }
    const Tree updates = RefUpdates(c.spec, params, grads, count, ref);
    ASSERT_TRUE(updater.Step(ops, *config, grad_vars, &vars, &state).ok());
    const OptimizerStepInfo info = *updater.ReadInfo(ops);
    EXPECT_EQ(info.applied, 1);
    EXPECT_EQ(info.count, count + 1);
    EXPECT_NEAR(info.grad_norm_sq, GlobalNorm(grads) * GlobalNorm(grads), 1e-5 * info.grad_norm_sq);
    EXPECT_NEAR(info.learning_rate, config->LearningRateAt(count), kScheduleTolerance);
    for (const auto& [path, shape] : shapes) {
      const std::vector<double> now = read(vars.at("params/" + path));
      double diff = 0, size = 0;
      for (size_t i = 0; i < now.size(); ++i) {
        const double got = now[i] - params[path][i], want = updates.at(path)[i];
        // The new param is rounded to float32: up to one of its ulps is not
        // the update's error.
        const float stored = static_cast<float>(now[i]);
        const double ulp = std::nextafter(stored, INFINITY) - stored;
        const double excess = std::max(0.0, std::abs(got - want) - ulp);
        diff += excess * excess;
        size += want * want;
      }
      EXPECT_LT(std::sqrt(diff / size), kUpdateTolerance) << path << " step " << count;
      for (const std::string& name : c.state) {
        const std::vector<double> got = read(state.at("opt_state/" + name + "/" + path));
        const std::vector<double>& want = ref.moments[name][path];
        double d = 0, n = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          d += (got[i] - want[i]) * (got[i] - want[i]);
          n += want[i] * want[i];
        }
        EXPECT_LT(std::sqrt(d / n), kUpdateTolerance) << name << "/" << path << " step " << count;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Optax, ChainTest, ::testing::Range(0, static_cast<int>(Cases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return Cases()[info.param].name;
                         });

// rmsprop's nu starts at initial_scale; everything else at zero.
TEST(ChainStateTest, InitialValuesAndNames) {
  CpuOps ops;
  te::v1::Optimizer spec;
  auto* r = spec.add_chain()->mutable_rmsprop();
  *r->mutable_learning_rate() = Constant(0.1);
  r->set_initial_scale(0.25);
  r->set_centered(true);
  r->set_momentum(0.9);
  *spec.add_chain()->mutable_lion()->mutable_learning_rate() = Constant(0.1);
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  Tensor p = *ops.Allocate(DType::kBF16, {3});
  layers::Variables vars = {{"params/w", p}};
  std::vector<std::string> names;
  for (const layers::VariableSpec& s : StateSpecs(config, vars)) {
    names.push_back(s.name);
    if (s.name != kCount && s.name != kTotalNotfinite) {
      EXPECT_EQ(s.dtype, DType::kBF16);
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{kCount, kTotalNotfinite, "opt_state/0/mu/w",
                                             "opt_state/0/nu/w", "opt_state/0/trace/w",
                                             "opt_state/1/mu/w"}));
  const layers::Variables state = *InitState(ops, config, vars);
  EXPECT_EQ(LoadAsFloat(state.at("opt_state/0/nu/w"), 2), 0.25f);
  EXPECT_EQ(LoadAsFloat(state.at("opt_state/0/mu/w"), 2), 0.0f);
  EXPECT_EQ(LoadAsFloat(state.at("opt_state/1/mu/w"), 0), 0.0f);
  EXPECT_EQ(std::string(config.name()), "chain");
}

// A non-finite gradient skips a chain's step: params, state and count stay.
TEST(ChainStateTest, NonFiniteGradientSkipsTheChain) {
  CpuOps ops;
  te::v1::Optimizer spec;
  *spec.mutable_lion()->mutable_learning_rate() = Constant(0.1);
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  Tensor p = *ops.Allocate(DType::kF32, {2});
  p.data_as<float>()[0] = 1.0f;
  p.data_as<float>()[1] = 2.0f;
  layers::Variables vars = {{"params/w", p}};
  layers::Variables state = *InitState(ops, config, vars);
  Tensor g = *ops.Allocate(DType::kF32, {2});
  g.data_as<float>()[0] = NAN;
  g.data_as<float>()[1] = 1.0f;
  Updater updater;
  ASSERT_TRUE(updater.Step(ops, config, {{"grads/w", g}}, &vars, &state).ok());
  EXPECT_EQ(p.data_as<float>()[0], 1.0f);
  EXPECT_EQ(p.data_as<float>()[1], 2.0f);
  EXPECT_EQ(state.at("opt_state/mu/w").data_as<float>()[1], 0.0f);
  const OptimizerStepInfo info = *updater.ReadInfo(ops);
  EXPECT_EQ(info.applied, 0);
  EXPECT_EQ(info.count, 0);
  EXPECT_EQ(info.total_notfinite, 1);
}

// ---- schedules ---------------------------------------------------------------------

std::vector<std::pair<std::string, v1Lr>> Schedules() {
  std::vector<std::pair<std::string, v1Lr>> s;
  s.push_back({"constant", Constant(0.3)});
  {
    v1Lr lr;
    auto* l = lr.mutable_linear();
    l->set_init_value(1.0);
    l->set_end_value(0.1);
    l->set_transition_steps(10);
    l->set_transition_begin(5);
    s.push_back({"linear", lr});
    l->set_transition_steps(0);  // optax: held at init_value
    s.push_back({"linear_no_steps", lr});
    l->set_transition_steps(4);
    l->set_transition_begin(-3);  // optax: from 0
    s.push_back({"linear_negative_begin", lr});
  }
  {
    v1Lr lr;
    auto* c = lr.mutable_cosine_decay();
    c->set_init_value(0.5);
    c->set_decay_steps(20);
    c->set_alpha(0.1);
    c->set_exponent(2.0);
    s.push_back({"cosine_decay", lr});
  }
  {
    v1Lr lr;
    auto* e = lr.mutable_exponential_decay();
    e->set_init_value(1.0);
    e->set_transition_steps(4);
    e->set_decay_rate(0.5);
    e->set_transition_begin(3);
    s.push_back({"exponential", lr});
    e->set_staircase(true);
    e->set_end_value(0.2);
    s.push_back({"exponential_staircase_end", lr});
    e->set_decay_rate(1.5);
    e->set_end_value(2.0);  // an upper bound when the rate grows
    e->set_staircase(false);
    s.push_back({"exponential_growing_end", lr});
    e->set_decay_rate(0.0);  // optax: held at init_value
    s.push_back({"exponential_zero_rate", lr});
  }
  {
    v1Lr lr;
    auto* pc = lr.mutable_piecewise_constant();
    pc->set_init_value(1.0);
    for (auto [step, scale] :
         std::vector<std::pair<int64_t, double>>{{10, 0.5}, {5, 0.1}, {20, 2.0}}) {
      auto* b = pc->add_boundaries_and_scales();
      b->set_step(step);
      b->set_scale(scale);
    }
    s.push_back({"piecewise_constant", lr});
  }
  {
    v1Lr w;
    auto* wc = w.mutable_warmup_cosine_decay();
    wc->set_init_value(0.0);
    wc->set_peak_value(0.4);
    wc->set_warmup_steps(4);
    wc->set_decay_steps(12);
    wc->set_end_value(0.05);
    s.push_back({"warmup_cosine", w});
    // Nested joins: constant, linear, then a join of cosine and exponential.
    v1Lr lr;
    auto* j = lr.mutable_join();
    *j->add_schedules() = Constant(1.0);
    auto* l = j->add_schedules()->mutable_linear();
    l->set_init_value(1.0);
    l->set_end_value(0.0);
    l->set_transition_steps(10);
    auto* inner = j->add_schedules()->mutable_join();
    *inner->add_schedules() = w;
    auto* e = inner->add_schedules()->mutable_exponential_decay();
    e->set_init_value(0.3);
    e->set_transition_steps(2);
    e->set_decay_rate(0.9);
    inner->add_boundaries(7);
    j->add_boundaries(5);
    j->add_boundaries(15);
    s.push_back({"nested_join", lr});
    // Boundaries out of order: optax's where-chain lets the last reached win.
    v1Lr unordered;
    auto* u = unordered.mutable_join();
    *u->add_schedules() = Constant(1.0);
    *u->add_schedules() = Constant(2.0);
    *u->add_schedules() = w;
    u->add_boundaries(10);
    u->add_boundaries(4);
    s.push_back({"unordered_join", unordered});
  }
  return s;
}

TEST(ScheduleTest, EverySchedulesBoundariesMatchOptax) {
  for (const auto& [name, lr] : Schedules()) {
    te::v1::Optimizer spec;
    *spec.add_chain()->mutable_scale_by_learning_rate() = lr;
    absl::StatusOr<OptimizerConfig> config = ResolveOptimizer(spec, "optimizer");
    ASSERT_TRUE(config.ok()) << name << ": " << config.status();
    for (int64_t count = 0; count <= 40; ++count) {
      EXPECT_NEAR(config->LearningRateAt(count), RefSchedule(lr, count), kScheduleTolerance)
          << name << " at " << count;
    }
    EXPECT_NEAR(config->LearningRateAt(100000), RefSchedule(lr, 100000), kScheduleTolerance)
        << name;
  }
}

// Values the reference alone could get wrong with the server: optax's own
// docstring examples.
TEST(ScheduleTest, OptaxDocExamples) {
  v1Lr pc;
  pc.mutable_piecewise_constant()->set_init_value(1.0);
  for (auto [step, scale] : std::vector<std::pair<int64_t, double>>{{100, 0.1}, {200, 0.01}}) {
    auto* b = pc.mutable_piecewise_constant()->add_boundaries_and_scales();
    b->set_step(step);
    b->set_scale(scale);
  }
  te::v1::Optimizer spec;
  *spec.add_chain()->mutable_scale_by_learning_rate() = pc;
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  EXPECT_NEAR(config.LearningRateAt(50), 1.0, kScheduleTolerance);
  EXPECT_NEAR(config.LearningRateAt(150), 0.1, kScheduleTolerance);
  EXPECT_NEAR(config.LearningRateAt(250), 0.001, kScheduleTolerance);
}

// ---- bad requests ------------------------------------------------------------------

TEST(ChainResolveTest, BadFieldsAreInvalidArgumentNamingThem) {
  std::vector<std::pair<te::v1::Optimizer, std::string>> cases;
  auto add = [&](const std::string& field) -> te::v1::Optimizer& {
    cases.push_back({te::v1::Optimizer(), field});
    return cases.back().first;
  };
  {
    te::v1::Optimizer& o = add("optimizer.chain[1].lion.b1: 1.5 is outside [0, 1]");
    o.add_chain()->set_clip_by_global_norm(1.0);
    auto* l = o.add_chain()->mutable_lion();
    *l->mutable_learning_rate() = Constant(0.1);
    l->set_b1(1.5);
  }
  {
    te::v1::Optimizer& o = add("optimizer.rmsprop.initial_scale: -1 is negative");
    *o.mutable_rmsprop()->mutable_learning_rate() = Constant(0.1);
    o.mutable_rmsprop()->set_initial_scale(-1);
  }
  {
    te::v1::Optimizer& o = add("optimizer.rmsprop.nesterov: needs a momentum");
    *o.mutable_rmsprop()->mutable_learning_rate() = Constant(0.1);
    o.mutable_rmsprop()->set_nesterov(true);
  }
  {
    te::v1::Optimizer& o = add("optimizer.rmsprop.eps: 0 with initial_scale 0");
    *o.mutable_rmsprop()->mutable_learning_rate() = Constant(0.1);
    o.mutable_rmsprop()->set_eps(0);
  }
  {
    te::v1::Optimizer& o = add("optimizer.rmsprop.decay: 1.1 is outside [0, 1]");
    *o.mutable_rmsprop()->mutable_learning_rate() = Constant(0.1);
    o.mutable_rmsprop()->set_decay(1.1);
  }
  {
    te::v1::Optimizer& o = add("optimizer.lion.weight_decay: inf");
    *o.mutable_lion()->mutable_learning_rate() = Constant(0.1);
    o.mutable_lion()->set_weight_decay(INFINITY);
  }
  add("optimizer.chain[0]: no transform").add_chain();
  {
    te::v1::Optimizer& o = add("optimizer.chain: set with another optimizer");
    o.add_chain()->set_scale(1.0);
    *o.mutable_sgd()->mutable_learning_rate() = Constant(0.1);
  }
  {
    te::v1::Optimizer& o = add("optimizer.clip_by_global_norm: set with a chain");
    o.add_chain()->set_scale(1.0);
    o.set_clip_by_global_norm(1.0);
  }
  {
    te::v1::Optimizer& o = add("optimizer.chain[2].clip_by_global_norm: 0 is not positive");
    o.add_chain()->set_scale(1.0);
    o.add_chain()->set_scale(1.0);
    o.add_chain()->set_clip_by_global_norm(0.0);
  }
  add("optimizer.chain[0].clip: -1 is negative").add_chain()->set_clip(-1);
  add("optimizer.chain[0].scale: nan").add_chain()->set_scale(NAN);
  {
    te::v1::Optimizer& o =
        add("optimizer.lion.learning_rate.cosine_decay.decay_steps: 0 is not positive");
    o.mutable_lion()->mutable_learning_rate()->mutable_cosine_decay()->set_init_value(0.1);
  }
  {
    te::v1::Optimizer& o =
        add("optimizer.sgd.learning_rate.piecewise_constant.boundaries_and_scales[1].scale: -0.5 "
            "is negative");
    auto* pc = o.mutable_sgd()->mutable_learning_rate()->mutable_piecewise_constant();
    pc->add_boundaries_and_scales()->set_scale(1.0);
    pc->add_boundaries_and_scales()->set_scale(-0.5);
  }
  {
    te::v1::Optimizer& o =
        add("optimizer.sgd.learning_rate.piecewise_constant.boundaries_and_scales[1].step: 5 is "
            "given twice");
    auto* pc = o.mutable_sgd()->mutable_learning_rate()->mutable_piecewise_constant();
    for (int i = 0; i < 2; ++i) {
      auto* b = pc->add_boundaries_and_scales();
      b->set_step(5);
      b->set_scale(0.5);
    }
  }
  {
    te::v1::Optimizer& o = add("optimizer.adam.learning_rate.join.boundaries: 2 boundaries for 2");
    auto* j = o.mutable_adam()->mutable_learning_rate()->mutable_join();
    *j->add_schedules() = Constant(0.1);
    *j->add_schedules() = Constant(0.2);
    j->add_boundaries(1);
    j->add_boundaries(2);
  }
  {
    te::v1::Optimizer& o = add("optimizer.adam.learning_rate.join.schedules[1]: required");
    auto* j = o.mutable_adam()->mutable_learning_rate()->mutable_join();
    *j->add_schedules() = Constant(0.1);
    j->add_schedules();
    j->add_boundaries(3);
  }
  add("optimizer.adam.learning_rate.join.schedules: empty")
      .mutable_adam()
      ->mutable_learning_rate()
      ->mutable_join();
  {
    te::v1::Optimizer& o =
        add("optimizer.chain[0].scale_by_learning_rate.exponential_decay.end_value: inf");
    auto* e = o.add_chain()->mutable_scale_by_learning_rate()->mutable_exponential_decay();
    e->set_init_value(1.0);
    e->set_end_value(INFINITY);
  }
  {
    te::v1::Optimizer& o = add("optimizer.chain: runs as 17 of optax's primitive");
    for (int i = 0; i < 17; ++i) o.add_chain()->set_scale(1.0);
  }
  {
    te::v1::Optimizer& o = add("optimizer.chain: keeps 10 state tensors per parameter");
    for (int i = 0; i < 5; ++i) {
      *o.add_chain()->mutable_adam()->mutable_learning_rate() = Constant(1);
    }
  }
  {
    te::v1::Optimizer& o =
        add("optimizer.sgd.learning_rate.piecewise_constant.boundaries_and_scales: "
            "the optimizer's schedules take more than 32 boundaries");
    auto* pc = o.mutable_sgd()->mutable_learning_rate()->mutable_piecewise_constant();
    for (int i = 0; i < 33; ++i) pc->add_boundaries_and_scales()->set_step(i);
  }
  for (const auto& [spec, field] : cases) {
    absl::StatusOr<OptimizerConfig> got = ResolveOptimizer(spec, "optimizer");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(got.status().message().find(field), std::string::npos)
        << "want \"" << field << "\", got " << got.status();
  }
}

}  // namespace
}  // namespace te::optim
