// The workspace the CUDA backend's GEMM and attention draw for a call
// (CudaOps::Workspace: one block per stream, grown on demand, kept, and
// charged to the session's memory like any tensor). The arithmetic is
// kernels/workspace/workspace_bytes.h's; these add what only the device
// knows (cuBLASLt's per-stream workspace, cuDNN's plan for the shapes). Each
// is an upper bound on what the op asks CudaOps::Workspace for; outputs and
// the op's own tensors (Ops::Allocate) are not included.
#ifndef TE_KERNELS_CUDA_WORKSPACE_H_
#define TE_KERNELS_CUDA_WORKSPACE_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace te {
namespace cuda {

class CudaOps;

// CudaOps::Gemm(args, out): the largest route the call can take.
// INVALID_ARGUMENT where Gemm would refuse the arguments.
absl::StatusOr<int64_t> GemmWorkspaceBytes(const Ops::GemmArgs& args, const Tensor& out);

// CudaOps::AttentionForward (backward false) or AttentionBackward on
// separate q [B, Sq, Hq, D], k, v [B, Skv, Hk, D]: the larger of cuDNN's
// (its plan built and cached on ops' stream where cuDNN takes the call) and
// the unfused path's.
absl::StatusOr<int64_t> AttentionWorkspaceBytes(CudaOps* ops, bool backward,
                                                const AttentionArgs& args, const Tensor& q,
                                                const Tensor& k, const Tensor& v);

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_WORKSPACE_H_
