// OptimizerUpdate on the GPU against the CPU reference: every rule, f32 and
// bf16, odd sizes, several steps with the moments carried over, clipping on
// and off, and a non-finite norm that must leave everything as it was.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/ops.h"

namespace te {
namespace {

using testing::RandomValues;
using testing::RelativeError;
using testing::ToDoubles;
using testing::Tolerance;
using Rule = OptimizerUpdateArgs::Rule;

class OptimizerGpuTest : public ::testing::TestWithParam<std::tuple<int, DType>> {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) GTEST_SKIP() << "no GPU: " << device.status();
    device_ = *std::move(device);
    gpu_ = *device_->NewOps(int64_t{1} << 30);
  }
  Tensor Upload(const Tensor& host) {
    Tensor t = *gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(gpu_->Upload(host.data(), &t).ok());
    return t;
  }
  Tensor Download(const Tensor& device) {
    Tensor t = *cpu_.Allocate(device.dtype(), device.shape());
    EXPECT_TRUE(gpu_->Download(device, t.data()).ok());
    return t;
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

OptimizerUpdateArgs ArgsFor(int rule_case) {
  OptimizerUpdateArgs a;
  a.learning_rate = 0.1f;
  switch (rule_case) {
    case 0: a.rule = Rule::kSgd; break;
    case 1: a.rule = Rule::kSgd; a.momentum = 0.9f; break;
    case 2: a.rule = Rule::kSgd; a.momentum = 0.9f; a.nesterov = true; break;
    case 3: a.rule = Rule::kAdam; a.eps_root = 1e-4f; break;
    default: a.rule = Rule::kAdam; a.weight_decay = 0.05f; a.max_norm = 1.0f; break;
  }
  return a;
}

TEST_P(OptimizerGpuTest, MatchesCpuReference) {
  const auto [rule_case, dtype] = GetParam();
  OptimizerUpdateArgs args = ArgsFor(rule_case);
  const bool adam = args.rule == Rule::kAdam;
  const bool trace = args.momentum != 0.0f;
  const Shape shape = {129, 67};
  Tensor p_cpu = testing::MakeRandom(cpu_, dtype, shape, 1);
  Tensor m_cpu = testing::MakeRandom(cpu_, dtype, shape, 2, -0.5f, 0.5f);
  Tensor v_cpu = testing::MakeRandom(cpu_, dtype, shape, 3, 0.01f, 1.0f);
  Tensor p_gpu = Upload(p_cpu), m_gpu = Upload(m_cpu), v_gpu = Upload(v_cpu);
  for (int step = 1; step <= 3; ++step) {
    args.bias_correction1 = 1.0f - std::pow(args.b1, float(step));
    args.bias_correction2 = 1.0f - std::pow(args.b2, float(step));
    Tensor g_cpu = testing::MakeRandom(cpu_, dtype, shape, 10 + step);
    const std::vector<double> g = ToDoubles(g_cpu);
    double norm_sq = 0;
    for (double x : g) norm_sq += x * x;
    Tensor n_cpu = testing::Scalar(cpu_, static_cast<float>(norm_sq));
    Tensor g_gpu = Upload(g_cpu), n_gpu = Upload(n_cpu);
    ASSERT_TRUE(cpu_.OptimizerUpdate(args, g_cpu, n_cpu, &p_cpu, adam || trace ? &m_cpu : nullptr,
                                     adam ? &v_cpu : nullptr).ok());
    ASSERT_TRUE(gpu_->OptimizerUpdate(args, g_gpu, n_gpu, &p_gpu, adam || trace ? &m_gpu : nullptr,
                                      adam ? &v_gpu : nullptr).ok());
    // Same float32 formula on both: the results differ by the GPU's fused
    // multiply-adds at most.
    EXPECT_LT(RelativeError(Download(p_gpu), ToDoubles(p_cpu)), Tolerance(dtype)) << step;
    if (adam || trace) EXPECT_LT(RelativeError(Download(m_gpu), ToDoubles(m_cpu)), Tolerance(dtype));
    if (adam) EXPECT_LT(RelativeError(Download(v_gpu), ToDoubles(v_cpu)), Tolerance(dtype));
  }
  // A non-finite norm: nothing written.
  const std::vector<double> before = ToDoubles(Download(p_gpu));
  Tensor g_gpu = Upload(testing::MakeRandom(cpu_, dtype, shape, 99));
  Tensor inf_gpu = Upload(testing::Scalar(cpu_, INFINITY));
  ASSERT_TRUE(gpu_->OptimizerUpdate(args, g_gpu, inf_gpu, &p_gpu, adam || trace ? &m_gpu : nullptr,
                                    adam ? &v_gpu : nullptr).ok());
  EXPECT_EQ(ToDoubles(Download(p_gpu)), before);
}

INSTANTIATE_TEST_SUITE_P(Rules, OptimizerGpuTest,
                         ::testing::Combine(::testing::Range(0, 5),
                                            ::testing::Values(DType::kF32, DType::kBF16)));

}  // namespace
}  // namespace te
