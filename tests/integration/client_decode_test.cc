// TE's decode through the C++ client against the real te_server (CPU):
// Init with InitOptions::decode creates the cache collection; Decode runs one
// token and returns y and the new version, the cache staying on the server.
// Decoding a sequence token by token gives, row for row, what one causal
// Apply of the whole sequence gives, for a MultiHeadAttention, a decoder
// TransformerLayer and a graph LM (Embed, MultiHeadAttention, Dense), in
// float32, bfloat16 and FP8 under DelayedScaling. And the failures: a full
// cache, two tokens, an encoder, variables without a cache, a failed step
// leaving the cache as it was, the cache in GetVariables and SetVariables.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "client/graph.h"
#include "client/modules.h"
#include "client/recipe.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

// The largest relative L2 error of one output row, a decode step's against
// the whole sequence's, stated once. float32 on the CPU: each row from the
// same float32 operands. bfloat16: each stage rounds once; where a sum's
// order differs, one ulp (2^-8) in an element, carried on: 2^-7. FP8 under
// DelayedScaling quantizes with the scales of fp8_metas, the same for one
// token as for the sequence (an Apply moves none): the bfloat16 bound.
constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1.0 / 128;
constexpr double kFp8Tolerance = kBf16Tolerance;

constexpr int64_t kB = 2, kLength = 6, kHidden = 32, kVocab = 13, kEncoded = 5;

enum class Precision { kF32, kBF16, kFp8 };

double Tolerance(Precision p) {
  return p == Precision::kF32 ? kF32Tolerance : p == Precision::kBF16 ? kBf16Tolerance : kFp8Tolerance;
}

// Position t of x [B, L, ...] as [B, 1, ...].
HostTensor Position(const HostTensor& x, int64_t t) {
  const int64_t batch = x.shape()[0], length = x.shape()[1];
  const size_t row = x.bytes().size() / static_cast<size_t>(batch * length);
  std::string bytes;
  for (int64_t b = 0; b < batch; ++b) bytes += x.bytes().substr((b * length + t) * row, row);
  Shape shape = x.shape();
  shape[1] = 1;
  return HostTensor::FromBytes(x.dtype(), shape, bytes).value();
}

// Worst over the batch of ||step[b, 0] - full[b, t]|| / ||full[b, t]||.
double RowError(const HostTensor& full, const HostTensor& step, int64_t t) {
  const std::vector<float> f = full.ToFloats(), s = step.ToFloats();
  const int64_t batch = full.shape()[0], length = full.shape()[1];
  const int64_t n = static_cast<int64_t>(s.size()) / batch;
  double worst = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    double diff = 0.0, norm = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = f[(b * length + t) * n + i], got = s[b * n + i];
      diff += (got - want) * (got - want);
      norm += want * want;
    }
    worst = std::max(worst, std::sqrt(diff / std::max(norm, 1e-30)));
  }
  return worst;
}

MultiHeadAttention Mha() {
  MultiHeadAttention mha(/*head_dim=*/8, /*num_attention_heads=*/4);
  mha.num_gqa_groups = 2;
  mha.enable_rotary_pos_emb = true;  // TE decodes separate q, k, v only
  mha.use_bias = true;
  return mha;
}

TransformerLayer Decoder() {
  TransformerLayer layer;
  layer.hidden_size = kHidden;
  layer.mlp_hidden_size = 64;
  layer.num_attention_heads = 4;
  layer.enable_rotary_pos_emb = true;
  layer.use_bias = true;
  layer.layer_type = "decoder";
  return layer;
}

// ids [B, L] -> Embed -> MultiHeadAttention (causal, rotary) -> Dense -> logits.
Graph Lm(DType compute) {
  Graph g("TinyLM", {kB, kLength}, DType::kI32);
  EmbedOptions embed;
  embed.dtype = compute;
  Graph::Edge h = g.Embed(g.x(), kVocab, kHidden, embed);
  h = g.Call(Mha(), {h});
  g.SetOutput(g.Call(FlaxDense(kVocab), {h}));
  return g;
}

int32_t CacheIndex(const Variables& vars, const std::string& name = "cache/cache_index") {
  auto values = GetVariables(vars, {"cache"});
  EXPECT_TRUE(values.ok()) << values.status();
  if (!values.ok() || values->count(name) == 0) return -1;
  return static_cast<int32_t>(values->at(name).ToFloats()[0]);
}

class ClientDecodeTest : public testing::ClientSessionTest {
 protected:

  // Decodes every position of x in turn from `vars`; checks each y against
  // row t of `full` and returns the last variables.
  Variables DecodeAll(const Module& module, Variables vars, const HostTensor& x,
                      const HostTensor& full, double tolerance, const ApplyOptions& options = {}) {
    for (int64_t t = 0; t < x.shape()[1]; ++t) {
      const int64_t read = vars.version();
      absl::StatusOr<DecodeResult> step = module.Decode(vars, Position(x, t), options);
      EXPECT_TRUE(step.ok()) << "token " << t << ": " << step.status();
      if (!step.ok()) return vars;
      EXPECT_EQ(step->y.shape()[1], 1);
      EXPECT_GT(step->variables.version(), read) << "a step makes a new version";
      EXPECT_LE(RowError(full, step->y, t), tolerance) << "token " << t;
      vars = step->variables;
    }
    return vars;
  }

};


class ClientDecodeEqualsApplyTest : public ClientDecodeTest,
                                    public ::testing::WithParamInterface<Precision> {
 protected:
  DType dtype() const { return GetParam() == Precision::kF32 ? DType::kF32 : DType::kBF16; }
  std::optional<Autocast> Scope() const {
    if (GetParam() != Precision::kFp8) return std::nullopt;
    DelayedScaling recipe;
    recipe.amax_history_len = 4;
    return std::make_optional<Autocast>(true, recipe);
  }
};

TEST_P(ClientDecodeEqualsApplyTest, MultiHeadAttention) {
  const std::optional<Autocast> fp8 = Scope();
  const MultiHeadAttention mha = Mha();
  const HostTensor x = HostTensor::RandomNormal({kB, kLength, kHidden}, dtype(), 1);
  InitOptions init;
  init.decode = true;
  absl::StatusOr<Variables> vars = mha.Init(*session_, 2, x, init);
  ASSERT_TRUE(vars.ok()) << vars.status();
  ASSERT_TRUE(vars->HasCollection("cache"));
  absl::StatusOr<HostTensor> full = mha.Apply(*vars, x);
  ASSERT_TRUE(full.ok()) << full.status();
  const Variables last = DecodeAll(mha, vars->Pinned(), x, *full, Tolerance(GetParam()));
  EXPECT_EQ(CacheIndex(last), kLength);
}

TEST_P(ClientDecodeEqualsApplyTest, DecoderTransformerLayer) {
  const std::optional<Autocast> fp8 = Scope();
  const TransformerLayer layer = Decoder();
  const HostTensor x = HostTensor::RandomNormal({kB, kLength, kHidden}, dtype(), 3);
  ApplyOptions options;
  options.extra_inputs = {HostTensor::RandomNormal({kB, kEncoded, kHidden}, dtype(), 4)};
  InitOptions init;
  init.decode = true;
  absl::StatusOr<Variables> vars = layer.Init(*session_, 5, x, init);
  ASSERT_TRUE(vars.ok()) << vars.status();
  absl::StatusOr<HostTensor> full = layer.Apply(*vars, x, options);
  ASSERT_TRUE(full.ok()) << full.status();
  const Variables last = DecodeAll(layer, *vars, x, *full, Tolerance(GetParam()), options);
  EXPECT_EQ(CacheIndex(last, "cache/self_attention/cache_index"), kLength);
}

TEST_P(ClientDecodeEqualsApplyTest, GraphLm) {
  const std::optional<Autocast> fp8 = Scope();
  const Graph lm = Lm(dtype());
  std::vector<float> ids(kB * kLength);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<float>((i * 7 + 3) % kVocab);
  const HostTensor x = HostTensor::FromFloats({kB, kLength}, ids, DType::kI32).value();
  InitOptions init;
  init.decode = true;
  absl::StatusOr<Variables> vars = lm.Init(*session_, 6, x, init);
  ASSERT_TRUE(vars.ok()) << vars.status();
  absl::StatusOr<HostTensor> full = lm.Apply(*vars, x);
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_EQ(full->shape(), (Shape{kB, kLength, kVocab}));
  const Variables last = DecodeAll(lm, *vars, x, *full, Tolerance(GetParam()));
  EXPECT_EQ(CacheIndex(last, "cache/MultiHeadAttention_0/cache_index"), kLength);
}

INSTANTIATE_TEST_SUITE_P(Precisions, ClientDecodeEqualsApplyTest,
                         ::testing::Values(Precision::kF32, Precision::kBF16, Precision::kFp8),
                         [](const ::testing::TestParamInfo<Precision>& info) {
                           return info.param == Precision::kF32    ? std::string("F32")
                                  : info.param == Precision::kBF16 ? std::string("BF16")
                                                                   : std::string("Fp8Delayed");
                         });

// ---- failures ---------------------------------------------------------------------

class ClientDecodeErrorsTest : public ClientDecodeTest {
 protected:
  void SetUp() override {
    ClientDecodeTest::SetUp();
    x_ = HostTensor::RandomNormal({kB, 4, kHidden}, DType::kF32, 7);
    InitOptions init;
    init.decode = true;
    absl::StatusOr<Variables> vars = mha_.Init(*session_, 8, x_, init);
    ASSERT_TRUE(vars.ok()) << vars.status();
    init_ = vars->Pinned();
    absl::StatusOr<HostTensor> full = mha_.Apply(init_, x_);
    ASSERT_TRUE(full.ok()) << full.status();
    full_ = *full;
    absl::StatusOr<DecodeResult> first = mha_.Decode(init_, Position(x_, 0));
    ASSERT_TRUE(first.ok()) << first.status();
    one_ = first->variables;
  }

  // The next token from `vars` (holding one) is x's row 1.
  void ExpectDecodesRowOne(const Variables& vars) {
    absl::StatusOr<DecodeResult> next = mha_.Decode(vars, Position(x_, 1));
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_LE(RowError(full_, next->y, 1), kF32Tolerance);
  }

  const MultiHeadAttention mha_ = Mha();
  HostTensor x_, full_;
  Variables init_, one_;
};

TEST_F(ClientDecodeErrorsTest, DecodeReturnsANewValueAndLeavesTheOneItRead) {
  EXPECT_FALSE(one_.live());
  EXPECT_EQ(one_.version(), init_.version() + 1);
  EXPECT_EQ(CacheIndex(init_), 0);
  EXPECT_EQ(CacheIndex(one_), 1);
  // Apply does not write the cache, as Flax's immutable collections.
  ApplyOptions decode;
  decode.decode = true;
  absl::StatusOr<HostTensor> y = mha_.Apply(one_, Position(x_, 1), decode);
  EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(y.status().message(), "immutable")) << y.status();
}

TEST_F(ClientDecodeErrorsTest, TwoTokensNameXAndLeaveTheCacheAsItWas) {
  HostTensor two = HostTensor::RandomNormal({kB, 2, kHidden}, DType::kF32, 9);
  absl::StatusOr<DecodeResult> step = mha_.Decode(one_, two);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(step.status().message(), "x.shape [2, 2, 32]")) << step.status();
  EXPECT_EQ(CacheIndex(one_), 1);
  ExpectDecodesRowOne(one_);
}

TEST_F(ClientDecodeErrorsTest, AFullCacheNamesCacheIndex) {
  Variables vars = one_;
  for (int64_t t = 1; t < 4; ++t) {
    absl::StatusOr<DecodeResult> step = mha_.Decode(vars, Position(x_, t));
    ASSERT_TRUE(step.ok()) << step.status();
    vars = step->variables;
  }
  absl::StatusOr<DecodeResult> past = mha_.Decode(vars, Position(x_, 0));
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past.status().message(), "cache_index is 4")) << past.status();
  EXPECT_EQ(CacheIndex(vars), 4);
}

TEST_F(ClientDecodeErrorsTest, VariablesWithoutACacheAreFailedPrecondition) {
  absl::StatusOr<Variables> plain = mha_.Init(*session_, 8, x_);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->HasCollection("cache"));
  absl::StatusOr<DecodeResult> step = mha_.Decode(*plain, Position(x_, 0));
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition) << step.status();
}

TEST_F(ClientDecodeErrorsTest, AnEncoderIsRefusedNamingDecode) {
  TransformerLayer encoder = Decoder();
  encoder.layer_type = "encoder";
  InitOptions init;
  init.decode = true;
  absl::StatusOr<Variables> vars = encoder.Init(*session_, 1, x_, init);
  EXPECT_EQ(vars.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(
      vars.status().message(),
      "decode: decode should be False when layer_type == TransformerLayerType.ENCODER"))
      << vars.status();
}

TEST_F(ClientDecodeErrorsTest, TheCacheIsACollectionOfGetAndSetVariables) {
  absl::StatusOr<std::map<std::string, HostTensor>> cache = GetVariables(one_, {"cache"});
  ASSERT_TRUE(cache.ok()) << cache.status();
  ASSERT_EQ(cache->size(), 3u);
  const std::vector<float> key = cache->at("cache/cached_key").ToFloats();
  const size_t row = 2 * 8, length = 4;
  for (size_t b = 0; b < kB; ++b) {
    double written = 0.0, rest = 0.0;
    for (size_t i = 0; i < row; ++i) written += std::fabs(key[b * length * row + i]);
    for (size_t i = row; i < length * row; ++i) rest += std::fabs(key[b * length * row + i]);
    EXPECT_GT(written, 0.0);
    EXPECT_EQ(rest, 0.0);
  }
  // The one-token cache set into init's version decodes on from position 1.
  te::v1::SetVariablesRequest set;
  set.set_layer_id(init_.layer_id);
  set.set_version(init_.version());
  for (const auto& [name, value] : *cache) {
    te::v1::Variable* v = set.add_variables();
    v->set_collection("cache");
    v->set_path(name.substr(6));
    *v->mutable_value() = ToInlineProto(value);
  }
  absl::StatusOr<te::v1::SetVariablesResponse> made = session_->SetVariables(set);
  ASSERT_TRUE(made.ok()) << made.status();
  te::v1::ForwardRequest request;
  request.set_layer_id(init_.layer_id);
  request.set_version(made->version());
  request.set_decode(true);
  request.set_deterministic(true);
  *request.mutable_x() = ToInlineProto(Position(x_, 1));
  absl::StatusOr<te::v1::ForwardResponse> next = session_->Forward(request);
  ASSERT_TRUE(next.ok()) << next.status();
  absl::StatusOr<HostTensor> y = FromInlineProto(next->y(), "y");
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_LE(RowError(full_, *y, 1), kF32Tolerance);
  EXPECT_GT(next->version(), made->version());
}

}  // namespace
}  // namespace te::client
