// nn.Embed, Embed.attend and the softmax cross-entropy loss node: the ops
// against float64 references, the init against Flax's default_embed_init,
// and a small LM graph (Embed -> Dense -> LayerNorm -> attend -> loss) whose
// parameter gradients match central differences of its loss.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;

// Tolerances, stated once.
// The CPU ops sum in double and round once to float32: against float64 they
// are within float32 rounding of the result.
constexpr double kOpTolerance = 1e-6;
// Central differences of a float32 loss with step 1e-2 (see testing.h).
constexpr double kStep = 1e-2;
constexpr double kGradTolerance = 2e-2;
// Init: 16384 normal draws estimate the std within ~0.6% (1 sigma); 3% is 5 sigma.
constexpr double kStdTolerance = 0.03;

Tensor Ids(Ops& ops, const std::vector<int32_t>& ids, const Shape& shape) {
  Tensor t = *ops.Allocate(DType::kI32, shape);
  EXPECT_TRUE(ops.Upload(ids.data(), &t).ok());
  return t;
}

TEST(EmbedOpsTest, GatherAndScatterAddMatchFloat64) {
  auto ops = NewCpuOps();
  const int64_t V = 7, F = 5;
  const std::vector<int32_t> ids = {3, 0, 3, 6, 3, 1};  // repeated and unused rows
  const int64_t N = static_cast<int64_t>(ids.size());
  Tensor table = RandomTensor(*ops, {V, F}, DType::kF32, 1);
  Tensor id = Ids(*ops, ids, {N});
  Tensor y = *ops->Allocate(DType::kF32, {N, F});
  ASSERT_TRUE(ops->EmbedForward(table, id, &y).ok());
  const std::vector<float> t = Values(table), got = Values(y);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) EXPECT_EQ(got[n * F + f], t[ids[n] * F + f]);
  }
  Tensor dy = RandomTensor(*ops, {N, F}, DType::kF32, 2);
  Tensor dtable = *ops->Allocate(DType::kF32, {V, F});
  ASSERT_TRUE(ops->EmbedBackward(dy, id, &dtable).ok());
  const std::vector<float> g = Values(dy);
  std::vector<double> want(V * F, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t f = 0; f < F; ++f) want[ids[n] * F + f] += g[n * F + f];
  }
  EXPECT_LT(RelativeError(Values(dtable), std::vector<float>(want.begin(), want.end())),
            kOpTolerance);
  EXPECT_EQ(Values(dtable)[2 * F], 0.0f);  // row 2: no id names it
}

TEST(EmbedOpsTest, OutOfRangeIdsGiveNanRowsAndNoGradient) {
  auto ops = NewCpuOps();
  Tensor table = RandomTensor(*ops, {4, 3}, DType::kF32, 1);
  Tensor id = Ids(*ops, {1, 4, -1}, {3});
  Tensor y = *ops->Allocate(DType::kF32, {3, 3});
  ASSERT_TRUE(ops->EmbedForward(table, id, &y).ok());
  const std::vector<float> got = Values(y);
  EXPECT_FALSE(std::isnan(got[0]));
  EXPECT_TRUE(std::isnan(got[3]) && std::isnan(got[6]));
  Tensor dy = RandomTensor(*ops, {3, 3}, DType::kF32, 2);
  Tensor dtable = *ops->Allocate(DType::kF32, {4, 3});
  ASSERT_TRUE(ops->EmbedBackward(dy, id, &dtable).ok());
  for (float v : Values(dtable)) EXPECT_TRUE(std::isfinite(v));
}

TEST(CrossEntropyOpsTest, LossAndGradientMatchFloat64) {
  auto ops = NewCpuOps();
  const int64_t N = 6, V = 11;
  Tensor logits = RandomTensor(*ops, {N, V}, DType::kF32, 3, 4.0f);
  const std::vector<int32_t> labels = {0, 10, 5, 5, 2, 7};
  Tensor lab = Ids(*ops, labels, {N});
  Tensor loss = *ops->Allocate(DType::kF32, {1});
  Tensor lse = *ops->Allocate(DType::kF32, {N});
  ASSERT_TRUE(ops->SoftmaxCrossEntropyForward(logits, lab, &loss, &lse).ok());
  const std::vector<float> l = Values(logits);
  double want = 0.0;
  std::vector<float> want_grad(N * V);
  const double dloss = 0.7;
  for (int64_t n = 0; n < N; ++n) {
    double sum = 0.0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(l[n * V + v]));
    want += std::log(sum) - l[n * V + labels[n]];
    for (int64_t v = 0; v < V; ++v) {
      want_grad[n * V + v] = static_cast<float>(
          dloss / N * (std::exp(static_cast<double>(l[n * V + v])) / sum - (v == labels[n])));
    }
  }
  want /= N;
  EXPECT_NEAR(Values(loss)[0], want, kOpTolerance * std::abs(want));
  Tensor g = *ops->Allocate(DType::kF32, {1});
  const float dloss32 = static_cast<float>(dloss);
  ASSERT_TRUE(ops->Upload(&dloss32, &g).ok());
  Tensor dlogits = *ops->Allocate(DType::kF32, {N, V});
  ASSERT_TRUE(ops->SoftmaxCrossEntropyBackward(logits, lab, lse, g, &dlogits).ok());
  EXPECT_LT(RelativeError(Values(dlogits), want_grad), kOpTolerance * 10);
}

TEST(CrossEntropyOpsTest, OutOfRangeLabelGivesNan) {
  auto ops = NewCpuOps();
  Tensor logits = RandomTensor(*ops, {2, 3}, DType::kF32, 3);
  Tensor lab = Ids(*ops, {1, 3}, {2});
  Tensor loss = *ops->Allocate(DType::kF32, {1});
  Tensor lse = *ops->Allocate(DType::kF32, {2});
  ASSERT_TRUE(ops->SoftmaxCrossEntropyForward(logits, lab, &loss, &lse).ok());
  EXPECT_TRUE(std::isnan(Values(loss)[0]));
}

te::v1::LayerSpec Parse(const std::string& text) {
  te::v1::LayerSpec spec;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &spec)) << text;
  return spec;
}

TEST(FlaxEmbedTest, InitIsFlaxsDefaultEmbedInit) {
  auto ops = NewCpuOps();
  auto layer = CreateLayer(Parse("flax_embed { num_embeddings: 256 features: 64 }"));
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_TRUE((*layer)->TakesTokenIds());
  auto vars = InitLayer(*ops, **layer, {2, 8}, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  const Tensor& e = vars->at("params/embedding");
  ASSERT_EQ(e.shape(), (Shape{256, 64}));
  double sum = 0.0, sq = 0.0;
  int beyond_two_sigma = 0;
  const double sigma = 1.0 / std::sqrt(64.0);
  for (float v : Values(e)) {
    sum += v;
    sq += static_cast<double>(v) * v;
    beyond_two_sigma += std::abs(v) > 2.0 * sigma;
  }
  const double n = static_cast<double>(e.numel());
  EXPECT_NEAR(std::sqrt(sq / n - (sum / n) * (sum / n)), sigma, kStdTolerance * sigma);
  // A plain normal, not lecun's truncated one: ~4.6% lie beyond 2 sigma.
  EXPECT_GT(beyond_two_sigma, 0.03 * n);
  EXPECT_EQ((*layer)->OutputDType(DType::kI32), DType::kF32);
}

TEST(FlaxEmbedTest, BadSpecsAndFloatIdsAreInvalidArgument) {
  EXPECT_TRUE(absl::IsInvalidArgument(
      CreateLayer(Parse("flax_embed { num_embeddings: 0 features: 4 }")).status()));
  auto ops = NewCpuOps();
  auto layer = CreateLayer(Parse("flax_embed { num_embeddings: 4 features: 4 }"));
  ASSERT_TRUE(layer.ok());
  Variables vars = *InitLayer(*ops, **layer, {3}, nullptr);
  LayerInputs in;
  in.x = RandomTensor(*ops, {3}, DType::kF32, 1);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  const absl::Status s = (*layer)->Forward(*ops, &vars, in, {}, &out, &saved);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
}

// tokens [2, 5] -> Embed(13, 8) -> Dense(8) -> LayerNorm -> attend -> loss
// against extra_inputs[0] (labels [2, 5]).
constexpr char kLmGraph[] = R"pb(
  graph {
    nodes { name: "Embed_0" inputs: "x" outputs: "Embed_0" module { flax_embed { num_embeddings: 13 features: 8 } } }
    nodes { name: "Dense_0" inputs: "Embed_0" outputs: "Dense_0" module { flax_dense { features: 8 precision: PRECISION_HIGHEST } } }
    nodes { name: "LayerNorm_0" inputs: "Dense_0" outputs: "LayerNorm_0" module { flax_layer_norm {} } }
    nodes { name: "attend_0" inputs: "LayerNorm_0" outputs: "logits" attend { embed: "Embed_0" } }
    nodes { name: "softmax_cross_entropy_0" inputs: "logits" inputs: "extra_inputs[0]" outputs: "loss" softmax_cross_entropy {} }
    outputs: "loss"
  })pb";

double LossOf(Ops& ops, const Layer& layer, Variables* vars, const LayerInputs& in) {
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  EXPECT_TRUE(layer.Forward(ops, vars, in, {}, &out, &saved).ok());
  return Values(out.y)[0];
}

TEST(LmGraphTest, LossGradientsMatchFiniteDifferences) {
  auto ops = NewCpuOps();
  auto layer = CreateLayer(Parse(kLmGraph));
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_TRUE((*layer)->TakesTokenIds());
  EXPECT_TRUE((*layer)->ReturnsLoss());
  EXPECT_EQ(*(*layer)->OutputShape({2, 5}), Shape{});
  auto vars = InitLayer(*ops, **layer, {2, 5}, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  testing::RandomizeParams(*ops, &*vars, 5);
  LayerInputs in;
  in.x = Ids(*ops, {1, 2, 3, 4, 5, 6, 7, 8, 9, 1}, {2, 5});
  in.extra.push_back(Ids(*ops, {2, 3, 4, 5, 6, 7, 8, 9, 1, 12}, {2, 5}));
  ForwardOptions opts;
  opts.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
  EXPECT_EQ(out.y.dtype(), DType::kF32);
  Tensor dloss = *ops->Allocate(DType::kF32, {});
  ASSERT_TRUE(ops->Fill(1.0f, &dloss).ok());
  LayerGrads grads;
  const absl::Status b = (*layer)->Backward(*ops, &*vars, *saved, dloss, &grads);
  ASSERT_TRUE(b.ok()) << b;
  EXPECT_EQ(grads.dx.dtype(), DType::kI32);
  ASSERT_EQ(grads.params.size(), 5u);  // embedding (Embed and attend summed), Dense, LayerNorm
  for (const auto& [name, grad] : grads.params) {
    Tensor& p = vars->at(name);
    std::vector<float> values = Values(p), numeric, analytic = Values(grad);
    for (size_t i = 0; i < values.size(); ++i) {
      std::vector<float> shifted = values;
      shifted[i] = values[i] + static_cast<float>(kStep);
      testing::SetValues(shifted, &p);
      const double up = LossOf(*ops, **layer, &*vars, in);
      shifted[i] = values[i] - static_cast<float>(kStep);
      testing::SetValues(shifted, &p);
      const double down = LossOf(*ops, **layer, &*vars, in);
      numeric.push_back(static_cast<float>((up - down) / (2 * kStep)));
    }
    testing::SetValues(values, &p);
    EXPECT_LT(RelativeError(analytic, numeric), kGradTolerance) << name;
  }
}

TEST(LmGraphTest, MisfitsAreInvalidArgumentNamingTheNode) {
  std::string text = kLmGraph;
  // attend naming a module that is no Embed.
  std::string bad = text;
  bad.replace(bad.find("embed: \"Embed_0\""), 16, "embed: \"Dense_0\"");
  absl::Status s = CreateLayer(Parse(bad)).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("attend.embed"), std::string::npos) << s;
  // Labels that do not fit the logits.
  auto ops = NewCpuOps();
  auto layer = CreateLayer(Parse(text));
  ASSERT_TRUE(layer.ok());
  Variables vars = *InitLayer(*ops, **layer, {2, 5}, nullptr);
  LayerInputs in;
  in.x = Ids(*ops, std::vector<int32_t>(10, 1), {2, 5});
  in.extra.push_back(Ids(*ops, std::vector<int32_t>(5, 1), {5}));
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  s = (*layer)->Forward(*ops, &vars, in, {}, &out, &saved);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("softmax_cross_entropy_0"), std::string::npos) << s;
  // Float x where the graph feeds an Embed.
  in.x = RandomTensor(*ops, {2, 5}, DType::kF32, 1);
  in.extra[0] = Ids(*ops, std::vector<int32_t>(10, 1), {2, 5});
  s = (*layer)->Forward(*ops, &vars, in, {}, &out, &saved);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
}

}  // namespace
}  // namespace te::layers
