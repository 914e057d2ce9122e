// The CUDA op tests' shared pieces (ops_gpu_*_test.cc, one binary:
// //kernels/cuda:ops_gpu_test): the tolerances, stated once here, the two
// backends (CUDA device 0 and the CPU reference), and a fixture that mirrors
// tensors on both and compares a GPU output with the CPU's by its dtype's
// rule. Every CUDA op but GEMM and attention (gemm_gpu_test.cc,
// attention_gpu_test.cc) is tested against the CPU reference on random data:
// a parameterised matrix of op x dtype x FP8 format x shape, odd shapes
// included (tokens not a multiple of 128, hidden not a multiple of 64). Needs
// a GPU: without one every test is skipped, unless TE_REQUIRE_GPU=1 (as
// deploy/bundle.sh's runs set), which makes that a failure.
#ifndef TE_KERNELS_CUDA_OPS_GPU_TEST_H_
#define TE_KERNELS_CUDA_OPS_GPU_TEST_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace gpu_test {

// ---- tolerances (DESIGN.md section 6), stated once ----------------------------
// Relative error ||gpu - cpu|| / ||cpu|| of float outputs, by output dtype.
constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;
// FP8 outputs: the value before the cast may differ in its last float bits
// (FMA contraction, block-reduced statistics), which can move a value across a
// rounding boundary: each code may differ by one FP8 ulp, and at most this
// share of the codes may differ at all.
constexpr int kFp8MaxUlps = 1;
constexpr double kFp8MaxDifferingShare = 0.01;
// Near zero the codes are dense (subnormals), and a value that cancels to ~0
// (x_hat * g + beta) carries float32 error of its terms' size, not its own:
// two codes whose values differ by at most this many float32 ulps of the
// tensor's largest value (2^-24 each) count as equal. Seen on the H200: GPU
// code 29 (4.9e-3) against CPU 0 in an E5M2 tensor whose largest value is 57344.
constexpr double kFp8NearZeroUlpsOfMax = 8;
// amax, scale, scale_inv: relative.
constexpr double kScalarTolerance = 1e-6;

inline double Tolerance(DType dtype) { return dtype == DType::kF32 ? kF32Tolerance : kBf16Tolerance; }

inline const char* Short(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
    case DType::kI32: return "i32";
    case DType::kBool: return "bool";
  }
  return "?";
}

inline std::string ShapeName(const Shape& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s;
}

// ---- the two backends ------------------------------------------------------------

struct Backends {
  std::unique_ptr<Device> cpu_device, gpu_device;
  std::unique_ptr<Ops> cpu, gpu;
};

// Opened once per test binary: every test file shares the two devices.
inline Backends* OpenBackends() {
  static Backends* backends = [] {
    auto* b = new Backends;
    auto gpu_device = OpenCudaDevice(0);
    if (!gpu_device.ok()) {
      std::fprintf(stderr, "no GPU: %s\n", gpu_device.status().ToString().c_str());
      return b;
    }
    b->gpu_device = *std::move(gpu_device);
    b->cpu_device = *OpenCpuDevice();
    b->cpu = *b->cpu_device->NewOps(int64_t{16} << 30);
    b->gpu = *b->gpu_device->NewOps(int64_t{16} << 30);
    return b;
  }();
  return backends;
}

// A tensor on both backends holding the same bytes.
struct Pair {
  Tensor cpu, gpu;
};

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Backends* b = OpenBackends();
    if (b->gpu == nullptr) TE_SKIP_OR_FAIL_WITHOUT_GPU("no CUDA device");
    cpu_ = b->cpu.get();
    gpu_ = b->gpu.get();
  }

  Tensor NewCpu(DType dtype, const Shape& shape) {
    auto t = cpu_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
  Tensor NewGpu(DType dtype, const Shape& shape) {
    auto t = gpu_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }

  // A fresh pair holding a copy of `cpu`'s bytes on each side.
  Pair Clone(const Tensor& cpu) {
    Tensor copy = NewCpu(cpu.dtype(), cpu.shape());
    EXPECT_TRUE(cpu_->Copy(cpu, &copy).ok());
    return Mirror(copy);
  }

  // `cpu` itself, and a GPU tensor with the same bytes.
  Pair Mirror(const Tensor& cpu) {
    Pair p{cpu, NewGpu(cpu.dtype(), cpu.shape())};
    EXPECT_TRUE(gpu_->Upload(cpu.data(), &p.gpu).ok());
    return p;
  }

  Pair Random(DType dtype, const Shape& shape, uint32_t seed, float lo = -2.0f, float hi = 2.0f) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> values(static_cast<size_t>(NumElements(shape)));
    for (float& v : values) v = dist(gen);
    Tensor cpu = NewCpu(dtype, shape);
    FromFloatVector(values, &cpu);
    return Mirror(cpu);
  }

  // Random, or with `misaligned` a view one element into its allocation, so
  // no 16-byte vector access fits (the kernels' single-element paths).
  Pair Input(DType dtype, const Shape& shape, uint32_t seed, bool misaligned, float lo = -2.0f,
             float hi = 2.0f) {
    if (!misaligned) return Random(dtype, shape, seed, lo, hi);
    const int64_t n = NumElements(shape);
    const Pair flat = Random(dtype, {n + 1}, seed, lo, hi);
    return Pair{flat.cpu.Slice0(1, n + 1).Reshaped(shape),
                flat.gpu.Slice0(1, n + 1).Reshaped(shape)};
  }

  Pair Scalar(float value) {
    Tensor cpu = NewCpu(DType::kF32, {1});
    cpu.data_as<float>()[0] = value;
    return Mirror(cpu);
  }

  // An output: the CPU side uninitialised, the GPU side poisoned (NaN, or
  // 0x7f for FP8) so an element the kernel never writes fails the comparison.
  Pair Output(DType dtype, const Shape& shape) {
    Pair p{NewCpu(dtype, shape), NewGpu(dtype, shape)};
    if (IsFloating(dtype)) {
      EXPECT_TRUE(gpu_->Fill(NAN, &p.gpu).ok());
    }
    return p;
  }

  // The GPU tensor's bytes as a CPU tensor.
  Tensor Fetch(const Tensor& gpu) {
    Tensor host = NewCpu(gpu.dtype(), gpu.shape());
    const absl::Status s = gpu_->Download(gpu, host.data());
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }

  // Compares a GPU output with the CPU's, by the dtype's rule.
  void ExpectMatches(const Pair& p, const std::string& what) {
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor got = Fetch(p.gpu);
    const Tensor& want = p.cpu;
    ASSERT_EQ(got.numel(), want.numel());
    if (IsFloat8(want.dtype())) {
      ExpectFp8Close(got, want, what);
      return;
    }
    if (!IsFloating(want.dtype())) {
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), want.nbytes())) << what;
      return;
    }
    double diff = 0.0, norm = 0.0;
    int64_t nans = 0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double a = LoadAsFloat(got, i), b = LoadAsFloat(want, i);
      if (std::isnan(a) != std::isnan(b)) ++nans;
      if (std::isnan(a) || std::isnan(b)) continue;
      diff += (a - b) * (a - b);
      norm += b * b;
    }
    EXPECT_EQ(nans, 0) << what << ": elements NaN on one side only (unwritten?)";
    const double rel = norm == 0.0 ? std::sqrt(diff) : std::sqrt(diff / norm);
    EXPECT_LE(rel, Tolerance(want.dtype())) << what << " (" << Short(want.dtype()) << ")";
  }

  void ExpectFp8Close(const Tensor& got, const Tensor& want, const std::string& what) {
    const uint8_t* g = got.data_as<const uint8_t>();
    const uint8_t* w = want.data_as<const uint8_t>();
    // Sign-magnitude codes as ordered integers: neighbours differ by 1.
    auto ordinal = [](uint8_t code) { return (code & 0x80) ? -(code & 0x7f) : (code & 0x7f); };
    double largest = 0.0;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double v = std::fabs(LoadAsFloat(want, i));
      if (std::isfinite(v)) largest = std::max(largest, v);
    }
    const double near_zero = kFp8NearZeroUlpsOfMax * std::ldexp(largest, -24);
    int64_t differing = 0, worst = 0, worst_at = -1;
    for (int64_t i = 0; i < want.numel(); ++i) {
      if (g[i] == w[i]) continue;
      ++differing;
      if (std::fabs(LoadAsFloat(got, i) - LoadAsFloat(want, i)) <= near_zero) continue;
      const int64_t ulps = std::abs(ordinal(g[i]) - ordinal(w[i]));
      if (ulps > worst) worst = ulps, worst_at = i;
    }
    EXPECT_LE(worst, kFp8MaxUlps) << what << ": element " << worst_at << " gpu code "
                                  << int(worst_at >= 0 ? g[worst_at] : 0) << " cpu code "
                                  << int(worst_at >= 0 ? w[worst_at] : 0);
    EXPECT_LE(static_cast<double>(differing), kFp8MaxDifferingShare * want.numel() + 1)
        << what << ": " << differing << " of " << want.numel() << " FP8 codes differ";
  }

  // Two GPU tensors holding the same bytes (two paths that must agree bit
  // for bit).
  void ExpectSameBits(const Tensor& a, const Tensor& b, const std::string& what) {
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor x = Fetch(a), y = Fetch(b);
    ASSERT_EQ(x.nbytes(), y.nbytes()) << what;
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.nbytes())) << what;
  }

  void ExpectScalarMatches(const Pair& p, const std::string& what) {
    const Tensor got = Fetch(p.gpu);
    const float a = got.data_as<float>()[0], b = p.cpu.data_as<float>()[0];
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a)) << what << ": gpu " << a << ", cpu NaN";
      return;
    }
    EXPECT_NEAR(a, b, kScalarTolerance * std::fabs(b)) << what;
  }

  struct Fp8Pair {
    Pair scale, amax, scale_inv;
    Fp8Output cpu() const { return {scale.cpu, amax.cpu, scale_inv.cpu}; }
    Fp8Output gpu() const { return {scale.gpu, amax.gpu, scale_inv.gpu}; }
  };
  Fp8Pair Fp8Side(float scale) { return {Scalar(scale), Scalar(-1.0f), Scalar(-1.0f)}; }
  void ExpectFp8SideMatches(const Fp8Pair& f, const std::string& what) {
    ExpectScalarMatches(f.amax, what + " amax");
    ExpectScalarMatches(f.scale_inv, what + " scale_inv");
  }

  Ops* cpu_ = nullptr;
  Ops* gpu_ = nullptr;
};

// A scale per FP8 format that makes some of the values in [-4, 4] saturate.
inline float SaturatingScale(DType fp8) { return fp8 == DType::kE4M3 ? 150.0f : 20000.0f; }

// Element counts that are and are not multiples of the kernels' 8-element vectors.
inline const std::vector<Shape> kShapes = {{77, 200}, {128, 4096}, {3, 5, 64}, {33, 101}, {1, 1}};

// (dtype, shape): the elementwise and dropout matrices.
using DTypeShape = std::tuple<DType, Shape>;
inline std::string DTypeShapeName(const ::testing::TestParamInfo<DTypeShape>& info) {
  return std::string(Short(std::get<0>(info.param))) + "_" + ShapeName(std::get<1>(info.param));
}

}  // namespace gpu_test
}  // namespace te

#endif  // TE_KERNELS_CUDA_OPS_GPU_TEST_H_
