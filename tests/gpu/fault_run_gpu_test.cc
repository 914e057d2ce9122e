// The fault run on a GPU: a CUDA te_server (--device=cuda:0) driven for
// FAULT_SECONDS (default 60) at the quickstart's layer sizes (batch 4, seq
// 2048, hidden 4096, ffn 16384, 32 heads, bf16 inputs) by clients that do
// what the CPU fault run's do (tests/integration/fault_test.cc), plus what
// only a GPU's memory shows:
//  - bystanders: a bf16 and an FP8 (DelayedScaling) TransformerLayer session
//    stepping ForwardBackward with a 2 s deadline: none may miss it or fail;
//  - memory hogs: sessions that together ask for more than the device's
//    account holds (each layer's decode cache a quarter of it less room for
//    the others' steps): what does not fit must be RESOURCE_EXHAUSTED naming
//    the device and what is left, and the other sessions keep stepping;
//  - abandoners: FP8 steps of 8 micro-batches given up after 20 ms;
//  - a failed-only session: every call with a 1 ms deadline (ForwardBackward,
//    Forward, InitLayer): nearly all fail (a Forward may answer as soon as
//    its kernels are queued; what such a call made is deleted), and its
//    variables and memory end bit for bit as they began;
//  - a stream canceller: PutTensor streams of a quickstart activation
//    cancelled part way, and GetTensor streams cancelled after two chunks.
// Afterwards: the server still serves, no call anywhere was INTERNAL,
// UNKNOWN or DATA_LOSS, and once every session is closed the device's
// session memory is back to zero. Prints its figures as a block for the
// README. Needs a GPU: runs through deploy/bundle.sh on the GPU machine.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/quickstart_layers.h"
#include "gtest/gtest.h"
#include "kernels/status_macros.h"
#include "te/v1/service.grpc.pb.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using client::HostTensor;
using client::LayerSize;
using client::Session;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr absl::Duration kBystanderDeadline = absl::Seconds(2);
constexpr absl::Duration kAbandonAfter = absl::Milliseconds(20);
constexpr absl::Duration kTiny = absl::Milliseconds(1);
// What four hog layers leave for everyone else's steps (activations,
// workspaces): less than a fifth hog layer, so a fifth is always refused.
constexpr int64_t kRoomForSteps = 16 * kGiB;

int FaultSeconds() {
  int seconds = 60;
  if (const char* env = std::getenv("FAULT_SECONDS")) {
    if (!absl::SimpleAtoi(env, &seconds) || seconds < 1) seconds = 60;
  }
  return seconds;
}

bool IsServerFault(absl::StatusCode code) {
  return code == absl::StatusCode::kInternal || code == absl::StatusCode::kUnknown ||
         code == absl::StatusCode::kDataLoss;
}

// Codes seen, by client kind, and the first message of each.
class Tally {
 public:
  void Add(const std::string& kind, const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    const std::string key = absl::StrCat(kind, " ", absl::StatusCodeToString(status.code()));
    ++counts_[key];
    if (!status.ok() && examples_.count(key) == 0) examples_[key] = std::string(status.message());
    if (IsServerFault(status.code())) server_faults_.push_back(status.ToString());
  }
  std::map<std::string, int64_t> counts() const {
    absl::MutexLock lock(&mu_);
    return counts_;
  }
  std::map<std::string, std::string> examples() const {
    absl::MutexLock lock(&mu_);
    return examples_;
  }
  std::vector<std::string> server_faults() const {
    absl::MutexLock lock(&mu_);
    return server_faults_;
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, int64_t> counts_;
  std::map<std::string, std::string> examples_;
  std::vector<std::string> server_faults_;
};

uint64_t Fnv1a(const std::string& bytes, uint64_t hash = 1469598103934665603ull) {
  for (unsigned char c : bytes) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

// Every variable of the layer's newest version, name -> hash of its bytes.
absl::StatusOr<std::map<std::string, uint64_t>> Digest(Session& session,
                                                       const std::string& layer_id) {
  te::v1::GetVariablesRequest request;
  request.set_layer_id(layer_id);
  request.set_keep_outputs(true);  // each as a resident snapshot, streamed back
  auto response = session.GetVariables(request);
  if (!response.ok()) return response.status();
  std::map<std::string, uint64_t> digest;
  for (const te::v1::Variable& v : response->variables()) {
    const std::string name = absl::StrCat(v.collection(), "/", v.path());
    auto host = session.Receive(v.value(), name);
    if (!host.ok()) return host.status();
    digest[name] = Fnv1a(host->bytes());
  }
  return digest;
}

// One quickstart TransformerLayer session with resident x and dy.
struct Layer {
  std::unique_ptr<Session> session;
  std::string layer_id;
  te::v1::ForwardBackwardRequest step;
  te::v1::ForwardRequest forward;
  te::v1::InitLayerRequest init;
};

absl::StatusOr<Layer> MakeLayer(client::Client& client, const LayerSize& size, bool fp8,
                                int micro_batches, uint64_t seed) {
  Layer l;
  client::SessionOptions options;
  if (fp8) options.recipes = {client::QuickstartRecipe()};
  options.policy = client::NegotiationPolicy::kEmulate;
  options.device = "cuda:0";
  ASSIGN_OR_RETURN(l.session, client.CreateSession(options));
  te::v1::Autocast autocast;
  if (fp8) {
    autocast = client::ToProto(
        client::AutocastState{true, std::optional<client::Recipe>(client::QuickstartRecipe())});
  }
  const client::Shape shape = {size.batch, size.seq, size.hidden};
  ASSIGN_OR_RETURN(client::ResidentTensor x,
                   l.session->Put(HostTensor::RandomNormal(shape, client::DType::kBF16, seed)));
  ASSIGN_OR_RETURN(client::ResidentTensor dy,
                   l.session->Put(HostTensor::RandomNormal(shape, client::DType::kBF16, seed + 1)));
  ASSIGN_OR_RETURN(*l.init.mutable_spec(), client::QuickstartTransformerLayer(size).Spec());
  l.init.set_seed(seed);
  l.init.set_input_dtype(te::v1::BFLOAT16);
  for (int64_t d : shape) l.init.add_input_shape(d);
  *l.init.mutable_autocast() = autocast;
  ASSIGN_OR_RETURN(te::v1::InitLayerResponse initialised, l.session->InitLayer(l.init));
  l.layer_id = initialised.layer_id();
  l.step.set_layer_id(l.layer_id);
  l.step.set_deterministic(true);
  l.step.set_discard_grads(true);
  *l.step.mutable_autocast() = autocast;
  for (int i = 0; i < micro_batches; ++i) {
    te::v1::MicroBatch* mb = l.step.add_micro_batches();
    *mb->mutable_x() = x.ToProto();
    *mb->mutable_dy() = dy.ToProto();
  }
  l.forward.set_layer_id(l.layer_id);
  *l.forward.mutable_x() = x.ToProto();
  l.forward.set_deterministic(true);
  *l.forward.mutable_autocast() = autocast;
  return l;
}

// A step that may make a version (FP8 state moves): the one before it goes,
// so a long run holds one version per layer.
absl::Status StepAndRelease(Layer& l, absl::Duration timeout, int64_t* version) {
  auto stepped = l.session->ForwardBackward(l.step, timeout);
  if (!stepped.ok()) return stepped.status();
  if (*version != 0 && stepped->version() != *version) {
    te::v1::ReleaseVersionsRequest release;
    release.set_layer_id(l.layer_id);
    release.add_versions(*version);
    RETURN_IF_ERROR(l.session->ReleaseVersions(release));
  }
  *version = stepped->version();
  return absl::OkStatus();
}

struct Figures {
  std::atomic<int64_t> bystander_steps{0}, bystander_missed{0};
  absl::Mutex mu;
  std::vector<double> bystander_ms ABSL_GUARDED_BY(mu);
  std::atomic<int64_t> hog_layers{0}, hog_refusals{0}, hog_refusals_naming_device{0};
  std::atomic<int64_t> abandoned{0}, tiny_deadlines{0}, tiny_ok{0}, tiny_undo_failed{0};
  std::atomic<int64_t> puts_cancelled{0}, gets_cancelled{0};
};

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// A raw session of the stream canceller's own.
te::v1::SessionRef RawSession(te::v1::TeService::Stub& stub) {
  te::v1::CreateSessionRequest request;
  request.set_device("cuda:0");
  te::v1::CreateSessionResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  EXPECT_TRUE(stub.CreateSession(&context, request, &response).ok());
  return response.session();
}

TEST(FaultRunGpuTest, QuickstartSessionsSurviveFaultsAndMemoryPressure) {
  // The device's account, from a first server: what the hogs are sized by.
  int64_t account = 0;
  {
    ServerProcess::Options probe_options;
    probe_options.flags = {"--device=cuda:0"};
    auto probe = ServerProcess::Start(probe_options);
    ASSERT_TRUE(probe.ok()) << probe.status();
    grpc::ClientContext context;
    te::v1::ServerInfo info;
    ASSERT_TRUE((*probe)->NewStub()->GetServerInfo(&context, {}, &info).ok());
    ASSERT_EQ(info.devices(0).backend(), "cuda") << "needs a GPU";
    account = info.devices(0).memory_bytes();
    ASSERT_TRUE((*probe)->Stop().ok());
  }
  const int64_t hog_layer_bytes = (account - kRoomForSteps) / 4;
  // Each hog must be too large for the room the steps keep (so one placed
  // there is refused): a device over 5 x kRoomForSteps (80 GiB), as the
  // H200's 139 GiB is. An 80 GB H100 accounts 74.7 GiB: the run cannot be
  // sized there, which is the hardware's limit, not a failure.
  if (hog_layer_bytes <= kRoomForSteps) {
    GTEST_SKIP() << "cuda:0 accounts " << account << " bytes; this run needs over "
                 << 5 * kRoomForSteps;
  }
  // A hog is a MultiHeadAttention initialised with decode: its variables are
  // small, and its cache (keys and values, zeros filled on the device) takes
  // the bytes, so a hog is placed or refused in milliseconds. (A kernel of
  // tens of GB drawn on the host takes minutes to place.)
  // Keys and values for x [batch, kHogLength, hidden] float32: 2 x x's bytes.
  constexpr int64_t kHogHeads = 8, kHogHeadDim = 128, kHogLength = 4096;
  constexpr int64_t kHogHidden = kHogHeads * kHogHeadDim;
  const int64_t hog_batch = hog_layer_bytes / (2 * kHogLength * kHogHidden * 4);
  const int64_t hog_x_bytes = hog_batch * kHogLength * kHogHidden * 4;
  constexpr int kHogs = 3;  // 3 sessions x 2 layers: 6 asked, 4 fit
  const int64_t session_limit = 2 * hog_layer_bytes + 2 * kGiB;

  ServerProcess::Options options;
  options.flags = {"--device=cuda:0", "--executor_threads=4", "--max_sessions=64",
                   absl::StrCat("--session_memory_bytes=", session_limit),
                   // The hogs declare an x of hog_x_bytes (never sent).
                   absl::StrCat("--max_tensor_bytes=", hog_x_bytes + kGiB),
                   "--log_level=warning"};
  auto started = ServerProcess::Start(options);
  ASSERT_TRUE(started.ok()) << started.status();
  ServerProcess& server = **started;
  auto stub = server.NewStub();
  auto connect = [&] {
    client::ClientOptions client_options;
    client_options.rpc_timeout = absl::Minutes(2);
    auto c = client::Client::Connect(server.address(), client_options);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  };

  auto size_or = client::SizeForConfig("quickstart");
  ASSERT_TRUE(size_or.ok());
  const LayerSize size = *size_or;
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < 6; ++i) clients.push_back(connect());
  auto bf16 = MakeLayer(*clients[0], size, false, 1, 10);
  auto fp8 = MakeLayer(*clients[1], size, true, 1, 20);
  auto abandoner = MakeLayer(*clients[2], size, true, 8, 30);
  // 16 micro-batches: a step no GPU finishes within a 1 ms deadline.
  auto failed_only = MakeLayer(*clients[3], size, false, 16, 40);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  ASSERT_TRUE(abandoner.ok()) << abandoner.status();
  ASSERT_TRUE(failed_only.ok()) << failed_only.status();
  {
    // One Forward and one step that succeed first: the session's library
    // workspace grows to what its calls use, and a 1 ms Forward that makes
    // its deadline later leaves only its y, which it deletes.
    auto forward = failed_only->session->Forward(failed_only->forward);
    ASSERT_TRUE(forward.ok()) << forward.status();
    if (!forward->y().resident_id().empty()) {
      ASSERT_TRUE(failed_only->session->Delete(forward->y().resident_id()).ok());
    }
    ASSERT_TRUE(failed_only->session->ForwardBackward(failed_only->step).ok());
  }
  auto failed_only_before = Digest(*failed_only->session, failed_only->layer_id);
  ASSERT_TRUE(failed_only_before.ok()) << failed_only_before.status();
  auto failed_only_info_before = failed_only->session->GetSessionInfo();
  ASSERT_TRUE(failed_only_info_before.ok());

  Figures figures;
  Tally tally;
  const int seconds = FaultSeconds();
  const absl::Time until = absl::Now() + absl::Seconds(seconds);
  std::vector<std::thread> threads;

  for (Layer* l : {&*bf16, &*fp8}) {
    threads.emplace_back([&, l] {
      int64_t version = 0;
      while (absl::Now() < until) {
        const absl::Time start = absl::Now();
        const absl::Status status = StepAndRelease(*l, kBystanderDeadline, &version);
        const absl::Duration took = absl::Now() - start;
        tally.Add("bystander", status);
        ++figures.bystander_steps;
        if (!status.ok() || took > kBystanderDeadline) ++figures.bystander_missed;
        absl::MutexLock lock(&figures.mu);
        figures.bystander_ms.push_back(absl::ToDoubleMilliseconds(took));
      }
    });
  }

  // Hogs: layers of a quarter of the account (less room for steps) each,
  // two per session at most, held a moment, then let go.
  std::vector<std::unique_ptr<Session>> hog_sessions;
  for (int i = 0; i < kHogs; ++i) {
    client::SessionOptions hog_options;
    hog_options.device = "cuda:0";
    auto s = clients[4]->CreateSession(hog_options);
    ASSERT_TRUE(s.ok()) << s.status();
    hog_sessions.push_back(*std::move(s));
  }
  for (int i = 0; i < kHogs; ++i) {
    threads.emplace_back([&, i] {
      Session& s = *hog_sessions[i];
      uint64_t seed = 100 * (i + 1);
      while (absl::Now() < until) {
        std::vector<std::string> held;
        for (int k = 0; k < 2 && absl::Now() < until; ++k) {
          te::v1::InitLayerRequest init;
          te::v1::MultiHeadAttention* mha = init.mutable_spec()->mutable_multi_head_attention();
          mha->set_head_dim(kHogHeadDim);
          mha->set_num_attention_heads(kHogHeads);
          mha->set_enable_rotary_pos_emb(true);  // TE decodes separate q, k, v only
          init.set_decode(true);
          init.set_seed(++seed);
          init.set_input_dtype(te::v1::FLOAT32);
          for (int64_t d : {hog_batch, kHogLength, kHogHidden}) init.add_input_shape(d);
          auto layer = s.InitLayer(init, absl::Seconds(30));
          tally.Add("hog InitLayer", layer.status());
          if (layer.ok()) {
            held.push_back(layer->layer_id());
            ++figures.hog_layers;
          } else if (layer.status().code() == absl::StatusCode::kResourceExhausted) {
            ++figures.hog_refusals;
            if (absl::StrContains(layer.status().message(), "cuda:0")) {
              ++figures.hog_refusals_naming_device;
            }
          }
        }
        absl::SleepFor(absl::Milliseconds(300));
        for (const std::string& id : held) {
          te::v1::DeleteLayerRequest del;
          del.set_layer_id(id);
          tally.Add("hog DeleteLayer", s.DeleteLayer(del, absl::Seconds(30)));
        }
        absl::SleepFor(absl::Milliseconds(100));
      }
    });
  }

  threads.emplace_back([&] {
    Layer& l = *abandoner;
    while (absl::Now() < until) {
      const absl::Status status = l.session->ForwardBackward(l.step, kAbandonAfter).status();
      tally.Add("abandoner", status);
      if (!status.ok()) ++figures.abandoned;
    }
  });

  threads.emplace_back([&] {
    Layer& l = *failed_only;
    int k = 0;
    while (absl::Now() < until) {
      // A call that makes its 1 ms deadline after all (a Forward answers once
      // its kernels are queued, and the GPU may queue them that fast) is not
      // a failed call: what it made goes again, by the API, so the session
      // is what its failed calls alone left.
      absl::Status status;
      std::string kind;
      absl::Status undone;
      switch (k++ % 3) {
        case 0: {
          kind = "ForwardBackward";
          te::v1::ForwardBackwardRequest step = l.step;
          step.set_discard_grads(false);  // would keep grads: a new version, if it ran
          auto stepped = l.session->ForwardBackward(step, kTiny);
          status = stepped.status();
          if (stepped.ok()) {
            te::v1::ReleaseVersionsRequest release;
            release.set_layer_id(l.layer_id);
            release.add_versions(stepped->version());
            undone = l.session->ReleaseVersions(release);
          }
          break;
        }
        case 1: {
          kind = "Forward";
          auto forward = l.session->Forward(l.forward, kTiny);
          status = forward.status();
          if (forward.ok() && !forward->y().resident_id().empty()) {
            undone = l.session->Delete(forward->y().resident_id());
          }
          break;
        }
        case 2: {
          kind = "InitLayer";
          auto layer = l.session->InitLayer(l.init, kTiny);
          status = layer.status();
          if (layer.ok()) {
            te::v1::DeleteLayerRequest del;
            del.set_layer_id(layer->layer_id());
            undone = l.session->DeleteLayer(del);
          }
          break;
        }
      }
      tally.Add("1 ms " + kind, status);
      ++figures.tiny_deadlines;
      if (status.ok()) {
        ++figures.tiny_ok;
        tally.Add("1 ms " + kind + " met: its result deleted", undone);
        if (!undone.ok()) ++figures.tiny_undo_failed;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  });

  threads.emplace_back([&] {
    auto raw = server.NewStub();
    const te::v1::SessionRef session = RawSession(*raw);
    const std::string chunk(4 << 20, '\x3c');  // bf16 1.47e-2-ish values
    const int64_t chunks = size.batch * size.seq * size.hidden * 2 / static_cast<int64_t>(chunk.size());
    // One whole tensor for the GetTensor streams.
    std::string resident;
    {
      grpc::ClientContext context;
      te::v1::PutTensorResponse response;
      auto writer = raw->PutTensor(&context, &response);
      te::v1::PutTensorChunk header;
      *header.mutable_header()->mutable_session() = session;
      header.mutable_header()->mutable_tensor()->set_dtype(te::v1::BFLOAT16);
      for (int64_t d : {size.batch, size.seq, size.hidden}) {
        header.mutable_header()->mutable_tensor()->add_shape(d);
      }
      writer->Write(header);
      te::v1::PutTensorChunk data;
      data.set_data(chunk);
      for (int64_t c = 0; c < chunks; ++c) writer->Write(data);
      writer->WritesDone();
      const grpc::Status status = writer->Finish();
      EXPECT_TRUE(status.ok()) << status.error_message();
      resident = response.tensor_id();
    }
    int k = 0;
    while (absl::Now() < until) {
      if (k++ % 2 == 0) {
        grpc::ClientContext context;
        te::v1::PutTensorResponse response;
        auto writer = raw->PutTensor(&context, &response);
        te::v1::PutTensorChunk header;
        *header.mutable_header()->mutable_session() = session;
        header.mutable_header()->mutable_tensor()->set_dtype(te::v1::BFLOAT16);
        for (int64_t d : {size.batch, size.seq, size.hidden}) {
          header.mutable_header()->mutable_tensor()->add_shape(d);
        }
        writer->Write(header);
        te::v1::PutTensorChunk data;
        data.set_data(chunk);
        for (int c = 0; c < 3; ++c) writer->Write(data);
        context.TryCancel();
        const grpc::Status status = writer->Finish();
        tally.Add("cancelled PutTensor",
                  absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()));
        ++figures.puts_cancelled;
      } else {
        grpc::ClientContext context;
        te::v1::GetTensorRequest request;
        *request.mutable_session() = session;
        request.set_tensor_id(resident);
        auto reader = raw->GetTensor(&context, request);
        te::v1::TensorChunk piece;
        for (int c = 0; c < 2 && reader->Read(&piece); ++c) {
        }
        context.TryCancel();
        while (reader->Read(&piece)) {
        }
        const grpc::Status status = reader->Finish();
        tally.Add("cancelled GetTensor",
                  absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message()));
        ++figures.gets_cancelled;
      }
    }
    te::v1::CloseSessionRequest close;
    *close.mutable_session() = session;
    te::v1::CloseSessionResponse closed;
    grpc::ClientContext context;
    raw->CloseSession(&context, close, &closed);
  });

  for (std::thread& t : threads) t.join();

  // Failed-only: every call failed, and nothing moved.
  auto failed_only_after = Digest(*failed_only->session, failed_only->layer_id);
  ASSERT_TRUE(failed_only_after.ok()) << failed_only_after.status();
  EXPECT_EQ(*failed_only_after, *failed_only_before) << "a session whose calls all failed changed";
  // A call whose answer was lost on its way (its 1 ms deadline passed
  // after the server ended it well) has its ids forgotten in a session turn
  // of their own, which may come after this GetSessionInfo: wait for it.
  auto failed_only_info_after = failed_only->session->GetSessionInfo();
  for (int i = 0; i < 50 && failed_only_info_after.ok() &&
                  failed_only_info_after->memory_bytes() != failed_only_info_before->memory_bytes();
       ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    failed_only_info_after = failed_only->session->GetSessionInfo();
  }
  ASSERT_TRUE(failed_only_info_after.ok());
  EXPECT_EQ(failed_only_info_after->memory_bytes(), failed_only_info_before->memory_bytes())
      << "layers " << failed_only_info_before->layers() << " -> "
      << failed_only_info_after->layers() << ", saved forwards "
      << failed_only_info_before->saved_forwards() << " -> "
      << failed_only_info_after->saved_forwards() << ", resident tensors "
      << failed_only_info_before->resident_tensors() << " -> "
      << failed_only_info_after->resident_tensors();
  // Nearly every 1 ms call expires; the few that make it are undone above.
  EXPECT_GT(figures.tiny_deadlines.load(), 0);
  EXPECT_LT(figures.tiny_ok.load() * 10, figures.tiny_deadlines.load())
      << "1 ms deadlines were met too often for the session to be one whose calls failed";
  EXPECT_EQ(figures.tiny_undo_failed.load(), 0) << "a call that met its 1 ms deadline stayed";

  // Everything closed: the device's session memory back to zero.
  for (auto& s : hog_sessions) EXPECT_TRUE(s->Close().ok());
  for (Layer* l : {&*bf16, &*fp8, &*abandoner, &*failed_only}) EXPECT_TRUE(l->session->Close().ok());
  te::v1::ServerInfo info;
  for (int i = 0; i < 100; ++i) {
    grpc::ClientContext context;
    ASSERT_TRUE(stub->GetServerInfo(&context, {}, &info).ok());
    if (info.stats().sessions_open() == 0 && info.stats().bytes_in_use() == 0) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(info.stats().sessions_open(), 0);
  EXPECT_EQ(info.stats().bytes_in_use(), 0);
  EXPECT_EQ(info.devices(0).sessions_memory_bytes(), 0);
  EXPECT_TRUE(info.devices(0).healthy());

  std::vector<double> ms;
  {
    absl::MutexLock lock(&figures.mu);
    ms = figures.bystander_ms;
  }
  std::printf("\nGPU fault run: %d s on %s, quickstart sizes; device account %lld MiB, "
              "hog layers %lld MiB (%d sessions x 2 = %.2f x the account)\n",
              seconds, info.devices(0).description().c_str(),
              static_cast<long long>(account >> 20), static_cast<long long>(hog_layer_bytes >> 20),
              kHogs, 2.0 * kHogs * static_cast<double>(hog_layer_bytes) / static_cast<double>(account));
  std::printf("  bystanders (bf16, FP8)  %lld steps, %lld missed the %s deadline or failed; "
              "p50 %.1f ms, p99 %.1f ms, max %.1f ms\n",
              static_cast<long long>(figures.bystander_steps.load()),
              static_cast<long long>(figures.bystander_missed.load()),
              absl::FormatDuration(kBystanderDeadline).c_str(), Quantile(ms, 0.5),
              Quantile(ms, 0.99), ms.empty() ? 0.0 : *std::max_element(ms.begin(), ms.end()));
  std::printf("  memory hogs             %lld layers placed, %lld refused (RESOURCE_EXHAUSTED), "
              "%lld of them naming cuda:0\n",
              static_cast<long long>(figures.hog_layers.load()),
              static_cast<long long>(figures.hog_refusals.load()),
              static_cast<long long>(figures.hog_refusals_naming_device.load()));
  std::printf("  abandoned steps         %lld;  1 ms deadlines %lld (%lld met);  cancelled streams "
              "%lld put, %lld get\n",
              static_cast<long long>(figures.abandoned.load()),
              static_cast<long long>(figures.tiny_deadlines.load()),
              static_cast<long long>(figures.tiny_ok.load()),
              static_cast<long long>(figures.puts_cancelled.load()),
              static_cast<long long>(figures.gets_cancelled.load()));
  std::printf("  failed-only session     variables %s; memory %lld -> %lld bytes\n",
              *failed_only_after == *failed_only_before ? "bit for bit unchanged" : "CHANGED",
              static_cast<long long>(failed_only_info_before->memory_bytes()),
              static_cast<long long>(failed_only_info_after->memory_bytes()));
  std::printf("  after closing           %d sessions, %lld bytes in use on cuda:0\n",
              info.stats().sessions_open(), static_cast<long long>(info.stats().bytes_in_use()));
  const std::map<std::string, std::string> examples = tally.examples();
  for (const auto& [key, n] : tally.counts()) {
    std::printf("    %-40s %lld%s%s\n", key.c_str(), static_cast<long long>(n),
                examples.count(key) ? "  e.g. " : "",
                examples.count(key) ? examples.at(key).substr(0, 160).c_str() : "");
  }

  EXPECT_EQ(figures.bystander_missed.load(), 0);
  EXPECT_GT(figures.bystander_steps.load(), 0);
  EXPECT_GT(figures.hog_refusals.load(), 0) << "the hogs never met the device's limit";
  EXPECT_EQ(figures.hog_refusals_naming_device.load(), figures.hog_refusals.load());
  EXPECT_TRUE(tally.server_faults().empty())
      << tally.server_faults().size() << " server faults, e.g. " << tally.server_faults()[0];
  EXPECT_TRUE(server.Stop().ok());
}

}  // namespace
}  // namespace te::testing
