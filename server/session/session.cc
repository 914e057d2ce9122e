// Session: layers, variables, resident tensors, autocast, and CreateSession.
// A layer's versions and graphs are in session_versions.cc.
// The steps (Forward, Backward, ForwardBackward, Benchmark) are in
// session_steps.cc.
#include "server/session/session.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/layers/cache.h"
#include "server/layers/fp8_state.h"
#include "server/session/log.h"
#include "server/session/negotiation.h"
#include "server/session/session_internal.h"

namespace te::session {
namespace {

constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
// Room for everything in a response but tensor bytes (names, shapes, framing).
constexpr int64_t kResponseOverheadBytes = int64_t{256} << 10;

const std::set<std::string>& KnownCollections() {
  static const auto* known =
      new std::set<std::string>{"params", "fp8_metas", "grads", "opt_state", "cache"};
  return *known;
}

// ResolveRecipe names fields from "recipe"; requests carry it under another name.
absl::Status RenameRecipeField(const absl::Status& status, const std::string& field) {
  std::string message(status.message());
  if (absl::StartsWith(message, "recipe")) message = field + message.substr(6);
  return absl::Status(status.code(), message);
}

}  // namespace

absl::Status CallContext::StillWanted(const std::string& what) const {
  // The deadline first: gRPC also marks a call cancelled once it expires.
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": the call's deadline passed; the session is as it was"));
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(
        absl::StrCat(what, ": cancelled by the client; the session is as it was"));
  }
  return absl::OkStatus();
}

void SplitVariableName(const std::string& name, std::string* collection, std::string* path) {
  const size_t slash = name.find('/');
  *collection = name.substr(0, slash);
  *path = slash == std::string::npos ? "" : name.substr(slash + 1);
}

Session::Session(std::string id, const DeviceInfo& device, std::unique_ptr<Ops> ops,
                 const SessionConfig& config, te::v1::NegotiationPolicy policy,
                 std::optional<te::v1::Recipe> negotiated)
    : id_(std::move(id)),
      device_(device),
      ops_(std::move(ops)),
      config_(config),
      policy_(EffectivePolicy(policy)),
      negotiated_(std::move(negotiated)) {}

Session::~Session() {
  // Tensors go before the Ops whose memory they hold; pending work first.
  ops_->Synchronize().IgnoreError();
  saved_.clear();
  layers_.clear();
  resident_.clear();
  regions_.clear();
}

std::string Session::NewId(Created::Kind kind) {
  const char* prefix = "";
  switch (kind) {
    case Created::Kind::kLayer: prefix = "layer"; break;
    case Created::Kind::kForward: prefix = "forward"; break;
    case Created::Kind::kTensor: prefix = "tensor"; break;
    case Created::Kind::kRegion: prefix = "region"; break;
    case Created::Kind::kVersion:
    case Created::Kind::kGraph: break;  // numbered by their layer
  }
  std::string id = absl::StrCat(prefix, "-", next_id_++);
  Record({kind, id});
  return id;
}

void Session::Record(Created created) {
  if (call_) call_->push_back(std::move(created));
}

void Session::BeginCall() {
  call_.emplace();
  call_scratch_bytes_ = ops_->scratch_bytes();
}

void Session::EndCall(bool undo) {
  if (undo && call_) {
    // Latest first: a version goes before the layer it is of.
    for (auto it = call_->rbegin(); it != call_->rend(); ++it) Undo(*it);
    // A workspace the call grew is its memory too. Shrinking only frees
    // (the smaller block fits where the larger one was), so an error here
    // is a device error, which the device's own status already reports.
    ops_->ShrinkScratch(call_scratch_bytes_).IgnoreError();
  }
  call_.reset();
}

void Session::KeepOnUndo(const std::string& layer_id, int64_t number) {
  if (!call_) return;
  for (auto it = call_->begin(); it != call_->end(); ++it) {
    if (it->kind == Created::Kind::kVersion && it->id == layer_id && it->number == number) {
      call_->erase(it);
      return;
    }
  }
}

std::vector<std::string> Session::CallAnswerIds() const {
  std::vector<std::string> ids;
  if (!call_) return ids;
  for (const Created& created : *call_) {
    if (created.kind != Created::Kind::kVersion && created.kind != Created::Kind::kGraph) {
      ids.push_back(created.id);
    }
  }
  return ids;
}

void Session::ForgetUnanswered(const std::vector<std::string>& ids) {
  for (const std::string& id : ids) {
    for (auto it = saved_.begin(); it != saved_.end();) {
      it = it->second->layer_id == id ? saved_.erase(it) : std::next(it);
    }
    layers_.erase(id);
    saved_.erase(id);
    resident_.erase(id);
    regions_.erase(id);
  }
}

void Session::Undo(const Created& created) {
  auto layer = layers_.find(created.id);
  switch (created.kind) {
    case Created::Kind::kLayer:
      for (auto it = saved_.begin(); it != saved_.end();) {
        it = it->second->layer_id == created.id ? saved_.erase(it) : std::next(it);
      }
      layers_.erase(created.id);
      return;
    case Created::Kind::kVersion:
      if (layer != layers_.end()) {
        layer->second->versions.erase(created.number);
        // The weight copies kept since may be of the undone version's
        // weights (held by the copies, so never freed): they go, and the
        // next call makes them again from the version it reads.
        layer->second->ParamsChanged();
      }
      return;
    case Created::Kind::kGraph:
      if (layer != layers_.end()) {
        std::vector<LayerGraph>& graphs = layer->second->graphs;
        if (created.number > 0 && created.number < static_cast<int64_t>(graphs.size())) {
          graphs.erase(graphs.begin() + created.number, graphs.end());
        }
      }
      return;
    case Created::Kind::kForward: saved_.erase(created.id); return;
    case Created::Kind::kTensor: resident_.erase(created.id); return;
    case Created::Kind::kRegion: regions_.erase(created.id); return;
  }
}

ResidentLookup Session::Resident() const {
  return [this](const std::string& id) -> const Tensor* {
    auto it = resident_.find(id);
    return it == resident_.end() ? nullptr : &it->second;
  };
}

ShmLookup Session::Regions() const {
  if (!config_.enable_shm) return nullptr;
  return [this](const std::string& id) -> ShmRegion* {
    auto it = regions_.find(id);
    return it == regions_.end() ? nullptr : it->second.get();
  };
}

void Session::GetSessionInfo(te::v1::SessionInfo* response) const {
  response->set_device(device_.name);
  response->set_memory_bytes(ops_->bytes_in_use());
  response->set_memory_limit_bytes(ops_->memory_limit());
  response->set_layers(static_cast<int32_t>(layers_.size()));
  response->set_saved_forwards(static_cast<int32_t>(saved_.size()));
  response->set_resident_tensors(static_cast<int32_t>(resident_.size()));
  response->set_shm_regions(static_cast<int32_t>(regions_.size()));
  response->set_peak_memory_bytes(ops_->peak_bytes_in_use());
  const DeviceMemoryStats device = ops_->device_memory_stats();
  response->set_device_bytes_in_use(device.bytes_in_use);
  response->set_device_peak_bytes_in_use(device.peak_bytes_in_use);
  response->set_device_bytes_reserved(device.bytes_reserved);
  response->set_device_peak_bytes_reserved(device.peak_bytes_reserved);
}

absl::StatusOr<Session::LayerEntry*> Session::FindLayer(const std::string& layer_id) {
  auto it = layers_.find(layer_id);
  if (it == layers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("layer_id: no layer '", layer_id, "' in this session"));
  }
  return it->second.get();
}

absl::StatusOr<std::optional<layers::Fp8Recipe>> Session::ResolveAutocast(
    const te::v1::Autocast& autocast, const std::string& field) const {
  if (!autocast.enabled()) return std::optional<layers::Fp8Recipe>();
  const bool named = KindOf(autocast.recipe()) != te::v1::RECIPE_KIND_UNSPECIFIED;
  if (!named && !negotiated_.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": FP8 enabled without a recipe, and this session negotiated none (bf16 only); "
        "name one in ", field, ".recipe or negotiate one at CreateSession"));
  }
  const te::v1::Recipe& recipe = named ? autocast.recipe() : *negotiated_;
  RETURN_IF_ERROR(CheckRecipeAllowed(device_, recipe, policy_, field + ".recipe"));
  absl::StatusOr<layers::Fp8Recipe> resolved = layers::ResolveRecipe(recipe);
  if (!resolved.ok()) return RenameRecipeField(resolved.status(), field + ".recipe");
  return std::optional<layers::Fp8Recipe>(*resolved);
}

// ---- outputs -------------------------------------------------------------------

Session::OutputEncoder::OutputEncoder(Session* session)
    : session_(session),
      budget_(std::max<int64_t>(0, session->config_.max_message_bytes - kResponseOverheadBytes)) {}

absl::Status Session::OutputEncoder::Encode(const Tensor& tensor, bool resident, bool snapshot,
                                            te::v1::Tensor* out) {
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  if (!resident && bytes <= budget_) {
    budget_ -= bytes;
    return EncodeInline(*session_->ops_, tensor, out);
  }
  Tensor kept = tensor;
  if (snapshot) {
    ASSIGN_OR_RETURN(kept, session_->ops_->Allocate(tensor.dtype(), tensor.shape()));
    if (kept.nbytes() > 0) RETURN_IF_ERROR(session_->ops_->Copy(tensor, &kept));
  }
  const std::string id = session_->NewId(Created::Kind::kTensor);
  session_->resident_[id] = kept;
  EncodeResident(kept, id, out);
  return absl::OkStatus();
}

// ---- layers --------------------------------------------------------------------

absl::Status Session::CheckFitsMemory(const std::vector<layers::VariableSpec>& specs) const {
  int64_t total = 0;
  const layers::VariableSpec* largest = nullptr;
  int64_t largest_bytes = 0;
  for (const layers::VariableSpec& spec : specs) {
    const std::optional<int64_t> bytes = CheckedNumBytes(spec.shape, spec.dtype);
    if (!bytes || __builtin_add_overflow(total, *bytes, &total)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "spec: variable ", spec.name, " ", ShapeString(spec.shape), " ", DTypeName(spec.dtype),
          " is over 2^63 bytes; the layer's sizes are out of range"));
    }
    if (*bytes > largest_bytes) {
      largest = &spec;
      largest_bytes = *bytes;
    }
  }
  const int64_t free_bytes = ops_->memory_limit() - ops_->bytes_in_use();
  // The device's memory, which every session on it shares, may be the
  // tighter bound.
  const int64_t device_free_bytes = ops_->memory_available();
  if (total > std::min(free_bytes, device_free_bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "spec: the layer's ", specs.size(), " variables need ", total, " bytes (",
        largest->name, " ", ShapeString(largest->shape), " ", DTypeName(largest->dtype), " alone ",
        largest_bytes, "), more than the ",
        total > free_bytes
            ? absl::StrCat(free_bytes, " bytes this session has left of its ",
                           ops_->memory_limit(), " (--session_memory_bytes)")
            : absl::StrCat(device_free_bytes, " bytes ", ops_->device_name(),
                           " has left for its sessions; retry later")));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeclaredInput> CheckDeclaredInput(const layers::Layer& layer, te::v1::DType dtype,
                                                 const google::protobuf::RepeatedField<int64_t>& shape,
                                                 int64_t max_tensor_bytes) {
  DeclaredInput declared;
  ASSIGN_OR_RETURN(declared.dtype, DTypeFromProto(dtype, "input_dtype"));
  if (!FitsLayerInput(layer.TakesTokenIds(), declared.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat("input_dtype: ", DTypeName(declared.dtype), "; ",
                                                   LayerInputWant(layer.TakesTokenIds())));
  }
  if (shape.empty()) {
    return absl::InvalidArgumentError("input_shape: empty; give x's shape, e.g. [batch, seq, hidden]");
  }
  for (int i = 0; i < shape.size(); ++i) {
    if (shape[i] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("input_shape[", i, "]: must be positive, got ", shape[i]));
    }
  }
  ASSIGN_OR_RETURN(declared.shape,
                   ShapeFromProto(shape, declared.dtype, max_tensor_bytes, "input_shape"));
  return declared;
}

absl::StatusOr<std::optional<layers::DeclaredExtras>> CheckDeclaredExtras(
    const google::protobuf::RepeatedPtrField<te::v1::TensorHeader>& extras, const Shape& x,
    int64_t max_tensor_bytes) {
  if (extras.empty()) return std::nullopt;
  layers::DeclaredExtras declared;
  declared.x = x;
  for (int i = 0; i < extras.size(); ++i) {
    const std::string field = absl::StrCat("extra_inputs[", i, "]");
    ASSIGN_OR_RETURN(const DType dtype, DTypeFromProto(extras[i].dtype(), field + ".dtype"));
    ASSIGN_OR_RETURN(Shape shape,
                     ShapeFromProto(extras[i].shape(), dtype, max_tensor_bytes, field + ".shape"));
    declared.dtypes.push_back(dtype);
    declared.shapes.push_back(std::move(shape));
  }
  return declared;
}

absl::Status Session::InitLayer(const te::v1::InitLayerRequest& request,
                                te::v1::InitLayerResponse* response, const CallContext& call) {
  ASSIGN_OR_RETURN(std::unique_ptr<layers::Layer> layer, layers::CreateLayer(request.spec()));
  ASSIGN_OR_RETURN(DeclaredInput declared,
                   CheckDeclared(*layer, request, config_.max_tensor_bytes));
  const DType input_dtype = declared.dtype;
  const Shape& input_shape = declared.shape;
  std::optional<layers::DeclaredExtras>& extras = declared.extras;
  if (extras) {
    if (!request.spec().has_graph()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "extra_inputs: declares a graph's extra inputs, but spec is a ", layer->type_name(),
          " (its extra inputs have x's dtype)"));
    }
    ASSIGN_OR_RETURN(layer, layers::MakeGraph(request.spec().graph(), extras));
  }
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  const layers::Fp8Recipe* fp8_ptr = fp8 ? &*fp8 : nullptr;
  ASSIGN_OR_RETURN(std::vector<layers::VariableSpec> specs,
                   layer->VariableSpecs(input_shape, fp8_ptr));
  ASSIGN_OR_RETURN(Shape output_shape, layer->OutputShape(input_shape));
  // TE's init(..., decode=True): the cache for x's batch and length too
  // (contract 11), zeros.
  std::vector<layers::VariableSpec> cache;
  if (request.decode()) {
    ASSIGN_OR_RETURN(cache, layer->CacheSpecs(input_shape, input_dtype, /*internal_decode=*/false));
    specs.insert(specs.end(), cache.begin(), cache.end());
  }
  RETURN_IF_ERROR(CheckFitsMemory(specs));

  auto entry = std::make_unique<LayerEntry>();
  VariableSet initial;
  {
    InterruptScope interrupt(*ops_, call, "InitLayer");
    RETURN_IF_ERROR(layer->Init(*ops_, request.seed(), input_shape, fp8_ptr, &initial.vars));
    RETURN_IF_ERROR(layers::InitCache(*ops_, cache, &initial.vars));
  }
  // Nothing above is the session's yet: an init that ends here frees it all.
  RETURN_IF_ERROR(call.StillWanted("InitLayer"));
  entry->id = NewId(Created::Kind::kLayer);
  entry->graphs.emplace_back();
  entry->graphs[0].layer = std::move(layer);
  entry->graphs[0].extras = std::move(extras);
  entry->init_recipe = fp8;
  entry->init = request;
  entry->init.clear_session();
  MakeVersion(*entry, std::move(initial));

  response->set_layer_id(entry->id);
  for (const layers::VariableSpec& spec : specs) {
    te::v1::VariableInfo* info = response->add_variables();
    SplitVariableName(spec.name, info->mutable_collection(), info->mutable_path());
    info->mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
    info->set_dtype(DTypeToProto(spec.dtype));
  }
  response->mutable_output_shape()->Assign(output_shape.begin(), output_shape.end());
  response->set_output_dtype(DTypeToProto(entry->layer().OutputDType(input_dtype)));
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(entry->id, ": ", entry->layer().type_name(), " initialised for x ",
                             ShapeString(input_shape), " ", DTypeName(input_dtype), ", ",
                             specs.size(), " variables", fp8 ? " (under FP8 autocast)" : "",
                             request.decode() ? " with a decode cache" : "",
                             "; session memory ", ops_->bytes_in_use(), " bytes"));
  layers_[entry->id] = std::move(entry);
  return absl::OkStatus();
}

absl::Status Session::GetVariables(const te::v1::GetVariablesRequest& request,
                                   te::v1::GetVariablesResponse* response) {
  ASSIGN_OR_RETURN(const Target target, Resolve(request.layer_id(), 0, request.version()));
  std::set<std::string> wanted;
  for (int i = 0; i < request.collections_size(); ++i) {
    if (KnownCollections().count(request.collections(i)) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("collections[", i, "]: unknown collection '", request.collections(i),
                       "' (params, fp8_metas, grads, opt_state, cache)"));
    }
    wanted.insert(request.collections(i));
  }
  if (wanted.empty()) wanted = KnownCollections();
  OutputEncoder encoder(this);
  const VariableSet& set = *target.read;
  for (const layers::Variables* vars : {&set.vars, &set.grads, &set.opt_state}) {
    for (const auto& [name, tensor] : *vars) {
      std::string collection, path;
      SplitVariableName(name, &collection, &path);
      if (wanted.count(collection) == 0) continue;
      te::v1::Variable* out = response->add_variables();
      out->set_collection(collection);
      out->set_path(path);
      // Snapshots: a later step may write a tensor in place once no
      // retained version holds it (contract 9), and a resident copy outlives that.
      ASSIGN_OR_RETURN(const Tensor held, AsDecoded(*vars, name, tensor));
      RETURN_IF_ERROR(encoder.Encode(held, /*resident=*/request.keep_outputs(),
                                     /*snapshot=*/true, out->mutable_value()));
    }
  }
  response->set_version(target.version);
  return absl::OkStatus();
}

absl::Status Session::SetOptimizer(const te::v1::SetOptimizerRequest& request,
                                   te::v1::SetOptimizerResponse* response) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
  ASSIGN_OR_RETURN(optim::OptimizerConfig config,
                   optim::ResolveOptimizer(request.optimizer(), "optimizer"));
  if (layer->versions.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer_id: every version of layer ", layer->id, "'s variables was released"));
  }
  // Every version has the same params' names, shapes and dtypes, so one
  // fresh state (zero moments, count 0) serves them all.
  const layers::Variables& params = layer->newest()->set.vars;
  const std::vector<layers::VariableSpec> specs = optim::StateSpecs(config, params);
  // The new state is made before the old one goes (all or nothing), so both
  // must fit for a moment.
  RETURN_IF_ERROR(CheckFitsMemory(specs));
  ASSIGN_OR_RETURN(layers::Variables state, optim::InitState(*ops_, config, params));
  RETURN_IF_ERROR(ops_->Synchronize());
  LayerOptimizer optimizer;
  optimizer.spec = request.optimizer();
  optimizer.config = config;
  layer->optimizer = std::move(optimizer);
  for (auto& [number, version] : layer->versions) version.set.opt_state = state;
  for (const layers::VariableSpec& spec : specs) {
    te::v1::VariableInfo* info = response->add_variables();
    SplitVariableName(spec.name, info->mutable_collection(), info->mutable_path());
    info->mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
    info->set_dtype(DTypeToProto(spec.dtype));
  }
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(layer->id, ": optimizer ", config.name(), ", ", specs.size(),
                             " state variables; session memory ", ops_->bytes_in_use(), " bytes"));
  return absl::OkStatus();
}

absl::Status Session::SetVariables(const te::v1::SetVariablesRequest& request,
                                   te::v1::SetVariablesResponse* response) {
  ASSIGN_OR_RETURN(const Target target, Resolve(request.layer_id(), 0, request.version()));
  LayerEntry* layer = target.entry;
  VariableSet next = *target.read;
  // Everything is checked before anything is written (all or nothing).
  struct Write {
    layers::Variables* target;
    std::string name;
    CheckedTensor value;
  };
  std::vector<Write> writes;
  std::set<std::string> seen;
  for (int i = 0; i < request.variables_size(); ++i) {
    const te::v1::Variable& variable = request.variables(i);
    const std::string field = absl::StrCat("variables[", i, "]");
    const std::string name = absl::StrCat(variable.collection(), "/", variable.path());
    layers::Variables* target = &next.vars;
    const char* why_missing = "";
    if (variable.collection() == "grads") {
      target = &next.grads;
      why_missing = " (no gradients are kept yet)";
    } else if (variable.collection() == optim::kOptState) {
      target = &next.opt_state;
      why_missing = layer->optimizer ? "" : " (it has no optimizer: SetOptimizer first)";
    }
    auto existing = target->find(name);
    if (existing == target->end()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": layer ", layer->id,
                                                     " has no variable ", name, why_missing));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", name, " is given twice"));
    }
    ASSIGN_OR_RETURN(CheckedTensor value,
                     CheckTensor(variable.value(), field + ".value", config_.max_tensor_bytes,
                                 Resident(), Regions()));
    const Tensor& current = existing->second;
    if (value.dtype != current.dtype() || value.shape != current.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".value: ", ShapeString(value.shape), " ", DTypeName(value.dtype), ", but ",
          name, " is ", ShapeString(current.shape()), " ", DTypeName(current.dtype())));
    }
    if (name == optim::kCount || name == optim::kTotalNotfinite) {
      // Step counters: a negative one would run a schedule before its start.
      int32_t counter = 0;
      ASSIGN_OR_RETURN(std::string bytes, HostBytes(*ops_, value));
      std::memcpy(&counter, bytes.data(), sizeof(counter));
      if (counter < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".value: ", name, " = ", counter, "; a step count is >= 0"));
      }
    }
    writes.push_back({target, name, std::move(value)});
  }
  // New tensors: a variable never aliases a resident tensor or a saved forward.
  std::vector<Tensor> values;
  for (const Write& write : writes) {
    if (write.value.resident != nullptr) {
      ASSIGN_OR_RETURN(Tensor fresh, ops_->Allocate(write.value.dtype, write.value.shape));
      if (fresh.nbytes() > 0) RETURN_IF_ERROR(ops_->Copy(*write.value.resident, &fresh));
      values.push_back(std::move(fresh));
    } else {
      // Inline and shared-memory bytes: copied into a new allocation.
      ASSIGN_OR_RETURN(Tensor fresh, Materialize(*ops_, write.value));
      values.push_back(std::move(fresh));
    }
  }
  for (size_t i = 0; i < writes.size(); ++i) (*writes[i].target)[writes[i].name] = values[i];
  layer->ParamsChanged();
  response->set_version(MakeVersion(*layer, std::move(next)));
  return absl::OkStatus();
}

// ---- resident tensors --------------------------------------------------------------

absl::StatusOr<std::unique_ptr<TensorUpload>> Session::BeginPut(
    const te::v1::PutTensorHeader& header) {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(header.tensor().dtype(), "header.tensor.dtype"));
  ASSIGN_OR_RETURN(Shape shape, ShapeFromProto(header.tensor().shape(), dtype,
                                               config_.max_tensor_bytes, "header.tensor.shape"));
  ShmRegion* region = nullptr;
  if (header.has_shm()) {
    const uint64_t bytes = static_cast<uint64_t>(NumElements(shape)) * DTypeSize(dtype);
    ASSIGN_OR_RETURN(region, CheckShmRef(header.shm(), bytes, "header.shm", Regions()));
  }
  if (region != nullptr) {
    // The region holds the whole tensor: an upload with nothing left to arrive.
    CheckedTensor checked;
    checked.dtype = dtype;
    checked.shape = shape;
    checked.shm = region;
    checked.shm_offset = header.shm().offset();
    ASSIGN_OR_RETURN(Tensor copied, Materialize(*ops_, checked));
    return TensorUpload::Complete(*ops_, std::move(copied));
  }
  ASSIGN_OR_RETURN(Tensor tensor, ops_->Allocate(dtype, shape));
  return TensorUpload::Start(*ops_, std::move(tensor));
}

absl::Status Session::CommitPut(std::unique_ptr<TensorUpload> upload,
                                te::v1::PutTensorResponse* response) {
  ASSIGN_OR_RETURN(Tensor tensor, upload->Finish());
  const std::string id = NewId(Created::Kind::kTensor);
  response->set_tensor_id(id);
  response->set_bytes(static_cast<int64_t>(tensor.nbytes()));
  resident_[id] = std::move(tensor);
  return absl::OkStatus();
}

absl::StatusOr<Session::TensorSource> Session::ReadTensor(
    const te::v1::GetTensorRequest& request) {
  auto it = resident_.find(request.tensor_id());
  if (it == resident_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id: no resident tensor '",
                                            request.tensor_id(), "' in this session"));
  }
  const int64_t max_chunk = std::max<int64_t>(1, config_.max_message_bytes - 4096);
  TensorSource source;
  source.chunk_bytes = request.chunk_bytes() == 0 ? std::min(kDefaultChunkBytes, max_chunk)
                                                  : request.chunk_bytes();
  if (source.chunk_bytes <= 0 || source.chunk_bytes > max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", request.chunk_bytes(),
                                                   " is outside [1, ", max_chunk,
                                                   "] (0: 1 MiB)"));
  }
  const Tensor& tensor = it->second;
  source.header.set_dtype(DTypeToProto(tensor.dtype()));
  source.header.mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  if (request.has_destination()) {
    ASSIGN_OR_RETURN(ShmRegion * region, CheckShmRef(request.destination(), tensor.nbytes(),
                                                     "destination", Regions()));
    RETURN_IF_ERROR(WriteToRegion(*ops_, tensor, *region, request.destination().offset()));
    return source;
  }
  source.bytes = static_cast<int64_t>(tensor.nbytes());
  if (IsHostMemory(*ops_)) {
    auto kept = std::make_shared<const Tensor>(tensor);
    source.data = static_cast<const char*>(kept->data());
    source.keepalive = std::move(kept);
    return source;
  }
  std::shared_ptr<char[]> host(new char[std::max<size_t>(1, tensor.nbytes())]);
  if (tensor.nbytes() > 0) RETURN_IF_ERROR(ops_->Download(tensor, host.get()));
  source.data = host.get();
  source.keepalive = std::shared_ptr<const void>(host, host.get());
  return source;
}

absl::Status Session::DeleteTensor(const te::v1::DeleteTensorRequest& request) {
  if (resident_.erase(request.tensor_id()) == 0) {
    return absl::NotFoundError(absl::StrCat("tensor_id: no resident tensor '",
                                            request.tensor_id(), "' in this session"));
  }
  return absl::OkStatus();
}

// ---- shared memory ---------------------------------------------------------------

absl::Status Session::RegisterSharedMemory(const te::v1::RegisterSharedMemoryRequest& request,
                                           te::v1::RegisterSharedMemoryResponse* response) {
  if (!config_.enable_shm) {
    return absl::FailedPreconditionError("shared memory disabled (--enable_shm)");
  }
  if (static_cast<int>(regions_.size()) >= config_.max_shm_regions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "this session already has ", regions_.size(),
        " shared-memory regions (the limit); unregister one first"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ShmRegion> region,
                   ShmRegion::Open(request.name(), request.size()));
  const std::string id = NewId(Created::Kind::kRegion);
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(id, ": mapped ", request.name(), " (", request.size(), " bytes)"));
  regions_[id] = std::move(region);
  response->set_region_id(id);
  return absl::OkStatus();
}

absl::Status Session::UnregisterSharedMemory(
    const te::v1::UnregisterSharedMemoryRequest& request) {
  if (regions_.erase(request.region_id()) == 0) {
    return absl::NotFoundError(absl::StrCat("region_id: no shared-memory region '",
                                            request.region_id(), "' in this session"));
  }
  return absl::OkStatus();
}

// ---- CreateSession ---------------------------------------------------------------

absl::Status OpenSession(const te::v1::CreateSessionRequest& request, Device* device,
                         const SessionConfig& config, SessionManager* manager,
                         te::v1::CreateSessionResponse* response) {
  const DeviceInfo info = device->info();
  if (!request.device().empty() && request.device() != info.name) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device: '", request.device(), "' is not served here; this server runs on '", info.name,
        "' (leave device empty for the server's choice)"));
  }
  for (int i = 0; i < request.preferred_recipes_size(); ++i) {
    if (KindOf(request.preferred_recipes(i)) == te::v1::RECIPE_KIND_UNSPECIFIED) continue;
    absl::StatusOr<layers::Fp8Recipe> resolved =
        layers::ResolveRecipe(request.preferred_recipes(i));
    if (!resolved.ok()) {
      return RenameRecipeField(resolved.status(), absl::StrCat("preferred_recipes[", i, "]"));
    }
  }
  ASSIGN_OR_RETURN(NegotiatedRecipe negotiated,
                   NegotiateRecipe(info, request.preferred_recipes(), request.policy()));
  std::optional<te::v1::Recipe> recipe;
  if (negotiated.has_recipe) recipe = negotiated.recipe;
  ASSIGN_OR_RETURN(
      SessionManager::Identity identity,
      manager->Create(absl::Seconds(request.ttl_seconds()),
                      [&](const std::string& id) -> absl::StatusOr<std::shared_ptr<Session>> {
                        ASSIGN_OR_RETURN(std::unique_ptr<Ops> ops,
                                         device->NewOps(config.session_memory_bytes));
                        return std::make_shared<Session>(id, info, std::move(ops), config,
                                                         request.policy(), recipe);
                      }));
  LogForSession(LogLevel::kInfo, identity.id,
                absl::StrCat("on ", info.name, "; negotiation: ", negotiated.explanation));
  response->mutable_session()->set_session_id(identity.id);
  response->mutable_session()->set_token(identity.token);
  if (recipe) *response->mutable_recipe() = *recipe;
  response->set_emulated(negotiated.emulated);
  response->set_negotiation(negotiated.explanation);
  response->set_ttl_seconds(absl::ToInt64Seconds(identity.ttl));
  response->set_device(info.name);
  return absl::OkStatus();
}

}  // namespace te::session
