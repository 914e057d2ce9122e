// TE's MultiHeadAttention as a reusable block: the standalone
// MultiHeadAttention layer uses it at scope "" (self-attention),
// TransformerLayer at scope "attention" (an encoder's), or "self_attention"
// and "encoder_decoder_attention" (a decoder's self- and cross-attention).
//
//   ln   = LayerNorm(x)                 (input_layernorm; else ln = x)
//   no GQA:  qkv = ln @ qkv/kernel (hidden, 3, H*D)   -> q, k, v [B, S, H, D]
//   GQA:     q = ln @ query/kernel (hidden, H*D);  kv = ln @ kv/kernel (hidden, 2, G*D)
//   q, k = rotary(q), rotary(k)         (enable_rotary_pos_emb)
//   ctx  = attention(q, k, v, mask, bias)   scale 1/sqrt(D) iff scale_attn_logits, else 1
// Without GQA and rotary, attention reads the packed qkv [B, S, 3, H, D] as
// the projection wrote it (Ops::AttentionForwardPacked) and its backward
// writes dqkv the same way: no split or stack copies.
// Cross-attention (MhaOptions::cross, TE's inputs_q is not inputs_kv): the
// GQA form with kv read from the other input, not normalised:
//   q = LayerNorm(x) @ query/kernel;  kv = inputs_kv @ kv/kernel (hidden, 2, G*D)
//   y    = ctx [B, S, H*D] @ out/kernel (H*D, hidden)
// The residual is not inside (TE's TransformerLayer adds it).
//
// Initialisers (TE): kernels variance_scaling(1, "fan_in", "normal") per
// q / k / v part (fan_in = hidden), the query part divided by sqrt(D) when
// scaled_query_init; out/kernel fan_in = H*D; biases zeros.
#ifndef TE_SERVER_LAYERS_MULTI_HEAD_ATTENTION_H_
#define TE_SERVER_LAYERS_MULTI_HEAD_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/layers/attention_core.h"
#include "server/layers/blocks.h"
#include "server/layers/cache.h"
#include "server/layers/init.h"
#include "server/layers/layer.h"

namespace te::layers {

struct MhaOptions {
  std::string scope;  // "" standalone, "attention" inside TransformerLayer
  int num_heads = 0;
  int num_gqa_groups = 0;
  int head_dim = 0;
  float attention_dropout = 0.0f;
  bool input_layernorm = true;
  NormArgs norm;
  bool use_bias = false;
  MaskType mask = MaskType::kCausal;
  bool rotary = false;
  bool scale_attn_logits = false;
  bool scaled_query_init = true;
  DType param_dtype = DType::kF32;
  // Keys and values from another input ([B, Skv, hidden], Forward's
  // kv_input): query / kv / out parameters whatever the GQA groups.
  bool cross = false;
};

// Builds MhaOptions from the te.v1 spec with TE's defaults; INVALID_ARGUMENT
// naming the field of `field` ("spec.multi_head_attention").
absl::StatusOr<MhaOptions> MhaOptionsFromSpec(const te::v1::MultiHeadAttention& spec,
                                              absl::string_view field);

class MhaBlock {
 public:
  // `hidden`: the input's last dimension (and the output's).
  MhaBlock(MhaOptions options, int64_t hidden);

  bool gqa() const { return options_.num_gqa_groups != options_.num_heads; }
  bool causal() const { return IsCausalMask(options_.mask); }
  // q and kv projected apart (GQA or cross-attention), not as one qkv.
  bool separate_kv() const { return gqa() || options_.cross; }
  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const;
  // InitVariables(Defs) then the kernels redrawn with TE's per-part normal
  // initialisers (deterministic from seed and name).
  absl::Status Init(Ops& ops, uint64_t seed, const Fp8Recipe* fp8, Variables* vars) const;

  struct Saved {
    LayerNormDense::Saved qkv;  // no GQA
    Norm::Saved norm;           // GQA (norm and the two Denses separately,
    Dense::Saved query;         // since ln feeds both)
    Dense::Saved kv;
    AttentionSaved attention;
    Dense::Saved out;
    // The backward's inverse rotation of the packed qkv, with its kept table
    // (KeptTeRotary); unset: TeRotary(true), the ops making their own.
    std::optional<RotaryArgs> rotary_backward;
    int64_t batch = 0, seq = 0;
    int64_t kv_seq = 0;           // cross-attention: kv_input's length
    DType compute = DType::kF32;  // x's dtype
    int64_t bytes() const;
  };
  // x [B, S, hidden] -> *y [B, S, hidden]; *ln_out [B, S, hidden] if non-null.
  // `bias`: optional, added to the logits after scaling (AttentionBias: made
  // [H, S, S], or a relative bias named by its table).
  // `residual` (optional, [B, S, hidden]): y = attention(x) + residual, added
  // in the output projection's GEMM. `kv_input` ([B, Skv, hidden], x's dtype):
  // the keys' and values' input, required with options.cross, else unused.
  // `query_position`: with rotary, where x's first row sits in its sequence
  // (a decode step's token at cache index p attends over a cross-attention's
  // whole kv_input as row p of the full forward does); the keys start at 0.
  absl::Status Forward(Ops& ops, Variables* vars, const Tensor& x, const SeqLens& seqlens,
                       const AttentionBias& bias, const ForwardOptions& opts, Tensor* y,
                       Tensor* ln_out,
                       Saved* saved, const Tensor& residual = Tensor(),
                       const Tensor& kv_input = Tensor(), int64_t query_position = 0) const;
  // dy [B, S, hidden] (any float dtype) -> *dx; parameter gradients into
  // *grads; *dbias (if non-null and the forward had a bias) f32 [H, S, S].
  // residual_grad (optional, [B, S, hidden]) is added to *dx (in the input
  // norm's backward where there is one). As the blocks' backwards (blocks.h),
  // `saved` by value: moved in, each part goes once its backward has read it.
  // Cross-attention: *dkv_input (not null) gets kv_input's gradient.
  absl::Status Backward(Ops& ops, Variables* vars, Saved saved, const Tensor& dy, Tensor* dx,
                        Tensor* dbias, Variables* grads,
                        const Tensor& residual_grad = Tensor(),
                        Tensor* dkv_input = nullptr) const;

  // ---- decode (cache.h) -------------------------------------------------
  // The cache for decoding after an init with x [batch, length, hidden] in
  // `dtype`: cache/<scope>/cached_key, cached_value [B, L, G, D], cache_index.
  std::vector<VariableSpec> CacheSpecs(int64_t batch, int64_t length, DType dtype) const;
  // TE's qkv_layout for this block's projections: BS3HD (the fused qkv),
  // BSHD_BS2HD (GQA: query and a fused kv) or, with rotary, BSHD_BSHD_BSHD.
  // TE decodes only the last.
  const char* QkvLayoutName() const;
  // One autoregressive step: x [B, 1, hidden] (one new token per sequence)
  // -> *y [B, 1, hidden], *ln_out as Forward. Projects the token, rotates q
  // and k at the token's position (the cache index p; TE rotates a decoded
  // token at position 0, which breaks the equality with the full forward
  // that this step keeps), writes k and v into row p of the cache, attends q
  // over rows 0..p, and sets the index to p + 1, the last thing it does, so
  // a step that fails leaves the index as it was. This runs for every layout
  // (generation decodes any causal self-attention); a TE module refuses
  // the ones TE refuses (QkvLayoutName). Every mask type attends over rows
  // 0..p, which for the causal types is what the full causal forward gives
  // row p. `mask` is the request's: INVALID_ARGUMENT naming attention_mask
  // when a padding type would read it (the cache's rows are the mask here);
  // other types ignore it, as TE does. opts.keep_for_backward is
  // INVALID_ARGUMENT (inference only). `residual` as Forward.
  // With opts.internal_decode x may be [B, S, hidden]: S tokens at rows
  // p..p + S - 1, token i attending over rows 0..p + i. `bias` (optional:
  // made, [H, S, L], or by its table's rows p.. of the [L, L] buckets) is
  // added to the logits against every cache row (TE slices its [L, L]
  // relative bias the same way); attention then reads the whole cache.
  absl::Status Decode(Ops& ops, Variables* vars, const Tensor& x, const SeqLens& mask,
                      const AttentionBias& bias, const ForwardOptions& opts, Tensor* y,
                      Tensor* ln_out, const Tensor& residual = Tensor()) const;
  // The cache's index for a step (opts.decode_cache_index, or read from the
  // cache), for a caller that needs it before Decode (a bias row).
  absl::StatusOr<int64_t> CacheIndex(Ops& ops, const Variables& vars,
                                     const ForwardOptions& opts) const;

 private:
  // The projections of x [B, S, hidden] (row-major [B * S, hidden]): with
  // `packed`, qkv [B, S, 3, H, D] alone (no GQA); else q [B, S, H, D], k and
  // v [B, S, G, D] (S: kv_input's for cross-attention). ln [B * S, hidden]
  // when `want_ln` or separate q and kv projections need it.
  struct Projected {
    Tensor qkv, q, k, v, ln;
  };
  // Cross-attention projects k and v from kv_input instead of x.
  absl::Status Project(Ops& ops, Variables* vars, const Tensor& x, const ForwardOptions& opts,
                       bool packed, bool want_ln, Projected* out, Saved* saved,
                       const Tensor& kv_input = Tensor()) const;

  AttentionConfig AttentionSettings() const;
  // Attention on the packed qkv (rotary embedding rotates q and k in place
  // there): no split into q, k, v and no stacking of their gradients.
  bool packed_attention() const { return !separate_kv(); }

  MhaOptions options_;
  int64_t hidden_;
  int64_t q_features_;   // H * D
  int64_t kv_features_;  // G * D
  LayerNormDense qkv_;   // neither GQA nor cross: scope "qkv"
  Norm norm_;            // separate_kv(): scope "query"
  Dense query_;          // separate_kv(): scope "query"
  Dense kv_;             // separate_kv(): scope "kv"
  Dense out_;            // scope "out"
};

// Values for TE initialisers init.h does not have, deterministic from
// (seed, variable name): a normal with `stddev`, and a uniform on
// [-limit, limit].
// Chunk by chunk (init.h's StoreVariable writes them).
ValueFill NormalValues(uint64_t seed, const std::string& name, double stddev);
ValueFill UniformValues(uint64_t seed, const std::string& name, double limit);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_MULTI_HEAD_ATTENTION_H_
