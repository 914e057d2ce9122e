// te_server's security flags:
//   --tls_cert, --tls_key  PEM certificate chain and key: serve TLS (else plaintext)
//   --tls_client_ca        PEM CA: mutual TLS, client certificates required and verified
//   --access_key_file      a file holding the key CreateSession must carry
#ifndef TE_SERVER_SECURITY_FLAGS_H_
#define TE_SERVER_SECURITY_FLAGS_H_

#include <memory>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "server/security/secrets.h"
#include "server/security/tls.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, access_key_file);

namespace te::security {

TlsFiles TlsFilesFromFlags();

// The access key --access_key_file names; nullptr when the flag is empty
// (CreateSession then needs no key). Errors as AccessKey::FromFile.
absl::StatusOr<std::shared_ptr<const AccessKey>> AccessKeyFromFlags();

}  // namespace te::security

#endif  // TE_SERVER_SECURITY_FLAGS_H_
