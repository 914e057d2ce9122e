// Device tensors several layers share instead of each uploading its own:
// every TransformerLayer of a graph needs the same relative-position buckets
// (int32 [S, S]: 4 MiB at S 1024, a synchronous host copy each). A holder
// keeps them as long as it lives: a graph's Forward for one call
// (ForwardOptions::constants), a DecodeContext for a decode step or a whole
// generation (whose recorded steps must keep reading the same memory).
// Used by one thread at a time, as a call runs.
#ifndef TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_
#define TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_

#include <functional>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace te::layers {

class DeviceConstants {
 public:
  // The tensor kept under `key`, made by `make` on the first ask.
  absl::StatusOr<Tensor> Get(const std::string& key,
                             const std::function<absl::StatusOr<Tensor>()>& make) {
    auto it = tensors_.find(key);
    if (it != tensors_.end()) return it->second;
    absl::StatusOr<Tensor> made = make();
    if (made.ok()) tensors_.emplace(key, *made);
    return made;
  }

 private:
  std::map<std::string, Tensor> tensors_;
};

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_DEVICE_CONSTANTS_H_
