// The attention block shared by DotProductAttention, MultiHeadAttention,
// TransformerLayer and the plain-Flax baseline layer: dot-product attention on
// [B, S, H, D] tensors through Ops::AttentionForward/Backward, or on a packed
// qkv [B, S, 3, H, D] through Ops::AttentionForwardPacked/BackwardPacked, plus
// the pieces around it that TE's modules add (rotary embedding, T5 relative
// position buckets, packed-tensor splitting, mask resolution).
//
// Attention itself always runs in the input's float dtype, also under FP8
// autocast: TE's fused attention is bf16/fp16 (only the projections around it
// are FP8 GEMMs).
//
// Functions here are stateless except RelativeBucketCache, which is
// thread-safe.
#ifndef TE_SERVER_LAYERS_ATTENTION_CORE_H_
#define TE_SERVER_LAYERS_ATTENTION_CORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// Resolved settings of one attention block.
struct AttentionConfig {
  int num_heads = 0;       // query heads, Hq
  int num_gqa_groups = 0;  // key/value heads, Hkv (divides Hq)
  int head_dim = 0;        // D
  MaskType mask = MaskType::kCausal;
  float scale = 1.0f;  // logits = scale * q.k (+ bias after scaling)
  float dropout_rate = 0.0f;
};

// INVALID_ARGUMENT naming `field` (e.g. "spec.dot_product_attention") when the
// sizes are not positive, Hq % Hkv != 0, or the dropout rate is outside [0, 1).
absl::Status ValidateAttentionConfig(const AttentionConfig& config, absl::string_view field);

// te.v1.AttnMaskType with `unspecified` resolved to TE's default (causal);
// INVALID_ARGUMENT naming `field` for a value the proto does not define.
absl::StatusOr<MaskType> ResolveMaskType(te::v1::AttnMaskType mask, absl::string_view field);

// What an attention forward keeps for its backward: q, k and v from
// AttentionForward, or qkv alone from AttentionForwardPacked.
struct AttentionSaved {
  AttentionArgs args;  // resolved: seqlens (padding masks), bias, dropout
  Tensor q, k, v;
  Tensor qkv;  // [B, S, 3, H, D]; defined iff the forward was packed
  Tensor out, softmax_lse;
  // Set when args.bias (or args.relative_bias) is a relative-position bias
  // (the layer that gave it sets this): the backward's dbias is then its
  // table's gradient, dtable f32 [H, NB], computed without the dense
  // [H, Sq, Skv] where the backend can.
  RelativeBuckets relative;
  int64_t relative_num_buckets = 0;  // NB, with `relative`
  bool packed() const { return qkv.rank() == 5; }
  int64_t bytes() const;
};

// The request's attention mask for one attention call, as the session
// decoded it (session/tensor_codec.h, DecodeAttentionMask). Each mask type
// reads it as TE's DotProductAttention does (transformer.py: the unfused
// softmax applies the mask it is given, broadcast against the logits
// [B, H, Sq, Skv], so per head where it has heads; cuDNN's fused path reads
// the same mask as valid lengths):
//   no_mask, causal: the mask is ignored, whatever its shape or dtype (TE:
//     "mask is ignored for no_mask and causal"); causal masks j > i itself.
//   padding: the mask as it is, elementwise; through the lengths when it is
//     exactly a padding pattern.
//   padding_causal: the mask and causality together (key j visible to query
//     i iff the mask allows it and j <= i), so a padding mask, a padding
//     mask already combined with the causal triangle (TE's tests), or any
//     other mask all mean what they say; through the lengths when the mask
//     is a padding (+ causal) pattern.
//   causal_bottom_right: the mask and the bottom-right diagonal together
//     (j <= i + Skv - Sq).
//   padding_causal_bottom_right: the mask and the bottom-right diagonal of
//     each batch row's actual lengths (j <= i + kv_len[b] - q_len[b], the
//     lengths the mask's valid region spans, as TE derives them from it).
// With no mask at all the padding types see every position.
struct SeqLens {
  // The mask's lengths int32 [B], or undefined without a mask: exactly its
  // padding pattern's where `elementwise` is undefined, or where
  // with_causal; else (an arbitrary mask) its extents.
  Tensor q;
  Tensor kv;  // undefined: same as q (self-attention)
  // The mask is exactly padding | causal of the lengths (it had the causal
  // triangle in it): a padding_causal call reads them, a padding call reads
  // `elementwise` instead.
  bool with_causal = false;
  // The mask elementwise, bool [B, Sq, Skv] or [B, H, Sq, Skv] (true =
  // masked out); defined unless the mask is exactly a padding pattern.
  Tensor elementwise;
  // Not OK when the request's mask could not be taken (its shape): what a
  // mask type that reads the mask returns.
  absl::Status error;
  // The heads the mask was given with: 1 or the layer's (checked even where
  // its planes were alike and came as one).
  int64_t heads = 1;
};

// The mask a layer's inputs carry.
inline SeqLens MaskOf(const LayerInputs& in) {
  return SeqLens{in.q_seqlens, in.kv_seqlens, in.seqlens_with_causal, in.elementwise_mask,
                 in.mask_error, in.mask_heads};
}

// Whether the inputs carry a mask at all (one that could not be taken too).
inline bool HasMask(const LayerInputs& in) {
  return (in.q_seqlens.defined() && in.q_seqlens.numel() > 0) ||
         (in.elementwise_mask.defined() && in.elementwise_mask.numel() > 0) ||
         !in.mask_error.ok();
}

// An attention's additive bias on the logits (after scaling): made, [Hq, Sq,
// Skv] in float32 or q's dtype, or named by its table (a relative bias,
// AttentionArgs::relative_bias: a full forward's, whose backward then takes
// the table's gradient, or a decode step's rows), which a backend may apply
// by distance instead of making it. A Tensor converts to a made bias.
struct AttentionBias {
  AttentionBias() = default;
  AttentionBias(Tensor made) : made(std::move(made)) {}  // NOLINT(runtime/explicit)
  Tensor made;
  AttentionArgs::RelativeBiasTable relative;
};

// out [B, Sq, Hq, D] = attention(q [B, Sq, Hq, D], k, v [B, Skv, Hkv, D]).
// `bias` (optional) as AttentionBias states (one named by its table is forward
// only: AttentionBackward refuses it). Dropout on the
// probabilities runs only when `dropout_active` and the rate is positive.
// INVALID_ARGUMENT when shapes or dtypes do not match the config (the message
// names q, k, v or the seqlens). With `saved` non-null, fills it for
// AttentionBackward.
absl::Status AttentionForward(Ops& ops, const AttentionConfig& config, const Tensor& q,
                              const Tensor& k, const Tensor& v, const SeqLens& seqlens,
                              const AttentionBias& bias, bool dropout_active,
                              uint64_t dropout_seed, Tensor* out, AttentionSaved* saved);

// A decode step's attention from the fused QKV projection's output qkv [B, S,
// 3, H, D] as it is (Ops::DecodeAttentionFromQkv): q out of it and the keys
// rotated by `rotary` where non-null, the key and value rows written into
// key_cache and value_cache [B, L, H, D] at rows *position.., then q
// attending over the caches as AttentionForward does (forward only), out
// [B, S, H, D] allocated here. One launch where the backend can.
absl::Status DecodeAttentionFromQkv(Ops& ops, const AttentionConfig& config, const Tensor& qkv,
                                    const RotaryArgs* rotary, const Tensor& position,
                                    Tensor key_cache, Tensor value_cache, const SeqLens& seqlens,
                                    const AttentionBias& bias, bool dropout_active,
                                    uint64_t dropout_seed, Tensor* out);

// Gradients of vdot(out, dout): dq, dk, dv are allocated here (like q, k, v);
// dbias (f32 [Hq, Sq, Skv]; with saved.relative, the table's dtable f32
// [H, NB]) only when the forward had a bias and `dbias`
// is non-null. INVALID_ARGUMENT if `saved` comes from AttentionForwardPacked.
absl::Status AttentionBackward(Ops& ops, const AttentionSaved& saved, const Tensor& dout,
                               Tensor* dq, Tensor* dk, Tensor* dv, Tensor* dbias);

// Self-attention on a packed qkv [B, S, 3, H, D] (TE's BS3HD: the fused QKV
// projection's output as it is): the same results as AttentionForward on its
// three parts (q, k, v at index 0, 1, 2 of axis 2), without splitting them
// (on CUDA, cuDNN reads them in place). Needs num_gqa_groups == num_heads.
// out [B, S, H, D]. INVALID_ARGUMENT naming qkv when its shape or dtype does
// not fit the config, otherwise as AttentionForward (seqlens, bias). With
// `saved` non-null, keeps qkv (not q, k, v) for AttentionBackwardPacked.
absl::Status AttentionForwardPacked(Ops& ops, const AttentionConfig& config, const Tensor& qkv,
                                    const SeqLens& seqlens, const AttentionBias& bias,
                                    bool dropout_active, uint64_t dropout_seed, Tensor* out,
                                    AttentionSaved* saved);

// Gradients of vdot(out, dout) for a packed forward: dqkv [B, S, 3, H, D]
// (allocated here, like qkv), dbias as AttentionBackward. INVALID_ARGUMENT if
// `saved` does not come from AttentionForwardPacked.
absl::Status AttentionBackwardPacked(Ops& ops, const AttentionSaved& saved, const Tensor& dout,
                                     Tensor* dqkv, Tensor* dbias);

// ---- activations ------------------------------------------------------------
// INVALID_ARGUMENT naming `name` unless x is float32, bfloat16 or float16.
absl::Status CheckFloatActivation(const Tensor& x, absl::string_view name);
// The output gradient as a backward uses it: `dy` must have `shape` and a
// float dtype (INVALID_ARGUMENT naming "dy"); returned in `dtype` (the
// forward's compute dtype), cast when it differs.
absl::StatusOr<Tensor> PrepareGradient(Ops& ops, const Tensor& dy, const Shape& shape, DType dtype);

// ---- packed tensors -------------------------------------------------------
// Splits x along `axis` into x.dim(axis) contiguous tensors with that axis
// removed: [B, S, 3, H, D] along 2 -> three [B, S, H, D].
absl::StatusOr<std::vector<Tensor>> SplitAxis(Ops& ops, const Tensor& x, int axis);
// The inverse: stacks equal-shaped parts along a new `axis`.
absl::StatusOr<Tensor> StackAxis(Ops& ops, const std::vector<Tensor>& parts, int axis);

// ---- rotary position embedding ----------------------------------------------
// TE's rotary_pos_emb with windows (1, 10000) and group method "consecutive",
// which in TE's JAX code rotates adjacent pairs (x[2i], x[2i+1]).
// x, y [B, S, H, D] (*y newly allocated; it may be x's own handle);
// `inverse` rotates by -angle (the backward). Row s of x is at position
// position_offset + s (a decode step's token is at its cache index).
// `position` (optional, an int32 on the device) adds to position_offset when
// the kernel runs: a decode step's position lives on the device.
absl::Status ApplyRotary(Ops& ops, const Tensor& x, bool inverse, Tensor* y,
                         int64_t position_offset = 0, const Tensor& position = Tensor());
// That rotation's arguments, for ops that rotate on the way (DecodeQkvRows).
RotaryArgs TeRotary(bool inverse, int64_t position_offset = 0,
                    const Tensor& position = Tensor());
// TeRotary(inverse) for positions 0 .. seq - 1 of head dim `dim`, with its
// angles' table (RotaryArgs::table) kept in `constants`: made by the first
// step that asks, read by every later one, where a training step would
// otherwise make it in each layer's forward and backward. Without constants,
// or where the backend makes no tables, the args carry none.
absl::StatusOr<RotaryArgs> KeptTeRotary(Ops& ops, bool inverse, int64_t seq, int64_t dim,
                                        DeviceConstants* constants);

// ---- T5 relative position biases --------------------------------------------
// TE's RelativePositionBiases bucket of each (query i, key j), int32 [Sq * Skv]
// row-major, from relative position j - i, exactly as TE computes it with
// numpy (float32 log, then a float64 division).
std::vector<int32_t> RelativePositionBuckets(int64_t q_len, int64_t k_len, bool bidirectional,
                                             int num_buckets, int max_distance);

// The smallest distance n >= 1 from which every key n or more positions
// before its query has the same bucket, over the distances a causal
// self-attention of `seq` positions sees (RelativeBuckets::uniform_from);
// 0 when the buckets do not settle (seq < 2). `buckets` [seq, seq] row-major.
int64_t UniformBucketDistance(const std::vector<int32_t>& buckets, int64_t seq);

// Host bucket tables computed once per (Sq, Skv) and shared by every call of a
// layer; at most kMaxShapes shapes are kept (a new one past that starts the
// cache afresh). Thread-safe.
class RelativeBucketCache {
 public:
  RelativeBucketCache(bool bidirectional, int num_buckets, int max_distance)
      : bidirectional_(bidirectional), num_buckets_(num_buckets), max_distance_(max_distance) {}
  // The buckets for (q_len, k_len) uploaded to `ops`' device: int32 [Sq, Skv];
  // with `constants`, uploaded once per call and shared.
  absl::StatusOr<Tensor> Buckets(Ops& ops, int64_t q_len, int64_t k_len,
                                 DeviceConstants* constants = nullptr) const;
  // Buckets() with its RelativeBuckets::uniform_from (UniformBucketDistance).
  absl::StatusOr<RelativeBuckets> Relative(Ops& ops, int64_t q_len, int64_t k_len,
                                           DeviceConstants* constants = nullptr) const;

  static constexpr size_t kMaxShapes = 8;

 private:
  std::shared_ptr<const std::vector<int32_t>> Host(int64_t q_len, int64_t k_len) const;

  const bool bidirectional_;
  const int num_buckets_;
  const int max_distance_;
  mutable absl::Mutex mu_;
  mutable std::map<std::pair<int64_t, int64_t>, std::shared_ptr<const std::vector<int32_t>>> tables_
      ABSL_GUARDED_BY(mu_);
};

// The dtype RelativeBias makes a bias in for the attention's `operands`.
DType RelativeBiasDType(DType operands);
// bias [H, Sq, Skv] from `table` [H, NB] (TE's rel_embedding) and buckets
// [Sq, Skv]; or, given `first_row` (an int32 on the device: a decode step's
// position), from rows first_row .. first_row + rows - 1 of buckets [R, Skv],
// read when the kernel runs. The bias is in `operands`, the attention's
// q/k/v dtype, when that is bf16 or f16 (as cuDNN adds it: no cast, half the
// bytes), else float32.
absl::StatusOr<Tensor> RelativeBias(Ops& ops, const Tensor& table, const Tensor& buckets,
                                    DType operands, const Tensor& first_row = Tensor(),
                                    int64_t rows = 0);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_ATTENTION_CORE_H_
