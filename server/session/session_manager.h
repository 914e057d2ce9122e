// SessionManager: who may call which session, and for how long. Thread-safe.
//
// Contract:
//  1. Ids and tokens are 128-bit random (random_id.h), server-issued.
//  2. Acquire() authenticates: an unknown id is NOT_FOUND (with the reason a
//     session went away: "session <id> was closed", "... expired after N s
//     idle", "... was evicted: <why>"), or DATA_LOSS / UNAVAILABLE for one
//     whose checkpoint could not be restored (RememberNotRestored); a missing or wrong token is
//     UNAUTHENTICATED; a token of another live session is PERMISSION_DENIED.
//  3. The manager does not order calls: a session's calls are put in order,
//     and run one at a time, by its device's executor (service/executor.h, contract
//     1), and each call takes its Lease inside that turn. A Lease is the one
//     call running on the session: Acquire while another Lease of the same
//     session is held answers INTERNAL at once (a call run outside its
//     session's turn), it never waits.
//  4. A session idle (no Lease held) for longer than its TTL expires: Sweep()
//     or the next Acquire() removes it and drops the manager's reference,
//     which frees its memory.
//  5. Close() removes the session (in its turn, like any call); calls that
//     the executor queued behind it get NOT_FOUND "was closed" when they
//     Acquire.
//  6. A session restored from a checkpoint keeps its id and authenticates its
//     old token against the checkpoint's salted digest (Restore()).
//  7. `on_removed` hears of every session that goes (closed, expired,
//     evicted), after the manager's lock is released.
#ifndef TE_SERVER_SESSION_SESSION_MANAGER_H_
#define TE_SERVER_SESSION_SESSION_MANAGER_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/security/secrets.h"

namespace te::session {

class Session;  // session.h; the manager only holds and hands out references.

struct SessionManagerOptions {
  int max_sessions = 64;
  absl::Duration default_ttl = absl::Seconds(1800);
  absl::Duration max_ttl = absl::Hours(24 * 7);
  size_t max_tombstones = 4096; // reasons remembered for ids that went away
  // Told the id of each session removed (e.g. to delete its checkpoint); may be empty.
  std::function<void(const std::string& id)> on_removed;
};

class SessionManager {
 public:
  using Clock = std::function<absl::Time()>;
  using Factory = std::function<absl::StatusOr<std::shared_ptr<Session>>(const std::string& id)>;

  explicit SessionManager(SessionManagerOptions options, Clock clock = [] { return absl::Now(); });
  ~SessionManager();

  struct Identity {
    std::string id;
    std::string token;
    absl::Duration ttl;
  };
  // A new session holding what `make` returns. `ttl` zero: the default;
  // negative or over max_ttl: INVALID_ARGUMENT ("ttl_seconds"). RESOURCE_EXHAUSTED
  // at max_sessions (after sweeping expired ones). `make`'s errors are
  // returned as they are, and no session is created.
  absl::StatusOr<Identity> Create(absl::Duration ttl, const Factory& make);

  struct Entry;
  // One call's hold on a live session (contract 3). Releasing it
  // (destruction) marks the session used now. Move-only.
  class Lease {
   public:
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    Session& session() const { return *session_; }
    const std::string& id() const;
    // What a checkpoint stores in place of the token, and the idle TTL.
    const security::TokenDigest& token_digest() const;
    absl::Duration ttl() const;

   private:
    friend class SessionManager;
    Lease(SessionManager* manager, std::shared_ptr<Entry> entry,
          std::shared_ptr<Session> session);
    SessionManager* manager_;
    std::shared_ptr<Entry> entry_;
    std::shared_ptr<Session> session_;  // keeps the session alive for the call
  };
  // Authenticates (contract 2) and holds the session for one call (contract
  // 3). INVALID_ARGUMENT when `id` is empty.
  absl::StatusOr<Lease> Acquire(const std::string& id, const std::string& token);

  // Authenticates as Acquire does, without holding the session: for routing
  // a call to its session's device before it queues. Only what a Session
  // allows while another call runs may be read through the result.
  absl::StatusOr<std::shared_ptr<Session>> Authenticate(const std::string& id,
                                                        const std::string& token);

  // A Lease on session `id` without a token: for the server itself (the
  // checkpoint at shutdown, in the session's executor turn), never for a
  // request. NOT_FOUND if not live.
  absl::StatusOr<Lease> AcquireForServer(const std::string& id);

  // Adds `session`, restored from a checkpoint, under its old `id`, with the
  // token `digest` stands for. ALREADY_EXISTS if `id` is live;
  // RESOURCE_EXHAUSTED at max_sessions; INVALID_ARGUMENT for a malformed digest.
  absl::Status Restore(const std::string& id, const security::TokenDigest& digest,
                       absl::Duration ttl, std::shared_ptr<Session> session);

  // A checkpointed session `id` that could not be restored (`why`): its
  // clients' calls get DATA_LOSS (a corrupt checkpoint) or UNAVAILABLE, with
  // the reason, instead of a bare NOT_FOUND.
  void RememberNotRestored(const std::string& id, const absl::Status& why);

  // Authenticates, holds the session as Acquire does, and removes it.
  absl::Status Close(const std::string& id, const std::string& token);

  // Removes a session at once (operator action); a running call finishes,
  // later ones get NOT_FOUND "was evicted: <reason>". NOT_FOUND if not live.
  absl::Status Evict(const std::string& id, const std::string& reason);

  // Removes every idle session past its TTL; returns how many.
  int Sweep();

  int live_sessions() const;
  std::vector<std::string> live_ids() const;
  // References to the live sessions, for figures that are safe to read while
  // calls run (Session::bytes_in_use()).
  std::vector<std::shared_ptr<Session>> live_session_refs() const;
  // Whether a Lease on session `id` is held now (false if it is not live).
  bool in_call(const std::string& id) const;

 private:
  // Sessions removed under mu_ are destroyed, and on_removed told, once it is
  // released (a session's destructor waits for its device stream): callers
  // declare one of these before taking the lock.
  class Doomed {
   public:
    explicit Doomed(const SessionManagerOptions& options) : options_(options) {}
    ~Doomed();
    void Add(const std::string& id, std::shared_ptr<Session> session);

   private:
    const SessionManagerOptions& options_;
    std::vector<std::shared_ptr<Session>> sessions_;
    std::vector<std::string> ids_;
  };
  // Removes `entry` from the live maps, remembers `reason`, and moves the
  // manager's reference to its session into `doomed`.
  void RemoveLocked(std::shared_ptr<Entry> entry, const std::string& reason, Doomed* doomed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RememberLocked(const std::string& id, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ExpiredLocked(const Entry& entry, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string ExpiryReason(const Entry& entry) const;
  int SweepLocked(absl::Time now, Doomed* doomed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(const std::shared_ptr<Entry>& entry);
  // Contract 2's checks; the live entry, or why not.
  absl::StatusOr<std::shared_ptr<Entry>> AuthenticateLocked(const std::string& id,
                                                            const std::string& token,
                                                            Doomed* doomed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks `entry` held (contract 3) and makes the lease.
  absl::StatusOr<Lease> HoldLocked(std::shared_ptr<Entry> entry)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionManagerOptions options_;
  const Clock clock_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> live_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::string> id_of_token_ ABSL_GUARDED_BY(mu_);
  int creating_ ABSL_GUARDED_BY(mu_) = 0;  // reserved slots while a factory runs
  // Why each id that went away is gone: NOT_FOUND with the reason, or the
  // code of a checkpoint that could not be restored.
  std::unordered_map<std::string, absl::Status> tombstones_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_SESSION_MANAGER_H_
