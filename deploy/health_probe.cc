#include "deploy/health_probe.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <memory>
#include <sstream>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace te::deploy {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;

absl::StatusOr<std::string> ReadFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": cannot open it"));
  std::stringstream contents;
  contents << in.rdbuf();
  if (contents.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "=", path, ": empty"));
  }
  return contents.str();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> Credentials(const ProbeOptions& options) {
  const bool tls = !options.tls_ca_file.empty() || !options.tls_cert_file.empty() ||
                   !options.tls_key_file.empty();
  if (!tls) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_file.empty() != options.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert and --tls_key come together (mutual TLS) or not at all");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadFile("--tls_ca", options.tls_ca_file);
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
  }
  if (!options.tls_cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadFile("--tls_cert", options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    absl::StatusOr<std::string> key = ReadFile("--tls_key", options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  return grpc::SslCredentials(ssl);
}

}  // namespace

ProbeOutcome Probe(const ProbeOptions& options) {
  const std::string asked = absl::StrCat(options.address, " service \"", options.service, "\"");
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = Credentials(options);
  if (!credentials.ok()) {
    return {ProbeResult::kBadArguments, std::string(credentials.status().message())};
  }
  grpc::ChannelArguments arguments;
  if (!options.tls_server_name.empty()) {
    arguments.SetSslTargetNameOverride(options.tls_server_name);
  }
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(options.address, *credentials, arguments);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + options.connect_timeout))) {
    return {ProbeResult::kConnectFailed,
            absl::StrCat(asked, ": no connection within ",
                         absl::FormatDuration(options.connect_timeout))};
  }
  std::unique_ptr<Health::Stub> stub = Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options.rpc_timeout));
  HealthCheckRequest request;
  request.set_service(options.service);
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    return {ProbeResult::kRpcFailed,
            absl::StrCat(asked, ": Check failed with code ", status.error_code(), ": ",
                         status.error_message())};
  }
  const std::string answer = HealthCheckResponse::ServingStatus_Name(response.status());
  if (response.status() != HealthCheckResponse::SERVING) {
    return {ProbeResult::kNotServing, absl::StrCat(asked, ": ", answer)};
  }
  return {ProbeResult::kServing, absl::StrCat(asked, ": ", answer)};
}

}  // namespace te::deploy
