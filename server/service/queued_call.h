// QueuedCall: the reactor of every unary RPC that does work. The work runs on
// a device's executor (executor.h); gRPC's threads only hand it over.
//
// Contract:
//  1. The call finishes with its work's status, or earlier: RESOURCE_EXHAUSTED
//     at once when the executor's queue is full; CANCELLED or
//     DEADLINE_EXCEEDED when its client cancels it or its deadline passes
//     before the work starts (its place in the queue is then free at once).
//  2. A session call (OnSession) is authenticated before it queues, queues
//     behind the session's earlier calls on the session's device (in the
//     order of SessionRef.sequence when the client numbers them), runs in
//     the session's turn (RunInSessionTurn), and is undone when it fails
//     or its client has gone by the time it ends: a cancelled Forward leaves
//     no saved forward and no resident output behind. A session call that
//     ended well but whose answer never reached its client (its deadline
//     passed while the answer was on its way: gRPC reports the call
//     cancelled once done) made ids nobody can name: the session forgets
//     them in a turn of its own after the call (Session::ForgetUnanswered).
#ifndef TE_SERVER_SERVICE_QUEUED_CALL_H_
#define TE_SERVER_SERVICE_QUEUED_CALL_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/service/executor.h"
#include "server/service/queued_turn.h"
#include "server/service/service_core.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "te/v1/service.pb.h"

namespace te::service {

class QueuedCall final : public grpc::ServerUnaryReactor {
 public:
  using Work = std::function<absl::Status(const session::CallContext& call)>;

  // Runs `work` on device `device`'s executor under `key` (contract 1), in
  // the place `order` gives it among the key's numbered calls (null: none;
  // executor.h, contract 6). `session_id` is for the log ("" for none).
  static grpc::ServerUnaryReactor* Start(const ServiceCore& core,
                                         grpc::CallbackServerContext* context, const char* rpc,
                                         std::string session_id, int device, std::string key,
                                         const te::v1::SessionRef* order, Work work);
  // Runs `work` in the turn of the session `ref` names (contract 2).
  static grpc::ServerUnaryReactor* OnSession(const ServiceCore& core,
                                             grpc::CallbackServerContext* context, const char* rpc,
                                             const te::v1::SessionRef& ref, SessionWork work);
  // A call that ends at once with `status`: refused before it queues, or
  // answered without any device work (GetServerInfo).
  static grpc::ServerUnaryReactor* Immediate(const ServiceCore& core,
                                             grpc::CallbackServerContext* context, const char* rpc,
                                             const std::string& session_id,
                                             const absl::Status& status);

  void OnCancel() override;
  void OnDone() override;

 private:
  QueuedCall(const ServiceCore& core, grpc::CallbackServerContext* context, const char* rpc,
             std::string session_id);
  // The executor's callbacks for `work` (QueuedTurn's contract 1).
  QueuedTurn::Run RunFor(Work work);
  QueuedTurn::Drop DropFor();
  void Run(DeviceExecutor::Turn turn, const Work& work);
  // Finishes the call; `this` may be gone when it returns.
  void End(const absl::Status& status);

  const ServiceCore& core_;
  grpc::CallbackServerContext* const context_;
  const char* const rpc_;
  const std::string session_id_;
  const absl::Time start_;
  QueuedTurn queued_;
  // A session call's session (its sequence cleared), and the ids its answer
  // names once it has ended well (contract 2).
  std::optional<te::v1::SessionRef> session_ref_;
  std::shared_ptr<std::vector<std::string>> answer_ids_ =
      std::make_shared<std::vector<std::string>>();
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_QUEUED_CALL_H_
