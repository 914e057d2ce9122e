#include "server/layers/testing.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "kernels/cpu/cpu_ops.h"

namespace te::layers::testing {

std::unique_ptr<Ops> NewCpuOps() { return std::make_unique<CpuOps>(); }

Tensor RandomTensor(Ops& ops, const Shape& shape, DType dtype, uint64_t seed, float scale) {
  auto t = ops.Allocate(dtype, shape);
  EXPECT_TRUE(t.ok()) << t.status();
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(static_cast<size_t>(NumElements(shape)));
  for (float& x : v) x = dist(gen);
  FromFloatVector(v, &*t);
  return *t;
}

std::vector<float> Values(const Tensor& t) { return ToFloatVector(t); }

void SetValues(const std::vector<float>& values, Tensor* t) { FromFloatVector(values, t); }

namespace {

double Norm(const std::vector<float>& v) {
  double sum = 0.0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

}  // namespace

bool IsKeyBiasGradient(const std::string& name) { return absl::EndsWith(name, "/key/bias"); }

std::string KeyKernelOf(const std::string& key_bias_name) {
  return key_bias_name.substr(0, key_bias_name.size() - 4) + "kernel";
}

double ZeroGradientError(const std::vector<float>& got, const std::vector<float>& want,
                         const std::vector<float>& key_kernel_gradient) {
  if (got == want) return 0.0;  // the same values: exact
  return std::max(Norm(want), Norm(got)) / std::max(Norm(key_kernel_gradient), 1e-30);
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, norm = 0.0;
  const size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  if (got.size() != want.size()) return INFINITY;
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

absl::StatusOr<StepOutputs> TrainingStep(Ops& ops, const Layer& layer, Variables* vars,
                                         const LayerInputs& inputs, const Tensor& dy, bool tf32) {
  ForwardOptions opts;
  opts.keep_for_backward = true;
  opts.tf32 = tf32;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = layer.Forward(ops, vars, inputs, opts, &out, &saved);
  if (!s.ok()) return s;
  LayerGrads grads;
  s = layer.Backward(ops, vars, *saved, dy, &grads);
  if (!s.ok()) return s;
  return StepOutputs{out.y, grads.dx, grads.dextra, grads.params};
}

absl::StatusOr<Tensor> ToDevice(Ops& device, const Tensor& host) {
  absl::StatusOr<Tensor> t = device.Allocate(host.dtype(), host.shape());
  if (!t.ok()) return t.status();
  absl::Status s = device.Upload(host.data(), &*t);
  if (s.ok()) s = device.Synchronize();
  if (!s.ok()) return s;
  return t;
}

std::vector<float> DeviceValues(Ops& device, Ops& host, const Tensor& t) {
  absl::StatusOr<Tensor> copy = host.Allocate(t.dtype(), t.shape());
  EXPECT_TRUE(copy.ok());
  if (!copy.ok()) return {};
  EXPECT_TRUE(device.Download(t, copy->data()).ok());
  return Values(*copy);
}

absl::StatusOr<Variables> InitLayer(Ops& ops, const Layer& layer, const Shape& input_shape,
                                    const Fp8Recipe* fp8, uint64_t seed) {
  Variables vars;
  absl::Status s = layer.Init(ops, seed, input_shape, fp8, &vars);
  if (!s.ok()) return s;
  return vars;
}

void RandomizeParams(Ops& ops, Variables* vars, uint64_t seed, float scale) {
  for (auto& [name, t] : *vars) {
    if (!absl::StartsWith(name, "params/")) continue;
    t = RandomTensor(ops, t.shape(), t.dtype(), seed++, scale);
  }
}

namespace {

// One tensor whose gradient is checked: where it lives and its analytic gradient.
struct Probe {
  std::string name;
  Tensor value;     // perturbed in place
  Tensor analytic;  // from Backward
};

double Objective(Ops& ops, const Layer& layer, Variables* vars, const LayerInputs& inputs,
                 ForwardOptions opts, const std::vector<float>& dy, absl::Status* status) {
  opts.keep_for_backward = false;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  *status = layer.Forward(ops, vars, inputs, opts, &out, &saved);
  if (!status->ok()) return 0.0;
  const std::vector<float> y = Values(out.y);
  double sum = 0.0;
  for (size_t i = 0; i < y.size(); ++i) sum += static_cast<double>(y[i]) * dy[i];
  return sum;
}

}  // namespace

::testing::AssertionResult CheckGradients(Ops& ops, const Layer& layer, Variables* vars,
                                          const LayerInputs& inputs, const ForwardOptions& opts,
                                          const GradCheckOptions& check) {
  ForwardOptions keep = opts;
  keep.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = layer.Forward(ops, vars, inputs, keep, &out, &saved);
  if (!s.ok()) return ::testing::AssertionFailure() << "forward: " << s;
  if (saved == nullptr) return ::testing::AssertionFailure() << "forward kept nothing";
  const Tensor dy_t = RandomTensor(ops, out.y.shape(), out.y.dtype(), check.dy_seed);
  const std::vector<float> dy = Values(dy_t);
  LayerGrads grads;
  s = layer.Backward(ops, vars, *saved, dy_t, &grads);
  if (!s.ok()) return ::testing::AssertionFailure() << "backward: " << s;

  std::vector<Probe> probes;
  probes.push_back({"dx", inputs.x, grads.dx});
  if (grads.dextra.size() != inputs.extra.size()) {
    return ::testing::AssertionFailure() << "backward returned " << grads.dextra.size()
                                         << " extra gradients for " << inputs.extra.size()
                                         << " extra inputs";
  }
  for (size_t i = 0; i < inputs.extra.size(); ++i) {
    probes.push_back({"dextra[" + std::to_string(i) + "]", inputs.extra[i], grads.dextra[i]});
  }
  for (const auto& [name, value] : *vars) {
    if (!absl::StartsWith(name, "params/")) continue;
    auto g = grads.params.find(name);
    if (g == grads.params.end()) {
      return ::testing::AssertionFailure() << "no gradient for " << name;
    }
    probes.push_back({name, value, g->second});
  }
  if (grads.params.size() + 1 + inputs.extra.size() > probes.size()) {
    return ::testing::AssertionFailure() << "gradients for variables the layer does not have";
  }

  std::ostringstream report;
  bool ok = true;
  for (Probe& p : probes) {
    if (p.value.dtype() != DType::kF32) {
      return ::testing::AssertionFailure() << p.name << ": finite differences need float32";
    }
    if (p.analytic.shape() != p.value.shape()) {
      return ::testing::AssertionFailure()
             << p.name << " gradient is " << ShapeString(p.analytic.shape()) << ", want "
             << ShapeString(p.value.shape());
    }
    const std::vector<float> analytic_all = Values(p.analytic);
    const int64_t n = p.value.numel();
    const int64_t stride = std::max<int64_t>(1, n / check.max_probes);
    std::vector<float> numeric, analytic;
    float* data = p.value.data_as<float>();
    for (int64_t i = (n > check.max_probes ? stride / 2 : 0); i < n; i += stride) {
      const float original = data[i];
      data[i] = original + static_cast<float>(check.step);
      const double plus = Objective(ops, layer, vars, inputs, opts, dy, &s);
      data[i] = original - static_cast<float>(check.step);
      const double minus = s.ok() ? Objective(ops, layer, vars, inputs, opts, dy, &s) : 0.0;
      data[i] = original;
      if (!s.ok()) return ::testing::AssertionFailure() << "forward while probing: " << s;
      numeric.push_back(static_cast<float>((plus - minus) / (2.0 * check.step)));
      analytic.push_back(analytic_all[i]);
    }
    const double err = RelativeError(analytic, numeric);
    report << p.name << ": rel err " << err << " over " << numeric.size() << " probes\n";
    if (!(err <= check.tolerance)) ok = false;
  }
  if (!ok) return ::testing::AssertionFailure() << "gradient mismatch:\n" << report.str();
  return ::testing::AssertionSuccess() << report.str();
}

namespace {

struct Step {
  Tensor y;
  LayerGrads grads;
};

absl::StatusOr<Step> RunStep(Ops& ops, const Layer& layer, Variables* vars,
                             const LayerInputs& inputs, ForwardOptions opts, const Tensor* dy) {
  opts.keep_for_backward = true;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  absl::Status s = layer.Forward(ops, vars, inputs, opts, &out, &saved);
  if (!s.ok()) return s;
  Step step;
  step.y = out.y;
  s = layer.Backward(ops, vars, *saved, *dy, &step.grads);
  if (!s.ok()) return s;
  return step;
}

}  // namespace

absl::StatusOr<Fp8Comparison> CompareWithFp8(Ops& ops, const Layer& layer, Variables* vars,
                                             const LayerInputs& inputs, const Fp8Recipe& fp8,
                                             ForwardOptions opts) {
  auto y_shape = layer.OutputShape(inputs.x.shape());
  if (!y_shape.ok()) return y_shape.status();
  const Tensor dy = RandomTensor(ops, *y_shape, inputs.x.dtype(), 1234);
  opts.fp8 = nullptr;
  auto ref = RunStep(ops, layer, vars, inputs, opts, &dy);
  if (!ref.ok()) return ref.status();
  opts.fp8 = &fp8;
  auto got = RunStep(ops, layer, vars, inputs, opts, &dy);
  if (!got.ok()) return got.status();
  Fp8Comparison c;
  c.y = RelativeError(Values(got->y), Values(ref->y));
  c.dx = RelativeError(Values(got->grads.dx), Values(ref->grads.dx));
  for (const auto& [name, g] : ref->grads.params) {
    auto it = got->grads.params.find(name);
    c.params[name] = it == got->grads.params.end()
                         ? INFINITY
                         : RelativeError(Values(it->second), Values(g));
  }
  return c;
}

Fp8Recipe DelayedRecipe(int amax_history_len) {
  Fp8Recipe r;
  r.kind = Fp8Recipe::Kind::kDelayedScaling;
  r.amax_history_len = amax_history_len;
  return r;
}

Fp8Recipe CurrentScalingRecipe() {
  Fp8Recipe r;
  r.kind = Fp8Recipe::Kind::kCurrentScaling;
  return r;
}

Fp8Recipe Mxfp8Recipe() {
  Fp8Recipe r;
  r.kind = Fp8Recipe::Kind::kMXFP8;
  r.format = Fp8Recipe::Format::kE4M3;
  return r;
}

Fp8Recipe Nvfp4Recipe() {
  Fp8Recipe r;
  r.kind = Fp8Recipe::Kind::kNVFP4;
  r.format = Fp8Recipe::Format::kE4M3;
  return r;
}

}  // namespace te::layers::testing
