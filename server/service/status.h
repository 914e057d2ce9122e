// The one mapping from absl::Status (everything inside the server) to
// grpc::Status (the wire). Codes map one to one (both follow google.rpc.Code);
// the message is kept.
#ifndef TE_SERVER_SERVICE_STATUS_H_
#define TE_SERVER_SERVICE_STATUS_H_

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"

namespace te::service {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_STATUS_H_
