// Generation over a graph LM (nn.Embed -> TE TransformerLayers, encoders
// with a causal mask, rotary and T5 relative bias -> nn.LayerNorm ->
// Embed.attend -> the loss), as client/python/examples/train_lm.py builds
// it: the graph's decode steps (a prompt at once, then a token at a time)
// give the logits rows of one causal forward; greedy generation gives the
// tokens of re-running the full forward on the growing prefix; sampling is
// reproducible and honours top-k, top-p and temperature; stop tokens,
// interruption and the errors.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/layers/cache.h"
#include "server/layers/decode_testing.h"
#include "server/layers/fp8_weight_cache.h"
#include "tests/lm_graph_text.h"
#include "server/layers/generate.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::DelayedRecipe;
using testing::HostValues;
using testing::InitLayer;
using testing::MaxDecodeRowError;
using testing::NewCpuOps;
using testing::RandomizeParams;

// Relative L2 error of one logits row, decode steps against the forward.
// float32 on the CPU: bit for bit in practice (the steps add the forward's
// terms in its order); 1e-5 is the bound promised.
constexpr double kF32Tolerance = 1e-5;
// bfloat16 activations (and FP8 DelayedScaling, whose codes are the
// forward's): a one-ulp (2^-8) difference where a sum's order differs,
// carried through the layers: 2^-6.
constexpr double kBf16Tolerance = 1.0 / 64;
// Sampled frequencies of 20000 draws against their probabilities: the
// standard deviation of a frequency is at most 0.0036; 0.015 is 4 of them.
constexpr double kFrequencyTolerance = 0.015;

constexpr int64_t kVocab = 23;

// The LM of train_lm.py at a small size; `cast` to bfloat16 after the Embed
// as it does, `loss`: the graph ends in the loss (else in the logits).
// `layers` TransformerLayers deep.
std::string LmGraph(bool cast, bool loss, bool rotary = true, int layers = 2) {
  te::testing::LmGraphOptions options;
  options.vocab = kVocab;
  options.hidden = 32;
  options.mlp_hidden = 64;
  options.layers = layers;
  options.cast = cast;
  options.rotary = rotary;
  options.loss = loss;
  return te::testing::LmGraphText(options);
}

std::unique_ptr<Layer> Make(const std::string& text) {
  te::v1::LayerSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

Tensor Ids(Ops& ops, const std::vector<int32_t>& ids, const Shape& shape) {
  Tensor t = *ops.Allocate(DType::kI32, shape);
  EXPECT_TRUE(ops.Upload(ids.data(), &t).ok());
  return t;
}

std::vector<int32_t> RandomIds(int64_t n, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  uint64_t s = seed;
  for (auto& id : ids) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    id = static_cast<int32_t>((s >> 33) % kVocab);
  }
  return ids;
}

struct Lm {
  std::unique_ptr<Layer> with_loss, logits;
  Variables vars;
};

// Both graphs share their node names, so one set of variables serves both.
Lm MakeLm(Ops& ops, bool cast, const Shape& x_shape, const Fp8Recipe* fp8 = nullptr,
          bool rotary = true, int layers = 2) {
  Lm lm;
  lm.with_loss = Make(LmGraph(cast, true, rotary, layers));
  lm.logits = Make(LmGraph(cast, false, rotary, layers));
  auto vars = InitLayer(ops, *lm.with_loss, x_shape, fp8, 3);
  EXPECT_TRUE(vars.ok()) << vars.status();
  if (vars.ok()) lm.vars = *std::move(vars);
  RandomizeParams(ops, &lm.vars, 5, 0.3f);
  return lm;
}

absl::StatusOr<Tensor> Apply(Ops& ops, const Layer& layer, Variables* vars, const Tensor& x,
                             const ForwardOptions& opts) {
  LayerInputs in;
  in.x = x;
  LayerOutputs out;
  RETURN_IF_ERROR(layer.Forward(ops, vars, in, opts, &out, nullptr));
  return out.y;
}

// ---- the graph's decode steps -------------------------------------------------

struct GraphCase {
  bool cast;
  int64_t batch;
  bool fp8;
  bool rotary;
};

class GraphDecodeTest : public ::testing::TestWithParam<GraphCase> {};

TEST_P(GraphDecodeTest, PromptThenTokensGiveTheForwardsLogits) {
  const GraphCase& c = GetParam();
  auto ops = NewCpuOps();
  const int64_t length = 10;
  const Shape x_shape = {c.batch, length};
  const Fp8Recipe recipe = DelayedRecipe();
  const Fp8Recipe* fp8 = c.fp8 ? &recipe : nullptr;
  Lm lm = MakeLm(*ops, c.cast, x_shape, fp8, c.rotary);
  ASSERT_NE(lm.logits, nullptr);
  // Each TransformerLayer's self-attention has its cache, under its node.
  auto specs = lm.with_loss->CacheSpecs(x_shape, DType::kI32, /*internal_decode=*/true);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 6u);
  EXPECT_EQ((*specs)[0].name, "cache/TransformerLayer_0/attention/cached_key");
  EXPECT_EQ((*specs)[0].shape, (Shape{c.batch, length, 4, 8}));
  EXPECT_EQ((*specs)[0].dtype, c.cast ? DType::kBF16 : DType::kF32);
  EXPECT_EQ((*specs)[5].name, "cache/TransformerLayer_1/attention/cache_index");
  ASSERT_TRUE(InitCache(*ops, *specs, &lm.vars).ok());

  const Tensor x = Ids(*ops, RandomIds(c.batch * length, 7), x_shape);
  ForwardOptions forward;
  forward.fp8 = fp8;
  ForwardOptions decode = forward;
  decode.decode = true;
  decode.internal_decode = true;
  // The loss graph's decode steps give its logits; its forward needs labels,
  // so the logits graph (the same variables) gives the forward's.
  auto error = MaxDecodeRowError(
      *ops, x, [&](const Tensor& all) { return Apply(*ops, *lm.logits, &lm.vars, all, forward); },
      [&](const Tensor& part) { return Apply(*ops, *lm.with_loss, &lm.vars, part, decode); },
      {6, 1, 1, 1, 1});
  ASSERT_TRUE(error.ok()) << error.status();
  EXPECT_LE(*error, c.cast ? kBf16Tolerance : kF32Tolerance);
  auto index = HostValues(*ops, lm.vars.at("cache/TransformerLayer_1/attention/cache_index"));
  ASSERT_TRUE(index.ok());
  EXPECT_EQ((*index)[0], static_cast<float>(length));

  // Again from fresh caches, the steps sharing one DecodeContext as
  // generation's do (lengths reserved once, the index known to the loop and
  // never written).
  ASSERT_TRUE(InitCache(*ops, *specs, &lm.vars).ok());
  DecodeContext context;
  context.write_index = false;
  std::vector<int64_t> lengths(static_cast<size_t>(length));
  std::iota(lengths.begin(), lengths.end(), 1);
  ASSERT_TRUE(context.Reserve(*ops, c.batch, lengths).ok());
  decode.decode_context = &context;
  int64_t position = 0;
  auto shared = MaxDecodeRowError(
      *ops, x, [&](const Tensor& all) { return Apply(*ops, *lm.logits, &lm.vars, all, forward); },
      [&](const Tensor& part) -> absl::StatusOr<Tensor> {
        decode.decode_cache_index = position;
        RETURN_IF_ERROR(context.SetStep(*ops, c.batch, position, part.dim(1)));
        position += part.dim(1);
        return Apply(*ops, *lm.with_loss, &lm.vars, part, decode);
      },
      {6, 1, 1, 1, 1});
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_LE(*shared, c.cast ? kBf16Tolerance : kF32Tolerance);
  // The reserved lengths, then one step state a step: none per attention.
  EXPECT_EQ(context.uploads(), 1 + 5);
}

INSTANTIATE_TEST_SUITE_P(Lms, GraphDecodeTest,
                         ::testing::Values(GraphCase{false, 1, false, true},
                                           GraphCase{false, 3, false, true},
                                           GraphCase{false, 2, false, false},
                                           GraphCase{true, 2, false, true},
                                           GraphCase{true, 1, true, true}),
                         [](const ::testing::TestParamInfo<GraphCase>& info) {
                           const GraphCase& c = info.param;
                           return absl::StrCat(c.cast ? "BF16" : "F32", "Batch", c.batch,
                                               c.fp8 ? "Fp8Delayed" : "",
                                               c.rotary ? "Rotary" : "");
                         });

TEST(GraphDecodeErrorTest, ModulesThatCannotDecodeAreNamed) {
  auto ops = NewCpuOps();
  std::string text = LmGraph(false, false);
  const std::string tl = "module { transformer_layer { hidden_size: 32";
  text.replace(text.find(tl), tl.size(),
               "module { transformer_layer { self_attn_mask_type: PADDING hidden_size: 32");
  auto layer = Make(text);
  ASSERT_NE(layer, nullptr);
  auto specs = layer->CacheSpecs({2, 6}, DType::kI32, true);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(specs.status().message(), "TransformerLayer_0")) << specs.status();
  EXPECT_TRUE(absl::StrContains(specs.status().message(), "causal")) << specs.status();

  auto flax = Make(R"pb(graph {
    nodes { name: "Embed_0" inputs: "x" outputs: "e" module { flax_embed { num_embeddings: 5 features: 8 } } }
    nodes { name: "Attention_0" inputs: "e" inputs: "e" inputs: "e" outputs: "y" module { flax_multi_head_dot_product_attention { num_heads: 2 } } }
    outputs: "y"
  })pb");
  ASSERT_NE(flax, nullptr);
  auto flax_specs = flax->CacheSpecs({2, 6}, DType::kI32, true);
  EXPECT_EQ(flax_specs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(flax_specs.status().message(), "Attention_0"))
      << flax_specs.status();

  // TE's own decode is not offered on a graph.
  auto te_decode = Make(LmGraph(false, false))->CacheSpecs({2, 6}, DType::kI32, false);
  EXPECT_EQ(te_decode.status().code(), absl::StatusCode::kInvalidArgument);
}

// ---- generation -----------------------------------------------------------------

// Greedy tokens by re-running the logits graph's full forward on the
// growing prefix, one new token per forward.
std::vector<std::vector<int32_t>> GreedyByFullForwards(Ops& ops, Lm& lm,
                                                       const std::vector<int32_t>& prompt,
                                                       int64_t batch, int64_t new_tokens,
                                                       const Fp8Recipe* fp8 = nullptr) {
  ForwardOptions forward;
  forward.fp8 = fp8;
  const int64_t prompt_length = static_cast<int64_t>(prompt.size()) / batch;
  std::vector<std::vector<int32_t>> seqs(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    seqs[b].assign(prompt.begin() + b * prompt_length, prompt.begin() + (b + 1) * prompt_length);
  }
  std::vector<std::vector<int32_t>> made(static_cast<size_t>(batch));
  for (int64_t k = 0; k < new_tokens; ++k) {
    const int64_t n = prompt_length + k;
    std::vector<int32_t> flat;
    for (const auto& s : seqs) flat.insert(flat.end(), s.begin(), s.end());
    auto y = Apply(ops, *lm.logits, &lm.vars, Ids(ops, flat, {batch, n}), forward);
    EXPECT_TRUE(y.ok()) << y.status();
    if (!y.ok()) return made;
    auto logits = HostValues(ops, *y);
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = logits->data() + ((b * n) + n - 1) * kVocab;
      int32_t best = 0;
      for (int32_t v = 1; v < kVocab; ++v) {
        if (row[v] > row[best]) best = v;
      }
      seqs[b].push_back(best);
      made[b].push_back(best);
    }
  }
  return made;
}

TEST(GenerateTest, GreedyTokensAreTheFullForwardsOnTheGrowingPrefix) {
  auto ops = NewCpuOps();
  const int64_t batch = 3, prompt_length = 5, new_tokens = 9;
  Lm lm = MakeLm(*ops, false, {batch, prompt_length + new_tokens});
  const std::vector<int32_t> prompt = RandomIds(batch * prompt_length, 11);
  GenerateOptions options;
  options.max_new_tokens = new_tokens;
  std::vector<std::vector<int32_t>> streamed;
  auto result = Generate(*ops, *lm.with_loss, lm.vars, Ids(*ops, prompt, {batch, prompt_length}),
                         options, [&](int64_t step, const std::vector<int32_t>& tokens) {
                           EXPECT_EQ(step, static_cast<int64_t>(streamed.size()));
                           streamed.push_back(tokens);
                           return absl::OkStatus();
                         });
  ASSERT_TRUE(result.ok()) << result.status();
  const auto want = GreedyByFullForwards(*ops, lm, prompt, batch, new_tokens);
  EXPECT_EQ(result->tokens, want);
  ASSERT_EQ(streamed.size(), static_cast<size_t>(new_tokens));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t k = 0; k < new_tokens; ++k) EXPECT_EQ(streamed[k][b], want[b][k]);
  }
  // The caller's variables hold no cache: generation's are its own.
  for (const auto& [name, t] : lm.vars) EXPECT_FALSE(absl::StartsWith(name, "cache/")) << name;
  // The CPU records no step (Ops::CaptureStep answers UNIMPLEMENTED): every
  // step ran itself, and that is no failure to report.
  EXPECT_EQ(result->replayed_steps, 0);
  EXPECT_TRUE(result->record_status.ok()) << result->record_status;
}

// The CPU backend, counting its host <-> device copies.
class CountingOps : public CpuOps {
 public:
  absl::Status Upload(const void* src, Tensor* dst) override {
    ++uploads;
    return CpuOps::Upload(src, dst);
  }
  absl::Status Download(const Tensor& src, void* dst) override {
    ++downloads;
    return CpuOps::Download(src, dst);
  }
  absl::Status Cast(const Tensor& x, Tensor* y) override {
    ++casts_from[x.data()];
    return CpuOps::Cast(x, y);
  }
  absl::Status QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                     const KeptQuantization& kept, Tensor* y,
                                     Tensor* y_t) override {
    ++kept_checks;
    return CpuOps::QuantizeTransposeKept(x, fp8, kept, y, y_t);
  }
  int64_t kept_checks = 0;
  int64_t uploads = 0;
  int64_t downloads = 0;
  std::map<const void*, int64_t> casts_from;  // by the source's memory
};

// The weights stay put for a whole generation, so each float32 weight of a
// bf16 model is cast once (Ops::CastKept), however many tokens it makes;
// and the memo goes with the call.
TEST(GenerateTest, EachWeightIsCastOncePerGeneration) {
  CountingOps ops;
  const int64_t batch = 2, prompt_length = 4;
  Lm lm = MakeLm(ops, /*cast=*/true, {batch, prompt_length + 8});
  const Tensor prompt = Ids(ops, RandomIds(batch * prompt_length, 23), {batch, prompt_length});
  GenerateOptions options;
  options.max_new_tokens = 6;
  auto result = Generate(ops, *lm.with_loss, lm.vars, prompt, options, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  int64_t weights_cast = 0;
  for (const auto& [name, t] : lm.vars) {
    if (!absl::StartsWith(name, "params/") || t.dtype() != DType::kF32) continue;
    auto it = ops.casts_from.find(t.data());
    if (it == ops.casts_from.end()) continue;  // read in float32 (norms' statistics, the loss)
    ++weights_cast;
    EXPECT_EQ(it->second, 1) << name << " cast " << it->second << " times in 6 steps";
  }
  EXPECT_GT(weights_cast, 4) << "the test meant a model whose GEMMs cast their weights";
  EXPECT_EQ(ops.cast_memo(), nullptr) << "Generate left its memo installed";
}

// A generation reads no amax back and moves no scale, so its FP8 steps run
// as inference: no activation's amax is recorded (every x and grad history
// stays as it was), and each kept FP8 weight copy is checked once a call,
// by the prompt's step, however many tokens follow. The tokens are those of
// the full forwards under the same recipe.
TEST(GenerateTest, Fp8StepsRecordNoAmaxAndCheckEachKeptWeightOncePerCall) {
  CountingOps ops;
  const int64_t batch = 2, prompt_length = 4, new_tokens = 6;
  Fp8Recipe recipe = DelayedRecipe();
  Lm lm = MakeLm(ops, false, {batch, prompt_length + new_tokens}, &recipe);
  ASSERT_NE(lm.with_loss, nullptr);
  Fp8WeightCache cache;
  Fp8Recipe cached = recipe;
  cached.weight_cache = &cache;
  const std::vector<int32_t> prompt = RandomIds(batch * prompt_length, 29);
  int64_t kernel_quantizers = 0;
  for (const auto& [name, t] : lm.vars) {
    kernel_quantizers += absl::StartsWith(name, "fp8_metas/") && absl::StrContains(name, "/kernel") &&
                         absl::EndsWith(name, "_scale");
  }
  ASSERT_GT(kernel_quantizers, 0);
  std::vector<std::vector<int32_t>> made;
  for (const int64_t n : {int64_t{1}, new_tokens}) {
    SCOPED_TRACE(absl::StrCat(n, " new tokens"));
    Fp8WeightCache::Call call(&cache);
    ops.kept_checks = 0;
    GenerateOptions options;
    options.max_new_tokens = n;
    options.fp8 = &cached;
    auto result = Generate(ops, *lm.with_loss, lm.vars, Ids(ops, prompt, {batch, prompt_length}),
                           options, nullptr);
    ASSERT_TRUE(result.ok()) << result.status();
    call.Commit();
    EXPECT_EQ(ops.kept_checks, kernel_quantizers);
    made = result->tokens;
  }
  for (const auto& [name, t] : lm.vars) {
    if (!absl::EndsWith(name, "_amax_history")) continue;
    auto history = HostValues(ops, t);
    ASSERT_TRUE(history.ok());
    const bool kernel = absl::StrContains(name, "/kernel");
    // The kernels' checks wrote their amaxes; nothing else was recorded.
    EXPECT_EQ((*history)[0] != 0.0f, kernel) << name << "[0] = " << (*history)[0];
    for (size_t i = 1; i < history->size(); ++i) ASSERT_EQ((*history)[i], 0.0f) << name;
  }
  EXPECT_EQ(made, GreedyByFullForwards(ops, lm, prompt, batch, new_tokens, &recipe));
}

// On a GPU each host copy is a round trip the step waits for or a transfer
// the stream orders. A greedy step makes one, its tokens down (picked on the
// device, which feeds them to the next step and advances the step state
// itself); a sampled step two, its logits down and its tokens up; however
// deep the model (its attentions share the generation's DecodeContext).
TEST(GenerateTest, AStepCopiesOnlyItsTokensOrLogitsWhateverTheDepth) {
  for (const bool greedy : {true, false}) {
    for (const int layers : {1, 3}) {
      for (const int64_t batch : {1, 2}) {
        SCOPED_TRACE(absl::StrCat(greedy ? "greedy, " : "sampled, ", layers, " layers, batch ",
                                  batch));
        CountingOps ops;
        const int64_t prompt_length = 4;
        Lm lm = MakeLm(ops, true, {batch, prompt_length + 8}, nullptr, true, layers);
        ASSERT_NE(lm.with_loss, nullptr);
        const Tensor prompt =
            Ids(ops, RandomIds(batch * prompt_length, 19), {batch, prompt_length});
        // Copies of a generation of n tokens: the same setup, the prompt's
        // step, then n - 1 one-token steps.
        auto copies = [&](int64_t n) -> std::pair<int64_t, int64_t> {
          GenerateOptions options;
          options.max_new_tokens = n;
          options.sampling.greedy = greedy;
          ops.uploads = ops.downloads = 0;
          auto result = Generate(ops, *lm.with_loss, lm.vars, prompt, options, nullptr);
          EXPECT_TRUE(result.ok()) << result.status();
          return {ops.uploads, ops.downloads};
        };
        const auto [up1, down1] = copies(1);
        const auto [up2, down2] = copies(2);
        const auto [up7, down7] = copies(7);
        EXPECT_EQ(up7 - up2, greedy ? 0 : 5);
        EXPECT_EQ(down7 - down2, 5);
        // The setup: a zero cache index per layer, the query lengths, the
        // relative-bias buckets (one [L, L] table for every layer and step);
        // the prompt's step state; and the first tokens or logits.
        EXPECT_EQ(up1, layers + 3);
        EXPECT_EQ(down1, 1);
        // The first one-token step's state (and a sampled step's tokens).
        EXPECT_EQ(up2 - up1, greedy ? 1 : 2);
        EXPECT_EQ(down2 - down1, 1);
      }
    }
  }
}

TEST(GenerateTest, StopTokensEndEachSequence) {
  auto ops = NewCpuOps();
  const int64_t batch = 2, prompt_length = 4;
  Lm lm = MakeLm(*ops, false, {batch, prompt_length + 8});
  const std::vector<int32_t> prompt = RandomIds(batch * prompt_length, 13);
  const auto greedy = GreedyByFullForwards(*ops, lm, prompt, batch, 8);
  // Sequence 0 stops at its third token; sequence 1 goes on unless it makes
  // that token too.
  GenerateOptions options;
  options.max_new_tokens = 8;
  options.stop_tokens = {greedy[0][2]};
  auto result =
      Generate(*ops, *lm.with_loss, lm.vars, Ids(*ops, prompt, {batch, prompt_length}), options,
               nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int32_t> want;
    for (int32_t t : greedy[b]) {
      want.push_back(t);
      if (t == greedy[0][2]) break;
    }
    EXPECT_EQ(result->tokens[b], want) << b;
    EXPECT_EQ(result->stopped[b], want.back() == greedy[0][2]) << b;
  }
  EXPECT_TRUE(result->stopped[0]);
}

TEST(GenerateTest, SamplingIsReproducibleFromItsSeed) {
  auto ops = NewCpuOps();
  const int64_t batch = 2, prompt_length = 3;
  Lm lm = MakeLm(*ops, true, {batch, prompt_length + 12});
  const Tensor prompt = Ids(*ops, RandomIds(batch * prompt_length, 17), {batch, prompt_length});
  GenerateOptions options;
  options.max_new_tokens = 12;
  options.sampling.greedy = false;
  options.sampling.temperature = 2.0f;  // flat enough that seeds differ
  options.sampling.top_k = 10;
  options.sampling.top_p = 0.95f;
  options.sampling.seed = 1;
  auto a = Generate(*ops, *lm.with_loss, lm.vars, prompt, options, nullptr);
  auto b = Generate(*ops, *lm.with_loss, lm.vars, prompt, options, nullptr);
  options.sampling.seed = 2;
  auto c = Generate(*ops, *lm.with_loss, lm.vars, prompt, options, nullptr);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok()) << a.status() << b.status() << c.status();
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NE(a->tokens, c->tokens);
}

// The sampling order is std::stable_sort's by logit (ties by the lower id)
// at every length kept, on the partial-sort and the radix paths alike: rows
// with ties, -0 and +0, infinities, subnormals and GPT-2's vocabulary; a row
// with a NaN as the stable sort leaves it.
TEST(SampleTokensTest, MostLikelyFirstIsTheStableSortsOrder) {
  std::mt19937 gen(7);
  for (const int64_t vocab : {int64_t{1}, int64_t{5}, int64_t{100}, int64_t{1000}, int64_t{50257}}) {
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(absl::StrCat("vocab ", vocab, ", variant ", variant));
      std::normal_distribution<float> normal(0.0f, 4.0f);
      std::vector<float> row(static_cast<size_t>(vocab));
      for (float& v : row) {
        v = normal(gen);
        if (variant >= 1) v = std::round(v);  // many ties
      }
      if (variant >= 2 && vocab >= 5) {
        row[0] = -0.0f;
        row[1] = 0.0f;
        row[2] = INFINITY;
        row[3] = -INFINITY;
        row[4] = 1e-40f;  // subnormal
      }
      if (variant == 3 && vocab >= 5) row[vocab / 2] = NAN;
      std::vector<int32_t> want(static_cast<size_t>(vocab));
      std::iota(want.begin(), want.end(), 0);
      std::stable_sort(want.begin(), want.end(),
                       [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      for (const size_t keep : {size_t{1}, size_t{3}, size_t{50}, static_cast<size_t>(vocab) / 16,
                                static_cast<size_t>(vocab) / 2, static_cast<size_t>(vocab)}) {
        if (keep < 1 || keep > static_cast<size_t>(vocab)) continue;
        const std::vector<int32_t> got = MostLikelyFirst(row.data(), vocab, keep);
        ASSERT_EQ(got, std::vector<int32_t>(want.begin(), want.begin() + keep)) << "keep " << keep;
      }
    }
  }
}

TEST(SampleTokensTest, GreedyTopKTopPAndTemperature) {
  // One row, probabilities at temperature 1: softmax of log(p).
  const std::vector<double> p = {0.05, 0.4, 0.1, 0.3, 0.15};
  std::vector<float> logits;
  for (double q : p) logits.push_back(static_cast<float>(std::log(q)));
  SamplingOptions greedy;
  auto argmax = SampleTokens(logits, 1, 5, greedy, 0);
  ASSERT_TRUE(argmax.ok());
  EXPECT_EQ((*argmax)[0], 1);

  auto frequencies = [&](SamplingOptions o) {
    std::vector<double> f(5, 0.0);
    const int draws = 20000;
    for (int step = 0; step < draws; ++step) {
      auto t = SampleTokens(logits, 1, 5, o, step);
      EXPECT_TRUE(t.ok());
      f[(*t)[0]] += 1.0 / draws;
    }
    return f;
  };
  SamplingOptions plain;
  plain.greedy = false;
  const std::vector<double> all = frequencies(plain);
  for (int v = 0; v < 5; ++v) EXPECT_NEAR(all[v], p[v], kFrequencyTolerance) << v;

  SamplingOptions top2 = plain;
  top2.top_k = 2;  // tokens 1 and 3: 0.4 / 0.7 and 0.3 / 0.7
  const std::vector<double> k2 = frequencies(top2);
  EXPECT_NEAR(k2[1], 0.4 / 0.7, kFrequencyTolerance);
  EXPECT_NEAR(k2[3], 0.3 / 0.7, kFrequencyTolerance);
  EXPECT_EQ(k2[0] + k2[2] + k2[4], 0.0);

  SamplingOptions nucleus = plain;
  nucleus.top_p = 0.8f;  // 0.4 + 0.3 + 0.15 = 0.85 reaches 0.8: tokens 1, 3, 4
  const std::vector<double> n = frequencies(nucleus);
  EXPECT_NEAR(n[1], 0.4 / 0.85, kFrequencyTolerance);
  EXPECT_NEAR(n[4], 0.15 / 0.85, kFrequencyTolerance);
  EXPECT_EQ(n[0] + n[2], 0.0);

  SamplingOptions hot = plain;
  hot.temperature = 2.0f;  // p^(1/2), renormalised
  double z = 0.0;
  for (double q : p) z += std::sqrt(q);
  const std::vector<double> h = frequencies(hot);
  for (int v = 0; v < 5; ++v) EXPECT_NEAR(h[v], std::sqrt(p[v]) / z, kFrequencyTolerance) << v;

  SamplingOptions bad = plain;
  bad.top_p = 0.0f;
  EXPECT_EQ(SampleTokens(logits, 1, 5, bad, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = plain;
  bad.temperature = 0.0f;
  auto cold = SampleTokens(logits, 1, 5, bad, 0);
  EXPECT_EQ(cold.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(cold.status().message(), "sampling.temperature"));
}

TEST(GenerateTest, InterruptionStopsBetweenTokens) {
  auto ops = NewCpuOps();
  Lm lm = MakeLm(*ops, false, {1, 10});
  int steps = 0;
  ops->set_interrupt_check([&] {
    return steps >= 2 ? absl::CancelledError("Generate: cancelled by the client")
                      : absl::OkStatus();
  });
  GenerateOptions options;
  options.max_new_tokens = 6;
  auto result = Generate(*ops, *lm.with_loss, lm.vars, Ids(*ops, {1, 2, 3}, {1, 3}), options,
                         [&](int64_t, const std::vector<int32_t>&) {
                           ++steps;
                           return absl::OkStatus();
                         });
  EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(steps, 2);
  ops->set_interrupt_check(nullptr);
}

TEST(GenerateTest, BadRequests) {
  auto ops = NewCpuOps();
  Lm lm = MakeLm(*ops, false, {1, 8});
  GenerateOptions options;
  Tensor floats = *ops->Allocate(DType::kF32, {1, 3});
  auto wrong_dtype = Generate(*ops, *lm.with_loss, lm.vars, floats, options, nullptr);
  EXPECT_EQ(wrong_dtype.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong_dtype.status().message(), "prompt"));
  options.max_new_tokens = 0;
  auto none = Generate(*ops, *lm.with_loss, lm.vars, Ids(*ops, {1, 2}, {1, 2}), options, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(none.status().message(), "max_new_tokens"));
}

}  // namespace
}  // namespace te::layers
