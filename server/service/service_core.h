// What every call's reactor needs from the service: the devices and their
// executors, the sessions, the options, and the one way a call ends. Internal
// to server/service.
#ifndef TE_SERVER_SERVICE_SERVICE_CORE_H_
#define TE_SERVER_SERVICE_SERVICE_CORE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/security/secrets.h"
#include "server/service/device_pool.h"
#include "server/session/checkpoint.h"
#include "server/session/executor.h"
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

// Puts `ref`'s place in its session's order (sequence, abandoned) into
// `call` (executor.h, contract 6).
void SetCallOrder(const te::v1::SessionRef& ref, session::DeviceExecutor::Call* call);

// The call's deadline (InfiniteFuture when it has none).
absl::Time DeadlineOf(const grpc::CallbackServerContext& context);
// Why a call ends early: its deadline passed, or its client cancelled it.
absl::Status CancelReason(absl::Time deadline);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_SERVICE_CORE_H_
