// StepTransaction: one call's run of a layer (Forward, a decode step,
// Backward, ForwardBackward, Generate, Benchmark) and the one way it changes
// the session (session.h, contract 2).
//
// Contract:
//  1. Open reads a layer's variables (a retained version, or what a kept
//     forward ran on) into the call's working copy: tensors shared, the
//     fp8_metas copied under DelayedScaling (the only state a step writes in
//     place). It installs the call's deadline and cancellation as the Ops'
//     interrupt check for the transaction's life, so every op of the layer
//     sees them (Ops::CheckInterrupt).
//  2. The layer runs through the transaction (Forward, Backward, Step) with
//     its options: the call's recipe with the FP8 weight copies the
//     transaction uses (the layer's, or, for a Benchmark, its own), the
//     device constants likewise (ForwardOptions::constants), tf32,
//     dropout.
//  3. EndStep is TE's end of a step under DelayedScaling (UpdateFp8Metas
//     over the working copy, which then differs from what was read): the
//     only place a session call moves the FP8 state.
//  4. Commit is the call's single change to the session, made only while the
//     call is still wanted (CallContext::StillWanted): the FP8 weight copies
//     and the compute-dtype casts of weights (LayerEntry::casts) the call
//     made are kept when it read the layer's newest version, the device
//     constants it made whatever version it read (they depend on none), and
//     the working copy becomes the layer's next version when the call
//     changed it (EndStep, Changed), recorded for the call's undo (contract
//     6); CommitKept keeps it with a forward for its Backward instead. A
//     transaction destroyed without a commit leaves the session as it was:
//     its working copy goes, and the weight copies and device constants it
//     made too.
#ifndef TE_SERVER_SESSION_STEP_TRANSACTION_H_
#define TE_SERVER_SESSION_STEP_TRANSACTION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/layers/fp8_weight_cache.h"
#include "server/layers/layer.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace te::session {

class Session::StepTransaction {
 public:
  // Whose FP8 weight copies and device constants the layer reads and makes
  // (contract 2).
  enum class WeightCopies {
    kLayers,  // the layer's kept copies: a call that may commit
    kOwn,     // copies of the transaction's own, gone with it (Benchmark)
  };
  // What the call reads: graph `graph` of `layer` over `read`, the
  // variables of version `version` (or of a kept forward of it).
  struct Read {
    LayerEntry* layer = nullptr;
    const layers::Layer* graph = nullptr;
    int64_t version = 0;
    const VariableSet* read = nullptr;
  };

  // Contract 1. `what` names the call in StillWanted's errors ("Forward").
  static absl::StatusOr<std::unique_ptr<StepTransaction>> Open(
      Session& session, const Read& read, std::optional<layers::Fp8Recipe> fp8,
      const CallContext& call, std::string what, WeightCopies copies = WeightCopies::kLayers);
  static Read ReadOf(const Target& target) {
    return {target.entry, target.layer, target.version, target.read};
  }
  ~StepTransaction();
  StepTransaction(const StepTransaction&) = delete;
  StepTransaction& operator=(const StepTransaction&) = delete;

  // The working copy: "params/...", "fp8_metas/...", and the grads and
  // opt_state the new version will hold.
  layers::Variables& vars() { return next_.vars; }
  VariableSet& next() { return next_; }
  // The layer's options; the caller sets the request's (deterministic,
  // dropout_seed, tf32, keep_for_backward, decode). fp8 is set (contract 2).
  layers::ForwardOptions& options() { return options_; }
  const layers::Fp8Recipe* fp8() const { return options_.fp8; }
  bool delayed_scaling() const { return layers::HasFp8Metas(options_.fp8); }

  // The layer, on the working copy (contract 2).
  absl::Status Forward(const layers::LayerInputs& inputs, layers::LayerOutputs* out,
                       std::unique_ptr<layers::SavedForward>* saved);
  absl::Status Backward(const layers::SavedForward& saved, const Tensor& dy,
                        layers::LayerGrads* grads);
  // One forward + loss + backward + EndStep (a micro-batch). The loss is
  // vdot(y, dy), or with `target` loss_scale * sum((y - target)^2), whose
  // gradient is then the dy the backward takes. `pending_value`: where
  // given, the value is left there on the device, unscaled and unread, and
  // *value is not set (ReadStepResult reads it). `aux`: where
  // given, the graph's outputs after y.
  absl::Status Step(const layers::LayerInputs& inputs, const Tensor& dy, double* value,
                    layers::LayerGrads* grads, const Tensor* target = nullptr,
                    double loss_scale = 1.0, Tensor* pending_value = nullptr,
                    std::vector<Tensor>* aux = nullptr);

  // A step's read-back, in one copy: [0] the value (returned, unscaled) and,
  // where it has a [1], the number of the step's FP8 scaling updates whose
  // amax was inf or NaN, added to Fp8NonFiniteAmaxes().
  absl::StatusOr<double> ReadStepResult(const Tensor& readback);
  // What ReadStepResult does with a read-back already on the host: `host`
  // holds readback_size floats.
  static double TakeStepResult(const float* host, int64_t readback_size);

  // Contract 3. `non_finite`: where given, a [1] float32 the count of inf or
  // NaN amaxes is added into.
  absl::Status EndStep(Tensor* non_finite = nullptr);
  // The call changed the working copy besides EndStep (gradients kept, an
  // update, a decode step's cache): Commit makes a version of it.
  void Changed() { changed_ = true; }

  // Contract 4: the version the call answers, the new one or the one read.
  // `unwanted_too`: commit even if the client has gone (a donating step's
  // update already wrote the version it read; contract 4's check would
  // leave neither).
  absl::StatusOr<int64_t> Commit(bool unwanted_too = false);
  // Contract 4 for a forward kept for its Backward: `saved` gets the
  // working copy (its step ends at the Backward) and is kept under the id
  // returned.
  absl::StatusOr<std::string> CommitKept(std::unique_ptr<SavedEntry> saved);

 private:
  StepTransaction(Session& session, const Read& read, std::optional<layers::Fp8Recipe> fp8,
                  const CallContext& call, std::string what, WeightCopies copies);
  // StillWanted (unless `unwanted_too`), then the FP8 weight copies kept
  // (contract 4).
  absl::Status Seal(bool unwanted_too = false);
  // At a forward's start: the kept FP8 weight copies it will read, checked in
  // one launch (Fp8WeightCache::CheckBeforeForward); EndStep forgets them.
  absl::Status CheckKeptCopies();
  // The FP8 recipe's weight cache; null without FP8.
  layers::Fp8WeightCache* WeightCache() const;
  // sum(y * dy) into out, a [1, 1] float32 tensor on the device.
  absl::Status VdotOnDevice(const Tensor& y, const Tensor& dy, Tensor* out);

  Session& session_;
  const Read read_;
  const CallContext& call_;
  const std::string what_;
  InterruptScope interrupt_;
  std::optional<layers::Fp8Recipe> fp8_;
  layers::Fp8WeightCache own_copies_;
  layers::Fp8WeightCache::Call kept_copies_;
  // The layer's kept casts (LayerEntry::casts) as the Ops' cast memo while
  // the transaction lives; the casts it keeps stay only if it commits having
  // read the newest version, as the FP8 copies do (contract 4). Null (a
  // Benchmark's own run): the Ops' memo is left alone.
  CastMemoScope kept_casts_;
  layers::DeviceConstants own_constants_;
  layers::DeviceConstants::Call kept_constants_;
  VariableSet next_;
  layers::ForwardOptions options_;
  bool changed_ = false;
  bool committed_ = false;
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_STEP_TRANSACTION_H_
