// The gradient check must catch wrong gradients, or every layer test is vacuous.
#include "server/layers/testing.h"

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "server/layers/modules.h"

namespace te::layers {
namespace {

// DenseGeneral with a corrupted backward.
class BrokenDense : public Layer {
 public:
  enum class Fault { kNone, kScaleKernelGrad, kDropBiasGrad, kScaleDx };
  explicit BrokenDense(Fault fault) : fault_(fault) {
    te::v1::DenseGeneral spec;
    spec.add_features(4);
    inner_ = std::move(*MakeDenseGeneral(spec));
  }
  std::string type_name() const override { return "BrokenDense"; }
  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& s,
                                                          const Fp8Recipe* f) const override {
    return inner_->VariableSpecs(s, f);
  }
  absl::StatusOr<Shape> OutputShape(const Shape& s) const override {
    return inner_->OutputShape(s);
  }
  absl::Status Init(Ops& ops, uint64_t seed, const Shape& s, const Fp8Recipe* f,
                    Variables* v) const override {
    return inner_->Init(ops, seed, s, f, v);
  }
  absl::Status Forward(Ops& ops, Variables* v, const LayerInputs& in, const ForwardOptions& o,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    return inner_->Forward(ops, v, in, o, out, saved);
  }
  absl::Status Backward(Ops& ops, Variables* v, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    absl::Status s = inner_->Backward(ops, v, saved, dy, grads);
    if (!s.ok()) return s;
    auto scale = [](Tensor* t, float by) {
      auto values = ToFloatVector(*t);
      for (float& x : values) x *= by;
      FromFloatVector(values, t);
    };
    switch (fault_) {
      case Fault::kNone: break;
      case Fault::kScaleKernelGrad: scale(&grads->params.at("params/kernel"), 1.05f); break;
      case Fault::kDropBiasGrad: grads->params.erase("params/bias"); break;
      case Fault::kScaleDx: scale(&grads->dx, 0.95f); break;
    }
    return absl::OkStatus();
  }

 private:
  Fault fault_;
  std::unique_ptr<Layer> inner_;
};

TEST(CheckGradientsTest, PassesCorrectAndCatchesWrongGradients) {
  auto ops = testing::NewCpuOps();
  for (auto fault : {BrokenDense::Fault::kNone, BrokenDense::Fault::kScaleKernelGrad,
                     BrokenDense::Fault::kDropBiasGrad, BrokenDense::Fault::kScaleDx}) {
    BrokenDense layer(fault);
    auto vars = testing::InitLayer(*ops, layer, {3, 5}, nullptr);
    ASSERT_TRUE(vars.ok());
    testing::RandomizeParams(*ops, &*vars, 1);
    const auto kernel_before = testing::Values(vars->at("params/kernel"));
    LayerInputs in;
    in.x = testing::RandomTensor(*ops, {3, 5}, DType::kF32, 2);
    const ::testing::AssertionResult result = testing::CheckGradients(*ops, layer, &*vars, in, {});
    EXPECT_EQ(static_cast<bool>(result), fault == BrokenDense::Fault::kNone)
        << static_cast<int>(fault) << ": " << result.message();
    // Probing restores every value exactly.
    EXPECT_EQ(testing::Values(vars->at("params/kernel")), kernel_before);
  }
}

// The key bias's zero-gradient rule: by size against the key kernel's
// gradient, exact where both sides agree, and only for key biases.
TEST(ZeroGradientErrorTest, JudgesNoiseBySizeNotByRelativeDifference) {
  EXPECT_TRUE(testing::IsKeyBiasGradient("params/attention/key/bias"));
  EXPECT_FALSE(testing::IsKeyBiasGradient("params/attention/query/bias"));
  EXPECT_EQ(testing::KeyKernelOf("params/attention/key/bias"), "params/attention/key/kernel");
  const std::vector<float> kernel = {3.0f, 4.0f};  // norm 5
  EXPECT_EQ(testing::ZeroGradientError({1e-7f, -2e-7f}, {1e-7f, -2e-7f}, kernel), 0.0);
  // Noise on both sides (relative difference 2): judged by the larger, 5e-7 / 5.
  EXPECT_NEAR(testing::ZeroGradientError({3e-7f, 4e-7f}, {-3e-7f, -4e-7f}, kernel), 1e-7, 1e-12);
  // A real gradient where zero belongs is large against the kernel's.
  EXPECT_GT(testing::ZeroGradientError({1.0f, 0.0f}, {0.0f, 0.0f}, kernel), 0.1);
}

}  // namespace
}  // namespace te::layers
