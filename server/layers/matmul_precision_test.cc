// The call's matmul precision (ForwardOptions::tf32, the request's
// jax.default_matmul_precision) reaches every float32 GEMM of every module,
// forward and backward: the CPU reference, recording each Gemm's TF32 flag,
// sees every float32 GEMM of a TE module (DenseGeneral, LayerNormDenseGeneral,
// LayerNormMLP, MultiHeadAttention, TransformerLayer) and of a Flax module at
// precision DEFAULT ask for TensorFloat-32 exactly when the call does, a Flax
// module at precision HIGHEST never, and no FP8 or bfloat16 GEMM ever. (The
// CPU computes exact float32 whatever the flag; the GPU tests check the
// numbers.)
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"
#include "te/v1/layers.pb.h"

namespace te::layers {
namespace {

using testing::RandomTensor;

// The CPU reference, recording the TF32 flag of each GEMM by operand dtype.
class RecordingOps : public CpuOps {
 public:
  absl::Status Gemm(const GemmArgs& args, Tensor* out) override {
    (args.a.dtype() == DType::kF32 ? f32_flags : other_flags).push_back(args.tf32);
    return CpuOps::Gemm(args, out);
  }
  void Clear() {
    f32_flags.clear();
    other_flags.clear();
  }
  std::vector<bool> f32_flags;    // float32 operands
  std::vector<bool> other_flags;  // bfloat16, FP8
};

constexpr int64_t kBatch = 2, kSeq = 4, kHidden = 16;

struct Case {
  std::string name;
  te::v1::LayerSpec spec;
  // The module's own precision is HIGHEST: exact whatever the call's.
  bool highest = false;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  te::v1::LayerSpec s;
  s.mutable_dense_general()->add_features(24);
  s.mutable_dense_general()->set_use_bias(true);
  cases.push_back({"DenseGeneral", s});
  s.Clear();
  s.mutable_layer_norm_dense_general()->add_features(24);
  cases.push_back({"LayerNormDenseGeneral", s});
  s.Clear();
  s.mutable_layer_norm_mlp()->set_intermediate_dim(32);
  s.mutable_layer_norm_mlp()->add_activations("gelu");  // the fused-GELU GEMM
  cases.push_back({"LayerNormMLP_gelu", s});
  s.Clear();
  s.mutable_layer_norm_mlp()->set_intermediate_dim(32);
  s.mutable_layer_norm_mlp()->add_activations("silu");
  s.mutable_layer_norm_mlp()->add_activations("linear");
  cases.push_back({"LayerNormMLP_swiglu", s});
  s.Clear();
  te::v1::MultiHeadAttention* mha = s.mutable_multi_head_attention();
  mha->set_head_dim(4);
  mha->set_num_attention_heads(4);
  cases.push_back({"MultiHeadAttention", s});
  mha->set_num_gqa_groups(2);  // query and kv projections apart
  cases.push_back({"MultiHeadAttention_gqa", s});
  s.Clear();
  te::v1::TransformerLayer* tl = s.mutable_transformer_layer();
  tl->set_hidden_size(kHidden);
  tl->set_mlp_hidden_size(32);
  tl->set_num_attention_heads(4);
  cases.push_back({"TransformerLayer", s});
  tl->set_hidden_dropout(0.0f);  // the residual adds fused into the GEMMs
  tl->set_attention_dropout(0.0f);
  cases.push_back({"TransformerLayer_fused_residual", s});
  tl->set_layer_type(te::v1::DECODER);  // the cross-attention's GEMMs too
  cases.push_back({"TransformerLayer_decoder", s});
  s.Clear();
  s.mutable_flax_dense()->set_features(24);
  cases.push_back({"FlaxDense_default", s});
  s.mutable_flax_dense()->set_precision(te::v1::PRECISION_HIGHEST);
  cases.push_back({"FlaxDense_highest", s, /*highest=*/true});
  s.Clear();
  s.mutable_flax_multi_head_dot_product_attention()->set_num_heads(4);
  cases.push_back({"FlaxMultiHeadDotProductAttention_default", s});
  s.mutable_flax_multi_head_dot_product_attention()->set_precision(te::v1::PRECISION_HIGHEST);
  cases.push_back({"FlaxMultiHeadDotProductAttention_highest", s, /*highest=*/true});
  return cases;
}

// The extra inputs a case's forward takes (a DECODER's `encoded`).
std::vector<Tensor> ExtraInputs(Ops& ops, const te::v1::LayerSpec& spec) {
  if (spec.has_transformer_layer() && spec.transformer_layer().layer_type() == te::v1::DECODER) {
    return {RandomTensor(ops, {kBatch, kSeq + 2, kHidden}, DType::kF32, 5)};
  }
  return {};
}

class MatmulPrecisionTest : public ::testing::TestWithParam<Case> {};

TEST_P(MatmulPrecisionTest, Float32GemmsFollowTheCallsPrecision) {
  const Case& c = GetParam();
  RecordingOps ops;
  auto layer = CreateLayer(c.spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Shape shape = {kBatch, kSeq, kHidden};
  auto vars = testing::InitLayer(ops, **layer, shape, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  for (bool tf32 : {true, false}) {
    SCOPED_TRACE(tf32 ? "call at DEFAULT" : "call at HIGHEST");
    LayerInputs in;
    in.x = RandomTensor(ops, shape, DType::kF32, 1);
    in.extra = ExtraInputs(ops, c.spec);
    ForwardOptions opts;
    opts.keep_for_backward = true;
    opts.tf32 = tf32;
    ops.Clear();
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE((*layer)->Forward(ops, &*vars, in, opts, &out, &saved).ok());
    const size_t forward_gemms = ops.f32_flags.size();
    ASSERT_GT(forward_gemms, 0u);
    // The backward runs at its forward's precision.
    LayerGrads grads;
    const Tensor dy = RandomTensor(ops, out.y.shape(), out.y.dtype(), 2);
    ASSERT_TRUE((*layer)->Backward(ops, &*vars, *saved, dy, &grads).ok());
    ASSERT_GT(ops.f32_flags.size(), forward_gemms);
    const bool want = tf32 && !c.highest;
    for (size_t i = 0; i < ops.f32_flags.size(); ++i) {
      EXPECT_EQ(ops.f32_flags[i], want) << "float32 GEMM " << i << " ("
                                        << (i < forward_gemms ? "forward" : "backward") << ")";
    }
    EXPECT_TRUE(ops.other_flags.empty());
  }
}

INSTANTIATE_TEST_SUITE_P(Modules, MatmulPrecisionTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// FP8 GEMMs (DelayedScaling) and bfloat16 GEMMs never ask for TF32, whatever
// the call's precision: it is a float32 matter.
TEST(MatmulPrecisionTest, Fp8AndBf16GemmsNeverAskForTf32) {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm_mlp()->set_intermediate_dim(32);
  spec.mutable_layer_norm_mlp()->add_activations("gelu");
  auto layer = CreateLayer(spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Fp8Recipe fp8 = testing::DelayedRecipe(4);
  for (const Fp8Recipe* recipe : {static_cast<const Fp8Recipe*>(nullptr), &fp8}) {
    RecordingOps ops;
    const Shape shape = {kBatch, kSeq, kHidden};
    auto vars = testing::InitLayer(ops, **layer, shape, &fp8);
    ASSERT_TRUE(vars.ok()) << vars.status();
    LayerInputs in;
    in.x = RandomTensor(ops, shape, DType::kBF16, 1);
    ForwardOptions opts;
    opts.keep_for_backward = true;
    opts.tf32 = true;
    opts.fp8 = recipe;
    ops.Clear();
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE((*layer)->Forward(ops, &*vars, in, opts, &out, &saved).ok());
    LayerGrads grads;
    const Tensor dy = RandomTensor(ops, out.y.shape(), out.y.dtype(), 2);
    ASSERT_TRUE((*layer)->Backward(ops, &*vars, *saved, dy, &grads).ok());
    EXPECT_TRUE(ops.f32_flags.empty());
    ASSERT_FALSE(ops.other_flags.empty());
    for (bool flag : ops.other_flags) EXPECT_FALSE(flag);
  }
}

TEST(MatmulTf32Test, DefaultIsTf32HighestIsExactAnythingElseIsRefused) {
  EXPECT_EQ(*MatmulTf32(te::v1::PRECISION_DEFAULT, "matmul_precision"), true);
  EXPECT_EQ(*MatmulTf32(te::v1::PRECISION_HIGHEST, "matmul_precision"), false);
  const absl::StatusOr<bool> bad = MatmulTf32(static_cast<te::v1::Precision>(7), "matmul_precision");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("matmul_precision: 7"), std::string::npos)
      << bad.status();
}

// A Flax module's precision outside DEFAULT and HIGHEST fails at creation,
// naming the field.
TEST(MatmulTf32Test, UnknownFlaxPrecisionIsRefused) {
  te::v1::LayerSpec spec;
  spec.mutable_flax_dense()->set_features(4);
  spec.mutable_flax_dense()->set_precision(static_cast<te::v1::Precision>(3));
  auto layer = CreateLayer(spec);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(layer.status().message().find("spec.flax_dense.precision"), std::string::npos)
      << layer.status();
}

}  // namespace
}  // namespace te::layers
