// DropoutForward / DropoutBackward on the GPU against the CPU reference: the
// same keep mask bit for bit (both draw DropoutUniform from the seed), and y
// and dx within the dtype's tolerance (ops_gpu_test.h).
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

// ---- dropout: dtype x shape x rate ---------------------------------------------------

class DropoutTest : public GpuTest, public ::testing::WithParamInterface<DTypeShape> {};

TEST_P(DropoutTest, ForwardAndBackward) {
  const auto [dtype, shape] = GetParam();
  const Pair x = Random(dtype, shape, 4);
  for (float rate : {0.0f, 0.1f, 0.5f, 1.0f}) {
    const std::string what = "Dropout rate " + std::to_string(rate);
    Pair y = Output(dtype, shape);
    Pair mask = Output(DType::kBool, shape);
    ASSERT_TRUE(cpu_->DropoutForward(rate, 1234567, x.cpu, &y.cpu, &mask.cpu).ok());
    ASSERT_TRUE(gpu_->DropoutForward(rate, 1234567, x.gpu, &y.gpu, &mask.gpu).ok());
    ExpectMatches(y, what);
    ExpectMatches(mask, what + " mask (bit for bit)");
    const Pair dy = Random(dtype, shape, 5);
    Pair dx = Output(dtype, shape);
    ASSERT_TRUE(cpu_->DropoutBackward(rate, dy.cpu, mask.cpu, &dx.cpu).ok());
    ASSERT_TRUE(gpu_->DropoutBackward(rate, dy.gpu, mask.gpu, &dx.gpu).ok());
    ExpectMatches(dx, what + " backward");
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, DropoutTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::ValuesIn(kShapes)),
                         DTypeShapeName);

}  // namespace
}  // namespace gpu_test
}  // namespace te
