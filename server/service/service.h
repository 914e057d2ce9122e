// TeService: the te.v1.TeService gRPC service (synchronous API). Each handler
// is a thin shim: authenticate and take the session's turn (SessionManager),
// call the session layer, map the Status once (status.h), log failures with
// the session id. Thread-safe; gRPC calls it from its thread pool.
#ifndef TE_SERVER_SERVICE_SERVICE_H_
#define TE_SERVER_SERVICE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "kernels/ops.h"
#include "server/security/secrets.h"
#include "server/session/checkpoint.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "te/v1/service.grpc.pb.h"

namespace te::service {

inline constexpr char kServerVersion[] = "te_server 0.1.0";

struct ServiceOptions {
  session::SessionConfig session;  // per-session limits
  int max_sessions = 64;
  int64_t session_ttl_seconds = 1800;
  // Security and state (issue 5): CreateSession must carry this key when set;
  // server_address is echoed to clients for session affinity; Checkpoint
  // writes to `checkpoints` (FAILED_PRECONDITION when null: no --state_dir).
  std::shared_ptr<const security::AccessKey> access_key;
  std::string advertise_address;
  session::CheckpointStore* checkpoints = nullptr;
  int sessions_restored = 0;
};

class TeService final : public te::v1::TeService::Service {
 public:
  // `device` and `sessions` must outlive the service.
  TeService(Device* device, session::SessionManager* sessions, ServiceOptions options);

  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const te::v1::GetServerInfoRequest* request,
                             te::v1::ServerInfo* response) override;
  grpc::Status CreateSession(grpc::ServerContext* context,
                             const te::v1::CreateSessionRequest* request,
                             te::v1::CreateSessionResponse* response) override;
  grpc::Status CloseSession(grpc::ServerContext* context,
                            const te::v1::CloseSessionRequest* request,
                            te::v1::CloseSessionResponse* response) override;
  grpc::Status InitLayer(grpc::ServerContext* context, const te::v1::InitLayerRequest* request,
                         te::v1::InitLayerResponse* response) override;
  grpc::Status Forward(grpc::ServerContext* context, const te::v1::ForwardRequest* request,
                       te::v1::ForwardResponse* response) override;
  grpc::Status Backward(grpc::ServerContext* context, const te::v1::BackwardRequest* request,
                        te::v1::BackwardResponse* response) override;
  grpc::Status ForwardBackward(grpc::ServerContext* context,
                               const te::v1::ForwardBackwardRequest* request,
                               te::v1::ForwardBackwardResponse* response) override;
  grpc::Status GetVariables(grpc::ServerContext* context,
                            const te::v1::GetVariablesRequest* request,
                            te::v1::GetVariablesResponse* response) override;
  grpc::Status SetVariables(grpc::ServerContext* context,
                            const te::v1::SetVariablesRequest* request,
                            te::v1::SetVariablesResponse* response) override;
  grpc::Status PutTensor(grpc::ServerContext* context,
                         grpc::ServerReader<te::v1::PutTensorChunk>* reader,
                         te::v1::PutTensorResponse* response) override;
  grpc::Status GetTensor(grpc::ServerContext* context, const te::v1::GetTensorRequest* request,
                         grpc::ServerWriter<te::v1::TensorChunk>* writer) override;
  grpc::Status DeleteTensor(grpc::ServerContext* context,
                            const te::v1::DeleteTensorRequest* request,
                            te::v1::DeleteTensorResponse* response) override;
  grpc::Status Benchmark(grpc::ServerContext* context, const te::v1::BenchmarkRequest* request,
                         te::v1::BenchmarkResponse* response) override;
  grpc::Status Checkpoint(grpc::ServerContext* context, const te::v1::CheckpointRequest* request,
                          te::v1::CheckpointResponse* response) override;

 private:
  // Runs `call` on the session `ref` names, in its turn.
  grpc::Status WithSession(grpc::ServerContext* context, const te::v1::SessionRef& ref,
                           const char* rpc,
                           const std::function<absl::Status(session::Session&)>& call);
  // Logs a failed call and maps its status.
  grpc::Status Finish(const char* rpc, const std::string& session_id, const absl::Status& status);

  Device* const device_;
  session::SessionManager* const sessions_;
  const ServiceOptions options_;
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_SERVICE_H_
