// TE's TransformerLayer (pre-norm), layer_type ENCODER:
//
//   bias = relpos_bias(S, S)            T5 buckets, bidirectional; only with
//                                       enable_relative_embedding
//   a    = MHA(x, mask, bias)           scope "attention" (input layernorm inside)
//   h    = dropout(a, hidden_dropout) + x
//   z    = LayerNormMLP(h)              scope "mlp" (intermediate_dropout inside)
//   y    = dropout(z, hidden_dropout) + h
//
// and DECODER, with `encoded` [B, Skv, hidden] (LayerInputs::extra[0]) and
// the request's mask as TE's encoder_decoder_mask:
//
//   bias = relpos_bias(S, S)            one-directional buckets (TE's
//                                       bidirectional=False for decoders)
//   a    = MHA(x, bias)                 scope "self_attention"; its mask type
//                                       reads no mask (causal or no_mask)
//   h    = dropout(a, hidden_dropout) + x
//   c    = MHA(h, encoded, mask)        scope "encoder_decoder_attention":
//                                       cross-attention, padding mask type,
//                                       layernorm on h only, no bias
//   g    = dropout(c, hidden_dropout) + h
//   z    = LayerNormMLP(g)              scope "mlp"
//   y    = dropout(z, hidden_dropout) + g
//
// Params: attention/{qkv|query,kv,out}/... (decoder: self_attention/... and
// encoder_decoder_attention/{query,kv,out}/...), mlp/{scale, ln_bias,
// wi_kernel, wo_kernel, ...}, relpos_bias/rel_embedding [heads, 32] (TE's
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
#include <string>
#include <utility>
#include <vector>

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
  bool decoder = false;  // layer_type DECODER
  MhaOptions attention;  // scope "attention" (encoder) or "self_attention" (decoder)
  MhaOptions cross;      // decoder: scope "encoder_decoder_attention"
  MlpConfig mlp;         // scope "mlp"
  float hidden_dropout = 0.1f;
  bool relative_embedding = true;
  DType param_dtype = DType::kF32;
};

class TransformerSaved : public SavedForward {
 public:
  DType compute = DType::kF32;  // x's dtype
  MhaBlock::Saved attention;
  DropoutSaved attention_dropout;
  MhaBlock::Saved cross;  // decoder
  DropoutSaved cross_dropout;
  Mlp::Saved mlp;
  DropoutSaved mlp_dropout;
  int64_t bytes() const override {
    return attention.bytes() + attention_dropout.bytes() + cross.bytes() + cross_dropout.bytes() +
           mlp.bytes() + mlp_dropout.bytes();
  }
};

class TransformerLayerImpl : public Layer {
 public:
  explicit TransformerLayerImpl(TransformerOptions options)
      : options_(std::move(options)),
        attention_(options_.attention, options_.hidden),
        cross_(options_.cross, options_.hidden),
        mlp_(options_.mlp),
        buckets_(/*bidirectional=*/!options_.decoder, kNumBuckets, kMaxDistance) {}

  std::string type_name() const override { return "TransformerLayer"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return specs_.Get(fp8, [&] { return Defs(fp8); });
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return input_shape;
  }

  // The self-attention's cache (cache/self_attention/... for a DECODER, as
  // TE decodes it; cache/attention/... for an encoder under generation).
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
    if (options_.decoder) RETURN_IF_ERROR(cross_.Init(ops, seed, fp8, vars));
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
    RETURN_IF_ERROR(CheckExtraInputs(in));
    RETURN_IF_ERROR(CheckVariables(*vars, specs_.Get(opts.fp8, [&] { return Defs(opts.fp8); })));
    if (opts.decode) RETURN_IF_ERROR(DecodeAllowed(opts.internal_decode));
    const bool keep = opts.keep_for_backward && saved != nullptr;
    auto kept = std::make_unique<TransformerSaved>();
    kept->compute = in.x.dtype();
    const int64_t seq = in.x.dim(1);

    AttentionBias bias;
    RelativeBuckets relative;  // the buckets of a full forward's relative bias
    ForwardOptions step = opts;  // a decode step's, with the cache index it read
    // A decoder's cross-attention rotates a decode step's query at the
    // token's position, as the full forward rotates its row.
    const bool cross_rotary = options_.decoder && options_.cross.rotary;
    if (opts.decode && (options_.relative_embedding || cross_rotary)) {
      ASSIGN_OR_RETURN(step.decode_cache_index, attention_.CacheIndex(ops, *vars, opts));
    }
    if (options_.relative_embedding && opts.decode) {
      ASSIGN_OR_RETURN(bias, DecodeBias(ops, *vars, step.decode_cache_index, seq, in.x.dtype(),
                                        opts.decode_context));
    } else if (options_.relative_embedding) {
      ASSIGN_OR_RETURN(relative, buckets_.Relative(ops, seq, seq, opts.constants));
      // The ops read the parameter [H, NB] as it is: no transposed copy a
      // layer. Where the backend applies the bias by distance (CUDA's split)
      // the attention gets the table and nothing [H, S, S] is made; else the
      // bias is made once here, for the forward and the backward to read.
      ASSIGN_OR_RETURN(const Tensor rel_embedding, GetVariable(*vars, kRelEmbedding));
      if (ops.AppliesRelativeBiasByTable()) {
        bias.relative.table = rel_embedding;
        if (rel_embedding.dtype() != DType::kF32 && rel_embedding.dtype() != in.x.dtype()) {
          ASSIGN_OR_RETURN(bias.relative.table, CastTo(ops, rel_embedding, DType::kF32));
        }
        bias.relative.buckets = relative.buckets;
        bias.relative.uniform_from = relative.uniform_from;
      } else {
        ASSIGN_OR_RETURN(bias.made,
                         RelativeBias(ops, rel_embedding, relative.buckets, in.x.dtype()));
      }
    }
    // A decoder's self-attention reads no mask: the request's is the
    // cross-attention's (encoder_decoder_mask).
    const SeqLens self_mask = options_.decoder ? SeqLens() : MaskOf(in);
    Tensor h;
    RETURN_IF_ERROR(Residual(ops, attention_, vars, in.x, self_mask, bias, Tensor(), step,
                             opts.decode, "hidden_dropout_0", keep ? &kept->attention : nullptr,
                             &kept->attention_dropout, &h));
    if (keep && (bias.made.defined() || bias.relative.defined()) && !opts.decode) {
      // The backward then reduces the table's gradient, not the dense dbias.
      kept->attention.attention.relative = relative;
      kept->attention.attention.relative_num_buckets = kNumBuckets;
    }
    Tensor mlp_in;  // undefined until written: ResidualAdd writes into a defined one
    if (options_.decoder) {
      RETURN_IF_ERROR(ops.CheckInterrupt());  // between the attentions
      // A decode step's token attends over the whole of `encoded`: nothing to cache.
      RETURN_IF_ERROR(Residual(ops, cross_, vars, h, MaskOf(in), Tensor(), in.extra[0], opts,
                               /*decode=*/false, "hidden_dropout_1", keep ? &kept->cross : nullptr,
                               &kept->cross_dropout, &mlp_in,
                               opts.decode && cross_rotary ? step.decode_cache_index : 0));
    } else {
      mlp_in = h;
    }

    RETURN_IF_ERROR(ops.CheckInterrupt());  // between attention and MLP
    // Without dropout on the MLP's output the residual add runs in wo's GEMM.
    Tensor z, z_dropped, y;
    if (FusedResidual(opts)) {
      RETURN_IF_ERROR(mlp_.Forward(ops, vars, mlp_in.As2D(), opts, &y, nullptr,
                                   keep ? &kept->mlp : nullptr, mlp_in.As2D()));
      out->y = y.Reshaped(mlp_in.shape());
    } else {
      RETURN_IF_ERROR(
          mlp_.Forward(ops, vars, mlp_in.As2D(), opts, &z, nullptr, keep ? &kept->mlp : nullptr));
      RETURN_IF_ERROR(Dropout(ops, options_.hidden_dropout, opts.deterministic,
                              DeriveSeed(opts.dropout_seed, MlpDropoutSite()),
                              z.Reshaped(mlp_in.shape()), &z_dropped, &kept->mlp_dropout));
      RETURN_IF_ERROR(ResidualAdd(ops, z_dropped, mlp_in, &y));
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
  // Without dropout on the blocks' outputs the residual adds run in their
  // last GEMMs (the attention's projection, the MLP's wo).
  bool FusedResidual(const ForwardOptions& opts) const {
    return opts.deterministic || options_.hidden_dropout <= 0.0f;
  }

  // The MLP's hidden dropout site: Flax numbers its Dropout modules in call
  // order, and a decoder has one more before the MLP's.
  const char* MlpDropoutSite() const {
    return options_.decoder ? "hidden_dropout_2" : "hidden_dropout_1";
  }

  // *out (undefined: allocated here) = dropout(block(x), hidden_dropout) + x:
  // an attention block with its residual connection (added in its output
  // projection when no dropout runs).
  // With `decode`, the block runs one cached step (MhaBlock::Decode) instead.
  // `query_position`: MhaBlock::Forward's.
  absl::Status Residual(Ops& ops, const MhaBlock& block, Variables* vars, const Tensor& x,
                        const SeqLens& mask, const AttentionBias& bias, const Tensor& kv_input,
                        const ForwardOptions& opts, bool decode, const char* dropout_site,
                        MhaBlock::Saved* saved, DropoutSaved* dropout, Tensor* out,
                        int64_t query_position = 0) const {
    auto attend = [&](Tensor* a, const Tensor& residual) {
      if (decode) return block.Decode(ops, vars, x, mask, bias, opts, a, nullptr, residual);
      return block.Forward(ops, vars, x, mask, bias, opts, a, nullptr, saved, residual,
                           kv_input, query_position);
    };
    if (FusedResidual(opts)) return attend(out, x);
    Tensor attention_out, dropped;
    RETURN_IF_ERROR(attend(&attention_out, Tensor()));
    RETURN_IF_ERROR(Dropout(ops, options_.hidden_dropout, opts.deterministic,
                            DeriveSeed(opts.dropout_seed, dropout_site), attention_out, &dropped,
                            dropout));
    return ResidualAdd(ops, dropped, x, out);
  }

  // The backward on `kept`, whose parts go as they are used: the MLP's
  // activations before the attentions' backwards run (when `kept` is the
  // only holder of them).
  absl::Status RunBackward(Ops& ops, Variables* vars, TransformerSaved kept, const Tensor& dy,
                           LayerGrads* grads) const {
    const Shape shape = {kept.attention.batch, kept.attention.seq, options_.hidden};
    ASSIGN_OR_RETURN(const Tensor dy_c, PrepareGradient(ops, dy, shape, kept.compute));
    grads->dextra.clear();
    // y = dropout(z) + g: dg gets dy directly (added in the MLP's norm
    // backward) and through the MLP.
    Tensor dz, dg2;
    RETURN_IF_ERROR(DropoutGrad(ops, kept.mlp_dropout, dy_c, &dz));
    kept.mlp_dropout = DropoutSaved();
    RETURN_IF_ERROR(mlp_.Backward(ops, vars, std::move(kept.mlp), dz.As2D(), &dg2,
                                  &grads->params, dy_c.As2D()));
    dz = Tensor();
    Tensor dh = dg2.Reshaped(shape);
    dg2 = Tensor();
    RETURN_IF_ERROR(ops.CheckInterrupt());  // between MLP and attention
    if (options_.decoder) {
      // g = dropout(c) + h: dh gets dg directly and through the
      // cross-attention; `encoded` gets the keys' and values' gradient.
      const Tensor dg = dh;
      Tensor dc, dencoded;
      RETURN_IF_ERROR(DropoutGrad(ops, kept.cross_dropout, dg, &dc));
      kept.cross_dropout = DropoutSaved();
      RETURN_IF_ERROR(cross_.Backward(ops, vars, std::move(kept.cross), dc, &dh, nullptr,
                                      &grads->params, dg, &dencoded));
      grads->dextra.push_back(dencoded);
      RETURN_IF_ERROR(ops.CheckInterrupt());  // between the attentions
    }
    Tensor da, dbias;
    RETURN_IF_ERROR(DropoutGrad(ops, kept.attention_dropout, dh, &da));
    kept.attention_dropout = DropoutSaved();
    // h = dropout(a) + x: dx gets dh directly (added in the attention's norm
    // backward) and through the attention.
    RETURN_IF_ERROR(attention_.Backward(ops, vars, std::move(kept.attention), da, &grads->dx,
                                        options_.relative_embedding ? &dbias : nullptr,
                                        &grads->params, dh));
    if (options_.relative_embedding) {
      // dtable is f32 [H, NB], the parameter's layout: only its dtype may differ.
      ASSIGN_OR_RETURN(grads->params[kRelEmbedding], CastTo(ops, dbias, options_.param_dtype));
    }
    return absl::OkStatus();
  }

  VariableSpec RelEmbeddingSpec() const {
    return {kRelEmbedding, {options_.attention.num_heads, kNumBuckets}, options_.param_dtype};
  }

  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const {
    std::vector<VariableDef> defs = attention_.Defs(fp8);
    if (options_.decoder) {
      const std::vector<VariableDef> cross = cross_.Defs(fp8);
      defs.insert(defs.end(), cross.begin(), cross.end());
    }
    const std::vector<VariableDef> mlp = mlp_.Defs(fp8);
    defs.insert(defs.end(), mlp.begin(), mlp.end());
    if (options_.relative_embedding) {
      defs.push_back({RelEmbeddingSpec(), Initializer::Zeros()});  // redrawn in Init
    }
    return defs;
  }

  // TE asserts "decode should be False when layer_type ==
  // TransformerLayerType.ENCODER"; a DECODER decodes its self-attention (its
  // cross-attention reads the whole of `encoded` at each step), which TE's
  // MultiHeadAttention decodes only with separate q, k, v (rotary).
  // Generation decodes any TransformerLayer whose self-attention is causal
  // (what its full forward gives each row, one row at a time).
  absl::Status DecodeAllowed(bool internal_decode) const {
    if (!internal_decode) {
      if (!options_.decoder) {
        return absl::InvalidArgumentError(
            "decode: decode should be False when layer_type == TransformerLayerType.ENCODER");
      }
      const std::string layout = attention_.QkvLayoutName();
      if (layout != "QKVLayout.BSHD_BSHD_BSHD") {
        return absl::InvalidArgumentError(absl::StrCat(
            "decode: decode mode requires QKVLayout.BSHD_BSHD_BSHD, but got ", layout,
            " (TE's self_attention keeps separate q, k, v only with enable_rotary_pos_emb)"));
      }
      return absl::OkStatus();
    }
    if (!IsCausalMask(options_.attention.mask)) {
      return absl::InvalidArgumentError(
          "decode: generation runs a causal self-attention one position at a time; this "
          "TransformerLayer's self_attn_mask_type is not causal");
    }
    return absl::OkStatus();
  }

  // The relative bias of a decode step's S rows at cache index p against all
  // L cache rows, by its table: rows p..p + S - 1 of the [L, L] buckets TE
  // makes (the bucket of key j for query i depends on j - i alone), p read
  // on the device (DecodePosition), so a step's launches are the same at
  // every position; the table [H, NB] in the bias dtype RelativeBias makes
  // (the operands' for bfloat16 and float16), so a backend that looks it up
  // adds the values one that makes [H, S, L] would. Undefined where the rows
  // fall outside the cache (the step reports that). Under a decode context
  // the buckets are uploaded, and each layer's table cast (where its dtype is
  // not the bias's), once for all its steps.
  absl::StatusOr<AttentionBias> DecodeBias(Ops& ops, const Variables& vars, int64_t position,
                                           int64_t tokens, DType operands,
                                           DecodeContext* context) const {
    const KvCacheNames names = KvCacheNamesAt(options_.attention.scope);
    auto key = vars.find(names.key);
    auto index = vars.find(names.index);
    if (key == vars.end() || key->second.rank() != 4 || index == vars.end()) {
      return AttentionBias();
    }
    const int64_t length = key->second.dim(1);
    if (position < 0 || position + tokens > length) return AttentionBias();
    ASSIGN_OR_RETURN(const Tensor rel_embedding, GetVariable(vars, kRelEmbedding));
    DeviceConstants* constants = context != nullptr ? &context->constants : nullptr;
    ASSIGN_OR_RETURN(const Tensor buckets, buckets_.Buckets(ops, length, length, constants));
    // The variables hold still for a context's steps: one cast of the table
    // for all of them, not one a step. Keyed by the parameter's memory:
    // every layer of a model has the same scope names.
    const DType bias_dtype = RelativeBiasDType(operands);
    AttentionBias bias;
    if (rel_embedding.dtype() == bias_dtype) {
      bias.relative.table = rel_embedding;
    } else {
      const auto cast = [&]() { return CastTo(ops, rel_embedding, bias_dtype); };
      ASSIGN_OR_RETURN(
          bias.relative.table,
          constants != nullptr
              ? constants->Get(absl::StrCat("relative table at ",
                                            reinterpret_cast<uintptr_t>(rel_embedding.data()),
                                            " in ", DTypeName(bias_dtype)),
                               cast)
              : cast());
    }
    bias.relative.buckets = buckets;
    bias.relative.first_row = DecodePosition(index->second, context);
    return bias;
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

  // An encoder takes x alone; a decoder x and `encoded` [B, Skv, hidden].
  absl::Status CheckExtraInputs(const LayerInputs& in) const {
    if (!options_.decoder) {
      if (in.extra.empty()) return absl::OkStatus();
      return absl::InvalidArgumentError(
          "extra_inputs: TransformerLayer (layer_type encoder) takes x alone");
    }
    if (in.extra.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: TransformerLayer (layer_type decoder) takes `encoded` as "
          "extra_inputs[0] and nothing else; got ",
          in.extra.size(), " extra inputs (TE: encoded is required when layer_type == DECODER)"));
    }
    const Tensor& encoded = in.extra[0];
    if (encoded.rank() != 3 || encoded.dim(0) != in.x.dim(0) || encoded.dim(1) <= 0 ||
        encoded.dim(2) != options_.hidden || encoded.dtype() != in.x.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs[0] (encoded): ", ShapeString(encoded.shape()), " ",
          DTypeName(encoded.dtype()), "; want [", in.x.dim(0), ", kv_seq, ", options_.hidden,
          "] (x's batch, hidden_size) in x's dtype ", DTypeName(in.x.dtype())));
    }
    return absl::OkStatus();
  }

  TransformerOptions options_;
  MhaBlock attention_;
  MhaBlock cross_;  // used by a decoder only
  Mlp mlp_;
  RelativeBucketCache buckets_;
  SpecsMemo specs_;  // of Defs
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

  if (!te::v1::TransformerLayerType_IsValid(spec.layer_type())) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".layer_type: unknown value ",
                                                   spec.layer_type(), " (encoder, decoder)"));
  }
  o.decoder = spec.layer_type() == te::v1::DECODER;  // unset: TE's ENCODER

  MhaOptions& a = o.attention;
  a.scope = o.decoder ? "self_attention" : "attention";
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
  if (o.decoder && a.mask != MaskType::kCausal && a.mask != MaskType::kNoMask) {
    return absl::InvalidArgumentError(absl::StrCat(
        kField, ".self_attn_mask_type: a layer_type decoder's self-attention takes causal or "
        "no_mask: the request's one attention_mask is the decoder's encoder_decoder_mask"));
  }
  // TE's encoder_decoder_attention: the self-attention's settings, with a
  // layernorm on the query side, the padding mask type and no bias.
  MhaOptions& c = o.cross;
  c = a;
  c.scope = "encoder_decoder_attention";
  c.input_layernorm = true;
  c.mask = MaskType::kPadding;
  c.cross = true;

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
