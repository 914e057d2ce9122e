// nn.MultiHeadDotProductAttention with Flax's semantics (flax_modules.h):
//
//   q = query(inputs_q)   [B, Sq, H, D]   DenseGeneral(features=(H, D))
//   k = key(inputs_k)     [B, Skv, H, D]
//   v = value(inputs_v)   [B, Skv, H, D]
//   a = softmax(q k^T / sqrt(D) + mask) v, dropout on the weights
//   y = out(a)            [B, Sq, out_features]   DenseGeneral(axis=(-2, -1))
//
// with D = qkv_features / H. The four projections are Flax's DenseGeneral
// (flax_modules_internal.h), all in the computation dtype; the attention is
// the server's attention core (attention_core.h: cuDNN's fused kernels on
// CUDA where they take the dtype and head_dim, the unfused kernels
// elsewhere), so it runs in that dtype too, as Flax's dot_product_attention
// runs in its promoted q, k, v. cuDNN's fused attention is bfloat16/float16
// only: the float32 attention that a bfloat16 x with float32 params makes
// runs the unfused kernels on CUDA, the slow path (about 350 ms of the
// quickstart's 520 ms step on an H200; flax_modules_gpu_test times it).
#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/flax_modules.h"
#include "server/layers/flax_modules_internal.h"
#include "server/layers/module_util.h"

namespace te::layers {
namespace {

constexpr char kField[] = "spec.flax_multi_head_dot_product_attention";

struct Options {
  int heads = 0;
  std::optional<int64_t> qkv_features;  // nullopt: x's features
  std::optional<int64_t> out_features;  // nullopt: x's features
  float dropout_rate = 0.0f;
  bool use_bias = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::kF32;
  bool highest_precision = false;  // the projections' precision (DEFAULT: the call's)
  bool causal = false;
};

// The sizes an input's features give.
struct Sizes {
  int64_t features = 0;  // F: x's (and k's, v's) last axis
  int64_t head_dim = 0;  // D
  int64_t out = 0;
};

class MhaSaved : public SavedForward {
 public:
  Sizes sizes;
  flax::DenseGeneral::Saved query, key, value, out;
  AttentionSaved attention;
  size_t num_extra = 0;  // 0: k = v = x; 1: k = v = extra[0]; 2: k, v
  int64_t bytes() const override {
    return query.bytes() + key.bytes() + value.bytes() + out.bytes() + attention.bytes();
  }
};

class MultiHeadDotProductAttention : public Layer {
 public:
  explicit MultiHeadDotProductAttention(Options o) : o_(o) {}

  std::string type_name() const override { return "FlaxMultiHeadDotProductAttention"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    ASSIGN_OR_RETURN(const Sizes sizes, SizesFor(input_shape, "input_shape"));
    return SpecsOf(Defs(sizes));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    ASSIGN_OR_RETURN(const Sizes sizes, SizesFor(input_shape, "input_shape"));
    return Shape{input_shape[0], input_shape[1], sizes.out};
  }

  DType OutputDType(DType input) const override {
    return flax::ComputeDType(o_.dtype, input, o_.param_dtype, /*has_params=*/true);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe*,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(const Sizes sizes, SizesFor(input_shape, "input_shape"));
    return InitVariables(ops, seed, Defs(sizes), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckFloatActivation(in.x, "x"));
    ASSIGN_OR_RETURN(const Sizes sizes, SizesFor(in.x.shape(), "x.shape"));
    if (in.extra.size() > 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: ", type_name(), " takes inputs_k and inputs_v at most; got ",
          in.extra.size(), " extra inputs"));
    }
    // Flax: inputs_k defaults to inputs_q, inputs_v to inputs_k.
    const Tensor& q_in = in.x;
    const Tensor& k_in = in.extra.empty() ? q_in : in.extra[0];
    const Tensor& v_in = in.extra.size() < 2 ? k_in : in.extra[1];
    for (size_t i = 0; i < in.extra.size(); ++i) {
      RETURN_IF_ERROR(CheckKeyValue(in.extra[i], q_in, k_in, absl::StrCat("extra_inputs[", i, "]")));
    }
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(Defs(sizes))));

    const bool keep = opts.keep_for_backward && saved != nullptr;
    auto s = std::make_unique<MhaSaved>();
    s->sizes = sizes;
    s->num_extra = in.extra.size();
    Tensor q, k, v, context;
    const bool tf32 = opts.tf32;
    RETURN_IF_ERROR(
        Projection("query", sizes).Forward(ops, vars, q_in, tf32, &q, keep ? &s->query : nullptr));
    RETURN_IF_ERROR(
        Projection("key", sizes).Forward(ops, vars, k_in, tf32, &k, keep ? &s->key : nullptr));
    RETURN_IF_ERROR(
        Projection("value", sizes).Forward(ops, vars, v_in, tf32, &v, keep ? &s->value : nullptr));
    const bool padded = HasMask(in);
    RETURN_IF_ERROR(AttentionForward(ops, AttentionSettings(sizes, padded), q, k, v,
                                     MaskOf(in), Tensor(),
                                     !opts.deterministic,
                                     DeriveSeed(opts.dropout_seed, "attention_weights"), &context,
                                     keep ? &s->attention : nullptr));
    RETURN_IF_ERROR(OutProjection(sizes).Forward(ops, vars, context, tf32, &out->y,
                                                 keep ? &s->out : nullptr));
    if (keep) *saved = std::move(s);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const MhaSaved* s, SavedAs<MhaSaved>(saved, type_name()));
    const Sizes& sizes = s->sizes;
    Variables* pgrads = &grads->params;
    Tensor dcontext, dq, dk, dv, dq_in, dk_in, dv_in;
    RETURN_IF_ERROR(OutProjection(sizes).Backward(ops, vars, s->out, dy, &dcontext, pgrads));
    RETURN_IF_ERROR(AttentionBackward(ops, s->attention, dcontext, &dq, &dk, &dv, nullptr));
    RETURN_IF_ERROR(Projection("query", sizes).Backward(ops, vars, s->query, dq, &dq_in, pgrads));
    RETURN_IF_ERROR(Projection("key", sizes).Backward(ops, vars, s->key, dk, &dk_in, pgrads));
    RETURN_IF_ERROR(Projection("value", sizes).Backward(ops, vars, s->value, dv, &dv_in, pgrads));
    // A tensor that fed several projections gets the sum of their gradients.
    grads->dextra.clear();
    switch (s->num_extra) {
      case 0: {
        Tensor dkv;
        RETURN_IF_ERROR(ResidualAdd(ops, dk_in, dv_in, &dkv));
        grads->dx = Tensor();
        return ResidualAdd(ops, dq_in, dkv, &grads->dx);
      }
      case 1: {
        grads->dx = dq_in;
        Tensor dkv;
        RETURN_IF_ERROR(ResidualAdd(ops, dk_in, dv_in, &dkv));
        grads->dextra.push_back(dkv);
        return absl::OkStatus();
      }
      default:
        grads->dx = dq_in;
        grads->dextra = {dk_in, dv_in};
        return absl::OkStatus();
    }
  }

 private:
  absl::StatusOr<Sizes> SizesFor(const Shape& shape, const std::string& field) const {
    if (shape.size() != 3 || shape[0] <= 0 || shape[1] <= 0 || shape[2] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " ", ShapeString(shape), " does not fit ", type_name(),
          ": want [batch, length, features] with positive sizes"));
    }
    Sizes sizes;
    sizes.features = shape[2];
    const int64_t qkv = o_.qkv_features.value_or(sizes.features);
    if (qkv % o_.heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kField, ".qkv_features (", qkv, o_.qkv_features ? "" : ": x's features, as it is unset",
          ") must be a multiple of num_heads (", o_.heads, ")"));
    }
    sizes.head_dim = qkv / o_.heads;
    sizes.out = o_.out_features.value_or(sizes.features);
    return sizes;
  }

  // k and v: [B, Skv, F] like q's batch and features (their kernels are
  // sized from x's), in q's dtype; v's length is k's.
  absl::Status CheckKeyValue(const Tensor& t, const Tensor& q, const Tensor& k,
                             const std::string& field) const {
    RETURN_IF_ERROR(CheckFloatActivation(t, field));
    if (t.rank() != 3 || t.dim(0) != q.dim(0) || t.dim(2) != q.dim(2) || t.dim(1) <= 0 ||
        t.dim(1) != k.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape ", ShapeString(t.shape()), " does not fit q ", ShapeString(q.shape()),
          ": want [", q.dim(0), ", kv_length, ", q.dim(2),
          "] (the key and value kernels are sized from x's features; v's length is k's)"));
    }
    if (t.dtype() != q.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".dtype: ", DTypeName(t.dtype()), ", but q is ", DTypeName(q.dtype()),
          "; give inputs_q, inputs_k and inputs_v one dtype"));
    }
    return absl::OkStatus();
  }

  flax::DenseGeneral Projection(const char* name, const Sizes& sizes) const {
    return DenseGeneralOf(name, {o_.heads, sizes.head_dim}, {-1});
  }

  flax::DenseGeneral OutProjection(const Sizes& sizes) const {
    return DenseGeneralOf("out", {sizes.out}, {-2, -1});
  }

  // A projection with the module's bias, dtypes and precision.
  flax::DenseGeneral DenseGeneralOf(const char* scope, Shape features,
                                    std::vector<int> axis) const {
    flax::DenseGeneralConfig c;
    c.scope = scope;
    c.features = std::move(features);
    c.axis = std::move(axis);
    c.use_bias = o_.use_bias;
    c.dtype = o_.dtype;
    c.param_dtype = o_.param_dtype;
    c.highest_precision = o_.highest_precision;
    c.field = kField;
    return flax::DenseGeneral(c);
  }

  std::vector<VariableDef> Defs(const Sizes& sizes) const {
    std::vector<VariableDef> defs;
    // Plans for one token: the kernels depend on the feature axes alone.
    for (const char* name : {"query", "key", "value"}) {
      const flax::DenseGeneral p = Projection(name, sizes);
      for (VariableDef& d : p.Defs(*p.MakePlan({1, 1, sizes.features}))) defs.push_back(std::move(d));
    }
    const flax::DenseGeneral out = OutProjection(sizes);
    for (VariableDef& d : out.Defs(*out.MakePlan({1, 1, o_.heads, sizes.head_dim}))) {
      defs.push_back(std::move(d));
    }
    return defs;
  }

  AttentionConfig AttentionSettings(const Sizes& sizes, bool padded) const {
    AttentionConfig c;
    c.num_heads = o_.heads;
    c.num_gqa_groups = o_.heads;
    c.head_dim = static_cast<int>(sizes.head_dim);
    c.mask = o_.causal ? MaskType::kCausal : padded ? MaskType::kPadding : MaskType::kNoMask;
    // Flax scales q by 1/sqrt(D) before q k^T: the same logits.
    c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sizes.head_dim)));
    c.dropout_rate = o_.dropout_rate;
    return c;
  }

  Options o_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxMultiHeadDotProductAttention(
    const te::v1::FlaxMultiHeadDotProductAttention& spec, bool causal) {
  Options o;
  o.heads = spec.num_heads();
  if (o.heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField, ".num_heads is required and must be positive; got ", spec.num_heads()));
  }
  // Unset: x's features (Flax's None).
  auto features = [](const char* name, bool has,
                     int64_t value) -> absl::StatusOr<std::optional<int64_t>> {
    if (!has) return std::optional<int64_t>();
    if (value <= 0 || value > (int64_t{1} << 31)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kField, ".", name, " must be in [1, 2^31] when set; got ", value));
    }
    return std::optional<int64_t>(value);
  };
  ASSIGN_OR_RETURN(o.qkv_features,
                   features("qkv_features", spec.has_qkv_features(), spec.qkv_features()));
  ASSIGN_OR_RETURN(o.out_features,
                   features("out_features", spec.has_out_features(), spec.out_features()));
  if (o.qkv_features && *o.qkv_features % o.heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".qkv_features (", *o.qkv_features,
                                                   ") must be a multiple of num_heads (", o.heads,
                                                   ")"));
  }
  o.dropout_rate = spec.has_dropout_rate() ? spec.dropout_rate() : 0.0f;
  if (!(o.dropout_rate >= 0.0f && o.dropout_rate < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, ".dropout_rate must be in [0, 1); got ", o.dropout_rate));
  }
  o.use_bias = !spec.has_use_bias() || spec.use_bias();
  // broadcast_dropout is accepted either way; the mask is per element
  // (flax_modules.h says why).
  ASSIGN_OR_RETURN(o.dtype, flax::ComputeDTypeOf(spec.dtype(), absl::StrCat(kField, ".dtype")));
  ASSIGN_OR_RETURN(o.param_dtype,
                   flax::ParamDTypeOf(spec.param_dtype(), absl::StrCat(kField, ".param_dtype")));
  ASSIGN_OR_RETURN(o.highest_precision, flax::HighestPrecisionOf(
                                             spec.precision(), absl::StrCat(kField, ".precision")));
  o.causal = causal;
  return std::unique_ptr<Layer>(new MultiHeadDotProductAttention(o));
}

}  // namespace te::layers
