// cuDNN's fused flash attention through the cuDNN 9 graph (backend) API,
// written by hand (cuDNN's C++ frontend is not available here). The graphs are
// the ones cuDNN's runtime fusion engine recognises as scaled dot-product
// attention (cuDNN docs: "Graph API > Fused Flash Attention fprop/bprop"):
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
// ops.h's bias and dbias are f32; cuDNN's are the operand dtype, so the bias is
// cast into the workspace first and dBias cast back after (bf16 rounding of
// the logit offsets, inside the bf16 tolerance). cuDNN has no dBias with a
// padding mask: bias + padding runs unfused.
//
// Masks are pointwise subgraphs: GEN_INDEX row/column, compares against the
// per-batch lengths (padding) or each other (causal), BINARY_SELECT with -inf.
// Softmax stats are the log-sum-exp in the natural-log domain, as ops.h's
// softmax_lse. Each execution plan is built once per shape (heuristic mode A,
// first engine config that finalizes) and cached on the stream; a call only
// makes its variant pack.
#include <cudnn.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {

namespace {
std::atomic<int64_t> cudnn_calls{0};
}  // namespace

int64_t CudnnAttentionCalls() { return cudnn_calls.load(); }

namespace {

// UIDs of the tensors a call binds in its variant pack. Virtual tensors
// (intermediates that never reach memory) count up from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kSeqQ,
  kSeqKv,
  kSeed,
  kOffset,
  kDropScale,
  kKeepProbability,
  kNegInf,
  kOne,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kBias,
  kDBias,
  kFirstVirtual = 1000,
};

constexpr int64_t kAlignment = 16;  // bytes, promised for every bound tensor

absl::Status Declined(const std::string& what, cudnnStatus_t status) {
  if (status == CUDNN_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": cuDNN is out of memory"));
  }
  return absl::UnimplementedError(absl::StrCat(what, ": ", cudnnGetErrorString(status)));
}

// Owns backend descriptors; destroys them in reverse order of creation.
class DescriptorSet {
 public:
  DescriptorSet() = default;
  DescriptorSet(const DescriptorSet&) = delete;
  DescriptorSet& operator=(const DescriptorSet&) = delete;
  ~DescriptorSet() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) {
      (void)cudnnBackendDestroyDescriptor(*it);
    }
  }

  absl::StatusOr<cudnnBackendDescriptor_t> Make(cudnnBackendDescriptorType_t type) {
    cudnnBackendDescriptor_t d = nullptr;
    const cudnnStatus_t status = cudnnBackendCreateDescriptor(type, &d);
    if (status != CUDNN_STATUS_SUCCESS) {
      return Declined(absl::StrCat("creating backend descriptor type ", static_cast<int>(type)),
                      status);
    }
    owned_.push_back(d);
    return d;
  }

  // Destroys one descriptor early (a plan that did not finalize).
  void Destroy(cudnnBackendDescriptor_t d) {
    for (auto it = owned_.begin(); it != owned_.end(); ++it) {
      if (*it == d) {
        (void)cudnnBackendDestroyDescriptor(d);
        owned_.erase(it);
        return;
      }
    }
  }

 private:
  std::vector<cudnnBackendDescriptor_t> owned_;
};

absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                 cudnnBackendAttributeType_t type, int64_t count, const void* values,
                 const char* what) {
  const cudnnStatus_t status = cudnnBackendSetAttribute(d, name, type, count, values);
  if (status != CUDNN_STATUS_SUCCESS) {
    return Declined(absl::StrCat(what, ": setting attribute ", static_cast<int>(name)), status);
  }
  return absl::OkStatus();
}

absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                     cudnnBackendDescriptor_t value, const char* what) {
  return Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
}

absl::Status Finalize(cudnnBackendDescriptor_t d, const char* what) {
  const cudnnStatus_t status = cudnnBackendFinalize(d);
  if (status != CUDNN_STATUS_SUCCESS) return Declined(absl::StrCat(what, " did not finalize"), status);
  return absl::OkStatus();
}

// One built graph: its descriptors (kept alive with the plan) and the plan.
struct CudnnPlan {
  DescriptorSet descriptors;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
};

using Dims = std::vector<int64_t>;

// Builds an operation graph op by op, then its execution plan.
class GraphBuilder {
 public:
  explicit GraphBuilder(CudnnPlan* plan) : set_(plan->descriptors), plan_(plan) {}

  absl::StatusOr<cudnnBackendDescriptor_t> Tensor(int64_t uid, cudnnDataType_t type,
                                                  const Dims& dims, const Dims& strides,
                                                  bool is_virtual = false,
                                                  bool by_value = false) {
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t t, set_.Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR));
    const char* what = "tensor";
    const int64_t rank = static_cast<int64_t>(dims.size());
    RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, what));
    RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, dims.data(), what));
    RETURN_IF_ERROR(
        Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, strides.data(), what));
    RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what));
    RETURN_IF_ERROR(
        Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &kAlignment, what));
    RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what));
    if (by_value) {
      RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what));
    }
    RETURN_IF_ERROR(Finalize(t, "tensor"));
    return t;
  }

  absl::StatusOr<cudnnBackendDescriptor_t> Virtual(cudnnDataType_t type, const Dims& dims,
                                                   const Dims& strides) {
    return Tensor(next_virtual_uid_++, type, dims, strides, /*is_virtual=*/true);
  }

  // A scalar passed by value from host memory at execution.
  absl::StatusOr<cudnnBackendDescriptor_t> Scalar(int64_t uid, cudnnDataType_t type) {
    return Tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, /*is_virtual=*/false,
                  /*by_value=*/true);
  }

  // y = mode(x, b) (or mode(x) when b is null; BINARY_SELECT: t ? x : b).
  absl::Status Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                         cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                         int64_t axis = -1) {
    const char* what = "pointwise";
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pw, set_.Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
    RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what));
    RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, what));
    if (axis >= 0) {
      RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what));
    }
    RETURN_IF_ERROR(Finalize(pw, what));
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                     set_.Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, what));
    if (b != nullptr) RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, what));
    if (t != nullptr) RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, what));
    RETURN_IF_ERROR(Finalize(op, "pointwise operation"));
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // c = a @ b (batched over the leading dims, f32 accumulation); the
  // overrides (int32 [B,1,1,1]) bound M, N, K per batch for padding masks.
  absl::Status Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t m_override,
                      cudnnBackendDescriptor_t n_override, cudnnBackendDescriptor_t k_override) {
    const char* what = "matmul";
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t mm, set_.Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR));
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    RETURN_IF_ERROR(Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
    RETURN_IF_ERROR(Finalize(mm, what));
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                     set_.Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, what));
    if (m_override != nullptr) {
      RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override, what));
    }
    if (n_override != nullptr) {
      RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override, what));
    }
    if (k_override != nullptr) {
      RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override, what));
    }
    RETURN_IF_ERROR(Finalize(op, "matmul operation"));
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // y = reduce(x) over the dimensions where y has extent 1 (or fewer heads).
  absl::Status Reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                         cudnnBackendDescriptor_t y) {
    const char* what = "reduction";
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t rd, set_.Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR));
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    RETURN_IF_ERROR(Set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1,
                        &reduce, what));
    RETURN_IF_ERROR(Set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
    RETURN_IF_ERROR(Finalize(rd, what));
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                     set_.Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, what));
    RETURN_IF_ERROR(Finalize(op, "reduction operation"));
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // y = x viewed with y's dims and strides (a transpose, for the matmuls).
  absl::Status Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    const char* what = "reshape";
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                     set_.Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what));
    RETURN_IF_ERROR(Finalize(op, "reshape operation"));
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // y = Bernoulli(keep_probability) from cuDNN's Philox stream (seed, offset).
  absl::Status Rng(double keep_probability, cudnnBackendDescriptor_t seed,
                   cudnnBackendDescriptor_t offset, cudnnBackendDescriptor_t y) {
    const char* what = "rng";
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t rng, set_.Make(CUDNN_BACKEND_RNG_DESCRIPTOR));
    const cudnnRngDistribution_t distribution = CUDNN_RNG_DISTRIBUTION_BERNOULLI;
    RETURN_IF_ERROR(Set(rng, CUDNN_ATTR_RNG_DISTRIBUTION, CUDNN_TYPE_RNG_DISTRIBUTION, 1,
                        &distribution, what));
    RETURN_IF_ERROR(Set(rng, CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY, CUDNN_TYPE_DOUBLE, 1,
                        &keep_probability, what));
    RETURN_IF_ERROR(Finalize(rng, what));
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op, set_.Make(CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_YDESC, y, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_SEED, seed, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC, offset, what));
    RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_DESC, rng, what));
    RETURN_IF_ERROR(Finalize(op, "rng operation"));
    ops_.push_back(op);
    return absl::OkStatus();
  }

  // The operation graph, heuristics (mode A), and the first engine config
  // whose plan finalizes.
  absl::Status Finish(cudnnHandle_t handle) {
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t graph,
                     set_.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
    RETURN_IF_ERROR(Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                        static_cast<int64_t>(ops_.size()), ops_.data(), "operation graph"));
    RETURN_IF_ERROR(
        Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph"));
    RETURN_IF_ERROR(Finalize(graph, "the operation graph"));

    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t heuristics,
                     set_.Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR));
    RETURN_IF_ERROR(SetDesc(heuristics, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics"));
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    RETURN_IF_ERROR(
        Set(heuristics, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics"));
    RETURN_IF_ERROR(Finalize(heuristics, "the engine heuristics"));
    int64_t count = 0;
    cudnnStatus_t status = cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
    if (status != CUDNN_STATUS_SUCCESS) return Declined("counting engine configs", status);
    if (count <= 0) return absl::UnimplementedError("no cuDNN engine supports this graph");
    std::vector<cudnnBackendDescriptor_t> configs(static_cast<size_t>(count));
    for (auto& config : configs) {
      ASSIGN_OR_RETURN(config, set_.Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    }
    int64_t returned = 0;
    status = cudnnBackendGetAttribute(heuristics, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                                      configs.data());
    if (status != CUDNN_STATUS_SUCCESS) return Declined("reading engine configs", status);

    cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
    for (int64_t i = 0; i < returned; ++i) {
      ASSIGN_OR_RETURN(cudnnBackendDescriptor_t plan,
                       set_.Make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR));
      RETURN_IF_ERROR(
          Set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "plan"));
      RETURN_IF_ERROR(SetDesc(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, configs[i], "plan"));
      last = cudnnBackendFinalize(plan);
      if (last != CUDNN_STATUS_SUCCESS) {
        set_.Destroy(plan);
        continue;
      }
      int64_t workspace = 0;
      int64_t got = 0;
      status = cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                        CUDNN_TYPE_INT64, 1, &got, &workspace);
      if (status != CUDNN_STATUS_SUCCESS) return Declined("reading the plan's workspace", status);
      plan_->plan = plan;
      plan_->workspace_bytes = workspace;
      return absl::OkStatus();
    }
    return Declined(absl::StrCat("none of ", returned, " engine configs made a plan"), last);
  }

 private:
  DescriptorSet& set_;
  CudnnPlan* plan_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = kFirstVirtual;
};

// What a plan depends on. Scale is bound per call (by value); the dropout
// probability is part of the graph, and so are the token strides of q, k, v
// and their gradients (separate tensors or packed qkv: different plans).
struct PlanConfig {
  bool backward = false;
  AttentionShape shape;
  DType dtype = DType::kBF16;
  int64_t q_token_stride = 0;  // QkvMemory's
  int64_t kv_token_stride = 0;
  bool padding = false;
  bool causal = false;
  bool bias = false;
  float dropout = 0.0f;

  std::string Key() const {
    return absl::StrCat(backward ? "bwd" : "fwd", "/", shape.batch, "/", shape.q_seq, "/",
                        shape.kv_seq, "/", shape.q_heads, "/", shape.kv_heads, "/",
                        shape.head_dim, "/", static_cast<int>(dtype), "/", q_token_stride, "/",
                        kv_token_stride, "/", padding, causal, bias, "/", dropout);
  }
};

// The layouts of ops.h's tensors as cuDNN's [b, h, s, d] views. q, k, v and
// their gradients are [B, S, H, D] with tokens q_token / kv_token elements
// apart (H*D, or 3*H*D inside a packed qkv); out and dout are always
// contiguous [B, Sq, Hq, D].
struct Layouts {
  explicit Layouts(const PlanConfig& c)
      : b(c.shape.batch),
        hq(c.shape.q_heads),
        hk(c.shape.kv_heads),
        sq(c.shape.q_seq),
        skv(c.shape.kv_seq),
        d(c.shape.head_dim),
        q_token(c.q_token_stride),
        kv_token(c.kv_token_stride) {}
  Dims QDims() const { return {b, hq, sq, d}; }
  Dims QStrides() const { return {sq * q_token, d, q_token, 1}; }  // q, dq
  Dims OStrides() const { return {sq * hq * d, d, hq * d, 1}; }    // out, dout
  Dims KvDims() const { return {b, hk, skv, d}; }
  Dims KvStrides() const { return {skv * kv_token, d, kv_token, 1}; }
  Dims KvTDims() const { return {b, hk, d, skv}; }  // K^T, V^T: the same memory
  Dims KvTStrides() const { return {skv * kv_token, d, 1, kv_token}; }
  Dims SDims() const { return {b, hq, sq, skv}; }
  Dims SStrides() const { return {hq * sq * skv, sq * skv, skv, 1}; }
  Dims STDims() const { return {b, hq, skv, sq}; }
  Dims STStrides() const { return {hq * sq * skv, sq * skv, 1, skv}; }
  Dims RowDims() const { return {b, hq, sq, 1}; }  // Stats, softmax_sum: [B, Hq, Sq]
  Dims RowStrides() const { return {hq * sq, sq, 1, 1}; }
  Dims BiasDims() const { return {1, hq, sq, skv}; }  // [Hq, Sq, Skv], shared by the batch
  Dims BiasStrides() const { return {hq * sq * skv, sq * skv, skv, 1}; }
  Dims LenDims() const { return {b, 1, 1, 1}; }
  Dims LenStrides() const { return {1, 1, 1, 1}; }
  int64_t b, hq, hk, sq, skv, d;
  int64_t q_token, kv_token;
};

cudnnDataType_t IoType(DType dtype) {
  return dtype == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

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
  ASSIGN_OR_RETURN(auto centred, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s, row_max, nullptr, centred));
  ASSIGN_OR_RETURN(auto exps, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centred, nullptr, nullptr, exps));
  ASSIGN_OR_RETURN(auto row_sum, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum));
  ASSIGN_OR_RETURN(auto log_sum, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, row_sum, nullptr, nullptr, log_sum));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, row_max, log_sum, nullptr, stats));
  // P goes into the second matmul in the operand dtype.
  const bool dropout = c.dropout > 0.0f;
  ASSIGN_OR_RETURN(auto probs, g.Virtual(dropout ? CUDNN_DATA_FLOAT : io, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, exps, row_sum, nullptr, probs));
  cudnnBackendDescriptor_t last = probs;
  if (dropout) {
    ASSIGN_OR_RETURN(auto keep, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Rng(1.0 - c.dropout, t.seed, t.offset, keep));
    ASSIGN_OR_RETURN(auto kept, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, probs, keep, nullptr, kept));
    ASSIGN_OR_RETURN(auto rescaled, g.Virtual(io, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(
        g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, kept, t.drop_scale, nullptr, rescaled));
    last = rescaled;
  }
  RETURN_IF_ERROR(g.Matmul(last, v, o, t.seq_q, nullptr, t.seq_kv));
  return g.Finish(handle);
}

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
  // takes its dP-workspace implementation, which writes dQ directly.
  cudnnBackendDescriptor_t dq_accum = nullptr;
  cudnnBackendDescriptor_t dbias = nullptr;
  if (c.bias) {
    ASSIGN_OR_RETURN(dbias, g.Tensor(kDBias, io, l.BiasDims(), l.BiasStrides()));
  } else {
    ASSIGN_OR_RETURN(dq_accum, g.Tensor(kDQAccum, CUDNN_DATA_FLOAT, l.QDims(),
                                        {l.hq * l.sq * l.d, l.sq * l.d, l.d, 1}));
  }
  ASSIGN_OR_RETURN(const CommonTensors t, MakeCommon(g, c, l));
  ASSIGN_OR_RETURN(auto keep_or_one, g.Scalar(dropout ? kKeepProbability : kOne, CUDNN_DATA_FLOAT));

  // softmax_sum = rowsum(dO * O) * (1 - p).
  ASSIGN_OR_RETURN(auto do_o, g.Virtual(CUDNN_DATA_FLOAT, l.QDims(),
                                        {l.hq * l.sq * l.d, l.sq * l.d, l.hq * l.d, 1}));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, d_o, o, nullptr, do_o));
  ASSIGN_OR_RETURN(auto row_dot, g.Virtual(CUDNN_DATA_FLOAT, l.RowDims(), l.RowStrides()));
  RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot));
  RETURN_IF_ERROR(
      g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, keep_or_one, nullptr, softmax_sum));

  // P = exp(S - Stats), masked; with dropout, P * M / (1-p).
  ASSIGN_OR_RETURN(auto s, MaskedScores(g, c, l, t, q, kt, stats));
  ASSIGN_OR_RETURN(auto probs, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s, nullptr, nullptr, probs));
  cudnnBackendDescriptor_t dropped = probs;
  cudnnBackendDescriptor_t keep = nullptr;
  if (dropout) {
    ASSIGN_OR_RETURN(keep, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Rng(1.0 - c.dropout, t.seed, t.offset, keep));
    ASSIGN_OR_RETURN(auto kept, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, probs, keep, nullptr, kept));
    ASSIGN_OR_RETURN(auto rescaled, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(
        g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, kept, t.drop_scale, nullptr, rescaled));
    dropped = rescaled;
  }

  // dV = P^T dO (GQA: over all query heads, then summed per kv head).
  const bool gqa = l.hq != l.hk;
  ASSIGN_OR_RETURN(auto probs_t, g.Virtual(io, l.STDims(), l.STStrides()));
  RETURN_IF_ERROR(g.Reshape(dropped, probs_t));
  const Dims full_head_dims = {l.b, l.hq, l.skv, l.d};
  const Dims full_head_strides = {l.hq * l.skv * l.d, l.skv * l.d, l.d, 1};
  if (!gqa) {
    RETURN_IF_ERROR(g.Matmul(probs_t, d_o, dv, t.seq_kv, nullptr, t.seq_q));
  } else {
    ASSIGN_OR_RETURN(auto dv_full, g.Virtual(io, full_head_dims, full_head_strides));
    RETURN_IF_ERROR(g.Matmul(probs_t, d_o, dv_full, t.seq_kv, nullptr, t.seq_q));
    RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dv));
  }

  // dS = (dO V^T [* M] - softmax_sum) * exp(S - Stats) [/ (1-p)] * scale.
  ASSIGN_OR_RETURN(auto dp, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Matmul(d_o, vt, dp, t.seq_q, t.seq_kv, nullptr));
  cudnnBackendDescriptor_t last = dp;
  if (dropout) {
    ASSIGN_OR_RETURN(auto masked, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, last, keep, nullptr, masked));
    last = masked;
  }
  ASSIGN_OR_RETURN(auto centred, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, last, softmax_sum, nullptr, centred));
  ASSIGN_OR_RETURN(auto weighted, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, centred, probs, nullptr, weighted));
  last = weighted;
  if (dropout) {
    ASSIGN_OR_RETURN(auto rescaled, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
    RETURN_IF_ERROR(
        g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, last, t.drop_scale, nullptr, rescaled));
    last = rescaled;
  }
  if (c.bias) RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, last, dbias));
  ASSIGN_OR_RETURN(auto ds, g.Virtual(CUDNN_DATA_FLOAT, l.SDims(), l.SStrides()));
  RETURN_IF_ERROR(g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, last, t.scale, nullptr, ds));

  // dK = dS^T Q.
  ASSIGN_OR_RETURN(auto ds_t, g.Virtual(io, l.STDims(), l.STStrides()));
  RETURN_IF_ERROR(g.Reshape(ds, ds_t));
  if (!gqa) {
    RETURN_IF_ERROR(g.Matmul(ds_t, q, dk, t.seq_kv, nullptr, t.seq_q));
  } else {
    ASSIGN_OR_RETURN(auto dk_full, g.Virtual(io, full_head_dims, full_head_strides));
    RETURN_IF_ERROR(g.Matmul(ds_t, q, dk_full, t.seq_kv, nullptr, t.seq_q));
    RETURN_IF_ERROR(g.Reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dk));
  }

  // dQ = dS K, accumulated in f32 (workspace), then cast. K is K^T's memory
  // viewed untransposed (strides swapped back).
  ASSIGN_OR_RETURN(auto k, g.Virtual(io, l.KvDims(), l.KvStrides()));
  RETURN_IF_ERROR(g.Reshape(kt, k));
  if (c.bias) {
    RETURN_IF_ERROR(g.Matmul(ds, k, dq, t.seq_q, nullptr, t.seq_kv));
  } else {
    RETURN_IF_ERROR(g.Matmul(ds, k, dq_accum, t.seq_q, nullptr, t.seq_kv));
    RETURN_IF_ERROR(
        g.Pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq));
  }
  return g.Finish(handle);
}

struct PlanEntry {
  absl::Status status;  // UNIMPLEMENTED: cuDNN declined this configuration
  CudnnPlan plan;
};

}  // namespace

// Per stream (the plans hold the stream's cuDNN handle). Entries are never
// evicted: a session sees few distinct shapes.
struct AttentionPlanCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<PlanEntry>> entries;
};

namespace {

absl::StatusOr<const CudnnPlan*> GetPlan(CudaOps* ops, const PlanConfig& config) {
  std::shared_ptr<AttentionPlanCache>& cache = ops->attention_plans();
  if (cache == nullptr) cache = std::make_shared<AttentionPlanCache>();
  std::lock_guard<std::mutex> lock(cache->mu);
  const std::string key = config.Key();
  auto it = cache->entries.find(key);
  if (it == cache->entries.end()) {
    auto handle = ops->CudnnHandle();
    if (!handle.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("cuDNN is unavailable: ", handle.status().message()));
    }
    auto entry = std::make_shared<PlanEntry>();
    entry->status = config.backward ? BuildBackward(*handle, config, &entry->plan)
                                    : BuildForward(*handle, config, &entry->plan);
    if (!entry->status.ok() && !absl::IsUnimplemented(entry->status)) return entry->status;
    it = cache->entries.emplace(key, std::move(entry)).first;
  }
  if (!it->second->status.ok()) return it->second->status;
  return &it->second->plan;
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlignment == 0; }

// A tensor the call binds besides q, k and v.
struct Operand {
  const void* data;
  DType dtype;
};

// The checks that decide, before any graph is built, whether cuDNN can take
// the call; UNIMPLEMENTED with the reason if not.
absl::Status Supported(const CudaOps& ops, const AttentionArgs& args, const AttentionShape& s,
                       const QkvMemory& qkv, const std::vector<Operand>& others) {
  if (cudnnGetVersion() < 90000) {
    return absl::UnimplementedError(absl::StrCat("cuDNN ", cudnnGetVersion(), " is older than 9.0"));
  }
  if (ops.context().properties.major < 8) {
    return absl::UnimplementedError("fused attention needs compute capability 8.0 or newer");
  }
  const bool padding = args.mask == MaskType::kPadding || args.mask == MaskType::kPaddingCausal;
  if (args.bias.data() != nullptr && padding) {
    return absl::UnimplementedError("cuDNN has no dBias with a padding mask");
  }
  // Measured on the H200 with cuDNN 9.19: a TransformerLayer with a T5
  // relative-position bias at sequence 37 came out of cuDNN 3-5% (bf16) away
  // from the CPU in every gradient, while the same layer at 128 and every
  // bias-free case agreed to 0.5%. cuDNN's frontend refused dBias for
  // sequences not a multiple of 64 before 9.5; we keep that rule.
  if (args.bias.data() != nullptr && (s.q_seq % 64 != 0 || s.kv_seq % 64 != 0)) {
    return absl::UnimplementedError(absl::StrCat("bias with sequence lengths ", s.q_seq, "/",
                                                 s.kv_seq, " (cuDNN's dBias wants multiples of 64)"));
  }
  const DType dtype = qkv.dtype;
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return absl::UnimplementedError(absl::StrCat(DTypeName(dtype), " operands (bf16/f16 only)"));
  }
  for (const Operand& t : others) {
    if (t.dtype != dtype) {
      return absl::UnimplementedError("operands and outputs of different dtypes");
    }
    if (!Aligned(t.data)) return absl::UnimplementedError("a tensor is not 16-byte aligned");
  }
  // Inside a packed qkv, k and v start H*D and 2*H*D elements past q: each
  // part's base and row pitch must meet the alignment the graph promises
  // (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT; Hopper's TMA needs it too).
  for (const void* part : {qkv.q, qkv.k, qkv.v}) {
    if (!Aligned(part)) {
      return absl::UnimplementedError("q, k or v does not start 16-byte aligned");
    }
  }
  const int64_t element = static_cast<int64_t>(DTypeSize(dtype));
  if ((qkv.q_token_stride * element) % kAlignment != 0 ||
      (qkv.kv_token_stride * element) % kAlignment != 0) {
    return absl::UnimplementedError(absl::StrCat("token strides ", qkv.q_token_stride, "/",
                                                 qkv.kv_token_stride,
                                                 " elements are not 16-byte multiples"));
  }
  if (s.head_dim % 8 != 0 || s.head_dim > 256) {
    return absl::UnimplementedError(
        absl::StrCat("head_dim ", s.head_dim, " (cuDNN wants a multiple of 8, at most 256)"));
  }
  return absl::OkStatus();
}

PlanConfig MakeConfig(bool backward, const AttentionArgs& args, const AttentionShape& s,
                      const QkvMemory& qkv) {
  PlanConfig c;
  c.backward = backward;
  c.shape = s;
  c.dtype = qkv.dtype;
  c.q_token_stride = qkv.q_token_stride;
  c.kv_token_stride = qkv.kv_token_stride;
  c.padding = args.mask == MaskType::kPadding || args.mask == MaskType::kPaddingCausal;
  c.causal = args.mask == MaskType::kCausal || args.mask == MaskType::kPaddingCausal;
  c.bias = args.bias.data() != nullptr;
  c.dropout = args.dropout_rate;
  return c;
}

// With dropout both directions must run on cuDNN (same Philox mask), so a
// configuration goes to cuDNN only if both plans build.
absl::Status CheckOtherDirection(CudaOps* ops, const PlanConfig& config) {
  if (config.dropout <= 0.0f) return absl::OkStatus();
  PlanConfig other = config;
  other.backward = !config.backward;
  auto plan = GetPlan(ops, other);
  if (!plan.ok()) {
    return absl::UnimplementedError(absl::StrCat(
        "with dropout both directions must run on cuDNN, and the ",
        other.backward ? "backward" : "forward", " was declined: ", plan.status().message()));
  }
  return absl::OkStatus();
}

// The host-side values of the by-value scalars; alive across Execute.
struct Scalars {
  float scale = 1.0f;
  float neg_inf = -INFINITY;
  float drop_scale = 1.0f;
  float keep_probability = 1.0f;
  float one = 1.0f;
};

class VariantPack {
 public:
  void Bind(int64_t uid, const void* p) {
    uids_.push_back(uid);
    pointers_.push_back(const_cast<void*>(p));
  }

  absl::Status Execute(cudnnHandle_t handle, const CudnnPlan& plan, void* workspace) {
    DescriptorSet set;
    ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pack, set.Make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
    const int64_t n = static_cast<int64_t>(uids_.size());
    RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids_.data(),
                        "variant pack"));
    RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                        pointers_.data(), "variant pack"));
    RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace,
                        "variant pack"));
    RETURN_IF_ERROR(Finalize(pack, "the variant pack"));
    CUDNN_RETURN_IF_ERROR(cudnnBackendExecute(handle, plan.plan, pack));
    return absl::OkStatus();
  }

 private:
  std::vector<int64_t> uids_;
  std::vector<void*> pointers_;
};

constexpr size_t RoundUp(size_t n) { return (n + 255) / 256 * 256; }

void BindCommon(const PlanConfig& c, const AttentionArgs& args, const Scalars& scalars,
                const int64_t* seed_offset, VariantPack* pack) {
  pack->Bind(kScale, &scalars.scale);
  if (c.padding) {
    pack->Bind(kSeqQ, args.q_seqlens.data());
    pack->Bind(kSeqKv, args.kv_seqlens.data());
  }
  if (c.padding || c.causal) pack->Bind(kNegInf, &scalars.neg_inf);
  if (c.dropout > 0.0f) {
    pack->Bind(kSeed, seed_offset);
    pack->Bind(kOffset, seed_offset + 1);
    pack->Bind(kDropScale, &scalars.drop_scale);
  }
}

// A view of workspace memory as a tensor (the workspace owns the memory).
Tensor WorkspaceTensor(void* data, DType dtype, const Shape& shape) {
  return Tensor(std::shared_ptr<void>(), data, dtype, shape);
}

Scalars MakeScalars(const AttentionArgs& args) {
  Scalars s;
  s.scale = args.scale;
  s.drop_scale = 1.0f / (1.0f - args.dropout_rate);
  s.keep_probability = 1.0f - args.dropout_rate;
  return s;
}

}  // namespace

absl::Status CudnnAttentionForward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& shape, const QkvMemory& qkv,
                                   Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(Supported(*ops, args, shape, qkv, {{out->data(), out->dtype()}}));
  const PlanConfig config = MakeConfig(/*backward=*/false, args, shape, qkv);
  ASSIGN_OR_RETURN(const CudnnPlan* plan, GetPlan(ops, config));
  RETURN_IF_ERROR(CheckOtherDirection(ops, config));
  ASSIGN_OR_RETURN(cudnnHandle_t handle, ops->CudnnHandle());

  // Workspace: cuDNN's own | bias in the operand dtype | seed, offset.
  const size_t library = RoundUp(static_cast<size_t>(plan->workspace_bytes));
  const size_t bias_bytes = config.bias ? RoundUp(args.bias.numel() * DTypeSize(qkv.dtype)) : 0;
  ASSIGN_OR_RETURN(void* workspace, ops->Workspace(library + bias_bytes + 2 * sizeof(int64_t)));
  char* base = static_cast<char*>(workspace);
  int64_t* seed_offset = reinterpret_cast<int64_t*>(base + library + bias_bytes);
  if (config.dropout > 0.0f) {
    RETURN_IF_ERROR(WriteDropoutSeed(seed_offset, args.dropout_seed, ops->stream()));
  }
  const Scalars scalars = MakeScalars(args);
  VariantPack pack;
  if (config.bias) {
    Tensor bias_io = WorkspaceTensor(base + library, qkv.dtype, args.bias.shape());
    RETURN_IF_ERROR(ops->Cast(args.bias, &bias_io));
    pack.Bind(kBias, bias_io.data());
  }
  pack.Bind(kQ, qkv.q);
  pack.Bind(kK, qkv.k);
  pack.Bind(kV, qkv.v);
  pack.Bind(kO, out->data());
  pack.Bind(kStats, softmax_lse->data());
  BindCommon(config, args, scalars, seed_offset, &pack);
  RETURN_IF_ERROR(pack.Execute(handle, *plan, workspace));
  cudnn_calls.fetch_add(1);
  if (config.padding) {
    // Rows past q_seqlens (or with no valid key) are unspecified in cuDNN's
    // output; ops.h wants zeros and lse = +inf there.
    AttentionProblem problem;
    problem.shape = shape;
    problem.q_seqlens = args.q_seqlens.data_as<const int32_t>();
    problem.kv_seqlens = args.kv_seqlens.data_as<const int32_t>();
    problem.causal = config.causal;
    RETURN_IF_ERROR(ZeroInvisibleRows(problem, out->data(), out->dtype(),
                                      softmax_lse->data_as<float>(), ops->stream()));
  }
  return absl::OkStatus();
}

absl::Status CudnnAttentionBackward(CudaOps* ops, const AttentionArgs& args,
                                    const AttentionShape& shape, const QkvMemory& qkv,
                                    const Tensor& out, const Tensor& dout,
                                    const Tensor& softmax_lse, const DqkvMemory& grads,
                                    Tensor* dbias) {
  RETURN_IF_ERROR(Supported(*ops, args, shape, qkv,
                            {{out.data(), out.dtype()},
                             {dout.data(), dout.dtype()},
                             {grads.dq, grads.dtype},
                             {grads.dk, grads.dtype},
                             {grads.dv, grads.dtype}}));
  if (!Aligned(softmax_lse.data())) return absl::UnimplementedError("softmax_lse is not aligned");
  const PlanConfig config = MakeConfig(/*backward=*/true, args, shape, qkv);
  ASSIGN_OR_RETURN(const CudnnPlan* plan, GetPlan(ops, config));
  RETURN_IF_ERROR(CheckOtherDirection(ops, config));
  ASSIGN_OR_RETURN(cudnnHandle_t handle, ops->CudnnHandle());

  // Workspace: cuDNN's own | softmax_sum [B, Hq, Sq] f32 | dQ accumulator
  // [B, Hq, Sq, D] f32 (without bias) | bias and dBias in the operand dtype
  // (with bias) | seed, offset.
  const size_t library = RoundUp(static_cast<size_t>(plan->workspace_bytes));
  const size_t rows = static_cast<size_t>(shape.batch * shape.q_heads * shape.q_seq);
  const size_t softmax_sum_bytes = RoundUp(rows * sizeof(float));
  const size_t dq_accum_bytes =
      config.bias ? 0 : RoundUp(rows * static_cast<size_t>(shape.head_dim) * sizeof(float));
  const size_t bias_bytes = config.bias ? RoundUp(args.bias.numel() * DTypeSize(qkv.dtype)) : 0;
  ASSIGN_OR_RETURN(void* workspace,
                   ops->Workspace(library + softmax_sum_bytes + dq_accum_bytes + 2 * bias_bytes +
                                  2 * sizeof(int64_t)));
  char* base = static_cast<char*>(workspace);
  char* softmax_sum = base + library;
  char* dq_accum = softmax_sum + softmax_sum_bytes;
  char* bias_io = dq_accum + dq_accum_bytes;
  char* dbias_io = bias_io + bias_bytes;
  int64_t* seed_offset = reinterpret_cast<int64_t*>(dbias_io + bias_bytes);
  if (config.dropout > 0.0f) {
    RETURN_IF_ERROR(WriteDropoutSeed(seed_offset, args.dropout_seed, ops->stream()));
  }
  if (config.padding) {
    // cuDNN leaves gradient rows past the valid lengths untouched; ops.h's
    // are zero there. Each gradient is B*S rows of H*D elements, a token
    // stride apart (contiguous when the stride is H*D).
    const size_t element = DTypeSize(grads.dtype);
    const struct {
      void* data;
      int64_t heads, seq, token_stride;
    } parts[] = {{grads.dq, shape.q_heads, shape.q_seq, qkv.q_token_stride},
                 {grads.dk, shape.kv_heads, shape.kv_seq, qkv.kv_token_stride},
                 {grads.dv, shape.kv_heads, shape.kv_seq, qkv.kv_token_stride}};
    for (const auto& part : parts) {
      CUDA_RETURN_IF_ERROR(cudaMemset2DAsync(
          part.data, static_cast<size_t>(part.token_stride) * element, 0,
          static_cast<size_t>(part.heads * shape.head_dim) * element,
          static_cast<size_t>(shape.batch * part.seq), ops->stream()));
    }
  }
  const Scalars scalars = MakeScalars(args);
  VariantPack pack;
  if (config.bias) {
    Tensor bias_view = WorkspaceTensor(bias_io, qkv.dtype, args.bias.shape());
    RETURN_IF_ERROR(ops->Cast(args.bias, &bias_view));
    pack.Bind(kBias, bias_io);
    pack.Bind(kDBias, dbias_io);
  } else {
    pack.Bind(kDQAccum, dq_accum);
  }
  pack.Bind(kQ, qkv.q);
  pack.Bind(kK, qkv.k);
  pack.Bind(kV, qkv.v);
  pack.Bind(kO, out.data());
  pack.Bind(kDO, dout.data());
  pack.Bind(kStats, softmax_lse.data());
  pack.Bind(kDQ, grads.dq);
  pack.Bind(kDK, grads.dk);
  pack.Bind(kDV, grads.dv);
  pack.Bind(kSoftmaxSum, softmax_sum);
  pack.Bind(config.dropout > 0.0f ? kKeepProbability : kOne,
            config.dropout > 0.0f ? &scalars.keep_probability : &scalars.one);
  BindCommon(config, args, scalars, seed_offset, &pack);
  RETURN_IF_ERROR(pack.Execute(handle, *plan, workspace));
  cudnn_calls.fetch_add(1);
  if (config.bias) {
    const Tensor dbias_view = WorkspaceTensor(dbias_io, qkv.dtype, args.bias.shape());
    RETURN_IF_ERROR(ops->Cast(dbias_view, dbias));
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
