// ServerCredentialsFor's checks, on certificates openssl makes for the test.
// The handshakes themselves are tested against the real server in
// tests/integration/tls_test.cc.
#include "server/security/tls.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/tls/test_certs.h"

namespace te::security {
namespace {

class TlsCredentialsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<testing::TestCerts> certs = testing::MakeTestCerts();
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = new testing::TestCerts(*certs);
  }
  static void TearDownTestSuite() { delete certs_; }
  static testing::TestCerts* certs_;
};
testing::TestCerts* TlsCredentialsTest::certs_ = nullptr;

TEST_F(TlsCredentialsTest, NoFilesIsPlaintext) {
  TlsFiles files;
  EXPECT_FALSE(files.enabled());
  EXPECT_TRUE(ServerCredentialsFor(files).ok());
  EXPECT_EQ(DescribeTransport(files), "plaintext");
}

TEST_F(TlsCredentialsTest, CertificateAndKeyGiveTls) {
  TlsFiles files{certs_->Path("server.pem"), certs_->Path("server.key"), ""};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFor(files);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  EXPECT_NE(*credentials, nullptr);
  EXPECT_EQ(DescribeTransport(files), "TLS");
}

TEST_F(TlsCredentialsTest, ClientCaGivesMutualTls) {
  TlsFiles files{certs_->Path("server.pem"), certs_->Path("server.key"), certs_->Path("ca.pem")};
  EXPECT_TRUE(ServerCredentialsFor(files).ok());
  EXPECT_NE(DescribeTransport(files).find("mutual TLS"), std::string::npos);
}

TEST_F(TlsCredentialsTest, HalfAPairIsInvalid) {
  EXPECT_EQ(ServerCredentialsFor({certs_->Path("server.pem"), "", ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentialsFor({"", certs_->Path("server.key"), ""}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerCredentialsFor({"", "", certs_->Path("ca.pem")}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TlsCredentialsTest, UnreadableFileNamesTheFlag) {
  absl::Status status =
      ServerCredentialsFor({"/no/such/cert.pem", certs_->Path("server.key"), ""}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("--tls_cert=/no/such/cert.pem"), std::string::npos);
}

TEST_F(TlsCredentialsTest, KeyOfAnotherCertificateIsRefused) {
  absl::Status status =
      ServerCredentialsFor({certs_->Path("server.pem"), certs_->Path("client.key"), ""}).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("does not match"), std::string::npos);
}

TEST_F(TlsCredentialsTest, NonPemIsRefused) {
  // A key where the certificate should be, and a certificate as the client CA's key.
  EXPECT_EQ(ServerCredentialsFor({certs_->Path("server.key"), certs_->Path("server.key"), ""})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ServerCredentialsFor({certs_->Path("server.pem"), certs_->Path("server.key"),
                                  certs_->Path("client.key")})
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace te::security
