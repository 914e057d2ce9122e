#include "kernels/cuda/workspace.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_cache.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "kernels/workspace/workspace_bytes.h"

namespace te {
namespace cuda {

absl::StatusOr<int64_t> GemmWorkspaceBytes(const Ops::GemmArgs& args, const Tensor& out) {
  ASSIGN_OR_RETURN(const GemmDims dims, CheckGemmArgs(args, &out));
  if (dims.m == 0 || dims.n == 0 || dims.k == 0) return 0;  // no library call
  workspace::GemmOperands g;
  g.a_dtype = args.a.dtype();
  g.b_dtype = args.b.dtype();
  g.a_numel = args.a.numel();
  g.b_numel = args.b.numel();
  g.transpose_a = args.transpose_a;
  g.transpose_b = args.transpose_b;
  g.m = dims.m;
  g.n = dims.n;
  return workspace::GemmWorkspaceBound(static_cast<int64_t>(kGemmWorkspaceBytes), g);
}

absl::StatusOr<int64_t> AttentionWorkspaceBytes(CudaOps* ops, bool backward,
                                                const AttentionArgs& args, const Tensor& q,
                                                const Tensor& k, const Tensor& v) {
  if (q.shape().size() != 4 || k.shape().size() != 4 || v.shape() != k.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention workspace: q ", ShapeString(q.shape()), ", k ", ShapeString(k.shape()),
        ", v ", ShapeString(v.shape()), ": want q [B, Sq, Hq, D] and k, v [B, Skv, Hk, D]"));
  }
  AttentionShape shape;
  shape.batch = q.shape()[0];
  shape.q_seq = q.shape()[1];
  shape.q_heads = q.shape()[2];
  shape.head_dim = q.shape()[3];
  shape.kv_seq = k.shape()[1];
  shape.kv_heads = k.shape()[2];
  workspace::AttentionDims dims;
  dims.batch = shape.batch;
  dims.q_seq = shape.q_seq;
  dims.kv_seq = shape.kv_seq;
  dims.q_heads = shape.q_heads;
  dims.head_dim = shape.head_dim;

  int64_t cudnn = 0;
  if (GetAttentionPath() == AttentionPath::kAuto && q.dtype() == k.dtype() &&
      q.dtype() == v.dtype()) {
    QkvMemory qkv;
    qkv.q = q.data();
    qkv.k = k.data();
    qkv.v = v.data();
    qkv.dtype = q.dtype();
    qkv.q_token_stride = shape.q_heads * shape.head_dim;
    qkv.kv_token_stride = shape.kv_heads * shape.head_dim;
    absl::StatusOr<int64_t> bytes = CudnnAttentionWorkspaceBytes(ops, backward, args, shape, qkv);
    if (bytes.ok()) {
      cudnn = *bytes;
    } else if (!absl::IsUnimplemented(bytes.status())) {
      return bytes.status();
    }
  }
  int64_t unfused = 0;
  if (backward) {
    AttentionProblem problem;
    problem.shape = shape;
    problem.bias = args.bias.data_as<const float>();
    problem.dropout_rate = args.dropout_rate;
    const bool small_head =
        GetAttentionPath() != AttentionPath::kGeneralFallbackOnly && SmallHeadAttentionFits(problem);
    unfused = workspace::FallbackAttentionBackwardWorkspace(
        dims, small_head,
        small_head ? static_cast<int64_t>(SmallHeadDropoutBitsBytes(problem)) : 0);
  }
  return std::max(cudnn, unfused);
}

}  // namespace cuda
}  // namespace te
