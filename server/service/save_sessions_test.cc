// TeService::SaveAllSessions, the save at shutdown: each session is saved as
// a call in its own executor turn, so a call of the session still running
// ends first, and a session whose turn does not come by the deadline is not
// saved (the others are). On the fake backend: no kernels needed.
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/service/device_pool.h"
#include "server/service/service.h"
#include "server/session/checkpoint.h"
#include "server/service/executor.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"
#include "server/session/testing/fake_ops.h"

namespace te::service {
namespace {


class SaveAllSessionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::unique_ptr<Device>> devices;
    devices.push_back(std::make_unique<session::testing::FakeDevice>());
    ExecutorOptions executor;
    executor.threads = 2;
    pool_ = std::make_unique<DevicePool>(std::move(devices), executor);
    sessions_ = std::make_unique<session::SessionManager>(session::SessionManagerOptions{});
    const char* tmp = std::getenv("TEST_TMPDIR");
    state_dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/save_all_", getpid());
    std::filesystem::remove_all(state_dir_);
    absl::StatusOr<std::unique_ptr<session::CheckpointStore>> store =
        session::CheckpointStore::Open(state_dir_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
    ServiceOptions options;
    options.checkpoints = store_.get();
    service_ = std::make_unique<TeService>(pool_.get(), sessions_.get(), options);
    for (int i = 0; i < 2; ++i) ids_.push_back(OpenWithALayer());
  }

  std::string OpenWithALayer() {
    config_.session_memory_bytes = 16 << 20;
    te::v1::CreateSessionResponse created;
    EXPECT_TRUE(session::OpenSession(te::v1::CreateSessionRequest(), &pool_->device(0), config_,
                                     sessions_.get(), &created)
                    .ok());
    auto lease = sessions_->Acquire(created.session().session_id(), created.session().token());
    EXPECT_TRUE(lease.ok()) << lease.status();
    te::v1::InitLayerRequest init;
    init.mutable_spec()->mutable_dense_general()->add_features(4);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(2);
    init.add_input_shape(8);
    te::v1::InitLayerResponse layer;
    EXPECT_TRUE(lease->session().InitLayer(init, &layer).ok());
    return created.session().session_id();
  }

  // A call that holds `id`'s turn until `release` is notified.
  void HoldTurn(const std::string& id, absl::Notification* started,
                absl::Notification* release) {
    DeviceExecutor::Call call;
    call.key = id;
    call.run = [started, release](DeviceExecutor::Turn turn) {
      started->Notify();
      release->WaitForNotification();
    };
    call.drop = [](absl::Status) {};
    ASSERT_TRUE(pool_->executor(0).Submit(std::move(call)).ok());
    started->WaitForNotification();
  }

  bool Saved(const std::string& id) const {
    return std::filesystem::exists(absl::StrCat(state_dir_, "/", id, "/session.pb"));
  }

  // Before the pool: a held call's worker may still be inside
  // release_.WaitForNotification() when a test returns, so they must outlive
  // the pool's workers, which its destruction joins.
  absl::Notification started_, release_;
  session::SessionConfig config_;
  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<session::SessionManager> sessions_;
  std::string state_dir_;
  std::unique_ptr<session::CheckpointStore> store_;
  std::unique_ptr<TeService> service_;
  std::vector<std::string> ids_;
};

TEST_F(SaveAllSessionsTest, ARunningCallEndsBeforeItsSessionIsSaved) {
  HoldTurn(ids_[0], &started_, &release_);
  absl::Notification saved_all;
  int saved = 0;
  std::thread saver([&] {
    saved = service_->SaveAllSessions(absl::Now() + absl::Seconds(30));
    saved_all.Notify();
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(saved_all.HasBeenNotified());
  EXPECT_FALSE(Saved(ids_[0]));  // not while its call runs
  release_.Notify();
  saver.join();
  EXPECT_EQ(saved, 2);
  EXPECT_TRUE(Saved(ids_[0]));
  EXPECT_TRUE(Saved(ids_[1]));
}

TEST_F(SaveAllSessionsTest, ASessionWhoseTurnDoesNotComeByTheDeadlineIsNotSaved) {
  HoldTurn(ids_[0], &started_, &release_);
  const absl::Time start = absl::Now();
  EXPECT_EQ(service_->SaveAllSessions(start + absl::Milliseconds(200)), 1);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_FALSE(Saved(ids_[0]));
  EXPECT_TRUE(Saved(ids_[1]));
  release_.Notify();
}

TEST(SaveAllSessionsWithoutStateDirTest, SavesNothing) {
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(std::make_unique<session::testing::FakeDevice>());
  DevicePool pool(std::move(devices), ExecutorOptions{});
  session::SessionManager sessions(session::SessionManagerOptions{});
  TeService service(&pool, &sessions, ServiceOptions{});
  EXPECT_EQ(service.SaveAllSessions(absl::Now() + absl::Seconds(1)), 0);
}

}  // namespace
}  // namespace te::service
