#include "tests/integration/test_util.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"

namespace te::testing {

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

std::vector<float> Rounded(te::v1::DType dtype, const std::vector<float>& values) {
  std::vector<float> out(values);
  for (float& v : out) {
    if (dtype == te::v1::BFLOAT16) v = Bf16ToFloat(FloatToBf16(v));
    if (dtype == te::v1::FLOAT16) v = Fp16ToFloat(FloatToFp16(v));
  }
  return out;
}

te::v1::Tensor MakeTensor(te::v1::DType dtype, const std::vector<int64_t>& shape,
                          const std::vector<float>& values) {
  te::v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  std::string* bytes = t.mutable_inline_data();
  if (dtype == te::v1::FLOAT32) {
    bytes->resize(values.size() * 4);
    std::memcpy(bytes->data(), values.data(), bytes->size());
    return t;
  }
  std::vector<uint16_t> halves(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    halves[i] = dtype == te::v1::BFLOAT16 ? FloatToBf16(values[i]) : FloatToFp16(values[i]);
  }
  bytes->resize(halves.size() * 2);
  std::memcpy(bytes->data(), halves.data(), bytes->size());
  return t;
}

std::vector<float> ToFloats(const te::v1::Tensor& tensor) {
  const std::string& bytes = tensor.inline_data();
  std::vector<float> values;
  if (tensor.dtype() == te::v1::FLOAT32) {
    values.resize(bytes.size() / 4);
    std::memcpy(values.data(), bytes.data(), values.size() * 4);
    return values;
  }
  std::vector<uint16_t> halves(bytes.size() / 2);
  std::memcpy(halves.data(), bytes.data(), halves.size() * 2);
  for (uint16_t h : halves) {
    values.push_back(tensor.dtype() == te::v1::BFLOAT16 ? Bf16ToFloat(h) : Fp16ToFloat(h));
  }
  return values;
}

te::v1::Tensor ResidentRef(const std::string& id) {
  te::v1::Tensor t;
  t.set_resident_id(id);
  return t;
}

std::vector<int64_t> ShapeOf(const te::v1::Tensor& tensor) {
  return std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end());
}

double RelativeError(const std::vector<float>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  return RelativeError(got, std::vector<double>(want.begin(), want.end()));
}

te::v1::CreateSessionResponse CreateSession(te::v1::TeService::Stub& stub,
                                            const te::v1::CreateSessionRequest& request) {
  grpc::ClientContext context;
  te::v1::CreateSessionResponse response;
  const grpc::Status status = stub.CreateSession(&context, request, &response);
  if (!status.ok()) ADD_FAILURE() << "CreateSession: " << Describe(status);
  return response;
}

std::map<std::string, te::v1::Tensor> GetAllVariables(te::v1::TeService::Stub& stub,
                                                      const te::v1::SessionRef& session,
                                                      const std::string& layer_id) {
  grpc::ClientContext context;
  te::v1::GetVariablesRequest request;
  *request.mutable_session() = session;
  request.set_layer_id(layer_id);
  te::v1::GetVariablesResponse response;
  const grpc::Status status = stub.GetVariables(&context, request, &response);
  std::map<std::string, te::v1::Tensor> variables;
  if (!status.ok()) {
    ADD_FAILURE() << "GetVariables: " << Describe(status);
    return variables;
  }
  for (const te::v1::Variable& v : response.variables()) {
    variables[v.collection() + "/" + v.path()] = v.value();
  }
  return variables;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat(static_cast<int>(status.error_code()), ": ", status.error_message());
}

ServerProcess* ServerSuite::server_ = nullptr;
std::string* ServerSuite::start_error_ = nullptr;

void ServerSuite::SetUpTestSuite() {
  ServerProcess::Options options;
  options.flags = SuiteFlags();
  auto started = ServerProcess::Start(options);
  if (started.ok()) {
    server_ = started->release();
  } else {
    start_error_ = new std::string(started.status().ToString());
  }
}

void ServerSuite::TearDownTestSuite() {
  if (server_ != nullptr) {
    const absl::Status stopped = server_->Stop();
    EXPECT_TRUE(stopped.ok()) << stopped;
    delete server_;
    server_ = nullptr;
  }
}

void ServerSuite::SetUp() {
  ASSERT_NE(server_, nullptr) << (start_error_ ? *start_error_ : "no server");
  stub_ = server_->NewStub();
  te::v1::CreateSessionRequest request;
  session_ = CreateSession(*stub_, request).session();
  ASSERT_FALSE(session_.session_id().empty());
}

void ServerSuite::UseSession(const te::v1::SessionRef& session) {
  TearDown();
  session_ = session;
}

void ServerSuite::TearDown() {
  if (stub_ == nullptr || session_.session_id().empty()) return;
  grpc::ClientContext context;
  te::v1::CloseSessionRequest request;
  *request.mutable_session() = session_;
  te::v1::CloseSessionResponse response;
  // A test may have closed it itself.
  stub_->CloseSession(&context, request, &response);
}

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service) {
  // The request's field 1 is the service name; the response's field 1 the
  // status, absent when it is UNKNOWN (proto3 sends no default value).
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back(0x0a);
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes += service;
  }
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                 &response, [&](grpc::Status s) {
                   status = s;
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return 0;
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -2;
}

}  // namespace te::testing
