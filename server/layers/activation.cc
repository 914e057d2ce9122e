// A standalone activation (TE's `activation(x, activation_type)`), no params.
//   one activation:   x [..., I]    -> y [..., I]
//   a gated pair:     x [..., 2, I] -> y [..., I] = act_0(x[..., 0, :]) * act_1(x[..., 1, :])
#include <memory>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/module_util.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

struct ActivationSaved {
  Tensor x;  // [N, n * I]
  int64_t bytes() const { return TensorBytes(x); }
};

class ActivationLayer : public Layer {
 public:
  explicit ActivationLayer(std::vector<Activation> acts) : acts_(std::move(acts)) {}

  std::string type_name() const override { return "Activation"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(OutputShape(input_shape).status());
    return std::vector<VariableSpec>{};
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    if (!gated()) {
      RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
      return input_shape;
    }
    RETURN_IF_ERROR(CheckInputShape(input_shape, 2));
    if (input_shape[input_shape.size() - 2] != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_shape ", ShapeString(input_shape),
                       ": a gated activation takes x [..., 2, I]"));
    }
    Shape y = input_shape;
    y.erase(y.end() - 2);
    return y;
  }

  absl::Status Init(Ops&, uint64_t, const Shape& input_shape, const Fp8Recipe*,
                    Variables*) const override {
    return OutputShape(input_shape).status();
  }

  absl::Status Forward(Ops& ops, Variables*, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, gated() ? 2 : 1, type_name()));
    ASSIGN_OR_RETURN(Shape y_shape, OutputShape(in.x.shape()));
    const int64_t inter = y_shape.back();
    const int64_t n = NumElements(y_shape) / inter;
    const Tensor x = in.x.Reshaped({n, inter * static_cast<int64_t>(acts_.size())});
    ASSIGN_OR_RETURN(Tensor y, ops.Allocate(in.x.dtype(), {n, inter}));
    RETURN_IF_ERROR(ops.ActivationForward(acts_, x, &y));
    out->y = y.Reshaped(y_shape);
    if (opts.keep_for_backward && saved != nullptr) {
      auto s = std::make_unique<ModuleSaved<ActivationSaved>>();
      s->block.x = x;
      s->x_shape = in.x.shape();
      s->y_shape = y_shape;
      s->compute = in.x.dtype();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables*, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s, SavedAs<ModuleSaved<ActivationSaved>>(saved, type_name()));
    ASSIGN_OR_RETURN(Tensor dy_c, PrepareDy(ops, dy, s->y_shape, s->compute));
    const Tensor& x = s->block.x;
    ASSIGN_OR_RETURN(Tensor dx, ops.Allocate(x.dtype(), x.shape()));
    RETURN_IF_ERROR(
        ops.ActivationBackward(acts_, dy_c.Reshaped({x.dim(0), dy_c.numel() / x.dim(0)}), x, &dx));
    grads->dx = dx.Reshaped(s->x_shape);
    return absl::OkStatus();
  }

 private:
  bool gated() const { return acts_.size() == 2; }

  std::vector<Activation> acts_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeActivation(const te::v1::Activation& spec) {
  std::vector<std::string> names(spec.activations().begin(), spec.activations().end());
  if (names.empty()) names = {"gelu"};
  ASSIGN_OR_RETURN(std::vector<Activation> acts,
                   ParseActivations(names, "spec.activation.activations"));
  return std::unique_ptr<Layer>(std::make_unique<ActivationLayer>(std::move(acts)));
}

}  // namespace te::layers
