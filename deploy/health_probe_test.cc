// The probe against a real in-process gRPC server with gRPC's default health
// service, over loopback: plaintext, and mutual TLS with certificates made by
// openssl at test time.
#include "deploy/health_probe.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace te::deploy {
namespace {

constexpr char kService[] = "te.v1.TeService";

// A server with nothing but the default health service.
class HealthServer {
 public:
  explicit HealthServer(
      std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials()) {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", credentials, &port_);
    server_ = builder.BuildAndStart();
  }
  ~HealthServer() {
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  void Set(const std::string& service, bool serving) {
    server_->GetHealthCheckService()->SetServingStatus(service, serving);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  void Stop() {
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
    server_.reset();
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

ProbeOptions At(const std::string& address, const std::string& service = "") {
  ProbeOptions options;
  options.address = address;
  options.service = service;
  options.connect_timeout = absl::Seconds(3);
  options.rpc_timeout = absl::Seconds(3);
  return options;
}

TEST(HealthProbeTest, ServingAndNotServing) {
  HealthServer server;
  ASSERT_TRUE(server.ok());
  server.Set(kService, true);
  EXPECT_EQ(Probe(At(server.address())).result, ProbeResult::kServing);
  ProbeOutcome outcome = Probe(At(server.address(), kService));
  EXPECT_EQ(outcome.result, ProbeResult::kServing) << outcome.message;
  EXPECT_TRUE(absl::StrContains(outcome.message, "SERVING")) << outcome.message;

  server.Set(kService, false);
  outcome = Probe(At(server.address(), kService));
  EXPECT_EQ(outcome.result, ProbeResult::kNotServing) << outcome.message;
  EXPECT_TRUE(absl::StrContains(outcome.message, "NOT_SERVING")) << outcome.message;
  server.Set("", false);
  EXPECT_EQ(Probe(At(server.address())).result, ProbeResult::kNotServing);
}

TEST(HealthProbeTest, AnUnknownServiceIsAFailedCheck) {
  HealthServer server;
  ASSERT_TRUE(server.ok());
  const ProbeOutcome outcome = Probe(At(server.address(), "no.such.Service"));
  EXPECT_EQ(outcome.result, ProbeResult::kRpcFailed) << outcome.message;
  EXPECT_TRUE(absl::StrContains(outcome.message, "code 5")) << outcome.message;  // NOT_FOUND
}

TEST(HealthProbeTest, NoServerIsAConnectFailureWithinTheTimeout) {
  std::string address;
  {
    HealthServer server;  // a port that was just free, now closed
    ASSERT_TRUE(server.ok());
    address = server.address();
    server.Stop();
  }
  ProbeOptions options = At(address);
  options.connect_timeout = absl::Milliseconds(500);
  const absl::Time start = absl::Now();
  const ProbeOutcome outcome = Probe(options);
  EXPECT_EQ(outcome.result, ProbeResult::kConnectFailed) << outcome.message;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(HealthProbeTest, BadTlsArguments) {
  ProbeOptions options = At("127.0.0.1:1");
  options.tls_cert_file = "/dev/null";  // a certificate without its key
  EXPECT_EQ(Probe(options).result, ProbeResult::kBadArguments);
  options = At("127.0.0.1:1");
  options.tls_ca_file = "/no/such/ca.pem";
  const ProbeOutcome outcome = Probe(options);
  EXPECT_EQ(outcome.result, ProbeResult::kBadArguments);
  EXPECT_TRUE(absl::StrContains(outcome.message, "/no/such/ca.pem")) << outcome.message;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// Certificates made with openssl: a CA, a server certificate for
// "te-server.test" and a client certificate, both signed by it; and a second,
// unrelated CA.
class MutualTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TEST_TMPDIR");
    dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/health_probe_tls");
    const std::string script = absl::StrCat(
        "set -e; rm -rf ", dir_, "; mkdir -p ", dir_, "; cd ", dir_, "\n",
        "ca() { openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj \"/CN=$1\" "
        "-keyout $1.key -out $1.pem 2>/dev/null; }\n",
        "leaf() { openssl req -newkey rsa:2048 -nodes -subj \"/CN=$1\" -keyout $1.key "
        "-out $1.csr 2>/dev/null; printf 'subjectAltName=DNS:%s\\n' $1 > $1.ext; "
        "openssl x509 -req -in $1.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile $1.ext -out $1.pem 2>/dev/null; }\n",
        "ca ca; ca other_ca; leaf te-server.test; leaf client.test\n");
    ASSERT_EQ(std::system(absl::StrCat("bash -c '", EscapeQuotes(script), "'").c_str()), 0);
  }

  static std::string EscapeQuotes(const std::string& text) {
    std::string out;
    for (char c : text) {
      if (c == '\'') {
        out += "'\\''";
      } else {
        out.push_back(c);
      }
    }
    return out;
  }

  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }

  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const {
    grpc::SslServerCredentialsOptions options(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    options.pem_root_certs = ReadAll(Path("ca.pem"));
    options.pem_key_cert_pairs.push_back(
        {ReadAll(Path("te-server.test.key")), ReadAll(Path("te-server.test.pem"))});
    return grpc::SslServerCredentials(options);
  }

  ProbeOptions Tls(const std::string& address, const std::string& ca) const {
    ProbeOptions options = At(address);
    options.tls_ca_file = Path(ca);
    options.tls_cert_file = Path("client.test.pem");
    options.tls_key_file = Path("client.test.key");
    options.tls_server_name = "te-server.test";
    return options;
  }

  std::string dir_;
};

TEST_F(MutualTlsTest, OnlyTheRightCaAndAClientCertificateGetAnAnswer) {
  HealthServer server(ServerCredentials());
  ASSERT_TRUE(server.ok());

  ProbeOutcome outcome = Probe(Tls(server.address(), "ca.pem"));
  EXPECT_EQ(outcome.result, ProbeResult::kServing) << outcome.message;

  ProbeOptions plaintext = At(server.address());
  plaintext.connect_timeout = absl::Seconds(1);
  EXPECT_NE(Probe(plaintext).result, ProbeResult::kServing);

  ProbeOptions wrong_ca = Tls(server.address(), "other_ca.pem");
  wrong_ca.connect_timeout = absl::Seconds(1);
  EXPECT_NE(Probe(wrong_ca).result, ProbeResult::kServing);

  ProbeOptions no_client_certificate = Tls(server.address(), "ca.pem");
  no_client_certificate.tls_cert_file.clear();
  no_client_certificate.tls_key_file.clear();
  no_client_certificate.connect_timeout = absl::Seconds(1);
  EXPECT_NE(Probe(no_client_certificate).result, ProbeResult::kServing);

  ProbeOptions wrong_name = Tls(server.address(), "ca.pem");
  wrong_name.tls_server_name = "someone-else.test";
  wrong_name.connect_timeout = absl::Seconds(1);
  EXPECT_NE(Probe(wrong_name).result, ProbeResult::kServing);
}

}  // namespace
}  // namespace te::deploy
