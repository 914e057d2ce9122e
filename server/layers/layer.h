// Layer: one module of TE's Flax API (DenseGeneral ... TransformerLayer),
// written once against kernels/ops.h so it runs on every backend.
//
// A layer object holds its configuration (the te.v1 spec with TE's defaults
// applied) and nothing else: variables, FP8 state and saved activations live
// in the caller's containers, so a session owns all the state it can lose.
// Layer methods are const and thread-compatible; they issue work on the `Ops`
// they are given.
//
// Variables are named as Flax names them: "params/qkv/kernel",
// "fp8_metas/qkv/kernel_amax_history". Under a delayed-scaling recipe every
// FP8 GEMM has three quantizers, "x", "kernel" and "grad", each with
// "<q><postfix>_scale" [1] f32 (init 1) and "<q><postfix>_amax_history" [L] f32
// (init 0), where postfix is "" for one GEMM per module and "_0", "_1" for the
// two GEMMs of LayerNormMLP (TE's generate_quantizer_set(postfix)).
//
// FP8 in a step (DelayedScaling): a forward quantizes x and the kernel with
// their current scales and writes each tensor's amax into history[0]; the
// backward quantizes the output gradient likewise (E5M2 under HYBRID). The
// caller ends the step with UpdateFp8Metas (fp8_state.h), which applies TE's
// scale update to every quantizer. Float8CurrentScaling computes scales from
// the tensor itself (no state); MXFP8/NVFP4 are emulated by fake-quantizing
// GEMM operands in blocks along the contraction axis.
#ifndef TE_SERVER_LAYERS_LAYER_H_
#define TE_SERVER_LAYERS_LAYER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/ops.h"
#include "server/layers/device_constants.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// "collection/path" -> tensor on the layer's device. Ordered: listings are stable.
using Variables = std::map<std::string, Tensor>;

// A resolved recipe (te.v1.Recipe with TE's defaults applied).
class Fp8WeightCache;
class DecodeContext;  // cache.h

struct Fp8Recipe {
  enum class Kind { kDelayedScaling, kCurrentScaling, kMXFP8, kNVFP4 };
  enum class Format { kE4M3, kE5M2, kHybrid };
  Kind kind = Kind::kDelayedScaling;
  Format format = Format::kHybrid;
  float margin = 0.0f;
  int amax_history_len = 1024;
  bool most_recent = false;  // amax_compute_algo
  float amax_epsilon = 0.0f;

  // Not the recipe but where a step keeps its FP8 weight copies: the
  // session's per-layer cache, or null (quantize every weight every step).
  Fp8WeightCache* weight_cache = nullptr;
  // Not the recipe either: set for steps that neither read their amaxes back
  // nor move a scale (a generation's). DelayedScaling's quantizers then
  // record no amax (Fp8Output::amax undefined), and a kept weight copy, once
  // checked against its scale in the weight cache's open call, is used as
  // it stands for the rest of that call.
  bool inference = false;
  // Not the recipe either: where the module run with it finds its variables
  // among its layer's, "" when they are the layer's own names. A graph runs
  // each module node on a view of the layer's variables under the module's
  // names ("fp8_metas/mlp/wi_kernel_scale" for the layer's
  // "fp8_metas/TransformerLayer_0/mlp/wi_kernel_scale"), and sets this to
  // the node's name: the weight cache names a kept copy's scale as the layer
  // does, which is how the optimizer's update finds it
  // (Fp8WeightCache::CopiesForUpdate).
  std::string variables_scope;

  DType forward_dtype() const { return format == Format::kE5M2 ? DType::kE5M2 : DType::kE4M3; }
  DType backward_dtype() const { return format == Format::kE4M3 ? DType::kE4M3 : DType::kE5M2; }
};

struct ForwardOptions {
  bool deterministic = true;   // true: every dropout is off
  uint64_t dropout_seed = 0;
  const Fp8Recipe* fp8 = nullptr;  // null: no FP8 (compute in the input dtype)
  bool keep_for_backward = false;  // fill *saved
  // TE's `decode=True`: x holds one new token per sequence, [B, 1, hidden],
  // and the layer runs one autoregressive step on its `cache` collection
  // (Layer::CacheSpecs): it attends over the cached positions <= cache_index,
  // writes the token's key and value at cache_index and advances it.
  // Inference only (INVALID_ARGUMENT with keep_for_backward). Only layers
  // whose CacheSpecs succeed read it: a caller checks CacheSpecs first.
  bool decode = false;
  // With decode: the cache_index the caller knows every cache of the layer to
  // hold (a generation loop that advanced them itself), or -1: the layer
  // reads it from the cache, a 4-byte download that waits for the stream.
  int64_t decode_cache_index = -1;
  // With decode, set by generation (generate.h), which keeps its caches to
  // itself: x may hold S >= 1 new tokens per sequence (a prompt at once, then
  // one a step), attending causally over the cache's rows 0..index + S - 1,
  // and every causal self-attention decodes, also in the configurations
  // TE's modules refuse to decode (fused qkv layouts, an ENCODER
  // TransformerLayer). A graph returns a loss's logits instead of the loss.
  bool internal_decode = false;
  // With decode: what the step's attentions share instead of each making its
  // own (cache.h): the attention lengths and the next cache_index on the
  // device, made once per step (or, for generation, once per generation).
  // Null: each attention uploads its own.
  DecodeContext* decode_context = nullptr;
  // jax.default_matmul_precision for the call's float32 GEMMs: true
  // (te.v1.PRECISION_DEFAULT, JAX's default) runs them with TensorFloat-32
  // products where the device has them (Ops::GemmArgs::tf32), TE's modules
  // and Flax's alike; false (PRECISION_HIGHEST) exact float32. A Flax module
  // whose own precision is HIGHEST stays exact either way. A backward runs at
  // its forward's precision, as JAX's transposed dots do. False here, so a
  // caller that does not choose gets exact float32; the session sets it from
  // the request (MatmulTf32).
  bool tf32 = false;
  // The call's shared device tensors (device_constants.h): a session's
  // layer keeps them across calls, a graph's Forward makes them for the call
  // where this is null; null for a module: it makes its own.
  DeviceConstants* constants = nullptr;
};

// A request's matmul_precision as ForwardOptions::tf32; INVALID_ARGUMENT
// naming `field` for a value that is neither DEFAULT nor HIGHEST.
absl::StatusOr<bool> MatmulTf32(te::v1::Precision precision, absl::string_view field);

struct LayerInputs {
  Tensor x;
  std::vector<Tensor> extra;  // DotProductAttention (bshd_bshd_bshd): k, v
  // The request's attention mask (see DecodeAttentionMask in
  // server/session/tensor_codec.h and SeqLens in attention_core.h): its
  // lengths int32 [B] (undefined when the request had no mask): exactly its
  // padding pattern's where elementwise_mask is undefined, else its extents;
  Tensor q_seqlens;
  Tensor kv_seqlens;
  // whether the mask is exactly padding | causal of those lengths;
  bool seqlens_with_causal = false;
  // and the mask elementwise, bool [B, Sq, Skv] or, one plane per head,
  // [B, H, Sq, Skv] (true = masked out), defined for a mask that is not
  // exactly a padding pattern.
  Tensor elementwise_mask;
  // The heads the mask was given with (1, or its per-head planes: TE
  // broadcasts it against the logits, so a layer takes 1 or its own).
  int64_t mask_heads = 1;
  // Why the request's mask could not be taken (INVALID_ARGUMENT naming
  // attention_mask), or OK: the error of every module whose mask type reads a
  // mask; no_mask and causal modules ignore it, as TE ignores their mask.
  absl::Status mask_error;
};

struct LayerOutputs {
  Tensor y;
  Tensor ln_out;  // only for modules that return their layernorm output
  // A graph's outputs after y, in order (a loss function's aux outputs, as
  // jax.value_and_grad's has_aux returns them): no gradient flows from them.
  std::vector<Tensor> aux;
};

struct LayerGrads {
  Tensor dx;
  std::vector<Tensor> dextra;  // dk, dv for bshd attention
  Variables params;            // "params/..." -> gradient, same shapes and dtypes
};

// What a forward kept for its backward (activations, FP8 copies, options).
class SavedForward {
 public:
  virtual ~SavedForward() = default;
  virtual int64_t bytes() const = 0;  // device memory held
};

struct VariableSpec {
  std::string name;  // "params/qkv/kernel"
  Shape shape;
  DType dtype;
};

class Layer {
 public:
  virtual ~Layer() = default;

  // The module's TE name, e.g. "TransformerLayer".
  virtual std::string type_name() const = 0;

  // The variables this layer has for an input of `input_shape` (x's shape),
  // with the fp8_metas collection only when `fp8` is a delayed-scaling recipe.
  // INVALID_ARGUMENT (naming "input_shape") when the shape does not fit.
  virtual absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(
      const Shape& input_shape, const Fp8Recipe* fp8) const = 0;

  // TE's autoregressive cache, the `cache` collection: the variables this
  // layer has when initialised for decoding (Flax: init(..., decode=True))
  // with an x of `input_shape` and `input_dtype`, whose length L is the
  // cache's. MultiHeadAttention has "cache/cached_key" and
  // "cache/cached_value" [B, L, G, D] in x's dtype and "cache/cache_index"
  // int32 [] (a scalar), zeros at init (InitCache in cache.h); a layer
  // holding one at scope s has them under "cache/s/". A decode forward
  // writes them in place, as a forward writes fp8_metas: the new token's key
  // and value into row cache_index of every batch row, and cache_index + 1.
  // It reads no row past cache_index, so restoring cache_index after a
  // failed step restores the cache as decoding reads it; two holders that
  // share the key and value tensors and decode from different indices
  // overwrite each other's rows (a branch copies them first).
  // INVALID_ARGUMENT naming "decode" for a layer TE gives no cache, or whose
  // configuration TE refuses to decode (unless `internal_decode`: the
  // caches generation keeps, ForwardOptions::internal_decode).
  virtual absl::StatusOr<std::vector<VariableSpec>> CacheSpecs(const Shape& input_shape,
                                                               DType input_dtype,
                                                               bool internal_decode) const {
    (void)input_shape;
    (void)input_dtype;
    (void)internal_decode;
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: ", type_name(),
        " has no autoregressive cache (TE decodes with MultiHeadAttention and DECODER "
        "TransformerLayers)"));
  }

  // Shape of y for an input shape.
  virtual absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const = 0;

  // dtype of y for an input (x) of `input` dtype. TE's modules compute in and
  // return x's dtype; Flax's promote it with their parameters' (a bfloat16 x
  // with float32 params gives float32), and a graph follows its nodes.
  virtual DType OutputDType(DType input) const { return input; }

  // x is int32 token ids, not a float activation: nn.Embed, or a graph whose
  // x an Embed reads. Its x gets no gradient (dx is int32 zeros).
  virtual bool TakesTokenIds() const { return false; }

  // y is a float32 scalar loss (a graph ending in a softmax_cross_entropy
  // node): a training step may seed its backward with dloss itself instead
  // of taking a dy from the client.
  virtual bool ReturnsLoss() const { return false; }

  // Init(key, x): creates every variable of VariableSpecs with TE's
  // initialisers, deterministically from `seed`, into *vars.
  virtual absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape,
                            const Fp8Recipe* fp8, Variables* vars) const = 0;

  // Apply. FAILED_PRECONDITION if opts.fp8 is a delayed-scaling recipe and
  // `vars` has no fp8_metas for this layer ("init under autocast"). Under
  // DelayedScaling it writes the x / kernel amax into vars' fp8_metas.
  virtual absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in,
                               const ForwardOptions& opts, LayerOutputs* out,
                               std::unique_ptr<SavedForward>* saved) const = 0;

  // Gradients of vdot(y, dy) for a kept forward. Writes the grad quantizers'
  // amax into `vars`' fp8_metas (DelayedScaling); does not update scales.
  virtual absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved,
                                const Tensor& dy, LayerGrads* grads) const = 0;

  // Backward for a saved forward nobody will read again (a training step's
  // own): the same results, but the layer may free each kept tensor as soon
  // as its backward has read it, as JAX frees residuals, so the step holds
  // less at its peak. `saved` (not null) is gone afterwards, whatever the
  // outcome. The default runs Backward, then drops it.
  virtual absl::Status BackwardOnce(Ops& ops, Variables* vars,
                                    std::unique_ptr<SavedForward> saved, const Tensor& dy,
                                    LayerGrads* grads) const {
    return Backward(ops, vars, *saved, dy, grads);
  }
};

// Validates `spec` (INVALID_ARGUMENT naming the field, e.g.
// "spec.dense_general.features") and returns the layer with TE's defaults.
absl::StatusOr<std::unique_ptr<Layer>> CreateLayer(const te::v1::LayerSpec& spec);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_LAYER_H_
