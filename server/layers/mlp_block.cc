// The Mlp block (TE's LayerNormMLP core) and activation-name parsing.
#include <algorithm>
#include <cctype>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

NormConfig MlpNormConfig(const MlpConfig& c) {
  NormConfig n;
  n.scope = c.scope;
  n.args = c.norm;
  n.hidden = c.hidden;
  n.param_dtype = c.param_dtype;
  return n;
}

DenseConfig MlpDenseConfig(const MlpConfig& c, bool first) {
  DenseConfig d;
  d.scope = c.scope;
  d.kernel_name = first ? "wi_kernel" : "wo_kernel";
  d.bias_name = first ? "wi_bias" : "wo_bias";
  d.use_bias = c.use_bias;
  d.fp8_postfix = first ? "_0" : "_1";
  d.in_dims = first ? Shape{c.hidden} : Shape{c.intermediate};
  d.features = first ? Shape{static_cast<int64_t>(c.activations.size()), c.intermediate}
                     : Shape{c.hidden};
  d.param_dtype = c.param_dtype;
  // TE initialises each activation's (hidden, inter) slice of wi_kernel on its
  // own, so the fan-in is `hidden`, not hidden * n_act.
  d.kernel_init = first ? KernelInit({c.hidden, c.intermediate})
                        : KernelInit({c.intermediate, c.hidden});
  return d;
}

LayerNormDenseConfig MlpLnWiConfig(const MlpConfig& c) {
  LayerNormDenseConfig l;
  l.enable_layernorm = c.enable_layernorm;
  l.norm = MlpNormConfig(c);
  l.dense = MlpDenseConfig(c, true);
  return l;
}

}  // namespace

Mlp::Mlp(MlpConfig config)
    : config_(std::move(config)),
      ln_wi_(MlpLnWiConfig(config_)),
      wo_(MlpDenseConfig(config_, false)) {}

std::vector<VariableDef> Mlp::Defs(const Fp8Recipe* fp8) const {
  std::vector<VariableDef> defs = ln_wi_.Defs(fp8);
  for (VariableDef& def : wo_.Defs(fp8)) defs.push_back(std::move(def));
  return defs;
}

int64_t Mlp::Saved::bytes() const {
  return ln_wi.bytes() + TensorBytes(h) + dropout.bytes() + wo.bytes();
}

bool Mlp::LoneGelu() const {
  return config_.activations.size() == 1 && config_.activations[0] == Activation::kGelu;
}

absl::Status Mlp::Forward(Ops& ops, Variables* vars, const Tensor& x, const ForwardOptions& opts,
                          Tensor* y, Tensor* ln_out, Saved* saved, const Tensor& residual) const {
  // Every variable (both GEMMs' FP8 state too) is checked first, so a failure
  // writes no amax.
  RETURN_IF_ERROR(CheckVariables(*vars, specs_.Get(opts.fp8, [&] { return Defs(opts.fp8); })));
  const bool keep = saved != nullptr;
  Saved s;
  DenseFusion wo_fusion;
  wo_fusion.residual = residual;
  const float rate = config_.intermediate_dropout_rate;
  if (opts.fp8 == nullptr && LoneGelu()) {
    // The GELU in wi's GEMM epilogue: h only as the GELU's saved input.
    Tensor act, dropped;
    DenseFusion wi_fusion;
    wi_fusion.gelu_input = &s.h;
    RETURN_IF_ERROR(ln_wi_.Forward(ops, vars, x, nullptr, opts.tf32, &act, ln_out,
                                   keep ? &s.ln_wi : nullptr, wi_fusion));
    RETURN_IF_ERROR(Dropout(
        ops, rate, opts.deterministic,
        DeriveSeed(opts.dropout_seed, JoinScope(config_.scope, "intermediate_dropout")), act,
        &dropped, &s.dropout));
    RETURN_IF_ERROR(wo_.Forward(ops, vars, dropped, nullptr, opts.tf32, y, keep ? &s.wo : nullptr, wo_fusion));
    if (keep) *saved = std::move(s);
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(
      ln_wi_.Forward(ops, vars, x, opts.fp8, opts.tf32, &s.h, ln_out, keep ? &s.ln_wi : nullptr));
  const int64_t n = s.h.dim(0);
  if (CanFuseQuantize(opts.fp8) && (opts.deterministic || rate <= 0.0f)) {
    // Nothing between the activation and wo: write the activation in FP8.
    Fp8Output q;
    ASSIGN_OR_RETURN(GemmOperand act_q,
                     AllocateFusedOperand(ops, *opts.fp8, wo_.quantizers(), QuantizerRole::kX,
                                          {n, config_.intermediate}, vars, &q));
    // wo's forward GEMM takes it as is; kept for a backward, the activation
    // also writes it transposed, for wo's wgrad.
    if (keep) {
      ASSIGN_OR_RETURN(act_q.data_t,
                       ops.Allocate(act_q.data.dtype(), {config_.intermediate, n}));
      RETURN_IF_ERROR(ops.ActivationForwardTransposed(config_.activations, s.h, q, &act_q.data,
                                                      &act_q.data_t));
    } else {
      RETURN_IF_ERROR(ops.ActivationForward(config_.activations, s.h, &act_q.data, &q));
    }
    RETURN_IF_ERROR(wo_.ForwardQuantized(ops, vars, act_q, s.h.dtype(), *opts.fp8, y,
                                         keep ? &s.wo : nullptr, wo_fusion));
  } else {
    ASSIGN_OR_RETURN(Tensor act, ops.Allocate(s.h.dtype(), {n, config_.intermediate}));
    RETURN_IF_ERROR(ops.ActivationForward(config_.activations, s.h, &act));
    Tensor dropped;
    RETURN_IF_ERROR(Dropout(
        ops, rate, opts.deterministic,
        DeriveSeed(opts.dropout_seed, JoinScope(config_.scope, "intermediate_dropout")), act,
        &dropped, &s.dropout));
    RETURN_IF_ERROR(
        wo_.Forward(ops, vars, dropped, opts.fp8, opts.tf32, y, keep ? &s.wo : nullptr, wo_fusion));
  }
  if (keep) *saved = std::move(s);
  return absl::OkStatus();
}

absl::Status Mlp::Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy, Tensor* dx,
                           Variables* grads, const Tensor& residual_grad) const {
  // The GELU's backward is not cuBLASLt's DGELU_BGRAD epilogue: that runs as
  // a separate pass after the GEMM anyway, slower than a kernel of its own
  // plus the bias sum (bench/results/2026-11-30-h200-fused-epilogues.md).
  Tensor ddropped, dact;
  RETURN_IF_ERROR(wo_.Backward(ops, vars, std::move(saved.wo), std::move(dy), &ddropped, grads));
  RETURN_IF_ERROR(DropoutGrad(ops, saved.dropout, ddropped, &dact));
  ddropped = Tensor();
  saved.dropout = DropoutSaved();
  const bool same_layout = dact.shape() == saved.h.shape() && dact.dtype() == saved.h.dtype();
  const std::optional<Fp8Recipe> fp8 = saved.ln_wi.dense.fp8;
  if (same_layout && fp8 && CanFuseQuantize(&*fp8) && !fp8->inference &&
      saved.h.rank() == 2) {
    // Under DelayedScaling wi's output gradient dh is written straight in
    // FP8, both layouts, with its bias gradient from the same pass (TE's
    // dact-cast-transpose-dbias): dh in bf16 is never written nor read back,
    // two passes over [N, n_act * inter] a layer. The price is memory for a
    // moment: dact, h and dh's two FP8 layouts coexist (one [N, inter] bf16
    // tensor's bytes more than writing dh over dact would hold).
    ASSIGN_OR_RETURN(Dense::QuantizedGrad dh,
                     ln_wi_.dense().AllocateQuantizedGrad(ops, *fp8, saved.h.dim(0), vars));
    RETURN_IF_ERROR(ops.ActivationBackwardQuantizeTranspose(
        config_.activations, &dact, saved.h, dh.fp8, &dh.dy.data, &dh.dy.data_t,
        dh.dbias.defined() ? &dh.dbias : nullptr));
    const DType compute = saved.h.dtype();
    dact = Tensor();
    saved.h = Tensor();
    return ln_wi_.BackwardQuantized(ops, std::move(saved.ln_wi), std::move(dh.dy),
                                    std::move(dh.dbias), compute, dx, grads, residual_grad);
  }
  Tensor dh;
  if (same_layout) {
    // One activation: dh [N, inter] overwrites dact, which nothing reads
    // after (ActivationBackward may write dx over dy), so the backward's
    // largest step holds two [N, inter] tensors, not three.
    dh = dact;
  } else {
    ASSIGN_OR_RETURN(dh, ops.Allocate(saved.h.dtype(), saved.h.shape()));
  }
  RETURN_IF_ERROR(ops.ActivationBackward(config_.activations, dact, saved.h, &dh));
  // [N, n_act * inter] twice: the largest tensors of the backward, read for
  // the last time.
  dact = Tensor();
  saved.h = Tensor();
  return ln_wi_.Backward(ops, vars, std::move(saved.ln_wi), std::move(dh), dx, grads,
                         residual_grad);
}

absl::StatusOr<std::vector<Activation>> ParseActivations(const std::vector<std::string>& names,
                                                         absl::string_view field) {
  static const std::pair<const char*, Activation> kNames[] = {
      {"gelu", Activation::kGelu},
      {"silu", Activation::kSilu},
      {"relu", Activation::kRelu},
      {"quick_gelu", Activation::kQuickGelu},
      {"squared_relu", Activation::kSquaredRelu},
      {"linear", Activation::kLinear},
  };
  std::vector<Activation> acts;
  for (const std::string& raw : names) {
    std::string name = raw;
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    const auto* found = std::find_if(std::begin(kNames), std::end(kNames),
                                     [&](const auto& entry) { return name == entry.first; });
    if (found == std::end(kNames)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": unknown activation \"", raw,
          "\" (gelu, silu, relu, quick_gelu, squared_relu, linear)"));
    }
    acts.push_back(found->second);
  }
  // TE normalises ("linear", act) to (act, "linear").
  if (acts.size() == 2 && acts[0] == Activation::kLinear) std::swap(acts[0], acts[1]);
  const bool single = acts.size() == 1;
  const bool gated = acts.size() == 2 && acts[0] != Activation::kLinear &&
                     acts[1] == Activation::kLinear;
  if (!single && !gated) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": [", absl::StrJoin(names, ", "),
        "] is not an activation TE implements: one activation, or a gated pair (act, "
        "\"linear\") with act in gelu, silu, relu, quick_gelu, squared_relu"));
  }
  return acts;
}

}  // namespace te::layers
