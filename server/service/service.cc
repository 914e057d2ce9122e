#include "server/service/service.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/status_macros.h"
#include "server/service/status.h"
#include "server/session/log.h"
#include "server/session/negotiation.h"

namespace te::service {
namespace {

using session::LogLevel;

absl::Time DeadlineOf(const grpc::ServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// Client mistakes are routine; server faults are not.
LogLevel LevelFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
      return LogLevel::kError;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
      return LogLevel::kWarning;
    default:
      return LogLevel::kInfo;
  }
}

}  // namespace

TeService::TeService(Device* device, session::SessionManager* sessions, ServiceOptions options)
    : device_(device), sessions_(sessions), options_(std::move(options)) {}

grpc::Status TeService::Finish(const char* rpc, const std::string& session_id,
                               const absl::Status& status) {
  if (!status.ok()) {
    const std::string line = absl::StrCat(rpc, " failed: ", status.ToString());
    if (session_id.empty()) {
      session::Log(LevelFor(status.code()), line);
    } else {
      session::LogForSession(LevelFor(status.code()), session_id, line);
    }
  }
  return ToGrpcStatus(status);
}

grpc::Status TeService::WithSession(grpc::ServerContext* context, const te::v1::SessionRef& ref,
                                    const char* rpc,
                                    const std::function<absl::Status(session::Session&)>& call) {
  absl::StatusOr<session::SessionManager::Lease> lease =
      sessions_->Acquire(ref.session_id(), ref.token(), DeadlineOf(*context));
  if (!lease.ok()) return Finish(rpc, ref.session_id(), lease.status());
  if (context->IsCancelled()) {
    return Finish(rpc, ref.session_id(), absl::CancelledError("the client cancelled the call"));
  }
  return Finish(rpc, ref.session_id(), call(lease->session()));
}

grpc::Status TeService::GetServerInfo(grpc::ServerContext*, const te::v1::GetServerInfoRequest*,
                                      te::v1::ServerInfo* response) {
  const DeviceInfo info = device_->info();
  response->set_version(kServerVersion);
  te::v1::DeviceInfo* device = response->add_devices();
  device->set_name(info.name);
  device->set_description(info.description);
  device->set_compute_capability(info.compute_capability);
  device->set_memory_bytes(info.memory_bytes);
  device->set_backend(info.name == "cpu" ? "cpu" : "cuda");
  device->set_healthy(device_->healthy());
  for (te::v1::RecipeKind kind :
       {te::v1::DELAYED_SCALING, te::v1::FLOAT8_CURRENT_SCALING, te::v1::MXFP8_BLOCK_SCALING,
        te::v1::NVFP4_BLOCK_SCALING}) {
    te::v1::RecipeSupport* support = device->add_recipes();
    support->set_kind(kind);
    support->set_support(session::RecipeSupportOn(info, kind));
  }
  response->add_backends("cpu");
  if (CudaBackendBuilt()) response->add_backends("cuda");
  for (te::v1::DType dtype : {te::v1::FLOAT32, te::v1::BFLOAT16, te::v1::FLOAT16,
                              te::v1::FLOAT8_E4M3, te::v1::FLOAT8_E5M2, te::v1::INT32,
                              te::v1::BOOL}) {
    response->add_dtypes(dtype);
  }
  te::v1::Limits* limits = response->mutable_limits();
  limits->set_max_message_bytes(options_.session.max_message_bytes);
  limits->set_max_session_memory_bytes(options_.session.session_memory_bytes);
  limits->set_max_sessions(options_.max_sessions);
  limits->set_max_saved_forwards(options_.session.max_saved_forwards);
  limits->set_max_tensor_bytes(options_.session.max_tensor_bytes);
  limits->set_session_ttl_seconds(options_.session_ttl_seconds);
  te::v1::ServerStats* stats = response->mutable_stats();
  int64_t bytes_in_use = 0;
  for (const auto& session : sessions_->live_session_refs()) bytes_in_use += session->bytes_in_use();
  stats->set_sessions_open(sessions_->live_sessions());
  stats->set_bytes_in_use(bytes_in_use);
  stats->set_sessions_restored(options_.sessions_restored);
  return grpc::Status::OK;
}

grpc::Status TeService::CreateSession(grpc::ServerContext*,
                                      const te::v1::CreateSessionRequest* request,
                                      te::v1::CreateSessionResponse* response) {
  absl::Status status = security::CheckAccessKey(options_.access_key.get(), request->access_key());
  if (status.ok()) {
    status = session::OpenSession(*request, device_, options_.session, sessions_, response);
  }
  if (status.ok()) response->set_server_address(options_.advertise_address);
  return Finish("CreateSession", "", status);
}

grpc::Status TeService::CloseSession(grpc::ServerContext* context,
                                     const te::v1::CloseSessionRequest* request,
                                     te::v1::CloseSessionResponse*) {
  return Finish("CloseSession", request->session().session_id(),
                sessions_->Close(request->session().session_id(), request->session().token(),
                                 DeadlineOf(*context)));
}

grpc::Status TeService::InitLayer(grpc::ServerContext* context,
                                  const te::v1::InitLayerRequest* request,
                                  te::v1::InitLayerResponse* response) {
  return WithSession(context, request->session(), "InitLayer",
                     [&](session::Session& s) { return s.InitLayer(*request, response); });
}

grpc::Status TeService::Forward(grpc::ServerContext* context,
                                const te::v1::ForwardRequest* request,
                                te::v1::ForwardResponse* response) {
  return WithSession(context, request->session(), "Forward",
                     [&](session::Session& s) { return s.Forward(*request, response); });
}

grpc::Status TeService::Backward(grpc::ServerContext* context,
                                 const te::v1::BackwardRequest* request,
                                 te::v1::BackwardResponse* response) {
  return WithSession(context, request->session(), "Backward",
                     [&](session::Session& s) { return s.Backward(*request, response); });
}

grpc::Status TeService::ForwardBackward(grpc::ServerContext* context,
                                        const te::v1::ForwardBackwardRequest* request,
                                        te::v1::ForwardBackwardResponse* response) {
  return WithSession(context, request->session(), "ForwardBackward",
                     [&](session::Session& s) { return s.ForwardBackward(*request, response); });
}

grpc::Status TeService::GetVariables(grpc::ServerContext* context,
                                     const te::v1::GetVariablesRequest* request,
                                     te::v1::GetVariablesResponse* response) {
  return WithSession(context, request->session(), "GetVariables",
                     [&](session::Session& s) { return s.GetVariables(*request, response); });
}

grpc::Status TeService::SetVariables(grpc::ServerContext* context,
                                     const te::v1::SetVariablesRequest* request,
                                     te::v1::SetVariablesResponse*) {
  return WithSession(context, request->session(), "SetVariables",
                     [&](session::Session& s) { return s.SetVariables(*request); });
}

grpc::Status TeService::PutTensor(grpc::ServerContext* context,
                                  grpc::ServerReader<te::v1::PutTensorChunk>* reader,
                                  te::v1::PutTensorResponse* response) {
  te::v1::PutTensorChunk first;
  if (!reader->Read(&first) || first.part_case() != te::v1::PutTensorChunk::kHeader) {
    return Finish("PutTensor", "",
                  absl::InvalidArgumentError("header: the stream's first message must be a header"));
  }
  const te::v1::PutTensorHeader& header = first.header();
  return WithSession(context, header.session(), "PutTensor", [&](session::Session& s) {
    int index = 1;
    auto read_chunk = [&](std::string* chunk) -> absl::StatusOr<bool> {
      te::v1::PutTensorChunk message;
      if (!reader->Read(&message)) {
        if (context->IsCancelled()) return absl::CancelledError("the client cancelled the upload");
        return false;
      }
      ++index;
      if (message.part_case() != te::v1::PutTensorChunk::kData) {
        return absl::InvalidArgumentError(
            absl::StrCat("message ", index, ": only the first message may be a header"));
      }
      *chunk = std::move(*message.mutable_data());
      return true;
    };
    return s.PutTensor(header.tensor(), read_chunk, response);
  });
}

grpc::Status TeService::GetTensor(grpc::ServerContext* context,
                                  const te::v1::GetTensorRequest* request,
                                  grpc::ServerWriter<te::v1::TensorChunk>* writer) {
  // The bytes are copied out in the session's turn; streaming them does not
  // hold the session up.
  session::Session::HostTensor host;
  grpc::Status status =
      WithSession(context, request->session(), "GetTensor", [&](session::Session& s) {
        ASSIGN_OR_RETURN(host, s.GetTensor(*request));
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  te::v1::TensorChunk header;
  *header.mutable_header() = host.header;
  if (!writer->Write(header)) {
    return Finish("GetTensor", request->session().session_id(),
                  absl::CancelledError("the client went away"));
  }
  for (size_t offset = 0; offset < host.bytes.size();
       offset += static_cast<size_t>(host.chunk_bytes)) {
    te::v1::TensorChunk chunk;
    chunk.set_data(host.bytes.substr(offset, static_cast<size_t>(host.chunk_bytes)));
    if (!writer->Write(chunk)) {
      return Finish("GetTensor", request->session().session_id(),
                    absl::CancelledError("the client went away"));
    }
  }
  return grpc::Status::OK;
}

grpc::Status TeService::DeleteTensor(grpc::ServerContext* context,
                                     const te::v1::DeleteTensorRequest* request,
                                     te::v1::DeleteTensorResponse*) {
  return WithSession(context, request->session(), "DeleteTensor",
                     [&](session::Session& s) { return s.DeleteTensor(*request); });
}

grpc::Status TeService::Benchmark(grpc::ServerContext* context,
                                  const te::v1::BenchmarkRequest* request,
                                  te::v1::BenchmarkResponse* response) {
  session::CallContext call;
  call.deadline = DeadlineOf(*context);
  call.cancelled = [context] { return context->IsCancelled(); };
  return WithSession(context, request->session(), "Benchmark", [&](session::Session& s) {
    return s.Benchmark(*request, call, response);
  });
}

grpc::Status TeService::Checkpoint(grpc::ServerContext* context,
                                   const te::v1::CheckpointRequest* request,
                                   te::v1::CheckpointResponse* response) {
  const te::v1::SessionRef& ref = request->session();
  if (options_.checkpoints == nullptr) {
    return Finish("Checkpoint", ref.session_id(),
                  absl::FailedPreconditionError(
                      "this server runs without --state_dir: it cannot save sessions"));
  }
  absl::StatusOr<session::SessionManager::Lease> lease =
      sessions_->Acquire(ref.session_id(), ref.token(), DeadlineOf(*context));
  if (!lease.ok()) return Finish("Checkpoint", ref.session_id(), lease.status());
  absl::StatusOr<session::CheckpointStore::Written> written = options_.checkpoints->Save(*lease);
  if (!written.ok()) return Finish("Checkpoint", ref.session_id(), written.status());
  response->set_path(written->path);
  response->set_bytes(written->bytes);
  return grpc::Status::OK;
}

}  // namespace te::service
