// TE's decode through the session (session.h, contract 11): InitLayer with
// decode creates the `cache` collection in the session's memory; Forward with
// decode advances it as a new version, so that decoding a sequence one token
// at a time gives, row for row, what one causal forward of the whole
// sequence gives (a MultiHeadAttention, a DECODER TransformerLayer and a
// graph LM; float32, bfloat16, FP8 under DelayedScaling); the version read
// stays as it was, also when a step fails, is cancelled, or decodes again
// from an older version (a branch); the cache is a collection for
// GetVariables and SetVariables; TE's refusals name their field.
//
// Built twice: on the CPU (decode_session_test) and, with
// TE_SESSION_TEST_GPU, on the CUDA backend (decode_session_gpu_test, tag
// gpu), where without a GPU every test is skipped unless TE_REQUIRE_GPU=1.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/fp8.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/session/session.h"
#include "server/session/testing/requests.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

using testing::AddNode;

// Tolerances: the largest relative L2 error of one output row, a decode
// step's against the forward's, stated once per backend.
#ifdef TE_SESSION_TEST_GPU
// float32 at HIGHEST precision: GEMMs over B rows and over B * L rows, and
// the one-query attention against the forward's, add in other orders.
constexpr double kF32Tolerance = 1e-4;
// bfloat16, and FP8 under DelayedScaling (the forward's scales, so its
// codes, with bfloat16 outputs): one-ulp differences where the two paths'
// float32 values straddle a rounding, carried through the stages.
constexpr double kBf16Tolerance = 2e-2;
#else
// float32 on the CPU: each row from the same float32 operands.
constexpr double kF32Tolerance = 1e-5;
// bfloat16: each stage rounds once; where a sum's order differs, one ulp
// (2^-8) in an element, carried on: 2^-7.
constexpr double kBf16Tolerance = 1.0 / 128;
#endif
constexpr double kFp8Tolerance = kBf16Tolerance;

constexpr int64_t kHidden = 32, kVocab = 13, kEncoded = 5;

enum class Kind { kMha, kDecoderLayer, kGraphLm };
enum class Precision { kF32, kBF16, kFp8 };

te::v1::MultiHeadAttention MhaSpec() {
  te::v1::MultiHeadAttention mha;
  mha.set_head_dim(8);
  mha.set_num_attention_heads(4);
  mha.set_num_gqa_groups(2);
  mha.set_enable_rotary_pos_emb(true);  // TE decodes separate q, k, v only
  mha.set_use_bias(true);
  return mha;
}

te::v1::LayerSpec DecoderLayerSpec() {
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* layer = spec.mutable_transformer_layer();
  layer->set_hidden_size(kHidden);
  layer->set_mlp_hidden_size(64);
  layer->set_num_attention_heads(4);
  layer->set_enable_rotary_pos_emb(true);
  layer->set_layer_type(te::v1::DECODER);
  layer->set_use_bias(true);
  return spec;
}

// ids [B, L] -> Embed -> LayerNorm -> MultiHeadAttention (causal, rotary) ->
// Dense -> logits [B, L, vocab]: a traced LM whose one attention decodes.
te::v1::LayerSpec GraphLmSpec() {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  te::v1::FlaxEmbed* embed =
      AddNode(g, "Embed_0", {"x"}, {"h"})->mutable_module()->mutable_flax_embed();
  embed->set_num_embeddings(kVocab);
  embed->set_features(kHidden);
  AddNode(g, "LayerNorm_0", {"h"}, {"n"})->mutable_module()->mutable_layer_norm();
  *AddNode(g, "MultiHeadAttention_0", {"n"}, {"a"})->mutable_module()->mutable_multi_head_attention() =
      MhaSpec();
  AddNode(g, "Dense_0", {"a"}, {"logits"})->mutable_module()->mutable_flax_dense()->set_features(
      kVocab);
  g->add_outputs("logits");
  return spec;
}

te::v1::Tensor Floats(const std::vector<int64_t>& shape, uint64_t seed, te::v1::DType dtype) {
  return testing::RandomFloats(shape, seed, 1.0f, dtype);
}

te::v1::Tensor Ids(const std::vector<int64_t>& shape, uint64_t seed) {
  return testing::RandomIds(shape, seed, kVocab);
}

// Elements as float (float32, bfloat16 or int32 inline data).
std::vector<float> Values(const te::v1::Tensor& t) {
  const std::string& bytes = t.inline_data();
  std::vector<float> v;
  if (t.dtype() == te::v1::BFLOAT16) {
    std::vector<uint16_t> b(bytes.size() / 2);
    std::memcpy(b.data(), bytes.data(), bytes.size());
    for (uint16_t h : b) v.push_back(Bf16ToFloat(h));
  } else if (t.dtype() == te::v1::INT32) {
    std::vector<int32_t> i(bytes.size() / 4);
    std::memcpy(i.data(), bytes.data(), bytes.size());
    for (int32_t x : i) v.push_back(static_cast<float>(x));
  } else {
    v.resize(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
  }
  return v;
}

// Positions t of x [B, L, ...] as [B, 1, ...] (same dtype, inline).
te::v1::Tensor Position(const te::v1::Tensor& x, int64_t t) {
  const int64_t batch = x.shape(0), length = x.shape(1);
  const int64_t row = static_cast<int64_t>(x.inline_data().size()) / (batch * length);
  te::v1::Tensor out = x;
  out.set_shape(1, 1);
  std::string bytes;
  for (int64_t b = 0; b < batch; ++b) bytes += x.inline_data().substr((b * length + t) * row, row);
  out.set_inline_data(bytes);
  return out;
}

// Relative L2 error of row (b, t) of `step` ([B, 1, F]) against row (b, t) of
// `full` ([B, L, F]), the worst over b.
double RowError(const std::vector<float>& full, const std::vector<float>& step, int64_t batch,
                int64_t length, int64_t t) {
  const int64_t f = static_cast<int64_t>(step.size()) / batch;
  double worst = 0.0;
  for (int64_t b = 0; b < batch; ++b) {
    double diff = 0.0, norm = 0.0;
    for (int64_t i = 0; i < f; ++i) {
      const double want = full[(b * length + t) * f + i];
      const double got = step[b * f + i];
      diff += (got - want) * (got - want);
      norm += want * want;
    }
    worst = std::max(worst, std::sqrt(diff / std::max(norm, 1e-30)));
  }
  return worst;
}

te::v1::Autocast DelayedScaling() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  return autocast;
}

class DecodeSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef TE_SESSION_TEST_GPU
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
#else
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCpuDevice();
    ASSERT_TRUE(device.ok()) << device.status();
#endif
    device_ = *std::move(device);
    Open(int64_t{1} << 30);
  }

  void Open(int64_t memory, const SessionConfig& config = SessionConfig()) {
    session_.reset();
    session_ = std::make_unique<Session>("decode", device_->info(), *device_->NewOps(memory),
                                         config, te::v1::EMULATE, std::nullopt);
  }

  absl::StatusOr<te::v1::InitLayerResponse> Init(const te::v1::LayerSpec& spec,
                                                 std::vector<int64_t> shape, te::v1::DType dtype,
                                                 bool decode, bool fp8 = false) {
    te::v1::InitLayerRequest request;
    *request.mutable_spec() = spec;
    request.set_seed(5);
    request.set_input_dtype(dtype);
    request.mutable_input_shape()->Assign(shape.begin(), shape.end());
    request.set_decode(decode);
    if (fp8) *request.mutable_autocast() = DelayedScaling();
    te::v1::InitLayerResponse response;
    RETURN_IF_ERROR(session_->InitLayer(request, &response));
    return response;
  }

  te::v1::ForwardRequest Request(const std::string& layer, const te::v1::Tensor& x, bool decode,
                                 int64_t version) const {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer);
    *request.mutable_x() = x;
    if (encoded_.dtype() != te::v1::DTYPE_UNSPECIFIED) *request.add_extra_inputs() = encoded_;
    request.set_deterministic(true);
    request.set_decode(decode);
    request.set_version(version);
    request.set_matmul_precision(te::v1::PRECISION_HIGHEST);
    if (fp8_) *request.mutable_autocast() = DelayedScaling();
    return request;
  }

  absl::StatusOr<te::v1::ForwardResponse> Forward(const std::string& layer,
                                                  const te::v1::Tensor& x, bool decode,
                                                  int64_t version = 0,
                                                  const CallContext& call = CallContext()) {
    te::v1::ForwardResponse response;
    RETURN_IF_ERROR(session_->Forward(Request(layer, x, decode, version), &response, call));
    return response;
  }

  // "collection/path" -> value of a version's variables in `collection`.
  std::map<std::string, te::v1::Tensor> Variables(const std::string& layer, int64_t version,
                                                  const std::string& collection = "cache") {
    te::v1::GetVariablesRequest request;
    request.set_layer_id(layer);
    request.set_version(version);
    request.add_collections(collection);
    te::v1::GetVariablesResponse response;
    const absl::Status status = session_->GetVariables(request, &response);
    EXPECT_TRUE(status.ok()) << status;
    std::map<std::string, te::v1::Tensor> out;
    for (const te::v1::Variable& v : response.variables()) {
      out[v.collection() + "/" + v.path()] = v.value();
    }
    return out;
  }

  int32_t CacheIndex(const std::string& layer, int64_t version,
                     const std::string& name = "cache/cache_index") {
    const std::map<std::string, te::v1::Tensor> cache = Variables(layer, version);
    auto it = cache.find(name);
    if (it == cache.end()) {
      ADD_FAILURE() << "no " << name;
      return -1;
    }
    return static_cast<int32_t>(Values(it->second)[0]);
  }

  std::string InitMha(int64_t batch, int64_t length) {
    te::v1::LayerSpec spec;
    *spec.mutable_multi_head_attention() = MhaSpec();
    auto init = Init(spec, {batch, length, kHidden}, te::v1::FLOAT32, true);
    EXPECT_TRUE(init.ok()) << init.status();
    return init.ok() ? init->layer_id() : "";
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
  te::v1::Tensor encoded_;  // a DECODER's `encoded`, sent with every call
  bool fp8_ = false;
};

// ---- init -------------------------------------------------------------------------

TEST_F(DecodeSessionTest, InitCreatesTheCacheAsTeNamesItInTheSessionsMemory) {
  te::v1::LayerSpec spec;
  *spec.mutable_multi_head_attention() = MhaSpec();
  const int64_t before = session_->bytes_in_use();
  auto plain = Init(spec, {3, 10, kHidden}, te::v1::BFLOAT16, false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const int64_t params = session_->bytes_in_use() - before;
  auto init = Init(spec, {3, 10, kHidden}, te::v1::BFLOAT16, true);
  ASSERT_TRUE(init.ok()) << init.status();
  std::map<std::string, te::v1::VariableInfo> infos;
  for (const te::v1::VariableInfo& v : init->variables()) infos[v.collection() + "/" + v.path()] = v;
  ASSERT_EQ(infos.count("cache/cached_key"), 1u);
  const te::v1::VariableInfo& key = infos["cache/cached_key"];
  EXPECT_EQ(std::vector<int64_t>(key.shape().begin(), key.shape().end()),
            (std::vector<int64_t>{3, 10, 2, 8}));  // [B, L, kv heads, head_dim]
  EXPECT_EQ(key.dtype(), te::v1::BFLOAT16);         // x's dtype
  EXPECT_EQ(infos["cache/cached_value"].shape_size(), 4);
  EXPECT_EQ(infos["cache/cache_index"].shape_size(), 0);
  EXPECT_EQ(infos["cache/cache_index"].dtype(), te::v1::INT32);
  // Counted: params again plus 2 x 3 * 10 * 2 * 8 bfloat16 and the index.
  const int64_t cache_bytes = 2 * 3 * 10 * 2 * 8 * 2 + 4;
  EXPECT_GE(session_->bytes_in_use() - before - params, params + cache_bytes);
  const std::map<std::string, te::v1::Tensor> cache = Variables(init->layer_id(), 0);
  ASSERT_EQ(cache.size(), 3u);
  for (const auto& [name, value] : cache) {
    for (float v : Values(value)) ASSERT_EQ(v, 0.0f) << name;
  }
  // The layer without decode has none.
  EXPECT_TRUE(Variables(plain->layer_id(), 0).empty());
}

TEST_F(DecodeSessionTest, InitRefusesLayersTeDoesNotDecode) {
  te::v1::LayerSpec encoder = DecoderLayerSpec();
  encoder.mutable_transformer_layer()->set_layer_type(te::v1::ENCODER);
  auto init = Init(encoder, {2, 6, kHidden}, te::v1::FLOAT32, true);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(
      init.status().message(),
      "decode: decode should be False when layer_type == TransformerLayerType.ENCODER"))
      << init.status();
  te::v1::LayerSpec fused;
  *fused.mutable_multi_head_attention() = MhaSpec();
  fused.mutable_multi_head_attention()->set_enable_rotary_pos_emb(false);
  init = Init(fused, {2, 6, kHidden}, te::v1::FLOAT32, true);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(init.status().message(),
                                "decode mode requires QKVLayout.BSHD_BSHD_BSHD"))
      << init.status();
  te::v1::LayerSpec dense;
  dense.mutable_dense_general()->add_features(8);
  init = Init(dense, {2, 6, kHidden}, te::v1::FLOAT32, true);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(init.status().message(), "decode")) << init.status();
  // A graph with no attention that decodes.
  te::v1::LayerSpec graph;
  AddNode(graph.mutable_graph(), "Dense_0", {"x"}, {"y"})
      ->mutable_module()
      ->mutable_flax_dense()
      ->set_features(4);
  graph.mutable_graph()->add_outputs("y");
  init = Init(graph, {2, 6, kHidden}, te::v1::FLOAT32, true);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(init.status().message(), "decode")) << init.status();
  te::v1::SessionInfo info;
  session_->GetSessionInfo(&info);
  EXPECT_EQ(info.layers(), 0);
  EXPECT_EQ(info.memory_bytes(), 0);
}

TEST_F(DecodeSessionTest, ACacheThatDoesNotFitIsResourceExhausted) {
  Open(int64_t{1} << 20);
  te::v1::LayerSpec spec;
  *spec.mutable_multi_head_attention() = MhaSpec();
  // Params fit; 2 x 64 * 1024 * 2 * 8 float32 (8 MiB) of cache does not.
  auto init = Init(spec, {64, 1024, kHidden}, te::v1::FLOAT32, true);
  EXPECT_EQ(init.status().code(), absl::StatusCode::kResourceExhausted) << init.status();
  EXPECT_EQ(session_->bytes_in_use(), 0);
}

// ---- decode equals the causal forward -------------------------------------------

struct EqualsCase {
  Kind kind;
  Precision precision;
  int64_t batch;
};

void PrintTo(const EqualsCase& c, std::ostream* os) {
  *os << static_cast<int>(c.kind) << " " << static_cast<int>(c.precision) << " batch " << c.batch;
}

class DecodeEqualsForwardTest : public DecodeSessionTest,
                                public ::testing::WithParamInterface<EqualsCase> {};

TEST_P(DecodeEqualsForwardTest, TokenByTokenEqualsOneCausalForwardRowForRow) {
  const EqualsCase& c = GetParam();
  const int64_t length = 6;
  const te::v1::DType dtype = c.precision == Precision::kF32 ? te::v1::FLOAT32 : te::v1::BFLOAT16;
  fp8_ = c.precision == Precision::kFp8;
  te::v1::LayerSpec spec;
  te::v1::Tensor x;
  std::vector<int64_t> shape = {c.batch, length};
  std::string index = "cache/cache_index";
  switch (c.kind) {
    case Kind::kMha:
      *spec.mutable_multi_head_attention() = MhaSpec();
      shape.push_back(kHidden);
      x = Floats(shape, 11, dtype);
      break;
    case Kind::kDecoderLayer:
      spec = DecoderLayerSpec();
      shape.push_back(kHidden);
      x = Floats(shape, 11, dtype);
      encoded_ = Floats({c.batch, kEncoded, kHidden}, 12, dtype);
      index = "cache/self_attention/cache_index";
      break;
    case Kind::kGraphLm:
      spec = GraphLmSpec();
      x = Ids(shape, 11);
      index = "cache/MultiHeadAttention_0/cache_index";
      if (dtype == te::v1::BFLOAT16) {
        // nn.Embed(dtype=jnp.bfloat16): the activations from it on.
        spec.mutable_graph()->mutable_nodes(0)->mutable_module()->mutable_flax_embed()->set_dtype(
            te::v1::BFLOAT16);
      }
      break;
  }
  auto init = Init(spec, shape, c.kind == Kind::kGraphLm ? te::v1::INT32 : dtype, true, fp8_);
  ASSERT_TRUE(init.ok()) << init.status();
  const std::string layer = init->layer_id();
  auto full = Forward(layer, x, /*decode=*/false);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->version(), 1);  // a forward changes nothing
  const std::vector<float> want = Values(full->y());
  const int64_t length_read = full->y().shape(1);
  ASSERT_EQ(length_read, length);

  const double tolerance = c.precision == Precision::kF32    ? kF32Tolerance
                           : c.precision == Precision::kBF16 ? kBf16Tolerance
                                                             : kFp8Tolerance;
  int64_t version = 1;
  for (int64_t t = 0; t < length; ++t) {
    auto step = Forward(layer, Position(x, t), /*decode=*/true, version);
    ASSERT_TRUE(step.ok()) << "token " << t << ": " << step.status();
    EXPECT_EQ(step->y().shape(1), 1);
    EXPECT_EQ(step->version(), version + 1) << "a step makes the next version";
    EXPECT_LE(RowError(want, Values(step->y()), c.batch, length, t), tolerance) << "token " << t;
    version = step->version();
  }
  EXPECT_EQ(CacheIndex(layer, version, index), length);
  // Every version read kept its cache: version v holds v - 1 tokens.
  for (int64_t v = 1; v < version; ++v) EXPECT_EQ(CacheIndex(layer, v, index), v - 1);
}

std::string EqualsName(const ::testing::TestParamInfo<EqualsCase>& info) {
  const EqualsCase& c = info.param;
  const char* kind = c.kind == Kind::kMha            ? "Mha"
                     : c.kind == Kind::kDecoderLayer ? "DecoderLayer"
                                                     : "GraphLm";
  const char* precision = c.precision == Precision::kF32    ? "F32"
                          : c.precision == Precision::kBF16 ? "BF16"
                                                            : "Fp8Delayed";
  return absl::StrCat(kind, precision, "Batch", c.batch);
}

INSTANTIATE_TEST_SUITE_P(
    Layers, DecodeEqualsForwardTest,
    ::testing::Values(EqualsCase{Kind::kMha, Precision::kF32, 1},
                      EqualsCase{Kind::kMha, Precision::kF32, 3},
                      EqualsCase{Kind::kMha, Precision::kBF16, 2},
                      EqualsCase{Kind::kMha, Precision::kFp8, 2},
                      EqualsCase{Kind::kDecoderLayer, Precision::kF32, 2},
                      EqualsCase{Kind::kDecoderLayer, Precision::kBF16, 1},
                      EqualsCase{Kind::kDecoderLayer, Precision::kFp8, 2},
                      EqualsCase{Kind::kGraphLm, Precision::kF32, 2},
                      EqualsCase{Kind::kGraphLm, Precision::kBF16, 2},
                      EqualsCase{Kind::kGraphLm, Precision::kFp8, 1}),
    EqualsName);

// ---- generation ------------------------------------------------------------------

// Session::Generate with its steps recorded and replayed (the default) makes
// the tokens of steps run one by one, greedy and sampled, in bfloat16 and
// under DelayedScaling, whose steps read the layer's kept FP8 weight copies.
TEST_F(DecodeSessionTest, GenerateMakesTheSameTokensWithStepsReplayedOrNot) {
  const int64_t batch = 2, prompt_length = 3, new_tokens = 9;
  for (const bool fp8 : {false, true}) {
    for (const bool sample : {false, true}) {
      SCOPED_TRACE(absl::StrCat(fp8 ? "fp8" : "bf16", sample ? ", sampled" : ", greedy"));
      std::vector<std::vector<int32_t>> tokens[2];
      for (const bool replay : {false, true}) {
        SessionConfig config;
        config.replay_decode_steps = replay;
        Open(int64_t{1} << 30, config);
        te::v1::LayerSpec spec = GraphLmSpec();
        spec.mutable_graph()->mutable_nodes(0)->mutable_module()->mutable_flax_embed()->set_dtype(
            te::v1::BFLOAT16);
        auto init =
            Init(spec, {batch, prompt_length + new_tokens}, te::v1::INT32, false, fp8);
        ASSERT_TRUE(init.ok()) << init.status();
        te::v1::GenerateRequest request;
        request.set_layer_id(init->layer_id());
        *request.mutable_prompt() = Ids({batch, prompt_length}, 31);
        request.set_max_new_tokens(new_tokens);
        request.mutable_sampling()->set_sample(sample);
        request.mutable_sampling()->set_temperature(0.8f);
        request.mutable_sampling()->set_seed(4);
        if (fp8) *request.mutable_autocast() = DelayedScaling();
        // Twice: the second generation finds the FP8 weight copies made.
        for (int round = 0; round < 2; ++round) {
          std::vector<std::vector<int32_t>> made;
          const absl::Status status = session_->Generate(
              request,
              [&](const te::v1::GenerateResponse& step) {
                made.emplace_back(step.tokens().begin(), step.tokens().end());
                return absl::OkStatus();
              },
              CallContext());
          ASSERT_TRUE(status.ok()) << status;
          ASSERT_EQ(made.size(), static_cast<size_t>(new_tokens));
          if (round == 0) tokens[replay] = made;
          EXPECT_EQ(made, tokens[replay]) << "round " << round;
        }
      }
      EXPECT_EQ(tokens[1], tokens[0]);
    }
  }
}

// ---- versions ------------------------------------------------------------------

// Decoding again from an older version (another token at the same position)
// must not write over the rows a newer version reads: the step copies the
// keys and values the newer one holds, and both go on as they should.
TEST_F(DecodeSessionTest, ABranchFromAnOlderVersionLeavesTheNewerOneAsItWas) {
  const int64_t length = 5;
  const std::string layer = InitMha(2, length);
  const te::v1::Tensor x = Floats({2, length, kHidden}, 21, te::v1::FLOAT32);
  auto full = Forward(layer, x, false);
  ASSERT_TRUE(full.ok());
  const std::vector<float> want = Values(full->y());
  int64_t version = 1;
  for (int64_t t = 0; t < 3; ++t) version = Forward(layer, Position(x, t), true, version)->version();
  ASSERT_EQ(version, 4);
  const std::map<std::string, te::v1::Tensor> newest = Variables(layer, 4);
  const int64_t before_branch = session_->bytes_in_use();
  // Version 2 holds one token; decode another one at position 1.
  auto branch = Forward(layer, Floats({2, 1, kHidden}, 99, te::v1::FLOAT32), true, 2);
  ASSERT_TRUE(branch.ok()) << branch.status();
  EXPECT_EQ(branch->version(), 5);
  EXPECT_EQ(CacheIndex(layer, 5), 2);
  // It paid for its own keys and values.
  EXPECT_GE(session_->bytes_in_use() - before_branch, 2 * 2 * length * 2 * 8 * 4);
  const std::map<std::string, te::v1::Tensor> after = Variables(layer, 4);
  for (const auto& [name, value] : newest) {
    EXPECT_EQ(after.at(name).inline_data(), value.inline_data()) << name;
  }
  auto next = Forward(layer, Position(x, 3), true, 4);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_LE(RowError(want, Values(next->y()), 2, length, 3), kF32Tolerance);
  // And the branch goes on from its own rows: position 2 of x after
  // [x0, z] is not x's row 2.
  auto on_branch = Forward(layer, Position(x, 2), true, 5);
  ASSERT_TRUE(on_branch.ok()) << on_branch.status();
  EXPECT_GT(RowError(want, Values(on_branch->y()), 2, length, 2), 1e-3);
  // Decoding the newest further from a version that nobody holds past it
  // copies nothing.
  const int64_t before_step = session_->bytes_in_use();
  ASSERT_TRUE(Forward(layer, Position(x, 4), true, next->version()).ok());
  EXPECT_LT(session_->bytes_in_use() - before_step, 2 * length * 2 * 8 * 4);
}

TEST_F(DecodeSessionTest, ReleaseAndDeleteLayerFreeTheCache) {
  const te::v1::Tensor x = Floats({2, 4, kHidden}, 23, te::v1::FLOAT32);
  // What the session keeps besides its layers (on the GPU, the attention
  // workspace its first forward allocates and holds): a throwaway layer's
  // step draws it, and deleting that layer leaves only it.
  {
    te::v1::DeleteLayerRequest warm_up;
    warm_up.set_layer_id(InitMha(2, 4));
    ASSERT_TRUE(Forward(warm_up.layer_id(), Position(x, 0), true, 1).ok());
    ASSERT_TRUE(session_->DeleteLayer(warm_up).ok());
  }
  const int64_t without_layers = session_->bytes_in_use();
  const std::string layer = InitMha(2, 4);
  ASSERT_TRUE(Forward(layer, Position(x, 0), true, 1).ok());  // 2
  ASSERT_TRUE(Forward(layer, Position(x, 1), true, 2).ok());  // 3
  const int64_t chain = session_->bytes_in_use();
  ASSERT_TRUE(Forward(layer, Position(x, 0), true, 1).ok());  // 4: a branch, its own copy
  EXPECT_GT(session_->bytes_in_use(), chain);
  te::v1::ReleaseVersionsRequest release;
  release.set_layer_id(layer);
  release.add_versions(4);
  ASSERT_TRUE(session_->ReleaseVersions(release).ok());
  EXPECT_EQ(session_->bytes_in_use(), chain);
  te::v1::DeleteLayerRequest remove;
  remove.set_layer_id(layer);
  ASSERT_TRUE(session_->DeleteLayer(remove).ok());
  EXPECT_EQ(session_->bytes_in_use(), without_layers);
}

// ---- errors: the field named, every version as it was ------------------------------

class DecodeErrorsTest : public DecodeSessionTest {
 protected:
  void SetUp() override {
    DecodeSessionTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    layer_ = InitMha(2, kLength);
    x_ = Floats({2, kLength, kHidden}, 31, te::v1::FLOAT32);
    auto full = Forward(layer_, x_, false);
    ASSERT_TRUE(full.ok());
    want_ = Values(full->y());
    auto first = Forward(layer_, Position(x_, 0), true, 1);
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_EQ(first->version(), 2);
    cache_ = Variables(layer_, 2);
  }
  // Nothing changed: no new version, version 2's cache as it was, and the
  // next step from it gives x's row 1.
  void ExpectUnchanged() {
    te::v1::GetVariablesRequest newest;
    newest.set_layer_id(layer_);
    te::v1::GetVariablesResponse response;
    ASSERT_TRUE(session_->GetVariables(newest, &response).ok());
    EXPECT_EQ(response.version(), 2);
    const std::map<std::string, te::v1::Tensor> now = Variables(layer_, 2);
    for (const auto& [name, value] : cache_) {
      EXPECT_EQ(now.at(name).inline_data(), value.inline_data()) << name;
    }
    auto next = Forward(layer_, Position(x_, 1), true, 2);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_LE(RowError(want_, Values(next->y()), 2, kLength, 1), kF32Tolerance);
  }

  static constexpr int64_t kLength = 4;
  std::string layer_;
  te::v1::Tensor x_;
  std::vector<float> want_;
  std::map<std::string, te::v1::Tensor> cache_;
};

TEST_F(DecodeErrorsTest, MoreThanOneNewTokenNamesX) {
  auto step = Forward(layer_, Floats({2, 2, kHidden}, 32, te::v1::FLOAT32), true, 2);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(step.status().message(), "x.shape [2, 2, 32]")) << step.status();
  ExpectUnchanged();
}

TEST_F(DecodeErrorsTest, AFullCacheNamesCacheIndex) {
  int64_t version = 2;
  for (int64_t t = 1; t < kLength; ++t) {
    version = Forward(layer_, Position(x_, t), true, version)->version();
  }
  auto past = Forward(layer_, Position(x_, 0), true, version);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past.status().message(), "cache/cache_index is 4"))
      << past.status();
  EXPECT_EQ(CacheIndex(layer_, version), kLength);
  te::v1::GetVariablesRequest newest;
  newest.set_layer_id(layer_);
  te::v1::GetVariablesResponse response;
  ASSERT_TRUE(session_->GetVariables(newest, &response).ok());
  EXPECT_EQ(response.version(), version);
}

TEST_F(DecodeErrorsTest, KeepForBackwardNamesIt) {
  te::v1::ForwardRequest request = Request(layer_, Position(x_, 1), true, 2);
  request.set_keep_for_backward(true);
  te::v1::ForwardResponse response;
  const absl::Status status = session_->Forward(request, &response);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(status.message(), "keep_for_backward")) << status;
  ExpectUnchanged();
}

TEST_F(DecodeErrorsTest, ALayerWithoutACacheIsFailedPrecondition) {
  te::v1::LayerSpec spec;
  *spec.mutable_multi_head_attention() = MhaSpec();
  auto plain = Init(spec, {2, kLength, kHidden}, te::v1::FLOAT32, false);
  ASSERT_TRUE(plain.ok());
  auto step = Forward(plain->layer_id(), Position(x_, 0), true);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(step.status().message(), "InitLayer with decode"))
      << step.status();
}

TEST_F(DecodeErrorsTest, ACancelledOrExpiredStepLeavesTheCacheAsItWas) {
  CallContext cancelled;
  cancelled.cancelled = [] { return true; };
  auto step = Forward(layer_, Position(x_, 1), true, 2, cancelled);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kCancelled) << step.status();
  CallContext expired;
  expired.deadline = absl::Now() - absl::Seconds(1);
  step = Forward(layer_, Position(x_, 1), true, 2, expired);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kDeadlineExceeded) << step.status();
  ExpectUnchanged();
}

TEST_F(DecodeErrorsTest, AStepThatFailsPartWayLeavesTheCacheAsItWas) {
  // bfloat16 x against a float32 cache: the layer refuses it after the
  // session prepared the step's cache.
  auto step = Forward(layer_, Floats({2, 1, kHidden}, 33, te::v1::BFLOAT16), true, 2);
  EXPECT_EQ(step.status().code(), absl::StatusCode::kInvalidArgument) << step.status();
  ExpectUnchanged();
}

// ---- the cache as a collection ----------------------------------------------------

TEST_F(DecodeErrorsTest, GetAndSetVariablesReadAndWriteTheCache) {
  // Version 2's cache: row 0 written, index 1.
  EXPECT_EQ(Values(cache_.at("cache/cache_index"))[0], 1.0f);
  const std::vector<float> key = Values(cache_.at("cache/cached_key"));
  const int64_t row = 2 * 8;  // [kv heads, head_dim]
  for (int64_t b = 0; b < 2; ++b) {
    double written = 0.0, rest = 0.0;
    for (int64_t i = 0; i < row; ++i) written += std::fabs(key[(b * kLength) * row + i]);
    for (int64_t i = row; i < kLength * row; ++i) rest += std::fabs(key[(b * kLength) * row + i]);
    EXPECT_GT(written, 0.0);
    EXPECT_EQ(rest, 0.0);
  }
  // Every collection at once lists the cache too.
  te::v1::GetVariablesRequest all;
  all.set_layer_id(layer_);
  te::v1::GetVariablesResponse listed;
  ASSERT_TRUE(session_->GetVariables(all, &listed).ok());
  int caches = 0;
  for (const te::v1::Variable& v : listed.variables()) caches += v.collection() == "cache";
  EXPECT_EQ(caches, 3);

  // Version 2's cache set into version 1 (index 0) makes a version that
  // decodes on from position 1.
  te::v1::SetVariablesRequest set;
  set.set_layer_id(layer_);
  set.set_version(1);
  for (const auto& [name, value] : cache_) {
    te::v1::Variable* v = set.add_variables();
    v->set_collection("cache");
    v->set_path(name.substr(6));
    *v->mutable_value() = value;
  }
  te::v1::SetVariablesResponse made;
  ASSERT_TRUE(session_->SetVariables(set, &made).ok());
  EXPECT_EQ(made.version(), 3);
  auto next = Forward(layer_, Position(x_, 1), true, 3);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_LE(RowError(want_, Values(next->y()), 2, kLength, 1), kF32Tolerance);

  // cache_index alone set back to 0 on version 4 (index 2): the new version
  // shares the keys and values of 4, which reads rows 0 and 1, so decoding
  // from it must copy them first.
  const std::map<std::string, te::v1::Tensor> four = Variables(layer_, 4);
  te::v1::SetVariablesRequest rewind;
  rewind.set_layer_id(layer_);
  rewind.set_version(4);
  te::v1::Variable* index = rewind.add_variables();
  index->set_collection("cache");
  index->set_path("cache_index");
  const int32_t zero = 0;
  index->mutable_value()->set_dtype(te::v1::INT32);
  index->mutable_value()->set_inline_data(&zero, sizeof(zero));
  ASSERT_TRUE(session_->SetVariables(rewind, &made).ok());
  EXPECT_EQ(made.version(), 5);
  auto restart = Forward(layer_, Floats({2, 1, kHidden}, 34, te::v1::FLOAT32), true, 5);
  ASSERT_TRUE(restart.ok()) << restart.status();
  const std::map<std::string, te::v1::Tensor> four_after = Variables(layer_, 4);
  for (const auto& [name, value] : four) {
    EXPECT_EQ(four_after.at(name).inline_data(), value.inline_data()) << name;
  }

  // A value of another shape names the variable.
  set.set_version(0);
  ASSERT_EQ(set.variables(1).path(), "cached_key");
  set.mutable_variables(1)->mutable_value()->set_shape(0, 3);
  const absl::Status wrong = session_->SetVariables(set, &made);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(wrong.message(), "variables[1]")) << wrong;
}

}  // namespace
}  // namespace te::session
