// A gtest fixture for the C++ client's integration tests: one real te_server
// per test suite on a loopback port, and per test a fresh client connection
// and session on it (real gRPC over a real socket).
#ifndef TE_TESTS_INTEGRATION_CLIENT_SESSION_FIXTURE_H_
#define TE_TESTS_INTEGRATION_CLIENT_SESSION_FIXTURE_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"

namespace te::client::testing {

// One real te_server for a whole test suite, for fixtures of any gtest base
// (::testing::Test, ::testing::TestWithParam<T>): a suite that needs server
// flags calls StartSuiteServer(flags) from its own SetUpTestSuite.
template <typename Base = ::testing::Test>
class SuiteServerTest : public Base {
 protected:
  static void StartSuiteServer(std::vector<std::string> flags = {}) {
    te::testing::ServerProcess::Options options;
    options.flags = std::move(flags);
    absl::StatusOr<std::unique_ptr<te::testing::ServerProcess>> server =
        te::testing::ServerProcess::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void SetUpTestSuite() { StartSuiteServer(); }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      absl::Status stopped = server_->Stop();
      EXPECT_TRUE(stopped.ok()) << stopped;
    }
    delete server_;
    server_ = nullptr;
  }

  static inline te::testing::ServerProcess* server_ = nullptr;
};

// The suite's server, and per test a client connection and a session on it.
class ClientSessionTest : public SuiteServerTest<> {
 protected:
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address(), ClientOptions());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    absl::StatusOr<std::unique_ptr<Session>> session = client_->CreateSession(SessionOptions());
    ASSERT_TRUE(session.ok()) << session.status();
    session_ = *std::move(session);
  }

  std::unique_ptr<Client> client_;
  std::unique_ptr<Session> session_;
};

}  // namespace te::client::testing

#endif  // TE_TESTS_INTEGRATION_CLIENT_SESSION_FIXTURE_H_
