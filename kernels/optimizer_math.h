// The scalars of one optimizer step, from the step count: optax's learning
// rate schedules and Adam's bias corrections in float64, rounded once to the
// float32 OptimizerUpdateArgs the elementwise rules take (ops.h), or to a
// chain's ChainStepArgs, and the chain's elementwise math (ApplyLinks). One
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

// One schedule node at `step`, in float64, as optax's schedule functions
// compute it (kJoin is resolved by LearningRateAt).
TE_HOST_DEVICE inline double ScheduleLeafAt(const ScheduleTable& table, const ScheduleNode& n,
                                            int64_t step) {
  switch (n.kind) {
    case ScheduleNode::Kind::kConstant:
    case ScheduleNode::Kind::kJoin:
      return n.init_value;
    case ScheduleNode::Kind::kPolynomial: {
      // transition_steps <= 0: held at init_value; a negative begin is 0.
      if (n.steps <= 0) return n.init_value;
      const int64_t begin = n.begin < 0 ? 0 : n.begin;
      int64_t c = step - begin;
      c = c < 0 ? 0 : (c > n.steps ? n.steps : c);
      const double frac = 1.0 - static_cast<double>(c) / static_cast<double>(n.steps);
      return (n.init_value - n.end_value) * pow(frac, n.power) + n.end_value;
    }
    case ScheduleNode::Kind::kCosineDecay: {
      const double c = static_cast<double>(step < n.steps ? step : n.steps);
      const double cosine =
          0.5 * (1.0 + cos(3.14159265358979323846 * c / static_cast<double>(n.steps)));
      return n.init_value * ((1.0 - n.alpha) * pow(cosine, n.power) + n.alpha);
    }
    case ScheduleNode::Kind::kExponentialDecay: {
      // transition_steps <= 0 or decay_rate 0: held at init_value.
      if (n.steps <= 0 || n.rate == 0.0) return n.init_value;
      const int64_t begin = n.begin < 0 ? 0 : n.begin;
      const int64_t decreased = step - begin;
      double p = static_cast<double>(decreased) / static_cast<double>(n.steps);
      if (n.staircase) p = floor(p);
      double v = decreased <= 0 ? n.init_value : n.init_value * pow(n.rate, p);
      if (n.has_end) {
        // end_value bounds the decay from below (rate < 1) or above.
        if (n.rate < 1.0) {
          v = v > n.end_value ? v : n.end_value;
        } else {
          v = v < n.end_value ? v : n.end_value;
        }
      }
      return v;
    }
    case ScheduleNode::Kind::kPiecewiseConstant: {
      double v = n.init_value;
      for (int32_t i = 0; i < n.num; ++i) {
        const ScheduleKnot& k = table.knots[n.first + i];
        if (step >= k.step) v = k.scale * v;
      }
      return v;
    }
  }
  return 0.0;
}

// The learning rate of `node` (-1: none, 0) at step `count` (0 for the
// first update), in float64. A join picks, like optax's chain of
// jnp.where, the last schedule whose boundary the step has reached and
// counts from that boundary; joins nest.
TE_HOST_DEVICE inline double LearningRateAt(const ScheduleTable& table, int32_t node,
                                            int64_t count) {
  if (node < 0 || node >= table.num_nodes) return 0.0;
  int64_t step = count;
  // Bounded: a node's children come before it in the table (the server
  // builds it so), and no walk is longer than the table.
  for (int hops = 0; hops < kMaxScheduleNodes; ++hops) {
    const ScheduleNode& n = table.nodes[node];
    if (n.kind != ScheduleNode::Kind::kJoin) return ScheduleLeafAt(table, n, step);
    int32_t child = table.knots[n.first].node;
    int64_t shift = 0;
    for (int32_t i = 1; i < n.num; ++i) {
      const ScheduleKnot& k = table.knots[n.first + i];
      if (step >= k.step) {
        child = k.node;
        shift = k.step;
      }
    }
    step -= shift;
    node = child;
  }
  return 0.0;
}

// The elementwise scalars for the step after `count` steps.
TE_HOST_DEVICE inline OptimizerUpdateArgs UpdateArgsAt(const OptimizerHyperparams& h,
                                                       int64_t count) {
  OptimizerUpdateArgs args;
  args.rule = h.rule;
  args.learning_rate = static_cast<float>(LearningRateAt(h.schedules, h.learning_rate, count));
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

// ---- chains (OptimizerHyperparams::links) -------------------------------------

// One link's float32 scalars at one step.
struct OptimizerLinkArgs {
  OptimizerLink::Kind kind = OptimizerLink::Kind::kScale;
  int32_t state = 0;
  int32_t flag = 0;
  float b1 = 0.0f, b2 = 0.0f, eps = 0.0f, eps_root = 0.0f;
  float value = 0.0f;  // kScaleByLearningRate: -lr(count)
  float bias_correction1 = 1.0f, bias_correction2 = 1.0f;  // kScaleByAdam: 1 - b^(count + 1)
};
// A chain's step: every link's scalars, and the global norm each
// clip_by_global_norm link divides by (the gradients' for a clip at link 0;
// a later clip's is the norm of the updates that reach it).
struct ChainStepArgs {
  int32_t num_links = 0;
  int32_t num_state = 0;
  OptimizerLinkArgs links[kMaxOptimizerLinks];
  float clip_norm[kMaxOptimizerLinks];
};

TE_HOST_DEVICE inline ChainStepArgs ChainArgsAt(const OptimizerHyperparams& h, int64_t count) {
  ChainStepArgs c;
  c.num_links = h.num_links;
  c.num_state = h.num_state;
  const double t = static_cast<double>(count) + 1.0;
  for (int k = 0; k < h.num_links && k < kMaxOptimizerLinks; ++k) {
    const OptimizerLink& l = h.links[k];
    OptimizerLinkArgs& a = c.links[k];
    a.kind = l.kind;
    a.state = l.state;
    a.flag = l.flag;
    a.b1 = static_cast<float>(l.b1);
    a.b2 = static_cast<float>(l.b2);
    a.eps = static_cast<float>(l.eps);
    a.eps_root = static_cast<float>(l.eps_root);
    a.value = static_cast<float>(l.value);
    if (l.kind == OptimizerLink::Kind::kScaleByAdam) {
      a.bias_correction1 = static_cast<float>(1.0 - pow(l.b1, t));
      a.bias_correction2 = static_cast<float>(1.0 - pow(l.b2, t));
    }
    if (l.kind == OptimizerLink::Kind::kScaleByLearningRate) {
      a.value = static_cast<float>(-LearningRateAt(h.schedules, l.schedule, count));
    }
    c.clip_norm[k] = 0.0f;
  }
  return c;
}

// jnp.sign: -1, 0 or 1, NaN for NaN.
TE_HOST_DEVICE inline float SignOf(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

// Links [0, end) of a chain on one element, in float32: u the incoming
// update (the gradient), p the param, state the slot's state values at this
// element (read and written in place; a norm pass works on a copy). Returns
// the update after link end - 1.
TE_HOST_DEVICE inline float ApplyLinks(const ChainStepArgs& c, int end, float u, float p,
                                       float* state) {
  for (int k = 0; k < end; ++k) {
    const OptimizerLinkArgs& a = c.links[k];
    float* s = state + a.state;
    switch (a.kind) {
      case OptimizerLink::Kind::kTrace: {
        const float t = u + a.b1 * s[0];
        s[0] = t;
        u = a.flag ? u + a.b1 * t : t;
        break;
      }
      case OptimizerLink::Kind::kScaleByAdam: {
        const float m = (1.0f - a.b1) * u + a.b1 * s[0];
        const float v = (1.0f - a.b2) * (u * u) + a.b2 * s[1];
        s[0] = m;
        s[1] = v;
        u = (m / a.bias_correction1) / (sqrtf(v / a.bias_correction2 + a.eps_root) + a.eps);
        break;
      }
      case OptimizerLink::Kind::kScaleByRms: {
        const float v = (1.0f - a.b2) * (u * u) + a.b2 * s[0];
        s[0] = v;
        const float scaling = a.flag ? 1.0f / sqrtf(v + a.eps) : 1.0f / (sqrtf(v) + a.eps);
        u = scaling * u;
        break;
      }
      case OptimizerLink::Kind::kScaleByStddev: {
        const float m = (1.0f - a.b2) * u + a.b2 * s[0];
        const float v = (1.0f - a.b2) * (u * u) + a.b2 * s[1];
        s[0] = m;
        s[1] = v;
        const float var = v - m * m;
        const float scaling = a.flag ? 1.0f / sqrtf(var + a.eps) : 1.0f / (sqrtf(var) + a.eps);
        u = scaling * u;
        break;
      }
      case OptimizerLink::Kind::kScaleByLion: {
        const float x = (1.0f - a.b1) * u + a.b1 * s[0];
        s[0] = (1.0f - a.b2) * u + a.b2 * s[0];
        u = SignOf(x);
        break;
      }
      case OptimizerLink::Kind::kClipByGlobalNorm: {
        const float n = c.clip_norm[k];
        if (!(n < a.value)) u = u / n * a.value;
        break;
      }
      case OptimizerLink::Kind::kClip:
        // jnp.clip(u, -max_delta, max_delta), NaN kept.
        u = u < -a.value ? -a.value : (u > a.value ? a.value : u);
        break;
      case OptimizerLink::Kind::kScale:
      case OptimizerLink::Kind::kScaleByLearningRate:
        u = u * a.value;
        break;
      case OptimizerLink::Kind::kAddDecayedWeights:
        u = u + a.value * p;
        break;
    }
  }
  return u;
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
  const bool chain = h.num_links > 0;
  if (h.num_links < 0 || h.num_links > kMaxOptimizerLinks || h.num_state < 0 ||
      h.num_state > kMaxSlotState || h.schedules.num_nodes < 0 ||
      h.schedules.num_nodes > kMaxScheduleNodes || h.schedules.num_knots < 0 ||
      h.schedules.num_knots > kMaxScheduleKnots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NewOptimizerPlan: ", h.num_links, " links, ", h.num_state, " state tensors, ",
        h.schedules.num_nodes, " schedule nodes, ", h.schedules.num_knots,
        " knots; at most ", kMaxOptimizerLinks, ", ", kMaxSlotState, ", ", kMaxScheduleNodes,
        ", ", kMaxScheduleKnots));
  }
  for (int k = 0; k < h.num_links; ++k) {
    const OptimizerLink& l = h.links[k];
    int wants = 0;
    switch (l.kind) {
      case OptimizerLink::Kind::kTrace:
      case OptimizerLink::Kind::kScaleByRms:
      case OptimizerLink::Kind::kScaleByLion:
        wants = 1;
        break;
      case OptimizerLink::Kind::kScaleByAdam:
      case OptimizerLink::Kind::kScaleByStddev:
        wants = 2;
        break;
      case OptimizerLink::Kind::kClipByGlobalNorm:
      case OptimizerLink::Kind::kClip:
      case OptimizerLink::Kind::kScale:
      case OptimizerLink::Kind::kAddDecayedWeights:
      case OptimizerLink::Kind::kScaleByLearningRate:
        break;
    }
    if (l.state < 0 || l.state + wants > h.num_state) {
      return absl::InvalidArgumentError(absl::StrCat("NewOptimizerPlan: links[", k, "] keeps ",
                                                     wants, " state tensors from ", l.state,
                                                     "; the slots have ", h.num_state));
    }
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    const OptimizerSlot& s = slots[i];
    const DType p = s.param.dtype();
    if (p != DType::kF32 && p != DType::kBF16 && p != DType::kF16) {
      return absl::InvalidArgumentError(absl::StrCat("NewOptimizerPlan: slots[", i, "].param is ",
                                                     DTypeName(p), "; want a float dtype"));
    }
    if (s.param.numel() == 0) continue;  // nothing to update
    if (s.compute_copy.data() != nullptr) {
      const DType c = s.compute_copy.dtype();
      if ((c != DType::kBF16 && c != DType::kF16) || c == p ||
          s.compute_copy.numel() != s.param.numel()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "NewOptimizerPlan: slots[", i, "].compute_copy is ", DTypeName(c), " ",
            ShapeString(s.compute_copy.shape()), "; want bf16 or f16, not the param's ",
            DTypeName(p), ", of the param's ", s.param.numel(), " elements"));
      }
    }
    if (chain) {
      if (s.mu.data() != nullptr || s.nu.data() != nullptr ||
          static_cast<int>(s.state.size()) != h.num_state) {
        return absl::InvalidArgumentError(
            absl::StrCat("NewOptimizerPlan: slots[", i, "]: a chain keeps ", h.num_state,
                         " state tensors in `state` and no mu or nu; got ", s.state.size()));
      }
      for (const Tensor& t : s.state) {
        if (t.data() == nullptr || t.dtype() != p || t.numel() != s.param.numel()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "NewOptimizerPlan: slots[", i, "]: a state tensor is ", DTypeName(t.dtype()), " ",
              ShapeString(t.shape()), "; want the param's ", DTypeName(p), " ",
              ShapeString(s.param.shape())));
        }
      }
      if (s.fp8.data.data() != nullptr) {
        absl::Status fp8 = CheckOptimizerFp8Copy(i, s);
        if (!fp8.ok()) return fp8;
      }
      continue;
    }
    if (!s.state.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("NewOptimizerPlan: slots[", i, "].state is given; only a chain keeps it"));
    }
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
