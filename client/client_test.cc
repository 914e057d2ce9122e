// The client's transport against a small fake TeService on loopback: chunked
// PutTensor / GetTensor, status passthrough, session close on destruction,
// and what CreateSession sends. The real server is exercised by
// tests/integration/quickstart_test.cc.
#include "client/client.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/modules.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

class FakeTeService final : public te::v1::TeService::Service {
 public:
  grpc::Status CreateSession(grpc::ServerContext*, const te::v1::CreateSessionRequest* request,
                             te::v1::CreateSessionResponse* response) override {
    absl::MutexLock lock(&mu_);
    last_create_ = *request;
    response->mutable_session()->set_session_id("s1");
    response->mutable_session()->set_token("t1");
    if (request->preferred_recipes_size() > 0) *response->mutable_recipe() = request->preferred_recipes(0);
    response->set_negotiation("took the first preference");
    response->set_ttl_seconds(300);
    response->set_device("cpu");
    return grpc::Status::OK;
  }

  grpc::Status CloseSession(grpc::ServerContext*, const te::v1::CloseSessionRequest* request,
                            te::v1::CloseSessionResponse*) override {
    absl::MutexLock lock(&mu_);
    ++closes_;
    return Check(request->session());
  }

  grpc::Status PutTensor(grpc::ServerContext*, grpc::ServerReader<te::v1::PutTensorChunk>* reader,
                         te::v1::PutTensorResponse* response) override {
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

  grpc::Status GetTensor(grpc::ServerContext*, const te::v1::GetTensorRequest* request,
                         grpc::ServerWriter<te::v1::TensorChunk>* writer) override {
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

  grpc::Status DeleteTensor(grpc::ServerContext*, const te::v1::DeleteTensorRequest* request,
                            te::v1::DeleteTensorResponse*) override {
    absl::MutexLock lock(&mu_);
    return tensors_.erase(request->tensor_id()) ? grpc::Status::OK
                                                : grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor");
  }

  // Every Forward fails as the server does for FP8 on a layer without fp8_metas.
  grpc::Status Forward(grpc::ServerContext*, const te::v1::ForwardRequest*, te::v1::ForwardResponse*) override {
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

 private:
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
};

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.chunk_bytes = 64 << 10;
    options.inline_tensor_bytes = 1 << 10;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect("127.0.0.1:" + std::to_string(port), options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override { server_->Shutdown(); }

  FakeTeService service_;
  std::unique_ptr<grpc::Server> server_;
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

TEST(ClientConnectTest, NothingListeningIsUnavailable) {
  ClientOptions options;
  options.connect_timeout = absl::Milliseconds(200);
  // Port 1 on loopback: nothing listens there in a test sandbox.
  EXPECT_EQ(Client::Connect("127.0.0.1:1", options).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace te::client
