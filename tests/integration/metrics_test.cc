// te_server's Prometheus endpoint: a real server with --metrics_port, a few
// calls over gRPC, then a scrape over HTTP parsed by Prometheus's text-format
// rules (server/metrics/text_format_parser).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/metrics/text_format_parser.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/server_fixture.h"

namespace te {
namespace {

// A loopback port that was free a moment ago (the exporter binds it next).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return -1;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(MetricsTest, ScrapeCountsCallsAndSessions) {
  const int metrics_port = FreePort();
  ASSERT_GT(metrics_port, 0);
  te::testing::ServerProcess::Options options;
  options.flags = {absl::StrCat("--metrics_port=", metrics_port), "--metrics_host=127.0.0.1"};
  auto server = te::testing::ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->NewStub();

  te::v1::CreateSessionResponse created;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->CreateSession(&context, te::v1::CreateSessionRequest(), &created).ok());
  }
  for (int i = 0; i < 2; ++i) {  // two failures: a wrong token
    grpc::ClientContext context;
    te::v1::CloseSessionRequest close;
    close.mutable_session()->set_session_id(created.session().session_id());
    close.mutable_session()->set_token("not-the-token");
    te::v1::CloseSessionResponse closed;
    EXPECT_EQ(stub->CloseSession(&context, close, &closed).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  httplib::Client http("127.0.0.1", metrics_port);
  auto scraped = http.Get("/metrics");
  ASSERT_TRUE(scraped) << "no answer from the metrics port";
  ASSERT_EQ(scraped->status, 200);
  auto families = metrics::testing::ParseTextFormat(scraped->body);
  ASSERT_TRUE(families.ok()) << families.status() << "\n" << scraped->body;

  const metrics::testing::ParsedSample* ok_creates = metrics::testing::FindSample(
      *families, "te_rpc_requests_total", {{"method", "CreateSession"}, {"code", "OK"}});
  ASSERT_NE(ok_creates, nullptr) << scraped->body;
  EXPECT_EQ(ok_creates->value, 1);
  const metrics::testing::ParsedSample* denied = metrics::testing::FindSample(
      *families, "te_rpc_requests_total", {{"method", "CloseSession"}, {"code", "UNAUTHENTICATED"}});
  ASSERT_NE(denied, nullptr) << scraped->body;
  EXPECT_EQ(denied->value, 2);
  const metrics::testing::ParsedSample* latency_count = metrics::testing::FindSample(
      *families, "te_rpc_latency_seconds_count", {{"method", "CloseSession"}});
  ASSERT_NE(latency_count, nullptr) << scraped->body;
  EXPECT_EQ(latency_count->value, 2);
  // The gauges are refreshed by the server's housekeeping (every second).
  bool sessions_seen = false;
  for (int attempt = 0; attempt < 30 && !sessions_seen; ++attempt) {
    auto again = http.Get("/metrics");
    ASSERT_TRUE(again);
    auto parsed = metrics::testing::ParseTextFormat(again->body);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const metrics::testing::ParsedSample* open = metrics::testing::FindSample(*parsed, "te_sessions_open", {});
    sessions_seen = open != nullptr && open->value == 1;
    if (!sessions_seen) usleep(200 * 1000);
  }
  EXPECT_TRUE(sessions_seen) << "te_sessions_open never reached 1";
}

}  // namespace
}  // namespace te
