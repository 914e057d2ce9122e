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
      deadline_(DeadlineOf(*context)) {}

grpc::ServerUnaryReactor* QueuedCall::Start(const ServiceCore& core,
                                            grpc::CallbackServerContext* context, const char* rpc,
                                            std::string session_id, int device, std::string key,
                                            const te::v1::SessionRef* order, Work work) {
  auto* call = new QueuedCall(core, context, rpc, std::move(session_id));
  call->Submit(device, std::move(key), order, std::move(work));
  return call;
}

grpc::ServerUnaryReactor* QueuedCall::OnSession(const ServiceCore& core,
                                                grpc::CallbackServerContext* context,
                                                const char* rpc, const te::v1::SessionRef& ref,
                                                SessionWork work) {
  auto* call = new QueuedCall(core, context, rpc, ref.session_id());
  absl::StatusOr<int> device = core.Route(ref);
  if (!device.ok()) {
    call->End(device.status());
    return call;
  }
  const ServiceCore* shared = &core;
  call->Submit(*device, ref.session_id(), &ref,
               [shared, ref, work = std::move(work)](const session::CallContext& context) {
                 ASSIGN_OR_RETURN(
                     session::SessionManager::Lease lease,
                     shared->sessions->Acquire(ref.session_id(), ref.token(), context.deadline));
                 const int64_t mark = lease.session().mark();
                 absl::Status status = NoThrow([&] { return work(lease, context); });
                 if (!status.ok() || context.cancelled()) lease.session().ForgetSince(mark);
                 return status;
               });
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

void QueuedCall::Submit(int device, std::string key, const te::v1::SessionRef* order,
                        Work work) {
  executor_ = &core_.devices->executor(device);
  session::DeviceExecutor::Call queued;
  queued.key = std::move(key);
  if (order != nullptr) SetCallOrder(*order, &queued);
  queued.deadline = deadline_;
  queued.run = [this, work = std::move(work)](session::DeviceExecutor::Turn turn) {
    Run(std::move(turn), work);
  };
  queued.drop = [this](absl::Status reason) { End(reason); };
  absl::StatusOr<session::DeviceExecutor::Handle> handle = executor_->Submit(std::move(queued));
  if (!handle.ok()) {
    End(handle.status());
    return;
  }
  // gRPC holds OnDone until this handler returns, so `this` is alive here
  // even if the call already ran on a worker.
  bool cancel_now = false;
  {
    absl::MutexLock lock(&mu_);
    handle_ = *handle;
    cancel_now = cancelled_;
  }
  if (cancel_now) executor_->Cancel(*handle, CancelReason(deadline_));
}

void QueuedCall::Run(session::DeviceExecutor::Turn turn, const Work& work) {
  absl::Status status;
  if (Cancelled()) {
    status = CancelReason(deadline_);
  } else {
    session::CallContext call;
    call.deadline = deadline_;
    call.cancelled = [this] { return Cancelled(); };
    status = NoThrow([&] { return work(call); });
  }
  turn.Release();  // the session's next call may start while this one answers
  End(status);
}

bool QueuedCall::Cancelled() const { return cancelled_ || context_->IsCancelled(); }

void QueuedCall::OnCancel() {
  session::DeviceExecutor::Handle handle;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    handle = handle_;
  }
  // Drops the work if it still waits (which finishes the call); a running
  // call sees cancelled_ and is undone when it ends.
  if (handle != nullptr) executor_->Cancel(handle, CancelReason(deadline_));
}

void QueuedCall::End(const absl::Status& status) {
  Finish(core_.Finished(rpc_, session_id_, status, start_));
}

}  // namespace te::service
