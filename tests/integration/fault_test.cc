// Fault test: 32 clients against a real te_server for FAULT_SECONDS (default
// 20) that, among ordinary calls, cancel calls, let deadlines pass (in flight
// and while queued behind their own session's call), cut PutTensor and
// GetTensor streams, drop connections in the middle of a PutTensor (a child
// process that dies), and close sessions with calls in flight. Afterwards:
// the server still serves; every surviving session's parameters are intact
// bit for bit; a closed session is explicitly gone (NOT_FOUND); and once the
// sessions are closed the server's memory is back to its baseline (no
// sessions, no bytes held). Prints calls made, faults injected, errors by code
// and memory before and after.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

extern char** environ;

namespace te::testing {
namespace {

constexpr int kClients = 32;
constexpr int64_t kHidden = 64;
const std::vector<int64_t> kInputShape = {4, 16, kHidden};
constexpr int kPutChunkBytes = 64 << 10;
constexpr int kPutChunks = 16;

int FaultSeconds() {
  int seconds = 20;
  if (const char* env = std::getenv("FAULT_SECONDS")) {
    if (!absl::SimpleAtoi(env, &seconds) || seconds < 1) seconds = 20;
  }
  return seconds;
}

// Everything the clients saw, merged at the end.
struct Figures {
  int64_t calls = 0;
  int64_t ordinary_failures = 0;          // calls without a fault that failed
  std::map<std::string, int64_t> faults;  // by kind
  std::map<grpc::StatusCode, int64_t> codes;
  int64_t sessions_opened = 0;
  int64_t sessions_closed = 0;
  int64_t integrity_checks = 0;
  int64_t corrupted = 0;
  std::vector<std::string> unexpected;  // a few examples

  void Merge(const Figures& other) {
    calls += other.calls;
    ordinary_failures += other.ordinary_failures;
    for (const auto& [k, v] : other.faults) faults[k] += v;
    for (const auto& [k, v] : other.codes) codes[k] += v;
    sessions_opened += other.sessions_opened;
    sessions_closed += other.sessions_closed;
    integrity_checks += other.integrity_checks;
    corrupted += other.corrupted;
    for (const std::string& u : other.unexpected) {
      if (unexpected.size() < 10) unexpected.push_back(u);
    }
  }
};

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    default:
      return "OTHER";
  }
}

// Codes a server fault would show; none may appear.
bool IsServerFault(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNKNOWN || code == grpc::StatusCode::INTERNAL ||
         code == grpc::StatusCode::DATA_LOSS;
}

int64_t ResidentKib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib = 0;
    if (line.rfind("VmRSS:", 0) == 0 &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(6, line.size() - 9)), &kib)) {
      return kib;
    }
  }
  return -1;
}

// $TE_FAULT_CLIENT_BINARY, else fault_client in the test's runfiles.
std::string FaultClientPath() {
  if (const char* path = std::getenv("TE_FAULT_CLIENT_BINARY")) return path;
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".", "/",
                      workspace != nullptr ? workspace : "te_server",
                      "/tests/integration/fault_client");
}

// One client: its own connection, at most one session at a time.
class FaultClient {
 public:
  FaultClient(const ServerProcess& server, uint32_t seed) : server_(server), rng_(seed) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    stub_ = te::v1::TeService::NewStub(
        grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args));
  }

  void Run(absl::Time until) {
    while (absl::Now() < until) {
      if (session_.session_id().empty() && !OpenSession()) continue;
      const int action = Uniform(0, 99);
      if (action < 30) {
        OrdinaryStep();
      } else if (action < 42) {
        CancelledStep();
      } else if (action < 54) {
        DeadlineStep();
      } else if (action < 62) {
        QueuedDeadline();
      } else if (action < 72) {
        CutPutTensor();
      } else if (action < 76) {
        DropConnectionInPutTensor();
      } else if (action < 84) {
        CutGetTensor();
      } else if (action < 92) {
        CheckIntegrity();
      } else {
        CloseWithCallInFlight();
      }
    }
  }

  // The survivor's final check; then closes it.
  void Finish() {
    if (session_.session_id().empty()) return;
    CheckIntegrity();
    Close();
  }

  const Figures& figures() const { return figures_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  void Count(const grpc::Status& status, bool fault) {
    ++figures_.calls;
    ++figures_.codes[status.error_code()];
    if (IsServerFault(status.error_code()) || (!fault && !status.ok())) {
      if (!fault) ++figures_.ordinary_failures;
      if (figures_.unexpected.size() < 5) {
        figures_.unexpected.push_back(
            absl::StrCat(CodeName(status.error_code()), ": ", status.error_message()));
      }
    }
  }

  te::v1::Tensor RandomInput(int seed) {
    const size_t n = static_cast<size_t>(kInputShape[0] * kInputShape[1] * kHidden);
    return MakeTensor(te::v1::FLOAT32, kInputShape, RandomFloats(n, seed));
  }

  bool OpenSession() {
    te::v1::CreateSessionRequest create;
    te::v1::CreateSessionResponse created;
    grpc::ClientContext context;
    grpc::Status status = stub_->CreateSession(&context, create, &created);
    Count(status, false);
    if (!status.ok()) return false;
    ++figures_.sessions_opened;
    session_ = created.session();
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session_;
    init.mutable_spec()->mutable_dense_general()->add_features(kHidden);
    init.set_seed(static_cast<uint64_t>(Uniform(1, 1 << 30)));
    init.set_input_dtype(te::v1::FLOAT32);
    init.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
    te::v1::InitLayerResponse initialised;
    grpc::ClientContext init_context;
    status = stub_->InitLayer(&init_context, init, &initialised);
    Count(status, false);
    if (!status.ok()) return false;
    layer_id_ = initialised.layer_id();
    params_.clear();
    for (const auto& [name, tensor] : GetAllVariables(*stub_, session_, layer_id_)) {
      if (name.rfind("params/", 0) == 0) params_[name] = tensor.inline_data();
    }
    return !params_.empty();
  }

  te::v1::ForwardBackwardRequest Step(int micro_batches) {
    te::v1::ForwardBackwardRequest request;
    *request.mutable_session() = session_;
    request.set_layer_id(layer_id_);
    for (int i = 0; i < micro_batches; ++i) {
      te::v1::MicroBatch* batch = request.add_micro_batches();
      *batch->mutable_x() = RandomInput(Uniform(0, 1 << 20));
      *batch->mutable_dy() = RandomInput(Uniform(0, 1 << 20));
    }
    return request;
  }

  void OrdinaryStep() {
    if (Uniform(0, 1) == 0) {
      te::v1::ForwardBackwardResponse response;
      grpc::ClientContext context;
      Count(stub_->ForwardBackward(&context, Step(2), &response), false);
      return;
    }
    te::v1::ForwardRequest forward;
    *forward.mutable_session() = session_;
    forward.set_layer_id(layer_id_);
    *forward.mutable_x() = RandomInput(Uniform(0, 1 << 20));
    forward.set_keep_for_backward(true);
    te::v1::ForwardResponse y;
    grpc::ClientContext context;
    grpc::Status status = stub_->Forward(&context, forward, &y);
    Count(status, false);
    if (!status.ok()) return;
    te::v1::BackwardRequest backward;
    *backward.mutable_session() = session_;
    backward.set_forward_id(y.forward_id());
    *backward.mutable_dy() = RandomInput(Uniform(0, 1 << 20));
    backward.set_keep_grads(true);
    te::v1::BackwardResponse grads;
    grpc::ClientContext backward_context;
    Count(stub_->Backward(&backward_context, backward, &grads), false);
  }

  // An asynchronous ForwardBackward; returns its status once done.
  grpc::Status RunAsync(grpc::ClientContext* context, const te::v1::ForwardBackwardRequest& request,
                        const std::function<void()>& meanwhile) {
    te::v1::ForwardBackwardResponse response;
    absl::Notification done;
    grpc::Status status;
    stub_->async()->ForwardBackward(context, &request, &response, [&](grpc::Status s) {
      status = std::move(s);
      done.Notify();
    });
    meanwhile();
    done.WaitForNotification();
    return status;
  }

  void CancelledStep() {
    ++figures_.faults["cancel"];
    grpc::ClientContext context;
    Count(RunAsync(&context, Step(4),
                   [&] {
                     absl::SleepFor(absl::Microseconds(Uniform(0, 3000)));
                     context.TryCancel();
                   }),
          true);
  }

  void DeadlineStep() {
    ++figures_.faults["deadline"];
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Microseconds(Uniform(0, 4000))));
    te::v1::ForwardBackwardResponse response;
    Count(stub_->ForwardBackward(&context, Step(4), &response), true);
  }

  // A call whose deadline passes while it waits for the session's turn.
  void QueuedDeadline() {
    ++figures_.faults["queued_deadline"];
    grpc::ClientContext long_context;
    Count(RunAsync(&long_context, Step(8),
                   [&] {
                     te::v1::GetVariablesRequest request;
                     *request.mutable_session() = session_;
                     request.set_layer_id(layer_id_);
                     te::v1::GetVariablesResponse response;
                     grpc::ClientContext context;
                     context.set_deadline(
                         absl::ToChronoTime(absl::Now() + absl::Microseconds(Uniform(100, 2000))));
                     Count(stub_->GetVariables(&context, request, &response), true);
                   }),
          false);
  }

  void CutPutTensor() {
    ++figures_.faults["put_cut"];
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(kPutChunks * kPutChunkBytes / 4);
    writer->Write(header);
    te::v1::PutTensorChunk chunk;
    chunk.set_data(std::string(kPutChunkBytes, '\x11'));
    const int chunks = Uniform(0, kPutChunks - 1);
    for (int i = 0; i < chunks; ++i) {
      if (!writer->Write(chunk)) break;
    }
    context.TryCancel();
    Count(writer->Finish(), true);
  }

  void DropConnectionInPutTensor() {
    ++figures_.faults["connection_drop"];
    ++figures_.calls;
    const std::string binary = FaultClientPath();
    std::vector<std::string> args = {binary, server_.address(), session_.session_id(),
                                     session_.token(), absl::StrCat(Uniform(0, kPutChunks - 2))};
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, binary.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      figures_.unexpected.push_back("cannot start " + binary);
      return;
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      figures_.unexpected.push_back(absl::StrCat("fault_client: wait status ", status));
    }
  }

  void CutGetTensor() {
    ++figures_.faults["get_cut"];
    te::v1::PutTensorResponse put;
    {
      grpc::ClientContext context;
      auto writer = stub_->PutTensor(&context, &put);
      te::v1::PutTensorChunk header;
      *header.mutable_header()->mutable_session() = session_;
      header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
      header.mutable_header()->mutable_tensor()->add_shape(kPutChunkBytes);  // 256 KiB
      writer->Write(header);
      te::v1::PutTensorChunk chunk;
      chunk.set_data(std::string(4 * kPutChunkBytes, '\x22'));
      writer->Write(chunk);
      writer->WritesDone();
      grpc::Status status = writer->Finish();
      Count(status, false);
      if (!status.ok()) return;
    }
    grpc::ClientContext context;
    te::v1::GetTensorRequest request;
    *request.mutable_session() = session_;
    request.set_tensor_id(put.tensor_id());
    request.set_chunk_bytes(16 << 10);
    auto reader = stub_->GetTensor(&context, request);
    te::v1::TensorChunk message;
    reader->Read(&message);
    context.TryCancel();
    while (reader->Read(&message)) {
    }
    Count(reader->Finish(), true);
    te::v1::DeleteTensorRequest remove;
    *remove.mutable_session() = session_;
    remove.set_tensor_id(put.tensor_id());
    te::v1::DeleteTensorResponse removed;
    grpc::ClientContext remove_context;
    Count(stub_->DeleteTensor(&remove_context, remove, &removed), false);
  }

  void CheckIntegrity() {
    grpc::ClientContext context;
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = session_;
    request.set_layer_id(layer_id_);
    request.add_collections("params");
    te::v1::GetVariablesResponse response;
    grpc::Status status = stub_->GetVariables(&context, request, &response);
    Count(status, false);
    if (!status.ok()) return;
    ++figures_.integrity_checks;
    std::map<std::string, std::string> now;
    for (const te::v1::Variable& v : response.variables()) {
      now[absl::StrCat(v.collection(), "/", v.path())] = v.value().inline_data();
    }
    if (now != params_) ++figures_.corrupted;
  }

  void Close() {
    te::v1::CloseSessionRequest close;
    *close.mutable_session() = session_;
    te::v1::CloseSessionResponse closed;
    grpc::ClientContext context;
    grpc::Status status = stub_->CloseSession(&context, close, &closed);
    Count(status, false);
    if (status.ok()) ++figures_.sessions_closed;
    // Explicitly gone from now on.
    grpc::ClientContext after;
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = session_;
    request.set_layer_id(layer_id_);
    te::v1::GetVariablesResponse response;
    grpc::Status gone = stub_->GetVariables(&after, request, &response);
    ++figures_.calls;
    ++figures_.codes[gone.error_code()];
    if (gone.error_code() != grpc::StatusCode::NOT_FOUND) {
      figures_.unexpected.push_back(
          absl::StrCat("a closed session answered ", CodeName(gone.error_code())));
    }
    session_.Clear();
  }

  void CloseWithCallInFlight() {
    ++figures_.faults["close_in_flight"];
    grpc::ClientContext context;
    // The step either finishes before the close takes its turn, or finds the
    // session closed (NOT_FOUND); both are fine.
    Count(RunAsync(&context, Step(4), [&] { Close(); }), true);
  }

  const ServerProcess& server_;
  std::mt19937 rng_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
  te::v1::SessionRef session_;
  std::string layer_id_;
  std::map<std::string, std::string> params_;  // as at init, bit for bit
  Figures figures_;
};

te::v1::ServerStats Stats(te::v1::TeService::Stub& stub) {
  grpc::ClientContext context;
  te::v1::ServerInfo info;
  grpc::Status status = stub.GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(status.ok()) << Describe(status);
  return info.stats();
}

TEST(FaultTest, ServerSurvivesFaultsAndReturnsToBaseline) {
  ServerProcess::Options options;
  options.flags = {"--max_sessions=128", "--session_memory_bytes=268435456",
                   "--max_saved_forwards=4"};
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  auto stub = server.NewStub();
  const te::v1::ServerStats before = Stats(*stub);
  const int64_t rss_before = ResidentKib(server.pid());
  ASSERT_EQ(before.sessions_open(), 0);
  ASSERT_EQ(before.bytes_in_use(), 0);

  const int seconds = FaultSeconds();
  const absl::Time until = absl::Now() + absl::Seconds(seconds);
  std::vector<std::unique_ptr<FaultClient>> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(std::make_unique<FaultClient>(server, 1000 + i));
  }
  std::vector<std::thread> threads;
  for (auto& client : clients) threads.emplace_back([&client, until] { client->Run(until); });
  for (std::thread& thread : threads) thread.join();
  const te::v1::ServerStats during = Stats(*stub);
  const int64_t rss_during = ResidentKib(server.pid());

  // Survivors: intact, then closed.
  for (auto& client : clients) client->Finish();
  Figures figures;
  for (auto& client : clients) figures.Merge(client->figures());

  // Sessions a cancelled call still held go when that call ends: allow a moment.
  te::v1::ServerStats after = Stats(*stub);
  for (int i = 0; i < 100 && (after.sessions_open() != 0 || after.bytes_in_use() != 0); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    after = Stats(*stub);
  }
  const int64_t rss_after = ResidentKib(server.pid());

  // The server still serves: a new session runs a step.
  {
    te::v1::SessionRef session = CreateSession(*stub).session();
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session;
    init.mutable_spec()->mutable_dense_general()->add_features(8);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(2);
    init.add_input_shape(8);
    te::v1::InitLayerResponse initialised;
    grpc::ClientContext context;
    grpc::Status status = stub->InitLayer(&context, init, &initialised);
    EXPECT_TRUE(status.ok()) << Describe(status);
    te::v1::CloseSessionRequest close;
    *close.mutable_session() = session;
    te::v1::CloseSessionResponse closed;
    grpc::ClientContext close_context;
    EXPECT_TRUE(stub->CloseSession(&close_context, close, &closed).ok());
  }

  std::printf("\nfault test: %d clients, %d s\n", kClients, seconds);
  std::printf("  calls made          %lld\n", static_cast<long long>(figures.calls));
  int64_t injected = 0;
  for (const auto& [kind, n] : figures.faults) injected += n;
  std::printf("  faults injected     %lld:", static_cast<long long>(injected));
  for (const auto& [kind, n] : figures.faults)
    std::printf(" %s=%lld", kind.c_str(), static_cast<long long>(n));
  std::printf("\n  results by code    ");
  for (const auto& [code, n] : figures.codes)
    std::printf(" %s=%lld", CodeName(code), static_cast<long long>(n));
  std::printf("\n  sessions            opened=%lld closed=%lld\n",
              static_cast<long long>(figures.sessions_opened),
              static_cast<long long>(figures.sessions_closed));
  std::printf("  integrity checks    %lld, corrupted %lld\n",
              static_cast<long long>(figures.integrity_checks),
              static_cast<long long>(figures.corrupted));
  std::printf("  memory (server)     before: sessions=%d bytes_in_use=%lld rss=%lld KiB\n",
              before.sessions_open(), static_cast<long long>(before.bytes_in_use()),
              static_cast<long long>(rss_before));
  std::printf(
      "                      at the end of the faults: sessions=%d bytes_in_use=%lld rss=%lld "
      "KiB\n",
      during.sessions_open(), static_cast<long long>(during.bytes_in_use()),
      static_cast<long long>(rss_during));
  std::printf("                      after closing: sessions=%d bytes_in_use=%lld rss=%lld KiB\n",
              after.sessions_open(), static_cast<long long>(after.bytes_in_use()),
              static_cast<long long>(rss_after));
  for (const std::string& u : figures.unexpected) std::printf("  unexpected: %s\n", u.c_str());
  std::fflush(stdout);

  EXPECT_GT(injected, 0);
  EXPECT_GT(figures.integrity_checks, 0);
  EXPECT_EQ(figures.corrupted, 0) << "a session's parameters changed under faults";
  EXPECT_EQ(figures.ordinary_failures, 0) << "calls without a fault failed";
  for (grpc::StatusCode code :
       {grpc::StatusCode::UNKNOWN, grpc::StatusCode::INTERNAL, grpc::StatusCode::DATA_LOSS}) {
    EXPECT_EQ(figures.codes.count(code), 0u) << "server fault: " << CodeName(code);
  }
  EXPECT_TRUE(figures.unexpected.empty());
  EXPECT_EQ(after.sessions_open(), before.sessions_open());
  EXPECT_EQ(after.bytes_in_use(), before.bytes_in_use());
  EXPECT_TRUE(server.Stop().ok()) << "the server must still stop cleanly";
}

}  // namespace
}  // namespace te::testing
