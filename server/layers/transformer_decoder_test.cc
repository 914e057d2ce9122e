// TE's TransformerLayer with layer_type DECODER on the CPU: TE's parameter
// names and shapes; its forward against a reference composed of the other
// modules on the decoder's own variables (the self-attention block with
// one-directional relative buckets, then TE's cross-attention as
// LayerNormDenseGeneral "query" on h, DenseGeneral "kv" on `encoded`,
// DotProductAttention under the padding mask and DenseGeneral "out", then
// LayerNormMLP, with the residual adds); its gradients (x, `encoded` and
// every parameter) against finite differences; dropout at every site; and
// the inputs and settings a decoder refuses.
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"
#include "server/layers/layer.h"
#include "server/layers/multi_head_attention.h"
#include "server/layers/testing.h"
#include "te/v1/layers.pb.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomizeParams;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;

// Relative error of the forward against the composed reference: float32
// throughout, the same ops in another grouping (residual adds inside the
// projections' GEMMs here, apart in the reference).
constexpr double kF32Tolerance = 1e-5;

constexpr int64_t kBatch = 2, kSeq = 5, kKvSeq = 4, kHidden = 16, kFfn = 24;
constexpr int kHeads = 4;

te::v1::LayerSpec DecoderSpec(int gqa_groups = kHeads) {
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* t = spec.mutable_transformer_layer();
  t->set_hidden_size(kHidden);
  t->set_mlp_hidden_size(kFfn);
  t->set_num_attention_heads(kHeads);
  t->set_num_gqa_groups(gqa_groups);
  t->set_use_bias(true);
  t->set_layer_type(te::v1::DECODER);
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::LayerSpec& spec) {
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

Tensor Lengths(Ops& ops, const std::vector<int32_t>& lengths) {
  Tensor t = *ops.Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())});
  for (size_t i = 0; i < lengths.size(); ++i) t.data_as<int32_t>()[i] = lengths[i];
  return t;
}

// The decoder's inputs: x, encoded, and the encoder_decoder_mask as padding
// lengths (query rows 5 and 4, keys 4 and 3).
LayerInputs DecoderInputs(Ops& ops) {
  LayerInputs in;
  in.x = RandomTensor(ops, {kBatch, kSeq, kHidden}, DType::kF32, 11);
  in.extra = {RandomTensor(ops, {kBatch, kKvSeq, kHidden}, DType::kF32, 12)};
  in.q_seqlens = Lengths(ops, {5, 4});
  in.kv_seqlens = Lengths(ops, {4, 3});
  return in;
}

// The variables under `scope` ("params/<scope>/...") as a standalone
// module's ("params/...").
Variables Sub(const Variables& vars, const std::string& scope) {
  Variables out;
  const std::string prefix = "params/" + scope + "/";
  for (const auto& [name, t] : vars) {
    if (absl::StartsWith(name, prefix)) out["params/" + name.substr(prefix.size())] = t;
  }
  return out;
}

absl::StatusOr<Tensor> Run(Ops& ops, const te::v1::LayerSpec& spec, Variables vars,
                           LayerInputs in) {
  auto layer = CreateLayer(spec);
  if (!layer.ok()) return layer.status();
  LayerOutputs out;
  RETURN_IF_ERROR((*layer)->Forward(ops, &vars, in, ForwardOptions{}, &out, nullptr));
  return out.y;
}

Tensor Add(Ops& ops, const Tensor& a, const Tensor& b) {
  Tensor y;
  EXPECT_TRUE(ResidualAdd(ops, a, b, &y).ok());
  return y;
}

// Part `part` of kv [B, Skv, 2, G*D] as [B, Skv, G, D].
Tensor KvPart(Ops& ops, const Tensor& kv, int part, int groups, int head_dim) {
  const int64_t b = kv.dim(0), s = kv.dim(1), f = static_cast<int64_t>(groups) * head_dim;
  Tensor out = *ops.Allocate(DType::kF32, {b, s, groups, head_dim});
  const float* src = kv.data_as<float>();
  float* dst = out.data_as<float>();
  for (int64_t r = 0; r < b * s; ++r) {
    for (int64_t j = 0; j < f; ++j) dst[r * f + j] = src[(r * 2 + part) * f + j];
  }
  return out;
}

// y of the decoder composed from the other modules on its variables.
Tensor Reference(Ops& ops, int groups, const Variables& vars, const LayerInputs& in) {
  const int head_dim = static_cast<int>(kHidden / kHeads);
  // Self-attention with the decoder's one-directional relative buckets.
  MhaOptions self;
  self.scope = "self_attention";
  self.num_heads = kHeads;
  self.num_gqa_groups = groups;
  self.head_dim = head_dim;
  self.use_bias = true;
  self.mask = MaskType::kCausal;
  const RelativeBucketCache buckets(/*bidirectional=*/false, 32, 128);
  const Tensor bucket_table = *buckets.Buckets(ops, kSeq, kSeq);
  const Tensor& table = vars.at("params/relpos_bias/rel_embedding");
  const Tensor bias = *RelativeBias(ops, table, bucket_table, in.x.dtype());
  Variables self_vars = vars;
  Tensor a;
  EXPECT_TRUE(MhaBlock(self, kHidden)
                  .Forward(ops, &self_vars, in.x, SeqLens(), bias, ForwardOptions{}, &a, nullptr,
                           nullptr)
                  .ok());
  const Tensor h = Add(ops, a, in.x);

  // Cross-attention as TE writes it for inputs_q != inputs_kv.
  te::v1::LayerSpec query;
  query.mutable_layer_norm_dense_general()->add_features(kHidden);
  query.mutable_layer_norm_dense_general()->set_use_bias(true);
  LayerInputs q_in;
  q_in.x = h;
  const Tensor q = *Run(ops, query, Sub(vars, "encoder_decoder_attention/query"), q_in);
  te::v1::LayerSpec kv;
  kv.mutable_dense_general()->add_features(2);
  kv.mutable_dense_general()->add_features(static_cast<int64_t>(groups) * head_dim);
  LayerInputs kv_in;
  kv_in.x = in.extra[0];
  const Tensor kv_out = *Run(ops, kv, Sub(vars, "encoder_decoder_attention/kv"), kv_in);
  te::v1::LayerSpec dpa;
  dpa.mutable_dot_product_attention()->set_head_dim(head_dim);
  dpa.mutable_dot_product_attention()->set_num_attention_heads(kHeads);
  dpa.mutable_dot_product_attention()->set_num_gqa_groups(groups);
  dpa.mutable_dot_product_attention()->set_attn_mask_type(te::v1::PADDING);
  dpa.mutable_dot_product_attention()->set_scale_factor(1.0f);  // scale_attn_logits false
  LayerInputs attn_in;
  attn_in.x = q.Reshaped({kBatch, kSeq, kHeads, head_dim});
  attn_in.extra = {KvPart(ops, kv_out, 0, groups, head_dim), KvPart(ops, kv_out, 1, groups, head_dim)};
  attn_in.q_seqlens = in.q_seqlens;
  attn_in.kv_seqlens = in.kv_seqlens;
  const Tensor context = *Run(ops, dpa, {}, attn_in);
  te::v1::LayerSpec out;
  out.mutable_dense_general()->add_features(kHidden);
  LayerInputs out_in;
  out_in.x = context.Reshaped({kBatch, kSeq, kHeads * head_dim});
  const Tensor c = *Run(ops, out, Sub(vars, "encoder_decoder_attention/out"), out_in);
  const Tensor g = Add(ops, c, h);

  te::v1::LayerSpec mlp;
  mlp.mutable_layer_norm_mlp()->set_intermediate_dim(kFfn);
  mlp.mutable_layer_norm_mlp()->set_use_bias(true);
  LayerInputs mlp_in;
  mlp_in.x = g;
  const Tensor z = *Run(ops, mlp, Sub(vars, "mlp"), mlp_in);
  return Add(ops, z, g);
}

TEST(TransformerDecoderTest, TeParameterNamesAndShapes) {
  auto layer = Make(DecoderSpec(/*gqa_groups=*/2));
  auto specs = layer->VariableSpecs({kBatch, kSeq, kHidden}, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, Shape> got;
  for (const VariableSpec& s : *specs) got[s.name] = s.shape;
  const std::map<std::string, Shape> cross = {
      {"params/encoder_decoder_attention/query/scale", {kHidden}},
      {"params/encoder_decoder_attention/query/ln_bias", {kHidden}},
      {"params/encoder_decoder_attention/query/kernel", {kHidden, kHidden}},
      {"params/encoder_decoder_attention/query/bias", {kHidden}},
      {"params/encoder_decoder_attention/kv/kernel", {kHidden, 2, 8}},
      {"params/encoder_decoder_attention/kv/bias", {2, 8}},
      {"params/encoder_decoder_attention/out/kernel", {kHidden, kHidden}},
      {"params/encoder_decoder_attention/out/bias", {kHidden}},
      {"params/self_attention/query/kernel", {kHidden, kHidden}},
      {"params/self_attention/kv/kernel", {kHidden, 2, 8}},
      {"params/self_attention/out/kernel", {kHidden, kHidden}},
      {"params/mlp/wi_kernel", {kHidden, 1, kFfn}},
      {"params/relpos_bias/rel_embedding", {kHeads, 32}},
  };
  for (const auto& [name, shape] : cross) {
    ASSERT_EQ(got.count(name), 1u) << name;
    EXPECT_EQ(got.at(name), shape) << name;
  }
  for (const auto& [name, shape] : got) {
    EXPECT_FALSE(absl::StartsWith(name, "params/attention/")) << name << ": an encoder's scope";
  }
  // Without GQA the self-attention keeps its fused qkv; the cross-attention
  // still projects q and kv apart, as TE does for inputs_q != inputs_kv.
  auto mha = Make(DecoderSpec());
  auto mha_specs = mha->VariableSpecs({kBatch, kSeq, kHidden}, nullptr);
  ASSERT_TRUE(mha_specs.ok());
  std::set<std::string> names;
  for (const VariableSpec& s : *mha_specs) names.insert(s.name);
  EXPECT_EQ(names.count("params/self_attention/qkv/kernel"), 1u);
  EXPECT_EQ(names.count("params/encoder_decoder_attention/kv/kernel"), 1u);
  EXPECT_EQ(names.count("params/encoder_decoder_attention/qkv/kernel"), 0u);
}

class TransformerDecoderParityTest : public ::testing::TestWithParam<int> {};

TEST_P(TransformerDecoderParityTest, ForwardMatchesTheComposedModules) {
  const int groups = GetParam();
  auto ops = NewCpuOps();
  auto layer = Make(DecoderSpec(groups));
  auto vars = InitLayer(*ops, *layer, {kBatch, kSeq, kHidden}, nullptr, 3);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 40);
  const LayerInputs in = DecoderInputs(*ops);
  LayerOutputs out;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, ForwardOptions{}, &out, nullptr).ok());
  const Tensor want = Reference(*ops, groups, *vars, in);
  EXPECT_LT(RelativeError(Values(out.y), Values(want)), kF32Tolerance);
}

INSTANTIATE_TEST_SUITE_P(Groups, TransformerDecoderParityTest, ::testing::Values(kHeads, 2));

TEST(TransformerDecoderTest, GradientsMatchFiniteDifferences) {
  for (int groups : {kHeads, 1}) {
    SCOPED_TRACE(groups);
    auto ops = NewCpuOps();
    auto layer = Make(DecoderSpec(groups));
    auto vars = InitLayer(*ops, *layer, {kBatch, kSeq, kHidden}, nullptr, 5);
    ASSERT_TRUE(vars.ok()) << vars.status();
    RandomizeParams(*ops, &*vars, 50);
    EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, DecoderInputs(*ops), ForwardOptions{}));
  }
}

// Every dropout site on (the attentions', the three hidden dropouts, the
// MLP's): the gradients are those of the masks drawn, and the sites differ.
TEST(TransformerDecoderTest, GradientsWithEveryDropoutOn) {
  te::v1::LayerSpec spec = DecoderSpec();
  te::v1::TransformerLayer* t = spec.mutable_transformer_layer();
  t->set_hidden_dropout(0.2f);
  t->set_attention_dropout(0.2f);
  t->set_intermediate_dropout(0.2f);
  t->set_enable_rotary_pos_emb(true);
  auto layer = Make(spec);
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, *layer, {kBatch, kSeq, kHidden}, nullptr, 7);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 70);
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 9;
  EXPECT_TRUE(CheckGradients(*ops, *layer, &*vars, DecoderInputs(*ops), opts));
  LayerOutputs on, off;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, DecoderInputs(*ops), opts, &on, nullptr).ok());
  ASSERT_TRUE(
      layer->Forward(*ops, &*vars, DecoderInputs(*ops), ForwardOptions{}, &off, nullptr).ok());
  EXPECT_GT(RelativeError(Values(on.y), Values(off.y)), 1e-3);
}

// The mask reaches the cross-attention: keys past a row's length change
// nothing, and without the mask they do.
TEST(TransformerDecoderTest, EncoderDecoderMaskHidesPaddedKeys) {
  auto ops = NewCpuOps();
  auto layer = Make(DecoderSpec());
  auto vars = InitLayer(*ops, *layer, {kBatch, kSeq, kHidden}, nullptr, 8);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 80);
  LayerInputs in = DecoderInputs(*ops);
  LayerOutputs before, after, unmasked_before, unmasked_after;
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, ForwardOptions{}, &before, nullptr).ok());
  LayerInputs unmasked = in;
  unmasked.q_seqlens = unmasked.kv_seqlens = Tensor();
  ASSERT_TRUE(
      layer->Forward(*ops, &*vars, unmasked, ForwardOptions{}, &unmasked_before, nullptr).ok());
  // Row 1 has 3 keys: change its 4th.
  Tensor encoded = RandomTensor(*ops, {kBatch, kKvSeq, kHidden}, DType::kF32, 12);
  std::vector<float> e = Values(encoded);
  for (int64_t j = 0; j < kHidden; ++j) e[(1 * kKvSeq + 3) * kHidden + j] += 1.0f;
  testing::SetValues(e, &encoded);
  in.extra = {encoded};
  unmasked.extra = {encoded};
  ASSERT_TRUE(layer->Forward(*ops, &*vars, in, ForwardOptions{}, &after, nullptr).ok());
  ASSERT_TRUE(
      layer->Forward(*ops, &*vars, unmasked, ForwardOptions{}, &unmasked_after, nullptr).ok());
  EXPECT_EQ(Values(before.y), Values(after.y));
  EXPECT_NE(Values(unmasked_before.y), Values(unmasked_after.y));
}

TEST(TransformerDecoderTest, RefusesWhatTeRefuses) {
  auto ops = NewCpuOps();
  auto layer = Make(DecoderSpec());
  auto vars = InitLayer(*ops, *layer, {kBatch, kSeq, kHidden}, nullptr, 9);
  ASSERT_TRUE(vars.ok());
  LayerOutputs out;
  LayerInputs no_encoded = DecoderInputs(*ops);
  no_encoded.extra.clear();
  absl::Status s = layer->Forward(*ops, &*vars, no_encoded, ForwardOptions{}, &out, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("encoded"), std::string::npos) << s;
  LayerInputs wrong = DecoderInputs(*ops);
  wrong.extra = {RandomTensor(*ops, {kBatch, kKvSeq, kHidden + 1}, DType::kF32, 3)};
  s = layer->Forward(*ops, &*vars, wrong, ForwardOptions{}, &out, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("extra_inputs[0] (encoded)"), std::string::npos) << s;

  // An encoder takes no `encoded`.
  te::v1::LayerSpec encoder = DecoderSpec();
  encoder.mutable_transformer_layer()->set_layer_type(te::v1::ENCODER);
  auto enc = Make(encoder);
  auto enc_vars = InitLayer(*ops, *enc, {kBatch, kSeq, kHidden}, nullptr, 9);
  ASSERT_TRUE(enc_vars.ok());
  s = enc->Forward(*ops, &*enc_vars, DecoderInputs(*ops), ForwardOptions{}, &out, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);

  // A decoder's one mask is the encoder_decoder_mask: its self-attention
  // takes causal or no_mask.
  te::v1::LayerSpec padded = DecoderSpec();
  padded.mutable_transformer_layer()->set_self_attn_mask_type(te::v1::PADDING_CAUSAL);
  auto refused = CreateLayer(padded);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("self_attn_mask_type"), std::string::npos);
  padded.mutable_transformer_layer()->set_self_attn_mask_type(te::v1::NO_MASK);
  EXPECT_TRUE(CreateLayer(padded).ok());

  te::v1::LayerSpec unknown = DecoderSpec();
  unknown.mutable_transformer_layer()->set_layer_type(static_cast<te::v1::TransformerLayerType>(7));
  auto bad = CreateLayer(unknown);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("spec.transformer_layer.layer_type"), std::string::npos);
}

}  // namespace
}  // namespace te::layers
