// nn.Dense, nn.DenseGeneral and nn.LayerNorm with Flax's semantics
// (flax_modules.h), and the dtype rules every Flax module here shares.
// MultiHeadDotProductAttention: flax_modules_attention.cc.
#include "server/layers/flax_modules.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "proto/dtype.h"
#include "server/layers/flax_modules_internal.h"
#include "server/layers/module_util.h"
#include "server/layers/variables.h"

namespace te::layers {

DType PromoteFloat(DType a, DType b) { return a == b ? a : DType::kF32; }

namespace flax {

absl::StatusOr<std::optional<DType>> ComputeDTypeOf(te::v1::DType dtype, absl::string_view field) {
  if (dtype == te::v1::DTYPE_UNSPECIFIED) return std::optional<DType>();
  ASSIGN_OR_RETURN(const DType d, FloatDTypeFromProto(dtype, field));
  return std::optional<DType>(d);
}

absl::StatusOr<DType> ParamDTypeOf(te::v1::DType dtype, absl::string_view field) {
  ASSIGN_OR_RETURN(const std::optional<DType> d, ComputeDTypeOf(dtype, field));
  return d.value_or(DType::kF32);
}

absl::StatusOr<bool> HighestPrecisionOf(te::v1::Precision precision, absl::string_view field) {
  ASSIGN_OR_RETURN(const bool tf32, MatmulTf32(precision, field));
  return !tf32;
}

DType ComputeDType(const std::optional<DType>& dtype, DType x, DType param_dtype,
                   bool has_params) {
  if (dtype) return *dtype;
  return has_params ? PromoteFloat(x, param_dtype) : x;
}

// ---- DenseGeneral block ---------------------------------------------------------

absl::StatusOr<DenseGeneral::Plan> DenseGeneral::MakePlan(const Shape& shape) const {
  ASSIGN_OR_RETURN(Plan plan, MakeContractionPlan(shape, config_.axis,
                                                  absl::StrCat(config_.field, ".axis"), "x"));
  if (!CheckedNumElements(Concat(plan.in_dims, config_.features))) {
    return absl::InvalidArgumentError(absl::StrCat(config_.field, ": a kernel ",
                                                   ShapeString(Concat(plan.in_dims, config_.features)),
                                                   " has more elements than fit in int64"));
  }
  return plan;
}

Shape DenseGeneral::OutputShape(const Plan& plan) const {
  return Concat(plan.batch_dims, config_.features);
}

layers::Dense DenseGeneral::DenseFor(const Plan& plan) const {
  DenseConfig c;
  c.scope = config_.scope;
  c.use_bias = config_.use_bias;
  c.in_dims = plan.in_dims;
  c.features = config_.features;
  c.param_dtype = config_.param_dtype;
  c.highest_precision = config_.highest_precision;
  // Flax initialises the kernel flattened to [prod(in), prod(features)].
  c.kernel_init = Initializer::VarianceScalingFanIn(NumElements(plan.in_dims));
  return layers::Dense(c);
}

std::vector<VariableDef> DenseGeneral::Defs(const Plan& plan) const {
  return DenseFor(plan).Defs(nullptr);
}

DType DenseGeneral::ComputeDTypeFor(DType x) const {
  return ComputeDType(config_.dtype, x, config_.param_dtype, /*has_params=*/true);
}

absl::Status DenseGeneral::Forward(Ops& ops, Variables* vars, const Tensor& x, bool tf32,
                                   Tensor* y, Saved* saved) const {
  ASSIGN_OR_RETURN(Plan plan, MakePlan(x.shape()));
  const layers::Dense dense = DenseFor(plan);
  const DType compute = ComputeDTypeFor(x.dtype());
  ASSIGN_OR_RETURN(Tensor xc, CastTo(ops, x, compute));
  ASSIGN_OR_RETURN(xc, ApplyContractionPermute(ops, plan, xc));
  Saved s;
  Tensor y2;
  RETURN_IF_ERROR(dense.Forward(ops, vars, xc.Reshaped({NumElements(plan.batch_dims), dense.in()}),
                                nullptr, tf32, &y2, saved != nullptr ? &s.dense : nullptr));
  *y = y2.Reshaped(OutputShape(plan));
  if (saved != nullptr) {
    s.plan = std::move(plan);
    s.x_shape = x.shape();
    s.x_dtype = x.dtype();
    s.compute = compute;
    *saved = std::move(s);
  }
  return absl::OkStatus();
}

absl::Status DenseGeneral::Backward(Ops& ops, Variables* vars, const Saved& saved,
                                    const Tensor& dy, Tensor* dx, Variables* grads) const {
  const Plan& plan = saved.plan;
  const layers::Dense dense = DenseFor(plan);
  ASSIGN_OR_RETURN(const Tensor dy_c, PrepareDy(ops, dy, OutputShape(plan), saved.compute));
  Tensor d;
  RETURN_IF_ERROR(dense.Backward(ops, vars, saved.dense,
                                 dy_c.Reshaped({NumElements(plan.batch_dims), dense.out()}), &d,
                                 grads));
  ASSIGN_OR_RETURN(d, UndoContractionPermute(ops, plan, d, saved.x_shape));
  // x was cast to the compute dtype: its gradient is cast back.
  ASSIGN_OR_RETURN(*dx, CastTo(ops, d, saved.x_dtype));
  return absl::OkStatus();
}

namespace {

// ---- nn.Dense, nn.DenseGeneral ----------------------------------------------------

class DenseGeneralLayer : public Layer {
 public:
  DenseGeneralLayer(std::string type, DenseGeneralConfig config)
      : type_(std::move(type)), block_(std::move(config)) {}

  std::string type_name() const override { return type_; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    ASSIGN_OR_RETURN(const DenseGeneral::Plan plan, block_.MakePlan(input_shape));
    return SpecsOf(block_.Defs(plan));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    ASSIGN_OR_RETURN(const DenseGeneral::Plan plan, block_.MakePlan(input_shape));
    return block_.OutputShape(plan);
  }

  DType OutputDType(DType input) const override { return block_.ComputeDTypeFor(input); }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe*,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(const DenseGeneral::Plan plan, block_.MakePlan(input_shape));
    return InitVariables(ops, seed, block_.Defs(plan), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_));
    const bool keep = opts.keep_for_backward && saved != nullptr;
    auto s = std::make_unique<ModuleSaved<DenseGeneral::Saved>>();
    RETURN_IF_ERROR(
        block_.Forward(ops, vars, in.x, opts.tf32, &out->y, keep ? &s->block : nullptr));
    if (keep) {
      s->y_shape = out->y.shape();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s, SavedAs<ModuleSaved<DenseGeneral::Saved>>(saved, type_));
    grads->dextra.clear();
    return block_.Backward(ops, vars, s->block, dy, &grads->dx, &grads->params);
  }

 private:
  std::string type_;
  DenseGeneral block_;
};

// ---- nn.LayerNorm -----------------------------------------------------------------
//   y = (x - mean) / sqrt(var + epsilon) * scale + bias over the last axis,
// statistics in float32 (Flax's force_float32_reductions), y rounded once to
// the computation dtype.

struct LayerNormOptions {
  float epsilon = 1e-6f;
  bool use_bias = true;
  bool use_scale = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::kF32;
};

struct LayerNormSaved {
  Tensor x;  // [N, F] in x's own dtype
  Tensor mu, rsigma, gamma;
  Shape x_shape;
  DType compute = DType::kF32;
  int64_t bytes() const {
    return TensorBytes(x) + TensorBytes(mu) + TensorBytes(rsigma) + TensorBytes(gamma);
  }
};

class LayerNormLayer : public Layer {
 public:
  explicit LayerNormLayer(LayerNormOptions o) : o_(o) {}

  std::string type_name() const override { return "FlaxLayerNorm"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return SpecsOf(Defs(input_shape.back()));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return input_shape;
  }

  DType OutputDType(DType input) const override {
    return ComputeDType(o_.dtype, input, o_.param_dtype, o_.use_scale || o_.use_bias);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe*,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return InitVariables(ops, seed, Defs(input_shape.back()), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_name()));
    const int64_t features = in.x.dim(-1);
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(Defs(features))));
    auto s = std::make_unique<ModuleSaved<LayerNormSaved>>();
    LayerNormSaved& b = s->block;
    b.x = in.x.As2D();
    b.x_shape = in.x.shape();
    b.compute = OutputDType(in.x.dtype());
    // A scale or bias the module does not have is the identity's: ones, zeros.
    ASSIGN_OR_RETURN(b.gamma, Param(ops, *vars, o_.use_scale, "scale", 1.0f, features));
    ASSIGN_OR_RETURN(const Tensor beta, Param(ops, *vars, o_.use_bias, "bias", 0.0f, features));
    ASSIGN_OR_RETURN(b.mu, ops.Allocate(DType::kF32, {b.x.dim(0)}));
    ASSIGN_OR_RETURN(b.rsigma, ops.Allocate(DType::kF32, {b.x.dim(0)}));
    // x is read in float32 whatever its dtype: no cast before the norm.
    ASSIGN_OR_RETURN(Tensor y, ops.Allocate(b.compute, b.x.shape()));
    RETURN_IF_ERROR(ops.NormForward(Args(), b.x, b.gamma, beta, &y, &b.mu, &b.rsigma));
    out->y = y.Reshaped(in.x.shape());
    if (opts.keep_for_backward && saved != nullptr) {
      s->y_shape = in.x.shape();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables*, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s, SavedAs<ModuleSaved<LayerNormSaved>>(saved, type_name()));
    const LayerNormSaved& b = s->block;
    // The backward runs in the wider of x's dtype and the compute dtype, so
    // neither x nor dy loses digits to it.
    const DType wide = PromoteFloat(b.x.dtype(), b.compute);
    ASSIGN_OR_RETURN(const Tensor dy_c, PrepareDy(ops, dy, b.x_shape, wide));
    ASSIGN_OR_RETURN(const Tensor x_c, CastTo(ops, b.x, wide));
    const int64_t features = b.x.dim(1);
    ASSIGN_OR_RETURN(Tensor dx, ops.Allocate(wide, b.x.shape()));
    ASSIGN_OR_RETURN(Tensor dgamma, ops.Allocate(o_.param_dtype, {features}));
    ASSIGN_OR_RETURN(Tensor dbeta, ops.Allocate(o_.param_dtype, {features}));
    RETURN_IF_ERROR(ops.NormBackward(Args(), dy_c.As2D(), x_c, b.mu, b.rsigma, b.gamma, &dx,
                                     &dgamma, &dbeta));
    ASSIGN_OR_RETURN(grads->dx, CastTo(ops, dx.Reshaped(b.x_shape), b.x.dtype()));
    grads->dextra.clear();
    if (o_.use_scale) grads->params[VariableName(kParams, "", "scale")] = dgamma;
    if (o_.use_bias) grads->params[VariableName(kParams, "", "bias")] = dbeta;
    return absl::OkStatus();
  }

 private:
  NormArgs Args() const {
    NormArgs args;
    args.type = NormType::kLayerNorm;
    args.epsilon = o_.epsilon;
    return args;
  }

  std::vector<VariableDef> Defs(int64_t features) const {
    std::vector<VariableDef> defs;
    if (o_.use_scale) {
      defs.push_back({{VariableName(kParams, "", "scale"), {features}, o_.param_dtype},
                      Initializer::Ones()});
    }
    if (o_.use_bias) {
      defs.push_back({{VariableName(kParams, "", "bias"), {features}, o_.param_dtype},
                      Initializer::Zeros()});
    }
    return defs;
  }

  // The variable `name`, or a constant [F] in param_dtype when the module
  // has none (both norm parameters share one dtype, as the CUDA norm wants).
  absl::StatusOr<Tensor> Param(Ops& ops, const Variables& vars, bool present,
                               const std::string& name, float value, int64_t features) const {
    if (present) return vars.at(VariableName(kParams, "", name));
    ASSIGN_OR_RETURN(Tensor t, ops.Allocate(o_.param_dtype, {features}));
    RETURN_IF_ERROR(ops.Fill(value, &t));
    return t;
  }

  LayerNormOptions o_;
};

}  // namespace

// The fields nn.Dense and nn.DenseGeneral share: use_bias (Flax's default
// true), dtype, param_dtype and precision, named under `field`.
template <typename Spec>
absl::Status ReadDenseFields(const Spec& spec, const char* field, DenseGeneralConfig* c) {
  c->use_bias = !spec.has_use_bias() || spec.use_bias();
  ASSIGN_OR_RETURN(c->dtype, ComputeDTypeOf(spec.dtype(), absl::StrCat(field, ".dtype")));
  ASSIGN_OR_RETURN(c->param_dtype,
                   ParamDTypeOf(spec.param_dtype(), absl::StrCat(field, ".param_dtype")));
  ASSIGN_OR_RETURN(c->highest_precision,
                   HighestPrecisionOf(spec.precision(), absl::StrCat(field, ".precision")));
  c->field = field;
  return absl::OkStatus();
}

}  // namespace flax

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxDense(const te::v1::FlaxDense& spec) {
  constexpr char kField[] = "spec.flax_dense";
  if (spec.features() <= 0 || spec.features() > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField, ".features is required and must be in [1, 2^31]; got ", spec.features()));
  }
  flax::DenseGeneralConfig c;
  c.features = {spec.features()};
  RETURN_IF_ERROR(flax::ReadDenseFields(spec, kField, &c));
  return std::unique_ptr<Layer>(new flax::DenseGeneralLayer("FlaxDense", std::move(c)));
}

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxDenseGeneral(const te::v1::FlaxDenseGeneral& spec) {
  constexpr char kField[] = "spec.flax_dense_general";
  RETURN_IF_ERROR(CheckFeatures(spec.features(), absl::StrCat(kField, ".features")));
  flax::DenseGeneralConfig c;
  c.features.assign(spec.features().begin(), spec.features().end());
  if (!CheckedNumElements(c.features)) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".features ", ShapeString(c.features),
                                                   " has more elements than fit in int64"));
  }
  c.axis.assign(spec.axis().begin(), spec.axis().end());
  if (c.axis.empty()) c.axis = {-1};
  RETURN_IF_ERROR(flax::ReadDenseFields(spec, kField, &c));
  return std::unique_ptr<Layer>(new flax::DenseGeneralLayer("FlaxDenseGeneral", std::move(c)));
}

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxLayerNorm(const te::v1::FlaxLayerNorm& spec) {
  constexpr char kField[] = "spec.flax_layer_norm";
  flax::LayerNormOptions o;
  o.epsilon = spec.has_epsilon() ? spec.epsilon() : 1e-6f;
  RETURN_IF_ERROR(CheckEpsilon(o.epsilon, absl::StrCat(kField, ".epsilon")));
  o.use_bias = !spec.has_use_bias() || spec.use_bias();
  o.use_scale = !spec.has_use_scale() || spec.use_scale();
  ASSIGN_OR_RETURN(o.dtype, flax::ComputeDTypeOf(spec.dtype(), absl::StrCat(kField, ".dtype")));
  ASSIGN_OR_RETURN(o.param_dtype,
                   flax::ParamDTypeOf(spec.param_dtype(), absl::StrCat(kField, ".param_dtype")));
  return std::unique_ptr<Layer>(new flax::LayerNormLayer(o));
}

}  // namespace te::layers
