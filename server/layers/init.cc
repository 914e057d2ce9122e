#include "server/layers/init.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te::layers {
namespace {

// JAX's variance_scaling divides by the std of a standard normal truncated
// to [-2, 2], so the result has the requested variance.
constexpr double kTruncatedStd = 0.87962566103423978;

// Inverse of erf on (-1, 1): Giles' approximation refined by Newton steps.
double ErfInv(double y) {
  const double w0 = -std::log((1.0 - y) * (1.0 + y));
  double x;
  if (w0 < 5.0) {
    const double w = w0 - 2.5;
    double p = 2.81022636e-08;
    p = 3.43273939e-07 + p * w;
    p = -3.5233877e-06 + p * w;
    p = -4.39150654e-06 + p * w;
    p = 0.00021858087 + p * w;
    p = -0.00125372503 + p * w;
    p = -0.00417768164 + p * w;
    p = 0.246640727 + p * w;
    p = 1.50140941 + p * w;
    x = p * y;
  } else {
    const double w = std::sqrt(w0) - 3.0;
    double p = -0.000200214257;
    p = 0.000100950558 + p * w;
    p = 0.00134934322 + p * w;
    p = -0.00367342844 + p * w;
    p = 0.00573950773 + p * w;
    p = -0.0076224613 + p * w;
    p = 0.00943887047 + p * w;
    p = 1.00167406 + p * w;
    p = 2.83297682 + p * w;
    x = p * y;
  }
  for (int i = 0; i < 2; ++i) {
    const double err = std::erf(x) - y;
    x -= err / (2.0 / std::sqrt(M_PI) * std::exp(-x * x));
  }
  return x;
}

}  // namespace


Initializer Initializer::VarianceScalingFanIn(int64_t fan_in, float scale) {
  const double variance = static_cast<double>(scale) / static_cast<double>(fan_in > 0 ? fan_in : 1);
  return {Kind::kTruncatedNormal, static_cast<float>(std::sqrt(variance) / kTruncatedStd)};
}

Initializer Initializer::NormalFanIn(int64_t fan_in, float scale) {
  const double variance = static_cast<double>(scale) / static_cast<double>(fan_in > 0 ? fan_in : 1);
  return {Kind::kNormal, static_cast<float>(std::sqrt(variance))};
}

int64_t KernelFanIn(const Shape& shape) {
  if (shape.empty() || shape.back() == 0) return 1;
  return NumElements(shape) / shape.back();
}

Initializer KernelInit(const Shape& shape) {
  return Initializer::VarianceScalingFanIn(KernelFanIn(shape));
}

std::vector<VariableSpec> SpecsOf(const std::vector<VariableDef>& defs) {
  std::vector<VariableSpec> specs;
  specs.reserve(defs.size());
  for (const VariableDef& def : defs) specs.push_back(def.spec);
  return specs;
}

std::pair<int, int64_t> Fp8StateKey(const Fp8Recipe* fp8) {
  if (fp8 == nullptr) return {-1, 0};
  return {static_cast<int>(fp8->kind), fp8->amax_history_len};
}

const std::vector<VariableSpec>& SpecsMemo::Get(
    const Fp8Recipe* fp8, const std::function<std::vector<VariableDef>()>& defs) const {
  const std::pair<int, int64_t> key = Fp8StateKey(fp8);
  std::lock_guard<std::mutex> lock(made_->mu);
  auto it = made_->specs.find(key);
  if (it == made_->specs.end()) it = made_->specs.emplace(key, SpecsOf(defs())).first;
  return it->second;  // a map's values stay where they are
}

ValueFill InitialValueFill(uint64_t seed, const std::string& name, const Initializer& init) {
  switch (init.kind) {
    case Initializer::Kind::kZeros:
      return [](int64_t begin, int64_t end, float* out) { std::fill(out, out + (end - begin), 0.0f); };
    case Initializer::Kind::kOnes:
      return [](int64_t begin, int64_t end, float* out) { std::fill(out, out + (end - begin), 1.0f); };
    case Initializer::Kind::kTruncatedNormal:
    case Initializer::Kind::kNormal:
      break;
  }
  // As jax.random.truncated_normal: uniform between erf(-2/sqrt2) and
  // erf(2/sqrt2), mapped through sqrt(2) * erfinv. A chunk splits over
  // threads: a quickstart layer has 200M values, about 20 s on one core.
  const uint64_t stream = DeriveSeed(seed, name);
  const float stddev = init.stddev;
  // kNormal: the same inverse-CDF map over all of (-1, 1) (jax.random.normal's
  // own draws differ; the distribution is the same).
  const bool truncated = init.kind == Initializer::Kind::kTruncatedNormal;
  return [stream, stddev, truncated](int64_t begin, int64_t end, float* out) {
    const double hi = truncated ? std::erf(2.0 / std::sqrt(2.0)) : 1.0 - 1e-12;
    auto fill = [out, begin, stream, hi, stddev, truncated](int64_t from, int64_t to) {
      for (int64_t i = from; i < to; ++i) {
        const double u = -hi + 2.0 * hi * UniformOpen01(stream, static_cast<uint64_t>(i));
        double z = std::sqrt(2.0) * ErfInv(u);
        if (truncated) z = std::fmin(2.0, std::fmax(-2.0, z));
        out[i - begin] = static_cast<float>(z * stddev);
      }
    };
    constexpr int64_t kValuesPerThread = 1 << 18;
    const int64_t n = end - begin;
    const int64_t threads =
        std::min<int64_t>(std::max<unsigned>(1, std::thread::hardware_concurrency()),
                          (n + kValuesPerThread - 1) / kValuesPerThread);
    if (threads <= 1) {
      fill(begin, end);
      return;
    }
    std::vector<std::thread> workers;
    const int64_t per = (n + threads - 1) / threads;
    for (int64_t t = 1; t < threads; ++t) {
      workers.emplace_back(fill, begin + std::min(n, t * per), begin + std::min(n, (t + 1) * per));
    }
    fill(begin, begin + std::min(n, per));
    for (std::thread& w : workers) w.join();
  };
}

std::vector<float> InitialValues(uint64_t seed, const std::string& name, const Initializer& init,
                                 int64_t n) {
  std::vector<float> values(static_cast<size_t>(n));
  InitialValueFill(seed, name, init)(0, n, values.data());
  return values;
}

absl::Status StoreVariable(Ops& ops, const VariableSpec& spec, const ValueFill& fill,
                           Variables* vars) {
  ASSIGN_OR_RETURN(Tensor variable, ops.Allocate(spec.dtype, spec.shape));
  const int64_t n = variable.numel();
  if (n > 0) {
    const int64_t chunk = std::min(n, kInitChunkElements);
    std::vector<float> host(static_cast<size_t>(chunk));
    Tensor staging;  // float32 on the device, for variables of another dtype
    if (spec.dtype != DType::kF32) {
      ASSIGN_OR_RETURN(staging, ops.Allocate(DType::kF32, {chunk}));
    }
    const Tensor flat = variable.Reshaped({n});
    for (int64_t begin = 0; begin < n; begin += chunk) {
      // A large layer's init takes minutes on the host: the call's deadline
      // and cancellation end it between chunks (what it allocated goes).
      RETURN_IF_ERROR(ops.CheckInterrupt());
      const int64_t end = std::min(n, begin + chunk);
      fill(begin, end, host.data());
      Tensor part = flat.Slice0(begin, end);
      if (spec.dtype == DType::kF32) {
        // Upload copies from pageable memory before it returns: `host` is free again.
        RETURN_IF_ERROR(ops.Upload(host.data(), &part));
        continue;
      }
      // The stream orders the next chunk's upload after this chunk's cast.
      Tensor staged = staging.Slice0(0, end - begin);
      RETURN_IF_ERROR(ops.Upload(host.data(), &staged));
      RETURN_IF_ERROR(ops.Cast(staged, &part));
    }
  }
  (*vars)[spec.name] = variable;
  return absl::OkStatus();
}

absl::Status InitVariables(Ops& ops, uint64_t seed, const std::vector<VariableDef>& defs,
                           Variables* vars) {
  for (const VariableDef& def : defs) {
    RETURN_IF_ERROR(
        StoreVariable(ops, def.spec, InitialValueFill(seed, def.spec.name, def.init), vars));
  }
  return absl::OkStatus();
}

}  // namespace te::layers
