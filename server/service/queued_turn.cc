#include "server/service/queued_turn.h"

#include <utility>

#include "kernels/status_macros.h"

namespace te::service {

absl::Status QueuedTurn::SubmitForSession(const ServiceCore& core, const te::v1::SessionRef& ref,
                                          Run run, Drop drop) {
  ASSIGN_OR_RETURN(const int device, core.Route(ref));
  return Submit(core, device, ref.session_id(), &ref, std::move(run), std::move(drop));
}

absl::Status QueuedTurn::Submit(const ServiceCore& core, int device, std::string key,
                                const te::v1::SessionRef* order, Run run, Drop drop) {
  DeviceExecutor* executor = &core.devices->executor(device);
  DeviceExecutor::Call call;
  call.key = std::move(key);
  if (order != nullptr) SetCallOrder(*order, &call);
  call.deadline = deadline_;
  call.run = std::move(run);
  call.drop = std::move(drop);
  {
    absl::MutexLock lock(&mu_);
    executor_ = executor;
  }
  ASSIGN_OR_RETURN(DeviceExecutor::Handle handle, executor->Submit(std::move(call)));
  // The call may already have started, or even ended, on a worker: the
  // reactor that owns this is kept alive by gRPC until the reaction that
  // called Submit returns, so only the cancel race is left to settle.
  bool cancel_now = false;
  {
    absl::MutexLock lock(&mu_);
    handle_ = handle;
    cancel_now = cancelled_;
  }
  if (cancel_now) executor->Cancel(handle, CancelReason(deadline_));
  return absl::OkStatus();
}

void QueuedTurn::Cancel() {
  DeviceExecutor* executor = nullptr;
  DeviceExecutor::Handle handle;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    executor = executor_;
    handle = handle_;
  }
  // Without a handle yet, Submit applies the cancel once it has one.
  if (handle != nullptr) executor->Cancel(handle, CancelReason(deadline_));
}

session::CallContext QueuedTurn::Context(const grpc::CallbackServerContext* context) const {
  session::CallContext call;
  call.deadline = deadline_;
  call.cancelled = [this, context] {
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return true;
    }
    return context != nullptr && context->IsCancelled();
  };
  return call;
}

}  // namespace te::service
