// Device tensors several layers share instead of each uploading its own:
// every TransformerLayer of a graph needs the same relative-position buckets
// (int32 [S, S]: 4 MiB at S 1024, a synchronous host copy each). A holder
// keeps them as long as it lives: a graph's Forward for one call
// (ForwardOptions::constants) where the caller gives none, a session layer
// across its calls (server/session/step_transaction.h), a DecodeContext for
// a decode step or a whole generation (whose recorded steps must keep
// reading the same memory).
//
// A session layer keeps them across calls because the upload blocked the
// host on a pageable copy at every training step, with the GPU idle after
// it. So what a layer puts here must be a function of its configuration and
// the call's shapes alone, never of its variables: the same tensor serves
// every version of the layer and every later call. Nothing writes one once
// it is made.
// Used by one thread at a time, as a call runs.
#ifndef TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_
#define TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_

#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace te::layers {

class DeviceConstants {
 public:
  // The tensor kept under `key`, made by `make` on the first ask.
  absl::StatusOr<Tensor> Get(const std::string& key,
                             const std::function<absl::StatusOr<Tensor>()>& make) {
    auto it = tensors_.find(key);
    if (it != tensors_.end()) {
      it->second.used_in = call_;
      return it->second.tensor;
    }
    absl::StatusOr<Tensor> made = make();
    if (made.ok()) {
      tensors_.emplace(key, Entry{*made, call_});
      pending_.push_back(key);
    }
    return made;
  }

  // What a holder kept across calls may hold, as Fp8WeightCache::Call does
  // for the FP8 weight copies: a Call destroyed without Commit drops what
  // was made while it was open, so a failed call leaves the session's
  // memory as it was (session.h contract 2). A committed call that made
  // something keeps only what it used: a client that changes its sequence
  // length does not pile up a table for every length it ever sent, and what
  // stays held between calls is never more than one call made.
  class Call {
   public:
    explicit Call(DeviceConstants* constants) : constants_(constants) {
      constants_->pending_.clear();
      ++constants_->call_;
    }
    ~Call() {
      if (!committed_) {
        for (const std::string& key : constants_->pending_) constants_->tensors_.erase(key);
      } else if (!constants_->pending_.empty()) {
        for (auto it = constants_->tensors_.begin(); it != constants_->tensors_.end();) {
          it = it->second.used_in == constants_->call_ ? std::next(it)
                                                        : constants_->tensors_.erase(it);
        }
      }
      constants_->pending_.clear();
    }
    void Commit() { committed_ = true; }
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;

   private:
    DeviceConstants* constants_;
    bool committed_ = false;
  };

  size_t size() const { return tensors_.size(); }
  int64_t bytes() const {
    int64_t total = 0;
    for (const auto& [key, entry] : tensors_) total += static_cast<int64_t>(entry.tensor.nbytes());
    return total;
  }

 private:
  struct Entry {
    Tensor tensor;
    uint64_t used_in = 0;  // the Call that last asked for it
  };
  std::map<std::string, Entry> tensors_;
  std::vector<std::string> pending_;  // made since the open Call began
  uint64_t call_ = 0;                 // the open Call's number
};

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_
