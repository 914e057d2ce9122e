// Session: a layer's versions and graphs (session.h, contracts 9 and 10):
// resolving what a call reads, making and releasing versions, the copies a
// write in place needs, AddGraph and DeleteLayer.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "google/protobuf/util/message_differencer.h"
#include "kernels/status_macros.h"
#include "server/layers/graph.h"
#include "server/layers/variables.h"
#include "server/session/log.h"
#include "server/session/session.h"
#include "server/session/session_internal.h"

namespace te::session {

int64_t Session::MakeVersion(LayerEntry& layer, VariableSet set) {
  const int64_t number = ++layer.last_version;
  layer.versions[number].set = std::move(set);
  Record({Created::Kind::kVersion, layer.id, number});
  return number;
}

absl::StatusOr<Session::Target> Session::Resolve(const std::string& layer_id, int64_t graph,
                                                 int64_t version) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(layer_id));
  Target target;
  target.entry = layer;
  if (graph < 0 || graph >= static_cast<int64_t>(layer->graphs.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "graph: ", graph, "; layer ", layer_id, " has graphs 0 to ", layer->graphs.size() - 1,
        " (0: the one InitLayer made; AddGraph adds others)"));
  }
  target.graph = static_cast<int>(graph);
  target.layer = layer->graphs[target.graph].layer.get();
  if (version < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("version: ", version, "; give a version's number, or 0 for the newest"));
  }
  if (layer->versions.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "version: ", version, "; every version of layer ", layer_id,
        "'s variables was released (ReleaseVersions); delete the layer and init it again"));
  }
  auto it = version == 0 ? std::prev(layer->versions.end()) : layer->versions.find(version);
  if (it == layer->versions.end()) {
    return absl::NotFoundError(absl::StrCat(
        "version: layer ", layer_id, " has no version ", version,
        version > layer->last_version ? " (none made yet)" : " (released)", "; it keeps ",
        layer->versions.size(), " from ", layer->versions.begin()->first, " to ",
        layer->versions.rbegin()->first));
  }
  target.version = it->first;
  target.read = &it->second.set;
  return target;
}

absl::Status Session::DetachFromVersions(LayerEntry& layer,
                                         const std::vector<const Tensor*>& writes,
                                         int64_t donated) {
  // Every variable map that may hold one of the tensors: the retained
  // versions' and those the layer's kept forwards ran on.
  std::vector<layers::Variables*> holders;
  auto add = [&holders](VariableSet& set) {
    for (layers::Variables* vars : {&set.vars, &set.grads, &set.opt_state}) holders.push_back(vars);
  };
  for (auto& [number, version] : layer.versions) {
    if (number != donated) add(version.set);
  }
  for (auto& [id, saved] : saved_) {
    if (saved->layer_id == layer.id) add(saved->base);
  }
  // The storage they hold, gathered once: a step writes every param and
  // optimizer slot, so asking each holder about each write would cost
  // writes x held map walks (the 24-layer LM's step: millions).
  absl::flat_hash_set<const void*> held;
  for (const layers::Variables* vars : holders) {
    for (const auto& [name, tensor] : *vars) held.insert(tensor.data());
  }
  // Copies first (they may fail, leaving everything as it was), then the swap.
  std::map<const void*, Tensor> copies;  // by node: `to` points into it
  std::vector<const Tensor*> from;
  std::vector<Tensor*> to;
  for (const Tensor* write : writes) {
    if (write->nbytes() == 0 || copies.count(write->data()) > 0) continue;
    if (!held.contains(write->data())) continue;
    absl::StatusOr<Tensor> copy = ops_->Allocate(write->dtype(), write->shape());
    if (!copy.ok()) {
      if (!absl::IsResourceExhausted(copy.status())) return copy.status();
      return absl::ResourceExhaustedError(absl::StrCat(
          "version: the new version of layer ", layer.id, " needs its own copy of what it "
          "writes while older versions hold it, and that does not fit: ", copy.status().message(),
          "; release versions no longer used (ReleaseVersions)"));
    }
    Tensor& kept = copies[write->data()] = *std::move(copy);
    from.push_back(write);
    to.push_back(&kept);
  }
  if (copies.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(ops_->CopyAll(from, to));
  for (layers::Variables* vars : holders) {
    for (auto& [name, tensor] : *vars) {
      auto it = copies.find(tensor.data());
      if (it != copies.end()) tensor = it->second;
    }
  }
  return absl::OkStatus();
}

namespace {

// The module nodes of the graph InitLayer made, by name; a layer that is one
// module has that module alone, named "" (the root scope).
std::map<std::string, const te::v1::LayerSpec*> InitModules(const te::v1::LayerSpec& spec) {
  std::map<std::string, const te::v1::LayerSpec*> modules;
  if (!spec.has_graph()) {
    modules[""] = &spec;
    return modules;
  }
  for (const te::v1::GraphSpec::Node& node : spec.graph().nodes()) {
    if (node.op_case() == te::v1::GraphSpec::Node::kModule) modules[node.name()] = &node.module();
  }
  return modules;
}

bool SameMessage(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

// The graph's own errors name "spec.graph..."; AddGraph's field is "graph".
absl::Status AsAddGraphField(const absl::Status& status) {
  return absl::Status(status.code(),
                      absl::StrReplaceAll(status.message(), {{"spec.graph", "graph"}}));
}

}  // namespace

absl::Status Session::AddGraph(const te::v1::AddGraphRequest& request,
                               te::v1::AddGraphResponse* response, const CallContext& call) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
  const LayerVersion* newest = layer->newest();
  if (newest == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer_id: every version of layer ", layer->id, "'s variables was released"));
  }
  // The nodes that read variables must be the layer's own, by name and spec.
  const std::map<std::string, const te::v1::LayerSpec*> modules = InitModules(layer->init.spec());
  const te::v1::GraphSpec& graph = request.graph();
  for (int i = 0; i < graph.nodes_size(); ++i) {
    const te::v1::GraphSpec::Node& node = graph.nodes(i);
    const std::string field = absl::StrCat("graph.nodes[", i, "] (", node.name(), ")");
    if (node.op_case() == te::v1::GraphSpec::Node::kModule) {
      auto it = modules.find(node.name());
      if (it == modules.end()) {
        std::vector<std::string> names;
        for (const auto& [name, spec] : modules) names.push_back(absl::StrCat("\"", name, "\""));
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": layer ", layer->id, " has no module named \"", node.name(),
            "\" (its modules: ", absl::StrJoin(names, ", "),
            "); a graph added over a layer reads that layer's modules"));
      }
      if (!SameMessage(node.module(), *it->second)) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".module: not the LayerSpec of layer ", layer->id, "'s module \"", node.name(),
            "\" (", it->second->ShortDebugString(), "); a module reads the variables of its own "
            "spec"));
      }
    } else if (node.op_case() == te::v1::GraphSpec::Node::kParam) {
      const std::string name = absl::StrCat(layers::kParams, "/", node.name());
      auto it = newest->set.vars.find(name);
      const te::v1::GraphSpec::Param& param = node.param();
      const Shape shape(param.shape().begin(), param.shape().end());
      // Unset: float32, Flax's default param dtype.
      absl::StatusOr<DType> want = param.dtype() == te::v1::DTYPE_UNSPECIFIED
                                       ? absl::StatusOr<DType>(DType::kF32)
                                       : DTypeFromProto(param.dtype(), field + ".param.dtype");
      RETURN_IF_ERROR(want.status());
      if (it == newest->set.vars.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": layer ", layer->id, " has no param ", name,
            "; a graph added over a layer reads that layer's params"));
      }
      if (it->second.shape() != shape || it->second.dtype() != *want) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".param: ", ShapeString(shape), " ", DTypeName(*want), ", but layer ",
            layer->id, "'s ", name, " is ", ShapeString(it->second.shape()), " ",
            DTypeName(it->second.dtype())));
      }
    }
  }
  absl::StatusOr<std::unique_ptr<layers::Layer>> made = layers::MakeGraph(graph);
  if (!made.ok()) return AsAddGraphField(made.status());
  std::unique_ptr<layers::Layer> added = *std::move(made);
  ASSIGN_OR_RETURN(DeclaredInput declared,
                   CheckDeclared(*added, request, config_.max_tensor_bytes));
  const DType input_dtype = declared.dtype;
  const Shape& input_shape = declared.shape;
  std::optional<layers::DeclaredExtras>& extras = declared.extras;
  if (extras) {
    made = layers::MakeGraph(graph, extras);
    if (!made.ok()) return AsAddGraphField(made.status());
    added = *std::move(made);
  }
  // Its variables for this input are exactly some of the layer's, so it
  // reads and trains them (under the autocast the layer was made with: its
  // fp8_metas exist iff InitLayer's did).
  const layers::Fp8Recipe* fp8 = layer->init_recipe ? &*layer->init_recipe : nullptr;
  absl::StatusOr<std::vector<layers::VariableSpec>> specs = added->VariableSpecs(input_shape, fp8);
  if (!specs.ok()) return AsAddGraphField(specs.status());
  const absl::Status fits = layers::CheckVariables(newest->set.vars, *specs);
  if (!fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "graph: for x ", ShapeString(input_shape), " its variables are not layer ", layer->id,
        "'s: ", fits.message()));
  }
  ASSIGN_OR_RETURN(Shape output_shape, added->OutputShape(input_shape));
  response->mutable_output_shape()->Assign(output_shape.begin(), output_shape.end());
  response->set_output_dtype(DTypeToProto(added->OutputDType(input_dtype)));
  // An equal graph, taking the same extra inputs: its index (graph 0 too,
  // where InitLayer traced this one).
  if (layer->init.spec().has_graph() && SameMessage(layer->init.spec().graph(), graph) &&
      layers::SameDeclaredExtras(layer->graphs[0].extras, extras)) {
    response->set_graph(0);
    return absl::OkStatus();
  }
  for (size_t i = 1; i < layer->graphs.size(); ++i) {
    if (SameMessage(layer->graphs[i].added.graph(), graph) &&
        layers::SameDeclaredExtras(layer->graphs[i].extras, extras)) {
      response->set_graph(static_cast<int32_t>(i));
      return absl::OkStatus();
    }
  }
  RETURN_IF_ERROR(call.StillWanted("AddGraph"));
  LayerGraph entry;
  entry.layer = std::move(added);
  entry.extras = std::move(extras);
  entry.added = request;
  entry.added.clear_session();
  entry.added.clear_layer_id();
  layer->graphs.push_back(std::move(entry));
  Record({Created::Kind::kGraph, layer->id, static_cast<int64_t>(layer->graphs.size() - 1)});
  response->set_graph(static_cast<int32_t>(layer->graphs.size() - 1));
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(layer->id, ": graph ", layer->graphs.size() - 1, " added for x ",
                             ShapeString(input_shape), " ", DTypeName(input_dtype)));
  return absl::OkStatus();
}

absl::Status Session::ReleaseVersions(const te::v1::ReleaseVersionsRequest& request) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
  for (int64_t number : request.versions()) layer->versions.erase(number);
  return absl::OkStatus();
}

absl::Status Session::DeleteLayer(const te::v1::DeleteLayerRequest& request) {
  ASSIGN_OR_RETURN(LayerEntry * layer, FindLayer(request.layer_id()));
  for (auto it = saved_.begin(); it != saved_.end();) {
    it = it->second->layer_id == layer->id ? saved_.erase(it) : std::next(it);
  }
  LogForSession(LogLevel::kInfo, id_,
                absl::StrCat(layer->id, ": deleted with ", layer->versions.size(), " versions and ",
                             layer->graphs.size(), " graphs"));
  layers_.erase(request.layer_id());
  return absl::OkStatus();
}

}  // namespace te::session
