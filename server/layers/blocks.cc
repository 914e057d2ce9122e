// Dense, Norm, LayerNormDense, dropout and residual add (Mlp: mlp_block.cc).
#include "server/layers/blocks.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "server/layers/fp8_weight_cache.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

bool FloatRows(const Tensor& t, int64_t cols) {
  return t.rank() == 2 && t.dim(1) == cols && IsFloating(t.dtype()) && !IsFloat8(t.dtype());
}

absl::Status CheckRows(const Tensor& t, int64_t cols, absl::string_view what) {
  if (!FloatRows(t, cols)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be a float [N, ", cols,
                                                   "] tensor, got ", ShapeString(t.shape()), " ",
                                                   DTypeName(t.dtype())));
  }
  return absl::OkStatus();
}

Shape Concat(const Shape& a, const Shape& b) {
  Shape s = a;
  s.insert(s.end(), b.begin(), b.end());
  return s;
}

}  // namespace

absl::StatusOr<bool> MatmulTf32(te::v1::Precision precision, absl::string_view field) {
  // A proto3 enum field holds any int: what is neither value is refused.
  if (precision == te::v1::PRECISION_DEFAULT) return true;
  if (precision == te::v1::PRECISION_HIGHEST) return false;
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", static_cast<int>(precision),
                                                 " is not DEFAULT (0) or HIGHEST (1)"));
}

absl::StatusOr<Tensor> NewTensor(Ops& ops, DType dtype, const Shape& shape) {
  return ops.Allocate(dtype, shape);
}

absl::StatusOr<Tensor> CastTo(Ops& ops, const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  ASSIGN_OR_RETURN(Tensor y, ops.Allocate(dtype, x.shape()));
  RETURN_IF_ERROR(ops.Cast(x, &y));
  return y;
}

// ---- Dense --------------------------------------------------------------------

Dense::Dense(DenseConfig config)
    : config_(std::move(config)),
      quantizers_(config_.scope, config_.fp8_postfix),
      in_(NumElements(config_.in_dims)),
      out_(NumElements(config_.features)) {}

Shape Dense::kernel_shape() const { return Concat(config_.in_dims, config_.features); }

std::string Dense::kernel_name() const {
  return VariableName(kParams, config_.scope, config_.kernel_name);
}

std::string Dense::bias_name() const {
  return VariableName(kParams, config_.scope, config_.bias_name);
}

std::vector<VariableDef> Dense::Defs(const Fp8Recipe* fp8) const {
  const Shape kshape = kernel_shape();
  std::vector<VariableDef> defs;
  defs.push_back({{kernel_name(), kshape, config_.param_dtype},
                  config_.kernel_init.value_or(KernelInit(kshape))});
  if (config_.use_bias) {
    defs.push_back({{bias_name(), config_.features, config_.param_dtype}, Initializer::Zeros()});
  }
  for (VariableDef& def : QuantizerSetDefs(quantizers(), fp8)) defs.push_back(std::move(def));
  return defs;
}

int64_t Dense::Saved::bytes() const {
  return x.bytes() + (kernel_owned ? kernel.bytes() : 0) + TensorBytes(x_hp) +
         TensorBytes(kernel_hp);
}

absl::Status Dense::Forward(Ops& ops, Variables* vars, const Tensor& x, const Fp8Recipe* fp8,
                            bool tf32, Tensor* y, Saved* saved,
                            const DenseFusion& fusion) const {
  if (!FloatRows(x, in_)) return CheckRows(x, in_, absl::StrCat("Dense ", kernel_name(), " input"));
  if (fusion.gelu_input != nullptr && fp8 != nullptr) {
    return absl::InternalError(absl::StrCat("Dense ", kernel_name(),
                                            ": a fused GELU needs float compute, not FP8"));
  }
  // Checked before any quantize writes an amax, so a failure changes nothing.
  RETURN_IF_ERROR(CheckVariables(*vars, specs_.Get(fp8, [&] { return Defs(fp8); })));
  if (fp8 != nullptr && IsPerTensorScaling(*fp8)) {
    // x enters the forward GEMM as is, and a backward's wgrad transposed:
    // both layouts from one pass when the forward is kept for one.
    GemmOperand a;
    if (saved != nullptr) {
      ASSIGN_OR_RETURN(a, QuantizeGemmOperandBothLayouts(ops, *fp8, quantizers(),
                                                         QuantizerRole::kX, x, GemmSide::kA,
                                                         false, vars));
    } else {
      ASSIGN_OR_RETURN(a, QuantizeGemmOperand(ops, *fp8, quantizers(), QuantizerRole::kX, x,
                                              GemmSide::kA, false, vars));
    }
    return ForwardQuantized(ops, vars, a, x.dtype(), *fp8, y, saved, fusion);
  }
  const DType compute = x.dtype();
  const Tensor kernel = vars->at(kernel_name()).Reshaped({in_, out_});
  Saved s;
  // TensorFloat-32 is for float32 operands alone: not for bfloat16 ones,
  // nor for block scaling's fake-quantized ones (their scaled codes are
  // exact in float32, not in TF32's 10 bits).
  s.tf32 = fp8 == nullptr && compute == DType::kF32 && Tf32For(tf32);
  GemmOperand a, b;
  if (fp8 != nullptr) {
    // Block scaling: fake-quantized operands in the compute dtype; each GEMM
    // quantizes along its own contraction axis, so backward redoes it.
    s.fp8 = *fp8;
    ASSIGN_OR_RETURN(s.kernel_hp, CastTo(ops, kernel, compute));
    ASSIGN_OR_RETURN(a, QuantizeGemmOperand(ops, *fp8, quantizers(), QuantizerRole::kX, x,
                                            GemmSide::kA, false, vars));
    ASSIGN_OR_RETURN(b, QuantizeGemmOperand(ops, *fp8, quantizers(), QuantizerRole::kKernel,
                                            s.kernel_hp, GemmSide::kB, false, vars));
    s.x_hp = x;
  } else {
    a.data = x;
    ASSIGN_OR_RETURN(b.data, ops.CastKept(kernel, compute));
    s.x = a;
    s.kernel = b;
    s.kernel_owned = kernel.dtype() != compute;
  }
  RETURN_IF_ERROR(RunGemm(ops, *vars, a, b, compute, s.tf32, fusion, y));
  if (saved != nullptr) *saved = std::move(s);
  return absl::OkStatus();
}

absl::Status Dense::ForwardQuantized(Ops& ops, Variables* vars, const GemmOperand& x,
                                     DType compute, const Fp8Recipe& fp8, Tensor* y, Saved* saved,
                                     const DenseFusion& fusion) const {
  if (fusion.gelu_input != nullptr) {
    return absl::InternalError(absl::StrCat("Dense ", kernel_name(),
                                            ": a fused GELU needs float compute, not FP8"));
  }
  if (!IsPerTensorScaling(fp8) || !IsFloat8(x.data.dtype()) || x.transpose ||
      x.data.rank() != 2 || x.data.dim(1) != in_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Dense ", kernel_name(), ": a pre-quantized input must be FP8 [N, ", in_,
        "] under a per-tensor recipe, got ", ShapeString(x.data.shape()), " ",
        DTypeName(x.data.dtype())));
  }
  RETURN_IF_ERROR(CheckVariables(*vars, specs_.Get(&fp8, [&] { return Defs(&fp8); })));
  // TE quantizes the kernel straight from the param dtype.
  // Both layouts: the forward GEMM takes the kernel transposed, the dgrad as is.
  ASSIGN_OR_RETURN(GemmOperand b,
                   QuantizeKernelOperand(ops, fp8, quantizers(),
                                         vars->at(kernel_name()).Reshaped({in_, out_}), vars));
  // FP8 operands: TensorFloat-32 does not apply.
  RETURN_IF_ERROR(RunGemm(ops, *vars, x, b, compute, /*tf32=*/false, fusion, y));
  if (saved != nullptr) {
    Saved s;
    s.fp8 = fp8;
    // The backward reads x only in the wgrad (x^T) and the kernel only in
    // the dgrad (as is, transposed: the layout ForGemm picks for it); the
    // other layouts go with the caller's operands once the forward GEMM has
    // read them, so a step holds one byte per element of a quantized
    // activation, not two.
    if (x.data_t.defined()) {
      s.x.data = x.data_t;
      s.x.scale_inv = x.scale_inv;
      s.x_transposed = true;
    } else {
      s.x = x;
    }
    s.kernel = b;
    s.kernel.data_t = Tensor();
    *saved = std::move(s);
  }
  return absl::OkStatus();
}

namespace {

// The GEMM a @ b of two operands as ForGemm lays them out.
Ops::GemmArgs GemmArgsOf(const GemmOperand& a, const GemmOperand& b, bool tf32) {
  Ops::GemmArgs gemm;
  gemm.tf32 = tf32;
  gemm.a = a.data;
  gemm.transpose_a = a.transpose;
  gemm.a_scale_inv = a.scale_inv;
  gemm.b = b.data;
  gemm.transpose_b = b.transpose;
  gemm.b_scale_inv = b.scale_inv;
  return gemm;
}

}  // namespace

absl::Status Dense::RunGemm(Ops& ops, const Variables& vars, const GemmOperand& a_in,
                            const GemmOperand& b_in, DType compute, bool tf32,
                            const DenseFusion& fusion, Tensor* y) const {
  const GemmOperand a = ForGemm(a_in, GemmSide::kA);
  const GemmOperand b = ForGemm(b_in, GemmSide::kB);
  Ops::GemmArgs gemm = GemmArgsOf(a, b, tf32);
  if (config_.use_bias) {
    ASSIGN_OR_RETURN(gemm.bias, ops.CastKept(vars.at(bias_name()).Reshaped({out_}), compute));
  }
  const int64_t n = a.transpose ? a.data.dim(1) : a.data.dim(0);
  if (fusion.residual.defined()) {
    ASSIGN_OR_RETURN(gemm.residual, CastTo(ops, fusion.residual.Reshaped({n, out_}), compute));
  }
  if (fusion.gelu_input != nullptr) {
    gemm.epilogue = Ops::GemmEpilogue::kGeluAux;
    ASSIGN_OR_RETURN(gemm.aux, ops.Allocate(compute, {n, out_}));
    *fusion.gelu_input = gemm.aux;
  }
  ASSIGN_OR_RETURN(*y, ops.Allocate(compute, {n, out_}));
  return ops.Gemm(gemm, y);
}

absl::Status Dense::Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy, Tensor* dx,
                             Variables* grads) const {
  if (!FloatRows(dy, out_)) return CheckRows(dy, out_, absl::StrCat("Dense ", kernel_name(), " dy"));
  const DType compute = dy.dtype();
  const std::optional<Fp8Recipe> fp8_recipe = saved.fp8;
  const Fp8Recipe* fp8 = fp8_recipe ? &*fp8_recipe : nullptr;
  if (fp8 != nullptr && IsPerTensorScaling(*fp8)) {
    // Both layouts: dy enters the dgrad as is and the wgrad transposed; the
    // bias gradient comes from the same pass over dy.
    Tensor dbias;
    if (config_.use_bias) {
      ASSIGN_OR_RETURN(dbias, AllocateBiasGrad(ops));
    }
    ASSIGN_OR_RETURN(GemmOperand dy_q,
                     QuantizeGemmOperandBothLayouts(ops, *fp8, quantizers(), QuantizerRole::kGrad,
                                                    dy, GemmSide::kA, false, vars,
                                                    config_.use_bias ? &dbias : nullptr));
    dy = Tensor();  // read for the last time: the codes replace it
    return BackwardQuantized(ops, std::move(saved), std::move(dy_q), std::move(dbias), compute,
                             dx, grads);
  }
  const int64_t n = dy.dim(0);
  const bool tf32 = saved.tf32;
  // dgrad: dx = dy @ kernel^T; wgrad: dkernel = x^T @ dy.
  GemmOperand dy_a, kernel_b, x_a, dy_b;
  if (fp8 != nullptr) {
    const QuantizerSet& q = quantizers();
    ASSIGN_OR_RETURN(dy_a, QuantizeGemmOperand(ops, *fp8, q, QuantizerRole::kGrad, dy,
                                               GemmSide::kA, false, vars));
    ASSIGN_OR_RETURN(kernel_b, QuantizeGemmOperand(ops, *fp8, q, QuantizerRole::kKernel,
                                                   saved.kernel_hp, GemmSide::kB, true, vars));
    ASSIGN_OR_RETURN(x_a, QuantizeGemmOperand(ops, *fp8, q, QuantizerRole::kX, saved.x_hp,
                                              GemmSide::kA, true, vars));
    ASSIGN_OR_RETURN(dy_b, QuantizeGemmOperand(ops, *fp8, q, QuantizerRole::kGrad, dy,
                                               GemmSide::kB, false, vars));
  } else {
    dy_a.data = dy;
    dy_b = dy_a;
    kernel_b = saved.kernel;
    kernel_b.transpose = true;
    x_a = saved.x;
    x_a.transpose = true;
  }
  // From here on the operands hold what the GEMMs read.
  saved = Saved();
  RETURN_IF_ERROR(RunBackwardGemms(ops, std::move(dy_a), std::move(kernel_b), std::move(x_a),
                                   std::move(dy_b), tf32, compute, n, dx, grads));
  if (config_.use_bias) {
    ASSIGN_OR_RETURN(Tensor dbias, AllocateBiasGrad(ops));
    RETURN_IF_ERROR(ops.SumRows(dy, &dbias));
    (*grads)[bias_name()] = dbias.Reshaped(config_.features);
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Dense::AllocateBiasGrad(Ops& ops) const {
  return ops.Allocate(config_.param_dtype, {out_});
}

absl::StatusOr<Dense::QuantizedGrad> Dense::AllocateQuantizedGrad(Ops& ops, const Fp8Recipe& fp8,
                                                                  int64_t rows,
                                                                  Variables* vars) const {
  QuantizedGrad g;
  ASSIGN_OR_RETURN(g.dy, AllocateFusedOperand(ops, fp8, quantizers_, QuantizerRole::kGrad,
                                              {rows, out_}, vars, &g.fp8));
  ASSIGN_OR_RETURN(g.dy.data_t, ops.Allocate(g.dy.data.dtype(), {out_, rows}));
  if (config_.use_bias) {
    ASSIGN_OR_RETURN(g.dbias, AllocateBiasGrad(ops));
  }
  return g;
}

absl::Status Dense::BackwardQuantized(Ops& ops, Saved saved, GemmOperand dy, Tensor dbias,
                                      DType compute, Tensor* dx, Variables* grads) const {
  if (!saved.fp8 || !IsPerTensorScaling(*saved.fp8) || !IsFloat8(dy.data.dtype()) ||
      dy.data.rank() != 2 || dy.data.dim(1) != out_ || !dy.data_t.defined() ||
      config_.use_bias != dbias.defined()) {
    return absl::InternalError(absl::StrCat(
        "Dense ", kernel_name(),
        ": a quantized dy needs a per-tensor FP8 forward, both layouts of [N, ", out_,
        "] codes, and a bias gradient iff the Dense has a bias"));
  }
  const int64_t n = dy.data.dim(0);
  // One scale for the whole tensor: the copy's two layouts serve both GEMMs.
  GemmOperand dy_a = dy, dy_b = dy;
  dy_a.data_t = Tensor();
  dy_b.data = Tensor();
  std::swap(dy_b.data, dy_b.data_t);
  dy_b.transpose = true;
  dy = GemmOperand();
  GemmOperand kernel_b = saved.kernel;
  kernel_b.transpose = true;
  GemmOperand x_a = saved.x;
  x_a.transpose = !saved.x_transposed;
  const bool tf32 = saved.tf32;
  saved = Saved();
  RETURN_IF_ERROR(RunBackwardGemms(ops, std::move(dy_a), std::move(kernel_b), std::move(x_a),
                                   std::move(dy_b), tf32, compute, n, dx, grads));
  if (config_.use_bias) (*grads)[bias_name()] = dbias.Reshaped(config_.features);
  return absl::OkStatus();
}

absl::Status Dense::RunBackwardGemms(Ops& ops, GemmOperand dy_a, GemmOperand kernel_b,
                                     GemmOperand x_a, GemmOperand dy_b, bool tf32,
                                     DType compute, int64_t n, Tensor* dx,
                                     Variables* grads) const {
  dy_a = ForGemm(dy_a, GemmSide::kA);
  kernel_b = ForGemm(kernel_b, GemmSide::kB);
  x_a = ForGemm(x_a, GemmSide::kA);
  dy_b = ForGemm(dy_b, GemmSide::kB);
  // The wgrad first: x (the saved activation) and dy's transposed codes go
  // before the dgrad allocates dx, so the two never coexist with dx (for the
  // MLP's wo: x and dx are both [N, inter]).
  {
    const Ops::GemmArgs wgrad = GemmArgsOf(x_a, dy_b, tf32);
    x_a = GemmOperand();
    dy_b = GemmOperand();
    ASSIGN_OR_RETURN(Tensor dkernel, ops.Allocate(config_.param_dtype, kernel_shape()));
    Tensor dkernel2d = dkernel.Reshaped({in_, out_});
    RETURN_IF_ERROR(ops.Gemm(wgrad, &dkernel2d));
    (*grads)[kernel_name()] = dkernel;
  }
  if (dx != nullptr) {
    const Ops::GemmArgs dgrad = GemmArgsOf(dy_a, kernel_b, tf32);
    ASSIGN_OR_RETURN(*dx, ops.Allocate(compute, {n, in_}));
    RETURN_IF_ERROR(ops.Gemm(dgrad, dx));
  }
  return absl::OkStatus();
}

// ---- Norm ---------------------------------------------------------------------

std::vector<VariableDef> Norm::Defs() const {
  const Shape shape = {config_.hidden};
  std::vector<VariableDef> defs;
  defs.push_back({{VariableName(kParams, config_.scope, config_.scale_name), shape,
                   config_.param_dtype},
                  config_.args.zero_centered_gamma ? Initializer::Zeros() : Initializer::Ones()});
  if (has_bias()) {
    defs.push_back({{VariableName(kParams, config_.scope, config_.bias_name), shape,
                     config_.param_dtype},
                    Initializer::Zeros()});
  }
  return defs;
}

int64_t Norm::Saved::bytes() const {
  return TensorBytes(x) + TensorBytes(mu) + TensorBytes(rsigma) + TensorBytes(gamma);
}

absl::Status Norm::Forward(Ops& ops, const Variables& vars, const Tensor& x, Tensor* y,
                           Saved* saved, const Fp8Output* fp8, Tensor* y_t) const {
  RETURN_IF_ERROR(CheckRows(x, config_.hidden, "norm input"));
  RETURN_IF_ERROR(CheckVariables(vars, SpecsOf(Defs())));
  const DType compute = x.dtype();
  Saved s;
  s.x = x;
  ASSIGN_OR_RETURN(
      s.gamma,
      ops.CastKept(vars.at(VariableName(kParams, config_.scope, config_.scale_name)), compute));
  Tensor beta;
  if (has_bias()) {
    ASSIGN_OR_RETURN(
        beta,
        ops.CastKept(vars.at(VariableName(kParams, config_.scope, config_.bias_name)), compute));
    ASSIGN_OR_RETURN(s.mu, ops.Allocate(DType::kF32, {x.dim(0)}));
  }
  ASSIGN_OR_RETURN(s.rsigma, ops.Allocate(DType::kF32, {x.dim(0)}));
  if (fp8 == nullptr) {
    ASSIGN_OR_RETURN(*y, ops.Allocate(compute, x.shape()));
  } else if (!IsFloat8(y->dtype()) || y->shape() != x.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "norm: a quantized output must be an FP8 tensor shaped like x ", ShapeString(x.shape())));
  }
  if (y_t != nullptr && fp8 != nullptr) {
    RETURN_IF_ERROR(
        ops.NormForwardTransposed(config_.args, x, s.gamma, beta, *fp8, y, y_t, &s.mu, &s.rsigma));
  } else {
    RETURN_IF_ERROR(ops.NormForward(config_.args, x, s.gamma, beta, y, &s.mu, &s.rsigma, fp8));
  }
  if (saved != nullptr) *saved = std::move(s);
  return absl::OkStatus();
}

absl::Status Norm::Backward(Ops& ops, Saved saved, Tensor dy, Tensor* dx, Variables* grads,
                            const Tensor& residual_grad) const {
  RETURN_IF_ERROR(CheckRows(dy, config_.hidden, "norm dy"));
  const Shape shape = {config_.hidden};
  ASSIGN_OR_RETURN(*dx, ops.Allocate(dy.dtype(), saved.x.shape()));
  ASSIGN_OR_RETURN(Tensor dgamma, ops.Allocate(config_.param_dtype, shape));
  Tensor dbeta;
  if (has_bias()) {
    ASSIGN_OR_RETURN(dbeta, ops.Allocate(config_.param_dtype, shape));
  }
  Tensor residual;
  if (residual_grad.defined()) {
    ASSIGN_OR_RETURN(residual, CastTo(ops, residual_grad.Reshaped(dx->shape()), dx->dtype()));
  }
  RETURN_IF_ERROR(ops.NormBackward(config_.args, dy, saved.x, saved.mu, saved.rsigma,
                                   saved.gamma, dx, &dgamma, &dbeta, residual));
  (*grads)[VariableName(kParams, config_.scope, config_.scale_name)] = dgamma;
  if (has_bias()) (*grads)[VariableName(kParams, config_.scope, config_.bias_name)] = dbeta;
  return absl::OkStatus();
}

// ---- LayerNormDense -----------------------------------------------------------

LayerNormDense::LayerNormDense(LayerNormDenseConfig config)
    : enable_layernorm_(config.enable_layernorm),
      norm_(std::move(config.norm)),
      dense_(std::move(config.dense)) {}

std::vector<VariableDef> LayerNormDense::Defs(const Fp8Recipe* fp8) const {
  std::vector<VariableDef> defs;
  if (enable_layernorm_) defs = norm_.Defs();
  for (VariableDef& def : dense_.Defs(fp8)) defs.push_back(std::move(def));
  return defs;
}

absl::Status LayerNormDense::Forward(Ops& ops, Variables* vars, const Tensor& x,
                                     const Fp8Recipe* fp8, bool tf32, Tensor* y,
                                     Tensor* ln_out, Saved* saved,
                                     const DenseFusion& fusion) const {
  Saved s;
  Tensor ln = x;
  if (enable_layernorm_ && ln_out == nullptr && CanFuseQuantize(fp8)) {
    // Nobody reads the norm's output in high precision: write it in FP8.
    RETURN_IF_ERROR(CheckVariables(*vars, specs_.Get(fp8, [&] { return Defs(fp8); })));
    Fp8Output q;
    ASSIGN_OR_RETURN(GemmOperand ln_q,
                     AllocateFusedOperand(ops, *fp8, dense_.quantizers(), QuantizerRole::kX,
                                          x.shape(), vars, &q));
    // The forward GEMM takes ln as is; kept for a backward, the norm also
    // writes it transposed, for the wgrad.
    if (saved != nullptr) {
      ASSIGN_OR_RETURN(ln_q.data_t, ops.Allocate(ln_q.data.dtype(), {x.dim(1), x.dim(0)}));
    }
    RETURN_IF_ERROR(norm_.Forward(ops, *vars, x, &ln_q.data, &s.norm, &q,
                                  saved != nullptr ? &ln_q.data_t : nullptr));
    RETURN_IF_ERROR(dense_.ForwardQuantized(ops, vars, ln_q, x.dtype(), *fp8, y,
                                            saved != nullptr ? &s.dense : nullptr, fusion));
    if (saved != nullptr) *saved = std::move(s);
    return absl::OkStatus();
  }
  if (enable_layernorm_) RETURN_IF_ERROR(norm_.Forward(ops, *vars, x, &ln, &s.norm));
  RETURN_IF_ERROR(
      dense_.Forward(ops, vars, ln, fp8, tf32, y, saved != nullptr ? &s.dense : nullptr, fusion));
  if (ln_out != nullptr) *ln_out = ln;
  if (saved != nullptr) *saved = std::move(s);
  return absl::OkStatus();
}

absl::Status LayerNormDense::Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy,
                                      Tensor* dx, Variables* grads,
                                      const Tensor& residual_grad) const {
  Tensor dln;
  RETURN_IF_ERROR(
      dense_.Backward(ops, vars, std::move(saved.dense), std::move(dy), DenseDx(dx, &dln), grads));
  return FinishBackward(ops, std::move(saved.norm), std::move(dln), dx, grads, residual_grad);
}

absl::Status LayerNormDense::BackwardQuantized(Ops& ops, Saved saved, GemmOperand dy,
                                               Tensor dbias, DType compute, Tensor* dx,
                                               Variables* grads,
                                               const Tensor& residual_grad) const {
  Tensor dln;
  RETURN_IF_ERROR(dense_.BackwardQuantized(ops, std::move(saved.dense), std::move(dy),
                                           std::move(dbias), compute, DenseDx(dx, &dln), grads));
  return FinishBackward(ops, std::move(saved.norm), std::move(dln), dx, grads, residual_grad);
}

Tensor* LayerNormDense::DenseDx(Tensor* dx, Tensor* dln) const {
  return enable_layernorm_ || dx != nullptr ? dln : nullptr;
}

absl::Status LayerNormDense::FinishBackward(Ops& ops, Norm::Saved norm, Tensor dln, Tensor* dx,
                                            Variables* grads,
                                            const Tensor& residual_grad) const {
  if (!enable_layernorm_) {
    if (dx == nullptr) return absl::OkStatus();
    *dx = std::move(dln);
    if (!residual_grad.defined()) return absl::OkStatus();
    return ResidualAdd(ops, *dx, residual_grad.Reshaped(dx->shape()), dx);
  }
  return norm_.Backward(ops, std::move(norm), std::move(dln), dx, grads, residual_grad);
}

// ---- Dropout, residual ----------------------------------------------------------

absl::Status Dropout(Ops& ops, float rate, bool deterministic, uint64_t seed, const Tensor& x,
                     Tensor* y, DropoutSaved* saved) {
  DropoutSaved s;
  if (deterministic || rate <= 0.0f) {
    *y = x;
  } else if (rate >= 1.0f) {  // Flax: everything dropped
    s.rate = 1.0f;
    ASSIGN_OR_RETURN(*y, ops.Allocate(x.dtype(), x.shape()));
    RETURN_IF_ERROR(ops.Fill(0.0f, y));
  } else {
    s.rate = rate;
    ASSIGN_OR_RETURN(*y, ops.Allocate(x.dtype(), x.shape()));
    ASSIGN_OR_RETURN(s.mask, ops.Allocate(DType::kBool, x.shape()));
    RETURN_IF_ERROR(ops.DropoutForward(rate, seed, x, y, &s.mask));
  }
  if (saved != nullptr) *saved = std::move(s);
  return absl::OkStatus();
}

absl::Status DropoutGrad(Ops& ops, const DropoutSaved& saved, const Tensor& dy, Tensor* dx) {
  if (saved.rate >= 1.0f) {
    ASSIGN_OR_RETURN(*dx, ops.Allocate(dy.dtype(), dy.shape()));
    return ops.Fill(0.0f, dx);
  }
  if (!saved.mask.defined() || saved.rate <= 0.0f) {
    *dx = dy;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(*dx, ops.Allocate(dy.dtype(), dy.shape()));
  return ops.DropoutBackward(saved.rate, dy, saved.mask, dx);
}

absl::Status ResidualAdd(Ops& ops, const Tensor& a, const Tensor& b, Tensor* y) {
  if (a.numel() != b.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("residual add of ", ShapeString(a.shape()),
                                                   " and ", ShapeString(b.shape())));
  }
  if (!y->defined() || y->numel() != a.numel()) {
    ASSIGN_OR_RETURN(*y, ops.Allocate(a.dtype(), a.shape()));
  }
  return ops.Axpby(1.0f, a, 1.0f, b, y);
}

}  // namespace te::layers
