// Calls on a Session that several of the session's tests make the same way.
#ifndef TE_SERVER_SESSION_TESTING_SESSION_CALLS_H_
#define TE_SERVER_SESSION_TESTING_SESSION_CALLS_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "server/session/session.h"

namespace te::session::testing {

// Every variable of the layer's newest version, "collection/path" -> its
// bytes, as GetVariables sends them inline (an error if one came back
// resident).
absl::StatusOr<std::map<std::string, std::string>> VariableBytes(Session& session,
                                                                  const std::string& layer_id);

// InitLayer(init), then AdamW (learning rate 0.05, weight decay 0.01) on the
// new layer, as the step tests train it. Returns the layer's id.
absl::StatusOr<std::string> InitWithAdamW(Session& session, const te::v1::InitLayerRequest& init);

// Sets the layer's first variable of `collection` ("fp8_metas", "params")
// to the value it has: no number changes, and the kept weight copies (FP8
// and compute-dtype casts) go, as after any write to the variables. Then
// releases every version older than the one that makes, as a client that
// holds only the newest does. Returns the rewritten variable's size in bytes.
absl::StatusOr<int64_t> RewriteFirstVariable(Session& session, const std::string& layer_id,
                                             const std::string& collection);

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_SESSION_CALLS_H_
