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

constexpr int kMaxPermuteRank = 5;  // Ops::Permute's limit

// How an input of some shape is laid out for the GEMM.
struct Plan {
  std::vector<int> perm;  // x axes in GEMM order: batch axes, then contracted axes
  bool identity = true;
  Shape batch_dims;
  Shape in_dims;
};

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
    Tensor x = in.x;
    if (!plan.identity) {
      Shape permuted;
      for (int a : plan.perm) permuted.push_back(x.dim(a));
      ASSIGN_OR_RETURN(x, ops.Allocate(in.x.dtype(), permuted));
      RETURN_IF_ERROR(ops.Permute(in.x, plan.perm, &x));
    }
    const int64_t n = NumElements(plan.batch_dims);
    auto s = std::make_unique<ModuleSaved<DenseGeneralSaved>>();
    Tensor y;
    RETURN_IF_ERROR(dense.Forward(ops, vars, x.Reshaped({n, dense.in()}), opts.fp8, &y,
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
    if (plan.identity) {
      grads->dx = dx.Reshaped(s->x_shape);
      return absl::OkStatus();
    }
    // dx is in the permuted layout: apply the inverse permutation.
    std::vector<int> inverse(plan.perm.size());
    Shape permuted;
    for (size_t i = 0; i < plan.perm.size(); ++i) {
      inverse[plan.perm[i]] = static_cast<int>(i);
      permuted.push_back(s->x_shape[plan.perm[i]]);
    }
    ASSIGN_OR_RETURN(grads->dx, ops.Allocate(dx.dtype(), s->x_shape));
    return ops.Permute(dx.Reshaped(permuted), inverse, &grads->dx);
  }

 private:
  absl::StatusOr<Plan> MakePlan(const Shape& shape) const {
    RETURN_IF_ERROR(CheckInputShape(shape, 1));
    const int rank = static_cast<int>(shape.size());
    Plan plan;
    std::vector<bool> contracted(rank, false);
    std::vector<int> axes;
    for (int a : axis_) {
      const int norm = a < 0 ? a + rank : a;
      if (norm < 0 || norm >= rank || contracted[norm]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "spec.dense_general.axis: axis ", a, " is out of range or repeated for input_shape ",
            ShapeString(shape)));
      }
      contracted[norm] = true;
      axes.push_back(norm);
    }
    for (int a = 0; a < rank; ++a) {
      if (!contracted[a]) {
        plan.perm.push_back(a);
        plan.batch_dims.push_back(shape[a]);
      }
    }
    for (int a : axes) {
      plan.perm.push_back(a);
      plan.in_dims.push_back(shape[a]);
    }
    for (int i = 0; i < rank; ++i) plan.identity = plan.identity && plan.perm[i] == i;
    if (!plan.identity && rank > kMaxPermuteRank) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_shape ", ShapeString(shape), ": contracting non-trailing axes "
                       "needs rank <= ", kMaxPermuteRank));
    }
    return plan;
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
