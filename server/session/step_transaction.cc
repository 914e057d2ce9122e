#include "server/session/step_transaction.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/fp8_state.h"

namespace te::session {
namespace {

std::atomic<int64_t> fp8_non_finite_amaxes{0};

// A view's offset into its block: aligned to its element, no further (the
// metas are float32; padding would count against the session's memory).
int64_t AlignedTo(int64_t offset, DType dtype) {
  const int64_t align = static_cast<int64_t>(DTypeSize(dtype));
  return (offset + align - 1) / align * align;
}

// A tensor of `dtype` and `shape` at `offset` bytes into `block`, keeping the
// block alive.
Tensor ViewInto(const Tensor& block, int64_t offset, DType dtype, const Shape& shape) {
  auto owner = std::make_shared<Tensor>(block);
  void* data = static_cast<char*>(block.data()) + offset;
  return Tensor(std::shared_ptr<void>(owner, data), data, dtype, shape);
}

}  // namespace

int64_t Fp8NonFiniteAmaxes() { return fp8_non_finite_amaxes.load(); }

Session::StepTransaction::StepTransaction(Session& session, const Read& read,
                                          std::optional<layers::Fp8Recipe> fp8,
                                          const CallContext& call, std::string what,
                                          WeightCopies copies)
    : session_(session),
      read_(read),
      call_(call),
      what_(std::move(what)),
      interrupt_(*session.ops_, call, what_),
      fp8_(std::move(fp8)),
      kept_copies_(copies == WeightCopies::kOwn ? &own_copies_ : &read.layer->fp8_weights),
      kept_casts_(*session.ops_, copies == WeightCopies::kOwn ? nullptr : read.layer->casts),
      kept_constants_(copies == WeightCopies::kOwn ? &own_constants_ : &read.layer->constants),
      next_(*read.read) {
  options_.constants = copies == WeightCopies::kOwn ? &own_constants_ : &read.layer->constants;
  if (fp8_) {
    fp8_->weight_cache = copies == WeightCopies::kOwn ? &own_copies_ : &read.layer->fp8_weights;
    options_.fp8 = &*fp8_;
  }
}

Session::StepTransaction::~StepTransaction() = default;

absl::StatusOr<std::unique_ptr<Session::StepTransaction>> Session::StepTransaction::Open(
    Session& session, const Read& read, std::optional<layers::Fp8Recipe> fp8,
    const CallContext& call, std::string what, WeightCopies copies) {
  std::unique_ptr<StepTransaction> tx(
      new StepTransaction(session, read, std::move(fp8), call, std::move(what), copies));
  if (!tx->delayed_scaling()) return tx;
  // Dozens of tiny tensors (each quantizer's amax history and scale): one
  // CopyAll, not a copy each, which would idle the GPU between them.
  Ops& ops = *session.ops_;
  std::vector<const Tensor*> from;
  std::vector<Tensor*> to;
  // The working copy's names are the read's: both maps hold the collection
  // as one run from the same place, walked side by side.
  const std::string prefix = "fp8_metas/";
  // The copies are views into one allocation: some hundreds of allocations,
  // each through the device allocator's locks, kept the GPU idle at every
  // FP8 step's start (1.19 ms of the 24 x 1024 LM's step on the H200). A
  // meta that SetVariables replaces later leaves its bytes in the block until
  // the block's last view goes.
  std::vector<int64_t> offsets;
  int64_t block_bytes = 0;
  auto read_it = read.read->vars.lower_bound(prefix);
  for (auto it = tx->next_.vars.lower_bound(prefix);
       it != tx->next_.vars.end() && absl::StartsWith(it->first, prefix); ++it, ++read_it) {
    const Tensor& original = read_it->second;
    from.push_back(&original);
    to.push_back(&it->second);
    offsets.push_back(AlignedTo(block_bytes, original.dtype()));
    block_bytes = offsets.back() + static_cast<int64_t>(original.nbytes());
  }
  if (from.empty()) return tx;
  ASSIGN_OR_RETURN(Tensor block, ops.Allocate(DType::kBool, {block_bytes}));
  bool one_run = true;  // the read's metas: one block laid out alike
  for (size_t n = 0; n < from.size(); ++n) {
    *to[n] = ViewInto(block, offsets[n], from[n]->dtype(), from[n]->shape());
    one_run = one_run && static_cast<const char*>(from[n]->data()) ==
                             static_cast<const char*>(from[0]->data()) + offsets[n];
  }
  // From the second step on, the read's metas are the last step's block: one copy.
  if (one_run) {
    RETURN_IF_ERROR(ops.Copy(ViewInto(*from[0], 0, DType::kBool, {block_bytes}), &block));
  } else {
    RETURN_IF_ERROR(ops.CopyAll(from, to));
  }
  return tx;
}

absl::Status Session::StepTransaction::Forward(const layers::LayerInputs& inputs,
                                               layers::LayerOutputs* out,
                                               std::unique_ptr<layers::SavedForward>* saved) {
  RETURN_IF_ERROR(CheckKeptCopies());
  return read_.graph->Forward(*session_.ops_, &next_.vars, inputs, options_, out, saved);
}

layers::Fp8WeightCache* Session::StepTransaction::WeightCache() const {
  return options_.fp8 != nullptr ? options_.fp8->weight_cache : nullptr;
}

absl::Status Session::StepTransaction::CheckKeptCopies() {
  layers::Fp8WeightCache* cache = WeightCache();
  if (cache == nullptr) return absl::OkStatus();
  return cache->CheckBeforeForward(*session_.ops_, *options_.fp8, next_.vars);
}

absl::Status Session::StepTransaction::Backward(const layers::SavedForward& saved,
                                                const Tensor& dy, layers::LayerGrads* grads) {
  return read_.graph->Backward(*session_.ops_, &next_.vars, saved, dy, grads);
}

absl::Status Session::StepTransaction::Step(const layers::LayerInputs& inputs,
                                            const Tensor& given_dy, double* value,
                                            layers::LayerGrads* grads, const Tensor* target,
                                            double loss_scale, Tensor* pending_value,
                                            std::vector<Tensor>* aux) {
  Ops& ops = *session_.ops_;
  const layers::Layer& layer = *read_.graph;
  layers::ForwardOptions opts = options_;
  opts.keep_for_backward = true;
  layers::LayerOutputs out;
  std::unique_ptr<layers::SavedForward> saved;
  RETURN_IF_ERROR(CheckKeptCopies());
  RETURN_IF_ERROR(layer.Forward(ops, &next_.vars, inputs, opts, &out, &saved));
  if (saved == nullptr) {
    return absl::InternalError(absl::StrCat(layer.type_name(),
                                            ": forward kept nothing for its backward"));
  }
  if (aux != nullptr) *aux = std::move(out.aux);
  RETURN_IF_ERROR(ops.CheckInterrupt());
  // The value stays on the device until the backward is queued: reading it
  // here would stall the stream between forward and backward. It is read in
  // one copy with the FP8 update's count of inf / NaN amaxes (ReadStepResult):
  // readback [1] f32, or [2] under DelayedScaling.
  const bool fp8_metas = delayed_scaling();
  Tensor readback;
  Tensor dy = given_dy;
  if (target != nullptr) {
    // optax.squared_error: r = y - target in float32; the value is
    // loss_scale * sum(r^2) and dy = 2 * loss_scale * r, in y's dtype.
    ASSIGN_OR_RETURN(Tensor residual, ops.Allocate(DType::kF32, out.y.shape()));
    RETURN_IF_ERROR(ops.Axpby(1.0f, out.y, -1.0f, *target, &residual));
    ASSIGN_OR_RETURN(readback, ops.Allocate(DType::kF32, {fp8_metas ? 2 : 1}));
    Tensor value_on_device = readback.Slice0(0, 1).Reshaped({1, 1});
    RETURN_IF_ERROR(ops.Dot(residual, residual, &value_on_device));
    ASSIGN_OR_RETURN(dy, ops.Allocate(out.y.dtype(), out.y.shape()));
    RETURN_IF_ERROR(ops.Axpby(static_cast<float>(2.0 * loss_scale), residual, 0.0f, residual, &dy));
  } else if (value != nullptr) {
    ASSIGN_OR_RETURN(readback, ops.Allocate(DType::kF32, {fp8_metas ? 2 : 1}));
    Tensor value_on_device = readback.Slice0(0, 1).Reshaped({1, 1});
    RETURN_IF_ERROR(VdotOnDevice(out.y, dy, &value_on_device));
  }
  // Nothing reads y again, and the saved forward is this step's own: both
  // go before the backward reaches its peak (the layer frees its activations
  // as its backward reads them for the last time).
  out = layers::LayerOutputs();
  RETURN_IF_ERROR(layer.BackwardOnce(ops, &next_.vars, std::move(saved), dy, grads));
  Tensor non_finite;
  if (fp8_metas && readback.defined()) {
    non_finite = readback.Slice0(1, 2);
    RETURN_IF_ERROR(ops.Fill(0.0f, &non_finite));
  }
  RETURN_IF_ERROR(EndStep(non_finite.defined() ? &non_finite : nullptr));
  if (pending_value != nullptr) {
    *pending_value = std::move(readback);
  } else if (value != nullptr) {
    ASSIGN_OR_RETURN(const double v, ReadStepResult(readback));
    *value = v * (target != nullptr ? loss_scale : 1.0);
  }
  return absl::OkStatus();
}

absl::Status Session::StepTransaction::VdotOnDevice(const Tensor& y, const Tensor& dy,
                                                    Tensor* out) {
  Ops& ops = *session_.ops_;
  if (y.dtype() == dy.dtype()) return ops.Dot(y, dy, out);
  // dy sent in another float dtype than y's: both exactly in f32.
  ASSIGN_OR_RETURN(const Tensor y32, layers::CastTo(ops, y, DType::kF32));
  ASSIGN_OR_RETURN(const Tensor dy32, layers::CastTo(ops, dy, DType::kF32));
  return ops.Dot(y32, dy32, out);
}

absl::StatusOr<double> Session::StepTransaction::ReadStepResult(const Tensor& readback) {
  float host[2] = {0.0f, 0.0f};
  RETURN_IF_ERROR(session_.ops_->Download(readback, host));
  return TakeStepResult(host, readback.numel());
}

double Session::StepTransaction::TakeStepResult(const float* host, int64_t readback_size) {
  if (readback_size == 2) fp8_non_finite_amaxes.fetch_add(static_cast<int64_t>(host[1]));
  return static_cast<double>(host[0]);
}

absl::Status Session::StepTransaction::EndStep(Tensor* non_finite) {
  if (layers::Fp8WeightCache* cache = WeightCache()) cache->ForgetChecks();
  if (!delayed_scaling()) return absl::OkStatus();
  RETURN_IF_ERROR(layers::UpdateFp8Metas(*session_.ops_, *options_.fp8, &next_.vars, non_finite));
  changed_ = true;
  return absl::OkStatus();
}

absl::Status Session::StepTransaction::Seal(bool unwanted_too) {
  if (committed_) {
    return absl::InternalError(absl::StrCat(what_, ": the step was committed twice"));
  }
  if (!unwanted_too) RETURN_IF_ERROR(call_.StillWanted(what_));
  // Only the newest version's weights train on: the copies of an older
  // one's would hold memory for weights no later call reads.
  if (read_.layer->is_newest(read_.version)) {
    kept_copies_.Commit();
    kept_casts_.Commit();
  }
  kept_constants_.Commit();
  committed_ = true;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Session::StepTransaction::Commit(bool unwanted_too) {
  RETURN_IF_ERROR(Seal(unwanted_too));
  if (!changed_) return read_.version;
  return session_.MakeVersion(*read_.layer, std::move(next_));
}

absl::StatusOr<std::string> Session::StepTransaction::CommitKept(
    std::unique_ptr<SavedEntry> saved) {
  RETURN_IF_ERROR(Seal());
  saved->base = std::move(next_);
  const std::string id = session_.NewId(Created::Kind::kForward);
  session_.saved_[id] = std::move(saved);
  return id;
}

}  // namespace te::session
