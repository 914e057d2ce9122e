// The client library's transport choice against a real te_server: kAuto
// sends small tensors inline and large ones through shared memory when the
// server allows it (else through the streams), and a caller can force each
// transport. The numbers do not depend on the way.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using client::Client;
using client::HostTensor;
using client::Session;
using client::SessionOptions;
using client::Transport;

// 4 MiB: over the 1 MiB inline threshold.
constexpr int64_t kRows = 1024, kCols = 1024;

class ClientTransportTest : public ::testing::TestWithParam<bool> {
 protected:
  bool shm_enabled() const { return GetParam(); }

  void SetUp() override {
    ServerProcess::Options options;
    if (shm_enabled()) options.flags = {"--enable_shm"};
    auto started = ServerProcess::Start(options);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    auto client = Client::Connect(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    client_.reset();
    if (server_ != nullptr) { EXPECT_TRUE(server_->Stop().ok()); }
  }

  std::unique_ptr<Session> Open(Transport transport) {
    SessionOptions options;
    options.transport = transport;
    auto session = client_->CreateSession(options);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.ok() ? *std::move(session) : nullptr;
  }

  // y of DenseGeneral(512) applied to a 4 MiB x, through `session`.
  absl::StatusOr<HostTensor> ApplyDense(Session& session) {
    client::DenseGeneral layer({512});
    const HostTensor x = HostTensor::RandomNormal({kRows, kCols}, client::DType::kF32, 11);
    absl::StatusOr<client::Variables> vars = layer.Init(session, /*key=*/5, x);
    if (!vars.ok()) return vars.status();
    return layer.Apply(*vars, x);
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
};

TEST_P(ClientTransportTest, AutoPicksByLocalityAndSize) {
  std::unique_ptr<Session> session = Open(Transport::kAuto);
  ASSERT_NE(session, nullptr);
  absl::StatusOr<HostTensor> y = ApplyDense(*session);
  ASSERT_TRUE(y.ok()) << y.status();
  const client::TransportCounts& counts = session->transport_counts();
  if (shm_enabled()) {
    // x went through shared memory; y (2 MiB) came back through it too.
    EXPECT_EQ(counts.shm_tensors.load(), 2);
    EXPECT_EQ(counts.streamed_tensors.load(), 0);
  } else {
    // The probe failed once; both went by stream.
    EXPECT_EQ(counts.shm_tensors.load(), 0);
    EXPECT_EQ(counts.streamed_tensors.load(), 2);
  }
  // Small tensors stay inline either way.
  std::vector<std::string> uploads;
  absl::StatusOr<te::v1::Tensor> small =
      session->Send(HostTensor::RandomNormal({8, 8}, client::DType::kF32, 1), &uploads);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->data_case(), te::v1::Tensor::kInlineData);
  EXPECT_TRUE(uploads.empty());
}

TEST_P(ClientTransportTest, EveryTransportGivesTheSameNumbers) {
  std::unique_ptr<Session> reference = Open(Transport::kStream);
  ASSERT_NE(reference, nullptr);
  absl::StatusOr<HostTensor> want = ApplyDense(*reference);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(reference->transport_counts().shm_tensors.load(), 0);
  std::vector<Transport> others = {Transport::kInline, Transport::kAuto};
  if (shm_enabled()) others.push_back(Transport::kSharedMemory);
  for (Transport transport : others) {
    std::unique_ptr<Session> session = Open(transport);
    ASSERT_NE(session, nullptr);
    absl::StatusOr<HostTensor> got = ApplyDense(*session);
    ASSERT_TRUE(got.ok()) << client::TransportName(transport) << ": " << got.status();
    EXPECT_EQ(got->bytes(), want->bytes()) << client::TransportName(transport);
  }
}

TEST_P(ClientTransportTest, ForcedSharedMemoryWithoutItIsFailedPrecondition) {
  if (shm_enabled()) {
    // Forced, it is used even for small tensors, and Put/Get go through it.
    std::unique_ptr<Session> session = Open(Transport::kSharedMemory);
    ASSERT_NE(session, nullptr);
    const HostTensor t = HostTensor::RandomNormal({3, 5}, client::DType::kBF16, 2);
    absl::StatusOr<client::ResidentTensor> put = session->Put(t);
    ASSERT_TRUE(put.ok()) << put.status();
    te::v1::Tensor resident;
    resident.set_dtype(te::v1::BFLOAT16);
    resident.add_shape(3);
    resident.add_shape(5);
    resident.set_resident_id(put->id);
    absl::StatusOr<HostTensor> back = session->Receive(resident, "t");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->bytes(), t.bytes());
    EXPECT_EQ(session->transport_counts().shm_tensors.load(), 2);
    return;
  }
  std::unique_ptr<Session> session = Open(Transport::kSharedMemory);
  ASSERT_NE(session, nullptr);
  std::vector<std::string> uploads;
  absl::StatusOr<te::v1::Tensor> sent =
      session->Send(HostTensor::RandomNormal({8}, client::DType::kF32, 3), &uploads);
  EXPECT_EQ(sent.status().code(), absl::StatusCode::kFailedPrecondition) << sent.status();
  EXPECT_NE(sent.status().message().find("--enable_shm"), std::string::npos) << sent.status();
}

INSTANTIATE_TEST_SUITE_P(Server, ClientTransportTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("WithShm") : std::string("WithoutShm");
                         });

}  // namespace
}  // namespace te::testing
