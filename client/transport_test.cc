#include "client/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

TEST(TransportTest, AutoGoesInlineThenSharedMemoryThenStreams) {
  int asked = 0;
  auto yes = [&] {
    ++asked;
    return true;
  };
  auto no = [&] {
    ++asked;
    return false;
  };
  EXPECT_EQ(Choose(Transport::kAuto, 1 << 20, 1 << 20, yes), Transport::kInline);
  EXPECT_EQ(asked, 0);  // small tensors never probe
  EXPECT_EQ(Choose(Transport::kAuto, (1 << 20) + 1, 1 << 20, yes), Transport::kSharedMemory);
  EXPECT_EQ(Choose(Transport::kAuto, 64 << 20, 1 << 20, no), Transport::kStream);
  EXPECT_EQ(asked, 2);
  for (Transport forced : {Transport::kInline, Transport::kStream, Transport::kSharedMemory}) {
    EXPECT_EQ(Choose(forced, 10, 1 << 20, no), forced);
    EXPECT_EQ(Choose(forced, 100 << 20, 1 << 20, no), forced);
  }
}

TEST(TransportTest, NamesRoundTrip) {
  for (Transport t :
       {Transport::kAuto, Transport::kInline, Transport::kStream, Transport::kSharedMemory}) {
    EXPECT_EQ(*ParseTransport(TransportName(t)), t);
  }
  EXPECT_EQ(ParseTransport("udp").status().code(), absl::StatusCode::kInvalidArgument);
}

// Plays the server: opens each registered object by name, as te_server does.
class FakeServer {
 public:
  ~FakeServer() {
    for (auto& [id, region] : regions_) munmap(region.first, region.second);
  }
  SharedMemoryPool::Registrar Registrar() {
    return [this](const std::string& name, uint64_t size) -> absl::StatusOr<std::string> {
      ++registrations;
      if (!refusal.ok()) return refusal;
      const int fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd < 0) return absl::NotFoundError(name);
      void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      const std::string id = absl::StrCat("region-", ++next_);
      regions_[id] = {static_cast<char*>(base), size};
      return id;
    };
  }
  char* Base(const std::string& id) { return regions_.at(id).first; }
  absl::Status refusal;
  int registrations = 0;

 private:
  int next_ = 0;
  std::map<std::string, std::pair<char*, size_t>> regions_;
};

TEST(SharedMemoryPoolTest, BlocksAreSeenByTheServerAtTheirOffsets) {
  FakeServer server;
  SharedMemoryPool pool(server.Registrar(), 1 << 20);
  absl::StatusOr<SharedMemoryPool::Block> a = pool.Allocate(1000);
  absl::StatusOr<SharedMemoryPool::Block> b = pool.Allocate(5000);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->region_id, b->region_id);
  EXPECT_EQ(a->offset % 4096, 0u);
  EXPECT_EQ(b->offset % 4096, 0u);
  EXPECT_GE(b->offset, a->offset + 1000);
  std::memset(b->data, 0x5a, 5000);
  EXPECT_EQ(server.Base(b->region_id)[b->offset + 4999], 0x5a);
  auto view = pool.View(b->region_id, b->offset, 5000);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(*view, b->data);
  EXPECT_EQ(pool.View(b->region_id, (1 << 20) - 10, 11).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.registrations, 1);
}

TEST(SharedMemoryPoolTest, FreedBlocksAreReusedAndLargeOnesGetARegion) {
  FakeServer server;
  SharedMemoryPool pool(server.Registrar(), 1 << 20, /*max_regions=*/2);
  auto a = pool.Allocate(600 << 10);
  ASSERT_TRUE(a.ok());
  auto b = pool.Allocate(600 << 10);  // does not fit beside a: a second region
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->region_id, b->region_id);
  EXPECT_EQ(pool.Allocate(600 << 10).status().code(), absl::StatusCode::kResourceExhausted);
  pool.Free(*a);
  auto c = pool.Allocate(1 << 20);  // the freed space coalesced back to a whole region
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->region_id, a->region_id);
  EXPECT_EQ(server.registrations, 2);
}

TEST(SharedMemoryPoolTest, ARefusalIsRememberedAndNotRetried) {
  FakeServer server;
  server.refusal = absl::FailedPreconditionError("shared memory disabled (--enable_shm)");
  SharedMemoryPool pool(server.Registrar(), 1 << 20);
  const absl::Status probe = pool.Probe();
  EXPECT_EQ(probe.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(probe.message().find("--enable_shm"), std::string::npos) << probe;
  EXPECT_FALSE(pool.available());
  EXPECT_EQ(pool.Allocate(10).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(server.registrations, 1);
}

TEST(SharedMemoryPoolTest, ATransientErrorIsRetried) {
  FakeServer server;
  server.refusal = absl::UnavailableError("connection reset");
  SharedMemoryPool pool(server.Registrar(), 1 << 20);
  EXPECT_EQ(pool.Allocate(10).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(pool.available());
  server.refusal = absl::OkStatus();
  EXPECT_TRUE(pool.Allocate(10).ok());
  EXPECT_EQ(server.registrations, 2);
}

TEST(SharedMemoryPoolTest, ObjectsAreUnlinkedOnceRegistered) {
  std::vector<std::string> names;
  SharedMemoryPool pool(
      [&](const std::string& name, uint64_t) -> absl::StatusOr<std::string> {
        names.push_back(name);
        return std::string("region-1");
      },
      4096);
  ASSERT_TRUE(pool.Probe().ok());
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(names[0].rfind("/te_client_", 0), 0u) << names[0];
  EXPECT_LT(shm_open(names[0].c_str(), O_RDONLY, 0), 0);  // gone from /dev/shm
}

}  // namespace
}  // namespace te::client
