#include "server/security/secrets.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace te::security {
namespace {

constexpr size_t kSaltBytes = 16;

absl::StatusOr<std::string> RandomBytes(size_t n) {
  std::string bytes(n, '\0');
  size_t filled = 0;
  while (filled < n) {
    const ssize_t got = getrandom(bytes.data() + filled, n - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(got);
  }
  return bytes;
}

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  if (a.empty()) return true;
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string Sha256(absl::string_view data) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

absl::StatusOr<AccessKey> AccessKey::FromString(absl::string_view key) {
  if (key.size() < kMinBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("access key: ", key.size(), " bytes; at least ", kMinBytes, " required"));
  }
  return AccessKey(Sha256(key));
}

absl::StatusOr<AccessKey> AccessKey::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat("--access_key_file=", path, ": cannot be read"));
  }
  std::stringstream content;
  content << in.rdbuf();
  const std::string key(absl::StripAsciiWhitespace(content.str()));
  absl::StatusOr<AccessKey> access_key = FromString(key);
  if (!access_key.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--access_key_file=", path, ": ", access_key.status().message()));
  }
  return access_key;
}

bool AccessKey::Accepts(absl::string_view given) const {
  return ConstantTimeEquals(Sha256(given), digest_);
}

absl::Status CheckAccessKey(const AccessKey* key, absl::string_view given) {
  if (key == nullptr) return absl::OkStatus();
  if (given.empty()) {
    return absl::UnauthenticatedError(
        "access_key: missing; this server requires its access key to create a session");
  }
  if (!key->Accepts(given)) return absl::UnauthenticatedError("access_key: wrong key");
  return absl::OkStatus();
}

absl::StatusOr<TokenDigest> TokenDigest::Of(absl::string_view token) {
  absl::StatusOr<std::string> salt = RandomBytes(kSaltBytes);
  if (!salt.ok()) return salt.status();
  TokenDigest digest;
  digest.salt = *std::move(salt);
  digest.sha256 = Sha256(absl::StrCat(digest.salt, token));
  return digest;
}

bool TokenDigest::Matches(absl::string_view token) const {
  return ConstantTimeEquals(Sha256(absl::StrCat(salt, token)), sha256);
}

bool TokenDigest::WellFormed() const {
  return salt.size() == kSaltBytes && sha256.size() == SHA256_DIGEST_LENGTH;
}

}  // namespace te::security
