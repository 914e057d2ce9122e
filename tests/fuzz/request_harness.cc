#include "tests/fuzz/request_harness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/security/secrets.h"
#include "server/session/checkpoint.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "server/session/shm_region.h"
#include "te/state/v1/session_state.pb.h"
#include "te/v1/service.pb.h"

namespace te::fuzz {
namespace {

constexpr char kAccessKey[] = "the fuzzer's access key";
constexpr char kRestoredId[] = "ffffffffffffffffffffffffffffffff";
constexpr int64_t kShmBytes = 1 << 20;
const std::vector<int64_t> kInputShape = {2, 3, 8};

// Tiny limits: a fuzzed shape cannot make the harness slow or large.
session::SessionConfig TinyConfig() {
  session::SessionConfig config;
  config.session_memory_bytes = 4 << 20;
  config.max_saved_forwards = 2;
  config.max_message_bytes = 1 << 20;
  config.max_tensor_bytes = 256 << 10;
  config.enable_shm = true;
  config.max_shm_regions = 2;
  return config;
}

te::v1::Autocast Fp8Autocast() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  return autocast;
}

te::v1::Tensor InputTensor(float scale) {
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  tensor.mutable_shape()->Assign(kInputShape.begin(), kInputShape.end());
  std::vector<float> values(2 * 3 * 8);
  for (size_t i = 0; i < values.size(); ++i) values[i] = scale * (static_cast<float>(i % 7) - 3.1f);
  tensor.set_inline_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

// Process-wide state, made once.
struct Globals {
  std::unique_ptr<Device> device;
  session::SessionConfig config = TinyConfig();
  std::unique_ptr<session::SessionManager> manager;
  std::unique_ptr<session::CheckpointStore> store;
  std::optional<security::AccessKey> access_key;
  std::string shm_name;  // the only shm object the harness lets a request map

  Globals() {
    device = *OpenCpuDevice();
    session::SessionManagerOptions options;
    options.max_sessions = 4;
    options.max_waiting_calls = 2;
    manager = std::make_unique<session::SessionManager>(options);
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/te_fuzz_state_", getpid());
    store = *session::CheckpointStore::Open(dir);
    access_key = *security::AccessKey::FromString(kAccessKey);
    shm_name = absl::StrCat("/te_fuzz_", getpid());
    const int fd = shm_open(shm_name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd >= 0) {
      if (ftruncate(fd, kShmBytes) != 0) shm_name.clear();
      close(fd);
    }
  }
  ~Globals() {
    if (!shm_name.empty()) shm_unlink(shm_name.c_str());
    std::error_code error;
    std::filesystem::remove_all(store->state_dir(), error);
  }
};

Globals& G() {
  static Globals* globals = new Globals();
  static const bool cleanup_registered = [] {
    std::atexit([] { delete &G(); });
    return true;
  }();
  (void)cleanup_registered;
  return *globals;
}

// The live session every input runs against: a DenseGeneral initialised under
// FP8 autocast, a forward kept for its backward, and a resident tensor.
struct Fixture {
  te::v1::SessionRef ref;
  std::string layer_id;
  std::string forward_id;
  std::string tensor_id;
};

std::optional<Fixture> MakeFixture() {
  Globals& g = G();
  Fixture fixture;
  te::v1::CreateSessionRequest create;
  create.add_preferred_recipes()->mutable_delayed_scaling()->set_amax_history_len(4);
  te::v1::CreateSessionResponse created;
  if (!session::OpenSession(create, g.device.get(), g.config, g.manager.get(), &created).ok()) {
    return std::nullopt;
  }
  fixture.ref = created.session();
  auto lease = g.manager->Acquire(fixture.ref.session_id(), fixture.ref.token());
  if (!lease.ok()) return std::nullopt;
  session::Session& s = lease->session();
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(4);
  init.set_seed(3);
  init.set_input_dtype(te::v1::FLOAT32);
  init.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
  *init.mutable_autocast() = Fp8Autocast();
  te::v1::InitLayerResponse initialised;
  if (!s.InitLayer(init, &initialised).ok()) return std::nullopt;
  fixture.layer_id = initialised.layer_id();
  te::v1::ForwardRequest forward;
  forward.set_layer_id(fixture.layer_id);
  *forward.mutable_x() = InputTensor(1.0f);
  *forward.mutable_autocast() = Fp8Autocast();
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  if (!s.Forward(forward, &y).ok()) return std::nullopt;
  fixture.forward_id = y.forward_id();
  te::v1::PutTensorHeader header;
  header.mutable_tensor()->set_dtype(te::v1::FLOAT32);
  header.mutable_tensor()->mutable_shape()->Assign(kInputShape.begin(), kInputShape.end());
  auto upload = s.BeginPut(header);
  if (!upload.ok()) return std::nullopt;
  const te::v1::Tensor bytes = InputTensor(0.5f);
  if (!(*upload)->Append(bytes.inline_data().data(), bytes.inline_data().size()).ok()) {
    return std::nullopt;
  }
  te::v1::PutTensorResponse put;
  if (!s.CommitPut(*std::move(upload), &put).ok()) return std::nullopt;
  fixture.tensor_id = put.tensor_id();
  return fixture;
}

struct Options {
  bool keep_ref = false;
  bool keep_empty_ids = false;
  bool undo = false;
};

template <typename Request>
void FixRef(const Fixture& fixture, const Options& options, Request* request) {
  if (!options.keep_ref) *request->mutable_session() = fixture.ref;
}

void FixId(const std::string& live, const Options& options, std::string* id) {
  if (!options.keep_empty_ids && id->empty()) *id = live;
}

// Reads every byte a response tensor points at (so ASan sees a bad pointer).
uint64_t Touch(const char* data, int64_t bytes) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < bytes; ++i) sum += static_cast<unsigned char>(data[i]);
  return sum;
}

// A session call as the service makes it: authenticate, take the turn, call.
template <typename Request, typename Call>
absl::Status OnSession(const Request& request, const Options& options, Call call) {
  auto lease = G().manager->Acquire(request.session().session_id(), request.session().token(),
                                    absl::Now() + absl::Seconds(1));
  if (!lease.ok()) return lease.status();
  session::Session& s = lease->session();
  const int64_t mark = s.mark();
  absl::Status status = call(s);
  if (options.undo) s.ForgetSince(mark);
  return status;
}

const absl::Status kUnparsable = absl::InvalidArgumentError("the input does not parse");

template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* request) {
  return request->ParseFromArray(data, static_cast<int>(size));
}

absl::Status RunPutTensor(const Fixture& fixture, const Options& options, const uint8_t* data,
                          size_t size) {
  google::protobuf::io::CodedInputStream stream(data, static_cast<int>(size));
  std::vector<te::v1::PutTensorChunk> chunks;
  uint32_t length = 0;
  while (stream.ReadVarint32(&length)) {
    std::string bytes;
    if (!stream.ReadString(&bytes, static_cast<int>(length))) break;
    te::v1::PutTensorChunk chunk;
    if (!chunk.ParseFromString(bytes)) break;
    chunks.push_back(std::move(chunk));
  }
  // The service's rule: the first message is the header.
  if (chunks.empty() || chunks[0].part_case() != te::v1::PutTensorChunk::kHeader) {
    return absl::InvalidArgumentError("header: the stream's first message must be a header");
  }
  te::v1::PutTensorHeader header = chunks[0].header();
  FixRef(fixture, options, &header);
  return OnSession(header, options, [&](session::Session& s) -> absl::Status {
    auto upload = s.BeginPut(header);
    if (!upload.ok()) return upload.status();
    for (size_t i = 1; i < chunks.size(); ++i) {
      if (chunks[i].part_case() != te::v1::PutTensorChunk::kData) {
        return absl::InvalidArgumentError("only the first message may be a header");
      }
      absl::Status appended = (*upload)->Append(chunks[i].data().data(), chunks[i].data().size());
      if (!appended.ok()) return appended;
    }
    te::v1::PutTensorResponse response;
    return s.CommitPut(*std::move(upload), &response);
  });
}

absl::Status RunRestore(const uint8_t* data, size_t size) {
  Globals& g = G();
  te::state::v1::SessionState state;
  if (!state.ParseFromArray(data, static_cast<int>(size))) return kUnparsable;
  // The checks before Rebuild (names, sizes, checksum) are unit-tested; make
  // them pass so the fuzzer reaches the layers and variables.
  std::string bytes(4096, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 131) >> 3);
  state.set_session_id(kRestoredId);
  state.set_data_file("variables-0000000000000000.bin");
  state.set_data_bytes(bytes.size());
  state.set_data_sha256(security::Sha256(bytes));
  if (state.token_salt().size() != 16) state.set_token_salt(std::string(16, 's'));
  if (state.token_sha256().size() != 32) state.set_token_sha256(std::string(32, 'h'));
  const std::string dir = absl::StrCat(g.store->state_dir(), "/", kRestoredId);
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/session.pb", std::ios::binary) << state.SerializeAsString();
  std::ofstream(dir + "/" + state.data_file(), std::ios::binary) << bytes;
  absl::Status restored = g.store->Restore(kRestoredId, g.device.get(), g.config, g.manager.get());
  if (restored.ok()) g.manager->Evict(kRestoredId, "fuzz input done").IgnoreError();
  g.store->Remove(kRestoredId).IgnoreError();
  return restored;
}

absl::Status Dispatch(Rpc rpc, const Fixture& fx, const Options& options, const uint8_t* data,
                      size_t size) {
  Globals& g = G();
  switch (rpc) {
    case Rpc::kCreateSession: {
      te::v1::CreateSessionRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      if (!options.keep_ref) request.set_access_key(kAccessKey);
      RETURN_IF_ERROR(security::CheckAccessKey(&*g.access_key, request.access_key()));
      te::v1::CreateSessionResponse response;
      absl::Status opened =
          session::OpenSession(request, g.device.get(), g.config, g.manager.get(), &response);
      if (opened.ok()) {
        g.manager->Evict(response.session().session_id(), "fuzz input done").IgnoreError();
      }
      return opened;
    }
    case Rpc::kCloseSession: {
      te::v1::CloseSessionRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      return g.manager->Close(request.session().session_id(), request.session().token(),
                              absl::Now() + absl::Seconds(1));
    }
    case Rpc::kInitLayer: {
      te::v1::InitLayerRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      te::v1::InitLayerResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.InitLayer(request, &response); });
    }
    case Rpc::kForward: {
      te::v1::ForwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      te::v1::ForwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.Forward(request, &response); });
    }
    case Rpc::kBackward: {
      te::v1::BackwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.forward_id, options, request.mutable_forward_id());
      te::v1::BackwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.Backward(request, &response); });
    }
    case Rpc::kForwardBackward: {
      te::v1::ForwardBackwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      te::v1::ForwardBackwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.ForwardBackward(request, &response); });
    }
    case Rpc::kGetVariables: {
      te::v1::GetVariablesRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      te::v1::GetVariablesResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.GetVariables(request, &response); });
    }
    case Rpc::kSetVariables: {
      te::v1::SetVariablesRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      return OnSession(request, options,
                       [&](session::Session& s) { return s.SetVariables(request); });
    }
    case Rpc::kPutTensor:
      return RunPutTensor(fx, options, data, size);
    case Rpc::kGetTensor: {
      te::v1::GetTensorRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.tensor_id, options, request.mutable_tensor_id());
      return OnSession(request, options, [&](session::Session& s) -> absl::Status {
        auto source = s.ReadTensor(request);
        if (!source.ok()) return source.status();
        Touch(source->data, source->bytes);
        return absl::OkStatus();
      });
    }
    case Rpc::kDeleteTensor: {
      te::v1::DeleteTensorRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.tensor_id, options, request.mutable_tensor_id());
      return OnSession(request, options,
                       [&](session::Session& s) { return s.DeleteTensor(request); });
    }
    case Rpc::kBenchmark: {
      te::v1::BenchmarkRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      session::CallContext call;
      call.deadline = absl::Now() + absl::Milliseconds(50);
      te::v1::BenchmarkResponse response;
      return OnSession(request, options,
                       [&](session::Session& s) { return s.Benchmark(request, call, &response); });
    }
    case Rpc::kRegisterSharedMemory: {
      te::v1::RegisterSharedMemoryRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      // The name check runs on what the fuzzer wrote; a valid name is then
      // pointed at the harness's own object, never at another process's.
      if (session::CheckShmName(request.name(), "name").ok() || request.name().empty()) {
        request.set_name(g.shm_name);
      }
      te::v1::RegisterSharedMemoryResponse response;
      return OnSession(request, options, [&](session::Session& s) {
        return s.RegisterSharedMemory(request, &response);
      });
    }
    case Rpc::kUnregisterSharedMemory: {
      te::v1::UnregisterSharedMemoryRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      return OnSession(request, options,
                       [&](session::Session& s) { return s.UnregisterSharedMemory(request); });
    }
    case Rpc::kCheckpoint: {
      te::v1::CheckpointRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      auto lease = g.manager->Acquire(request.session().session_id(), request.session().token(),
                                      absl::Now() + absl::Seconds(1));
      if (!lease.ok()) return lease.status();
      absl::Status saved = g.store->Save(*lease).status();
      if (saved.ok()) g.store->Remove(lease->id()).IgnoreError();
      return saved;
    }
    case Rpc::kRestoreCheckpoint:
      return RunRestore(data, size);
    case Rpc::kGetSessionInfo: {
      te::v1::GetSessionInfoRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      te::v1::SessionInfo info;
      return OnSession(request, options, [&](session::Session& s) {
        s.GetSessionInfo(&info);
        return absl::OkStatus();
      });
    }
    case Rpc::kCount:
      break;
  }
  return absl::InternalError("no such rpc");
}

}  // namespace

absl::Status RunOne(const uint8_t* data, size_t size) {
  if (size < 2) return kUnparsable;
  const Rpc rpc = static_cast<Rpc>(data[0] % kRpcCount);
  Options options;
  options.keep_ref = (data[1] & 1) != 0;
  options.keep_empty_ids = (data[1] & 2) != 0;
  options.undo = (data[1] & 4) != 0;
  std::optional<Fixture> fixture = MakeFixture();
  if (!fixture) std::abort();  // the harness itself is broken: say so loudly
  absl::Status status = Dispatch(rpc, *fixture, options, data + 2, size - 2);
  G().manager->Evict(fixture->ref.session_id(), "fuzz input done").IgnoreError();
  return status;
}

}  // namespace te::fuzz
