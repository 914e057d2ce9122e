// TeService: the te.v1.TeService gRPC service, on gRPC's callback API. Each
// handler is a thin shim: it authenticates, routes the call to its session's
// device, and queues it on that device's bounded executor (QueuedCall, and
// the reactors of the tensor streams and Generate), where the session layer does the work in the
// session's turn; every call ends through ServiceCore::Finished (the one
// Status -> grpc::Status mapping, the log, the metrics hook). gRPC's threads
// never wait for a session or a device. Thread-safe.
//
// Contract (beyond service.proto's):
//  1. Calls of one session run one at a time, in arrival order; sessions run
//     concurrently, up to --executor_threads per device.
//  2. A device whose queue is full answers RESOURCE_EXHAUSTED at once.
//  3. A call cancelled, or whose deadline passes, while it waits is dropped
//     and frees its place; one whose client goes away while it runs is undone
//     when it ends (its saved forward, resident outputs, partly uploaded
//     tensor are freed).
//  4. CreateSession places a session on the device it names, else on the
//     least-loaded one (fewest sessions, then least memory), and says which.
#ifndef TE_SERVER_SERVICE_SERVICE_H_
#define TE_SERVER_SERVICE_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "server/service/device_pool.h"
#include "server/service/service_core.h"
#include "server/session/session_manager.h"
#include "te/v1/service.grpc.pb.h"

namespace te::service {

inline constexpr char kServerVersion[] = "te_server 0.1.0";

// PutTensor and GetTensor are raw (ByteBuffer) methods, so tensor bytes are
// not copied into and out of protobuf strings.
using TeServiceBase = te::v1::TeService::WithRawCallbackMethod_PutTensor<
    te::v1::TeService::WithRawCallbackMethod_GetTensor<te::v1::TeService::CallbackService>>;
// The raw methods above, by name: their messages are grpc::ByteBuffers to
// whatever sees them as they pass (the byte counters, server/metrics/rpc_bytes.h).
inline constexpr const char* kRawMethods[] = {"PutTensor", "GetTensor"};

class TeService final : public TeServiceBase {
 public:
  // `devices` and `sessions` must outlive the service, and the service must
  // outlive the grpc::Server it is registered with.
  TeService(DevicePool* devices, session::SessionManager* sessions, ServiceOptions options);

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const te::v1::GetServerInfoRequest* request,
                                          te::v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const te::v1::CreateSessionRequest* request,
                                          te::v1::CreateSessionResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const te::v1::CloseSessionRequest* request,
                                         te::v1::CloseSessionResponse* response) override;
  grpc::ServerUnaryReactor* InitLayer(grpc::CallbackServerContext* context,
                                      const te::v1::InitLayerRequest* request,
                                      te::v1::InitLayerResponse* response) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const te::v1::ForwardRequest* request,
                                    te::v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* context,
                                     const te::v1::BackwardRequest* request,
                                     te::v1::BackwardResponse* response) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* context,
                                            const te::v1::ForwardBackwardRequest* request,
                                            te::v1::ForwardBackwardResponse* response) override;
  grpc::ServerUnaryReactor* SetOptimizer(grpc::CallbackServerContext* context,
                                         const te::v1::SetOptimizerRequest* request,
                                         te::v1::SetOptimizerResponse* response) override;
  grpc::ServerUnaryReactor* GetVariables(grpc::CallbackServerContext* context,
                                         const te::v1::GetVariablesRequest* request,
                                         te::v1::GetVariablesResponse* response) override;
  grpc::ServerUnaryReactor* SetVariables(grpc::CallbackServerContext* context,
                                         const te::v1::SetVariablesRequest* request,
                                         te::v1::SetVariablesResponse* response) override;
  grpc::ServerUnaryReactor* AddGraph(grpc::CallbackServerContext* context,
                                     const te::v1::AddGraphRequest* request,
                                     te::v1::AddGraphResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseVersions(grpc::CallbackServerContext* context,
                                            const te::v1::ReleaseVersionsRequest* request,
                                            te::v1::ReleaseVersionsResponse* response) override;
  grpc::ServerUnaryReactor* DeleteLayer(grpc::CallbackServerContext* context,
                                        const te::v1::DeleteLayerRequest* request,
                                        te::v1::DeleteLayerResponse* response) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* PutTensor(grpc::CallbackServerContext* context,
                                                       grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetTensor(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request) override;
  grpc::ServerUnaryReactor* DeleteTensor(grpc::CallbackServerContext* context,
                                         const te::v1::DeleteTensorRequest* request,
                                         te::v1::DeleteTensorResponse* response) override;
  grpc::ServerWriteReactor<te::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const te::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Benchmark(grpc::CallbackServerContext* context,
                                      const te::v1::BenchmarkRequest* request,
                                      te::v1::BenchmarkResponse* response) override;
  grpc::ServerUnaryReactor* RegisterSharedMemory(
      grpc::CallbackServerContext* context, const te::v1::RegisterSharedMemoryRequest* request,
      te::v1::RegisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* UnregisterSharedMemory(
      grpc::CallbackServerContext* context, const te::v1::UnregisterSharedMemoryRequest* request,
      te::v1::UnregisterSharedMemoryResponse* response) override;
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* context,
                                       const te::v1::CheckpointRequest* request,
                                       te::v1::CheckpointResponse* response) override;
  grpc::ServerUnaryReactor* GetSessionInfo(grpc::CallbackServerContext* context,
                                           const te::v1::GetSessionInfoRequest* request,
                                           te::v1::SessionInfo* response) override;

  // What each device holds now (indexed like the DevicePool), for placement,
  // GetServerInfo and the metrics gauges.
  std::vector<DeviceLoad> Loads() const;

  // Saves every live session to options.checkpoints (nothing without one),
  // each as a call in its session's turn on its device's executor, so a call
  // of the session still running ends first. A session whose turn has not
  // come by `deadline` is not saved. Returns how many were saved; failures
  // are logged. For the shutdown, once the server takes no more calls.
  int SaveAllSessions(absl::Time deadline);

 private:
  // Places a new session and counts it as pending on its device until its
  // creation has run (or was never queued): concurrent CreateSessions then
  // see each other's placements instead of all picking the same device,
  // which they would while none is registered yet.
  absl::StatusOr<std::pair<int, std::shared_ptr<void>>> PlaceNewSession(const std::string& requested);

  const ServiceCore core_;
  std::atomic<int64_t> creations_{0};  // executor keys for CreateSession
  mutable std::mutex placement_mu_;
  std::vector<int> pending_creations_;  // per device; guarded by placement_mu_
};

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_SERVICE_H_
