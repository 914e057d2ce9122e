#include "server/security/flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the server; with --tls_key, serve TLS instead of plaintext");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: mutual TLS; clients must present a certificate it signed");
ABSL_FLAG(std::string, access_key_file, "",
          "file holding a server-wide key (at least 16 bytes) that CreateSession must carry in "
          "access_key; empty: no key needed");

namespace te::security {

TlsFiles TlsFilesFromFlags() {
  TlsFiles files;
  files.cert_file = absl::GetFlag(FLAGS_tls_cert);
  files.key_file = absl::GetFlag(FLAGS_tls_key);
  files.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  return files;
}

absl::StatusOr<std::shared_ptr<const AccessKey>> AccessKeyFromFlags() {
  const std::string path = absl::GetFlag(FLAGS_access_key_file);
  if (path.empty()) return std::shared_ptr<const AccessKey>();
  absl::StatusOr<AccessKey> key = AccessKey::FromFile(path);
  if (!key.ok()) return key.status();
  return std::make_shared<const AccessKey>(*std::move(key));
}

}  // namespace te::security
