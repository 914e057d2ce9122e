// transport_bench: how fast a 64 MiB tensor goes to te_server and back on one
// host, by each transport, in one run:
//   unary     the tensor inline in one message each way (SetVariables of a
//             64 MiB variable, GetVariables of it): what a client does without
//             streams
//   streamed  PutTensor / GetTensor in chunks (1, 2 and 4 MiB)
//   shm       through a registered shared-memory region: the client's copy
//             into (or out of) the region plus the PutTensor (GetTensor) call
//             that names it
// Rates are the median of --reps timed transfers after one untimed one; the
// ratios to unary are the transports' targets (streamed >= 2x, shm >= 5x).
//
//   bazel run //bench/transport:transport_bench
//   bazel run //bench/transport:transport_bench -- --address=host:port
//
// Not a test: it asserts nothing, and its figures depend on the machine.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/grpcpp.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/server_fixture.h"

ABSL_FLAG(std::string, address, "",
          "a running te_server (host:port); empty: start one (--enable_shm) for the run");
ABSL_FLAG(std::string, server_binary, "",
          "te_server to start; empty: the one in this binary's runfiles");
ABSL_FLAG(std::string, server_flags, "", "extra flags for the started server, space-separated");
ABSL_FLAG(int, mib, 64, "tensor size in MiB (float32, [mib * 256 K])");
ABSL_FLAG(int, reps, 5, "timed transfers per transport and direction");
ABSL_FLAG(int, place_sessions, 4,
          "sessions to open at the end, printing the device each was placed on (a server "
          "with several devices spreads them)");

namespace te::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxMessageBytes = 512 << 20;

struct Rate {
  std::string transport;
  double upload_gbps = 0;
  double download_gbps = 0;
};

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// GB/s of `bytes` moved by `transfer`, median of reps after one warm-up.
double Measure(size_t bytes, int reps, const std::function<bool()>& transfer) {
  if (!transfer()) return 0;
  std::vector<double> rates;
  for (int i = 0; i < reps; ++i) {
    const auto start = Clock::now();
    if (!transfer()) return 0;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    rates.push_back(static_cast<double>(bytes) / seconds / 1e9);
  }
  return Median(rates);
}

bool Check(const grpc::Status& status, const char* what) {
  if (status.ok()) return true;
  std::fprintf(stderr, "%s: %s: %s\n", what, std::to_string(status.error_code()).c_str(),
               status.error_message().c_str());
  return false;
}

class Bench {
 public:
  Bench(std::shared_ptr<grpc::Channel> channel, size_t bytes, int reps)
      : stub_(te::v1::TeService::NewStub(channel)), bytes_(bytes), reps_(reps) {
    data_.resize(bytes);
    std::mt19937 rng(1);
    for (size_t i = 0; i < bytes; i += 4) {
      const float v = static_cast<float>(rng() % 1000) / 1000.0f;
      std::memcpy(&data_[i], &v, 4);
    }
    received_.assign(bytes, '\0');
  }

  bool Setup() {
    grpc::ClientContext context;
    te::v1::CreateSessionResponse created;
    if (!Check(stub_->CreateSession(&context, te::v1::CreateSessionRequest(), &created),
               "CreateSession")) {
      return false;
    }
    session_ = created.session();
    return true;
  }

  ~Bench() {
    if (session_.session_id().empty()) return;
    grpc::ClientContext context;
    te::v1::CloseSessionRequest request;
    *request.mutable_session() = session_;
    te::v1::CloseSessionResponse response;
    stub_->CloseSession(&context, request, &response);
  }

  // One message each way: a DenseGeneral kernel of the tensor's size.
  // A transfer that returns other bytes than were sent counts as failed.
  void Verify(Rate* rate) {
    if (received_ == data_) return;
    std::fprintf(stderr, "%s: the bytes that came back differ from those sent\n",
                 rate->transport.c_str());
    rate->download_gbps = 0;
  }

  Rate Unary() {
    const int64_t rows = static_cast<int64_t>(bytes_ / 4 / 4096);
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session_;
    init.mutable_spec()->mutable_dense_general()->add_features(4096);
    init.mutable_spec()->mutable_dense_general()->set_use_bias(false);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(1);
    init.add_input_shape(rows);
    te::v1::InitLayerResponse layer;
    grpc::ClientContext context;
    if (!Check(stub_->InitLayer(&context, init, &layer), "InitLayer")) return {"unary"};
    te::v1::SetVariablesRequest set;
    *set.mutable_session() = session_;
    set.set_layer_id(layer.layer_id());
    te::v1::Variable* kernel = set.add_variables();
    kernel->set_collection("params");
    kernel->set_path("kernel");
    kernel->mutable_value()->set_dtype(te::v1::FLOAT32);
    kernel->mutable_value()->add_shape(rows);
    kernel->mutable_value()->add_shape(4096);
    Rate rate{"unary (one message)"};
    rate.upload_gbps = Measure(bytes_, reps_, [&] {
      // The client's tensor becomes the request: the copy a unary client pays.
      kernel->mutable_value()->set_inline_data(data_.data(), data_.size());
      grpc::ClientContext call;
      te::v1::SetVariablesResponse response;
      return Check(stub_->SetVariables(&call, set, &response), "SetVariables");
    });
    te::v1::GetVariablesRequest get;
    *get.mutable_session() = session_;
    get.set_layer_id(layer.layer_id());
    get.add_collections("params");
    rate.download_gbps = Measure(bytes_, reps_, [&] {
      grpc::ClientContext call;
      te::v1::GetVariablesResponse response;
      if (!Check(stub_->GetVariables(&call, get, &response), "GetVariables")) return false;
      const std::string& got = response.variables(0).value().inline_data();
      std::memcpy(received_.data(), got.data(), std::min(got.size(), received_.size()));
      return got.size() == bytes_;
    });
    Verify(&rate);
    return rate;
  }

  Rate Streamed(size_t chunk) {
    Rate rate{absl::StrCat("streamed (", chunk >> 20, " MiB chunks)")};
    std::string tensor_id;
    rate.upload_gbps = Measure(bytes_, reps_, [&] {
      if (!tensor_id.empty()) Delete(tensor_id);
      grpc::ClientContext context;
      te::v1::PutTensorResponse response;
      auto writer = stub_->PutTensor(&context, &response);
      te::v1::PutTensorChunk message;
      *message.mutable_header()->mutable_session() = session_;
      message.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
      message.mutable_header()->mutable_tensor()->add_shape(static_cast<int64_t>(bytes_ / 4));
      bool open = writer->Write(message);
      for (size_t offset = 0; open && offset < bytes_; offset += chunk) {
        message.set_data(data_.data() + offset, std::min(chunk, bytes_ - offset));
        open = writer->Write(message);
      }
      writer->WritesDone();
      if (!Check(writer->Finish(), "PutTensor")) return false;
      tensor_id = response.tensor_id();
      return true;
    });
    rate.download_gbps = Measure(bytes_, reps_, [&] {
      grpc::ClientContext context;
      te::v1::GetTensorRequest request;
      *request.mutable_session() = session_;
      request.set_tensor_id(tensor_id);
      request.set_chunk_bytes(static_cast<int32_t>(chunk));
      auto reader = stub_->GetTensor(&context, request);
      te::v1::TensorChunk message;
      size_t offset = 0;
      while (reader->Read(&message)) {
        if (message.has_header()) continue;
        const std::string& data = message.data();
        if (offset + data.size() > received_.size()) return false;
        std::memcpy(received_.data() + offset, data.data(), data.size());
        offset += data.size();
      }
      return Check(reader->Finish(), "GetTensor") && offset == bytes_;
    });
    Delete(tensor_id);
    Verify(&rate);
    return rate;
  }

  Rate SharedMemory() {
    Rate rate{"shared memory"};
    const std::string name = absl::StrCat("/te_transport_bench_", getpid());
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      std::fprintf(stderr, "shm_open %s: %s\n", name.c_str(), std::strerror(errno));
      return rate;
    }
    char* region =
        static_cast<char*>(mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    te::v1::RegisterSharedMemoryRequest registration;
    *registration.mutable_session() = session_;
    registration.set_name(name);
    registration.set_size(bytes_);
    te::v1::RegisterSharedMemoryResponse registered;
    grpc::ClientContext context;
    const bool ok = region != MAP_FAILED &&
                    Check(stub_->RegisterSharedMemory(&context, registration, &registered),
                          "RegisterSharedMemory");
    shm_unlink(name.c_str());  // the server has it open: the name is no longer needed
    if (!ok) return rate;
    std::string tensor_id;
    rate.upload_gbps = Measure(bytes_, reps_, [&] {
      if (!tensor_id.empty()) Delete(tensor_id);
      std::memcpy(region, data_.data(), bytes_);
      grpc::ClientContext call;
      te::v1::PutTensorResponse response;
      auto writer = stub_->PutTensor(&call, &response);
      te::v1::PutTensorChunk message;
      *message.mutable_header()->mutable_session() = session_;
      message.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
      message.mutable_header()->mutable_tensor()->add_shape(static_cast<int64_t>(bytes_ / 4));
      message.mutable_header()->mutable_shm()->set_region_id(registered.region_id());
      writer->Write(message);
      writer->WritesDone();
      if (!Check(writer->Finish(), "PutTensor (shm)")) return false;
      tensor_id = response.tensor_id();
      return true;
    });
    rate.download_gbps = Measure(bytes_, reps_, [&] {
      grpc::ClientContext call;
      te::v1::GetTensorRequest request;
      *request.mutable_session() = session_;
      request.set_tensor_id(tensor_id);
      request.mutable_destination()->set_region_id(registered.region_id());
      auto reader = stub_->GetTensor(&call, request);
      te::v1::TensorChunk message;
      while (reader->Read(&message)) {
      }
      if (!Check(reader->Finish(), "GetTensor (shm)")) return false;
      std::memcpy(received_.data(), region, bytes_);
      return true;
    });
    Delete(tensor_id);
    munmap(region, bytes_);
    Verify(&rate);
    return rate;
  }

 private:
  void Delete(const std::string& tensor_id) {
    grpc::ClientContext context;
    te::v1::DeleteTensorRequest request;
    *request.mutable_session() = session_;
    request.set_tensor_id(tensor_id);
    te::v1::DeleteTensorResponse response;
    stub_->DeleteTensor(&context, request, &response);
  }

  std::unique_ptr<te::v1::TeService::Stub> stub_;
  const size_t bytes_;
  const int reps_;
  std::string data_;
  std::string received_;
  te::v1::SessionRef session_;
};

std::string RunfilesServer(const char* argv0) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string exe = n > 0 ? std::string(self, n) : std::string(argv0);
  return exe + ".runfiles/te_server/server/te_server";
}

int Main(int argc, char** argv) {
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_mib)) << 20;
  std::unique_ptr<testing::ServerProcess> server;
  std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) {
    const std::string binary = absl::GetFlag(FLAGS_server_binary).empty()
                                   ? RunfilesServer(argv[0])
                                   : absl::GetFlag(FLAGS_server_binary);
    setenv("TE_SERVER_BINARY", binary.c_str(), 1);
    testing::ServerProcess::Options options;
    options.flags = {"--enable_shm", absl::StrCat("--max_message_bytes=", kMaxMessageBytes),
                     absl::StrCat("--max_tensor_bytes=", int64_t{2} << 30)};
    for (absl::string_view flag :
         absl::StrSplit(absl::GetFlag(FLAGS_server_flags), ' ', absl::SkipEmpty())) {
      options.flags.emplace_back(flag);
    }
    absl::StatusOr<std::unique_ptr<testing::ServerProcess>> started =
        testing::ServerProcess::Start(options);
    if (!started.ok()) {
      std::fprintf(stderr, "cannot start %s: %s\n", binary.c_str(),
                   started.status().ToString().c_str());
      return 1;
    }
    server = *std::move(started);
    address = server->address();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  std::vector<Rate> rates;
  {
    Bench bench(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args), bytes,
                absl::GetFlag(FLAGS_reps));
    if (!bench.Setup()) return 1;
    rates.push_back(bench.Unary());
    for (size_t chunk : {size_t{1} << 20, size_t{2} << 20, size_t{4} << 20}) {
      rates.push_back(bench.Streamed(chunk));
    }
    rates.push_back(bench.SharedMemory());
  }
  std::vector<std::string> placed;
  {
    auto stub = te::v1::TeService::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    std::vector<te::v1::SessionRef> sessions;
    for (int i = 0; i < absl::GetFlag(FLAGS_place_sessions); ++i) {
      grpc::ClientContext context;
      te::v1::CreateSessionResponse created;
      if (!Check(stub->CreateSession(&context, te::v1::CreateSessionRequest(), &created),
                 "CreateSession")) {
        break;
      }
      placed.push_back(created.device());
      sessions.push_back(created.session());
    }
    for (const te::v1::SessionRef& session : sessions) {
      grpc::ClientContext context;
      te::v1::CloseSessionRequest request;
      *request.mutable_session() = session;
      te::v1::CloseSessionResponse response;
      stub->CloseSession(&context, request, &response);
    }
  }
  if (server != nullptr) server->Stop().IgnoreError();

  const Rate& unary = rates.front();
  std::printf("%zu MiB float32 tensor, loopback, %s, median of %d\n", bytes >> 20, address.c_str(),
              absl::GetFlag(FLAGS_reps));
  std::printf("%-28s %12s %12s %10s %10s\n", "transport", "upload GB/s", "download GB/s", "up x",
              "down x");
  for (const Rate& rate : rates) {
    std::printf("%-28s %12.3f %12.3f %10.2f %10.2f\n", rate.transport.c_str(), rate.upload_gbps,
                rate.download_gbps,
                unary.upload_gbps > 0 ? rate.upload_gbps / unary.upload_gbps : 0,
                unary.download_gbps > 0 ? rate.download_gbps / unary.download_gbps : 0);
  }
  if (!placed.empty()) {
    std::printf("%zu new sessions placed on: %s\n", placed.size(),
                absl::StrJoin(placed, " ").c_str());
  }
  (void)rest;
  return 0;
}

}  // namespace
}  // namespace te::bench

int main(int argc, char** argv) { return te::bench::Main(argc, argv); }
