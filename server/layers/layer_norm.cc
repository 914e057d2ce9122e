// TE's LayerNorm module: layernorm or rmsnorm over the last axis.
#include <memory>

#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/module_util.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

class LayerNormLayer : public Layer {
 public:
  LayerNormLayer(NormArgs args, DType param_dtype) : args_(args), param_dtype_(param_dtype) {}

  std::string type_name() const override { return "LayerNorm"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return SpecsOf(NormFor(input_shape.back()).Defs());
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return input_shape;
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe*,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return InitVariables(ops, seed, NormFor(input_shape.back()).Defs(), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                       const ForwardOptions& opts, LayerOutputs* out,
                       std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_name()));
    const Norm norm = NormFor(in.x.shape().back());
    auto s = std::make_unique<ModuleSaved<Norm::Saved>>();
    Tensor y;
    RETURN_IF_ERROR(norm.Forward(ops, *vars, in.x.As2D(), &y, &s->block));
    out->y = y.Reshaped(in.x.shape());
    if (opts.keep_for_backward && saved != nullptr) {
      s->x_shape = in.x.shape();
      s->y_shape = in.x.shape();
      s->compute = in.x.dtype();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables*, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s, SavedAs<ModuleSaved<Norm::Saved>>(saved, type_name()));
    ASSIGN_OR_RETURN(Tensor dy_c, PrepareDy(ops, dy, s->y_shape, s->compute));
    Tensor dx;
    RETURN_IF_ERROR(
        NormFor(s->x_shape.back()).Backward(ops, s->block, dy_c.As2D(), &dx, &grads->params));
    grads->dx = dx.Reshaped(s->x_shape);
    return absl::OkStatus();
  }

 private:
  Norm NormFor(int64_t hidden) const {
    NormConfig c;
    c.args = args_;
    c.hidden = hidden;
    c.param_dtype = param_dtype_;
    return Norm(c);
  }

  NormArgs args_;
  DType param_dtype_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNorm(const te::v1::LayerNorm& spec) {
  const float epsilon = spec.has_epsilon() ? spec.epsilon() : 1e-6f;
  RETURN_IF_ERROR(CheckEpsilon(epsilon, "spec.layer_norm.epsilon"));
  RETURN_IF_ERROR(CheckNormType(spec.layernorm_type(), "spec.layer_norm.layernorm_type"));
  RETURN_IF_ERROR(CheckParamDType(spec.dtype(), "spec.layer_norm.dtype"));
  return std::unique_ptr<Layer>(std::make_unique<LayerNormLayer>(
      MakeNormArgs(spec.layernorm_type(), epsilon, spec.zero_centered_gamma()),
      ParamDTypeOf(spec.dtype())));
}

}  // namespace te::layers
