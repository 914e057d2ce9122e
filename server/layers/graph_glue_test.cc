// The graph layer's glue ops, each alone or in small graphs: forward values
// checked against the op done by hand, every backward against finite
// differences on random data (float32, CPU), dropout against its mask drawn
// by hand, and dtype inference through casts.
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/rng.h"
#include "server/layers/graph.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::GradCheckOptions;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::Values;
using Spec = te::v1::GraphSpec;

Spec::Node* Add(Spec* g, const std::string& name, std::vector<std::string> in,
                std::vector<std::string> out) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  for (const std::string& s : out) node->add_outputs(s);
  return node;
}

std::unique_ptr<Layer> Build(const Spec& graph) {
  te::v1::LayerSpec spec;
  *spec.mutable_graph() = graph;
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

class GlueTest : public ::testing::Test {
 protected:
  // Finite differences of vdot(y, dy) against the graph's dx (and dextra).
  ::testing::AssertionResult Check(const Spec& g, const Shape& x,
                                   const std::vector<Shape>& extra = {},
                                   const ForwardOptions& opts = {},
                                   const GradCheckOptions& check = {}) {
    auto layer = Build(g);
    if (layer == nullptr) return ::testing::AssertionFailure() << "no layer";
    LayerInputs in;
    in.x = RandomTensor(*ops_, x, DType::kF32, 1);
    for (size_t i = 0; i < extra.size(); ++i) {
      in.extra.push_back(RandomTensor(*ops_, extra[i], DType::kF32, 2 + i));
    }
    Variables vars;
    return CheckGradients(*ops_, *layer, &vars, in, opts, check);
  }

  // y for a random x (seed 1, as Check draws it).
  std::vector<float> Forward(const Spec& g, const Shape& x, const ForwardOptions& opts = {},
                             Tensor* x_out = nullptr) {
    auto layer = Build(g);
    LayerInputs in;
    in.x = RandomTensor(*ops_, x, DType::kF32, 1);
    if (x_out != nullptr) *x_out = in.x;
    Variables vars;
    LayerOutputs out;
    const absl::Status s = layer->Forward(*ops_, &vars, in, opts, &out, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    return Values(out.y);
  }

  std::unique_ptr<Ops> ops_ = NewCpuOps();
};

TEST_F(GlueTest, Reshape) {
  Spec g;
  auto* r = Add(&g, "r", {"x"}, {"y"})->mutable_reshape();
  r->add_shape(4);
  r->add_shape(-1);
  g.add_outputs("y");
  EXPECT_TRUE(Check(g, {2, 3, 4}));
}

// Split along the outermost axis (views) and concatenated in another order.
TEST_F(GlueTest, SplitAndConcatenateOuterAxis) {
  Spec g;
  auto* s = Add(&g, "s", {"x"}, {"p0", "p1", "p2"})->mutable_split();
  s->set_axis(0);
  s->set_parts(3);
  Add(&g, "c", {"p2", "p0", "p1"}, {"y"})->mutable_concatenate()->set_axis(0);
  g.add_outputs("y");
  const std::vector<float> y = Forward(g, {6, 4});
  const std::vector<float> x = Values(RandomTensor(*ops_, {6, 4}, DType::kF32, 1));
  // Rows [4, 6) first, then [0, 2), then [2, 4).
  for (int r = 0; r < 6; ++r) {
    const int from = (r < 2 ? r + 4 : r - 2);
    for (int c = 0; c < 4; ++c) EXPECT_EQ(y[r * 4 + c], x[from * 4 + c]);
  }
  EXPECT_TRUE(Check(g, {6, 4}));
}

// Split along an inner axis (Permute) and concatenated along the last.
TEST_F(GlueTest, SplitInnerAxisConcatenateLast) {
  Spec g;
  auto* s = Add(&g, "s", {"x"}, {"p0", "p1"})->mutable_split();
  s->set_axis(-2);
  s->set_parts(2);
  Add(&g, "c", {"p1", "p0"}, {"y"})->mutable_concatenate()->set_axis(-1);
  g.add_outputs("y");
  const std::vector<float> y = Forward(g, {2, 6, 4});
  const std::vector<float> x = Values(RandomTensor(*ops_, {2, 6, 4}, DType::kF32, 1));
  // y [2, 3, 8]: y[b, i, 0:4] = x[b, 3 + i, :], y[b, i, 4:8] = x[b, i, :].
  for (int b = 0; b < 2; ++b) {
    for (int i = 0; i < 3; ++i) {
      for (int c = 0; c < 8; ++c) {
        const int row = c < 4 ? 3 + i : i;
        EXPECT_EQ(y[(b * 3 + i) * 8 + c], x[(b * 6 + row) * 4 + c % 4]);
      }
    }
  }
  EXPECT_TRUE(Check(g, {2, 6, 4}));
}

// A part nobody reads gets no gradient: counted as zeros in the split's.
TEST_F(GlueTest, SplitPartWithoutGradient) {
  Spec g;
  auto* s = Add(&g, "s", {"x"}, {"p0", "p1", "p2"})->mutable_split();
  s->set_axis(1);
  s->set_parts(3);
  g.add_outputs("p1");
  EXPECT_TRUE(Check(g, {2, 6, 2}));
}

// Parts of unequal sizes along an inner axis: the two-Permute path.
TEST_F(GlueTest, ConcatenateUnequalParts) {
  Spec g;
  Add(&g, "c", {"x", "extra_inputs[0]", "x"}, {"y"})->mutable_concatenate()->set_axis(1);
  g.add_outputs("y");
  EXPECT_TRUE(Check(g, {2, 3, 4}, {{2, 5, 4}}));
}

TEST_F(GlueTest, AddOfThreeWithARepeatedInput) {
  Spec g;
  Add(&g, "sum", {"x", "extra_inputs[0]", "x"}, {"y"})->mutable_add();
  g.add_outputs("y");
  EXPECT_TRUE(Check(g, {3, 5}, {{3, 5}}));
}

TEST_F(GlueTest, Scale) {
  Spec g;
  Add(&g, "s", {"x"}, {"y"})->mutable_scale()->set_factor(-0.75);
  g.add_outputs("y");
  Tensor x;
  const std::vector<float> y = Forward(g, {4, 3}, {}, &x);
  const std::vector<float> xv = Values(x);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], -0.75f * xv[i]);
  EXPECT_TRUE(Check(g, {4, 3}));
}

// x -> float16 -> scale -> float32: linear, so a large step leaves only the
// float16 rounding (2^-11 relative) over the step in the differences.
TEST_F(GlueTest, CastThereAndBack) {
  Spec g;
  Add(&g, "half", {"x"}, {"h"})->mutable_cast()->set_dtype(te::v1::FLOAT16);
  Add(&g, "s", {"h"}, {"hs"})->mutable_scale()->set_factor(3.0);
  Add(&g, "full", {"hs"}, {"y"})->mutable_cast()->set_dtype(te::v1::FLOAT32);
  g.add_outputs("y");
  GradCheckOptions check;
  check.step = 0.25;
  EXPECT_TRUE(Check(g, {4, 6}, {}, {}, check));
}

// A cast changes the dtype that follows: y in bfloat16, dx in x's float32.
TEST_F(GlueTest, CastSetsTheOutputDType) {
  Spec g;
  Add(&g, "c", {"x"}, {"y"})->mutable_cast()->set_dtype(te::v1::BFLOAT16);
  g.add_outputs("y");
  auto layer = Build(g);
  LayerInputs in;
  in.x = RandomTensor(*ops_, {2, 3}, DType::kF32, 1);
  Variables vars;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ForwardOptions opts;
  opts.keep_for_backward = true;
  ASSERT_TRUE(layer->Forward(*ops_, &vars, in, opts, &out, &saved).ok());
  EXPECT_EQ(out.y.dtype(), DType::kBF16);
  LayerGrads grads;
  ASSERT_TRUE(layer->Backward(*ops_, &vars, *saved, RandomTensor(*ops_, {2, 3}, DType::kF32, 2),
                              &grads)
                  .ok());
  EXPECT_EQ(grads.dx.dtype(), DType::kF32);
}

TEST_F(GlueTest, Transpose) {
  Spec g;
  auto* t = Add(&g, "t", {"x"}, {"y"})->mutable_transpose();
  for (int a : {2, 0, -1, 1}) t->add_axes(a);
  g.add_outputs("y");
  const std::vector<float> y = Forward(g, {2, 3, 4, 5});
  const std::vector<float> x = Values(RandomTensor(*ops_, {2, 3, 4, 5}, DType::kF32, 1));
  // y [4, 2, 5, 3] = x[a, b, c, d] at y[c, a, d, b].
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 4; ++c)
        for (int d = 0; d < 5; ++d)
          EXPECT_EQ(y[((c * 2 + a) * 5 + d) * 3 + b], x[((a * 3 + b) * 4 + c) * 5 + d]);
  EXPECT_TRUE(Check(g, {2, 3, 4, 5}));
}

// Rank 6 and numpy's default (reversed axes): dims that stay neighbours
// merge, so Permute's rank limit applies to what actually moves.
TEST_F(GlueTest, TransposeBeyondPermutesRank) {
  Spec g;
  auto* t = Add(&g, "t", {"x"}, {"y"})->mutable_transpose();
  for (int a : {0, 1, 2, 5, 3, 4}) t->add_axes(a);
  g.add_outputs("y");
  EXPECT_TRUE(Check(g, {2, 1, 3, 2, 2, 3}));
  Spec reversed;
  Add(&reversed, "t", {"x"}, {"y"})->mutable_transpose();
  reversed.add_outputs("y");
  EXPECT_TRUE(Check(reversed, {2, 3, 4}));
}

float Kept(uint64_t seed, int64_t index, float rate) {
  return DropoutUniform(seed, static_cast<uint64_t>(index)) >= rate ? 1.0f / (1.0f - rate) : 0.0f;
}

uint64_t Seed(uint64_t seed, const std::string& name) {
  return DeriveSeed(seed, name);
}

// Element i kept iff DropoutUniform(DeriveSeed(dropout_seed, name), i) >= rate.
TEST_F(GlueTest, DropoutAppliesTheMaskOfItsDerivedSeed) {
  constexpr float kRate = 0.3f;
  Spec g;
  Add(&g, "Dropout_0", {"x"}, {"y"})->mutable_dropout()->set_rate(kRate);
  g.add_outputs("y");
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 5;
  Tensor x;
  const std::vector<float> y = Forward(g, {4, 8}, opts, &x);
  const std::vector<float> xv = Values(x);
  int dropped = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float keep = Kept(Seed(5, "Dropout_0"), static_cast<int64_t>(i), kRate);
    EXPECT_EQ(y[i], xv[i] * keep) << i;
    dropped += keep == 0.0f;
  }
  EXPECT_GT(dropped, 0);
  EXPECT_TRUE(Check(g, {4, 8}, {}, opts));
  // Off when deterministic.
  EXPECT_EQ(Forward(g, {4, 8}), xv);
}

// broadcast_dims share the mask along those axes: drawn for x's shape with
// them set to 1, index i of that shape.
TEST_F(GlueTest, DropoutBroadcastDims) {
  constexpr float kRate = 0.5f;
  Spec g;
  auto* d = Add(&g, "drop", {"x"}, {"y"})->mutable_dropout();
  d->set_rate(kRate);
  d->add_broadcast_dims(0);
  d->add_broadcast_dims(-1);
  g.add_outputs("y");
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 9;
  Tensor x;
  const std::vector<float> y = Forward(g, {3, 5, 4}, opts, &x);
  const std::vector<float> xv = Values(x);
  for (int a = 0; a < 3; ++a)
    for (int s = 0; s < 5; ++s)
      for (int h = 0; h < 4; ++h) {
        const int64_t i = (a * 5 + s) * 4 + h;
        EXPECT_EQ(y[i], xv[i] * Kept(Seed(9, "drop"), s, kRate)) << a << " " << s << " " << h;
      }
  EXPECT_TRUE(Check(g, {3, 5, 4}, {}, opts));
}

}  // namespace
}  // namespace te::layers
