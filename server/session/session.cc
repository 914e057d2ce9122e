// Session: layers, variables, resident tensors, autocast, and CreateSession.
// The steps (Forward, Backward, ForwardBackward, Benchmark) are in
// session_steps.cc.
#include "server/session/session.h"

#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
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
  static const auto* known = new std::set<std::string>{"params", "fp8_metas", "grads"};
  return *known;
}

// ResolveRecipe names fields from "recipe"; requests carry it under another name.
absl::Status RenameRecipeField(const absl::Status& status, const std::string& field) {
  std::string message(status.message());
  if (absl::StartsWith(message, "recipe")) message = field + message.substr(6);
  return absl::Status(status.code(), message);
}

}  // namespace

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
}

std::string Session::NewId(const char* kind) { return absl::StrCat(kind, "-", next_id_++); }

ResidentLookup Session::Resident() const {
  return [this](const std::string& id) -> const Tensor* {
    auto it = resident_.find(id);
    return it == resident_.end() ? nullptr : &it->second;
  };
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
  const std::string id = session_->NewId("tensor");
  session_->resident_[id] = kept;
  EncodeResident(kept, id, out);
  return absl::OkStatus();
}

// ---- layers --------------------------------------------------------------------

absl::Status Session::InitLayer(const te::v1::InitLayerRequest& request,
                                te::v1::InitLayerResponse* response) {
  ASSIGN_OR_RETURN(std::unique_ptr<layers::Layer> layer, layers::CreateLayer(request.spec()));
  ASSIGN_OR_RETURN(DType input_dtype, DTypeFromProto(request.input_dtype(), "input_dtype"));
  if (!IsLayerInputDType(input_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "input_dtype: ", DTypeName(input_dtype), "; x must be float32, bfloat16 or float16"));
  }
  if (request.input_shape_size() == 0) {
    return absl::InvalidArgumentError("input_shape: empty; give x's shape, e.g. [batch, seq, hidden]");
  }
  for (int i = 0; i < request.input_shape_size(); ++i) {
    if (request.input_shape(i) <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "input_shape[", i, "]: must be positive, got ", request.input_shape(i)));
    }
  }
  ASSIGN_OR_RETURN(Shape input_shape, ShapeFromProto(request.input_shape(), input_dtype,
                                                     config_.max_tensor_bytes, "input_shape"));
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  const layers::Fp8Recipe* fp8_ptr = fp8 ? &*fp8 : nullptr;
  ASSIGN_OR_RETURN(std::vector<layers::VariableSpec> specs,
                   layer->VariableSpecs(input_shape, fp8_ptr));
  ASSIGN_OR_RETURN(Shape output_shape, layer->OutputShape(input_shape));

  auto entry = std::make_unique<LayerEntry>();
  RETURN_IF_ERROR(layer->Init(*ops_, request.seed(), input_shape, fp8_ptr, &entry->vars));
  entry->id = NewId("layer");
  entry->layer = std::move(layer);
  entry->init_recipe = fp8;
  entry->init = request;
  entry->init.clear_session();

  response->set_layer_id(entry->id);
  for (const layers::VariableSpec& spec : specs) {
    te::v1::VariableInfo* info = response->add_variables();
    SplitVariableName(spec.name, info->mutable_collection(), info->mutable_path());
    info->mutable_shape()->Assign(spec.shape.begin(), spec.shape.end());
    info->set_dtype(DTypeToProto(spec.dtype));
  }
  response->mutable_output_shape()->Assign(output_shape.begin(), output_shape.end());
  response->set_output_dtype(DTypeToProto(input_dtype));
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(entry->id, ": ", entry->layer->type_name(), " initialised for x ",
                             ShapeString(input_shape), " ", DTypeName(input_dtype), ", ",
                             specs.size(), " variables", fp8 ? " (under FP8 autocast)" : "",
                             "; session memory ", ops_->bytes_in_use(), " bytes"));
  layers_[entry->id] = std::move(entry);
  return absl::OkStatus();
}

absl::Status Session::GetVariables(const te::v1::GetVariablesRequest& request,
                                   te::v1::GetVariablesResponse* response) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
  std::set<std::string> wanted;
  for (int i = 0; i < request.collections_size(); ++i) {
    if (KnownCollections().count(request.collections(i)) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("collections[", i, "]: unknown collection '", request.collections(i),
                       "' (params, fp8_metas, grads)"));
    }
    wanted.insert(request.collections(i));
  }
  if (wanted.empty()) wanted = KnownCollections();
  OutputEncoder encoder(this);
  for (const layers::Variables* vars : {&layer->vars, &layer->grads}) {
    for (const auto& [name, tensor] : *vars) {
      std::string collection, path;
      SplitVariableName(name, &collection, &path);
      if (wanted.count(collection) == 0) continue;
      te::v1::Variable* out = response->add_variables();
      out->set_collection(collection);
      out->set_path(path);
      RETURN_IF_ERROR(encoder.Encode(tensor, /*resident=*/false, /*snapshot=*/true,
                                     out->mutable_value()));
    }
  }
  return absl::OkStatus();
}

absl::Status Session::SetVariables(const te::v1::SetVariablesRequest& request) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
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
    layers::Variables* target = variable.collection() == "grads" ? &layer->grads : &layer->vars;
    auto existing = target->find(name);
    if (existing == target->end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": layer ", layer->id, " has no variable ", name,
          variable.collection() == "grads" ? " (no gradients are kept yet)" : ""));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", name, " is given twice"));
    }
    ASSIGN_OR_RETURN(CheckedTensor value, CheckTensor(variable.value(), field + ".value",
                                                      config_.max_tensor_bytes, Resident()));
    const Tensor& current = existing->second;
    if (value.dtype != current.dtype() || value.shape != current.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".value: ", ShapeString(value.shape), " ", DTypeName(value.dtype), ", but ",
          name, " is ", ShapeString(current.shape()), " ", DTypeName(current.dtype())));
    }
    writes.push_back({target, name, std::move(value)});
  }
  // New tensors: a variable never aliases a resident tensor or a saved forward.
  std::vector<Tensor> values;
  for (const Write& write : writes) {
    ASSIGN_OR_RETURN(Tensor fresh, ops_->Allocate(write.value.dtype, write.value.shape));
    if (write.value.resident != nullptr) {
      if (fresh.nbytes() > 0) RETURN_IF_ERROR(ops_->Copy(*write.value.resident, &fresh));
    } else if (fresh.nbytes() > 0) {
      RETURN_IF_ERROR(ops_->Upload(write.value.inline_data->data(), &fresh));
    }
    values.push_back(std::move(fresh));
  }
  for (size_t i = 0; i < writes.size(); ++i) (*writes[i].target)[writes[i].name] = values[i];
  return absl::OkStatus();
}

// ---- resident tensors --------------------------------------------------------------

absl::Status Session::PutTensor(const te::v1::TensorHeader& header, const ChunkReader& read_chunk,
                                te::v1::PutTensorResponse* response) {
  ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(header.dtype(), "header.tensor.dtype"));
  ASSIGN_OR_RETURN(Shape shape, ShapeFromProto(header.shape(), dtype, config_.max_tensor_bytes,
                                               "header.tensor.shape"));
  ASSIGN_OR_RETURN(Tensor tensor, ops_->Allocate(dtype, shape));
  const int64_t total = static_cast<int64_t>(tensor.nbytes());
  int64_t offset = 0;
  std::string chunk;
  for (int index = 1;; ++index) {
    ASSIGN_OR_RETURN(bool more, read_chunk(&chunk));
    if (!more) break;
    const int64_t size = static_cast<int64_t>(chunk.size());
    if (size > total - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data (message ", index, "): the chunks add up to more than the ", total,
          " bytes of ", ShapeString(shape), " ", DTypeName(dtype)));
    }
    if (size == 0) continue;
    // A byte view of the allocation at `offset`: chunks need not align to elements.
    Tensor window(nullptr, static_cast<char*>(tensor.data()) + offset, DType::kBool, {size});
    RETURN_IF_ERROR(ops_->Upload(chunk.data(), &window));
    offset += size;
  }
  if (offset != total) {
    return absl::InvalidArgumentError(absl::StrCat("data: the chunks add up to ", offset,
                                                   " bytes, but ", ShapeString(shape), " ",
                                                   DTypeName(dtype), " needs ", total));
  }
  const std::string id = NewId("tensor");
  resident_[id] = std::move(tensor);
  response->set_tensor_id(id);
  response->set_bytes(total);
  return absl::OkStatus();
}

absl::StatusOr<Session::HostTensor> Session::GetTensor(const te::v1::GetTensorRequest& request) {
  auto it = resident_.find(request.tensor_id());
  if (it == resident_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor_id: no resident tensor '",
                                            request.tensor_id(), "' in this session"));
  }
  const int64_t max_chunk = std::max<int64_t>(1, config_.max_message_bytes - 4096);
  HostTensor host;
  host.chunk_bytes = request.chunk_bytes() == 0 ? std::min(kDefaultChunkBytes, max_chunk)
                                                : request.chunk_bytes();
  if (host.chunk_bytes <= 0 || host.chunk_bytes > max_chunk) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", request.chunk_bytes(),
                                                   " is outside [1, ", max_chunk,
                                                   "] (0: 1 MiB)"));
  }
  const Tensor& tensor = it->second;
  host.header.set_dtype(DTypeToProto(tensor.dtype()));
  host.header.mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  host.bytes.resize(tensor.nbytes());
  if (!host.bytes.empty()) RETURN_IF_ERROR(ops_->Download(tensor, host.bytes.data()));
  return host;
}

absl::Status Session::DeleteTensor(const te::v1::DeleteTensorRequest& request) {
  if (resident_.erase(request.tensor_id()) == 0) {
    return absl::NotFoundError(absl::StrCat("tensor_id: no resident tensor '",
                                            request.tensor_id(), "' in this session"));
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
