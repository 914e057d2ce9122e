// QueuedTurn: one call's place in a device's executor queue, the one way
// every reactor (QueuedCall, PutTensor, GetTensor) routes, submits and
// cancels its work. Thread-safe.
//
// Contract:
//  1. SubmitForSession authenticates the call's SessionRef (without holding
//     the session), and submits it on the session's device under the
//     session's key, in the place SessionRef.sequence gives it; Submit does
//     the same for a key and device of the caller's choosing. On OK exactly
//     one of `run` (on a worker, holding the key's turn) and `drop` (why it
//     never ran: cancelled, deadline, shutdown, a sequence gap) follows; on
//     an error neither does, and the caller ends the call with it.
//  2. Cancel drops the call if it still waits, whichever of Cancel and
//     Submit comes first (a cancel that arrives while Submit runs is applied
//     once the call's handle is known); once the call has started it only
//     marks it cancelled, for `run` to see.
//  3. The deadline of the submitted call is the one given at construction.
//  4. Context is the one answer to "does the client still want this call"
//     every reactor gives the session (CallContext::StillWanted).
#ifndef TE_SERVER_SERVICE_QUEUED_TURN_H_
#define TE_SERVER_SERVICE_QUEUED_TURN_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/service/executor.h"
#include "server/service/service_core.h"
#include "server/session/session.h"
#include "te/v1/service.pb.h"

namespace te::service {

class QueuedTurn {
 public:
  using Run = std::function<void(DeviceExecutor::Turn turn)>;
  using Drop = std::function<void(absl::Status reason)>;

  explicit QueuedTurn(absl::Time deadline) : deadline_(deadline) {}
  QueuedTurn(const QueuedTurn&) = delete;
  QueuedTurn& operator=(const QueuedTurn&) = delete;

  // Contract 1, for a session's call. `ref` is read before this returns.
  absl::Status SubmitForSession(const ServiceCore& core, const te::v1::SessionRef& ref, Run run,
                                Drop drop);
  // Contract 1 under `key` on device `device`; `order` (may be null: none)
  // places it among the key's numbered calls (executor.h, contract 6).
  absl::Status Submit(const ServiceCore& core, int device, std::string key,
                      const te::v1::SessionRef* order, Run run, Drop drop);

  // Contract 2, with CancelReason(deadline) as the reason; from OnCancel.
  void Cancel();
  absl::Time deadline() const { return deadline_; }
  // What the call's work sees of its client (contract 4), valid while this
  // lives: the deadline, and cancelled once Cancel has run or `context` (may
  // be null: the server's own call) says its client cancelled.
  session::CallContext Context(const grpc::CallbackServerContext* context) const;

 private:
  const absl::Time deadline_;
  mutable absl::Mutex mu_;
  DeviceExecutor* executor_ ABSL_GUARDED_BY(mu_) = nullptr;
  DeviceExecutor::Handle handle_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_QUEUED_TURN_H_
