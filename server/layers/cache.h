// TE's autoregressive cache (the `cache` collection of Flax's decode) for
// self-attention: one key and one value per position, written a token at a
// time, and the index of the next position.
//
// For an attention block at `scope`, initialised with an x of [B, L, hidden]
// (TE: MultiHeadAttention, transformer.py, `if decode:`):
//   cache/<scope>/cached_key    [B, L, G, D]  x's dtype  zeros
//   cache/<scope>/cached_value  [B, L, G, D]  x's dtype  zeros
//   cache/<scope>/cache_index   int32 []      0
// (G: the key/value heads, D: head_dim; TE's layout with batch first). A
// decode step with the index at p writes its token's key and value into row
// p of each batch row, attends over rows 0..p, and sets the index to p + 1.
// Generation's steps (ForwardOptions::internal_decode) may write S tokens at
// once (the prompt), rows p..p + S - 1, token i attending over rows 0..p + i.
#ifndef TE_SERVER_LAYERS_CACHE_H_
#define TE_SERVER_LAYERS_CACHE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/ops.h"
#include "server/layers/device_constants.h"
#include "server/layers/layer.h"

namespace te::layers {

inline constexpr char kCache[] = "cache";

struct KvCacheNames {
  std::string key;    // "cache/<scope>/cached_key"
  std::string value;  // "cache/<scope>/cached_value"
  std::string index;  // "cache/<scope>/cache_index"
};
KvCacheNames KvCacheNamesAt(absl::string_view scope);

// The three variables of the cache at `scope` for batch B, length L.
std::vector<VariableSpec> KvCacheSpecs(absl::string_view scope, int64_t batch, int64_t length,
                                       int64_t groups, int64_t head_dim, DType dtype);

// INVALID_ARGUMENT naming x.dtype unless it is a float dtype a cache holds
// (float32, bfloat16, float16: the keys and values in x's dtype).
absl::Status CheckCacheDType(DType dtype);

// Creates every variable of `specs` as zeros (float or int32) into *vars.
absl::Status InitCache(Ops& ops, const std::vector<VariableSpec>& specs, Variables* vars);

// One decode step's cache: its tensors (sharing the variables' memory), the
// index it holds and the step's new tokens per sequence.
struct KvCache {
  KvCacheNames names;
  Tensor key, value;  // [B, L, G, D]
  Tensor index;       // int32 []
  int64_t position = 0;  // the index's value: the first row this step writes
  int64_t tokens = 1;    // S: the step writes rows position .. position + S - 1
  int64_t length() const { return key.dim(1); }
};

// The cache at `scope` for a step of `tokens` new positions of `batch`
// sequences in `dtype`: FAILED_PRECONDITION when the layer was initialised
// without it ("init with decode"), INVALID_ARGUMENT naming the variable when
// its shape or dtype does not fit the step (batch, heads, head_dim, x's
// dtype), or naming cache_index when the step's rows do not fit in [0, L)
// (a cache decoded to its length has no row left). The index is
// `known_index` when that is >= 0, else read from the device (a 4-byte
// download that waits for the stream).
absl::StatusOr<KvCache> OpenKvCache(Ops& ops, const Variables& vars, absl::string_view scope,
                                    int64_t batch, int64_t tokens, int64_t groups,
                                    int64_t head_dim, DType dtype, int64_t known_index);

// The index of the cache at `scope`: `known_index` when that is >= 0, else
// read from the device; FAILED_PRECONDITION or INVALID_ARGUMENT as
// OpenKvCache for a missing or malformed cache_index.
absl::StatusOr<int64_t> ReadKvCacheIndex(Ops& ops, const Variables& vars, absl::string_view scope,
                                         int64_t known_index);

// k, v [B, S, G, D] (the cache's dtype) into rows p .. p + S - 1 of every
// batch row of cache.key / cache.value, in place, p read on the device from
// `position` (DecodePosition: it holds cache.position).
absl::Status WriteKvRows(Ops& ops, const Tensor& k, const Tensor& v, const KvCache& cache,
                         const Tensor& position);
// INTERNAL unless a fused projection's qkv is [B, S, 3, G, D] in the
// cache's dtype: the rows a step writes into `cache` from it
// (DecodeAttentionFromQkv in attention_core.h).
absl::Status CheckQkvRows(const Tensor& qkv, const KvCache& cache);

// What the attentions of one decode step share (ForwardOptions::
// decode_context), so a model of N attention blocks makes its small device
// tensors once per step rather than N times, and a generation once for all
// its steps: the attention lengths (int32 [B] all holding one value), of
// which the next cache_index is a view, and device constants a layer keys by
// name (the relative-position buckets). Each is made by the first step that
// asks and shared by every later ask of the context's life; the caller keeps
// the context while any step that asked may still run. Not thread-safe: a
// step's layers run one after another.
class DecodeContext {
 public:
  // One upload of int32 [values.size(), batch], row i all values[i]:
  // Lengths(ops, batch, v) for each v of `values` is then a view of it.
  absl::Status Reserve(Ops& ops, int64_t batch, const std::vector<int64_t>& values);
  // int32 [batch], every element `value`, on ops' device: a reserved row, or
  // uploaded on the first ask and kept.
  absl::StatusOr<Tensor> Lengths(Ops& ops, int64_t batch, int64_t value);
  // Device tensors the step's (or generation's) layers share: the
  // relative-position buckets.
  DeviceConstants constants;
  // A generation's step state on the device, one upload a step: the step's
  // position (int32 [1]) and its attentions' kv lengths (int32 [batch], all
  // position + tokens). While it is set, a step's layers read the position
  // on the device and the kv lengths from here, so the step issues the same
  // launches at every position and can be recorded once and replayed
  // (Ops::CaptureStep). The buffer is made on the first call and reused.
  absl::Status SetStep(Ops& ops, int64_t batch, int64_t position, int64_t tokens);
  // From a one-token step's state to the next one's (position and kv lengths
  // one further), on the device: no upload, so it can end a recorded step.
  absl::Status AdvanceOneToken(Ops& ops);
  bool has_step() const { return step_.defined(); }
  Tensor step_position() const { return step_.Slice0(0, 1); }
  Tensor step_kv_lengths() const { return step_.Slice0(1, step_.dim(0)); }
  // Whether a step writes each cache's cache_index. False only for a caller
  // that keeps the caches to itself and passes the index it knows
  // (ForwardOptions::decode_cache_index): generation, whose caches nobody
  // else reads.
  bool write_index = true;
  // Uploads made so far (tests count them).
  int64_t uploads() const { return uploads_; }

 private:
  std::map<std::pair<int64_t, int64_t>, Tensor> lengths_;  // (batch, value)
  Tensor step_;  // int32 [1 + batch]: the position, then the kv lengths
  int64_t uploads_ = 0;
};

// The int32 on the device that holds a decode step's position: the
// context's step state when it has one, else the cache's own cache_index
// (which the step advances only after its layers have read it).
Tensor DecodePosition(const Tensor& cache_index, const DecodeContext* context);

// cache_index = cache.position + cache.tokens, in place: a device copy from
// the context's lengths (none with !context.write_index).
absl::Status AdvanceKvCache(Ops& ops, const KvCache& cache, DecodeContext& context);

// The step's keys and values as attention reads them: the whole cache
// [B, L, G, D] at every step, so the attention's shapes stay the same for a
// whole generation (a GPU backend plans an attention once per shape), with
// q_seqlens S and kv_seqlens p + S from the context (its step state when
// it has one, which holds p + S on the device) showing query i (at
// position p + i) the rows 0..p + i: a padding mask for one token, padding
// with the causal diagonal for S tokens at p = 0 (where top-left and
// bottom-right agree), padding_causal_bottom_right for S tokens past 0.
struct KvView {
  Tensor key, value;  // [B, L, G, D]
  MaskType mask = MaskType::kPadding;
  Tensor q_seqlens;   // int32 [B]
  Tensor kv_seqlens;
};
absl::StatusOr<KvView> VisibleKv(Ops& ops, const KvCache& cache, DecodeContext& context);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_CACHE_H_
