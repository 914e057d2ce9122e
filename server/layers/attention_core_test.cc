// The attention core's host-side pieces and helpers: T5 buckets (hand-checked
// against TE's formula), packed-tensor splitting, rotary against a float64
// reference of TE's rotary_pos_emb, AttentionForward's argument checks, and
// the packed-qkv wrappers against the unpacked ones.
#include "server/layers/attention_core.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "server/layers/attention_reference.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::NewCpuOps;
using testing::RandomTensor;
using testing::Values;

constexpr double kF32Tolerance = 1e-5;  // float32 op against a float64 reference

int BucketOf(int64_t i, int64_t j, bool bidirectional) {
  return RelativePositionBuckets(i + 1, j + 1, bidirectional, 32, 128)[i * (j + 1) + j];
}

TEST(RelativePositionBucketsTest, BidirectionalMatchesTeFormula) {
  // 16 buckets a side, 8 exact: n = i - j; keys after the query use 16..31.
  EXPECT_EQ(BucketOf(0, 0, true), 0);
  EXPECT_EQ(BucketOf(1, 0, true), 1);
  EXPECT_EQ(BucketOf(7, 0, true), 7);
  EXPECT_EQ(BucketOf(0, 1, true), 17);
  EXPECT_EQ(BucketOf(0, 7, true), 23);
  // Large: 8 + floor(log(n / 8) / log(16) * 8).
  EXPECT_EQ(BucketOf(8, 0, true), 8);
  EXPECT_EQ(BucketOf(15, 0, true), 8 + static_cast<int>(std::log(15.0 / 8) / std::log(16.0) * 8));
  EXPECT_EQ(BucketOf(16, 0, true), 10);
  EXPECT_EQ(BucketOf(32, 0, true), 12);
  EXPECT_EQ(BucketOf(64, 0, true), 14);
  EXPECT_EQ(BucketOf(127, 0, true), 15);
  EXPECT_EQ(BucketOf(300, 0, true), 15);  // clamped to the last bucket of the side
  EXPECT_EQ(BucketOf(0, 300, true), 31);
}

TEST(RelativePositionBucketsTest, UnidirectionalIgnoresFutureKeys) {
  // 32 buckets, 16 exact; keys after the query all fall in bucket 0.
  EXPECT_EQ(BucketOf(0, 5, false), 0);
  EXPECT_EQ(BucketOf(15, 0, false), 15);
  EXPECT_EQ(BucketOf(32, 0, false), 16 + static_cast<int>(std::log(2.0) / std::log(8.0) * 16));
  EXPECT_EQ(BucketOf(1000, 0, false), 31);
}

TEST(RelativePositionBucketsTest, EveryBucketInRangeAndToeplitz) {
  const std::vector<int32_t> b = RelativePositionBuckets(40, 50, true, 32, 128);
  for (int64_t i = 0; i < 40; ++i) {
    for (int64_t j = 0; j < 50; ++j) {
      ASSERT_GE(b[i * 50 + j], 0);
      ASSERT_LT(b[i * 50 + j], 32);
      if (i > 0 && j > 0) {
        ASSERT_EQ(b[i * 50 + j], b[(i - 1) * 50 + j - 1]);
      }
    }
  }
}

TEST(RelativeBucketCacheTest, UploadsTheComputedTable) {
  auto ops = NewCpuOps();
  RelativeBucketCache cache(true, 32, 128);
  for (int round = 0; round < 2; ++round) {  // the second call hits the cache
    auto buckets = cache.Buckets(*ops, 5, 7);
    ASSERT_TRUE(buckets.ok()) << buckets.status();
    EXPECT_EQ(buckets->shape(), (Shape{5, 7}));
    const std::vector<int32_t> want = RelativePositionBuckets(5, 7, true, 32, 128);
    for (int64_t n = 0; n < 35; ++n) EXPECT_EQ(buckets->data_as<int32_t>()[n], want[n]);
  }
}

// The band a relative table's gradient may be reduced from: every distance at
// or past it has the last distance's bucket, the one before it another.
TEST(UniformBucketDistanceTest, MarksWhereTheBucketsSettle) {
  for (const bool bidirectional : {false, true}) {
    for (const int64_t seq : {2, 20, 100, 256, 1024}) {
      const std::vector<int32_t> b = RelativePositionBuckets(seq, seq, bidirectional, 32, 128);
      const int64_t from = UniformBucketDistance(b, seq);
      ASSERT_GE(from, 1) << seq;
      ASSERT_LE(from, seq - 1) << seq;
      const int32_t* last = b.data() + (seq - 1) * seq;  // distance n at key seq - 1 - n
      for (int64_t n = from; n < seq; ++n) EXPECT_EQ(last[seq - 1 - n], last[0]) << seq << " " << n;
      if (from > 1) {
        EXPECT_NE(last[seq - 1 - (from - 1)], last[0]) << seq;
      }
    }
  }
  // TE's causal buckets (32 over 128 positions) settle before 128: a band the
  // CUDA backend's kernel holds (kRelativeBandMax).
  const int64_t causal =
      UniformBucketDistance(RelativePositionBuckets(1024, 1024, false, 32, 128), 1024);
  EXPECT_GT(causal, 64);
  EXPECT_LE(causal, 128);
  EXPECT_EQ(UniformBucketDistance({}, 0), 0);
  EXPECT_EQ(UniformBucketDistance({0}, 1), 0);
}

TEST(RelativeBucketCacheTest, RelativeCarriesTheBandForSelfAttention) {
  auto ops = NewCpuOps();
  RelativeBucketCache cache(false, 32, 128);
  auto self = cache.Relative(*ops, 300, 300);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_EQ(self->buckets.shape(), (Shape{300, 300}));
  EXPECT_EQ(self->uniform_from,
            UniformBucketDistance(RelativePositionBuckets(300, 300, false, 32, 128), 300));
  auto cross = cache.Relative(*ops, 3, 300);
  ASSERT_TRUE(cross.ok()) << cross.status();
  EXPECT_EQ(cross->uniform_from, 0);  // only self-attention's band is stated
}

TEST(SplitAxisTest, SplitThenStackRoundTrips) {
  auto ops = NewCpuOps();
  const Tensor x = RandomTensor(*ops, {2, 3, 4, 5}, DType::kF32, 7);
  for (int axis = 0; axis < 4; ++axis) {
    auto parts = SplitAxis(*ops, x, axis);
    ASSERT_TRUE(parts.ok()) << parts.status();
    ASSERT_EQ(static_cast<int64_t>(parts->size()), x.dim(axis));
    // parts[i] holds x[..., i, ...].
    const std::vector<float> xs = Values(x);
    const std::vector<float> last = Values(parts->back());
    Shape strides = {60, 20, 5, 1};
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < 2; ++i0)
      for (int64_t i1 = 0; i1 < 3; ++i1)
        for (int64_t i2 = 0; i2 < 4; ++i2)
          for (int64_t i3 = 0; i3 < 5; ++i3) {
            const int64_t idx[4] = {i0, i1, i2, i3};
            if (idx[axis] != x.dim(axis) - 1) continue;
            EXPECT_EQ(last[n++], xs[i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3]);
          }
    auto stacked = StackAxis(*ops, *parts, axis);
    ASSERT_TRUE(stacked.ok()) << stacked.status();
    EXPECT_EQ(stacked->shape(), x.shape());
    EXPECT_EQ(Values(*stacked), xs);
  }
}

TEST(ApplyRotaryTest, MatchesTeConsecutivePairsAndInverts) {
  auto ops = NewCpuOps();
  const int64_t b = 2, s = 9, h = 3, d = 8;
  const Tensor x = RandomTensor(*ops, {b, s, h, d}, DType::kF32, 11);
  Tensor y;
  ASSERT_TRUE(ApplyRotary(*ops, x, false, &y).ok());
  const std::vector<float> xs = Values(x);
  const reference::Vec want = reference::Rotary(reference::Vec(xs.begin(), xs.end()), b, s, h, d);
  const std::vector<float> ys = Values(y);
  EXPECT_LT(reference::RelativeError(reference::Vec(ys.begin(), ys.end()), want), kF32Tolerance);
  Tensor back;
  ASSERT_TRUE(ApplyRotary(*ops, y, true, &back).ok());
  const std::vector<float> bs = Values(back);
  EXPECT_LT(reference::RelativeError(reference::Vec(bs.begin(), bs.end()),
                                     reference::Vec(xs.begin(), xs.end())),
            kF32Tolerance);
  // In place (the output handle may be the input's).
  Tensor same = x;
  ASSERT_TRUE(ApplyRotary(*ops, same, false, &same).ok());
  EXPECT_EQ(Values(same), ys);
}

TEST(AttentionForwardTest, RejectsMismatchedShapesAndLengths) {
  auto ops = NewCpuOps();
  AttentionConfig config;
  config.num_heads = 4;
  config.num_gqa_groups = 2;
  config.head_dim = 8;
  const Tensor q = RandomTensor(*ops, {2, 5, 4, 8}, DType::kF32, 1);
  const Tensor kv = RandomTensor(*ops, {2, 6, 2, 8}, DType::kF32, 2);
  const Tensor wrong_heads = RandomTensor(*ops, {2, 6, 3, 8}, DType::kF32, 3);
  const Tensor bf16_kv = RandomTensor(*ops, {2, 6, 2, 8}, DType::kBF16, 4);
  Tensor out;
  EXPECT_TRUE(
      AttentionForward(*ops, config, q, kv, kv, {}, Tensor(), false, 0, &out, nullptr).ok());
  EXPECT_EQ(out.shape(), q.shape());
  auto status =
      AttentionForward(*ops, config, q, wrong_heads, kv, {}, Tensor(), false, 0, &out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("k has shape"), std::string::npos) << status;
  status = AttentionForward(*ops, config, q, kv, bf16_kv, {}, Tensor(), false, 0, &out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);

  config.mask = MaskType::kPadding;
  const Tensor bad_lengths = RandomTensor(*ops, {3}, DType::kF32, 5);
  status = AttentionForward(*ops, config, q, kv, kv, SeqLens{bad_lengths, Tensor()}, Tensor(),
                            false, 0, &out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("q_seqlens"), std::string::npos) << status;
}

// int32 [B] lengths.
Tensor Lengths(Ops& ops, const std::vector<int32_t>& lengths) {
  Tensor t = ops.Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())}).value();
  for (size_t b = 0; b < lengths.size(); ++b) t.data_as<int32_t>()[b] = lengths[b];
  return t;
}

// The packed wrappers against the unpacked ones on qkv's parts (CpuOps runs
// the packed ops' default, which computes exactly that): identical out and
// gradients with padding, causal, dropout and a bias; only qkv is kept.
TEST(AttentionForwardPackedTest, MatchesSplitPartsAndKeepsOnlyQkv) {
  auto ops = NewCpuOps();
  AttentionConfig config;
  config.num_heads = 3;
  config.num_gqa_groups = 3;
  config.head_dim = 4;
  config.mask = MaskType::kPaddingCausal;
  config.scale = 0.5f;
  config.dropout_rate = 0.25f;
  const int64_t b = 2, s = 6;
  const Tensor qkv = RandomTensor(*ops, {b, s, 3, 3, 4}, DType::kF32, 31);
  const Tensor bias = RandomTensor(*ops, {3, s, s}, DType::kF32, 32);
  const SeqLens seqlens{Lengths(*ops, {6, 4}), Lengths(*ops, {5, 6})};

  Tensor packed_out;
  AttentionSaved packed;
  ASSERT_TRUE(AttentionForwardPacked(*ops, config, qkv, seqlens, bias, /*dropout_active=*/true,
                                     99, &packed_out, &packed)
                  .ok());
  auto parts = SplitAxis(*ops, qkv, 2);
  ASSERT_TRUE(parts.ok()) << parts.status();
  Tensor out;
  AttentionSaved split;
  ASSERT_TRUE(AttentionForward(*ops, config, (*parts)[0], (*parts)[1], (*parts)[2], seqlens, bias,
                               true, 99, &out, &split)
                  .ok());
  EXPECT_EQ(packed_out.shape(), (Shape{b, s, 3, 4}));
  EXPECT_EQ(Values(packed_out), Values(out));
  EXPECT_TRUE(packed.packed());
  EXPECT_FALSE(split.packed());
  EXPECT_FALSE(packed.q.defined() || packed.k.defined() || packed.v.defined());
  EXPECT_EQ(packed.qkv.data(), qkv.data());  // kept as is, not copied
  EXPECT_EQ(packed.bytes(), split.bytes());

  const Tensor dout = RandomTensor(*ops, {b, s, 3, 4}, DType::kF32, 33);
  Tensor dqkv, packed_dbias;
  ASSERT_TRUE(AttentionBackwardPacked(*ops, packed, dout, &dqkv, &packed_dbias).ok());
  Tensor dq, dk, dv, dbias;
  ASSERT_TRUE(AttentionBackward(*ops, split, dout, &dq, &dk, &dv, &dbias).ok());
  auto stacked = StackAxis(*ops, {dq, dk, dv}, 2);
  ASSERT_TRUE(stacked.ok()) << stacked.status();
  EXPECT_EQ(dqkv.shape(), qkv.shape());
  EXPECT_EQ(Values(dqkv), Values(*stacked));
  EXPECT_EQ(Values(packed_dbias), Values(dbias));

  // Each saved state goes with its own backward.
  EXPECT_EQ(AttentionBackward(*ops, packed, dout, &dq, &dk, &dv, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AttentionBackwardPacked(*ops, split, dout, &dqkv, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

// A relative bias named by its table (as TransformerLayer passes it: no
// [H, S, S] kept) gives what the made bias gives, in both directions, and the
// backward the table's gradient; its saved state holds no dense bias.
TEST(AttentionForwardPackedTest, ARelativeBiasByItsTableMatchesTheMadeBias) {
  auto ops = NewCpuOps();
  AttentionConfig config;
  config.num_heads = 2;
  config.num_gqa_groups = 2;
  config.head_dim = 4;
  config.mask = MaskType::kCausal;
  config.scale = 0.5f;
  const int64_t b = 2, s = 40, num_buckets = 32;
  const Tensor qkv = RandomTensor(*ops, {b, s, 3, 2, 4}, DType::kF32, 41);
  const Tensor table = RandomTensor(*ops, {2, num_buckets}, DType::kF32, 42);
  RelativeBucketCache cache(/*bidirectional=*/false, num_buckets, 128);
  auto relative = cache.Relative(*ops, s, s);
  ASSERT_TRUE(relative.ok()) << relative.status();
  AttentionBias by_table;
  by_table.relative.table = table;
  by_table.relative.buckets = relative->buckets;
  by_table.relative.uniform_from = relative->uniform_from;
  auto made = RelativeBias(*ops, table, relative->buckets, DType::kF32);
  ASSERT_TRUE(made.ok()) << made.status();

  Tensor out[2];
  AttentionSaved saved[2];
  const AttentionBias biases[2] = {by_table, AttentionBias(*made)};
  for (int n = 0; n < 2; ++n) {
    ASSERT_TRUE(AttentionForwardPacked(*ops, config, qkv, {}, biases[n], false, 0, &out[n],
                                       &saved[n])
                    .ok());
    saved[n].relative = *relative;
    saved[n].relative_num_buckets = num_buckets;
  }
  EXPECT_EQ(Values(out[0]), Values(out[1]));
  EXPECT_FALSE(saved[0].args.bias.defined() && saved[0].args.bias.numel() > 0);
  EXPECT_EQ(saved[0].bytes() + made->nbytes(), saved[1].bytes());

  const Tensor dout = RandomTensor(*ops, {b, s, 2, 4}, DType::kF32, 43);
  Tensor dqkv[2], dtable[2];
  for (int n = 0; n < 2; ++n) {
    ASSERT_TRUE(AttentionBackwardPacked(*ops, saved[n], dout, &dqkv[n], &dtable[n]).ok());
  }
  EXPECT_EQ(dtable[0].shape(), (Shape{2, num_buckets}));
  EXPECT_EQ(Values(dqkv[0]), Values(dqkv[1]));
  EXPECT_EQ(Values(dtable[0]), Values(dtable[1]));
  // Without its gradient asked for, the backward makes the bias itself.
  Tensor no_dbias;
  ASSERT_TRUE(AttentionBackwardPacked(*ops, saved[0], dout, &no_dbias, nullptr).ok());
  EXPECT_EQ(Values(no_dbias), Values(dqkv[1]));
}

TEST(AttentionForwardPackedTest, RejectsBadQkv) {
  auto ops = NewCpuOps();
  AttentionConfig config;
  config.num_heads = 4;
  config.num_gqa_groups = 4;
  config.head_dim = 8;
  Tensor out;
  auto forward = [&](const Tensor& qkv, const AttentionConfig& c) {
    return AttentionForwardPacked(*ops, c, qkv, {}, Tensor(), false, 0, &out, nullptr);
  };
  ASSERT_TRUE(forward(RandomTensor(*ops, {2, 5, 3, 4, 8}, DType::kF32, 1), config).ok());
  for (const Shape& bad : {Shape{2, 5, 2, 4, 8}, Shape{2, 5, 3, 2, 8}, Shape{2, 5, 3, 4, 4},
                           Shape{2, 5, 4, 8}}) {
    const absl::Status status = forward(RandomTensor(*ops, bad, DType::kF32, 2), config);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << ShapeString(bad);
    EXPECT_NE(status.message().find("qkv has shape"), std::string::npos) << status;
  }
  const Tensor fp8 = ops->Allocate(DType::kE4M3, {2, 5, 3, 4, 8}).value();
  absl::Status status = forward(fp8, config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("qkv has dtype"), std::string::npos) << status;
  AttentionConfig gqa = config;
  gqa.num_gqa_groups = 2;
  status = forward(RandomTensor(*ops, {2, 5, 3, 4, 8}, DType::kF32, 3), gqa);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("num_gqa_groups"), std::string::npos) << status;
}

TEST(ValidateAttentionConfigTest, NamesTheField) {
  AttentionConfig config;
  config.num_heads = 6;
  config.num_gqa_groups = 4;
  config.head_dim = 8;
  const absl::Status status = ValidateAttentionConfig(config, "spec.x");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("spec.x.num_gqa_groups"), std::string::npos) << status;
  config.num_gqa_groups = 3;
  EXPECT_TRUE(ValidateAttentionConfig(config, "spec.x").ok());
  config.dropout_rate = 1.0f;
  EXPECT_EQ(ValidateAttentionConfig(config, "spec.x").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
