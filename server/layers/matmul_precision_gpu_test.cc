// The call's matmul precision on the GPU, for TE's modules in float32
// (ForwardOptions::tf32, the request's jax.default_matmul_precision):
//  * DenseGeneral against float64 references of its three GEMMs (y, dx,
//    dkernel): at HIGHEST within float32's error of the exact product; at
//    DEFAULT off it by TensorFloat-32's error, and on a reference whose
//    operands were rounded to TF32 first (to nearest, or by truncation:
//    cuBLAS does not say which its TF32 kernels do; the test takes the closer)
//    within float32's error of that. The relative errors against float64 it
//    prints are the accuracy of the two precisions.
//  * TransformerLayer on the GPU against the CPU reference (exact float32):
//    at HIGHEST within the float32 tolerance of a composed layer; at DEFAULT
//    within TF32's, and visibly off exact (the flag reached the GEMMs).
// Needs a GPU: without one every test is skipped, unless TE_REQUIRE_GPU=1.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"
#include "te/v1/layers.pb.h"

namespace te::layers {
namespace {

using testing::RandomizeParams;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;

// ---- tolerances, relative ||got - want|| / ||want||, stated once --------------------
// float32 GEMMs against their float64 product: float32 rounding (2^-24) of
// the result and of K-long sums in another order.
constexpr double kF32Tolerance = 1e-5;
// TensorFloat-32 against the float64 product: each operand rounded to 10
// mantissa bits (2^-11 relative to nearest, 2^-10 truncated), so a product
// is off by up to ~2^-10 and a K-long sum of random-signed products by
// ~2^-11 RMS relative; 3e-3 leaves room for truncation's bias.
constexpr double kTf32Tolerance = 3e-3;
// Below this a DEFAULT run did not use TF32 at all (exact float32 is ~1e-7).
constexpr double kTf32Floor = 2e-5;
// A whole float32 TransformerLayer, GPU against the CPU: as
// tests/gpu/layers_gpu_test.cc's composed float32 bound.
constexpr double kF32ComposedTolerance = 1e-4;
// At DEFAULT its GEMMs run TF32 on the GPU only: y within TF32's GEMM error,
// the gradients (through LayerNorm's backward cancellations and the
// softmax's) by the bfloat16 composed bound that tests/gpu judges TF32 by.
constexpr double kTf32ComposedYTolerance = 5e-3;
constexpr double kTf32ComposedGradTolerance = 2e-2;

using Backends = testing::GpuBackends;
Backends& GetBackends() { return testing::GetGpuBackends(int64_t{8} << 30); }

using testing::DeviceValues;
using testing::StepOutputs;
using testing::ToDevice;

// ---- float64 references with operands as the GPU reads them ---------------------------
enum class Operands { kExact, kTf32Nearest, kTf32Truncated };

float AsTf32(float v, Operands how) {
  if (how == Operands::kExact || !std::isfinite(v)) return v;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if (how == Operands::kTf32Nearest) bits += 0xFFFu + ((bits >> 13) & 1u);  // to nearest even
  bits &= ~0x1FFFu;  // 23 - 10 = 13 mantissa bits dropped
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// c [M, N] = op(a) @ op(b) in float64 over operands converted `how`; a is
// [M, K] (or [K, M] when transpose_a), b [K, N] (or [N, K]).
std::vector<float> Product(const std::vector<float>& a, bool transpose_a,
                           const std::vector<float>& b, bool transpose_b, int64_t m, int64_t k,
                           int64_t n, Operands how) {
  std::vector<double> a64(a.size()), b64(b.size());
  for (size_t i = 0; i < a.size(); ++i) a64[i] = AsTf32(a[i], how);
  for (size_t i = 0; i < b.size(); ++i) b64[i] = AsTf32(b[i], how);
  std::vector<float> c(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = transpose_a ? a64[p * m + i] : a64[i * k + p];
        const double bv = transpose_b ? b64[j * k + p] : b64[p * n + j];
        sum += av * bv;
      }
      c[i * n + j] = static_cast<float>(sum);
    }
  }
  return c;
}

class MatmulPrecisionGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Backends& b = GetBackends();
    if (b.gpu == nullptr) TE_SKIP_OR_FAIL_WITHOUT_GPU("no CUDA device: " << b.unavailable);
    cpu_ = b.cpu.get();
    gpu_ = b.gpu.get();
  }

  absl::StatusOr<Variables> CopyToGpu(const Variables& cpu_vars) {
    Variables gpu_vars;
    for (const auto& [name, t] : cpu_vars) {
      absl::StatusOr<Tensor> g = ToDevice(*gpu_, t);
      if (!g.ok()) return g.status();
      gpu_vars[name] = *g;
    }
    return gpu_vars;
  }

  Ops* cpu_ = nullptr;
  Ops* gpu_ = nullptr;
};

TEST_F(MatmulPrecisionGpuTest, DenseGeneralAgainstFloat64) {
  // Odd sizes: no tile divides them evenly.
  constexpr int64_t kBatch = 3, kSeq = 37, kIn = 320, kOut = 208;
  constexpr int64_t kRows = kBatch * kSeq;
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(kOut);
  spec.mutable_dense_general()->set_use_bias(true);
  auto layer = CreateLayer(spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Shape shape = {kBatch, kSeq, kIn};
  auto cpu_vars = testing::InitLayer(*cpu_, **layer, shape, nullptr, 3);
  ASSERT_TRUE(cpu_vars.ok()) << cpu_vars.status();
  RandomizeParams(*cpu_, &*cpu_vars, 11, 0.5f);
  const std::string kernel_name = "params/kernel", bias_name = "params/bias";
  ASSERT_EQ(cpu_vars->count(kernel_name), 1u);
  ASSERT_EQ(cpu_vars->count(bias_name), 1u);
  const std::vector<float> kernel = Values(cpu_vars->at(kernel_name));  // [kIn, kOut]
  const std::vector<float> bias = Values(cpu_vars->at(bias_name));
  const Tensor x = RandomTensor(*cpu_, shape, DType::kF32, 1);
  const Tensor dy = RandomTensor(*cpu_, {kBatch, kSeq, kOut}, DType::kF32, 2);
  const std::vector<float> xv = Values(x), dyv = Values(dy);

  // The references: y = x @ kernel + bias, dx = dy @ kernel^T, dkernel = x^T @ dy.
  std::map<Operands, std::map<std::string, std::vector<float>>> refs;
  for (Operands how : {Operands::kExact, Operands::kTf32Nearest, Operands::kTf32Truncated}) {
    std::vector<float> y = Product(xv, false, kernel, false, kRows, kIn, kOut, how);
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kOut; ++j) y[i * kOut + j] += bias[j];
    }
    refs[how]["y"] = y;
    refs[how]["dx"] = Product(dyv, false, kernel, true, kRows, kOut, kIn, how);
    refs[how]["dkernel"] = Product(xv, true, dyv, false, kIn, kRows, kOut, how);
  }

  for (bool tf32 : {false, true}) {
    SCOPED_TRACE(tf32 ? "DEFAULT" : "HIGHEST");
    auto gpu_vars = CopyToGpu(*cpu_vars);
    ASSERT_TRUE(gpu_vars.ok()) << gpu_vars.status();
    LayerInputs in;
    in.x = *ToDevice(*gpu_, x);
    auto got = testing::TrainingStep(*gpu_, **layer, &*gpu_vars, in, *ToDevice(*gpu_, dy), tf32);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const std::map<std::string, std::vector<float>> values = {
        {"y", DeviceValues(*gpu_, *cpu_, got->y)},
        {"dx", DeviceValues(*gpu_, *cpu_, got->dx)},
        {"dkernel", DeviceValues(*gpu_, *cpu_, got->grads.at(kernel_name))}};
    for (const auto& [name, v] : values) {
      const double vs_float64 = RelativeError(v, refs[Operands::kExact][name]);
      const double vs_nearest = RelativeError(v, refs[Operands::kTf32Nearest][name]);
      const double vs_truncated = RelativeError(v, refs[Operands::kTf32Truncated][name]);
      std::printf("DenseGeneral %s %s: relative error against float64 %.3g (against TF32 "
                  "operands: to nearest %.3g, truncated %.3g)\n",
                  tf32 ? "DEFAULT" : "HIGHEST", name.c_str(), vs_float64, vs_nearest,
                  vs_truncated);
      if (!tf32) {
        EXPECT_LT(vs_float64, kF32Tolerance) << name;
        continue;
      }
      EXPECT_GT(vs_float64, kTf32Floor) << name << ": DEFAULT ran exact float32";
      EXPECT_LT(vs_float64, kTf32Tolerance) << name;
      EXPECT_LT(std::min(vs_nearest, vs_truncated), kF32Tolerance)
          << name << ": not the product of TF32-rounded operands";
    }
  }
}

TEST_F(MatmulPrecisionGpuTest, TransformerLayerAgainstTheCpu) {
  constexpr int64_t kBatch = 2, kSeq = 40, kHidden = 128;
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* t = spec.mutable_transformer_layer();
  t->set_hidden_size(kHidden);
  t->set_mlp_hidden_size(320);
  t->set_num_attention_heads(4);
  t->set_use_bias(true);
  auto layer = CreateLayer(spec);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Shape shape = {kBatch, kSeq, kHidden};
  auto cpu_vars = testing::InitLayer(*cpu_, **layer, shape, nullptr, 5);
  ASSERT_TRUE(cpu_vars.ok()) << cpu_vars.status();
  RandomizeParams(*cpu_, &*cpu_vars, 13, 0.5f);
  LayerInputs cpu_in;
  cpu_in.x = RandomTensor(*cpu_, shape, DType::kF32, 1);
  const Tensor dy = RandomTensor(*cpu_, shape, DType::kF32, 2);
  // The CPU is exact float32 whatever the flag: one reference serves both.
  Variables ref_vars = *cpu_vars;
  auto ref = testing::TrainingStep(*cpu_, **layer, &ref_vars, cpu_in, dy, /*tf32=*/true);
  ASSERT_TRUE(ref.ok()) << ref.status();

  for (bool tf32 : {false, true}) {
    SCOPED_TRACE(tf32 ? "DEFAULT" : "HIGHEST");
    auto gpu_vars = CopyToGpu(*cpu_vars);
    ASSERT_TRUE(gpu_vars.ok()) << gpu_vars.status();
    LayerInputs in;
    in.x = *ToDevice(*gpu_, cpu_in.x);
    auto got = testing::TrainingStep(*gpu_, **layer, &*gpu_vars, in, *ToDevice(*gpu_, dy), tf32);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(gpu_->Synchronize().ok());
    std::map<std::string, double> errors;
    errors["y"] = RelativeError(DeviceValues(*gpu_, *cpu_, got->y), Values(ref->y));
    errors["dx"] = RelativeError(DeviceValues(*gpu_, *cpu_, got->dx), Values(ref->dx));
    for (const auto& [name, g] : ref->grads) {
      ASSERT_EQ(got->grads.count(name), 1u) << name;
      errors[name] = RelativeError(DeviceValues(*gpu_, *cpu_, got->grads.at(name)), Values(g));
    }
    double worst = 0.0;
    std::string summary;
    for (const auto& [name, e] : errors) {
      worst = std::max(worst, e);
      summary += " " + name + "=" + std::to_string(e);
      const double bound = !tf32 ? kF32ComposedTolerance
                           : name == "y" ? kTf32ComposedYTolerance
                                         : kTf32ComposedGradTolerance;
      EXPECT_LT(e, bound) << name;
    }
    if (tf32) {
      EXPECT_GT(worst, kTf32Floor) << "DEFAULT ran exact float32";
    }
    std::printf("TransformerLayer float32 %s, GPU against the CPU:%s\n",
                tf32 ? "DEFAULT" : "HIGHEST", summary.c_str());
  }
}

}  // namespace
}  // namespace te::layers
