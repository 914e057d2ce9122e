// What the session's step tests check alike: two runs of the same steps
// (one keeping something across calls, one not) gave the same answer and
// the same variables, bit for bit.
#ifndef TE_SERVER_SESSION_TESTING_STEP_EXPECTATIONS_H_
#define TE_SERVER_SESSION_TESTING_STEP_EXPECTATIONS_H_

#include <map>
#include <string>

#include "te/v1/service.pb.h"

namespace te::session::testing {

// The same values and update record (applied, grad_norm), bit for bit.
void ExpectSameStep(const te::v1::ForwardBackwardResponse& got,
                    const te::v1::ForwardBackwardResponse& want);
// The same variables ("collection/path" -> bytes, as VariableBytes gives
// them), bit for bit.
void ExpectSameVariables(const std::map<std::string, std::string>& got,
                         const std::map<std::string, std::string>& want);

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_STEP_EXPECTATIONS_H_
