#include "server/security/tls.h"

#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace te::security {
namespace {

absl::StatusOr<std::string> ReadPem(const char* flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::FailedPreconditionError(absl::StrCat(flag, "=", path, ": cannot be read"));
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

struct BioFree {
  void operator()(BIO* bio) const { BIO_free(bio); }
};
struct X509Free {
  void operator()(X509* x509) const { X509_free(x509); }
};
struct KeyFree {
  void operator()(EVP_PKEY* key) const { EVP_PKEY_free(key); }
};
using Bio = std::unique_ptr<BIO, BioFree>;

Bio BioOf(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM chain or bundle, or null.
std::unique_ptr<X509, X509Free> FirstCertificate(const std::string& pem) {
  Bio bio = BioOf(pem);
  return std::unique_ptr<X509, X509Free>(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsFiles& files) {
  if (!files.enabled()) return grpc::InsecureServerCredentials();
  if (files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key: give both (the server's certificate and its key), or neither "
        "for plaintext; --tls_client_ca needs them too");
  }
  absl::StatusOr<std::string> cert = ReadPem("--tls_cert", files.cert_file);
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPem("--tls_key", files.key_file);
  if (!key.ok()) return key.status();

  std::unique_ptr<X509, X509Free> certificate = FirstCertificate(*cert);
  if (certificate == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("--tls_cert=", files.cert_file, ": no PEM certificate in it"));
  }
  Bio key_bio = BioOf(*key);
  std::unique_ptr<EVP_PKEY, KeyFree> private_key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (private_key == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tls_key=", files.key_file, ": no PEM private key in it (or it is encrypted)"));
  }
  if (X509_check_private_key(certificate.get(), private_key.get()) != 1) {
    return absl::FailedPreconditionError(absl::StrCat("--tls_key=", files.key_file,
                                                      " does not match the certificate in "
                                                      "--tls_cert=",
                                                      files.cert_file));
  }

  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  if (files.client_ca_file.empty()) {
    options.client_certificate_request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  } else {
    absl::StatusOr<std::string> client_ca = ReadPem("--tls_client_ca", files.client_ca_file);
    if (!client_ca.ok()) return client_ca.status();
    if (FirstCertificate(*client_ca) == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("--tls_client_ca=", files.client_ca_file, ": no PEM certificate in it"));
    }
    options.pem_root_certs = *client_ca;
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

std::string DescribeTransport(const TlsFiles& files) {
  if (!files.enabled()) return "plaintext";
  if (files.client_ca_file.empty()) return "TLS";
  return absl::StrCat("mutual TLS (client CA ", files.client_ca_file, ")");
}

}  // namespace te::security
