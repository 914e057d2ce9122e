// TE's LayerNormMLP: layernorm, wi (+bias), activation(s), intermediate
// dropout, wo (+bias). Returns (y, ln_out). Quantizer sets "_0" (wi) and "_1" (wo).
#include <memory>

#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/module_util.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

class LayerNormMlpLayer : public Layer {
 public:
  LayerNormMlpLayer(MlpConfig config, bool return_layernorm_output)
      : config_(std::move(config)), return_layernorm_output_(return_layernorm_output) {}

  std::string type_name() const override { return "LayerNormMLP"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return SpecsOf(MlpFor(input_shape.back()).Defs(fp8));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return input_shape;
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return InitVariables(ops, seed, MlpFor(input_shape.back()).Defs(fp8), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                       const ForwardOptions& opts, LayerOutputs* out,
                       std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_name()));
    const Mlp mlp = MlpFor(in.x.shape().back());
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(mlp.Defs(opts.fp8))));
    auto s = std::make_unique<ModuleSaved<Mlp::Saved>>();
    Tensor y, ln_out;
    // Without ln_out the block may fuse the norm with FP8 quantization.
    RETURN_IF_ERROR(mlp.Forward(ops, vars, in.x.As2D(), opts, &y,
                                return_layernorm_output_ ? &ln_out : nullptr,
                                opts.keep_for_backward ? &s->block : nullptr));
    out->y = y.Reshaped(in.x.shape());
    if (return_layernorm_output_) out->ln_out = ln_out.Reshaped(in.x.shape());
    if (opts.keep_for_backward && saved != nullptr) {
      s->x_shape = in.x.shape();
      s->y_shape = in.x.shape();
      s->compute = in.x.dtype();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s, SavedAs<ModuleSaved<Mlp::Saved>>(saved, type_name()));
    ASSIGN_OR_RETURN(Tensor dy_c, PrepareDy(ops, dy, s->y_shape, s->compute));
    Tensor dx;
    RETURN_IF_ERROR(MlpFor(s->x_shape.back())
                        .Backward(ops, vars, s->block, dy_c.As2D(), &dx, &grads->params));
    grads->dx = dx.Reshaped(s->x_shape);
    return absl::OkStatus();
  }

 private:
  Mlp MlpFor(int64_t hidden) const {
    MlpConfig c = config_;
    c.hidden = hidden;
    return Mlp(c);
  }

  MlpConfig config_;  // hidden filled per input
  bool return_layernorm_output_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNormMLP(const te::v1::LayerNormMLP& spec) {
  MlpConfig c;
  c.intermediate = spec.has_intermediate_dim() ? spec.intermediate_dim() : 2048;
  if (c.intermediate <= 0 || c.intermediate > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.layer_norm_mlp.intermediate_dim must be positive (and < 2^31), got ",
        c.intermediate));
  }
  std::vector<std::string> names(spec.activations().begin(), spec.activations().end());
  if (names.empty()) names = {"gelu"};
  ASSIGN_OR_RETURN(c.activations, ParseActivations(names, "spec.layer_norm_mlp.activations"));
  c.intermediate_dropout_rate =
      spec.has_intermediate_dropout_rate() ? spec.intermediate_dropout_rate() : 0.0f;
  RETURN_IF_ERROR(
      CheckRate(c.intermediate_dropout_rate, "spec.layer_norm_mlp.intermediate_dropout_rate"));
  const float epsilon = spec.has_epsilon() ? spec.epsilon() : 1e-6f;
  RETURN_IF_ERROR(CheckEpsilon(epsilon, "spec.layer_norm_mlp.epsilon"));
  RETURN_IF_ERROR(CheckNormType(spec.layernorm_type(), "spec.layer_norm_mlp.layernorm_type"));
  RETURN_IF_ERROR(CheckParamDType(spec.dtype(), "spec.layer_norm_mlp.dtype"));
  c.norm = MakeNormArgs(spec.layernorm_type(), epsilon, spec.zero_centered_gamma());
  c.use_bias = spec.has_use_bias() && spec.use_bias();
  c.enable_layernorm = spec.has_enable_layernorm() ? spec.enable_layernorm() : true;
  c.param_dtype = ParamDTypeOf(spec.dtype());
  const bool return_ln =
      spec.has_return_layernorm_output() ? spec.return_layernorm_output() : false;
  return std::unique_ptr<Layer>(std::make_unique<LayerNormMlpLayer>(std::move(c), return_ln));
}

}  // namespace te::layers
