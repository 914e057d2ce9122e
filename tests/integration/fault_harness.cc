// The fault run's clients and the run itself (fault_harness.h).
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/integration/fault_harness.h"
#include "tests/integration/test_util.h"
#include "tests/runfiles.h"
#include "tests/server_fixture.h"

extern char** environ;

namespace te::testing {
namespace {

constexpr int64_t kHidden = 64;
const std::vector<int64_t> kInputShape = {4, 16, kHidden};
constexpr int kPutChunkBytes = 64 << 10;
constexpr int kPutChunks = 16;

// A step that takes tens of milliseconds on the CPU reference (a 256x256x256
// GEMM forward and two backward): what abandoners give up on, and what
// hostile clients' deadlines can never be met by.
constexpr int64_t kHeavyHidden = 256;
const std::vector<int64_t> kHeavyShape = {4, 64, kHeavyHidden};
// An abandoned call carries this much work (micro-batches sized from a
// measured step), at most kMaxAbandonedMicroBatches (within the server's
// --max_micro_batches). On a GPU (TE_SERVER_FLAGS=--device=auto) the cap
// keeps abandoned calls short, and the bystanders' check proves less there.
constexpr absl::Duration kAbandonedWork = absl::Seconds(5);
constexpr int kMaxAbandonedMicroBatches = 200;

// A micro-batch so small that even 10,000 of them end in seconds on a server
// that wrongly runs them.
constexpr int64_t kLightHidden = 16;
const std::vector<int64_t> kLightShape = {1, 4, kLightHidden};
constexpr int kHostileMicroBatches = 10000;

// What hostile calls may take to be refused.
constexpr absl::Duration kHostileDeadline = absl::Seconds(10);
// The longest deadline of the failed-only sessions' steps that expire
// mid-run (long enough that the server has started them).
constexpr absl::Duration kMidRunDeadlineMax = absl::Milliseconds(200);
// Every expiring call of theirs carries at least this many times its
// deadline's worth of work, as measured on the server at hand: on a GPU a
// step of the heavy layer takes a fraction of a millisecond, so a 1 ms call
// of fixed size could be met, and the session rightly change.
constexpr int kExpiringWorkOverDeadline = 10;
// The most micro-batches an expiring step carries (the harness's server runs
// with --max_micro_batches above it), and the largest forward input.
constexpr int kMaxExpiringMicroBatches = 4096;
constexpr int64_t kMaxExpiringForwardBatch = 1024;
// For the checks after the run: room for whatever the run left queued.
constexpr absl::Duration kCheckDeadline = absl::Seconds(60);


std::chrono::system_clock::time_point In(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

// Codes a server fault would show; none may appear.
bool IsServerFault(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNKNOWN || code == grpc::StatusCode::INTERNAL ||
         code == grpc::StatusCode::DATA_LOSS;
}

// The only answers to a size no server can honour: a refusal naming it.
bool IsCleanRefusal(grpc::StatusCode code) {
  return code == grpc::StatusCode::RESOURCE_EXHAUSTED || code == grpc::StatusCode::INVALID_ARGUMENT;
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

// The server is the test's child: once it dies it stays a zombie ('Z') until
// the fixture reaps it, so an UNAVAILABLE can be told from a dead server.
bool ServerAlive(pid_t pid) {
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z' &&
         line[paren + 2] != 'X';
}

// $TE_FAULT_CLIENT_BINARY, else fault_client in the test's runfiles.
std::string FaultClientPath() {
  if (const char* path = std::getenv("TE_FAULT_CLIENT_BINARY")) return path;
  return te::testing::RunfilePath("tests/integration/fault_client");
}

// every client stops at once instead of spinning on UNAVAILABLE).
struct RunState {
  absl::Time until;
  std::atomic<bool> server_gone{false};
  bool Over() const { return server_gone.load() || absl::Now() >= until; }
};

// ---- requests -----------------------------------------------------------------------

te::v1::Autocast DelayedScaling() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  te::v1::DelayedScaling* recipe = autocast.mutable_recipe()->mutable_delayed_scaling();
  recipe->set_fp8_format(te::v1::HYBRID);
  recipe->set_amax_history_len(16);
  return autocast;
}

te::v1::InitLayerRequest DenseInit(const te::v1::SessionRef& session, int64_t features,
                                   const std::vector<int64_t>& input_shape, uint64_t seed,
                                   bool fp8) {
  te::v1::InitLayerRequest init;
  *init.mutable_session() = session;
  init.mutable_spec()->mutable_dense_general()->add_features(features);
  init.set_seed(seed);
  init.set_input_dtype(te::v1::FLOAT32);
  init.mutable_input_shape()->Assign(input_shape.begin(), input_shape.end());
  if (fp8) *init.mutable_autocast() = DelayedScaling();
  return init;
}

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A ForwardBackward of `micro_batches` (x, dy) pairs that all name the same
// resident tensors: any number of micro-batches in a small message.
te::v1::ForwardBackwardRequest ResidentStep(const te::v1::SessionRef& session,
                                            const std::string& layer_id, const std::string& x,
                                            const std::string& dy, int micro_batches, bool fp8) {
  te::v1::ForwardBackwardRequest request;
  *request.mutable_session() = session;
  request.set_layer_id(layer_id);
  request.set_deterministic(true);
  if (fp8) *request.mutable_autocast() = DelayedScaling();
  for (int i = 0; i < micro_batches; ++i) {
    te::v1::MicroBatch* batch = request.add_micro_batches();
    *batch->mutable_x() = ResidentRef(x);
    *batch->mutable_dy() = ResidentRef(dy);
  }
  return request;
}

// A connection of the client's own (not shared with the other clients').
// Its calls wait for the connection (waitForReady) and a failed connect is
// retried after 100 ms, not after gRPC's 1 s backoff: Debian's gRPC 1.51
// reads connect()'s errno after other calls (tcp_client_posix.cc), so now
// and then a connect still in progress is reported failed ("connect: No
// such file or directory", seen 1 run in 30 with GRPC_TRACE=subchannel),
// and fail-fast calls would then fail for the whole backoff, with no fault
// of the server's. A server that refuses or drops connections still fails
// them: they wait until their deadline.
std::unique_ptr<te::v1::TeService::Stub> OwnConnection(const ServerProcess& server) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetServiceConfigJSON(R"({"methodConfig": [{"name": [{}], "waitForReady": true}]})");
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  return te::v1::TeService::NewStub(
      grpc::CreateCustomChannel(server.address(), grpc::InsecureChannelCredentials(), args));
}

// Uploads `tensor`'s inline bytes as a resident tensor; its id, or the status.
absl::StatusOr<std::string> PutResident(te::v1::TeService::Stub& stub,
                                        const te::v1::SessionRef& session,
                                        const te::v1::Tensor& tensor) {
  grpc::ClientContext context;
  context.set_deadline(In(kCheckDeadline));
  te::v1::PutTensorResponse response;
  auto writer = stub.PutTensor(&context, &response);
  te::v1::PutTensorChunk header;
  *header.mutable_header()->mutable_session() = session;
  header.mutable_header()->mutable_tensor()->set_dtype(tensor.dtype());
  *header.mutable_header()->mutable_tensor()->mutable_shape() = tensor.shape();
  writer->Write(header);
  te::v1::PutTensorChunk chunk;
  chunk.set_data(tensor.inline_data());
  writer->Write(chunk);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return absl::UnavailableError(absl::StrCat("PutTensor: ", Describe(status)));
  return response.tensor_id();
}

void CloseQuietly(te::v1::TeService::Stub& stub, const te::v1::SessionRef& session) {
  if (session.session_id().empty()) return;
  te::v1::CloseSessionRequest close;
  *close.mutable_session() = session;
  te::v1::CloseSessionResponse closed;
  grpc::ClientContext context;
  context.set_deadline(In(kCheckDeadline));
  stub.CloseSession(&context, close, &closed);
}

// ---- fault clients -----------------------------------------------------------------

// One client: its own connection, at most one session at a time.
class FaultClient {
 public:
  FaultClient(const ServerProcess& server, uint32_t seed)
      : server_(server), rng_(seed), stub_(OwnConnection(server)) {}

  void Run(const RunState& run) {
    while (!run.Over()) {
      if (session_.session_id().empty() && !OpenSession()) continue;
      const int action = Uniform(0, 99);
      if (action < 26) {
        OrdinaryStep();
      } else if (action < 38) {
        CancelledStep();
      } else if (action < 48) {
        DeadlineStep();
      } else if (action < 56) {
        OneMillisecondDeadline();
      } else if (action < 63) {
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
    te::v1::InitLayerRequest init = DenseInit(session_, kHidden, kInputShape,
                                              static_cast<uint64_t>(Uniform(1, 1 << 30)), false);
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

  te::v1::ForwardRequest ForwardOf(bool keep_for_backward) {
    te::v1::ForwardRequest forward;
    *forward.mutable_session() = session_;
    forward.set_layer_id(layer_id_);
    *forward.mutable_x() = RandomInput(Uniform(0, 1 << 20));
    forward.set_keep_for_backward(keep_for_backward);
    return forward;
  }

  void OrdinaryStep() {
    if (Uniform(0, 1) == 0) {
      te::v1::ForwardBackwardResponse response;
      grpc::ClientContext context;
      Count(stub_->ForwardBackward(&context, Step(2), &response), false);
      return;
    }
    te::v1::ForwardResponse y;
    grpc::ClientContext context;
    grpc::Status status = stub_->Forward(&context, ForwardOf(true), &y);
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

  // An ordinary call of each kind that does work with a 1 ms deadline: it
  // may end either way, but never with a server fault. (A 1 ms InitLayer
  // that still ran leaves an unused layer, freed with the session.)
  void OneMillisecondDeadline() {
    ++figures_.faults["deadline_1ms"];
    grpc::ClientContext context;
    context.set_deadline(In(absl::Milliseconds(1)));
    grpc::Status status;
    const char* kind = "";
    switch (Uniform(0, 2)) {
      case 0: {
        kind = "1 ms Forward (fault client)";
        te::v1::ForwardResponse response;
        status = stub_->Forward(&context, ForwardOf(Uniform(0, 1) == 1), &response);
        break;
      }
      case 1: {
        kind = "1 ms ForwardBackward (fault client)";
        te::v1::ForwardBackwardResponse response;
        status = stub_->ForwardBackward(&context, Step(2), &response);
        break;
      }
      default: {
        kind = "1 ms InitLayer (fault client)";
        te::v1::InitLayerResponse response;
        status = stub_->InitLayer(
            &context, DenseInit(session_, kHidden, kInputShape, Uniform(1, 1 << 30), false),
            &response);
        break;
      }
    }
    ++figures_.kind_codes[kind][status.error_code()];
    Count(status, true);
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

// ---- abandoners -----------------------------------------------------------------------

// Starts ForwardBackward calls worth kAbandonedWork of device time and gives
// up on each after 20-150 ms: half by cancelling, half by a deadline that
// passes. Right behind each, the session's GetSessionInfo measures how long
// the server kept working for nobody (it runs in the session's turn, so it
// waits until the abandoned call has let go).
class Abandoner {
 public:
  Abandoner(const ServerProcess& server, uint32_t seed)
      : rng_(seed), stub_(OwnConnection(server)) {}

  // A session with a heavy layer and its inputs resident, and one micro-batch
  // timed (best of two, before the run, on an idle server) to size the
  // abandoned calls.
  bool SetUp() {
    grpc::ClientContext context;
    context.set_deadline(In(kCheckDeadline));
    te::v1::CreateSessionResponse created;
    grpc::Status status = stub_->CreateSession(&context, te::v1::CreateSessionRequest(), &created);
    if (!status.ok()) return Fail("CreateSession", status);
    session_ = created.session();
    grpc::ClientContext init_context;
    init_context.set_deadline(In(kCheckDeadline));
    te::v1::InitLayerResponse initialised;
    status = stub_->InitLayer(
        &init_context, DenseInit(session_, kHeavyHidden, kHeavyShape, 7, false), &initialised);
    if (!status.ok()) return Fail("InitLayer", status);
    layer_id_ = initialised.layer_id();
    const size_t n = static_cast<size_t>(Elements(kHeavyShape));
    absl::StatusOr<std::string> x =
        PutResident(*stub_, session_, MakeTensor(te::v1::FLOAT32, kHeavyShape, RandomFloats(n, 1)));
    absl::StatusOr<std::string> dy =
        PutResident(*stub_, session_, MakeTensor(te::v1::FLOAT32, kHeavyShape, RandomFloats(n, 2)));
    if (!x.ok() || !dy.ok()) {
      return Fail((!x.ok() ? x.status() : dy.status()).ToString(), grpc::Status::OK);
    }
    x_id_ = *x;
    dy_id_ = *dy;
    absl::Duration step = absl::InfiniteDuration();
    for (int i = 0; i < 2; ++i) {
      grpc::ClientContext step_context;
      step_context.set_deadline(In(kCheckDeadline));
      te::v1::ForwardBackwardResponse response;
      const absl::Time start = absl::Now();
      status = stub_->ForwardBackward(
          &step_context, ResidentStep(session_, layer_id_, x_id_, dy_id_, 1, false), &response);
      if (!status.ok()) return Fail("ForwardBackward", status);
      step = std::min(step, absl::Now() - start);
    }
    step = std::max(step, absl::Microseconds(100));
    micro_batches_ = static_cast<int>(
        std::clamp<double>(absl::FDivDuration(kAbandonedWork, step), 8, kMaxAbandonedMicroBatches));
    figures_.heavy_step_ms.push_back(absl::ToDoubleMilliseconds(step));
    figures_.abandoned_micro_batches.push_back(micro_batches_);
    return true;
  }

  void Run(const RunState& run) {
    if (session_.session_id().empty()) return;
    while (!run.Over()) {
      const bool by_cancel = Uniform(0, 1) == 0;
      const char* kind = by_cancel ? "abandoned (cancelled)" : "abandoned (deadline)";
      ++figures_.faults[by_cancel ? "abandon_cancel" : "abandon_deadline"];
      const absl::Duration after = absl::Milliseconds(Uniform(20, 150));
      te::v1::ForwardBackwardRequest request =
          ResidentStep(session_, layer_id_, x_id_, dy_id_, micro_batches_, false);
      te::v1::ForwardBackwardResponse response;
      grpc::ClientContext context;
      grpc::Status status;
      if (by_cancel) {
        absl::Notification done;
        stub_->async()->ForwardBackward(&context, &request, &response, [&](grpc::Status s) {
          status = std::move(s);
          done.Notify();
        });
        if (!done.WaitForNotificationWithTimeout(after)) context.TryCancel();
        done.WaitForNotification();
      } else {
        context.set_deadline(In(after));
        status = stub_->ForwardBackward(&context, request, &response);
      }
      ++figures_.calls;
      ++figures_.codes[status.error_code()];
      ++figures_.kind_codes[kind][status.error_code()];
      if (IsServerFault(status.error_code())) {
        figures_.unexpected.push_back(absl::StrCat(kind, ": ", Describe(status)));
      }
      MeasureRelease();
      absl::SleepFor(absl::Milliseconds(Uniform(50, 150)));
    }
  }

  void Finish() { CloseQuietly(*stub_, session_); }
  const Figures& figures() const { return figures_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  bool Fail(const std::string& what, const grpc::Status& status) {
    figures_.unexpected.push_back(absl::StrCat("abandoner set-up: ", what, ": ", Describe(status)));
    session_.Clear();
    return false;
  }

  void MeasureRelease() {
    te::v1::GetSessionInfoRequest request;
    *request.mutable_session() = session_;
    te::v1::SessionInfo info;
    grpc::ClientContext context;
    context.set_deadline(In(kCheckDeadline));
    const absl::Time start = absl::Now();
    const grpc::Status status = stub_->GetSessionInfo(&context, request, &info);
    ++figures_.calls;
    ++figures_.codes[status.error_code()];
    if (!status.ok()) {
      ++figures_.ordinary_failures;
      figures_.unexpected.push_back(absl::StrCat("abandoner GetSessionInfo: ", Describe(status)));
      return;
    }
    figures_.release_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }

  std::mt19937 rng_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
  te::v1::SessionRef session_;
  std::string layer_id_, x_id_, dy_id_;
  int micro_batches_ = 8;
  Figures figures_;
};

// ---- bystanders ------------------------------------------------------------------------

// An ordinary session that, all through the run, asks what it holds, runs a
// small step and opens (and closes) a session, each with kBystanderDeadline:
// whatever the others do, every one of those must answer in time.
class Bystander {
 public:
  Bystander(const ServerProcess& server, uint32_t seed)
      : rng_(seed), stub_(OwnConnection(server)) {}

  // Before the run: the session, its small layer and inputs (resident).
  bool SetUp() {
    te::v1::CreateSessionResponse created;
    if (!Timed("CreateSession", [&](grpc::ClientContext* context) {
           return stub_->CreateSession(context, te::v1::CreateSessionRequest(), &created);
         }).ok()) {
      return false;
    }
    session_ = created.session();
    te::v1::InitLayerResponse initialised;
    if (!Timed("InitLayer", [&](grpc::ClientContext* context) {
           return stub_->InitLayer(context, DenseInit(session_, kHidden, kInputShape, 3, false),
                                   &initialised);
         }).ok()) {
      return false;
    }
    layer_id_ = initialised.layer_id();
    const size_t n = static_cast<size_t>(Elements(kInputShape));
    absl::StatusOr<std::string> x =
        PutResident(*stub_, session_, MakeTensor(te::v1::FLOAT32, kInputShape, RandomFloats(n, 5)));
    absl::StatusOr<std::string> dy =
        PutResident(*stub_, session_, MakeTensor(te::v1::FLOAT32, kInputShape, RandomFloats(n, 6)));
    if (!x.ok() || !dy.ok()) {
      ++figures_.bystander_misses;
      figures_.miss_examples.push_back(
          absl::StrCat("set-up: ", (!x.ok() ? x.status() : dy.status()).ToString()));
      return false;
    }
    x_id_ = *x;
    dy_id_ = *dy;
    return true;
  }

  void Run(const RunState& run) {
    if (session_.session_id().empty()) return;
    for (int round = 0; !run.Over(); ++round) {
      Timed("GetSessionInfo", [&](grpc::ClientContext* context) {
        te::v1::GetSessionInfoRequest request;
        *request.mutable_session() = session_;
        te::v1::SessionInfo info;
        return stub_->GetSessionInfo(context, request, &info);
      });
      Timed("ForwardBackward", [&](grpc::ClientContext* context) {
        te::v1::ForwardBackwardResponse response;
        return stub_->ForwardBackward(
            context, ResidentStep(session_, layer_id_, x_id_, dy_id_, 1, false), &response);
      });
      if (round % 4 == 0) {
        te::v1::CreateSessionResponse created;
        const grpc::Status status = Timed("CreateSession", [&](grpc::ClientContext* context) {
          return stub_->CreateSession(context, te::v1::CreateSessionRequest(), &created);
        });
        if (status.ok()) {
          Timed("CloseSession", [&](grpc::ClientContext* context) {
            te::v1::CloseSessionRequest close;
            *close.mutable_session() = created.session();
            te::v1::CloseSessionResponse closed;
            return stub_->CloseSession(context, close, &closed);
          });
        }
      }
      absl::SleepFor(absl::Milliseconds(Uniform(20, 60)));
    }
  }

  void Finish() { CloseQuietly(*stub_, session_); }
  const Figures& figures() const { return figures_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  grpc::Status Timed(const std::string& kind,
                     const std::function<grpc::Status(grpc::ClientContext*)>& call) {
    grpc::ClientContext context;
    context.set_deadline(In(kBystanderDeadline));
    const absl::Time start = absl::Now();
    const grpc::Status status = call(&context);
    const absl::Duration took = absl::Now() - start;
    ++figures_.calls;
    ++figures_.codes[status.error_code()];
    ++figures_.bystander_calls;
    figures_.bystander_ms[kind].push_back(absl::ToDoubleMilliseconds(took));
    if (!status.ok() || took > kBystanderDeadline) {
      ++figures_.bystander_misses;
      if (figures_.miss_examples.size() < 5) {
        figures_.miss_examples.push_back(absl::StrCat(kind, " after ", absl::FormatDuration(took),
                                                      ": ", CodeName(status.error_code()), " ",
                                                      status.error_message()));
      }
    }
    return status;
  }

  std::mt19937 rng_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
  te::v1::SessionRef session_;
  std::string layer_id_, x_id_, dy_id_;
  Figures figures_;
};

// ---- hostile clients -------------------------------------------------------------------

// A session's whole observable state: every variable of its layers (bytes,
// dtype, shape) and what GetSessionInfo reports.
struct SessionState {
  std::map<std::string, std::tuple<int, std::vector<int64_t>, std::string>> variables;
  te::v1::SessionInfo info;
  grpc::Status status;  // of the first call that failed, if any
};

// Variables are named "<label>:<collection>/<path>", the label saying which
// of the session's layers (and so which calls) they belong to.
SessionState ReadState(te::v1::TeService::Stub& stub, const te::v1::SessionRef& session,
                       const std::vector<std::pair<std::string, std::string>>& layers) {
  SessionState state;
  for (const auto& [label, layer_id] : layers) {
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer_id);  // no collections: params, fp8_metas and grads
    te::v1::GetVariablesResponse response;
    grpc::ClientContext context;
    context.set_deadline(In(kCheckDeadline));
    state.status = stub.GetVariables(&context, request, &response);
    if (!state.status.ok()) return state;
    for (const te::v1::Variable& v : response.variables()) {
      state.variables[absl::StrCat(label, ":", v.collection(), "/", v.path())] =
          std::make_tuple(static_cast<int>(v.value().dtype()), ShapeOf(v.value()),
                          v.value().has_inline_data() ? v.value().inline_data()
                                                      : "resident:" + v.value().resident_id());
    }
  }
  te::v1::GetSessionInfoRequest request;
  *request.mutable_session() = session;
  grpc::ClientContext context;
  context.set_deadline(In(kCheckDeadline));
  state.status = stub.GetSessionInfo(&context, request, &state.info);
  return state;
}


// A valid session that only ever makes calls that must fail: sizes no
// server can honour, and steps whose deadline (1 ms, or a few ms into a step
// of tens of ms) cannot be met. Its two layers are initialised under FP8
// DelayedScaling, so any step that wrongly commits moves their fp8_metas
// (and, for ForwardBackward, the kept grads).
class HostileClient {
 public:
  HostileClient(const ServerProcess& server, uint32_t seed)
      : server_(server), rng_(seed), stub_(OwnConnection(server)) {}

  // Before the run (no one else is on the server yet): the session, its
  // layers, their inputs, and the state everything must leave alone.
  bool SetUp() {
    grpc::ClientContext context;
    context.set_deadline(In(kCheckDeadline));
    te::v1::CreateSessionResponse created;
    grpc::Status status = stub_->CreateSession(&context, te::v1::CreateSessionRequest(), &created);
    if (!status.ok()) return Fail("CreateSession", status);
    session_ = created.session();
    for (auto [layer, features, shape] :
         {std::make_tuple(&heavy_layer_, kHeavyHidden, &kHeavyShape),
          std::make_tuple(&light_layer_, kLightHidden, &kLightShape)}) {
      grpc::ClientContext init_context;
      init_context.set_deadline(In(kCheckDeadline));
      te::v1::InitLayerResponse initialised;
      status = stub_->InitLayer(&init_context, DenseInit(session_, features, *shape, 11, true),
                                &initialised);
      if (!status.ok()) return Fail("InitLayer", status);
      *layer = initialised.layer_id();
    }
    for (auto [id, shape, seed] : {std::make_tuple(&heavy_x_, &kHeavyShape, 21),
                                   std::make_tuple(&heavy_dy_, &kHeavyShape, 22),
                                   std::make_tuple(&light_x_, &kLightShape, 23),
                                   std::make_tuple(&light_dy_, &kLightShape, 24)}) {
      absl::StatusOr<std::string> put =
          PutResident(*stub_, session_,
                      MakeTensor(te::v1::FLOAT32, *shape,
                                 RandomFloats(static_cast<size_t>(Elements(*shape)), seed, 2.0f)));
      if (!put.ok()) return Fail(put.status().ToString(), grpc::Status::OK);
      *id = *put;
    }
    // One FP8 step on the heavy layer, timed (best of two) to size the steps
    // whose deadline passes mid-run: ten times the work their deadline allows.
    absl::Duration step = absl::InfiniteDuration();
    for (int i = 0; i < 2; ++i) {
      grpc::ClientContext step_context;
      step_context.set_deadline(In(kCheckDeadline));
      te::v1::ForwardBackwardResponse response;
      const absl::Time start = absl::Now();
      status = stub_->ForwardBackward(
          &step_context, ResidentStep(session_, heavy_layer_, heavy_x_, heavy_dy_, 1, true),
          &response);
      if (!status.ok()) return Fail("ForwardBackward", status);
      step = std::min(step, absl::Now() - start);
    }
    step = std::max(step, absl::Microseconds(10));
    auto micro_batches_for = [step](absl::Duration deadline) {
      return static_cast<int>(std::clamp<double>(
          std::ceil(absl::FDivDuration(kExpiringWorkOverDeadline * deadline, step)), 16,
          kMaxExpiringMicroBatches));
    };
    mid_run_micro_batches_ = micro_batches_for(kMidRunDeadlineMax);
    tiny_micro_batches_ = micro_batches_for(absl::Milliseconds(1));
    figures_.mid_run_micro_batches.push_back(mid_run_micro_batches_);
    // The 1 ms Forward's x: the heavy x repeated along its batch until its
    // forward (about a third of a step) is worth ten deadlines.
    const int64_t repeats = static_cast<int64_t>(std::clamp<double>(
        std::ceil(absl::FDivDuration(3 * kExpiringWorkOverDeadline * absl::Milliseconds(1), step)),
        1, static_cast<double>(kMaxExpiringForwardBatch / kHeavyShape[0])));
    std::vector<int64_t> forward_shape = kHeavyShape;
    forward_shape[0] *= repeats;
    absl::StatusOr<std::string> forward_x =
        PutResident(*stub_, session_,
                    MakeTensor(te::v1::FLOAT32, forward_shape,
                               RandomFloats(static_cast<size_t>(Elements(forward_shape)), 25, 2.0f)));
    if (!forward_x.ok()) return Fail(forward_x.status().ToString(), grpc::Status::OK);
    forward_x_ = *forward_x;
    // The state every call from now on must leave alone.
    before_ = ReadState(*stub_, session_, Layers());
    if (!before_.status.ok()) return Fail("the state before", before_.status);
    return true;
  }

  void Run(const RunState& run) {
    if (session_.session_id().empty()) return;
    const std::vector<std::pair<std::string, std::function<grpc::Status()>>> calls = {
        {"hostile: InitLayer TransformerLayer hidden 2^20", [&] { return HugeTransformer(false); }},
        {"hostile: InitLayer TransformerLayer hidden 2^20 FP8",
         [&] { return HugeTransformer(true); }},
        {"hostile: InitLayer DenseGeneral features 2^31",
         [&] { return HugeDense(int64_t{1} << 31); }},
        {"hostile: InitLayer DenseGeneral features 2^40",
         [&] { return HugeDense(int64_t{1} << 40); }},
        {"hostile: PutTensor shape product overflows int64",
         [&] {
           return PutHeaderOnly({4, int64_t{4611686018427387904}, int64_t{1844674407370955161}});
         }},
        {"hostile: PutTensor header of 2^40 bytes",
         [&] { return PutHeaderOnly({int64_t{1} << 38}); }},
        {"hostile: ForwardBackward 10000 micro-batches", [&] { return ManyMicroBatches(); }},
    };
    const std::vector<std::pair<std::string, std::function<grpc::Status()>>> expiring = {
        {"failed-only: 1 ms Forward", [&] { return ExpiringForward(); }},
        {"failed-only: 1 ms ForwardBackward",
         [&] { return ExpiringStep(absl::Milliseconds(1), tiny_micro_batches_); }},
        {"failed-only: 1 ms InitLayer", [&] { return ExpiringInit(); }},
        {"failed-only: ForwardBackward deadline mid-run",
         [&] {
           return ExpiringStep(
               absl::Milliseconds(Uniform(5, absl::ToInt64Milliseconds(kMidRunDeadlineMax))),
               mid_run_micro_batches_);
         }},
    };
    // One of each in turn, so that both kinds run even when a server is slow
    // to answer either.
    for (size_t round = 0; !run.Over(); ++round) {
      {
        const auto& [kind, call] = calls[round % calls.size()];
        ++figures_.faults["hostile_size"];
        const grpc::Status status = call();
        Record(kind, status);
        if (!IsCleanRefusal(status.error_code())) {
          ++figures_.unclean;
          if (figures_.unclean_examples.size() < 6) {
            figures_.unclean_examples.push_back(
                absl::StrCat(kind, ": ", CodeName(status.error_code()), " ",
                             status.error_message().substr(0, 160)));
          }
        }
        if (status.ok()) ++figures_.failed_only_succeeded;
      }
      absl::SleepFor(absl::Milliseconds(Uniform(10, 40)));
      if (run.Over()) break;
      {
        const auto& [kind, call] = expiring[round % expiring.size()];
        ++figures_.faults[absl::StrContains(kind, "mid-run") ? "deadline_mid_run" : "deadline_1ms"];
        const grpc::Status status = call();
        Record(kind, status);
        if (status.ok()) ++figures_.failed_only_succeeded;
      }
      absl::SleepFor(absl::Milliseconds(Uniform(10, 40)));
    }
  }

  // After the run: the session must be as SetUp left it.
  FailedOnlyReport Compare() {
    FailedOnlyReport report;
    if (session_.session_id().empty()) {
      report.read_error = "no session (its set-up failed)";
      return report;
    }
    const SessionState after = ReadState(*stub_, session_, Layers());
    if (!after.status.ok()) {
      report.read_error = Describe(after.status);
      return report;
    }
    report.read = true;
    report.variables_before = static_cast<int64_t>(before_.variables.size());
    auto note = [&report](const std::string& name, const char* how) {
      report.changed.push_back(how[0] == 'c' ? name : absl::StrCat(name, " (", how, ")"));
      ++report.change_counts[name.substr(0, name.find('/'))][how];
    };
    for (const auto& [name, value] : before_.variables) {
      ++report.by_collection[name.substr(name.find(':') + 1, name.find('/') - name.find(':') - 1)];
      auto it = after.variables.find(name);
      if (it == after.variables.end()) {
        note(name, "gone");
      } else if (it->second != value) {
        note(name, "changed");
      }
    }
    for (const auto& [name, value] : after.variables) {
      if (before_.variables.count(name) == 0) note(name, "appeared");
    }
    report.before = before_.info;
    report.after = after.info;
    return report;
  }

  void Finish() { CloseQuietly(*stub_, session_); }
  const Figures& figures() const { return figures_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  // "heavy" gets only the steps that cannot meet their deadline; "light" the
  // 10,000 micro-batches.
  std::vector<std::pair<std::string, std::string>> Layers() const {
    return {{"heavy", heavy_layer_}, {"light", light_layer_}};
  }

  bool Fail(const std::string& what, const grpc::Status& status) {
    figures_.unexpected.push_back(absl::StrCat("hostile set-up: ", what, ": ", Describe(status)));
    session_.Clear();
    return false;
  }

  void Record(const std::string& kind, const grpc::Status& status) {
    ++figures_.calls;
    ++figures_.codes[status.error_code()];
    ++figures_.kind_codes[kind][status.error_code()];
    if (IsServerFault(status.error_code()) && figures_.unexpected.size() < 5) {
      figures_.unexpected.push_back(absl::StrCat(kind, ": ", Describe(status)));
    }
    // A dead server answers UNAVAILABLE: name the call it died on.
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE && !died_reported_) {
      absl::SleepFor(absl::Milliseconds(300));
      if (!ServerAlive(server_.pid())) {
        died_reported_ = true;
        figures_.server_died_during.push_back(kind);
      }
    }
  }

  // TransformerLayer(hidden_size 2^20): x [1, 1, 2^20] is only a few MiB,
  // but the QKV kernel alone is 2^20 x 3 * 2^20 and the MLP's 2^20 x 2^22.
  grpc::Status HugeTransformer(bool fp8) {
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session_;
    te::v1::TransformerLayer* layer = init.mutable_spec()->mutable_transformer_layer();
    layer->set_hidden_size(int64_t{1} << 20);
    layer->set_mlp_hidden_size(int64_t{4} << 20);
    layer->set_num_attention_heads(16);
    init.set_input_dtype(te::v1::BFLOAT16);
    for (int64_t d : {int64_t{1}, int64_t{1}, int64_t{1} << 20}) init.add_input_shape(d);
    if (fp8) *init.mutable_autocast() = DelayedScaling();
    grpc::ClientContext context;
    context.set_deadline(In(kHostileDeadline));
    te::v1::InitLayerResponse response;
    return stub_->InitLayer(&context, init, &response);
  }

  grpc::Status HugeDense(int64_t features) {
    grpc::ClientContext context;
    context.set_deadline(In(kHostileDeadline));
    te::v1::InitLayerResponse response;
    return stub_->InitLayer(&context, DenseInit(session_, features, kHeavyShape, 13, true),
                            &response);
  }

  // A PutTensor whose header alone must be refused; no data follows.
  grpc::Status PutHeaderOnly(const std::vector<int64_t>& shape) {
    grpc::ClientContext context;
    context.set_deadline(In(kHostileDeadline));
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->mutable_shape()->Assign(shape.begin(), shape.end());
    writer->Write(header);
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status ManyMicroBatches() {
    grpc::ClientContext context;
    context.set_deadline(In(kHostileDeadline));
    te::v1::ForwardBackwardResponse response;
    return stub_->ForwardBackward(
        &context,
        ResidentStep(session_, light_layer_, light_x_, light_dy_, kHostileMicroBatches, true),
        &response);
  }

  grpc::Status ExpiringForward() {
    te::v1::ForwardRequest forward;
    *forward.mutable_session() = session_;
    forward.set_layer_id(heavy_layer_);
    *forward.mutable_x() = ResidentRef(forward_x_);
    *forward.mutable_autocast() = DelayedScaling();
    // Kept: a saved forward would be left behind; not kept: the step ends
    // here and would move the fp8_metas.
    forward.set_keep_for_backward(Uniform(0, 1) == 1);
    grpc::ClientContext context;
    context.set_deadline(In(absl::Milliseconds(1)));
    te::v1::ForwardResponse response;
    return stub_->Forward(&context, forward, &response);
  }

  grpc::Status ExpiringStep(absl::Duration deadline, int micro_batches) {
    grpc::ClientContext context;
    context.set_deadline(In(deadline));
    te::v1::ForwardBackwardResponse response;
    return stub_->ForwardBackward(
        &context, ResidentStep(session_, heavy_layer_, heavy_x_, heavy_dy_, micro_batches, true),
        &response);
  }

  grpc::Status ExpiringInit() {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Milliseconds(1)));
    te::v1::InitLayerResponse response;
    return stub_->InitLayer(&context, DenseInit(session_, 4 * kHeavyHidden, kHeavyShape, 17, true),
                            &response);
  }

  const ServerProcess& server_;
  std::mt19937 rng_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
  te::v1::SessionRef session_;
  std::string heavy_layer_, light_layer_;
  std::string heavy_x_, heavy_dy_, light_x_, light_dy_;
  std::string forward_x_;  // the 1 ms Forward's input (sized in SetUp)
  int mid_run_micro_batches_ = 16;
  int tiny_micro_batches_ = 16;
  SessionState before_;
  bool died_reported_ = false;
  Figures figures_;
};

te::v1::ServerStats Stats(te::v1::TeService::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(In(kCheckDeadline));
  te::v1::ServerInfo info;
  grpc::Status status = stub.GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
  EXPECT_TRUE(status.ok()) << Describe(status);
  return info.stats();
}

std::string CodesLine(const std::map<grpc::StatusCode, int64_t>& codes) {
  std::vector<std::string> parts;
  for (const auto& [code, n] : codes) parts.push_back(absl::StrCat(CodeName(code), "=", n));
  return absl::StrJoin(parts, " ");
}

}  // namespace

int FaultSeconds() {
  int seconds = 20;
  if (const char* env = std::getenv("FAULT_SECONDS")) {
    if (!absl::SimpleAtoi(env, &seconds) || seconds < 1) seconds = 20;
  }
  return seconds;
}

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
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    default:
      return "OTHER";
  }
}

double Quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

FaultRunResult RunFaults(const FaultRunOptions& run_options) {
  FaultRunResult result;
  ServerProcess::Options options;
  options.flags = {"--max_sessions=128", "--session_memory_bytes=268435456",
                   absl::StrCat("--max_micro_batches=", kMaxExpiringMicroBatches),
                   "--max_saved_forwards=4", absl::StrCat("--executor_threads=", kExecutorThreads),
                   // Thousands of injected failures: their info lines would bury the
                   // test's own report.
                   "--log_level=warning"};
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(options);
  if (!started.ok()) {
    result.setup_failures.push_back(absl::StrCat("te_server: ", started.status().ToString()));
    return result;
  }
  ServerProcess& server = **started;
  auto stub = server.NewStub();
  const te::v1::ServerStats before = Stats(*stub);
  result.before = before;
  const int64_t rss_before = ResidentKib(server.pid());
  if (before.sessions_open() != 0 || before.bytes_in_use() != 0) {
    result.setup_failures.push_back(absl::StrCat("a fresh server holds ", before.sessions_open(),
                                                 " sessions and ", before.bytes_in_use(), " bytes"));
  }

  std::vector<std::unique_ptr<FaultClient>> faulty;
  std::vector<std::unique_ptr<Abandoner>> abandoners;
  std::vector<std::unique_ptr<Bystander>> bystanders;
  std::vector<std::unique_ptr<HostileClient>> hostile;
  uint32_t seed = 1000;
  for (int i = 0; i < run_options.fault_clients; ++i) {
    faulty.push_back(std::make_unique<FaultClient>(server, seed++));
  }
  for (int i = 0; i < run_options.abandoners; ++i) {
    abandoners.push_back(std::make_unique<Abandoner>(server, seed++));
    if (!abandoners.back()->SetUp()) result.setup_failures.push_back("an abandoner");
  }
  for (int i = 0; i < run_options.bystanders; ++i) {
    bystanders.push_back(std::make_unique<Bystander>(server, seed++));
    if (!bystanders.back()->SetUp()) result.setup_failures.push_back("a bystander");
  }
  for (int i = 0; i < run_options.hostile_clients; ++i) {
    hostile.push_back(std::make_unique<HostileClient>(server, seed++));
    if (!hostile.back()->SetUp()) result.setup_failures.push_back("a failed-only session");
  }

  const int seconds = run_options.seconds;
  RunState run;
  run.until = absl::Now() + absl::Seconds(seconds);
  absl::Time server_gone_at = absl::InfiniteFuture();
  std::thread watcher([&] {
    while (absl::Now() < run.until) {
      if (!ServerAlive(server.pid())) {
        server_gone_at = absl::Now();
        run.server_gone = true;
        return;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  const absl::Time run_start = absl::Now();
  std::vector<std::thread> threads;
  for (auto& client : faulty) threads.emplace_back([&client, &run] { client->Run(run); });
  for (auto& client : abandoners) threads.emplace_back([&client, &run] { client->Run(run); });
  for (auto& client : bystanders) threads.emplace_back([&client, &run] { client->Run(run); });
  for (auto& client : hostile) threads.emplace_back([&client, &run] { client->Run(run); });
  for (std::thread& thread : threads) thread.join();
  watcher.join();
  const bool alive = ServerAlive(server.pid());
  result.alive = alive;

  te::v1::ServerStats& during = result.during;
  te::v1::ServerStats& after = result.after;
  int64_t rss_during = -1, rss_after = -1;
  std::vector<FailedOnlyReport>& failed_only = result.failed_only;
  bool& still_serves = result.still_serves;
  if (alive) {
    during = Stats(*stub);
    rss_during = ResidentKib(server.pid());
    // The failed-only sessions first: in their session's order, after
    // whatever the run left running on them.
    for (auto& client : hostile) failed_only.push_back(client->Compare());
    // Survivors: intact, then closed.
    for (auto& client : faulty) client->Finish();
    for (auto& client : abandoners) client->Finish();
    for (auto& client : bystanders) client->Finish();
    for (auto& client : hostile) client->Finish();

    // Sessions a cancelled call still held go when that call ends: allow a moment.
    after = Stats(*stub);
    for (int i = 0; i < 100 && (after.sessions_open() != 0 || after.bytes_in_use() != 0); ++i) {
      absl::SleepFor(absl::Milliseconds(100));
      after = Stats(*stub);
    }
    rss_after = ResidentKib(server.pid());

    // The server still serves: a new session runs a step.
    te::v1::SessionRef session = CreateSession(*stub).session();
    grpc::ClientContext context;
    context.set_deadline(In(kCheckDeadline));
    te::v1::InitLayerResponse initialised;
    grpc::Status status =
        stub->InitLayer(&context, DenseInit(session, 8, {2, 8}, 1, false), &initialised);
    still_serves = status.ok();
    if (!status.ok()) std::printf("  InitLayer after the run: %s\n", Describe(status).c_str());
    CloseQuietly(*stub, session);
  }

  Figures& figures = result.figures;
  for (auto& client : faulty) figures.Merge(client->figures());
  for (auto& client : abandoners) figures.Merge(client->figures());
  for (auto& client : bystanders) figures.Merge(client->figures());
  for (auto& client : hostile) figures.Merge(client->figures());

  // ---- the figures, as a block for the README ----
  std::printf(
      "\nfault test: %d clients (%d fault, %d abandoners, %d bystanders, %d hostile), %d s\n",
      run_options.fault_clients + run_options.abandoners + run_options.bystanders +
          run_options.hostile_clients,
      run_options.fault_clients, run_options.abandoners, run_options.bystanders,
      run_options.hostile_clients, seconds);
  std::printf(
      "  server              %s\n",
      alive ? "alive after the run"
            : absl::StrCat(
                  "DIED ", absl::FormatDuration(server_gone_at - run_start), " into the run",
                  figures.server_died_during.empty()
                      ? std::string()
                      : absl::StrCat(", during: ", absl::StrJoin(figures.server_died_during, "; ")))
                  .c_str());
  std::printf("  calls made          %lld\n", static_cast<long long>(figures.calls));
  int64_t& injected = result.injected;
  for (const auto& [kind, n] : figures.faults) injected += n;
  std::printf("  faults injected     %lld:", static_cast<long long>(injected));
  for (const auto& [kind, n] : figures.faults)
    std::printf(" %s=%lld", kind.c_str(), static_cast<long long>(n));
  std::printf("\n  results by code     %s\n", CodesLine(figures.codes).c_str());
  std::printf("  by kind of call\n");
  for (const auto& [kind, codes] : figures.kind_codes) {
    std::printf("    %-52s %s\n", kind.c_str(), CodesLine(codes).c_str());
  }
  std::printf("  sessions            opened=%lld closed=%lld\n",
              static_cast<long long>(figures.sessions_opened),
              static_cast<long long>(figures.sessions_closed));
  std::printf("  integrity checks    %lld, corrupted %lld\n",
              static_cast<long long>(figures.integrity_checks),
              static_cast<long long>(figures.corrupted));
  std::printf(
      "  abandoned calls     heavy micro-batch %.0f ms (max of %zu), %d-%d micro-batches "
      "per call; session busy after its client left: max %.0f ms, p99 %.0f ms (%zu)\n",
      figures.heavy_step_ms.empty()
          ? 0.0
          : *std::max_element(figures.heavy_step_ms.begin(), figures.heavy_step_ms.end()),
      figures.heavy_step_ms.size(),
      figures.abandoned_micro_batches.empty()
          ? 0
          : *std::min_element(figures.abandoned_micro_batches.begin(),
                              figures.abandoned_micro_batches.end()),
      figures.abandoned_micro_batches.empty()
          ? 0
          : *std::max_element(figures.abandoned_micro_batches.begin(),
                              figures.abandoned_micro_batches.end()),
      Quantile(figures.release_ms, 1.0), Quantile(figures.release_ms, 0.99),
      figures.release_ms.size());
  std::printf("  bystanders          %lld calls with a %s deadline, %lld missed\n",
              static_cast<long long>(figures.bystander_calls),
              absl::FormatDuration(kBystanderDeadline).c_str(),
              static_cast<long long>(figures.bystander_misses));
  for (const auto& [kind, ms] : figures.bystander_ms) {
    std::printf("    %-16s n=%-5zu max %6.1f ms  p99 %6.1f ms  p50 %6.1f ms\n", kind.c_str(),
                ms.size(), Quantile(ms, 1.0), Quantile(ms, 0.99), Quantile(ms, 0.5));
  }
  std::printf(
      "  failed-only sessions %zu, each with a heavy and a light FP8 layer; steps expiring "
      "mid-run: %s micro-batches, deadline 5-%lld ms\n",
      failed_only.size(), absl::StrJoin(figures.mid_run_micro_batches, "/").c_str(),
      static_cast<long long>(absl::ToInt64Milliseconds(kMidRunDeadlineMax)));
  for (size_t i = 0; i < failed_only.size(); ++i) {
    const FailedOnlyReport& r = failed_only[i];
    if (!r.read) {
      std::printf("  failed-only session %zu: not readable: %s\n", i, r.read_error.c_str());
      continue;
    }
    std::vector<std::string> counts;
    for (const auto& [collection, n] : r.by_collection)
      counts.push_back(absl::StrCat(collection, " ", n));
    std::printf("  failed-only session %zu: %lld variables (%s): %s\n", i,
                static_cast<long long>(r.variables_before), absl::StrJoin(counts, ", ").c_str(),
                r.changed.empty() ? "all equal bit for bit" : r.Summary().c_str());
    std::printf(
        "                        memory before=%lld after=%lld bytes; layers %d/%d, saved "
        "forwards %d/%d, resident tensors %d/%d\n",
        static_cast<long long>(r.before.memory_bytes()),
        static_cast<long long>(r.after.memory_bytes()), r.before.layers(), r.after.layers(),
        r.before.saved_forwards(), r.after.saved_forwards(), r.before.resident_tensors(),
        r.after.resident_tensors());
  }
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
  for (const std::string& u : figures.unclean_examples) std::printf("  unclean: %s\n", u.c_str());
  for (const std::string& m : figures.miss_examples) std::printf("  missed: %s\n", m.c_str());
  std::fflush(stdout);

  result.stopped = server.Stop();
  return result;
}

}  // namespace te::testing
