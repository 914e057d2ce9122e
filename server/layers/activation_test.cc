#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/modules.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;

std::unique_ptr<Layer> Make(std::vector<std::string> names) {
  te::v1::Activation spec;
  for (const auto& n : names) spec.add_activations(n);
  auto layer = MakeActivation(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return std::move(*layer);
}

double Gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(ActivationTest, DefaultIsTanhGelu) {
  auto ops = testing::NewCpuOps();
  auto act = Make({});
  EXPECT_EQ(*act->OutputShape({2, 5}), (Shape{2, 5}));
  LayerInputs in;
  in.x = RandomTensor(*ops, {2, 5}, DType::kF32, 1, 3.0f);
  Variables vars;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(act->Forward(*ops, &vars, in, {}, &out, &saved).ok());
  std::vector<float> want;
  for (float v : Values(in.x)) want.push_back(static_cast<float>(Gelu(v)));
  EXPECT_LT(RelativeError(Values(out.y), want), 1e-5);
}

TEST(ActivationTest, GatedPairTakesTeLayout) {
  auto ops = testing::NewCpuOps();
  auto act = Make({"linear", "silu"});  // normalised to (silu, linear)
  auto shape = act->OutputShape({3, 2, 4});
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(*shape, (Shape{3, 4}));
  EXPECT_EQ(act->OutputShape({3, 4}).status().code(), absl::StatusCode::kInvalidArgument);
  LayerInputs in;
  in.x = RandomTensor(*ops, {3, 2, 4}, DType::kF32, 1, 2.0f);
  Variables vars;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE(act->Forward(*ops, &vars, in, {}, &out, &saved).ok());
  const auto x = Values(in.x);
  std::vector<float> want;
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 4; ++i) {
      const double a = x[r * 8 + i], b = x[r * 8 + 4 + i];
      want.push_back(static_cast<float>(a / (1.0 + std::exp(-a)) * b));
    }
  }
  EXPECT_LT(RelativeError(Values(out.y), want), 1e-5);
}

TEST(ActivationTest, GradientsMatchFiniteDifferences) {
  auto ops = testing::NewCpuOps();
  const std::vector<std::vector<std::string>> cases = {
      {"gelu"}, {"silu"}, {"quick_gelu"}, {"gelu", "linear"}, {"silu", "linear"},
      {"quick_gelu", "linear"}, {"squared_relu", "linear"}};
  for (const auto& names : cases) {
    SCOPED_TRACE(names[0] + (names.size() > 1 ? "+" + names[1] : ""));
    auto act = Make(names);
    LayerInputs in;
    in.x = RandomTensor(*ops, names.size() == 2 ? Shape{3, 2, 5} : Shape{3, 5}, DType::kF32, 4,
                        2.0f);
    Variables vars;
    EXPECT_TRUE(CheckGradients(*ops, *act, &vars, in, {}));
  }
}

TEST(ActivationTest, UnknownOrUnsupportedNamesAreInvalid) {
  te::v1::Activation spec;
  spec.add_activations("tanh");
  auto s = MakeActivation(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("spec.activation.activations"), std::string::npos);
  te::v1::Activation pair;
  pair.add_activations("gelu");
  pair.add_activations("relu");
  EXPECT_EQ(MakeActivation(pair).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te::layers
