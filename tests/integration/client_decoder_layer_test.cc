// TE's decoder layer (TransformerLayer layer_type "decoder") through the C++
// client against the real te_server (CPU, float32): `encoded` travels as
// extra_inputs[0] and the encoder_decoder_mask as attention_mask; a masked
// key of `encoded` changes nothing in y and gets an exactly zero gradient,
// an unmasked one changes y; a decoder without `encoded` is INVALID_ARGUMENT
// naming it. And the matmul-precision guard reaches the requests: on the CPU
// (exact float32 either way) both precisions give the same y.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/modules.h"
#include "client/recipe.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

constexpr int64_t kB = 2, kSeq = 5, kKvSeq = 4, kHidden = 16;
constexpr int64_t kKeys[kB] = {4, 2};  // each batch row's visible keys of `encoded`

class ClientDecoderLayerTest : public testing::ClientSessionTest {
 protected:
  void SetUp() override {
    testing::ClientSessionTest::SetUp();
    if (HasFatalFailure()) return;
    layer_.hidden_size = kHidden;
    layer_.mlp_hidden_size = 24;
    layer_.num_attention_heads = 4;
    layer_.layer_type = "decoder";
    x_ = HostTensor::RandomNormal({kB, kSeq, kHidden}, DType::kF32, 1);
    encoded_ = HostTensor::RandomNormal({kB, kKvSeq, kHidden}, DType::kF32, 2);
    absl::StatusOr<Variables> vars = layer_.Init(*session_, 3, x_);
    ASSERT_TRUE(vars.ok()) << vars.status();
    vars_ = *vars;
  }

  // TE's encoder_decoder_mask [B, 1, Sq, Skv]: true where key j is past row b's keys.
  static HostTensor CrossMask() {
    std::string bytes(static_cast<size_t>(kB * kSeq * kKvSeq), 0);
    for (int64_t b = 0; b < kB; ++b) {
      for (int64_t i = 0; i < kSeq; ++i) {
        for (int64_t j = 0; j < kKvSeq; ++j) bytes[(b * kSeq + i) * kKvSeq + j] = j >= kKeys[b];
      }
    }
    return HostTensor::FromBytes(DType::kBool, {kB, 1, kSeq, kKvSeq}, bytes).value();
  }

  ApplyOptions Options(const HostTensor& encoded, bool masked = true) const {
    ApplyOptions options;
    options.extra_inputs = {encoded};
    if (masked) options.attention_mask = CrossMask();
    return options;
  }

  // `encoded` with key `j` of batch row `b` moved.
  HostTensor Moved(int64_t b, int64_t j) const {
    std::vector<float> v = encoded_.ToFloats();
    for (int64_t f = 0; f < kHidden; ++f) v[(b * kKvSeq + j) * kHidden + f] += 1.0f;
    return HostTensor::FromFloats({kB, kKvSeq, kHidden}, v).value();
  }

  TransformerLayer layer_;
  Variables vars_;
  HostTensor x_, encoded_;
};


TEST_F(ClientDecoderLayerTest, TheMaskHidesPaddedKeysOfEncoded) {
  absl::StatusOr<HostTensor> y = layer_.Apply(vars_, x_, Options(encoded_));
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape(), (Shape{kB, kSeq, kHidden}));
  // Row 1 sees 2 keys: its 4th is masked, its 1st is not.
  absl::StatusOr<HostTensor> masked_moved = layer_.Apply(vars_, x_, Options(Moved(1, 3)));
  ASSERT_TRUE(masked_moved.ok()) << masked_moved.status();
  EXPECT_EQ(masked_moved->ToFloats(), y->ToFloats());
  absl::StatusOr<HostTensor> visible_moved = layer_.Apply(vars_, x_, Options(Moved(1, 0)));
  ASSERT_TRUE(visible_moved.ok()) << visible_moved.status();
  EXPECT_NE(visible_moved->ToFloats(), y->ToFloats());
  // Without the mask the 4th key counts.
  absl::StatusOr<HostTensor> unmasked = layer_.Apply(vars_, x_, Options(encoded_, false));
  absl::StatusOr<HostTensor> unmasked_moved = layer_.Apply(vars_, x_, Options(Moved(1, 3), false));
  ASSERT_TRUE(unmasked.ok() && unmasked_moved.ok());
  EXPECT_NE(unmasked->ToFloats(), unmasked_moved->ToFloats());
}

TEST_F(ClientDecoderLayerTest, BackwardGivesEncodedItsGradient) {
  absl::StatusOr<ForwardResult> forward =
      layer_.Forward(vars_, x_, Options(encoded_), /*keep_for_backward=*/true);
  ASSERT_TRUE(forward.ok()) << forward.status();
  const HostTensor dy = HostTensor::RandomNormal({kB, kSeq, kHidden}, DType::kF32, 4);
  absl::StatusOr<BackwardResult> grads = Backward(*session_, forward->forward_id, dy);
  ASSERT_TRUE(grads.ok()) << grads.status();
  ASSERT_EQ(grads->extra_input_grads.size(), 1u);
  const HostTensor& dencoded = grads->extra_input_grads[0];
  ASSERT_EQ(dencoded.shape(), (Shape{kB, kKvSeq, kHidden}));
  const std::vector<float> d = dencoded.ToFloats();
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t j = 0; j < kKvSeq; ++j) {
      double norm = 0.0;
      for (int64_t f = 0; f < kHidden; ++f) norm += std::abs(d[(b * kKvSeq + j) * kHidden + f]);
      if (j < kKeys[b]) {
        EXPECT_GT(norm, 0.0) << "row " << b << " key " << j;
      } else {
        EXPECT_EQ(norm, 0.0) << "row " << b << " masked key " << j;
      }
    }
  }
  EXPECT_EQ(grads->grads.count("params/encoder_decoder_attention/kv/kernel"), 1u);
}

TEST_F(ClientDecoderLayerTest, ADecoderNeedsEncoded) {
  absl::StatusOr<HostTensor> y = layer_.Apply(vars_, x_);
  ASSERT_FALSE(y.ok());
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(y.status().message().find("encoded"), std::string::npos) << y.status();
}

TEST_F(ClientDecoderLayerTest, MatmulPrecisionGuardReachesTheServer) {
  absl::StatusOr<HostTensor> at_default = layer_.Apply(vars_, x_, Options(encoded_));
  ASSERT_TRUE(at_default.ok()) << at_default.status();
  {
    DefaultMatmulPrecision highest(MatmulPrecision::kHighest);
    EXPECT_EQ(DefaultMatmulPrecision::Current(), MatmulPrecision::kHighest);
    absl::StatusOr<HostTensor> at_highest = layer_.Apply(vars_, x_, Options(encoded_));
    ASSERT_TRUE(at_highest.ok()) << at_highest.status();
    EXPECT_EQ(at_highest->ToFloats(), at_default->ToFloats());  // the CPU is exact either way
  }
  EXPECT_EQ(DefaultMatmulPrecision::Current(), MatmulPrecision::kDefault);
}

}  // namespace
}  // namespace te::client
