// What each attention mask type makes of a given mask, as TE's Flax modules
// define it, from the request's mask bytes (decoded as the session decodes
// them) to the layer's output, against a float64 softmax reference:
//
//  * transformer.py, _UnfusedDotProductAttention.convert_to_softmax_type:
//    "mask is ignored for no_mask and causal_mask"; for the padding types the
//    mask is applied as given (SCALED_MASKED), elementwise, any pattern.
//  * DotProductAttention's docstring: padding_causal is "a combination of
//    both causal and padding masks"; TE's tests hand it the causal triangle
//    (tests/jax/test_layer.py, EncoderRunner.generate_inputs: uint8
//    jnp.triu(ones, k=1) for 'causal' and 'padding_causal'), and its fused
//    path (attention.py, _legacy_fused_attn) applies causality itself from
//    the mask type: so a padding_causal layer masks key j for query i when
//    the mask does or j > i.
//  * Module's Softmax combines the mask with the logits [b, h, q, k] by
//    broadcasting, so a mask may have one plane per head ([B, H, Sq, Skv]),
//    and any dim may be 1.
//  * attention.py, AttnMaskType: CAUSAL_BOTTOM_RIGHT_MASK and
//    PADDING_CAUSAL_BOTTOM_RIGHT_MASK align the diagonal with the bottom-right
//    corner: key j visible to query i iff j <= i + (Skv - Sq), with each batch
//    row's actual lengths for the padding variant.
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "server/layers/attention_layers.h"
#include "server/layers/attention_reference.h"
#include "server/layers/testing.h"
#include "server/session/tensor_codec.h"

namespace te::layers {
namespace {

using reference::Vec;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::Values;

constexpr double kF32Tolerance = 1e-5;  // float32 against float64

constexpr int64_t kB = 2, kSq = 6, kSkv = 6, kHeads = 2, kD = 8;

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

// The layer inputs a request with `mask` (bytes of `shape`, nonzero = masked
// out) gets for logits [B, heads, q_len, kv_len]: what the session makes of
// it (Session::CheckInputs and MaterializeInputs), a mask that does not
// broadcast as a deferred error.
LayerInputs WithMask(Ops& ops, LayerInputs in, const std::string& mask, DType dtype,
                     const Shape& shape, int64_t q_len, int64_t kv_len) {
  auto decoded =
      session::DecodeAttentionMask(mask, dtype, shape, kB, q_len, kv_len, "attention_mask");
  if (!decoded.ok()) {
    in.mask_error = decoded.status();
    return in;
  }
  session::MaskTensors tensors = session::UploadMask(ops, *decoded).value();
  in.q_seqlens = tensors.q_seqlens;
  in.kv_seqlens = tensors.kv_seqlens;
  in.seqlens_with_causal = tensors.with_causal;
  in.elementwise_mask = tensors.elementwise;
  in.mask_heads = tensors.given_heads;
  return in;
}
LayerInputs WithMask(Ops& ops, LayerInputs in, const std::string& mask, DType dtype) {
  return WithMask(ops, std::move(in), mask, dtype, {kB, 1, kSq, kSkv}, kSq, kSkv);
}

// Masks as bool bytes [B, Sq, Skv] (1 = masked out).
std::string Padding(const std::vector<int>& q, const std::vector<int>& kv) {
  std::string m;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t i = 0; i < kSq; ++i) {
      for (int64_t j = 0; j < kSkv; ++j) m.push_back(i < q[b] && j < kv[b] ? 0 : 1);
    }
  }
  return m;
}
std::string Triu(std::string m) {  // the causal triangle j > i masked too
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t i = 0; i < kSq; ++i) {
      for (int64_t j = i + 1; j < kSkv; ++j) m[(b * kSq + i) * kSkv + j] = 1;
    }
  }
  return m;
}
std::string Arbitrary(uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution masked(0.4);
  std::string m(kB * kSq * kSkv, 0);
  for (char& c : m) c = masked(rng) ? 1 : 0;
  for (int64_t j = 0; j < kSkv; ++j) m[2 * kSkv + j] = 1;  // batch 0, query 2: nothing visible
  return m;
}
std::string AsInt32(const std::string& m) {
  std::string out;
  for (char c : m) {
    const int32_t v = c ? 1 : 0;
    out.append(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  return out;
}

std::unique_ptr<Layer> Dpa(te::v1::AttnMaskType mask) {
  te::v1::DotProductAttention spec;
  spec.set_head_dim(kD);
  spec.set_num_attention_heads(kHeads);
  spec.set_attn_mask_type(mask);
  return MakeDotProductAttention(spec).value();
}

struct Run {
  LayerInputs in;
  Vec y;
};

class MaskSemanticsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ops_ = NewCpuOps();
    base_.x = RandomTensor(*ops_, {kB, kSq, kHeads, kD}, DType::kF32, 1);
    base_.extra = {RandomTensor(*ops_, {kB, kSkv, kHeads, kD}, DType::kF32, 2),
                   RandomTensor(*ops_, {kB, kSkv, kHeads, kD}, DType::kF32, 3)};
  }
  // y of a DotProductAttention of `type` given `mask` (none when empty).
  Vec Forward(te::v1::AttnMaskType type, const std::string& mask, DType dtype = DType::kBool) {
    auto layer = Dpa(type);
    const LayerInputs in = mask.empty() ? base_ : WithMask(*ops_, base_, mask, dtype);
    Variables vars;
    LayerOutputs out;
    const absl::Status st = layer->Forward(*ops_, &vars, in, {}, &out, nullptr);
    EXPECT_TRUE(st.ok()) << st;
    return st.ok() ? ToVec(out.y) : Vec();
  }
  // The reference with the keys `masked` masks (and j > i when causal) dropped.
  Vec Want(bool causal, const std::string& masked) {
    const reference::AttentionShape s{kB, kSq, kSkv, kHeads, kHeads, kD};
    return reference::Attention(s, ToVec(base_.x), ToVec(base_.extra[0]), ToVec(base_.extra[1]),
                                1.0 / std::sqrt(static_cast<double>(kD)), causal, {}, {}, {},
                                std::vector<char>(masked.begin(), masked.end()));
  }

  std::unique_ptr<Ops> ops_;
  LayerInputs base_;
};

// A causal layer ignores the mask it is given (TE: "mask is ignored for ...
// causal"), here the causal triangle TE's tests pass (today's server refused
// it: "not a padding mask"), and an arbitrary one.
TEST_F(MaskSemanticsTest, CausalIgnoresTheMask) {
  const Vec want = Want(/*causal=*/true, "");
  EXPECT_LT(reference::RelativeError(Forward(te::v1::CAUSAL, Triu(Padding({6, 6}, {6, 6}))), want),
            kF32Tolerance);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::CAUSAL, Arbitrary(5)), want), kF32Tolerance);
}

// no_mask ignores the mask too.
TEST_F(MaskSemanticsTest, NoMaskIgnoresTheMask) {
  const Vec want = Want(/*causal=*/false, "");
  EXPECT_LT(reference::RelativeError(Forward(te::v1::NO_MASK, Arbitrary(6)), want),
            kF32Tolerance);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::NO_MASK, Padding({3, 2}, {4, 1})), want),
            kF32Tolerance);
}

// padding: the mask as it is, elementwise, whatever its pattern.
TEST_F(MaskSemanticsTest, PaddingAppliesAnyMaskElementwise) {
  const std::string pad = Padding({5, 3}, {4, 6});
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING, pad), Want(false, pad)),
            kF32Tolerance);
  const std::string arbitrary = Arbitrary(7);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING, arbitrary), Want(false, arbitrary)),
            kF32Tolerance);
  // The causal triangle through a padding layer is applied as given.
  const std::string triu = Triu(Padding({6, 4}, {6, 4}));
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING, triu), Want(false, triu)),
            kF32Tolerance);
}

// padding_causal: the mask and causality together; a plain padding mask, the
// padding mask with the triangle (TE's tests), and an arbitrary mask.
TEST_F(MaskSemanticsTest, PaddingCausalCombinesTheMaskWithCausality) {
  const std::string pad = Padding({5, 3}, {4, 6});
  const Vec want = Want(true, pad);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING_CAUSAL, pad), want), kF32Tolerance);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING_CAUSAL, Triu(pad)), want),
            kF32Tolerance);
  const std::string arbitrary = Arbitrary(8);
  EXPECT_LT(reference::RelativeError(Forward(te::v1::PADDING_CAUSAL, arbitrary),
                                     Want(true, arbitrary)),
            kF32Tolerance);
}

// int32 masks mean what the same bool mask means (nonzero = masked out).
TEST_F(MaskSemanticsTest, Int32MasksEqualBoolMasks) {
  const std::string arbitrary = Arbitrary(9);
  EXPECT_EQ(Forward(te::v1::PADDING, AsInt32(arbitrary), DType::kI32),
            Forward(te::v1::PADDING, arbitrary));
}

// Through MultiHeadAttention and TransformerLayer too (the attention block
// they share reads the mask the same way): an arbitrary mask to a padding
// layer changes y, and the causal triangle to a causal layer does not.
TEST_F(MaskSemanticsTest, MhaAndTransformerLayerReadTheMask) {
  const int64_t hidden = kHeads * kD;
  te::v1::LayerSpec specs[2];
  auto* mha = specs[0].mutable_multi_head_attention();
  mha->set_head_dim(kD);
  mha->set_num_attention_heads(kHeads);
  auto* tl = specs[1].mutable_transformer_layer();
  tl->set_hidden_size(hidden);
  tl->set_mlp_hidden_size(2 * hidden);
  tl->set_num_attention_heads(kHeads);
  for (te::v1::LayerSpec& spec : specs) {
    for (te::v1::AttnMaskType type : {te::v1::PADDING, te::v1::CAUSAL}) {
      if (spec.has_multi_head_attention()) spec.mutable_multi_head_attention()->set_attn_mask_type(type);
      if (spec.has_transformer_layer()) spec.mutable_transformer_layer()->set_self_attn_mask_type(type);
      auto layer = CreateLayer(spec).value();
      LayerInputs in;
      in.x = RandomTensor(*ops_, {kB, kSq, hidden}, DType::kF32, 11);
      Variables vars = testing::InitLayer(*ops_, *layer, in.x.shape(), nullptr, 3).value();
      auto run = [&](const LayerInputs& inputs) {
        LayerOutputs out;
        const absl::Status st = layer->Forward(*ops_, &vars, inputs, {}, &out, nullptr);
        EXPECT_TRUE(st.ok()) << st;
        return ToVec(out.y);
      };
      const Vec plain = run(in);
      const std::string mask = type == te::v1::CAUSAL ? Triu(Padding({6, 6}, {6, 6})) : Arbitrary(12);
      const Vec masked = run(WithMask(*ops_, in, mask, DType::kBool));
      if (type == te::v1::CAUSAL) {
        EXPECT_LT(reference::RelativeError(masked, plain), kF32Tolerance) << spec.DebugString();
      } else {
        EXPECT_GT(reference::RelativeError(masked, plain), 1e-3) << spec.DebugString();
      }
    }
  }
}

// ---- mask shapes (broadcast, per head), ignored masks, bottom-right -----------

// Random bool bytes, true (1) with probability `rate`.
std::string RandomMask(size_t n, double rate, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution masked(rate);
  std::string m(n, 0);
  for (char& c : m) c = masked(rng) ? 1 : 0;
  return m;
}

// DotProductAttention on q [kB, Sq, Hq, kD], k, v [kB, Skv, Hkv, kD] of any
// sizes, against AttentionWhere with the visibility TE's definitions give.
class MaskShapeTest : public ::testing::Test {
 protected:
  void Make(int64_t sq, int64_t skv, int64_t hq, int64_t hkv) {
    ops_ = NewCpuOps();
    sq_ = sq, skv_ = skv, hq_ = hq, hkv_ = hkv;
    base_ = LayerInputs();
    base_.x = RandomTensor(*ops_, {kB, sq, hq, kD}, DType::kF32, 21);
    base_.extra = {RandomTensor(*ops_, {kB, skv, hkv, kD}, DType::kF32, 22),
                   RandomTensor(*ops_, {kB, skv, hkv, kD}, DType::kF32, 23)};
  }
  // y for a mask of `shape` (no mask when `shape` is empty).
  absl::StatusOr<Vec> Forward(te::v1::AttnMaskType type, const std::string& mask = "",
                              const Shape& shape = {}, DType dtype = DType::kBool) {
    te::v1::DotProductAttention spec;
    spec.set_head_dim(kD);
    spec.set_num_attention_heads(static_cast<int>(hq_));
    spec.set_num_gqa_groups(static_cast<int>(hkv_));
    spec.set_attn_mask_type(type);
    auto layer = MakeDotProductAttention(spec).value();
    const LayerInputs in =
        shape.empty() ? base_ : WithMask(*ops_, base_, mask, dtype, shape, sq_, skv_);
    Variables vars;
    LayerOutputs out;
    const absl::Status st = layer->Forward(*ops_, &vars, in, {}, &out, nullptr);
    if (!st.ok()) return st;
    return ToVec(out.y);
  }
  Vec MustForward(te::v1::AttnMaskType type, const std::string& mask = "",
                  const Shape& shape = {}) {
    absl::StatusOr<Vec> y = Forward(type, mask, shape);
    EXPECT_TRUE(y.ok()) << y.status();
    return y.ok() ? *y : Vec();
  }
  Vec Want(const reference::Visibility& visible) {
    const reference::AttentionShape s{kB, sq_, skv_, hq_, hkv_, kD};
    return reference::AttentionWhere(s, ToVec(base_.x), ToVec(base_.extra[0]),
                                     ToVec(base_.extra[1]),
                                     1.0 / std::sqrt(static_cast<double>(kD)), visible);
  }

  std::unique_ptr<Ops> ops_;
  int64_t sq_ = 0, skv_ = 0, hq_ = 0, hkv_ = 0;
  LayerInputs base_;
};

// A [B, H, Sq, Skv] mask masks each head by its own plane (TE broadcasts it
// against the logits; under GQA those have the query heads), for the padding
// types as for any other mask; [1, H, Sq, Skv] broadcasts over the batch.
TEST_F(MaskShapeTest, APerHeadMaskMasksEachHeadByItsPlane) {
  Make(6, 7, 4, 2);
  const std::string mask = RandomMask(kB * 4 * 6 * 7, 0.4, 31);
  const auto at = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    return mask[((b * 4 + h) * 6 + i) * 7 + j] != 0;
  };
  EXPECT_LT(reference::RelativeError(
                MustForward(te::v1::PADDING, mask, {kB, 4, 6, 7}),
                Want([&](int64_t b, int64_t h, int64_t i, int64_t j) { return !at(b, h, i, j); })),
            kF32Tolerance);
  EXPECT_LT(reference::RelativeError(MustForward(te::v1::PADDING_CAUSAL, mask, {kB, 4, 6, 7}),
                                     Want([&](int64_t b, int64_t h, int64_t i, int64_t j) {
                                       return !at(b, h, i, j) && j <= i;
                                     })),
            kF32Tolerance);
  const std::string one = mask.substr(0, 4 * 6 * 7);  // batch 0's planes, for every batch row
  EXPECT_LT(reference::RelativeError(
                MustForward(te::v1::PADDING, one, {1, 4, 6, 7}),
                Want([&](int64_t, int64_t h, int64_t i, int64_t j) { return !at(0, h, i, j); })),
            kF32Tolerance);
}

// Heads other than 1 or the layer's are what TE cannot broadcast either:
// INVALID_ARGUMENT naming attention_mask with the shapes TE takes.
TEST_F(MaskShapeTest, APerHeadMaskOfOtherHeadsIsInvalidArgument) {
  Make(6, 6, 4, 4);
  // Planes that differ, and planes all alike (the heads still do not fit).
  for (const std::string& mask :
       {RandomMask(kB * 3 * 36, 0.3, 32), std::string(kB * 3 * 36, 0)}) {
    const absl::StatusOr<Vec> y = Forward(te::v1::PADDING, mask, {kB, 3, 6, 6});
    ASSERT_TRUE(absl::IsInvalidArgument(y.status())) << y.status();
    EXPECT_NE(y.status().message().find("attention_mask"), std::string::npos) << y.status();
    EXPECT_NE(y.status().message().find("4 or 1"), std::string::npos) << y.status();
  }
}

// Any dim of 1 broadcasts: a key mask [B, 1, 1, Skv], a query mask [1, 1, Sq, 1].
TEST_F(MaskShapeTest, DimsOfOneBroadcast) {
  Make(5, 6, 2, 2);
  const std::string keys = RandomMask(kB * 6, 0.4, 33);
  EXPECT_LT(reference::RelativeError(MustForward(te::v1::PADDING, keys, {kB, 1, 1, 6}),
                                     Want([&](int64_t b, int64_t, int64_t, int64_t j) {
                                       return keys[b * 6 + j] == 0;
                                     })),
            kF32Tolerance);
  const std::string queries = {0, 1, 0, 0, 1};
  EXPECT_LT(reference::RelativeError(MustForward(te::v1::PADDING_CAUSAL, queries, {1, 1, 5, 1}),
                                     Want([&](int64_t, int64_t, int64_t i, int64_t j) {
                                       return queries[i] == 0 && j <= i;
                                     })),
            kF32Tolerance);
}

// no_mask and causal ignore the mask whatever its shape and dtype (TE drops
// it before looking at it); every type that reads a mask refuses one that
// does not broadcast, naming attention_mask.
TEST_F(MaskShapeTest, IgnoredMasksAreNotChecked) {
  Make(5, 7, 2, 2);
  struct Bad {
    Shape shape;
    DType dtype;
  };
  const Bad bad[] = {{{5, 7}, DType::kBool},          // rank 2
                     {{kB, 1, 7, 5}, DType::kF32},    // Sq and Skv swapped
                     {{3, 1, 5, 7}, DType::kI32},     // batch 3 of 2
                     {{1, 1, 1, 5, 7}, DType::kBF16}};  // rank 5
  for (const Bad& m : bad) {
    const std::string bytes(NumElements(m.shape) * DTypeSize(m.dtype), 1);
    for (te::v1::AttnMaskType type : {te::v1::NO_MASK, te::v1::CAUSAL}) {
      const absl::StatusOr<Vec> y = Forward(type, bytes, m.shape, m.dtype);
      ASSERT_TRUE(y.ok()) << ShapeString(m.shape) << y.status();
      EXPECT_EQ(*y, MustForward(type)) << ShapeString(m.shape);
    }
    for (te::v1::AttnMaskType type :
         {te::v1::PADDING, te::v1::PADDING_CAUSAL, te::v1::CAUSAL_BOTTOM_RIGHT,
          te::v1::PADDING_CAUSAL_BOTTOM_RIGHT}) {
      const absl::StatusOr<Vec> y = Forward(type, bytes, m.shape, m.dtype);
      EXPECT_TRUE(absl::IsInvalidArgument(y.status())) << ShapeString(m.shape) << y.status();
      EXPECT_EQ(y.status().message().rfind("attention_mask.shape", 0), 0u) << y.status();
    }
  }
}

// causal_bottom_right: j <= i + (Skv - Sq). Self-attention (Sq == Skv) is
// causal; cross attention is not, against the float64 reference both ways
// (fewer keys than queries leaves the first queries nothing to see).
TEST_F(MaskShapeTest, CausalBottomRightAlignsTheDiagonalWithTheLastKey) {
  Make(6, 6, 2, 2);
  EXPECT_EQ(MustForward(te::v1::CAUSAL_BOTTOM_RIGHT), MustForward(te::v1::CAUSAL));
  for (const std::pair<int64_t, int64_t>& sizes : {std::pair<int64_t, int64_t>{4, 9}, {9, 4}}) {
    const int64_t sq = sizes.first, skv = sizes.second;
    Make(sq, skv, 2, 1);
    const int64_t offset = skv - sq;
    const Vec y = MustForward(te::v1::CAUSAL_BOTTOM_RIGHT);
    EXPECT_LT(reference::RelativeError(y, Want([offset](int64_t, int64_t, int64_t i, int64_t j) {
                                         return j <= i + offset;
                                       })),
              kF32Tolerance)
        << sq << " x " << skv;
    EXPECT_GT(reference::RelativeError(y, MustForward(te::v1::CAUSAL)), 1e-3) << sq << " x " << skv;
    // A mask is read together with the diagonal: an arbitrary one, and a
    // padding pattern (which a non-padding type applies elementwise).
    const std::string holes = RandomMask(kB * sq * skv, 0.3, 34);
    EXPECT_LT(reference::RelativeError(
                  MustForward(te::v1::CAUSAL_BOTTOM_RIGHT, holes, {kB, 1, sq, skv}),
                  Want([&, offset, sq, skv](int64_t b, int64_t, int64_t i, int64_t j) {
                    return holes[(b * sq + i) * skv + j] == 0 && j <= i + offset;
                  })),
              kF32Tolerance);
    std::string pad;
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t i = 0; i < sq; ++i) {
        for (int64_t j = 0; j < skv; ++j) pad.push_back(b == 1 && (i >= sq - 1 || j >= skv - 2));
      }
    }
    EXPECT_LT(reference::RelativeError(
                  MustForward(te::v1::CAUSAL_BOTTOM_RIGHT, pad, {kB, 1, sq, skv}),
                  Want([&, offset, sq, skv](int64_t b, int64_t, int64_t i, int64_t j) {
                    return pad[(b * sq + i) * skv + j] == 0 && j <= i + offset;
                  })),
              kF32Tolerance);
  }
}

// padding_causal_bottom_right: j <= i + (kv_len[b] - q_len[b]) with each
// batch row's actual lengths, from a padding mask, or from the valid region
// of a mask with holes in it (read elementwise as well); without a mask the
// lengths are Sq and Skv.
TEST_F(MaskShapeTest, PaddingCausalBottomRightUsesEachRowsLengths) {
  const int64_t sq = 5, skv = 8;
  Make(sq, skv, 2, 2);
  const int q_len[kB] = {5, 3}, kv_len[kB] = {8, 4};
  std::string pad;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t j = 0; j < skv; ++j) pad.push_back(i >= q_len[b] || j >= kv_len[b]);
    }
  }
  const auto padded = [&](int64_t b, int64_t i, int64_t j) {
    return i < q_len[b] && j < kv_len[b] && j <= i + kv_len[b] - q_len[b];
  };
  EXPECT_LT(reference::RelativeError(
                MustForward(te::v1::PADDING_CAUSAL_BOTTOM_RIGHT, pad, {kB, 1, sq, skv}),
                Want([&](int64_t b, int64_t, int64_t i, int64_t j) { return padded(b, i, j); })),
            kF32Tolerance);
  std::string holed = pad;
  holed[(1 * sq + 1) * skv + 0] = 1;  // batch 1, query 1 loses key 0: not a padding pattern
  EXPECT_LT(reference::RelativeError(
                MustForward(te::v1::PADDING_CAUSAL_BOTTOM_RIGHT, holed, {kB, 1, sq, skv}),
                Want([&](int64_t b, int64_t, int64_t i, int64_t j) {
                  return holed[(b * sq + i) * skv + j] == 0 && padded(b, i, j);
                })),
            kF32Tolerance);
  EXPECT_LT(reference::RelativeError(MustForward(te::v1::PADDING_CAUSAL_BOTTOM_RIGHT),
                                     Want([&](int64_t, int64_t, int64_t i, int64_t j) {
                                       return j <= i + skv - sq;
                                     })),
            kF32Tolerance);
}

// TransformerLayer's self-attention has Sq == Skv: bottom-right is causal,
// and padding_causal_bottom_right with equal query and key lengths per row is
// padding_causal.
TEST_F(MaskSemanticsTest, TransformerLayerTakesTheBottomRightTypes) {
  const int64_t hidden = kHeads * kD;
  auto run = [&](te::v1::AttnMaskType type, const std::string& mask) {
    te::v1::LayerSpec spec;
    auto* tl = spec.mutable_transformer_layer();
    tl->set_hidden_size(hidden);
    tl->set_mlp_hidden_size(2 * hidden);
    tl->set_num_attention_heads(kHeads);
    tl->set_self_attn_mask_type(type);
    auto layer = CreateLayer(spec).value();
    LayerInputs in;
    in.x = RandomTensor(*ops_, {kB, kSq, hidden}, DType::kF32, 13);
    Variables vars = testing::InitLayer(*ops_, *layer, in.x.shape(), nullptr, 3).value();
    if (!mask.empty()) in = WithMask(*ops_, in, mask, DType::kBool);
    LayerOutputs out;
    const absl::Status st = layer->Forward(*ops_, &vars, in, {}, &out, nullptr);
    EXPECT_TRUE(st.ok()) << st;
    return ToVec(out.y);
  };
  EXPECT_EQ(run(te::v1::CAUSAL_BOTTOM_RIGHT, ""), run(te::v1::CAUSAL, ""));
  const std::string pad = Padding({6, 4}, {6, 4});
  EXPECT_LT(reference::RelativeError(run(te::v1::PADDING_CAUSAL_BOTTOM_RIGHT, pad),
                                     run(te::v1::PADDING_CAUSAL, pad)),
            kF32Tolerance);
}

}  // namespace
}  // namespace te::layers
