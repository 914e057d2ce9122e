// cuBLASLt state per GEMM configuration: the matmul descriptor, the four
// matrix layouts and the heuristic's algorithm, built once and reused, so a
// steady-state Gemm makes no descriptor and asks no heuristic.
//
// A GemmPlanCache belongs to one CudaOps (stream). It is thread-safe for
// lookups and inserts; a plan's descriptor is then used by its stream alone
// (Gemm sets the per-call pointers - bias, FP8 scales - on it).
#ifndef TE_KERNELS_CUDA_GEMM_CACHE_H_
#define TE_KERNELS_CUDA_GEMM_CACHE_H_

#include <cublasLt.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

// Everything a plan depends on, in cuBLASLt's column-major terms (see gemm.cu:
// A is ops.h's b, B is ops.h's a, D is out^T).
struct GemmKey {
  int64_t m = 0, n = 0, k = 0;
  DType a_type = DType::kF32, b_type = DType::kF32, d_type = DType::kF32;
  bool transpose_a = false, transpose_b = false;
  bool accumulate = false;  // beta = 1; C = D, or the residual
  bool bias = false;        // CUBLASLT_EPILOGUE_BIAS (or GELU_AUX_BIAS)
  DType bias_type = DType::kF32;
  Ops::GemmEpilogue activation = Ops::GemmEpilogue::kNone;  // GELU_AUX(_BIAS)
  bool tf32 = false;        // CUBLAS_COMPUTE_32F_FAST_TF32 (float32 operands)
  // Pointer alignments in bytes (capped at 256): the heuristic picks kernels
  // that need no more than these.
  int align_a = 256, align_b = 256, align_d = 256;

  auto Tie() const {
    return std::tie(m, n, k, a_type, b_type, d_type, transpose_a, transpose_b, accumulate, bias,
                    bias_type, activation, tf32, align_a, align_b, align_d);
  }
  bool operator<(const GemmKey& o) const { return Tie() < o.Tie(); }
  std::string DebugString() const;
};

// A plan, or why cuBLASLt has none for the key (cached too, so an unsupported
// configuration is not re-asked on every call).
struct GemmPlan {
  absl::Status status;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  // The heuristic's best few algorithms: the first call times each on its
  // own operands and keeps the fastest in `algo` (gemm.cu's TunePlan), as
  // XLA autotunes its GEMMs; `tuned` once that is done.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  bool tuned = false;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan();
};

struct GemmPlanCache {
  // The plan for `key`, built by `build` on a miss (under the lock: plans for
  // one key are built once).
  std::shared_ptr<GemmPlan> GetOrBuild(const GemmKey& key,
                                       const std::function<std::unique_ptr<GemmPlan>()>& build);
  size_t size() const;
  // Every key with its plan's status (tests: which route a call took).
  std::vector<std::pair<GemmKey, absl::Status>> Entries() const;

 private:
  mutable std::mutex mu_;
  std::map<GemmKey, std::shared_ptr<GemmPlan>> plans_;
};

// The per-stream cuBLASLt workspace (TE and PyTorch use 32 MiB on Hopper).
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_GEMM_CACHE_H_
