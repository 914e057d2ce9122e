#include "server/session/shm_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace te::session {
namespace {

// A client's shm object, removed at the end of the test.
class ClientObject {
 public:
  explicit ClientObject(size_t size)
      : name_(absl::StrCat("/te_shm_region_test_", getpid(), "_", counter_++)) {
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
  }
  ~ClientObject() {
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  int fd() const { return fd_; }

 private:
  static inline int counter_ = 0;
  std::string name_;
  int fd_ = -1;
};

std::vector<char> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> bytes(n);
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

TEST(ShmRegionTest, ReadsAndWritesWhatTheClientSees) {
  ClientObject object(1 << 16);
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Open(object.name(), 1 << 16);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ((*region)->size(), 1u << 16);
  const std::vector<char> written = RandomBytes(1000, 1);
  ASSERT_TRUE((*region)->Write(123, written.data(), written.size()).ok());
  std::vector<char> seen(1000);
  ASSERT_EQ(pread(object.fd(), seen.data(), seen.size(), 123), 1000);
  EXPECT_EQ(seen, written);

  const std::vector<char> from_client = RandomBytes(500, 2);
  ASSERT_EQ(pwrite(object.fd(), from_client.data(), from_client.size(), 4000), 500);
  std::vector<char> read(500);
  ASSERT_TRUE((*region)->Read(4000, read.data(), read.size()).ok());
  EXPECT_EQ(read, from_client);
}

TEST(ShmRegionTest, CheckRangeRejectsWhatPassesTheEnd) {
  ClientObject object(4096);
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Open(object.name(), 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_TRUE((*region)->CheckRange(0, 4096, "x.shm").ok());
  EXPECT_TRUE((*region)->CheckRange(4096, 0, "x.shm").ok());
  const absl::Status past = (*region)->CheckRange(4000, 97, "x.shm");
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.message().find("x.shm"), std::string::npos) << past;
  EXPECT_EQ((*region)->CheckRange(5000, 0, "x").code(), absl::StatusCode::kInvalidArgument);
  // An offset near 2^64 must not wrap around into the region.
  EXPECT_EQ((*region)->CheckRange(~uint64_t{0} - 10, 100, "x").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShmRegionTest, ObjectSmallerThanAskedIsInvalid) {
  ClientObject object(4096);
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Open(object.name(), 8192);
  ASSERT_EQ(region.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(region.status().message().find("holds only 4096"), std::string::npos)
      << region.status();
  EXPECT_EQ(ShmRegion::Open(object.name(), 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmRegionTest, MissingObjectIsNotFound) {
  EXPECT_EQ(ShmRegion::Open("/te_shm_region_test_no_such_object", 10).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ShmRegionTest, ShrunkObjectFailsTheCopyInsteadOfTheServer) {
  ClientObject object(1 << 20);
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Open(object.name(), 1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_EQ(ftruncate(object.fd(), 0), 0);
  std::vector<char> buffer(1 << 20);
  EXPECT_EQ((*region)->Read(0, buffer.data(), buffer.size()).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*region)->Write(4096, buffer.data(), 100).code(),
            absl::StatusCode::kFailedPrecondition);
  // Grown back, the mapping works again.
  ASSERT_EQ(ftruncate(object.fd(), 1 << 20), 0);
  EXPECT_TRUE((*region)->Read(0, buffer.data(), buffer.size()).ok());
}

class ShmNameTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ShmNameTest, IsRejected) {
  const absl::Status status = CheckShmName(GetParam(), "name");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << GetParam();
  EXPECT_EQ(ShmRegion::Open(GetParam(), 10).status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(BadNames, ShmNameTest,
                         ::testing::Values("", "/", "noslash", "/a/b", "/..", "/../etc/passwd",
                                           "/a..b", "/.", "/with space", "/semi;colon", "//double",
                                           "/" + std::string(201, 'a'),
                                           std::string("/nul\0byte", 9)));

TEST(ShmNameTest, GoodNamesPass) {
  EXPECT_TRUE(CheckShmName("/te_client_1234_0", "name").ok());
  EXPECT_TRUE(CheckShmName("/a.b-c_D9", "name").ok());
  EXPECT_TRUE(CheckShmName("/" + std::string(200, 'z'), "name").ok());
}

}  // namespace
}  // namespace te::session
