#include "server/service/service.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "server/service/generate_stream.h"
#include "server/service/queued_call.h"
#include "server/service/queued_turn.h"
#include "server/service/status.h"
#include "server/service/tensor_streams.h"
#include "server/session/log.h"
#include "server/session/negotiation.h"

namespace te::service {
namespace {

using session::CallContext;
using session::LogLevel;
using Lease = session::SessionManager::Lease;

}  // namespace

// ---- TeService ----------------------------------------------------------------------

TeService::TeService(DevicePool* devices, session::SessionManager* sessions, ServiceOptions options)
    : core_{devices, sessions, std::move(options)}, pending_creations_(devices->size(), 0) {}

absl::StatusOr<std::pair<int, std::shared_ptr<void>>> TeService::PlaceNewSession(
    const std::string& requested) {
  std::lock_guard<std::mutex> lock(placement_mu_);
  std::vector<DeviceLoad> loads = Loads();
  for (size_t i = 0; i < loads.size(); ++i) loads[i].sessions += pending_creations_[i];
  ASSIGN_OR_RETURN(const int index, core_.devices->Place(requested, loads));
  ++pending_creations_[index];
  // Released when the creation has run, or with the call if it never runs.
  std::shared_ptr<void> pending(nullptr, [this, index](void*) {
    std::lock_guard<std::mutex> release(placement_mu_);
    --pending_creations_[index];
  });
  return std::make_pair(index, std::move(pending));
}

std::vector<DeviceLoad> TeService::Loads() const {
  std::vector<DeviceLoad> loads(core_.devices->size());
  for (const auto& session : core_.sessions->live_session_refs()) {
    const int device = core_.devices->Find(session->device_name());
    if (device < 0) continue;
    ++loads[device].sessions;
    loads[device].bytes_in_use += session->bytes_in_use();
  }
  return loads;
}

int TeService::SaveAllSessions(absl::Time deadline) {
  session::CheckpointStore* store = core_.options.checkpoints;
  if (store == nullptr) return 0;
  // A call of the server's own in each session's turn, as a client's would
  // be (QueuedTurn, RunInSessionTurn), with no client to cancel it.
  struct Save {
    std::string id;
    int device = 0;
    std::unique_ptr<QueuedTurn> queued;
    std::unique_ptr<absl::Notification> done;
    absl::Status status;
  };
  std::vector<Save> saves;
  for (const std::shared_ptr<session::Session>& live : core_.sessions->live_session_refs()) {
    const int found = core_.devices->Find(live->device_name());
    saves.push_back({live->id(), found >= 0 ? found : 0, nullptr, nullptr, absl::OkStatus()});
  }
  // All sessions at once, so one whose call runs long holds up only itself;
  // in waves when they outnumber a device's queue.
  std::vector<Save*> waiting;
  for (Save& save : saves) waiting.push_back(&save);
  while (!waiting.empty()) {
    std::vector<Save*> submitted, refused;
    for (Save* save : waiting) {
      save->queued = std::make_unique<QueuedTurn>(deadline);
      save->done = std::make_unique<absl::Notification>();
      // Both callbacks touch only `save`, which outlives them: every
      // submitted save is waited for below.
      // The deadline bounds when its turn may come (the executor drops it
      // after); once it runs, the save runs to its end.
      auto run = [this, store, save](DeviceExecutor::Turn turn) {
        save->status = RunInSessionTurn(
            core_, "Checkpoint", save->id, /*token=*/nullptr, CallContext(),
            [store](Lease& lease, const CallContext&) { return store->Save(lease).status(); });
        turn.Release();
        save->done->Notify();
      };
      auto drop = [save](absl::Status reason) {
        save->status = std::move(reason);
        save->done->Notify();
      };
      const absl::Status queued =
          save->queued->Submit(core_, save->device, save->id, nullptr, run, drop);
      if (queued.ok()) {
        submitted.push_back(save);
      } else {
        save->status = queued;
        if (absl::IsResourceExhausted(queued)) refused.push_back(save);
      }
    }
    for (Save* save : submitted) {
      // Its turn has until the deadline to come; its work as long as it takes.
      if (!save->done->WaitForNotificationWithDeadline(deadline)) save->queued->Cancel();
      save->done->WaitForNotification();  // dropped by the Cancel, or running
    }
    if (submitted.empty() || absl::Now() >= deadline) break;  // nothing moves any more
    waiting = std::move(refused);
  }
  int saved = 0;
  for (const Save& save : saves) {
    if (save.status.ok()) {
      ++saved;
    } else {
      session::LogForSession(LogLevel::kError, save.id, "checkpoint at shutdown failed",
                             {{"error", save.status.ToString()}});
    }
  }
  return saved;
}

grpc::ServerUnaryReactor* TeService::GetServerInfo(grpc::CallbackServerContext* context,
                                                   const te::v1::GetServerInfoRequest*,
                                                   te::v1::ServerInfo* response) {
  // Answered on gRPC's thread: it reads counters, and never waits.
  const ServiceOptions& options = core_.options;
  const std::vector<DeviceLoad> loads = Loads();
  response->set_version(kServerVersion);
  for (int i = 0; i < core_.devices->size(); ++i) {
    Device& device = core_.devices->device(i);
    const DeviceInfo info = device.info();
    te::v1::DeviceInfo* out = response->add_devices();
    out->set_name(info.name);
    out->set_description(info.description);
    out->set_compute_capability(info.compute_capability);
    out->set_memory_bytes(info.memory_bytes);
    out->set_backend(info.name == "cpu" ? "cpu" : "cuda");
    out->set_healthy(device.healthy());
    for (te::v1::RecipeKind kind : {te::v1::DELAYED_SCALING, te::v1::FLOAT8_CURRENT_SCALING,
                                    te::v1::MXFP8_BLOCK_SCALING, te::v1::NVFP4_BLOCK_SCALING}) {
      te::v1::RecipeSupport* support = out->add_recipes();
      support->set_kind(kind);
      support->set_support(session::RecipeSupportOn(info, kind));
    }
    out->set_sessions(loads[i].sessions);
    out->set_sessions_memory_bytes(loads[i].bytes_in_use);
    out->set_queued_calls(core_.devices->executor(i).queued());
  }
  response->add_backends("cpu");
  if (CudaBackendBuilt()) response->add_backends("cuda");
  for (te::v1::DType dtype :
       {te::v1::FLOAT32, te::v1::BFLOAT16, te::v1::FLOAT16, te::v1::FLOAT8_E4M3,
        te::v1::FLOAT8_E5M2, te::v1::INT32, te::v1::BOOL}) {
    response->add_dtypes(dtype);
  }
  te::v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(options.session.max_message_bytes);
  limits->set_max_session_memory_bytes(options.session.session_memory_bytes);
  limits->set_max_sessions(options.max_sessions);
  limits->set_max_saved_forwards(options.session.max_saved_forwards);
  limits->set_max_tensor_bytes(options.session.max_tensor_bytes);
  limits->set_session_ttl_seconds(options.session_ttl_seconds);
  te::v1::ServerStats* stats = response->mutable_stats();
  int64_t bytes_in_use = 0;
  for (const DeviceLoad& load : loads) bytes_in_use += load.bytes_in_use;
  stats->set_sessions_open(core_.sessions->live_sessions());
  stats->set_bytes_in_use(bytes_in_use);
  stats->set_sessions_restored(options.sessions_restored);
  return QueuedCall::Immediate(core_, context, "GetServerInfo", "", absl::OkStatus());
}

grpc::ServerUnaryReactor* TeService::CreateSession(grpc::CallbackServerContext* context,
                                                   const te::v1::CreateSessionRequest* request,
                                                   te::v1::CreateSessionResponse* response) {
  absl::Status access =
      security::CheckAccessKey(core_.options.access_key.get(), request->access_key());
  if (!access.ok()) return QueuedCall::Immediate(core_, context, "CreateSession", "", access);
  auto placed = PlaceNewSession(request->device());
  if (!placed.ok()) {
    return QueuedCall::Immediate(core_, context, "CreateSession", "", placed.status());
  }
  // Making a session makes a device stream: device work, so it queues on the
  // device's executor like the rest (under a key of its own).
  const int index = placed->first;
  std::shared_ptr<void> pending = std::move(placed->second);
  return QueuedCall::Start(
      core_, context, "CreateSession", "", index, absl::StrCat("create-", creations_.fetch_add(1)),
      nullptr, [this, index, request, response, pending](const CallContext&) mutable -> absl::Status {
        const absl::Status opened = session::OpenSession(*request, &core_.devices->device(index),
                                                         core_.options.session, core_.sessions, response);
        pending.reset();  // registered (or failed): the live count has it now
        RETURN_IF_ERROR(opened);
        // Before the client can know the id: its numbered calls start at 1.
        core_.devices->executor(index).StartSequence(response->session().session_id(), 1);
        response->set_server_address(core_.options.advertise_address);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* TeService::CloseSession(grpc::CallbackServerContext* context,
                                                  const te::v1::CloseSessionRequest* request,
                                                  te::v1::CloseSessionResponse*) {
  const te::v1::SessionRef& ref = request->session();
  absl::StatusOr<int> device = core_.Route(ref);
  if (!device.ok()) {
    return QueuedCall::Immediate(core_, context, "CloseSession", ref.session_id(), device.status());
  }
  // In the session's order: the close waits for the calls queued before it.
  return QueuedCall::Start(core_, context, "CloseSession", ref.session_id(), *device,
                           ref.session_id(), &ref, [this, ref](const CallContext&) {
                             return core_.sessions->Close(ref.session_id(), ref.token());
                           });
}

grpc::ServerUnaryReactor* TeService::InitLayer(grpc::CallbackServerContext* context,
                                               const te::v1::InitLayerRequest* request,
                                               te::v1::InitLayerResponse* response) {
  return QueuedCall::OnSession(core_, context, "InitLayer", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().InitLayer(*request, response, call);
                               });
}

grpc::ServerUnaryReactor* TeService::Forward(grpc::CallbackServerContext* context,
                                             const te::v1::ForwardRequest* request,
                                             te::v1::ForwardResponse* response) {
  return QueuedCall::OnSession(core_, context, "Forward", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().Forward(*request, response, call);
                               });
}

grpc::ServerUnaryReactor* TeService::Backward(grpc::CallbackServerContext* context,
                                              const te::v1::BackwardRequest* request,
                                              te::v1::BackwardResponse* response) {
  return QueuedCall::OnSession(core_, context, "Backward", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().Backward(*request, response, call);
                               });
}

grpc::ServerUnaryReactor* TeService::ForwardBackward(grpc::CallbackServerContext* context,
                                                     const te::v1::ForwardBackwardRequest* request,
                                                     te::v1::ForwardBackwardResponse* response) {
  return QueuedCall::OnSession(core_, context, "ForwardBackward", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().ForwardBackward(*request, response, call);
                               });
}

grpc::ServerUnaryReactor* TeService::SetOptimizer(grpc::CallbackServerContext* context,
                                                  const te::v1::SetOptimizerRequest* request,
                                                  te::v1::SetOptimizerResponse* response) {
  return QueuedCall::OnSession(core_, context, "SetOptimizer", request->session(),
                               [request, response](Lease& lease, const CallContext&) {
                                 return lease.session().SetOptimizer(*request, response);
                               });
}

grpc::ServerUnaryReactor* TeService::GetVariables(grpc::CallbackServerContext* context,
                                                  const te::v1::GetVariablesRequest* request,
                                                  te::v1::GetVariablesResponse* response) {
  return QueuedCall::OnSession(core_, context, "GetVariables", request->session(),
                               [request, response](Lease& lease, const CallContext&) {
                                 return lease.session().GetVariables(*request, response);
                               });
}

grpc::ServerUnaryReactor* TeService::SetVariables(grpc::CallbackServerContext* context,
                                                  const te::v1::SetVariablesRequest* request,
                                                  te::v1::SetVariablesResponse* response) {
  return QueuedCall::OnSession(core_, context, "SetVariables", request->session(),
                               [request, response](Lease& lease, const CallContext&) {
                                 return lease.session().SetVariables(*request, response);
                               });
}

grpc::ServerUnaryReactor* TeService::AddGraph(grpc::CallbackServerContext* context,
                                              const te::v1::AddGraphRequest* request,
                                              te::v1::AddGraphResponse* response) {
  return QueuedCall::OnSession(core_, context, "AddGraph", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().AddGraph(*request, response, call);
                               });
}

grpc::ServerUnaryReactor* TeService::ReleaseVersions(grpc::CallbackServerContext* context,
                                                     const te::v1::ReleaseVersionsRequest* request,
                                                     te::v1::ReleaseVersionsResponse*) {
  return QueuedCall::OnSession(core_, context, "ReleaseVersions", request->session(),
                               [request](Lease& lease, const CallContext&) {
                                 return lease.session().ReleaseVersions(*request);
                               });
}

grpc::ServerUnaryReactor* TeService::DeleteLayer(grpc::CallbackServerContext* context,
                                                 const te::v1::DeleteLayerRequest* request,
                                                 te::v1::DeleteLayerResponse*) {
  return QueuedCall::OnSession(core_, context, "DeleteLayer", request->session(),
                               [request](Lease& lease, const CallContext&) {
                                 return lease.session().DeleteLayer(*request);
                               });
}

grpc::ServerReadReactor<grpc::ByteBuffer>* TeService::PutTensor(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return StartPutTensor(core_, context, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* TeService::GetTensor(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return StartGetTensor(core_, context, request);
}

grpc::ServerUnaryReactor* TeService::DeleteTensor(grpc::CallbackServerContext* context,
                                                  const te::v1::DeleteTensorRequest* request,
                                                  te::v1::DeleteTensorResponse*) {
  return QueuedCall::OnSession(core_, context, "DeleteTensor", request->session(),
                               [request](Lease& lease, const CallContext&) {
                                 return lease.session().DeleteTensor(*request);
                               });
}

grpc::ServerWriteReactor<te::v1::GenerateResponse>* TeService::Generate(
    grpc::CallbackServerContext* context, const te::v1::GenerateRequest* request) {
  return StartGenerate(core_, context, request);
}

grpc::ServerUnaryReactor* TeService::Benchmark(grpc::CallbackServerContext* context,
                                               const te::v1::BenchmarkRequest* request,
                                               te::v1::BenchmarkResponse* response) {
  return QueuedCall::OnSession(core_, context, "Benchmark", request->session(),
                               [request, response](Lease& lease, const CallContext& call) {
                                 return lease.session().Benchmark(*request, call, response);
                               });
}

grpc::ServerUnaryReactor* TeService::RegisterSharedMemory(
    grpc::CallbackServerContext* context, const te::v1::RegisterSharedMemoryRequest* request,
    te::v1::RegisterSharedMemoryResponse* response) {
  return QueuedCall::OnSession(core_, context, "RegisterSharedMemory", request->session(),
                               [request, response](Lease& lease, const CallContext&) {
                                 return lease.session().RegisterSharedMemory(*request, response);
                               });
}

grpc::ServerUnaryReactor* TeService::UnregisterSharedMemory(
    grpc::CallbackServerContext* context, const te::v1::UnregisterSharedMemoryRequest* request,
    te::v1::UnregisterSharedMemoryResponse*) {
  return QueuedCall::OnSession(core_, context, "UnregisterSharedMemory", request->session(),
                               [request](Lease& lease, const CallContext&) {
                                 return lease.session().UnregisterSharedMemory(*request);
                               });
}

grpc::ServerUnaryReactor* TeService::Checkpoint(grpc::CallbackServerContext* context,
                                                const te::v1::CheckpointRequest* request,
                                                te::v1::CheckpointResponse* response) {
  const te::v1::SessionRef& ref = request->session();
  if (core_.options.checkpoints == nullptr) {
    return QueuedCall::Immediate(
        core_, context, "Checkpoint", ref.session_id(),
        absl::FailedPreconditionError(
            "this server runs without --state_dir: it cannot save sessions"));
  }
  session::CheckpointStore* store = core_.options.checkpoints;
  return QueuedCall::OnSession(core_, context, "Checkpoint", ref,
                               [store, response](Lease& lease, const CallContext&) -> absl::Status {
                                 ASSIGN_OR_RETURN(session::CheckpointStore::Written written,
                                                  store->Save(lease));
                                 response->set_path(written.path);
                                 response->set_bytes(written.bytes);
                                 return absl::OkStatus();
                               });
}

grpc::ServerUnaryReactor* TeService::GetSessionInfo(grpc::CallbackServerContext* context,
                                                    const te::v1::GetSessionInfoRequest* request,
                                                    te::v1::SessionInfo* response) {
  return QueuedCall::OnSession(core_, context, "GetSessionInfo", request->session(),
                               [response](Lease& lease, const CallContext&) {
                                 lease.session().GetSessionInfo(response);
                                 return absl::OkStatus();
                               });
}

}  // namespace te::service
