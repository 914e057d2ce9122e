// RpcBytesCounter: te_rpc_received_bytes_total and te_rpc_sent_bytes_total for
// every call of one gRPC service, unary and streaming alike, counted in one
// place: a gRPC server interceptor that sees each message a call receives
// (after it is parsed) and sends (before it goes out).
//
// Bytes are the messages' serialized payload: a protobuf message's
// ByteSizeLong(), a raw method's grpc::ByteBuffer's Length(). gRPC's own
// framing (5 bytes a message), HTTP/2 and TLS are not counted. Calls of other
// services (health, reflection) and of unknown methods are not intercepted.
#ifndef TE_SERVER_METRICS_RPC_BYTES_H_
#define TE_SERVER_METRICS_RPC_BYTES_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/metrics/server_metrics.h"

namespace te::metrics {

class RpcBytesCounter final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  // Counts the methods of `service` (a full name, "te.v1.TeService", whose
  // descriptor is linked in) into `metrics`' byte counters, labelled with the
  // method's name. `raw_methods` names the methods the service registers raw
  // (their messages are grpc::ByteBuffers, not protobuf messages); every other
  // method's messages are read as protobuf messages, so a raw method left out
  // of the list would be misread. NOT_FOUND: no such service. INVALID_ARGUMENT:
  // a raw method the service does not have.
  static absl::StatusOr<std::unique_ptr<RpcBytesCounter>> Create(
      const ServerMetrics& metrics, absl::string_view service,
      absl::Span<const char* const> raw_methods);

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

 private:
  struct Method {
    std::string name;  // the label value: "Forward"
    bool raw = false;
  };
  RpcBytesCounter(const ServerMetrics& metrics, absl::flat_hash_map<std::string, Method> methods)
      : metrics_(metrics), methods_(std::move(methods)) {}

  const ServerMetrics metrics_;
  // By the path gRPC reports, "/te.v1.TeService/Forward". Never changes after
  // Create, so calls read it without a lock.
  const absl::flat_hash_map<std::string, Method> methods_;
};

// Installs an RpcBytesCounter (as above) on `builder`, before BuildAndStart.
// It takes the builder's interceptor list: te_server installs no other.
absl::Status CountRpcBytes(const ServerMetrics& metrics, absl::string_view service,
                           absl::Span<const char* const> raw_methods,
                           grpc::ServerBuilder* builder);

}  // namespace te::metrics

#endif  // TE_SERVER_METRICS_RPC_BYTES_H_
