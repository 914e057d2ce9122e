// The cuDNN SDPA plans of one stream, built once per configuration.
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {
namespace {

struct PlanEntry {
  absl::Status status;  // UNIMPLEMENTED: cuDNN declined this configuration
  CudnnPlan plan;
};

}  // namespace
}  // namespace cudnn_graph

// Per stream (the plans hold the stream's cuDNN handle). Entries are never
// evicted: a session sees few distinct shapes.
struct AttentionPlanCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<cudnn_graph::PlanEntry>> entries;
};

namespace cudnn_graph {

absl::StatusOr<const CudnnPlan*> GetPlan(CudaOps* ops, const PlanConfig& config) {
  std::shared_ptr<AttentionPlanCache>& cache = ops->attention_plans();
  if (cache == nullptr) cache = std::make_shared<AttentionPlanCache>();
  std::lock_guard<std::mutex> lock(cache->mu);
  const std::string key = config.Key();
  auto it = cache->entries.find(key);
  if (it == cache->entries.end()) {
    auto handle = ops->CudnnHandle();
    if (!handle.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("cuDNN is unavailable: ", handle.status().message()));
    }
    auto entry = std::make_shared<PlanEntry>();
    entry->status = config.backward ? BuildBackward(*handle, config, &entry->plan)
                                    : BuildForward(*handle, config, &entry->plan);
    if (!entry->status.ok() && !absl::IsUnimplemented(entry->status)) return entry->status;
    it = cache->entries.emplace(key, std::move(entry)).first;
  }
  if (!it->second->status.ok()) return it->second->status;
  return &it->second->plan;
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
