// te_client: the C++ client of te_server, shaped like TE's JAX quickstart.
//
//   auto client = Client::Connect("localhost:50051").value();
//   auto session = client->CreateSession({{DelayedScaling{}}}).value();
//   TransformerLayer layer;                        // client/modules.h
//   Autocast autocast(true, DelayedScaling{});     // client/recipe.h
//   Variables vars = layer.Init(*session, /*key=*/42, x).value();
//   HostTensor y = layer.Apply(vars, x).value();
//
// A Client is a connection; it is thread-safe. A Session is one server-side
// session (parameters, FP8 state, resident tensors); its methods are
// thread-safe, and the server runs one session's calls one at a time, in the
// order the Session numbers them ("Call order", at class Session). Every
// error is an absl::Status carrying the server's code and message unchanged
// (the transport's own failures arrive as UNAVAILABLE or DEADLINE_EXCEEDED).
// Companion headers: tensor.h (HostTensor), recipe.h (recipes, Autocast),
// modules.h (the modules), graph.h (composites), speedometer.h.
#ifndef TE_CLIENT_CLIENT_H_
#define TE_CLIENT_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/recipe.h"
#include "client/tensor.h"
#include "client/transport.h"
#include "grpcpp/security/credentials.h"
#include "te/v1/service.grpc.pb.h"

namespace te::client {

struct ClientOptions {
  // Transport. Tensors up to inline_tensor_bytes travel inside the request;
  // larger ones through the PutTensor / GetTensor streams in chunk_bytes
  // pieces (the API allows 1-4 MiB), so no message nears the limit.
  int max_message_bytes = 64 << 20;
  size_t inline_tensor_bytes = 1 << 20;
  size_t chunk_bytes = 1 << 20;
  // Which way tensors go (transport.h): kAuto picks inline, shared memory
  // (same host, server started with --enable_shm) or streams by size and
  // locality; the others force one. Shared-memory regions are made in pieces
  // of at least shm_region_bytes.
  Transport transport = Transport::kAuto;
  size_t shm_region_bytes = 64 << 20;

  // Deadlines: Connect waits connect_timeout for the channel (a refused
  // connection fails at once); every RPC gets rpc_timeout, so a server that
  // stops answering fails the call with DEADLINE_EXCEEDED within minutes (a
  // forward + backward of the full quickstart layer on a CPU server takes
  // longer: raise it there).
  absl::Duration connect_timeout = absl::Seconds(10);
  absl::Duration rpc_timeout = absl::Minutes(5);

  // Security (te_server's --tls_cert, --tls_client_ca, --access_key_file).
  // TLS when tls_root_ca_file is set: the PEM CA bundle that signed the
  // server's certificate. Mutual TLS when tls_cert_file and tls_key_file also
  // name this client's PEM certificate and key. All empty: plaintext.
  std::string tls_root_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;  // the name the server's certificate must carry, if not the host's
  std::string access_key;       // sent with CreateSession when the server requires one

  // Session affinity. Every call of a session carries the metadata header
  // x-te-session: <the session's affinity_key()>, so a balancer that hashes on
  // it (deploy/envoy/envoy.yaml) sends them all to one replica. With
  // pin_to_replica, when CreateSession's answer names a replica address
  // (te_server --advertise_address) other than the one connected to, the
  // session's later calls go straight there, over a channel with these same
  // options, so sessions survive a plain L4 balancer too. There is no
  // fallback: the session exists on that replica only.
  bool pin_to_replica = true;
};

// How the server picks a recipe from the preferred list (te.v1.NegotiationPolicy).
enum class NegotiationPolicy {
  kStrict,    // the first recipe, natively, or FAILED_PRECONDITION
  kFallback,  // the first recipe the device runs natively
  kEmulate,   // the first recipe, natively or with emulated numerics
};

struct SessionOptions {
  std::vector<Recipe> recipes;  // preferred, in order; empty: no FP8 recipe
  NegotiationPolicy policy = NegotiationPolicy::kFallback;
  std::string device;           // "cpu", "cuda:0"; empty: the server's choice
  absl::Duration ttl = absl::ZeroDuration();  // idle TTL; zero: the server's default
  std::optional<Transport> transport;         // unset: ClientOptions::transport
  // The session's x-te-session value (ClientOptions' session affinity);
  // empty: 32 random hex digits. A chosen key picks the replica a hashing
  // balancer sends the session to, e.g. to spread test sessions over every
  // replica deterministically.
  std::string affinity_key;
};

// optax's learning-rate schedules (te.v1.LearningRate), with optax's names,
// arguments and defaults; a schedule's steps count the optimizer's applied
// updates from 0.
namespace schedules {
te::v1::LearningRate Constant(double value);
te::v1::LearningRate Linear(double init_value, double end_value, int64_t transition_steps,
                            int64_t transition_begin = 0);
te::v1::LearningRate CosineDecay(double init_value, int64_t decay_steps, double alpha = 0.0,
                                 double exponent = 1.0);
te::v1::LearningRate WarmupCosineDecay(double init_value, double peak_value, int64_t warmup_steps,
                                       int64_t decay_steps, double end_value = 0.0,
                                       double exponent = 1.0);
te::v1::LearningRate ExponentialDecay(double init_value, int64_t transition_steps,
                                      double decay_rate, int64_t transition_begin = 0,
                                      bool staircase = false,
                                      std::optional<double> end_value = std::nullopt);
// {step: scale}: init_value times every scale whose step has been reached.
te::v1::LearningRate PiecewiseConstant(double init_value,
                                       const std::map<int64_t, double>& boundaries_and_scales);
// schedules[i] from boundaries[i - 1] on, counting its steps from there.
te::v1::LearningRate JoinSchedules(const std::vector<te::v1::LearningRate>& schedules,
                                   const std::vector<int64_t>& boundaries);
}  // namespace schedules

// A layer's optimizer (Session::SetOptimizer), with optax's names and
// defaults: optax.sgd(lr, momentum=None, nesterov=False), optax.adam(lr,
// b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0), optax.adamw(..., weight_decay=1e-4),
// optax.rmsprop(lr, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True,
// centered=False, momentum=None, nesterov=False), optax.lion(lr, b1=0.9,
// b2=0.99, weight_decay=1e-3), optionally after
// optax.clip_by_global_norm(max_norm); or optax.chain of Transforms. The
// functions below build them as optax's constructors do.
// One link of optax.chain: an optimizer or one of optax's transformations.
using Transform = te::v1::Transform;
struct Optimizer {
  enum class Kind { kSgd, kAdam, kAdamW, kRmsprop, kLion, kChain };
  Kind kind = Kind::kAdamW;
  double learning_rate = 1e-3;  // constant, unless a schedule is set
  // optax.warmup_cosine_decay_schedule, or any schedule (takes precedence).
  std::optional<te::v1::WarmupCosineDecaySchedule> schedule;
  std::optional<te::v1::LearningRate> learning_rate_schedule;
  std::optional<double> momentum;  // sgd, rmsprop
  bool nesterov = false;           // sgd, rmsprop
  // adam, adamw, lion (the Lion builder sets lion's 0.9, 0.99).
  double b1 = 0.9, b2 = 0.999, eps = 1e-8, eps_root = 0.0;
  // adamw's (1e-4); lion's is lion_weight_decay.
  double weight_decay = 1e-4;
  double lion_weight_decay = 1e-3;
  double decay = 0.9;          // rmsprop
  double initial_scale = 0.0;  // rmsprop
  bool eps_in_sqrt = true;     // rmsprop
  bool centered = false;       // rmsprop
  std::optional<double> clip_by_global_norm;
  std::vector<Transform> chain;  // kChain: its links, in order
  te::v1::Optimizer ToProto() const;
  te::v1::LearningRate LearningRate() const;
};

Optimizer Sgd(te::v1::LearningRate learning_rate, std::optional<double> momentum = std::nullopt,
              bool nesterov = false);
Optimizer Adam(te::v1::LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999,
               double eps = 1e-8, double eps_root = 0.0);
Optimizer AdamW(te::v1::LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999,
                double eps = 1e-8, double eps_root = 0.0, double weight_decay = 1e-4);
Optimizer Rmsprop(te::v1::LearningRate learning_rate, double decay = 0.9, double eps = 1e-8,
                  double initial_scale = 0.0, bool eps_in_sqrt = true, bool centered = false,
                  std::optional<double> momentum = std::nullopt, bool nesterov = false);
Optimizer Lion(te::v1::LearningRate learning_rate, double b1 = 0.9, double b2 = 0.99,
               double weight_decay = 1e-3);
// optax.chain(links...): clip_by_global_norm may come anywhere, e.g.
// Chain({Link(Adam(...)), ClipByGlobalNorm(1.0)}) clips adam's updates.
Optimizer Chain(std::vector<Transform> links);
Transform Link(const Optimizer& optimizer);  // sgd, adam, adamw, rmsprop, lion (no clip)
Transform ClipByGlobalNorm(double max_norm);
Transform Clip(double max_delta);
Transform Scale(double step_size);
Transform AddDecayedWeights(double weight_decay);
Transform ScaleByLearningRate(te::v1::LearningRate learning_rate);

// A tensor held by the server in a session (from Put, or kept outputs).
struct ResidentTensor {
  std::string id;
  DType dtype = DType::kF32;
  Shape shape;
  // The request's Tensor that names it: dtype, shape and resident_id.
  te::v1::Tensor ToProto() const;
};

// Call order. Every call a Session makes (the raw calls, the PutTensor and
// GetTensor streams behind Put, Get, Send and Receive, Delete, Close) carries
// the session's next number (SessionRef.sequence: 1, 2, 3, ...), taken as the
// request is sent; a call made again gets a new number. The server runs the
// session's calls in that order, whatever order they arrive in, so a caller
// need not wait for one call's answer before sending the next (the Async
// calls below), and calls from several threads run in the order they took
// their numbers. A call that ends here without the server's answer
// (DEADLINE_EXCEEDED, CANCELLED, UNAVAILABLE: it may never have been sent)
// would leave a gap the session's later calls wait for, so the Session
// names its number in every later call (SessionRef.abandoned) until a call
// numbered above it is answered: the server does not wait for it, and
// refuses it should it arrive after all. A gap remains only for calls sent
// before the failure was known (Async calls already in flight), when no
// later call follows to name the number: the server ends them ABORTED,
// naming the missing number, after its --sequence_gap_seconds.
class Session {
 public:
  // Closes the session (best effort: errors are dropped; call Close() to see
  // them), then waits for its Async calls: those the server has not answered
  // within 10 s of the close are cancelled (their futures end CANCELLED).
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Frees everything the session holds on the server. OK if already closed
  // by this object; NOT_FOUND if the server had expired or evicted it.
  absl::Status Close();

  const std::string& id() const { return id_; }
  const std::string& device() const { return device_; }
  // The negotiated recipe (nullopt: none, bf16 only), whether the device
  // emulates its numerics, and the server's account of what it skipped and why.
  const std::optional<Recipe>& recipe() const { return recipe_; }
  bool emulated() const { return emulated_; }
  const std::string& negotiation() const { return negotiation_; }
  absl::Duration ttl() const { return ttl_; }
  // The x-te-session value sent on every call of this session (32 hex
  // digits, random, chosen before CreateSession).
  const std::string& affinity_key() const { return affinity_key_; }
  // The replica this session's calls go to directly (CreateSession's
  // server_address) when pinned; empty when they go where the client connected.
  const std::string& pinned_address() const { return pinned_address_; }

  // Uploads `tensor` through the PutTensor stream (chunk_bytes pieces). The
  // tensor lives until Delete or the session's end. RESOURCE_EXHAUSTED when
  // the session's memory limit would be passed.
  absl::StatusOr<ResidentTensor> Put(const HostTensor& tensor);
  // Downloads a resident tensor (GetTensor stream). NOT_FOUND for an unknown id.
  absl::StatusOr<HostTensor> Get(const std::string& tensor_id);
  absl::Status Delete(const std::string& tensor_id);

  // --- Raw calls, for the module classes (modules.h) and tools. Each fills
  // in the session reference, applies the deadline (rpc_timeout, or
  // `timeout` when shorter), and returns the server's response or status.
  absl::StatusOr<te::v1::InitLayerResponse> InitLayer(
      te::v1::InitLayerRequest request, absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<te::v1::ForwardResponse> Forward(
      te::v1::ForwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<te::v1::BackwardResponse> Backward(
      te::v1::BackwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<te::v1::ForwardBackwardResponse> ForwardBackward(
      te::v1::ForwardBackwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  absl::StatusOr<te::v1::GetVariablesResponse> GetVariables(
      te::v1::GetVariablesRequest request, absl::Duration timeout = absl::InfiniteDuration());
  // The response names the new version (a layer's variables are versions:
  // te.v1 ReleaseVersionsRequest).
  absl::StatusOr<te::v1::SetVariablesResponse> SetVariables(
      te::v1::SetVariablesRequest request, absl::Duration timeout = absl::InfiniteDuration());
  // Another graph over a layer's variables (another batch size, a loss):
  // its index, or that of an equal graph the layer has. INVALID_ARGUMENT
  // naming the node that is not the layer's or does not fit.
  absl::StatusOr<te::v1::AddGraphResponse> AddGraph(
      te::v1::AddGraphRequest request, absl::Duration timeout = absl::InfiniteDuration());
  // Frees versions of a layer's variables; unknown or released ones are ignored.
  absl::Status ReleaseVersions(te::v1::ReleaseVersionsRequest request,
                               absl::Duration timeout = absl::InfiniteDuration());
  // Frees a layer: every version, graph, optimizer state and kept forward of it.
  absl::Status DeleteLayer(te::v1::DeleteLayerRequest request,
                           absl::Duration timeout = absl::InfiniteDuration());
  // The Benchmark RPC: step times, and the memory of the timed steps
  // (peak_bytes_in_use: this session's; bytes_reserved / peak_bytes_reserved:
  // the device allocator's, as JAX's device.memory_stats()).
  absl::StatusOr<te::v1::BenchmarkResponse> Benchmark(
      te::v1::BenchmarkRequest request, absl::Duration timeout = absl::InfiniteDuration());
  // The Generate stream (te.v1; client/generate.h builds the request from
  // a model's variables): `on_step` gets each step's GenerateResponse as it
  // arrives; a non-OK status from it cancels the call, which then returns
  // that status. OK once the server has sent every step; else the server's
  // status after the steps already delivered (DEADLINE_EXCEEDED when
  // `timeout` or rpc_timeout passes first, INVALID_ARGUMENT naming the field
  // before any step).
  absl::Status Generate(
      te::v1::GenerateRequest request,
      const std::function<absl::Status(const te::v1::GenerateResponse& step)>& on_step,
      absl::Duration timeout = absl::InfiniteDuration());
  // The session's device, memory now and at peak (since it opened or its
  // last Benchmark's timed steps began), the device's, and its counts of
  // layers, saved forwards, resident tensors and regions.
  absl::StatusOr<te::v1::SessionInfo> GetSessionInfo(
      absl::Duration timeout = absl::InfiniteDuration());
  // tx.init(params): gives layer `layer_id` `optimizer` and a fresh state
  // (collection opt_state), replacing any; a ForwardBackward with
  // apply_update then runs a whole training step. INVALID_ARGUMENT naming the
  // field for a bad hyperparameter (NaN, b1 outside [0, 1), ...);
  // RESOURCE_EXHAUSTED when the state does not fit the session's memory.
  absl::StatusOr<te::v1::SetOptimizerResponse> SetOptimizer(
      const std::string& layer_id, const Optimizer& optimizer,
      absl::Duration timeout = absl::InfiniteDuration());

  // --- Pipelined step calls. Each takes its number in the session's order
  // (Call order, above) before it returns, sends the request without waiting
  // for the session's earlier calls to answer, and returns a future of what
  // the synchronous form gives: the response on success (SetVariables: an
  // empty response), else the server's status unchanged (the transport's own
  // failures as UNAVAILABLE or DEADLINE_EXCEEDED after rpc_timeout; ABORTED
  // when the server gave up waiting for a lower number of this session;
  // RESOURCE_EXHAUSTED when more calls wait for the device than its queue
  // holds, te_server's --executor_queue). So
  //   auto set = session.SetVariablesAsync(write);
  //   auto got = session.GetVariablesAsync(read);  // sees what `write` set
  // runs `write` then `read` on the server with no round trip between them. The
  // request's tensors must already be inline, resident or in shared memory
  // (Send); Receive the response's. Thread-safe; the futures may be waited on
  // from any thread, in any order, and each is set exactly once. `timeout`
  // as for the raw calls.
  std::future<absl::StatusOr<te::v1::ForwardResponse>> ForwardAsync(
      te::v1::ForwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  std::future<absl::StatusOr<te::v1::BackwardResponse>> BackwardAsync(
      te::v1::BackwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  std::future<absl::StatusOr<te::v1::ForwardBackwardResponse>> ForwardBackwardAsync(
      te::v1::ForwardBackwardRequest request, absl::Duration timeout = absl::InfiniteDuration());
  std::future<absl::StatusOr<te::v1::GetVariablesResponse>> GetVariablesAsync(
      te::v1::GetVariablesRequest request, absl::Duration timeout = absl::InfiniteDuration());
  std::future<absl::StatusOr<te::v1::SetVariablesResponse>> SetVariablesAsync(
      te::v1::SetVariablesRequest request, absl::Duration timeout = absl::InfiniteDuration());
  std::future<absl::StatusOr<te::v1::ReleaseVersionsResponse>> ReleaseVersionsAsync(
      te::v1::ReleaseVersionsRequest request, absl::Duration timeout = absl::InfiniteDuration());

  // A handle to this Session that may outlive it: what holds a version of
  // a layer's variables (modules.h's Variables) releases it through here.
  class Link {
   public:
    // Sends ReleaseVersions for `version` of `layer_id` without waiting for
    // the answer (in the session's call order; its errors are dropped:
    // the version may have gone with its layer). Nothing once the Session
    // is closed or gone.
    void ReleaseVersion(const std::string& layer_id, int64_t version);

   private:
    friend class Session;
    absl::Mutex mu_;
    Session* session_ ABSL_GUARDED_BY(mu_) = nullptr;
  };
  std::shared_ptr<Link> link() const { return link_; }

  // A request tensor for `tensor`, by the session's transport: inline,
  // uploaded with Put, or written to shared memory (its id, or its block as
  // "shm:...", appended to *uploaded, for the caller to DeleteAll after the call).
  absl::StatusOr<te::v1::Tensor> Send(const HostTensor& tensor, std::vector<std::string>* uploaded);
  // A response tensor as a HostTensor: inline bytes, bytes in this session's
  // shared memory, or a resident id fetched (through shared memory or the
  // stream) and then deleted. `field` names it in errors.
  absl::StatusOr<HostTensor> Receive(const te::v1::Tensor& tensor, const std::string& field);
  // Deletes each id (and frees each shared-memory block), keeping the first error.
  absl::Status DeleteAll(const std::vector<std::string>& tensor_ids);

  const ClientOptions& options() const { return options_; }
  Transport transport() const { return transport_; }
  // What the transport did so far (which way kAuto sent and received tensors).
  const TransportCounts& transport_counts() const { return counts_; }

 private:
  friend class Client;
  Session(std::shared_ptr<te::v1::TeService::Stub> stub, ClientOptions options,
          const te::v1::CreateSessionResponse& created, Transport transport,
          std::string affinity_key, std::string pinned_address);
  // The deadline (rpc_timeout, or `timeout` when shorter) and the x-te-session
  // header: every call of the session goes through here.
  void PrepareContext(grpc::ClientContext* context,
                      absl::Duration timeout = absl::InfiniteDuration()) const;
  // The session reference for a call being sent now: its next number in the
  // session's order and the abandoned numbers below it (Call order).
  te::v1::SessionRef NextRef();
  // The status of the call numbered `sequence` (every call of the session
  // ends here), kept in the session's order: DEADLINE_EXCEEDED, CANCELLED
  // and UNAVAILABLE abandon the number; any other code is the server's
  // answer, after which it waits for no lower number. An UNAVAILABLE from a
  // pinned replica names its address.
  absl::Status CallStatus(uint64_t sequence, const grpc::Status& status);

  // One Async call: the stub's blocking `rpc` on a thread of its own. (gRPC
  // 1.51's callback API frees the call's arena under a callback that drops
  // the last reference to its ClientContext, which ASan caught as a double
  // free; a blocking call owns its context for exactly as long as it runs.)
  template <typename Request, typename Response>
  using SyncRpc = grpc::Status (te::v1::TeService::Stub::*)(grpc::ClientContext*, const Request&,
                                                            Response*);
  template <typename Request, typename Response>
  std::future<absl::StatusOr<Response>> CallAsync(SyncRpc<Request, Response> rpc, Request request,
                                                  absl::Duration timeout);

  // Shared memory (transport.cc). The way a tensor of `bytes` goes now.
  Transport TransportFor(size_t bytes) const;
  absl::StatusOr<std::string> RegisterRegion(const std::string& name, uint64_t size);
  absl::StatusOr<ResidentTensor> PutShared(const HostTensor& tensor,
                                           const SharedMemoryPool::Block& block);
  absl::StatusOr<HostTensor> GetShared(const std::string& tensor_id, DType dtype,
                                       const Shape& shape, const SharedMemoryPool::Block& block);
  absl::StatusOr<HostTensor> ReadShared(const te::v1::Tensor& tensor, const std::string& field);
  // Frees the block an "shm:..." upload id names; false for another id.
  bool FreeShared(const std::string& upload_id);
  absl::StatusOr<ResidentTensor> PutStreamed(const HostTensor& tensor);

  std::shared_ptr<te::v1::TeService::Stub> stub_;  // the pinned replica's, or the client's
  ClientOptions options_;
  const std::string affinity_key_;
  const std::string pinned_address_;
  te::v1::SessionRef ref_;  // sequence unset: NextRef numbers each call
  // The session's order (Call order): the next number, the numbers of
  // calls that ended without the server's answer, not yet passed by an
  // answered call, and those sent and not yet ended (the lowest goes in
  // every call: where a session restored from a checkpoint goes on).
  absl::Mutex order_mu_;
  uint64_t next_sequence_ ABSL_GUARDED_BY(order_mu_) = 1;
  std::set<uint64_t> abandoned_ ABSL_GUARDED_BY(order_mu_);
  std::set<uint64_t> in_flight_numbers_ ABSL_GUARDED_BY(order_mu_);
  std::string id_;
  std::string device_;
  std::optional<Recipe> recipe_;
  bool emulated_ = false;
  std::string negotiation_;
  absl::Duration ttl_;
  std::atomic<bool> closed_{false};
  std::shared_ptr<Link> link_ = std::make_shared<Link>();
  const Transport transport_;
  SharedMemoryPool shm_;
  TransportCounts counts_;
  // The contexts of the Async calls not yet answered (their threads use this
  // Session): the destructor waits for them, or cancels them.
  absl::Mutex async_mu_;
  std::set<grpc::ClientContext*> in_flight_ ABSL_GUARDED_BY(async_mu_);
  int async_starting_ ABSL_GUARDED_BY(async_mu_) = 0;  // threads not yet in in_flight_
  bool NoAsyncCalls() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(async_mu_) {
    return async_starting_ == 0 && in_flight_.empty();
  }
};

class Client {
 public:
  // Opens a channel to `address` ("host:port"), plaintext or TLS as options
  // say, and waits up to options.connect_timeout for it. UNAVAILABLE naming
  // the address: at once when the connection is refused (nothing listens
  // there) or the TLS handshake fails, after connect_timeout when nothing
  // answers. INVALID_ARGUMENT for a client certificate without its key (or
  // the reverse); FAILED_PRECONDITION when a TLS file cannot be read.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& address,
                                                         const ClientOptions& options = {});

  // Version, devices (with the recipes each runs natively or emulated), dtypes, limits.
  absl::StatusOr<te::v1::ServerInfo> GetServerInfo();

  // Opens a session; the caller owns it (closing it on destruction). The
  // recipe is negotiated from options.recipes under options.policy:
  // FAILED_PRECONDITION when STRICT cannot be met; RESOURCE_EXHAUSTED when
  // the server is at its session limit (retry later). The session may be
  // pinned to the replica that answered (ClientOptions::pin_to_replica); the
  // pinned channel connects lazily, so a replica that cannot be reached shows
  // as UNAVAILABLE, naming its address, on the session's first call.
  absl::StatusOr<std::unique_ptr<Session>> CreateSession(const SessionOptions& options = {});

  const ClientOptions& options() const { return options_; }
  const std::string& address() const { return address_; }

 private:
  Client(std::string address, std::shared_ptr<grpc::ChannelCredentials> credentials,
         std::shared_ptr<te::v1::TeService::Stub> stub, ClientOptions options)
      : address_(std::move(address)),
        credentials_(std::move(credentials)),
        stub_(std::move(stub)),
        options_(std::move(options)) {}
  // The stub for a replica's own address, one channel per address, shared by
  // the sessions pinned there.
  std::shared_ptr<te::v1::TeService::Stub> PinnedStub(const std::string& address);

  const std::string address_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::shared_ptr<te::v1::TeService::Stub> stub_;
  ClientOptions options_;
  absl::Mutex pinned_mu_;
  std::map<std::string, std::shared_ptr<te::v1::TeService::Stub>> pinned_stubs_
      ABSL_GUARDED_BY(pinned_mu_);
};

// The metadata header that carries Session::affinity_key() on every call of a
// session (the key deploy/envoy/envoy.yaml hashes on).
extern const char kAffinityHeader[];

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace te::client

#endif  // TE_CLIENT_CLIENT_H_
