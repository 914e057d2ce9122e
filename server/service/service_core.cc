#include "server/service/service_core.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/service/status.h"
#include "server/session/log.h"

namespace te::service {
namespace {

using session::LogLevel;

// Client mistakes are routine; server faults are not.
LogLevel LevelFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss: return LogLevel::kError;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable: return LogLevel::kWarning;
    default: return LogLevel::kInfo;
  }
}

}  // namespace

void SetCallOrder(const te::v1::SessionRef& ref, DeviceExecutor::Call* call) {
  call->sequence = ref.sequence();
  call->abandoned.assign(ref.abandoned().begin(), ref.abandoned().end());
  call->first_unanswered = ref.first_unanswered();
}

absl::Time DeadlineOf(const grpc::CallbackServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

absl::Status CancelReason(absl::Time deadline) {
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("the call's deadline passed before it ran to its end");
  }
  return absl::CancelledError("the client cancelled the call");
}

grpc::Status ServiceCore::Finished(const char* rpc, const std::string& session_id,
                                   const absl::Status& status, absl::Time start) const {
  if (!status.ok()) {
    const std::string line = absl::StrCat(rpc, " failed: ", status.ToString());
    if (session_id.empty()) {
      session::Log(LevelFor(status.code()), line);
    } else {
      session::LogForSession(LevelFor(status.code()), session_id, line);
    }
  }
  if (options.on_finished) options.on_finished(rpc, status.code(), absl::Now() - start);
  return ToGrpcStatus(status);
}

absl::StatusOr<int> ServiceCore::Route(const te::v1::SessionRef& ref) const {
  ASSIGN_OR_RETURN(std::shared_ptr<session::Session> session,
                   sessions->Authenticate(ref.session_id(), ref.token()));
  const int device = devices->Find(session->device_name());
  // A session restored onto a device this server no longer lists still has
  // to run somewhere.
  return device >= 0 ? device : 0;
}

// ---- the session's turn ----------------------------------------------------------------

absl::StatusOr<SessionTurn> SessionTurn::Enter(const ServiceCore& core,
                                               const std::string& session_id,
                                               const std::string* token) {
  ASSIGN_OR_RETURN(session::SessionManager::Lease lease,
                   token != nullptr ? core.sessions->Acquire(session_id, *token)
                                    : core.sessions->AcquireForServer(session_id));
  lease.session().BeginCall();
  return SessionTurn(std::move(lease));
}

SessionTurn::~SessionTurn() {
  if (lease_) lease_->session().EndCall(/*undo=*/true);
}

absl::Status SessionTurn::Leave(absl::Status status, const session::CallContext& call,
                                const char* rpc) {
  // Its client may have gone while it ran: then nobody sees the answer, and
  // the call is undone as a failed one is.
  if (status.ok()) status = call.StillWanted(rpc);
  // An answer sent in its deadline's last moments can reach the client after
  // it stopped waiting, and the client then cannot name what the call made
  // (a Forward's resident output): such a call is undone and answered
  // DEADLINE_EXCEEDED, so the client's view and the session's agree.
  if (status.ok() && call.deadline - absl::Now() < kAnswerTime) {
    status = absl::DeadlineExceededError(absl::StrCat(
        rpc, ": ended with less than ", absl::FormatDuration(kAnswerTime),
        " of its deadline left for the answer to reach the client; undone"));
  }
  if (status.ok() && call.answer_ids != nullptr) {
    *call.answer_ids = lease_->session().CallAnswerIds();
  }
  lease_->session().EndCall(/*undo=*/!status.ok());
  lease_.reset();
  return status;
}

absl::Status RunInSessionTurn(const ServiceCore& core, const char* rpc,
                              const std::string& session_id, const std::string* token,
                              const session::CallContext& call, const SessionWork& work) {
  RETURN_IF_ERROR(call.StillWanted(rpc));
  ASSIGN_OR_RETURN(SessionTurn turn, SessionTurn::Enter(core, session_id, token));
  absl::Status status = NoThrow([&] { return work(turn.lease(), call); });
  return turn.Leave(std::move(status), call, rpc);
}

}  // namespace te::service
