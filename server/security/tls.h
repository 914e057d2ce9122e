// Transport security for te_server: TLS, or mutual TLS when a client CA is
// given (then every client must present a certificate that CA signed).
// Credentials are checked when made, so a wrong file fails at start with a
// message naming the flag, not at the first handshake.
#ifndef TE_SERVER_SECURITY_TLS_H_
#define TE_SERVER_SECURITY_TLS_H_

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace te::security {

// PEM files (te_server's --tls_cert, --tls_key, --tls_client_ca).
struct TlsFiles {
  std::string cert_file;       // the server's certificate chain
  std::string key_file;        // its private key
  std::string client_ca_file;  // set: mutual TLS, client certificates required and verified

  bool enabled() const {
    return !cert_file.empty() || !key_file.empty() || !client_ca_file.empty();
  }
};

// Insecure credentials when no file is named; TLS otherwise.
// INVALID_ARGUMENT: a certificate without its key or the reverse, or a client
// CA without a server certificate. FAILED_PRECONDITION: a file that cannot be
// read, is not PEM of the right kind, or a key that does not match the
// certificate (each message names the flag and the file).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& files);

// "plaintext", "TLS" or "mutual TLS (client CA <file>)", for the start-up log.
std::string DescribeTransport(const TlsFiles& files);

}  // namespace te::security

#endif  // TE_SERVER_SECURITY_TLS_H_
