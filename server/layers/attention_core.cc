#include "server/layers/attention_core.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "server/layers/device_constants.h"

namespace te::layers {
namespace {

// The mask types that read the request's mask (TE: every type but no_mask
// and causal).
bool ReadsMask(MaskType mask) {
  return IsPaddingMask(mask) || mask == MaskType::kCausalBottomRight;
}

absl::Status CheckBshd(const Tensor& t, const char* name, int64_t batch, int64_t heads,
                       int64_t head_dim, DType dtype) {
  if (t.rank() != 4 || t.dim(0) != batch || t.dim(2) != heads || t.dim(3) != head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has shape ", ShapeString(t.shape()),
                                                   "; want [", batch, ", seq, ", heads, ", ",
                                                   head_dim, "] ([batch, seq, heads, head_dim])"));
  }
  if (t.dtype() != dtype || !IsFloating(dtype) || IsFloat8(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has dtype ", DTypeName(t.dtype()),
                                                   "; want the query's float dtype ",
                                                   DTypeName(dtype)));
  }
  return absl::OkStatus();
}

// Valid lengths for a padding mask: the given int32 [B], or S for every row.
absl::StatusOr<Tensor> ResolveLengths(Ops& ops, const Tensor& given, const char* name,
                                      int64_t batch, int64_t seq) {
  if (given.defined() && given.numel() > 0) {
    if (given.dtype() != DType::kI32 || given.rank() != 1 || given.dim(0) != batch) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be int32 [", batch, "] (valid lengths per batch row); got ",
                       DTypeName(given.dtype()), " ", ShapeString(given.shape())));
    }
    return given;
  }
  ASSIGN_OR_RETURN(Tensor full, ops.Allocate(DType::kI32, {batch}));
  std::vector<int32_t> host(static_cast<size_t>(batch), static_cast<int32_t>(seq));
  RETURN_IF_ERROR(ops.Upload(host.data(), &full));
  return full;
}

// The mask's lengths given as an elementwise mask: bool [B, Sq, Skv], true
// past q_len[b] or kv_len[b]. For a type that reads a mask but no lengths
// (causal_bottom_right) when the mask came as exactly a padding pattern.
absl::StatusOr<Tensor> PaddingAsElementwise(Ops& ops, const Tensor& q_lens, const Tensor& kv_lens,
                                            int64_t batch, int64_t q_len, int64_t kv_len) {
  std::vector<int32_t> q(static_cast<size_t>(batch)), kv(static_cast<size_t>(batch));
  RETURN_IF_ERROR(ops.Download(q_lens, q.data()));
  RETURN_IF_ERROR(ops.Download(kv_lens, kv.data()));
  std::vector<uint8_t> host(static_cast<size_t>(batch * q_len * kv_len));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < q_len; ++i) {
      for (int64_t j = 0; j < kv_len; ++j) {
        host[(b * q_len + i) * kv_len + j] = i >= q[b] || j >= kv[b] ? 1 : 0;
      }
    }
  }
  ASSIGN_OR_RETURN(Tensor mask, ops.Allocate(DType::kBool, {batch, q_len, kv_len}));
  RETURN_IF_ERROR(ops.Upload(host.data(), &mask));
  return mask;
}

// The elementwise mask as the op takes it: shared over the heads, or one
// plane per query head (TE broadcasts a mask against its logits [B, Hq, Sq,
// Skv], so a per-head mask has Hq heads, GQA included).
absl::Status CheckHeads(int64_t heads, int num_heads, int64_t batch, int64_t q_len,
                        int64_t kv_len) {
  if (heads == 1 || heads == num_heads) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "attention_mask: a mask of ", heads, " heads for ", num_heads,
      " attention heads; TE broadcasts the mask against the logits [batch, ", num_heads,
      ", q_len, kv_len]: [", batch, " or 1, ", num_heads, " or 1, ", q_len, " or 1, ", kv_len,
      " or 1]"));
}

absl::Status CheckElementwise(const Tensor& mask, int num_heads, int64_t batch, int64_t q_len,
                              int64_t kv_len) {
  if (mask.dtype() == DType::kBool && mask.rank() == 4 && mask.dim(0) == batch &&
      mask.dim(2) == q_len && mask.dim(3) == kv_len) {
    RETURN_IF_ERROR(CheckHeads(mask.dim(1), num_heads, batch, q_len, kv_len));
  }
  const Shape shared = {batch, q_len, kv_len};
  const Shape per_head = {batch, num_heads, q_len, kv_len};
  if (mask.dtype() != DType::kBool || (mask.shape() != shared && mask.shape() != per_head)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attention mask must be bool ", ShapeString(shared), " or ", ShapeString(per_head),
        " elementwise; got ", DTypeName(mask.dtype()), " ", ShapeString(mask.shape())));
  }
  return absl::OkStatus();
}

// The op's arguments for one call: mask, scale, dropout (when active), the
// padding lengths resolved, and the bias checked against [Hq, Sq, Skv].
absl::StatusOr<AttentionArgs> ResolveArgs(Ops& ops, const AttentionConfig& config,
                                          int64_t batch, int64_t q_len, int64_t kv_len,
                                          const SeqLens& seqlens, const AttentionBias& given,
                                          bool dropout_active, uint64_t dropout_seed) {
  AttentionArgs args;
  args.mask = config.mask;
  args.scale = config.scale;
  args.dropout_rate = dropout_active ? config.dropout_rate : 0.0f;
  args.dropout_seed = dropout_seed;
  if (ReadsMask(config.mask)) {
    RETURN_IF_ERROR(seqlens.error);
    RETURN_IF_ERROR(CheckHeads(seqlens.heads, config.num_heads, batch, q_len, kv_len));
    const bool has_lengths = seqlens.q.defined() && seqlens.q.numel() > 0;
    const bool has_elementwise = seqlens.elementwise.defined() && seqlens.elementwise.numel() > 0;
    if (has_elementwise) {
      RETURN_IF_ERROR(
          CheckElementwise(seqlens.elementwise, config.num_heads, batch, q_len, kv_len));
    }
    // What the lengths are: exactly the mask (a padding pattern), exactly it
    // with the causal triangle, or (an arbitrary mask) its extents.
    const bool exact_padding = has_lengths && !has_elementwise;
    const bool exact_padding_causal = has_lengths && has_elementwise && seqlens.with_causal;
    const Tensor kv_given = seqlens.kv.defined() && seqlens.kv.numel() > 0 ? seqlens.kv
                            : q_len == kv_len                             ? seqlens.q
                                                                          : Tensor();
    // The lengths say it all for a padding pattern, and for padding | causal
    // under padding_causal; the bottom-right padding type aligns its diagonal
    // with the lengths whatever the mask; any other mask goes elementwise
    // (SeqLens above).
    bool use_lengths = false, use_elementwise = has_elementwise;
    switch (config.mask) {
      case MaskType::kPadding: use_lengths = exact_padding; break;
      case MaskType::kPaddingCausal:
        use_lengths = exact_padding || exact_padding_causal;
        use_elementwise = has_elementwise && !exact_padding_causal;
        break;
      case MaskType::kPaddingCausalBottomRight: use_lengths = has_lengths; break;
      case MaskType::kNoMask:  // no lengths
      case MaskType::kCausal:
      case MaskType::kCausalBottomRight:
        break;
    }
    if (use_elementwise) args.elementwise_mask = seqlens.elementwise;
    if (config.mask == MaskType::kCausalBottomRight) {
      if (exact_padding) {
        if (!kv_given.defined()) {
          return absl::InvalidArgumentError("kv_seqlens must be given for q_len != kv_len");
        }
        ASSIGN_OR_RETURN(args.elementwise_mask,
                         PaddingAsElementwise(ops, seqlens.q, kv_given, batch, q_len, kv_len));
      }
    } else {
      const Tensor q_lengths = use_lengths ? seqlens.q : Tensor();
      const Tensor kv_lengths = use_lengths ? kv_given : Tensor();
      ASSIGN_OR_RETURN(args.q_seqlens, ResolveLengths(ops, q_lengths, "q_seqlens", batch, q_len));
      ASSIGN_OR_RETURN(args.kv_seqlens,
                       ResolveLengths(ops, kv_lengths, "kv_seqlens", batch, kv_len));
    }
  }
  // The op checks a bias named by its table.
  args.relative_bias = given.relative;
  const Tensor& bias = given.made;
  if (bias.defined() && bias.numel() > 0) {
    const Shape want = {config.num_heads, q_len, kv_len};
    // float32, or q's dtype (a relative bias as cuDNN reads it); the op
    // checks which.
    if (bias.shape() != want || !IsComputeFloat(bias.dtype())) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention bias must be float ", ShapeString(want), "; got ",
                       DTypeName(bias.dtype()), " ", ShapeString(bias.shape())));
    }
    args.bias = bias;
  }
  return args;
}

bool HasBias(const AttentionSaved& saved) {
  return (saved.args.bias.defined() && saved.args.bias.numel() > 0) ||
         saved.args.relative_bias.defined();
}

// A backward asked for dbias of a relative bias: it gets the table's gradient.
bool WantsTableGrad(const AttentionSaved& saved, const Tensor* dbias) {
  return dbias != nullptr && HasBias(saved) && saved.relative.buckets.defined();
}

// The table's gradient a relative backward writes, f32 [H, num_buckets]
// (WantsTableGrad holds).
absl::StatusOr<Tensor> TableGradFor(Ops& ops, const AttentionSaved& saved) {
  const int64_t num_buckets = saved.relative_num_buckets;
  if (num_buckets <= 0) {
    return absl::InternalError("attention: a relative bias's backward needs its bucket count");
  }
  const int64_t heads = saved.args.relative_bias.defined() ? saved.args.relative_bias.table.dim(0)
                                                           : saved.args.bias.dim(0);
  return ops.Allocate(DType::kF32, {heads, num_buckets});
}

}  // namespace

absl::Status ValidateAttentionConfig(const AttentionConfig& config, absl::string_view field) {
  if (config.head_dim <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".head_dim must be positive; got ", config.head_dim));
  }
  if (config.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".num_attention_heads must be positive; got ", config.num_heads));
  }
  if (config.num_gqa_groups <= 0 || config.num_heads % config.num_gqa_groups != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".num_gqa_groups must be positive and divide num_attention_heads (",
                     config.num_heads, "); got ", config.num_gqa_groups));
  }
  if (!(config.dropout_rate >= 0.0f && config.dropout_rate < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".attention_dropout must be in [0, 1); got ", config.dropout_rate));
  }
  if (!std::isfinite(config.scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".scale_factor must be finite; got ", config.scale));
  }
  return absl::OkStatus();
}

absl::StatusOr<MaskType> ResolveMaskType(te::v1::AttnMaskType mask, absl::string_view field) {
  switch (mask) {
    case te::v1::ATTN_MASK_TYPE_UNSPECIFIED:
    case te::v1::CAUSAL: return MaskType::kCausal;
    case te::v1::NO_MASK: return MaskType::kNoMask;
    case te::v1::PADDING: return MaskType::kPadding;
    case te::v1::PADDING_CAUSAL: return MaskType::kPaddingCausal;
    case te::v1::CAUSAL_BOTTOM_RIGHT: return MaskType::kCausalBottomRight;
    case te::v1::PADDING_CAUSAL_BOTTOM_RIGHT: return MaskType::kPaddingCausalBottomRight;
    default: break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " has unknown value ", static_cast<int>(mask)));
}

int64_t AttentionSaved::bytes() const {
  int64_t total = 0;
  for (const Tensor* t :
       {&q, &k, &v, &qkv, &out, &softmax_lse, &args.bias, &args.q_seqlens, &args.kv_seqlens,
        &args.elementwise_mask, &relative.buckets}) {
    // An absent tensor (Tensor(): no memory, shape []) holds nothing.
    if (t->data() != nullptr) total += static_cast<int64_t>(t->nbytes());
  }
  return total;
}

absl::Status AttentionForward(Ops& ops, const AttentionConfig& config, const Tensor& q,
                              const Tensor& k, const Tensor& v, const SeqLens& seqlens,
                              const AttentionBias& bias, bool dropout_active,
                              uint64_t dropout_seed, Tensor* out, AttentionSaved* saved) {
  if (q.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("q must be [batch, seq, heads, head_dim]; got ", ShapeString(q.shape())));
  }
  const int64_t batch = q.dim(0);
  const int64_t q_len = q.dim(1);
  RETURN_IF_ERROR(CheckBshd(q, "q", batch, config.num_heads, config.head_dim, q.dtype()));
  RETURN_IF_ERROR(CheckBshd(k, "k", batch, config.num_gqa_groups, config.head_dim, q.dtype()));
  RETURN_IF_ERROR(CheckBshd(v, "v", batch, config.num_gqa_groups, config.head_dim, q.dtype()));
  const int64_t kv_len = k.dim(1);
  if (v.dim(1) != kv_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("k and v sequence lengths differ: ", kv_len, " vs ", v.dim(1)));
  }

  ASSIGN_OR_RETURN(AttentionArgs args,
                   ResolveArgs(ops, config, batch, q_len, kv_len, seqlens, bias, dropout_active,
                               dropout_seed));
  args.forward_only = saved == nullptr;

  ASSIGN_OR_RETURN(*out, ops.Allocate(q.dtype(), q.shape()));
  ASSIGN_OR_RETURN(Tensor lse, ops.Allocate(DType::kF32, {batch, config.num_heads, q_len}));
  RETURN_IF_ERROR(ops.AttentionForward(args, q, k, v, out, &lse));
  if (saved != nullptr) {
    *saved = AttentionSaved();
    saved->args = args;
    saved->q = q;
    saved->k = k;
    saved->v = v;
    saved->out = *out;
    saved->softmax_lse = lse;
  }
  return absl::OkStatus();
}

absl::Status DecodeAttentionFromQkv(Ops& ops, const AttentionConfig& config, const Tensor& qkv,
                                    const RotaryArgs* rotary, const Tensor& position,
                                    Tensor key_cache, Tensor value_cache, const SeqLens& seqlens,
                                    const AttentionBias& bias, bool dropout_active,
                                    uint64_t dropout_seed, Tensor* out) {
  if (qkv.rank() != 5 || qkv.dim(2) != 3 || key_cache.rank() != 4) {
    return absl::InvalidArgumentError(absl::StrCat("qkv must be [batch, seq, 3, heads, head_dim]; got ",
                                                   ShapeString(qkv.shape())));
  }
  const int64_t batch = qkv.dim(0), q_len = qkv.dim(1), kv_len = key_cache.dim(1);
  ASSIGN_OR_RETURN(AttentionArgs args,
                   ResolveArgs(ops, config, batch, q_len, kv_len, seqlens, bias, dropout_active,
                               dropout_seed));
  args.forward_only = true;
  const Shape q_shape = {batch, q_len, qkv.dim(3), qkv.dim(4)};
  ASSIGN_OR_RETURN(Tensor q, ops.Allocate(qkv.dtype(), q_shape));
  ASSIGN_OR_RETURN(*out, ops.Allocate(qkv.dtype(), q_shape));
  ASSIGN_OR_RETURN(Tensor lse, ops.Allocate(DType::kF32, {batch, config.num_heads, q_len}));
  return ops.DecodeAttentionFromQkv(args, qkv, rotary, position, &q, &key_cache, &value_cache,
                                    out, &lse);
}

absl::Status AttentionBackward(Ops& ops, const AttentionSaved& saved, const Tensor& dout,
                               Tensor* dq, Tensor* dk, Tensor* dv, Tensor* dbias) {
  if (saved.packed()) {
    return absl::InvalidArgumentError(
        "attention: the saved forward is packed (qkv); its backward is AttentionBackwardPacked");
  }
  ASSIGN_OR_RETURN(const Tensor grad,
                   PrepareGradient(ops, dout, saved.out.shape(), saved.out.dtype()));
  ASSIGN_OR_RETURN(*dq, ops.Allocate(saved.q.dtype(), saved.q.shape()));
  ASSIGN_OR_RETURN(*dk, ops.Allocate(saved.k.dtype(), saved.k.shape()));
  ASSIGN_OR_RETURN(*dv, ops.Allocate(saved.v.dtype(), saved.v.shape()));
  if (WantsTableGrad(saved, dbias)) {
    ASSIGN_OR_RETURN(*dbias, TableGradFor(ops, saved));
    return ops.AttentionBackwardRelative(saved.args, saved.q, saved.k, saved.v, saved.out, grad,
                                         saved.softmax_lse, saved.relative, dq, dk, dv, dbias);
  }
  // A relative bias named by its table, without its gradient asked for: made.
  ASSIGN_OR_RETURN(const AttentionArgs args,
                   WithRelativeBiasMadeForBackward(ops, saved.args, saved.q, "attention"));
  Tensor bias_grad;
  if (args.bias.defined() && args.bias.numel() > 0) {  // the op wants dbias beside a bias
    ASSIGN_OR_RETURN(bias_grad, ops.Allocate(DType::kF32, args.bias.shape()));
  }
  RETURN_IF_ERROR(ops.AttentionBackward(args, saved.q, saved.k, saved.v, saved.out, grad,
                                        saved.softmax_lse, dq, dk, dv,
                                        bias_grad.defined() ? &bias_grad : nullptr));
  if (dbias != nullptr) *dbias = bias_grad;
  return absl::OkStatus();
}

absl::Status AttentionForwardPacked(Ops& ops, const AttentionConfig& config, const Tensor& qkv,
                                    const SeqLens& seqlens, const AttentionBias& bias,
                                    bool dropout_active, uint64_t dropout_seed, Tensor* out,
                                    AttentionSaved* saved) {
  if (qkv.rank() != 5 || qkv.dim(2) != 3 || qkv.dim(3) != config.num_heads ||
      qkv.dim(4) != config.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qkv has shape ", ShapeString(qkv.shape()), "; want [batch, seq, 3, ", config.num_heads,
        ", ", config.head_dim, "] ([batch, seq, 3, heads, head_dim])"));
  }
  if (!IsFloating(qkv.dtype()) || IsFloat8(qkv.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qkv has dtype ", DTypeName(qkv.dtype()), "; want float32, bfloat16 or float16"));
  }
  if (config.num_gqa_groups != config.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a packed qkv has one head count; got num_heads ", config.num_heads,
        " and num_gqa_groups ", config.num_gqa_groups));
  }
  const int64_t batch = qkv.dim(0);
  const int64_t seq = qkv.dim(1);
  ASSIGN_OR_RETURN(const AttentionArgs args,
                   ResolveArgs(ops, config, batch, seq, seq, seqlens, bias, dropout_active,
                               dropout_seed));

  ASSIGN_OR_RETURN(*out, ops.Allocate(qkv.dtype(), {batch, seq, qkv.dim(3), qkv.dim(4)}));
  ASSIGN_OR_RETURN(Tensor lse, ops.Allocate(DType::kF32, {batch, config.num_heads, seq}));
  RETURN_IF_ERROR(ops.AttentionForwardPacked(args, qkv, out, &lse));
  if (saved != nullptr) {
    *saved = AttentionSaved();
    saved->args = args;
    saved->qkv = qkv;
    saved->out = *out;
    saved->softmax_lse = lse;
  }
  return absl::OkStatus();
}

absl::Status AttentionBackwardPacked(Ops& ops, const AttentionSaved& saved, const Tensor& dout,
                                     Tensor* dqkv, Tensor* dbias) {
  if (!saved.packed()) {
    return absl::InvalidArgumentError(
        "attention: the saved forward is not packed (q, k, v); its backward is AttentionBackward");
  }
  ASSIGN_OR_RETURN(const Tensor grad,
                   PrepareGradient(ops, dout, saved.out.shape(), saved.out.dtype()));
  ASSIGN_OR_RETURN(*dqkv, ops.Allocate(saved.qkv.dtype(), saved.qkv.shape()));
  if (WantsTableGrad(saved, dbias)) {
    ASSIGN_OR_RETURN(*dbias, TableGradFor(ops, saved));
    return ops.AttentionBackwardPackedRelative(saved.args, saved.qkv, saved.out, grad,
                                               saved.softmax_lse, saved.relative, dqkv, dbias);
  }
  ASSIGN_OR_RETURN(const AttentionArgs args,
                   WithRelativeBiasMadeForBackward(ops, saved.args, saved.qkv, "attention"));
  Tensor bias_grad;
  if (args.bias.defined() && args.bias.numel() > 0) {  // the op wants dbias beside a bias
    ASSIGN_OR_RETURN(bias_grad, ops.Allocate(DType::kF32, args.bias.shape()));
  }
  RETURN_IF_ERROR(ops.AttentionBackwardPacked(args, saved.qkv, saved.out, grad,
                                              saved.softmax_lse, dqkv,
                                              bias_grad.defined() ? &bias_grad : nullptr));
  if (dbias != nullptr) *dbias = bias_grad;
  return absl::OkStatus();
}

absl::Status CheckFloatActivation(const Tensor& x, absl::string_view name) {
  if (IsFloating(x.dtype()) && !IsFloat8(x.dtype())) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " has dtype ", DTypeName(x.dtype()),
                                                 "; want float32, bfloat16 or float16"));
}

absl::StatusOr<Tensor> PrepareGradient(Ops& ops, const Tensor& dy, const Shape& shape,
                                       DType dtype) {
  if (dy.shape() != shape) {
    return absl::InvalidArgumentError(absl::StrCat("dy has shape ", ShapeString(dy.shape()),
                                                   "; want the output's ", ShapeString(shape)));
  }
  RETURN_IF_ERROR(CheckFloatActivation(dy, "dy"));
  if (dy.dtype() == dtype) return dy;
  ASSIGN_OR_RETURN(Tensor cast, ops.Allocate(dtype, dy.shape()));
  RETURN_IF_ERROR(ops.Cast(dy, &cast));
  return cast;
}

absl::StatusOr<std::vector<Tensor>> SplitAxis(Ops& ops, const Tensor& x, int axis) {
  if (axis < 0 || axis >= x.rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat("split axis ", axis, " out of range for ", ShapeString(x.shape())));
  }
  // Move `axis` to the front; each part is then one contiguous row block.
  std::vector<int> perm = {axis};
  Shape moved = {x.dim(axis)};
  for (int i = 0; i < x.rank(); ++i) {
    if (i == axis) continue;
    perm.push_back(i);
    moved.push_back(x.dim(i));
  }
  Tensor front;
  if (axis == 0) {
    front = x;
  } else {
    ASSIGN_OR_RETURN(front, ops.Allocate(x.dtype(), moved));
    RETURN_IF_ERROR(ops.Permute(x, perm, &front));
  }
  const Shape part_shape(moved.begin() + 1, moved.end());
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < x.dim(axis); ++i) {
    parts.push_back(front.Slice0(i, i + 1).Reshaped(part_shape));
  }
  return parts;
}

absl::StatusOr<Tensor> StackAxis(Ops& ops, const std::vector<Tensor>& parts, int axis) {
  if (parts.empty()) return absl::InvalidArgumentError("StackAxis: no parts");
  const Shape& part_shape = parts[0].shape();
  const int rank = static_cast<int>(part_shape.size()) + 1;
  if (axis < 0 || axis >= rank) {
    return absl::InvalidArgumentError(absl::StrCat("stack axis ", axis, " out of range"));
  }
  Shape front_shape = {static_cast<int64_t>(parts.size())};
  front_shape.insert(front_shape.end(), part_shape.begin(), part_shape.end());
  ASSIGN_OR_RETURN(Tensor front, ops.Allocate(parts[0].dtype(), front_shape));
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].shape() != part_shape || parts[i].dtype() != parts[0].dtype()) {
      return absl::InvalidArgumentError("StackAxis: parts differ in shape or dtype");
    }
    Tensor slot =
        front.Slice0(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1).Reshaped(part_shape);
    RETURN_IF_ERROR(ops.Copy(parts[i], &slot));
  }
  if (axis == 0) return front;
  // front is [n, d_0, ..]; out[.., n at axis, ..] reads front's axis 0 there.
  std::vector<int> perm;
  Shape out_shape;
  for (int i = 0, src = 1; i < rank; ++i) {
    if (i == axis) {
      perm.push_back(0);
      out_shape.push_back(front_shape[0]);
    } else {
      perm.push_back(src);
      out_shape.push_back(front_shape[src]);
      ++src;
    }
  }
  ASSIGN_OR_RETURN(Tensor out, ops.Allocate(front.dtype(), out_shape));
  RETURN_IF_ERROR(ops.Permute(front, perm, &out));
  return out;
}

RotaryArgs TeRotary(bool inverse, int64_t position_offset, const Tensor& position) {
  RotaryArgs args;
  args.min_timescale = 1.0f;
  args.max_timescale = 10000.0f;
  args.consecutive = true;  // TE's default group method: adjacent pairs
  args.inverse = inverse;
  args.position_offset = position_offset;
  args.position = position;
  return args;
}

absl::StatusOr<RotaryArgs> KeptTeRotary(Ops& ops, bool inverse, int64_t seq, int64_t dim,
                                        DeviceConstants* constants) {
  RotaryArgs args = TeRotary(inverse);
  if (constants == nullptr) return args;
  // A function of the layer's configuration and the call's shape alone, as
  // DeviceConstants asks: TE's timescales and group method are fixed.
  absl::StatusOr<Tensor> table = constants->Get(
      absl::StrCat("rotary angles ", inverse ? "inverse " : "", seq, " x ", dim, " from ",
                   args.min_timescale, " to ", args.max_timescale),
      [&] { return ops.RotaryTable(args, seq, dim); });
  if (absl::IsUnimplemented(table.status())) return args;
  RETURN_IF_ERROR(table.status());
  args.table = *std::move(table);
  return args;
}

absl::Status ApplyRotary(Ops& ops, const Tensor& x, bool inverse, Tensor* y,
                         int64_t position_offset, const Tensor& position) {
  if (x.rank() != 4 || x.dim(3) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rotary embedding needs [batch, seq, heads, head_dim] with an even head_dim; got ",
        ShapeString(x.shape())));
  }
  ASSIGN_OR_RETURN(Tensor rotated, ops.Allocate(x.dtype(), x.shape()));
  RETURN_IF_ERROR(ops.Rotary(TeRotary(inverse, position_offset, position), x, &rotated));
  *y = rotated;
  return absl::OkStatus();
}

std::vector<int32_t> RelativePositionBuckets(int64_t q_len, int64_t k_len, bool bidirectional,
                                             int num_buckets, int max_distance) {
  const int half = bidirectional ? num_buckets / 2 : num_buckets;
  const int max_exact = half / 2;
  const float eps = std::numeric_limits<float>::epsilon();
  // numpy: np.log(16.0) is a float64 scalar; NEP 50 promotes the float32
  // numerator to float64 for the division.
  const double log_range = std::log(static_cast<double>(max_distance) / max_exact);
  // The bucket depends on i - j alone: one per diagonal, then a fill.
  std::vector<int32_t> by_diagonal(static_cast<size_t>(q_len + k_len - 1));
  for (int64_t diagonal = 0; diagonal < q_len + k_len - 1; ++diagonal) {
    int64_t n = diagonal - (k_len - 1);  // TE's negative relative position: query - key
    int32_t bucket = 0;
    if (bidirectional) {
      if (n < 0) bucket += half;
      n = n < 0 ? -n : n;
    } else {
      n = std::max<int64_t>(n, 0);
    }
    int32_t offset;
    if (n < max_exact) {
      offset = static_cast<int32_t>(n);
    } else {
      const float ratio = static_cast<float>(n) / static_cast<float>(max_exact) + eps;
      const double scaled =
          static_cast<double>(std::log(ratio)) / log_range * static_cast<double>(half - max_exact);
      offset = std::min(max_exact + static_cast<int32_t>(scaled), half - 1);
    }
    by_diagonal[static_cast<size_t>(diagonal)] = bucket + offset;
  }
  std::vector<int32_t> buckets(static_cast<size_t>(q_len * k_len));
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t j = 0; j < k_len; ++j) {
      buckets[static_cast<size_t>(i * k_len + j)] =
          by_diagonal[static_cast<size_t>(i - j + k_len - 1)];
    }
  }
  return buckets;
}

int64_t UniformBucketDistance(const std::vector<int32_t>& buckets, int64_t seq) {
  if (seq < 2 || static_cast<int64_t>(buckets.size()) != seq * seq) return 0;
  // The last row sees every distance: key j is seq - 1 - j before it.
  const int32_t* last = buckets.data() + (seq - 1) * seq;
  const auto at = [&](int64_t n) { return last[seq - 1 - n]; };
  int64_t from = seq - 1;
  while (from > 1 && at(from - 1) == at(seq - 1)) --from;
  return from;
}

std::shared_ptr<const std::vector<int32_t>> RelativeBucketCache::Host(int64_t q_len,
                                                                     int64_t k_len) const {
  std::shared_ptr<const std::vector<int32_t>> table;
  {
    absl::MutexLock lock(&mu_);
    auto it = tables_.find({q_len, k_len});
    if (it != tables_.end()) table = it->second;
  }
  if (table == nullptr) {
    auto computed = std::make_shared<const std::vector<int32_t>>(
        RelativePositionBuckets(q_len, k_len, bidirectional_, num_buckets_, max_distance_));
    absl::MutexLock lock(&mu_);
    // Clients choose the sequence length: bound what the cache holds.
    if (tables_.size() >= kMaxShapes) tables_.clear();
    table = tables_.emplace(std::make_pair(q_len, k_len), std::move(computed)).first->second;
  }
  return table;
}

absl::StatusOr<Tensor> RelativeBucketCache::Buckets(Ops& ops, int64_t q_len, int64_t k_len,
                                                    DeviceConstants* constants) const {
  const auto upload = [&]() -> absl::StatusOr<Tensor> {
    const std::shared_ptr<const std::vector<int32_t>> table = Host(q_len, k_len);
    ASSIGN_OR_RETURN(Tensor buckets, ops.Allocate(DType::kI32, {q_len, k_len}));
    RETURN_IF_ERROR(ops.Upload(table->data(), &buckets));
    return buckets;
  };
  if (constants == nullptr) return upload();
  return constants->Get(absl::StrCat("relative_buckets/", bidirectional_, "/", num_buckets_, "/",
                                     max_distance_, "/", q_len, "x", k_len),
                        upload);
}

absl::StatusOr<RelativeBuckets> RelativeBucketCache::Relative(Ops& ops, int64_t q_len,
                                                              int64_t k_len,
                                                              DeviceConstants* constants) const {
  RelativeBuckets relative;
  ASSIGN_OR_RETURN(relative.buckets, Buckets(ops, q_len, k_len, constants));
  if (q_len == k_len) relative.uniform_from = UniformBucketDistance(*Host(q_len, k_len), q_len);
  return relative;
}

DType RelativeBiasDType(DType operands) {
  return operands == DType::kBF16 || operands == DType::kF16 ? operands : DType::kF32;
}

absl::StatusOr<Tensor> RelativeBias(Ops& ops, const Tensor& table, const Tensor& buckets,
                                    DType operands, const Tensor& first_row, int64_t rows) {
  const int64_t heads = table.dim(0);
  const int64_t query_rows = first_row.defined() ? rows : buckets.dim(0);
  ASSIGN_OR_RETURN(Tensor bias, ops.Allocate(RelativeBiasDType(operands),
                                             {heads, query_rows, buckets.dim(1)}));
  RETURN_IF_ERROR(ops.RelativeBiasForward(table, buckets, first_row, &bias));
  return bias;
}

}  // namespace te::layers
