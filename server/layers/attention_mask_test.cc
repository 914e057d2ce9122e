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
#include <cmath>
#include <memory>
#include <random>
#include <string>
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

// The layer inputs a request with `mask` ([B, 1, Sq, Skv] bytes, nonzero =
// masked out) gets: what Session::MaterializeInputs makes of the decoded mask.
LayerInputs WithMask(Ops& ops, LayerInputs in, const std::string& mask, DType dtype) {
  auto decoded = session::DecodeAttentionMask(mask, dtype, {kB, 1, kSq, kSkv}, kB, "mask");
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  if (decoded->seqlens) {
    in.q_seqlens = session::UploadSeqlens(ops, decoded->seqlens->q).value();
    in.kv_seqlens = session::UploadSeqlens(ops, decoded->seqlens->kv).value();
    in.seqlens_with_causal = decoded->with_causal;
  }
  if (!decoded->elementwise.empty()) {
    in.elementwise_mask = ops.Allocate(DType::kBool, {kB, kSq, kSkv}).value();
    EXPECT_TRUE(ops.Upload(decoded->elementwise.data(), &in.elementwise_mask).ok());
  }
  return in;
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

}  // namespace
}  // namespace te::layers
