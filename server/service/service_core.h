// The service core: what every call's reactor needs from the service (the
// devices and their executors, the sessions, the options), the routing of a
// call to its session's device, its place in the session's order, the one
// way work runs in a session's turn (RunInSessionTurn), and the one way a
// call ends (Finished). Defined in service_core.cc, which calls nothing of
// the reactors that include it. Internal to server/service.
#ifndef TE_SERVER_SERVICE_SERVICE_CORE_H_
#define TE_SERVER_SERVICE_SERVICE_CORE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/security/secrets.h"
#include "server/service/device_pool.h"
#include "server/service/executor.h"
#include "server/session/checkpoint.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "te/v1/service.pb.h"

namespace te::service {

struct ServiceOptions {
  session::SessionConfig session;  // per-session limits
  int max_sessions = 64;
  int64_t session_ttl_seconds = 1800;
  // Security and state: CreateSession must carry this key when set;
  // server_address is echoed to clients for session affinity; Checkpoint
  // writes to `checkpoints` (FAILED_PRECONDITION when null: no --state_dir).
  std::shared_ptr<const security::AccessKey> access_key;
  std::string advertise_address;
  session::CheckpointStore* checkpoints = nullptr;
  int sessions_restored = 0;
  // Told of every finished call (metrics); may be empty. Runs on gRPC's or
  // the executors' threads, so it must be thread-safe and quick.
  std::function<void(absl::string_view method, absl::StatusCode code, absl::Duration latency)>
      on_finished;
};

struct ServiceCore {
  DevicePool* devices;
  session::SessionManager* sessions;
  ServiceOptions options;

  // Logs a failed call with its session, tells on_finished, and maps the
  // status (status.h): every call ends through here.
  grpc::Status Finished(const char* rpc, const std::string& session_id, const absl::Status& status,
                        absl::Time start) const;
  // Authenticates `ref` (without its turn) and names the device its session
  // runs on.
  absl::StatusOr<int> Route(const te::v1::SessionRef& ref) const;
};

// Puts `ref`'s place in its session's order (sequence, abandoned,
// first_unanswered) into `call` (executor.h, contract 6).
void SetCallOrder(const te::v1::SessionRef& ref, DeviceExecutor::Call* call);

// The call's deadline (InfiniteFuture when it has none).
absl::Time DeadlineOf(const grpc::CallbackServerContext& context);
// Why a call ends early: its deadline passed, or its client cancelled it.
absl::Status CancelReason(absl::Time deadline);

// Work in a session's turn, with the session's lease and the call's context.
using SessionWork = std::function<absl::Status(session::SessionManager::Lease& lease,
                                               const session::CallContext& call)>;

// A call's hold on its session during its turn (session.h, contract 6).
// Enter takes the session's lease and opens the session's record of the
// call; Leave closes it, undoing what the call created unless the call
// succeeded and its client still waits for the answer, and returns the
// call's status (the reason it is no longer wanted, for a success nobody
// waits for). Destroyed without Leave, the call is undone. The caller holds
// the session's executor turn throughout.
// The least of a call's deadline its answer is given to travel back: a
// call that ends with less left is undone and answered DEADLINE_EXCEEDED
// (SessionTurn::Leave), since its client may have stopped waiting by the
// time the answer arrives.
inline constexpr absl::Duration kAnswerTime = absl::Milliseconds(10);

class SessionTurn {
 public:
  // `token`: the client's, checked (SessionManager::Acquire); null for the
  // server's own call (the save at shutdown).
  static absl::StatusOr<SessionTurn> Enter(const ServiceCore& core, const std::string& session_id,
                                           const std::string* token);
  SessionTurn(SessionTurn&& other) noexcept : lease_(std::move(other.lease_)) {
    other.lease_.reset();
  }
  SessionTurn& operator=(SessionTurn&&) = delete;
  ~SessionTurn();

  session::SessionManager::Lease& lease() { return *lease_; }
  session::Session& session() { return lease_->session(); }
  absl::Status Leave(absl::Status status, const session::CallContext& call, const char* rpc);

 private:
  explicit SessionTurn(session::SessionManager::Lease lease) : lease_(std::move(lease)) {}
  std::optional<session::SessionManager::Lease> lease_;  // empty once left
};

// The one way work runs in a session's turn, for every call that runs there
// (the unary calls, both tensor streams, Generate, the save at shutdown):
// nothing runs for a call no longer wanted; else `work` runs with no
// exception escaping (NoThrow), inside a SessionTurn. The caller holds the
// session's executor turn.
absl::Status RunInSessionTurn(const ServiceCore& core, const char* rpc,
                              const std::string& session_id, const std::string* token,
                              const session::CallContext& call, const SessionWork& work);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_SERVICE_CORE_H_
