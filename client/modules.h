// The modules of transformer_engine.jax.flax, as client-side descriptions
// with TE's field names and defaults as public members, and Flax's own
// modules (flax.linen's Dense, DenseGeneral, LayerNorm and
// MultiHeadDotProductAttention) with Flax's. A module object is a configuration only (thread-compatible);
// the layer's state lives in the server session that Init created it in.
//
//   TransformerLayer layer;
//   layer.hidden_size = 64;
//   Variables vars = layer.Init(*session, /*key=*/0, x).value();   // flax: init(key, x)
//   HostTensor y = layer.Apply(vars, x).value();                   // flax: apply(vars, x)
//
// Init, Apply and ValueAndGrad send the calling thread's current Autocast
// (recipe.h), as te.autocast scopes a Flax call.
#ifndef TE_CLIENT_MODULES_H_
#define TE_CLIENT_MODULES_H_

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "te/v1/layers.pb.h"

namespace te::client {

struct VariableInfo {
  std::string collection;  // "params" | "fp8_metas" | "cache"
  std::string path;        // "qkv/kernel", "mlp/kernel_0_amax_history"
  Shape shape;
  DType dtype = DType::kF32;
};

class VersionHold;  // modules.cc

// What Init returns: the server's handle to one layer's variables.
//
// A layer's variables come in versions on the server (te.v1
// ReleaseVersionsRequest): a call that changes them (a step, SetVariables,
// an Apply with update_fp8_metas) makes a new version from the one it read.
// A Variables is one of two kinds:
//  * live (what Init returns): it follows its layer's newest version. A
//    call through it that makes a new version moves every copy of it there,
//    and the version it left is released once no Variables holds it: the
//    stateful handle of a server-side layer.
//  * a value (Pinned(), and the `variables` of a step's result): one version,
//    which no later call changes, kept on the server while any copy of it
//    lives and released (without waiting) when the last one goes. Calls
//    through it read that version; a call that makes a new version returns
//    it as another value.
// Copies are cheap (a shared handle) and thread-compatible.
struct Variables {
  Session* session = nullptr;  // not owned: must outlive every use of these variables
  std::string layer_id;
  std::vector<VariableInfo> variables;
  Shape output_shape;          // for the input shape Init saw
  DType output_dtype = DType::kF32;
  std::shared_ptr<VersionHold> hold;  // the version; null: unknown (the newest, unheld)

  bool HasCollection(const std::string& collection) const;
  // The version these variables read now (a live handle's moves); 0 when unknown.
  int64_t version() const;
  bool live() const;
  // A value of the version these variables read now.
  Variables Pinned() const;
};

// The variable tree's shapes as the quickstart prints
// jax.tree_util.tree_map(lambda x: x.shape, params):
// "{'params': {'kernel': (64, 192), 'bias': (192,)}}", keys sorted.
std::string ShapeTree(const std::vector<VariableInfo>& variables);

struct ApplyOptions {
  bool deterministic = true;  // Flax's `deterministic`: true turns dropout off
  // The "dropout" PRNG key (Flax's rngs={"dropout": key}). A call whose
  // dropout runs (deterministic false, a rate above 0) needs one: without it
  // the call is INVALID_ARGUMENT naming what draws dropout, as Flax raises.
  std::optional<uint64_t> dropout_seed;
  // Rank 4, broadcast against the logits [B, H, Sq, Skv] ([B or 1, H or 1,
  // Sq or 1, Skv or 1]: per head too), bool or int32 (or float), nonzero =
  // masked out, any pattern: read as the module's TE mask type reads it
  // (no_mask and causal ignore it, whatever its shape; padding applies it
  // elementwise, padding_causal with causality, the bottom-right types with
  // their diagonal; te.v1 ForwardRequest.attention_mask).
  std::optional<HostTensor> attention_mask;
  std::vector<HostTensor> extra_inputs;      // DotProductAttention (bshd_bshd_bshd): k, v
  // y comes back through the GetTensor stream instead of inline (chosen
  // automatically when y is larger than ClientOptions::inline_tensor_bytes).
  bool keep_outputs = false;
  // Apply is functional under DelayedScaling (TE's: only a step moves the FP8
  // state); true ends the step at this forward instead (amaxes recorded,
  // scales updated), as inference under DelayedScaling wants.
  bool update_fp8_metas = false;
  // Which of the layer's graphs runs: 0, the one Init made, or AddGraph's.
  int graph = 0;
  // ValueAndGrad: one step of the layer's optimizer (Session::SetOptimizer)
  // with the gradients, on the server, in the same call; the result's grads
  // are then empty and its variables the updated version.
  bool apply_update = false;
  // TE's decode=True: one autoregressive step on the `cache` collection (x
  // [batch, 1, ...], the next token of each sequence). It changes the cache,
  // so it runs through Module::Decode (Flax's mutable=["cache"]), which
  // returns the new version; Apply refuses it as Flax refuses an immutable
  // collection.
  bool decode = false;
};

// What Init does besides creating the params (Flax's init(key, x, **kwargs)).
struct InitOptions {
  // TE's init(key, x, decode=True): the layer's attentions that decode (a
  // MultiHeadAttention with enable_rotary_pos_emb, a decoder
  // TransformerLayer's self-attention, such modules in a Graph) also get
  // their `cache` collection for x's batch and length (cache/<scope>/
  // {cached_key, cached_value, cache_index}), zeros, on the server.
  // INVALID_ARGUMENT naming decode for a module with no such attention (an
  // encoder TransformerLayer: TE asserts it).
  bool decode = false;
};

// What Decode returns: y = apply(vars, x_t, decode=True, mutable=["cache"]).
struct DecodeResult {
  HostTensor y;  // [batch, 1, ...]
  // The version with the cache advanced by the token: the live handle the
  // call went through (moved there), or a new value for a value's call. The
  // cache stays on the server: only y crosses the wire.
  Variables variables;
};

struct ForwardResult {
  HostTensor y;
  std::optional<HostTensor> ln_out;  // modules that return their layernorm output
  std::vector<HostTensor> aux;       // a graph's outputs after y
  std::string forward_id;            // set when the forward was kept for Backward
  // Where the call made a new version (update_fp8_metas): it, as a value
  // for a value's call (a live handle moved there itself).
  std::optional<Variables> variables;
};

// Gradients of vdot(y, dy). `grads` is keyed like the params it belongs to
// ("params/qkv/kernel").
struct BackwardResult {
  HostTensor dx;
  std::vector<HostTensor> extra_input_grads;  // dk, dv for bshd attention; a decoder's d encoded
  std::map<std::string, HostTensor> grads;
  // The version the step made (FP8 state, kept gradients), of the kind
  // Backward's `vars` are: live (moved there) or a value. Unset without
  // `vars`: that version then stays on the server until its layer goes.
  std::optional<Variables> variables;
};

struct ValueAndGradResult {
  double value = 0.0;  // vdot(apply(x), dy), or the loss
  HostTensor dx;
  std::vector<HostTensor> extra_input_grads;  // of ApplyOptions::extra_inputs
  std::map<std::string, HostTensor> grads;
  std::vector<HostTensor> aux;  // a loss graph's outputs after the loss (has_aux)
  // The variables after the step (Module::ValueAndGrad): the new version the
  // step made (FP8 state moved, gradients kept, an update), else the one it
  // read; live when the call went through a live handle (which moved there).
  std::optional<Variables> variables;
  std::optional<te::v1::UpdateInfo> update;  // with ApplyOptions::apply_update
};

// What AddGraph made.
struct AddedGraph {
  int graph = 0;  // for ApplyOptions::graph
  Shape output_shape;
  DType output_dtype = DType::kF32;
};

// The shared machinery: a module only says what its te.v1.LayerSpec is.
class Module {
 public:
  virtual ~Module() = default;

  virtual std::string type_name() const = 0;
  // INVALID_ARGUMENT naming the field when a string field has no te.v1 value
  // (e.g. layernorm_type "batchnorm").
  virtual absl::StatusOr<te::v1::LayerSpec> Spec() const = 0;
  // What draws dropout when a call is not deterministic (Flax's make_rng
  // ("dropout") callers): the module itself when one of its dropout rates is
  // above 0; a Graph names its nodes.
  virtual std::vector<std::string> DropoutUsers() const { return {}; }
  // The extra inputs a call beside an x of `x` takes, as Init and AddGraph
  // declare them to the server (InitLayerRequest.extra_inputs): a Graph's
  // ExtraInput edges, of any dtype (int32 labels beside a float x). Empty for
  // the other modules, whose extra inputs (k, v) have x's dtype.
  virtual std::vector<te::v1::TensorHeader> ExtraInputs(const Shape& x) const { return {}; }

  // Creates the layer's variables on the server from `key` and x's shape and
  // dtype (x's values are not sent). Under a DelayedScaling autocast the
  // fp8_metas collection is created too, and with options.decode the cache.
  // INVALID_ARGUMENT when x does not fit the module (a Graph's declared extra
  // inputs included). The returned Variables point at `session`.
  absl::StatusOr<Variables> Init(Session& session, uint64_t key, const HostTensor& x,
                                 const InitOptions& options = {}) const;

  // y = apply(vars, x). FAILED_PRECONDITION (the server's message) when FP8 is
  // on and the layer was initialised without a DelayedScaling autocast;
  // INVALID_ARGUMENT with options.decode (the cache is immutable here: use
  // Decode).
  absl::StatusOr<HostTensor> Apply(const Variables& vars, const HostTensor& x,
                                   const ApplyOptions& options = {}) const;

  // apply(vars, x_t, decode=True, mutable=["cache"]): one autoregressive step
  // (options.decode implied). The version `vars` read keeps its cache, so a
  // step that fails changes nothing. Decoding a sequence token by token gives
  // the rows of one causal Apply of the whole sequence. The server's errors:
  // FAILED_PRECONDITION for variables initialised without decode;
  // INVALID_ARGUMENT naming x.shape for more than one token, or cache_index
  // for a cache decoded to its length (init with a longer x).
  absl::StatusOr<DecodeResult> Decode(const Variables& vars, const HostTensor& x_t,
                                      const ApplyOptions& options = {}) const;

  // jax.value_and_grad(lambda v, x: vdot(apply(v, x), dy), argnums=(0, 1)),
  // one ForwardBackward call. Under DelayedScaling the step's end updates the
  // server's FP8 scales. dx and the gradients come back inline, so each must
  // fit ClientOptions::max_message_bytes (RESOURCE_EXHAUSTED otherwise); time
  // larger layers with Speedometer, which brings nothing back.
  absl::StatusOr<ValueAndGradResult> ValueAndGrad(const Variables& vars, const HostTensor& x,
                                                  const HostTensor& dy,
                                                  const ApplyOptions& options = {}) const;

  // jax.value_and_grad(loss_fn, has_aux=True) for a graph whose y is a
  // float32 scalar (options.graph, added over the layer with AddGraph, or
  // Init's own): no dy, the loss's backward is seeded with 1; result.aux
  // holds the graph's outputs after the loss. INVALID_ARGUMENT (the
  // server's) when that graph's y is not a float32 scalar.
  absl::StatusOr<ValueAndGradResult> LossValueAndGrad(const Variables& vars, const HostTensor& x,
                                                      const ApplyOptions& options = {}) const;

  // A forward that, with keep_for_backward, leaves what Backward needs on the
  // server, for a Backward call to use (a chain of modules run call by call).
  absl::StatusOr<ForwardResult> Forward(const Variables& vars, const HostTensor& x,
                                        const ApplyOptions& options, bool keep_for_backward) const;

 protected:
  // DropoutUsers of a module with these dropout rates: itself when one is above 0.
  std::vector<std::string> DropoutUsersIf(std::initializer_list<float> rates) const;
};

// The backward of a kept forward: gradients of vdot(y, dy). With keep_grads
// the parameter gradients stay on the server (summed into the layer's "grads"
// collection) and result.grads is empty. NOT_FOUND when the forward id is
// unknown or was already used.
// `vars`, when given, are the forward's: a live handle moves to the version
// the step makes (its FP8 state, kept gradients).
absl::StatusOr<BackwardResult> Backward(Session& session, const std::string& forward_id,
                                        const HostTensor& dy, bool keep_grads = false,
                                        const Variables* vars = nullptr);

// The variables of the version `vars` read ("params/...", "fp8_metas/...",
// "grads/...", "opt_state/..."), downloaded; `collections` empty means all.
absl::StatusOr<std::map<std::string, HostTensor>> GetVariables(
    const Variables& vars, const std::vector<std::string>& collections = {});

// Adds `graph` (a Graph, client/graph.h, over the layer's own modules: the
// same names and specs; for a layer that is one module, that module as the
// graph's Graph::CallLayer) for an x of `x_shape` and `x_dtype` to the layer
// `vars` name. INVALID_ARGUMENT naming the node that is not the layer's.
absl::StatusOr<AddedGraph> AddGraph(const Variables& vars, const Module& graph,
                                    const Shape& x_shape, DType x_dtype);

// Frees the layer on the server: every version (every Variables of it is
// then unusable: NOT_FOUND), graph, optimizer state and kept forward.
absl::Status DeleteLayer(const Variables& vars);

// ---- The modules (TE's defaults) ----------------------------------------------

class LayerNorm : public Module {
 public:
  float epsilon = 1e-6f;
  std::string layernorm_type = "layernorm";  // | "rmsnorm"
  bool zero_centered_gamma = false;
  DType dtype = DType::kF32;  // parameter dtype

  std::string type_name() const override { return "LayerNorm"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

class DenseGeneral : public Module {
 public:
  explicit DenseGeneral(std::vector<int64_t> features) : features(std::move(features)) {}
  std::vector<int64_t> features;
  bool use_bias = true;
  std::vector<int> axis = {-1};
  DType dtype = DType::kF32;

  std::string type_name() const override { return "DenseGeneral"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

// te.activation.activation(x, activation_type): no parameters.
class Activation : public Module {
 public:
  std::vector<std::string> activations = {"gelu"};

  std::string type_name() const override { return "Activation"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

class LayerNormDenseGeneral : public Module {
 public:
  explicit LayerNormDenseGeneral(std::vector<int64_t> features) : features(std::move(features)) {}
  std::vector<int64_t> features;
  float epsilon = 1e-6f;
  std::string layernorm_type = "layernorm";
  bool zero_centered_gamma = false;
  bool use_bias = false;
  bool return_layernorm_output = false;
  bool enable_layernorm = true;
  DType dtype = DType::kF32;

  std::string type_name() const override { return "LayerNormDenseGeneral"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

class LayerNormMLP : public Module {
 public:
  int64_t intermediate_dim = 2048;
  std::vector<std::string> activations = {"gelu"};
  float intermediate_dropout_rate = 0.0f;
  bool use_bias = false;
  bool return_layernorm_output = false;
  float epsilon = 1e-6f;
  std::string layernorm_type = "layernorm";
  bool zero_centered_gamma = false;
  bool enable_layernorm = true;
  DType dtype = DType::kF32;

  std::string type_name() const override { return "LayerNormMLP"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  std::vector<std::string> DropoutUsers() const override { return DropoutUsersIf({intermediate_dropout_rate}); }
};

// Inputs: q as x and k, v as ApplyOptions::extra_inputs (bshd_bshd_bshd), or
// the packed [B, S, 3, H, D] qkv as x (bs3hd).
class DotProductAttention : public Module {
 public:
  DotProductAttention(int head_dim, int num_attention_heads)
      : head_dim(head_dim), num_attention_heads(num_attention_heads) {}
  int head_dim;
  int num_attention_heads;
  std::optional<int> num_gqa_groups;  // None: num_attention_heads
  float attention_dropout = 0.0f;
  // no_mask | padding | causal | padding_causal | causal_bottom_right |
  // padding_causal_bottom_right (and TE's aliases, e.g. causal_padding)
  std::string attn_mask_type = "causal";
  std::string qkv_layout = "bshd_bshd_bshd";  // | "bs3hd"
  std::optional<float> scale_factor;  // None: 1 / sqrt(head_dim)
  DType dtype = DType::kF32;

  std::string type_name() const override { return "DotProductAttention"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  std::vector<std::string> DropoutUsers() const override { return DropoutUsersIf({attention_dropout}); }
};

class MultiHeadAttention : public Module {
 public:
  MultiHeadAttention(int head_dim, int num_attention_heads)
      : head_dim(head_dim), num_attention_heads(num_attention_heads) {}
  int head_dim;
  int num_attention_heads;
  std::optional<int> num_gqa_groups;
  float attention_dropout = 0.0f;
  bool input_layernorm = true;
  std::string layernorm_type = "layernorm";
  float layernorm_epsilon = 1e-6f;
  bool zero_centered_gamma = false;
  bool use_bias = false;
  std::string attn_mask_type = "causal";
  bool enable_rotary_pos_emb = false;
  bool scale_attn_logits = false;
  bool scaled_query_init = true;
  bool return_layernorm_output = false;
  DType dtype = DType::kF32;

  std::string type_name() const override { return "MultiHeadAttention"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  std::vector<std::string> DropoutUsers() const override { return DropoutUsersIf({attention_dropout}); }
};

// layer_type "decoder" (TE's TransformerLayerType.DECODER) adds
// cross-attention over `encoded` after the self-attention: pass `encoded`
// [batch, kv_seq, hidden_size] as ApplyOptions::extra_inputs[0] (its
// gradient is BackwardResult::extra_input_grads[0]) and TE's encoder_decoder_mask as
// ApplyOptions::attention_mask; a decoder's self_attn_mask_type is then
// "causal" or "no_mask" (te.v1.TransformerLayer says why).
class TransformerLayer : public Module {
 public:
  int64_t hidden_size = 512;
  int64_t mlp_hidden_size = 2048;
  int num_attention_heads = 8;
  std::optional<int> num_gqa_groups;
  std::string layernorm_type = "layernorm";
  float layernorm_epsilon = 1e-6f;
  bool zero_centered_gamma = false;
  float hidden_dropout = 0.1f;
  float attention_dropout = 0.1f;
  float intermediate_dropout = 0.0f;
  std::vector<std::string> mlp_activations = {"gelu"};
  bool use_bias = false;
  std::string self_attn_mask_type = "causal";
  std::optional<std::string> self_attn_bias_type;  // None | "no_bias" | "post_scale_bias"
  bool enable_relative_embedding = true;
  bool enable_rotary_pos_emb = false;
  bool scale_attn_logits = false;
  bool scaled_query_init = true;
  DType dtype = DType::kF32;
  std::string layer_type = "encoder";  // | "decoder"

  std::string type_name() const override { return "TransformerLayer"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  std::vector<std::string> DropoutUsers() const override {
    return DropoutUsersIf({hidden_dropout, attention_dropout, intermediate_dropout});
  }
};

// ---- Flax's own modules (flax.linen), Flax's defaults ---------------------------
// Flax's names, shapes, initialisers and dtype rule (layers.proto's
// FlaxDense...): parameters in param_dtype; the computation, and y, in
// `dtype` when set, else in the promotion of the input's dtype and
// param_dtype (a bfloat16 x with float32 params gives float32). type_name()
// is Flax's class name, so a Graph names them "Dense_0", "LayerNorm_1".
// They ignore FP8 autocast, as plain Flax does.

class FlaxDense : public Module {
 public:
  explicit FlaxDense(int64_t features) : features(features) {}
  int64_t features;
  bool use_bias = true;
  std::optional<DType> dtype;  // None: promote x's dtype and param_dtype
  DType param_dtype = DType::kF32;
  // Flax's precision: false is Flax's None (the call's
  // DefaultMatmulPrecision, recipe.h: TensorFloat-32 float32 matmuls on a
  // GPU by default), true HIGHEST (exact float32 whatever the call's).
  bool highest_precision = false;

  std::string type_name() const override { return "Dense"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

class FlaxDenseGeneral : public Module {
 public:
  explicit FlaxDenseGeneral(std::vector<int64_t> features) : features(std::move(features)) {}
  std::vector<int64_t> features;
  std::vector<int> axis = {-1};  // contracted input axes
  bool use_bias = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::kF32;
  // Flax's precision: false is Flax's None (the call's
  // DefaultMatmulPrecision, recipe.h: TensorFloat-32 float32 matmuls on a
  // GPU by default), true HIGHEST (exact float32 whatever the call's).
  bool highest_precision = false;

  std::string type_name() const override { return "DenseGeneral"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

class FlaxLayerNorm : public Module {
 public:
  float epsilon = 1e-6f;
  bool use_bias = true;
  bool use_scale = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::kF32;

  std::string type_name() const override { return "LayerNorm"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
};

// x is inputs_q [batch, q_len, features]; k and v are extra inputs (in a
// Graph, the node's second and third inputs). Its mask in a Graph is the
// node's: a causal_mask node's output makes it causal.
class FlaxMultiHeadDotProductAttention : public Module {
 public:
  explicit FlaxMultiHeadDotProductAttention(int num_heads) : num_heads(num_heads) {}
  int num_heads;
  std::optional<int64_t> qkv_features;  // None: inputs_q's features
  std::optional<int64_t> out_features;  // None: inputs_q's features
  float dropout_rate = 0.0f;
  bool use_bias = true;
  bool broadcast_dropout = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::kF32;
  // Flax's precision: false is Flax's None (the call's
  // DefaultMatmulPrecision, recipe.h: TensorFloat-32 float32 matmuls on a
  // GPU by default), true HIGHEST (exact float32 whatever the call's).
  bool highest_precision = false;

  std::string type_name() const override { return "MultiHeadDotProductAttention"; }
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  std::vector<std::string> DropoutUsers() const override { return DropoutUsersIf({dropout_rate}); }
};

}  // namespace te::client

#endif  // TE_CLIENT_MODULES_H_
