// health_probe: exits 0 when a gRPC server answers SERVING to grpc.health.v1
// Check, else 1 (bad arguments), 2 (no connection), 3 (Check failed) or
// 4 (not serving), with one line on stderr saying why.
//   health_probe --address=127.0.0.1:50051 [--service=te.v1.TeService]
//                [--connect_timeout=2s] [--rpc_timeout=2s]
//                [--tls_ca=FILE [--tls_cert=FILE --tls_key=FILE] [--tls_server_name=NAME]]
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "deploy/health_probe.h"

ABSL_FLAG(std::string, address, "127.0.0.1:50051", "the server's host:port");
ABSL_FLAG(std::string, service, "", "the service to ask about; empty for the whole server");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(2), "time allowed to connect");
ABSL_FLAG(absl::Duration, rpc_timeout, absl::Seconds(2), "time allowed for the Check call");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle to check the server with; turns TLS on");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate, for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM client private key, for mutual TLS");
ABSL_FLAG(std::string, tls_server_name, "", "the name the server's certificate must carry");
ABSL_FLAG(bool, quiet, false, "print nothing when serving");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  te::deploy::ProbeOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.service = absl::GetFlag(FLAGS_service);
  options.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  options.rpc_timeout = absl::GetFlag(FLAGS_rpc_timeout);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  const te::deploy::ProbeOutcome outcome = te::deploy::Probe(options);
  if (outcome.result != te::deploy::ProbeResult::kServing || !absl::GetFlag(FLAGS_quiet)) {
    std::fprintf(stderr, "health_probe: %s\n", outcome.message.c_str());
  }
  return static_cast<int>(outcome.result);
}
