// CheckpointStore on the CPU backend: a session saved and restored into a new
// manager comes back bit for bit (params, FP8 state, kept gradients) and
// accepts its old token only; damaged checkpoints are refused and kept;
// interrupted saves leave the previous checkpoint whole; paths never come
// from outside.
#include "server/session/checkpoint.h"

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kHidden = 16;
constexpr int64_t kFeatures = 8;
const std::vector<int64_t> kInputShape = {2, 4, kHidden};

std::string NewStateDir() {
  static int count = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/state_", count++);
  fs::remove_all(dir);
  return dir;
}

te::v1::Tensor RandomTensor(const std::vector<int64_t>& shape, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = normal(rng);
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  tensor.mutable_shape()->Assign(shape.begin(), shape.end());
  tensor.set_inline_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

te::v1::Autocast DelayedScalingAutocast() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  te::v1::DelayedScaling* recipe = autocast.mutable_recipe()->mutable_delayed_scaling();
  recipe->set_amax_history_len(4);
  recipe->set_fp8_format(te::v1::HYBRID);
  return autocast;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCpuDevice();
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    config_.session_memory_bytes = 64 << 20;
    manager_ = std::make_unique<SessionManager>(SessionManagerOptions{});
    absl::StatusOr<std::unique_ptr<CheckpointStore>> store = CheckpointStore::Open(NewStateDir());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  // A session with one DenseGeneral initialised under FP8 autocast and two
  // training steps behind it (moved FP8 state, kept gradients).
  void MakeTrainedSession() {
    te::v1::CreateSessionResponse created;
    ASSERT_TRUE(OpenSession(te::v1::CreateSessionRequest(), device_.get(), config_, manager_.get(),
                            &created)
                    .ok());
    ref_ = created.session();
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok()) << lease.status();
    te::v1::InitLayerRequest init;
    init.mutable_spec()->mutable_dense_general()->add_features(kFeatures);
    init.set_seed(7);
    init.set_input_dtype(te::v1::FLOAT32);
    init.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
    *init.mutable_autocast() = DelayedScalingAutocast();
    te::v1::InitLayerResponse initialised;
    ASSERT_TRUE(lease->session().InitLayer(init, &initialised).ok());
    layer_id_ = initialised.layer_id();
    for (uint32_t step = 0; step < 2; ++step) {
      te::v1::ForwardBackwardRequest request;
      request.set_layer_id(layer_id_);
      *request.mutable_autocast() = DelayedScalingAutocast();
      te::v1::MicroBatch* batch = request.add_micro_batches();
      *batch->mutable_x() = RandomTensor(kInputShape, 100 + step);
      *batch->mutable_dy() = RandomTensor({2, 4, kFeatures}, 200 + step);
      te::v1::ForwardBackwardResponse response;
      absl::Status status = lease->session().ForwardBackward(request, &response);
      ASSERT_TRUE(status.ok()) << status;
    }
  }

  std::map<std::string, te::v1::Tensor> Variables(SessionManager& manager,
                                                  const std::string& token) {
    auto lease = manager.Acquire(ref_.session_id(), token);
    EXPECT_TRUE(lease.ok()) << lease.status();
    if (!lease.ok()) return {};
    te::v1::GetVariablesRequest request;
    request.set_layer_id(layer_id_);
    te::v1::GetVariablesResponse response;
    EXPECT_TRUE(lease->session().GetVariables(request, &response).ok());
    std::map<std::string, te::v1::Tensor> variables;
    for (const te::v1::Variable& v : response.variables()) {
      variables[absl::StrCat(v.collection(), "/", v.path())] = v.value();
    }
    return variables;
  }

  absl::StatusOr<CheckpointStore::Written> Save() {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    if (!lease.ok()) return lease.status();
    return store_->Save(*lease);
  }

  std::string SessionDir() const {
    return absl::StrCat(store_->state_dir(), "/", ref_.session_id());
  }

  std::unique_ptr<Device> device_;
  SessionConfig config_;
  std::unique_ptr<SessionManager> manager_;
  std::unique_ptr<CheckpointStore> store_;
  te::v1::SessionRef ref_;
  std::string layer_id_;
};

// The newest version is saved, under its number; the graphs AddGraph added
// keep their indices; version numbers continue after the highest made.
TEST_F(CheckpointTest, RestoreKeepsTheNewestVersionsNumberAndTheAddedGraphs) {
  MakeTrainedSession();  // versions 1 (init), 2 and 3 (the steps)
  te::v1::GraphSpec graph;
  te::v1::GraphSpec::Node* module = graph.add_nodes();
  module->add_inputs("x");
  module->add_outputs("h");
  module->mutable_module()->mutable_dense_general()->add_features(kFeatures);
  te::v1::GraphSpec::Node* scale = graph.add_nodes();
  scale->set_name("scale_0");
  scale->add_inputs("h");
  scale->add_outputs("y");
  scale->mutable_scale()->set_factor(2.0);
  graph.add_outputs("y");
  {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok());
    te::v1::AddGraphRequest add;
    add.set_layer_id(layer_id_);
    *add.mutable_graph() = graph;
    add.set_input_dtype(te::v1::FLOAT32);
    add.mutable_input_shape()->Assign(kInputShape.begin(), kInputShape.end());
    te::v1::AddGraphResponse added;
    ASSERT_TRUE(lease->session().AddGraph(add, &added).ok());
    EXPECT_EQ(added.graph(), 1);
    te::v1::ReleaseVersionsRequest release;
    release.set_layer_id(layer_id_);
    release.add_versions(3);  // the newest retained is now 2
    ASSERT_TRUE(lease->session().ReleaseVersions(release).ok());
  }
  const std::map<std::string, te::v1::Tensor> before = Variables(*manager_, ref_.token());
  ASSERT_TRUE(Save().ok());
  SessionManager restarted{SessionManagerOptions{}};
  ASSERT_EQ(store_->RestoreAll(device_.get(), config_, &restarted).restored, 1);
  auto lease = restarted.Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok());
  te::v1::GetVariablesRequest get;
  get.set_layer_id(layer_id_);
  get.set_version(2);
  te::v1::GetVariablesResponse got;
  ASSERT_TRUE(lease->session().GetVariables(get, &got).ok());
  EXPECT_EQ(got.version(), 2);
  for (const te::v1::Variable& v : got.variables()) {
    EXPECT_EQ(v.value().inline_data(), before.at(v.collection() + "/" + v.path()).inline_data());
  }
  get.set_version(1);
  EXPECT_EQ(lease->session().GetVariables(get, &got).code(), absl::StatusCode::kNotFound);
  te::v1::ForwardRequest forward;
  forward.set_layer_id(layer_id_);
  *forward.mutable_x() = RandomTensor(kInputShape, 9);
  te::v1::ForwardResponse plain, doubled;
  ASSERT_TRUE(lease->session().Forward(forward, &plain).ok());
  forward.set_graph(1);
  ASSERT_TRUE(lease->session().Forward(forward, &doubled).ok());
  std::vector<float> p(plain.y().inline_data().size() / 4), d(p.size());
  std::memcpy(p.data(), plain.y().inline_data().data(), p.size() * 4);
  std::memcpy(d.data(), doubled.y().inline_data().data(), d.size() * 4);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_EQ(d[i], 2.0f * p[i]) << i;
  // The next version is 4: 3 was made (and released) before the save.
  te::v1::SetVariablesRequest set;
  set.set_layer_id(layer_id_);
  te::v1::Variable* bias = set.add_variables();
  bias->set_collection("params");
  bias->set_path("bias");
  *bias->mutable_value() = RandomTensor({kFeatures}, 3);
  te::v1::SetVariablesResponse made;
  ASSERT_TRUE(lease->session().SetVariables(set, &made).ok());
  EXPECT_EQ(made.version(), 4);
}

// A layer initialised with decode saves its cache (collection cache) with
// its params, and the restored layer decodes on from where it was: the same
// next row as the original session gives.
TEST_F(CheckpointTest, ACacheComesBackAndDecodesOn) {
  te::v1::CreateSessionResponse created;
  ASSERT_TRUE(OpenSession(te::v1::CreateSessionRequest(), device_.get(), config_, manager_.get(),
                          &created)
                  .ok());
  ref_ = created.session();
  const std::vector<int64_t> shape = {2, 5, kHidden};
  auto token = [&](uint32_t seed) { return RandomTensor({2, 1, kHidden}, seed); };
  te::v1::ForwardRequest step;
  step.set_decode(true);
  step.set_deterministic(true);
  {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok());
    te::v1::InitLayerRequest init;
    te::v1::MultiHeadAttention* mha = init.mutable_spec()->mutable_multi_head_attention();
    mha->set_head_dim(4);
    mha->set_num_attention_heads(4);
    mha->set_enable_rotary_pos_emb(true);
    init.set_seed(3);
    init.set_input_dtype(te::v1::FLOAT32);
    init.mutable_input_shape()->Assign(shape.begin(), shape.end());
    init.set_decode(true);
    te::v1::InitLayerResponse initialised;
    ASSERT_TRUE(lease->session().InitLayer(init, &initialised).ok());
    layer_id_ = initialised.layer_id();
    step.set_layer_id(layer_id_);
    for (uint32_t t = 0; t < 2; ++t) {
      *step.mutable_x() = token(40 + t);
      te::v1::ForwardResponse y;
      const absl::Status status = lease->session().Forward(step, &y);
      ASSERT_TRUE(status.ok()) << status;
    }
  }
  const std::map<std::string, te::v1::Tensor> before = Variables(*manager_, ref_.token());
  ASSERT_EQ(before.count("cache/cached_key"), 1u);
  ASSERT_TRUE(Save().ok());
  SessionManager restarted{SessionManagerOptions{}};
  ASSERT_EQ(store_->RestoreAll(device_.get(), config_, &restarted).restored, 1);
  const std::map<std::string, te::v1::Tensor> after = Variables(restarted, ref_.token());
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, tensor] : before) {
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name;
  }
  int32_t index = -1;
  std::memcpy(&index, after.at("cache/cache_index").inline_data().data(), sizeof(index));
  EXPECT_EQ(index, 2);
  *step.mutable_x() = token(42);
  te::v1::ForwardResponse original, restored;
  {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok());
    ASSERT_TRUE(lease->session().Forward(step, &original).ok());
  }
  auto lease = restarted.Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok());
  const absl::Status status = lease->session().Forward(step, &restored);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(restored.y().inline_data(), original.y().inline_data());
  EXPECT_EQ(restored.version(), original.version());
}

TEST(IsSessionIdTest, OnlyServerIssuedForm) {
  EXPECT_TRUE(IsSessionId("0123456789abcdef0123456789abcdef"));
  EXPECT_FALSE(IsSessionId("0123456789ABCDEF0123456789abcdef"));
  EXPECT_FALSE(IsSessionId("../../../../etc/passwd0000000000"));
  EXPECT_FALSE(IsSessionId("0123456789abcdef"));
  EXPECT_FALSE(IsSessionId(""));
}

TEST_F(CheckpointTest, RestoredSessionIsBitForBitAndKeepsItsToken) {
  MakeTrainedSession();
  const std::map<std::string, te::v1::Tensor> before = Variables(*manager_, ref_.token());
  ASSERT_GT(before.count("fp8_metas/x_amax_history"), 0u);
  ASSERT_GT(before.count("grads/kernel"), 0u);
  absl::StatusOr<CheckpointStore::Written> written = Save();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->path, absl::StrCat(ref_.session_id(), "/session.pb"));
  EXPECT_GT(written->bytes, kHidden * kFeatures * 4 * 2);

  // A new server: new manager, same state_dir.
  SessionManager restarted{SessionManagerOptions{}};
  CheckpointStore::RestoreReport report = store_->RestoreAll(device_.get(), config_, &restarted);
  EXPECT_EQ(report.restored, 1);
  EXPECT_EQ(report.failed, 0);
  EXPECT_EQ(
      restarted.Acquire(ref_.session_id(), "0000000000000000000000000000000f").status().code(),
      absl::StatusCode::kUnauthenticated);
  const std::map<std::string, te::v1::Tensor> after = Variables(restarted, ref_.token());
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, tensor] : before) {
    ASSERT_GT(after.count(name), 0u) << name;
    EXPECT_EQ(after.at(name).shape_size(), tensor.shape_size()) << name;
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name << " differs";
  }

  // The restored layer still trains, and new ids do not collide with old ones.
  auto lease = restarted.Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok());
  te::v1::ForwardRequest forward;
  forward.set_layer_id(layer_id_);
  *forward.mutable_x() = RandomTensor(kInputShape, 9);
  *forward.mutable_autocast() = DelayedScalingAutocast();
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  ASSERT_TRUE(lease->session().Forward(forward, &y).ok());
  te::v1::InitLayerRequest init;
  init.mutable_spec()->mutable_dense_general()->add_features(4);
  init.set_input_dtype(te::v1::FLOAT32);
  init.add_input_shape(3);
  init.add_input_shape(kHidden);
  te::v1::InitLayerResponse second;
  ASSERT_TRUE(lease->session().InitLayer(init, &second).ok());
  EXPECT_NE(second.layer_id(), layer_id_);
}

TEST_F(CheckpointTest, FilesArePrivateAndOldGenerationsGo) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  // Leftovers of an interrupted save: a stray data file and a temp manifest.
  std::ofstream(SessionDir() + "/variables-00000000deadbeef.bin") << "partial";
  std::ofstream(SessionDir() + "/session.pb.tmp") << "partial";
  ASSERT_TRUE(Save().ok());
  std::vector<std::string> names;
  for (const auto& file : fs::directory_iterator(SessionDir())) {
    names.push_back(file.path().filename().string());
    struct stat info;
    ASSERT_EQ(stat(file.path().c_str(), &info), 0);
    EXPECT_EQ(info.st_mode & 0077, 0u) << file.path() << " is readable by others";
  }
  ASSERT_EQ(names.size(), 2u);  // session.pb and one data file
}

TEST_F(CheckpointTest, InterruptedSaveLeavesThePreviousCheckpoint) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  const std::map<std::string, te::v1::Tensor> saved = Variables(*manager_, ref_.token());
  // A crash after the data file, before the manifest's rename.
  std::ofstream(SessionDir() + "/variables-0123456789abcdef.bin") << "new data, never committed";
  std::ofstream(SessionDir() + "/session.pb.tmp") << "half a manifest";
  SessionManager restarted{SessionManagerOptions{}};
  ASSERT_TRUE(store_->Restore(ref_.session_id(), device_.get(), config_, &restarted).ok());
  EXPECT_EQ(Variables(restarted, ref_.token()).at("params/kernel").inline_data(),
            saved.at("params/kernel").inline_data());
}

TEST_F(CheckpointTest, DamagedDataIsDataLossAndKept) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  std::string data_file;
  for (const auto& file : fs::directory_iterator(SessionDir())) {
    if (file.path().extension() == ".bin") data_file = file.path();
  }
  ASSERT_FALSE(data_file.empty());
  {
    std::fstream f(data_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5);
    f.put('\x7f');  // one flipped byte: same size, wrong checksum
  }
  SessionManager restarted{SessionManagerOptions{}};
  EXPECT_EQ(store_->Restore(ref_.session_id(), device_.get(), config_, &restarted).code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(restarted.live_sessions(), 0);
  fs::resize_file(data_file, 3);
  CheckpointStore::RestoreReport report = store_->RestoreAll(device_.get(), config_, &restarted);
  EXPECT_EQ(report.failed, 1);
  EXPECT_TRUE(fs::exists(data_file));
  // Its client hears why, not a bare NOT_FOUND.
  const absl::Status gone = restarted.Acquire(ref_.session_id(), ref_.token()).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kDataLoss) << gone;
  EXPECT_NE(gone.message().find("could not be restored from its checkpoint"), std::string::npos)
      << gone;
}

TEST_F(CheckpointTest, ManifestOfAnotherSessionIsRefused) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  const std::string other = absl::StrCat(store_->state_dir(), "/ffffffffffffffffffffffffffffffff");
  fs::create_directory(other);
  fs::copy_file(SessionDir() + "/session.pb", other + "/session.pb");
  SessionManager restarted{SessionManagerOptions{}};
  EXPECT_EQ(store_->Restore("ffffffffffffffffffffffffffffffff", device_.get(), config_, &restarted)
                .code(),
            absl::StatusCode::kDataLoss);
}

TEST_F(CheckpointTest, RemoveDeletesAndRefusesForeignNames) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  ASSERT_TRUE(fs::exists(SessionDir()));
  EXPECT_EQ(store_->Remove("..").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Remove("../state_0").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store_->Remove(ref_.session_id()).ok());
  EXPECT_FALSE(fs::exists(SessionDir()));
  EXPECT_TRUE(store_->Remove(ref_.session_id()).ok());  // already gone: fine
  SessionManager restarted{SessionManagerOptions{}};
  EXPECT_EQ(store_->Restore(ref_.session_id(), device_.get(), config_, &restarted).code(),
            absl::StatusCode::kNotFound);
}

// A session evicted while its lease writes a checkpoint: the eviction's
// Remove must win, or the session comes back at the next start.
TEST_F(CheckpointTest, SaveOfASessionRemovedMeanwhileLeavesNothing) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(store_->Remove(ref_.session_id()).ok());
  EXPECT_EQ(store_->Save(*lease).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(SessionDir()));
  SessionManager restarted{SessionManagerOptions{}};
  EXPECT_EQ(store_->Restore(ref_.session_id(), device_.get(), config_, &restarted).code(),
            absl::StatusCode::kNotFound);
}

// The same with the Remove landing anywhere inside a save: saves run back to
// back on one thread while another removes; afterwards nothing is on disk.
TEST_F(CheckpointTest, RemoveRacingSavesLeavesNothing) {
  MakeTrainedSession();
  std::atomic<bool> removed{false};
  int saved_after_remove = 0;
  std::thread saver([&] {
    auto lease = manager_->Acquire(ref_.session_id(), ref_.token());
    ASSERT_TRUE(lease.ok()) << lease.status();
    for (int i = 0; i < 200; ++i) {
      const bool was_removed = removed.load();
      absl::StatusOr<CheckpointStore::Written> written = store_->Save(*lease);
      if (was_removed && written.ok()) ++saved_after_remove;
      if (was_removed && !written.ok()) break;
    }
  });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(store_->Remove(ref_.session_id()).ok());
  removed.store(true);
  saver.join();
  EXPECT_EQ(saved_after_remove, 0);
  EXPECT_FALSE(fs::exists(SessionDir()));
}

TEST_F(CheckpointTest, RestoreAsksForTheDeviceItWasSavedOn) {
  MakeTrainedSession();
  ASSERT_TRUE(Save().ok());
  std::vector<std::string> asked;
  SessionManager restarted{SessionManagerOptions{}};
  CheckpointStore::RestoreReport report = store_->RestoreAll(
      [&](const std::string& saved_on) {
        asked.push_back(saved_on);
        return device_.get();
      },
      config_, &restarted);
  EXPECT_EQ(report.restored, 1);
  EXPECT_EQ(asked, std::vector<std::string>{"cpu"});
}

TEST(CheckpointStoreOpenTest, RefusesAFile) {
  const std::string path = NewStateDir();
  std::ofstream(path) << "a file";
  EXPECT_EQ(CheckpointStore::Open(path).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace te::session
