// CPU reference attention: softmax(scale * q k^T + bias, masked) -> dropout -> @ v,
// one query row at a time, float32 throughout, each output rounded once.
//
// Rows with no visible key. A query at or past q_seqlens[b], or one whose every
// key is masked, outputs zeros and gets softmax_lse = +inf. +inf (flash
// attention's convention) rather than log(0) = -inf so that backward's
// recomputed probabilities exp(logit - lse) are exactly 0 for such a row with no
// special case; its dq is 0 and it adds nothing to dk, dv or dbias.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/op_checks.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The sizes of one attention call (checked by op_checks) and the flat offsets
// of its tensors.
struct AttentionDims : AttentionShape {
  explicit AttentionDims(const AttentionShape& shape) : AttentionShape(shape) {}

  // GQA: query head h reads kv head h / (q_heads / kv_heads).
  int64_t KvHead(int64_t h) const { return h / (q_heads / kv_heads); }
  // First element of q[b, i, h, :] (also out, dout, dq).
  int64_t QOffset(int64_t b, int64_t i, int64_t h) const {
    return ((b * q_seq + i) * q_heads + h) * head_dim;
  }
  // First element of k[b, j, kvh, :] (also v, dk, dv).
  int64_t KvOffset(int64_t b, int64_t j, int64_t kvh) const {
    return ((b * kv_seq + j) * kv_heads + kvh) * head_dim;
  }
  // softmax_lse[b, h, i]; times kv_seq plus j, the dropout element index.
  int64_t Row(int64_t b, int64_t h, int64_t i) const { return (b * q_heads + h) * q_seq + i; }
  // bias[h, i, j] (also dbias).
  int64_t BiasOffset(int64_t h, int64_t i) const { return (h * q_seq + i) * kv_seq; }
};

// Reads padding lengths, int32 [B] (checked by op_checks), each of which must
// be in [0, max_len]: on the CPU the values can be checked, not just clamped.
absl::StatusOr<std::vector<int64_t>> ReadLengths(const char* op, const char* name,
                                                 const Tensor& lengths, int64_t batch,
                                                 int64_t max_len) {
  std::vector<int64_t> result(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t len = lengths.data_as<const int32_t>()[b];
    if (len < 0 || len > max_len) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, "[", b, "] = ", len,
                                                     " is outside [0, ", max_len, "]"));
    }
    result[b] = len;
  }
  return result;
}

// Under every mask type the keys visible to query i are a prefix [0, end):
// padding cuts it at the valid key count, causality at i + 1 + offset (0 top
// left; bottom right the key count minus the query count, per batch row
// under padding: ops.h's MaskType).
class VisibleKeys {
 public:
  static absl::StatusOr<VisibleKeys> Make(const char* op, const AttentionArgs& args,
                                          const AttentionDims& dims) {
    VisibleKeys keys;
    keys.causal_ = IsCausalMask(args.mask);
    keys.bottom_right_ = IsBottomRightMask(args.mask);
    if (IsPaddingMask(args.mask)) {
      ASSIGN_OR_RETURN(keys.q_valid_,
                       ReadLengths(op, "q_seqlens", args.q_seqlens, dims.batch, dims.q_seq));
      ASSIGN_OR_RETURN(keys.kv_valid_,
                       ReadLengths(op, "kv_seqlens", args.kv_seqlens, dims.batch, dims.kv_seq));
    } else {
      keys.q_valid_.assign(static_cast<size_t>(dims.batch), dims.q_seq);
      keys.kv_valid_.assign(static_cast<size_t>(dims.batch), dims.kv_seq);
    }
    return keys;
  }

  // One past the last key query i of batch b sees; 0 when it sees none.
  int64_t End(int64_t b, int64_t i) const {
    if (i >= q_valid_[b]) return 0;
    const int64_t end = kv_valid_[b];
    if (!causal_) return end;
    const int64_t offset = bottom_right_ ? kv_valid_[b] - q_valid_[b] : 0;
    return std::max<int64_t>(0, std::min(end, i + 1 + offset));
  }

 private:
  bool causal_ = false;
  bool bottom_right_ = false;
  std::vector<int64_t> q_valid_;
  std::vector<int64_t> kv_valid_;
};

// The inverted-dropout multiplier of each probability in one row: 0 where
// dropped, 1/(1-rate) where kept (all ones without dropout).
void DropoutRow(const AttentionArgs& args, const AttentionDims& dims, int64_t row, int64_t end,
                std::vector<float>* multiplier) {
  multiplier->assign(static_cast<size_t>(end), 1.0f);
  if (args.dropout_rate == 0.0f) return;
  const float keep_scale = 1.0f / (1.0f - args.dropout_rate);
  for (int64_t j = 0; j < end; ++j) {
    const uint64_t index = static_cast<uint64_t>(row * dims.kv_seq + j);
    (*multiplier)[j] =
        DropoutUniform(args.dropout_seed, index) >= args.dropout_rate ? keep_scale : 0.0f;
  }
}

// logits[j] = scale * q[b,i,h] . k[b,j,kvh] + bias[h,i,j] for the keys j < end
// (the prefix the mask type leaves), -inf where the elementwise mask masks j.
void RowLogits(const AttentionArgs& args, const AttentionDims& dims,
               const std::vector<float>& q, const std::vector<float>& k,
               const std::vector<float>& bias, int64_t b, int64_t h, int64_t i, int64_t end,
               std::vector<float>* logits) {
  logits->resize(static_cast<size_t>(end));
  const float* q_row = &q[dims.QOffset(b, i, h)];
  const int64_t kvh = dims.KvHead(h);
  // The mask's plane: shared over the heads ([B, Sq, Skv]) or head h's
  // ([B, Hq, Sq, Skv]).
  const int64_t plane =
      args.elementwise_mask.rank() == 4 ? b * dims.q_heads + h : b;
  const bool* masked = args.elementwise_mask.defined()
                           ? args.elementwise_mask.data_as<const bool>() +
                                 (plane * dims.q_seq + i) * dims.kv_seq
                           : nullptr;
  for (int64_t j = 0; j < end; ++j) {
    if (masked != nullptr && masked[j]) {
      (*logits)[j] = -kInf;
      continue;
    }
    const float* k_row = &k[dims.KvOffset(b, j, kvh)];
    float dot = 0.0f;
    for (int64_t d = 0; d < dims.head_dim; ++d) dot += q_row[d] * k_row[d];
    float logit = args.scale * dot;
    if (!bias.empty()) logit += bias[dims.BiasOffset(h, i) + j];
    (*logits)[j] = logit;
  }
}

}  // namespace

absl::Status CpuOps::AttentionForward(const AttentionArgs& args, const Tensor& q,
                                      const Tensor& k, const Tensor& v, Tensor* out,
                                      Tensor* softmax_lse) {
  constexpr const char* kOp = "AttentionForward";
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionForwardArgs(args, q, k, v, out, softmax_lse));
  if (args.relative_bias.defined()) {
    ASSIGN_OR_RETURN(const AttentionArgs made, WithRelativeBiasMade(*this, args, shape.q_seq, q.dtype()));
    return AttentionForward(made, q, k, v, out, softmax_lse);
  }
  const AttentionDims dims(shape);
  ASSIGN_OR_RETURN(const VisibleKeys visible, VisibleKeys::Make(kOp, args, dims));

  const std::vector<float> qf = ToFloatVector(q);
  const std::vector<float> kf = ToFloatVector(k);
  const std::vector<float> vf = ToFloatVector(v);
  const std::vector<float> bias = args.bias.defined() ? ToFloatVector(args.bias)
                                                      : std::vector<float>();
  std::vector<float> outf(static_cast<size_t>(out->numel()), 0.0f);
  float* lse = softmax_lse->data_as<float>();

  std::vector<float> logits, multiplier;
  for (int64_t b = 0; b < dims.batch; ++b) {
    for (int64_t h = 0; h < dims.q_heads; ++h) {
      const int64_t kvh = dims.KvHead(h);
      for (int64_t i = 0; i < dims.q_seq; ++i) {
        const int64_t row = dims.Row(b, h, i);
        const int64_t end = visible.End(b, i);
        lse[row] = kInf;
        if (end == 0) continue;
        RowLogits(args, dims, qf, kf, bias, b, h, i, end, &logits);
        float max_logit = -kInf;
        for (float l : logits) max_logit = std::max(max_logit, l);
        // A bias of -inf (or the elementwise mask) on every visible key masks
        // the row too.
        if (max_logit == -kInf) continue;
        float sum = 0.0f;
        for (float& l : logits) {
          l = std::exp(l - max_logit);  // unnormalised probability
          sum += l;
        }
        lse[row] = max_logit + std::log(sum);
        DropoutRow(args, dims, row, end, &multiplier);
        float* out_row = &outf[dims.QOffset(b, i, h)];
        for (int64_t j = 0; j < end; ++j) {
          const float weight = logits[j] / sum * multiplier[j];
          if (weight == 0.0f) continue;
          const float* v_row = &vf[dims.KvOffset(b, j, kvh)];
          for (int64_t d = 0; d < dims.head_dim; ++d) out_row[d] += weight * v_row[d];
        }
      }
    }
  }
  FromFloatVector(outf, out);
  return absl::OkStatus();
}

// With P the softmax probabilities, M the dropout multipliers and
// dP = (dout v^T) * M:  dv = (P*M)^T dout;  dS = P * (dP - rowsum(P * dP));
// dq = scale dS k;  dk = scale dS^T q;  dbias = sum over the batch of dS.
// rowsum(P * dP) equals flash attention's rowsum(dout * out), but is taken from
// the recomputed P so that out's rounding to bf16 does not enter the gradient.
absl::Status CpuOps::AttentionBackward(const AttentionArgs& args, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& out,
                                       const Tensor& dout, const Tensor& softmax_lse,
                                       Tensor* dq, Tensor* dk, Tensor* dv, Tensor* dbias) {
  constexpr const char* kOp = "AttentionBackward";
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionBackwardArgs(args, q, k, v, out, dout, softmax_lse, dq, dk, dv,
                                              dbias));
  const AttentionDims dims(shape);
  const bool with_bias = args.bias.defined();
  ASSIGN_OR_RETURN(const VisibleKeys visible, VisibleKeys::Make(kOp, args, dims));

  const std::vector<float> qf = ToFloatVector(q);
  const std::vector<float> kf = ToFloatVector(k);
  const std::vector<float> vf = ToFloatVector(v);
  const std::vector<float> doutf = ToFloatVector(dout);
  const std::vector<float> bias = with_bias ? ToFloatVector(args.bias) : std::vector<float>();
  const float* lse = softmax_lse.data_as<const float>();
  std::vector<float> dqf(static_cast<size_t>(dq->numel()), 0.0f);
  std::vector<float> dkf(static_cast<size_t>(dk->numel()), 0.0f);
  std::vector<float> dvf(static_cast<size_t>(dv->numel()), 0.0f);
  std::vector<float> dbiasf(with_bias ? static_cast<size_t>(dbias->numel()) : 0, 0.0f);

  std::vector<float> probs, multiplier, dprobs;
  for (int64_t b = 0; b < dims.batch; ++b) {
    for (int64_t h = 0; h < dims.q_heads; ++h) {
      const int64_t kvh = dims.KvHead(h);
      for (int64_t i = 0; i < dims.q_seq; ++i) {
        const int64_t row = dims.Row(b, h, i);
        const int64_t end = visible.End(b, i);
        if (end == 0 || !std::isfinite(lse[row])) continue;
        RowLogits(args, dims, qf, kf, bias, b, h, i, end, &probs);
        for (float& p : probs) p = std::exp(p - lse[row]);
        DropoutRow(args, dims, row, end, &multiplier);

        const int64_t q_offset = dims.QOffset(b, i, h);
        const float* dout_row = &doutf[q_offset];
        dprobs.resize(static_cast<size_t>(end));
        float row_dot = 0.0f;  // rowsum(P * dP)
        for (int64_t j = 0; j < end; ++j) {
          const int64_t kv_offset = dims.KvOffset(b, j, kvh);
          const float dropped_prob = probs[j] * multiplier[j];
          float dot = 0.0f;
          for (int64_t d = 0; d < dims.head_dim; ++d) {
            dot += dout_row[d] * vf[kv_offset + d];
            dvf[kv_offset + d] += dropped_prob * dout_row[d];
          }
          dprobs[j] = dot * multiplier[j];
          row_dot += probs[j] * dprobs[j];
        }
        const float* q_row = &qf[q_offset];
        float* dq_row = &dqf[q_offset];
        for (int64_t j = 0; j < end; ++j) {
          const float dlogit = probs[j] * (dprobs[j] - row_dot);
          if (with_bias) dbiasf[dims.BiasOffset(h, i) + j] += dlogit;
          const float dscaled = args.scale * dlogit;
          const int64_t kv_offset = dims.KvOffset(b, j, kvh);
          for (int64_t d = 0; d < dims.head_dim; ++d) {
            dq_row[d] += dscaled * kf[kv_offset + d];
            dkf[kv_offset + d] += dscaled * q_row[d];
          }
        }
      }
    }
  }
  FromFloatVector(dqf, dq);
  FromFloatVector(dkf, dk);
  FromFloatVector(dvf, dv);
  if (with_bias) FromFloatVector(dbiasf, dbias);
  return absl::OkStatus();
}

}  // namespace te
