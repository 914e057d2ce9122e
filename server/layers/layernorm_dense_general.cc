// TE's LayerNormDenseGeneral: (optional) layernorm, then a dense layer over the
// last axis. Returns (z, ln_out); ln_out is the dense layer's input, returned
// when return_layernorm_output (TE's default: false).
#include <memory>

#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/module_util.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

struct Options {
  Shape features;
  NormArgs norm;
  bool use_bias = false;
  bool return_layernorm_output = false;
  bool enable_layernorm = true;
  DType param_dtype = DType::kF32;
};

class LayerNormDenseGeneralLayer : public Layer {
 public:
  explicit LayerNormDenseGeneralLayer(Options options) : options_(std::move(options)) {}

  std::string type_name() const override { return "LayerNormDenseGeneral"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return SpecsOf(BlockFor(input_shape.back()).Defs(fp8));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return Concat(Shape(input_shape.begin(), input_shape.end() - 1), options_.features);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return InitVariables(ops, seed, BlockFor(input_shape.back()).Defs(fp8), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                       const ForwardOptions& opts, LayerOutputs* out,
                       std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_name()));
    const LayerNormDense block = BlockFor(in.x.shape().back());
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(block.Defs(opts.fp8))));
    ASSIGN_OR_RETURN(Shape y_shape, OutputShape(in.x.shape()));
    auto s = std::make_unique<ModuleSaved<LayerNormDense::Saved>>();
    Tensor y, ln_out;
    // Without ln_out the block may fuse the norm with FP8 quantization.
    RETURN_IF_ERROR(block.Forward(ops, vars, in.x.As2D(), opts.fp8, /*tf32=*/opts.tf32, &y,
                                  options_.return_layernorm_output ? &ln_out : nullptr,
                                  opts.keep_for_backward ? &s->block : nullptr));
    out->y = y.Reshaped(y_shape);
    if (options_.return_layernorm_output) out->ln_out = ln_out.Reshaped(in.x.shape());
    if (opts.keep_for_backward && saved != nullptr) {
      s->x_shape = in.x.shape();
      s->y_shape = y_shape;
      s->compute = in.x.dtype();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s,
                     SavedAs<ModuleSaved<LayerNormDense::Saved>>(saved, type_name()));
    ASSIGN_OR_RETURN(Tensor dy_c, PrepareDy(ops, dy, s->y_shape, s->compute));
    const LayerNormDense block = BlockFor(s->x_shape.back());
    Tensor dx;
    RETURN_IF_ERROR(block.Backward(ops, vars, s->block,
                                   dy_c.Reshaped({NumElements(s->x_shape) / s->x_shape.back(),
                                                  block.dense().out()}),
                                   &dx, &grads->params));
    grads->dx = dx.Reshaped(s->x_shape);
    return absl::OkStatus();
  }

 private:
  LayerNormDense BlockFor(int64_t hidden) const {
    LayerNormDenseConfig c;
    c.enable_layernorm = options_.enable_layernorm;
    c.norm.args = options_.norm;
    c.norm.hidden = hidden;
    c.norm.param_dtype = options_.param_dtype;
    c.dense.use_bias = options_.use_bias;
    c.dense.in_dims = {hidden};
    c.dense.features = options_.features;
    c.dense.param_dtype = options_.param_dtype;
    return LayerNormDense(c);
  }

  Options options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeLayerNormDenseGeneral(
    const te::v1::LayerNormDenseGeneral& spec) {
  RETURN_IF_ERROR(CheckFeatures(spec.features(), "spec.layer_norm_dense_general.features"));
  const float epsilon = spec.has_epsilon() ? spec.epsilon() : 1e-6f;
  RETURN_IF_ERROR(CheckEpsilon(epsilon, "spec.layer_norm_dense_general.epsilon"));
  RETURN_IF_ERROR(
      CheckNormType(spec.layernorm_type(), "spec.layer_norm_dense_general.layernorm_type"));
  RETURN_IF_ERROR(CheckParamDType(spec.dtype(), "spec.layer_norm_dense_general.dtype"));
  Options o;
  o.features.assign(spec.features().begin(), spec.features().end());
  o.norm = MakeNormArgs(spec.layernorm_type(), epsilon, spec.zero_centered_gamma());
  o.use_bias = spec.has_use_bias() && spec.use_bias();
  o.return_layernorm_output =
      spec.has_return_layernorm_output() ? spec.return_layernorm_output() : false;
  o.enable_layernorm = spec.has_enable_layernorm() ? spec.enable_layernorm() : true;
  o.param_dtype = ParamDTypeOf(spec.dtype());
  return std::unique_ptr<Layer>(std::make_unique<LayerNormDenseGeneralLayer>(std::move(o)));
}

}  // namespace te::layers
