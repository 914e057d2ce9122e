// SessionManager: restored sessions (contract 6), the server's own lease, and
// on_removed (contract 7).
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "server/security/secrets.h"
#include "server/session/session_manager.h"

namespace te::session {
namespace {

// The manager never looks inside a Session: a reference owning a probe will do.
std::shared_ptr<Session> FakeSession() {
  return std::shared_ptr<Session>(std::make_shared<int>(0), static_cast<Session*>(nullptr));
}

absl::StatusOr<std::shared_ptr<Session>> MakeFake(const std::string&) { return FakeSession(); }

constexpr char kRestoredId[] = "0123456789abcdef0123456789abcdef";
constexpr char kRestoredToken[] = "fedcba9876543210fedcba9876543210";

TEST(SessionManagerRestoreTest, RestoredSessionAcceptsItsOldTokenOnly) {
  SessionManager manager(SessionManagerOptions{});
  absl::StatusOr<security::TokenDigest> digest = security::TokenDigest::Of(kRestoredToken);
  ASSERT_TRUE(digest.ok());
  ASSERT_TRUE(manager.Restore(kRestoredId, *digest, absl::Seconds(60), FakeSession()).ok());
  EXPECT_EQ(manager.live_sessions(), 1);

  EXPECT_EQ(manager.Acquire(kRestoredId, "not the token").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(manager.Acquire(kRestoredId, "").status().code(), absl::StatusCode::kUnauthenticated);
  {
    absl::StatusOr<SessionManager::Lease> lease = manager.Acquire(kRestoredId, kRestoredToken);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_EQ(lease->id(), kRestoredId);
    EXPECT_EQ(lease->ttl(), absl::Seconds(60));
    EXPECT_TRUE(lease->token_digest().Matches(kRestoredToken));
  }
  // Once seen, the token is known: still accepted, and still the only one.
  EXPECT_TRUE(manager.Acquire(kRestoredId, kRestoredToken).ok());
  EXPECT_EQ(manager.Acquire(kRestoredId, "fedcba9876543210fedcba987654321f").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(SessionManagerRestoreTest, AnotherSessionsTokenIsPermissionDenied) {
  SessionManager manager(SessionManagerOptions{});
  absl::StatusOr<SessionManager::Identity> created = manager.Create(absl::ZeroDuration(), MakeFake);
  ASSERT_TRUE(created.ok());
  absl::StatusOr<security::TokenDigest> digest = security::TokenDigest::Of(kRestoredToken);
  ASSERT_TRUE(manager.Restore(kRestoredId, *digest, absl::Seconds(60), FakeSession()).ok());
  EXPECT_EQ(manager.Acquire(kRestoredId, created->token).status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(manager.Acquire(kRestoredId, kRestoredToken).ok());
  EXPECT_EQ(manager.Acquire(created->id, kRestoredToken).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(SessionManagerRestoreTest, RestoreRefusesDuplicatesBadDigestsAndOverflow) {
  SessionManagerOptions options;
  options.max_sessions = 1;
  SessionManager manager(options);
  absl::StatusOr<security::TokenDigest> digest = security::TokenDigest::Of(kRestoredToken);
  ASSERT_TRUE(manager.Restore(kRestoredId, *digest, absl::Seconds(60), FakeSession()).ok());
  EXPECT_EQ(manager.Restore(kRestoredId, *digest, absl::Seconds(60), FakeSession()).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(
      manager.Restore("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", *digest, absl::Seconds(60), FakeSession())
          .code(),
      absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager
                .Restore("bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", security::TokenDigest{},
                         absl::Seconds(60), FakeSession())
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SessionManagerRestoreTest, ServerLeaseNeedsNoTokenButALiveSession) {
  SessionManager manager(SessionManagerOptions{});
  absl::StatusOr<SessionManager::Identity> created = manager.Create(absl::ZeroDuration(), MakeFake);
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(manager.live_ids(), std::vector<std::string>{created->id});
  {
    absl::StatusOr<SessionManager::Lease> lease = manager.AcquireForServer(created->id);
    ASSERT_TRUE(lease.ok()) << lease.status();
    EXPECT_TRUE(lease->token_digest().Matches(created->token));
    // The server's lease is a call like any other: no second one meanwhile.
    EXPECT_EQ(manager.Acquire(created->id, created->token).status().code(),
              absl::StatusCode::kInternal);
  }
  EXPECT_EQ(manager.AcquireForServer("ffffffffffffffffffffffffffffffff").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(SessionManagerRestoreTest, OnRemovedHearsOfCloseAndEvict) {
  absl::Mutex mu;
  std::vector<std::string> removed;
  SessionManagerOptions options;
  options.on_removed = [&](const std::string& id) {
    absl::MutexLock lock(&mu);
    removed.push_back(id);
  };
  SessionManager manager(options);
  absl::StatusOr<SessionManager::Identity> a = manager.Create(absl::ZeroDuration(), MakeFake);
  absl::StatusOr<SessionManager::Identity> b = manager.Create(absl::ZeroDuration(), MakeFake);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(manager.Close(a->id, a->token).ok());
  ASSERT_TRUE(manager.Evict(b->id, "operator").ok());
  absl::MutexLock lock(&mu);
  EXPECT_EQ(removed, (std::vector<std::string>{a->id, b->id}));
}

}  // namespace
}  // namespace te::session
