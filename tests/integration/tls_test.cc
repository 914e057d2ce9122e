// TLS, mutual TLS and the access key against the real te_server, with
// certificates openssl makes for the run (tests/tls/make_certs.sh): a
// plaintext client or one trusting another CA cannot talk to a TLS server; a
// client with the right CA can; under mutual TLS a client needs a certificate
// the server's client CA signed; CreateSession needs the access key.
#include <grpcpp/grpcpp.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/server_fixture.h"
#include "tests/tls/test_certs.h"

namespace te::testing {
namespace {

constexpr char kAccessKey[] = "a test access key, 32 bytes long";

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<TestCerts> certs = MakeTestCerts();
    ASSERT_TRUE(certs.ok()) << certs.status();
    certs_ = new TestCerts(*certs);
  }
  static void TearDownTestSuite() { delete certs_; }

  // TLS credentials trusting `ca`, with a client certificate when `client` names one.
  static std::shared_ptr<grpc::ChannelCredentials> Tls(const std::string& ca,
                                                       const std::string& client = "") {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = certs_->Read(ca + ".pem");
    if (!client.empty()) {
      options.pem_cert_chain = certs_->Read(client + ".pem");
      options.pem_private_key = certs_->Read(client + ".key");
    }
    return grpc::SslCredentials(options);
  }

  static std::unique_ptr<ServerProcess> StartServer(
      std::vector<std::string> flags, std::shared_ptr<grpc::ChannelCredentials> credentials) {
    ServerProcess::Options options;
    options.flags = std::move(flags);
    options.channel_credentials = std::move(credentials);
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  std::vector<std::string> TlsFlags() const {
    return {"--tls_cert=" + certs_->Path("server.pem"), "--tls_key=" + certs_->Path("server.key")};
  }

  // GetServerInfo over a fresh channel with `credentials`.
  static grpc::Status Probe(const ServerProcess& server,
                            std::shared_ptr<grpc::ChannelCredentials> credentials) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a connection of its own
    auto stub =
        te::v1::TeService::NewStub(grpc::CreateCustomChannel(server.address(), credentials, args));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    te::v1::ServerInfo info;
    return stub->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
  }

  static TestCerts* certs_;
};
TestCerts* TlsTest::certs_ = nullptr;

TEST_F(TlsTest, OnlyAClientTrustingTheServersCaConnects) {
  std::unique_ptr<ServerProcess> server = StartServer(TlsFlags(), Tls("ca"));
  ASSERT_NE(server, nullptr);
  grpc::Status right = Probe(*server, Tls("ca"));
  EXPECT_TRUE(right.ok()) << right.error_message();
  grpc::Status plaintext = Probe(*server, grpc::InsecureChannelCredentials());
  EXPECT_EQ(plaintext.error_code(), grpc::StatusCode::UNAVAILABLE) << plaintext.error_message();
  grpc::Status wrong_ca = Probe(*server, Tls("other_ca"));
  EXPECT_EQ(wrong_ca.error_code(), grpc::StatusCode::UNAVAILABLE) << wrong_ca.error_message();
  // Without a client CA the server asks for no client certificate, and takes one in stride.
  EXPECT_TRUE(Probe(*server, Tls("ca", "client")).ok());
  EXPECT_TRUE(server->Stop().ok());
}

TEST_F(TlsTest, MutualTlsRequiresAClientCertificateFromTheClientCa) {
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca=" + certs_->Path("ca.pem"));
  std::unique_ptr<ServerProcess> server = StartServer(flags, Tls("ca", "client"));
  ASSERT_NE(server, nullptr);
  grpc::Status with_certificate = Probe(*server, Tls("ca", "client"));
  EXPECT_TRUE(with_certificate.ok()) << with_certificate.error_message();
  grpc::Status without = Probe(*server, Tls("ca"));
  EXPECT_EQ(without.error_code(), grpc::StatusCode::UNAVAILABLE) << without.error_message();
  grpc::Status other_ca_client = Probe(*server, Tls("ca", "other_client"));
  EXPECT_EQ(other_ca_client.error_code(), grpc::StatusCode::UNAVAILABLE)
      << other_ca_client.error_message();
  grpc::Status plaintext = Probe(*server, grpc::InsecureChannelCredentials());
  EXPECT_EQ(plaintext.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(server->Stop().ok());
}

TEST_F(TlsTest, BadCredentialsStopTheServerAtStart) {
  ServerProcess::Options options;
  options.flags = {"--tls_cert=" + certs_->Path("server.pem"),
                   "--tls_key=" + certs_->Path("client.key")};  // not the certificate's key
  options.startup_timeout = absl::Seconds(20);
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("exit status 2"), std::string::npos) << server.status();
}

TEST_F(TlsTest, CreateSessionNeedsTheAccessKeyAndEchoesTheAddress) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string key_file = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/access_key");
  std::ofstream(key_file) << kAccessKey << "\n";
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--access_key_file=" + key_file);
  flags.push_back("--advertise_address=te-server-0.te-server:50051");
  std::unique_ptr<ServerProcess> server = StartServer(flags, Tls("ca"));
  ASSERT_NE(server, nullptr);
  auto stub = server->NewStub();
  auto create = [&](const std::string& key, te::v1::CreateSessionResponse* response) {
    te::v1::CreateSessionRequest request;
    request.set_access_key(key);
    grpc::ClientContext context;
    return stub->CreateSession(&context, request, response);
  };
  te::v1::CreateSessionResponse response;
  EXPECT_EQ(create("", &response).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(create("a test access key, 32 bytes lonG", &response).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  grpc::Status right = create(kAccessKey, &response);
  ASSERT_TRUE(right.ok()) << right.error_message();
  EXPECT_EQ(response.server_address(), "te-server-0.te-server:50051");
  EXPECT_EQ(response.session().session_id().size(), 32u);
  // The session's own calls need its token, not the key.
  grpc::ClientContext context;
  te::v1::CloseSessionRequest close;
  *close.mutable_session() = response.session();
  te::v1::CloseSessionResponse closed;
  EXPECT_TRUE(stub->CloseSession(&context, close, &closed).ok());
  EXPECT_TRUE(server->Stop().ok());
}

TEST_F(TlsTest, ClientLibraryConnectsWithMutualTlsAndTheAccessKey) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string key_file = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/client_access_key");
  std::ofstream(key_file) << kAccessKey;
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca=" + certs_->Path("ca.pem"));
  flags.push_back("--access_key_file=" + key_file);
  std::unique_ptr<ServerProcess> server = StartServer(flags, Tls("ca", "client"));
  ASSERT_NE(server, nullptr);

  client::ClientOptions options;
  options.connect_timeout = absl::Seconds(5);
  options.tls_root_ca_file = certs_->Path("ca.pem");
  options.tls_cert_file = certs_->Path("client.pem");
  options.tls_key_file = certs_->Path("client.key");
  options.access_key = kAccessKey;
  absl::StatusOr<std::unique_ptr<client::Client>> client =
      client::Client::Connect(server->address(), options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::unique_ptr<client::Session>> session = (*client)->CreateSession({});
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE((*session)->Close().ok());

  client::ClientOptions no_key = options;
  no_key.access_key.clear();
  client = client::Client::Connect(server->address(), no_key);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->CreateSession({}).status().code(), absl::StatusCode::kUnauthenticated);

  client::ClientOptions wrong_ca = options;
  wrong_ca.tls_root_ca_file = certs_->Path("other_ca.pem");
  EXPECT_EQ(client::Client::Connect(server->address(), wrong_ca).status().code(),
            absl::StatusCode::kUnavailable);
  client::ClientOptions no_certificate = options;
  no_certificate.tls_cert_file.clear();
  no_certificate.tls_key_file.clear();
  EXPECT_EQ(client::Client::Connect(server->address(), no_certificate).status().code(),
            absl::StatusCode::kUnavailable);
  client::ClientOptions half = options;
  half.tls_key_file.clear();
  EXPECT_EQ(client::Client::Connect(server->address(), half).status().code(),
            absl::StatusCode::kInvalidArgument);
  client::ClientOptions missing = options;
  missing.tls_root_ca_file = "/no/such/ca.pem";
  EXPECT_EQ(client::Client::Connect(server->address(), missing).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(server->Stop().ok());
}

}  // namespace
}  // namespace te::testing
