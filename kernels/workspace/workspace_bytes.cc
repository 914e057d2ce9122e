#include "kernels/workspace/workspace_bytes.h"

#include <algorithm>

namespace te {
namespace workspace {

GemmWorkspace GemmWorkspaceFor(GemmRoute route, int64_t library_bytes, const GemmOperands& g) {
  GemmWorkspace w;
  w.route = route;
  w.library = library_bytes;
  const int64_t product = RoundUp(g.m * g.n * static_cast<int64_t>(sizeof(float)));
  if (route == GemmRoute::kF32Operands) {
    w.b_copy = RoundUp(g.b_numel * static_cast<int64_t>(sizeof(float)));
    w.a_copy = RoundUp(g.a_numel * static_cast<int64_t>(sizeof(float)));
    w.product = product;
    return w;
  }
  const bool fp8 = IsFloat8(g.a_dtype);
  if (fp8 && !g.transpose_b) {
    w.b_copy = RoundUp(g.b_numel * static_cast<int64_t>(DTypeSize(g.b_dtype)));
  }
  if (fp8 && g.transpose_a) {
    w.a_copy = RoundUp(g.a_numel * static_cast<int64_t>(DTypeSize(g.a_dtype)));
  }
  if (route == GemmRoute::kF32Product) w.product = product;
  return w;
}

int64_t GemmWorkspaceBound(int64_t library_bytes, const GemmOperands& g) {
  int64_t bound = GemmWorkspaceFor(GemmRoute::kF32Operands, library_bytes, g).total();
  // Routes 1 and 2 are tried first for FP8 operands or one float dtype.
  if (IsFloat8(g.a_dtype) || g.a_dtype == g.b_dtype) {
    bound = std::max(bound, GemmWorkspaceFor(GemmRoute::kF32Product, library_bytes, g).total());
  }
  return bound;
}

CudnnAttentionWorkspace CudnnAttentionWorkspaceFor(bool backward, int64_t library_bytes,
                                                   const AttentionDims& d, DType io_dtype,
                                                   bool bias, bool dbias) {
  CudnnAttentionWorkspace w;
  w.library = RoundUp(library_bytes);
  const int64_t bias_bytes =
      bias ? RoundUp(d.q_heads * d.q_seq * d.kv_seq * static_cast<int64_t>(DTypeSize(io_dtype)))
           : 0;
  w.bias = bias_bytes;
  w.seed_offset = 2 * static_cast<int64_t>(sizeof(int64_t));
  if (!backward) return w;
  const int64_t rows = d.batch * d.q_heads * d.q_seq;
  w.softmax_sum = RoundUp(rows * static_cast<int64_t>(sizeof(float)));
  w.dq_accum = dbias ? 0 : RoundUp(rows * d.head_dim * static_cast<int64_t>(sizeof(float)));
  w.dbias = dbias ? bias_bytes : 0;
  return w;
}

int64_t FallbackAttentionBackwardWorkspace(const AttentionDims& d, bool small_head,
                                           int64_t dropout_bits_bytes) {
  const int64_t row_dot = d.batch * d.q_heads * d.q_seq * static_cast<int64_t>(sizeof(float));
  if (!small_head) return row_dot;
  return (row_dot + 15) / 16 * 16 + dropout_bits_bytes;
}

}  // namespace workspace
}  // namespace te
