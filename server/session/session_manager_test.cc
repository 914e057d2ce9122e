#include "server/session/session_manager.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace te::session {
namespace {

// The manager never looks inside a Session: these tests hand it a reference
// that owns a probe (aliasing constructor), so they can watch it being freed.
struct Probe {};

class FakeClock {
 public:
  absl::Time Now() {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1700000000);
};

class SessionManagerTest : public ::testing::Test {
 protected:
  SessionManagerTest() { Reset(SessionManagerOptions{}); }

  void Reset(SessionManagerOptions options) {
    manager_ = std::make_unique<SessionManager>(options, [this] { return clock_.Now(); });
  }

  // Creates a session whose state is a probe; `probe` observes its lifetime.
  SessionManager::Identity MakeSession(std::weak_ptr<Probe>* probe = nullptr,
                                       absl::Duration ttl = absl::ZeroDuration()) {
    auto identity = manager_->Create(ttl, [&](const std::string&) {
      auto owner = std::make_shared<Probe>();
      if (probe != nullptr) *probe = owner;
      return absl::StatusOr<std::shared_ptr<Session>>(
          std::shared_ptr<Session>(owner, static_cast<Session*>(nullptr)));
    });
    EXPECT_TRUE(identity.ok()) << identity.status();
    return *identity;
  }

  absl::StatusCode AcquireCode(const std::string& id, const std::string& token) {
    return manager_->Acquire(id, token).status().code();
  }

  FakeClock clock_;
  std::unique_ptr<SessionManager> manager_;
};

TEST_F(SessionManagerTest, IdsAndTokensAre128BitHexAndDistinct) {
  const auto a = MakeSession();
  const auto b = MakeSession();
  for (const std::string& s : {a.id, a.token, b.id, b.token}) {
    EXPECT_EQ(s.size(), 32u);
    EXPECT_EQ(s.find_first_not_of("0123456789abcdef"), std::string::npos) << s;
  }
  EXPECT_NE(a.id, b.id);
  EXPECT_NE(a.token, b.token);
  EXPECT_NE(a.id, a.token);
  EXPECT_EQ(a.ttl, absl::Seconds(1800));
}

TEST_F(SessionManagerTest, AuthenticationCodes) {
  const auto a = MakeSession();
  const auto b = MakeSession();
  EXPECT_EQ(AcquireCode(a.id, a.token), absl::StatusCode::kOk);
  EXPECT_EQ(AcquireCode(a.id, ""), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(AcquireCode(a.id, "00000000000000000000000000000000"),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(AcquireCode(a.id, a.token.substr(1)), absl::StatusCode::kUnauthenticated);
  // A real token, but of another session.
  EXPECT_EQ(AcquireCode(a.id, b.token), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AcquireCode(b.id, a.token), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(AcquireCode("ffffffffffffffffffffffffffffffff", a.token),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(AcquireCode("", a.token), absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionManagerTest, ClosedSessionsAreNotFoundWithTheReason) {
  std::weak_ptr<Probe> probe;
  const auto a = MakeSession(&probe);
  const auto b = MakeSession();
  EXPECT_EQ(manager_->Close(a.id, b.token).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(manager_->Close(a.id, a.token).ok());
  EXPECT_TRUE(probe.expired());  // its memory went with it
  auto again = manager_->Acquire(a.id, a.token);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.status().message(), "session " + a.id + " was closed");
  EXPECT_EQ(manager_->Close(a.id, a.token).code(), absl::StatusCode::kNotFound);
  // A closed session's token is no longer "another session's".
  EXPECT_EQ(AcquireCode(b.id, a.token), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(manager_->live_sessions(), 1);
}

TEST_F(SessionManagerTest, IdleSessionsExpireAndAreSwept) {
  std::weak_ptr<Probe> probe_a, probe_b;
  const auto a = MakeSession(&probe_a, absl::Seconds(60));
  const auto b = MakeSession(&probe_b, absl::Seconds(600));
  clock_.Advance(absl::Seconds(59));
  { ASSERT_TRUE(manager_->Acquire(a.id, a.token).ok()); }  // use renews the idle clock
  clock_.Advance(absl::Seconds(59));
  EXPECT_EQ(manager_->Sweep(), 0);
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(manager_->Sweep(), 1);
  EXPECT_TRUE(probe_a.expired());
  EXPECT_FALSE(probe_b.expired());
  auto late = manager_->Acquire(a.id, a.token);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(late.status().message(), "session " + a.id + " expired after 60 s idle");
  EXPECT_EQ(AcquireCode(b.id, b.token), absl::StatusCode::kOk);
}

TEST_F(SessionManagerTest, AcquireExpiresWithoutASweep) {
  const auto a = MakeSession(nullptr, absl::Seconds(10));
  clock_.Advance(absl::Seconds(11));
  auto late = manager_->Acquire(a.id, a.token);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(late.status().message().find("expired after 10 s idle"), std::string::npos);
}

TEST_F(SessionManagerTest, ASessionInUseDoesNotExpire) {
  std::weak_ptr<Probe> probe;
  const auto a = MakeSession(&probe, absl::Seconds(10));
  auto lease = manager_->Acquire(a.id, a.token);
  ASSERT_TRUE(lease.ok());
  clock_.Advance(absl::Seconds(100));
  EXPECT_EQ(manager_->Sweep(), 0);
  EXPECT_FALSE(probe.expired());
}

TEST_F(SessionManagerTest, EvictedSessionsSayWhy) {
  const auto a = MakeSession();
  ASSERT_TRUE(manager_->Evict(a.id, "device unhealthy").ok());
  auto late = manager_->Acquire(a.id, a.token);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(late.status().message(), "session " + a.id + " was evicted: device unhealthy");
  EXPECT_EQ(manager_->Evict(a.id, "again").code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionManagerTest, MaxSessions) {
  SessionManagerOptions options;
  options.max_sessions = 2;
  Reset(options);
  const auto a = MakeSession(nullptr, absl::Seconds(5));
  MakeSession(nullptr, absl::Seconds(500));
  auto third = manager_->Create(absl::ZeroDuration(), [](const std::string&) {
    return absl::StatusOr<std::shared_ptr<Session>>(nullptr);
  });
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  // Closing or expiring one frees a slot.
  clock_.Advance(absl::Seconds(6));
  MakeSession();
  EXPECT_EQ(manager_->live_sessions(), 2);
}

TEST_F(SessionManagerTest, FactoryErrorsCreateNothing) {
  auto failed = manager_->Create(absl::ZeroDuration(), [](const std::string&) {
    return absl::StatusOr<std::shared_ptr<Session>>(absl::ResourceExhaustedError("no memory"));
  });
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(manager_->live_sessions(), 0);
}

TEST_F(SessionManagerTest, RejectsBadTtls) {
  auto negative = manager_->Create(absl::Seconds(-1), [](const std::string&) {
    return absl::StatusOr<std::shared_ptr<Session>>(nullptr);
  });
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  auto huge = manager_->Create(absl::Hours(24 * 365), [](const std::string&) {
    return absl::StatusOr<std::shared_ptr<Session>>(nullptr);
  });
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
}

// The manager orders nothing (the executor does): a second Lease while one is
// held is refused at once, never waited for, and other sessions are free.
TEST_F(SessionManagerTest, ASecondLeaseIsRefusedAtOnceNotWaitedFor) {
  const auto a = MakeSession();
  const auto b = MakeSession();
  std::optional<absl::StatusOr<SessionManager::Lease>> first;
  first.emplace(manager_->Acquire(a.id, a.token));
  ASSERT_TRUE(first->ok());
  EXPECT_TRUE(manager_->in_call(a.id));
  const absl::Time before = absl::Now();
  const absl::Status second = manager_->Acquire(a.id, a.token).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kInternal);
  EXPECT_NE(second.message().find("executor turn"), std::string::npos) << second;
  EXPECT_LT(absl::Now() - before, absl::Seconds(1));
  EXPECT_EQ(manager_->AcquireForServer(a.id).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(manager_->Close(a.id, a.token).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(manager_->Acquire(b.id, b.token).ok());
  first.reset();  // releases the lease
  EXPECT_FALSE(manager_->in_call(a.id));
  EXPECT_TRUE(manager_->Acquire(a.id, a.token).ok());
  EXPECT_TRUE(manager_->Close(a.id, a.token).ok());
}

// A Lease held while its session is closed or evicted still releases cleanly,
// and later calls hear why the session went.
TEST_F(SessionManagerTest, ALeaseOutlivesItsSessionsEviction) {
  std::weak_ptr<Probe> probe;
  const auto a = MakeSession(&probe);
  std::optional<absl::StatusOr<SessionManager::Lease>> held;
  held.emplace(manager_->Acquire(a.id, a.token));
  ASSERT_TRUE(held->ok());
  ASSERT_TRUE(manager_->Evict(a.id, "operator").ok());
  EXPECT_FALSE(probe.expired());  // the running call still holds it
  held.reset();
  EXPECT_TRUE(probe.expired());
  EXPECT_EQ(manager_->Acquire(a.id, a.token).status().message(),
            "session " + a.id + " was evicted: operator");
}

TEST_F(SessionManagerTest, AuthenticateChecksLikeAcquireWithoutHoldingTheSession) {
  std::weak_ptr<Probe> probe;
  const SessionManager::Identity a = MakeSession(&probe);
  const SessionManager::Identity b = MakeSession();
  absl::StatusOr<SessionManager::Lease> held = manager_->Acquire(a.id, a.token);
  ASSERT_TRUE(held.ok());
  // A call holds the session, yet authentication answers at once.
  absl::StatusOr<std::shared_ptr<Session>> session = manager_->Authenticate(a.id, a.token);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(manager_->in_call(a.id));
  EXPECT_EQ(manager_->Authenticate(a.id, "").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(manager_->Authenticate(a.id, "wrong").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(manager_->Authenticate(a.id, b.token).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(manager_->Authenticate("", a.token).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(manager_->Authenticate("unknown", a.token).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace te::session
