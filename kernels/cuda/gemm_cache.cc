#include "kernels/cuda/gemm_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace te {
namespace cuda {

std::string GemmKey::DebugString() const {
  return absl::StrCat("m=", m, " n=", n, " k=", k, " A=", DTypeName(a_type),
                      transpose_a ? "^T" : "", " B=", DTypeName(b_type), transpose_b ? "^T" : "",
                      " D=", DTypeName(d_type), accumulate ? " beta=1" : "",
                      bias ? absl::StrCat(" bias=", DTypeName(bias_type)) : "",
                      activation == Ops::GemmEpilogue::kGeluAux ? " gelu_aux" : "",
                      tf32 ? " tf32" : "");
}

GemmPlan::~GemmPlan() {
  for (cublasLtMatrixLayout_t layout : {a, b, c, d}) {
    if (layout != nullptr) (void)cublasLtMatrixLayoutDestroy(layout);
  }
  if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
}

std::shared_ptr<GemmPlan> GemmPlanCache::GetOrBuild(
    const GemmKey& key, const std::function<std::unique_ptr<GemmPlan>()>& build) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  std::shared_ptr<GemmPlan> plan = build();
  plans_.emplace(key, plan);
  return plan;
}

size_t GemmPlanCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plans_.size();
}

std::vector<std::pair<GemmKey, absl::Status>> GemmPlanCache::Entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<GemmKey, absl::Status>> entries;
  for (const auto& [key, plan] : plans_) entries.emplace_back(key, plan->status);
  return entries;
}

}  // namespace cuda
}  // namespace te
