// Session: one client's layers, variables, FP8 state, saved forwards and
// resident tensors on one device stream. The proto-aware layer between the
// gRPC handlers and the layers; knows nothing of gRPC.
//
// Contract:
//  1. Not thread-safe: its device's executor runs the session's calls one at
//     a time (service/executor.h), each holding the session's Lease, so no two
//     methods ever run concurrently.
//  2. A call that fails leaves the session as it was, whatever the code:
//     every method validates its whole request before it changes anything,
//     and the calls that run a layer (Forward, Backward, ForwardBackward,
//     Generate, Benchmark) run it in a StepTransaction (step_transaction.h)
//     on a working copy of the version they read, making the new version
//     (contract 9) or the saved forward in its one commit, once all their
//     work has succeeded and the client still waits for the answer
//     (CallContext): a call that runs out of memory part way
//     (RESOURCE_EXHAUSTED), is cancelled or expires moves nothing. Errors
//     from the layers and ops keep their codes.
//  3. All the session's device memory (every retained version's variables,
//     saved forwards, resident tensors, and what a layer keeps across calls:
//     its FP8 weight copies and device constants) is accounted on its Ops
//     and freed with the Session. A tensor that versions share is counted once; a
//     layer's graphs hold no device memory.
//  4. Response tensors come inline while they fit in one message
//     (max_message_bytes); one that does not comes back resident
//     (Tensor.resident_id: fetch it with GetTensor, free it with DeleteTensor).
//     Resident copies of variables are snapshots.
//  5. FP8 delayed scaling: a step ends (UpdateFp8Metas) after a Backward, after
//     each micro-batch of ForwardBackward, and after a Forward that keeps
//     nothing for a backward. Benchmark runs on a copy of the FP8 state,
//     with FP8 weight copies of its own, and leaves the session's unchanged.
//  6. Undo. Between BeginCall and EndCall the session records what the call
//     creates: layers, versions, graphs, kept forwards, resident tensors,
//     regions, and how far it grew the device's library workspace.
//     EndCall(undo) removes exactly those (a new version included,
//     so the layer's newest is again the one the call read), for a call
//     that failed or whose client went away before it saw the answer: such
//     a call leaves no memory held. What a call freed (ReleaseVersions,
//     DeleteLayer, DeleteTensor, a Backward's kept forward) stays freed.
//     Ids (layers, forwards, tensors, regions) are "<kind>-<n>", numbered in
//     one sequence and never reused, an undone call's included.
//  7. Shared-memory regions (--enable_shm) are the client's memory, mapped;
//     request tensors in them are copied in, never aliased, so the client may
//     reuse a region as soon as a call returns. Regions are unmapped on
//     UnregisterSharedMemory or with the session.
//  8. Training: SetOptimizer gives a layer an optimizer and a fresh state
//     (collection opt_state, counted in the session's memory) in every
//     retained version, as tx.init would for each. A ForwardBackward with
//     apply_update steps it after its micro-batches, on the device, as the
//     last thing the call does: the new version's params and opt_state are
//     updated in place, after every retained version that shared one of
//     them was given a copy (contract 9). A step whose gradients hold an inf
//     or NaN changes no parameter or moment and is counted
//     (opt_state/total_notfinite).
//  9. Versions. A layer's variables (params, fp8_metas, grads, opt_state)
//     come in numbered versions. InitLayer makes version 1; each later
//     number is the layer's highest so far plus one, never reused. A call
//     reads one retained version (`version`, 0: the newest retained) and,
//     when it changes variables, makes a new one from it and answers its
//     number: ForwardBackward (fp8_metas under DelayedScaling, kept grads,
//     apply_update), Backward (the same, from the version its Forward read),
//     SetVariables, Forward with update_fp8_metas under DelayedScaling. A
//     call that changes nothing answers the number it read. A version never
//     changes value: tensors are shared between versions until one is
//     written, and a write in place first gives every retained version that
//     holds the tensor a copy of it (the writer keeps the original, so kept
//     FP8 weight copies and optimizer plans stay valid for the newest).
//     Every version made is retained until ReleaseVersions names it, its
//     layer is deleted or the session closes; a call whose new version would
//     not fit the session's memory is RESOURCE_EXHAUSTED. The version read
//     may be released while a kept forward of it waits for its Backward:
//     the forward holds what it read. A released or never made version is
//     NOT_FOUND naming `version`. A ForwardBackward with `donate` releases
//     the version it read when it succeeds, and its update writes in place
//     without giving that version copies (it gives the others theirs); its
//     new version stays if the call is undone (contract 6), as the version
//     it replaced is gone.
// 10. Graphs. A layer runs one of its graphs (`graph`): 0 is what InitLayer
//     made; AddGraph appends one over the layer's variables (for another
//     batch size, or a loss function) and answers its index, or the index of
//     an equal graph the layer has. Indices are never reused while the layer
//     lives.
// 11. Decode (TE's apply(..., decode=True, mutable=["cache"])). InitLayer
//     with decode gives the layer its `cache` collection (Layer::CacheSpecs
//     for x's batch and length, zeros, in the session's memory); a layer
//     with no attention that decodes is INVALID_ARGUMENT naming decode. A
//     Forward with decode reads the cache of the version read and makes a
//     new version with the cache advanced by one token, so a failed or
//     cancelled step leaves every version as it was. The new version shares
//     the keys and values with the one read (the one read never reads the
//     row the step writes) and has its own cache_index; a step copies them
//     only when another retained version decodes from them further (a
//     branch). FAILED_PRECONDITION for a layer without a cache; the layers'
//     INVALID_ARGUMENT for more than one new token, a full cache (naming
//     cache_index) or keep_for_backward. The cache is a collection like
//     params for GetVariables, SetVariables and checkpoints; a version
//     holds the rows of its keys and values before its cache_index, and
//     reads the rows from it on as zeros (TE's, until a step writes them).
#ifndef TE_SERVER_SESSION_SESSION_H_
#define TE_SERVER_SESSION_SESSION_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "server/session/session_manager.h"
#include "server/session/shm_region.h"
#include "server/session/tensor_codec.h"
#include "server/session/tensor_upload.h"
#include "te/v1/service.pb.h"

namespace te::session {

struct LayerOptimizer;  // session_internal.h
struct VariableSet;     // session_internal.h
struct DecodeStep;      // session_internal.h

// Server-wide limits every session obeys (te_server's flags).
struct SessionConfig {
  int64_t session_memory_bytes = int64_t{8} << 30;
  int max_saved_forwards = 16;
  int max_micro_batches = 256;  // per ForwardBackward call
  int64_t max_message_bytes = int64_t{64} << 20;
  int64_t max_tensor_bytes = int64_t{1} << 30;
  bool enable_shm = false;      // --enable_shm
  int max_shm_regions = 16;     // per session
  // --replay_decode_steps: Generate replays its recorded one-token step
  // (layers::GenerateOptions::replay_steps).
  bool replay_decode_steps = true;
};

// What a call brings besides its request: the client's deadline and a way to
// see whether it gave up. Long work checks both between micro-batches and
// between layers, and once more before it commits (contract 2).
struct CallContext {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  // Where a call that ends well leaves the ids only its answer names (its
  // new resident tensors, saved forwards, layers, regions): if the answer
  // then never reaches the client (its deadline passes on the way), the
  // reactor has the session forget them (Session::ForgetUnanswered). May
  // be null: nobody asks.
  std::shared_ptr<std::vector<std::string>> answer_ids;
  // Where a call may leave the part of its answer that only waits for the
  // device (a training step's loss and update record): the reactor runs it
  // once the session's turn is released, so the session's next call issues
  // its work while this one waits, and a pipelined training loop never
  // drains the stream between steps. It must not touch the session. Null:
  // the call reads everything in its turn.
  std::function<absl::Status()>* after_turn = nullptr;

  // CANCELLED or DEADLINE_EXCEEDED (naming `what`) once nobody waits for the
  // call's answer; OK before.
  absl::Status StillWanted(const std::string& what) const;
};

// Process-wide and thread-safe: how many delayed-scaling updates of every
// session's steps took an amax that was inf or NaN, so kept their scale (as
// TE's update does). Counted from each ForwardBackward or Benchmark step's
// read-back of its value, which carries the count from the device; a Forward
// or Backward called apart reads nothing back that it could travel with, so
// their updates are not counted.
int64_t Fp8NonFiniteAmaxes();

// A graph remembers what its calls need of a version (the variables' names,
// shapes and dtypes) for this many input shapes and FP8 states; past them it
// starts again, so a client that sends every prompt length does not grow the
// session.
inline constexpr size_t kMaxRememberedSpecs = 64;

class Session {
 public:
  Session(std::string id, const DeviceInfo& device, std::unique_ptr<Ops> ops,
          const SessionConfig& config, te::v1::NegotiationPolicy policy,
          std::optional<te::v1::Recipe> negotiated);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  // The ids the current call (between BeginCall and EndCall) made that only
  // its answer names: resident tensors, saved forwards, layers, regions.
  std::vector<std::string> CallAnswerIds() const;
  // Drops those of `ids` the session still holds: a call whose answer never
  // reached its client made them, and no client can name them. Versions and
  // graphs are not among them: later calls build on those.
  void ForgetUnanswered(const std::vector<std::string>& ids);
  // The device the session runs on ("cpu", "cuda:1"). Thread-safe.
  const std::string& device_name() const { return device_.name; }
  // Device memory the session holds now. Thread-safe (may run during a call).
  int64_t bytes_in_use() const { return ops_->bytes_in_use(); }

  // Init(key, x): the layer's variables for an input of input_shape/dtype.
  // The call's deadline and cancellation end the init between chunks of its
  // variables (DEADLINE_EXCEEDED, CANCELLED), leaving the session as it was.
  absl::Status InitLayer(const te::v1::InitLayerRequest& request,
                         te::v1::InitLayerResponse* response,
                         const CallContext& call = CallContext());
  // Apply. NOT_FOUND for an unknown layer_id; RESOURCE_EXHAUSTED when
  // keep_for_backward would exceed max_saved_forwards.
  absl::Status Forward(const te::v1::ForwardRequest& request, te::v1::ForwardResponse* response,
                       const CallContext& call = CallContext());
  // Consumes forward_id when it succeeds (NOT_FOUND when unknown or already
  // used).
  absl::Status Backward(const te::v1::BackwardRequest& request,
                        te::v1::BackwardResponse* response,
                        const CallContext& call = CallContext());
  // INVALID_ARGUMENT beyond max_micro_batches; checks `call` between
  // micro-batches.
  absl::Status ForwardBackward(const te::v1::ForwardBackwardRequest& request,
                               te::v1::ForwardBackwardResponse* response,
                               const CallContext& call = CallContext());

  // tx.init(params) (contract 8): INVALID_ARGUMENT naming the field for a
  // bad optimizer; RESOURCE_EXHAUSTED when its state does not fit the
  // session's memory. The layer's previous optimizer state, if any, goes.
  absl::Status SetOptimizer(const te::v1::SetOptimizerRequest& request,
                            te::v1::SetOptimizerResponse* response);

  // NOT_FOUND for an unknown layer or version.
  absl::Status GetVariables(const te::v1::GetVariablesRequest& request,
                            te::v1::GetVariablesResponse* response);
  // All or nothing: every variable must exist with the same shape and dtype
  // in the version read; the new version (contract 9) is `version` with
  // them replaced.
  absl::Status SetVariables(const te::v1::SetVariablesRequest& request,
                            te::v1::SetVariablesResponse* response);

  // Contract 10. INVALID_ARGUMENT naming the node ("graph.nodes[i] (name)")
  // whose module is not the layer's (another name or LayerSpec), whose Param
  // is not the layer's param of that shape and dtype, or whose shapes do not
  // fit input_shape; the graph's own errors as at InitLayer.
  absl::Status AddGraph(const te::v1::AddGraphRequest& request,
                        te::v1::AddGraphResponse* response,
                        const CallContext& call = CallContext());
  // Frees the versions named (contract 9); unknown or released ones are
  // ignored. NOT_FOUND for an unknown layer.
  absl::Status ReleaseVersions(const te::v1::ReleaseVersionsRequest& request);
  // Frees the layer: every version, graph, optimizer, kept FP8 copy and saved
  // forward of it. NOT_FOUND for an unknown layer.
  absl::Status DeleteLayer(const te::v1::DeleteLayerRequest& request);

  // PutTensor, for a stream whose pieces arrive over time. BeginPut
  // validates the header and allocates the tensor (RESOURCE_EXHAUSTED over
  // the memory limit); with header.shm it copies the bytes from the region at
  // once (no data messages may follow). The upload's Append writes arriving
  // bytes in place; CommitPut checks the count and makes the tensor resident.
  // Dropping an unfinished upload frees its memory. All in the session's turn.
  absl::StatusOr<std::unique_ptr<TensorUpload>> BeginPut(const te::v1::PutTensorHeader& header);
  absl::Status CommitPut(std::unique_ptr<TensorUpload> upload,
                         te::v1::PutTensorResponse* response);
  // A resident tensor's bytes on the host, to stream out after the turn. On
  // the CPU `data` points into the tensor itself (no copy), kept alive by
  // `keepalive` (resident tensors are never written in place); elsewhere into
  // a host copy. With request.destination the bytes go into that region
  // instead and `bytes` is 0.
  struct TensorSource {
    te::v1::TensorHeader header;
    std::shared_ptr<const void> keepalive;
    const char* data = nullptr;
    int64_t bytes = 0;
    int64_t chunk_bytes = 0;
  };
  absl::StatusOr<TensorSource> ReadTensor(const te::v1::GetTensorRequest& request);
  absl::Status DeleteTensor(const te::v1::DeleteTensorRequest& request);

  // Maps the client's shm object (contract 7). FAILED_PRECONDITION when the
  // server runs without --enable_shm; RESOURCE_EXHAUSTED past
  // max_shm_regions; ShmRegion::Open's errors otherwise.
  absl::Status RegisterSharedMemory(const te::v1::RegisterSharedMemoryRequest& request,
                                    te::v1::RegisterSharedMemoryResponse* response);
  // NOT_FOUND for a region this session does not have.
  absl::Status UnregisterSharedMemory(const te::v1::UnregisterSharedMemoryRequest& request);

  void GetSessionInfo(te::v1::SessionInfo* response) const;

  // Contract 6: the record of the call about to run opens, and closes,
  // undoing what the call created when `undo`. One call at a time
  // (contract 1); outside a call nothing is recorded.
  void BeginCall();
  void EndCall(bool undo);

  absl::Status Benchmark(const te::v1::BenchmarkRequest& request, const CallContext& call,
                         te::v1::BenchmarkResponse* response);

  // Generation (server/layers/generate.h) with graph `graph` of a layer over
  // its version `version`, which stays as it was: the steps' amaxes go into
  // a copy of its fp8_metas, and the caches are the call's own. `sink` gets
  // one GenerateResponse per step as its tokens are made, in the session's
  // turn; a non-OK status from it ends the call with that status. The call's
  // deadline and cancellation are checked between tokens (DEADLINE_EXCEEDED,
  // CANCELLED after the steps already sunk). INVALID_ARGUMENT naming the
  // field: a prompt that is not int32 [batch, length], max_new_tokens < 1 or
  // making sequences the model does not take, sampling out of range, a
  // layer that takes no token ids or cannot decode (naming the module);
  // FAILED_PRECONDITION for a delayed-scaling autocast on a layer initialised
  // without it; RESOURCE_EXHAUSTED when the caches do not fit the session's
  // memory.
  using GenerateSink = std::function<absl::Status(const te::v1::GenerateResponse& step)>;
  absl::Status Generate(const te::v1::GenerateRequest& request, const GenerateSink& sink,
                        const CallContext& call = CallContext());

 private:
  struct LayerEntry;
  struct SavedEntry;
  struct Target;
  struct CheckedInputs;
  class OutputEncoder;
  class StepTransaction;  // step_transaction.h

  absl::StatusOr<LayerEntry*> FindLayer(const std::string& layer_id);
  // The layer's graph `graph` over its version `version` (0: the newest
  // retained): INVALID_ARGUMENT naming "graph" for an index it does not have,
  // NOT_FOUND naming "version" for one it does not retain.
  absl::StatusOr<Target> Resolve(const std::string& layer_id, int64_t graph, int64_t version);
  // Retains `set` as the layer's next version (contract 9) and returns its number.
  int64_t MakeVersion(LayerEntry& layer, VariableSet set);
  // Before `set` (a version being made) writes `writes` (tensors of it) in
  // place: every retained version and kept forward of `layer` that holds one
  // of them gets a copy instead (RESOURCE_EXHAUSTED when the copies do not
  // fit; then nothing changed).
  // `donated`: a version number (0: none) the writer releases once it is
  // done, which gets no copies.
  absl::Status DetachFromVersions(LayerEntry& layer, const std::vector<const Tensor*>& writes,
                                  int64_t donated = 0);
  // A decode step's caches (contract 11) in `vars`, the working copy of
  // target's version: each gets its own cache_index, and its keys and values
  // where another holder decodes from them further. FAILED_PRECONDITION
  // without a cache; RESOURCE_EXHAUSTED when the copies do not fit.
  absl::StatusOr<DecodeStep> PrepareDecode(const Target& target, layers::Variables* vars);
  // Variable `name` (`tensor`) of `vars` as its version holds it: a cache's
  // keys and values with the rows from its cache_index on as zeros (a new
  // tensor; contract 11), any other variable as it is.
  absl::StatusOr<Tensor> AsDecoded(const layers::Variables& vars, const std::string& name,
                                   const Tensor& tensor);
  // Before a layer is initialised: its variables' bytes, overflow-checked
  // (INVALID_ARGUMENT "spec"), fit the memory the session has left
  // (RESOURCE_EXHAUSTED otherwise), so nothing is allocated for a layer that
  // cannot fit.
  absl::Status CheckFitsMemory(const std::vector<layers::VariableSpec>& specs) const;
  // The FP8 recipe a request's autocast asks for (nullopt: FP8 off).
  absl::StatusOr<std::optional<layers::Fp8Recipe>> ResolveAutocast(
      const te::v1::Autocast& autocast, const std::string& field) const;
  // Validates a request's layer inputs (x, extra inputs, mask) against the
  // target's graph and version, without touching the session. `prefix` is ""
  // or "micro_batches[1].".
  absl::StatusOr<CheckedInputs> CheckInputs(const Target& target,
                                            const layers::Fp8Recipe* fp8,
                                            const te::v1::Tensor& x,
                                            const google::protobuf::RepeatedPtrField<
                                                te::v1::Tensor>& extra_inputs,
                                            const te::v1::Tensor* attention_mask,
                                            const std::string& prefix);
  // Checks dy against the output the inputs produce.
  absl::StatusOr<CheckedTensor> CheckDy(const CheckedInputs& inputs, const te::v1::Tensor& dy,
                                        const std::string& field);
  absl::StatusOr<layers::LayerInputs> MaterializeInputs(const CheckedInputs& inputs);
  // Applies the optimizer step to `next`, the version being made, in place
  // (contract 8), and says what it did: the update is decided and done on
  // the device (optim, contract 3), and its record read back once it is
  // done. `fp8`: the step's recipe (null: FP8 off); under DelayedScaling the
  // update rewrites the layer's kept FP8 weight copies, else they go.
  // `donated` (0: none): the version the call read and donates
  // (ForwardBackwardRequest.donate), written in place with no copy of its
  // own; `*donated_written` becomes true once the update may have written
  // it, so a failure from then on must release it. `info_later`: where
  // given, the record is not read here but copied into `info_later->first`
  // behind the step, there once `info_later->second` is done (the caller
  // answers with UpdateInfoOf); `info` is then left as it is.
  absl::Status ApplyUpdate(LayerEntry& layer, const layers::Fp8Recipe* fp8,
                           const layers::Variables& grads, VariableSet* next,
                           te::v1::UpdateInfo* info, int64_t donated = 0,
                           bool* donated_written = nullptr,
                           std::pair<OptimizerStepInfo*, Ops::Completion*> info_later = {});
  // Adds param gradients ("params/p") into `sum` under `collection/p`.
  absl::Status AccumulateGrads(const layers::Variables& param_grads,
                               const std::string& collection, layers::Variables* sum);
  // A step's kept gradients: `kept` (the version's "grads/...") plus the
  // call's `sums`, added into the sums (the call's own tensors), so the
  // version read keeps its own.
  absl::StatusOr<layers::Variables> KeptGrads(const layers::Variables& kept,
                                              layers::Variables sums);
  // What a call created (contract 6).
  struct Created {
    enum class Kind { kLayer, kVersion, kGraph, kForward, kTensor, kRegion };
    Kind kind;
    std::string id;      // the id made; for kVersion and kGraph, their layer's
    int64_t number = 0;  // kVersion: the version's number; kGraph: the graph's index
  };
  // A new id of `kind` (not kVersion or kGraph), recorded as created.
  std::string NewId(Created::Kind kind);
  void Record(Created created);
  void Undo(const Created& created);
  // Version `number` of `layer_id`, made by the open call, stays if the
  // call is undone: it replaced a donated version, which is gone.
  void KeepOnUndo(const std::string& layer_id, int64_t number);
  ResidentLookup Resident() const;
  ShmLookup Regions() const;  // empty without --enable_shm

  // Saves and restores sessions (checkpoint.cc).
  friend class SessionCheckpoint;

  const std::string id_;
  const DeviceInfo device_;
  std::unique_ptr<Ops> ops_;
  const SessionConfig config_;
  const te::v1::NegotiationPolicy policy_;
  const std::optional<te::v1::Recipe> negotiated_;

  int64_t next_id_ = 1;
  std::optional<std::vector<Created>> call_;  // the open call's record (contract 6)
  int64_t call_scratch_bytes_ = 0;            // ops_->scratch_bytes() when it opened
  std::map<std::string, std::unique_ptr<LayerEntry>> layers_;
  std::map<std::string, std::unique_ptr<SavedEntry>> saved_;
  std::map<std::string, Tensor> resident_;
  std::map<std::string, std::unique_ptr<ShmRegion>> regions_;
};

// CreateSession: negotiates a recipe for `device`, makes the session a stream
// with `config.session_memory_bytes`, and registers it with `manager`.
// INVALID_ARGUMENT for a device this server does not serve or a bad recipe
// (naming "preferred_recipes[i]..."); FAILED_PRECONDITION under STRICT (see
// negotiation.h); RESOURCE_EXHAUSTED at max sessions.
absl::Status OpenSession(const te::v1::CreateSessionRequest& request, Device* device,
                         const SessionConfig& config, SessionManager* manager,
                         te::v1::CreateSessionResponse* response);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_SESSION_H_
