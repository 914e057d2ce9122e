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

// A device that is only a name, for placement.
class NamedDevice : public Device {
 public:
  explicit NamedDevice(std::string name) : name_(std::move(name)) {}
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
