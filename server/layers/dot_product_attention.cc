// TE's DotProductAttention (transformer_engine.jax.flax): no parameters;
// softmax(scale * q k^T, masked) v over [batch, seq, heads, head_dim] inputs,
// returning [batch, seq, heads, head_dim] as TE does (callers reshape).
//
// Inputs by qkv_layout: bshd_bshd_bshd takes q as x and k, v as the two extra
// inputs (k, v with num_gqa_groups heads); bs3hd takes one packed x
// [B, S, 3, H, D] (no GQA: TE's packed layout has one head count), which the
// packed attention ops read as it is (and whose gradient they write packed).
#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/attention_layers.h"
#include "server/layers/blocks.h"

namespace te::layers {
namespace {

constexpr char kField[] = "spec.dot_product_attention";

class DotProductAttentionSaved : public SavedForward {
 public:
  AttentionSaved attention;
  int64_t bytes() const override { return attention.bytes(); }
};

class DotProductAttentionLayer : public Layer {
 public:
  DotProductAttentionLayer(AttentionConfig config, bool packed)
      : config_(config), packed_(packed) {}

  std::string type_name() const override { return "DotProductAttention"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return std::vector<VariableSpec>{};
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape));
    return Shape{input_shape[0], input_shape[1], config_.num_heads, config_.head_dim};
  }

  absl::Status Init(Ops&, uint64_t, const Shape& input_shape, const Fp8Recipe*,
                    Variables*) const override {
    return CheckInputShape(input_shape);
  }

  absl::Status Forward(Ops& ops, Variables*, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    RETURN_IF_ERROR(CheckInputShape(in.x.shape()));
    const SeqLens seqlens = MaskOf(in);
    const uint64_t seed = DeriveSeed(opts.dropout_seed, "attention_dropout");
    auto kept = std::make_unique<DotProductAttentionSaved>();
    AttentionSaved* attention_saved = opts.keep_for_backward ? &kept->attention : nullptr;
    if (packed_) {
      if (!in.extra.empty()) {
        return absl::InvalidArgumentError(
            "extra_inputs: must be empty for qkv_layout bs3hd (x is the packed qkv)");
      }
      RETURN_IF_ERROR(AttentionForwardPacked(ops, config_, in.x, seqlens, Tensor(),
                                             !opts.deterministic, seed, &out->y,
                                             attention_saved));
    } else {
      if (in.extra.size() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(
            "extra_inputs: qkv_layout bshd_bshd_bshd takes q as x and k, v as two extra_inputs; got ",
            in.extra.size(), " extra inputs"));
      }
      RETURN_IF_ERROR(AttentionForward(ops, config_, in.x, in.extra[0], in.extra[1], seqlens,
                                       Tensor(), !opts.deterministic, seed, &out->y,
                                       attention_saved));
    }
    if (opts.keep_for_backward && saved != nullptr) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables*, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const DotProductAttentionSaved*>(&saved);
    if (kept == nullptr) {
      return absl::InvalidArgumentError("saved forward does not come from DotProductAttention");
    }
    grads->dextra.clear();
    if (packed_) {
      return AttentionBackwardPacked(ops, kept->attention, dy, &grads->dx, nullptr);
    }
    Tensor dq, dk, dv;
    RETURN_IF_ERROR(AttentionBackward(ops, kept->attention, dy, &dq, &dk, &dv, nullptr));
    grads->dx = dq;
    grads->dextra = {dk, dv};
    return absl::OkStatus();
  }

 private:
  absl::Status CheckInputShape(const Shape& shape) const {
    const bool fits = packed_ ? shape.size() == 5 && shape[2] == 3 &&
                                    shape[3] == config_.num_heads && shape[4] == config_.head_dim
                              : shape.size() == 4 && shape[2] == config_.num_heads &&
                                    shape[3] == config_.head_dim;
    if (fits && shape[0] > 0 && shape[1] > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("input_shape ", ShapeString(shape), " does not fit DotProductAttention: want ",
                     packed_ ? absl::StrCat("[batch, seq, 3, ", config_.num_heads, ", ",
                                            config_.head_dim, "] (bs3hd)")
                             : absl::StrCat("[batch, seq, ", config_.num_heads, ", ",
                                            config_.head_dim, "] (bshd_bshd_bshd)")));
  }

  AttentionConfig config_;
  bool packed_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeDotProductAttention(
    const te::v1::DotProductAttention& spec) {
  AttentionConfig config;
  config.head_dim = spec.head_dim();
  config.num_heads = spec.num_attention_heads();
  config.num_gqa_groups = spec.has_num_gqa_groups() ? spec.num_gqa_groups() : config.num_heads;
  config.dropout_rate = spec.has_attention_dropout() ? spec.attention_dropout() : 0.0f;
  ASSIGN_OR_RETURN(config.mask,
                   ResolveMaskType(spec.attn_mask_type(), absl::StrCat(kField, ".attn_mask_type")));
  config.scale =
      spec.has_scale_factor()
          ? spec.scale_factor()
          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(std::max(spec.head_dim(), 1))));
  RETURN_IF_ERROR(ValidateAttentionConfig(config, kField));
  if (spec.qkv_layout() != te::v1::QKV_LAYOUT_UNSPECIFIED &&
      spec.qkv_layout() != te::v1::BSHD_BSHD_BSHD && spec.qkv_layout() != te::v1::BS3HD) {
    return absl::InvalidArgumentError(absl::StrCat(kField, ".qkv_layout has unknown value ",
                                                   static_cast<int>(spec.qkv_layout())));
  }
  const bool packed = spec.qkv_layout() == te::v1::BS3HD;
  if (packed && config.num_gqa_groups != config.num_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat(kField, ".num_gqa_groups must equal num_attention_heads (", config.num_heads,
                     ") for qkv_layout bs3hd; got ", config.num_gqa_groups));
  }
  return std::unique_ptr<Layer>(new DotProductAttentionLayer(config, packed));
}

}  // namespace te::layers
