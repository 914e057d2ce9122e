// How many device bytes an op's workspace takes, for given shapes and dtypes:
// the one place the CUDA backend's GEMM and attention scratch is sized, so the
// op asks for exactly this (CudaOps::Workspace, charged to the session's
// memory: RESOURCE_EXHAUSTED naming the limit when it does not fit) and a
// caller or test can know it beforehand. Pure arithmetic; thread-safe.
//
// Every region starts 256-byte aligned (RoundUp), as the layouts below lay
// them out one after another.
#ifndef TE_KERNELS_WORKSPACE_WORKSPACE_BYTES_H_
#define TE_KERNELS_WORKSPACE_WORKSPACE_BYTES_H_

#include <cstdint>

#include "kernels/tensor.h"

namespace te {
namespace workspace {

constexpr int64_t RoundUp(int64_t n) { return (n + 255) / 256 * 256; }

// ---- GEMM (kernels/cuda/gemm.cu) ------------------------------------------
// out [M, N] = op(a) op(b), K the contracted extent. The routes:
//   kNative:      cuBLASLt writes out itself;
//   kF32Product:  cuBLASLt writes an f32 product [M, N], one epilogue kernel
//                 rounds it into out;
//   kF32Operands: a and b converted to f32 first, then as kF32Product.
// FP8 operands (routes 1 and 2) want the TN layout: a transposed a ([K, M])
// or an untransposed b ([K, N]) is copied transposed into the workspace.
enum class GemmRoute { kNative, kF32Product, kF32Operands };

struct GemmOperands {
  DType a_dtype = DType::kF32;
  DType b_dtype = DType::kF32;
  int64_t a_numel = 0;
  int64_t b_numel = 0;
  bool transpose_a = false;
  bool transpose_b = false;
  int64_t m = 0;
  int64_t n = 0;
};

// Layout: library | b copy | a copy | f32 product (routes 1 and 2), or
// library | a f32 | b f32 | f32 product (route 3). Offsets from the start.
struct GemmWorkspace {
  GemmRoute route = GemmRoute::kNative;
  int64_t library = 0;  // cuBLASLt's own (the per-stream workspace size)
  int64_t b_copy = 0;   // FP8 b transposed into [N, K], or b as f32 (route 3)
  int64_t a_copy = 0;   // FP8 a transposed into [M, K], or a as f32 (route 3)
  int64_t product = 0;  // f32 [M, N] (routes 2 and 3)
  int64_t a_offset() const {
    return route == GemmRoute::kF32Operands ? library : library + b_copy;
  }
  int64_t b_offset() const {
    return route == GemmRoute::kF32Operands ? library + a_copy : library;
  }
  int64_t product_offset() const { return library + b_copy + a_copy; }
  int64_t total() const { return library + b_copy + a_copy + product; }
};

GemmWorkspace GemmWorkspaceFor(GemmRoute route, int64_t library_bytes, const GemmOperands& g);

// The most any route the call may take needs: what the op can draw, at most.
int64_t GemmWorkspaceBound(int64_t library_bytes, const GemmOperands& g);

// ---- cuDNN fused attention (kernels/cuda/attention_cudnn.cc) -------------
// Shapes as kernels/ops.h's attention: q [B, Sq, Hq, D], bias [Hq, Sq, Skv].
struct AttentionDims {
  int64_t batch = 0;
  int64_t q_seq = 0;
  int64_t kv_seq = 0;
  int64_t q_heads = 0;
  int64_t head_dim = 0;
};

// Forward: library | bias in the operand dtype (with bias) | seed, offset.
// Backward: library | softmax_sum [B, Hq, Sq] f32 | dQ accumulator
// [B, Hq, Sq, D] f32 (without dBias: cuDNN accumulates dQ in f32) | bias (with
// bias) and dBias (with dbias) in the operand dtype | seed, offset.
struct CudnnAttentionWorkspace {
  int64_t library = 0;  // the execution plan's own workspace
  int64_t softmax_sum = 0;
  int64_t dq_accum = 0;
  int64_t bias = 0;
  int64_t dbias = 0;
  int64_t seed_offset = 0;  // two int64
  int64_t softmax_sum_offset() const { return library; }
  int64_t dq_accum_offset() const { return library + softmax_sum; }
  int64_t bias_offset() const { return library + softmax_sum + dq_accum; }
  int64_t dbias_offset() const { return bias_offset() + bias; }
  int64_t seed_offset_offset() const { return dbias_offset() + dbias; }
  int64_t total() const { return seed_offset_offset() + seed_offset; }
};

// `library_bytes`: the plan's CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE.
CudnnAttentionWorkspace CudnnAttentionWorkspaceFor(bool backward, int64_t library_bytes,
                                                   const AttentionDims& dims, DType io_dtype,
                                                   bool bias, bool dbias);

// ---- unfused attention (kernels/cuda/attention.cu) ------------------------
// The forward needs none. The backward: row_dot [B, Hq, Sq] f32, and for the
// small-head kernels (16-byte aligned after it) the dropout bits they hand
// from the dq pass to the dk/dv pass (`dropout_bits_bytes`, 0 where unused).
int64_t FallbackAttentionBackwardWorkspace(const AttentionDims& dims, bool small_head,
                                           int64_t dropout_bits_bytes);

}  // namespace workspace
}  // namespace te

#endif  // TE_KERNELS_WORKSPACE_WORKSPACE_BYTES_H_
