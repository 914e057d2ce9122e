// The client's transport against a small fake TeService on loopback: chunked
// PutTensor / GetTensor, status passthrough, session close on destruction,
// what CreateSession sends, the x-te-session header on every call of a
// session, and pinning a session to the replica CreateSession names. The real server is exercised by
// tests/integration/quickstart_test.cc.
#include "client/client.h"

#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/modules.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/ports.h"

namespace te::client {
namespace {

// One call as the fake saw it: the method and its x-te-session header ("" when absent).
struct SeenCall {
  std::string method;
  std::string affinity;
};

class FakeTeService final : public te::v1::TeService::Service {
 public:
  // What CreateSession answers in server_address (--advertise_address).
  void set_server_address(const std::string& address) {
    absl::MutexLock lock(&mu_);
    server_address_ = address;
  }

  grpc::Status GetServerInfo(grpc::ServerContext* context, const te::v1::GetServerInfoRequest*,
                             te::v1::ServerInfo*) override {
    Record(context, "GetServerInfo");
    return grpc::Status::OK;
  }

  grpc::Status CreateSession(grpc::ServerContext* context, const te::v1::CreateSessionRequest* request,
                             te::v1::CreateSessionResponse* response) override {
    Record(context, "CreateSession");
    absl::MutexLock lock(&mu_);
    response->set_server_address(server_address_);
    last_create_ = *request;
    response->mutable_session()->set_session_id("s1");
    response->mutable_session()->set_token("t1");
    if (request->preferred_recipes_size() > 0) *response->mutable_recipe() = request->preferred_recipes(0);
    response->set_negotiation("took the first preference");
    response->set_ttl_seconds(300);
    response->set_device("cpu");
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(grpc::ServerContext* context, const te::v1::CloseSessionRequest* request,
                            te::v1::CloseSessionResponse*) override {
    Record(context, "CloseSession");
    absl::MutexLock lock(&mu_);
    ++closes_;
    return Check(request->session());
  }

  grpc::Status PutTensor(grpc::ServerContext* context, grpc::ServerReader<te::v1::PutTensorChunk>* reader,
                         te::v1::PutTensorResponse* response) override {
    Record(context, "PutTensor");
    te::v1::PutTensorChunk chunk;
    te::v1::TensorHeader header;
    std::string bytes;
    std::vector<size_t> sizes;
    while (reader->Read(&chunk)) {
      if (chunk.has_header()) {
        grpc::Status status = Check(chunk.header().session());
        if (!status.ok()) return status;
        header = chunk.header().tensor();
      } else {
        sizes.push_back(chunk.data().size());
        bytes += chunk.data();
      }
    }
    absl::MutexLock lock(&mu_);
    const std::string id = "r" + std::to_string(tensors_.size());
    tensors_[id] = {header, bytes};
    put_chunk_sizes_ = sizes;
    response->set_tensor_id(id);
    response->set_bytes(bytes.size());
    return grpc::Status::OK;
  }

  grpc::Status GetTensor(grpc::ServerContext* context, const te::v1::GetTensorRequest* request,
                         grpc::ServerWriter<te::v1::TensorChunk>* writer) override {
    Record(context, "GetTensor");
    std::pair<te::v1::TensorHeader, std::string> stored;
    {
      absl::MutexLock lock(&mu_);
      auto it = tensors_.find(request->tensor_id());
      if (it == tensors_.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor " + request->tensor_id());
      stored = it->second;
    }
    te::v1::TensorChunk chunk;
    *chunk.mutable_header() = stored.first;
    writer->Write(chunk);
    const size_t step = request->chunk_bytes() > 0 ? request->chunk_bytes() : (1 << 20);
    for (size_t offset = 0; offset < stored.second.size(); offset += step) {
      chunk.Clear();
      chunk.set_data(stored.second.substr(offset, step));
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }

  grpc::Status DeleteTensor(grpc::ServerContext* context, const te::v1::DeleteTensorRequest* request,
                            te::v1::DeleteTensorResponse*) override {
    Record(context, "DeleteTensor");
    absl::MutexLock lock(&mu_);
    return tensors_.erase(request->tensor_id()) ? grpc::Status::OK
                                                : grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor");
  }

  // Every Forward fails as the server does for FP8 on a layer without fp8_metas.
  grpc::Status Forward(grpc::ServerContext* context, const te::v1::ForwardRequest*,
                       te::v1::ForwardResponse*) override {
    Record(context, "Forward");
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, kNoFp8Metas);
  }

  static constexpr char kNoFp8Metas[] = "fp8_metas/x_scale is missing: init the layer under autocast";

  int closes() {
    absl::MutexLock lock(&mu_);
    return closes_;
  }
  std::vector<size_t> put_chunk_sizes() {
    absl::MutexLock lock(&mu_);
    return put_chunk_sizes_;
  }
  size_t stored() {
    absl::MutexLock lock(&mu_);
    return tensors_.size();
  }
  te::v1::CreateSessionRequest last_create() {
    absl::MutexLock lock(&mu_);
    return last_create_;
  }
  std::vector<SeenCall> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  void Record(grpc::ServerContext* context, const std::string& method) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kAffinityHeader);
    SeenCall call{method, ""};
    if (it != metadata.end()) call.affinity.assign(it->second.data(), it->second.size());
    absl::MutexLock lock(&mu_);
    calls_.push_back(call);
  }

  static grpc::Status Check(const te::v1::SessionRef& ref) {
    if (ref.session_id() != "s1" || ref.token() != "t1") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad session reference");
    }
    return grpc::Status::OK;
  }

  absl::Mutex mu_;
  int closes_ = 0;
  std::map<std::string, std::pair<te::v1::TensorHeader, std::string>> tensors_;
  std::vector<size_t> put_chunk_sizes_;
  te::v1::CreateSessionRequest last_create_;
  std::string server_address_;
  std::vector<SeenCall> calls_;
};

// A fake on a loopback port of its own; its address is "127.0.0.1:<port>".
struct FakeServer {
  FakeServer() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~FakeServer() {
    if (server != nullptr) server->Shutdown();
  }
  FakeTeService service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

// Nothing listens on port 1 of loopback in a test sandbox.
constexpr char kDeadAddress[] = "127.0.0.1:1";

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(fake_.server, nullptr);
    client_ = ConnectTo(fake_.address, /*pin_to_replica=*/true);
    ASSERT_NE(client_, nullptr);
  }

  static std::unique_ptr<Client> ConnectTo(const std::string& address, bool pin_to_replica) {
    ClientOptions options;
    options.chunk_bytes = 64 << 10;
    options.inline_tensor_bytes = 1 << 10;
    options.pin_to_replica = pin_to_replica;
    options.rpc_timeout = absl::Seconds(20);
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  FakeServer fake_;
  FakeTeService& service_ = fake_.service;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientTest, CreateSessionSendsRecipesAndClosesOnDestruction) {
  SessionOptions options;
  DelayedScaling recipe;
  recipe.amax_history_len = 16;
  options.recipes = {recipe, Float8CurrentScaling{}};
  options.policy = NegotiationPolicy::kStrict;
  options.ttl = absl::Seconds(60);
  {
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession(options);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ((*session)->id(), "s1");
    EXPECT_EQ((*session)->device(), "cpu");
    ASSERT_TRUE((*session)->recipe().has_value());
    EXPECT_EQ(std::get<DelayedScaling>(*(*session)->recipe()).amax_history_len, 16);
    EXPECT_EQ((*session)->negotiation(), "took the first preference");
    EXPECT_EQ((*session)->ttl(), absl::Seconds(300));
  }
  EXPECT_EQ(service_.closes(), 1);
  const te::v1::CreateSessionRequest sent = service_.last_create();
  ASSERT_EQ(sent.preferred_recipes_size(), 2);
  EXPECT_TRUE(sent.preferred_recipes(1).has_float8_current_scaling());
  EXPECT_EQ(sent.policy(), te::v1::STRICT);
  EXPECT_EQ(sent.ttl_seconds(), 60);
}

TEST_F(ClientTest, CloseIsIdempotent) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
  ASSERT_TRUE(session.ok());
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_TRUE((*session)->Close().ok());
  session->reset();
  EXPECT_EQ(service_.closes(), 1);
}

TEST_F(ClientTest, PutAndGetStreamInChunks) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
  ASSERT_TRUE(session.ok());
  // 100 x 1000 bf16 = 200000 bytes: three full 64 KiB chunks and a remainder.
  const HostTensor t = HostTensor::RandomNormal({100, 1000}, DType::kBF16, 3);
  absl::StatusOr<ResidentTensor> resident = (*session)->Put(t);
  ASSERT_TRUE(resident.ok()) << resident.status();
  EXPECT_EQ(resident->shape, t.shape());
  EXPECT_EQ(service_.put_chunk_sizes(), (std::vector<size_t>{65536, 65536, 65536, 3392}));
  absl::StatusOr<HostTensor> back = (*session)->Get(resident->id);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->dtype(), DType::kBF16);
  EXPECT_EQ(back->shape(), t.shape());
  EXPECT_EQ(back->bytes(), t.bytes());
  EXPECT_TRUE((*session)->Delete(resident->id).ok());
  EXPECT_EQ((*session)->Get(resident->id).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientTest, SendInlinesSmallTensorsAndUploadsLargeOnes) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
  ASSERT_TRUE(session.ok());
  std::vector<std::string> uploaded;
  absl::StatusOr<te::v1::Tensor> small = (*session)->Send(HostTensor::RandomNormal({4, 4}, DType::kF32, 1), &uploaded);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->data_case(), te::v1::Tensor::kInlineData);
  EXPECT_TRUE(uploaded.empty());
  absl::StatusOr<te::v1::Tensor> large = (*session)->Send(HostTensor::RandomNormal({64, 64}, DType::kF32, 1), &uploaded);
  ASSERT_TRUE(large.ok());
  EXPECT_EQ(large->data_case(), te::v1::Tensor::kResidentId);
  ASSERT_EQ(uploaded.size(), 1u);
  // A resident response tensor is fetched, then freed on the server.
  absl::StatusOr<HostTensor> received = (*session)->Receive(*large, "y");
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(received->shape(), (Shape{64, 64}));
  EXPECT_EQ(service_.stored(), 0u);
}

TEST_F(ClientTest, ServerStatusArrivesUnchanged) {
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
  ASSERT_TRUE(session.ok());
  Variables vars;
  vars.session = session->get();
  vars.layer_id = "layer-1";
  const DenseGeneral dense({8});
  absl::Status status = dense.Apply(vars, HostTensor::RandomNormal({2, 8}, DType::kBF16, 1)).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(), FakeTeService::kNoFp8Metas);
}

TEST_F(ClientTest, EveryCallOfASessionCarriesItsAffinityKey) {
  std::string first_key;
  {
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
    ASSERT_TRUE(session.ok()) << session.status();
    first_key = (*session)->affinity_key();
    absl::StatusOr<ResidentTensor> resident =
        (*session)->Put(HostTensor::RandomNormal({64, 64}, DType::kF32, 5));
    ASSERT_TRUE(resident.ok()) << resident.status();
    ASSERT_TRUE((*session)->Get(resident->id).ok());
    ASSERT_TRUE((*session)->Delete(resident->id).ok());
    EXPECT_FALSE((*session)->Forward(te::v1::ForwardRequest()).ok());  // the fake refuses it
  }  // CloseSession
  const std::vector<SeenCall> first = service_.calls();
  absl::StatusOr<std::unique_ptr<Session>> second = client_->CreateSession();
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(client_->GetServerInfo().ok());
  const std::vector<SeenCall> all = service_.calls();

  // 128 bits in hex; a fresh one per session.
  ASSERT_EQ(first_key.size(), 32u);
  EXPECT_EQ(first_key.find_first_not_of("0123456789abcdef"), std::string::npos) << first_key;
  EXPECT_NE((*second)->affinity_key(), first_key);
  std::vector<std::string> methods;
  for (const SeenCall& call : first) {
    methods.push_back(call.method);
    EXPECT_EQ(call.affinity, first_key) << call.method;
  }
  EXPECT_EQ(methods, (std::vector<std::string>{"CreateSession", "PutTensor", "GetTensor",
                                               "DeleteTensor", "Forward", "CloseSession"}));
  ASSERT_EQ(all.size(), first.size() + 2);
  EXPECT_EQ(all[first.size()].method, "CreateSession");
  EXPECT_EQ(all[first.size()].affinity, (*second)->affinity_key());
  EXPECT_EQ(all.back().method, "GetServerInfo");
  EXPECT_EQ(all.back().affinity, "");  // not tied to a session
}

TEST_F(ClientTest, SessionIsPinnedToTheReplicaCreateSessionNames) {
  FakeServer replica;
  service_.set_server_address(replica.address);
  {
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ((*session)->pinned_address(), replica.address);
    ASSERT_TRUE((*session)->Put(HostTensor::RandomNormal({64, 64}, DType::kF32, 6)).ok());
  }
  // Only CreateSession went where the client connected; the rest to the replica,
  // with the same key.
  ASSERT_EQ(service_.calls().size(), 1u);
  EXPECT_EQ(replica.service.stored(), 1u);
  EXPECT_EQ(replica.service.closes(), 1);
  const std::vector<SeenCall> pinned = replica.service.calls();
  ASSERT_EQ(pinned.size(), 2u);
  EXPECT_EQ(pinned[0].affinity, service_.calls()[0].affinity);
}

TEST_F(ClientTest, PinningOffOrOwnAddressKeepsTheClientsChannel) {
  FakeServer replica;
  service_.set_server_address(replica.address);
  std::unique_ptr<Client> unpinned = ConnectTo(fake_.address, /*pin_to_replica=*/false);
  ASSERT_NE(unpinned, nullptr);
  absl::StatusOr<std::unique_ptr<Session>> session = unpinned->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->pinned_address(), "");
  ASSERT_TRUE((*session)->Put(HostTensor::RandomNormal({64, 64}, DType::kF32, 7)).ok());
  EXPECT_EQ(service_.stored(), 1u);
  EXPECT_EQ(replica.service.calls().size(), 0u);

  // A server that advertises the address the client connected to: nothing to pin.
  service_.set_server_address(fake_.address);
  absl::StatusOr<std::unique_ptr<Session>> own = client_->CreateSession();
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ((*own)->pinned_address(), "");
}

TEST_F(ClientTest, UnreachablePinnedReplicaIsUnavailableAndNamed) {
  service_.set_server_address(kDeadAddress);
  absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession();
  ASSERT_TRUE(session.ok()) << session.status();
  absl::Status put = (*session)->Put(HostTensor::RandomNormal({64, 64}, DType::kF32, 8)).status();
  EXPECT_EQ(put.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(put.message().find(kDeadAddress), absl::string_view::npos) << put;
  // No fallback: the client's own server saw CreateSession only.
  EXPECT_EQ(service_.calls().size(), 1u);
  EXPECT_EQ((*session)->Close().code(), absl::StatusCode::kUnavailable);
}

TEST(ClientConnectTest, ConnectionRefusedSaysSoAtOnce) {
  const int port = te::testing::FreeLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ClientOptions options;
  options.connect_timeout = absl::Seconds(30);
  const absl::Time start = absl::Now();
  const absl::Status status = Client::Connect(address, options).status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the 30 s connect timeout
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("connection refused at " + address), absl::string_view::npos) << status;
}

TEST(ClientConnectTest, DefaultCallDeadlineIsMinutes) {
  const ClientOptions options;
  EXPECT_GE(options.rpc_timeout, absl::Minutes(1));
  EXPECT_LE(options.rpc_timeout, absl::Minutes(5));  // a stopped server fails a call within minutes
  EXPECT_LE(options.connect_timeout, absl::Seconds(30));
}

}  // namespace
}  // namespace te::client
