// Autoregressive decoding with TE's `cache` collection (MultiHeadAttention's
// decode): the cache's names, shapes and initial values as TE makes them,
// TE's refusals and the cache's own errors, and, by construction, that
// decoding a sequence one token at a time gives row for row what one causal
// forward of the whole sequence gives, for every qkv layout (with and
// without GQA, with rotary), one or several sequences, float32, bfloat16
// and FP8 (DelayedScaling). Then generation's steps (internal_decode): a
// prompt at once and chunks of tokens, and the encoder TransformerLayers
// of a causal LM (rotary, T5 relative bias), which TE itself does not
// decode.
#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_layers.h"
#include "server/layers/cache.h"
#include "server/layers/decode_testing.h"
#include "server/layers/multi_head_attention.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::DelayedRecipe;
using testing::HostValues;
using testing::InitLayer;
using testing::MaxDecodeRowError;
using testing::NewCpuOps;
using testing::RandomizeParams;
using testing::RandomTensor;
using testing::TokenAt;

// Tolerances (relative L2 error of one output row, decode against the
// forward's row), stated once. On the CPU reference every case measured 0:
// the step adds the same float32 terms in the same order as the forward's
// row. The bounds say what the construction promises, not what one
// implementation happens to give.
// float32: the decode step computes each row from the same float32 operands
// as the forward; GEMMs over another row count may add in another order.
constexpr double kF32Tolerance = 1e-5;
// bfloat16: both round each stage's output once to bfloat16 (the cache holds
// the same bfloat16 keys and values the forward attends over); where a sum's
// order differs, the roundings may differ by one bfloat16 ulp (2^-8
// relative) in an element, and the next stages carry it on: 2^-7 bounds it.
constexpr double kBf16Tolerance = 1.0 / 128;
// FP8 under DelayedScaling: each GEMM operand is quantized with the scale
// held in fp8_metas, the same for a one-token step as for the whole
// sequence (a forward does not move scales), so the FP8 codes are the ones
// the forward used and the bfloat16 bound holds. (Float8CurrentScaling takes
// its scale from the tensor at hand, one token against the whole sequence:
// decode and forward then differ by FP8's own error, and TE's do too.)
constexpr double kFp8Tolerance = kBf16Tolerance;

constexpr int64_t kHidden = 32;

te::v1::MultiHeadAttention Spec(int heads, int groups, bool rotary) {
  te::v1::MultiHeadAttention spec;
  spec.set_head_dim(8);
  spec.set_num_attention_heads(heads);
  spec.set_num_gqa_groups(groups);
  spec.set_enable_rotary_pos_emb(rotary);
  spec.set_use_bias(true);
  return spec;
}

std::unique_ptr<Layer> Make(const te::v1::MultiHeadAttention& spec) {
  auto layer = MakeMultiHeadAttention(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

// Init(decode=True) as a session does it: the params (and fp8_metas) of
// VariableSpecs, then the cache of CacheSpecs for the full-length x.
absl::StatusOr<Variables> InitForDecode(Ops& ops, const Layer& layer, const Shape& x_shape,
                                        DType dtype, const Fp8Recipe* fp8) {
  ASSIGN_OR_RETURN(Variables vars, InitLayer(ops, layer, x_shape, fp8));
  RandomizeParams(ops, &vars, 7);
  ASSIGN_OR_RETURN(std::vector<VariableSpec> cache, layer.CacheSpecs(x_shape, dtype, false));
  RETURN_IF_ERROR(InitCache(ops, cache, &vars));
  return vars;
}

absl::StatusOr<Tensor> Apply(Ops& ops, const Layer& layer, Variables* vars, const Tensor& x,
                             const ForwardOptions& opts) {
  LayerInputs in;
  in.x = x;
  LayerOutputs out;
  RETURN_IF_ERROR(layer.Forward(ops, vars, in, opts, &out, nullptr));
  return out.y;
}

int32_t CacheIndex(Ops& ops, const Variables& vars, const std::string& name) {
  auto values = HostValues(ops, vars.at(name));
  EXPECT_TRUE(values.ok()) << values.status();
  return values.ok() ? static_cast<int32_t>((*values)[0]) : -1;
}

// ---- the cache collection ---------------------------------------------------

TEST(DecodeCacheTest, NamesShapesAndZerosAsTe) {
  auto ops = NewCpuOps();
  auto layer = Make(Spec(4, 2, /*rotary=*/true));
  auto specs = layer->CacheSpecs({3, 10, kHidden}, DType::kBF16, false);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 3u);
  EXPECT_EQ((*specs)[0].name, "cache/cached_key");
  EXPECT_EQ((*specs)[0].shape, (Shape{3, 10, 2, 8}));  // [B, L, G, D]
  EXPECT_EQ((*specs)[0].dtype, DType::kBF16);           // x's dtype
  EXPECT_EQ((*specs)[1].name, "cache/cached_value");
  EXPECT_EQ((*specs)[1].shape, (Shape{3, 10, 2, 8}));
  EXPECT_EQ((*specs)[2].name, "cache/cache_index");
  EXPECT_EQ((*specs)[2].shape, Shape{});  // jnp.array(0, dtype=jnp.int32)
  EXPECT_EQ((*specs)[2].dtype, DType::kI32);

  Variables vars;
  ASSERT_TRUE(InitCache(*ops, *specs, &vars).ok());
  for (const VariableSpec& spec : *specs) {
    auto values = HostValues(*ops, vars.at(spec.name));
    ASSERT_TRUE(values.ok());
    for (float v : *values) ASSERT_EQ(v, 0.0f) << spec.name;
  }

  // The block inside a TransformerLayer keeps its cache under its scope.
  auto options = MhaOptionsFromSpec(Spec(4, 4, true), "spec");
  ASSERT_TRUE(options.ok());
  options->scope = "attention";
  const std::vector<VariableSpec> scoped = MhaBlock(*options, kHidden).CacheSpecs(2, 6, DType::kF32);
  EXPECT_EQ(scoped[0].name, "cache/attention/cached_key");
  EXPECT_EQ(scoped[0].shape, (Shape{2, 6, 4, 8}));
  EXPECT_EQ(scoped[2].name, "cache/attention/cache_index");
}

TEST(DecodeCacheTest, LayersWithoutACacheRefuseDecode) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(8);
  auto dense = CreateLayer(spec);
  ASSERT_TRUE(dense.ok());
  auto specs = (*dense)->CacheSpecs({2, 4, 8}, DType::kF32, false);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(specs.status().message(), "decode")) << specs.status();
}

// TE: "decode mode requires QKVLayout.BSHD_BSHD_BSHD, but got {qkv_layout}":
// its fused projections keep q, k, v apart only when rotary splits them.
TEST(DecodeCacheTest, TeRefusesDecodeOfFusedQkvLayouts) {
  auto ops = NewCpuOps();
  for (const auto& [groups, layout] :
       std::vector<std::pair<int, std::string>>{{4, "QKVLayout.BS3HD"}, {2, "QKVLayout.BSHD_BS2HD"}}) {
    auto layer = Make(Spec(4, groups, /*rotary=*/false));
    auto specs = layer->CacheSpecs({2, 5, kHidden}, DType::kF32, false);
    EXPECT_EQ(specs.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(specs.status().message(),
                                  "decode mode requires QKVLayout.BSHD_BSHD_BSHD, but got " +
                                      layout))
        << specs.status();
    // A forward with decode says the same, cache or not.
    auto vars = InitLayer(*ops, *layer, {2, 5, kHidden}, nullptr);
    ASSERT_TRUE(vars.ok());
    ForwardOptions opts;
    opts.decode = true;
    auto y = Apply(*ops, *layer, &*vars, RandomTensor(*ops, {2, 1, kHidden}, DType::kF32, 3), opts);
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(y.status().message(), layout)) << y.status();
  }
}

// ---- decode equals the causal forward -----------------------------------------

enum class Precision { kF32, kBF16, kFp8Delayed };

struct DecodeCase {
  int groups;  // 4 = no GQA (heads 4)
  int64_t batch;
  Precision precision;
};

void PrintTo(const DecodeCase& c, std::ostream* os) {
  *os << "groups " << c.groups << " batch " << c.batch << " precision "
      << static_cast<int>(c.precision);
}

std::string CaseName(const ::testing::TestParamInfo<DecodeCase>& info) {
  const DecodeCase& c = info.param;
  const char* precision = c.precision == Precision::kF32    ? "F32"
                          : c.precision == Precision::kBF16 ? "BF16"
                                                            : "Fp8Delayed";
  return absl::StrCat(c.groups == 4 ? "Mha" : "Gqa", "Batch", c.batch, precision);
}

class MultiHeadAttentionDecodeTest : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(MultiHeadAttentionDecodeTest, TokenByTokenEqualsOneCausalForward) {
  const DecodeCase& c = GetParam();
  auto ops = NewCpuOps();
  auto layer = Make(Spec(4, c.groups, /*rotary=*/true));
  const int64_t length = 7;
  const DType dtype = c.precision == Precision::kF32 ? DType::kF32 : DType::kBF16;
  const Fp8Recipe recipe = DelayedRecipe();
  const Fp8Recipe* fp8 = c.precision == Precision::kFp8Delayed ? &recipe : nullptr;
  const Shape x_shape = {c.batch, length, kHidden};
  auto vars = InitForDecode(*ops, *layer, x_shape, dtype, fp8);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Tensor x = RandomTensor(*ops, x_shape, dtype, 11);

  ForwardOptions forward;
  forward.fp8 = fp8;
  ForwardOptions decode = forward;
  decode.decode = true;
  int64_t steps = 0;
  auto error = MaxDecodeRowError(
      *ops, x, [&](const Tensor& all) { return Apply(*ops, *layer, &*vars, all, forward); },
      [&](const Tensor& token) {
        ++steps;
        return Apply(*ops, *layer, &*vars, token, decode);
      });
  ASSERT_TRUE(error.ok()) << error.status();
  const double tolerance = c.precision == Precision::kF32    ? kF32Tolerance
                           : c.precision == Precision::kBF16 ? kBf16Tolerance
                                                             : kFp8Tolerance;
  EXPECT_LE(*error, tolerance);
  EXPECT_EQ(steps, length);
  EXPECT_EQ(CacheIndex(*ops, *vars, "cache/cache_index"), length);
  if (fp8 != nullptr) {
    // The steps ran FP8 GEMMs: they wrote the output projection's x amax.
    auto amax = HostValues(*ops, vars->at("fp8_metas/out/x_amax_history"));
    ASSERT_TRUE(amax.ok());
    EXPECT_GT((*amax)[0], 0.0f);
  }

  // The cache is full: TE would silently write nowhere; here the step is
  // refused, naming the index, and the cache is left as it was.
  auto token = TokenAt(*ops, x, 0);
  ASSERT_TRUE(token.ok());
  auto past = Apply(*ops, *layer, &*vars, *token, decode);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past.status().message(), "cache/cache_index is 7"))
      << past.status();
  EXPECT_EQ(CacheIndex(*ops, *vars, "cache/cache_index"), length);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MultiHeadAttentionDecodeTest,
    ::testing::Values(DecodeCase{4, 1, Precision::kF32}, DecodeCase{4, 3, Precision::kF32},
                      DecodeCase{2, 1, Precision::kF32}, DecodeCase{2, 3, Precision::kF32},
                      DecodeCase{4, 3, Precision::kBF16}, DecodeCase{2, 1, Precision::kBF16},
                      DecodeCase{4, 1, Precision::kFp8Delayed},
                      DecodeCase{2, 3, Precision::kFp8Delayed}),
    CaseName);

// The attention block as generation decodes it: every layout, TE's fused
// BS3HD and BSHD_BS2HD included (generation keeps its caches internally).
struct BlockCase {
  int groups;
  bool rotary;
  int64_t batch;
  te::v1::AttnMaskType mask;
};

void PrintTo(const BlockCase& c, std::ostream* os) {
  *os << "groups " << c.groups << (c.rotary ? " rotary" : "") << " batch " << c.batch << " "
      << te::v1::AttnMaskType_Name(c.mask);
}

std::string BlockCaseName(const ::testing::TestParamInfo<BlockCase>& info) {
  const BlockCase& c = info.param;
  std::string mask = te::v1::AttnMaskType_Name(c.mask);
  mask.erase(std::remove(mask.begin(), mask.end(), '_'), mask.end());
  return absl::StrCat(c.groups == 4 ? "Mha" : "Gqa", c.rotary ? "Rotary" : "", "Batch", c.batch,
                      mask);
}

class MhaBlockDecodeTest : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MhaBlockDecodeTest, TokenByTokenEqualsOneCausalForward) {
  const BlockCase& c = GetParam();
  auto ops = NewCpuOps();
  te::v1::MultiHeadAttention spec = Spec(4, c.groups, c.rotary);
  spec.set_attn_mask_type(c.mask);
  spec.set_layernorm_type(te::v1::RMSNORM);
  auto options = MhaOptionsFromSpec(spec, "spec");
  ASSERT_TRUE(options.ok());
  options->scope = "attention";
  const MhaBlock block(*options, kHidden);
  const int64_t length = 6;
  Variables vars;
  ASSERT_TRUE(block.Init(*ops, 5, nullptr, &vars).ok());
  RandomizeParams(*ops, &vars, 9);
  ASSERT_TRUE(InitCache(*ops, block.CacheSpecs(c.batch, length, DType::kF32), &vars).ok());
  const Tensor x = RandomTensor(*ops, {c.batch, length, kHidden}, DType::kF32, 13);
  const Tensor residual = RandomTensor(*ops, {c.batch, length, kHidden}, DType::kF32, 17);

  ForwardOptions forward;
  ForwardOptions decode;
  decode.decode = true;
  int64_t t = 0;
  auto error = MaxDecodeRowError(
      *ops, x,
      [&](const Tensor& all) -> absl::StatusOr<Tensor> {
        Tensor y;
        RETURN_IF_ERROR(block.Forward(*ops, &vars, all, SeqLens(), Tensor(), forward, &y, nullptr,
                                      nullptr, residual));
        return y;
      },
      [&](const Tensor& token) -> absl::StatusOr<Tensor> {
        // Every other step says where the cache is, as generation's loop does.
        decode.decode_cache_index = t % 2 == 0 ? t : -1;
        ASSIGN_OR_RETURN(const Tensor residual_t, TokenAt(*ops, residual, t));
        ++t;
        Tensor y;
        RETURN_IF_ERROR(
            block.Decode(*ops, &vars, token, SeqLens(), Tensor(), decode, &y, nullptr, residual_t));
        return y;
      });
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_LE(*error, kF32Tolerance);
  EXPECT_EQ(CacheIndex(*ops, vars, "cache/attention/cache_index"), length);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MhaBlockDecodeTest,
    ::testing::Values(BlockCase{4, false, 1, te::v1::CAUSAL},  // BS3HD
                      BlockCase{4, false, 2, te::v1::CAUSAL},
                      BlockCase{2, false, 2, te::v1::CAUSAL},  // BSHD_BS2HD
                      BlockCase{2, true, 2, te::v1::CAUSAL},
                      // With no mask given, the padding types see every
                      // position: their forward is the causal one.
                      BlockCase{4, false, 2, te::v1::PADDING_CAUSAL},
                      BlockCase{2, true, 1, te::v1::CAUSAL_BOTTOM_RIGHT},
                      BlockCase{4, true, 2, te::v1::PADDING_CAUSAL_BOTTOM_RIGHT}),
    BlockCaseName);

// Generation's steps (internal_decode): a prompt at once, then a token at a
// time, or any chunks; every causal layout, with one or several sequences.
class MhaBlockChunkedDecodeTest : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MhaBlockChunkedDecodeTest, ChunksEqualOneCausalForward) {
  const BlockCase& c = GetParam();
  auto ops = NewCpuOps();
  te::v1::MultiHeadAttention spec = Spec(4, c.groups, c.rotary);
  spec.set_attn_mask_type(c.mask);
  auto options = MhaOptionsFromSpec(spec, "spec");
  ASSERT_TRUE(options.ok());
  const MhaBlock block(*options, kHidden);
  const int64_t length = 9;
  for (const std::vector<int64_t>& chunks :
       std::vector<std::vector<int64_t>>{{5, 1, 1, 1, 1}, {2, 3, 1, 3}, {9}}) {
    Variables vars;
    ASSERT_TRUE(block.Init(*ops, 5, nullptr, &vars).ok());
    RandomizeParams(*ops, &vars, 9);
    ASSERT_TRUE(InitCache(*ops, block.CacheSpecs(c.batch, length, DType::kF32), &vars).ok());
    const Tensor x = RandomTensor(*ops, {c.batch, length, kHidden}, DType::kF32, 19);
    ForwardOptions decode;
    decode.decode = true;
    decode.internal_decode = true;
    auto error = MaxDecodeRowError(
        *ops, x,
        [&](const Tensor& all) -> absl::StatusOr<Tensor> {
          Tensor y;
          RETURN_IF_ERROR(block.Forward(*ops, &vars, all, SeqLens(), Tensor(), ForwardOptions(),
                                        &y, nullptr, nullptr));
          return y;
        },
        [&](const Tensor& part) -> absl::StatusOr<Tensor> {
          Tensor y;
          RETURN_IF_ERROR(
              block.Decode(*ops, &vars, part, SeqLens(), Tensor(), decode, &y, nullptr));
          return y;
        },
        chunks);
    ASSERT_TRUE(error.ok()) << error.status();
    EXPECT_LE(*error, kF32Tolerance) << chunks.size() << " chunks";
    EXPECT_EQ(CacheIndex(*ops, vars, "cache/cache_index"), length);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MhaBlockChunkedDecodeTest,
    ::testing::Values(BlockCase{4, false, 1, te::v1::CAUSAL},  // BS3HD
                      BlockCase{4, false, 3, te::v1::CAUSAL},
                      BlockCase{2, false, 2, te::v1::CAUSAL},  // BSHD_BS2HD
                      BlockCase{2, true, 1, te::v1::PADDING_CAUSAL},
                      BlockCase{4, true, 2, te::v1::CAUSAL_BOTTOM_RIGHT}),
    BlockCaseName);

// ---- TransformerLayer ---------------------------------------------------------

te::v1::TransformerLayer EncoderSpec(bool rotary, bool relative_embedding, int groups) {
  te::v1::TransformerLayer spec;
  spec.set_hidden_size(kHidden);
  spec.set_mlp_hidden_size(64);
  spec.set_num_attention_heads(4);
  spec.set_num_gqa_groups(groups);
  spec.set_enable_rotary_pos_emb(rotary);
  spec.set_enable_relative_embedding(relative_embedding);
  spec.set_use_bias(true);
  spec.add_mlp_activations("gelu");
  return spec;
}

// TE: "decode should be False when layer_type == TransformerLayerType.ENCODER".
TEST(TransformerLayerDecodeTest, TeRefusesDecodingAnEncoder) {
  auto ops = NewCpuOps();
  auto layer = MakeTransformerLayer(EncoderSpec(true, true, 4));
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto specs = (*layer)->CacheSpecs({2, 5, kHidden}, DType::kF32, false);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(
      specs.status().message(),
      "decode should be False when layer_type == TransformerLayerType.ENCODER"))
      << specs.status();
  auto vars = InitLayer(*ops, **layer, {2, 5, kHidden}, nullptr);
  ASSERT_TRUE(vars.ok());
  ForwardOptions opts;
  opts.decode = true;
  auto y = Apply(*ops, **layer, &*vars, RandomTensor(*ops, {2, 1, kHidden}, DType::kF32, 3), opts);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(y.status().message(), "TransformerLayerType.ENCODER"))
      << y.status();

  // Generation decodes only causal self-attention.
  te::v1::TransformerLayer padding = EncoderSpec(true, true, 4);
  padding.set_self_attn_mask_type(te::v1::PADDING);
  auto bidirectional = MakeTransformerLayer(padding);
  ASSERT_TRUE(bidirectional.ok());
  auto internal = (*bidirectional)->CacheSpecs({2, 5, kHidden}, DType::kF32, true);
  EXPECT_EQ(internal.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(internal.status().message(), "causal")) << internal.status();
}

// TE decodes a DECODER: its self-attention through the cache
// (cache/self_attention/...), its cross-attention over the whole of
// `encoded` at each step, the query rotated at the token's position as the
// forward rotates its row.
TEST(TransformerLayerDecodeTest, ADecoderTokenByTokenEqualsOneCausalForward) {
  auto ops = NewCpuOps();
  for (const bool relative : {true, false}) {
    te::v1::TransformerLayer spec = EncoderSpec(/*rotary=*/true, relative, 2);
    spec.set_layer_type(te::v1::DECODER);
    auto made = MakeTransformerLayer(spec);
    ASSERT_TRUE(made.ok()) << made.status();
    const Layer& layer = **made;
    const Shape x_shape = {2, 6, kHidden};
    auto vars = InitForDecode(*ops, layer, x_shape, DType::kF32, nullptr);
    ASSERT_TRUE(vars.ok()) << vars.status();
    EXPECT_EQ(vars->count("cache/self_attention/cached_key"), 1u);
    const Tensor x = RandomTensor(*ops, x_shape, DType::kF32, 37);
    const Tensor encoded = RandomTensor(*ops, {2, 5, kHidden}, DType::kF32, 38);
    ForwardOptions forward;
    ForwardOptions decode;
    decode.decode = true;
    auto run = [&](const Tensor& in, const ForwardOptions& opts) -> absl::StatusOr<Tensor> {
      LayerInputs inputs;
      inputs.x = in;
      inputs.extra = {encoded};
      LayerOutputs out;
      RETURN_IF_ERROR(layer.Forward(*ops, &*vars, inputs, opts, &out, nullptr));
      return out.y;
    };
    auto error = MaxDecodeRowError(
        *ops, x, [&](const Tensor& all) { return run(all, forward); },
        [&](const Tensor& token) { return run(token, decode); });
    ASSERT_TRUE(error.ok()) << error.status();
    EXPECT_LE(*error, kF32Tolerance) << (relative ? "relative bias" : "no bias");
    EXPECT_EQ(CacheIndex(*ops, *vars, "cache/self_attention/cache_index"), 6);
  }
  // Without rotary TE's fused projections refuse it, as MultiHeadAttention's.
  te::v1::TransformerLayer fused = EncoderSpec(/*rotary=*/false, true, 4);
  fused.set_layer_type(te::v1::DECODER);
  auto layer = MakeTransformerLayer(fused);
  ASSERT_TRUE(layer.ok());
  auto specs = (*layer)->CacheSpecs({2, 5, kHidden}, DType::kF32, false);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(specs.status().message(),
                                "decode mode requires QKVLayout.BSHD_BSHD_BSHD, but got "
                                "QKVLayout.BS3HD"))
      << specs.status();
}

struct EncoderCase {
  bool rotary;
  bool relative_embedding;
  int groups;
  int64_t batch;
  DType dtype;
};

void PrintTo(const EncoderCase& c, std::ostream* os) {
  *os << (c.rotary ? "rotary " : "") << (c.relative_embedding ? "relative bias " : "")
      << "groups " << c.groups << " batch " << c.batch << " " << DTypeName(c.dtype);
}

class TransformerLayerGenerationTest : public ::testing::TestWithParam<EncoderCase> {};

TEST_P(TransformerLayerGenerationTest, PromptThenTokensEqualOneCausalForward) {
  const EncoderCase& c = GetParam();
  auto ops = NewCpuOps();
  auto made = MakeTransformerLayer(EncoderSpec(c.rotary, c.relative_embedding, c.groups));
  ASSERT_TRUE(made.ok()) << made.status();
  const Layer& layer = **made;
  const int64_t length = 8;
  const Shape x_shape = {c.batch, length, kHidden};
  auto cache = layer.CacheSpecs(x_shape, c.dtype, /*internal_decode=*/true);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)[0].name, "cache/attention/cached_key");
  // Each attention making its own lengths, then the steps sharing one
  // DecodeContext (its lengths, its relative-bias buckets by distance) as
  // generation's do: writing the index through it, or, as generation, not
  // at all.
  struct Run {
    std::vector<int64_t> chunks;
    bool context;
    bool write_index;
  };
  for (const Run& run : std::vector<Run>{{{}, false, true},
                                         {{4, 1, 1, 2}, false, true},
                                         {{}, true, true},
                                         {{4, 1, 1, 2}, true, false}}) {
    SCOPED_TRACE(absl::StrCat("chunks ", run.chunks.size(), " context ", run.context,
                              " write_index ", run.write_index));
    const std::vector<int64_t>& chunks = run.chunks;
    DecodeContext context;
    context.write_index = run.write_index;
    auto vars = InitLayer(*ops, layer, x_shape, nullptr);
    ASSERT_TRUE(vars.ok()) << vars.status();
    RandomizeParams(*ops, &*vars, 3);
    ASSERT_TRUE(InitCache(*ops, *cache, &*vars).ok());
    const Tensor x = RandomTensor(*ops, x_shape, c.dtype, 29);
    ForwardOptions forward;
    ForwardOptions decode;
    decode.decode = true;
    decode.internal_decode = true;
    if (run.context) decode.decode_context = &context;
    int64_t position = 0;
    auto error = MaxDecodeRowError(
        *ops, x, [&](const Tensor& all) { return Apply(*ops, layer, &*vars, all, forward); },
        [&](const Tensor& part) -> absl::StatusOr<Tensor> {
          // As generation's loop: it knows where the cache is, and a context
          // that writes no index carries the step's position on the device.
          decode.decode_cache_index = position;
          if (!run.write_index) {
            RETURN_IF_ERROR(context.SetStep(*ops, c.batch, position, part.dim(1)));
          }
          position += part.dim(1);
          return Apply(*ops, layer, &*vars, part, decode);
        },
        chunks);
    ASSERT_TRUE(error.ok()) << error.status();
    EXPECT_LE(*error, c.dtype == DType::kF32 ? kF32Tolerance : kBf16Tolerance);
    EXPECT_EQ(CacheIndex(*ops, *vars, "cache/attention/cache_index"),
              run.write_index ? length : 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Encoders, TransformerLayerGenerationTest,
    ::testing::Values(EncoderCase{true, true, 4, 1, DType::kF32},
                      EncoderCase{true, true, 4, 3, DType::kF32},
                      EncoderCase{false, true, 2, 2, DType::kF32},
                      EncoderCase{false, false, 4, 1, DType::kF32},
                      EncoderCase{true, false, 2, 2, DType::kBF16}),
    [](const ::testing::TestParamInfo<EncoderCase>& info) {
      const EncoderCase& c = info.param;
      return absl::StrCat(c.rotary ? "Rotary" : "", c.relative_embedding ? "RelativeBias" : "",
                          c.groups == 4 ? "Mha" : "Gqa", "Batch", c.batch,
                          c.dtype == DType::kF32 ? "F32" : "BF16");
    });

// ---- the context a step's attentions share ---------------------------------------

TEST(DecodeContextTest, LengthsAreMadeOnceAndReservedOnesCostNoUpload) {
  auto ops = NewCpuOps();
  DecodeContext context;
  ASSERT_TRUE(context.Reserve(*ops, 3, {1, 4, 9}).ok());
  EXPECT_EQ(context.uploads(), 1);
  for (int64_t v : {1, 4, 9}) {
    auto lengths = context.Lengths(*ops, 3, v);
    ASSERT_TRUE(lengths.ok()) << lengths.status();
    EXPECT_EQ(lengths->shape(), (Shape{3}));
    EXPECT_EQ(*HostValues(*ops, *lengths), std::vector<float>(3, static_cast<float>(v)));
  }
  EXPECT_EQ(context.uploads(), 1);
  // Another value, or another batch, is uploaded once, then kept.
  auto five = context.Lengths(*ops, 3, 5);
  auto again = context.Lengths(*ops, 3, 5);
  auto other_batch = context.Lengths(*ops, 2, 4);
  ASSERT_TRUE(five.ok() && again.ok() && other_batch.ok());
  EXPECT_EQ(five->data(), again->data());
  EXPECT_EQ(*HostValues(*ops, *five), std::vector<float>(3, 5.0f));
  EXPECT_EQ(*HostValues(*ops, *other_batch), std::vector<float>(2, 4.0f));
  EXPECT_EQ(context.uploads(), 3);
  int made = 0;
  auto make = [&]() -> absl::StatusOr<Tensor> {
    ++made;
    return ops->Allocate(DType::kI32, {2});
  };
  auto a = context.constants.Get("k", make);
  auto b = context.constants.Get("k", make);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->data(), b->data());
  EXPECT_EQ(made, 1);
}

// ---- errors leave the cache as it was -------------------------------------------

class DecodeErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ops_ = NewCpuOps();
    layer_ = Make(Spec(4, 2, /*rotary=*/true));
    auto vars = InitForDecode(*ops_, *layer_, {2, 5, kHidden}, DType::kF32, nullptr);
    ASSERT_TRUE(vars.ok()) << vars.status();
    vars_ = *std::move(vars);
    decode_.decode = true;
    // One good step first: index 1.
    ASSERT_TRUE(Step(RandomTensor(*ops_, {2, 1, kHidden}, DType::kF32, 21)).ok());
  }
  absl::StatusOr<Tensor> Step(const Tensor& x, const LayerInputs* with = nullptr) {
    LayerInputs in = with != nullptr ? *with : LayerInputs();
    in.x = x;
    LayerOutputs out;
    RETURN_IF_ERROR(layer_->Forward(*ops_, &vars_, in, decode_, &out, nullptr));
    return out.y;
  }
  void ExpectUnchanged() {
    EXPECT_EQ(CacheIndex(*ops_, vars_, "cache/cache_index"), 1);
  }

  std::unique_ptr<Ops> ops_;
  std::unique_ptr<Layer> layer_;
  Variables vars_;
  ForwardOptions decode_;
};

TEST_F(DecodeErrorTest, MoreThanOneNewToken) {
  auto y = Step(RandomTensor(*ops_, {2, 2, kHidden}, DType::kF32, 22));
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(y.status().message(), "x.shape [2, 2, 32]")) << y.status();
  EXPECT_TRUE(absl::StrContains(y.status().message(), "one new token")) << y.status();
  ExpectUnchanged();
}

TEST_F(DecodeErrorTest, BatchOrDtypeOtherThanTheCaches) {
  auto y = Step(RandomTensor(*ops_, {3, 1, kHidden}, DType::kF32, 23));
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(y.status().message(), "cache/cached_key")) << y.status();
  auto bf16 = Step(RandomTensor(*ops_, {2, 1, kHidden}, DType::kBF16, 24));
  EXPECT_EQ(bf16.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bf16.status().message(), "float32")) << bf16.status();
  ExpectUnchanged();
}

TEST_F(DecodeErrorTest, IndexOutsideTheCache) {
  Tensor& index = vars_.at("cache/cache_index");
  const int32_t negative = -1;
  ASSERT_TRUE(ops_->Upload(&negative, &index).ok());
  auto y = Step(RandomTensor(*ops_, {2, 1, kHidden}, DType::kF32, 25));
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(y.status().message(), "cache/cache_index is -1")) << y.status();
}

TEST_F(DecodeErrorTest, KeepForBackwardAndMissingCache) {
  decode_.keep_for_backward = true;
  auto kept = Step(RandomTensor(*ops_, {2, 1, kHidden}, DType::kF32, 26));
  EXPECT_EQ(kept.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(kept.status().message(), "keep_for_backward")) << kept.status();
  decode_.keep_for_backward = false;
  ExpectUnchanged();

  vars_.erase("cache/cached_value");
  auto missing = Step(RandomTensor(*ops_, {2, 1, kHidden}, DType::kF32, 27));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "init with decode"))
      << missing.status();
}

TEST(DecodeMaskTest, PaddingTypesTakeNoMaskWithDecode) {
  auto ops = NewCpuOps();
  te::v1::MultiHeadAttention spec = Spec(4, 4, /*rotary=*/true);
  spec.set_attn_mask_type(te::v1::PADDING_CAUSAL);
  auto layer = Make(spec);
  auto vars = InitForDecode(*ops, *layer, {2, 4, kHidden}, DType::kF32, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 1, kHidden}, DType::kF32, 31);
  auto q_seqlens = ops->Allocate(DType::kI32, {2});
  ASSERT_TRUE(q_seqlens.ok());
  in.q_seqlens = *q_seqlens;
  const int32_t lengths[2] = {1, 1};
  ASSERT_TRUE(ops->Upload(lengths, &in.q_seqlens).ok());
  ForwardOptions opts;
  opts.decode = true;
  LayerOutputs out;
  absl::Status status = layer->Forward(*ops, &*vars, in, opts, &out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(), "attention_mask")) << status;
  EXPECT_EQ(CacheIndex(*ops, *vars, "cache/cache_index"), 0);
}

// The rotary offset: rotating row s of a sequence equals rotating that row
// alone at position_offset s.
TEST(RotaryOffsetTest, RowAloneAtItsPositionEqualsRowInSequence) {
  auto ops = NewCpuOps();
  const Tensor x = RandomTensor(*ops, {1, 9, 2, 8}, DType::kF32, 41);
  Tensor whole;
  ASSERT_TRUE(ApplyRotary(*ops, x, false, &whole).ok());
  const std::vector<float> all = testing::Values(whole);
  for (int64_t s = 0; s < 9; ++s) {
    Tensor row = x.Reshaped({9, 2, 8}).Slice0(s, s + 1).Reshaped({1, 1, 2, 8});
    Tensor rotated;
    ASSERT_TRUE(ApplyRotary(*ops, row, false, &rotated, s).ok());
    const std::vector<float> got = testing::Values(rotated);
    for (int i = 0; i < 16; ++i) EXPECT_FLOAT_EQ(got[i], all[s * 16 + i]) << s << " " << i;
  }
}

}  // namespace
}  // namespace te::layers
