// The scalars of one optimizer step, from the step count: optax's learning
// rate schedules and Adam's bias corrections in float64, rounded once to the
// float32 OptimizerUpdateArgs the elementwise rules take (ops.h). One
// definition for the CPU reference, the CUDA step (which evaluates it on the
// device, from the count the device holds) and the server's reports.
#ifndef TE_KERNELS_OPTIMIZER_MATH_H_
#define TE_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/ops.h"

#ifdef __CUDACC__
#define TE_HOST_DEVICE __host__ __device__
#else
#define TE_HOST_DEVICE
#endif

namespace te {

// The learning rate at step `count` (0 for the first update), in float64:
// the constant, or optax.warmup_cosine_decay_schedule (linear warmup from
// init_value to peak_value over warmup_steps, then cosine decay to end_value
// at decay_steps, raised to `exponent`).
TE_HOST_DEVICE inline double LearningRateAt(const LearningRateSchedule& s, int64_t count) {
  if (!s.warmup_cosine) return s.value;
  const double step = static_cast<double>(count);
  if (step < static_cast<double>(s.warmup_steps)) {
    // optax.linear_schedule(init_value, peak_value, warmup_steps).
    const double frac = 1.0 - step / static_cast<double>(s.warmup_steps);
    return (s.init_value - s.peak_value) * frac + s.peak_value;
  }
  // optax.cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent).
  const double span = static_cast<double>(s.decay_steps - s.warmup_steps);
  const double since = step - static_cast<double>(s.warmup_steps);
  const double t = since < span ? since : span;
  const double alpha = s.peak_value == 0.0 ? 0.0 : s.end_value / s.peak_value;
  const double cosine = 0.5 * (1.0 + cos(3.14159265358979323846 * t / span));
  return s.peak_value * ((1.0 - alpha) * pow(cosine, s.exponent) + alpha);
}

// The elementwise scalars for the step after `count` steps.
TE_HOST_DEVICE inline OptimizerUpdateArgs UpdateArgsAt(const OptimizerHyperparams& h,
                                                       int64_t count) {
  OptimizerUpdateArgs args;
  args.rule = h.rule;
  args.learning_rate = static_cast<float>(LearningRateAt(h.learning_rate, count));
  if (h.rule == OptimizerUpdateArgs::Rule::kSgd) {
    args.momentum = static_cast<float>(h.momentum);
    args.nesterov = h.nesterov;
  } else {
    // optax's bias correction uses the count after this step.
    const double t = static_cast<double>(count) + 1.0;
    args.b1 = static_cast<float>(h.b1);
    args.b2 = static_cast<float>(h.b2);
    args.eps = static_cast<float>(h.eps);
    args.eps_root = static_cast<float>(h.eps_root);
    args.bias_correction1 = static_cast<float>(1.0 - pow(h.b1, t));
    args.bias_correction2 = static_cast<float>(1.0 - pow(h.b2, t));
    args.weight_decay = static_cast<float>(h.weight_decay);
  }
  args.max_norm = static_cast<float>(h.max_norm);
  return args;
}

// The counters after a step (int32, as optax's; saturating, not wrapping).
TE_HOST_DEVICE inline int32_t SaturatingIncrement(int32_t v, bool by_one) {
  return by_one && v < INT32_MAX ? v + 1 : v;
}

// OptimizerStep's argument checks, shared by both backends (host only).
inline absl::Status CheckOptimizerStepArgs(const OptimizerPlan& plan,
                                           const std::vector<OptimizerSlot>& slots,
                                           const std::vector<Tensor>& grads, const Tensor* count,
                                           const Tensor* total_notfinite) {
  if (count == nullptr || total_notfinite == nullptr ||
      !plan.Matches(slots, *count, *total_notfinite)) {
    return absl::InvalidArgumentError(
        "OptimizerStep: slots, count or total_notfinite are not the tensors the plan was made "
        "for; make a new plan (NewOptimizerPlan)");
  }
  if (grads.size() != slots.size()) {
    return absl::InvalidArgumentError(absl::StrCat("OptimizerStep: ", grads.size(),
                                                   " grads for ", slots.size(), " slots"));
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].data() == nullptr && grads[i].numel() != 0) continue;  // no gradient
    const DType g = grads[i].dtype();
    if (g != DType::kF32 && g != DType::kBF16 && g != DType::kF16) {
      return absl::InvalidArgumentError(absl::StrCat("OptimizerStep: grads[", i, "] is ",
                                                     DTypeName(g), "; want a float dtype"));
    }
    if (grads[i].numel() != slots[i].param.numel()) {
      return absl::InvalidArgumentError(
          absl::StrCat("OptimizerStep: grads[", i, "] has ", grads[i].numel(),
                       " elements; its param has ", slots[i].param.numel()));
    }
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const Tensor& scale = slots[i].fp8.scale;
    if (slots[i].fp8.data.data() == nullptr || slots[i].param.numel() == 0) continue;
    if (scale.data() == nullptr || scale.dtype() != DType::kF32 || scale.numel() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OptimizerStep: slots[", i, "].fp8.scale must be f32 [1] (the FP8 copy's scale)"));
    }
  }
  return absl::OkStatus();
}

// An FP8 copy that fits its param (OptimizerFp8Copy), for NewOptimizerPlan.
inline absl::Status CheckOptimizerFp8Copy(size_t i, const OptimizerSlot& s) {
  const OptimizerFp8Copy& c = s.fp8;
  const std::string field = absl::StrCat("NewOptimizerPlan: slots[", i, "].fp8");
  const DType d = c.data.dtype();
  if (d != DType::kE4M3 && d != DType::kE5M2) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data is ", DTypeName(d), "; want E4M3 or E5M2"));
  }
  if (c.data.rank() != 2 || c.data.numel() != s.param.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data is ", ShapeString(c.data.shape()), "; want [rows, cols] of the param's ",
        s.param.numel(), " elements"));
  }
  const Shape transposed = {c.data.dim(1), c.data.dim(0)};
  if (c.data_t.data() == nullptr || c.data_t.dtype() != d || c.data_t.shape() != transposed) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data_t is ",
                                                   ShapeString(c.data_t.shape()), " ",
                                                   DTypeName(c.data_t.dtype()), "; want ",
                                                   ShapeString(transposed), " ", DTypeName(d)));
  }
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"scale_inv", &c.scale_inv},
                                {"kept_scale", &c.kept_scale},
                                {"kept_amax", &c.kept_amax}}) {
    if (t->data() == nullptr || t->dtype() != DType::kF32 || t->numel() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".", name, " must be f32 [1]"));
    }
  }
  return absl::OkStatus();
}

// NewOptimizerPlan's checks: float params, moments as OptimizerUpdate wants
// them for the rule, int32 [1] counters.
inline absl::Status CheckOptimizerPlanArgs(const OptimizerHyperparams& h,
                                           const std::vector<OptimizerSlot>& slots,
                                           const Tensor& count, const Tensor& total_notfinite) {
  const bool adam = h.rule == OptimizerUpdateArgs::Rule::kAdam;
  for (size_t i = 0; i < slots.size(); ++i) {
    const OptimizerSlot& s = slots[i];
    const DType p = s.param.dtype();
    if (p != DType::kF32 && p != DType::kBF16 && p != DType::kF16) {
      return absl::InvalidArgumentError(absl::StrCat("NewOptimizerPlan: slots[", i, "].param is ",
                                                     DTypeName(p), "; want a float dtype"));
    }
    if (s.param.numel() == 0) continue;  // nothing to update
    const bool has_mu = s.mu.data() != nullptr;
    const bool has_nu = s.nu.data() != nullptr;
    if (adam && (!has_mu || !has_nu)) {
      return absl::InvalidArgumentError(
          absl::StrCat("NewOptimizerPlan: slots[", i, "]: adam needs mu and nu"));
    }
    if (!adam && has_nu) {
      return absl::InvalidArgumentError(
          absl::StrCat("NewOptimizerPlan: slots[", i, "].nu is given; sgd keeps no nu"));
    }
    for (const auto* m : {&s.mu, &s.nu}) {
      if (m->data() == nullptr) continue;
      if (m->dtype() != p || m->numel() != s.param.numel()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "NewOptimizerPlan: slots[", i, "]: a moment is ", DTypeName(m->dtype()), " ",
            ShapeString(m->shape()), "; want the param's ", DTypeName(p), " ",
            ShapeString(s.param.shape())));
      }
    }
    if (s.fp8.data.data() != nullptr) {
      absl::Status fp8 = CheckOptimizerFp8Copy(i, s);
      if (!fp8.ok()) return fp8;
    }
  }
  for (const auto* c : {&count, &total_notfinite}) {
    if (c->dtype() != DType::kI32 || c->numel() != 1 || c->data() == nullptr) {
      return absl::InvalidArgumentError(
          "NewOptimizerPlan: count and total_notfinite must be int32 [1]");
    }
  }
  return absl::OkStatus();
}

}  // namespace te

#endif  // TE_KERNELS_OPTIMIZER_MATH_H_
