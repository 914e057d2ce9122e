// A sticky device fault over real gRPC: te_server on two devices, one CUDA
// device armed with --inject_device_fault (its kernel launch after N fails
// as a faulting kernel's would, through kernels/cuda/check.h), driven by
// sessions on both devices. Checks, in order: the call that meets the fault
// gets a status (INTERNAL naming the device), never a crash; the device goes
// NOT_SERVING in grpc.health.v1 under its own name while the server stays
// SERVING; every later call of its sessions is UNAVAILABLE naming it; new
// sessions go to the other device, and one asked for on the faulted device
// is UNAVAILABLE; the session on the other device answers bit for bit as
// before the fault; GetServerInfo says which device is unhealthy.
//
// Two devices: --device=all when the host has two GPUs (faulting cuda:0,
// cuda:1 goes on), and always --device=cuda:0,cpu (the CPU goes on). Needs a
// GPU; runs through deploy/bundle.sh on the GPU machine.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kHidden = 256;
const std::vector<int64_t> kShape = {4, 64, kHidden};
// Kernel launches that pass before the injected fault: past the setup's.
constexpr int kLaunchesBeforeFault = 200;

std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// A session with one LayerNormDenseGeneral layer and its input, on `device`.
struct Placed {
  te::v1::SessionRef session;
  std::string device;
  std::string layer_id;
  te::v1::Tensor x;
};

Placed Place(te::v1::TeService::Stub& stub, const std::string& device, uint32_t seed) {
  Placed p;
  te::v1::CreateSessionRequest create;
  create.set_device(device);
  const te::v1::CreateSessionResponse created = CreateSession(stub, create);
  p.session = created.session();
  p.device = created.device();
  te::v1::InitLayerRequest init;
  *init.mutable_session() = p.session;
  // A LayerNorm before the GEMM: a kernel of ours that every forward
  // launches (a lone DenseGeneral runs cuBLASLt alone, no launch to fault).
  init.mutable_spec()->mutable_layer_norm_dense_general()->add_features(kHidden);
  init.set_seed(seed);
  init.set_input_dtype(te::v1::FLOAT32);
  init.mutable_input_shape()->Assign(kShape.begin(), kShape.end());
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  te::v1::InitLayerResponse initialised;
  const grpc::Status status = stub.InitLayer(&context, init, &initialised);
  EXPECT_TRUE(status.ok()) << Describe(status);
  p.layer_id = initialised.layer_id();
  p.x = MakeTensor(te::v1::FLOAT32, kShape, RandomFloats(4 * 64 * kHidden, seed + 1));
  return p;
}

grpc::Status Forward(te::v1::TeService::Stub& stub, const Placed& p, std::string* y_bytes) {
  te::v1::ForwardRequest request;
  *request.mutable_session() = p.session;
  request.set_layer_id(p.layer_id);
  *request.mutable_x() = p.x;
  request.set_deterministic(true);
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  te::v1::ForwardResponse response;
  const grpc::Status status = stub.Forward(&context, request, &response);
  if (status.ok() && y_bytes != nullptr) *y_bytes = response.y().inline_data();
  return status;
}

std::map<std::string, std::string> VariableBytes(te::v1::TeService::Stub& stub, const Placed& p) {
  std::map<std::string, std::string> bytes;
  for (const auto& [name, tensor] : GetAllVariables(stub, p.session, p.layer_id)) {
    bytes[name] = tensor.inline_data();
  }
  return bytes;
}

// Runs the whole check on a server over `devices`, faulting `faulty`.
void CheckFaultOn(const std::string& devices, const std::string& faulty,
                  const std::string& other) {
  ServerProcess::Options options;
  options.flags = {absl::StrCat("--device=", devices),
                   absl::StrCat("--inject_device_fault=", faulty, "@", kLaunchesBeforeFault),
                   "--session_memory_bytes=1073741824", "--log_level=warning"};
  auto started = ServerProcess::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  auto stub = server.NewStub();
  const auto channel = server.NewChannel();
  EXPECT_EQ(HealthStatus(channel, ""), 1);
  EXPECT_EQ(HealthStatus(channel, faulty), 1);
  EXPECT_EQ(HealthStatus(channel, other), 1);

  Placed doomed = Place(*stub, faulty, 1);
  Placed also_doomed = Place(*stub, faulty, 2);
  Placed bystander = Place(*stub, other, 3);
  ASSERT_EQ(doomed.device, faulty);
  ASSERT_EQ(bystander.device, other);
  std::string y_before;
  ASSERT_TRUE(Forward(*stub, bystander, &y_before).ok());
  const std::map<std::string, std::string> vars_before = VariableBytes(*stub, bystander);
  ASSERT_FALSE(vars_before.empty());

  // Forwards on the faulty device until one meets the fault.
  grpc::Status fault;
  int forwards = 0;
  for (; forwards < 10 * kLaunchesBeforeFault && fault.ok(); ++forwards) {
    fault = Forward(*stub, doomed, nullptr);
  }
  ASSERT_FALSE(fault.ok()) << "no forward met the fault in " << forwards << " calls";
  std::printf("%s: the fault met forward %d: %s\n", faulty.c_str(), forwards,
              Describe(fault).c_str());
  EXPECT_EQ(fault.error_code(), grpc::StatusCode::INTERNAL) << Describe(fault);
  EXPECT_TRUE(absl::StrContains(fault.error_message(), faulty)) << Describe(fault);
  EXPECT_TRUE(absl::StrContains(fault.error_message(), "cudaErrorLaunchFailure"))
      << Describe(fault);

  // Health follows within the server's housekeeping period (1 s).
  int device_health = -1;
  for (int i = 0; i < 50 && (device_health = HealthStatus(channel, faulty)) != 2; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(device_health, 2) << faulty << " should be NOT_SERVING";
  EXPECT_EQ(HealthStatus(channel, other), 1);
  EXPECT_EQ(HealthStatus(channel, ""), 1) << "the other device still serves";
  EXPECT_EQ(HealthStatus(channel, "te.v1.TeService"), 1);

  // The faulted device's sessions: UNAVAILABLE naming it.
  for (const Placed* p : {&doomed, &also_doomed}) {
    const grpc::Status later = Forward(*stub, *p, nullptr);
    EXPECT_EQ(later.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(later);
    EXPECT_TRUE(absl::StrContains(later.error_message(), faulty)) << Describe(later);
  }

  // New sessions: not on the faulted device.
  te::v1::CreateSessionRequest on_faulty;
  on_faulty.set_device(faulty);
  grpc::ClientContext create_context;
  create_context.set_deadline(In(absl::Seconds(30)));
  te::v1::CreateSessionResponse refused;
  const grpc::Status asked = stub->CreateSession(&create_context, on_faulty, &refused);
  EXPECT_EQ(asked.error_code(), grpc::StatusCode::UNAVAILABLE) << Describe(asked);
  EXPECT_TRUE(absl::StrContains(asked.error_message(), faulty)) << Describe(asked);
  Placed newcomer = Place(*stub, "", 4);
  EXPECT_EQ(newcomer.device, other);
  EXPECT_TRUE(Forward(*stub, newcomer, nullptr).ok());

  // The other device's session: as before, bit for bit.
  std::string y_after;
  const grpc::Status after = Forward(*stub, bystander, &y_after);
  ASSERT_TRUE(after.ok()) << Describe(after);
  EXPECT_EQ(y_after, y_before);
  EXPECT_EQ(VariableBytes(*stub, bystander), vars_before);

  grpc::ClientContext info_context;
  te::v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&info_context, te::v1::GetServerInfoRequest(), &info).ok());
  for (const te::v1::DeviceInfo& device : info.devices()) {
    EXPECT_EQ(device.healthy(), device.name() != faulty) << device.name();
  }

  // The server still stops cleanly (the faulted device's sessions included).
  EXPECT_TRUE(server.Stop().ok());
}

TEST(DeviceFaultGpuTest, TheCpuGoesOnWhenTheGpuFaults) {
  CheckFaultOn("cuda:0,cpu", "cuda:0", "cpu");
}

TEST(DeviceFaultGpuTest, TheOtherGpuGoesOn) {
  // How many GPUs: a --device=all server's answer.
  ServerProcess::Options options;
  options.flags = {"--device=all"};
  auto probe = ServerProcess::Start(options);
  ASSERT_TRUE(probe.ok()) << probe.status();
  grpc::ClientContext context;
  te::v1::ServerInfo info;
  ASSERT_TRUE((*probe)->NewStub()->GetServerInfo(&context, {}, &info).ok());
  ASSERT_TRUE((*probe)->Stop().ok());
  if (info.devices_size() < 2 || info.devices(1).name() != "cuda:1") {
    GTEST_SKIP() << "one GPU here: --device=all has " << info.devices_size() << " device(s)";
  }
  CheckFaultOn("all", "cuda:0", "cuda:1");
}

}  // namespace
}  // namespace te::testing
