// Attention masks over real gRPC: every mask TE's Flax modules accept is
// accepted, with TE's meaning for each mask type (transformer_engine/jax/
// flax/transformer.py, _UnfusedDotProductAttention.convert_to_softmax_type:
// the mask is ignored for no_mask and causal and applied as given for the
// padding types; padding_causal is padding and causality together, as TE's
// fused path applies it), in the dtypes TE's tests use (uint8 0/1, sent as
// bool or int32 here: the wire has no uint8), 1 = masked out.
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/test_util.h"

namespace te::testing {
namespace {

constexpr int64_t kB = 2, kS = 8, kHidden = 32;

class AttentionMaskTest : public ServerSuite {
 protected:
  std::string Init(te::v1::AttnMaskType type) {
    te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
    te::v1::TransformerLayer* layer = request.mutable_spec()->mutable_transformer_layer();
    layer->set_hidden_size(kHidden);
    layer->set_mlp_hidden_size(2 * kHidden);
    layer->set_num_attention_heads(4);
    layer->set_self_attn_mask_type(type);
    request.set_seed(42);
    request.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : {kB, kS, kHidden}) request.add_input_shape(d);
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, request, &response);
    EXPECT_TRUE(status.ok()) << "InitLayer: " << Describe(status);
    return response.layer_id();
  }

  // y of the layer for the suite's x, with `mask` when given.
  grpc::Status Forward(const std::string& layer_id, const te::v1::Tensor* mask,
                       std::vector<float>* y) {
    te::v1::ForwardRequest request = WithSession(te::v1::ForwardRequest());
    request.set_layer_id(layer_id);
    request.set_deterministic(true);
    *request.mutable_x() = MakeTensor(te::v1::FLOAT32, {kB, kS, kHidden},
                                      RandomFloats(kB * kS * kHidden, 70));
    if (mask != nullptr) *request.mutable_attention_mask() = *mask;
    grpc::ClientContext context;
    te::v1::ForwardResponse response;
    const grpc::Status status = stub_->Forward(&context, request, &response);
    if (status.ok()) *y = ToFloats(response.y());
    return status;
  }

  std::vector<float> MustForward(const std::string& layer_id, const te::v1::Tensor* mask) {
    std::vector<float> y;
    const grpc::Status status = Forward(layer_id, mask, &y);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return y;
  }
};

// [B, 1, S, S] from `masked(b, i, j)`, as bool or int32.
template <typename F>
te::v1::Tensor Mask(F masked, te::v1::DType dtype = te::v1::BOOL, int64_t batch = kB) {
  te::v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : {batch, int64_t{1}, kS, kS}) t.add_shape(d);
  std::string bytes;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < kS; ++i) {
      for (int64_t j = 0; j < kS; ++j) {
        const int32_t v = masked(b, i, j) ? 1 : 0;
        if (dtype == te::v1::BOOL) {
          bytes.push_back(static_cast<char>(v));
        } else {
          bytes.append(reinterpret_cast<const char*>(&v), sizeof(v));
        }
      }
    }
  }
  t.set_inline_data(bytes);
  return t;
}

bool Triu(int64_t, int64_t i, int64_t j) { return j > i; }
bool Padded(int64_t b, int64_t i, int64_t j) { return b == 1 && (i >= 5 || j >= 5); }
// An arbitrary pattern: no padding, no triangle, holes anywhere.
bool Holes(int64_t b, int64_t i, int64_t j) { return j != 0 && (b * 7 + i * 3 + j * 5) % 4 == 0; }

// TE's tests hand a causal layer jnp.triu(ones, k=1) (tests/jax/test_layer.py,
// EncoderRunner.generate_inputs); TE ignores it. The server refused it once.
TEST_F(AttentionMaskTest, CausalTriangleToACausalLayerIsIgnored) {
  const std::string id = Init(te::v1::CAUSAL);
  const te::v1::Tensor triu = Mask(Triu);
  EXPECT_LT(RelativeError(MustForward(id, &triu), MustForward(id, nullptr)), kF32Tolerance);
  const te::v1::Tensor holes = Mask(Holes, te::v1::INT32);
  EXPECT_LT(RelativeError(MustForward(id, &holes), MustForward(id, nullptr)), kF32Tolerance);
}

TEST_F(AttentionMaskTest, AnyMaskToANoMaskLayerIsIgnored) {
  const std::string id = Init(te::v1::NO_MASK);
  const te::v1::Tensor holes = Mask(Holes);
  EXPECT_LT(RelativeError(MustForward(id, &holes), MustForward(id, nullptr)), kF32Tolerance);
}

// padding_causal = padding and causality: a padding mask means the same as
// that padding mask with the triangle in it (TE's tests' form).
TEST_F(AttentionMaskTest, PaddingMaskToPaddingCausalEqualsPaddingWithTheTriangle) {
  const std::string id = Init(te::v1::PADDING_CAUSAL);
  const te::v1::Tensor pad = Mask(Padded);
  const te::v1::Tensor both =
      Mask([](int64_t b, int64_t i, int64_t j) { return Padded(b, i, j) || Triu(b, i, j); });
  const std::vector<float> y = MustForward(id, &pad);
  EXPECT_LT(RelativeError(MustForward(id, &both), y), kF32Tolerance);
  // And no mask at all is plain causal: batch 0 (unpadded) is the same.
  const std::vector<float> none = MustForward(id, nullptr);
  const size_t half = none.size() / 2;
  EXPECT_LT(RelativeError(std::vector<float>(y.begin(), y.begin() + half),
                          std::vector<float>(none.begin(), none.begin() + half)),
            kF32Tolerance);
}

// padding applies an arbitrary mask elementwise: it changes y, and the
// causal triangle through a padding layer equals a causal layer.
TEST_F(AttentionMaskTest, ArbitraryMaskToAPaddingLayerAppliesElementwise) {
  const std::string padding = Init(te::v1::PADDING);
  const te::v1::Tensor holes = Mask(Holes);
  const std::vector<float> y = MustForward(padding, &holes);
  EXPECT_GT(RelativeError(y, MustForward(padding, nullptr)), 1e-3);
  // int32 and bool masks mean the same; a [1, 1, S, S] mask broadcasts over the batch.
  const te::v1::Tensor holes32 = Mask(Holes, te::v1::INT32);
  EXPECT_EQ(MustForward(padding, &holes32), y);
  const te::v1::Tensor triu_one = Mask(Triu, te::v1::BOOL, /*batch=*/1);
  const std::string causal = Init(te::v1::CAUSAL);  // same seed: the same parameters
  EXPECT_LT(RelativeError(MustForward(padding, &triu_one), MustForward(causal, nullptr)),
            kF32Tolerance);
}

// TE ignores the mask of a causal or no_mask layer before looking at it: a
// mask that broadcasts to nothing is taken (and ignored) there, while a
// padding layer refuses it, and the session is as it was after the refusal.
TEST_F(AttentionMaskTest, AMaskTENeverReadsIsNotChecked) {
  te::v1::Tensor odd = Mask(Holes);
  odd.clear_shape();
  for (int64_t d : {int64_t{3}, kS}) odd.add_shape(d);  // rank 2, not [B, H, Sq, Skv]
  odd.set_inline_data(std::string(3 * kS, 1));
  for (te::v1::AttnMaskType type : {te::v1::CAUSAL, te::v1::NO_MASK}) {
    const std::string id = Init(type);
    EXPECT_EQ(MustForward(id, &odd), MustForward(id, nullptr));
  }
  const std::string padding = Init(te::v1::PADDING);
  const std::vector<float> before = MustForward(padding, nullptr);
  std::vector<float> y;
  const grpc::Status status = Forward(padding, &odd, &y);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("attention_mask.shape"), std::string::npos)
      << Describe(status);
  EXPECT_EQ(MustForward(padding, nullptr), before);
}

// A mask per head ([B, H, S, S], TE broadcasts it against the logits) is
// taken by the layer's attention; its planes differ, so y differs from the
// same layer given head 0's plane for every head.
TEST_F(AttentionMaskTest, APerHeadMaskIsTaken) {
  const std::string id = Init(te::v1::PADDING);
  te::v1::Tensor per_head;
  per_head.set_dtype(te::v1::BOOL);
  for (int64_t d : {kB, int64_t{4}, kS, kS}) per_head.add_shape(d);
  std::string bytes, head0;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 0; i < kS; ++i) {
        for (int64_t j = 0; j < kS; ++j) {
          const char masked = j != 0 && (h * 5 + i * 3 + j * 7) % 3 == 0;
          bytes.push_back(masked);
          if (h == 0) head0.push_back(masked);
        }
      }
    }
  }
  per_head.set_inline_data(bytes);
  te::v1::Tensor shared = Mask(Holes);
  shared.set_inline_data(head0);
  EXPECT_GT(RelativeError(MustForward(id, &per_head), MustForward(id, &shared)), 1e-3);
}

// What TE refuses too is refused: a mask that does not broadcast to the
// logits [B, H, Sq, Skv].
TEST_F(AttentionMaskTest, AMaskOfAnotherShapeIsInvalidArgumentNamingTheField) {
  const std::string id = Init(te::v1::PADDING);
  te::v1::Tensor bad = Mask(Holes);
  bad.clear_shape();
  for (int64_t d : {kB, int64_t{1}, kS, kS / 2}) bad.add_shape(d);
  bad.set_inline_data(std::string(kB * kS * kS / 2, 0));
  std::vector<float> y;
  const grpc::Status status = Forward(id, &bad, &y);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("attention_mask.shape"), std::string::npos)
      << Describe(status);
}

}  // namespace
}  // namespace te::testing
