// Helpers for the integration tests: request tensors from host values and
// back, host references, and session bookkeeping over a real stub.
#ifndef TE_TESTS_INTEGRATION_TEST_UTIL_H_
#define TE_TESTS_INTEGRATION_TEST_UTIL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/server_fixture.h"

namespace te::testing {

// Tolerances, relative (||got - want|| / ||want||), stated once: float32
// results against a float64 host reference, and bfloat16 results (8 bits of
// mantissa, float32 accumulation) against the same.
inline constexpr double kF32Tolerance = 1e-5;
inline constexpr double kBf16Tolerance = 1e-2;

// Normal(0, scale) values, deterministic in `seed`.
std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.0f);

// A float tensor (FLOAT32, BFLOAT16 or FLOAT16) holding `values` rounded to
// its dtype, inline.
te::v1::Tensor MakeTensor(te::v1::DType dtype, const std::vector<int64_t>& shape,
                          const std::vector<float>& values);
// The values of an inline float tensor.
std::vector<float> ToFloats(const te::v1::Tensor& tensor);
// The values `MakeTensor` stores (rounded to the dtype).
std::vector<float> Rounded(te::v1::DType dtype, const std::vector<float>& values);

te::v1::Tensor ResidentRef(const std::string& id);
std::vector<int64_t> ShapeOf(const te::v1::Tensor& tensor);

double RelativeError(const std::vector<float>& got, const std::vector<double>& want);
double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

// Creates a session (ADD_FAILURE on error: the ref is then empty).
te::v1::CreateSessionResponse CreateSession(te::v1::TeService::Stub& stub,
                                            const te::v1::CreateSessionRequest& request = {});

// Every variable of a layer, "collection/path" -> the Tensor as returned.
std::map<std::string, te::v1::Tensor> GetAllVariables(te::v1::TeService::Stub& stub,
                                                      const te::v1::SessionRef& session,
                                                      const std::string& layer_id);

// "CODE: message", for failure output.
std::string Describe(const grpc::Status& status);

// grpc.health.v1.Health/Check for `service` ("" is the whole server) through a
// generic stub, with a 10 s deadline: the status (1 SERVING, 2 NOT_SERVING,
// 0 UNKNOWN), -1 when the call fails, -2 for a response it cannot read.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& service);

// A test suite sharing one te_server (CPU, loopback) across its tests; each
// test gets a stub and a fresh session, closed afterwards.
class ServerSuite : public ::testing::Test {
 protected:
  // The shared server's flags (besides the fixture's own).
  static std::vector<std::string> SuiteFlags() {
    return {"--max_saved_forwards=4", "--session_memory_bytes=1073741824"};
  }
  static void SetUpTestSuite();
  static void TearDownTestSuite();
  void SetUp() override;
  void TearDown() override;

  // Builds a request's session reference.
  template <typename Request>
  Request WithSession(Request request) const {
    *request.mutable_session() = session_;
    return request;
  }

  // Closes the test's session and continues with `session` instead.
  void UseSession(const te::v1::SessionRef& session);

  static ServerProcess* server_;
  static std::string* start_error_;
  std::unique_ptr<te::v1::TeService::Stub> stub_;
  te::v1::SessionRef session_;
};

}  // namespace te::testing

#endif  // TE_TESTS_INTEGRATION_TEST_UTIL_H_
