// OptimizerUpdate: optax's elementwise update rules (ops.h), the reference;
// OptimizerStep: the whole step over a plan's slots, defined by the per-tensor
// rule and optimizer_math.h's scalars (or a chain's links, ApplyLinks), and
// the slots' FP8 copies as QuantizeTranspose makes them and their compute
// copies as Cast does.
#include <cmath>
#include <cstring>
#include <memory>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"
#include "kernels/optimizer_math.h"
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

namespace {

// The CPU needs no device tables: the plan is the remembered layout and the
// info record.
class CpuOptimizerPlan : public OptimizerPlan {
 public:
  CpuOptimizerPlan(const OptimizerHyperparams& h, const std::vector<OptimizerSlot>& slots,
                   const Tensor& count, const Tensor& total_notfinite, Tensor info) {
    Remember(h, slots, count, total_notfinite);
    info_ = std::move(info);
  }
};

// The copy exactly as the next forward's QuantizeTransposeKept would make it
// from the new param: QuantizeTranspose, then the kept record.
absl::Status WriteFp8Copy(Ops& ops, const Tensor& param, const OptimizerFp8Copy& copy) {
  Fp8Output out;
  out.scale = copy.scale;
  out.amax = copy.kept_amax;
  out.scale_inv = copy.scale_inv;
  Tensor data = copy.data, data_t = copy.data_t, kept_scale = copy.kept_scale;
  RETURN_IF_ERROR(ops.QuantizeTranspose(param.Reshaped(data.shape()), out, &data, &data_t));
  return ops.Copy(copy.scale, &kept_scale);
}

// A chain's update of every slot with a gradient (the step is applied):
// each clip_by_global_norm after the first link first takes the norm of the
// updates reaching it (a pass over every slot that leaves the state alone,
// squares added in float64 and rounded once, as the gradients' norm), then
// one pass runs every link and writes state and params.
absl::Status ChainUpdate(const OptimizerHyperparams& h, int32_t count, float grad_norm_sq,
                         const std::vector<OptimizerSlot>& slots,
                         const std::vector<Tensor>& grads) {
  ChainStepArgs args = ChainArgsAt(h, count);
  float state[kMaxSlotState];
  auto load_state = [&](const OptimizerSlot& slot, int64_t i) {
    for (int j = 0; j < args.num_state; ++j) state[j] = LoadAsFloat(slot.state[j], i);
  };
  for (int k = 0; k < args.num_links; ++k) {
    if (args.links[k].kind != OptimizerLink::Kind::kClipByGlobalNorm) continue;
    if (k == 0) {
      args.clip_norm[k] = std::sqrt(grad_norm_sq);
      continue;
    }
    double sum64 = 0.0;
    for (size_t s = 0; s < slots.size(); ++s) {
      if (grads[s].data() == nullptr || slots[s].param.numel() == 0) continue;
      for (int64_t i = 0; i < slots[s].param.numel(); ++i) {
        load_state(slots[s], i);
        const double u =
            ApplyLinks(args, k, LoadAsFloat(grads[s], i), LoadAsFloat(slots[s].param, i), state);
        sum64 += u * u;
      }
    }
    args.clip_norm[k] = std::sqrt(static_cast<float>(sum64));
  }
  for (size_t s = 0; s < slots.size(); ++s) {
    if (grads[s].data() == nullptr || slots[s].param.numel() == 0) continue;
    Tensor param = slots[s].param;
    for (int64_t i = 0; i < param.numel(); ++i) {
      load_state(slots[s], i);
      const float p = LoadAsFloat(param, i);
      const float u = ApplyLinks(args, args.num_links, LoadAsFloat(grads[s], i), p, state);
      for (int j = 0; j < args.num_state; ++j) {
        Tensor t = slots[s].state[j];
        StoreFromFloat(&t, i, state[j]);
      }
      StoreFromFloat(&param, i, p + u);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<OptimizerPlan>> CpuOps::NewOptimizerPlan(
    const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
    const Tensor& count, const Tensor& total_notfinite) {
  RETURN_IF_ERROR(CheckOptimizerPlanArgs(hyperparams, slots, count, total_notfinite));
  ASSIGN_OR_RETURN(Tensor info, Allocate(DType::kI32, {6}));
  std::memset(info.data(), 0, info.nbytes());
  return std::unique_ptr<OptimizerPlan>(
      new CpuOptimizerPlan(hyperparams, slots, count, total_notfinite, std::move(info)));
}

absl::Status CpuOps::OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                                   const std::vector<Tensor>& grads, Tensor* count,
                                   Tensor* total_notfinite) {
  RETURN_IF_ERROR(CheckOptimizerStepArgs(plan, slots, grads, count, total_notfinite));
  // optax.global_norm squared, the reference's way: every square added in
  // float64, rounded once to float32. A float32 running sum over a layer's
  // gradients drifts by ~sqrt(n) ulps (3e-5 relative at 190 K elements),
  // more than the backends may differ by.
  ASSIGN_OR_RETURN(Tensor norm_sq, Allocate(DType::kF32, {1}));
  double sum64 = 0.0;
  for (const Tensor& g : grads) {
    if (g.data() == nullptr) continue;
    for (int64_t i = 0; i < g.numel(); ++i) {
      const double x = LoadAsFloat(g, i);
      sum64 += x * x;
    }
  }
  const float sum = static_cast<float>(sum64);
  *norm_sq.data_as<float>() = sum;
  const int32_t c = *count->data_as<int32_t>();
  const bool applied = std::isfinite(sum);
  const OptimizerHyperparams& h = plan.hyperparams();
  if (h.num_links > 0) {
    if (applied) RETURN_IF_ERROR(ChainUpdate(h, c, sum, slots, grads));
  } else {
    const OptimizerUpdateArgs args = UpdateArgsAt(h, c);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (grads[i].data() == nullptr || slots[i].param.numel() == 0) continue;
      Tensor param = slots[i].param, mu = slots[i].mu, nu = slots[i].nu;
      RETURN_IF_ERROR(OptimizerUpdate(args, grads[i], norm_sq, &param,
                                      mu.data() != nullptr ? &mu : nullptr,
                                      nu.data() != nullptr ? &nu : nullptr));
    }
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    if (grads[i].data() == nullptr || slots[i].param.numel() == 0) continue;
    if (applied && slots[i].fp8.data.data() != nullptr) {
      RETURN_IF_ERROR(WriteFp8Copy(*this, slots[i].param, slots[i].fp8));
    }
    if (applied && slots[i].compute_copy.data() != nullptr) {
      Tensor copy = slots[i].compute_copy;
      RETURN_IF_ERROR(Cast(slots[i].param.Reshaped(copy.shape()), &copy));
    }
  }
  OptimizerStepInfo info;
  info.learning_rate = LearningRateAt(h.schedules, h.learning_rate, c);
  info.grad_norm_sq = sum;
  info.applied = applied ? 1 : 0;
  info.count = SaturatingIncrement(c, applied);
  info.total_notfinite = SaturatingIncrement(*total_notfinite->data_as<int32_t>(), !applied);
  *count->data_as<int32_t>() = info.count;
  *total_notfinite->data_as<int32_t>() = info.total_notfinite;
  std::memcpy(plan.info().data(), &info, sizeof(info));
  return absl::OkStatus();
}

}  // namespace te
