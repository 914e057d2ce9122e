// The subgraphs both directions of cuDNN's SDPA share: masks, the common
// tensors, and the masked scores S.
#include <cudnn.h>

#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {
namespace {

struct RowColumn {
  cudnnBackendDescriptor_t row, column;
};
// S's row index i and column index j as int32 tensors of S's shape (GEN_INDEX
// along axes 2 and 3, computed in `math`).
absl::StatusOr<RowColumn> ScoresIndices(GraphBuilder& g, const Layouts& l,
                                        cudnnBackendDescriptor_t s, cudnnDataType_t math) {
  RowColumn rc;
  ASSIGN_OR_RETURN(rc.row, ScoresPointwise(g, l, CUDNN_DATA_INT32, CUDNN_POINTWISE_GEN_INDEX, math,
                                           s, nullptr, nullptr, 2));
  ASSIGN_OR_RETURN(rc.column, ScoresPointwise(g, l, CUDNN_DATA_INT32, CUDNN_POINTWISE_GEN_INDEX,
                                              math, s, nullptr, nullptr, 3));
  return rc;
}

// S where keep, else -inf.
absl::StatusOr<cudnnBackendDescriptor_t> KeepOrNegInf(GraphBuilder& g, const Layouts& l,
                                                      cudnnBackendDescriptor_t s,
                                                      cudnnBackendDescriptor_t keep,
                                                      cudnnBackendDescriptor_t neg_inf) {
  return ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s,
                         neg_inf, keep);
}

// Padding: keep S[b, h, i, j] where i < seq_q[b] and j < seq_kv[b], else -inf.
absl::StatusOr<cudnnBackendDescriptor_t> PaddingMask(GraphBuilder& g, const Layouts& l,
                                                     cudnnBackendDescriptor_t s,
                                                     cudnnBackendDescriptor_t seq_q,
                                                     cudnnBackendDescriptor_t seq_kv,
                                                     cudnnBackendDescriptor_t neg_inf) {
  ASSIGN_OR_RETURN(const RowColumn index, ScoresIndices(g, l, s, CUDNN_DATA_INT32));
  ASSIGN_OR_RETURN(auto row_ok, ScoresPointwise(g, l, CUDNN_DATA_BOOLEAN, CUDNN_POINTWISE_CMP_LT,
                                                CUDNN_DATA_BOOLEAN, index.row, seq_q));
  ASSIGN_OR_RETURN(auto col_ok, ScoresPointwise(g, l, CUDNN_DATA_BOOLEAN, CUDNN_POINTWISE_CMP_LT,
                                                CUDNN_DATA_BOOLEAN, index.column, seq_kv));
  ASSIGN_OR_RETURN(auto keep, ScoresPointwise(g, l, CUDNN_DATA_BOOLEAN, CUDNN_POINTWISE_LOGICAL_AND,
                                              CUDNN_DATA_BOOLEAN, row_ok, col_ok));
  return KeepOrNegInf(g, l, s, keep, neg_inf);
}

// Causal (top-left aligned): keep S[b, h, i, j] where i >= j, else -inf.
absl::StatusOr<cudnnBackendDescriptor_t> CausalMask(GraphBuilder& g, const Layouts& l,
                                                    cudnnBackendDescriptor_t s,
                                                    cudnnBackendDescriptor_t neg_inf) {
  ASSIGN_OR_RETURN(const RowColumn index, ScoresIndices(g, l, s, CUDNN_DATA_FLOAT));
  ASSIGN_OR_RETURN(auto keep, ScoresPointwise(g, l, CUDNN_DATA_BOOLEAN, CUDNN_POINTWISE_CMP_GE,
                                              CUDNN_DATA_BOOLEAN, index.row, index.column));
  return KeepOrNegInf(g, l, s, keep, neg_inf);
}

}  // namespace

absl::StatusOr<cudnnBackendDescriptor_t> ScoresPointwise(
    GraphBuilder& g, const Layouts& l, cudnnDataType_t type, cudnnPointwiseMode_t mode,
    cudnnDataType_t math, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
    cudnnBackendDescriptor_t t, int64_t axis) {
  ASSIGN_OR_RETURN(auto y, g.Virtual(type, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(mode, math, x, b, t, y, axis));
  return y;
}

absl::StatusOr<CommonTensors> MakeCommon(GraphBuilder& g, const PlanConfig& c, const Layouts& l) {
  CommonTensors t;
  ASSIGN_OR_RETURN(t.scale, g.Scalar(kScale, CUDNN_DATA_FLOAT));
  if (c.padding) {
    ASSIGN_OR_RETURN(t.seq_q, g.Tensor(kSeqQ, CUDNN_DATA_INT32, l.LenDims(), l.LenStrides()));
    ASSIGN_OR_RETURN(t.seq_kv, g.Tensor(kSeqKv, CUDNN_DATA_INT32, l.LenDims(), l.LenStrides()));
  }
  if (c.padding || c.causal) {
    ASSIGN_OR_RETURN(t.neg_inf, g.Scalar(kNegInf, CUDNN_DATA_FLOAT));
  }
  if (c.bias) {
    ASSIGN_OR_RETURN(t.bias, g.Tensor(kBias, IoType(c.dtype), l.BiasDims(), l.BiasStrides()));
  }
  if (c.dropout > 0.0f) {
    ASSIGN_OR_RETURN(t.seed, g.Tensor(kSeed, CUDNN_DATA_INT64, {1, 1, 1, 1}, {1, 1, 1, 1}));
    ASSIGN_OR_RETURN(t.offset, g.Tensor(kOffset, CUDNN_DATA_INT64, {1, 1, 1, 1}, {1, 1, 1, 1}));
    ASSIGN_OR_RETURN(t.drop_scale, g.Scalar(kDropScale, CUDNN_DATA_FLOAT));
  }
  return t;
}

// S = Q K^T * scale [+ bias] [- stats], then the masks.
absl::StatusOr<cudnnBackendDescriptor_t> MaskedScores(GraphBuilder& g, const PlanConfig& c,
                                                      const Layouts& l, const CommonTensors& t,
                                                      cudnnBackendDescriptor_t q,
                                                      cudnnBackendDescriptor_t kt,
                                                      cudnnBackendDescriptor_t stats) {
  ASSIGN_OR_RETURN(auto s, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Matmul(q, kt, s, t.seq_q, t.seq_kv, nullptr));
  ASSIGN_OR_RETURN(auto scaled, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_MUL,
                                                CUDNN_DATA_FLOAT, s, t.scale));
  cudnnBackendDescriptor_t last = scaled;
  if (c.bias) {
    ASSIGN_OR_RETURN(auto biased, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_ADD,
                                                  CUDNN_DATA_FLOAT, last, t.bias));
    last = biased;
  }
  if (stats != nullptr) {
    ASSIGN_OR_RETURN(auto shifted, ScoresPointwise(g, l, CUDNN_DATA_FLOAT, CUDNN_POINTWISE_SUB,
                                                   CUDNN_DATA_FLOAT, last, stats));
    last = shifted;
  }
  if (c.padding) {
    ASSIGN_OR_RETURN(last, PaddingMask(g, l, last, t.seq_q, t.seq_kv, t.neg_inf));
  }
  if (c.causal) {
    ASSIGN_OR_RETURN(last, CausalMask(g, l, last, t.neg_inf));
  }
  return last;
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
