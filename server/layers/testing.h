// Test helpers for layer tests on the CPU backend (test-only): random tensors,
// host access, relative errors, and a finite-difference gradient check of any
// Layer. CPU tensors live in host memory, so values are read and written
// directly.
#ifndef TE_SERVER_LAYERS_TESTING_H_
#define TE_SERVER_LAYERS_TESTING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"

namespace te::layers::testing {

// Tolerances, stated once.
// Central differences in float32 with step 1e-2 on O(1) data: truncation
// error ~ step^2 and rounding noise ~ 1e-7 / step leave gradients within 1%
// (relative L2 error over the probed elements).
constexpr double kGradStep = 1e-2;
constexpr double kGradTolerance = 1e-2;
// FP8 forward against the same forward without FP8 (relative L2 error of y):
// E4M3 rounds each GEMM operand to 3 mantissa bits (relative error <= 2^-4
// each, ~2^-5 in RMS), two operands and accumulation over random signs keep
// the output within ~6%; E5M2 gradients would be looser but only y is checked.
constexpr double kFp8ForwardTolerance = 0.08;
// Emulated MXFP8 (E4M3 values, power-of-two block scales): as E4M3.
constexpr double kBlockScaledForwardTolerance = 0.08;
// NVFP4 (E2M1 values: 1 mantissa bit) is much coarser.
constexpr double kNvfp4ForwardTolerance = 0.35;
// FP8 gradients against gradients without FP8: dy in E5M2 (2 mantissa bits,
// relative error <= 2^-3, ~2^-4.5 RMS) on top of the E4M3 forward operands.
constexpr double kFp8BackwardTolerance = 0.15;

// A CPU-backend Ops with no memory limit.
std::unique_ptr<Ops> NewCpuOps();

// Uniform in [-scale, scale), reproducible from `seed`, never all zeros.
Tensor RandomTensor(Ops& ops, const Shape& shape, DType dtype, uint64_t seed,
                    float scale = 1.0f);
std::vector<float> Values(const Tensor& t);
void SetValues(const std::vector<float>& values, Tensor* t);

// ||got - want|| / ||want|| (want all zeros: ||got||).
double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

// Flax attention's key bias gets a gradient that is exactly zero (softmax
// ignores a shift of a query's logits, and q . b_key shifts them all), so two
// backends hold rounding noise there and their relative difference means
// nothing. The one rule every comparison uses (GPU against CPU here, and
// client/python/examples/jax_parity.py's zero_err against JAX): each side is
// judged by its size against the key kernel's gradient,
// max(|want|, |got|) / |key kernel gradient|, and 0 where the two are equal.
bool IsKeyBiasGradient(const std::string& name);
// The key kernel's name for a key bias's: ".../key/bias" -> ".../key/kernel".
std::string KeyKernelOf(const std::string& key_bias_name);
double ZeroGradientError(const std::vector<float>& got, const std::vector<float>& want,
                         const std::vector<float>& key_kernel_gradient);

// Init(seed) of `layer` for `input_shape` into a fresh Variables.
absl::StatusOr<Variables> InitLayer(Ops& ops, const Layer& layer, const Shape& input_shape,
                                    const Fp8Recipe* fp8, uint64_t seed = 1);
// Replaces every "params/..." variable with random values (same shape and
// dtype), so gradient checks see non-trivial biases and norm scales.
void RandomizeParams(Ops& ops, Variables* vars, uint64_t seed, float scale = 0.5f);

struct GradCheckOptions {
  double step = kGradStep;
  double tolerance = kGradTolerance;
  int max_probes = 48;  // elements probed per tensor (all when fewer)
  uint64_t dy_seed = 99;
};

// Runs forward (keeping) and backward with a random dy, then checks dx, each
// extra-input gradient and every parameter gradient against central
// differences of vdot(y, dy). Inputs and params must be float32. `vars` is
// restored exactly afterwards. Fails when a gradient is missing, has the
// wrong shape, or its relative error exceeds the tolerance.
::testing::AssertionResult CheckGradients(Ops& ops, const Layer& layer, Variables* vars,
                                          const LayerInputs& inputs, const ForwardOptions& opts,
                                          const GradCheckOptions& check = {});

// One step with FP8 against the same step without it (same vars, x and dy):
// relative errors of y, dx and every parameter gradient.
struct Fp8Comparison {
  double y = 0.0;
  double dx = 0.0;
  std::map<std::string, double> params;
};
absl::StatusOr<Fp8Comparison> CompareWithFp8(Ops& ops, const Layer& layer, Variables* vars,
                                             const LayerInputs& inputs, const Fp8Recipe& fp8,
                                             ForwardOptions opts = {});

// One training step (forward keeping, then backward with `dy`) at the
// call's matmul precision (`tf32`: DEFAULT on the GPU): what the tests that
// compare the two backends run on each.
struct StepOutputs {
  Tensor y, dx;
  std::vector<Tensor> dextra;
  Variables grads;
};
absl::StatusOr<StepOutputs> TrainingStep(Ops& ops, const Layer& layer, Variables* vars,
                                         const LayerInputs& inputs, const Tensor& dy, bool tf32);

// A host tensor copied onto `device` (synchronised), and a device tensor's
// values read back through the host backend `host`.
absl::StatusOr<Tensor> ToDevice(Ops& device, const Tensor& host);
std::vector<float> DeviceValues(Ops& device, Ops& host, const Tensor& t);

// Recipes with TE's defaults and a short history (tests).
Fp8Recipe DelayedRecipe(int amax_history_len = 16);
Fp8Recipe CurrentScalingRecipe();
Fp8Recipe Mxfp8Recipe();
Fp8Recipe Nvfp4Recipe();

// CUDA device 0 and the CPU reference, opened once per test binary, for the
// tests that compare the two backends (they link //kernels/cuda). `gpu` is
// null, with the reason in `unavailable`, where no GPU could be opened.
// `gpu_memory_limit` is the GPU Ops' session memory limit; the first call's
// holds. Inline, so the CPU-only tests that link this library never reference
// OpenCudaDevice.
struct GpuBackends {
  std::unique_ptr<Device> gpu_device;
  std::unique_ptr<Ops> cpu, gpu;
  std::string unavailable;  // why there is no GPU
};
inline GpuBackends& GetGpuBackends(int64_t gpu_memory_limit) {
  static GpuBackends* backends = [gpu_memory_limit] {
    auto* b = new GpuBackends;
    absl::StatusOr<std::unique_ptr<Device>> device = OpenCudaDevice(0);
    if (!device.ok()) {
      b->unavailable = device.status().ToString();
      return b;
    }
    absl::StatusOr<std::unique_ptr<Ops>> gpu = (*device)->NewOps(gpu_memory_limit);
    if (!gpu.ok()) {
      b->unavailable = gpu.status().ToString();
      return b;
    }
    b->gpu_device = *std::move(device);
    b->gpu = *std::move(gpu);
    b->cpu = NewCpuOps();
    return b;
  }();
  return *backends;
}

}  // namespace te::layers::testing

#endif  // TE_SERVER_LAYERS_TESTING_H_
