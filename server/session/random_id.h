// Unguessable identifiers: 128 bits from the kernel's CSPRNG, as 32 hex digits.
#ifndef TE_SERVER_SESSION_RANDOM_ID_H_
#define TE_SERVER_SESSION_RANDOM_ID_H_

#include <string>

#include "absl/status/statusor.h"

namespace te::session {

// 32 lowercase hex digits from getrandom(2) (/dev/urandom's source).
// UNAVAILABLE if the kernel cannot supply random bytes.
absl::StatusOr<std::string> RandomHex128();

}  // namespace te::session

#endif  // TE_SERVER_SESSION_RANDOM_ID_H_
