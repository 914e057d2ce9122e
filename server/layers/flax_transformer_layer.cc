// The quickstart's plain-Flax baseline layer (TE docs/examples/quickstart_jax:
// BasicTransformerLayer with its BasicMLP and dot-product attention), so a
// user can compare against TE's modules as the quickstart does:
//
//   ln0 = LayerNorm_0(x)                       nn.LayerNorm(epsilon=layernorm_eps)
//   qkv = ln0 @ Dense_0/kernel (H, 3H)         nn.Dense(3H, use_bias=False)
//   q, k, v = split(qkv as [B, S, heads, 3*D], 3, axis=-1)   (per-head q|k|v)
//   ctx = softmax(q k^T / sqrt(D), causal) v   attention dropout on the probabilities
//   a   = ctx [B, S, H] @ Dense_1/kernel (H, H) nn.Dense(H, use_bias=False)
//   h   = x + dropout(a, hidden_dropout)
//   f   = BasicMLP_0: Dense_0 (H, ffn) + bias -> gelu (tanh) -> Dense_1 (ffn, H) + bias
//   y   = h + dropout(f, hidden_dropout)
//
// Flax initialisers: kernels lecun_normal (variance_scaling(1, "fan_in",
// "truncated_normal")), biases zeros, LayerNorm scale ones and bias zeros.
// Plain Flax ignores TE's autocast: this layer never runs FP8 and has no
// fp8_metas. A padding mask (valid lengths) combines with the causal mask.
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/attention_layers.h"
#include "server/layers/blocks.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

constexpr char kField[] = "spec.flax_transformer_layer";

struct FlaxOptions {
  int64_t hidden = 0;
  int64_t ffn = 0;
  int heads = 0;
  float layernorm_eps = 1e-5f;
  float attention_dropout = 0.1f;
  float hidden_dropout = 0.1f;
  DType param_dtype = DType::kF32;
};

NormConfig LayerNormOf(const FlaxOptions& o, const char* scope) {
  NormConfig c;
  c.scope = scope;
  c.scale_name = "scale";
  c.bias_name = "bias";
  c.args.type = NormType::kLayerNorm;
  c.args.epsilon = o.layernorm_eps;
  c.hidden = o.hidden;
  c.param_dtype = o.param_dtype;
  return c;
}

DenseConfig DenseOf(const FlaxOptions& o, const char* scope, int64_t in, int64_t out,
                    bool use_bias) {
  DenseConfig c;
  c.scope = scope;
  c.use_bias = use_bias;
  c.in_dims = {in};
  c.features = {out};
  c.param_dtype = o.param_dtype;
  return c;
}

class FlaxSaved : public SavedForward {
 public:
  int64_t batch = 0, seq = 0;
  DType compute = DType::kF32;  // x's dtype
  Norm::Saved ln0;
  Dense::Saved qkv;
  AttentionSaved attention;
  Dense::Saved proj;
  DropoutSaved proj_dropout;
  Norm::Saved ln1;
  Dense::Saved fc1;
  Tensor fc1_out;  // the gelu's input
  Dense::Saved fc2;
  DropoutSaved mlp_dropout;
  int64_t bytes() const override {
    return ln0.bytes() + qkv.bytes() + attention.bytes() + proj.bytes() + proj_dropout.bytes() +
           ln1.bytes() + fc1.bytes() + static_cast<int64_t>(fc1_out.nbytes()) + fc2.bytes() +
           mlp_dropout.bytes();
  }
};

class FlaxTransformerLayerImpl : public Layer {
 public:
  explicit FlaxTransformerLayerImpl(FlaxOptions o)
      : o_(o),
        ln0_(LayerNormOf(o, "LayerNorm_0")),
        qkv_(DenseOf(o, "Dense_0", o.hidden, 3 * o.hidden, /*use_bias=*/false)),
        proj_(DenseOf(o, "Dense_1", o.hidden, o.hidden, /*use_bias=*/false)),
        ln1_(LayerNormOf(o, "LayerNorm_1")),
        fc1_(DenseOf(o, "BasicMLP_0/Dense_0", o.hidden, o.ffn, /*use_bias=*/true)),
        fc2_(DenseOf(o, "BasicMLP_0/Dense_1", o.ffn, o.hidden, /*use_bias=*/true)) {}

  std::string type_name() const override { return "FlaxTransformerLayer"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return SpecsOf(Defs());
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return input_shape;
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe*,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return InitVariables(ops, seed, Defs(), vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputShape(in.x.shape()));
    if (!in.extra.empty()) {
      return absl::InvalidArgumentError("extra_inputs: FlaxTransformerLayer takes x alone");
    }
    RETURN_IF_ERROR(CheckFloatActivation(in.x, "x"));
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(Defs())));
    const bool keep = opts.keep_for_backward && saved != nullptr;
    auto s = std::make_unique<FlaxSaved>();
    const int64_t batch = in.x.dim(0), seq = in.x.dim(1), tokens = batch * seq;
    const int64_t head_dim = o_.hidden / o_.heads;
    s->batch = batch;
    s->seq = seq;
    s->compute = in.x.dtype();
    const Tensor x2 = in.x.As2D();

    Tensor ln0, qkv;
    RETURN_IF_ERROR(ln0_.Forward(ops, *vars, x2, &ln0, keep ? &s->ln0 : nullptr));
    RETURN_IF_ERROR(qkv_.Forward(ops, vars, ln0, nullptr, &qkv, keep ? &s->qkv : nullptr));
    // [B, S, heads, 3 * D] split on the last axis: per head, q | k | v.
    ASSIGN_OR_RETURN(std::vector<Tensor> parts,
                     SplitAxis(ops, qkv.Reshaped({batch, seq, o_.heads, 3, head_dim}), 3));
    const bool padded = in.q_seqlens.defined() && in.q_seqlens.numel() > 0;
    Tensor context;
    RETURN_IF_ERROR(AttentionForward(ops, AttentionSettings(padded), parts[0], parts[1], parts[2],
                                     SeqLens{in.q_seqlens, in.kv_seqlens}, Tensor(),
                                     !opts.deterministic,
                                     DeriveSeed(opts.dropout_seed, "attention_dropout"), &context,
                                     keep ? &s->attention : nullptr));

    Tensor a, a_dropped, h;
    RETURN_IF_ERROR(proj_.Forward(ops, vars, context.Reshaped({tokens, o_.hidden}), nullptr, &a,
                                  keep ? &s->proj : nullptr));
    RETURN_IF_ERROR(Dropout(ops, o_.hidden_dropout, opts.deterministic,
                            DeriveSeed(opts.dropout_seed, "hidden_dropout_0"), a, &a_dropped,
                            &s->proj_dropout));
    RETURN_IF_ERROR(ResidualAdd(ops, x2, a_dropped, &h));

    Tensor ln1, fc1_out, act, f, f_dropped, y;
    RETURN_IF_ERROR(ln1_.Forward(ops, *vars, h, &ln1, keep ? &s->ln1 : nullptr));
    RETURN_IF_ERROR(fc1_.Forward(ops, vars, ln1, nullptr, &fc1_out, keep ? &s->fc1 : nullptr));
    ASSIGN_OR_RETURN(act, NewTensor(ops, fc1_out.dtype(), fc1_out.shape()));
    RETURN_IF_ERROR(ops.ActivationForward({Activation::kGelu}, fc1_out, &act));
    RETURN_IF_ERROR(fc2_.Forward(ops, vars, act, nullptr, &f, keep ? &s->fc2 : nullptr));
    RETURN_IF_ERROR(Dropout(ops, o_.hidden_dropout, opts.deterministic,
                            DeriveSeed(opts.dropout_seed, "hidden_dropout_1"), f, &f_dropped,
                            &s->mlp_dropout));
    RETURN_IF_ERROR(ResidualAdd(ops, h, f_dropped, &y));
    out->y = y.Reshaped(in.x.shape());
    if (keep) {
      s->fc1_out = fc1_out;
      *saved = std::move(s);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* s = dynamic_cast<const FlaxSaved*>(&saved);
    if (s == nullptr) {
      return absl::InvalidArgumentError("saved forward does not come from FlaxTransformerLayer");
    }
    const Shape shape = {s->batch, s->seq, o_.hidden};
    ASSIGN_OR_RETURN(const Tensor dy_c, PrepareGradient(ops, dy, shape, s->compute));
    grads->dextra.clear();
    Variables* pgrads = &grads->params;
    const int64_t tokens = s->batch * s->seq, head_dim = o_.hidden / o_.heads;
    const Tensor dy2 = dy_c.As2D();

    // y = h + dropout(fc2(gelu(fc1(ln1(h))))).
    Tensor df, dact, dfc1, dln1, dh_mlp, dh;
    RETURN_IF_ERROR(DropoutGrad(ops, s->mlp_dropout, dy2, &df));
    RETURN_IF_ERROR(fc2_.Backward(ops, vars, s->fc2, df, &dact, pgrads));
    ASSIGN_OR_RETURN(dfc1, NewTensor(ops, s->fc1_out.dtype(), s->fc1_out.shape()));
    RETURN_IF_ERROR(ops.ActivationBackward({Activation::kGelu}, dact, s->fc1_out, &dfc1));
    RETURN_IF_ERROR(fc1_.Backward(ops, vars, s->fc1, dfc1, &dln1, pgrads));
    RETURN_IF_ERROR(ln1_.Backward(ops, s->ln1, dln1, &dh_mlp, pgrads));
    RETURN_IF_ERROR(ResidualAdd(ops, dy2, dh_mlp, &dh));

    // h = x + dropout(proj(attention(split(qkv(ln0(x)))))).
    Tensor da, dcontext, dq, dk, dv, dln0, dx_attention, dx;
    RETURN_IF_ERROR(DropoutGrad(ops, s->proj_dropout, dh, &da));
    RETURN_IF_ERROR(proj_.Backward(ops, vars, s->proj, da, &dcontext, pgrads));
    RETURN_IF_ERROR(AttentionBackward(ops, s->attention,
                                      dcontext.Reshaped({s->batch, s->seq, o_.heads, head_dim}),
                                      &dq, &dk, &dv, nullptr));
    ASSIGN_OR_RETURN(Tensor dqkv, StackAxis(ops, {dq, dk, dv}, 3));
    RETURN_IF_ERROR(
        qkv_.Backward(ops, vars, s->qkv, dqkv.Reshaped({tokens, 3 * o_.hidden}), &dln0, pgrads));
    RETURN_IF_ERROR(ln0_.Backward(ops, s->ln0, dln0, &dx_attention, pgrads));
    RETURN_IF_ERROR(ResidualAdd(ops, dh, dx_attention, &dx));
    grads->dx = dx.Reshaped(shape);
    return absl::OkStatus();
  }

 private:
  AttentionConfig AttentionSettings(bool padded) const {
    AttentionConfig c;
    c.num_heads = o_.heads;
    c.num_gqa_groups = o_.heads;
    c.head_dim = static_cast<int>(o_.hidden / o_.heads);
    c.mask = padded ? MaskType::kPaddingCausal : MaskType::kCausal;
    c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
    c.dropout_rate = o_.attention_dropout;
    return c;
  }

  std::vector<VariableDef> Defs() const {
    std::vector<VariableDef> defs;
    for (std::vector<VariableDef> part : {ln0_.Defs(), qkv_.Defs(nullptr), proj_.Defs(nullptr),
                                          ln1_.Defs(), fc1_.Defs(nullptr), fc2_.Defs(nullptr)}) {
      defs.insert(defs.end(), part.begin(), part.end());
    }
    return defs;
  }

  absl::Status CheckInputShape(const Shape& shape) const {
    if (shape.size() == 3 && shape[0] > 0 && shape[1] > 0 && shape[2] == o_.hidden) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("input_shape ", ShapeString(shape),
                                                   " does not fit FlaxTransformerLayer: want "
                                                   "[batch, seq, ",
                                                   o_.hidden, "] (hidden_size)"));
  }

  FlaxOptions o_;
  Norm ln0_;
  Dense qkv_;
  Dense proj_;
  Norm ln1_;
  Dense fc1_;
  Dense fc2_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxTransformerLayer(
    const te::v1::FlaxTransformerLayer& spec) {
  FlaxOptions o;
  o.hidden = spec.hidden_size();
  o.ffn = spec.ffn_hidden_size();
  o.heads = spec.num_attention_heads();
  if (o.hidden <= 0 || o.ffn <= 0 || o.heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField, ": hidden_size (", o.hidden, "), ffn_hidden_size (", o.ffn,
        ") and num_attention_heads (", o.heads, ") are required and must be positive"));
  }
  if (o.hidden % o.heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".hidden_size (", o.hidden,
                                                   ") must be a multiple of num_attention_heads (",
                                                   o.heads, ")"));
  }
  o.layernorm_eps = spec.has_layernorm_eps() ? spec.layernorm_eps() : 1e-5f;
  o.attention_dropout = spec.has_attention_dropout() ? spec.attention_dropout() : 0.1f;
  o.hidden_dropout = spec.has_hidden_dropout() ? spec.hidden_dropout() : 0.1f;
  o.param_dtype = ParamDTypeOf(spec.dtype());
  if (!(o.layernorm_eps > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, ".layernorm_eps must be positive; got ", o.layernorm_eps));
  }
  for (const auto& [name, rate] :
       {std::pair<const char*, float>{"attention_dropout", o.attention_dropout},
        {"hidden_dropout", o.hidden_dropout}}) {
    if (!(rate >= 0.0f && rate < 1.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kField, ".", name, " must be in [0, 1); got ", rate));
    }
  }
  return std::unique_ptr<Layer>(new FlaxTransformerLayerImpl(o));
}

}  // namespace te::layers
