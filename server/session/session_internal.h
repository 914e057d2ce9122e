// Session's private parts, shared by session.cc (layers, variables, tensors),
// session_versions.cc (versions, graphs), session_decode.cc (decode's cache),
// session_steps.cc (forward, backward, benchmark) and session_generate.cc
// (generation). Not for other users.
#ifndef TE_SERVER_SESSION_SESSION_INTERNAL_H_
#define TE_SERVER_SESSION_SESSION_INTERNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "server/layers/device_constants.h"
#include "server/layers/fp8_weight_cache.h"
#include "server/layers/graph.h"
#include "server/layers/layer.h"
#include "server/optim/optimizer.h"
#include "server/session/session.h"
#include "server/session/tensor_codec.h"

namespace te::session {

// A layer's optimizer (SetOptimizer). Its state, "opt_state/..." (optim's
// contract 2), is part of each version of the layer's variables.
struct LayerOptimizer {
  te::v1::Optimizer spec;  // as requested: what a checkpoint keeps
  optim::OptimizerConfig config;
  optim::Updater updater;  // the step's device plan over the params and state
};

// One version of a layer's variables (contract 9). Tensors are handles:
// versions share every tensor that neither has written since they parted.
struct VariableSet {
  layers::Variables vars;       // "params/...", "fp8_metas/..."
  layers::Variables grads;      // "grads/...": kept gradients, accumulated
  layers::Variables opt_state;  // "opt_state/...", with an optimizer
};

// One cache a decode step advances (session_decode.cc): its variables'
// names and the index the version read holds.
struct DecodeCache {
  std::string index;  // "cache/<scope>/cache_index"
  std::string key;    // "cache/<scope>/cached_key"
  std::string value;  // "cache/<scope>/cached_value"
  int64_t position = 0;
  size_t slot = 0;  // where PrepareDecode read the index
};

// A decode step's caches, prepared in its working variables.
struct DecodeStep {
  std::vector<DecodeCache> caches;  // never empty
  // The index every cache holds, or -1 where they differ (each attention
  // then reads its own): ForwardOptions::decode_cache_index.
  int64_t common_index = -1;
  int branched = 0;  // caches whose keys and values the step copied
  // What the step's attentions share (ForwardOptions::decode_context): with
  // a common index, its lengths uploaded in one copy for every attention.
  std::shared_ptr<layers::DecodeContext> context;
};

// Contract 11: how many rows (per sequence) of variable `name` of `vars` are
// the version's when it is a cache's cached_key or cached_value: its
// cache_index (read from the device) within [0, L]. -1 for any other
// variable (held whole).
absl::StatusOr<int64_t> CacheRowsHeld(Ops& ops, const layers::Variables& vars,
                                      const std::string& name);

// A retained version.
struct LayerVersion {
  VariableSet set;
};

// One of a layer's graphs: [0] is what InitLayer made (the module, or the
// graph init traced); AddGraph adds the others over the same variables.
struct LayerGraph {
  std::unique_ptr<layers::Layer> layer;
  // AddGraph's graph, input shape and dtype (session and layer id cleared):
  // what a checkpoint keeps. Unset for [0].
  te::v1::AddGraphRequest added;
  // The graph's extra inputs as InitLayer or AddGraph declared them (a call's
  // are checked against them); none declared: each has x's dtype.
  std::optional<layers::DeclaredExtras> extras;
  // What the graph's calls need of a version (Layer::VariableSpecs), made
  // once per input shape and FP8 state (layers::Fp8StateKey): each call
  // checks the version it reads against them, and the graph's shape
  // inference and its modules' variable names need not be made again for it.
  // At most kMaxRememberedSpecs (session.h) of them.
  std::map<std::pair<Shape, std::pair<int, int64_t>>, std::vector<layers::VariableSpec>> specs;
};

struct Session::LayerEntry {
  std::string id;
  std::vector<LayerGraph> graphs;  // never empty
  // The retained versions by number (contract 9); numbers are never reused.
  std::map<int64_t, LayerVersion> versions;
  int64_t last_version = 0;  // the highest number made
  std::optional<LayerOptimizer> optimizer;
  std::optional<layers::Fp8Recipe> init_recipe;  // the autocast recipe at init
  // FP8 copies of the parameters kept between steps (DelayedScaling). A
  // call keeps the copies it made only when it read the newest version, so
  // the copies follow the version that trains and do not hold an older
  // one's weights once it is released.
  layers::Fp8WeightCache fp8_weights;
  // Device tensors the layer's modules share and keep across calls
  // (device_constants.h: the relative-position buckets): made by the first
  // call that needs them, not uploaded again by every step. They depend on
  // no variable, so every version reads them and no write drops them.
  layers::DeviceConstants constants;
  // The parameters cast to their GEMMs' compute dtype (a float32 weight of a
  // bfloat16 layer), kept between steps as the FP8 copies are: installed as
  // the Ops' cast memo while a call runs (StepTransaction), kept only by a
  // call that commits having read the newest version, and rewritten by the
  // optimizer as it writes the params (OptimizerSlot::compute_copy), so no
  // forward casts a weight again while it trains.
  std::shared_ptr<Ops::CastMemo> casts = std::make_shared<Ops::CastMemo>();
  // Every write to the parameters outside an optimizer update (SetVariables,
  // a failed update that may have part written them) calls this: every kept
  // copy is stale. An update rewrites the compute copies, and under
  // DelayedScaling the FP8 copies too (ApplyUpdate).
  void ParamsChanged() {
    fp8_weights.Clear();
    casts->Clear();
  }
  // The InitLayer request less its session ref: a checkpoint re-creates the
  // layer from its spec, input shape and dtype, and autocast.
  te::v1::InitLayerRequest init;

  // The module (or graph) InitLayer made.
  const layers::Layer& layer() const { return *graphs[0].layer; }
  bool is_newest(int64_t version) const {
    return !versions.empty() && versions.rbegin()->first == version;
  }
  // The newest retained version, or null when every one was released.
  const LayerVersion* newest() const {
    return versions.empty() ? nullptr : &versions.rbegin()->second;
  }
};

// What a call runs: one graph of a layer over one retained version of its
// variables.
struct Session::Target {
  LayerEntry* entry = nullptr;
  int graph = 0;
  const layers::Layer* layer = nullptr;  // entry->graphs[graph]
  int64_t version = 0;                   // the version read, by number
  const VariableSet* read = nullptr;     // and its variables
};

struct Session::SavedEntry {
  std::string layer_id;
  int graph = 0;
  int64_t version = 0;  // the version the forward read
  // The variables the forward ran on (its working fp8_metas, with the
  // forward's amaxes): the Backward makes the step's new version from them,
  // whatever was released or made meanwhile.
  VariableSet base;
  const layers::Layer* layer = nullptr;  // the graph that ran (the layer owns it)
  std::unique_ptr<layers::SavedForward> saved;
  std::optional<layers::Fp8Recipe> recipe;  // the forward's: the backward ends its step
  Shape y_shape;
  DType y_dtype = DType::kF32;
};

// A request's layer inputs, validated, not yet on the device.
struct Session::CheckedInputs {
  CheckedTensor x;
  std::vector<CheckedTensor> extra;
  std::optional<DecodedMask> mask;  // the attention mask, decoded
  // Why the mask could not be decoded (its shape), or OK. Not an error of the
  // request yet: no_mask and causal modules ignore any mask, and a module
  // whose type reads it returns this instead (layers::LayerInputs).
  absl::Status mask_error;
  Shape y_shape;                   // what the layer will output
  DType y_dtype = DType::kF32;     // and in which dtype (Layer::OutputDType)
  // y is a float32 scalar: a loss, whose backward a step seeds with dloss
  // when the micro-batch brings no dy (jax.value_and_grad's contract).
  bool y_is_loss() const { return y_shape.empty() && y_dtype == DType::kF32; }
};

// Encodes response tensors inline while they fit in one message, resident
// beyond (session.h, contract 4).
class Session::OutputEncoder {
 public:
  explicit OutputEncoder(Session* session);
  // `snapshot`: a resident result must be a copy, because `tensor` is state
  // that later calls change in place (variables). `resident`: always resident.
  absl::Status Encode(const Tensor& tensor, bool resident, bool snapshot, te::v1::Tensor* out);

 private:
  Session* session_;
  int64_t budget_;  // bytes still free in the response
};

// Lets the layers see the call's deadline and cancellation (Ops'
// CheckInterrupt) for as long as the call runs.
class InterruptScope {
 public:
  InterruptScope(Ops& ops, const CallContext& call, std::string what) : ops_(ops) {
    ops_.set_interrupt_check(
        [&call, what = std::move(what)] { return call.StillWanted(what); });
  }
  ~InterruptScope() { ops_.set_interrupt_check(nullptr); }
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;

 private:
  Ops& ops_;
};

// Layers take float inputs: f32, bf16 or f16 (FP8 only inside, under autocast).
inline bool IsLayerInputDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16;
}

// x's dtype for a layer: int32 token ids for one whose x feeds an Embed
// (Layer::TakesTokenIds), a float dtype for every other.
inline bool FitsLayerInput(bool takes_ids, DType dtype) {
  return takes_ids ? dtype == DType::kI32 : IsLayerInputDType(dtype);
}
inline const char* LayerInputWant(bool takes_ids) {
  return takes_ids ? "x must be int32 token ids (the layer's x feeds an Embed)"
                   : "x must be float32, bfloat16 or float16";
}

// The x an InitLayer or AddGraph request declares for `layer`, checked:
// INVALID_ARGUMENT naming input_dtype or input_shape.
struct DeclaredInput {
  DType dtype;
  Shape shape;
  // The extra inputs declared beside x (CheckDeclaredExtras; none: each
  // has x's dtype).
  std::optional<layers::DeclaredExtras> extras;
};
absl::StatusOr<DeclaredInput> CheckDeclaredInput(const layers::Layer& layer, te::v1::DType dtype,
                                                 const google::protobuf::RepeatedField<int64_t>& shape,
                                                 int64_t max_tensor_bytes);

// The extra inputs an InitLayer or AddGraph request declares beside its x of
// `x` (nullopt when none), checked: INVALID_ARGUMENT naming
// "extra_inputs[i]" for an unknown dtype or a bad shape.
absl::StatusOr<std::optional<layers::DeclaredExtras>> CheckDeclaredExtras(
    const google::protobuf::RepeatedPtrField<te::v1::TensorHeader>& extras, const Shape& x,
    int64_t max_tensor_bytes);

// x and the extra inputs an InitLayer or AddGraph `request` declares for
// `layer`: CheckDeclaredInput, then CheckDeclaredExtras.
template <typename Request>
absl::StatusOr<DeclaredInput> CheckDeclared(const layers::Layer& layer, const Request& request,
                                            int64_t max_tensor_bytes) {
  absl::StatusOr<DeclaredInput> declared = CheckDeclaredInput(
      layer, request.input_dtype(), request.input_shape(), max_tensor_bytes);
  if (!declared.ok()) return declared;
  absl::StatusOr<std::optional<layers::DeclaredExtras>> extras =
      CheckDeclaredExtras(request.extra_inputs(), declared->shape, max_tensor_bytes);
  if (!extras.ok()) return extras.status();
  declared->extras = *std::move(extras);
  return declared;
}

// The layer name "params/a/b" split as Flax does: collection "params", path "a/b".
void SplitVariableName(const std::string& name, std::string* collection, std::string* path);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_SESSION_INTERNAL_H_
