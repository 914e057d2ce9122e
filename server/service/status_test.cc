#include "server/service/status.h"

#include "gtest/gtest.h"

namespace te::service {
namespace {

TEST(ToGrpcStatus, KeepsEveryCodeAndTheMessage) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status status(static_cast<absl::StatusCode>(code), "x.shape[1]: negative");
    const grpc::Status mapped = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(mapped.error_code()), code);
    EXPECT_EQ(mapped.error_message(), "x.shape[1]: negative");
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatus(absl::Status(static_cast<absl::StatusCode>(99), "odd")).error_code(),
            grpc::StatusCode::UNKNOWN);
}

}  // namespace
}  // namespace te::service
