// cuDNN SDPA's forward graph: O = softmax(S) [* dropout] V, with Stats.
#include <cudnn.h>

#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {

absl::Status BuildForward(cudnnHandle_t handle, const PlanConfig& c, CudnnPlan* plan) {
  GraphBuilder g(plan);
  const Layouts l(c);
  const cudnnDataType_t io = IoType(c.dtype);
  ASSIGN_OR_RETURN(auto q, g.Tensor(kQ, io, l.QDims(), l.QStrides()));
  ASSIGN_OR_RETURN(auto kt, g.Tensor(kK, io, l.KvTDims(), l.KvTStrides()));
  ASSIGN_OR_RETURN(auto v, g.Tensor(kV, io, l.KvDims(), l.KvStrides()));
  ASSIGN_OR_RETURN(auto o, g.Tensor(kO, io, l.QDims(), l.OStrides()));
  ASSIGN_OR_RETURN(auto stats, g.Tensor(kStats, CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  ASSIGN_OR_RETURN(const CommonTensors t, MakeCommon(g, c, l));
  ASSIGN_OR_RETURN(auto s, MaskedScores(g, c, l, t, q, kt, nullptr));

  // Softmax with its statistics: Stats = max + log(sum(exp(S - max))).
  ASSIGN_OR_RETURN(auto row_max, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_MAX, s, row_max));
  ASSIGN_OR_RETURN(auto centred, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_SUB,
                                                 CUDNN_DATA_FLOAT, s, row_max));
  ASSIGN_OR_RETURN(auto exps, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_EXP,
                                              CUDNN_DATA_FLOAT, centred, nullptr));
  ASSIGN_OR_RETURN(auto row_sum, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum));
  ASSIGN_OR_RETURN(auto log_sum, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum, nullptr, nullptr, log_sum));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, row_max, log_sum, nullptr, stats));
  // P goes into the second matmul in the operand dtype.
  const bool dropout = c.dropout > 0.0f;
  ASSIGN_OR_RETURN(auto probs,
                   ScoresPointwise(g, l, dropout ? CUDNN_DATA_FLOAT : io, CUDNN_POINTWISE_DIV,
                                   CUDNN_DATA_FLOAT, exps, row_sum));
  cudnnBackendDescriptor_t last = probs;
  if (dropout) {
    ASSIGN_OR_RETURN(auto keep, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Rng(1.0 - c.dropout, t.seed, t.offset, keep));
    ASSIGN_OR_RETURN(auto kept, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                CUDNN_DATA_FLOAT, probs, keep));
    ASSIGN_OR_RETURN(auto rescaled, ScoresPointwise(g, l, io, CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT,
                                                    kept, t.drop_scale));
    last = rescaled;
  }
  RETURN_IF_ERROR(g.Matmul(last, v, o, t.seq_q, nullptr, t.seq_kv));
  return g.Finish(handle);
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
