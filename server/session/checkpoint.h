// CheckpointStore: sessions saved under te_server's --state_dir, and restored
// from it when a server starts, so a client resumes with its session id and
// token. Thread-safe for different sessions; Save runs in the session's turn.
//
// Contract:
//  1. A session's checkpoint is <state_dir>/<session_id>/: session.pb (the
//     manifest: layers with their specs, init shapes, dtypes, autocast and
//     added graphs; recipe; policy; TTL; a salted SHA-256 of the token, never
//     the token) and variables-<generation>.bin (the raw bytes of every
//     variable of each layer's newest retained version: params, fp8_metas,
//     grads, opt_state). That version comes back under its number, the
//     layer's only one; older retained versions, saved forwards and resident
//     tensors are not saved: they are a running client's values and per-step
//     data, which it re-creates. Graph indices are kept.
//  2. Atomic: the data file is written under a new name and fsynced, then the
//     manifest is written to a temporary file, fsynced and renamed over the
//     old one (the commit point), then the directory is fsynced. A crash at
//     any point leaves the previous checkpoint or the new one, whole.
//  3. File names derive only from server-issued ids, validated as 32 lowercase
//     hex digits, and from names this store makes; no client string reaches
//     a path.
//  4. Restore is bit for bit: variables come back byte-identical, checked
//     against the manifest's SHA-256 of the data file. A checkpoint that
//     fails any check is left on disk, logged, and skipped.
#ifndef TE_SERVER_SESSION_CHECKPOINT_H_
#define TE_SERVER_SESSION_CHECKPOINT_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"

namespace te::session {

// True iff `id` has the form of a server-issued id: 32 lowercase hex digits.
bool IsSessionId(absl::string_view id);

class CheckpointStore {
 public:
  // Uses `state_dir`, creating it (mode 0700) if missing. FAILED_PRECONDITION
  // when it cannot be created or is not a writable directory.
  static absl::StatusOr<std::unique_ptr<CheckpointStore>> Open(const std::string& state_dir);

  const std::string& state_dir() const { return state_dir_; }

  struct Written {
    std::string path;   // the manifest, relative to state_dir: "<id>/session.pb"
    int64_t bytes = 0;  // manifest + data
  };
  // Writes the session `lease` holds (contract 2). UNAVAILABLE on an I/O
  // error (the previous checkpoint is then still whole); device errors keep
  // their codes.
  absl::StatusOr<Written> Save(const SessionManager::Lease& lease);

  // Deletes session `id`'s checkpoint, if any. INVALID_ARGUMENT for an id not
  // of the server's form.
  absl::Status Remove(const std::string& id);

  // The device a session saved on device `saved_on` ("cuda:1") comes back
  // on: that one where the server still has it, else another.
  using DeviceFor = std::function<Device*(const std::string& saved_on)>;

  // Re-creates session `id` from its checkpoint on `device_for`'s choice (a
  // new stream with `config`'s limits) and adds it to `manager` under its old
  // id and token. NOT_FOUND without a checkpoint; DATA_LOSS for a checkpoint that is
  // malformed, truncated or fails its checksum; errors of the layers and the
  // manager (RESOURCE_EXHAUSTED: over the memory or session limit) as they are.
  absl::Status Restore(const std::string& id, const DeviceFor& device_for,
                       const SessionConfig& config, SessionManager* manager);
  // Every session onto one device.
  absl::Status Restore(const std::string& id, Device* device, const SessionConfig& config,
                       SessionManager* manager) {
    return Restore(id, [device](const std::string&) { return device; }, config, manager);
  }

  struct RestoreReport {
    int restored = 0;
    int failed = 0;  // left on disk
  };
  // Restore() for every checkpoint in state_dir; entries not named like a
  // session id are ignored.
  RestoreReport RestoreAll(const DeviceFor& device_for, const SessionConfig& config,
                           SessionManager* manager);
  RestoreReport RestoreAll(Device* device, const SessionConfig& config, SessionManager* manager) {
    return RestoreAll([device](const std::string&) { return device; }, config, manager);
  }

 private:
  explicit CheckpointStore(std::string state_dir) : state_dir_(std::move(state_dir)) {}
  std::string SessionDir(const std::string& id) const;
  // Whether Remove(id) has run: a Save racing it (a session evicted while its
  // lease writes the checkpoint) must not commit, or the removed session
  // would come back at the next start.
  bool RemovedLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Deletes what a Save of a removed session left (its directory).
  absl::Status AbandonedSave(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string state_dir_;
  absl::Mutex mu_;  // orders Save's commit against Remove
  std::set<std::string> removed_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> removed_order_ ABSL_GUARDED_BY(mu_);  // oldest first, bounded
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_CHECKPOINT_H_
