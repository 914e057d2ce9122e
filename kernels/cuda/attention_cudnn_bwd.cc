// cuDNN SDPA's backward graph: dQ, dK, dV [and dBias] from dO, O and Stats.
#include <cudnn.h>

#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {
namespace {

// grad = s^T x: s [B, Hq, Sq, Skv] (read as io), x [B, Hq, Sq, D], grad a K or
// V gradient [B, Hk, Skv, D]. Under GQA the product is formed for every query
// head, then summed over each kv head's group.
absl::Status KvHeadGradient(GraphBuilder& g, const Layouts& l, const CommonTensors& t,
                            cudnnDataType_t io, cudnnBackendDescriptor_t s,
                            cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t grad) {
  ASSIGN_OR_RETURN(auto s_t, g.Virtual(io, l.STDims(), l.STStrides()));
  RETURN_IF_ERROR(g.Reshape(s, s_t));
  if (l.hq == l.hk) return g.Matmul(s_t, x, grad, t.seq_kv, nullptr, t.seq_q);
  ASSIGN_OR_RETURN(auto per_query_head, g.Virtual(io, {l.b, l.hq, l.skv, l.d},
                                                  {l.hq * l.skv * l.d, l.skv * l.d, l.d, 1}));
  RETURN_IF_ERROR(g.Matmul(s_t, x, per_query_head, t.seq_kv, nullptr, t.seq_q));
  return g.Reduction(CUDNN_REDUCE_TENSOR_ADD, per_query_head, grad);
}

}  // namespace

absl::Status BuildBackward(cudnnHandle_t handle, const PlanConfig& c, CudnnPlan* plan) {
  GraphBuilder g(plan);
  const Layouts l(c);
  const cudnnDataType_t io = IoType(c.dtype);
  const bool dropout = c.dropout > 0.0f;
  ASSIGN_OR_RETURN(auto q, g.Tensor(kQ, io, l.QDims(), l.QStrides()));
  ASSIGN_OR_RETURN(auto kt, g.Tensor(kK, io, l.KvTDims(), l.KvTStrides()));
  ASSIGN_OR_RETURN(auto vt, g.Tensor(kV, io, l.KvTDims(), l.KvTStrides()));
  ASSIGN_OR_RETURN(auto o, g.Tensor(kO, io, l.QDims(), l.OStrides()));
  ASSIGN_OR_RETURN(auto d_o, g.Tensor(kDO, io, l.QDims(), l.OStrides()));
  ASSIGN_OR_RETURN(auto stats, g.Tensor(kStats, CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  ASSIGN_OR_RETURN(auto dq, g.Tensor(kDQ, io, l.QDims(), l.QStrides()));
  ASSIGN_OR_RETURN(auto dk, g.Tensor(kDK, io, l.KvDims(), l.KvStrides()));
  ASSIGN_OR_RETURN(auto dv, g.Tensor(kDV, io, l.KvDims(), l.KvStrides()));
  ASSIGN_OR_RETURN(auto softmax_sum,
                   g.Tensor(kSoftmaxSum, CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  // Without dBias, dQ accumulates in an f32 workspace tensor; with dBias cuDNN
  // takes its dP-workspace implementation, which writes dQ directly (and is
  // much slower: a relative bias's table gradient comes from its own kernel,
  // relative_bias_grad.cu, so that the bias is only read here).
  cudnnBackendDescriptor_t dq_accum = nullptr;
  cudnnBackendDescriptor_t dbias = nullptr;
  if (c.dbias) {
    ASSIGN_OR_RETURN(dbias, g.Tensor(kDBias, io, l.BiasDims(), l.BiasStrides()));
  } else {
    ASSIGN_OR_RETURN(dq_accum, g.Tensor(kDQAccum, CUDNN_DATA_FLOAT, l.QDims(), l.DqAccumStrides()));
  }
  ASSIGN_OR_RETURN(const CommonTensors t, MakeCommon(g, c, l));
  ASSIGN_OR_RETURN(auto keep_or_one, g.Scalar(dropout ? kKeepProbability : kOne, CUDNN_DATA_FLOAT));

  // softmax_sum = rowsum(dO * O) * (1 - p).
  ASSIGN_OR_RETURN(auto do_o, g.Virtual(CUDNN_DATA_FLOAT, l.QDims(), l.DoOStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, nullptr, do_o));
  ASSIGN_OR_RETURN(auto row_dot, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot));
  RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, keep_or_one, nullptr, softmax_sum));

  // P = exp(S - Stats), masked; with dropout, P * M / (1-p).
  ASSIGN_OR_RETURN(auto s, MaskedScores(g, c, l, t, q, kt, stats));
  ASSIGN_OR_RETURN(auto probs, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_EXP,
                                               CUDNN_DATA_FLOAT, s, nullptr));
  cudnnBackendDescriptor_t dropped = probs;
  cudnnBackendDescriptor_t keep = nullptr;
  if (dropout) {
    ASSIGN_OR_RETURN(keep, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Rng(1.0 - c.dropout, t.seed, t.offset, keep));
    ASSIGN_OR_RETURN(auto kept, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                CUDNN_DATA_FLOAT, probs, keep));
    ASSIGN_OR_RETURN(auto rescaled, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                    CUDNN_DATA_FLOAT, kept, t.drop_scale));
    dropped = rescaled;
  }

  // dV = P^T dO.
  RETURN_IF_ERROR(KvHeadGradient(g, l, t, io, dropped, d_o, dv));

  // dS = (dO V^T [* M] - softmax_sum) * exp(S - Stats) [/ (1-p)] * scale.
  ASSIGN_OR_RETURN(auto dp, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Matmul(d_o, vt, dp, t.seq_q, t.seq_kv, nullptr));
  cudnnBackendDescriptor_t last = dp;
  if (dropout) {
    ASSIGN_OR_RETURN(auto masked, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                  CUDNN_DATA_FLOAT, last, keep));
    last = masked;
  }
  ASSIGN_OR_RETURN(auto centred, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_SUB,
                                                 CUDNN_DATA_FLOAT, last, softmax_sum));
  ASSIGN_OR_RETURN(auto weighted, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                  CUDNN_DATA_FLOAT, centred, probs));
  last = weighted;
  if (dropout) {
    ASSIGN_OR_RETURN(auto rescaled, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                    CUDNN_DATA_FLOAT, last, t.drop_scale));
    last = rescaled;
  }
  if (c.dbias) RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, last, dbias));
  ASSIGN_OR_RETURN(auto ds, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                            CUDNN_DATA_FLOAT, last, t.scale));

  // dK = dS^T Q.
  RETURN_IF_ERROR(KvHeadGradient(g, l, t, io, ds, q, dk));

  // dQ = dS K, accumulated in f32 (workspace), then cast. K is K^T's memory
  // viewed untransposed (strides swapped back).
  ASSIGN_OR_RETURN(auto k, g.Virtual(io, l.KvDims(), l.KvStrides()));
  RETURN_IF_ERROR(g.Reshape(kt, k));
  if (c.dbias) {
    RETURN_IF_ERROR(g.Matmul(ds, k, dq, t.seq_q, nullptr, t.seq_kv));
  } else {
    RETURN_IF_ERROR(g.Matmul(ds, k, dq_accum, t.seq_q, nullptr, t.seq_kv));
    RETURN_IF_ERROR(
        g.Pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq));
  }
  return g.Finish(handle);
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
