// RETURN_IF_ERROR / ASSIGN_OR_RETURN: Debian's abseil (20220623) predates its own.
#ifndef TE_KERNELS_STATUS_MACROS_H_
#define TE_KERNELS_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TE_STATUS_CONCAT_INNER(a, b) a##b
#define TE_STATUS_CONCAT(a, b) TE_STATUS_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                         \
  do {                                                \
    ::absl::Status _te_status = (expr);               \
    if (!_te_status.ok()) return _te_status;          \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  TE_ASSIGN_OR_RETURN_IMPL(TE_STATUS_CONCAT(_te_statusor_, __LINE__), lhs, expr)

#define TE_ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                             \
  if (!statusor.ok()) return statusor.status();       \
  lhs = std::move(statusor).value()

#endif  // TE_KERNELS_STATUS_MACROS_H_
