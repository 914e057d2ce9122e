#include "server/layers/init.h"

#include <cmath>

#include "gtest/gtest.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

TEST(InitTest, KernelFanInFollowsFlax) {
  EXPECT_EQ(KernelFanIn({64, 128}), 64);
  EXPECT_EQ(KernelFanIn({64, 3, 128}), 64 * 3);  // TE DenseGeneral features (3, 128)
  EXPECT_EQ(KernelFanIn({4, 2, 3}), 8);
}

TEST(InitTest, TruncatedNormalStatistics) {
  const Initializer init = Initializer::VarianceScalingFanIn(100);
  const double want_std = std::sqrt(1.0 / 100);
  EXPECT_NEAR(init.stddev, want_std / 0.87962566103423978, 1e-7);
  const auto v = InitialValues(5, "params/kernel", init, 100000);
  double sum = 0, sq = 0, max_abs = 0;
  for (float x : v) {
    sum += x;
    sq += static_cast<double>(x) * x;
    max_abs = std::max(max_abs, std::fabs(static_cast<double>(x)));
  }
  const double mean = sum / v.size();
  EXPECT_NEAR(mean, 0.0, 0.01 * want_std);
  EXPECT_NEAR(std::sqrt(sq / v.size() - mean * mean), want_std, 0.01 * want_std);
  EXPECT_LE(max_abs, 2.0 * init.stddev * (1 + 1e-6));  // truncated at 2 (pre-scaling) sigma
  EXPECT_GT(max_abs, 1.9 * init.stddev);                // and reaches the bound
}

TEST(InitTest, DeterministicPerSeedAndName) {
  const Initializer init = Initializer::VarianceScalingFanIn(16);
  const auto a = InitialValues(1, "params/kernel", init, 64);
  EXPECT_EQ(a, InitialValues(1, "params/kernel", init, 64));
  EXPECT_NE(a, InitialValues(2, "params/kernel", init, 64));
  EXPECT_NE(a, InitialValues(1, "params/qkv/kernel", init, 64));
  // A prefix of a longer draw: values depend on (seed, name, index) only.
  const auto longer = InitialValues(1, "params/kernel", init, 128);
  EXPECT_EQ(a, std::vector<float>(longer.begin(), longer.begin() + 64));
}

// Large variables are drawn on several threads; a value must not depend on
// how the work was split (two sizes split at different indices).
TEST(InitTest, ValuesDoNotDependOnTheThreadSplit) {
  const Initializer init = Initializer::VarianceScalingFanIn(64);
  const int64_t n = (1 << 20) + 12345;
  const auto big = InitialValues(11, "params/kernel", init, n);
  const auto bigger = InitialValues(11, "params/kernel", init, n + 777777);
  const auto small = InitialValues(11, "params/kernel", init, 1000);  // one thread
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(big[i], bigger[i]) << "index " << i;
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(big[i], small[i]) << "index " << i;
}

TEST(InitTest, InitVariablesCreatesEveryDtype) {
  auto ops = testing::NewCpuOps();
  const std::vector<VariableDef> defs = {
      {{"params/kernel", {8, 4}, DType::kBF16}, KernelInit({8, 4})},
      {{"params/bias", {4}, DType::kF32}, Initializer::Zeros()},
      {{"params/scale", {4}, DType::kBF16}, Initializer::Ones()},
  };
  Variables vars;
  ASSERT_TRUE(InitVariables(*ops, 3, defs, &vars).ok());
  ASSERT_EQ(vars.size(), 3u);
  EXPECT_EQ(vars.at("params/kernel").dtype(), DType::kBF16);
  EXPECT_EQ(vars.at("params/kernel").shape(), (Shape{8, 4}));
  const auto k = testing::Values(vars.at("params/kernel"));
  const auto want = InitialValues(3, "params/kernel", KernelInit({8, 4}), 32);
  for (size_t i = 0; i < k.size(); ++i) EXPECT_NEAR(k[i], want[i], std::fabs(want[i]) / 128);
  EXPECT_EQ(testing::Values(vars.at("params/bias")), std::vector<float>(4, 0.0f));
  EXPECT_EQ(testing::Values(vars.at("params/scale")), std::vector<float>(4, 1.0f));
}

}  // namespace
}  // namespace te::layers
