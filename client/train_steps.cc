// TrainSteps (train_steps.h): loss-graph training steps over the session's
// Async calls, each sent before the one before it has answered.
#include "client/train_steps.h"

#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace internal {

struct StepRecord {
  Session* session = nullptr;
  std::vector<std::string> blocks;  // its shared-memory blocks ("shm:..."), freed once it has answered
  absl::Mutex mu;
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> call ABSL_GUARDED_BY(mu);
  // A value of the layer: the version the step reads when it names one,
  // held until it has answered (and the template of the version it makes).
  Variables base ABSL_GUARDED_BY(mu);
  // The step it reads the newest version of (sent while that one was in
  // flight): its outcome decides this one's.
  std::shared_ptr<StepRecord> parent ABSL_GUARDED_BY(mu);
  bool settled ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  StepMetrics metrics ABSL_GUARDED_BY(mu);
  std::optional<Variables> made ABSL_GUARDED_BY(mu);  // until TrainSteps takes it
};

}  // namespace internal

namespace {

using internal::StepRecord;

constexpr absl::string_view kNotRun = "not run on the variables the program meant: ";

// What a step sent on top of a failed one reports: the failed step's code, naming it.
absl::Status Dependent(const absl::Status& failed) {
  if (absl::StartsWith(failed.message(), kNotRun)) return failed;
  return absl::Status(failed.code(), absl::StrCat(kNotRun, "the step it continues from failed (",
                                                  absl::StatusCodeToString(failed.code()), ": ",
                                                  failed.message(), ")"));
}

// Settles `record` once its parent has settled: waits for its answer.
void SettleOne(StepRecord& record) {
  absl::MutexLock lock(&record.mu);
  if (record.settled) return;
  absl::StatusOr<te::v1::ForwardBackwardResponse> own = record.call.get();
  record.session->DeleteAll(record.blocks).IgnoreError();
  absl::Status before;
  if (record.parent != nullptr) {
    absl::MutexLock parent_lock(&record.parent->mu);
    before = record.parent->status;
  }
  if (!before.ok()) {
    record.status = Dependent(before);
    // It ran on the version before the failed step: that result is never
    // seen, and its version is released as this temporary value goes.
    if (own.ok() && own->version() != 0) ValueAt(record.base, own->version());
  } else if (!own.ok()) {
    record.status = own.status();
  } else if (own->values_size() != 1) {
    record.status = absl::InternalError(
        absl::StrCat("ForwardBackward answered ", own->values_size(), " values for one micro-batch"));
  } else {
    record.metrics.loss = own->values(0);
    record.metrics.update = own->update();
    record.made = own->version() != 0 ? ValueAt(record.base, own->version()) : record.base;
  }
  record.parent.reset();
  record.base = Variables();
  record.settled = true;
}

// Settles `record` and every unsettled step it continues from, oldest first.
void Settle(const std::shared_ptr<StepRecord>& record) {
  std::vector<std::shared_ptr<StepRecord>> chain;
  for (std::shared_ptr<StepRecord> r = record; r != nullptr;) {
    absl::MutexLock lock(&r->mu);
    if (r->settled) break;
    chain.push_back(r);
    std::shared_ptr<StepRecord> parent = r->parent;
    r = std::move(parent);
  }
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) SettleOne(**it);
}

}  // namespace

absl::StatusOr<StepMetrics> PendingStep::Get() const {
  if (record_ == nullptr) return absl::FailedPreconditionError("PendingStep: not from TrainSteps::Step");
  Settle(record_);
  absl::MutexLock lock(&record_->mu);
  if (!record_->status.ok()) return record_->status;
  return record_->metrics;
}

bool PendingStep::Ready() const {
  if (record_ == nullptr) return false;
  absl::MutexLock lock(&record_->mu);
  return record_->settled ||
         record_->call.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

TrainSteps::TrainSteps(const Module& module, const Variables& vars, int depth, bool donate)
    : module_(module), depth_(depth < 1 ? 1 : depth), donate_(donate), current_(vars.Pinned()) {}

TrainSteps::~TrainSteps() {
  while (!in_flight_.empty()) SettleFront();
  for (std::future<void>& deleted : deletes_) deleted.wait();
}

void TrainSteps::SettleFront() {
  std::shared_ptr<StepRecord> front = std::move(in_flight_.front());
  in_flight_.pop_front();
  Settle(front);
  absl::MutexLock lock(&front->mu);
  if (!front->status.ok()) {
    if (failed_.ok()) failed_ = front->status;
    return;
  }
  if (failed_.ok() && front->made.has_value()) current_ = *std::move(front->made);
  front->made.reset();
}

absl::StatusOr<PendingStep> TrainSteps::Step(const HostTensor& x, const ApplyOptions& options) {
  RETURN_IF_ERROR(failed_);
  if (current_.session == nullptr || current_.layer_id.empty()) {
    return absl::FailedPreconditionError("TrainSteps: variables not from Module::Init (no session or layer id)");
  }
  if (!options.deterministic && !options.dropout_seed.has_value() && !module_.DropoutUsers().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        absl::StrJoin(module_.DropoutUsers(), ", "),
        " needs PRNG for \"dropout\": with deterministic false set ApplyOptions::dropout_seed"));
  }
  while (static_cast<int>(in_flight_.size()) >= depth_) SettleFront();
  RETURN_IF_ERROR(failed_);

  Session& session = *current_.session;
  auto record = std::make_shared<StepRecord>();
  record->session = &session;
  te::v1::ForwardBackwardRequest request;
  request.set_layer_id(current_.layer_id);
  te::v1::MicroBatch* batch = request.add_micro_batches();
  std::vector<std::string> uploads;
  absl::Status sent = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(*batch->mutable_x(), session.Send(x, &uploads));
    for (const HostTensor& extra : options.extra_inputs) {
      ASSIGN_OR_RETURN(*batch->add_extra_inputs(), session.Send(extra, &uploads));
    }
    if (options.attention_mask.has_value()) {
      ASSIGN_OR_RETURN(*batch->mutable_attention_mask(), session.Send(*options.attention_mask, &uploads));
    }
    return absl::OkStatus();
  }();
  if (!sent.ok()) {
    session.DeleteAll(uploads).IgnoreError();
    return sent;
  }
  std::vector<std::string> residents;
  for (std::string& id : uploads) {
    (absl::StartsWith(id, "shm:") ? record->blocks : residents).push_back(std::move(id));
  }
  batch->set_dropout_seed(options.dropout_seed.value_or(0));
  request.set_deterministic(options.deterministic);
  *request.mutable_autocast() = ToProto(Autocast::Current());
  request.set_matmul_precision(ToProto(DefaultMatmulPrecision::Current()));
  request.set_apply_update(true);
  // Every step of this object donates alike, so one sent on top of a step in
  // flight donates only what the program already gave away.
  request.set_donate(donate_);
  request.set_graph(options.graph);
  {
    absl::MutexLock lock(&record->mu);
    record->base = current_;
    if (!in_flight_.empty()) {
      // The step before is in flight: the layer's newest is what it makes.
      record->parent = in_flight_.back();
      request.set_version(0);
    } else {
      request.set_version(current_.version());
    }
    record->call = session.ForwardBackwardAsync(std::move(request));
  }
  if (!residents.empty()) {
    // Deleted by calls numbered after the step (so run after it) on a thread
    // of their own: a DeleteTensor waited for here would wait for every step
    // in flight, emptying the pipeline.
    deletes_.push_back(std::async(std::launch::async, [&session, ids = std::move(residents)] {
      session.DeleteAll(ids).IgnoreError();
    }));
  }
  while (!deletes_.empty() &&
         deletes_.front().wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    deletes_.pop_front();
  }
  in_flight_.push_back(record);
  PendingStep pending;
  pending.record_ = std::move(record);
  return pending;
}

absl::StatusOr<Variables> TrainSteps::Wait() {
  while (!in_flight_.empty()) SettleFront();
  for (std::future<void>& deleted : deletes_) deleted.wait();
  deletes_.clear();
  RETURN_IF_ERROR(failed_);
  return current_;
}

}  // namespace te::client
