// te_server's Prometheus endpoint: a real server with --metrics_port, real
// gRPC calls (failed ones, a unary Forward of 0.4 MB, FP8 steps with an
// infinite amax, a PutTensor and a GetTensor stream), then one scrape linted by `promtool check metrics` and a
// real Prometheus scraping the endpoint, whose query API must show what the
// calls did (tests/metrics/prometheus_fixture.h). Needs Debian's prometheus
// package; without it the test fails.
#include <httplib.h>
#include <unistd.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/metrics/prometheus_fixture.h"
#include "tests/server_fixture.h"
#include "tests/ports.h"

namespace te {
namespace {

using testing::PrometheusServer;

std::function<bool(double)> Equals(double want) {
  return [want](double v) { return v == want; };
}

// At least `least`, and over it by no more than a message's worth of slack
// (calls the test did not make are none of these methods').
std::function<bool(double)> AtLeast(double least) {
  return [least](double v) { return v >= least && v < least + 1024; };
}

TEST(MetricsTest, PrometheusScrapesCallsBytesAndSessions) {
  const int metrics_port = te::testing::FreeLoopbackPort();
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
  const te::v1::SessionRef& session = created.session();
  for (int i = 0; i < 2; ++i) {  // two failures: a wrong token
    grpc::ClientContext context;
    te::v1::CloseSessionRequest close;
    close.mutable_session()->set_session_id(session.session_id());
    close.mutable_session()->set_token("not-the-token");
    te::v1::CloseSessionResponse closed;
    EXPECT_EQ(stub->CloseSession(&context, close, &closed).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }

  // A unary Forward whose x is 0.4 MB inline: its request and response bytes
  // must both be counted.
  constexpr int64_t kRows = 1000, kIn = 100, kOut = 64;
  te::v1::InitLayerRequest init;
  *init.mutable_session() = session;
  init.mutable_spec()->mutable_dense_general()->add_features(kOut);
  init.set_input_dtype(te::v1::FLOAT32);
  init.add_input_shape(kRows);
  init.add_input_shape(kIn);
  te::v1::InitLayerResponse layer;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->InitLayer(&context, init, &layer);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  te::v1::ForwardRequest forward;
  *forward.mutable_session() = session;
  forward.set_layer_id(layer.layer_id());
  forward.set_deterministic(true);
  forward.mutable_x()->set_dtype(te::v1::FLOAT32);
  forward.mutable_x()->add_shape(kRows);
  forward.mutable_x()->add_shape(kIn);
  forward.mutable_x()->set_inline_data(std::string(kRows * kIn * 4, '\0'));
  te::v1::ForwardResponse y;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->Forward(&context, forward, &y);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_GE(forward.ByteSizeLong(), 400000u);
  ASSERT_GE(y.ByteSizeLong(), static_cast<size_t>(kRows * kOut * 4));

  // FP8 steps (DelayedScaling, a history of one) whose first x holds an inf:
  // that step's x quantizer takes an infinite amax and keeps its scale, once;
  // its kernel and gradient amaxes, and the second step's, are finite.
  te::v1::Autocast fp8;
  fp8.set_enabled(true);
  fp8.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(1);
  te::v1::InitLayerRequest fp8_init;
  *fp8_init.mutable_session() = session;
  fp8_init.mutable_spec()->mutable_dense_general()->add_features(16);
  fp8_init.set_input_dtype(te::v1::FLOAT32);
  fp8_init.add_input_shape(16);
  fp8_init.add_input_shape(16);
  *fp8_init.mutable_autocast() = fp8;
  te::v1::InitLayerResponse fp8_layer;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->InitLayer(&context, fp8_init, &fp8_layer);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  te::v1::ForwardBackwardRequest steps;
  *steps.mutable_session() = session;
  steps.set_layer_id(fp8_layer.layer_id());
  steps.set_deterministic(true);
  *steps.mutable_autocast() = fp8;
  for (int i = 0; i < 2; ++i) {
    std::vector<float> x(16 * 16, 0.25f), dy(16 * 16, 0.5f);
    if (i == 0) x[37] = std::numeric_limits<float>::infinity();
    te::v1::MicroBatch* mb = steps.add_micro_batches();
    for (auto [tensor, values] : {std::pair{mb->mutable_x(), &x}, std::pair{mb->mutable_dy(), &dy}}) {
      tensor->set_dtype(te::v1::FLOAT32);
      tensor->add_shape(16);
      tensor->add_shape(16);
      tensor->set_inline_data(values->data(), values->size() * sizeof(float));
    }
  }
  te::v1::ForwardBackwardResponse stepped;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub->ForwardBackward(&context, steps, &stepped);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }

  // A tensor up in two data chunks, and down again.
  size_t put_bytes = 0;
  te::v1::PutTensorResponse put;
  {
    grpc::ClientContext context;
    auto writer = stub->PutTensor(&context, &put);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(2 * 65536);
    ASSERT_TRUE(writer->Write(header));
    put_bytes += header.ByteSizeLong();
    for (int i = 0; i < 2; ++i) {
      te::v1::PutTensorChunk data;
      data.set_data(std::string(65536 * 4, static_cast<char>(i)));
      ASSERT_TRUE(writer->Write(data));
      put_bytes += data.ByteSizeLong();
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  size_t get_bytes = 0;
  te::v1::GetTensorRequest get;
  *get.mutable_session() = session;
  get.set_tensor_id(put.tensor_id());
  get.set_chunk_bytes(65536);
  {
    grpc::ClientContext context;
    auto reader = stub->GetTensor(&context, get);
    te::v1::TensorChunk chunk;
    while (reader->Read(&chunk)) get_bytes += chunk.ByteSizeLong();
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  ASSERT_GT(get_bytes, 2u * 65536 * 4);

  // One scrape, through promtool's lint.
  httplib::Client http("127.0.0.1", metrics_port);
  auto scraped = http.Get("/metrics");
  ASSERT_TRUE(scraped) << "no answer from the metrics port";
  ASSERT_EQ(scraped->status, 200);
  const absl::Status lint = testing::PromtoolCheckMetrics(scraped->body);
  EXPECT_TRUE(lint.ok()) << lint << "\n" << scraped->body;

  // A real Prometheus scraping the endpoint every second.
  auto prometheus = PrometheusServer::Start({absl::StrCat("127.0.0.1:", metrics_port)});
  ASSERT_TRUE(prometheus.ok()) << prometheus.status();
  const PrometheusServer& prom = **prometheus;
  struct Expectation {
    std::string expr;
    std::function<bool(double)> accept;
    std::string what;
  };
  const std::vector<Expectation> expectations = {
      {"up{job=\"te_server\"}", Equals(1), "1"},
      {"te_rpc_requests_total{method=\"CreateSession\",code=\"OK\"}", Equals(1), "1"},
      {"te_rpc_requests_total{method=\"CloseSession\",code=\"UNAUTHENTICATED\"}", Equals(2), "2"},
      {"te_rpc_latency_seconds_count{method=\"CloseSession\"}", Equals(2), "2"},
      {"te_rpc_latency_seconds_bucket{method=\"CloseSession\",le=\"+Inf\"}", Equals(2), "2"},
      {"te_rpc_requests_total{method=\"Forward\",code=\"OK\"}", Equals(1), "1"},
      {"te_rpc_requests_total{method=\"ForwardBackward\",code=\"OK\"}", Equals(1), "1"},
      // Published by the housekeeping thread, from the steps' read-backs.
      {"te_fp8_amax_overflows_total", Equals(1), "1"},
      // The housekeeping thread refreshes the gauges every second.
      {"te_sessions_open", Equals(1), "1"},
      {"te_device_memory_total_bytes{device=\"cpu\"}", [](double v) { return v > 0; }, "> 0"},
      {"te_rpc_received_bytes_total{method=\"Forward\"}", AtLeast(forward.ByteSizeLong()),
       absl::StrCat(">= ", forward.ByteSizeLong())},
      {"te_rpc_sent_bytes_total{method=\"Forward\"}", AtLeast(y.ByteSizeLong()),
       absl::StrCat(">= ", y.ByteSizeLong())},
      {"te_rpc_received_bytes_total{method=\"InitLayer\"}", AtLeast(init.ByteSizeLong()),
       absl::StrCat(">= ", init.ByteSizeLong())},
      {"te_rpc_received_bytes_total{method=\"PutTensor\"}", AtLeast(put_bytes),
       absl::StrCat(">= ", put_bytes)},
      {"te_rpc_sent_bytes_total{method=\"PutTensor\"}", AtLeast(put.ByteSizeLong()),
       absl::StrCat(">= ", put.ByteSizeLong())},
      {"te_rpc_received_bytes_total{method=\"GetTensor\"}", AtLeast(get.ByteSizeLong()),
       absl::StrCat(">= ", get.ByteSizeLong())},
      {"te_rpc_sent_bytes_total{method=\"GetTensor\"}", AtLeast(get_bytes),
       absl::StrCat(">= ", get_bytes)},
  };
  for (const Expectation& e : expectations) {
    absl::StatusOr<double> value = prom.WaitFor(e.expr, e.accept);
    EXPECT_TRUE(value.ok()) << e.expr << " should be " << e.what << ": " << value.status() << "\n"
                            << prom.LogTail();
  }
  // Only te.v1.TeService's methods carry byte counters (health checks do not).
  absl::StatusOr<std::vector<testing::PromSample>> methods =
      prom.Query("te_rpc_received_bytes_total");
  ASSERT_TRUE(methods.ok()) << methods.status();
  for (const testing::PromSample& sample : *methods) {
    EXPECT_NE(sample.labels.at("method"), "Check");
    EXPECT_NE(sample.labels.at("method"), "Watch");
  }
  absl::StatusOr<std::vector<std::string>> errors = prom.ScrapeErrors();
  ASSERT_TRUE(errors.ok()) << errors.status();
  EXPECT_TRUE(errors->empty()) << errors->front();
}

}  // namespace
}  // namespace te
