// CudaOps::AttentionForward / AttentionBackward: argument checks, then (a
// forward of one query row per sequence, a decode step's) the decode kernel
// of attention_decode.cu, else cuDNN's fused SDPA (attention_cudnn.cc) where
// it takes the call, else the unfused kernels: attention_small_head.cu for
// head_dim <= 32 without a bias, attention_fallback.cu for the rest. The
// first fallback of each configuration is logged once on stderr with cuDNN's
// reason.
//
// The packed variants (qkv [B, S, 3, H, D]) hand cuDNN pointers into qkv and
// dqkv with a token stride of 3*H*D, so nothing is copied. Where cuDNN
// declines the packed layout (or the unfused path is forced) they run Ops'
// default, which splits qkv and calls the unpacked op above (logged once per
// configuration, as the unpacked fallback is).
//
// With dropout, forward and backward must draw the same mask, and cuDNN's
// Philox stream is not kernels/rng.h's: such a call goes to cuDNN only when
// cuDNN takes both its forward and its backward (decided identically in both
// directions, packed and unpacked separately), else both run unfused.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

std::atomic<int> attention_path{static_cast<int>(AttentionPath::kAuto)};
std::atomic<int64_t> packed_cudnn_calls{0};
std::atomic<int64_t> relative_band_calls{0};
std::atomic<int64_t> relative_split_calls{0};
std::atomic<bool> relative_split_on{false};
std::atomic<int64_t> decode_attention_calls{0};

__global__ void WriteDropoutSeedKernel(int64_t* dst, uint64_t seed) {
  dst[0] = static_cast<int64_t>(seed);
  dst[1] = 0;
}

const char* MaskName(MaskType mask) {
  switch (mask) {
    case MaskType::kNoMask: return "no_mask";
    case MaskType::kPadding: return "padding";
    case MaskType::kCausal: return "causal";
    case MaskType::kPaddingCausal: return "padding_causal";
    case MaskType::kCausalBottomRight: return "causal_bottom_right";
    case MaskType::kPaddingCausalBottomRight: return "padding_causal_bottom_right";
  }
  return "?";
}

// The configuration as the fallback log names it. `direction`: "forward",
// "backward packed", ...
std::string Describe(const char* direction, const AttentionArgs& args, const AttentionShape& s,
                     DType dtype) {
  return absl::StrCat(direction, " ", DTypeName(dtype), " q [", s.batch, ", ", s.q_seq, ", ",
                      s.q_heads, ", ", s.head_dim, "] kv [", s.batch, ", ", s.kv_seq, ", ",
                      s.kv_heads, ", ", s.head_dim, "] mask ", MaskName(args.mask),
                      args.elementwise_mask.defined() ? " + elementwise" : "", " dropout ",
                      args.dropout_rate, args.bias.defined() ? " bias" : "");
}

// `outcome`: what runs instead ("runs unfused", ...).
void LogFallbackOnce(const std::string& config, const char* outcome, const absl::Status& reason) {
  static std::mutex mu;
  static std::set<std::string>* logged = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (!logged->insert(config).second) return;
  std::fprintf(stderr, "te_server: attention %s %s (cuDNN fused attention declined: %s)\n",
               config.c_str(), outcome, std::string(reason.message()).c_str());
}

constexpr char kSplit[] = "splits qkv into q, k, v first";

// What runs where cuDNN declines.
const char* Unfused(bool small_head) {
  return small_head ? "runs unfused (small-head kernels)" : "runs unfused";
}

bool SameDtype(const Tensor& a, const Tensor& b, const Tensor& c) {
  return a.dtype() == b.dtype() && a.dtype() == c.dtype();
}

// Separate q, k, v [B, S, H, D] as cuDNN reads them (one dtype: the caller
// checks).
QkvMemory SeparateQkv(const AttentionShape& s, const Tensor& q, const Tensor& k,
                      const Tensor& v) {
  QkvMemory m;
  m.q = q.data();
  m.k = k.data();
  m.v = v.data();
  m.dtype = q.dtype();
  m.q_token_stride = s.q_heads * s.head_dim;
  m.kv_token_stride = s.kv_heads * s.head_dim;
  return m;
}

// An elementwise (arbitrary) mask is not a cuDNN padding or causal mask:
// such a call runs on the general fallback, forward and backward alike (the
// same decision in both directions, as dropout needs).
absl::Status DeclineElementwiseMask(const AttentionArgs& args) {
  if (args.elementwise_mask.defined()) {
    return absl::UnimplementedError("an elementwise attention mask");
  }
  return absl::OkStatus();
}

// cuDNN on separate tensors; UNIMPLEMENTED where it cannot take them.
absl::Status CudnnSeparateForward(CudaOps* ops, const AttentionArgs& args,
                                  const AttentionShape& shape, const Tensor& q, const Tensor& k,
                                  const Tensor& v, Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(DeclineElementwiseMask(args));
  if (!SameDtype(q, k, v)) return absl::UnimplementedError("q, k and v of different dtypes");
  return CudnnAttentionForward(ops, args, shape, SeparateQkv(shape, q, k, v), out, softmax_lse);
}

absl::Status CudnnSeparateBackward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& shape, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& out, const Tensor& dout,
                                   const Tensor& softmax_lse, Tensor* dq, Tensor* dk, Tensor* dv,
                                   Tensor* dbias) {
  RETURN_IF_ERROR(DeclineElementwiseMask(args));
  if (!SameDtype(q, k, v) || !SameDtype(*dq, *dk, *dv)) {
    return absl::UnimplementedError("q, k and v (or dq, dk and dv) of different dtypes");
  }
  DqkvMemory grads;
  grads.dq = dq->data();
  grads.dk = dk->data();
  grads.dv = dv->data();
  grads.dtype = dq->dtype();
  return CudnnAttentionBackward(ops, args, shape, SeparateQkv(shape, q, k, v), out, dout,
                                softmax_lse, grads, dbias);
}

// The three parts of a packed [B, S, 3, H, D]: part p starts p*H*D elements
// in, tokens 3*H*D apart.
QkvMemory PackedQkv(const Tensor& qkv) {
  const int64_t part = qkv.dim(3) * qkv.dim(4);
  const char* base = static_cast<const char*>(qkv.data());
  const int64_t part_bytes = part * static_cast<int64_t>(DTypeSize(qkv.dtype()));
  QkvMemory m;
  m.q = base;
  m.k = base + part_bytes;
  m.v = base + 2 * part_bytes;
  m.dtype = qkv.dtype();
  m.q_token_stride = 3 * part;
  m.kv_token_stride = 3 * part;
  return m;
}

DqkvMemory PackedDqkv(Tensor* dqkv) {
  const QkvMemory parts = PackedQkv(*dqkv);
  DqkvMemory m;
  m.dq = const_cast<void*>(parts.q);
  m.dk = const_cast<void*>(parts.k);
  m.dv = const_cast<void*>(parts.v);
  m.dtype = dqkv->dtype();
  return m;
}

// q's shape [B, S, H, D] and qkv's dtype, for the unpacked op's argument
// checks. It points at qkv's memory but is not a view of any part (the parts
// are strided); only its shape and dtype are read.
Tensor PartStandIn(const Tensor& packed) {
  return Tensor(std::shared_ptr<void>(), packed.data(), packed.dtype(),
                {packed.dim(0), packed.dim(1), packed.dim(3), packed.dim(4)});
}

AttentionProblem MakeProblem(const AttentionArgs& args, const AttentionShape& shape,
                             const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionProblem p;
  p.shape = shape;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.q_dtype = q.dtype();
  p.k_dtype = k.dtype();
  p.v_dtype = v.dtype();
  p.bias = args.bias.data_as<const float>();  // null when absent
  if (IsPaddingMask(args.mask)) {
    p.q_seqlens = args.q_seqlens.data_as<const int32_t>();
    p.kv_seqlens = args.kv_seqlens.data_as<const int32_t>();
  }
  p.mask = args.elementwise_mask.data_as<const bool>();  // null when absent
  p.mask_per_head = args.elementwise_mask.rank() == 4;
  p.causal = IsCausalMask(args.mask);
  p.bottom_right = IsBottomRightMask(args.mask);
  p.scale = args.scale;
  p.dropout_rate = args.dropout_rate;
  p.dropout_seed = args.dropout_seed;
  return p;
}

// The fallback kernels add the bias as float32: a bias in the operands' dtype
// (cuDNN's) is widened into a temporary first, off cuDNN's path.
absl::StatusOr<AttentionArgs> WithFloat32Bias(CudaOps* ops, const AttentionArgs& args) {
  if (!args.bias.defined() || args.bias.dtype() == DType::kF32) return args;
  AttentionArgs widened = args;
  ASSIGN_OR_RETURN(widened.bias, ops->Allocate(DType::kF32, args.bias.shape()));
  RETURN_IF_ERROR(ops->Cast(args.bias, &widened.bias));
  return widened;
}

// The small-head kernels wherever they fit, unless a test or benchmark asked
// for the general fallback.
bool UseSmallHead(const AttentionProblem& problem) {
  return GetAttentionPath() != AttentionPath::kGeneralFallbackOnly &&
         SmallHeadAttentionFits(problem);
}

// Where the split finds the bias at each distance: args.relative_bias's
// table, or args.bias made from it.
BandBias BandBiasOf(const AttentionArgs& args) {
  BandBias b;
  const AttentionArgs::RelativeBiasTable& r = args.relative_bias;
  if (r.defined()) {
    b.table = r.table.data();
    b.buckets = r.buckets.data_as<const int32_t>();
    b.num_buckets = static_cast<int>(r.table.dim(1));
    b.f32 = r.table.dtype() == DType::kF32;
  } else {
    b.dense = args.bias.data();
    b.f32 = args.bias.dtype() == DType::kF32;
  }
  return b;
}

// A forward's relative bias named by its table through the split where it
// serves the call; UNIMPLEMENTED (nothing written) where it does not.
absl::Status SplitForward(CudaOps* ops, const AttentionArgs& args, const AttentionShape& shape,
                          const QkvMemory& qkv, Tensor* out, Tensor* softmax_lse) {
  const AttentionArgs::RelativeBiasTable& r = args.relative_bias;
  if (!RelativeSplitOn()) return absl::UnimplementedError("the split is off");
  if (r.first_row.defined() || r.uniform_from <= 0) {
    return absl::UnimplementedError("a decode step's rows, or buckets that do not settle");
  }
  RETURN_IF_ERROR(RelativeSplitForward(ops, args, shape, qkv, BandBiasOf(args), r.uniform_from,
                                       out, softmax_lse));
  relative_split_calls.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteDropoutSeed(int64_t* dst, uint64_t seed, cudaStream_t stream) {
  WriteDropoutSeedKernel<<<1, 1, 0, stream>>>(dst, seed);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

void SetAttentionPath(AttentionPath path) { attention_path.store(static_cast<int>(path)); }
AttentionPath GetAttentionPath() { return static_cast<AttentionPath>(attention_path.load()); }
int64_t CudnnPackedAttentionCalls() { return packed_cudnn_calls.load(); }
int64_t RelativeBandCalls() { return relative_band_calls.load(); }
int64_t RelativeSplitCalls() { return relative_split_calls.load(); }
void SetRelativeSplit(bool on) { relative_split_on.store(on); }
bool RelativeSplitOn() { return relative_split_on.load(); }
int64_t DecodeAttentionCalls() { return decode_attention_calls.load(); }

bool CudaOps::AppliesRelativeBiasByTable() const { return RelativeSplitOn(); }

absl::Status CudaOps::AttentionForward(const AttentionArgs& args, const Tensor& q,
                                       const Tensor& k, const Tensor& v, Tensor* out,
                                       Tensor* softmax_lse) {
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionForwardArgs(args, q, k, v, out, softmax_lse));
  if (out->numel() == 0) return absl::OkStatus();

  // A decode step's one query row: cuDNN would compute a whole 64-row tile.
  // It looks a relative bias up in its table; every other path adds it made.
  if (GetAttentionPath() == AttentionPath::kAuto &&
      DecodeAttentionFits(args, shape, q, k, v, *out)) {
    decode_attention_calls.fetch_add(1);
    return DecodeAttentionForward(args, shape, q, k, v, out, softmax_lse, stream());
  }
  if (args.relative_bias.defined()) {
    if (SameDtype(q, k, v)) {
      const absl::Status split =
          SplitForward(this, args, shape, SeparateQkv(shape, q, k, v), out, softmax_lse);
      if (!absl::IsUnimplemented(split)) return split;
    }
    ASSIGN_OR_RETURN(const AttentionArgs made,
                     WithRelativeBiasMade(*this, args, shape.q_seq, q.dtype()));
    return AttentionForward(made, q, k, v, out, softmax_lse);
  }
  const bool small_head = UseSmallHead(MakeProblem(args, shape, q, k, v));
  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status fused =
        CudnnSeparateForward(this, args, shape, q, k, v, out, softmax_lse);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("forward", args, shape, q.dtype()), Unfused(small_head), fused);
  }
  ASSIGN_OR_RETURN(const AttentionArgs unfused, WithFloat32Bias(this, args));
  const AttentionProblem problem = MakeProblem(unfused, shape, q, k, v);
  if (small_head) {
    return SmallHeadAttentionForward(problem, out->data(), out->dtype(),
                                     softmax_lse->data_as<float>(), stream());
  }
  return FallbackAttentionForward(problem, out->data(), out->dtype(),
                                  softmax_lse->data_as<float>(), stream());
}

absl::Status CudaOps::DecodeAttentionFromQkv(const AttentionArgs& args, const Tensor& qkv,
                                             const RotaryArgs* rotary, const Tensor& position,
                                             Tensor* q, Tensor* key_cache, Tensor* value_cache,
                                             Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(Enter());
  RETURN_IF_ERROR(CheckDecodeQkvRowsArgs(qkv, rotary, position, q, key_cache, value_cache));
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionForwardArgs(args, *q, *key_cache, *value_cache, out,
                                             softmax_lse));
  // One token a sequence, and the kernel takes the attention: one launch
  // for the rows and the attention. Otherwise the two ops.
  if (GetAttentionPath() != AttentionPath::kAuto || qkv.dim(1) != 1 || out->numel() == 0 ||
      !DecodeAttentionFits(args, shape, *q, *key_cache, *value_cache, *out)) {
    return Ops::DecodeAttentionFromQkv(args, qkv, rotary, position, q, key_cache, value_cache,
                                       out, softmax_lse);
  }
  decode_attention_calls.fetch_add(1);
  return DecodeAttentionFromQkvForward(args, shape, qkv, rotary, position, q, key_cache,
                                       value_cache, out, softmax_lse, stream());
}

absl::Status CudaOps::AttentionBackward(const AttentionArgs& args, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& out,
                                        const Tensor& dout, const Tensor& softmax_lse,
                                        Tensor* dq, Tensor* dk, Tensor* dv, Tensor* dbias) {
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionBackwardArgs(args, q, k, v, out, dout, softmax_lse, dq, dk, dv,
                                              dbias));
  const bool with_bias = args.bias.data() != nullptr;
  if (q.numel() == 0 && k.numel() == 0) return absl::OkStatus();

  const bool small_head = UseSmallHead(MakeProblem(args, shape, q, k, v));
  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status fused = CudnnSeparateBackward(this, args, shape, q, k, v, out, dout,
                                                     softmax_lse, dq, dk, dv, dbias);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("backward", args, shape, q.dtype()), Unfused(small_head), fused);
  }
  ASSIGN_OR_RETURN(const AttentionArgs unfused, WithFloat32Bias(this, args));
  const AttentionProblem problem = MakeProblem(unfused, shape, q, k, v);
  const size_t rows = static_cast<size_t>(shape.batch * shape.q_heads * shape.q_seq);
  if (small_head) {
    // row_dot, then (16-byte aligned) the dropout bits the dq pass hands on.
    const size_t row_dot_bytes = (rows * sizeof(float) + 15) / 16 * 16;
    const size_t bits_bytes = SmallHeadDropoutBitsBytes(problem);
    ASSIGN_OR_RETURN(void* scratch, Workspace(row_dot_bytes + bits_bytes));
    uint32_t* bits = bits_bytes == 0 ? nullptr
                                     : reinterpret_cast<uint32_t*>(static_cast<char*>(scratch) +
                                                                   row_dot_bytes);
    return SmallHeadAttentionBackward(problem, out.data(), out.dtype(), dout.data(),
                                      dout.dtype(), softmax_lse.data_as<float>(), dq->data(),
                                      dq->dtype(), dk->data(), dk->dtype(), dv->data(),
                                      dv->dtype(), static_cast<float*>(scratch), bits, stream());
  }
  ASSIGN_OR_RETURN(void* row_dot, Workspace(rows * sizeof(float)));
  return FallbackAttentionBackward(problem, dout.data(), dout.dtype(),
                                   softmax_lse.data_as<float>(), dq->data(), dq->dtype(),
                                   dk->data(), dk->dtype(), dv->data(), dv->dtype(),
                                   with_bias ? dbias->data_as<float>() : nullptr,
                                   static_cast<float*>(row_dot), stream());
}

absl::Status CudaOps::AttentionForwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                             Tensor* out, Tensor* softmax_lse) {
  RETURN_IF_ERROR(Enter());
  RETURN_IF_ERROR(CheckPackedQkv("AttentionForwardPacked", "qkv", qkv));
  const Tensor part = PartStandIn(qkv);
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionForwardArgs(args, part, part, part, out, softmax_lse));
  if (out->numel() == 0) return absl::OkStatus();
  if (args.relative_bias.defined()) {
    const absl::Status split = SplitForward(this, args, shape, PackedQkv(qkv), out, softmax_lse);
    if (split.ok()) packed_cudnn_calls.fetch_add(1);
    if (!absl::IsUnimplemented(split)) return split;
    ASSIGN_OR_RETURN(const AttentionArgs made,
                     WithRelativeBiasMade(*this, args, shape.q_seq, qkv.dtype()));
    return AttentionForwardPacked(made, qkv, out, softmax_lse);
  }

  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status declined = DeclineElementwiseMask(args);
    const absl::Status fused =
        declined.ok() ? CudnnAttentionForward(this, args, shape, PackedQkv(qkv), out, softmax_lse)
                      : declined;
    if (fused.ok()) packed_cudnn_calls.fetch_add(1);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("forward packed", args, shape, qkv.dtype()), kSplit, fused);
  }
  return Ops::AttentionForwardPacked(args, qkv, out, softmax_lse);
}

absl::Status CudaOps::AttentionBackwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                              const Tensor& out, const Tensor& dout,
                                              const Tensor& softmax_lse, Tensor* dqkv,
                                              Tensor* dbias) {
  RETURN_IF_ERROR(Enter());
  const char* op = "AttentionBackwardPacked";
  RETURN_IF_ERROR(CheckPackedQkv(op, "qkv", qkv));
  RETURN_IF_ERROR(CheckPackedQkv(op, "dqkv", *dqkv));
  if (dqkv->shape() != qkv.shape() || dqkv->dtype() != qkv.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": dqkv is ", ShapeString(dqkv->shape()), " ", DTypeName(dqkv->dtype()),
        ", want qkv's ", ShapeString(qkv.shape()), " ", DTypeName(qkv.dtype())));
  }
  const Tensor part = PartStandIn(qkv);
  const Tensor dpart = PartStandIn(*dqkv);
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionBackwardArgs(args, part, part, part, out, dout, softmax_lse,
                                              &dpart, &dpart, &dpart, dbias));
  if (qkv.numel() == 0) return absl::OkStatus();

  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status declined = DeclineElementwiseMask(args);
    const absl::Status fused =
        declined.ok() ? CudnnAttentionBackward(this, args, shape, PackedQkv(qkv), out, dout,
                                               softmax_lse, PackedDqkv(dqkv), dbias)
                      : declined;
    if (fused.ok()) packed_cudnn_calls.fetch_add(1);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("backward packed", args, shape, qkv.dtype()), kSplit, fused);
  }
  return Ops::AttentionBackwardPacked(args, qkv, out, dout, softmax_lse, dqkv, dbias);
}

namespace {

// The dense dbias the argument checks expect beside a bias: the bias's own
// shape and memory (only its shape and dtype are read; nothing is written).
Tensor DenseBiasStandIn(const AttentionArgs& args) {
  return Tensor(std::shared_ptr<void>(), const_cast<void*>(args.bias.data()), DType::kF32,
                args.bias.shape());
}

// The argument checks of a relative backward whose bias may be named by its
// table (args.relative_bias): the forward's checks of the table and buckets,
// then the backward's with a stand-in of the dense bias's shape (never read).
absl::StatusOr<AttentionShape> CheckRelativeBackward(const AttentionArgs& args, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& out, const Tensor& dout,
                                                     const Tensor& softmax_lse,
                                                     const RelativeBuckets& relative,
                                                     const Tensor* dq, const Tensor* dk,
                                                     const Tensor* dv, const Tensor* dtable) {
  AttentionArgs dense = args;
  Tensor standin = DenseBiasStandIn(args);
  if (args.relative_bias.defined()) {
    const AttentionArgs::RelativeBiasTable& r = args.relative_bias;
    ASSIGN_OR_RETURN(const AttentionShape s,
                     CheckAttentionForwardArgs(args, q, k, v, &out, &softmax_lse));
    if (r.first_row.defined()) {
      return absl::InvalidArgumentError(
          "AttentionBackwardRelative: relative_bias.first_row is a decode step's (forward only)");
    }
    if (dtable == nullptr || dtable->rank() != 2 || dtable->dim(1) != r.table.dim(1)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AttentionBackwardRelative: dtable must be [heads, ", r.table.dim(1), "] like the table"));
    }
    dense.relative_bias = AttentionArgs::RelativeBiasTable();
    standin = Tensor(std::shared_ptr<void>(), dtable->data(), DType::kF32,
                     {s.q_heads, s.q_seq, s.kv_seq});
    dense.bias = standin;
  }
  RETURN_IF_ERROR(CheckRelativeBiasBackwardArgs(standin, relative.buckets, dtable).status());
  return CheckAttentionBackwardArgs(dense, q, k, v, out, dout, softmax_lse, dq, dk, dv, &standin);
}

// The split's backward where it serves the call (no dense bias made or
// read beyond its last row); UNIMPLEMENTED where it does not.
absl::Status SplitBackward(CudaOps* ops, const AttentionArgs& args, const AttentionShape& shape,
                           const QkvMemory& qkv, const Tensor& out, const Tensor& dout,
                           const Tensor& softmax_lse, const RelativeBuckets& relative,
                           const DqkvMemory& grads, Tensor* dtable) {
  if (!args.relative_bias.defined() && !args.bias.defined()) {
    return absl::UnimplementedError("no bias");
  }
  if (!RelativeSplitOn()) return absl::UnimplementedError("the split is off");
  RETURN_IF_ERROR(RelativeSplitBackward(ops, args, shape, qkv, out, dout, softmax_lse,
                                        BandBiasOf(args), relative, grads, dtable));
  relative_band_calls.fetch_add(1);
  relative_split_calls.fetch_add(1);
  return absl::OkStatus();
}

// cuDNN's backward reading the relative bias without writing dBias, then the
// band kernel for the table's gradient; UNIMPLEMENTED (nothing written) when
// either cannot serve the call.
absl::Status RelativeOnCudnn(CudaOps* ops, const AttentionArgs& args,
                             const AttentionShape& shape, const QkvMemory& qkv,
                             const Tensor& out, const Tensor& dout, const Tensor& softmax_lse,
                             const RelativeBuckets& relative, const DqkvMemory& grads,
                             Tensor* dtable) {
  if (GetAttentionPath() != AttentionPath::kAuto) {
    return absl::UnimplementedError("cuDNN attention is switched off");
  }
  RETURN_IF_ERROR(
      CheckRelativeBiasBackwardArgs(DenseBiasStandIn(args), relative.buckets, dtable).status());
  RETURN_IF_ERROR(RelativeBandApplies(args, shape, qkv, relative));
  if (dtable->dtype() != DType::kF32) return absl::UnimplementedError("dtable is not float32");
  if (out.dtype() != qkv.dtype || dout.dtype() != qkv.dtype) {
    return absl::UnimplementedError("out or dout not in the operands' dtype");
  }
  // The band kernel reads their rows 16 bytes at a time.
  if (reinterpret_cast<uintptr_t>(out.data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(dout.data()) % 16 != 0) {
    return absl::UnimplementedError("out or dout not 16-byte aligned");
  }
  // The band kernel follows cuDNN's backward on the op's stream: beside it on
  // a second stream it overlapped less than a third of its time, and the
  // 24 x 1024 FP8 LM's step measured 0.15-0.2 ms faster without the
  // stream's fork and join (bench/results/2026-12-07-h100-band-main-stream).
  // After cuDNN's launches, so a cuDNN refusal leaves nothing written.
  RETURN_IF_ERROR(CudnnAttentionBackward(ops, args, shape, qkv, out, dout, softmax_lse, grads,
                                         /*dbias=*/nullptr));
  RETURN_IF_ERROR(
      RelativeBandTableGrad(ops, args, shape, qkv, out, dout, softmax_lse, relative, dtable));
  relative_band_calls.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaOps::AttentionBackwardRelative(const AttentionArgs& args, const Tensor& q,
                                                const Tensor& k, const Tensor& v,
                                                const Tensor& out, const Tensor& dout,
                                                const Tensor& softmax_lse,
                                                const RelativeBuckets& relative, Tensor* dq,
                                                Tensor* dk, Tensor* dv, Tensor* dtable) {
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckRelativeBackward(args, q, k, v, out, dout, softmax_lse, relative, dq, dk,
                                         dv, dtable));
  const bool one_dtype =
      SameDtype(q, k, v) && SameDtype(*dq, *dk, *dv) && dq->dtype() == q.dtype();
  DqkvMemory grads;
  grads.dq = dq->data();
  grads.dk = dk->data();
  grads.dv = dv->data();
  grads.dtype = dq->dtype();
  if (one_dtype) {
    const absl::Status split = SplitBackward(this, args, shape, SeparateQkv(shape, q, k, v), out,
                                             dout, softmax_lse, relative, grads, dtable);
    if (!absl::IsUnimplemented(split)) return split;
  }
  ASSIGN_OR_RETURN(const AttentionArgs made,
                   WithRelativeBiasMadeForBackward(*this, args, q, "AttentionBackwardRelative"));
  if (made.bias.defined() && one_dtype) {
    const absl::Status band = RelativeOnCudnn(this, made, shape, SeparateQkv(shape, q, k, v), out,
                                              dout, softmax_lse, relative, grads, dtable);
    if (!absl::IsUnimplemented(band)) return band;
  }
  return Ops::AttentionBackwardRelative(made, q, k, v, out, dout, softmax_lse, relative, dq, dk,
                                        dv, dtable);
}

absl::Status CudaOps::AttentionBackwardPackedRelative(const AttentionArgs& args,
                                                      const Tensor& qkv, const Tensor& out,
                                                      const Tensor& dout,
                                                      const Tensor& softmax_lse,
                                                      const RelativeBuckets& relative,
                                                      Tensor* dqkv, Tensor* dtable) {
  RETURN_IF_ERROR(Enter());
  const char* op = "AttentionBackwardPackedRelative";
  RETURN_IF_ERROR(CheckPackedQkv(op, "qkv", qkv));
  RETURN_IF_ERROR(CheckPackedQkv(op, "dqkv", *dqkv));
  if (dqkv->shape() != qkv.shape() || dqkv->dtype() != qkv.dtype()) {
    return Ops::AttentionBackwardPackedRelative(args, qkv, out, dout, softmax_lse, relative, dqkv,
                                                dtable);
  }
  const Tensor part = PartStandIn(qkv);
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckRelativeBackward(args, part, part, part, out, dout, softmax_lse, relative,
                                         &part, &part, &part, dtable));
  const absl::Status split = SplitBackward(this, args, shape, PackedQkv(qkv), out, dout,
                                           softmax_lse, relative, PackedDqkv(dqkv), dtable);
  if (split.ok()) packed_cudnn_calls.fetch_add(1);
  if (!absl::IsUnimplemented(split)) return split;
  ASSIGN_OR_RETURN(const AttentionArgs made, WithRelativeBiasMadeForBackward(*this, args, qkv, op));
  if (made.bias.defined()) {
    const absl::Status band = RelativeOnCudnn(this, made, shape, PackedQkv(qkv), out, dout,
                                              softmax_lse, relative, PackedDqkv(dqkv), dtable);
    if (band.ok()) packed_cudnn_calls.fetch_add(1);
    if (!absl::IsUnimplemented(band)) return band;
  }
  return Ops::AttentionBackwardPackedRelative(made, qkv, out, dout, softmax_lse, relative, dqkv,
                                              dtable);
}

}  // namespace cuda
}  // namespace te
