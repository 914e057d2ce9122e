#include "tests/fuzz/request_harness.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "google/protobuf/io/coded_stream.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/security/secrets.h"
#include "server/service/status.h"
#include "server/session/checkpoint.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "server/session/shm_region.h"
#include "te/state/v1/session_state.pb.h"
#include "te/v1/service.pb.h"
#include "tests/fuzz/request_specs.h"

namespace te::fuzz {
namespace {

constexpr char kAccessKey[] = "the fuzzer's access key";
constexpr char kRestoredId[] = "ffffffffffffffffffffffffffffffff";
constexpr int64_t kShmBytes = kShmRegionBytes;

// Tiny limits: a fuzzed shape cannot make the harness slow or large.
session::SessionConfig TinyConfig() {
  session::SessionConfig config;
  config.session_memory_bytes = kSessionMemoryBytes;
  config.max_saved_forwards = 2;
  config.max_micro_batches = kMaxMicroBatches;
  config.max_message_bytes = 1 << 20;
  config.max_tensor_bytes = kMaxTensorBytes;
  config.enable_shm = true;
  config.max_shm_regions = 2;
  return config;
}

te::v1::Tensor Floats(const std::vector<int64_t>& shape, float scale) {
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
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
  std::string shm_name;      // the only shm object the harness lets a request map
  char* shm_base = nullptr;  // the harness's own mapping of it (reset per input)
  std::string shm_pattern;   // what the region holds before every input

  Globals() {
    device = *OpenCpuDevice();
    session::SessionManagerOptions options;
    options.max_sessions = 4;
    // Few: an input that leaves a tombstone behind looks like a leak to
    // libFuzzer (more mallocs than frees), which then reruns it under LSan.
    options.max_tombstones = 2;
    manager = std::make_unique<session::SessionManager>(options);
    const char* tmp = std::getenv("TEST_TMPDIR");
    const std::string dir =
        absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/te_fuzz_state_", getpid());
    store = *session::CheckpointStore::Open(dir);
    access_key = *security::AccessKey::FromString(kAccessKey);
    shm_name = absl::StrCat("/te_fuzz_", getpid());
    const int fd = shm_open(shm_name.c_str(), O_CREAT | O_RDWR, 0600);
    if (fd >= 0) {
      if (ftruncate(fd, kShmBytes) == 0) {
        void* base = mmap(nullptr, kShmBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base != MAP_FAILED) shm_base = static_cast<char*>(base);
      }
      close(fd);
    }
    shm_pattern.resize(kShmBytes);
    for (int64_t i = 0; i < kShmBytes; ++i) shm_pattern[i] = static_cast<char>((i * 37) >> 4);
    if (shm_base == nullptr) {
      if (fd >= 0) shm_unlink(shm_name.c_str());
      shm_name.clear();
    }
  }
  ~Globals() {
    if (shm_base != nullptr) munmap(shm_base, kShmBytes);
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

// ---- the live session -------------------------------------------------------------

struct KindSetup {
  te::v1::LayerSpec spec;
  std::vector<int64_t> x_shape = {2, 3, 8};
  te::v1::Autocast autocast;                            // at init and in the fixture's own calls
  bool extra_kv = false;                                // k = v = x as extra inputs
  te::v1::NegotiationPolicy policy = te::v1::FALLBACK;  // EMULATE for the emulated recipes
};

// q = Dense(x), k and v from the extra inputs (any length), attention, back to
// [2, 3, 8], a residual add and a scale.
te::v1::LayerSpec GraphWithExtraInputs() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  *GraphNode(g, "DenseGeneral_0", {"x"}, {"q"})->mutable_module() = DenseSpec({8});
  for (const auto& [in, out] : std::vector<std::pair<std::string, std::string>>{
           {"q", "q4"}, {"extra_inputs[0]", "k4"}, {"extra_inputs[1]", "v4"}}) {
    te::v1::GraphSpec::Node* reshape = GraphNode(g, "reshape_" + out, {in}, {out});
    for (int64_t d : {int64_t{2}, int64_t{-1}, int64_t{2}, int64_t{4}}) {
      reshape->mutable_reshape()->add_shape(d);
    }
  }
  *GraphNode(g, "DotProductAttention_0", {"q4", "k4", "v4"}, {"a"})->mutable_module() = AttentionSpec();
  te::v1::GraphSpec::Node* back = GraphNode(g, "reshape_a", {"a"}, {"a3"});
  for (int64_t d : {2, 3, 8}) back->mutable_reshape()->add_shape(d);
  GraphNode(g, "add", {"a3", "x"}, {"h"})->mutable_add();
  GraphNode(g, "scale", {"h"}, {"y"})->mutable_scale()->set_factor(0.5);
  g->add_outputs("y");
  return spec;
}

KindSetup SetupFor(LayerKind kind) {
  KindSetup k;
  switch (kind) {
    case LayerKind::kDenseFp8:
      k.spec = DenseSpec({4});
      k.autocast = DelayedScaling();
      break;
    case LayerKind::kLayerNormMlpFp8:
      k.spec.mutable_layer_norm_mlp()->set_intermediate_dim(16);
      k.spec.mutable_layer_norm_mlp()->add_activations("gelu");
      k.spec.mutable_layer_norm_mlp()->add_activations("linear");
      k.autocast = DelayedScaling();
      break;
    case LayerKind::kUnfusedGraphFp8:
      k.spec = UnfusedGraphSpec();
      k.autocast = DelayedScaling();
      break;
    case LayerKind::kTransformerFp8:
      k.spec.mutable_transformer_layer()->set_hidden_size(8);
      k.spec.mutable_transformer_layer()->set_mlp_hidden_size(16);
      k.spec.mutable_transformer_layer()->set_num_attention_heads(2);
      k.autocast = DelayedScaling();
      break;
    case LayerKind::kMhaCurrentScaling:
      k.spec.mutable_multi_head_attention()->set_head_dim(4);
      k.spec.mutable_multi_head_attention()->set_num_attention_heads(2);
      k.autocast.set_enabled(true);
      k.autocast.mutable_recipe()->mutable_float8_current_scaling();
      break;
    case LayerKind::kAttentionGraphFp8:
      k.spec = AttentionGraphSpec();
      k.x_shape = {2, 3, 2, 4};
      k.extra_kv = true;
      k.autocast = DelayedScaling();
      break;
    case LayerKind::kLayerNormDenseMxfp8:
      // MXFP8's GEMMs contract in blocks of 32: hidden, features and tokens.
      k.spec.mutable_layer_norm_dense_general()->add_features(32);
      k.x_shape = {2, 16, 32};
      k.autocast.set_enabled(true);
      k.autocast.mutable_recipe()->mutable_mxfp8_block_scaling();
      k.policy = te::v1::EMULATE;
      break;
    case LayerKind::kGraphFp8:
    case LayerKind::kCount:
      k.spec = GraphWithExtraInputs();
      k.extra_kv = true;
      k.autocast = DelayedScaling();
      break;
  }
  return k;
}

struct Fixture {
  te::v1::SessionRef ref;
  LayerKind kind = LayerKind::kDenseFp8;
  std::vector<int64_t> x_shape;
  bool extra_kv = false;
  std::string layer_id;
  std::string forward_id;
  std::string tensor_id;     // x
  std::string dy_tensor_id;  // dy for the live layer's y
  std::string region_id;     // empty where shm is unavailable
};

absl::StatusOr<std::string> PutResident(session::Session& s, const te::v1::Tensor& value) {
  te::v1::PutTensorHeader header;
  header.mutable_tensor()->set_dtype(value.dtype());
  *header.mutable_tensor()->mutable_shape() = value.shape();
  ASSIGN_OR_RETURN(std::unique_ptr<session::TensorUpload> upload, s.BeginPut(header));
  RETURN_IF_ERROR(upload->Append(value.inline_data().data(), value.inline_data().size()));
  te::v1::PutTensorResponse put;
  RETURN_IF_ERROR(s.CommitPut(std::move(upload), &put));
  return put.tensor_id();
}

te::v1::Tensor Resident(const std::string& id) {
  te::v1::Tensor tensor;
  tensor.set_resident_id(id);
  return tensor;
}

absl::StatusOr<Fixture> MakeFixture(LayerKind kind) {
  Globals& g = G();
  const KindSetup setup = SetupFor(kind);
  Fixture fixture;
  fixture.kind = kind;
  fixture.x_shape = setup.x_shape;
  fixture.extra_kv = setup.extra_kv;
  te::v1::CreateSessionRequest create;
  create.add_preferred_recipes()->mutable_delayed_scaling()->set_amax_history_len(4);
  create.set_policy(setup.policy);
  te::v1::CreateSessionResponse created;
  RETURN_IF_ERROR(
      session::OpenSession(create, g.device.get(), g.config, g.manager.get(), &created));
  fixture.ref = created.session();
  ASSIGN_OR_RETURN(session::SessionManager::Lease lease,
                   g.manager->Acquire(fixture.ref.session_id(), fixture.ref.token()));
  session::Session& s = lease.session();

  if (g.shm_base != nullptr) {
    // The region's bytes are the client's: the same before every input.
    std::memcpy(g.shm_base, g.shm_pattern.data(), kShmBytes);
    te::v1::RegisterSharedMemoryRequest region;
    region.set_name(g.shm_name);
    region.set_size(kShmBytes);
    te::v1::RegisterSharedMemoryResponse registered;
    RETURN_IF_ERROR(s.RegisterSharedMemory(region, &registered));
    fixture.region_id = registered.region_id();
  }

  te::v1::InitLayerRequest init;
  *init.mutable_spec() = setup.spec;
  init.set_seed(3);
  init.set_input_dtype(te::v1::FLOAT32);
  init.mutable_input_shape()->Assign(setup.x_shape.begin(), setup.x_shape.end());
  *init.mutable_autocast() = setup.autocast;
  te::v1::InitLayerResponse initialised;
  RETURN_IF_ERROR(s.InitLayer(init, &initialised));
  fixture.layer_id = initialised.layer_id();
  const std::vector<int64_t> y_shape(initialised.output_shape().begin(),
                                     initialised.output_shape().end());

  ASSIGN_OR_RETURN(fixture.tensor_id, PutResident(s, Floats(setup.x_shape, 0.5f)));
  ASSIGN_OR_RETURN(fixture.dy_tensor_id, PutResident(s, Floats(y_shape, 0.25f)));

  // A step with its gradients kept, so the grads collection exists.
  te::v1::ForwardBackwardRequest step;
  step.set_layer_id(fixture.layer_id);
  *step.mutable_autocast() = setup.autocast;
  te::v1::MicroBatch* batch = step.add_micro_batches();
  *batch->mutable_x() = Floats(setup.x_shape, 1.0f);
  *batch->mutable_dy() = Resident(fixture.dy_tensor_id);
  if (setup.extra_kv) {
    *batch->add_extra_inputs() = Resident(fixture.tensor_id);
    *batch->add_extra_inputs() = Resident(fixture.tensor_id);
  }
  batch->set_dropout_seed(5);
  te::v1::ForwardBackwardResponse stepped;
  RETURN_IF_ERROR(s.ForwardBackward(step, &stepped));

  te::v1::ForwardRequest forward;
  forward.set_layer_id(fixture.layer_id);
  *forward.mutable_x() = Floats(setup.x_shape, 1.0f);
  if (setup.extra_kv) {
    *forward.add_extra_inputs() = Resident(fixture.tensor_id);
    *forward.add_extra_inputs() = Resident(fixture.tensor_id);
  }
  *forward.mutable_autocast() = setup.autocast;
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  RETURN_IF_ERROR(s.Forward(forward, &y));
  fixture.forward_id = y.forward_id();
  return fixture;
}

// ---- the invariant's digest ----------------------------------------------------------

std::string TensorLine(const te::v1::Tensor& t) {
  std::string line =
      absl::StrCat(te::v1::DType_Name(t.dtype()), " [", absl::StrJoin(t.shape(), ","), "] ");
  switch (t.data_case()) {
    case te::v1::Tensor::kInlineData: {
      static const char kHex[] = "0123456789abcdef";
      for (unsigned char c : t.inline_data()) {
        line += kHex[c >> 4];
        line += kHex[c & 15];
      }
      break;
    }
    case te::v1::Tensor::kResidentId:
      absl::StrAppend(&line, "resident ", t.resident_id());
      break;
    case te::v1::Tensor::kShm:
      absl::StrAppend(&line, "shm ", t.shm().region_id());
      break;
    case te::v1::Tensor::DATA_NOT_SET:
      line += "no data";
      break;
  }
  return line;
}

// The live session's observable state, one fact a line. Every layer the
// session has (layer-1, layer-2, ... until as many as GetSessionInfo counts
// were found, so a layer a failed call left behind shows too), all collections with their values; the resident tensors'
// bytes; the counts and bytes of GetSessionInfo; the server's live sessions.
// Reads only: GetVariables answers inline at the live layers' sizes (a larger
// answer's resident copies are forgotten at once), and ReadTensor on the CPU
// points into the tensor.
std::string Digest(const Fixture& fx) {
  Globals& g = G();
  std::vector<std::string> lines;
  std::vector<std::string> ids = g.manager->live_ids();
  std::sort(ids.begin(), ids.end());
  lines.push_back(absl::StrCat("live sessions: ", absl::StrJoin(ids, " ")));
  auto lease =
      g.manager->Acquire(fx.ref.session_id(), fx.ref.token());
  if (!lease.ok()) {
    lines.push_back(absl::StrCat("the live session: ", lease.status().ToString()));
    return absl::StrJoin(lines, "\n");
  }
  session::Session& s = lease->session();
  te::v1::SessionInfo info;
  s.GetSessionInfo(&info);
  lines.push_back(absl::StrCat("session info: memory_bytes ", info.memory_bytes(), " layers ",
                               info.layers(), " saved_forwards ", info.saved_forwards(),
                               " resident_tensors ", info.resident_tensors(), " shm_regions ",
                               info.shm_regions()));
  // Ids are numbered in one sequence, so the layers lie within the first
  // ids the session made; the bound only keeps a miscount from looping.
  constexpr int64_t kMaxIds = int64_t{1} << 20;
  int found = 0;
  for (int64_t n = 1; found < info.layers() && n < kMaxIds; ++n) {
    te::v1::GetVariablesRequest request;
    request.set_layer_id(absl::StrCat("layer-", n));
    te::v1::GetVariablesResponse response;
    s.BeginCall();
    if (!s.GetVariables(request, &response).ok()) {
      s.EndCall(/*undo=*/true);
      continue;
    }
    ++found;
    te::v1::SessionInfo after;
    s.GetSessionInfo(&after);
    s.EndCall(/*undo=*/true);  // the digest reads; what it made goes
    if (after.resident_tensors() != info.resident_tensors()) {
      // Too large to answer inline (only a layer a failed call left behind
      // can be): the digest's own resident copies went with the undo.
      lines.push_back(absl::StrCat(request.layer_id(), ": variables past one message"));
      continue;
    }
    lines.push_back(
        absl::StrCat(request.layer_id(), ": ", response.variables_size(), " variables"));
    for (const te::v1::Variable& v : response.variables()) {
      lines.push_back(
          absl::StrCat("  ", v.collection(), "/", v.path(), " ", TensorLine(v.value())));
    }
  }
  found = 0;
  for (int64_t n = 1; found < info.resident_tensors() && n < kMaxIds; ++n) {
    te::v1::GetTensorRequest request;
    request.set_tensor_id(absl::StrCat("tensor-", n));
    auto source = s.ReadTensor(request);
    if (!source.ok()) continue;
    ++found;
    te::v1::Tensor t;
    t.set_dtype(source->header.dtype());
    *t.mutable_shape() = source->header.shape();
    t.set_inline_data(source->data, static_cast<size_t>(source->bytes));
    lines.push_back(absl::StrCat(request.tensor_id(), ": ", TensorLine(t)));
  }
  return absl::StrJoin(lines, "\n");
}

bool Checked(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
      return true;
    default:
      return false;
  }
}

[[noreturn]] void ReportChangedState(Rpc rpc, const absl::Status& status, const std::string& before,
                                     const std::string& after) {
  std::fprintf(stderr,
               "request_harness: INVARIANT BROKEN: rpc %d failed with %s but changed the "
               "session\n",
               static_cast<int>(rpc), status.ToString().c_str());
  const std::vector<std::string> a = absl::StrSplit(before, '\n');
  const std::vector<std::string> b = absl::StrSplit(after, '\n');
  for (const std::string& line : a) {
    if (std::find(b.begin(), b.end(), line) == b.end()) {
      std::fprintf(stderr, "  before: %.400s\n", line.c_str());
    }
  }
  for (const std::string& line : b) {
    if (std::find(a.begin(), a.end(), line) == a.end()) {
      std::fprintf(stderr, "  after:  %.400s\n", line.c_str());
    }
  }
  std::fflush(stderr);
  __builtin_trap();
}

// ---- requests -------------------------------------------------------------------

struct Options {
  bool keep_ref = false;
  bool keep_empty = false;
  bool undo = false;
  Interrupt interrupt = Interrupt::kNone;
};

// The call's context as the service gives it (QueuedCall::Run): the client's
// deadline (kCallSeconds ahead, or already passed) and whether it gave up
// (after `after` questions, for the interrupt modes that cancel).
session::CallContext ContextFor(const Options& options) {
  session::CallContext call;
  call.deadline = absl::Now() + absl::Seconds(kCallSeconds);
  int after = -1;
  switch (options.interrupt) {
    case Interrupt::kNone:
      break;
    case Interrupt::kDeadlinePassed:
      call.deadline = absl::Now() - absl::Milliseconds(1);
      break;
    case Interrupt::kCancelAfterOne:
      after = 1;
      break;
    case Interrupt::kCancelAfterThree:
      after = 3;
      break;
  }
  if (after >= 0) {
    auto asked = std::make_shared<int>(0);
    call.cancelled = [asked, after] { return (*asked)++ >= after; };
  }
  return call;
}

template <typename Request>
void FixRef(const Fixture& fixture, const Options& options, Request* request) {
  if (!options.keep_ref) *request->mutable_session() = fixture.ref;
}

void FixId(const std::string& live, const Options& options, std::string* id) {
  if (!options.keep_empty && id->empty()) *id = live;
}

void FixShmRef(const Fixture& fx, const Options& options, te::v1::SharedMemoryRef* ref) {
  FixId(fx.region_id, options, ref->mutable_region_id());
}

// A tensor without data names the live x (or dy); a shm ref without a region
// names the live region.
void FixTensor(const Fixture& fx, const Options& options, const std::string& live,
               te::v1::Tensor* t) {
  if (options.keep_empty) return;
  if (t->data_case() == te::v1::Tensor::DATA_NOT_SET) {
    t->set_resident_id(live);
  } else if (t->data_case() == te::v1::Tensor::kShm) {
    FixShmRef(fx, options, t->mutable_shm());
  }
}

void FixInputs(const Fixture& fx, const Options& options, te::v1::Tensor* x,
               google::protobuf::RepeatedPtrField<te::v1::Tensor>* extra) {
  FixTensor(fx, options, fx.tensor_id, x);
  if (options.keep_empty) return;
  if (fx.extra_kv && extra->empty()) {
    extra->Add()->set_resident_id(fx.tensor_id);
    extra->Add()->set_resident_id(fx.tensor_id);
  }
  for (te::v1::Tensor& t : *extra) FixTensor(fx, options, fx.tensor_id, &t);
}

void FixMicroBatch(const Fixture& fx, const Options& options, te::v1::MicroBatch* mb) {
  FixInputs(fx, options, mb->mutable_x(), mb->mutable_extra_inputs());
  FixTensor(fx, options, fx.dy_tensor_id, mb->mutable_dy());
}

// Reads every byte a response tensor points at (so ASan sees a bad pointer).
uint64_t Touch(const char* data, int64_t bytes) {
  uint64_t sum = 0;
  for (int64_t i = 0; i < bytes; ++i) sum += static_cast<unsigned char>(data[i]);
  return sum;
}

// A session call as the service makes it (QueuedCall::OnSession):
// authenticate, take the turn, call with no exception escaping (NoThrow), and
// undo what a failed call created (EndCall), as for one whose client went
// away (the undo flag).
template <typename Request, typename Call>
absl::Status OnSession(const Request& request, const Options& options, Call call) {
  auto lease = G().manager->Acquire(request.session().session_id(), request.session().token());
  if (!lease.ok()) return lease.status();
  session::Session& s = lease->session();
  s.BeginCall();
  const session::CallContext context = ContextFor(options);
  absl::Status status = service::NoThrow([&] { return call(s, context); });
  s.EndCall(/*undo=*/!status.ok() || options.undo);
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
  if (header.has_shm()) FixShmRef(fixture, options, header.mutable_shm());
  // As the service's PutTensor stream (tensor_streams.cc): BeginPut in the
  // session's turn, each data message appended, CommitPut after the last;
  // no exception escapes; a failed stream's upload is dropped and what it
  // created forgotten.
  auto lease = G().manager->Acquire(header.session().session_id(), header.session().token());
  if (!lease.ok()) return lease.status();
  session::Session& s = lease->session();
  s.BeginCall();
  absl::StatusOr<std::unique_ptr<session::TensorUpload>> upload =
      service::NoThrow([&] { return s.BeginPut(header); });
  if (!upload.ok()) {
    s.EndCall(/*undo=*/true);
    return upload.status();
  }
  absl::Status status;
  for (size_t i = 1; i < chunks.size() && status.ok(); ++i) {
    if (chunks[i].part_case() != te::v1::PutTensorChunk::kData) {
      status = absl::InvalidArgumentError(
          absl::StrCat("message ", i + 1, ": only the first message may be a header"));
    } else if (header.has_shm()) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "message ", i + 1, ": the header named shared memory, so no data may follow"));
    } else {
      status = service::NoThrow(
          [&] { return (*upload)->Append(chunks[i].data().data(), chunks[i].data().size()); });
    }
  }
  if (status.ok()) {
    te::v1::PutTensorResponse response;
    status = service::NoThrow([&] { return s.CommitPut(*std::move(upload), &response); });
  }
  upload->reset();
  s.EndCall(/*undo=*/!status.ok() || options.undo);
  return status;
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
      return g.manager->Close(request.session().session_id(), request.session().token());
    }
    case Rpc::kInitLayer: {
      te::v1::InitLayerRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      if (!options.keep_empty) {
        if (request.input_shape().empty()) {
          request.mutable_input_shape()->Assign(fx.x_shape.begin(), fx.x_shape.end());
        }
        if (request.input_dtype() == te::v1::DTYPE_UNSPECIFIED) {
          request.set_input_dtype(te::v1::FLOAT32);
        }
      }
      te::v1::InitLayerResponse response;
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        return s.InitLayer(request, &response);
      });
    }
    case Rpc::kForward: {
      te::v1::ForwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      FixInputs(fx, options, request.mutable_x(), request.mutable_extra_inputs());
      if (request.has_attention_mask()) {
        FixTensor(fx, options, fx.tensor_id, request.mutable_attention_mask());
      }
      if (request.has_y_shm()) FixShmRef(fx, options, request.mutable_y_shm());
      te::v1::ForwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s, const session::CallContext& call) {
                         return s.Forward(request, &response, call);
                       });
    }
    case Rpc::kBackward: {
      te::v1::BackwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.forward_id, options, request.mutable_forward_id());
      FixTensor(fx, options, fx.dy_tensor_id, request.mutable_dy());
      te::v1::BackwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s, const session::CallContext& call) {
                         return s.Backward(request, &response, call);
                       });
    }
    case Rpc::kForwardBackward: {
      te::v1::ForwardBackwardRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      for (te::v1::MicroBatch& mb : *request.mutable_micro_batches()) {
        FixMicroBatch(fx, options, &mb);
      }
      if (request.micro_batches_size() > kMaxRunMicroBatches) {
        // Validated, never run: the last dy cannot pass (header comment).
        te::v1::Tensor* dy = request.mutable_micro_batches()->rbegin()->mutable_dy();
        dy->Clear();
        dy->set_inline_data("");
      }
      te::v1::ForwardBackwardResponse response;
      return OnSession(request, options,
                       [&](session::Session& s, const session::CallContext& call) {
                         return s.ForwardBackward(request, &response, call);
                       });
    }
    case Rpc::kGetVariables: {
      te::v1::GetVariablesRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      te::v1::GetVariablesResponse response;
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        return s.GetVariables(request, &response);
      });
    }
    case Rpc::kSetVariables: {
      te::v1::SetVariablesRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      for (te::v1::Variable& v : *request.mutable_variables()) {
        if (v.value().data_case() == te::v1::Tensor::kShm) {
          FixShmRef(fx, options, v.mutable_value()->mutable_shm());
        }
      }
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        te::v1::SetVariablesResponse response;
        return s.SetVariables(request, &response);
      });
    }
    case Rpc::kPutTensor:
      return RunPutTensor(fx, options, data, size);
    case Rpc::kGetTensor: {
      te::v1::GetTensorRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.tensor_id, options, request.mutable_tensor_id());
      if (request.has_destination()) FixShmRef(fx, options, request.mutable_destination());
      return OnSession(request, options,
                       [&](session::Session& s, const session::CallContext&) -> absl::Status {
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
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        return s.DeleteTensor(request);
      });
    }
    case Rpc::kBenchmark: {
      te::v1::BenchmarkRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.layer_id, options, request.mutable_layer_id());
      FixInputs(fx, options, request.mutable_inputs()->mutable_x(),
                request.mutable_inputs()->mutable_extra_inputs());
      if (request.inputs().has_dy()) {
        FixTensor(fx, options, fx.dy_tensor_id, request.mutable_inputs()->mutable_dy());
      }
      te::v1::BenchmarkResponse response;
      return OnSession(
          request, options, [&](session::Session& s, const session::CallContext& call) {
            // A benchmark runs until its deadline at most: a short one here.
            session::CallContext shorter = call;
            shorter.deadline = std::min(call.deadline, absl::Now() + absl::Milliseconds(50));
            return s.Benchmark(request, shorter, &response);
          });
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
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        return s.RegisterSharedMemory(request, &response);
      });
    }
    case Rpc::kUnregisterSharedMemory: {
      te::v1::UnregisterSharedMemoryRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      FixId(fx.region_id, options, request.mutable_region_id());
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
        return s.UnregisterSharedMemory(request);
      });
    }
    case Rpc::kCheckpoint: {
      te::v1::CheckpointRequest request;
      if (!Parse(data, size, &request)) return kUnparsable;
      FixRef(fx, options, &request);
      auto lease = g.manager->Acquire(request.session().session_id(), request.session().token());
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
      return OnSession(request, options, [&](session::Session& s, const session::CallContext&) {
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
  options.keep_ref = (data[1] & kKeepRef) != 0;
  options.keep_empty = (data[1] & kKeepEmpty) != 0;
  options.undo = (data[1] & kUndo) != 0;
  options.interrupt = static_cast<Interrupt>((data[1] >> 6) & 3);
  const LayerKind kind = static_cast<LayerKind>((data[1] >> 3) & 7);
  absl::StatusOr<Fixture> fixture = MakeFixture(kind);
  if (!fixture.ok()) {
    // The harness itself is broken: say so loudly.
    std::fprintf(stderr, "request_harness: the live session (kind %d) failed: %s\n",
                 static_cast<int>(kind), fixture.status().ToString().c_str());
    std::abort();
  }
  const std::string before = Digest(*fixture);
  // No exception leaves a call (the service's NoThrow around every one).
  absl::Status status =
      service::NoThrow([&] { return Dispatch(rpc, *fixture, options, data + 2, size - 2); });
  if (!status.ok() && Checked(status.code())) {
    const std::string after = Digest(*fixture);
    if (after != before) ReportChangedState(rpc, status, before, after);
  }
  G().manager->Evict(fixture->ref.session_id(), "fuzz input done").IgnoreError();
  return status;
}

}  // namespace te::fuzz
