// cuDNN's fused flash attention (scaled dot-product attention) as cuDNN 9
// graphs, built by hand on attention_cudnn_graph.h. The graphs are the ones
// cuDNN's runtime fusion engine recognises as SDPA (cuDNN docs: "Graph API >
// Fused Flash Attention fprop/bprop"):
//
//   forward:  S = Q K^T * scale [+ bias] -> [padding mask] -> [causal mask] -> softmax
//             (max, exp, sum; Stats = max + log(sum), natural log) -> P
//             -> [P * Bernoulli(1-p) * 1/(1-p)] -> O = P V
//   backward: softmax_sum = rowsum(dO * O) * (1-p); S recomputed from Q, K and
//             Stats; dV = P^T dO; dP = dO V^T [* mask]; dS = (dP - softmax_sum)
//             * exp(S - Stats) [* 1/(1-p)] * scale; dK = dS^T Q; dQ = dS K
//             (accumulated in f32, then cast); with a bias, dBias = sum over the
//             batch of dS (before * scale), and dQ is written directly.
//
// Masks are pointwise subgraphs: GEN_INDEX row/column, compares against the
// per-batch lengths (padding) or each other (causal), BINARY_SELECT with -inf.
// Softmax stats are the log-sum-exp in the natural-log domain, as ops.h's
// softmax_lse.
//
//   attention_cudnn_scores.cc  the pieces both directions share (masks, S)
//   attention_cudnn_fwd.cc     BuildForward
//   attention_cudnn_bwd.cc     BuildBackward
//   attention_cudnn_cache.cc   GetPlan: each plan built once per configuration
//                              (heuristic mode A, first engine config that
//                              finalizes) and cached on the stream
//   attention_cudnn.cc         CudnnAttentionForward/Backward: support checks,
//                              workspace, variant pack, execution
#ifndef TE_KERNELS_CUDA_ATTENTION_CUDNN_SDPA_H_
#define TE_KERNELS_CUDA_ATTENTION_CUDNN_SDPA_H_

#include <cudnn.h>

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_cudnn_graph.h"
#include "kernels/cuda/attention_internal.h"  // QkvMemory
#include "kernels/op_checks.h"  // AttentionShape
#include "kernels/ops.h"

namespace te {
namespace cuda {

class CudaOps;

namespace cudnn_graph {

// What a plan depends on. Scale is bound per call (by value); the dropout
// probability is part of the graph, and so are the token strides of q, k, v
// and their gradients (separate tensors or packed qkv: different plans).
struct PlanConfig {
  bool backward = false;
  AttentionShape shape;
  DType dtype = DType::kBF16;
  int64_t q_token_stride = 0;  // QkvMemory's
  int64_t kv_token_stride = 0;
  int64_t batch_rows = 0;  // QkvMemory's
  bool padding = false;
  bool causal = false;
  bool bias = false;
  bool dbias = false;  // backward with a bias: writes dBias (else reads the bias only)
  float dropout = 0.0f;
  // cuDNN's [b, h] axes are ops.h's [head, batch] (Layouts): with a bias
  // shared over the batch, the blocks cuDNN runs at once then take one head
  // of several batch rows, which read the same [Sq, Skv] bias through L2,
  // instead of one batch row of several heads, which each read their own
  // from memory. On the H100 at the 24 x 1024 LM's shape this took about a
  // tenth off what the bias adds to cuDNN's forward and backward (the rest is
  // cuDNN's slower kernel with a bias operand, not the reads). Only where the
  // views are all that changes: no per-batch lengths, no dropout (its mask
  // follows cuDNN's indices), no GQA, no dBias.
  bool heads_outer = false;

  std::string Key() const {
    return absl::StrCat(backward ? "bwd" : "fwd", "/", shape.batch, "/", shape.q_seq, "/",
                        shape.kv_seq, "/", shape.q_heads, "/", shape.kv_heads, "/",
                        shape.head_dim, "/", static_cast<int>(dtype), "/", q_token_stride, "/",
                        kv_token_stride, "/", batch_rows, "/", padding, causal, bias, dbias, heads_outer, "/",
                        dropout);
  }
};

// The layouts of ops.h's tensors as cuDNN's [b, h, s, d] views. q, k, v and
// their gradients are [B, S, H, D] with tokens q_token / kv_token elements
// apart (H*D, or 3*H*D inside a packed qkv); out and dout are always
// contiguous [B, Sq, Hq, D]. With heads_outer the first two axes of every
// view trade places (the memory is the same); the graph's virtual score
// tensors are packed in the order cuDNN sees.
struct Layouts {
  explicit Layouts(const PlanConfig& c)
      : b(c.shape.batch),
        hq(c.shape.q_heads),
        hk(c.shape.kv_heads),
        sq(c.shape.q_seq),
        skv(c.shape.kv_seq),
        d(c.shape.head_dim),
        q_token(c.q_token_stride),
        kv_token(c.kv_token_stride),
        q_rows(c.batch_rows > 0 ? c.batch_rows : sq),
        kv_rows(c.batch_rows > 0 ? c.batch_rows : skv),
        heads_outer(c.heads_outer) {}
  Dims QDims() const { return Outer({b, hq, sq, d}); }
  Dims QStrides() const { return Outer({q_rows * q_token, d, q_token, 1}); }  // q, dq
  Dims OStrides() const { return Outer({q_rows * hq * d, d, hq * d, 1}); }    // out, dout
  Dims KvDims() const { return Outer({b, hk, skv, d}); }
  Dims KvStrides() const { return Outer({kv_rows * kv_token, d, kv_token, 1}); }
  Dims KvTDims() const { return Outer({b, hk, d, skv}); }  // K^T, V^T: the same memory
  Dims KvTStrides() const { return Outer({kv_rows * kv_token, d, 1, kv_token}); }
  Dims SDims() const { return Outer({b, hq, sq, skv}); }
  Dims SStrides() const { return {SDims()[1] * sq * skv, sq * skv, skv, 1}; }
  Dims STDims() const { return Outer({b, hq, skv, sq}); }
  Dims STStrides() const { return {STDims()[1] * sq * skv, sq * skv, 1, skv}; }
  Dims RowDims() const { return Outer({b, hq, sq, 1}); }  // Stats, softmax_sum: [B, Hq, Sq]
  Dims RowStrides() const { return Outer({hq * sq, sq, 1, 1}); }
  Dims BiasDims() const { return Outer({1, hq, sq, skv}); }  // [Hq, Sq, Skv], shared by the batch
  Dims BiasStrides() const { return Outer({hq * sq * skv, sq * skv, skv, 1}); }
  Dims DoOStrides() const { return Outer({hq * sq * d, sq * d, hq * d, 1}); }  // dO * O, virtual
  Dims DqAccumStrides() const { return Outer({hq * sq * d, sq * d, d, 1}); }  // [B, Hq, Sq, D]
  Dims LenDims() const { return {b, 1, 1, 1}; }
  Dims LenStrides() const { return {1, 1, 1, 1}; }
  int64_t b, hq, hk, sq, skv, d;
  int64_t q_token, kv_token;
  int64_t q_rows, kv_rows;  // tokens from one batch row to the next
  bool heads_outer;

 private:
  Dims Outer(Dims x) const {
    if (heads_outer) std::swap(x[0], x[1]);
    return x;
  }
};

inline cudnnDataType_t IoType(DType dtype) {
  return dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

// The tensors both directions share.
struct CommonTensors {
  cudnnBackendDescriptor_t scale = nullptr;
  cudnnBackendDescriptor_t seq_q = nullptr;
  cudnnBackendDescriptor_t seq_kv = nullptr;
  cudnnBackendDescriptor_t neg_inf = nullptr;
  cudnnBackendDescriptor_t seed = nullptr;
  cudnnBackendDescriptor_t offset = nullptr;
  cudnnBackendDescriptor_t drop_scale = nullptr;
  cudnnBackendDescriptor_t bias = nullptr;
};

// y = mode(x, b) (GraphBuilder::Pointwise) into a new virtual tensor of S's
// shape [B, Hq, Sq, Skv] with elements of `type`.
absl::StatusOr<cudnnBackendDescriptor_t> ScoresPointwise(
    GraphBuilder& g, const Layouts& l, cudnnDataType_t type, cudnnPointwiseMode_t mode,
    cudnnDataType_t math, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
    cudnnBackendDescriptor_t t = nullptr, int64_t axis = -1);

// The shared tensors of configuration c (scale; lengths and -inf with masks;
// bias; seed, offset and 1/(1-p) with dropout).
absl::StatusOr<CommonTensors> MakeCommon(GraphBuilder& g, const PlanConfig& c, const Layouts& l);

// S = Q K^T * scale [+ bias] [- stats], then the masks (stats null: forward).
absl::StatusOr<cudnnBackendDescriptor_t> MaskedScores(GraphBuilder& g, const PlanConfig& c,
                                                      const Layouts& l, const CommonTensors& t,
                                                      cudnnBackendDescriptor_t q,
                                                      cudnnBackendDescriptor_t kt,
                                                      cudnnBackendDescriptor_t stats);

// The forward and backward graphs of c and their plans (UNIMPLEMENTED where
// cuDNN declines the configuration).
absl::Status BuildForward(cudnnHandle_t handle, const PlanConfig& c, CudnnPlan* plan);
absl::Status BuildBackward(cudnnHandle_t handle, const PlanConfig& c, CudnnPlan* plan);

// The plan of config on ops' stream, built on first use and cached (a
// declined configuration is cached as declined). The plan lives as long as
// ops.
absl::StatusOr<const CudnnPlan*> GetPlan(CudaOps* ops, const PlanConfig& config);

}  // namespace cudnn_graph

// The workspace CudnnAttentionForward (backward false) or
// CudnnAttentionBackward asks CudaOps::Workspace for on this call's
// configuration (kernels/workspace's layout with the plan's own bytes; the
// plan is built and cached if it was not). UNIMPLEMENTED where cuDNN would
// decline the call.
absl::StatusOr<int64_t> CudnnAttentionWorkspaceBytes(CudaOps* ops, bool backward,
                                                     const AttentionArgs& args,
                                                     const AttentionShape& shape,
                                                     const QkvMemory& qkv);

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ATTENTION_CUDNN_SDPA_H_
