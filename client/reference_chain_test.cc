// The reference chain's host glue without a server: a reshape and a split
// and their backwards invert each other, and a tensor that does not fit is
// INVALID_ARGUMENT.
#include "client/reference_chain.h"

#include "gtest/gtest.h"

namespace te::client {
namespace {

TEST(ReferenceChainGlueTest, QkvSplitAndItsBackward) {
  // [B, S, 3 * heads * D] -> [B, S, heads, 3D] -> q, k, v [B, S, heads, D].
  const HostStep reshape = ReshapeTrailing({24}, {4, 6});
  const HostStep split = SplitLastAxisStep(3);
  const HostTensor qkv = HostTensor::RandomNormal({2, 3, 24}, DType::kBF16, 7);
  absl::StatusOr<Tensors> viewed = reshape.forward({qkv});
  ASSERT_TRUE(viewed.ok());
  absl::StatusOr<Tensors> q_k_v = split.forward(*viewed);
  ASSERT_TRUE(q_k_v.ok());
  ASSERT_EQ(q_k_v->size(), 3u);
  EXPECT_EQ((*q_k_v)[0].shape(), (Shape{2, 3, 4, 2}));

  // The backward maps gradients the other way, to the input's layout.
  absl::StatusOr<Tensors> joined = split.backward(*q_k_v);
  ASSERT_TRUE(joined.ok());
  absl::StatusOr<Tensors> dqkv = reshape.backward(*joined);
  ASSERT_TRUE(dqkv.ok());
  EXPECT_EQ((*dqkv)[0].shape(), qkv.shape());
  EXPECT_EQ((*dqkv)[0].bytes(), qkv.bytes());

  EXPECT_EQ(reshape.forward({HostTensor::RandomNormal({2, 3, 25}, DType::kBF16, 1)}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(split.backward({qkv}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::client
