// RpcBytesCounter on a real in-process gRPC server over loopback TCP, with a
// stand-in te.v1.TeService registered as te_server registers its own: unary
// methods on protobuf messages, PutTensor and GetTensor raw. The counters must
// hold exactly the serialized size of every message each call moved. (The
// real te_server, scraped by a real Prometheus: //tests/integration:metrics_test.)
#include "server/metrics/rpc_bytes.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "te/v1/service.grpc.pb.h"

namespace te::metrics {
namespace {

constexpr const char* kRawMethods[] = {"PutTensor", "GetTensor"};

using StandInBase = te::v1::TeService::WithRawCallbackMethod_PutTensor<
    te::v1::TeService::WithRawCallbackMethod_GetTensor<te::v1::TeService::CallbackService>>;

grpc::ByteBuffer Serialized(const google::protobuf::MessageLite& message) {
  const std::string bytes = message.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// Answers Forward with a y as large as the request's x plus `extra` bytes,
// takes any PutTensor stream, and streams GetTensor's chunk_bytes back as
// three data chunks after a header.
class StandInService final : public StandInBase {
 public:
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const te::v1::ForwardRequest* request,
                                    te::v1::ForwardResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    if (request->layer_id() == "fail") {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "layer_id: fail"));
      return reactor;
    }
    response->mutable_y()->set_inline_data(request->x().inline_data() + std::string(1000, 'y'));
    response->set_forward_id("f-1");
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerReadReactor<grpc::ByteBuffer>* PutTensor(grpc::CallbackServerContext*,
                                                       grpc::ByteBuffer* response) override {
    class Reader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
     public:
      explicit Reader(grpc::ByteBuffer* response) : response_(response) { StartRead(&chunk_); }
      void OnReadDone(bool ok) override {
        if (ok) {
          bytes_ += chunk_.Length();
          chunk_.Clear();
          StartRead(&chunk_);
          return;
        }
        te::v1::PutTensorResponse answer;
        answer.set_tensor_id("tensor-of-the-stand-in");
        answer.set_bytes(static_cast<int64_t>(bytes_));
        *response_ = Serialized(answer);
        Finish(grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      grpc::ByteBuffer* response_;
      grpc::ByteBuffer chunk_;
      size_t bytes_ = 0;
    };
    return new Reader(response);
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetTensor(grpc::CallbackServerContext*,
                                                        const grpc::ByteBuffer* request) override {
    class Writer final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
     public:
      explicit Writer(int chunk_bytes) {
        te::v1::TensorChunk header;
        header.mutable_header()->add_shape(3 * chunk_bytes);
        chunks_.push_back(Serialized(header));
        for (int i = 0; i < 3; ++i) {
          te::v1::TensorChunk data;
          data.set_data(std::string(chunk_bytes, static_cast<char>('a' + i)));
          chunks_.push_back(Serialized(data));
        }
        Next();
      }
      void OnWriteDone(bool ok) override {
        if (!ok) return Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
        Next();
      }
      void OnDone() override { delete this; }

     private:
      void Next() {
        if (next_ == chunks_.size()) return Finish(grpc::Status::OK);
        StartWrite(&chunks_[next_++]);
      }
      std::vector<grpc::ByteBuffer> chunks_;
      size_t next_ = 0;
    };
    std::vector<grpc::Slice> slices;
    te::v1::GetTensorRequest parsed;
    if (!request->Dump(&slices).ok()) return nullptr;
    std::string bytes;
    for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    parsed.ParseFromString(bytes);
    return new Writer(parsed.chunk_bytes());
  }
};

class RpcBytesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(registry_);
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    metrics_ = *metrics;
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&service_);
    const absl::Status counted =
        CountRpcBytes(metrics_, te::v1::TeService::service_full_name(), kRawMethods, &builder);
    ASSERT_TRUE(counted.ok()) << counted;
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port_),
                                   grpc::InsecureChannelCredentials());
    stub_ = te::v1::TeService::NewStub(channel_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // The counter's value, or -1 where the series does not exist.
  double Bytes(const std::string& family, const std::string& method) const {
    for (const prometheus::MetricFamily& f : registry_.Collect()) {
      if (f.name != family) continue;
      for (const prometheus::ClientMetric& m : f.metric) {
        if (m.label.size() == 1 && m.label[0].name == "method" && m.label[0].value == method) {
          return m.counter.value;
        }
      }
    }
    return -1;
  }
  double Received(const std::string& method) const {
    return Bytes("te_rpc_received_bytes_total", method);
  }
  double Sent(const std::string& method) const { return Bytes("te_rpc_sent_bytes_total", method); }

  prometheus::Registry registry_;
  ServerMetrics metrics_;
  StandInService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
};

TEST_F(RpcBytesTest, UnaryCallsCountTheirRequestAndResponse) {
  double want_received = 0, want_sent = 0;
  for (int size : {400 << 10, 10, 0}) {  // 0.4 MB, a few bytes, an empty x
    te::v1::ForwardRequest request;
    request.set_layer_id("layer-1");
    request.mutable_x()->set_inline_data(std::string(size, 'x'));
    request.mutable_x()->add_shape(size);
    te::v1::ForwardResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Forward(&context, request, &response).ok());
    want_received += static_cast<double>(request.ByteSizeLong());
    want_sent += static_cast<double>(response.ByteSizeLong());
    EXPECT_EQ(Received("Forward"), want_received) << size;
    EXPECT_EQ(Sent("Forward"), want_sent) << size;
  }
  EXPECT_GT(want_received, 400 << 10);
}

TEST_F(RpcBytesTest, AFailedCallCountsWhatArrivedAndNothingSent) {
  te::v1::ForwardRequest request;
  request.set_layer_id("fail");
  request.mutable_x()->set_inline_data(std::string(5000, 'x'));
  te::v1::ForwardResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->Forward(&context, request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Received("Forward"), static_cast<double>(request.ByteSizeLong()));
  EXPECT_EQ(Sent("Forward"), -1);
}

TEST_F(RpcBytesTest, ClientStreamsCountEveryChunk) {
  te::v1::PutTensorResponse response;
  grpc::ClientContext context;
  auto writer = stub_->PutTensor(&context, &response);
  double want = 0;
  te::v1::PutTensorChunk header;
  header.mutable_header()->mutable_tensor()->add_shape(3 << 20);
  header.mutable_header()->mutable_session()->set_session_id("s-1");
  ASSERT_TRUE(writer->Write(header));
  want += static_cast<double>(header.ByteSizeLong());
  for (int i = 0; i < 3; ++i) {
    te::v1::PutTensorChunk data;
    data.set_data(std::string(1 << 20, 'd'));
    ASSERT_TRUE(writer->Write(data));
    want += static_cast<double>(data.ByteSizeLong());
  }
  ASSERT_TRUE(writer->WritesDone());
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(response.bytes(), static_cast<int64_t>(want));  // what the stand-in read
  EXPECT_EQ(Received("PutTensor"), want);
  EXPECT_EQ(Sent("PutTensor"), static_cast<double>(response.ByteSizeLong()));
}

TEST_F(RpcBytesTest, ServerStreamsCountEveryChunk) {
  te::v1::GetTensorRequest request;
  request.set_tensor_id("t-1");
  request.set_chunk_bytes(256 << 10);
  grpc::ClientContext context;
  auto reader = stub_->GetTensor(&context, request);
  te::v1::TensorChunk chunk;
  double want = 0;
  int chunks = 0;
  while (reader->Read(&chunk)) {
    want += static_cast<double>(chunk.ByteSizeLong());
    ++chunks;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(chunks, 4);
  EXPECT_GT(want, 3 * (256 << 10));
  EXPECT_EQ(Received("GetTensor"), static_cast<double>(request.ByteSizeLong()));
  EXPECT_EQ(Sent("GetTensor"), want);
}

// Health checks (and any other service's calls) are not te.v1.TeService's.
TEST_F(RpcBytesTest, OtherServicesAndUnknownMethodsAreNotCounted) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest check;
  grpc::health::v1::HealthCheckResponse serving;
  grpc::ClientContext context;
  const grpc::Status status = health->Check(&context, check, &serving);
  EXPECT_TRUE(status.ok()) << status.error_message();
  // Unimplemented by the stand-in: counted under its own method, no other series.
  te::v1::GetServerInfoRequest info_request;
  te::v1::ServerInfo info;
  grpc::ClientContext info_context;
  EXPECT_EQ(stub_->GetServerInfo(&info_context, info_request, &info).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  for (const prometheus::MetricFamily& f : registry_.Collect()) {
    if (f.name != "te_rpc_received_bytes_total" && f.name != "te_rpc_sent_bytes_total") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      ASSERT_EQ(m.label.size(), 1u);
      EXPECT_EQ(m.label[0].value, "GetServerInfo") << f.name;
    }
  }
}

TEST(RpcBytesCounterTest, RefusesWhatItCannotCount) {
  prometheus::Registry registry;
  absl::StatusOr<ServerMetrics> metrics = RegisterServerMetrics(registry);
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(RpcBytesCounter::Create(*metrics, "te.v1.NoSuchService", {}).status().code(),
            absl::StatusCode::kNotFound);
  constexpr const char* kTypo[] = {"PutTensors"};
  EXPECT_EQ(RpcBytesCounter::Create(*metrics, "te.v1.TeService", kTypo).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(RpcBytesCounter::Create(*metrics, "te.v1.TeService", kRawMethods).ok());
}

}  // namespace
}  // namespace te::metrics
