#include "server/session/testing/session_calls.h"

#include "absl/status/status.h"
#include "kernels/status_macros.h"
#include "server/session/testing/requests.h"
#include "te/v1/service.pb.h"

namespace te::session::testing {

absl::StatusOr<std::map<std::string, std::string>> VariableBytes(Session& session,
                                                                  const std::string& layer_id) {
  te::v1::GetVariablesRequest request;
  request.set_layer_id(layer_id);
  te::v1::GetVariablesResponse response;
  RETURN_IF_ERROR(session.GetVariables(request, &response));
  std::map<std::string, std::string> out;
  for (const te::v1::Variable& v : response.variables()) {
    const std::string name = v.collection() + "/" + v.path();
    if (!v.value().resident_id().empty()) {
      return absl::InternalError(name + " came back resident");
    }
    out[name] = v.value().inline_data();
  }
  return out;
}

absl::StatusOr<std::string> InitWithAdamW(Session& session, const te::v1::InitLayerRequest& init) {
  te::v1::InitLayerResponse layer;
  RETURN_IF_ERROR(session.InitLayer(init, &layer));
  te::v1::SetOptimizerResponse unused;
  RETURN_IF_ERROR(session.SetOptimizer(AdamWRequest(layer.layer_id(), 0.05, 0.01), &unused));
  return layer.layer_id();
}

absl::StatusOr<int64_t> RewriteFirstVariable(Session& session, const std::string& layer_id,
                                             const std::string& collection) {
  te::v1::GetVariablesRequest get;
  get.set_layer_id(layer_id);
  get.add_collections(collection);
  te::v1::GetVariablesResponse metas;
  RETURN_IF_ERROR(session.GetVariables(get, &metas));
  if (metas.variables_size() == 0) return absl::InternalError("the layer has no " + collection);
  te::v1::SetVariablesRequest set;
  set.set_layer_id(layer_id);
  *set.add_variables() = metas.variables(0);
  te::v1::SetVariablesResponse response;
  RETURN_IF_ERROR(session.SetVariables(set, &response));
  te::v1::ReleaseVersionsRequest release;
  release.set_layer_id(layer_id);
  for (int64_t v = 1; v < response.version(); ++v) release.add_versions(v);
  RETURN_IF_ERROR(session.ReleaseVersions(release));
  return static_cast<int64_t>(metas.variables(0).value().inline_data().size());
}

}  // namespace te::session::testing
