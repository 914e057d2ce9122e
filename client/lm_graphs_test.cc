// The C++ client's decoder LM (client/decoder_lm.h: Graph::Embed, Attend,
// SoftmaxCrossEntropyWithIntegerLabels) equals, field for field, the
// GraphSpec the Python tracer builds from train_lm.DecoderLM
// (tests/data/lm_graphs, written by client/python/examples/lm_graphs.py), so
// both clients send the server the same LM with the same variable names. And
// the builder's checks: a bad use is INVALID_ARGUMENT naming the node.
#include <functional>
#include <string>

#include "client/decoder_lm.h"
#include "client/modules.h"
#include "client/golden_graphs.h"
#include "gtest/gtest.h"

namespace te::client {
namespace {

void ExpectGolden(const Graph& graph, const std::string& name) {
  testing::ExpectGolden(graph, "lm_graphs", name);
}

// lm_graphs.py's sizes.
TEST(LmGraphsTest, TinyEqualsPythonTrace) {
  DecoderLmSize size;
  size.num_layers = 2;
  size.hidden = 32;
  size.heads = 4;
  size.batch = 4;
  size.seq = 16;
  ExpectGolden(DecoderLm(size), "tiny");
}

TEST(LmGraphsTest, TrainLmDefaultsEqualPythonTrace) { ExpectGolden(DecoderLm(DecoderLmSize{}), "train_lm"); }

TEST(LmGraphsTest, ShapesAndDtypes) {
  Graph g("LM", {2, 5}, DType::kI32);
  const Graph::Edge e = g.Embed(g.x(), 11, 8);
  EXPECT_EQ(g.shape(e), (Shape{2, 5, 8}));
  EXPECT_EQ(g.dtype(e), DType::kF32);
  const Graph::Edge logits = g.Attend(e, g.Cast(e, DType::kBF16));
  EXPECT_EQ(g.shape(logits), (Shape{2, 5, 11}));
  EXPECT_EQ(g.dtype(logits), DType::kF32);  // bfloat16 query, float32 table
  const Graph::Edge loss = g.SoftmaxCrossEntropyWithIntegerLabels(logits, g.ExtraInput(0, {2, 5}, DType::kI32));
  EXPECT_EQ(g.shape(loss), Shape{});
  g.SetOutput(loss);
  ASSERT_TRUE(g.Spec().ok()) << g.Spec().status();

  Graph half("LM", {3}, DType::kI32);
  EmbedOptions bf16;
  bf16.dtype = DType::kBF16;
  const Graph::Edge h = half.Embed(half.x(), 4, 2, bf16, "tokens");
  EXPECT_EQ(half.dtype(h), DType::kBF16);
  const Graph::Edge a = half.Attend(h, half.Cast(h, DType::kF32));
  EXPECT_EQ(half.dtype(a), DType::kBF16);  // the Embed's dtype
  half.SetOutput(a);
  absl::StatusOr<te::v1::LayerSpec> spec = half.Spec();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->graph().nodes(0).name(), "tokens");
  EXPECT_EQ(spec->graph().nodes(2).attend().embed(), "tokens");
  EXPECT_EQ(spec->graph().nodes(2).attend().dtype(), te::v1::BFLOAT16);
}

TEST(LmGraphsTest, BadUsesAreInvalidArgumentNamingTheNode) {
  struct Case {
    std::string want;
    std::function<void(Graph&)> build;
  };
  const std::vector<Case> cases = {
      {"Embed_1 (Embed): reads float32 ids",
       [](Graph& g) { g.Embed(g.Cast(g.Embed(g.x(), 4, 2), DType::kF32), 4, 2); }},
      {"attend_0: `embedded` is not the output of an Embed",
       [](Graph& g) { g.Attend(g.ExtraInput(0, {3, 2}, DType::kF32), g.ExtraInput(1, {3, 2}, DType::kF32)); }},
      {"attend_0: query [3, 5] does not end in Embed_0's features (2)",
       [](Graph& g) { g.Attend(g.Embed(g.x(), 4, 2), g.ExtraInput(0, {3, 5}, DType::kF32)); }},
      {"softmax_cross_entropy_0: labels [4] are not logits [3, 4]",
       [](Graph& g) {
         g.SoftmaxCrossEntropyWithIntegerLabels(g.ExtraInput(0, {3, 4}, DType::kF32),
                                                g.ExtraInput(1, {4}, DType::kI32));
       }},
      {"softmax_cross_entropy_0: labels are float32",
       [](Graph& g) {
         g.SoftmaxCrossEntropyWithIntegerLabels(g.ExtraInput(0, {3, 4}, DType::kF32),
                                                g.ExtraInput(1, {3}, DType::kF32));
       }},
  };
  for (const Case& c : cases) {
    Graph g("LM", {3}, DType::kI32);
    c.build(g);
    g.SetOutput(g.x());
    absl::StatusOr<te::v1::LayerSpec> spec = g.Spec();
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_NE(spec.status().message().find(c.want), std::string::npos) << spec.status();
  }
}

}  // namespace
}  // namespace te::client
