// Session steps: Forward, Backward and ForwardBackward, and the input
// validation they share with Benchmark (session_benchmark.cc).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/fp8_state.h"
#include "server/layers/init.h"
#include "server/layers/variables.h"
#include "server/optim/optimizer.h"
#include "server/session/log.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"
#include "server/session/step_transaction.h"

namespace te::session {
namespace {

// Prefixes a layer's message with the request field it is about.
absl::Status AboutField(const absl::Status& status, const std::string& field) {
  return absl::Status(status.code(), absl::StrCat(field, ": ", status.message()));
}

// A gradient must match what it is the gradient of: "<field>.shape" or
// "<field>.dtype" otherwise.
absl::Status CheckLike(const CheckedTensor& t, const Shape& shape, DType dtype,
                       const std::string& field, const std::string& of) {
  if (t.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: ", ShapeString(t.shape),
                                                   ", but ", of, " is ", ShapeString(shape)));
  }
  if (t.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", DTypeName(t.dtype),
                                                   ", but ", of, " is ", DTypeName(dtype)));
  }
  return absl::OkStatus();
}

const layers::Fp8Recipe* PtrOf(const std::optional<layers::Fp8Recipe>& fp8) {
  return fp8 ? &*fp8 : nullptr;
}

}  // namespace

absl::StatusOr<Session::CheckedInputs> Session::CheckInputs(
    const Target& target, const layers::Fp8Recipe* fp8, const te::v1::Tensor& x,
    const google::protobuf::RepeatedPtrField<te::v1::Tensor>& extra_inputs,
    const te::v1::Tensor* attention_mask, const std::string& prefix) {
  const layers::Layer& layer = *target.layer;
  CheckedInputs in;
  ASSIGN_OR_RETURN(in.x,
                   CheckTensor(x, prefix + "x", config_.max_tensor_bytes, Resident(), Regions()));
  if (!FitsLayerInput(layer.TakesTokenIds(), in.x.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "x.dtype: ", DTypeName(in.x.dtype), "; ",
                                                   LayerInputWant(layer.TakesTokenIds())));
  }
  // x fits the initialised layer iff the variables it needs are those it has
  // (and, under DelayedScaling, the fp8_metas exist: else FAILED_PRECONDITION).
  // A graph traced for another batch size may not fit: AddGraph one for it.
  const std::string x_field =
      absl::StrCat(prefix, "x.shape ", ShapeString(in.x.shape),
                   target.graph > 0 ? absl::StrCat(" (graph ", target.graph, ")") : "");
  auto& known = target.entry->graphs[target.graph].specs;
  const auto key = std::make_pair(in.x.shape, layers::Fp8StateKey(fp8));
  auto specs = known.find(key);
  if (specs == known.end()) {
    absl::StatusOr<std::vector<layers::VariableSpec>> made = layer.VariableSpecs(in.x.shape, fp8);
    if (!made.ok()) return AboutField(made.status(), x_field);
    // A client that sends ever new shapes (prompts of every length) must not
    // grow the session without bound: past the bound the memo starts again.
    if (known.size() >= kMaxRememberedSpecs) known.clear();
    specs = known.emplace(key, *std::move(made)).first;
  }
  absl::Status fits = layers::CheckVariables(target.read->vars, specs->second);
  if (absl::IsInvalidArgument(fits)) return AboutField(fits, x_field);
  if (absl::IsFailedPrecondition(fits)) {
    return absl::FailedPreconditionError(absl::StrCat(
        target.entry->id, " (", layer.type_name(), "): ", fits.message(),
        " (TE: ScopeCollectionNotFound)"));
  }
  RETURN_IF_ERROR(fits);
  absl::StatusOr<Shape> y_shape = layer.OutputShape(in.x.shape);
  if (!y_shape.ok()) return AboutField(y_shape.status(), x_field);
  in.y_shape = *y_shape;
  in.y_dtype = layer.OutputDType(in.x.dtype);

  // Extra inputs have the dtypes and shapes the graph declared, else x's dtype.
  const std::optional<layers::DeclaredExtras>& declared = target.entry->graphs[target.graph].extras;
  for (int i = 0; i < extra_inputs.size(); ++i) {
    const std::string field = absl::StrCat(prefix, "extra_inputs[", i, "]");
    ASSIGN_OR_RETURN(
        CheckedTensor extra,
        CheckTensor(extra_inputs[i], field, config_.max_tensor_bytes, Resident(), Regions()));
    if (declared && i < static_cast<int>(declared->dtypes.size())) {
      RETURN_IF_ERROR(layers::CheckDeclaredExtra(*declared, static_cast<size_t>(i), extra.dtype,
                                                 extra.shape, in.x.shape, field));
    } else if (extra.dtype != in.x.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", DTypeName(extra.dtype),
                                                     ", but x is ", DTypeName(in.x.dtype)));
    }
    in.extra.push_back(std::move(extra));
  }

  if (attention_mask != nullptr) {
    const std::string field = prefix + "attention_mask";
    ASSIGN_OR_RETURN(
        CheckedTensor mask,
        CheckTensor(*attention_mask, field, config_.max_tensor_bytes, Resident(), Regions()));
    // Broadcast against [B, heads, Sq, Skv]: B and Sq from x, Skv from k when
    // k is given. A mask that does not fit is refused only by a module whose
    // mask type reads it: TE ignores any mask under no_mask and causal.
    const Shape& xs = in.x.shape;
    const Shape& kv = in.extra.empty() ? xs : in.extra[0].shape;
    if (xs.size() < 2 || kv.size() < 2) {
      in.mask_error = absl::InvalidArgumentError(
          absl::StrCat(field, ": x ", ShapeString(xs), " has no [batch, seq, ...] to mask"));
    } else {
      ASSIGN_OR_RETURN(std::string bytes, HostBytes(*ops_, mask));
      absl::StatusOr<DecodedMask> decoded =
          DecodeAttentionMask(bytes, mask.dtype, mask.shape, xs[0], xs[1], kv[1], field);
      if (decoded.ok()) {
        in.mask = *std::move(decoded);
      } else {
        in.mask_error = decoded.status();
      }
    }
  }
  return in;
}

absl::StatusOr<CheckedTensor> Session::CheckDy(const CheckedInputs& inputs,
                                               const te::v1::Tensor& dy,
                                               const std::string& field) {
  ASSIGN_OR_RETURN(CheckedTensor checked,
                   CheckTensor(dy, field, config_.max_tensor_bytes, Resident(), Regions()));
  RETURN_IF_ERROR(CheckLike(checked, inputs.y_shape, inputs.y_dtype, field, "y"));
  return checked;
}

absl::StatusOr<layers::LayerInputs> Session::MaterializeInputs(const CheckedInputs& inputs) {
  layers::LayerInputs in;
  ASSIGN_OR_RETURN(in.x, Materialize(*ops_, inputs.x));
  for (const CheckedTensor& extra : inputs.extra) {
    ASSIGN_OR_RETURN(Tensor t, Materialize(*ops_, extra));
    in.extra.push_back(std::move(t));
  }
  in.mask_error = inputs.mask_error;
  if (inputs.mask) {
    ASSIGN_OR_RETURN(MaskTensors mask, UploadMask(*ops_, *inputs.mask));
    in.q_seqlens = std::move(mask.q_seqlens);
    in.kv_seqlens = std::move(mask.kv_seqlens);
    in.seqlens_with_causal = mask.with_causal;
    in.elementwise_mask = std::move(mask.elementwise);
    in.mask_heads = mask.given_heads;
  }
  return in;
}

absl::StatusOr<layers::Variables> Session::KeptGrads(const layers::Variables& kept,
                                                     layers::Variables sums) {
  for (const auto& [name, grad] : kept) {
    auto it = sums.find(name);
    if (it == sums.end()) {
      sums[name] = grad;  // shared: this call does not write it
    } else {
      RETURN_IF_ERROR(ops_->Axpby(1.0f, it->second, 1.0f, grad, &it->second));
    }
  }
  return sums;
}

absl::Status Session::AccumulateGrads(const layers::Variables& param_grads,
                                      const std::string& collection, layers::Variables* sum) {
  for (const auto& [name, grad] : param_grads) {
    const std::string key = collection + name.substr(name.find('/'));
    auto it = sum->find(key);
    if (it == sum->end()) {
      (*sum)[key] = grad;
    } else {
      RETURN_IF_ERROR(ops_->Axpby(1.0f, it->second, 1.0f, grad, &it->second));
    }
  }
  return absl::OkStatus();
}

namespace {

// An optimizer step's record in the answer, and a log line when it skipped.
void SetUpdateInfo(const OptimizerStepInfo& step, const std::string& session_id,
                   const std::string& layer_id, te::v1::UpdateInfo* info) {
  info->set_applied(step.applied != 0);
  info->set_count(step.count);
  info->set_total_notfinite(step.total_notfinite);
  info->set_learning_rate(step.learning_rate);
  info->set_grad_norm(std::sqrt(static_cast<double>(step.grad_norm_sq)));
  if (step.applied == 0) {
    LogForSession(LogLevel::kInfo, session_id,
                  absl::StrCat(layer_id, ": update skipped, gradient norm ", step.grad_norm_sq,
                               " is not finite (", step.total_notfinite, " skipped so far)"));
  }
}

// What a training step's answer reads back from the device when it waits
// outside the session's turn (CallContext::after_turn): the update's record
// and each micro-batch's read-back (value, and the FP8 non-finite count),
// copied behind the step into page-locked memory.
struct StepAnswerLater {
  std::shared_ptr<void> staging;  // OptimizerStepInfo, then 2 floats a micro-batch
  std::unique_ptr<Ops::Completion> done;
  std::vector<int64_t> readback_sizes;
  std::vector<double> scales;

  static absl::StatusOr<std::shared_ptr<StepAnswerLater>> Start(
      Ops& ops, const std::vector<std::pair<Tensor, double>>& values) {
    auto later = std::make_shared<StepAnswerLater>();
    ASSIGN_OR_RETURN(later->staging, ops.AllocateStaging(sizeof(OptimizerStepInfo) +
                                                         2 * sizeof(float) * values.size()));
    ASSIGN_OR_RETURN(later->done, ops.NewCompletion());
    for (const auto& [readback, scale] : values) {
      later->readback_sizes.push_back(readback.numel());
      later->scales.push_back(scale);
    }
    return later;
  }
  // A call that fails after its copies were queued drops this: the staging
  // memory goes back to its pool only once they have landed.
  ~StepAnswerLater() {
    if (done != nullptr) done->Wait().IgnoreError();
  }

  OptimizerStepInfo* info() const { return static_cast<OptimizerStepInfo*>(staging.get()); }
  // The micro-batches' values into response, once done->Wait() is OK;
  // `take` is StepTransaction::TakeStepResult.
  void SetValues(double (*take)(const float*, int64_t),
                 te::v1::ForwardBackwardResponse* response) const {
    for (size_t i = 0; i < scales.size(); ++i) {
      const double v = take(value(i), readback_sizes[i]);
      response->set_values(static_cast<int>(i), v * scales[i]);
    }
  }
  float* value(size_t i) const {
    return reinterpret_cast<float*>(static_cast<char*>(staging.get()) + sizeof(OptimizerStepInfo)) +
           2 * i;
  }
};

// The kept casts (LayerEntry::casts) of the params of `vars`, by the param's
// storage, for the update to rewrite as it writes them
// (OptimizerSlot::compute_copy). Every other kept cast goes: one of a
// tensor that is not a whole param of `vars` (another version's), or a
// param's second cast, would be stale once the update writes it.
std::map<const void*, Tensor> CastsForUpdate(Ops::CastMemo& casts, const layers::Variables& vars) {
  if (casts.kept().empty()) return {};  // a float32 layer casts nothing
  const std::string prefix = absl::StrCat(layers::kParams, "/");
  std::map<const void*, int64_t> params;  // storage -> element count
  for (auto it = vars.lower_bound(prefix); it != vars.end() && absl::StartsWith(it->first, prefix);
       ++it) {
    params.emplace(it->second.data(), it->second.numel());
  }
  std::map<const void*, Tensor> copies;
  std::vector<Ops::CastMemo::Key> stale;
  for (const auto& [key, kept] : casts.kept()) {
    auto param = params.find(key.first);
    if (param == params.end() || param->second != kept.source.numel() ||
        !copies.emplace(key.first, kept.copy).second) {
      stale.push_back(key);
    }
  }
  for (const Ops::CastMemo::Key& key : stale) casts.Forget(key);
  return copies;
}

}  // namespace

absl::Status Session::ApplyUpdate(LayerEntry& layer, const layers::Fp8Recipe* fp8,
                                  const layers::Variables& grads, VariableSet* next,
                                  te::v1::UpdateInfo* info, int64_t donated,
                                  bool* donated_written,
                                  std::pair<OptimizerStepInfo*, Ops::Completion*> info_later) {
  LayerOptimizer& optimizer = *layer.optimizer;
  // The step writes the params it has gradients for and the whole state in
  // place: versions that share them get copies first (contract 9), so the
  // new version keeps the storage, and with it the optimizer's plan and the
  // kept FP8 copies, which are made by the storage.
  std::vector<const Tensor*> writes;
  for (const auto& [name, grad] : grads) {
    auto param = next->vars.find(absl::StrCat(layers::kParams, name.substr(name.find('/'))));
    if (param != next->vars.end()) writes.push_back(&param->second);
  }
  for (const auto& [name, tensor] : next->opt_state) writes.push_back(&tensor);
  RETURN_IF_ERROR(DetachFromVersions(layer, writes, donated));
  // Under DelayedScaling the next forward's kernel scales are already made
  // (this call's last scaling update), so the update writes the kept FP8
  // weight copies with them as it writes the weights, and that forward reads
  // no weight to quantize it. Current scaling takes its scale from the new
  // weights' amax, so there is no pass to save: the copies go.
  std::map<const void*, OptimizerFp8Copy> fp8_copies;
  const bool rewrite = layers::HasFp8Metas(fp8);
  if (rewrite) {
    fp8_copies = layer.fp8_weights.CopiesForUpdate(next->vars);
  } else {
    layer.fp8_weights.Clear();
  }
  // The weights' compute-dtype casts are rewritten by the update whatever
  // the recipe: the next forward casts nothing.
  const std::map<const void*, Tensor> compute_copies = CastsForUpdate(*layer.casts, next->vars);
  // Norm, skip, clip, learning rate and counters are decided on the device;
  // this queues the step and nothing waits for it.
  if (donated_written != nullptr) *donated_written = donated != 0;
  if (absl::Status step = optimizer.updater.Step(*ops_, optimizer.config, grads, &next->vars,
                                                 &next->opt_state,
                                                 rewrite ? &fp8_copies : nullptr, &compute_copies);
      !step.ok()) {
    layer.ParamsChanged();  // the params may be part written: no copy is sure to match
    return step;
  }
  // What the step did comes back in one copy, once it is done.
  if (info_later.first != nullptr) {
    return optimizer.updater.ReadInfoAsync(*ops_, info_later.first, info_later.second);
  }
  ASSIGN_OR_RETURN(const OptimizerStepInfo step, optimizer.updater.ReadInfo(*ops_));
  SetUpdateInfo(step, id_, layer.id, info);
  return absl::OkStatus();
}

// ---- Forward / Backward ------------------------------------------------------------

absl::Status Session::Forward(const te::v1::ForwardRequest& request,
                              te::v1::ForwardResponse* response, const CallContext& call) {
  ASSIGN_OR_RETURN(const Target target,
                   Resolve(request.layer_id(), request.graph(), request.version()));
  LayerEntry* layer = target.entry;
  ASSIGN_OR_RETURN(const bool tf32,
                   layers::MatmulTf32(request.matmul_precision(), "matmul_precision"));
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  ASSIGN_OR_RETURN(CheckedInputs checked,
                   CheckInputs(target, PtrOf(fp8), request.x(), request.extra_inputs(),
                               request.has_attention_mask() ? &request.attention_mask() : nullptr,
                               ""));
  if (request.decode() && request.keep_for_backward()) {
    return absl::InvalidArgumentError(
        "keep_for_backward: a decode step is inference only; it keeps nothing for a backward");
  }
  if (request.keep_for_backward() &&
      static_cast<int>(saved_.size()) >= config_.max_saved_forwards) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "keep_for_backward: this session already keeps ", saved_.size(),
        " forwards (max_saved_forwards); run their Backward first"));
  }
  ShmRegion* y_region = nullptr;
  if (request.has_y_shm()) {
    if (request.keep_outputs()) {
      return absl::InvalidArgumentError(
          "y_shm: set together with keep_outputs; y goes to shared memory or stays resident, "
          "not both");
    }
    const uint64_t y_bytes =
        static_cast<uint64_t>(NumElements(checked.y_shape)) * DTypeSize(checked.y_dtype);
    ASSIGN_OR_RETURN(y_region, CheckShmRef(request.y_shm(), y_bytes, "y_shm", Regions()));
  }
  ASSIGN_OR_RETURN(layers::LayerInputs inputs, MaterializeInputs(checked));
  ASSIGN_OR_RETURN(std::unique_ptr<StepTransaction> tx,
                   StepTransaction::Open(*this, StepTransaction::ReadOf(target), fp8, call,
                                         "Forward"));
  layers::ForwardOptions& opts = tx->options();
  opts.deterministic = request.deterministic();
  opts.dropout_seed = request.dropout_seed();
  opts.tf32 = tf32;
  opts.keep_for_backward = request.keep_for_backward();
  std::shared_ptr<layers::DecodeContext> decode_context;  // alive through the forward
  if (request.decode()) {
    // Contract 11: the step advances its own copy of each cache index.
    ASSIGN_OR_RETURN(const DecodeStep step, PrepareDecode(target, &tx->vars()));
    opts.decode = true;
    opts.decode_cache_index = step.common_index;
    decode_context = step.context;
    opts.decode_context = decode_context.get();
    tx->Changed();
  }
  layers::LayerOutputs out;
  std::unique_ptr<layers::SavedForward> saved;
  RETURN_IF_ERROR(tx->Forward(inputs, &out, &saved));
  if (y_region != nullptr) {
    // Before the forward is kept or its step ends: a region its client shrank
    // then fails the call without leaving a saved forward behind.
    if (out.y.dtype() != checked.y_dtype || out.y.shape() != checked.y_shape) {
      return absl::InternalError(absl::StrCat(
          target.layer->type_name(), ": y is ", ShapeString(out.y.shape()), " ",
          DTypeName(out.y.dtype()), ", not the ", ShapeString(checked.y_shape), " ",
          DTypeName(checked.y_dtype), " its shape check promised"));
    }
    RETURN_IF_ERROR(WriteToRegion(*ops_, out.y, *y_region, request.y_shm().offset()));
  }
  // Without a backward to come, a forward is TE's functional apply: its
  // amaxes are dropped with the working copy, unless the request asks for
  // the step to end here.
  if (!request.keep_for_backward() && request.update_fp8_metas()) {
    RETURN_IF_ERROR(tx->EndStep());
  }
  if (request.keep_for_backward() && saved == nullptr) {
    return absl::InternalError(absl::StrCat(target.layer->type_name(),
                                            ": forward kept nothing for its backward"));
  }
  OutputEncoder encoder(this);
  if (y_region != nullptr) {
    te::v1::Tensor* y = response->mutable_y();
    y->set_dtype(DTypeToProto(out.y.dtype()));
    y->mutable_shape()->Assign(out.y.shape().begin(), out.y.shape().end());
    *y->mutable_shm() = request.y_shm();
  } else {
    RETURN_IF_ERROR(encoder.Encode(out.y, request.keep_outputs(), false, response->mutable_y()));
  }
  if (!out.aux.empty()) {
    // A graph's outputs after y (ln_out among them, where it has one).
    for (const Tensor& t : out.aux) {
      RETURN_IF_ERROR(encoder.Encode(t, request.keep_outputs(), false, response->add_outputs()));
    }
  } else if (out.ln_out.defined()) {
    RETURN_IF_ERROR(
        encoder.Encode(out.ln_out, request.keep_outputs(), false, response->mutable_ln_out()));
  }
  // Nothing above changed the session but resident outputs, which the
  // call's undo removes if it fails (contract 6).
  if (request.keep_for_backward()) {
    // The step ends at its Backward, which makes the new version from what
    // this forward ran on (its amaxes recorded under DelayedScaling).
    auto entry = std::make_unique<SavedEntry>();
    entry->layer_id = layer->id;
    entry->graph = target.graph;
    entry->version = target.version;
    entry->layer = target.layer;
    entry->saved = std::move(saved);
    entry->recipe = fp8;
    entry->y_shape = out.y.shape();
    entry->y_dtype = out.y.dtype();
    ASSIGN_OR_RETURN(const std::string forward_id, tx->CommitKept(std::move(entry)));
    response->set_forward_id(forward_id);
    response->set_version(target.version);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const int64_t version, tx->Commit());
  response->set_version(version);
  return absl::OkStatus();
}

absl::Status Session::Backward(const te::v1::BackwardRequest& request,
                               te::v1::BackwardResponse* response, const CallContext& call) {
  auto it = saved_.find(request.forward_id());
  if (it == saved_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "forward_id: no kept forward '", request.forward_id(),
        "' in this session (Forward with keep_for_backward; each is consumed by one Backward)"));
  }
  SavedEntry& saved = *it->second;
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(saved.layer_id));
  ASSIGN_OR_RETURN(
      CheckedTensor dy_checked,
      CheckTensor(request.dy(), "dy", config_.max_tensor_bytes, Resident(), Regions()));
  RETURN_IF_ERROR(CheckLike(dy_checked, saved.y_shape, saved.y_dtype, "dy", "the forward's y"));
  ASSIGN_OR_RETURN(Tensor dy, Materialize(*ops_, dy_checked));
  // The forward's working fp8_metas are the step's own, but a failed
  // Backward must leave the forward as it was (its Backward may be retried):
  // the transaction works on a copy of them.
  ASSIGN_OR_RETURN(std::unique_ptr<StepTransaction> tx,
                   StepTransaction::Open(*this, {layer, saved.layer, saved.version, &saved.base},
                                         saved.recipe, call, "Backward"));
  layers::LayerGrads grads;
  RETURN_IF_ERROR(tx->Backward(*saved.saved, dy, &grads));
  RETURN_IF_ERROR(tx->EndStep());
  OutputEncoder encoder(this);
  RETURN_IF_ERROR(encoder.Encode(grads.dx, request.keep_outputs(), false, response->mutable_dx()));
  for (const Tensor& dextra : grads.dextra) {
    RETURN_IF_ERROR(encoder.Encode(dextra, request.keep_outputs(), false,
                                   response->add_extra_input_grads()));
  }
  if (!request.keep_grads()) {
    for (const auto& [name, grad] : grads.params) {
      te::v1::Variable* out = response->add_grads();
      std::string collection;
      SplitVariableName(name, &collection, out->mutable_path());
      out->set_collection("grads");
      RETURN_IF_ERROR(encoder.Encode(grad, false, false, out->mutable_value()));
    }
  }
  if (request.keep_grads()) {
    layers::Variables sums;
    RETURN_IF_ERROR(AccumulateGrads(grads.params, "grads", &sums));
    ASSIGN_OR_RETURN(tx->next().grads, KeptGrads(tx->next().grads, std::move(sums)));
    tx->Changed();
  }
  // Unchanged: the version the forward read (which may have been released since).
  ASSIGN_OR_RETURN(const int64_t version, tx->Commit());
  response->set_version(version);
  tx.reset();  // it reads the kept forward's variables
  saved_.erase(it);
  return absl::OkStatus();
}

// ---- ForwardBackward -------------------------------------------------------------------

absl::Status Session::ForwardBackward(const te::v1::ForwardBackwardRequest& request,
                                      te::v1::ForwardBackwardResponse* response,
                                      const CallContext& call) {
  ASSIGN_OR_RETURN(const Target run,
                   Resolve(request.layer_id(), request.graph(), request.version()));
  LayerEntry* layer = run.entry;
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  ASSIGN_OR_RETURN(const bool tf32,
                   layers::MatmulTf32(request.matmul_precision(), "matmul_precision"));
  if (request.micro_batches_size() == 0) {
    return absl::InvalidArgumentError("micro_batches: empty; give at least one (x, dy)");
  }
  if (request.micro_batches_size() > config_.max_micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "micro_batches: ", request.micro_batches_size(), " given; this server takes at most ",
        config_.max_micro_batches, " per call (--max_micro_batches); split them over calls"));
  }
  if (request.discard_grads() && (request.return_grads() || request.apply_update())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "discard_grads: the gradients are dropped, so they cannot also be ",
        request.return_grads() ? "returned (return_grads)" : "applied (apply_update)"));
  }
  if (request.donate() && !request.apply_update()) {
    return absl::InvalidArgumentError(
        "donate: donates the version read to the update that writes it in place; set "
        "apply_update");
  }
  if (request.apply_update() && !layer->optimizer) {
    return absl::FailedPreconditionError(absl::StrCat(
        "apply_update: layer ", layer->id, " has no optimizer; give it one with SetOptimizer"));
  }
  // Every micro-batch is validated before the first one runs.
  std::vector<CheckedInputs> inputs;
  std::vector<CheckedTensor> dys;  // dy, or the target where one is given
  std::vector<bool> is_target;
  std::vector<bool> is_seeded;     // a loss layer's micro-batch without dy
  int64_t target_elements = 0;     // the squared error's mean is over these
  for (int i = 0; i < request.micro_batches_size(); ++i) {
    const te::v1::MicroBatch& mb = request.micro_batches(i);
    const std::string prefix = absl::StrCat("micro_batches[", i, "].");
    ASSIGN_OR_RETURN(CheckedInputs in,
                     CheckInputs(run, PtrOf(fp8), mb.x(), mb.extra_inputs(),
                                 mb.has_attention_mask() ? &mb.attention_mask() : nullptr, prefix));
    if (mb.has_target() && mb.has_dy()) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "target: given with dy; a micro-batch's loss is vdot(y, dy) or the squared "
          "error against target, not both"));
    }
    const bool target = mb.has_target();
    // A graph whose y is a loss (a float32 scalar) seeds its own backward
    // when no dy is given.
    const bool seeded = !target && !mb.has_dy() && in.y_is_loss();
    if (target && in.y_is_loss()) {
      return absl::InvalidArgumentError(absl::StrCat(
          prefix, "target: layer ", layer->id, "'s y is already a loss (a float32 scalar); send "
          "what the loss reads (labels) as extra inputs and no target or dy"));
    }
    CheckedTensor dy;
    if (!seeded) {
      ASSIGN_OR_RETURN(dy, CheckDy(in, target ? mb.target() : mb.dy(),
                                   prefix + (target ? "target" : "dy")));
    }
    if (target) target_elements += NumElements(in.y_shape);
    inputs.push_back(std::move(in));
    dys.push_back(std::move(dy));
    is_target.push_back(target);
    is_seeded.push_back(seeded);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StepTransaction> tx,
                   StepTransaction::Open(*this, StepTransaction::ReadOf(run), fp8, call,
                                         "ForwardBackward"));
  tx->options().deterministic = request.deterministic();
  tx->options().tf32 = tf32;
  OutputEncoder encoder(this);
  layers::Variables grad_sum;  // "grads/..."
  // With an update, the micro-batches' values stay on the device until the
  // update is queued too: read in between, they would idle the GPU while the
  // host queues the update. A step whose answer is only its values (the
  // speedometer's, a loss's value_and_grad whose gradients stay on the
  // server) reads them outside the session's turn where the reactor allows
  // (CallContext::after_turn), so a client's next queued step issues its
  // work while this one finishes on the device.
  const bool values_after_turn = call.after_turn != nullptr && !request.apply_update() &&
                                 !request.return_dx() && !request.return_outputs() &&
                                 !request.return_grads();
  const bool pend_values = request.apply_update() || values_after_turn;
  std::vector<std::pair<Tensor, double>> pending_values;  // value, its scale
  for (size_t i = 0; i < inputs.size(); ++i) {
    RETURN_IF_ERROR(call.StillWanted(absl::StrCat("ForwardBackward, before micro_batches[", i, "]")));
    ASSIGN_OR_RETURN(layers::LayerInputs in, MaterializeInputs(inputs[i]));
    Tensor dy;
    if (is_seeded[i]) {
      // dloss = 1 / micro-batches: the values then sum to the mean of the
      // micro-batches' losses, and the gradients to its gradient.
      ASSIGN_OR_RETURN(dy, ops_->Allocate(DType::kF32, inputs[i].y_shape));
      RETURN_IF_ERROR(ops_->Fill(1.0f / static_cast<float>(inputs.size()), &dy));
    } else {
      ASSIGN_OR_RETURN(dy, Materialize(*ops_, dys[i]));
    }
    tx->options().dropout_seed = request.micro_batches(static_cast<int>(i)).dropout_seed();
    double value = 0.0;
    layers::LayerGrads grads;
    const Tensor* target = is_target[i] ? &dy : nullptr;
    const double loss_scale = target_elements > 0 ? 1.0 / static_cast<double>(target_elements) : 1.0;
    Tensor pending;
    std::vector<Tensor> aux;
    if (absl::Status step = tx->Step(in, target ? Tensor() : dy, &value, &grads, target,
                                     loss_scale, pend_values ? &pending : nullptr,
                                     &aux);
        !step.ok()) {
      // A bad input shows only once the layer runs: name its micro-batch.
      return absl::IsInvalidArgument(step) ? AboutField(step, absl::StrCat("micro_batches[", i, "]"))
                                           : step;
    }
    response->add_values(value);
    if (pend_values) pending_values.emplace_back(pending, target ? loss_scale : 1.0);
    if (request.return_dx()) {
      RETURN_IF_ERROR(encoder.Encode(grads.dx, false, false, response->add_dx()));
      te::v1::ForwardBackwardResponse::InputGrads* extra = response->add_extra_input_grads();
      for (const Tensor& d : grads.dextra) {
        RETURN_IF_ERROR(encoder.Encode(d, false, false, extra->add_grads()));
      }
    }
    if (request.return_outputs()) {
      te::v1::ForwardBackwardResponse::Outputs* outputs = response->add_outputs();
      for (const Tensor& t : aux) {
        RETURN_IF_ERROR(encoder.Encode(t, false, false, outputs->add_outputs()));
      }
    }
    if (!request.discard_grads()) {
      RETURN_IF_ERROR(AccumulateGrads(grads.params, "grads", &grad_sum));
    }
  }
  if (request.return_grads()) {
    for (const auto& [name, grad] : grad_sum) {
      te::v1::Variable* out = response->add_grads();
      std::string collection;
      SplitVariableName(name, &collection, out->mutable_path());
      out->set_collection("grads");
      RETURN_IF_ERROR(encoder.Encode(grad, false, false, out->mutable_value()));
    }
  }
  VariableSet& next = tx->next();
  // The version the step donates (ForwardBackwardRequest.donate): written in
  // place by the update, released with the call.
  const int64_t donated = request.donate() ? run.version : 0;
  if (request.apply_update()) {
    // The update takes the gradients kept by earlier calls too: added into
    // this call's sums, which are the call's own tensors, and the new
    // version keeps none.
    RETURN_IF_ERROR(AccumulateGrads(run.read->grads, "grads", &grad_sum));
    next.grads.clear();
    RETURN_IF_ERROR(call.StillWanted("ForwardBackward"));
    // The update last (contract 8): it writes only the new version's tensors
    // (and a donated version's, which goes with the call).
    // Where the reactor can wait outside the session's turn, the answer's
    // device values are read there (CallContext::after_turn).
    std::shared_ptr<StepAnswerLater> later;
    if (call.after_turn != nullptr) {
      ASSIGN_OR_RETURN(later, StepAnswerLater::Start(*ops_, pending_values));
    }
    bool donated_written = false;
    absl::Status updated = ApplyUpdate(
        *layer, tx->fp8(), grad_sum, &next, response->mutable_update(), donated, &donated_written,
        later != nullptr ? std::make_pair(later->info(), later->done.get())
                         : std::pair<OptimizerStepInfo*, Ops::Completion*>());
    for (size_t i = 0; updated.ok() && i < pending_values.size(); ++i) {
      if (later != nullptr) {
        updated = ops_->DownloadAsync(pending_values[i].first, later->value(i), later->done.get());
        continue;
      }
      // The step is done (ApplyUpdate read its record): these copies wait for nothing.
      absl::StatusOr<double> v = tx->ReadStepResult(pending_values[i].first);
      if (v.ok()) {
        response->set_values(static_cast<int>(i), *v * pending_values[i].second);
      } else {
        updated = v.status();
      }
    }
    if (later != nullptr && updated.ok()) {
      *call.after_turn = [later, response, session_id = id_, layer_id = layer->id]() {
        RETURN_IF_ERROR(later->done->Wait());
        SetUpdateInfo(*later->info(), session_id, layer_id, response->mutable_update());
        later->SetValues(&StepTransaction::TakeStepResult, response);
        return absl::OkStatus();
      };
    }
    if (!updated.ok()) {
      if (!donated_written) return updated;
      layer->versions.erase(donated);
      return absl::Status(updated.code(),
                          absl::StrCat(updated.message(), " (donate: version ", donated,
                                       ", part written by the update, was released)"));
    }
    tx->Changed();
  } else if (!request.return_grads() && !request.discard_grads()) {
    ASSIGN_OR_RETURN(next.grads, KeptGrads(run.read->grads, std::move(grad_sum)));
    tx->Changed();
  }
  if (values_after_turn) {
    ASSIGN_OR_RETURN(std::shared_ptr<StepAnswerLater> later,
                     StepAnswerLater::Start(*ops_, pending_values));
    for (size_t i = 0; i < pending_values.size(); ++i) {
      RETURN_IF_ERROR(
          ops_->DownloadAsync(pending_values[i].first, later->value(i), later->done.get()));
    }
    *call.after_turn = [later, response]() {
      RETURN_IF_ERROR(later->done->Wait());
      later->SetValues(&StepTransaction::TakeStepResult, response);
      return absl::OkStatus();
    };
  }
  // A donated version is written by now: the new one is made even if the
  // client has gone, and kept if the call is undone, so the layer keeps
  // its variables.
  absl::StatusOr<int64_t> version = tx->Commit(/*unwanted_too=*/donated != 0);
  if (donated != 0) {
    layer->versions.erase(donated);
    if (version.ok()) KeepOnUndo(layer->id, *version);
  }
  RETURN_IF_ERROR(version.status());
  response->set_version(*version);
  return absl::OkStatus();
}

}  // namespace te::session
