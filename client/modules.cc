// The machinery every module shares: Init / Apply / ValueAndGrad / Forward
// over the session's raw calls, and the shape-tree printer. The per-module
// te.v1.LayerSpec builders are in module_specs.cc.
#include "client/modules.h"
#include "client/train_steps.h"

#include <atomic>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

absl::Status CheckVariables(const Variables& vars) {
  if (vars.session == nullptr || vars.layer_id.empty()) {
    return absl::FailedPreconditionError("variables: not from Module::Init (no session or layer id)");
  }
  return absl::OkStatus();
}

Shape ShapeOf(const google::protobuf::RepeatedField<int64_t>& dims) { return Shape(dims.begin(), dims.end()); }

// Tensors uploaded for one call, deleted when the call is over (the first
// error is kept for the caller; a failed delete leaks only session memory).
class Uploads {
 public:
  explicit Uploads(Session& session) : session_(session) {}
  ~Uploads() { session_.DeleteAll(ids_).IgnoreError(); }
  std::vector<std::string>* ids() { return &ids_; }

 private:
  Session& session_;
  std::vector<std::string> ids_;
};

// Whether a response tensor of about `bytes` should come back by stream.
bool LargeForInline(const Session& session, int64_t bytes) {
  return bytes > static_cast<int64_t>(session.options().inline_tensor_bytes);
}

// dy null: none (a loss graph seeds its own backward).
absl::Status FillMicroBatch(Session& session, const HostTensor& x, const HostTensor* dy,
                            const ApplyOptions& options, Uploads* uploads, te::v1::MicroBatch* batch) {
  ASSIGN_OR_RETURN(*batch->mutable_x(), session.Send(x, uploads->ids()));
  if (dy != nullptr) {
    ASSIGN_OR_RETURN(*batch->mutable_dy(), session.Send(*dy, uploads->ids()));
  }
  for (const HostTensor& extra : options.extra_inputs) {
    ASSIGN_OR_RETURN(*batch->add_extra_inputs(), session.Send(extra, uploads->ids()));
  }
  if (options.attention_mask.has_value()) {
    ASSIGN_OR_RETURN(*batch->mutable_attention_mask(), session.Send(*options.attention_mask, uploads->ids()));
  }
  batch->set_dropout_seed(options.dropout_seed.value_or(0));
  return absl::OkStatus();
}

// Flax's make_rng("dropout") without the key: a dropout that runs needs the call's seed.
absl::Status CheckDropoutSeed(const Module& module, const ApplyOptions& options) {
  if (options.deterministic || options.dropout_seed.has_value()) return absl::OkStatus();
  const std::vector<std::string> users = module.DropoutUsers();
  if (users.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      absl::StrJoin(users, ", "),
      " needs PRNG for \"dropout\": with deterministic false set ApplyOptions::dropout_seed, as Flax "
      "requires rngs={\"dropout\": key}"));
}

}  // namespace

// ---- versions ---------------------------------------------------------------------

// How many holds this client has of each version of one layer: the server's
// version is released when the last goes. Thread-safe.
class LayerVersions {
 public:
  LayerVersions(std::shared_ptr<Session::Link> link, std::string layer_id)
      : link_(std::move(link)), layer_id_(std::move(layer_id)) {}
  void Acquire(int64_t version) {
    absl::MutexLock lock(&mu_);
    ++holders_[version];
  }
  void Release(int64_t version) {
    {
      absl::MutexLock lock(&mu_);
      auto it = holders_.find(version);
      if (it == holders_.end() || --it->second > 0) return;
      holders_.erase(it);
    }
    link_->ReleaseVersion(layer_id_, version);
  }

 private:
  const std::shared_ptr<Session::Link> link_;
  const std::string layer_id_;
  absl::Mutex mu_;
  std::map<int64_t, int> holders_ ABSL_GUARDED_BY(mu_);
};

class VersionHold {
 public:
  VersionHold(std::shared_ptr<LayerVersions> layer, int64_t version, bool live)
      : layer_(std::move(layer)), version_(version), live_(live) {
    layer_->Acquire(version);
  }
  ~VersionHold() { layer_->Release(version_.load()); }
  VersionHold(const VersionHold&) = delete;
  VersionHold& operator=(const VersionHold&) = delete;

  int64_t version() const { return version_.load(); }
  bool live() const { return live_; }
  const std::shared_ptr<LayerVersions>& layer() const { return layer_; }
  // A live hold follows its layer to `version`, releasing the one it left.
  void MoveTo(int64_t version) {
    layer_->Acquire(version);
    layer_->Release(version_.exchange(version));
  }

 private:
  const std::shared_ptr<LayerVersions> layer_;
  std::atomic<int64_t> version_;
  const bool live_;
};

int64_t Variables::version() const { return hold != nullptr ? hold->version() : 0; }
bool Variables::live() const { return hold == nullptr || hold->live(); }

Variables Variables::Pinned() const {
  Variables value = *this;
  if (hold != nullptr) value.hold = std::make_shared<VersionHold>(hold->layer(), hold->version(), false);
  return value;
}

namespace {

// After a call through `vars` answered `version`: a live handle follows it;
// for a value, a new version is another value (held, so released when it
// goes), returned; nullopt when nothing changed (or nothing holds versions).
std::optional<Variables> Follow(const Variables& vars, int64_t version) {
  if (vars.hold == nullptr || version == 0 || version == vars.hold->version()) {
    return std::nullopt;
  }
  if (vars.hold->live()) {
    vars.hold->MoveTo(version);
    return vars;
  }
  Variables next = vars;
  next.hold = std::make_shared<VersionHold>(vars.hold->layer(), version, false);
  return next;
}

}  // namespace

// Declared in train_steps.h: a step's version as the value its result holds.
Variables ValueAt(const Variables& vars, int64_t version) {
  Variables value = vars;
  if (vars.hold != nullptr && version != 0) {
    value.hold = std::make_shared<VersionHold>(vars.hold->layer(), version, false);
  }
  return value;
}

bool Variables::HasCollection(const std::string& collection) const {
  for (const VariableInfo& v : variables) {
    if (v.collection == collection) return true;
  }
  return false;
}

// ---- Shape tree -------------------------------------------------------------------

namespace {

// A nested dict of shapes, keys sorted as the quickstart's printout shows them.
struct TreeNode {
  std::map<std::string, std::unique_ptr<TreeNode>> children;
  std::optional<Shape> shape;  // a leaf
};

std::string PythonTuple(const Shape& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

std::string Render(const TreeNode& node) {
  if (node.shape.has_value()) return PythonTuple(*node.shape);
  std::vector<std::string> items;
  for (const auto& [key, child] : node.children) items.push_back(absl::StrCat("'", key, "': ", Render(*child)));
  return absl::StrCat("{", absl::StrJoin(items, ", "), "}");
}

}  // namespace

std::string ShapeTree(const std::vector<VariableInfo>& variables) {
  TreeNode root;
  for (const VariableInfo& v : variables) {
    TreeNode* node = &root;
    std::vector<std::string> keys = {v.collection};
    for (absl::string_view part : absl::StrSplit(v.path, '/', absl::SkipEmpty())) keys.emplace_back(part);
    for (const std::string& key : keys) {
      std::unique_ptr<TreeNode>& child = node->children[key];
      if (child == nullptr) child = std::make_unique<TreeNode>();
      node = child.get();
    }
    node->shape = v.shape;
  }
  return Render(root);
}

// ---- Module -----------------------------------------------------------------------

std::vector<std::string> Module::DropoutUsersIf(std::initializer_list<float> rates) const {
  for (float rate : rates) {
    if (rate > 0.0f) return {type_name()};
  }
  return {};
}

absl::StatusOr<Variables> Module::Init(Session& session, uint64_t key, const HostTensor& x,
                                       const InitOptions& options) const {
  te::v1::InitLayerRequest request;
  ASSIGN_OR_RETURN(*request.mutable_spec(), Spec());
  request.set_seed(key);
  request.set_decode(options.decode);
  request.set_input_dtype(DTypeToProto(x.dtype()));
  for (int64_t d : x.shape()) request.add_input_shape(d);
  *request.mutable_autocast() = ToProto(Autocast::Current());
  for (te::v1::TensorHeader& extra : ExtraInputs(x.shape())) *request.add_extra_inputs() = std::move(extra);
  ASSIGN_OR_RETURN(te::v1::InitLayerResponse response, session.InitLayer(std::move(request)));

  Variables vars;
  vars.session = &session;
  vars.layer_id = response.layer_id();
  // InitLayer made version 1: the live handle holds it.
  vars.hold = std::make_shared<VersionHold>(
      std::make_shared<LayerVersions>(session.link(), response.layer_id()), 1, /*live=*/true);
  vars.output_shape = ShapeOf(response.output_shape());
  ASSIGN_OR_RETURN(vars.output_dtype, DTypeFromProto(response.output_dtype(), "InitLayerResponse.output_dtype"));
  for (const te::v1::VariableInfo& info : response.variables()) {
    ASSIGN_OR_RETURN(DType dtype, DTypeFromProto(info.dtype(), absl::StrCat("InitLayerResponse.variables[", info.path(), "].dtype")));
    vars.variables.push_back(VariableInfo{info.collection(), info.path(), ShapeOf(info.shape()), dtype});
  }
  return vars;
}

absl::StatusOr<ForwardResult> Module::Forward(const Variables& vars, const HostTensor& x,
                                              const ApplyOptions& options, bool keep_for_backward) const {
  RETURN_IF_ERROR(CheckVariables(vars));
  RETURN_IF_ERROR(CheckDropoutSeed(*this, options));
  Session& session = *vars.session;
  Uploads uploads(session);
  te::v1::ForwardRequest request;
  request.set_layer_id(vars.layer_id);
  ASSIGN_OR_RETURN(*request.mutable_x(), session.Send(x, uploads.ids()));
  for (const HostTensor& extra : options.extra_inputs) {
    ASSIGN_OR_RETURN(*request.add_extra_inputs(), session.Send(extra, uploads.ids()));
  }
  if (options.attention_mask.has_value()) {
    ASSIGN_OR_RETURN(*request.mutable_attention_mask(), session.Send(*options.attention_mask, uploads.ids()));
  }
  request.set_deterministic(options.deterministic);
  request.set_dropout_seed(options.dropout_seed.value_or(0));
  *request.mutable_autocast() = ToProto(Autocast::Current());
  request.set_matmul_precision(ToProto(DefaultMatmulPrecision::Current()));
  request.set_keep_for_backward(keep_for_backward);
  request.set_update_fp8_metas(options.update_fp8_metas);
  request.set_graph(options.graph);
  request.set_version(vars.version());
  request.set_decode(options.decode);
  // y is about as large as x (a projection may widen it: budget for 4x).
  request.set_keep_outputs(options.keep_outputs ||
                           LargeForInline(session, 4 * static_cast<int64_t>(x.bytes().size())));
  ASSIGN_OR_RETURN(te::v1::ForwardResponse response, session.Forward(std::move(request)));

  ForwardResult result;
  ASSIGN_OR_RETURN(result.y, session.Receive(response.y(), "y"));
  if (response.has_ln_out() && response.ln_out().data_case() != te::v1::Tensor::DATA_NOT_SET) {
    ASSIGN_OR_RETURN(result.ln_out, session.Receive(response.ln_out(), "ln_out"));
  }
  for (int i = 0; i < response.outputs_size(); ++i) {
    ASSIGN_OR_RETURN(HostTensor out, session.Receive(response.outputs(i), absl::StrCat("outputs[", i, "]")));
    result.aux.push_back(std::move(out));
  }
  result.forward_id = response.forward_id();
  result.variables = Follow(vars, response.version());
  return result;
}

absl::StatusOr<HostTensor> Module::Apply(const Variables& vars, const HostTensor& x,
                                         const ApplyOptions& options) const {
  if (options.decode) {
    // Flax: apply(..., decode=True) without mutable=["cache"] cannot write
    // the cache.
    return absl::InvalidArgumentError(
        "decode: the step updates collection \"cache\", which Apply keeps immutable; call "
        "Decode (Flax: apply(..., decode=True, mutable=[\"cache\"])) for the new version");
  }
  ASSIGN_OR_RETURN(ForwardResult result, Forward(vars, x, options, /*keep_for_backward=*/false));
  return std::move(result.y);
}

absl::StatusOr<DecodeResult> Module::Decode(const Variables& vars, const HostTensor& x_t,
                                            const ApplyOptions& options) const {
  ApplyOptions step = options;
  step.decode = true;
  ASSIGN_OR_RETURN(ForwardResult result, Forward(vars, x_t, step, /*keep_for_backward=*/false));
  DecodeResult decoded;
  decoded.y = std::move(result.y);
  decoded.variables = result.variables ? *std::move(result.variables) : vars;
  return decoded;
}

namespace {

// One ForwardBackward of one micro-batch through `vars` (dy null: a loss graph's).
absl::StatusOr<ValueAndGradResult> Step(const Module& module, const Variables& vars,
                                        const HostTensor& x, const HostTensor* dy,
                                        const ApplyOptions& options) {
  RETURN_IF_ERROR(CheckVariables(vars));
  RETURN_IF_ERROR(CheckDropoutSeed(module, options));
  Session& session = *vars.session;
  Uploads uploads(session);
  te::v1::ForwardBackwardRequest request;
  request.set_layer_id(vars.layer_id);
  te::v1::MicroBatch* batch = request.add_micro_batches();
  RETURN_IF_ERROR(FillMicroBatch(session, x, dy, options, &uploads, batch));
  request.set_deterministic(options.deterministic);
  *request.mutable_autocast() = ToProto(Autocast::Current());
  request.set_matmul_precision(ToProto(DefaultMatmulPrecision::Current()));
  request.set_return_dx(true);
  request.set_return_grads(!options.apply_update);
  request.set_apply_update(options.apply_update);
  request.set_return_outputs(true);
  request.set_graph(options.graph);
  request.set_version(vars.version());
  ASSIGN_OR_RETURN(te::v1::ForwardBackwardResponse response, session.ForwardBackward(std::move(request)));
  if (response.values_size() != 1 || response.dx_size() != 1) {
    return absl::InternalError(absl::StrCat("ForwardBackward answered ", response.values_size(), " values and ",
                                            response.dx_size(), " dx for one micro-batch"));
  }
  ValueAndGradResult result;
  result.value = response.values(0);
  // Held first: whatever fails below, the new version is released with it.
  result.variables = Follow(vars, response.version());
  if (!result.variables) result.variables = vars;
  ASSIGN_OR_RETURN(result.dx, session.Receive(response.dx(0), "dx"));
  if (response.extra_input_grads_size() > 0) {
    for (int i = 0; i < response.extra_input_grads(0).grads_size(); ++i) {
      ASSIGN_OR_RETURN(HostTensor d, session.Receive(response.extra_input_grads(0).grads(i),
                                                     absl::StrCat("extra_input_grads[", i, "]")));
      result.extra_input_grads.push_back(std::move(d));
    }
  }
  if (response.outputs_size() > 0) {
    for (int i = 0; i < response.outputs(0).outputs_size(); ++i) {
      ASSIGN_OR_RETURN(HostTensor out, session.Receive(response.outputs(0).outputs(i),
                                                       absl::StrCat("outputs[", i, "]")));
      result.aux.push_back(std::move(out));
    }
  }
  for (const te::v1::Variable& grad : response.grads()) {
    ASSIGN_OR_RETURN(result.grads[absl::StrCat("params/", grad.path())],
                     session.Receive(grad.value(), absl::StrCat("grads/", grad.path())));
  }
  if (response.has_update()) result.update = response.update();
  return result;
}

}  // namespace

absl::StatusOr<ValueAndGradResult> Module::ValueAndGrad(const Variables& vars, const HostTensor& x,
                                                        const HostTensor& dy, const ApplyOptions& options) const {
  return Step(*this, vars, x, &dy, options);
}

absl::StatusOr<ValueAndGradResult> Module::LossValueAndGrad(const Variables& vars, const HostTensor& x,
                                                            const ApplyOptions& options) const {
  return Step(*this, vars, x, nullptr, options);
}

absl::StatusOr<BackwardResult> Backward(Session& session, const std::string& forward_id, const HostTensor& dy,
                                        bool keep_grads, const Variables* vars) {
  Uploads uploads(session);
  te::v1::BackwardRequest request;
  request.set_forward_id(forward_id);
  ASSIGN_OR_RETURN(*request.mutable_dy(), session.Send(dy, uploads.ids()));
  request.set_keep_grads(keep_grads);
  request.set_keep_outputs(LargeForInline(session, static_cast<int64_t>(dy.bytes().size())));
  ASSIGN_OR_RETURN(te::v1::BackwardResponse response, session.Backward(std::move(request)));
  BackwardResult result;
  if (vars != nullptr) {
    result.variables = Follow(*vars, response.version());
    if (!result.variables) result.variables = *vars;
  }
  ASSIGN_OR_RETURN(result.dx, session.Receive(response.dx(), "dx"));
  for (int i = 0; i < response.extra_input_grads_size(); ++i) {
    ASSIGN_OR_RETURN(HostTensor g, session.Receive(response.extra_input_grads(i), "extra_input_grads"));
    result.extra_input_grads.push_back(std::move(g));
  }
  for (const te::v1::Variable& grad : response.grads()) {
    ASSIGN_OR_RETURN(result.grads[absl::StrCat("params/", grad.path())],
                     session.Receive(grad.value(), absl::StrCat("grads/", grad.path())));
  }
  return result;
}

absl::StatusOr<std::map<std::string, HostTensor>> GetVariables(const Variables& vars,
                                                               const std::vector<std::string>& collections) {
  RETURN_IF_ERROR(CheckVariables(vars));
  te::v1::GetVariablesRequest request;
  request.set_layer_id(vars.layer_id);
  request.set_version(vars.version());
  for (const std::string& c : collections) request.add_collections(c);
  ASSIGN_OR_RETURN(te::v1::GetVariablesResponse response, vars.session->GetVariables(std::move(request)));
  std::map<std::string, HostTensor> out;
  for (const te::v1::Variable& v : response.variables()) {
    const std::string name = absl::StrCat(v.collection(), "/", v.path());
    ASSIGN_OR_RETURN(out[name], vars.session->Receive(v.value(), name));
  }
  return out;
}

absl::StatusOr<AddedGraph> AddGraph(const Variables& vars, const Module& graph, const Shape& x_shape,
                                    DType x_dtype) {
  RETURN_IF_ERROR(CheckVariables(vars));
  ASSIGN_OR_RETURN(te::v1::LayerSpec spec, graph.Spec());
  if (!spec.has_graph()) {
    return absl::InvalidArgumentError(absl::StrCat("graph: a ", graph.type_name(),
                                                   ", not a Graph (client/graph.h)"));
  }
  te::v1::AddGraphRequest request;
  request.set_layer_id(vars.layer_id);
  *request.mutable_graph() = spec.graph();
  request.set_input_dtype(DTypeToProto(x_dtype));
  for (int64_t d : x_shape) request.add_input_shape(d);
  for (te::v1::TensorHeader& extra : graph.ExtraInputs(x_shape)) *request.add_extra_inputs() = std::move(extra);
  ASSIGN_OR_RETURN(te::v1::AddGraphResponse response, vars.session->AddGraph(std::move(request)));
  AddedGraph added;
  added.graph = response.graph();
  added.output_shape = ShapeOf(response.output_shape());
  ASSIGN_OR_RETURN(added.output_dtype, DTypeFromProto(response.output_dtype(), "AddGraphResponse.output_dtype"));
  return added;
}

absl::Status DeleteLayer(const Variables& vars) {
  RETURN_IF_ERROR(CheckVariables(vars));
  te::v1::DeleteLayerRequest request;
  request.set_layer_id(vars.layer_id);
  return vars.session->DeleteLayer(std::move(request));
}

}  // namespace te::client
