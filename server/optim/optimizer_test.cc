// The optimizers as optax defines them: defaults, validation, schedules, and
// whole steps over several parameters (global-norm clipping across them)
// against a float64 reference on random values.
#include "server/optim/optimizer.h"

#include <cmath>
#include <limits>
#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"

namespace te::optim {
namespace {

// float32 kernels against a float64 reference, relative to the change.
constexpr double kUpdateTolerance = 1e-5;
// Schedules are float64 on both sides.
constexpr double kScheduleTolerance = 1e-12;

te::v1::Optimizer AdamW(double lr) {
  te::v1::Optimizer spec;
  spec.mutable_adamw()->mutable_learning_rate()->set_constant(lr);
  return spec;
}

TEST(ResolveOptimizerTest, OptaxDefaults) {
  absl::StatusOr<OptimizerConfig> adamw = ResolveOptimizer(AdamW(1e-3), "optimizer");
  ASSERT_TRUE(adamw.ok()) << adamw.status();
  const OptimizerHyperparams& h = adamw->hyperparams;
  EXPECT_EQ(h.rule, OptimizerUpdateArgs::Rule::kAdam);
  EXPECT_EQ(h.num_links, 0);  // the fused rule
  EXPECT_EQ(h.b1, 0.9);
  EXPECT_EQ(h.b2, 0.999);
  EXPECT_EQ(h.eps, 1e-8);
  EXPECT_EQ(h.eps_root, 0.0);
  EXPECT_EQ(h.weight_decay, 1e-4);
  EXPECT_EQ(h.max_norm, 0.0);
  te::v1::Optimizer adam;
  adam.mutable_adam()->mutable_learning_rate()->set_constant(1e-3);
  EXPECT_EQ(ResolveOptimizer(adam, "optimizer")->hyperparams.weight_decay, 0.0);
  te::v1::Optimizer sgd;
  sgd.mutable_sgd()->mutable_learning_rate()->set_constant(0.1);
  absl::StatusOr<OptimizerConfig> s = ResolveOptimizer(sgd, "optimizer");
  ASSERT_TRUE(s.ok());
  EXPECT_TRUE(s->state.empty());             // optax: momentum=None, no trace state
  EXPECT_EQ(StateSpecs(*s, {}).size(), 2u);  // count, total_notfinite
}

TEST(ResolveOptimizerTest, BadFieldsAreInvalidArgumentNamingThem) {
  struct Bad {
    te::v1::Optimizer spec;
    std::string field;
  };
  std::vector<Bad> cases;
  cases.push_back({te::v1::Optimizer(), "optimizer: no optimizer"});
  cases.push_back({AdamW(std::nan("")), "optimizer.adamw.learning_rate.constant: nan"});
  te::v1::Optimizer no_lr;
  no_lr.mutable_adam();
  cases.push_back({no_lr, "optimizer.adam.learning_rate: required"});
  te::v1::Optimizer b1 = AdamW(1e-3);
  b1.mutable_adamw()->set_b1(1.0);
  cases.push_back({b1, "optimizer.adamw.b1: 1 is outside [0, 1)"});
  te::v1::Optimizer decay = AdamW(0);
  auto* w = decay.mutable_adamw()->mutable_learning_rate()->mutable_warmup_cosine_decay();
  w->set_warmup_steps(10);
  w->set_decay_steps(10);
  cases.push_back({decay, "optimizer.adamw.learning_rate.warmup_cosine_decay.decay_steps"});
  te::v1::Optimizer clip = AdamW(1e-3);
  clip.set_clip_by_global_norm(-1);
  cases.push_back({clip, "optimizer.clip_by_global_norm: -1 is not positive"});
  te::v1::Optimizer nesterov;
  nesterov.mutable_sgd()->mutable_learning_rate()->set_constant(0.1);
  nesterov.mutable_sgd()->set_nesterov(true);
  cases.push_back({nesterov, "optimizer.sgd.nesterov"});
  for (const Bad& bad : cases) {
    absl::StatusOr<OptimizerConfig> got = ResolveOptimizer(bad.spec, "optimizer");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad.field;
    EXPECT_NE(got.status().message().find(bad.field), std::string::npos) << got.status();
  }
}

TEST(ScheduleTest, WarmupCosineDecayIsOptaxs) {
  te::v1::LearningRate lr;
  auto* w = lr.mutable_warmup_cosine_decay();
  w->set_init_value(0.01);
  w->set_peak_value(0.5);
  w->set_warmup_steps(7);
  w->set_decay_steps(40);
  w->set_end_value(0.02);
  w->set_exponent(1.5);
  te::v1::Optimizer spec;
  *spec.mutable_sgd()->mutable_learning_rate() = lr;
  const OptimizerConfig s = *ResolveOptimizer(spec, "optimizer");
  const double pi = std::acos(-1.0);
  for (int64_t count : {0, 1, 3, 6, 7, 8, 20, 39, 40, 41, 100}) {
    double want;
    if (count < 7) {
      want = 0.01 + (0.5 - 0.01) * count / 7.0;
    } else {
      const double t = std::min<double>(count - 7, 33);
      const double alpha = 0.02 / 0.5;
      want = 0.5 * ((1 - alpha) * std::pow(0.5 * (1 + std::cos(pi * t / 33)), 1.5) + alpha);
    }
    EXPECT_NEAR(s.LearningRateAt(count), want, kScheduleTolerance) << count;
  }
  EXPECT_NEAR(s.LearningRateAt(1000), 0.02, kScheduleTolerance);  // end_value after decay_steps
}

// Two parameters, several adamw steps with clipping, through Update (the
// norm is over both), against float64 optax.
TEST(UpdateTest, ClippedAdamWOverTwoParamsMatchesFloat64) {
  CpuOps ops;
  te::v1::Optimizer spec = AdamW(0.05);
  spec.mutable_adamw()->set_weight_decay(0.1);
  spec.set_clip_by_global_norm(2.0);
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(-1.5f, 1.5f);
  auto random = [&](const Shape& shape) {
    Tensor t = *ops.Allocate(DType::kF32, shape);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(gen);
    return t;
  };
  layers::Variables vars = {{"params/kernel", random({6, 5})}, {"params/bias", random({5})}};
  layers::Variables state = *InitState(ops, config, vars);
  ASSERT_EQ(state.size(), 6u);
  Updater updater;
  std::map<std::string, std::vector<double>> p, m, v;
  for (const auto& [name, t] : vars) {
    p[name].assign(t.data_as<float>(), t.data_as<float>() + t.numel());
    m[name].assign(t.numel(), 0.0);
    v[name].assign(t.numel(), 0.0);
  }
  for (int64_t count = 0; count < 5; ++count) {
    layers::Variables grads = {{"grads/kernel", random({6, 5})}, {"grads/bias", random({5})}};
    double norm_sq = 0;
    for (const auto& [name, g] : grads) {
      for (int64_t i = 0; i < g.numel(); ++i) norm_sq += double(g.data_as<float>()[i]) * g.data_as<float>()[i];
    }
    ASSERT_TRUE(updater.Step(ops, config, grads, &vars, &state).ok());
    const OptimizerStepInfo info = *updater.ReadInfo(ops);
    EXPECT_NEAR(info.grad_norm_sq, norm_sq, 1e-5 * norm_sq);
    EXPECT_EQ(info.applied, 1);
    EXPECT_EQ(info.count, count + 1);
    EXPECT_EQ(info.learning_rate, 0.05);
    EXPECT_EQ(state.at(kCount).data_as<int32_t>()[0], count + 1);
    const double norm = std::sqrt(norm_sq), t = count + 1.0;
    for (auto& [name, pv] : p) {
      const Tensor& g = grads.at("grads" + name.substr(6));
      double diff = 0, size = 0;
      for (size_t i = 0; i < pv.size(); ++i) {
        double gi = g.data_as<float>()[i];
        if (!(norm < 2.0)) gi = gi / norm * 2.0;
        m[name][i] = 0.1 * gi + 0.9 * m[name][i];
        v[name][i] = 0.001 * gi * gi + 0.999 * v[name][i];
        const double u = (m[name][i] / (1 - std::pow(0.9, t))) /
                             (std::sqrt(v[name][i] / (1 - std::pow(0.999, t))) + 1e-8) +
                         0.1 * pv[i];
        const double ref_delta = -0.05 * u;
        const double got_delta = double(vars.at(name).data_as<float>()[i]) - pv[i];
        diff += (got_delta - ref_delta) * (got_delta - ref_delta);
        size += ref_delta * ref_delta;
        pv[i] = vars.at(name).data_as<float>()[i];  // continue from what the server holds
      }
      EXPECT_LT(std::sqrt(diff / size), kUpdateTolerance) << name << " step " << count;
    }
  }
}

TEST(UpdateTest, InfiniteGradientChangesNothing) {
  CpuOps ops;
  const OptimizerConfig config = *ResolveOptimizer(AdamW(0.1), "optimizer");
  Tensor kernel = *ops.Allocate(DType::kF32, {3});
  for (int i = 0; i < 3; ++i) kernel.data_as<float>()[i] = 0.5f + i;
  layers::Variables vars = {{"params/kernel", kernel}};
  layers::Variables state = *InitState(ops, config, vars);
  Tensor grad = *ops.Allocate(DType::kF32, {3});
  grad.data_as<float>()[0] = 1.0f;
  grad.data_as<float>()[1] = std::numeric_limits<float>::infinity();
  grad.data_as<float>()[2] = 2.0f;
  layers::Variables grads = {{"grads/kernel", grad}};
  Updater updater;
  ASSERT_TRUE(updater.Step(ops, config, grads, &vars, &state).ok());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(kernel.data_as<float>()[i], 0.5f + i);
  for (const auto& [name, t] : state) {
    if (t.dtype() == DType::kF32) {
      for (int i = 0; i < 3; ++i) EXPECT_EQ(t.data_as<float>()[i], 0.0f) << name;
    }
  }
  const OptimizerStepInfo info = *updater.ReadInfo(ops);
  EXPECT_EQ(info.applied, 0);
  EXPECT_TRUE(std::isinf(info.grad_norm_sq));
  EXPECT_EQ(info.count, 0);  // apply_if_finite: the inner state, count included, stays
  EXPECT_EQ(info.total_notfinite, 1);
  EXPECT_EQ(state.at(kCount).data_as<int32_t>()[0], 0);
  EXPECT_EQ(state.at(kTotalNotfinite).data_as<int32_t>()[0], 1);
  // A finite step afterwards applies at count 0.
  grad.data_as<float>()[1] = 1.0f;
  ASSERT_TRUE(updater.Step(ops, config, grads, &vars, &state).ok());
  EXPECT_EQ(updater.ReadInfo(ops)->count, 1);
  EXPECT_NE(kernel.data_as<float>()[0], 0.5f);
}

// The plan follows the tensors: a param replaced (SetVariables, a restore)
// is the one the next step updates, and a param without a gradient keeps
// its value.
TEST(UpdaterTest, ReplacedParamIsUpdatedAndGradlessParamKept) {
  CpuOps ops;
  te::v1::Optimizer spec;
  spec.mutable_sgd()->mutable_learning_rate()->set_constant(0.5);
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  auto filled = [&](float v) {
    Tensor t = *ops.Allocate(DType::kF32, {4});
    for (int i = 0; i < 4; ++i) t.data_as<float>()[i] = v;
    return t;
  };
  layers::Variables vars = {{"params/a", filled(1.0f)}, {"params/b", filled(2.0f)}};
  layers::Variables state = *InitState(ops, config, vars);
  Updater updater;
  const layers::Variables grads = {{"grads/a", filled(1.0f)}};
  ASSERT_TRUE(updater.Step(ops, config, grads, &vars, &state).ok());
  EXPECT_EQ(vars.at("params/a").data_as<float>()[0], 0.5f);
  EXPECT_EQ(vars.at("params/b").data_as<float>()[0], 2.0f);
  Tensor old_a = vars.at("params/a");
  vars["params/a"] = filled(3.0f);
  ASSERT_TRUE(updater.Step(ops, config, grads, &vars, &state).ok());
  EXPECT_EQ(vars.at("params/a").data_as<float>()[0], 2.5f);
  EXPECT_EQ(old_a.data_as<float>()[0], 0.5f);  // the replaced tensor is left alone
  EXPECT_EQ(updater.ReadInfo(ops)->count, 2);
}

// The learning rate each step reports is the schedule at the count before it.
TEST(UpdaterTest, StepsFollowTheSchedule) {
  CpuOps ops;
  te::v1::Optimizer spec;
  auto* w = spec.mutable_adam()->mutable_learning_rate()->mutable_warmup_cosine_decay();
  w->set_init_value(0.0);
  w->set_peak_value(0.1);
  w->set_warmup_steps(3);
  w->set_decay_steps(8);
  const OptimizerConfig config = *ResolveOptimizer(spec, "optimizer");
  Tensor p = *ops.Allocate(DType::kF32, {2});
  p.data_as<float>()[0] = p.data_as<float>()[1] = 1.0f;
  layers::Variables vars = {{"params/p", p}};
  layers::Variables state = *InitState(ops, config, vars);
  Tensor g = *ops.Allocate(DType::kF32, {2});
  g.data_as<float>()[0] = g.data_as<float>()[1] = 1.0f;
  Updater updater;
  EXPECT_EQ(updater.ReadInfo(ops).status().code(), absl::StatusCode::kFailedPrecondition);
  for (int64_t count = 0; count < 10; ++count) {
    ASSERT_TRUE(updater.Step(ops, config, {{"grads/p", g}}, &vars, &state).ok());
    EXPECT_NEAR(updater.ReadInfo(ops)->learning_rate, config.LearningRateAt(count),
                kScheduleTolerance);
  }
}

}  // namespace
}  // namespace te::optim
