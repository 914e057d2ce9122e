// DotProductAttention against a direct float64 softmax reference (every mask
// type, GQA, bs3hd, bf16), its gradients against finite differences, dropout
// determinism, and spec / input validation.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/layers/attention_layers.h"
#include "server/layers/attention_reference.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using reference::Vec;
using testing::CheckGradients;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::Values;

// float32 attention against float64: accumulation error only.
constexpr double kF32Tolerance = 1e-5;
// bf16 inputs and output: one rounding of the output (2^-9) plus bf16 inputs.
constexpr double kBf16Tolerance = 1e-2;

Vec ToVec(const Tensor& t) {
  const std::vector<float> v = Values(t);
  return Vec(v.begin(), v.end());
}

Tensor Lengths(Ops& ops, const std::vector<int32_t>& lengths) {
  auto t = ops.Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())});
  EXPECT_TRUE(t.ok());
  for (size_t i = 0; i < lengths.size(); ++i) t->data_as<int32_t>()[i] = lengths[i];
  return *t;
}

std::unique_ptr<Layer> MakeLayer(int heads, int groups, int head_dim, te::v1::AttnMaskType mask,
                                 te::v1::QkvLayout layout = te::v1::BSHD_BSHD_BSHD,
                                 float dropout = 0.0f) {
  te::v1::DotProductAttention spec;
  spec.set_head_dim(head_dim);
  spec.set_num_attention_heads(heads);
  spec.set_num_gqa_groups(groups);
  spec.set_attn_mask_type(mask);
  spec.set_qkv_layout(layout);
  spec.set_attention_dropout(dropout);
  auto layer = MakeDotProductAttention(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

struct MaskCase {
  te::v1::AttnMaskType mask;
  bool causal;
  bool padded;
};

class DotProductAttentionForwardTest : public ::testing::TestWithParam<std::tuple<MaskCase, int>> {
};

TEST_P(DotProductAttentionForwardTest, MatchesSoftmaxReference) {
  const auto [mask_case, groups] = GetParam();
  const int64_t b = 2, sq = 5, skv = 7, heads = 4, d = 8;
  auto ops = NewCpuOps();
  auto layer = MakeLayer(heads, groups, d, mask_case.mask);
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, sq, heads, d}, DType::kF32, 1);
  in.extra = {RandomTensor(*ops, {b, skv, groups, d}, DType::kF32, 2),
              RandomTensor(*ops, {b, skv, groups, d}, DType::kF32, 3)};
  const std::vector<int32_t> q_lens = {5, 3}, kv_lens = {7, 4};
  if (mask_case.padded) {
    in.q_seqlens = Lengths(*ops, q_lens);
    in.kv_seqlens = Lengths(*ops, kv_lens);
  }
  Variables vars;
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &vars, in, {}, &out, nullptr).ok());
  ASSERT_EQ(out.y.shape(), (Shape{b, sq, heads, d}));  // TE returns [B, S, H, D]

  const reference::AttentionShape s{b, sq, skv, heads, groups, d};
  const Vec want = reference::Attention(
      s, ToVec(in.x), ToVec(in.extra[0]), ToVec(in.extra[1]), 1.0 / std::sqrt(8.0),
      mask_case.causal,
      mask_case.padded ? std::vector<int>(q_lens.begin(), q_lens.end()) : std::vector<int>{},
      mask_case.padded ? std::vector<int>(kv_lens.begin(), kv_lens.end()) : std::vector<int>{});
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);
}

INSTANTIATE_TEST_SUITE_P(
    MasksAndGroups, DotProductAttentionForwardTest,
    ::testing::Combine(::testing::Values(MaskCase{te::v1::NO_MASK, false, false},
                                         MaskCase{te::v1::CAUSAL, true, false},
                                         MaskCase{te::v1::PADDING, false, true},
                                         MaskCase{te::v1::PADDING_CAUSAL, true, true}),
                       ::testing::Values(4, 2, 1)));

TEST(DotProductAttentionTest, DefaultsAreCausalWithInverseSqrtScale) {
  te::v1::DotProductAttention spec;
  spec.set_head_dim(16);
  spec.set_num_attention_heads(2);
  auto layer = MakeDotProductAttention(spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto ops = NewCpuOps();
  LayerInputs in;
  in.x = RandomTensor(*ops, {1, 6, 2, 16}, DType::kF32, 4);
  in.extra = {RandomTensor(*ops, {1, 6, 2, 16}, DType::kF32, 5),
              RandomTensor(*ops, {1, 6, 2, 16}, DType::kF32, 6)};
  Variables vars;
  LayerOutputs out;
  ASSERT_TRUE((*layer)->Forward(*ops, &vars, in, {}, &out, nullptr).ok());
  const Vec want = reference::Attention({1, 6, 6, 2, 2, 16}, ToVec(in.x), ToVec(in.extra[0]),
                                        ToVec(in.extra[1]), 0.25, true, {}, {});
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);
}

TEST(DotProductAttentionTest, PackedQkvMatchesSeparateInputs) {
  const int64_t b = 2, s = 6, heads = 3, d = 4;
  auto ops = NewCpuOps();
  auto packed = MakeLayer(heads, heads, d, te::v1::CAUSAL, te::v1::BS3HD);
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, s, 3, heads, d}, DType::kF32, 7);
  Variables vars;
  LayerOutputs out;
  ASSERT_TRUE(packed->Forward(*ops, &vars, in, {}, &out, nullptr).ok());
  EXPECT_EQ(out.y.shape(), (Shape{b, s, heads, d}));
  const Vec x = ToVec(in.x);
  const int64_t row = heads * d;
  const Vec want =
      reference::Attention({b, s, s, heads, heads, d}, reference::Columns(x, 3 * row, 0, row),
                           reference::Columns(x, 3 * row, row, row),
                           reference::Columns(x, 3 * row, 2 * row, row), 1.0 / 2.0, true, {}, {});
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kF32Tolerance);
  auto shape = packed->OutputShape({b, s, 3, heads, d});
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(*shape, (Shape{b, s, heads, d}));
}

TEST(DotProductAttentionTest, Bf16WithinOneRounding) {
  const int64_t b = 2, s = 8, heads = 2, d = 16;
  auto ops = NewCpuOps();
  auto layer = MakeLayer(heads, heads, d, te::v1::CAUSAL);
  LayerInputs in;
  in.x = RandomTensor(*ops, {b, s, heads, d}, DType::kBF16, 8);
  in.extra = {RandomTensor(*ops, {b, s, heads, d}, DType::kBF16, 9),
              RandomTensor(*ops, {b, s, heads, d}, DType::kBF16, 10)};
  Variables vars;
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &vars, in, {}, &out, nullptr).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  const Vec want = reference::Attention({b, s, s, heads, heads, d}, ToVec(in.x), ToVec(in.extra[0]),
                                        ToVec(in.extra[1]), 0.25, true, {}, {});
  EXPECT_LT(reference::RelativeError(ToVec(out.y), want), kBf16Tolerance);
}

TEST(DotProductAttentionTest, GradientsMatchFiniteDifferences) {
  auto ops = NewCpuOps();
  Variables vars;
  for (const auto& [groups, mask] : {std::pair<int, te::v1::AttnMaskType>{4, te::v1::CAUSAL},
                                     {2, te::v1::NO_MASK},
                                     {1, te::v1::PADDING_CAUSAL}}) {
    SCOPED_TRACE(::testing::Message() << "groups " << groups << " mask " << mask);
    auto layer = MakeLayer(4, groups, 4, mask);
    LayerInputs in;
    in.x = RandomTensor(*ops, {2, 4, 4, 4}, DType::kF32, 11);
    in.extra = {RandomTensor(*ops, {2, 5, groups, 4}, DType::kF32, 12),
                RandomTensor(*ops, {2, 5, groups, 4}, DType::kF32, 13)};
    if (mask == te::v1::PADDING_CAUSAL) {
      in.q_seqlens = Lengths(*ops, {4, 3});
      in.kv_seqlens = Lengths(*ops, {5, 2});
    }
    EXPECT_TRUE(CheckGradients(*ops, *layer, &vars, in, {}));
  }
}

TEST(DotProductAttentionTest, PackedGradientsAndDropoutGradients) {
  auto ops = NewCpuOps();
  Variables vars;
  auto packed = MakeLayer(2, 2, 4, te::v1::CAUSAL, te::v1::BS3HD, /*dropout=*/0.25f);
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 5, 3, 2, 4}, DType::kF32, 14);
  ForwardOptions opts;
  EXPECT_TRUE(CheckGradients(*ops, *packed, &vars, in, opts));
  opts.deterministic = false;  // the same dropout mask in every evaluation
  opts.dropout_seed = 1234;
  EXPECT_TRUE(CheckGradients(*ops, *packed, &vars, in, opts));
}

TEST(DotProductAttentionTest, DropoutFollowsSeedAndDeterministic) {
  auto ops = NewCpuOps();
  auto layer = MakeLayer(2, 2, 8, te::v1::NO_MASK, te::v1::BSHD_BSHD_BSHD, 0.5f);
  LayerInputs in;
  in.x = RandomTensor(*ops, {1, 6, 2, 8}, DType::kF32, 15);
  in.extra = {RandomTensor(*ops, {1, 6, 2, 8}, DType::kF32, 16),
              RandomTensor(*ops, {1, 6, 2, 8}, DType::kF32, 17)};
  Variables vars;
  auto run = [&](bool deterministic, uint64_t seed) {
    ForwardOptions opts;
    opts.deterministic = deterministic;
    opts.dropout_seed = seed;
    LayerOutputs out;
    EXPECT_TRUE(layer->Forward(*ops, &vars, in, opts, &out, nullptr).ok());
    return Values(out.y);
  };
  const std::vector<float> off = run(true, 1);
  EXPECT_EQ(run(true, 2), off);
  const std::vector<float> a = run(false, 1);
  EXPECT_NE(a, off);
  EXPECT_EQ(run(false, 1), a);
  EXPECT_NE(run(false, 2), a);
}

TEST(DotProductAttentionTest, HasNoVariables) {
  auto layer = MakeLayer(4, 2, 8, te::v1::CAUSAL);
  Fp8Recipe fp8;
  auto specs = layer->VariableSpecs({2, 3, 4, 8}, &fp8);
  ASSERT_TRUE(specs.ok()) << specs.status();
  EXPECT_TRUE(specs->empty());
  EXPECT_EQ(layer->type_name(), "DotProductAttention");
}

TEST(DotProductAttentionTest, RejectsBadSpecsAndInputs) {
  te::v1::DotProductAttention spec;
  spec.set_head_dim(8);
  spec.set_num_attention_heads(4);
  spec.set_num_gqa_groups(3);
  auto bad = MakeDotProductAttention(spec);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("spec.dot_product_attention.num_gqa_groups"),
            std::string::npos);
  spec.set_num_gqa_groups(2);
  spec.set_qkv_layout(te::v1::BS3HD);
  EXPECT_EQ(MakeDotProductAttention(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.clear_num_gqa_groups();
  spec.set_head_dim(0);
  bad = MakeDotProductAttention(spec);
  EXPECT_NE(bad.status().message().find("head_dim"), std::string::npos) << bad.status();

  auto layer = MakeLayer(4, 2, 8, te::v1::CAUSAL);
  EXPECT_EQ(layer->VariableSpecs({2, 3, 5, 8}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto ops = NewCpuOps();
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 3, 4, 8}, DType::kF32, 18);
  in.extra = {RandomTensor(*ops, {2, 3, 2, 8}, DType::kF32, 19)};  // v missing
  Variables vars;
  LayerOutputs out;
  EXPECT_EQ(layer->Forward(*ops, &vars, in, {}, &out, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
