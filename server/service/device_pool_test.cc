#include "server/service/device_pool.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te::service {
namespace {

TEST(ParseDeviceListTest, ListsInOrder) {
  auto names = ParseDeviceList("cuda:1,cpu, cuda:0");
  ASSERT_TRUE(names.ok()) << names.status();
  EXPECT_EQ(*names, (std::vector<std::string>{"cuda:1", "cpu", "cuda:0"}));
}

TEST(ParseDeviceListTest, RejectsMalformedAndRepeatedEntries) {
  for (const std::string flag : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:01", "cpu,",
                                 "cpu,cpu", "cuda:0,cuda:0", "cpu,all", "auto,cpu"}) {
    EXPECT_EQ(ParseDeviceList(flag).status().code(), absl::StatusCode::kInvalidArgument)
        << "--device=" << flag;
  }
  const absl::Status twice = ParseDeviceList("cuda:0,cuda:0").status();
  EXPECT_NE(twice.message().find("cuda:0 is listed twice"), std::string::npos) << twice;
}

TEST(LeastLoadedTest, FewestSessionsThenLeastMemoryThenLowestIndex) {
  EXPECT_EQ(LeastLoaded({{2, 0}, {1, 1 << 30}, {3, 0}}), 1);
  EXPECT_EQ(LeastLoaded({{1, 500}, {1, 100}, {1, 300}}), 1);
  EXPECT_EQ(LeastLoaded({{1, 100}, {1, 100}}), 0);
  EXPECT_EQ(LeastLoaded({{0, 0}}), 0);
}

// A device that is only a name and a health flag, for placement.
class NamedDevice : public Device {
 public:
  explicit NamedDevice(std::string name, std::shared_ptr<bool> healthy = nullptr)
      : name_(std::move(name)), healthy_(std::move(healthy)) {}
  bool healthy() const override { return healthy_ == nullptr || *healthy_; }
  DeviceInfo info() const override {
    DeviceInfo info;
    info.name = name_;
    return info;
  }
  absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t) override {
    return absl::UnimplementedError("placement only");
  }

 private:
  std::string name_;
  std::shared_ptr<bool> healthy_;
};

DevicePool TwoDevices() {
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(std::make_unique<NamedDevice>("cuda:0"));
  devices.push_back(std::make_unique<NamedDevice>("cuda:1"));
  return DevicePool(std::move(devices), {/*threads=*/1, /*max_queued=*/4, ""});
}

TEST(DevicePoolTest, PlacesOnTheLeastLoadedUnlessAsked) {
  DevicePool pool = TwoDevices();
  ASSERT_EQ(pool.size(), 2);
  EXPECT_EQ(pool.name(1), "cuda:1");
  EXPECT_EQ(pool.executor(1).options().name, "cuda:1");
  EXPECT_EQ(*pool.Place("", {{3, 0}, {2, 0}}), 1);
  EXPECT_EQ(*pool.Place("cuda:0", {{3, 0}, {2, 0}}), 0);
  const absl::Status missing = pool.Place("cuda:7", {{0, 0}, {0, 0}}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("'cuda:0', 'cuda:1'"), std::string::npos) << missing;
}

TEST(DevicePoolTest, AFaultedDeviceTakesNoNewSessionsAndTheOtherGoesOn) {
  auto healthy0 = std::make_shared<bool>(true);
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(std::make_unique<NamedDevice>("cuda:0", healthy0));
  devices.push_back(std::make_unique<NamedDevice>("cuda:1"));
  DevicePool pool(std::move(devices), {/*threads=*/1, /*max_queued=*/4, ""});
  // cuda:0 is the least loaded, until it faults.
  EXPECT_EQ(*pool.Place("", {{0, 0}, {5, 1 << 20}}), 0);
  EXPECT_EQ(pool.UnhealthyNames(), "");
  *healthy0 = false;
  EXPECT_EQ(*pool.Place("", {{0, 0}, {5, 1 << 20}}), 1);
  EXPECT_EQ(*pool.Place("cuda:1", {{0, 0}, {5, 1 << 20}}), 1);
  const absl::Status asked = pool.Place("cuda:0", {{0, 0}, {5, 1 << 20}}).status();
  EXPECT_EQ(asked.code(), absl::StatusCode::kUnavailable) << asked;
  EXPECT_NE(asked.message().find("cuda:0 hit a sticky error"), std::string::npos) << asked;
  EXPECT_EQ(pool.UnhealthyNames(), "cuda:0");

  const std::vector<HealthEntry> health = pool.Health("te.v1.TeService");
  ASSERT_EQ(health.size(), 4u);
  EXPECT_EQ(health[0].service, "cuda:0");
  EXPECT_FALSE(health[0].serving);
  EXPECT_EQ(health[1].service, "cuda:1");
  EXPECT_TRUE(health[1].serving);
  EXPECT_EQ(health[2].service, "");
  EXPECT_TRUE(health[2].serving);  // cuda:1 still serves its sessions
  EXPECT_EQ(health[3].service, "te.v1.TeService");
  EXPECT_TRUE(health[3].serving);
}

TEST(DevicePoolTest, NoHealthyDeviceIsNotServing) {
  auto healthy = std::make_shared<bool>(false);
  std::vector<std::unique_ptr<Device>> devices;
  devices.push_back(std::make_unique<NamedDevice>("cuda:0", healthy));
  DevicePool pool(std::move(devices), {/*threads=*/1, /*max_queued=*/4, ""});
  const absl::Status placed = pool.Place("", {{0, 0}}).status();
  EXPECT_EQ(placed.code(), absl::StatusCode::kUnavailable) << placed;
  for (const HealthEntry& entry : pool.Health("te.v1.TeService")) {
    EXPECT_FALSE(entry.serving) << "'" << entry.service << "'";
  }
}

TEST(ParseFaultInjectionsTest, CudaDevicesWithLaunchCounts) {
  auto faults = ParseFaultInjections("cuda:1@200, cuda:0@0");
  ASSERT_TRUE(faults.ok()) << faults.status();
  ASSERT_EQ(faults->size(), 2u);
  EXPECT_EQ((*faults)[0].device, "cuda:1");
  EXPECT_EQ((*faults)[0].after_launches, 200);
  EXPECT_EQ((*faults)[1].device, "cuda:0");
  EXPECT_EQ((*faults)[1].after_launches, 0);
  EXPECT_TRUE(ParseFaultInjections("")->empty());
  for (const std::string flag : {"cuda:0", "cuda:0@", "cuda:0@-1", "cuda:0@x", "cpu@3", "gpu@3",
                                 "cuda:01@3", "cuda:0@1,cuda:0@2", "@5"}) {
    const absl::Status status = ParseFaultInjections(flag).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(status.message().find("--inject_device_fault"), std::string::npos) << status;
  }
}

TEST(DevicePoolTest, AFaultOnADeviceNotServedIsRefused) {
  DeviceOpenOptions open;
  open.faults = {{"cuda:3", 10}};
  const absl::Status status = DevicePool::Open("cpu", {2, 8, ""}, open).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("cuda:3"), std::string::npos) << status;
}

TEST(DevicePoolTest, OpensTheCpu) {
  auto pool = DevicePool::Open("cpu", {/*threads=*/2, /*max_queued=*/8, ""});
  ASSERT_TRUE(pool.ok()) << pool.status();
  ASSERT_EQ((*pool)->size(), 1);
  EXPECT_EQ((*pool)->name(0), "cpu");
  EXPECT_EQ((*pool)->Find("cpu"), 0);
  EXPECT_EQ((*pool)->Find("cuda:0"), -1);
}

}  // namespace
}  // namespace te::service
