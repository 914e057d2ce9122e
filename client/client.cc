#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"

namespace te::client {

const char kAffinityHeader[] = "x-te-session";

namespace {

te::v1::NegotiationPolicy PolicyToProto(NegotiationPolicy policy) {
  switch (policy) {
    case NegotiationPolicy::kStrict: return te::v1::STRICT;
    case NegotiationPolicy::kFallback: return te::v1::FALLBACK;
    case NegotiationPolicy::kEmulate: return te::v1::EMULATE;
  }
  return te::v1::NEGOTIATION_POLICY_UNSPECIFIED;
}

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout);
}

absl::StatusOr<std::string> ReadPemFile(const char* option, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(absl::StrCat("ClientOptions.", option, " = ", path,
                                                      ": cannot be read"));
  }
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

// Plaintext, TLS or mutual TLS, as `options` ask.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> CredentialsFor(
    const ClientOptions& options) {
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "ClientOptions.tls_cert_file and tls_key_file: give both (mutual TLS) or neither");
  }
  if (options.tls_root_ca_file.empty() && options.tls_cert_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_root_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadPemFile("tls_root_ca_file", options.tls_root_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPemFile("tls_cert_file", options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadPemFile("tls_key_file", options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

// Both the balancer's channel and a pinned replica's: same limits, same TLS
// name check.
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                                          const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  return grpc::CreateCustomChannel(address, credentials, args);
}

// 128 random bits in hex: unique across clients without coordination, so a
// ring hash spreads sessions evenly.
std::string NewAffinityKey() {
  std::random_device device;
  std::string key;
  for (int i = 0; i < 4; ++i) key += absl::StrCat(absl::Hex(device(), absl::kZeroPad8));
  return key;
}

void SetAffinityHeader(grpc::ClientContext* context, const std::string& affinity_key) {
  context->AddMetadata(kAffinityHeader, affinity_key);
}

// Waits up to `timeout` for `channel` to connect. UNAVAILABLE naming the
// address: at once when an attempt fails (nothing listening, an unknown host,
// a refused TLS handshake), with gRPC's reason; after `timeout` when attempts
// hang.
absl::Status WaitConnected(const std::shared_ptr<grpc::Channel>& channel, const std::string& address,
                           absl::Duration timeout) {
  const auto deadline = DeadlineAfter(timeout);
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY && state != GRPC_CHANNEL_TRANSIENT_FAILURE &&
         state != GRPC_CHANNEL_SHUTDOWN) {
    if (!channel->WaitForStateChange(state, deadline)) {
      return absl::UnavailableError(absl::StrCat("no te_server answered at ", address, " within ",
                                                 absl::FormatDuration(timeout),
                                                 " (ClientOptions::connect_timeout)"));
    }
    state = channel->GetState(/*try_to_connect=*/true);
  }
  if (state == GRPC_CHANNEL_READY) return absl::OkStatus();
  // The attempt failed: a call that does not wait for the channel fails at
  // once, with gRPC's reason.
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(std::min(timeout, absl::Seconds(5))));
  te::v1::ServerInfo info;
  const grpc::Status status =
      te::v1::TeService::NewStub(channel)->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
  if (status.ok()) return absl::OkStatus();  // it connected after all
  if (absl::StrContains(absl::AsciiStrToLower(status.error_message()), "refused")) {
    return absl::UnavailableError(absl::StrCat("connection refused at ", address,
                                               ": nothing listens there (is te_server running, on that port?); "
                                               "gRPC: ",
                                               status.error_message()));
  }
  return absl::UnavailableError(absl::StrCat("cannot connect to te_server at ", address, ": ",
                                             status.error_message()));
}

// The codes of a call that ended at the client without the server's answer:
// it may never have reached the server (SessionRef.abandoned).
bool Unanswered(grpc::StatusCode code) {
  return code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::CANCELLED ||
         code == grpc::StatusCode::UNAVAILABLE;
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode share their numbering.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// ---- Client -------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& address,
                                                        const ClientOptions& options) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = CredentialsFor(options);
  if (!credentials.ok()) return credentials.status();
  std::shared_ptr<grpc::Channel> channel = NewChannel(address, *credentials, options);
  absl::Status connected = WaitConnected(channel, address, options.connect_timeout);
  if (!connected.ok()) return connected;
  return std::unique_ptr<Client>(
      new Client(address, *credentials, te::v1::TeService::NewStub(channel), options));
}

std::shared_ptr<te::v1::TeService::Stub> Client::PinnedStub(const std::string& address) {
  absl::MutexLock lock(&pinned_mu_);
  std::shared_ptr<te::v1::TeService::Stub>& stub = pinned_stubs_[address];
  if (stub == nullptr) stub = te::v1::TeService::NewStub(NewChannel(address, credentials_, options_));
  return stub;
}

absl::StatusOr<te::v1::ServerInfo> Client::GetServerInfo() {
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(options_.rpc_timeout));
  te::v1::ServerInfo info;
  absl::Status status = FromGrpcStatus(stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info));
  if (!status.ok()) return status;
  return info;
}

absl::StatusOr<std::unique_ptr<Session>> Client::CreateSession(const SessionOptions& options) {
  te::v1::CreateSessionRequest request;
  for (const Recipe& recipe : options.recipes) *request.add_preferred_recipes() = ToProto(recipe);
  request.set_policy(PolicyToProto(options.policy));
  request.set_device(options.device);
  request.set_ttl_seconds(absl::ToInt64Seconds(options.ttl));
  request.set_access_key(options_.access_key);
  // The key exists before the session does: CreateSession itself must reach
  // the replica that the balancer will send the session's later calls to.
  std::string affinity_key = options.affinity_key.empty() ? NewAffinityKey() : options.affinity_key;
  grpc::ClientContext context;
  context.set_deadline(DeadlineAfter(options_.rpc_timeout));
  SetAffinityHeader(&context, affinity_key);
  te::v1::CreateSessionResponse response;
  absl::Status status = FromGrpcStatus(stub_->CreateSession(&context, request, &response));
  if (!status.ok()) return status;
  std::shared_ptr<te::v1::TeService::Stub> stub = stub_;
  std::string pinned_address;
  if (options_.pin_to_replica && !response.server_address().empty() &&
      response.server_address() != address_) {
    pinned_address = response.server_address();
    stub = PinnedStub(pinned_address);
  }
  return std::unique_ptr<Session>(new Session(std::move(stub), options_, response,
                                              options.transport.value_or(options_.transport),
                                              std::move(affinity_key), std::move(pinned_address)));
}

// ---- Session ------------------------------------------------------------------

Session::Session(std::shared_ptr<te::v1::TeService::Stub> stub, ClientOptions options,
                 const te::v1::CreateSessionResponse& created, Transport transport,
                 std::string affinity_key, std::string pinned_address)
    : stub_(std::move(stub)),
      options_(std::move(options)),
      affinity_key_(std::move(affinity_key)),
      pinned_address_(std::move(pinned_address)),
      ref_(created.session()),
      id_(created.session().session_id()),
      device_(created.device()),
      emulated_(created.emulated()),
      negotiation_(created.negotiation()),
      ttl_(absl::Seconds(created.ttl_seconds())),
      transport_(transport),
      shm_([this](const std::string& name, uint64_t size) { return RegisterRegion(name, size); },
           options_.shm_region_bytes) {
  if (created.has_recipe()) {
    absl::StatusOr<Recipe> recipe = FromProto(created.recipe());
    if (recipe.ok()) recipe_ = *std::move(recipe);
  }
  absl::MutexLock lock(&link_->mu_);
  link_->session_ = this;
}

Session::~Session() {
  {
    // No release starts once the Session is going (Link::ReleaseVersion).
    absl::MutexLock lock(&link_->mu_);
    link_->session_ = nullptr;
  }
  // The close is numbered after every Async call, so the server answers those first.
  Close().IgnoreError();
  absl::MutexLock lock(&async_mu_);
  if (!async_mu_.AwaitWithTimeout(absl::Condition(this, &Session::NoAsyncCalls), absl::Seconds(10))) {
    // Under the lock: a call's thread leaves in_flight_ (under it) before its
    // context goes, so every context here is alive.
    for (grpc::ClientContext* context : in_flight_) context->TryCancel();
  }
  async_mu_.Await(absl::Condition(this, &Session::NoAsyncCalls));
}

te::v1::SessionRef Session::NextRef() {
  te::v1::SessionRef ref = ref_;
  absl::MutexLock lock(&order_mu_);
  ref.set_sequence(next_sequence_++);
  // Every abandoned number was given out before this one: all are below it.
  for (uint64_t lost : abandoned_) ref.add_abandoned(lost);
  in_flight_numbers_.insert(ref.sequence());
  ref.set_first_unanswered(*in_flight_numbers_.begin());
  return ref;
}

void Session::PrepareContext(grpc::ClientContext* context, absl::Duration timeout) const {
  context->set_deadline(DeadlineAfter(std::min(options_.rpc_timeout, timeout)));
  SetAffinityHeader(context, affinity_key_);
}

absl::Status Session::CallStatus(uint64_t sequence, const grpc::Status& status) {
  {
    absl::MutexLock lock(&order_mu_);
    in_flight_numbers_.erase(sequence);
    if (Unanswered(status.error_code())) {
      abandoned_.insert(sequence);
    } else {
      // The server got to this call, so it waits for no lower number: each
      // arrived, was named abandoned, or was skipped.
      abandoned_.erase(abandoned_.begin(), abandoned_.lower_bound(sequence));
    }
  }
  if (pinned_address_.empty() || status.error_code() != grpc::StatusCode::UNAVAILABLE) {
    return FromGrpcStatus(status);
  }
  return absl::UnavailableError(absl::StrCat("session ", id_, " is pinned to replica ",
                                             pinned_address_, " (CreateSession's server_address): ",
                                             status.error_message()));
}

absl::Status Session::Close() {
  if (closed_.exchange(true)) return absl::OkStatus();
  te::v1::CloseSessionRequest request;
  grpc::ClientContext context;
  // Closing should not hold a destructor for the full RPC timeout.
  PrepareContext(&context, absl::Seconds(10));
  *request.mutable_session() = NextRef();
  te::v1::CloseSessionResponse response;
  return CallStatus(request.session().sequence(),
                    stub_->CloseSession(&context, request, &response));
}

absl::StatusOr<ResidentTensor> Session::Put(const HostTensor& tensor) {
  // A stream or shared memory: Put makes a resident tensor, never an inline one.
  if (TransportFor(tensor.bytes().size()) == Transport::kSharedMemory) {
    absl::StatusOr<SharedMemoryPool::Block> block = shm_.Allocate(tensor.bytes().size());
    if (block.ok()) {
      absl::StatusOr<ResidentTensor> put = PutShared(tensor, *block);
      shm_.Free(*block);
      return put;
    }
    if (transport_ == Transport::kSharedMemory) return block.status();
  }
  return PutStreamed(tensor);
}

absl::StatusOr<ResidentTensor> Session::PutStreamed(const HostTensor& tensor) {
  ++counts_.streamed_tensors;
  grpc::ClientContext context;
  PrepareContext(&context);
  te::v1::PutTensorResponse response;
  std::unique_ptr<grpc::ClientWriter<te::v1::PutTensorChunk>> writer = stub_->PutTensor(&context, &response);
  te::v1::PutTensorChunk chunk;
  te::v1::PutTensorHeader* header = chunk.mutable_header();
  header->mutable_tensor()->set_dtype(DTypeToProto(tensor.dtype()));
  for (int64_t d : tensor.shape()) header->mutable_tensor()->add_shape(d);
  *header->mutable_session() = NextRef();
  const uint64_t sequence = header->session().sequence();
  bool open = writer->Write(chunk);
  const std::string& bytes = tensor.bytes();
  const size_t step = std::max<size_t>(options_.chunk_bytes, 1);
  for (size_t offset = 0; open && offset < bytes.size(); offset += step) {
    chunk.Clear();
    chunk.set_data(bytes.substr(offset, step));
    open = writer->Write(chunk);
  }
  // A failed Write means the server ended the stream; Finish has its status.
  writer->WritesDone();
  absl::Status status = CallStatus(sequence, writer->Finish());
  if (!status.ok()) return status;
  return ResidentTensor{response.tensor_id(), tensor.dtype(), tensor.shape()};
}

absl::StatusOr<HostTensor> Session::Get(const std::string& tensor_id) {
  ++counts_.streamed_tensors;
  te::v1::GetTensorRequest request;
  request.set_tensor_id(tensor_id);
  request.set_chunk_bytes(static_cast<int32_t>(options_.chunk_bytes));
  grpc::ClientContext context;
  PrepareContext(&context);
  *request.mutable_session() = NextRef();
  std::unique_ptr<grpc::ClientReader<te::v1::TensorChunk>> reader = stub_->GetTensor(&context, request);
  te::v1::TensorChunk chunk;
  te::v1::TensorHeader header;
  bool have_header = false;
  std::string bytes;
  while (reader->Read(&chunk)) {
    if (chunk.has_header()) {
      header = chunk.header();
      have_header = true;
      // Reserve for the announced size, but trust it only within reason: the
      // bytes that arrive are checked against the header below anyway.
      absl::StatusOr<DType> dtype = DTypeFromProto(header.dtype(), "GetTensor header.dtype");
      const int64_t n = NumElements(Shape(header.shape().begin(), header.shape().end()));
      if (dtype.ok() && n > 0 && n <= (int64_t{1} << 32)) bytes.reserve(static_cast<size_t>(n) * DTypeSize(*dtype));
    } else {
      bytes += chunk.data();
    }
  }
  absl::Status status = CallStatus(request.session().sequence(), reader->Finish());
  if (!status.ok()) return status;
  if (!have_header) {
    return absl::InternalError(absl::StrCat("GetTensor(", tensor_id, "): the stream had no header"));
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(header.dtype(), "GetTensor header.dtype");
  if (!dtype.ok()) return dtype.status();
  return HostTensor::FromBytes(*dtype, Shape(header.shape().begin(), header.shape().end()), std::move(bytes));
}

absl::Status Session::Delete(const std::string& tensor_id) {
  te::v1::DeleteTensorRequest request;
  request.set_tensor_id(tensor_id);
  grpc::ClientContext context;
  PrepareContext(&context);
  *request.mutable_session() = NextRef();
  te::v1::DeleteTensorResponse response;
  return CallStatus(request.session().sequence(),
                    stub_->DeleteTensor(&context, request, &response));
}

absl::Status Session::DeleteAll(const std::vector<std::string>& tensor_ids) {
  absl::Status first;
  for (const std::string& id : tensor_ids) {
    if (!FreeShared(id)) first.Update(Delete(id));
  }
  return first;
}

// One unary call with the session filled in. `Rpc` is a Stub member function.
#define TE_CLIENT_UNARY(Rpc, Response)                                                    \
  grpc::ClientContext context;                                                            \
  PrepareContext(&context, timeout);                                                      \
  te::v1::Response response;                                                              \
  *request.mutable_session() = NextRef();                                                 \
  absl::Status status =                                                                   \
      CallStatus(request.session().sequence(), stub_->Rpc(&context, request, &response)); \
  if (!status.ok()) return status;

absl::StatusOr<te::v1::InitLayerResponse> Session::InitLayer(te::v1::InitLayerRequest request,
                                                             absl::Duration timeout) {
  TE_CLIENT_UNARY(InitLayer, InitLayerResponse)
  return response;
}

absl::StatusOr<te::v1::ForwardResponse> Session::Forward(te::v1::ForwardRequest request,
                                                         absl::Duration timeout) {
  TE_CLIENT_UNARY(Forward, ForwardResponse)
  return response;
}

absl::StatusOr<te::v1::BackwardResponse> Session::Backward(te::v1::BackwardRequest request,
                                                           absl::Duration timeout) {
  TE_CLIENT_UNARY(Backward, BackwardResponse)
  return response;
}

absl::StatusOr<te::v1::ForwardBackwardResponse> Session::ForwardBackward(
    te::v1::ForwardBackwardRequest request, absl::Duration timeout) {
  TE_CLIENT_UNARY(ForwardBackward, ForwardBackwardResponse)
  return response;
}

absl::StatusOr<te::v1::GetVariablesResponse> Session::GetVariables(
    te::v1::GetVariablesRequest request, absl::Duration timeout) {
  TE_CLIENT_UNARY(GetVariables, GetVariablesResponse)
  return response;
}

absl::StatusOr<te::v1::SetVariablesResponse> Session::SetVariables(
    te::v1::SetVariablesRequest request, absl::Duration timeout) {
  TE_CLIENT_UNARY(SetVariables, SetVariablesResponse)
  return response;
}

absl::StatusOr<te::v1::AddGraphResponse> Session::AddGraph(te::v1::AddGraphRequest request,
                                                           absl::Duration timeout) {
  TE_CLIENT_UNARY(AddGraph, AddGraphResponse)
  return response;
}

absl::Status Session::ReleaseVersions(te::v1::ReleaseVersionsRequest request,
                                      absl::Duration timeout) {
  TE_CLIENT_UNARY(ReleaseVersions, ReleaseVersionsResponse)
  return absl::OkStatus();
}

absl::Status Session::DeleteLayer(te::v1::DeleteLayerRequest request, absl::Duration timeout) {
  TE_CLIENT_UNARY(DeleteLayer, DeleteLayerResponse)
  return absl::OkStatus();
}

absl::Status Session::Generate(
    te::v1::GenerateRequest request,
    const std::function<absl::Status(const te::v1::GenerateResponse& step)>& on_step,
    absl::Duration timeout) {
  grpc::ClientContext context;
  PrepareContext(&context, timeout);
  *request.mutable_session() = NextRef();
  std::unique_ptr<grpc::ClientReader<te::v1::GenerateResponse>> reader =
      stub_->Generate(&context, request);
  te::v1::GenerateResponse step;
  absl::Status stopped_here;
  while (reader->Read(&step)) {
    stopped_here = on_step ? on_step(step) : absl::OkStatus();
    if (!stopped_here.ok()) {
      // The server stops at its next token; Finish then has CANCELLED.
      context.TryCancel();
      break;
    }
  }
  absl::Status status = CallStatus(request.session().sequence(), reader->Finish());
  return stopped_here.ok() ? status : stopped_here;
}

void Session::Link::ReleaseVersion(const std::string& layer_id, int64_t version) {
  absl::MutexLock lock(&mu_);
  // Held while the call is handed over: the Session's destructor, which
  // clears session_ under this lock first, then waits for its Async calls.
  if (session_ == nullptr || session_->closed_) return;
  te::v1::ReleaseVersionsRequest request;
  request.set_layer_id(layer_id);
  request.add_versions(version);
  session_->ReleaseVersionsAsync(std::move(request));  // its future is dropped: nobody waits
}

absl::StatusOr<te::v1::BenchmarkResponse> Session::Benchmark(te::v1::BenchmarkRequest request,
                                                             absl::Duration timeout) {
  TE_CLIENT_UNARY(Benchmark, BenchmarkResponse)
  return response;
}

absl::StatusOr<te::v1::SessionInfo> Session::GetSessionInfo(absl::Duration timeout) {
  te::v1::GetSessionInfoRequest request;
  TE_CLIENT_UNARY(GetSessionInfo, SessionInfo)
  return response;
}

absl::StatusOr<te::v1::SetOptimizerResponse> Session::SetOptimizer(const std::string& layer_id,
                                                                  const Optimizer& optimizer,
                                                                  absl::Duration timeout) {
  te::v1::SetOptimizerRequest request;
  request.set_layer_id(layer_id);
  *request.mutable_optimizer() = optimizer.ToProto();
  TE_CLIENT_UNARY(SetOptimizer, SetOptimizerResponse)
  return response;
}

#undef TE_CLIENT_UNARY

te::v1::Tensor ResidentTensor::ToProto() const {
  te::v1::Tensor proto;
  proto.set_dtype(DTypeToProto(dtype));
  for (int64_t d : shape) proto.add_shape(d);
  proto.set_resident_id(id);
  return proto;
}

namespace schedules {

te::v1::LearningRate Constant(double value) {
  te::v1::LearningRate lr;
  lr.set_constant(value);
  return lr;
}

te::v1::LearningRate Linear(double init_value, double end_value, int64_t transition_steps,
                            int64_t transition_begin) {
  te::v1::LearningRate lr;
  te::v1::LinearSchedule* l = lr.mutable_linear();
  l->set_init_value(init_value);
  l->set_end_value(end_value);
  l->set_transition_steps(transition_steps);
  l->set_transition_begin(transition_begin);
  return lr;
}

te::v1::LearningRate CosineDecay(double init_value, int64_t decay_steps, double alpha,
                                 double exponent) {
  te::v1::LearningRate lr;
  te::v1::CosineDecaySchedule* c = lr.mutable_cosine_decay();
  c->set_init_value(init_value);
  c->set_decay_steps(decay_steps);
  c->set_alpha(alpha);
  c->set_exponent(exponent);
  return lr;
}

te::v1::LearningRate WarmupCosineDecay(double init_value, double peak_value, int64_t warmup_steps,
                                       int64_t decay_steps, double end_value, double exponent) {
  te::v1::LearningRate lr;
  te::v1::WarmupCosineDecaySchedule* w = lr.mutable_warmup_cosine_decay();
  w->set_init_value(init_value);
  w->set_peak_value(peak_value);
  w->set_warmup_steps(warmup_steps);
  w->set_decay_steps(decay_steps);
  w->set_end_value(end_value);
  w->set_exponent(exponent);
  return lr;
}

te::v1::LearningRate ExponentialDecay(double init_value, int64_t transition_steps,
                                      double decay_rate, int64_t transition_begin, bool staircase,
                                      std::optional<double> end_value) {
  te::v1::LearningRate lr;
  te::v1::ExponentialDecaySchedule* e = lr.mutable_exponential_decay();
  e->set_init_value(init_value);
  e->set_transition_steps(transition_steps);
  e->set_decay_rate(decay_rate);
  e->set_transition_begin(transition_begin);
  e->set_staircase(staircase);
  if (end_value) e->set_end_value(*end_value);
  return lr;
}

te::v1::LearningRate PiecewiseConstant(double init_value,
                                       const std::map<int64_t, double>& boundaries_and_scales) {
  te::v1::LearningRate lr;
  te::v1::PiecewiseConstantSchedule* p = lr.mutable_piecewise_constant();
  p->set_init_value(init_value);
  for (const auto& [step, scale] : boundaries_and_scales) {
    te::v1::PiecewiseConstantSchedule::Boundary* b = p->add_boundaries_and_scales();
    b->set_step(step);
    b->set_scale(scale);
  }
  return lr;
}

te::v1::LearningRate JoinSchedules(const std::vector<te::v1::LearningRate>& schedules,
                                   const std::vector<int64_t>& boundaries) {
  te::v1::LearningRate lr;
  te::v1::JoinSchedules* j = lr.mutable_join();
  for (const te::v1::LearningRate& s : schedules) *j->add_schedules() = s;
  for (int64_t b : boundaries) j->add_boundaries(b);
  return lr;
}

}  // namespace schedules

te::v1::LearningRate Optimizer::LearningRate() const {
  if (learning_rate_schedule) return *learning_rate_schedule;
  te::v1::LearningRate lr;
  if (schedule) {
    *lr.mutable_warmup_cosine_decay() = *schedule;
  } else {
    lr.set_constant(learning_rate);
  }
  return lr;
}

namespace {

// The optimizer's own message (no clip, no chain) into a oneof that has
// sgd, adam, adamw, rmsprop and lion: te.v1.Optimizer or te.v1.Transform.
template <typename Oneof>
void SetOptimizerKind(const Optimizer& o, Oneof* out) {
  const te::v1::LearningRate lr = o.LearningRate();
  auto adam_fields = [&](auto* adam) {
    *adam->mutable_learning_rate() = lr;
    adam->set_b1(o.b1);
    adam->set_b2(o.b2);
    adam->set_eps(o.eps);
    adam->set_eps_root(o.eps_root);
  };
  switch (o.kind) {
    case Optimizer::Kind::kSgd:
      *out->mutable_sgd()->mutable_learning_rate() = lr;
      if (o.momentum) out->mutable_sgd()->set_momentum(*o.momentum);
      out->mutable_sgd()->set_nesterov(o.nesterov);
      return;
    case Optimizer::Kind::kAdam:
      adam_fields(out->mutable_adam());
      return;
    case Optimizer::Kind::kAdamW:
      adam_fields(out->mutable_adamw());
      out->mutable_adamw()->set_weight_decay(o.weight_decay);
      return;
    case Optimizer::Kind::kRmsprop: {
      te::v1::Rmsprop* r = out->mutable_rmsprop();
      *r->mutable_learning_rate() = lr;
      r->set_decay(o.decay);
      r->set_eps(o.eps);
      r->set_initial_scale(o.initial_scale);
      r->set_eps_in_sqrt(o.eps_in_sqrt);
      r->set_centered(o.centered);
      if (o.momentum) r->set_momentum(*o.momentum);
      r->set_nesterov(o.nesterov);
      return;
    }
    case Optimizer::Kind::kLion: {
      te::v1::Lion* l = out->mutable_lion();
      *l->mutable_learning_rate() = lr;
      l->set_b1(o.b1);
      l->set_b2(o.b2);
      l->set_weight_decay(o.lion_weight_decay);
      return;
    }
    case Optimizer::Kind::kChain:
      return;  // the caller's: a chain is no link
  }
}

}  // namespace

te::v1::Optimizer Optimizer::ToProto() const {
  te::v1::Optimizer spec;
  if (kind == Kind::kChain) {
    for (const Transform& t : chain) *spec.add_chain() = t;
  } else {
    SetOptimizerKind(*this, &spec);
  }
  // Sent as given: with a chain the server refuses it, naming the field.
  if (clip_by_global_norm) spec.set_clip_by_global_norm(*clip_by_global_norm);
  return spec;
}

Optimizer Sgd(te::v1::LearningRate learning_rate, std::optional<double> momentum, bool nesterov) {
  Optimizer o;
  o.kind = Optimizer::Kind::kSgd;
  o.learning_rate_schedule = std::move(learning_rate);
  o.momentum = momentum;
  o.nesterov = nesterov;
  return o;
}

Optimizer Adam(te::v1::LearningRate learning_rate, double b1, double b2, double eps,
               double eps_root) {
  Optimizer o;
  o.kind = Optimizer::Kind::kAdam;
  o.learning_rate_schedule = std::move(learning_rate);
  o.b1 = b1;
  o.b2 = b2;
  o.eps = eps;
  o.eps_root = eps_root;
  return o;
}

Optimizer AdamW(te::v1::LearningRate learning_rate, double b1, double b2, double eps,
                double eps_root, double weight_decay) {
  Optimizer o = Adam(std::move(learning_rate), b1, b2, eps, eps_root);
  o.kind = Optimizer::Kind::kAdamW;
  o.weight_decay = weight_decay;
  return o;
}

Optimizer Rmsprop(te::v1::LearningRate learning_rate, double decay, double eps,
                  double initial_scale, bool eps_in_sqrt, bool centered,
                  std::optional<double> momentum, bool nesterov) {
  Optimizer o;
  o.kind = Optimizer::Kind::kRmsprop;
  o.learning_rate_schedule = std::move(learning_rate);
  o.decay = decay;
  o.eps = eps;
  o.initial_scale = initial_scale;
  o.eps_in_sqrt = eps_in_sqrt;
  o.centered = centered;
  o.momentum = momentum;
  o.nesterov = nesterov;
  return o;
}

Optimizer Lion(te::v1::LearningRate learning_rate, double b1, double b2, double weight_decay) {
  Optimizer o;
  o.kind = Optimizer::Kind::kLion;
  o.learning_rate_schedule = std::move(learning_rate);
  o.b1 = b1;
  o.b2 = b2;
  o.lion_weight_decay = weight_decay;
  return o;
}

Optimizer Chain(std::vector<Transform> links) {
  Optimizer o;
  o.kind = Optimizer::Kind::kChain;
  o.chain = std::move(links);
  return o;
}

Transform Link(const Optimizer& optimizer) {
  Transform t;
  SetOptimizerKind(optimizer, &t);
  return t;
}

Transform ClipByGlobalNorm(double max_norm) {
  Transform t;
  t.set_clip_by_global_norm(max_norm);
  return t;
}

Transform Clip(double max_delta) {
  Transform t;
  t.set_clip(max_delta);
  return t;
}

Transform Scale(double step_size) {
  Transform t;
  t.set_scale(step_size);
  return t;
}

Transform AddDecayedWeights(double weight_decay) {
  Transform t;
  t.set_add_decayed_weights(weight_decay);
  return t;
}

Transform ScaleByLearningRate(te::v1::LearningRate learning_rate) {
  Transform t;
  *t.mutable_scale_by_learning_rate() = std::move(learning_rate);
  return t;
}

template <typename Request, typename Response>
std::future<absl::StatusOr<Response>> Session::CallAsync(SyncRpc<Request, Response> rpc,
                                                         Request request, absl::Duration timeout) {
  // Numbered here, in the caller's thread, so the numbers follow the order of
  // the caller's Async calls whichever gets onto the wire first.
  *request.mutable_session() = NextRef();
  auto done = std::make_shared<std::promise<absl::StatusOr<Response>>>();
  std::future<absl::StatusOr<Response>> result = done->get_future();
  {
    // Counted before the thread starts, so the destructor waits for it.
    absl::MutexLock lock(&async_mu_);
    ++async_starting_;
  }
  std::thread([this, rpc, request = std::move(request), timeout, done]() {
    grpc::ClientContext context;
    PrepareContext(&context, timeout);
    {
      absl::MutexLock lock(&async_mu_);
      --async_starting_;
      in_flight_.insert(&context);
    }
    Response response;
    const grpc::Status status = (stub_.get()->*rpc)(&context, request, &response);
    absl::Status answer = CallStatus(request.session().sequence(), status);
    {
      absl::MutexLock lock(&async_mu_);
      in_flight_.erase(&context);
    }
    // Last, and without touching the Session: its destructor may run now.
    if (answer.ok()) {
      done->set_value(std::move(response));
    } else {
      done->set_value(std::move(answer));
    }
  }).detach();
  return result;
}

std::future<absl::StatusOr<te::v1::ForwardResponse>> Session::ForwardAsync(
    te::v1::ForwardRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::Forward, std::move(request),
                   timeout);
}

std::future<absl::StatusOr<te::v1::BackwardResponse>> Session::BackwardAsync(
    te::v1::BackwardRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::Backward, std::move(request),
                   timeout);
}

std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> Session::ForwardBackwardAsync(
    te::v1::ForwardBackwardRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::ForwardBackward,
                   std::move(request), timeout);
}

std::future<absl::StatusOr<te::v1::GetVariablesResponse>> Session::GetVariablesAsync(
    te::v1::GetVariablesRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::GetVariables,
                   std::move(request), timeout);
}

std::future<absl::StatusOr<te::v1::ReleaseVersionsResponse>> Session::ReleaseVersionsAsync(
    te::v1::ReleaseVersionsRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::ReleaseVersions, std::move(request), timeout);
}

std::future<absl::StatusOr<te::v1::SetVariablesResponse>> Session::SetVariablesAsync(
    te::v1::SetVariablesRequest request, absl::Duration timeout) {
  return CallAsync(&te::v1::TeService::Stub::SetVariables,
                   std::move(request), timeout);
}

absl::StatusOr<te::v1::Tensor> Session::Send(const HostTensor& tensor, std::vector<std::string>* uploaded) {
  const Transport how = TransportFor(tensor.bytes().size());
  if (how == Transport::kInline) {
    ++counts_.inline_tensors;
    return ToInlineProto(tensor);
  }
  if (how == Transport::kSharedMemory) {
    absl::StatusOr<SharedMemoryPool::Block> block = shm_.Allocate(tensor.bytes().size());
    if (block.ok()) {
      ++counts_.shm_tensors;
      std::memcpy(block->data, tensor.bytes().data(), tensor.bytes().size());
      uploaded->push_back(absl::StrCat("shm:", block->region_id, ":", block->offset, ":", block->size));
      te::v1::Tensor proto;
      proto.set_dtype(DTypeToProto(tensor.dtype()));
      for (int64_t d : tensor.shape()) proto.add_shape(d);
      proto.mutable_shm()->set_region_id(block->region_id);
      proto.mutable_shm()->set_offset(block->offset);
      return proto;
    }
    if (transport_ == Transport::kSharedMemory) return block.status();
  }
  absl::StatusOr<ResidentTensor> resident = PutStreamed(tensor);
  if (!resident.ok()) return resident.status();
  uploaded->push_back(resident->id);
  return resident->ToProto();
}

absl::StatusOr<HostTensor> Session::Receive(const te::v1::Tensor& tensor, const std::string& field) {
  if (tensor.data_case() == te::v1::Tensor::kShm) return ReadShared(tensor, field);
  if (tensor.data_case() != te::v1::Tensor::kResidentId) {
    ++counts_.inline_tensors;
    return FromInlineProto(tensor, field);
  }
  absl::StatusOr<HostTensor> host = absl::UnknownError("not fetched");
  absl::StatusOr<DType> dtype = DTypeFromProto(tensor.dtype(), field + ".dtype");
  const Shape shape(tensor.shape().begin(), tensor.shape().end());
  const int64_t n = NumElements(shape);
  std::optional<SharedMemoryPool::Block> block;
  if (dtype.ok() && n >= 0 && n <= (int64_t{1} << 40) &&
      TransportFor(static_cast<size_t>(n) * DTypeSize(*dtype)) == Transport::kSharedMemory) {
    absl::StatusOr<SharedMemoryPool::Block> allocated =
        shm_.Allocate(static_cast<size_t>(n) * DTypeSize(*dtype));
    if (allocated.ok()) {
      block = *allocated;
    } else if (transport_ == Transport::kSharedMemory) {
      return allocated.status();
    }
  }
  if (block.has_value()) {
    host = GetShared(tensor.resident_id(), *dtype, shape, *block);
    shm_.Free(*block);
  } else {
    host = Get(tensor.resident_id());
  }
  absl::Status deleted = Delete(tensor.resident_id());
  if (!host.ok()) return host.status();
  if (!deleted.ok()) return deleted;
  return host;
}

}  // namespace te::client
