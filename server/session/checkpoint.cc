#include "server/session/checkpoint.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/layers/cache.h"
#include "server/layers/graph.h"
#include "server/layers/variables.h"
#include "server/optim/optimizer.h"
#include "server/security/secrets.h"
#include "server/session/log.h"
#include "server/session/random_id.h"
#include "server/session/session_internal.h"
#include "te/state/v1/session_state.pb.h"

namespace te::session {
namespace {

namespace fs = std::filesystem;
using te::state::v1::SavedLayer;
using te::state::v1::SavedVariable;
using te::state::v1::SessionState;

constexpr char kManifest[] = "session.pb";
constexpr char kManifestTemp[] = "session.pb.tmp";
constexpr char kDataPrefix[] = "variables-";
constexpr char kDataSuffix[] = ".bin";
constexpr size_t kGenerationDigits = 16;
constexpr uint32_t kFormatVersion = 1;
// A manifest holds names, shapes and specs; the bytes are in the data file.
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;

absl::Status IoError(const std::string& what, const std::string& path) {
  return absl::UnavailableError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

bool IsLowerHex(absl::string_view s, size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

bool IsDataFileName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, kDataPrefix) || !absl::ConsumeSuffix(&name, kDataSuffix)) {
    return false;
  }
  return IsLowerHex(name, kGenerationDigits);
}

// "layer-<n>", as Session::NewId makes them; *n is the number.
bool ParseLayerId(absl::string_view id, int64_t* n) {
  return absl::ConsumePrefix(&id, "layer-") && !id.empty() &&
         absl::c_all_of(id, absl::ascii_isdigit) && absl::SimpleAtoi(id, n) && *n > 0;
}

// A file descriptor, closed when it goes.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting the error close() can carry (deferred write errors).
  absl::Status Close(const std::string& path) {
    const int fd = fd_;
    fd_ = -1;
    if (close(fd) != 0) return IoError("close", path);
    return absl::OkStatus();
  }

 private:
  int fd_;
};

absl::Status FsyncDir(const std::string& dir) {
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return IoError("open", dir);
  if (fsync(fd.get()) != 0) return IoError("fsync", dir);
  return absl::OkStatus();
}

absl::Status WriteAll(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t written = write(fd, data, n);
    if (written < 0) {
      if (errno == EINTR) continue;
      return IoError("write", path);
    }
    data += written;
    n -= static_cast<size_t>(written);
  }
  return absl::OkStatus();
}

// Incremental SHA-256 (OpenSSL EVP).
class Sha256Stream {
 public:
  Sha256Stream() : context_(EVP_MD_CTX_new()) {
    ok_ = context_ != nullptr && EVP_DigestInit_ex(context_, EVP_sha256(), nullptr) == 1;
  }
  ~Sha256Stream() { EVP_MD_CTX_free(context_); }
  void Update(const void* data, size_t n) { ok_ = ok_ && EVP_DigestUpdate(context_, data, n) == 1; }
  absl::StatusOr<std::string> Finish() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int size = 0;
    if (!ok_ || EVP_DigestFinal_ex(context_, digest, &size) != 1) {
      return absl::InternalError("SHA-256 failed (OpenSSL)");
    }
    return std::string(reinterpret_cast<const char*>(digest), size);
  }

 private:
  EVP_MD_CTX* context_;
  bool ok_;
};

// Appends variables to the data file, hashing as it goes.
class DataSink {
 public:
  DataSink(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  absl::Status Write(const std::string& bytes) {
    RETURN_IF_ERROR(WriteAll(fd_, bytes.data(), bytes.size(), path_));
    hash_.Update(bytes.data(), bytes.size());
    offset_ += bytes.size();
    return absl::OkStatus();
  }
  uint64_t offset() const { return offset_; }
  absl::StatusOr<std::string> Digest() { return hash_.Finish(); }

 private:
  const int fd_;
  const std::string path_;
  Sha256Stream hash_;
  uint64_t offset_ = 0;
};

// Reads the data file front to back, hashing as it goes.
class DataSource {
 public:
  DataSource(int fd, std::string path, uint64_t size)
      : fd_(fd), path_(std::move(path)), size_(size) {}
  uint64_t offset() const { return offset_; }
  // Exactly `n` bytes at the current offset; DATA_LOSS past the end.
  absl::Status Read(size_t n, std::string* bytes) {
    if (n > size_ - offset_) {
      return absl::DataLossError(absl::StrCat(path_, ": ", n, " bytes wanted at offset ", offset_,
                                              ", past its end (", size_, ")"));
    }
    bytes->resize(n);
    size_t done = 0;
    while (done < n) {
      const ssize_t got = read(fd_, bytes->data() + done, n - done);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return IoError("read", path_);
      if (got == 0) return absl::DataLossError(absl::StrCat(path_, ": truncated"));
      done += static_cast<size_t>(got);
    }
    hash_.Update(bytes->data(), n);
    offset_ += n;
    return absl::OkStatus();
  }
  // The whole file was read and its SHA-256 is `expected`.
  absl::Status Verify(const std::string& expected) {
    if (offset_ != size_) {
      return absl::DataLossError(
          absl::StrCat(path_, ": ", size_ - offset_, " bytes after the last variable"));
    }
    ASSIGN_OR_RETURN(std::string digest, hash_.Finish());
    if (!security::ConstantTimeEquals(digest, expected)) {
      return absl::DataLossError(absl::StrCat(path_, ": SHA-256 does not match the manifest"));
    }
    return absl::OkStatus();
  }

 private:
  const int fd_;
  const std::string path_;
  const uint64_t size_;
  Sha256Stream hash_;
  uint64_t offset_ = 0;
};

absl::Status InCheckpoint(const absl::Status& status, const std::string& what) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, int64_t max_bytes) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return IoError("open", path);
  }
  struct stat info;
  if (fstat(fd.get(), &info) != 0) return IoError("stat", path);
  if (!S_ISREG(info.st_mode) || info.st_size > max_bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": not a regular file of at most ", max_bytes, " bytes"));
  }
  DataSource source(fd.get(), path, static_cast<uint64_t>(info.st_size));
  std::string content;
  RETURN_IF_ERROR(source.Read(static_cast<size_t>(info.st_size), &content));
  return content;
}

}  // namespace

// Session's private state <-> a checkpoint. A friend of Session.
class SessionCheckpoint {
 public:
  using LayerEntry = Session::LayerEntry;

  // Writes every variable of every layer to `sink` and describes the session
  // (everything but the token and the data file's name) in `state`.
  static absl::Status Capture(Session& session, DataSink& sink, SessionState* state) {
    state->set_policy(session.policy_);
    if (session.negotiated_) *state->mutable_negotiated_recipe() = *session.negotiated_;
    state->set_device(session.device_.name);
    state->set_next_id(static_cast<uint64_t>(session.next_id_));
    std::string host;
    for (const auto& [layer_id, entry] : session.layers_) {
      SavedLayer* saved = state->add_layers();
      saved->set_layer_id(layer_id);
      *saved->mutable_spec() = entry->init.spec();
      *saved->mutable_input_shape() = entry->init.input_shape();
      saved->set_input_dtype(entry->init.input_dtype());
      *saved->mutable_extra_inputs() = entry->init.extra_inputs();
      *saved->mutable_autocast() = entry->init.autocast();
      if (entry->optimizer) *saved->mutable_optimizer() = entry->optimizer->spec;
      for (size_t g = 1; g < entry->graphs.size(); ++g) *saved->add_graphs() = entry->graphs[g].added;
      saved->set_last_version(entry->last_version);
      // The newest version alone: older retained ones are the client's
      // values of a running session, not state to resume from.
      const LayerVersion* newest = entry->newest();
      saved->set_version(newest != nullptr ? entry->versions.rbegin()->first : -1);
      if (newest == nullptr) continue;
      const VariableSet& set = newest->set;
      for (const layers::Variables* vars : {&set.vars, &set.grads, &set.opt_state}) {
        for (const auto& [name, tensor] : *vars) {
          host.resize(tensor.nbytes());
          if (!host.empty()) RETURN_IF_ERROR(session.ops_->Download(tensor, host.data()));
          // A cache's keys and values: the rows the version holds (contract 11).
          ASSIGN_OR_RETURN(const int64_t held, CacheRowsHeld(*session.ops_, *vars, name));
          if (held >= 0) {
            const int64_t batch = tensor.dim(0), length = tensor.dim(1);
            const size_t row = host.size() / static_cast<size_t>(batch * length);
            for (int64_t b = 0; b < batch; ++b) {
              std::memset(host.data() + (b * length + held) * row, 0, (length - held) * row);
            }
          }
          SavedVariable* variable = saved->add_variables();
          variable->set_name(name);
          variable->set_dtype(DTypeToProto(tensor.dtype()));
          variable->mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
          variable->set_offset(sink.offset());
          variable->set_bytes(host.size());
          RETURN_IF_ERROR(sink.Write(host));
        }
      }
    }
    return absl::OkStatus();
  }

  // A new session on `device` with the state's layers and variables.
  static absl::StatusOr<std::shared_ptr<Session>> Rebuild(const SessionState& state,
                                                          DataSource& source, Device* device,
                                                          const SessionConfig& config) {
    std::optional<te::v1::Recipe> negotiated;
    if (state.has_negotiated_recipe()) negotiated = state.negotiated_recipe();
    ASSIGN_OR_RETURN(std::unique_ptr<Ops> ops, device->NewOps(config.session_memory_bytes));
    auto session = std::make_shared<Session>(state.session_id(), device->info(), std::move(ops),
                                             config, state.policy(), negotiated);
    int64_t next_id = static_cast<int64_t>(std::min<uint64_t>(state.next_id(), INT64_MAX / 2));
    for (const SavedLayer& saved : state.layers()) {
      int64_t number = 0;
      if (!ParseLayerId(saved.layer_id(), &number) || session->layers_.count(saved.layer_id())) {
        return absl::DataLossError(
            absl::StrCat("layer id '", saved.layer_id(), "' is malformed or repeated"));
      }
      next_id = std::max(next_id, number + 1);
      absl::StatusOr<std::unique_ptr<LayerEntry>> entry = RebuildLayer(*session, saved, source);
      if (!entry.ok()) return InCheckpoint(entry.status(), saved.layer_id());
      session->layers_[saved.layer_id()] = *std::move(entry);
    }
    RETURN_IF_ERROR(source.Verify(state.data_sha256()));
    session->next_id_ = next_id;
    return session;
  }

 private:
  static absl::StatusOr<std::unique_ptr<LayerEntry>> RebuildLayer(Session& session,
                                                                  const SavedLayer& saved,
                                                                  DataSource& source) {
    auto entry = std::make_unique<LayerEntry>();
    entry->id = saved.layer_id();
    entry->graphs.emplace_back();
    ASSIGN_OR_RETURN(DType input_dtype, DTypeFromProto(saved.input_dtype(), "input_dtype"));
    ASSIGN_OR_RETURN(Shape input_shape,
                     ShapeFromProto(saved.input_shape(), input_dtype,
                                    session.config_.max_tensor_bytes, "input_shape"));
    ASSIGN_OR_RETURN(entry->graphs[0].extras,
                     CheckDeclaredExtras(saved.extra_inputs(), input_shape,
                                         session.config_.max_tensor_bytes));
    if (entry->graphs[0].extras) {
      ASSIGN_OR_RETURN(entry->graphs[0].layer,
                       layers::MakeGraph(saved.spec().graph(), entry->graphs[0].extras));
    } else {
      ASSIGN_OR_RETURN(entry->graphs[0].layer, layers::CreateLayer(saved.spec()));
    }
    ASSIGN_OR_RETURN(entry->init_recipe, session.ResolveAutocast(saved.autocast(), "autocast"));
    const layers::Fp8Recipe* fp8 = entry->init_recipe ? &*entry->init_recipe : nullptr;
    ASSIGN_OR_RETURN(std::vector<layers::VariableSpec> specs,
                     entry->layer().VariableSpecs(input_shape, fp8));
    *entry->init.mutable_spec() = saved.spec();
    *entry->init.mutable_input_shape() = saved.input_shape();
    entry->init.set_input_dtype(saved.input_dtype());
    *entry->init.mutable_autocast() = saved.autocast();
    *entry->init.mutable_extra_inputs() = saved.extra_inputs();

    // A layer initialised with decode saved its cache (collection cache):
    // it comes back with it, checked against the specs init made.
    for (const SavedVariable& variable : saved.variables()) {
      if (!absl::StartsWith(variable.name(), absl::StrCat(layers::kCache, "/"))) continue;
      ASSIGN_OR_RETURN(std::vector<layers::VariableSpec> cache,
                       entry->layer().CacheSpecs(input_shape, input_dtype,
                                                 /*internal_decode=*/false));
      specs.insert(specs.end(), cache.begin(), cache.end());
      entry->init.set_decode(true);
      break;
    }
    std::set<std::string> spec_names;
    for (const layers::VariableSpec& spec : specs) spec_names.insert(spec.name);
    std::optional<optim::OptimizerConfig> optimizer;
    if (saved.has_optimizer()) {
      absl::StatusOr<optim::OptimizerConfig> config =
          optim::ResolveOptimizer(saved.optimizer(), "optimizer");
      if (!config.ok()) return absl::DataLossError(std::string(config.status().message()));
      optimizer = *config;
    }
    VariableSet set;
    layers::Variables& opt_state = set.opt_state;
    std::string host;
    for (const SavedVariable& variable : saved.variables()) {
      const std::string& name = variable.name();
      std::string collection, path;
      SplitVariableName(name, &collection, &path);
      const bool is_grad = collection == "grads";
      const bool is_state = collection == optim::kOptState;
      if (is_state && !optimizer) {
        return absl::DataLossError(absl::StrCat(name, ": optimizer state without an optimizer"));
      }
      if (!is_grad && !is_state && spec_names.count(name) == 0) {
        return absl::DataLossError(absl::StrCat(name, ": not a variable of this layer"));
      }
      layers::Variables& target = is_grad ? set.grads : (is_state ? opt_state : set.vars);
      if (target.count(name) > 0) return absl::DataLossError(absl::StrCat(name, ": repeated"));
      if (variable.offset() != source.offset()) {
        return absl::DataLossError(
            absl::StrCat(name, ": at offset ", variable.offset(), ", expected ", source.offset()));
      }
      ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(variable.dtype(), name + ".dtype"));
      ASSIGN_OR_RETURN(Shape shape, ShapeFromProto(variable.shape(), dtype,
                                                   session.ops_->memory_limit(), name + ".shape"));
      ASSIGN_OR_RETURN(Tensor tensor, session.ops_->Allocate(dtype, shape));
      if (tensor.nbytes() != variable.bytes()) {
        return absl::DataLossError(absl::StrCat(name, ": ", variable.bytes(), " bytes for ",
                                                ShapeString(shape), " ", DTypeName(dtype)));
      }
      RETURN_IF_ERROR(source.Read(tensor.nbytes(), &host));
      if (!host.empty()) RETURN_IF_ERROR(session.ops_->Upload(host.data(), &tensor));
      target[name] = std::move(tensor);
    }
    const bool released = saved.version() < 0;
    if (released && !saved.variables().empty()) {
      return absl::DataLossError("variables saved for a layer whose every version was released");
    }
    // The layer must accept what came back, as after InitLayer.
    if (!released) RETURN_IF_ERROR(layers::CheckVariables(set.vars, specs));
    for (const auto& [name, grad] : set.grads) {
      std::string collection, path;
      SplitVariableName(name, &collection, &path);
      auto param = set.vars.find(absl::StrCat(layers::kParams, "/", path));
      if (param == set.vars.end() || param->second.shape() != grad.shape()) {
        return absl::DataLossError(absl::StrCat(name, ": no parameter of its shape"));
      }
    }
    if (optimizer && !released) {
      // Exactly the state the optimizer keeps for these parameters.
      const std::vector<layers::VariableSpec> state_specs = optim::StateSpecs(*optimizer, set.vars);
      if (state_specs.size() != opt_state.size()) {
        return absl::DataLossError(absl::StrCat("opt_state: ", opt_state.size(), " variables, ",
                                                optimizer->name(), " keeps ", state_specs.size()));
      }
      for (const layers::VariableSpec& spec : state_specs) {
        auto it = opt_state.find(spec.name);
        if (it == opt_state.end() || it->second.shape() != spec.shape ||
            it->second.dtype() != spec.dtype) {
          return absl::DataLossError(absl::StrCat(spec.name, ": missing or of another shape"));
        }
      }
    }
    if (optimizer) {
      LayerOptimizer restored;
      restored.spec = saved.optimizer();
      restored.config = *optimizer;
      entry->optimizer = std::move(restored);
    }
    // The version comes back under its number (1 from a checkpoint written
    // before versions), and later ones continue after the highest made.
    const int64_t number = saved.version() == 0 ? 1 : saved.version();
    entry->last_version = std::max({saved.last_version(), number, int64_t{0}});
    if (!released) entry->versions[number].set = std::move(set);
    for (int g = 0; g < saved.graphs_size(); ++g) {
      absl::StatusOr<LayerGraph> restored = RebuildGraph(session, saved.graphs(g));
      if (!restored.ok()) {
        return absl::DataLossError(absl::StrCat("graphs[", g, "]: ", restored.status().message()));
      }
      entry->graphs.push_back(*std::move(restored));
    }
    RETURN_IF_ERROR(session.ops_->Synchronize());
    return entry;
  }

  // A graph AddGraph added, from its request as saved.
  static absl::StatusOr<LayerGraph> RebuildGraph(Session& session,
                                                 const te::v1::AddGraphRequest& added) {
    const int64_t max_bytes = session.config_.max_tensor_bytes;
    LayerGraph restored;
    ASSIGN_OR_RETURN(const DType x_dtype, DTypeFromProto(added.input_dtype(), "input_dtype"));
    ASSIGN_OR_RETURN(const Shape x_shape,
                     ShapeFromProto(added.input_shape(), x_dtype, max_bytes, "input_shape"));
    ASSIGN_OR_RETURN(restored.extras, CheckDeclaredExtras(added.extra_inputs(), x_shape, max_bytes));
    ASSIGN_OR_RETURN(restored.layer, layers::MakeGraph(added.graph(), restored.extras));
    restored.added = added;
    return restored;
  }
};

bool IsSessionId(absl::string_view id) { return IsLowerHex(id, 32); }

absl::StatusOr<std::unique_ptr<CheckpointStore>> CheckpointStore::Open(
    const std::string& state_dir) {
  if (state_dir.empty()) return absl::InvalidArgumentError("--state_dir: empty");
  if (mkdir(state_dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir=", state_dir, ": cannot create: ", std::strerror(errno)));
  }
  struct stat info;
  if (stat(state_dir.c_str(), &info) != 0 || !S_ISDIR(info.st_mode) ||
      access(state_dir.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state_dir=", state_dir, ": not a writable directory"));
  }
  return std::unique_ptr<CheckpointStore>(new CheckpointStore(state_dir));
}

std::string CheckpointStore::SessionDir(const std::string& id) const {
  return absl::StrCat(state_dir_, "/", id);
}

absl::StatusOr<CheckpointStore::Written> CheckpointStore::Save(const SessionManager::Lease& lease) {
  const std::string& id = lease.id();
  if (!IsSessionId(id)) {
    return absl::InternalError(absl::StrCat("session id '", id, "' is not of the server's form"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (RemovedLocked(id)) return AbandonedSave(id);
  }
  const std::string dir = SessionDir(id);
  if (mkdir(dir.c_str(), 0700) == 0) {
    RETURN_IF_ERROR(FsyncDir(state_dir_));
  } else if (errno != EEXIST) {
    return IoError("mkdir", dir);
  }
  ASSIGN_OR_RETURN(std::string generation, RandomHex128());
  const std::string data_name =
      absl::StrCat(kDataPrefix, generation.substr(0, kGenerationDigits), kDataSuffix);
  const std::string data_path = absl::StrCat(dir, "/", data_name);

  SessionState state;
  {
    Fd fd(open(data_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (fd.get() < 0) return IoError("create", data_path);
    DataSink sink(fd.get(), data_path);
    absl::Status written = SessionCheckpoint::Capture(lease.session(), sink, &state);
    if (written.ok() && fsync(fd.get()) != 0) written = IoError("fsync", data_path);
    if (written.ok()) written = fd.Close(data_path);
    absl::StatusOr<std::string> digest = sink.Digest();
    if (written.ok() && !digest.ok()) written = digest.status();
    if (!written.ok()) {
      unlink(data_path.c_str());
      return written;
    }
    state.set_data_file(data_name);
    state.set_data_bytes(sink.offset());
    state.set_data_sha256(*digest);
  }
  state.set_format_version(kFormatVersion);
  state.set_session_id(id);
  state.set_token_salt(lease.token_digest().salt);
  state.set_token_sha256(lease.token_digest().sha256);
  state.set_ttl_seconds(absl::ToInt64Seconds(lease.ttl()));
  state.set_saved_unix_seconds(absl::ToUnixSeconds(absl::Now()));

  // The commit point: the manifest naming the new data file replaces the old.
  const std::string manifest = state.SerializeAsString();
  const std::string temp_path = absl::StrCat(dir, "/", kManifestTemp);
  const std::string manifest_path = absl::StrCat(dir, "/", kManifest);
  // Under mu_: a Remove either ran before (nothing is committed, and what
  // this save wrote goes) or waits until the commit, then deletes it.
  absl::MutexLock commit_lock(&mu_);
  if (RemovedLocked(id)) return AbandonedSave(id);
  absl::Status committed = [&]() -> absl::Status {
    // A leftover temp file of an interrupted save goes first: O_EXCL makes
    // ours afresh with our mode, whoever made the old one.
    if (unlink(temp_path.c_str()) != 0 && errno != ENOENT) return IoError("unlink", temp_path);
    Fd fd(open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (fd.get() < 0) return IoError("create", temp_path);
    RETURN_IF_ERROR(WriteAll(fd.get(), manifest.data(), manifest.size(), temp_path));
    if (fsync(fd.get()) != 0) return IoError("fsync", temp_path);
    RETURN_IF_ERROR(fd.Close(temp_path));
    if (rename(temp_path.c_str(), manifest_path.c_str()) != 0) {
      return IoError("rename to session.pb", temp_path);
    }
    return FsyncDir(dir);
  }();
  if (!committed.ok()) {
    unlink(data_path.c_str());
    return committed;
  }
  // Older generations (and leftovers of interrupted saves) are garbage now.
  std::error_code error;
  for (const fs::directory_entry& file : fs::directory_iterator(dir, error)) {
    const std::string name = file.path().filename().string();
    if (name != kManifest && name != data_name) fs::remove(file.path(), error);
  }
  Written result;
  result.path = absl::StrCat(id, "/", kManifest);
  result.bytes = static_cast<int64_t>(state.data_bytes() + manifest.size());
  LogForSession(LogLevel::kInfo, id, "checkpoint saved",
                {{"path", result.path},
                 {"bytes", absl::StrCat(result.bytes)},
                 {"layers", absl::StrCat(state.layers_size())}});
  return result;
}

bool CheckpointStore::RemovedLocked(const std::string& id) const { return removed_.count(id) > 0; }

absl::Status CheckpointStore::AbandonedSave(const std::string& id) {
  std::error_code error;
  fs::remove_all(SessionDir(id), error);
  return absl::NotFoundError(absl::StrCat("session ", id,
                                          " was removed while its checkpoint was being written; "
                                          "nothing is kept"));
}

absl::Status CheckpointStore::Remove(const std::string& id) {
  if (!IsSessionId(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session id '", id, "' is not of the server's form"));
  }
  absl::MutexLock lock(&mu_);
  // Ids are never reused; the bound only caps memory on a long-lived server
  // (a save still running for a session removed 64k removals ago is not a
  // concern).
  constexpr size_t kRemovedKept = 1 << 16;
  if (removed_.insert(id).second) {
    removed_order_.push_back(id);
    if (removed_order_.size() > kRemovedKept) {
      removed_.erase(removed_order_.front());
      removed_order_.pop_front();
    }
  }
  std::error_code error;
  const uintmax_t removed = fs::remove_all(SessionDir(id), error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot remove ", SessionDir(id), ": ", error.message()));
  }
  if (removed > 0) {
    LogForSession(LogLevel::kInfo, id, "checkpoint removed");
    return FsyncDir(state_dir_);
  }
  return absl::OkStatus();
}

absl::Status CheckpointStore::Restore(const std::string& id, const DeviceFor& device_for,
                                      const SessionConfig& config, SessionManager* manager) {
  if (!IsSessionId(id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session id '", id, "' is not of the server's form"));
  }
  const std::string dir = SessionDir(id);
  ASSIGN_OR_RETURN(std::string manifest,
                   ReadSmallFile(absl::StrCat(dir, "/", kManifest), kMaxManifestBytes));
  SessionState state;
  if (!state.ParseFromString(manifest)) {
    return absl::DataLossError(absl::StrCat(dir, "/", kManifest, ": not a session manifest"));
  }
  if (state.format_version() != kFormatVersion) {
    return absl::DataLossError(absl::StrCat(dir, ": format version ", state.format_version(),
                                            "; this server reads ", kFormatVersion));
  }
  if (state.session_id() != id) {
    return absl::DataLossError(
        absl::StrCat(dir, ": the manifest is of session '", state.session_id(), "'"));
  }
  security::TokenDigest digest{state.token_salt(), state.token_sha256()};
  if (!digest.WellFormed())
    return absl::DataLossError(absl::StrCat(dir, ": malformed token digest"));
  if (!IsDataFileName(state.data_file())) {
    return absl::DataLossError(absl::StrCat(dir, ": data file name '", state.data_file(),
                                            "' is not one this server makes"));
  }
  const std::string data_path = absl::StrCat(dir, "/", state.data_file());
  Fd fd(open(data_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return absl::DataLossError(absl::StrCat(data_path, ": ", std::strerror(errno)));
  struct stat info;
  if (fstat(fd.get(), &info) != 0 || !S_ISREG(info.st_mode) ||
      static_cast<uint64_t>(info.st_size) != state.data_bytes()) {
    return absl::DataLossError(absl::StrCat(data_path, ": not a file of the ", state.data_bytes(),
                                            " bytes the manifest says"));
  }
  DataSource source(fd.get(), data_path, state.data_bytes());
  absl::StatusOr<std::shared_ptr<Session>> session =
      SessionCheckpoint::Rebuild(state, source, device_for(state.device()), config);
  if (!session.ok()) return InCheckpoint(session.status(), dir);
  RETURN_IF_ERROR(manager->Restore(id, digest, absl::Seconds(state.ttl_seconds()), *session));
  LogForSession(
      LogLevel::kInfo, id, "restored from checkpoint",
      {{"layers", absl::StrCat(state.layers_size())},
       {"bytes", absl::StrCat(state.data_bytes())},
       {"saved_on", state.device()},
       {"saved_at", absl::FormatTime(absl::FromUnixSeconds(state.saved_unix_seconds()))}});
  return absl::OkStatus();
}

CheckpointStore::RestoreReport CheckpointStore::RestoreAll(const DeviceFor& device_for,
                                                           const SessionConfig& config,
                                                           SessionManager* manager) {
  RestoreReport report;
  std::error_code error;
  std::vector<std::string> ids;
  for (const fs::directory_entry& entry : fs::directory_iterator(state_dir_, error)) {
    const std::string name = entry.path().filename().string();
    if (IsSessionId(name) && entry.is_directory(error)) ids.push_back(name);
  }
  if (error) {
    Log(LogLevel::kError, "cannot list the state directory",
        {{"state_dir", state_dir_}, {"error", error.message()}});
  }
  for (const std::string& id : ids) {
    absl::Status restored = Restore(id, device_for, config, manager);
    if (restored.ok()) {
      ++report.restored;
    } else {
      ++report.failed;
      LogForSession(LogLevel::kError, id, "not restored; its checkpoint is kept",
                    {{"error", restored.ToString()}});
      manager->RememberNotRestored(id, restored);
    }
  }
  return report;
}

}  // namespace te::session
