// TE's TransformerLayer (layer_type encoder: self-attention, pre-norm):
//
//   bias = relpos_bias(S, S)            T5 buckets, bidirectional (encoder);
//                                       only with enable_relative_embedding
//   a    = MHA(x, mask, bias)           scope "attention" (input layernorm inside)
//   h    = dropout(a, hidden_dropout) + x
//   z    = LayerNormMLP(h)              scope "mlp" (intermediate_dropout inside)
//   y    = dropout(z, hidden_dropout) + h
//
// Params: attention/{qkv|query,kv,out}/..., mlp/{scale, ln_bias, wi_kernel,
// wo_kernel, ...}, relpos_bias/rel_embedding [heads, 32] (TE's
// RelativePositionBiases: num_buckets 32, max_distance 128, init
// variance_scaling(1, "fan_avg", "uniform")).
//
// The quickstart's TE variant, for the client helper, is
//   TransformerLayer(hidden_size=4096, mlp_hidden_size=16384,
//                    num_attention_heads=32, mlp_activations=("gelu",),
//                    self_attn_mask_type="causal", layernorm_epsilon=1e-5,
//                    use_bias=True, intermediate_dropout=0.0,
//                    enable_relative_embedding=False,
//                    self_attn_bias_type="no_bias", hidden_dropout=0.0,
//                    dtype=jnp.bfloat16)
// applied to x [4, 2048, 4096] bf16 with attention_dropout left at 0.1 and
// deterministic=False in the timed step (TE docs/examples/quickstart_jax.ipynb).
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/attention_layers.h"
#include "server/layers/blocks.h"
#include "server/layers/cache.h"
#include "server/layers/multi_head_attention.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

constexpr char kField[] = "spec.transformer_layer";
constexpr int kNumBuckets = 32;
constexpr int kMaxDistance = 128;
constexpr char kRelEmbedding[] = "params/relpos_bias/rel_embedding";

struct TransformerOptions {
  int64_t hidden = 512;
  MhaOptions attention;  // scope "attention"
  MlpConfig mlp;         // scope "mlp"
  float hidden_dropout = 0.1f;
  bool relative_embedding = true;
  DType param_dtype = DType::kF32;
};

class TransformerSaved : public SavedForward {
 public:
  DType compute = DType::kF32;  // x's dtype
  Tensor buckets;               // int32 [S, S] when the relative embedding is on
  MhaBlock::Saved attention;
  DropoutSaved attention_dropout;
  Mlp::Saved mlp;
  DropoutSaved mlp_dropout;
  int64_t bytes() const override {
    return static_cast<int64_t>(buckets.nbytes()) + attention.bytes() + attention_dropout.bytes() +
           mlp.bytes() + mlp_dropout.bytes();
  }
};

class TransformerLayerImpl : public Layer {
 public:
  explicit TransformerLayerImpl(TransformerOptions options)
      : options_(std::move(options)),
        attention_(options_.attention, options_.hidden),
        mlp_(options_.mlp),
        buckets_(/*bidirectional=*/true, kNumBuckets, kMaxDistance) {}

  std::string type_name() const override { return "TransformerLayer"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return SpecsOf(Defs(fp8));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return input_shape;
  }

  // The self-attention's cache (cache/attention/...), for generation only:
  // TE decodes no encoder.
  absl::StatusOr<std::vector<VariableSpec>> CacheSpecs(const Shape& input_shape,
                                                       DType input_dtype,
                                                       bool internal_decode) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    RETURN_IF_ERROR(DecodeAllowed(internal_decode));
    RETURN_IF_ERROR(CheckCacheDType(input_dtype));
    return attention_.CacheSpecs(input_shape[0], input_shape[1], input_dtype);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    RETURN_IF_ERROR(attention_.Init(ops, seed, fp8, vars));
    RETURN_IF_ERROR(InitVariables(ops, seed, mlp_.Defs(fp8), vars));
    if (options_.relative_embedding) {
      const VariableSpec spec = RelEmbeddingSpec();
      // variance_scaling(1, "fan_avg", "uniform") on (heads, buckets): fan_in =
      // heads, fan_out = buckets, limit = sqrt(3 / fan_avg).
      const double fan_avg = (spec.shape[0] + spec.shape[1]) / 2.0;
      RETURN_IF_ERROR(StoreVariable(
          ops, spec,
          UniformValues(seed, spec.name, std::sqrt(3.0 / fan_avg)), vars));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputShape(in.x.shape()));
    if (!in.extra.empty()) {
      return absl::InvalidArgumentError("extra_inputs: TransformerLayer takes x alone");
    }
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(Defs(opts.fp8))));
    if (opts.decode) RETURN_IF_ERROR(DecodeAllowed(opts.internal_decode));
    const bool keep = opts.keep_for_backward && saved != nullptr;
    auto kept = std::make_unique<TransformerSaved>();
    kept->compute = in.x.dtype();
    const int64_t seq = in.x.dim(1);

    Tensor bias;
    ForwardOptions step = opts;  // a decode step's, with the cache index it read
    if (options_.relative_embedding && opts.decode) {
      ASSIGN_OR_RETURN(step.decode_cache_index, attention_.CacheIndex(ops, *vars, opts));
      ASSIGN_OR_RETURN(bias, DecodeBias(ops, *vars, step.decode_cache_index, seq));
    } else if (options_.relative_embedding) {
      ASSIGN_OR_RETURN(kept->buckets, buckets_.Buckets(ops, seq, seq));
      ASSIGN_OR_RETURN(Tensor table, GetVariable(*vars, kRelEmbedding));
      ASSIGN_OR_RETURN(bias, RelativeBias(ops, table, kept->buckets));
    }
    auto attend = [&](Tensor* a, const Tensor& residual) {
      if (opts.decode) {
        return attention_.Decode(ops, vars, in.x, MaskOf(in), bias, step, a, nullptr, residual);
      }
      return attention_.Forward(ops, vars, in.x, MaskOf(in), bias, opts, a, nullptr,
                                keep ? &kept->attention : nullptr, residual);
    };
    // Without dropout on the blocks' outputs the residual adds run in their
    // last GEMMs (the attention's projection, the MLP's wo).
    const bool fused_residual = opts.deterministic || options_.hidden_dropout <= 0.0f;
    Tensor attention_out, dropped, h;
    if (fused_residual) {
      RETURN_IF_ERROR(attend(&h, in.x));
    } else {
      RETURN_IF_ERROR(attend(&attention_out, Tensor()));
      RETURN_IF_ERROR(Dropout(ops, options_.hidden_dropout, opts.deterministic,
                              DeriveSeed(opts.dropout_seed, "hidden_dropout_0"), attention_out,
                              &dropped, &kept->attention_dropout));
      RETURN_IF_ERROR(ResidualAdd(ops, dropped, in.x, &h));
    }

    RETURN_IF_ERROR(ops.CheckInterrupt());  // between attention and MLP
    Tensor z, z_dropped, y;
    if (fused_residual) {
      RETURN_IF_ERROR(mlp_.Forward(ops, vars, h.As2D(), opts, &y, nullptr,
                                   keep ? &kept->mlp : nullptr, h.As2D()));
      out->y = y.Reshaped(h.shape());
    } else {
      RETURN_IF_ERROR(
          mlp_.Forward(ops, vars, h.As2D(), opts, &z, nullptr, keep ? &kept->mlp : nullptr));
      RETURN_IF_ERROR(Dropout(ops, options_.hidden_dropout, opts.deterministic,
                              DeriveSeed(opts.dropout_seed, "hidden_dropout_1"),
                              z.Reshaped(h.shape()), &z_dropped, &kept->mlp_dropout));
      RETURN_IF_ERROR(ResidualAdd(ops, z_dropped, h, &y));
      out->y = y;
    }
    if (keep) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const TransformerSaved*>(&saved);
    if (kept == nullptr) {
      return absl::InvalidArgumentError("saved forward does not come from TransformerLayer");
    }
    // A copy shares the tensors: the caller's saved forward keeps them all.
    return RunBackward(ops, vars, *kept, dy, grads);
  }

  absl::Status BackwardOnce(Ops& ops, Variables* vars, std::unique_ptr<SavedForward> saved,
                            const Tensor& dy, LayerGrads* grads) const override {
    auto* kept = dynamic_cast<TransformerSaved*>(saved.get());
    if (kept == nullptr) {
      return absl::InvalidArgumentError("saved forward does not come from TransformerLayer");
    }
    TransformerSaved own = std::move(*kept);
    saved.reset();
    return RunBackward(ops, vars, std::move(own), dy, grads);
  }

 private:
  // The backward on `kept`, whose parts go as they are used: the MLP's
  // activations before the attention's backward runs (when `kept` is the only
  // holder of them).
  absl::Status RunBackward(Ops& ops, Variables* vars, TransformerSaved kept, const Tensor& dy,
                           LayerGrads* grads) const {
    const Shape shape = {kept.attention.batch, kept.attention.seq, options_.hidden};
    ASSIGN_OR_RETURN(const Tensor dy_c, PrepareGradient(ops, dy, shape, kept.compute));
    grads->dextra.clear();
    // y = dropout(z) + h: dh gets dy directly (added in the MLP's norm
    // backward) and through the MLP.
    Tensor dz, dh2;
    RETURN_IF_ERROR(DropoutGrad(ops, kept.mlp_dropout, dy_c, &dz));
    kept.mlp_dropout = DropoutSaved();
    RETURN_IF_ERROR(mlp_.Backward(ops, vars, std::move(kept.mlp), dz.As2D(), &dh2,
                                  &grads->params, dy_c.As2D()));
    dz = Tensor();
    const Tensor dh = dh2.Reshaped(shape);
    dh2 = Tensor();
    RETURN_IF_ERROR(ops.CheckInterrupt());  // between MLP and attention
    Tensor da, dbias;
    RETURN_IF_ERROR(DropoutGrad(ops, kept.attention_dropout, dh, &da));
    kept.attention_dropout = DropoutSaved();
    // h = dropout(a) + x: dx gets dh directly (added in the attention's norm
    // backward) and through the attention.
    RETURN_IF_ERROR(attention_.Backward(ops, vars, std::move(kept.attention), da, &grads->dx,
                                        options_.relative_embedding ? &dbias : nullptr,
                                        &grads->params, dh));
    if (options_.relative_embedding) {
      ASSIGN_OR_RETURN(
          grads->params[kRelEmbedding],
          RelativeBiasGrad(ops, dbias, kept.buckets, kNumBuckets, options_.param_dtype));
    }
    return absl::OkStatus();
  }

  VariableSpec RelEmbeddingSpec() const {
    return {kRelEmbedding, {options_.attention.num_heads, kNumBuckets}, options_.param_dtype};
  }

  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const {
    std::vector<VariableDef> defs = attention_.Defs(fp8);
    const std::vector<VariableDef> mlp = mlp_.Defs(fp8);
    defs.insert(defs.end(), mlp.begin(), mlp.end());
    if (options_.relative_embedding) {
      defs.push_back({RelEmbeddingSpec(), Initializer::Zeros()});  // redrawn in Init
    }
    return defs;
  }

  // TE asserts "decode should be False when layer_type ==
  // TransformerLayerType.ENCODER", and every TransformerLayer here is an
  // encoder; generation decodes one whose self-attention is causal (what
  // its full forward gives each row, one row at a time).
  absl::Status DecodeAllowed(bool internal_decode) const {
    if (!internal_decode) {
      return absl::InvalidArgumentError(
          "decode: decode should be False when layer_type == TransformerLayerType.ENCODER");
    }
    if (!IsCausalMask(options_.attention.mask)) {
      return absl::InvalidArgumentError(
          "decode: generation runs a causal self-attention one position at a time; this "
          "TransformerLayer's self_attn_mask_type is not causal");
    }
    return absl::OkStatus();
  }

  // The relative bias of a decode step's S rows at cache index p against all
  // L cache rows, f32 [H, S, L]: rows p..p + S - 1 of the [L, L] table TE
  // makes (the bucket of key j for query i depends on j - i alone). Undefined
  // where the rows fall outside the cache (the step reports that).
  absl::StatusOr<Tensor> DecodeBias(Ops& ops, const Variables& vars, int64_t position,
                                    int64_t tokens) const {
    auto key = vars.find(KvCacheNamesAt(options_.attention.scope).key);
    if (key == vars.end() || key->second.rank() != 4) return Tensor();
    const int64_t length = key->second.dim(1);
    if (position < 0 || position + tokens > length) return Tensor();
    ASSIGN_OR_RETURN(const Tensor buckets, buckets_.Buckets(ops, length, length));
    ASSIGN_OR_RETURN(const Tensor table, GetVariable(vars, kRelEmbedding));
    return RelativeBias(ops, table, buckets.Slice0(position, position + tokens));
  }

  absl::Status CheckInputShape(const Shape& shape) const {
    if (shape.size() == 3 && shape[0] > 0 && shape[1] > 0 && shape[2] == options_.hidden) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("input_shape ", ShapeString(shape),
                                                   " does not fit TransformerLayer: want "
                                                   "[batch, seq, ",
                                                   options_.hidden, "] (hidden_size)"));
  }

  TransformerOptions options_;
  MhaBlock attention_;
  Mlp mlp_;
  RelativeBucketCache buckets_;
};

absl::Status CheckRate(float rate, const char* name) {
  if (rate >= 0.0f && rate < 1.0f) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(kField, ".", name, " must be in [0, 1); got ", rate));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeTransformerLayer(const te::v1::TransformerLayer& spec) {
  TransformerOptions o;
  o.hidden = spec.has_hidden_size() ? spec.hidden_size() : 512;
  const int64_t mlp_hidden = spec.has_mlp_hidden_size() ? spec.mlp_hidden_size() : 2048;
  const int heads = spec.has_num_attention_heads() ? spec.num_attention_heads() : 8;
  if (o.hidden <= 0 || mlp_hidden <= 0 || heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, ": hidden_size (", o.hidden, "), mlp_hidden_size (", mlp_hidden,
                     ") and num_attention_heads (", heads, ") must be positive"));
  }
  if (o.hidden % heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".hidden_size (", o.hidden,
                                                   ") must be a multiple of num_attention_heads (",
                                                   heads, ")"));
  }
  o.param_dtype = ParamDTypeOf(spec.dtype());
  o.hidden_dropout = spec.has_hidden_dropout() ? spec.hidden_dropout() : 0.1f;
  RETURN_IF_ERROR(CheckRate(o.hidden_dropout, "hidden_dropout"));
  const float attention_dropout = spec.has_attention_dropout() ? spec.attention_dropout() : 0.1f;
  RETURN_IF_ERROR(CheckRate(attention_dropout, "attention_dropout"));
  const float intermediate_dropout =
      spec.has_intermediate_dropout() ? spec.intermediate_dropout() : 0.0f;
  RETURN_IF_ERROR(CheckRate(intermediate_dropout, "intermediate_dropout"));

  NormArgs norm;
  norm.type = spec.layernorm_type() == te::v1::RMSNORM ? NormType::kRMSNorm : NormType::kLayerNorm;
  norm.epsilon = spec.has_layernorm_epsilon() ? spec.layernorm_epsilon() : 1e-6f;
  norm.zero_centered_gamma = spec.has_zero_centered_gamma() && spec.zero_centered_gamma();
  if (!(norm.epsilon > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, ".layernorm_epsilon must be positive; got ", norm.epsilon));
  }
  const bool use_bias = spec.has_use_bias() && spec.use_bias();

  // TE derives the attention bias type from whether a bias exists; an
  // explicit type that contradicts enable_relative_embedding fails TE's
  // assertion, so it is rejected here.
  o.relative_embedding =
      spec.has_enable_relative_embedding() ? spec.enable_relative_embedding() : true;
  if (spec.self_attn_bias_type() == te::v1::NO_BIAS && o.relative_embedding) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField,
        ".self_attn_bias_type no_bias contradicts enable_relative_embedding (TE's "
        "default true): set enable_relative_embedding false or leave the bias type unset"));
  }
  if (spec.self_attn_bias_type() == te::v1::POST_SCALE_BIAS && !o.relative_embedding) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField, ".self_attn_bias_type post_scale_bias needs enable_relative_embedding"));
  }
  if (spec.self_attn_bias_type() != te::v1::ATTN_BIAS_TYPE_UNSPECIFIED &&
      spec.self_attn_bias_type() != te::v1::NO_BIAS &&
      spec.self_attn_bias_type() != te::v1::POST_SCALE_BIAS) {
    return absl::InvalidArgumentError(absl::StrCat(kField,
                                                   ".self_attn_bias_type has unknown "
                                                   "value ",
                                                   spec.self_attn_bias_type()));
  }

  MhaOptions& a = o.attention;
  a.scope = "attention";
  a.num_heads = heads;
  a.num_gqa_groups = spec.has_num_gqa_groups() ? spec.num_gqa_groups() : heads;
  a.head_dim = static_cast<int>(o.hidden / heads);
  a.attention_dropout = attention_dropout;
  a.input_layernorm = true;
  a.norm = norm;
  a.use_bias = use_bias;
  ASSIGN_OR_RETURN(a.mask, ResolveMaskType(spec.self_attn_mask_type(),
                                           absl::StrCat(kField, ".self_attn_mask_type")));
  a.rotary = spec.has_enable_rotary_pos_emb() && spec.enable_rotary_pos_emb();
  a.scale_attn_logits = spec.has_scale_attn_logits() && spec.scale_attn_logits();
  a.scaled_query_init = spec.has_scaled_query_init() ? spec.scaled_query_init() : true;
  a.param_dtype = o.param_dtype;
  AttentionConfig check;
  check.num_heads = a.num_heads;
  check.num_gqa_groups = a.num_gqa_groups;
  check.head_dim = a.head_dim;
  check.dropout_rate = a.attention_dropout;
  RETURN_IF_ERROR(ValidateAttentionConfig(check, kField));
  if (a.rotary && a.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField,
                     ": enable_rotary_pos_emb needs an even head dim (hidden_size / "
                     "num_attention_heads); got ",
                     a.head_dim));
  }

  MlpConfig& m = o.mlp;
  m.scope = "mlp";
  m.enable_layernorm = true;
  m.norm = norm;
  m.hidden = o.hidden;
  m.intermediate = mlp_hidden;
  std::vector<std::string> names(spec.mlp_activations().begin(), spec.mlp_activations().end());
  if (names.empty()) names = {"gelu"};
  ASSIGN_OR_RETURN(m.activations,
                   ParseActivations(names, absl::StrCat(kField, ".mlp_activations")));
  m.intermediate_dropout_rate = intermediate_dropout;
  m.use_bias = use_bias;
  m.param_dtype = o.param_dtype;
  return std::unique_ptr<Layer>(new TransformerLayerImpl(std::move(o)));
}

}  // namespace te::layers
