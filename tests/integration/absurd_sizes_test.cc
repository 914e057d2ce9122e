// Every RPC that takes a size, given an absurd one by a valid, authenticated
// client, against the real te_server: each answers a clean status (the code
// chosen for the caller's next action), never an abort (UNAVAILABLE: the
// server died), INTERNAL or UNKNOWN (an exception that escaped); the server
// keeps serving and the session is as it was.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kHuge = int64_t{1} << 62;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

struct AbsurdCase {
  std::string name;
  std::function<grpc::Status()> call;
  grpc::StatusCode code;
};

te::v1::Tensor Shaped(const std::vector<int64_t>& shape) {
  te::v1::Tensor t;
  t.set_dtype(te::v1::FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::string(16, '\0'));
  return t;
}

class AbsurdSizesTest : public ServerSuite {
 protected:
  void SetUp() override {
    ServerSuite::SetUp();
    if (HasFatalFailure()) return;
    te::v1::InitLayerRequest init = WithSession(te::v1::InitLayerRequest());
    init.mutable_spec()->mutable_dense_general()->add_features(4);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(2);
    init.add_input_shape(2);
    grpc::ClientContext context;
    te::v1::InitLayerResponse layer;
    ASSERT_TRUE(stub_->InitLayer(&context, init, &layer).ok());
    layer_id_ = layer.layer_id();
    resident_id_ = PutSmall();
  }

  template <typename Request, typename Response, typename Rpc>
  grpc::Status Unary(Rpc rpc, Request request) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    Response response;
    return (stub_.get()->*rpc)(&context, request, &response);
  }

  grpc::Status Init(const te::v1::LayerSpec& spec, const std::vector<int64_t>& shape,
                    const te::v1::Autocast& autocast = {}) {
    te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
    *request.mutable_spec() = spec;
    request.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : shape) request.add_input_shape(d);
    *request.mutable_autocast() = autocast;
    return Unary<te::v1::InitLayerRequest, te::v1::InitLayerResponse>(
        &te::v1::TeService::Stub::InitLayer, request);
  }

  grpc::Status PutHeader(const std::vector<int64_t>& shape) {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    for (int64_t d : shape) header.mutable_header()->mutable_tensor()->add_shape(d);
    writer->Write(header);
    te::v1::PutTensorChunk data;
    data.set_data(std::string(64, '\0'));
    writer->Write(data);
    writer->WritesDone();
    return writer->Finish();
  }

  // A resident tensor of 16 bytes, for GetTensor.
  std::string PutSmall() {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(4);
    writer->Write(header);
    te::v1::PutTensorChunk data;
    data.set_data(std::string(16, '\0'));
    writer->Write(data);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response.tensor_id();
  }

  grpc::Status GetTensorChunks(int32_t chunk_bytes) {
    te::v1::GetTensorRequest request = WithSession(te::v1::GetTensorRequest());
    request.set_tensor_id(resident_id_);
    request.set_chunk_bytes(chunk_bytes);
    grpc::ClientContext context;
    auto reader = stub_->GetTensor(&context, request);
    te::v1::TensorChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return reader->Finish();
  }

  std::string layer_id_;
  std::string resident_id_;
};

TEST_F(AbsurdSizesTest, EveryRpcAnswersCleanlyAndTheServerStays) {
  const auto before = GetAllVariables(*stub_, session_, layer_id_);
  using Code = grpc::StatusCode;
  te::v1::LayerSpec dense;
  dense.mutable_dense_general()->add_features(4);
  te::v1::LayerSpec wide;
  wide.mutable_dense_general()->add_features(std::numeric_limits<int32_t>::max());
  te::v1::Autocast long_history;
  long_history.set_enabled(true);
  long_history.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(
      std::numeric_limits<int32_t>::max());

  const std::vector<AbsurdCase> cases = {
      {"CreateSession ttl INT64_MAX",
       [&] {
         te::v1::CreateSessionRequest r;
         r.set_ttl_seconds(kInt64Max);
         return Unary<te::v1::CreateSessionRequest, te::v1::CreateSessionResponse>(
             &te::v1::TeService::Stub::CreateSession, r);
       },
       Code::INVALID_ARGUMENT},
      {"InitLayer input_shape [2^62, 2^62]", [&] { return Init(dense, {kHuge, kHuge}); },
       Code::INVALID_ARGUMENT},
      {"InitLayer features 2^31 - 1", [&] { return Init(wide, {2, 2}); },
       Code::RESOURCE_EXHAUSTED},
      {"InitLayer amax_history_len 2^31 - 1", [&] { return Init(dense, {2, 2}, long_history); },
       Code::INVALID_ARGUMENT},
      {"Forward x [2^62, 2^62]",
       [&] {
         te::v1::ForwardRequest r = WithSession(te::v1::ForwardRequest());
         r.set_layer_id(layer_id_);
         *r.mutable_x() = Shaped({kHuge, kHuge});
         return Unary<te::v1::ForwardRequest, te::v1::ForwardResponse>(
             &te::v1::TeService::Stub::Forward, r);
       },
       Code::INVALID_ARGUMENT},
      {"Backward dy [INT64_MAX]",
       [&] {
         te::v1::BackwardRequest r = WithSession(te::v1::BackwardRequest());
         r.set_forward_id("forward-1");
         *r.mutable_dy() = Shaped({kInt64Max});
         return Unary<te::v1::BackwardRequest, te::v1::BackwardResponse>(
             &te::v1::TeService::Stub::Backward, r);
       },
       Code::NOT_FOUND},  // the forward is checked first; dy never allocates
      {"ForwardBackward x [4, 2^62, 2^62]",
       [&] {
         te::v1::ForwardBackwardRequest r = WithSession(te::v1::ForwardBackwardRequest());
         r.set_layer_id(layer_id_);
         *r.add_micro_batches()->mutable_x() = Shaped({4, kHuge, kHuge});
         return Unary<te::v1::ForwardBackwardRequest, te::v1::ForwardBackwardResponse>(
             &te::v1::TeService::Stub::ForwardBackward, r);
       },
       Code::INVALID_ARGUMENT},
      {"SetVariables value [2^62, 2^62]",
       [&] {
         te::v1::SetVariablesRequest r = WithSession(te::v1::SetVariablesRequest());
         r.set_layer_id(layer_id_);
         te::v1::Variable* v = r.add_variables();
         v->set_collection("params");
         v->set_path("kernel");
         *v->mutable_value() = Shaped({kHuge, kHuge});
         return Unary<te::v1::SetVariablesRequest, te::v1::SetVariablesResponse>(
             &te::v1::TeService::Stub::SetVariables, r);
       },
       Code::INVALID_ARGUMENT},
      {"PutTensor header [4, 2^62, 2^62]", [&] { return PutHeader({4, kHuge, kHuge}); },
       Code::INVALID_ARGUMENT},
      {"PutTensor header of 2^40 bytes", [&] { return PutHeader({int64_t{1} << 38}); },
       Code::INVALID_ARGUMENT},
      {"GetTensor chunk_bytes INT32_MAX",
       [&] { return GetTensorChunks(std::numeric_limits<int32_t>::max()); }, Code::INVALID_ARGUMENT},
      {"GetTensor chunk_bytes negative", [&] { return GetTensorChunks(-1); },
       Code::INVALID_ARGUMENT},
      {"Benchmark warmup INT32_MAX",
       [&] {
         te::v1::BenchmarkRequest r = WithSession(te::v1::BenchmarkRequest());
         r.set_layer_id(layer_id_);
         r.set_warmup_iters(std::numeric_limits<int32_t>::max());
         *r.mutable_inputs()->mutable_x() = Shaped({2, 2});
         return Unary<te::v1::BenchmarkRequest, te::v1::BenchmarkResponse>(
             &te::v1::TeService::Stub::Benchmark, r);
       },
       Code::INVALID_ARGUMENT},
      {"RegisterSharedMemory size 2^63",
       [&] {
         te::v1::RegisterSharedMemoryRequest r = WithSession(te::v1::RegisterSharedMemoryRequest());
         r.set_name("/te_absurd");
         r.set_size(uint64_t{1} << 63);
         return Unary<te::v1::RegisterSharedMemoryRequest, te::v1::RegisterSharedMemoryResponse>(
             &te::v1::TeService::Stub::RegisterSharedMemory, r);
       },
       Code::FAILED_PRECONDITION},  // the suite's server runs without --enable_shm
  };
  for (const AbsurdCase& c : cases) {
    const grpc::Status status = c.call();
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << Describe(status);
    // Still serving.
    te::v1::GetSessionInfoRequest info = WithSession(te::v1::GetSessionInfoRequest());
    const grpc::Status alive = Unary<te::v1::GetSessionInfoRequest, te::v1::SessionInfo>(
        &te::v1::TeService::Stub::GetSessionInfo, info);
    ASSERT_TRUE(alive.ok()) << "after " << c.name << ": " << Describe(alive);
  }
  const auto after = GetAllVariables(*stub_, session_, layer_id_);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, tensor] : before) {
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name;
  }
}

}  // namespace
}  // namespace te::testing
