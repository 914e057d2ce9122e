#include "server/session/session_manager.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/session/log.h"
#include "server/session/random_id.h"

namespace te::session {

struct SessionManager::Entry {
  Entry(std::string id, std::string token, security::TokenDigest digest, absl::Duration ttl)
      : id(std::move(id)), digest(std::move(digest)), ttl(ttl), token(std::move(token)) {}
  const std::string id;
  const security::TokenDigest digest;  // what a checkpoint stores
  const absl::Duration ttl;
  // Guarded by the manager's mu_.
  std::string token;  // empty for a restored session until its token is seen
  std::shared_ptr<Session> session;
  absl::Time last_used;
  bool in_call = false;  // a Lease is held (contract 3)
  std::string gone;      // set when removed: why
};

namespace {

// Compares secrets in time independent of where they differ.
bool SecretEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

SessionManager::SessionManager(SessionManagerOptions options, Clock clock)
    : options_(options), clock_(std::move(clock)) {}

SessionManager::~SessionManager() = default;

SessionManager::Lease::Lease(SessionManager* manager, std::shared_ptr<Entry> entry,
                             std::shared_ptr<Session> session)
    : manager_(manager), entry_(std::move(entry)), session_(std::move(session)) {}

SessionManager::Lease::Lease(Lease&& other) noexcept
    : manager_(other.manager_),
      entry_(std::move(other.entry_)),
      session_(std::move(other.session_)) {}

SessionManager::Lease::~Lease() {
  if (entry_ == nullptr) return;  // moved from
  session_.reset();
  manager_->Release(entry_);
}

const std::string& SessionManager::Lease::id() const { return entry_->id; }

const security::TokenDigest& SessionManager::Lease::token_digest() const {
  return entry_->digest;
}

absl::Duration SessionManager::Lease::ttl() const { return entry_->ttl; }

SessionManager::Doomed::~Doomed() {
  sessions_.clear();  // frees their memory unless a call still holds one
  if (!options_.on_removed) return;
  for (const std::string& id : ids_) options_.on_removed(id);
}

void SessionManager::Doomed::Add(const std::string& id, std::shared_ptr<Session> session) {
  ids_.push_back(id);
  sessions_.push_back(std::move(session));
}

void SessionManager::Release(const std::shared_ptr<Entry>& entry) {
  absl::MutexLock lock(&mu_);
  entry->last_used = clock_();
  entry->in_call = false;
}

absl::StatusOr<SessionManager::Identity> SessionManager::Create(absl::Duration ttl,
                                                                const Factory& make) {
  if (ttl < absl::ZeroDuration() || ttl > options_.max_ttl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ttl_seconds: ", absl::ToInt64Seconds(ttl), " is outside [0, ",
        absl::ToInt64Seconds(options_.max_ttl), "] (0: the server's default, ",
        absl::ToInt64Seconds(options_.default_ttl), ")"));
  }
  if (ttl == absl::ZeroDuration()) ttl = options_.default_ttl;
  {
    Doomed doomed(options_);
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(live_.size()) + creating_ >= options_.max_sessions) {
      SweepLocked(clock_(), &doomed);
    }
    if (static_cast<int>(live_.size()) + creating_ >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the server already holds its maximum of ", options_.max_sessions,
                       " sessions; close one or retry later"));
    }
    ++creating_;  // the slot is ours while the factory runs, outside the lock
  }
  auto release_slot = [this] {
    absl::MutexLock lock(&mu_);
    --creating_;
  };
  absl::StatusOr<std::string> id = RandomHex128();
  absl::StatusOr<std::string> token = RandomHex128();
  if (!id.ok() || !token.ok()) {
    release_slot();
    return id.ok() ? token.status() : id.status();
  }
  absl::StatusOr<security::TokenDigest> digest = security::TokenDigest::Of(*token);
  if (!digest.ok()) {
    release_slot();
    return digest.status();
  }
  absl::StatusOr<std::shared_ptr<Session>> session = make(*id);
  if (!session.ok()) {
    release_slot();
    return session.status();
  }
  auto entry = std::make_shared<Entry>(*id, *token, *std::move(digest), ttl);
  entry->session = *std::move(session);
  {
    absl::MutexLock lock(&mu_);
    --creating_;
    entry->last_used = clock_();
    live_[entry->id] = entry;
    id_of_token_[entry->token] = entry->id;
  }
  LogForSession(LogLevel::kInfo, entry->id,
                absl::StrCat("created (idle ttl ", absl::ToInt64Seconds(ttl), " s)"));
  return Identity{entry->id, entry->token, ttl};
}

bool SessionManager::ExpiredLocked(const Entry& entry, absl::Time now) const {
  return !entry.in_call && now - entry.last_used > entry.ttl;
}

std::string SessionManager::ExpiryReason(const Entry& entry) const {
  return absl::StrCat("session ", entry.id, " expired after ", absl::ToInt64Seconds(entry.ttl),
                      " s idle");
}

// `entry` by value: the caller may pass live_'s copy, which this erases.
void SessionManager::RemoveLocked(std::shared_ptr<Entry> entry, const std::string& reason,
                                  Doomed* doomed) {
  entry->gone = reason;
  live_.erase(entry->id);
  if (!entry->token.empty()) id_of_token_.erase(entry->token);
  // Dropping the reference frees the session's memory unless a call still runs.
  doomed->Add(entry->id, std::move(entry->session));
  RememberLocked(entry->id, absl::NotFoundError(reason));
}

void SessionManager::RememberLocked(const std::string& id, absl::Status why) {
  tombstones_[id] = std::move(why);
  tombstone_order_.push_back(id);
  while (tombstone_order_.size() > options_.max_tombstones) {
    tombstones_.erase(tombstone_order_.front());
    tombstone_order_.pop_front();
  }
}

void SessionManager::RememberNotRestored(const std::string& id, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (live_.count(id) > 0) return;
  RememberLocked(id, absl::Status(why.code() == absl::StatusCode::kDataLoss
                                      ? absl::StatusCode::kDataLoss
                                      : absl::StatusCode::kUnavailable,
                                  absl::StrCat("session ", id,
                                               " could not be restored from its checkpoint at "
                                               "the server's start: ",
                                               why.message())));
}

absl::StatusOr<std::shared_ptr<SessionManager::Entry>> SessionManager::AuthenticateLocked(
    const std::string& id, const std::string& token, Doomed* doomed) {
  auto it = live_.find(id);
  if (it != live_.end() && ExpiredLocked(*it->second, clock_())) {
    const std::string reason = ExpiryReason(*it->second);
    LogForSession(LogLevel::kInfo, id, reason);
    RemoveLocked(it->second, reason, doomed);
    it = live_.end();
  }
  if (it == live_.end()) {
    auto gone = tombstones_.find(id);
    return gone != tombstones_.end() ? gone->second
                                     : absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  }
  std::shared_ptr<Entry> entry = it->second;
  if (token.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("session.token: missing for session ", id));
  }
  // A restored session knows its token only by digest until it is seen.
  const bool matches = entry->token.empty() ? entry->digest.Matches(token)
                                            : SecretEquals(token, entry->token);
  if (!matches) {
    if (id_of_token_.count(token) > 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "session.token belongs to another session, not to session ", id));
    }
    return absl::UnauthenticatedError(
        absl::StrCat("session.token: wrong token for session ", id));
  }
  if (entry->token.empty()) {
    entry->token = token;
    id_of_token_[token] = id;
  }
  return entry;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Authenticate(const std::string& id,
                                                                     const std::string& token) {
  if (id.empty()) return absl::InvalidArgumentError("session.session_id: empty");
  Doomed doomed(options_);
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, AuthenticateLocked(id, token, &doomed));
  return entry->session;
}

absl::StatusOr<SessionManager::Lease> SessionManager::Acquire(const std::string& id,
                                                              const std::string& token) {
  if (id.empty()) return absl::InvalidArgumentError("session.session_id: empty");
  Doomed doomed(options_);
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(std::shared_ptr<Entry> entry, AuthenticateLocked(id, token, &doomed));
  return HoldLocked(std::move(entry));
}

absl::StatusOr<SessionManager::Lease> SessionManager::AcquireForServer(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  return HoldLocked(it->second);
}

absl::StatusOr<SessionManager::Lease> SessionManager::HoldLocked(std::shared_ptr<Entry> entry) {
  if (entry->in_call) {
    // The executor runs a session's calls one at a time; a second holder
    // means some call ran outside its session's turn.
    return absl::InternalError(absl::StrCat(
        "session ", entry->id,
        " already has a call running: its calls must run in its executor turn"));
  }
  entry->in_call = true;
  std::shared_ptr<Session> session = entry->session;
  return Lease(this, std::move(entry), std::move(session));
}

absl::Status SessionManager::Close(const std::string& id, const std::string& token) {
  ASSIGN_OR_RETURN(Lease lease, Acquire(id, token));
  {
    Doomed doomed(options_);  // the lease still holds the session: it goes with the lease
    absl::MutexLock lock(&mu_);
    RemoveLocked(lease.entry_, absl::StrCat("session ", id, " was closed"), &doomed);
  }
  LogForSession(LogLevel::kInfo, id, "closed");
  return absl::OkStatus();
}

absl::Status SessionManager::Evict(const std::string& id, const std::string& reason) {
  Doomed doomed(options_);
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return absl::NotFoundError(absl::StrCat("session ", id, " not found"));
  LogForSession(LogLevel::kWarning, id, absl::StrCat("evicted: ", reason));
  RemoveLocked(it->second, absl::StrCat("session ", id, " was evicted: ", reason), &doomed);
  return absl::OkStatus();
}

int SessionManager::SweepLocked(absl::Time now, Doomed* doomed) {
  std::vector<std::shared_ptr<Entry>> expired;
  for (const auto& [id, entry] : live_) {
    if (ExpiredLocked(*entry, now)) expired.push_back(entry);
  }
  for (const auto& entry : expired) {
    const std::string reason = ExpiryReason(*entry);
    LogForSession(LogLevel::kInfo, entry->id, reason);
    RemoveLocked(entry, reason, doomed);
  }
  return static_cast<int>(expired.size());
}

int SessionManager::Sweep() {
  Doomed doomed(options_);
  absl::MutexLock lock(&mu_);
  return SweepLocked(clock_(), &doomed);
}

int SessionManager::live_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size());
}

std::vector<std::string> SessionManager::live_ids() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, entry] : live_) ids.push_back(id);
  return ids;
}

std::vector<std::shared_ptr<Session>> SessionManager::live_session_refs() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> sessions;
  for (const auto& [id, entry] : live_) sessions.push_back(entry->session);
  return sessions;
}

absl::Status SessionManager::Restore(const std::string& id, const security::TokenDigest& digest,
                                     absl::Duration ttl, std::shared_ptr<Session> session) {
  if (!digest.WellFormed()) {
    return absl::InvalidArgumentError(absl::StrCat("session ", id, ": malformed token digest"));
  }
  if (ttl <= absl::ZeroDuration() || ttl > options_.max_ttl) ttl = options_.default_ttl;
  auto entry = std::make_shared<Entry>(id, "", digest, ttl);
  entry->session = std::move(session);
  absl::MutexLock lock(&mu_);
  if (live_.count(id) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("session ", id, " is already live"));
  }
  if (static_cast<int>(live_.size()) + creating_ >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server already holds its maximum of ", options_.max_sessions, " sessions"));
  }
  entry->last_used = clock_();
  live_[id] = std::move(entry);
  tombstones_.erase(id);
  return absl::OkStatus();
}

bool SessionManager::in_call(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = live_.find(id);
  return it != live_.end() && it->second->in_call;
}

}  // namespace te::session
