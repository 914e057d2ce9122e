// TE's DenseGeneral: y = x contracted over `axis` with kernel
// (x.shape[axis]..., features...), plus bias (features...).
//
// The contracted axes are moved last (one Permute, skipped when they already
// are the trailing axes in order) and x is flattened to [N, in], so the GEMM
// is the Dense block's. y is [batch dims..., features...].
#include <algorithm>
#include <memory>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/module_util.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

using Plan = ContractionPlan;

struct DenseGeneralSaved {
  Dense::Saved dense;
  Plan plan;
  int64_t bytes() const { return dense.bytes(); }
};

class DenseGeneralLayer : public Layer {
 public:
  DenseGeneralLayer(Shape features, bool use_bias, std::vector<int> axis, DType param_dtype)
      : features_(std::move(features)),
        use_bias_(use_bias),
        axis_(std::move(axis)),
        param_dtype_(param_dtype) {}

  std::string type_name() const override { return "DenseGeneral"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    ASSIGN_OR_RETURN(Plan plan, MakePlan(input_shape));
    return SpecsOf(DenseFor(plan).Defs(fp8));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    ASSIGN_OR_RETURN(Plan plan, MakePlan(input_shape));
    return Concat(plan.batch_dims, features_);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(Plan plan, MakePlan(input_shape));
    return InitVariables(ops, seed, DenseFor(plan).Defs(fp8), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                       const ForwardOptions& opts, LayerOutputs* out,
                       std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputs(in, 1, type_name()));
    ASSIGN_OR_RETURN(Plan plan, MakePlan(in.x.shape()));
    const Dense dense = DenseFor(plan);
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(dense.Defs(opts.fp8))));
    ASSIGN_OR_RETURN(const Tensor x, ApplyContractionPermute(ops, plan, in.x));
    const int64_t n = NumElements(plan.batch_dims);
    auto s = std::make_unique<ModuleSaved<DenseGeneralSaved>>();
    Tensor y;
    RETURN_IF_ERROR(dense.Forward(ops, vars, x.Reshaped({n, dense.in()}), opts.fp8, opts.tf32, &y,
                                  opts.keep_for_backward ? &s->block.dense : nullptr));
    out->y = y.Reshaped(Concat(plan.batch_dims, features_));
    if (opts.keep_for_backward && saved != nullptr) {
      s->block.plan = plan;
      s->x_shape = in.x.shape();
      s->y_shape = out->y.shape();
      s->compute = in.x.dtype();
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const auto* s,
                     SavedAs<ModuleSaved<DenseGeneralSaved>>(saved, type_name()));
    ASSIGN_OR_RETURN(Tensor dy_c, PrepareDy(ops, dy, s->y_shape, s->compute));
    const Plan& plan = s->block.plan;
    const Dense dense = DenseFor(plan);
    const int64_t n = NumElements(plan.batch_dims);
    Tensor dx;
    RETURN_IF_ERROR(dense.Backward(ops, vars, s->block.dense, dy_c.Reshaped({n, dense.out()}),
                                   &dx, &grads->params));
    ASSIGN_OR_RETURN(grads->dx, UndoContractionPermute(ops, plan, dx, s->x_shape));
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<Plan> MakePlan(const Shape& shape) const {
    return MakeContractionPlan(shape, axis_, "spec.dense_general.axis", "input_shape");
  }

  Dense DenseFor(const Plan& plan) const {
    DenseConfig c;
    c.use_bias = use_bias_;
    c.in_dims = plan.in_dims;
    c.features = features_;
    c.param_dtype = param_dtype_;
    return Dense(c);
  }

  Shape features_;
  bool use_bias_;
  std::vector<int> axis_;
  DType param_dtype_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeDenseGeneral(const te::v1::DenseGeneral& spec) {
  RETURN_IF_ERROR(CheckFeatures(spec.features(), "spec.dense_general.features"));
  RETURN_IF_ERROR(CheckParamDType(spec.dtype(), "spec.dense_general.dtype"));
  std::vector<int> axis(spec.axis().begin(), spec.axis().end());
  if (axis.empty()) axis = {-1};
  return std::unique_ptr<Layer>(std::make_unique<DenseGeneralLayer>(
      Shape(spec.features().begin(), spec.features().end()),
      spec.has_use_bias() ? spec.use_bias() : true, std::move(axis),
      ParamDTypeOf(spec.dtype())));
}

}  // namespace te::layers
