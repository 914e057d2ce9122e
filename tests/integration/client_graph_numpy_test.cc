// jax.numpy's graph nodes built with the C++ client's Graph and run by the
// real te_server (CPU backend, loopback): a composite with its own params
// (self.param), einsum, broadcasting arithmetic with scalars, where,
// reductions, softmax and a strided slice inits, applies with the output a
// float64 host computation from the fetched variables gives, and
// value_and_grad reaches every param.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "client/graph.h"
#include "client/modules.h"
#include "gtest/gtest.h"
#include "tests/integration/client_session_fixture.h"

namespace te::client {
namespace {

constexpr int64_t kB = 2, kS = 5, kD = 8, kF = 6;
// float32 on the server against float64 here: a few operations per element
// and sums of 8 terms.
constexpr double kTolerance = 1e-5;

using Spec = te::v1::GraphSpec;

// y = softmax(where(h > 0, h, 0.1 * h) - mean(h, -1, keepdims), -1)[:, 1:5:2, :]
// with h = einsum("bsd,df->bsf", x * scale, w); scale [D] and w [D, F] params.
Graph NumpyBlock() {
  Graph g("NumpyBlock", {kB, kS, kD}, DType::kF32);
  te::v1::Initializer normal;
  normal.set_kind(te::v1::Initializer::NORMAL);
  normal.set_stddev(1.0);
  const Graph::Edge scale = g.Param("scale", {kD}, normal);
  const Graph::Edge w = g.Param("w", {kD, kF});  // lecun_normal
  const Graph::Edge xs = g.Binary(Spec::Binary::MULTIPLY, g.x(), scale);
  const Graph::Edge h = g.Einsum("bsd,df->bsf", xs, w);
  const Graph::Edge positive = g.Binary(Spec::Binary::GREATER, h, 0.0);
  const Graph::Edge leaky = g.Where(positive, h, g.Binary(Spec::Binary::MULTIPLY, h, 0.1));
  const Graph::Edge mean = g.Reduce(Spec::Reduce::MEAN, h, {-1}, /*keepdims=*/true);
  const Graph::Edge centred = g.Binary(Spec::Binary::SUBTRACT, leaky, mean);
  const Graph::Edge p = g.Softmax(centred, -1);
  g.SetOutput(g.Slice(p, {0, 1, 0}, {kB, kS, kF}, {1, 2, 1}));
  return g;
}

class ClientGraphNumpyTest : public testing::ClientSessionTest {
 protected:

};


TEST_F(ClientGraphNumpyTest, InitsAppliesAndDifferentiates) {
  const Graph block = NumpyBlock();
  const HostTensor x = HostTensor::RandomNormal({kB, kS, kD}, DType::kF32, 7);
  absl::StatusOr<Variables> vars = block.Init(*session_, 42, x);
  ASSERT_TRUE(vars.ok()) << vars.status();
  absl::StatusOr<std::map<std::string, HostTensor>> params = GetVariables(*vars, {"params"});
  ASSERT_TRUE(params.ok()) << params.status();
  ASSERT_EQ(params->size(), 2u);
  const std::vector<float> scale = params->at("params/scale").ToFloats();
  const std::vector<float> w = params->at("params/w").ToFloats();
  ASSERT_EQ(scale.size(), static_cast<size_t>(kD));
  ASSERT_EQ(w.size(), static_cast<size_t>(kD * kF));

  absl::StatusOr<HostTensor> y = block.Apply(*vars, x);
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_EQ(y->shape(), (Shape{kB, 2, kF}));
  // The same in float64.
  const std::vector<float> xs = x.ToFloats(), got = y->ToFloats();
  double diff = 0, norm = 0;
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t s = 1, row = 0; s < kS; s += 2, ++row) {
      std::vector<double> h(kF, 0.0), z(kF);
      for (int64_t f = 0; f < kF; ++f) {
        for (int64_t d = 0; d < kD; ++d)
          h[f] += xs[(b * kS + s) * kD + d] * scale[d] * w[d * kF + f];
      }
      double mean = 0, m = -1e300, sum = 0;
      for (double v : h) mean += v / kF;
      for (int64_t f = 0; f < kF; ++f)
        z[f] = (h[f] > 0 ? h[f] : 0.1 * h[f]) - mean, m = std::max(m, z[f]);
      for (double v : z) sum += std::exp(v - m);
      for (int64_t f = 0; f < kF; ++f) {
        const double want = std::exp(z[f] - m) / sum;
        const double delta = got[(b * 2 + row) * kF + f] - want;
        diff += delta * delta;
        norm += want * want;
      }
    }
  }
  EXPECT_LT(std::sqrt(diff / norm), kTolerance);

  const HostTensor dy = HostTensor::RandomNormal({kB, 2, kF}, DType::kF32, 8);
  absl::StatusOr<ValueAndGradResult> vg = block.ValueAndGrad(*vars, x, dy);
  ASSERT_TRUE(vg.ok()) << vg.status();
  double vdot = 0;
  const std::vector<float> dys = dy.ToFloats();
  for (size_t i = 0; i < got.size(); ++i) vdot += double(got[i]) * dys[i];
  EXPECT_NEAR(vg->value, vdot, 1e-5 * (1 + std::abs(vdot)));
  for (const std::string name : {"params/scale", "params/w"}) {
    auto it = vg->grads.find(name);
    ASSERT_NE(it, vg->grads.end()) << "no gradient for " << name;
    EXPECT_EQ(it->second.shape(), params->at(name).shape()) << name;
    double sq = 0;
    for (float v : it->second.ToFloats()) {
      EXPECT_TRUE(std::isfinite(v)) << name;
      sq += double(v) * v;
    }
    EXPECT_GT(sq, 0.0) << name;
  }
  EXPECT_EQ(vg->dx.shape(), x.shape());
}

// The server checks what the builder cannot: a bad initializer is the
// InitLayer's INVALID_ARGUMENT naming the node's field.
TEST_F(ClientGraphNumpyTest, BadInitializerIsInvalidArgument) {
  Graph g("Bad", {kB, kD}, DType::kF32);
  te::v1::Initializer init;
  init.set_kind(te::v1::Initializer::VARIANCE_SCALING);
  init.set_mode("fan_sideways");
  g.SetOutput(g.Binary(Spec::Binary::ADD, g.x(), g.Param("bias", {1, kD}, init)));
  absl::StatusOr<Variables> vars =
      g.Init(*session_, 1, HostTensor::Full({kB, kD}, DType::kF32, 1.0f));
  ASSERT_FALSE(vars.ok());
  EXPECT_EQ(vars.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(vars.status().message().find("(bias).param.initializer.mode"), std::string::npos)
      << vars.status();
}

}  // namespace
}  // namespace te::client
