// Activations (single and gated) on the GPU against the CPU reference: forward
// and backward, acts x dtype x output format x shape, aligned and misaligned.
#include "kernels/cpu/test_util.h"
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

// ---- activations: acts x dtype x output format x shape ------------------------------------

using ActCase = std::tuple<std::vector<Activation>, DType, DType, Shape>;
class ActivationTest : public GpuTest, public ::testing::WithParamInterface<ActCase> {
 protected:
  // Forward (and, for float outputs, backward) against the CPU reference.
  void ExpectForwardAndBackwardMatch(bool misaligned) {
    const auto [acts, dtype, out_dtype_param, shape] = GetParam();
    const DType out_dtype = out_dtype_param == DType::kF32 ? dtype : out_dtype_param;
    Shape x_shape = shape;
    x_shape.back() *= static_cast<int64_t>(acts.size());
    const Pair x = Input(dtype, x_shape, 14, misaligned, -4.0f, 4.0f);
    const bool fp8 = IsFloat8(out_dtype);
    Fp8Pair side = Fp8Side(fp8 ? 25.0f : 1.0f);
    const Fp8Output cpu_side = side.cpu(), gpu_side = side.gpu();
    Pair y = Output(out_dtype, shape);
    ASSERT_TRUE(cpu_->ActivationForward(acts, x.cpu, &y.cpu, fp8 ? &cpu_side : nullptr).ok());
    ASSERT_TRUE(gpu_->ActivationForward(acts, x.gpu, &y.gpu, fp8 ? &gpu_side : nullptr).ok());
    ExpectMatches(y, "forward");
    if (fp8) {
      ExpectFp8SideMatches(side, "forward");
      return;
    }
    const Pair dy = Input(dtype, shape, 15, misaligned);
    Pair dx = Output(dtype, x_shape);
    ASSERT_TRUE(cpu_->ActivationBackward(acts, dy.cpu, x.cpu, &dx.cpu).ok());
    ASSERT_TRUE(gpu_->ActivationBackward(acts, dy.gpu, x.gpu, &dx.gpu).ok());
    ExpectMatches(dx, "backward");
  }
};

TEST_P(ActivationTest, ForwardAndBackward) { ExpectForwardAndBackwardMatch(false); }

// The same on inputs that are not 16-byte aligned: the element-wise fallback.
TEST_P(ActivationTest, MisalignedInputs) { ExpectForwardAndBackwardMatch(true); }

// GELU (tanh form) and its derivative in float32, both backends, against the
// same function in double over [-12, 12]: each value within 1e-4 of itself,
// down the negative tail to 1e-35 (flushed below; 0.5 x (1 + tanh u)
// in float cancels to 0 there from x of about -4); the derivative within
// 1e-5 of itself plus 1e-6 (it crosses zero near x = -0.75).
TEST_F(GpuTest, GeluKeepsItsNegativeTailOnBothBackends) {
  const Shape shape{64, 1024};
  const Pair x = Random(DType::kF32, shape, 31, -12.0f, 12.0f);
  const Pair ones = Random(DType::kF32, shape, 32, 1.0f, 1.0f);
  Pair y = Output(DType::kF32, shape), dx = Output(DType::kF32, shape);
  const std::vector<Activation> gelu{Activation::kGelu};
  ASSERT_TRUE(cpu_->ActivationForward(gelu, x.cpu, &y.cpu, nullptr).ok());
  ASSERT_TRUE(gpu_->ActivationForward(gelu, x.gpu, &y.gpu, nullptr).ok());
  ASSERT_TRUE(cpu_->ActivationBackward(gelu, ones.cpu, x.cpu, &dx.cpu).ok());
  ASSERT_TRUE(gpu_->ActivationBackward(gelu, ones.gpu, x.gpu, &dx.gpu).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const Tensor gpu_y = Fetch(y.gpu), gpu_dx = Fetch(dx.gpu);
  const float* xs = x.cpu.data_as<const float>();
  // Element i of both backends' `what` within rel * |want| + abs of want.
  auto expect_near = [&](const char* what, const Tensor& cpu, const Tensor& gpu, int64_t i,
                         double want, double rel, double abs) {
    for (const auto& [name, got] : {std::pair<const char*, const Tensor*>{"cpu", &cpu},
                                    std::pair<const char*, const Tensor*>{"gpu", &gpu}}) {
      const double g = got->data_as<const float>()[i];
      EXPECT_LE(std::fabs(g - want), rel * std::fabs(want) + abs)
          << name << " " << what << "(" << xs[i] << ") = " << g << ", want " << want;
    }
  };
  int64_t tail = 0;
  for (int64_t i = 0; i < x.cpu.numel(); ++i) {
    if (xs[i] < -5.0f) ++tail;
    expect_near("gelu", y.cpu, gpu_y, i, te::testing::GeluTanhReference(xs[i]), 1e-4, 1e-35);
    expect_near("gelu'", dx.cpu, gpu_dx, i, te::testing::GeluTanhDerivativeReference(xs[i]), 1e-5,
                1e-6);
    if (HasFailure()) return;  // the first element off, not thousands
  }
  EXPECT_GT(tail, 1000);  // the tail is sampled
}

const char* ActName(Activation a) {
  switch (a) {
    case Activation::kGelu: return "gelu";
    case Activation::kSilu: return "silu";
    case Activation::kRelu: return "relu";
    case Activation::kQuickGelu: return "quick_gelu";
    case Activation::kSquaredRelu: return "squared_relu";
    case Activation::kLinear: return "linear";
  }
  return "?";
}

std::string ActCaseName(const ::testing::TestParamInfo<ActCase>& info) {
  std::string name;
  for (Activation a : std::get<0>(info.param)) name += std::string(ActName(a)) + "_";
  const DType out = std::get<2>(info.param);
  return name + Short(std::get<1>(info.param)) + "_" + (out == DType::kF32 ? "same" : Short(out)) +
         "_" + ShapeName(std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, ActivationTest,
    ::testing::Combine(
        ::testing::Values(std::vector<Activation>{Activation::kGelu},
                          std::vector<Activation>{Activation::kSilu},
                          std::vector<Activation>{Activation::kRelu},
                          std::vector<Activation>{Activation::kQuickGelu},
                          std::vector<Activation>{Activation::kSquaredRelu},
                          std::vector<Activation>{Activation::kLinear},
                          std::vector<Activation>{Activation::kGelu, Activation::kLinear},
                          std::vector<Activation>{Activation::kSilu, Activation::kLinear},
                          std::vector<Activation>{Activation::kSquaredRelu, Activation::kGelu}),
        ::testing::Values(DType::kF32, DType::kBF16),
        ::testing::Values(DType::kF32, DType::kE4M3, DType::kE5M2),
        // I = 100, 37: rows not a multiple of the 8-element vectors (gated: the
        // element-wise path; plain: vectors over the flat run plus a tail of
        // N * I % 8 = 4, 1 elements)
        ::testing::Values(Shape{77, 200}, Shape{128, 4096}, Shape{33, 100}, Shape{5, 37})),
    ActCaseName);

// Large enough that every thread walks more than one pair of vectors (more
// than 2 x SMs x 16 x 256 of them: GridFor's cap, on the 132 SMs of an
// H200), with rows (1025 vectors) that the
// per-thread stride does not divide: the gated row cursor wraps mid-row. The
// activations the layers use, and a pair with a non-linear gate (the
// per-element fallback kernel).
INSTANTIATE_TEST_SUITE_P(
    Large, ActivationTest,
    ::testing::Combine(
        ::testing::Values(std::vector<Activation>{Activation::kGelu},
                          std::vector<Activation>{Activation::kSilu, Activation::kLinear},
                          std::vector<Activation>{Activation::kSquaredRelu, Activation::kGelu}),
        ::testing::Values(DType::kBF16), ::testing::Values(DType::kF32, DType::kE4M3),
        ::testing::Values(Shape{1200, 8200})),
    ActCaseName);

}  // namespace
}  // namespace gpu_test
}  // namespace te
