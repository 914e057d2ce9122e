#include "server/service/queued_call.h"

#include <utility>

#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/service/status.h"

namespace te::service {

QueuedCall::QueuedCall(const ServiceCore& core, grpc::CallbackServerContext* context,
                       const char* rpc, std::string session_id)
    : core_(core),
      context_(context),
      rpc_(rpc),
      session_id_(std::move(session_id)),
      start_(absl::Now()),
      queued_(DeadlineOf(*context)) {}

grpc::ServerUnaryReactor* QueuedCall::Start(const ServiceCore& core,
                                            grpc::CallbackServerContext* context, const char* rpc,
                                            std::string session_id, int device, std::string key,
                                            const te::v1::SessionRef* order, Work work) {
  auto* call = new QueuedCall(core, context, rpc, std::move(session_id));
  absl::Status queued =
      call->queued_.Submit(core, device, std::move(key), order, call->RunFor(std::move(work)),
                           call->DropFor());
  if (!queued.ok()) call->End(queued);
  return call;
}

grpc::ServerUnaryReactor* QueuedCall::OnSession(const ServiceCore& core,
                                                grpc::CallbackServerContext* context,
                                                const char* rpc, const te::v1::SessionRef& ref,
                                                SessionWork work) {
  auto* call = new QueuedCall(core, context, rpc, ref.session_id());
  call->session_ref_ = ref;
  call->session_ref_->clear_sequence();
  const ServiceCore* shared = &core;
  Work in_session = [shared, rpc, ref, work = std::move(work)](const session::CallContext& call) {
    return RunInSessionTurn(*shared, rpc, ref.session_id(), &ref.token(), call, work);
  };
  absl::Status queued = call->queued_.SubmitForSession(
      core, ref, call->RunFor(std::move(in_session)), call->DropFor());
  if (!queued.ok()) call->End(queued);
  return call;
}

grpc::ServerUnaryReactor* QueuedCall::Immediate(const ServiceCore& core,
                                                grpc::CallbackServerContext* context,
                                                const char* rpc, const std::string& session_id,
                                                const absl::Status& status) {
  auto* call = new QueuedCall(core, context, rpc, session_id);
  call->End(status);
  return call;
}

QueuedTurn::Run QueuedCall::RunFor(Work work) {
  return [this, work = std::move(work)](DeviceExecutor::Turn turn) {
    Run(std::move(turn), work);
  };
}

QueuedTurn::Drop QueuedCall::DropFor() {
  return [this](absl::Status reason) { End(reason); };
}

void QueuedCall::Run(DeviceExecutor::Turn turn, const Work& work) {
  session::CallContext call = queued_.Context(context_);
  call.answer_ids = answer_ids_;
  std::function<absl::Status()> after_turn;
  call.after_turn = &after_turn;
  absl::Status status = call.StillWanted(rpc_);
  if (status.ok()) status = NoThrow([&] { return work(call); });
  turn.Release();  // the session's next call may start while this one answers
  if (status.ok() && after_turn) status = NoThrow(after_turn);
  End(status);
}

// Drops the work if it still waits (which finishes the call); a running call
// sees the cancel and is undone when it ends.
void QueuedCall::OnCancel() { queued_.Cancel(); }

namespace {

// The session's own turn that drops the ids of a call whose answer was lost
// (contract 2). Shared by its run, its drop and Submit, so it lives until
// the last of them is done with it.
class ForgetUnanswered {
 public:
  static void Submit(const ServiceCore& core, const te::v1::SessionRef& ref,
                     std::vector<std::string> ids) {
    auto forget = std::make_shared<ForgetUnanswered>(std::move(ids));
    const ServiceCore* shared = &core;
    const std::string id = ref.session_id();
    // Not queued (the session is gone, the server stops): nothing to forget.
    forget->turn_
        .SubmitForSession(
            core, ref,
            [forget, shared, id](DeviceExecutor::Turn turn) {
              auto lease = shared->sessions->AcquireForServer(id);
              if (lease.ok()) lease->session().ForgetUnanswered(forget->ids_);
            },
            [forget](absl::Status) {})
        .IgnoreError();
  }

  explicit ForgetUnanswered(std::vector<std::string> ids)
      : turn_(absl::InfiniteFuture()), ids_(std::move(ids)) {}

 private:
  QueuedTurn turn_;
  const std::vector<std::string> ids_;
};

}  // namespace

void QueuedCall::OnDone() {
  // IsCancelled here: the call's status never reached its client.
  if (session_ref_.has_value() && !answer_ids_->empty() && context_->IsCancelled()) {
    ForgetUnanswered::Submit(core_, *session_ref_, std::move(*answer_ids_));
  }
  delete this;
}

void QueuedCall::End(const absl::Status& status) {
  Finish(core_.Finished(rpc_, session_id_, status, start_));
}

}  // namespace te::service
