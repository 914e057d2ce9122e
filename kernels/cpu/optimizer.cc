// OptimizerUpdate: optax's elementwise update rules (ops.h), the reference.
#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {

absl::Status CpuOps::OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                                     const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                                     Tensor* nu) {
  RETURN_IF_ERROR(CheckOptimizerUpdateArgs(args, grad, grad_norm_sq, param, mu, nu));
  const float norm_sq = LoadAsFloat(grad_norm_sq, 0);
  if (!std::isfinite(norm_sq)) return absl::OkStatus();  // apply_if_finite: the step is skipped
  const float norm = std::sqrt(norm_sq);
  const bool clip = args.max_norm > 0.0f && !(norm < args.max_norm);
  const bool adam = args.rule == OptimizerUpdateArgs::Rule::kAdam;
  const bool trace = !adam && Wanted(mu);
  for (int64_t i = 0; i < param->numel(); ++i) {
    float g = LoadAsFloat(grad, i);
    if (clip) g = g / norm * args.max_norm;
    const float p = LoadAsFloat(*param, i);
    float u = g;
    if (adam) {
      const float m = (1.0f - args.b1) * g + args.b1 * LoadAsFloat(*mu, i);
      const float v = (1.0f - args.b2) * (g * g) + args.b2 * LoadAsFloat(*nu, i);
      StoreFromFloat(mu, i, m);
      StoreFromFloat(nu, i, v);
      u = (m / args.bias_correction1) /
          (std::sqrt(v / args.bias_correction2 + args.eps_root) + args.eps);
    } else if (trace) {
      const float t = g + args.momentum * LoadAsFloat(*mu, i);
      StoreFromFloat(mu, i, t);
      u = args.nesterov ? g + args.momentum * t : t;
    }
    u += args.weight_decay * p;
    StoreFromFloat(param, i, p - args.learning_rate * u);
  }
  return absl::OkStatus();
}

}  // namespace te
