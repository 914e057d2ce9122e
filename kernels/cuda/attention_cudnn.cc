// CudnnAttentionForward / CudnnAttentionBackward (attention_internal.h): the
// checks that decide whether cuDNN takes a call, its cached plan
// (attention_cudnn_sdpa.h has the graphs), its workspace and variant pack.
//
// cuDNN's bias and dBias are in the operands' dtype. ops.h's bias may be
// already (RelativeBiasForward writes it so: cuDNN reads it in place) or f32,
// cast into the workspace first; dBias (f32 in ops.h) is cast back after
// (bf16 rounding of the logit offsets, inside the bf16 tolerance). cuDNN has no dBias with a
// padding mask: bias + padding runs unfused unless no backward follows
// (AttentionArgs::forward_only). A call only makes its variant
// pack; the plans are built once per configuration.
#include <cudnn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_cudnn_graph.h"
#include "kernels/cuda/attention_cudnn_sdpa.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"
#include "kernels/workspace/workspace_bytes.h"

namespace te {
namespace cuda {

// The graphs, plans and variant packs are this file's vocabulary.
using namespace cudnn_graph;  // NOLINT(build/namespaces)

namespace {
std::atomic<int64_t> cudnn_calls{0};
std::atomic<int64_t> heads_outer_calls{0};
}  // namespace

int64_t CudnnAttentionCalls() { return cudnn_calls.load(); }
int64_t CudnnHeadsOuterCalls() { return heads_outer_calls.load(); }

namespace {

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
  // The graphs' causal mask is top-left aligned. Bottom-right equals it where
  // there are as many keys as queries and no per-batch lengths move the
  // diagonal (TE's own cuDNN path makes the same substitution); otherwise
  // these types run unfused.
  if (IsBottomRightMask(args.mask) &&
      (args.mask == MaskType::kPaddingCausalBottomRight || s.q_seq != s.kv_seq)) {
    return absl::UnimplementedError(
        absl::StrCat("a bottom-right causal mask with ", s.q_seq, " queries and ", s.kv_seq,
                     " keys", args.mask == MaskType::kPaddingCausalBottomRight
                                  ? " and per-batch lengths"
                                  : ""));
  }
  // The next two rules are dBias's; a forward that no backward reads (a
  // decode step) runs a bias over any lengths and with a padding mask.
  const bool needs_dbias = args.bias.data() != nullptr && !args.forward_only;
  if (needs_dbias && IsPaddingMask(args.mask)) {
    return absl::UnimplementedError("cuDNN has no dBias with a padding mask");
  }
  // Measured on the H200 with cuDNN 9.19: a TransformerLayer with a T5
  // relative-position bias at sequence 37 came out of cuDNN 3-5% (bf16) away
  // from the CPU in every gradient, while the same layer at 128 and every
  // bias-free case agreed to 0.5%. cuDNN's frontend refused dBias for
  // sequences not a multiple of 64 before 9.5; we keep that rule.
  if (needs_dbias && (s.q_seq % 64 != 0 || s.kv_seq % 64 != 0)) {
    return absl::UnimplementedError(absl::StrCat("bias with sequence lengths ", s.q_seq, "/",
                                                 s.kv_seq, " (cuDNN's dBias wants multiples of 64)"));
  }
  // Rows viewed inside longer sequences: the relative bias's bias-free far
  // part, nothing else (the padding path clears whole rows of B * S).
  if (qkv.batch_rows > 0 &&
      (IsPaddingMask(args.mask) || args.bias.defined() || qkv.batch_rows < s.q_seq ||
       qkv.batch_rows < s.kv_seq)) {
    return absl::UnimplementedError("rows inside longer sequences with a padding mask or bias");
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

// dbias: a backward that writes dBias (with a bias; without it the bias is
// only read).
PlanConfig MakeConfig(bool backward, const AttentionArgs& args, const AttentionShape& s,
                      const QkvMemory& qkv, bool dbias) {
  PlanConfig c;
  c.backward = backward;
  c.shape = s;
  c.dtype = qkv.dtype;
  c.q_token_stride = qkv.q_token_stride;
  c.kv_token_stride = qkv.kv_token_stride;
  c.batch_rows = qkv.batch_rows;
  c.padding = IsPaddingMask(args.mask);
  // Supported() lets through only a bottom-right mask that is top-left.
  c.causal = IsCausalMask(args.mask);
  c.bias = args.bias.data() != nullptr;
  c.dbias = backward && c.bias && dbias;
  c.dropout = args.dropout_rate;
  c.heads_outer = c.bias && !c.dbias && !c.padding && c.dropout == 0.0f &&
                  s.q_heads == s.kv_heads;
  return c;
}

// The plan of *config; where cuDNN declines its heads-outer views, the
// plain ones (*config changed to them).
absl::StatusOr<const CudnnPlan*> PlanFor(CudaOps* ops, PlanConfig* config) {
  auto plan = GetPlan(ops, *config);
  if (plan.ok() || !config->heads_outer || !absl::IsUnimplemented(plan.status())) return plan;
  config->heads_outer = false;
  return GetPlan(ops, *config);
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

// The call's workspace (kernels/workspace): the plan's own, then the
// graph's tensors that live in memory but are not ops.h's.
workspace::CudnnAttentionWorkspace WorkspaceLayout(const PlanConfig& c, const CudnnPlan& plan) {
  workspace::AttentionDims dims;
  dims.batch = c.shape.batch;
  dims.q_seq = c.shape.q_seq;
  dims.kv_seq = c.shape.kv_seq;
  dims.q_heads = c.shape.q_heads;
  dims.head_dim = c.shape.head_dim;
  return workspace::CudnnAttentionWorkspaceFor(c.backward, plan.workspace_bytes, dims, c.dtype,
                                               c.bias, c.dbias);
}

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

absl::StatusOr<int64_t> CudnnAttentionWorkspaceBytes(CudaOps* ops, bool backward,
                                                     const AttentionArgs& args,
                                                     const AttentionShape& shape,
                                                     const QkvMemory& qkv) {
  RETURN_IF_ERROR(Supported(*ops, args, shape, qkv, {}));
  // A backward with a bias may write dBias or only read the bias (a relative
  // bias's table gradient): the larger of the two.
  int64_t bytes = 0;
  for (const bool dbias : {true, false}) {
    PlanConfig config = MakeConfig(backward, args, shape, qkv, dbias);
    ASSIGN_OR_RETURN(const CudnnPlan* plan, PlanFor(ops, &config));
    RETURN_IF_ERROR(CheckOtherDirection(ops, config));
    bytes = std::max(bytes, WorkspaceLayout(config, *plan).total());
    if (!config.bias || !backward) break;
  }
  return bytes;
}

namespace {

// What a call needs to execute `config`'s plan: the plan (made with the
// other direction's, see CheckOtherDirection), the handle, and the
// workspace laid out, with the dropout seed written into it.
struct PreparedCall {
  const CudnnPlan* plan = nullptr;
  bool heads_outer = false;  // the plan's views (PlanFor may have dropped them)
  cudnnHandle_t handle = nullptr;
  workspace::CudnnAttentionWorkspace layout;
  char* base = nullptr;
  int64_t* seed_offset = nullptr;
};

absl::StatusOr<PreparedCall> Prepare(CudaOps* ops, PlanConfig config,
                                     const AttentionArgs& args) {
  PreparedCall call;
  ASSIGN_OR_RETURN(call.plan, PlanFor(ops, &config));
  call.heads_outer = config.heads_outer;
  RETURN_IF_ERROR(CheckOtherDirection(ops, config));
  ASSIGN_OR_RETURN(call.handle, ops->CudnnHandle());
  call.layout = WorkspaceLayout(config, *call.plan);
  ASSIGN_OR_RETURN(void* workspace, ops->Workspace(static_cast<size_t>(call.layout.total())));
  call.base = static_cast<char*>(workspace);
  call.seed_offset = reinterpret_cast<int64_t*>(call.base + call.layout.seed_offset_offset());
  if (config.dropout > 0.0f) {
    RETURN_IF_ERROR(WriteDropoutSeed(call.seed_offset, args.dropout_seed, ops->stream()));
  }
  return call;
}

// The bias as cuDNN reads it, in the operands' dtype: the caller's own memory
// when it is in that dtype already, else cast into the workspace's slot.
absl::StatusOr<const void*> BiasInOperandDtype(CudaOps* ops, const AttentionArgs& args,
                                               const QkvMemory& qkv, char* slot) {
  if (args.bias.dtype() == qkv.dtype && Aligned(args.bias.data())) return args.bias.data();
  Tensor cast = WorkspaceTensor(slot, qkv.dtype, args.bias.shape());
  RETURN_IF_ERROR(ops->Cast(args.bias, &cast));
  return slot;
}

}  // namespace

absl::Status CudnnAttentionForward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& shape, const QkvMemory& qkv,
                                   Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(Supported(*ops, args, shape, qkv, {{out->data(), out->dtype()}}));
  const PlanConfig config = MakeConfig(/*backward=*/false, args, shape, qkv, /*dbias=*/false);
  ASSIGN_OR_RETURN(const PreparedCall call, Prepare(ops, config, args));
  const workspace::CudnnAttentionWorkspace& layout = call.layout;
  char* base = call.base;
  int64_t* seed_offset = call.seed_offset;
  const Scalars scalars = MakeScalars(args);
  VariantPack pack;
  if (config.bias) {
    ASSIGN_OR_RETURN(const void* bias,
                     BiasInOperandDtype(ops, args, qkv, base + layout.bias_offset()));
    pack.Bind(kBias, bias);
  }
  pack.Bind(kQ, qkv.q);
  pack.Bind(kK, qkv.k);
  pack.Bind(kV, qkv.v);
  pack.Bind(kO, out->data());
  pack.Bind(kStats, softmax_lse->data());
  BindCommon(config, args, scalars, seed_offset, &pack);
  RETURN_IF_ERROR(pack.Execute(call.handle, *call.plan, call.base));
  cudnn_calls.fetch_add(1);
  if (call.heads_outer) heads_outer_calls.fetch_add(1);
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
  const PlanConfig config = MakeConfig(/*backward=*/true, args, shape, qkv, dbias != nullptr);
  ASSIGN_OR_RETURN(const PreparedCall call, Prepare(ops, config, args));
  const workspace::CudnnAttentionWorkspace& layout = call.layout;
  char* base = call.base;
  char* softmax_sum = base + layout.softmax_sum_offset();
  char* dq_accum = base + layout.dq_accum_offset();
  char* bias_io = base + layout.bias_offset();
  char* dbias_io = base + layout.dbias_offset();
  int64_t* seed_offset = call.seed_offset;
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
    ASSIGN_OR_RETURN(const void* bias, BiasInOperandDtype(ops, args, qkv, bias_io));
    pack.Bind(kBias, bias);
  }
  if (config.dbias) {
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
  RETURN_IF_ERROR(pack.Execute(call.handle, *call.plan, call.base));
  cudnn_calls.fetch_add(1);
  if (call.heads_outer) heads_outer_calls.fetch_add(1);
  if (config.dbias) {
    const Tensor dbias_view = WorkspaceTensor(dbias_io, qkv.dtype, args.bias.shape());
    RETURN_IF_ERROR(ops->Cast(dbias_view, dbias));
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
