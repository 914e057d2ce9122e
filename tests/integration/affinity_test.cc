// Session affinity from the client's side, over real sockets: real
// te_server processes behind a small generic gRPC proxy that stands in for a
// balancer. The proxy forwards every call's bytes unchanged (round robin over
// its backends, as a plain L4 balancer would spread connections) and records
// each call's method and x-te-session header.
//
//  (a) every call of a session carries the session's key, CreateSession and
//      the shared-memory and stream calls included; two sessions, two keys;
//      GetServerInfo none;
//  (b) with --advertise_address set, a session's calls after CreateSession go
//      straight to its replica (the proxy sees no more of them) and work even
//      when the proxy alternates between two replicas; with pinning off they
//      keep going through the proxy;
//  (c) an advertised address where nothing answers: UNAVAILABLE naming it,
//      and no fallback to the proxy.
#include <unistd.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/modules.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/server_fixture.h"
#include "tests/ports.h"

namespace te::testing {
namespace {

using client::Client;
using client::ClientOptions;
using client::HostTensor;
using client::Session;
using client::SessionOptions;
using client::Transport;

constexpr int kMaxMessageBytes = 64 << 20;

// One call as the proxy saw it: the method's short name ("PutTensor") and its
// x-te-session header ("" when absent).
struct ProxiedCall {
  std::string method;
  std::string affinity;
};

// A generic gRPC proxy on a loopback port. Each call is one bidi stream on
// both sides (any of unary, client- or server-streaming fits): messages go
// across one at a time in each direction, and the backend's status comes back
// as the call's. Backends are taken in turn, call by call.
class GrpcProxy {
 public:
  explicit GrpcProxy(const std::vector<std::string>& backends) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    for (const std::string& backend : backends) {
      stubs_.push_back(std::make_unique<grpc::GenericStub>(
          grpc::CreateCustomChannel(backend, grpc::InsecureChannelCredentials(), args)));
    }
    service_.proxy = this;
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
    builder.SetMaxSendMessageSize(kMaxMessageBytes);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
  }
  // Shutting down cancels the calls still open; their backend halves end
  // after that, so the proxy waits for every Call to be freed before its
  // backend channels go.
  ~GrpcProxy() {
    if (server_ != nullptr) server_->Shutdown();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* live) { return *live == 0; }, &live_calls_));
  }

  bool started() const { return server_ != nullptr; }
  const std::string& address() const { return address_; }
  std::vector<ProxiedCall> calls() {
    absl::MutexLock lock(&mu_);
    return calls_;
  }

 private:
  class Call;
  struct Service : grpc::CallbackGenericService {
    grpc::ServerGenericBidiReactor* CreateReactor(
        grpc::GenericCallbackServerContext* context) override;
    GrpcProxy* proxy = nullptr;
  };

  Service service_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::atomic<size_t> next_backend_{0};
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Mutex mu_;
  std::vector<ProxiedCall> calls_ ABSL_GUARDED_BY(mu_);
  int live_calls_ ABSL_GUARDED_BY(mu_) = 0;  // Calls not yet freed
};

// One proxied call: the client's side (Downstream, a server reactor) and the
// backend's side (Upstream, a client reactor). Requests: read downstream,
// write upstream, read again; responses the other way round. Upstream holds
// (AddHold) cover the upstream operations started from downstream reactions.
// Freed when both sides are done.
class GrpcProxy::Call {
 public:
  Call(GrpcProxy* proxy, grpc::GenericCallbackServerContext* context, grpc::GenericStub* stub)
      : proxy_(proxy), context_(context) {
    if (context->deadline() != std::chrono::system_clock::time_point::max()) {
      upstream_context_.set_deadline(context->deadline());
    }
    for (const auto& [key, value] : context->client_metadata()) {
      const std::string name(key.data(), key.size());
      if (name == "user-agent" || absl::StartsWith(name, "grpc-")) continue;
      upstream_context_.AddMetadata(name, std::string(value.data(), value.size()));
    }
    stub->PrepareBidiStreamingCall(&upstream_context_, context->method(), grpc::StubOptions(),
                                   &upstream_);
    upstream_.AddHold();  // the request direction, until the client half-closes
    upstream_.StartRead(&response_);
    upstream_.StartCall();
    downstream_.StartRead(&request_);
  }
  grpc::ServerGenericBidiReactor* reactor() { return &downstream_; }

 private:
  struct Downstream : grpc::ServerGenericBidiReactor {
    explicit Downstream(Call* call) : call(call) {}
    void OnReadDone(bool ok) override {
      if (ok) {
        call->upstream_.StartWrite(&call->request_);
        return;
      }
      call->upstream_.StartWritesDone();
      call->upstream_.RemoveHold();
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        call->upstream_.StartRead(&call->response_);
      } else {
        call->upstream_context_.TryCancel();  // the client has gone
      }
      call->upstream_.RemoveHold();  // taken in Upstream::OnReadDone
    }
    void OnCancel() override { call->upstream_context_.TryCancel(); }
    void OnDone() override { call->Unref(); }
    Call* call;
  };
  struct Upstream : grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
    explicit Upstream(Call* call) : call(call) {}
    void OnWriteDone(bool ok) override {
      if (ok) {
        call->downstream_.StartRead(&call->request_);
      } else {
        RemoveHold();  // the backend ended the call; its status arrives in OnDone
      }
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      AddHold();  // until the client has the response and the next read starts
      call->downstream_.StartWrite(&call->response_);
    }
    void OnDone(const grpc::Status& status) override {
      call->downstream_.Finish(status);
      call->Unref();
    }
    Call* call;
  };

  void Unref() {
    if (refs_.fetch_sub(1) != 1) return;
    GrpcProxy* proxy = proxy_;
    delete this;
    absl::MutexLock lock(&proxy->mu_);
    --proxy->live_calls_;
  }

  GrpcProxy* const proxy_;
  grpc::GenericCallbackServerContext* context_;
  grpc::ClientContext upstream_context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  std::atomic<int> refs_{2};
  Downstream downstream_{this};
  Upstream upstream_{this};
};

grpc::ServerGenericBidiReactor* GrpcProxy::Service::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  ProxiedCall seen;
  seen.method = std::string(absl::StripPrefix(context->method(), "/te.v1.TeService/"));
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find(client::kAffinityHeader); it != metadata.end()) {
    seen.affinity.assign(it->second.data(), it->second.size());
  }
  {
    absl::MutexLock lock(&proxy->mu_);
    proxy->calls_.push_back(seen);
    ++proxy->live_calls_;
  }
  grpc::GenericStub* stub = proxy->stubs_[proxy->next_backend_++ % proxy->stubs_.size()].get();
  return (new Call(proxy, context, stub))->reactor();
}

// A te_server that advertises its own address. Its port must be known before
// it starts, so it is picked here, not by --port=0; another process could
// take it in between, hence a few tries.
absl::StatusOr<std::unique_ptr<ServerProcess>> StartAdvertising(
    std::vector<std::string> flags = {}) {
  absl::Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int port = te::testing::FreeLoopbackPort();
    ServerProcess::Options options;
    options.flags = flags;
    options.flags.push_back(absl::StrCat("--port=", port));  // later flags win over the fixture's
    options.flags.push_back(absl::StrCat("--advertise_address=127.0.0.1:", port));
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(options);
    if (server.ok()) return server;
    last = server.status();
  }
  return last;
}

std::unique_ptr<Client> Connect(const std::string& address, bool pin_to_replica) {
  ClientOptions options;
  options.pin_to_replica = pin_to_replica;
  options.rpc_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(address, options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

std::unique_ptr<Session> Open(Client& client, Transport transport = Transport::kAuto) {
  SessionOptions options;
  options.transport = transport;
  absl::StatusOr<std::unique_ptr<Session>> session = client.CreateSession(options);
  EXPECT_TRUE(session.ok()) << session.status();
  return session.ok() ? *std::move(session) : nullptr;
}

// A Put and a Get of 2 MiB, the bytes compared: the session's tensors work.
absl::Status RoundTrip(Session& session, uint64_t seed) {
  const HostTensor x = HostTensor::RandomNormal({512, 1024}, client::DType::kF32, seed);
  absl::StatusOr<client::ResidentTensor> resident = session.Put(x);
  if (!resident.ok()) return resident.status();
  absl::StatusOr<HostTensor> back = session.Get(resident->id);
  if (!back.ok()) return back.status();
  if (back->bytes() != x.bytes()) return absl::DataLossError("the tensor came back different");
  return session.Delete(resident->id);
}

std::vector<std::string> Methods(const std::vector<ProxiedCall>& calls) {
  std::vector<std::string> methods;
  for (const ProxiedCall& call : calls) methods.push_back(call.method);
  return methods;
}

TEST(AffinityTest, EveryCallOfASessionCarriesOneKey) {
  ServerProcess::Options server_options;
  server_options.flags = {"--enable_shm"};  // so the shared-memory calls are proxied too
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(server_options);
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcProxy proxy({(*server)->address()});
  ASSERT_TRUE(proxy.started());
  std::unique_ptr<Client> client = Connect(proxy.address(), /*pin_to_replica=*/true);
  ASSERT_NE(client, nullptr);

  // Session 1: a layer's init and apply, its 4 MiB x through shared memory.
  std::string first_key;
  {
    std::unique_ptr<Session> session = Open(*client, Transport::kAuto);
    ASSERT_NE(session, nullptr);
    EXPECT_EQ(session->pinned_address(), "");  // the server advertises nothing
    first_key = session->affinity_key();
    client::DenseGeneral layer({256});
    const HostTensor x = HostTensor::RandomNormal({1024, 1024}, client::DType::kF32, 3);
    absl::StatusOr<client::Variables> vars = layer.Init(*session, /*key=*/4, x);
    ASSERT_TRUE(vars.ok()) << vars.status();
    ASSERT_TRUE(layer.Apply(*vars, x).ok());
    EXPECT_GT(session->transport_counts().shm_tensors.load(), 0);
  }
  const size_t first_end = proxy.calls().size();
  // Session 2: the streams.
  std::string second_key;
  {
    std::unique_ptr<Session> session = Open(*client, Transport::kStream);
    ASSERT_NE(session, nullptr);
    second_key = session->affinity_key();
    ASSERT_TRUE(RoundTrip(*session, 5).ok());
  }
  ASSERT_TRUE(client->GetServerInfo().ok());
  const std::vector<ProxiedCall> calls = proxy.calls();

  ASSERT_EQ(first_key.size(), 32u);
  ASSERT_EQ(second_key.size(), 32u);
  EXPECT_NE(first_key, second_key);
  ASSERT_EQ(calls.size(), first_end + 6);
  for (size_t i = 0; i < calls.size(); ++i) {
    const std::string& expected = i < first_end          ? first_key
                                  : i + 1 < calls.size() ? second_key
                                                         : "";
    EXPECT_EQ(calls[i].affinity, expected) << "call " << i << ": " << calls[i].method;
  }
  const std::vector<std::string> methods = Methods(calls);
  const std::set<std::string> first_methods(methods.begin(), methods.begin() + first_end);
  for (const char* method :
       {"CreateSession", "InitLayer", "RegisterSharedMemory", "Forward", "CloseSession"}) {
    EXPECT_EQ(first_methods.count(method), 1u) << method;
  }
  EXPECT_EQ(std::vector<std::string>(methods.begin() + first_end, methods.end()),
            (std::vector<std::string>{"CreateSession", "PutTensor", "GetTensor", "DeleteTensor",
                                      "CloseSession", "GetServerInfo"}));
}

// A key the caller chooses is the one every call of the session carries.
TEST(AffinityTest, AChosenKeyIsTheSessionsKey) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcProxy proxy({(*server)->address()});
  ASSERT_TRUE(proxy.started());
  std::unique_ptr<Client> client = Connect(proxy.address(), /*pin_to_replica=*/true);
  ASSERT_NE(client, nullptr);
  {
    SessionOptions options;
    options.affinity_key = "ct-probe-007";
    options.transport = Transport::kStream;  // no shared-memory registration among the calls
    absl::StatusOr<std::unique_ptr<Session>> session = client->CreateSession(options);
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ((*session)->affinity_key(), "ct-probe-007");
    ASSERT_TRUE(RoundTrip(**session, 6).ok());
  }
  const std::vector<ProxiedCall> calls = proxy.calls();
  ASSERT_EQ(calls.size(), 5u);  // CreateSession, PutTensor, GetTensor, DeleteTensor, CloseSession
  for (const ProxiedCall& call : calls) EXPECT_EQ(call.affinity, "ct-probe-007") << call.method;
}

TEST(AffinityTest, PinnedSessionsBypassABalancerOverTwoReplicas) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> a = StartAdvertising();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::unique_ptr<ServerProcess>> b = StartAdvertising();
  ASSERT_TRUE(b.ok()) << b.status();
  GrpcProxy balancer({(*a)->address(), (*b)->address()});
  ASSERT_TRUE(balancer.started());

  // Pinned: CreateSession alone goes through the balancer; every later call
  // goes to the session's own replica and works.
  std::unique_ptr<Client> client = Connect(balancer.address(), /*pin_to_replica=*/true);
  ASSERT_NE(client, nullptr);
  std::vector<std::unique_ptr<Session>> sessions;
  std::set<std::string> replicas;
  for (int i = 0; i < 4; ++i) {
    sessions.push_back(Open(*client));
    ASSERT_NE(sessions.back(), nullptr);
    replicas.insert(sessions.back()->pinned_address());
  }
  EXPECT_EQ(replicas, (std::set<std::string>{(*a)->address(), (*b)->address()}));
  ASSERT_EQ(balancer.calls().size(), 4u);
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_TRUE(RoundTrip(*sessions[i], 10 + i).ok()) << "session " << i;
    EXPECT_TRUE(sessions[i]->Close().ok()) << "session " << i;
  }
  EXPECT_EQ(Methods(balancer.calls()), std::vector<std::string>(4, "CreateSession"));

  // Not pinned, behind the same balancer: the session's next call lands on
  // the other replica, which does not know it. This is what pinning is for.
  std::unique_ptr<Client> unpinned = Connect(balancer.address(), /*pin_to_replica=*/false);
  ASSERT_NE(unpinned, nullptr);
  std::unique_ptr<Session> stray = Open(*unpinned, Transport::kStream);
  ASSERT_NE(stray, nullptr);
  EXPECT_EQ(stray->pinned_address(), "");
  EXPECT_EQ(RoundTrip(*stray, 20).code(), absl::StatusCode::kNotFound);
  EXPECT_GT(balancer.calls().size(), 5u);
}

TEST(AffinityTest, WithoutPinningCallsKeepGoingThroughTheProxy) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = StartAdvertising();
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcProxy proxy({(*server)->address()});
  ASSERT_TRUE(proxy.started());
  std::unique_ptr<Client> client = Connect(proxy.address(), /*pin_to_replica=*/false);
  ASSERT_NE(client, nullptr);
  std::unique_ptr<Session> session = Open(*client, Transport::kStream);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->pinned_address(), "");
  ASSERT_TRUE(RoundTrip(*session, 30).ok());
  EXPECT_EQ(Methods(proxy.calls()),
            (std::vector<std::string>{"CreateSession", "PutTensor", "GetTensor", "DeleteTensor"}));
}

TEST(AffinityTest, UnreachablePinnedReplicaIsUnavailableAndNamed) {
  const std::string nowhere = absl::StrCat("127.0.0.1:", te::testing::FreeLoopbackPort());
  ServerProcess::Options options;
  options.flags = {"--advertise_address=" + nowhere};
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  GrpcProxy proxy({(*server)->address()});
  ASSERT_TRUE(proxy.started());
  std::unique_ptr<Client> client = Connect(proxy.address(), /*pin_to_replica=*/true);
  ASSERT_NE(client, nullptr);
  std::unique_ptr<Session> session = Open(*client, Transport::kStream);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->pinned_address(), nowhere);

  const absl::Status status = RoundTrip(*session, 40);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find(nowhere), absl::string_view::npos) << status;
  // No silent fallback: the proxy saw CreateSession only.
  EXPECT_EQ(Methods(proxy.calls()), std::vector<std::string>{"CreateSession"});
}

}  // namespace
}  // namespace te::testing
