// OptimizerUpdate against a float64 reference of optax's formulas, on random
// values (never zeros), over several steps so the moments carry over.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::MakeTensor;
using testing::RelativeError;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;
using Rule = OptimizerUpdateArgs::Rule;

// The parameter's change (param_out - param_in) is compared in float32, not
// the parameter: the change is what the formula computes, and against a
// parameter of |p| ~ 1 a wrong update of 1e-3 would hide under the bound. In
// bf16 a change can be smaller than the parameter's ulp, so there each
// parameter must be its float64 reference rounded to bf16, within one bf16
// ulp (2^-7 relative: half an ulp of rounding, the rest for float32 math).
constexpr double kBf16ParamUlps = 1.0 / 128;

struct Case {
  std::string name;
  OptimizerUpdateArgs args;
  bool trace = false;  // sgd with momentum
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  OptimizerUpdateArgs sgd;
  sgd.rule = Rule::kSgd;
  sgd.learning_rate = 0.3f;
  cases.push_back({"sgd", sgd});
  OptimizerUpdateArgs momentum = sgd;
  momentum.momentum = 0.9f;
  cases.push_back({"sgd_momentum", momentum, true});
  OptimizerUpdateArgs nesterov = momentum;
  nesterov.nesterov = true;
  cases.push_back({"sgd_nesterov", nesterov, true});
  OptimizerUpdateArgs adam;
  adam.rule = Rule::kAdam;
  adam.learning_rate = 0.2f;
  adam.b1 = 0.8f;
  adam.b2 = 0.95f;
  adam.eps = 1e-3f;
  adam.eps_root = 1e-4f;
  cases.push_back({"adam", adam});
  OptimizerUpdateArgs adamw = adam;
  adamw.eps = 1e-8f;
  adamw.eps_root = 0.0f;
  adamw.weight_decay = 0.05f;
  cases.push_back({"adamw", adamw});
  OptimizerUpdateArgs clipped = adamw;
  clipped.max_norm = 1.5f;  // below the random gradients' norm: clipping acts
  cases.push_back({"adamw_clipped", clipped});
  OptimizerUpdateArgs clipped_sgd = momentum;
  clipped_sgd.max_norm = 1e6f;  // above it: the gradients pass unchanged
  cases.push_back({"sgd_momentum_unclipped", clipped_sgd, true});
  return cases;
}

// optax's update of one element, in float64, from the stored inputs.
struct Ref {
  double param, mu, nu;
};
Ref Reference(const OptimizerUpdateArgs& a, bool trace, double g, double p, double mu, double nu,
              double norm) {
  if (a.max_norm > 0 && !(norm < a.max_norm)) g = g / norm * a.max_norm;
  double u = g;
  Ref r{p, mu, nu};
  if (a.rule == Rule::kAdam) {
    r.mu = (1 - double(a.b1)) * g + double(a.b1) * mu;
    r.nu = (1 - double(a.b2)) * g * g + double(a.b2) * nu;
    u = (r.mu / a.bias_correction1) / (std::sqrt(r.nu / a.bias_correction2 + a.eps_root) + a.eps);
  } else if (trace) {
    r.mu = g + double(a.momentum) * mu;
    u = a.nesterov ? g + double(a.momentum) * r.mu : r.mu;
  }
  u += double(a.weight_decay) * p;
  r.param = p - double(a.learning_rate) * u;
  return r;
}

class OptimizerUpdateTest : public ::testing::TestWithParam<std::tuple<Case, DType>> {};

TEST_P(OptimizerUpdateTest, MatchesFloat64OptaxOverSteps) {
  const auto& [c, dtype] = GetParam();
  CpuOps ops;
  const Shape shape = {37, 19};  // odd sizes
  Tensor param = MakeRandom(ops, dtype, shape, 11);
  const bool adam = c.args.rule == Rule::kAdam;
  Tensor mu = adam || c.trace ? MakeRandom(ops, dtype, shape, 12, -0.5f, 0.5f) : Tensor();
  Tensor nu = adam ? MakeRandom(ops, dtype, shape, 13, 0.01f, 1.0f) : Tensor();
  for (int step = 1; step <= 4; ++step) {
    OptimizerUpdateArgs args = c.args;
    args.bias_correction1 = static_cast<float>(1 - std::pow(double(args.b1), step));
    args.bias_correction2 = static_cast<float>(1 - std::pow(double(args.b2), step));
    Tensor grad = MakeRandom(ops, dtype, shape, 100 + step);
    const std::vector<double> g = ToDoubles(grad), p = ToDoubles(param);
    const std::vector<double> m = mu.defined() ? ToDoubles(mu) : std::vector<double>(g.size());
    const std::vector<double> v = nu.defined() ? ToDoubles(nu) : std::vector<double>(g.size());
    double norm_sq = 0;
    for (double x : g) norm_sq += x * x;
    Tensor norm_sq_t = MakeTensor(ops, DType::kF32, {1}, {static_cast<float>(norm_sq)});
    ASSERT_TRUE(ops.OptimizerUpdate(args, grad, norm_sq_t, &param, mu.defined() ? &mu : nullptr,
                                    nu.defined() ? &nu : nullptr)
                    .ok());
    std::vector<double> ref_delta(g.size()), ref_mu(g.size()), ref_nu(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
      const Ref r = Reference(args, c.trace, g[i], p[i], m[i], v[i], std::sqrt(norm_sq));
      ref_delta[i] = r.param - p[i];
      ref_mu[i] = r.mu;
      ref_nu[i] = r.nu;
    }
    const std::vector<double> out = ToDoubles(param);
    if (dtype == DType::kBF16) {
      for (size_t i = 0; i < out.size(); ++i) {
        const double ref = p[i] + ref_delta[i];
        ASSERT_LE(std::fabs(out[i] - ref), kBf16ParamUlps * std::fabs(ref)) << "step " << step << " [" << i << "]";
      }
    } else {
      std::vector<double> delta(out.size());
      for (size_t i = 0; i < out.size(); ++i) delta[i] = out[i] - p[i];
      EXPECT_LT(RelativeError(delta, ref_delta), Tolerance(dtype)) << "step " << step;
    }
    if (mu.defined()) EXPECT_LT(RelativeError(mu, ref_mu), Tolerance(dtype)) << "step " << step;
    if (nu.defined()) EXPECT_LT(RelativeError(nu, ref_nu), Tolerance(dtype)) << "step " << step;
  }
}

TEST_P(OptimizerUpdateTest, NonFiniteNormSkipsTheStep) {
  const auto& [c, dtype] = GetParam();
  CpuOps ops;
  const Shape shape = {5, 7};
  Tensor param = MakeRandom(ops, dtype, shape, 21);
  const bool adam = c.args.rule == Rule::kAdam;
  Tensor mu = adam || c.trace ? MakeRandom(ops, dtype, shape, 22) : Tensor();
  Tensor nu = adam ? MakeRandom(ops, dtype, shape, 23, 0.1f, 1.0f) : Tensor();
  Tensor grad = MakeRandom(ops, dtype, shape, 24);
  const std::vector<double> p = ToDoubles(param);
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    Tensor norm_sq = MakeTensor(ops, DType::kF32, {1}, {bad});
    ASSERT_TRUE(ops.OptimizerUpdate(c.args, grad, norm_sq, &param, mu.defined() ? &mu : nullptr,
                                    nu.defined() ? &nu : nullptr)
                    .ok());
    EXPECT_EQ(ToDoubles(param), p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, OptimizerUpdateTest,
    ::testing::Combine(::testing::ValuesIn(Cases()),
                       ::testing::Values(DType::kF32, DType::kBF16)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_" + ShortName(std::get<1>(info.param));
    });

TEST(OptimizerUpdateArgsTest, AdamWithoutMomentsIsInvalid) {
  CpuOps ops;
  Tensor param = MakeRandom(ops, DType::kF32, {4}, 1);
  Tensor grad = MakeRandom(ops, DType::kF32, {4}, 2);
  Tensor norm_sq = MakeTensor(ops, DType::kF32, {1}, {1.0f});
  OptimizerUpdateArgs args;
  args.rule = Rule::kAdam;
  const absl::Status status = ops.OptimizerUpdate(args, grad, norm_sq, &param, nullptr, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("mu"), std::string::npos) << status;
  Tensor short_mu = MakeEmpty(ops, DType::kF32, {3});
  Tensor nu = MakeEmpty(ops, DType::kF32, {4});
  EXPECT_EQ(ops.OptimizerUpdate(args, grad, norm_sq, &param, &short_mu, &nu).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te
