// The one mapping from absl::Status (everything inside the server) to
// grpc::Status (the wire). Codes map one to one (both follow google.rpc.Code);
// the message is kept.
#ifndef TE_SERVER_SERVICE_STATUS_H_
#define TE_SERVER_SERVICE_STATUS_H_

#include <grpcpp/grpcpp.h>

#include <exception>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace te::service {

grpc::Status ToGrpcStatus(const absl::Status& status);

// Runs `fn` (returning absl::Status or absl::StatusOr) so that no exception
// leaves it: the session layer reports errors as statuses, but the standard
// library it runs on may still throw (std::bad_alloc from a host allocation
// the memory checks did not foresee). An exception then ends this call, not
// the server: RESOURCE_EXHAUSTED for memory, INTERNAL for anything else.
template <typename F>
auto NoThrow(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError("the server ran out of host memory for this call");
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("unexpected exception: ", e.what()));
  } catch (...) {
    return absl::InternalError("unexpected exception");
  }
}

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_STATUS_H_
