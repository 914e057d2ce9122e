// Server-side secrets: the server-wide access key (--access_key_file) and the
// salted digests under which session tokens are checkpointed. Comparisons run
// in time independent of where, or whether, the inputs differ. Thread-safe
// (immutable once made).
#ifndef TE_SERVER_SECURITY_SECRETS_H_
#define TE_SERVER_SECURITY_SECRETS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace te::security {

// a == b, in time that depends only on the lengths (tokens and keys are
// compared through fixed-size digests, so not even on those).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// SHA-256 of `data`: 32 raw bytes.
std::string Sha256(absl::string_view data);

// The key every CreateSession must carry when te_server runs with
// --access_key_file.
class AccessKey {
 public:
  // The file's content less surrounding whitespace. FAILED_PRECONDITION when
  // the file cannot be read, or holds fewer than kMinBytes (a key that short
  // can be guessed).
  static absl::StatusOr<AccessKey> FromFile(const std::string& path);
  // For tests: the key itself (same length rule, INVALID_ARGUMENT).
  static absl::StatusOr<AccessKey> FromString(absl::string_view key);

  static constexpr size_t kMinBytes = 16;

  // True iff `given` is the key. Compares digests, so neither the key's
  // length nor the position of a first difference shows in the timing.
  bool Accepts(absl::string_view given) const;

 private:
  explicit AccessKey(std::string digest) : digest_(std::move(digest)) {}
  std::string digest_;  // SHA-256 of the key; the key itself is not kept
};

// CreateSession's check: OK when `key` is null (no key required) or accepts
// `given`; UNAUTHENTICATED ("access_key: missing" / "access_key: wrong") otherwise.
absl::Status CheckAccessKey(const AccessKey* key, absl::string_view given);

// A session token as a checkpoint stores it: SHA-256(salt || token) with a
// random 16-byte salt, so the disk never holds a token a reader could replay,
// yet a restored session still accepts its old token.
struct TokenDigest {
  std::string salt;    // 16 raw bytes
  std::string sha256;  // 32 raw bytes

  // A fresh digest of `token`. UNAVAILABLE if the kernel gives no randomness.
  static absl::StatusOr<TokenDigest> Of(absl::string_view token);
  // True iff `token` is the token this digest was made from.
  bool Matches(absl::string_view token) const;
  // Salt and digest have their sizes (a checkpoint's are checked on load).
  bool WellFormed() const;
};

}  // namespace te::security

#endif  // TE_SERVER_SECURITY_SECRETS_H_
