#include "server/layers/multi_head_attention.h"

#include <cmath>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_layers.h"
#include "server/layers/cache.h"
#include "server/layers/fp8_state.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

// A different stream from init.h's for the same name: these values replace
// the ones InitVariables drew.
uint64_t NameStream(uint64_t seed, const std::string& name) {
  return DeriveSeed(DeriveSeed(seed, name), "multi_head_attention");
}

NormType NormTypeOf(te::v1::LayerNormType type) {
  return type == te::v1::RMSNORM ? NormType::kRMSNorm : NormType::kLayerNorm;
}

LayerNormDenseConfig QkvConfig(const MhaOptions& o, int64_t hidden) {
  LayerNormDenseConfig c;
  c.enable_layernorm = o.input_layernorm;
  c.norm.scope = JoinScope(o.scope, "qkv");
  c.norm.args = o.norm;
  c.norm.hidden = hidden;
  c.norm.param_dtype = o.param_dtype;
  c.dense.scope = JoinScope(o.scope, "qkv");
  c.dense.use_bias = o.use_bias;
  c.dense.in_dims = {hidden};
  c.dense.features = {3, static_cast<int64_t>(o.num_heads) * o.head_dim};
  c.dense.param_dtype = o.param_dtype;
  return c;
}

NormConfig QueryNormConfig(const MhaOptions& o, int64_t hidden) {
  NormConfig c;
  c.scope = JoinScope(o.scope, "query");
  c.args = o.norm;
  c.hidden = hidden;
  c.param_dtype = o.param_dtype;
  return c;
}

DenseConfig DenseOf(const MhaOptions& o, const char* name, Shape in_dims, Shape features) {
  DenseConfig c;
  c.scope = JoinScope(o.scope, name);
  c.use_bias = o.use_bias;
  c.in_dims = std::move(in_dims);
  c.features = std::move(features);
  c.param_dtype = o.param_dtype;
  return c;
}

// Redraws a kernel [in, parts..., features] as TE's qkv_init / kv_init do:
// each part a normal with std sqrt(1 / in), the query part (part 0, when
// `scale_first`) further divided by `query_divisor`.
absl::Status RedrawKernel(Ops& ops, uint64_t seed, const Dense& dense, int64_t parts,
                          bool scale_first, double query_divisor, Variables* vars) {
  const Shape shape = dense.kernel_shape();
  const int64_t in = shape[0];
  const int64_t out = dense.out();
  const int64_t per_part = out / parts;
  const ValueFill normal =
      NormalValues(seed, dense.kernel_name(), 1.0 / std::sqrt(static_cast<double>(in)));
  const float divisor = static_cast<float>(query_divisor);
  // Element i is row i / out, column i % out; the query part is columns [0, per_part).
  ValueFill fill = [&](int64_t begin, int64_t end, float* values) {
    normal(begin, end, values);
    if (!scale_first) return;
    for (int64_t i = begin; i < end; ++i) {
      if (i % out < per_part) values[i - begin] /= divisor;
    }
  };
  return StoreVariable(ops, {dense.kernel_name(), shape, dense.config().param_dtype}, fill, vars);
}

}  // namespace

ValueFill NormalValues(uint64_t seed, const std::string& name, double stddev) {
  const uint64_t stream = NameStream(seed, name);
  return [stream, stddev](int64_t begin, int64_t end, float* values) {
    for (int64_t i = begin; i < end; ++i) {
      // Box-Muller on two independent uniforms of this element.
      const double u1 = UniformOpen01(stream, 2 * static_cast<uint64_t>(i));
      const double u2 = UniformOpen01(stream, 2 * static_cast<uint64_t>(i) + 1);
      const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
      values[i - begin] = static_cast<float>(z * stddev);
    }
  };
}

ValueFill UniformValues(uint64_t seed, const std::string& name, double limit) {
  const uint64_t stream = NameStream(seed, name);
  return [stream, limit](int64_t begin, int64_t end, float* values) {
    for (int64_t i = begin; i < end; ++i) {
      values[i - begin] =
          static_cast<float>((2.0 * UniformOpen01(stream, static_cast<uint64_t>(i)) - 1.0) * limit);
    }
  };
}

absl::StatusOr<MhaOptions> MhaOptionsFromSpec(const te::v1::MultiHeadAttention& spec,
                                              absl::string_view field) {
  MhaOptions o;
  o.num_heads = spec.num_attention_heads();
  o.num_gqa_groups = spec.has_num_gqa_groups() ? spec.num_gqa_groups() : o.num_heads;
  o.head_dim = spec.head_dim();
  o.attention_dropout = spec.has_attention_dropout() ? spec.attention_dropout() : 0.0f;
  o.input_layernorm = spec.has_input_layernorm() ? spec.input_layernorm() : true;
  o.norm.type = NormTypeOf(spec.layernorm_type());
  o.norm.epsilon = spec.has_layernorm_epsilon() ? spec.layernorm_epsilon() : 1e-6f;
  o.norm.zero_centered_gamma = spec.has_zero_centered_gamma() && spec.zero_centered_gamma();
  o.use_bias = spec.has_use_bias() && spec.use_bias();
  ASSIGN_OR_RETURN(o.mask,
                   ResolveMaskType(spec.attn_mask_type(), absl::StrCat(field, ".attn_mask_type")));
  o.rotary = spec.has_enable_rotary_pos_emb() && spec.enable_rotary_pos_emb();
  o.scale_attn_logits = spec.has_scale_attn_logits() && spec.scale_attn_logits();
  o.scaled_query_init = spec.has_scaled_query_init() ? spec.scaled_query_init() : true;
  o.param_dtype = ParamDTypeOf(spec.dtype());
  if (!(o.norm.epsilon > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".layernorm_epsilon must be positive; got ", o.norm.epsilon));
  }
  if (o.rotary && o.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".head_dim must be even with enable_rotary_pos_emb; got ", o.head_dim));
  }
  AttentionConfig attention;
  attention.num_heads = o.num_heads;
  attention.num_gqa_groups = o.num_gqa_groups;
  attention.head_dim = o.head_dim;
  attention.dropout_rate = o.attention_dropout;
  RETURN_IF_ERROR(ValidateAttentionConfig(attention, field));
  return o;
}

MhaBlock::MhaBlock(MhaOptions options, int64_t hidden)
    : options_(std::move(options)),
      hidden_(hidden),
      q_features_(static_cast<int64_t>(options_.num_heads) * options_.head_dim),
      kv_features_(static_cast<int64_t>(options_.num_gqa_groups) * options_.head_dim),
      qkv_(QkvConfig(options_, hidden)),
      norm_(QueryNormConfig(options_, hidden)),
      query_(DenseOf(options_, "query", {hidden}, {q_features_})),
      kv_(DenseOf(options_, "kv", {hidden}, {2, kv_features_})),
      out_(DenseOf(options_, "out", {q_features_}, {hidden})) {}

AttentionConfig MhaBlock::AttentionSettings() const {
  AttentionConfig c;
  c.num_heads = options_.num_heads;
  c.num_gqa_groups = options_.num_gqa_groups;
  c.head_dim = options_.head_dim;
  c.mask = options_.mask;
  // TE: 1/sqrt(D) only with scale_attn_logits; by default the query kernel's
  // initialisation carries the 1/sqrt(D) instead (scaled_query_init).
  c.scale = options_.scale_attn_logits
                ? static_cast<float>(1.0 / std::sqrt(static_cast<double>(options_.head_dim)))
                : 1.0f;
  c.dropout_rate = options_.attention_dropout;
  return c;
}

std::vector<VariableDef> MhaBlock::Defs(const Fp8Recipe* fp8) const {
  std::vector<VariableDef> defs;
  auto append = [&defs](std::vector<VariableDef> more) {
    defs.insert(defs.end(), more.begin(), more.end());
  };
  if (!separate_kv()) {
    append(qkv_.Defs(fp8));
  } else {
    if (options_.input_layernorm) append(norm_.Defs());
    append(query_.Defs(fp8));
    append(kv_.Defs(fp8));
  }
  append(out_.Defs(fp8));
  return defs;
}

absl::Status MhaBlock::Init(Ops& ops, uint64_t seed, const Fp8Recipe* fp8, Variables* vars) const {
  RETURN_IF_ERROR(InitVariables(ops, seed, Defs(fp8), vars));
  const double query_divisor =
      options_.scaled_query_init ? std::sqrt(static_cast<double>(options_.head_dim)) : 1.0;
  if (!separate_kv()) {
    RETURN_IF_ERROR(RedrawKernel(ops, seed, qkv_.dense(), 3, true, query_divisor, vars));
  } else {
    RETURN_IF_ERROR(RedrawKernel(ops, seed, query_, 1, true, query_divisor, vars));
    RETURN_IF_ERROR(RedrawKernel(ops, seed, kv_, 2, false, 1.0, vars));
  }
  return RedrawKernel(ops, seed, out_, 1, false, 1.0, vars);
}

int64_t MhaBlock::Saved::bytes() const {
  return qkv.bytes() + norm.bytes() + query.bytes() + kv.bytes() + attention.bytes() + out.bytes();
}

absl::Status MhaBlock::Project(Ops& ops, Variables* vars, const Tensor& x,
                               const ForwardOptions& opts, bool packed, bool want_ln,
                               Projected* out, Saved* saved, const Tensor& kv_input) const {
  const int64_t batch = x.dim(0), seq = x.dim(1);
  const int heads = options_.num_heads, groups = options_.num_gqa_groups;
  const int head_dim = options_.head_dim;
  const Tensor x2 = x.As2D();
  if (!separate_kv()) {
    Tensor fused;
    RETURN_IF_ERROR(qkv_.Forward(ops, vars, x2, opts.fp8, opts.tf32, &fused, want_ln ? &out->ln : nullptr,
                                 saved != nullptr ? &saved->qkv : nullptr));
    const Tensor qkv = fused.Reshaped({batch, seq, 3, heads, head_dim});
    if (packed) {
      out->qkv = qkv;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(std::vector<Tensor> parts, SplitAxis(ops, qkv, 2));
    out->q = parts[0];
    out->k = parts[1];
    out->v = parts[2];
    return absl::OkStatus();
  }
  if (options_.input_layernorm) {
    RETURN_IF_ERROR(
        norm_.Forward(ops, *vars, x2, &out->ln, saved != nullptr ? &saved->norm : nullptr));
  } else {
    out->ln = x2;
  }
  Tensor query, kv;
  RETURN_IF_ERROR(query_.Forward(ops, vars, out->ln, opts.fp8, opts.tf32, &query,
                                 saved != nullptr ? &saved->query : nullptr));
  // Cross-attention projects the other input, as it is (TE normalises
  // inputs_q alone).
  const Tensor kv_in = options_.cross ? kv_input.As2D() : out->ln;
  const int64_t kv_seq = options_.cross ? kv_input.dim(1) : seq;
  RETURN_IF_ERROR(
      kv_.Forward(ops, vars, kv_in, opts.fp8, opts.tf32, &kv, saved != nullptr ? &saved->kv : nullptr));
  if (saved != nullptr) saved->kv_seq = kv_seq;
  out->q = query.Reshaped({batch, seq, heads, head_dim});
  ASSIGN_OR_RETURN(std::vector<Tensor> parts,
                   SplitAxis(ops, kv.Reshaped({batch, kv_seq, 2, groups, head_dim}), 2));
  out->k = parts[0];
  out->v = parts[1];
  return absl::OkStatus();
}

absl::Status MhaBlock::Forward(Ops& ops, Variables* vars, const Tensor& x, const SeqLens& seqlens,
                               const AttentionBias& bias, const ForwardOptions& opts, Tensor* y,
                               Tensor* ln_out, Saved* saved, const Tensor& residual,
                               const Tensor& kv_input, int64_t query_position) const {
  if (x.rank() != 3 || x.dim(2) != hidden_) {
    return absl::InvalidArgumentError(
        absl::StrCat("x has shape ", ShapeString(x.shape()), "; want [batch, seq, ", hidden_, "]"));
  }
  RETURN_IF_ERROR(CheckFloatActivation(x, "x"));
  if (options_.cross &&
      (kv_input.rank() != 3 || kv_input.dim(0) != x.dim(0) || kv_input.dim(2) != hidden_ ||
       kv_input.dtype() != x.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross-attention keys and values ", ShapeString(kv_input.shape()), " ",
        DTypeName(kv_input.dtype()), ": want [", x.dim(0), ", kv_seq, ", hidden_, "] ",
        DTypeName(x.dtype()), " (x's batch, hidden and dtype)"));
  }
  const int64_t batch = x.dim(0), seq = x.dim(1);
  Projected p;
  RETURN_IF_ERROR(
      Project(ops, vars, x, opts, packed_attention(), ln_out != nullptr, &p, saved,
              kv_input));
  const uint64_t dropout_seed =
      DeriveSeed(opts.dropout_seed, JoinScope(options_.scope, "attention_dropout"));
  AttentionSaved* attention_saved = saved != nullptr ? &saved->attention : nullptr;
  Tensor context;
  if (packed_attention()) {
    if (options_.rotary) {
      // Self-attention: the queries start where the keys do.
      if (query_position != 0) {
        return absl::InternalError("a packed self-attention's queries at a position offset");
      }
      const int64_t head_dim = p.qkv.dim(4);
      ASSIGN_OR_RETURN(const RotaryArgs rotation,
                       KeptTeRotary(ops, /*inverse=*/false, seq, head_dim, opts.constants));
      RETURN_IF_ERROR(ops.RotaryQkInPlace(rotation, &p.qkv));
      if (saved != nullptr) {
        ASSIGN_OR_RETURN(saved->rotary_backward,
                         KeptTeRotary(ops, /*inverse=*/true, seq, head_dim, opts.constants));
      }
    }
    RETURN_IF_ERROR(AttentionForwardPacked(ops, AttentionSettings(), p.qkv, seqlens, bias,
                                           !opts.deterministic, dropout_seed, &context,
                                           attention_saved));
  } else {
    if (options_.rotary) {
      RETURN_IF_ERROR(ApplyRotary(ops, p.q, /*inverse=*/false, &p.q, query_position));
      RETURN_IF_ERROR(ApplyRotary(ops, p.k, /*inverse=*/false, &p.k));
    }
    RETURN_IF_ERROR(AttentionForward(ops, AttentionSettings(), p.q, p.k, p.v, seqlens, bias,
                                     !opts.deterministic, dropout_seed, &context,
                                     attention_saved));
  }
  Tensor y2;
  DenseFusion out_fusion;
  if (residual.defined()) out_fusion.residual = residual.Reshaped({batch * seq, hidden_});
  RETURN_IF_ERROR(out_.Forward(ops, vars, context.Reshaped({batch * seq, q_features_}), opts.fp8,
                               opts.tf32, &y2, saved != nullptr ? &saved->out : nullptr, out_fusion));
  *y = y2.Reshaped({batch, seq, hidden_});
  if (ln_out != nullptr) *ln_out = p.ln.Reshaped({batch, seq, hidden_});
  if (saved != nullptr) {
    saved->batch = batch;
    saved->seq = seq;
    saved->compute = x.dtype();
  }
  return absl::OkStatus();
}

std::vector<VariableSpec> MhaBlock::CacheSpecs(int64_t batch, int64_t length, DType dtype) const {
  return KvCacheSpecs(options_.scope, batch, length, options_.num_gqa_groups, options_.head_dim,
                      dtype);
}

const char* MhaBlock::QkvLayoutName() const {
  if (options_.rotary) return "QKVLayout.BSHD_BSHD_BSHD";
  return gqa() ? "QKVLayout.BSHD_BS2HD" : "QKVLayout.BS3HD";
}

absl::StatusOr<int64_t> MhaBlock::CacheIndex(Ops& ops, const Variables& vars,
                                             const ForwardOptions& opts) const {
  return ReadKvCacheIndex(ops, vars, options_.scope, opts.decode_cache_index);
}

absl::Status MhaBlock::Decode(Ops& ops, Variables* vars, const Tensor& x, const SeqLens& mask,
                              const AttentionBias& bias, const ForwardOptions& opts, Tensor* y,
                              Tensor* ln_out, const Tensor& residual) const {
  if (x.rank() != 3 || x.dim(2) != hidden_ || x.dim(1) < 1 ||
      (x.dim(1) != 1 && !opts.internal_decode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x.shape ", ShapeString(x.shape()), ": decode takes one new token per sequence, want [",
        "batch, 1, ", hidden_, "] (TE: \"Autoregressive cache shape error\")"));
  }
  RETURN_IF_ERROR(CheckFloatActivation(x, "x"));
  if (opts.keep_for_backward) {
    return absl::InvalidArgumentError(
        "keep_for_backward: a decode step is inference only; it keeps nothing for a backward");
  }
  const bool has_mask = (mask.q.defined() && mask.q.numel() > 0) ||
                        (mask.elementwise.defined() && mask.elementwise.numel() > 0) ||
                        !mask.error.ok();
  if (IsPaddingMask(options_.mask) && has_mask) {
    return absl::InvalidArgumentError(
        "attention_mask: a decode step attends over the cache's positions <= cache_index and "
        "takes no mask; send none");
  }
  const int64_t batch = x.dim(0), tokens = x.dim(1);
  ASSIGN_OR_RETURN(KvCache cache,
                   OpenKvCache(ops, *vars, options_.scope, batch, tokens,
                               options_.num_gqa_groups, options_.head_dim, x.dtype(),
                               opts.decode_cache_index));
  // One fused projection (no GQA, no cross-attention): its output goes to q
  // and the cache, rotated on the way, in the attention's own op.
  const bool fused_rows = !separate_kv();
  Projected p;
  RETURN_IF_ERROR(
      Project(ops, vars, x, opts, /*packed=*/fused_rows, ln_out != nullptr, &p, nullptr));
  // Without the caller's context (one layer decoding alone) this step's own.
  DecodeContext own_context;
  DecodeContext& shared = opts.decode_context != nullptr ? *opts.decode_context : own_context;
  if (!shared.write_index && !shared.has_step()) {
    return absl::FailedPreconditionError(
        "decode: a context that writes no cache_index must carry the step's position "
        "(DecodeContext::SetStep)");
  }
  // The position as the device holds it: every launch below reads it there.
  const Tensor position = DecodePosition(cache.index, &shared);
  ASSIGN_OR_RETURN(const KvView kv, VisibleKv(ops, cache, shared));
  AttentionConfig config = AttentionSettings();
  config.mask = kv.mask;
  SeqLens lengths;
  lengths.q = kv.q_seqlens;
  lengths.kv = kv.kv_seqlens;
  const uint64_t dropout_seed =
      DeriveSeed(opts.dropout_seed, JoinScope(options_.scope, "attention_dropout"));
  Tensor context;
  if (fused_rows) {
    // The rows into the cache and the attention over it: one launch where
    // the backend can (Ops::DecodeAttentionFromQkv).
    RETURN_IF_ERROR(CheckQkvRows(p.qkv, cache));
    const RotaryArgs rotation = TeRotary(/*inverse=*/false, 0, position);
    RETURN_IF_ERROR(DecodeAttentionFromQkv(ops, config, p.qkv,
                                           options_.rotary ? &rotation : nullptr, position,
                                           kv.key, kv.value, lengths, bias, !opts.deterministic,
                                           dropout_seed, &context));
  } else {
    if (options_.rotary) {
      RETURN_IF_ERROR(ApplyRotary(ops, p.q, /*inverse=*/false, &p.q, 0, position));
      RETURN_IF_ERROR(ApplyRotary(ops, p.k, /*inverse=*/false, &p.k, 0, position));
    }
    RETURN_IF_ERROR(WriteKvRows(ops, p.k, p.v, cache, position));
    RETURN_IF_ERROR(AttentionForward(ops, config, p.q, kv.key, kv.value, lengths, bias,
                                     !opts.deterministic, dropout_seed, &context, nullptr));
  }
  const int64_t rows = batch * tokens;
  Tensor y2;
  DenseFusion out_fusion;
  if (residual.defined()) out_fusion.residual = residual.Reshaped({rows, hidden_});
  RETURN_IF_ERROR(out_.Forward(ops, vars, context.Reshaped({rows, q_features_}), opts.fp8, opts.tf32, &y2,
                               nullptr, out_fusion));
  *y = y2.Reshaped({batch, tokens, hidden_});
  if (ln_out != nullptr) *ln_out = p.ln.Reshaped({batch, tokens, hidden_});
  return AdvanceKvCache(ops, cache, shared);
}

absl::Status MhaBlock::Backward(Ops& ops, Variables* vars, Saved saved, const Tensor& dy,
                                Tensor* dx, Tensor* dbias, Variables* grads,
                                const Tensor& residual_grad, Tensor* dkv_input) const {
  if (options_.cross && dkv_input == nullptr) {
    return absl::InternalError("cross-attention backward without a dkv_input");
  }
  const int64_t batch = saved.batch, seq = saved.seq, tokens = batch * seq;
  const Tensor residual_grad2 =
      residual_grad.defined() ? residual_grad.Reshaped({tokens, hidden_}) : Tensor();
  ASSIGN_OR_RETURN(const Tensor grad,
                   PrepareGradient(ops, dy, {batch, seq, hidden_}, saved.compute));
  Tensor dcontext;
  RETURN_IF_ERROR(
      out_.Backward(ops, vars, std::move(saved.out), grad.As2D(), &dcontext, grads));
  Tensor dout = dcontext.Reshaped({batch, seq, options_.num_heads, options_.head_dim});
  dcontext = Tensor();
  Tensor dx2;
  if (packed_attention()) {
    Tensor dqkv;
    RETURN_IF_ERROR(AttentionBackwardPacked(ops, saved.attention, dout, &dqkv, dbias));
    // q, k, v, the context and its gradient are read for the last time.
    saved.attention = AttentionSaved();
    dout = Tensor();
    // The rotation is orthogonal: its transpose is the rotation by -angle.
    const RotaryArgs rotary_backward =
        saved.rotary_backward.has_value() ? *saved.rotary_backward : TeRotary(/*inverse=*/true);
    const std::optional<Fp8Recipe>& fp8 = saved.qkv.dense.fp8;
    if (options_.rotary && fp8 && CanFuseQuantize(&*fp8) && !fp8->inference) {
      // Under DelayedScaling the inverse rotation and the qkv projection's
      // E5M2 dy in both layouts (with its bias gradient) come from one pass
      // over dqkv, which is never written back rotated.
      ASSIGN_OR_RETURN(Dense::QuantizedGrad grad,
                       qkv_.dense().AllocateQuantizedGrad(ops, *fp8, tokens, vars));
      RETURN_IF_ERROR(ops.RotaryQkQuantizeTranspose(rotary_backward, &dqkv, grad.fp8,
                                                    &grad.dy.data, &grad.dy.data_t,
                                                    grad.dbias.defined() ? &grad.dbias : nullptr));
      const DType compute = dqkv.dtype();
      dqkv = Tensor();
      RETURN_IF_ERROR(qkv_.BackwardQuantized(ops, std::move(saved.qkv), std::move(grad.dy),
                                             std::move(grad.dbias), compute, &dx2, grads,
                                             residual_grad2));
      *dx = dx2.Reshaped({batch, seq, hidden_});
      return absl::OkStatus();
    }
    if (options_.rotary) {
      RETURN_IF_ERROR(ops.RotaryQkInPlace(rotary_backward, &dqkv));
    }
    Tensor dqkv2 = dqkv.Reshaped({tokens, 3 * q_features_});
    dqkv = Tensor();
    RETURN_IF_ERROR(qkv_.Backward(ops, vars, std::move(saved.qkv), std::move(dqkv2), &dx2, grads,
                                  residual_grad2));
    *dx = dx2.Reshaped({batch, seq, hidden_});
    return absl::OkStatus();
  }
  Tensor dq, dk, dv;
  RETURN_IF_ERROR(AttentionBackward(ops, saved.attention, dout, &dq, &dk, &dv, dbias));
  if (options_.rotary) {
    // The rotation is orthogonal: its transpose is the rotation by -angle.
    RETURN_IF_ERROR(ApplyRotary(ops, dq, /*inverse=*/true, &dq));
    RETURN_IF_ERROR(ApplyRotary(ops, dk, /*inverse=*/true, &dk));
  }
  if (!separate_kv()) {
    ASSIGN_OR_RETURN(Tensor dqkv, StackAxis(ops, {dq, dk, dv}, 2));
    RETURN_IF_ERROR(qkv_.Backward(ops, vars, saved.qkv, dqkv.Reshaped({tokens, 3 * q_features_}),
                                  &dx2, grads, residual_grad2));
  } else {
    ASSIGN_OR_RETURN(Tensor dkv, StackAxis(ops, {dk, dv}, 2));
    Tensor dln_query, dln_kv, dln;
    RETURN_IF_ERROR(query_.Backward(ops, vars, saved.query, dq.Reshaped({tokens, q_features_}),
                                    &dln_query, grads));
    const int64_t kv_tokens = batch * (options_.cross ? saved.kv_seq : seq);
    RETURN_IF_ERROR(kv_.Backward(ops, vars, saved.kv,
                                 dkv.Reshaped({kv_tokens, 2 * kv_features_}), &dln_kv, grads));
    if (options_.cross) {
      // kv read the other input: its gradient goes there, not into ln.
      *dkv_input = dln_kv.Reshaped({batch, saved.kv_seq, hidden_});
      dln = dln_query;
    } else {
      RETURN_IF_ERROR(ResidualAdd(ops, dln_query, dln_kv, &dln));
    }
    if (options_.input_layernorm) {
      RETURN_IF_ERROR(norm_.Backward(ops, saved.norm, dln, &dx2, grads, residual_grad2));
    } else if (residual_grad2.defined()) {
      RETURN_IF_ERROR(ResidualAdd(ops, dln, residual_grad2, &dx2));
    } else {
      dx2 = dln;
    }
  }
  *dx = dx2.Reshaped({batch, seq, hidden_});
  return absl::OkStatus();
}

namespace {

constexpr char kField[] = "spec.multi_head_attention";

class MultiHeadAttentionSaved : public SavedForward {
 public:
  int64_t hidden = 0;
  MhaBlock::Saved block;
  int64_t bytes() const override { return block.bytes(); }
};

class MultiHeadAttentionLayer : public Layer {
 public:
  MultiHeadAttentionLayer(MhaOptions options, bool return_layernorm_output)
      : options_(std::move(options)), return_layernorm_output_(return_layernorm_output) {}

  std::string type_name() const override { return "MultiHeadAttention"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    ASSIGN_OR_RETURN(int64_t hidden, HiddenOf(input_shape));
    return SpecsOf(MhaBlock(options_, hidden).Defs(fp8));
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(HiddenOf(input_shape).status());
    return input_shape;
  }

  absl::StatusOr<std::vector<VariableSpec>> CacheSpecs(const Shape& input_shape,
                                                       DType input_dtype,
                                                       bool internal_decode) const override {
    ASSIGN_OR_RETURN(int64_t hidden, HiddenOf(input_shape));
    const MhaBlock block(options_, hidden);
    if (!internal_decode) RETURN_IF_ERROR(DecodeAllowed(block));
    if (internal_decode && !block.causal()) {
      return absl::InvalidArgumentError(
          "decode: generation runs a causal self-attention one position at a time; this "
          "MultiHeadAttention's attn_mask_type is not causal");
    }
    RETURN_IF_ERROR(CheckCacheDType(input_dtype));
    return block.CacheSpecs(input_shape[0], input_shape[1], input_dtype);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(int64_t hidden, HiddenOf(input_shape));
    return MhaBlock(options_, hidden).Init(ops, seed, fp8, vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    ASSIGN_OR_RETURN(int64_t hidden, HiddenOf(in.x.shape()));
    if (!in.extra.empty()) {
      return absl::InvalidArgumentError(
          "extra_inputs: MultiHeadAttention is self-attention here: must be empty");
    }
    const MhaBlock block(options_, hidden);
    RETURN_IF_ERROR(CheckVariables(*vars, SpecsOf(block.Defs(opts.fp8))));
    if (opts.decode) {
      if (!opts.internal_decode) RETURN_IF_ERROR(DecodeAllowed(block));
      return block.Decode(ops, vars, in.x, MaskOf(in), Tensor(), opts, &out->y,
                          return_layernorm_output_ ? &out->ln_out : nullptr);
    }
    auto kept = std::make_unique<MultiHeadAttentionSaved>();
    kept->hidden = hidden;
    RETURN_IF_ERROR(block.Forward(ops, vars, in.x, MaskOf(in), Tensor(),
                                  opts, &out->y, return_layernorm_output_ ? &out->ln_out : nullptr,
                                  opts.keep_for_backward ? &kept->block : nullptr));
    if (opts.keep_for_backward && saved != nullptr) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const MultiHeadAttentionSaved*>(&saved);
    if (kept == nullptr) {
      return absl::InvalidArgumentError("saved forward does not come from MultiHeadAttention");
    }
    grads->dextra.clear();
    return MhaBlock(options_, kept->hidden)
        .Backward(ops, vars, kept->block, dy, &grads->dx, nullptr, &grads->params);
  }

 private:
  // TE's MultiHeadAttention (fused QKV parameters, its only kind here)
  // decodes only the separate q, k, v layout that rotary leaves.
  static absl::Status DecodeAllowed(const MhaBlock& block) {
    const std::string layout = block.QkvLayoutName();
    if (layout != "QKVLayout.BSHD_BSHD_BSHD") {
      return absl::InvalidArgumentError(absl::StrCat(
          "decode: decode mode requires QKVLayout.BSHD_BSHD_BSHD, but got ", layout,
          " (TE's MultiHeadAttention keeps separate q, k, v only with enable_rotary_pos_emb)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> HiddenOf(const Shape& shape) const {
    if (shape.size() != 3 || shape[0] <= 0 || shape[1] <= 0 || shape[2] <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("input_shape ", ShapeString(shape),
                                                     " does not fit MultiHeadAttention: want "
                                                     "[batch, seq, hidden]"));
    }
    return shape[2];
  }

  MhaOptions options_;
  bool return_layernorm_output_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeMultiHeadAttention(
    const te::v1::MultiHeadAttention& spec) {
  ASSIGN_OR_RETURN(MhaOptions options, MhaOptionsFromSpec(spec, kField));
  const bool return_ln = spec.has_return_layernorm_output() && spec.return_layernorm_output();
  return std::unique_ptr<Layer>(new MultiHeadAttentionLayer(std::move(options), return_ln));
}

}  // namespace te::layers
