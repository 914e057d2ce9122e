// Autoregressive decoding on the CUDA backend: decoding a sequence one token
// at a time with MultiHeadAttention's cache gives, row for row, what one
// causal forward of the whole sequence gives on the same GPU (the forward
// itself is checked against the CPU reference elsewhere). Float32, bfloat16
// (cuDNN's attention for the forward; one query against the cache for the
// step) and FP8 under DelayedScaling, with and without GQA, one and several
// sequences, the fused qkv layouts that generation decodes, an LM graph as
// generation runs it (prompt, then tokens), and generation's replayed steps.
//
// Needs a GPU: without one every test is skipped, unless TE_REQUIRE_GPU=1
// (as deploy/bundle.sh's run.sh sets).
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_layers.h"
#include "server/layers/cache.h"
#include "server/layers/decode_testing.h"
#include "server/layers/generate.h"
#include "server/layers/multi_head_attention.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::DelayedRecipe;
using testing::HostValues;
using testing::InitLayer;
using testing::MaxDecodeRowError;
using testing::RandomizeParams;
using testing::RandomTensor;

// Relative L2 error of one row, decode against the forward on the GPU.
// float32: exact float32 products on both paths (TE's modules do not take
// TensorFloat-32); a GEMM over B rows and one over B * L rows, and cuDNN or
// the unfused kernel against the one-query step, add in other orders:
// 1e-4 leaves room for that over the chain and still flags a wrong row.
constexpr double kF32Tolerance = 1e-4;
// bfloat16 (and FP8 under DelayedScaling, whose scales and so codes are the
// forward's, with bfloat16 outputs): one-ulp (2^-8) differences where the
// two paths' float32 values straddle a rounding boundary, compounded over
// the projections, the attention and the output projection.
constexpr double kBF16Tolerance = 2e-2;

testing::GpuBackends& Backends() { return testing::GetGpuBackends(int64_t{16} << 30); }

bool SkipWithoutGpu() {
  testing::GpuBackends& b = Backends();
  if (b.gpu != nullptr) return false;
  if (::te::GpuRequired()) ADD_FAILURE() << "TE_REQUIRE_GPU=1, but no GPU: " << b.unavailable;
  return true;
}

// Made on the CPU (TE's initialisers, then random params so that biases and
// norm scales are not trivial) and copied to the GPU byte for byte.
absl::StatusOr<Variables> GpuVariables(const Variables& host) {
  testing::GpuBackends& b = Backends();
  Variables vars;
  for (const auto& [name, t] : host) {
    ASSIGN_OR_RETURN(Tensor d, b.gpu->Allocate(t.dtype(), t.shape()));
    RETURN_IF_ERROR(b.gpu->Upload(t.data(), &d));
    vars[name] = d;
  }
  RETURN_IF_ERROR(b.gpu->Synchronize());
  return vars;
}

absl::StatusOr<Tensor> GpuRandom(const Shape& shape, DType dtype, uint64_t seed) {
  testing::GpuBackends& b = Backends();
  const Tensor host = RandomTensor(*b.cpu, shape, dtype, seed);
  ASSIGN_OR_RETURN(Tensor d, b.gpu->Allocate(dtype, shape));
  RETURN_IF_ERROR(b.gpu->Upload(host.data(), &d));
  RETURN_IF_ERROR(b.gpu->Synchronize());
  return d;
}

te::v1::MultiHeadAttention Spec(int heads, int groups, bool rotary) {
  te::v1::MultiHeadAttention spec;
  spec.set_head_dim(64);
  spec.set_num_attention_heads(heads);
  spec.set_num_gqa_groups(groups);
  spec.set_enable_rotary_pos_emb(rotary);
  spec.set_use_bias(true);
  return spec;
}

enum class Precision { kF32, kBF16, kFp8Delayed };

struct GpuDecodeCase {
  int groups;  // 8 = no GQA (heads 8)
  int64_t batch;
  Precision precision;
};

std::string CaseName(const ::testing::TestParamInfo<GpuDecodeCase>& info) {
  const GpuDecodeCase& c = info.param;
  const char* precision = c.precision == Precision::kF32    ? "F32"
                          : c.precision == Precision::kBF16 ? "BF16"
                                                            : "Fp8Delayed";
  return absl::StrCat(c.groups == 8 ? "Mha" : "Gqa", "Batch", c.batch, precision);
}

class MultiHeadAttentionDecodeGpuTest : public ::testing::TestWithParam<GpuDecodeCase> {};

TEST_P(MultiHeadAttentionDecodeGpuTest, TokenByTokenEqualsOneCausalForward) {
  if (SkipWithoutGpu()) GTEST_SKIP() << Backends().unavailable;
  const GpuDecodeCase& c = GetParam();
  testing::GpuBackends& b = Backends();
  Ops& gpu = *b.gpu;
  auto made = MakeMultiHeadAttention(Spec(8, c.groups, /*rotary=*/true));
  ASSERT_TRUE(made.ok()) << made.status();
  const Layer& layer = **made;
  const int64_t hidden = 512, length = 37;
  const DType dtype = c.precision == Precision::kF32 ? DType::kF32 : DType::kBF16;
  const Fp8Recipe recipe = DelayedRecipe();
  const Fp8Recipe* fp8 = c.precision == Precision::kFp8Delayed ? &recipe : nullptr;
  const Shape x_shape = {c.batch, length, hidden};
  auto host_vars = InitLayer(*b.cpu, layer, x_shape, fp8);
  ASSERT_TRUE(host_vars.ok()) << host_vars.status();
  RandomizeParams(*b.cpu, &*host_vars, 7, 0.1f);
  auto vars = GpuVariables(*host_vars);
  ASSERT_TRUE(vars.ok()) << vars.status();
  auto cache = layer.CacheSpecs(x_shape, dtype, false);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_TRUE(InitCache(gpu, *cache, &*vars).ok());
  auto x = GpuRandom(x_shape, dtype, 11);
  ASSERT_TRUE(x.ok());

  ForwardOptions forward;
  forward.fp8 = fp8;
  ForwardOptions decode = forward;
  decode.decode = true;
  auto apply = [&](const Tensor& in_x, const ForwardOptions& opts) -> absl::StatusOr<Tensor> {
    LayerInputs in;
    in.x = in_x;
    LayerOutputs out;
    RETURN_IF_ERROR(layer.Forward(gpu, &*vars, in, opts, &out, nullptr));
    return out.y;
  };
  auto error = MaxDecodeRowError(
      gpu, *x, [&](const Tensor& all) { return apply(all, forward); },
      [&](const Tensor& token) { return apply(token, decode); });
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_LE(*error, c.precision == Precision::kF32 ? kF32Tolerance : kBF16Tolerance);
  auto index = HostValues(gpu, vars->at("cache/cache_index"));
  ASSERT_TRUE(index.ok());
  EXPECT_EQ((*index)[0], static_cast<float>(length));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, MultiHeadAttentionDecodeGpuTest,
    ::testing::Values(GpuDecodeCase{8, 1, Precision::kF32}, GpuDecodeCase{2, 4, Precision::kF32},
                      GpuDecodeCase{8, 1, Precision::kBF16}, GpuDecodeCase{8, 4, Precision::kBF16},
                      GpuDecodeCase{2, 1, Precision::kBF16}, GpuDecodeCase{2, 4, Precision::kBF16},
                      GpuDecodeCase{8, 1, Precision::kFp8Delayed},
                      GpuDecodeCase{2, 4, Precision::kFp8Delayed}),
    CaseName);

// The attention block in the fused layouts generation decodes (BS3HD and
// BSHD_BS2HD), bfloat16.
class MhaBlockDecodeGpuTest : public ::testing::TestWithParam<int> {};

TEST_P(MhaBlockDecodeGpuTest, TokenByTokenEqualsOneCausalForward) {
  if (SkipWithoutGpu()) GTEST_SKIP() << Backends().unavailable;
  testing::GpuBackends& b = Backends();
  Ops& gpu = *b.gpu;
  const int groups = GetParam();
  auto options = MhaOptionsFromSpec(Spec(8, groups, /*rotary=*/false), "spec");
  ASSERT_TRUE(options.ok());
  options->scope = "attention";
  const int64_t hidden = 512, length = 29, batch = 3;
  const MhaBlock block(*options, hidden);
  Variables host;
  ASSERT_TRUE(block.Init(*b.cpu, 5, nullptr, &host).ok());
  RandomizeParams(*b.cpu, &host, 9, 0.1f);
  auto vars = GpuVariables(host);
  ASSERT_TRUE(vars.ok());
  ASSERT_TRUE(InitCache(gpu, block.CacheSpecs(batch, length, DType::kBF16), &*vars).ok());
  auto x = GpuRandom({batch, length, hidden}, DType::kBF16, 13);
  ASSERT_TRUE(x.ok());
  ForwardOptions forward;
  ForwardOptions decode;
  decode.decode = true;
  auto error = MaxDecodeRowError(
      gpu, *x,
      [&](const Tensor& all) -> absl::StatusOr<Tensor> {
        Tensor y;
        RETURN_IF_ERROR(block.Forward(gpu, &*vars, all, SeqLens(), Tensor(), forward, &y,
                                      nullptr, nullptr));
        return y;
      },
      [&](const Tensor& token) -> absl::StatusOr<Tensor> {
        Tensor y;
        RETURN_IF_ERROR(block.Decode(gpu, &*vars, token, SeqLens(), Tensor(), decode, &y, nullptr));
        return y;
      });
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_LE(*error, kBF16Tolerance);
}

INSTANTIATE_TEST_SUITE_P(FusedLayouts, MhaBlockDecodeGpuTest, ::testing::Values(8, 2));

// Generation's steps over an LM graph as train_lm.py builds it (Embed, a
// bfloat16 cast, TransformerLayers with rotary and T5 relative bias,
// LayerNorm, attend, the loss): a prompt at once, then a token at a time,
// give the logits rows of one causal forward.
std::string LmGraph(bool loss) {
  const std::string layer =
      "transformer_layer { hidden_size: 256 mlp_hidden_size: 1024 num_attention_heads: 4 "
      "mlp_activations: \"gelu\" hidden_dropout: 0 attention_dropout: 0 "
      "intermediate_dropout: 0 enable_rotary_pos_emb: true }";
  std::string text = absl::StrCat(
      "graph {\n",
      "  nodes { name: \"Embed_0\" inputs: \"x\" outputs: \"e\" module { flax_embed { ",
      "num_embeddings: 97 features: 256 } } }\n",
      "  nodes { name: \"cast_0\" inputs: \"e\" outputs: \"h0\" cast { dtype: BFLOAT16 } }\n",
      "  nodes { name: \"TransformerLayer_0\" inputs: \"h0\" outputs: \"h1\" module { ", layer,
      " } }\n",
      "  nodes { name: \"TransformerLayer_1\" inputs: \"h1\" outputs: \"h2\" module { ", layer,
      " } }\n",
      "  nodes { name: \"LayerNorm_0\" inputs: \"h2\" outputs: \"n\" module { flax_layer_norm {} "
      "} }\n",
      "  nodes { name: \"attend_0\" inputs: \"n\" outputs: \"logits\" attend { embed: "
      "\"Embed_0\" } }\n");
  absl::StrAppend(&text, loss ? "  nodes { name: \"loss_0\" inputs: \"logits\" inputs: "
                                "\"extra_inputs[0]\" outputs: \"loss\" softmax_cross_entropy "
                                "{} }\n  outputs: \"loss\"\n}"
                              : "  outputs: \"logits\"\n}");
  return text;
}

class LmGraphDecodeGpuTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(LmGraphDecodeGpuTest, PromptThenTokensGiveTheForwardsLogits) {
  if (SkipWithoutGpu()) GTEST_SKIP() << Backends().unavailable;
  testing::GpuBackends& b = Backends();
  Ops& gpu = *b.gpu;
  const int64_t batch = GetParam(), prompt = 20, length = 32;
  std::unique_ptr<Layer> with_loss, logits;
  for (bool loss : {true, false}) {
    te::v1::LayerSpec spec;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(LmGraph(loss), &spec));
    auto layer = CreateLayer(spec);
    ASSERT_TRUE(layer.ok()) << layer.status();
    (loss ? with_loss : logits) = *std::move(layer);
  }
  const Shape x_shape = {batch, length};
  auto host_vars = InitLayer(*b.cpu, *with_loss, x_shape, nullptr);
  ASSERT_TRUE(host_vars.ok()) << host_vars.status();
  auto vars = GpuVariables(*host_vars);
  ASSERT_TRUE(vars.ok());
  auto cache = with_loss->CacheSpecs(x_shape, DType::kI32, /*internal_decode=*/true);
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<int32_t> ids(static_cast<size_t>(batch * length));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 97);
  auto x = gpu.Allocate(DType::kI32, x_shape);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(gpu.Upload(ids.data(), &*x).ok());
  ForwardOptions forward;
  auto apply = [&](const Layer& layer, const Tensor& in_x,
                   const ForwardOptions& opts) -> absl::StatusOr<Tensor> {
    LayerInputs in;
    in.x = in_x;
    LayerOutputs out;
    RETURN_IF_ERROR(layer.Forward(gpu, &*vars, in, opts, &out, nullptr));
    return out.y;
  };
  std::vector<int64_t> chunks = {prompt};
  chunks.resize(static_cast<size_t>(length - prompt + 1), 1);
  // Each attention making its own lengths, then the steps sharing one
  // DecodeContext as generation's do (lengths reserved once, the relative
  // bias's buckets kept, the index known to the loop and never written).
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared DecodeContext" : "no context");
    ASSERT_TRUE(InitCache(gpu, *cache, &*vars).ok());
    DecodeContext context;
    ForwardOptions decode;
    decode.decode = true;
    decode.internal_decode = true;
    if (shared) {
      context.write_index = false;
      std::vector<int64_t> lengths(static_cast<size_t>(length));
      for (int64_t i = 0; i < length; ++i) lengths[i] = i + 1;
      ASSERT_TRUE(context.Reserve(gpu, batch, lengths).ok());
      decode.decode_context = &context;
    }
    int64_t position = 0;
    auto error = MaxDecodeRowError(
        gpu, *x, [&](const Tensor& all) { return apply(*logits, all, forward); },
        [&](const Tensor& part) -> absl::StatusOr<Tensor> {
          decode.decode_cache_index = position;
          if (shared) RETURN_IF_ERROR(context.SetStep(gpu, batch, position, part.dim(1)));
          position += part.dim(1);
          return apply(*with_loss, part, decode);
        },
        chunks);
    ASSERT_TRUE(error.ok()) << error.status();
    EXPECT_LE(*error, kBF16Tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(Batches, LmGraphDecodeGpuTest, ::testing::Values(1, 4));

// Generation records its second one-token step as a CUDA graph and replays
// it for the rest: the tokens are those of running every step itself
// (greedy, and sampled, which any change in the logits would move), and
// every later step was a replay.
// (batch, FP8 under DelayedScaling): replayed steps make the tokens of
// steps run one by one, greedy (picked on the device, the next step queued
// before they are read) and sampled (on the host); under FP8 too (the kept
// weight copies and the amax writes are the same launches every step).
class GenerateReplayGpuTest : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(GenerateReplayGpuTest, ReplayedStepsMakeTheTokensOfStepsRunOneByOne) {
  if (SkipWithoutGpu()) GTEST_SKIP() << Backends().unavailable;
  testing::GpuBackends& b = Backends();
  Ops& gpu = *b.gpu;
  const auto [batch, fp8] = GetParam();
  const int64_t prompt = 9, new_tokens = 12;
  te::v1::LayerSpec spec;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(LmGraph(false), &spec));
  auto model = CreateLayer(spec);
  ASSERT_TRUE(model.ok()) << model.status();
  const Fp8Recipe recipe = DelayedRecipe();
  const Fp8Recipe* recipe_or_null = fp8 ? &recipe : nullptr;
  auto host_vars = InitLayer(*b.cpu, **model, {batch, prompt + new_tokens}, recipe_or_null);
  ASSERT_TRUE(host_vars.ok()) << host_vars.status();
  RandomizeParams(*b.cpu, &*host_vars, 5);
  std::vector<int32_t> ids(static_cast<size_t>(batch * prompt));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 53 + 5) % 97);
  auto x = gpu.Allocate(DType::kI32, {batch, prompt});
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE(gpu.Upload(ids.data(), &*x).ok());
  for (const bool greedy : {true, false}) {
    SCOPED_TRACE(greedy ? "greedy" : "sampled");
    GenerateOptions options;
    options.max_new_tokens = new_tokens;
    options.sampling.greedy = greedy;
    options.sampling.temperature = 0.7f;
    options.sampling.seed = 11;
    options.fp8 = recipe_or_null;
    options.replay_steps = false;
    // Each run from the same variables: the steps write their amaxes into
    // fp8_metas, which the next step's scales do not read (no update runs),
    // but a fresh copy keeps the runs independent.
    auto vars = GpuVariables(*host_vars);
    ASSERT_TRUE(vars.ok());
    auto one_by_one = Generate(gpu, **model, *vars, *x, options, nullptr);
    ASSERT_TRUE(one_by_one.ok()) << one_by_one.status();
    EXPECT_EQ(one_by_one->replayed_steps, 0);
    options.replay_steps = true;
    vars = GpuVariables(*host_vars);
    ASSERT_TRUE(vars.ok());
    auto replayed = Generate(gpu, **model, *vars, *x, options, nullptr);
    ASSERT_TRUE(replayed.ok()) << replayed.status();
    EXPECT_TRUE(replayed->record_status.ok()) << replayed->record_status;
    // The prompt's step and the first one-token step ran themselves.
    EXPECT_EQ(replayed->replayed_steps, new_tokens - 2);
    EXPECT_EQ(replayed->tokens, one_by_one->tokens);
  }
}

INSTANTIATE_TEST_SUITE_P(BatchesAndRecipes, GenerateReplayGpuTest,
                         ::testing::Combine(::testing::Values(int64_t{1}, int64_t{3}),
                                            ::testing::Bool()));

}  // namespace
}  // namespace te::layers
