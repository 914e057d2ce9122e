// A grpc.health.v1 client for container health checks (Docker HEALTHCHECK,
// Kubernetes exec probes when TLS rules out the native grpc probe): connects,
// asks Check once, and says whether the server (or one service) is SERVING.
#ifndef TE_DEPLOY_HEALTH_PROBE_H_
#define TE_DEPLOY_HEALTH_PROBE_H_

#include <string>

#include "absl/time/time.h"

namespace te::deploy {

struct ProbeOptions {
  std::string address = "127.0.0.1:50051";  // host:port
  std::string service;                      // "" asks about the whole server
  absl::Duration connect_timeout = absl::Seconds(2);
  absl::Duration rpc_timeout = absl::Seconds(2);

  // TLS: all empty means plaintext. A CA file alone is TLS that checks the
  // server; a client certificate and key (both or neither) add mutual TLS.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;  // overrides the name the certificate must carry
};

// The probe's exit codes (those of the widely used grpc_health_probe).
enum class ProbeResult {
  kServing = 0,
  kBadArguments = 1,   // options that cannot work (unreadable file, half a key pair)
  kConnectFailed = 2,  // no connection within connect_timeout
  kRpcFailed = 3,      // Check failed (deadline, NOT_FOUND for an unknown service...)
  kNotServing = 4,     // answered, but not SERVING
};

struct ProbeOutcome {
  ProbeResult result;
  std::string message;  // one line for the log: what was asked and what came back
};

// Never blocks longer than connect_timeout + rpc_timeout.
ProbeOutcome Probe(const ProbeOptions& options);

}  // namespace te::deploy

#endif  // TE_DEPLOY_HEALTH_PROBE_H_
