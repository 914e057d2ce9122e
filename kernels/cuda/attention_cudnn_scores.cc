// The subgraphs both directions of cuDNN's SDPA share: masks, the common
// tensors, and the masked scores S.
#include <cudnn.h>

#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {
namespace {

// Padding: keep S[b, h, i, j] where i < seq_q[b] and j < seq_kv[b], else -inf.
absl::StatusOr<cudnnBackendDescriptor_t> PaddingMask(GraphBuilder& g, const Layouts& l,
                                                     cudnnBackendDescriptor_t s,
                                                     cudnnBackendDescriptor_t seq_q,
                                                     cudnnBackendDescriptor_t seq_kv,
                                                     cudnnBackendDescriptor_t neg_inf) {
  ASSIGN_OR_RETURN(auto row, g.Virtual(CUDNN_DATA_INT32, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, row, 2));
  ASSIGN_OR_RETURN(auto col, g.Virtual(CUDNN_DATA_INT32, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, s, nullptr, nullptr, col, 3));
  ASSIGN_OR_RETURN(auto row_ok, g.Virtual(CUDNN_DATA_BOOLEAN, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, seq_q, nullptr, row_ok));
  ASSIGN_OR_RETURN(auto col_ok, g.Virtual(CUDNN_DATA_BOOLEAN, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, seq_kv, nullptr, col_ok));
  ASSIGN_OR_RETURN(auto keep, g.Virtual(CUDNN_DATA_BOOLEAN, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep));
  ASSIGN_OR_RETURN(auto masked, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, neg_inf, keep, masked));
  return masked;
}

// Causal (top-left aligned): keep S[b, h, i, j] where i >= j, else -inf.
absl::StatusOr<cudnnBackendDescriptor_t> CausalMask(GraphBuilder& g, const Layouts& l,
                                                    cudnnBackendDescriptor_t s,
                                                    cudnnBackendDescriptor_t neg_inf) {
  ASSIGN_OR_RETURN(auto row, g.Virtual(CUDNN_DATA_INT32, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, nullptr, nullptr, row, 2));
  ASSIGN_OR_RETURN(auto col, g.Virtual(CUDNN_DATA_INT32, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, s, nullptr, nullptr, col, 3));
  ASSIGN_OR_RETURN(auto keep, g.Virtual(CUDNN_DATA_BOOLEAN, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep));
  ASSIGN_OR_RETURN(auto masked, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, s, neg_inf, keep, masked));
  return masked;
}

}  // namespace

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
  ASSIGN_OR_RETURN(auto scaled, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, t.scale, nullptr, scaled));
  cudnnBackendDescriptor_t last = scaled;
  if (c.bias) {
    ASSIGN_OR_RETURN(auto biased, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, last, t.bias, nullptr, biased));
    last = biased;
  }
  if (stats != nullptr) {
    ASSIGN_OR_RETURN(auto shifted, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, last, stats, nullptr, shifted));
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
