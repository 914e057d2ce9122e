// Every CUDA op (but GEMM and attention, tested in their own files) against
// the CPU reference on random data: a parameterised matrix of op x dtype x FP8
// format x shape, odd shapes included (tokens not a multiple of 128, hidden
// not a multiple of 64). Needs a GPU: without one every test is skipped,
// unless TE_REQUIRE_GPU=1 (as deploy/bundle.sh's runs set), which makes that a
// failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
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
#include "kernels/ops.h"

namespace te {
namespace {

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

double Tolerance(DType dtype) { return dtype == DType::kF32 ? kF32Tolerance : kBf16Tolerance; }

const char* Short(DType dtype) {
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

std::string ShapeName(const Shape& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "x" : "") + std::to_string(shape[i]);
  return s;
}

// ---- the two backends ------------------------------------------------------------

struct Backends {
  std::unique_ptr<Device> cpu_device, gpu_device;
  std::unique_ptr<Ops> cpu, gpu;
};

Backends* OpenBackends() {
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
    if (b->gpu == nullptr) {
      const char* require = std::getenv("TE_REQUIRE_GPU");
      if (require != nullptr && std::string(require) == "1") FAIL() << "TE_REQUIRE_GPU=1 but no GPU";
      GTEST_SKIP() << "no CUDA device";
    }
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
float SaturatingScale(DType fp8) { return fp8 == DType::kE4M3 ? 150.0f : 20000.0f; }

// Element counts that are and are not multiples of the kernels' 8-element vectors.
const std::vector<Shape> kShapes = {{77, 200}, {128, 4096}, {3, 5, 64}, {33, 101}, {1, 1}};

// ---- elementwise: op x dtype x shape ---------------------------------------------

using DTypeShape = std::tuple<DType, Shape>;
class ElementwiseTest : public GpuTest, public ::testing::WithParamInterface<DTypeShape> {};

TEST_P(ElementwiseTest, CastAxpbyFillCopy) {
  const auto [dtype, shape] = GetParam();
  const Pair x = Random(dtype, shape, 1);
  const Pair b = Random(DType::kF32, shape, 2);
  for (DType to : {DType::kF32, DType::kBF16, DType::kF16}) {
    Pair y = Output(to, shape);
    ASSERT_TRUE(cpu_->Cast(x.cpu, &y.cpu).ok());
    ASSERT_TRUE(gpu_->Cast(x.gpu, &y.gpu).ok());
    ASSERT_TRUE(gpu_->Synchronize().ok());
    // A cast is one rounding of the same value: bit-exact.
    const Tensor got = Fetch(y.gpu);
    EXPECT_EQ(0, std::memcmp(got.data(), y.cpu.data(), got.nbytes())) << "Cast to " << Short(to);
  }
  Pair y = Output(dtype, shape);
  ASSERT_TRUE(cpu_->Axpby(0.7f, x.cpu, -1.3f, b.cpu, &y.cpu).ok());
  ASSERT_TRUE(gpu_->Axpby(0.7f, x.gpu, -1.3f, b.gpu, &y.gpu).ok());
  ExpectMatches(y, "Axpby");
  Pair scaled = Output(dtype, shape);  // beta 0: b is not read
  ASSERT_TRUE(cpu_->Axpby(2.5f, x.cpu, 0.0f, Tensor(), &scaled.cpu).ok());
  ASSERT_TRUE(gpu_->Axpby(2.5f, x.gpu, 0.0f, Tensor(), &scaled.gpu).ok());
  ExpectMatches(scaled, "Axpby beta=0");
  Pair in_place = Clone(x.cpu);  // y aliases a
  ASSERT_TRUE(cpu_->Axpby(1.5f, in_place.cpu, 1.0f, b.cpu, &in_place.cpu).ok());
  ASSERT_TRUE(gpu_->Axpby(1.5f, in_place.gpu, 1.0f, b.gpu, &in_place.gpu).ok());
  ExpectMatches(in_place, "Axpby in place");

  for (DType fill_dtype : {dtype, DType::kE4M3, DType::kI32, DType::kBool}) {
    Pair f = Output(fill_dtype, shape);
    ASSERT_TRUE(cpu_->Fill(-3.3f, &f.cpu).ok());
    ASSERT_TRUE(gpu_->Fill(-3.3f, &f.gpu).ok());
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor got = Fetch(f.gpu);
    EXPECT_EQ(0, std::memcmp(got.data(), f.cpu.data(), got.nbytes())) << "Fill " << Short(fill_dtype);
  }
  Pair copy = Output(dtype, shape);
  ASSERT_TRUE(cpu_->Copy(x.cpu, &copy.cpu).ok());
  ASSERT_TRUE(gpu_->Copy(x.gpu, &copy.gpu).ok());
  ExpectMatches(copy, "Copy");
}

// SumRows reads kVec columns per access where it can; a view one element in
// (misaligned) must take the single-element path and give the same sums.
TEST_F(GpuTest, SumRowsOfAMisalignedView) {
  const Pair x = Input(DType::kBF16, {64, 200}, 9, /*misaligned=*/true);
  Pair y = Output(DType::kF32, {200});
  ASSERT_TRUE(cpu_->SumRows(x.cpu, &y.cpu).ok());
  ASSERT_TRUE(gpu_->SumRows(x.gpu, &y.gpu).ok());
  ExpectMatches(y, "SumRows of a misaligned view");
}

TEST_P(ElementwiseTest, SumRowsAndAmax) {
  const auto [dtype, shape] = GetParam();
  const Pair x = Random(dtype, shape, 3);
  Pair y = Output(dtype, {shape.back()});
  ASSERT_TRUE(cpu_->SumRows(x.cpu, &y.cpu).ok());
  ASSERT_TRUE(gpu_->SumRows(x.gpu, &y.gpu).ok());
  ExpectMatches(y, "SumRows");
  Pair y32 = Output(DType::kF32, {shape.back()});
  ASSERT_TRUE(cpu_->SumRows(x.cpu, &y32.cpu).ok());
  ASSERT_TRUE(gpu_->SumRows(x.gpu, &y32.gpu).ok());
  // Float32 sums of up to 128 terms in another order: well inside 1e-5.
  ExpectMatches(y32, "SumRows to f32");

  Pair amax = Scalar(-1.0f);
  ASSERT_TRUE(cpu_->Amax(x.cpu, &amax.cpu).ok());
  ASSERT_TRUE(gpu_->Amax(x.gpu, &amax.gpu).ok());
  ExpectScalarMatches(amax, "Amax");
}

TEST_P(ElementwiseTest, Dropout) {
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

INSTANTIATE_TEST_SUITE_P(Matrix, ElementwiseTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::ValuesIn(kShapes)),
                         [](const auto& info) {
                           return std::string(Short(std::get<0>(info.param))) + "_" +
                                  ShapeName(std::get<1>(info.param));
                         });

// ---- Permute: dtype x (shape, perm) ------------------------------------------------

using PermuteCase = std::tuple<DType, std::tuple<Shape, std::vector<int>>>;
class PermuteTest : public GpuTest, public ::testing::WithParamInterface<PermuteCase> {};

TEST_P(PermuteTest, MatchesCpu) {
  const DType dtype = std::get<0>(GetParam());
  const auto& [shape, perm] = std::get<1>(GetParam());
  const Pair x = Random(dtype, shape, 6);
  Shape out_shape(shape.size());
  for (size_t i = 0; i < perm.size(); ++i) out_shape[i] = shape[perm[i]];
  Pair y = Output(dtype, out_shape);
  ASSERT_TRUE(cpu_->Permute(x.cpu, perm, &y.cpu).ok());
  ASSERT_TRUE(gpu_->Permute(x.gpu, perm, &y.gpu).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const Tensor got = Fetch(y.gpu);
  EXPECT_EQ(0, std::memcmp(got.data(), y.cpu.data(), got.nbytes()));
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, PermuteTest,
    ::testing::Combine(
        ::testing::Values(DType::kF32, DType::kBF16, DType::kE4M3),
        ::testing::Values(std::make_tuple(Shape{77, 200}, std::vector<int>{1, 0}),
                          std::make_tuple(Shape{2, 77, 6, 40}, std::vector<int>{0, 2, 1, 3}),
                          std::make_tuple(Shape{3, 2, 5, 7, 4}, std::vector<int>{4, 2, 0, 3, 1}),
                          std::make_tuple(Shape{9}, std::vector<int>{0}),
                          // batched transpose; size-1 dims dropped before choosing a path
                          std::make_tuple(Shape{3, 33, 65}, std::vector<int>{0, 2, 1}),
                          std::make_tuple(Shape{1, 77, 1, 40}, std::vector<int>{2, 3, 0, 1}))),
    [](const auto& info) {
      return std::string(Short(std::get<0>(info.param))) + "_" +
             ShapeName(std::get<0>(std::get<1>(info.param)));
    });

// ---- cast-transpose: the fused tile kernel and its fallback ----------------------------

using QuantizeTransposeCase = std::tuple<DType, DType, Shape>;
class QuantizeTransposeTest : public GpuTest,
                              public ::testing::WithParamInterface<QuantizeTransposeCase> {};

// The CPU's QuantizeTranspose is Quantize then Permute (both checked above);
// the GPU's fused kernel must give the same codes in both layouts, and the
// same amax and scale_inv.
TEST_P(QuantizeTransposeTest, CodesInBothLayoutsMatchTheCpu) {
  const auto [dtype, fp8, shape] = GetParam();
  const Pair x = Random(dtype, shape, 11, -4.0f, 4.0f);
  Fp8Pair side = Fp8Side(SaturatingScale(fp8) * 0.5f);
  Pair q = Output(fp8, shape);
  Pair q_t = Output(fp8, {shape[1], shape[0]});
  ASSERT_TRUE(cpu_->QuantizeTranspose(x.cpu, side.cpu(), &q.cpu, &q_t.cpu).ok());
  ASSERT_TRUE(gpu_->QuantizeTranspose(x.gpu, side.gpu(), &q.gpu, &q_t.gpu).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const Tensor codes = Fetch(q.gpu), codes_t = Fetch(q_t.gpu);
  EXPECT_EQ(0, std::memcmp(codes.data(), q.cpu.data(), codes.nbytes())) << "y";
  EXPECT_EQ(0, std::memcmp(codes_t.data(), q_t.cpu.data(), codes_t.nbytes())) << "y_t";
  ExpectFp8SideMatches(side, "QuantizeTranspose");
  EXPECT_EQ(Fetch(side.amax.gpu).data_as<float>()[0], side.amax.cpu.data_as<float>()[0]);
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, QuantizeTransposeTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(DType::kE4M3, DType::kE5M2),
                       // tiles: whole, ragged edges (multiples of 4), and shapes the
                       // tile kernel declines (odd: the fallback)
                       ::testing::Values(Shape{128, 256}, Shape{100, 36}, Shape{516, 1028},
                                         Shape{4, 4}, Shape{37, 24}, Shape{64, 30})),
    [](const auto& info) {
      return std::string(Short(std::get<0>(info.param))) + "_" + Short(std::get<1>(info.param)) +
             "_" + ShapeName(std::get<2>(info.param));
    });

// Cast-transpose-dbias: the tile kernel's codes (bit-exact, as above), and
// dbias, its column sums of x, against the CPU's SumRows within the float
// tolerance of dbias's dtype.
class QuantizeTransposeDbiasTest : public GpuTest,
                                   public ::testing::WithParamInterface<QuantizeTransposeCase> {};

TEST_P(QuantizeTransposeDbiasTest, CodesAndColumnSumsMatchTheCpu) {
  const auto [dtype, fp8, shape] = GetParam();
  const Pair x = Random(dtype, shape, 26, -4.0f, 4.0f);
  for (DType dbias_dtype : {DType::kF32, DType::kBF16}) {
    const std::string what = std::string("dbias ") + Short(dbias_dtype);
    Fp8Pair side = Fp8Side(SaturatingScale(fp8) * 0.5f);
    Pair q = Output(fp8, shape);
    Pair q_t = Output(fp8, {shape[1], shape[0]});
    Pair dbias = Output(dbias_dtype, {shape[1]});
    ASSERT_TRUE(
        cpu_->QuantizeTransposeDbias(x.cpu, side.cpu(), &q.cpu, &q_t.cpu, &dbias.cpu).ok());
    const absl::Status s =
        gpu_->QuantizeTransposeDbias(x.gpu, side.gpu(), &q.gpu, &q_t.gpu, &dbias.gpu);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor codes = Fetch(q.gpu), codes_t = Fetch(q_t.gpu);
    EXPECT_EQ(0, std::memcmp(codes.data(), q.cpu.data(), codes.nbytes())) << what << " y";
    EXPECT_EQ(0, std::memcmp(codes_t.data(), q_t.cpu.data(), codes_t.nbytes())) << what << " y_t";
    ExpectFp8SideMatches(side, what);
    EXPECT_EQ(Fetch(side.amax.gpu).data_as<float>()[0], side.amax.cpu.data_as<float>()[0]);
    ExpectMatches(dbias, what);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, QuantizeTransposeDbiasTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(DType::kE4M3, DType::kE5M2),
                       // tiles: whole, ragged edges (multiples of 4), many row tiles
                       // (the partial rows' reduction), and shapes the tile kernel
                       // declines (odd: the fallback)
                       ::testing::Values(Shape{128, 256}, Shape{100, 36}, Shape{516, 1028},
                                         Shape{4, 4}, Shape{1000, 200}, Shape{2052, 64},
                                         Shape{37, 24}, Shape{64, 30})),
    [](const auto& info) {
      return std::string(Short(std::get<0>(info.param))) + "_" + Short(std::get<1>(info.param)) +
             "_" + ShapeName(std::get<2>(info.param));
    });

// ---- FP8 scaling: input dtype x FP8 format x scale x shape -----------------------------

using QuantizeCase = std::tuple<DType, DType, float, Shape>;
class QuantizeTest : public GpuTest, public ::testing::WithParamInterface<QuantizeCase> {};

TEST_P(QuantizeTest, QuantizeDequantize) {
  const auto [dtype, fp8, scale_kind, shape] = GetParam();
  // scale_kind: 0 saturating, else the scale itself (0.01: subnormal codes).
  const float scale = scale_kind == 0.0f ? SaturatingScale(fp8) : scale_kind;
  const Pair x = Random(dtype, shape, 7, -4.0f, 4.0f);
  Fp8Pair side = Fp8Side(scale);
  Pair q = Output(fp8, shape);
  ASSERT_TRUE(cpu_->Quantize(x.cpu, side.cpu(), &q.cpu).ok());
  ASSERT_TRUE(gpu_->Quantize(x.gpu, side.gpu(), &q.gpu).ok());
  // One multiply and one cast of the same value: bit-exact, amax exact.
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const Tensor codes = Fetch(q.gpu);
  EXPECT_EQ(0, std::memcmp(codes.data(), q.cpu.data(), codes.nbytes())) << "Quantize codes";
  ExpectFp8SideMatches(side, "Quantize");
  EXPECT_EQ(Fetch(side.amax.gpu).data_as<float>()[0], side.amax.cpu.data_as<float>()[0]);

  Pair deq = Output(dtype, shape);
  ASSERT_TRUE(cpu_->Dequantize(q.cpu, side.scale_inv.cpu, &deq.cpu).ok());
  ASSERT_TRUE(gpu_->Dequantize(q.gpu, side.scale_inv.gpu, &deq.gpu).ok());
  ExpectMatches(deq, "Dequantize");
  Pair amax = Scalar(-1.0f);  // Amax reads FP8 unscaled
  ASSERT_TRUE(cpu_->Amax(q.cpu, &amax.cpu).ok());
  ASSERT_TRUE(gpu_->Amax(q.gpu, &amax.gpu).ok());
  ExpectScalarMatches(amax, "Amax of FP8");
}

INSTANTIATE_TEST_SUITE_P(Matrix, QuantizeTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(DType::kE4M3, DType::kE5M2),
                                            ::testing::Values(0.0f, 1.0f, 0.01f),
                                            ::testing::ValuesIn(kShapes)),
                         [](const auto& info) {
                           const float s = std::get<2>(info.param);
                           return std::string(Short(std::get<0>(info.param))) + "_" +
                                  Short(std::get<1>(info.param)) + "_" +
                                  (s == 0.0f ? "saturating" : s == 1.0f ? "unit" : "small") +
                                  "_" + ShapeName(std::get<3>(info.param));
                         });

class ScalingTest : public GpuTest {};

TEST_F(ScalingTest, ScaleFromAmax) {
  for (float a : {3.5f, 0.0f, 1e-12f, INFINITY, NAN, 1e-40f}) {
    for (float margin : {0.0f, 1.0f}) {
      for (float epsilon : {0.0f, 1e-6f}) {
        const std::string what = "amax " + std::to_string(a) + " margin " +
                                  std::to_string(margin) + " eps " + std::to_string(epsilon);
        const Pair amax = Scalar(a);
        Pair scale = Scalar(-1.0f), scale_inv = Scalar(-1.0f);
        ASSERT_TRUE(cpu_->ScaleFromAmax(amax.cpu, 448.0f, margin, epsilon, &scale.cpu,
                                        &scale_inv.cpu).ok());
        ASSERT_TRUE(gpu_->ScaleFromAmax(amax.gpu, 448.0f, margin, epsilon, &scale.gpu,
                                        &scale_inv.gpu).ok());
        ExpectScalarMatches(scale, what + " scale");
        ExpectScalarMatches(scale_inv, what + " scale_inv");
      }
    }
  }
}

// 20 steps of TE's delayed-scaling loop on both backends: quantize (writes
// history[0]), then update; the history, scale and scale_inv must agree.
TEST_F(ScalingTest, DelayedScalingUpdateOverSteps) {
  for (int length : {1, 16, 1024, 5000}) {
    for (bool most_recent : {false, true}) {
      DelayedScalingArgs args;
      args.fp8_max = kE4M3Max;
      args.margin = most_recent ? 1.0f : 0.0f;
      args.most_recent = most_recent;
      const std::string what = "L=" + std::to_string(length) +
                               (most_recent ? " most_recent" : " max");
      Pair history = Random(DType::kF32, {length}, 8, 0.0f, 3.0f);
      Fp8Pair side = Fp8Side(1.0f);
      for (int step = 0; step < 20; ++step) {
        const Pair x = Random(DType::kBF16, {77, 200}, 100 + step, -1.0f - step, 1.0f + step);
        Pair q = Output(DType::kE4M3, {77, 200});
        Fp8Output cpu_fp8{side.scale.cpu, history.cpu.Slice0(0, 1), side.scale_inv.cpu};
        Fp8Output gpu_fp8{side.scale.gpu, history.gpu.Slice0(0, 1), side.scale_inv.gpu};
        ASSERT_TRUE(cpu_->Quantize(x.cpu, cpu_fp8, &q.cpu).ok());
        ASSERT_TRUE(gpu_->Quantize(x.gpu, gpu_fp8, &q.gpu).ok());
        if (step == 7) {  // a step with no signal: the scale must be kept
          ASSERT_TRUE(cpu_->Fill(0.0f, &history.cpu).ok());
          ASSERT_TRUE(gpu_->Fill(0.0f, &history.gpu).ok());
        }
        ASSERT_TRUE(cpu_->DelayedScalingUpdate(args, &history.cpu, &side.scale.cpu,
                                               &side.scale_inv.cpu).ok());
        ASSERT_TRUE(gpu_->DelayedScalingUpdate(args, &history.gpu, &side.scale.gpu,
                                               &side.scale_inv.gpu).ok());
        ExpectMatches(q, what + " codes, step " + std::to_string(step));
      }
      ASSERT_TRUE(gpu_->Synchronize().ok());
      const Tensor got = Fetch(history.gpu);
      EXPECT_EQ(0, std::memcmp(got.data(), history.cpu.data(), got.nbytes())) << what;
      ExpectScalarMatches(side.scale, what + " scale");
      ExpectScalarMatches(side.scale_inv, what + " scale_inv");
    }
  }
}

using BlockCase = std::tuple<BlockFormat, DType, Shape>;
class BlockScaledTest : public GpuTest, public ::testing::WithParamInterface<BlockCase> {};

TEST_P(BlockScaledTest, FakeQuantize) {
  const auto [format, dtype, shape] = GetParam();
  Pair x = Random(dtype, shape, 9, -3.0f, 3.0f);
  Pair y = Output(dtype, shape);
  ASSERT_TRUE(cpu_->FakeQuantizeBlockScaled(format, x.cpu, &y.cpu).ok());
  ASSERT_TRUE(gpu_->FakeQuantizeBlockScaled(format, x.gpu, &y.gpu).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  // Power-of-two scalings and exact casts: bit-exact.
  const Tensor got = Fetch(y.gpu);
  EXPECT_EQ(0, std::memcmp(got.data(), y.cpu.data(), got.nbytes()));
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, BlockScaledTest,
    ::testing::Combine(::testing::Values(BlockFormat::kMXFP8, BlockFormat::kNVFP4),
                       ::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(Shape{77, 224}, Shape{128, 4096}, Shape{1, 32})),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == BlockFormat::kMXFP8 ? "mxfp8" : "nvfp4") +
             "_" + Short(std::get<1>(info.param)) + "_" + ShapeName(std::get<2>(info.param));
    });

// ---- normalisation: type x dtype x output format x shape --------------------------------

using NormCase = std::tuple<NormType, DType, DType, Shape>;  // y dtype: same as x, or FP8
class NormTest : public GpuTest, public ::testing::WithParamInterface<NormCase> {};

TEST_P(NormTest, ForwardAndBackward) {
  const auto [type, dtype, out_dtype_param, shape] = GetParam();
  const DType out_dtype = out_dtype_param == DType::kF32 ? dtype : out_dtype_param;
  const bool layernorm = type == NormType::kLayerNorm;
  const int64_t rows = NumElements(shape) / shape.back(), cols = shape.back();
  for (bool zero_centered : {false, true}) {
    NormArgs args;
    args.type = type;
    args.epsilon = 1e-5f;
    args.zero_centered_gamma = zero_centered;
    const std::string what = std::string(layernorm ? "LayerNorm" : "RMSNorm") +
                             (zero_centered ? " zero-centred" : "");
    const Pair x = Random(dtype, shape, 10, -3.0f, 5.0f);  // a non-zero mean
    const Pair gamma = Random(dtype, {cols}, 11, 0.5f, 1.5f);
    const Pair beta = layernorm ? Random(dtype, {cols}, 12) : Pair{};
    Pair y = Output(out_dtype, shape);
    Pair mu = Output(DType::kF32, {rows}), rsigma = Output(DType::kF32, {rows});
    const bool fp8 = IsFloat8(out_dtype);
    Fp8Pair side = Fp8Side(fp8 ? 40.0f : 1.0f);
    const Fp8Output cpu_side = side.cpu(), gpu_side = side.gpu();
    ASSERT_TRUE(cpu_->NormForward(args, x.cpu, gamma.cpu, beta.cpu, &y.cpu,
                                  layernorm ? &mu.cpu : nullptr, &rsigma.cpu,
                                  fp8 ? &cpu_side : nullptr).ok());
    const absl::Status s = gpu_->NormForward(args, x.gpu, gamma.gpu, beta.gpu, &y.gpu,
                                             layernorm ? &mu.gpu : nullptr, &rsigma.gpu,
                                             fp8 ? &gpu_side : nullptr);
    ASSERT_TRUE(s.ok()) << s;
    ExpectMatches(y, what + " y");
    if (layernorm) ExpectMatches(mu, what + " mu");
    ExpectMatches(rsigma, what + " rsigma");
    if (fp8) ExpectFp8SideMatches(side, what);
    if (fp8) continue;  // backward reads the float path's statistics

    const Pair dy = Random(dtype, shape, 13);
    Pair dx = Output(dtype, shape), dgamma = Output(dtype, {cols});
    Pair dbeta = layernorm ? Output(dtype, {cols}) : Pair{};
    // Both backwards read the CPU's statistics, so only backward is compared.
    const Pair mu_in = layernorm ? Mirror(mu.cpu) : Pair{};
    const Pair rsigma_in = Mirror(rsigma.cpu);
    ASSERT_TRUE(cpu_->NormBackward(args, dy.cpu, x.cpu, mu_in.cpu, rsigma_in.cpu, gamma.cpu,
                                   &dx.cpu, &dgamma.cpu, layernorm ? &dbeta.cpu : nullptr).ok());
    const absl::Status b = gpu_->NormBackward(args, dy.gpu, x.gpu, mu_in.gpu, rsigma_in.gpu,
                                              gamma.gpu, &dx.gpu, &dgamma.gpu,
                                              layernorm ? &dbeta.gpu : nullptr);
    ASSERT_TRUE(b.ok()) << b;
    ExpectMatches(dx, what + " dx");
    ExpectMatches(dgamma, what + " dgamma");
    if (layernorm) ExpectMatches(dbeta, what + " dbeta");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, NormTest,
    ::testing::Combine(::testing::Values(NormType::kLayerNorm, NormType::kRMSNorm),
                       ::testing::Values(DType::kF32, DType::kBF16),
                       // kF32 here stands for "y in x's dtype".
                       ::testing::Values(DType::kF32, DType::kE4M3, DType::kE5M2),
                       ::testing::Values(Shape{77, 200}, Shape{128, 4096}, Shape{2, 3, 96},
                                         // backward partials in shared memory (opt-in
                                         // size), then in global memory
                                         Shape{5, 20000}, Shape{3, 30000},
                                         // scalar path (H % 8 != 0); forward row cache
                                         // in global memory (H > 51200)
                                         Shape{7, 100}, Shape{2, 60000})),
    [](const auto& info) {
      const DType out = std::get<2>(info.param);
      return std::string(std::get<0>(info.param) == NormType::kLayerNorm ? "ln" : "rms") + "_" +
             Short(std::get<1>(info.param)) + "_" + (out == DType::kF32 ? "same" : Short(out)) +
             "_" + ShapeName(std::get<3>(info.param));
    });

// ---- normalisation: the register-resident fast paths and their fallbacks ----------------
//
// The fast paths take H % 8 == 0 and aligned tensors: forward H <= 8192 (16-bit
// x) or 4096 (f32 x), backward 12288 or 6144; the general kernels take the
// rest. The shapes below cover each warps-per-row choice, rows that are and
// are not multiples of the groups and tiles, groups walking several rows
// (backward's register column sums), and shapes and views the fast paths
// decline.

// x dtype, gamma (and beta, dgamma, dbeta) dtype.
using NormDTypes = std::tuple<DType, DType>;
const std::vector<NormDTypes> kNormDTypes = {
    {DType::kF32, DType::kF32}, {DType::kBF16, DType::kBF16}, {DType::kBF16, DType::kF32}};

std::string NormDTypesName(const NormDTypes& d) {
  return std::string(Short(std::get<0>(d))) + "_g" + Short(std::get<1>(d));
}

using NormPathCase = std::tuple<NormType, NormDTypes, Shape>;
class NormPathTest : public GpuTest, public ::testing::WithParamInterface<NormPathCase> {
 protected:
  // Forward (float y), then backward without and with residual_grad, each
  // against the CPU; both backwards read the CPU's statistics.
  void ExpectForwardAndBackwardMatch(bool misaligned) {
    const auto [type, dtypes, shape] = GetParam();
    const auto [dtype, param_dtype] = dtypes;
    const bool layernorm = type == NormType::kLayerNorm;
    const int64_t cols = shape.back(), rows = NumElements(shape) / cols;
    for (bool zero_centered : {false, true}) {
      NormArgs args;
      args.type = type;
      args.epsilon = 1e-5f;
      args.zero_centered_gamma = zero_centered;
      const std::string what = std::string(layernorm ? "LayerNorm" : "RMSNorm") +
                               (zero_centered ? " zero-centred" : "");
      const Pair x = Input(dtype, shape, 40, misaligned, -3.0f, 5.0f);  // a non-zero mean
      const Pair gamma = Random(param_dtype, {cols}, 41, 0.5f, 1.5f);
      const Pair beta = layernorm ? Random(param_dtype, {cols}, 42) : Pair{};
      Pair y = Output(dtype, shape);
      Pair mu = Output(DType::kF32, {rows}), rsigma = Output(DType::kF32, {rows});
      ASSERT_TRUE(cpu_->NormForward(args, x.cpu, gamma.cpu, beta.cpu, &y.cpu,
                                    layernorm ? &mu.cpu : nullptr, &rsigma.cpu, nullptr).ok());
      const absl::Status f = gpu_->NormForward(args, x.gpu, gamma.gpu, beta.gpu, &y.gpu,
                                               layernorm ? &mu.gpu : nullptr, &rsigma.gpu,
                                               nullptr);
      ASSERT_TRUE(f.ok()) << f;
      ExpectMatches(y, what + " y");
      if (layernorm) ExpectMatches(mu, what + " mu");
      ExpectMatches(rsigma, what + " rsigma");

      const Pair dy = Input(dtype, shape, 43, misaligned);
      const Pair residual = Input(dtype, shape, 44, misaligned);
      const Pair mu_in = layernorm ? Mirror(mu.cpu) : Pair{};
      const Pair rsigma_in = Mirror(rsigma.cpu);
      for (bool with_residual : {false, true}) {
        const std::string step = what + (with_residual ? " with residual_grad" : "");
        Pair dx = Output(dtype, shape), dgamma = Output(param_dtype, {cols});
        Pair dbeta = layernorm ? Output(param_dtype, {cols}) : Pair{};
        ASSERT_TRUE(cpu_->NormBackward(args, dy.cpu, x.cpu, mu_in.cpu, rsigma_in.cpu, gamma.cpu,
                                       &dx.cpu, &dgamma.cpu, layernorm ? &dbeta.cpu : nullptr,
                                       with_residual ? residual.cpu : Tensor()).ok());
        const absl::Status b = gpu_->NormBackward(
            args, dy.gpu, x.gpu, mu_in.gpu, rsigma_in.gpu, gamma.gpu, &dx.gpu, &dgamma.gpu,
            layernorm ? &dbeta.gpu : nullptr, with_residual ? residual.gpu : Tensor());
        ASSERT_TRUE(b.ok()) << b;
        ExpectMatches(dx, step + " dx");
        ExpectMatches(dgamma, step + " dgamma");
        if (layernorm) ExpectMatches(dbeta, step + " dbeta");
      }
    }
  }
};

TEST_P(NormPathTest, ForwardAndBackwardWithResidualGrad) { ExpectForwardAndBackwardMatch(false); }

TEST_P(NormPathTest, MisalignedViewsTakeTheGeneralPath) {
  const Shape& shape = std::get<2>(GetParam());
  if (NumElements(shape) > 300 * 4096) GTEST_SKIP() << "the aligned run covers this size";
  ExpectForwardAndBackwardMatch(true);
}

std::string NormPathName(const ::testing::TestParamInfo<NormPathCase>& info) {
  return std::string(std::get<0>(info.param) == NormType::kLayerNorm ? "ln" : "rms") + "_" +
         NormDTypesName(std::get<1>(info.param)) + "_" + ShapeName(std::get<2>(info.param));
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, NormPathTest,
    ::testing::Combine(::testing::Values(NormType::kLayerNorm, NormType::kRMSNorm),
                       ::testing::ValuesIn(kNormDTypes),
                       ::testing::Values(
                           // fast: 4 / 8 warps a row (16-bit / f32 x); rows % 4 != 0
                           Shape{300, 4096},
                           // fast: 1 / 2 warps a row, several groups a block
                           Shape{256, 1024},
                           // fast: one 25-pack row per warp, odd rows, H % 64 != 0
                           Shape{37, 200},
                           // fast, rank 3
                           Shape{2, 3, 96},
                           // fast; groups walk several rows (backward's register sums
                           // over rows, then the block's groups in order)
                           Shape{2000, 4096}, Shape{9000, 256},
                           // 16-bit x: forward 8 warps, backward 12 (f32: general)
                           Shape{3, 8192},
                           // 16-bit x: packs not a multiple of the threads (fwd 8
                           // warps, bwd 6)
                           Shape{4, 6000},
                           // 16-bit x: backward fast at its limit (12 warps, 96 KiB of
                           // shared column sums), forward general
                           Shape{5, 12288},
                           // general: H % 8 != 0
                           Shape{37, 100})),
    NormPathName);

// ---- NormForwardTransposed: type x dtypes x FP8 format x shape ----------------------------

using NormTransposedCase = std::tuple<NormType, NormDTypes, DType, Shape>;
class NormTransposedTest : public GpuTest,
                           public ::testing::WithParamInterface<NormTransposedCase> {};

// y and y_t against the CPU (the default: NormForward, then Permute) by the
// FP8 rule; on the GPU, y_t is exactly y's transpose, and y, amax, mu and
// rsigma are exactly what CUDA NormForward writes for the same inputs.
TEST_P(NormTransposedTest, MatchesTheCpuAndNormForward) {
  const auto [type, dtypes, fp8, shape] = GetParam();
  const auto [dtype, param_dtype] = dtypes;
  const bool layernorm = type == NormType::kLayerNorm;
  const int64_t cols = shape.back(), rows = NumElements(shape) / cols;
  for (bool zero_centered : {false, true}) {
    NormArgs args;
    args.type = type;
    args.epsilon = 1e-5f;
    args.zero_centered_gamma = zero_centered;
    const std::string what = std::string(layernorm ? "LayerNorm" : "RMSNorm") +
                             (zero_centered ? " zero-centred" : "");
    const Pair x = Random(dtype, shape, 45, -3.0f, 5.0f);
    const Pair gamma = Random(param_dtype, {cols}, 46, 0.5f, 1.5f);
    const Pair beta = layernorm ? Random(param_dtype, {cols}, 47) : Pair{};
    Fp8Pair side = Fp8Side(SaturatingScale(fp8));
    Pair y = Output(fp8, shape), y_t = Output(fp8, {cols, rows});
    Pair mu = Output(DType::kF32, {rows}), rsigma = Output(DType::kF32, {rows});
    ASSERT_TRUE(cpu_->NormForwardTransposed(args, x.cpu, gamma.cpu, beta.cpu, side.cpu(),
                                            &y.cpu, &y_t.cpu, layernorm ? &mu.cpu : nullptr,
                                            &rsigma.cpu).ok());
    const absl::Status s = gpu_->NormForwardTransposed(args, x.gpu, gamma.gpu, beta.gpu,
                                                       side.gpu(), &y.gpu, &y_t.gpu,
                                                       layernorm ? &mu.gpu : nullptr, &rsigma.gpu);
    ASSERT_TRUE(s.ok()) << s;
    ExpectMatches(y, what + " y");
    ExpectMatches(y_t, what + " y_t");
    ExpectFp8SideMatches(side, what);
    if (layernorm) ExpectMatches(mu, what + " mu");
    ExpectMatches(rsigma, what + " rsigma");

    const Tensor codes = Fetch(y.gpu), codes_t = Fetch(y_t.gpu);
    const uint8_t* c = codes.data_as<const uint8_t>();
    const uint8_t* t = codes_t.data_as<const uint8_t>();
    int64_t not_transposed = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < cols; ++h) not_transposed += t[h * rows + r] != c[r * cols + h];
    }
    EXPECT_EQ(not_transposed, 0) << what << ": y_t is not y transposed";

    Fp8Pair forward_side = Fp8Side(SaturatingScale(fp8));
    const Fp8Output forward_fp8 = forward_side.gpu();
    Tensor forward_y = NewGpu(fp8, shape);
    Tensor forward_mu = NewGpu(DType::kF32, {rows}), forward_rsigma = NewGpu(DType::kF32, {rows});
    const absl::Status f = gpu_->NormForward(args, x.gpu, gamma.gpu, beta.gpu, &forward_y,
                                             layernorm ? &forward_mu : nullptr, &forward_rsigma,
                                             &forward_fp8);
    ASSERT_TRUE(f.ok()) << f;
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor forward_codes = Fetch(forward_y);
    EXPECT_EQ(0, std::memcmp(forward_codes.data(), codes.data(), codes.nbytes()))
        << what << ": y differs from NormForward's FP8 y";
    EXPECT_EQ(Fetch(forward_side.amax.gpu).data_as<float>()[0],
              Fetch(side.amax.gpu).data_as<float>()[0]) << what << " amax";
    const Tensor rsigma_got = Fetch(rsigma.gpu), forward_rsigma_got = Fetch(forward_rsigma);
    EXPECT_EQ(0, std::memcmp(rsigma_got.data(), forward_rsigma_got.data(), rsigma_got.nbytes()))
        << what << " rsigma";
    if (layernorm) {
      const Tensor mu_got = Fetch(mu.gpu), forward_mu_got = Fetch(forward_mu);
      EXPECT_EQ(0, std::memcmp(mu_got.data(), forward_mu_got.data(), mu_got.nbytes()))
          << what << " mu";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, NormTransposedTest,
    ::testing::Combine(::testing::Values(NormType::kLayerNorm, NormType::kRMSNorm),
                       ::testing::ValuesIn(kNormDTypes),
                       ::testing::Values(DType::kE4M3, DType::kE5M2),
                       ::testing::Values(
                           // fused: 32-row tiles, whole and ragged (300 = 9 x 32 + 12)
                           Shape{128, 4096}, Shape{300, 4096}, Shape{256, 1024},
                           // fused: H % 64 != 0; many tiles, the last of 4 rows
                           Shape{36, 200}, Shape{1028, 96},
                           // fused for 16-bit x: 16-row tiles (H > 4096), rank 3, and
                           // packs not a multiple of the threads (f32 x: fallback)
                           Shape{2, 6, 8192}, Shape{20, 5000},
                           // fallback: rows % 4 != 0; H % 8 != 0
                           Shape{37, 200}, Shape{64, 100})),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == NormType::kLayerNorm ? "ln" : "rms") + "_" +
             NormDTypesName(std::get<1>(info.param)) + "_" + Short(std::get<2>(info.param)) +
             "_" + ShapeName(std::get<3>(info.param));
    });

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
// than 2 x 132 x 16 x 256 of them), with rows (1025 vectors) that the
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

// ---- position encodings --------------------------------------------------------------------

using RotaryCase = std::tuple<DType, bool, bool, Shape>;  // consecutive, inverse
class RotaryTest : public GpuTest, public ::testing::WithParamInterface<RotaryCase> {};

TEST_P(RotaryTest, MatchesCpu) {
  const auto [dtype, consecutive, inverse, shape] = GetParam();
  RotaryArgs args;
  args.consecutive = consecutive;
  args.inverse = inverse;
  const Pair x = Random(dtype, shape, 16);
  Pair y = Output(dtype, shape);
  ASSERT_TRUE(cpu_->Rotary(args, x.cpu, &y.cpu).ok());
  ASSERT_TRUE(gpu_->Rotary(args, x.gpu, &y.gpu).ok());
  ExpectMatches(y, "Rotary");
  Pair in_place = Clone(x.cpu);  // y aliases x
  ASSERT_TRUE(gpu_->Rotary(args, in_place.gpu, &in_place.gpu).ok());
  ExpectMatches(Pair{y.cpu, in_place.gpu}, "Rotary in place");
}

INSTANTIATE_TEST_SUITE_P(Matrix, RotaryTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(Shape{2, 77, 3, 64},
                                                              Shape{1, 2048, 2, 128},
                                                              Shape{1, 5, 1, 2})),
                         [](const auto& info) {
                           return std::string(Short(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_consecutive" : "_alternate") +
                                  (std::get<2>(info.param) ? "_inverse_" : "_") +
                                  ShapeName(std::get<3>(info.param));
                         });

class RelativeBiasTest : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(RelativeBiasTest, ForwardAndBackward) {
  const DType dtype = GetParam();
  for (const auto& [num_buckets, heads, q_seq, kv_seq] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {32, 8, 77, 100}, {128, 3, 300, 300}, {600, 2, 64, 64}}) {
    const Pair table = Random(dtype, {num_buckets, heads}, 17);
    Tensor buckets_cpu = NewCpu(DType::kI32, {q_seq, kv_seq});
    std::mt19937 gen(18);
    for (int64_t i = 0; i < buckets_cpu.numel(); ++i) {
      buckets_cpu.data_as<int32_t>()[i] = static_cast<int32_t>(gen() % num_buckets);
    }
    const Pair buckets = Mirror(buckets_cpu);
    Pair bias = Output(DType::kF32, {heads, q_seq, kv_seq});
    ASSERT_TRUE(cpu_->RelativeBiasForward(table.cpu, buckets.cpu, &bias.cpu).ok());
    ASSERT_TRUE(gpu_->RelativeBiasForward(table.gpu, buckets.gpu, &bias.gpu).ok());
    ExpectMatches(bias, "RelativeBiasForward");
    const Pair dbias = Random(DType::kF32, {heads, q_seq, kv_seq}, 19);
    Pair dtable = Output(dtype, {num_buckets, heads});
    ASSERT_TRUE(cpu_->RelativeBiasBackward(dbias.cpu, buckets.cpu, &dtable.cpu).ok());
    const absl::Status s = gpu_->RelativeBiasBackward(dbias.gpu, buckets.gpu, &dtable.gpu);
    ASSERT_TRUE(s.ok()) << s;
    ExpectMatches(dtable, "RelativeBiasBackward NB=" + std::to_string(num_buckets));
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, RelativeBiasTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(Short(info.param)); });

// ---- device, memory, allocator ------------------------------------------------------------

class DeviceTest : public GpuTest {};

TEST_F(DeviceTest, InfoAndBackend) {
  EXPECT_TRUE(CudaBackendBuilt());
  const DeviceInfo info = OpenBackends()->gpu_device->info();
  EXPECT_EQ(info.name, "cuda:0");
  EXPECT_FALSE(info.description.empty());
  EXPECT_GE(info.compute_capability, 70);
  EXPECT_GT(info.memory_bytes, int64_t{1} << 30);
  EXPECT_EQ(info.fp8_native, info.compute_capability >= 89);
  EXPECT_EQ(info.block_scaling_native, info.compute_capability >= 100);
  EXPECT_TRUE(OpenBackends()->gpu_device->healthy());
  EXPECT_EQ(gpu_->device_name(), "cuda:0");
}

TEST_F(DeviceTest, OrdinalOutOfRangeIsUnavailable) {
  auto device = OpenCudaDevice(1000);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
}

TEST_F(DeviceTest, MemoryLimitIsResourceExhausted) {
  auto ops = OpenBackends()->gpu_device->NewOps(1 << 20);
  ASSERT_TRUE(ops.ok());
  auto small = (*ops)->Allocate(DType::kF32, {1000});
  ASSERT_TRUE(small.ok());
  auto big = (*ops)->Allocate(DType::kF32, {1 << 20});
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*ops)->bytes_in_use(), 4000);
}

TEST_F(DeviceTest, DeviceOutOfMemoryIsResourceExhausted) {
  auto ops = OpenBackends()->gpu_device->NewOps(int64_t{1} << 50);
  ASSERT_TRUE(ops.ok());
  auto huge = (*ops)->Allocate(DType::kF32, {int64_t{1} << 45});  // 128 TiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // The device is still usable afterwards.
  Pair x = Random(DType::kF32, {77, 200}, 20);
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

// A training-like step allocating and freeing its temporaries: after the first
// step every allocation is served from the cache.
TEST_F(DeviceTest, NoCudaMallocInSteadyState) {
  auto* cuda_ops = dynamic_cast<cuda::CudaOps*>(gpu_);
  ASSERT_NE(cuda_ops, nullptr);
  const Pair x = Random(DType::kBF16, {128, 4096}, 21);
  const Pair gamma = Random(DType::kBF16, {4096}, 22);
  const Pair beta = Random(DType::kBF16, {4096}, 23);
  auto step = [&] {
    Tensor y = NewGpu(DType::kBF16, {128, 4096});
    Tensor mu = NewGpu(DType::kF32, {128});
    Tensor rsigma = NewGpu(DType::kF32, {128});
    NormArgs args;
    ASSERT_TRUE(gpu_->NormForward(args, x.gpu, gamma.gpu, beta.gpu, &y, &mu, &rsigma, nullptr).ok());
    Tensor dx = NewGpu(DType::kBF16, {128, 4096});
    Tensor dgamma = NewGpu(DType::kBF16, {4096}), dbeta = NewGpu(DType::kBF16, {4096});
    ASSERT_TRUE(gpu_->NormBackward(args, y, x.gpu, mu, rsigma, gamma.gpu, &dx, &dgamma, &dbeta).ok());
    Tensor bias_grad = NewGpu(DType::kF32, {4096});
    ASSERT_TRUE(gpu_->SumRows(dx, &bias_grad).ok());
  };
  step();
  const int64_t mallocs = cuda_ops->context().allocator->stats().cuda_mallocs;
  for (int i = 0; i < 5; ++i) step();
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(cuda_ops->context().allocator->stats().cuda_mallocs, mallocs);
}

TEST_F(DeviceTest, TwoStreamsShareTheCacheSafely) {
  auto other = OpenBackends()->gpu_device->NewOps(int64_t{1} << 30);
  ASSERT_TRUE(other.ok());
  // Memory freed on one stream and reused on the other must not be clobbered
  // while the first stream's work is still queued.
  const Pair x = Random(DType::kF32, {1024, 1024}, 24);
  for (int round = 0; round < 3; ++round) {
    Tensor expected_cpu = NewCpu(DType::kF32, {1024, 1024});
    ASSERT_TRUE(cpu_->Axpby(2.0f, x.cpu, 0.0f, Tensor(), &expected_cpu).ok());
    Tensor result;
    {
      Tensor scratch = NewGpu(DType::kF32, {1024, 1024});
      ASSERT_TRUE(gpu_->Axpby(2.0f, x.gpu, 0.0f, Tensor(), &scratch).ok());
      result = NewGpu(DType::kF32, {1024, 1024});
      ASSERT_TRUE(gpu_->Copy(scratch, &result).ok());
    }  // scratch freed with gpu_'s work possibly queued
    auto reuse = (*other)->Allocate(DType::kF32, {1024, 1024});
    ASSERT_TRUE(reuse.ok());
    ASSERT_TRUE((*other)->Fill(-7.0f, &*reuse).ok());
    ExpectMatches(Pair{expected_cpu, result}, "result after cross-stream reuse");
    ASSERT_TRUE((*other)->Synchronize().ok());
  }
}

TEST_F(DeviceTest, BadArgumentsAreInvalidArgument) {
  Pair x = Random(DType::kF32, {4, 8}, 25);
  Pair y = Output(DType::kF32, {4, 9});
  EXPECT_EQ(gpu_->Cast(x.gpu, &y.gpu).code(), absl::StatusCode::kInvalidArgument);
  Pair q = Output(DType::kE4M3, {4, 8});
  EXPECT_EQ(gpu_->ActivationForward({Activation::kGelu}, x.gpu, &q.gpu, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->DropoutForward(1.5f, 1, x.gpu, &x.gpu, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->Permute(x.gpu, {0, 0}, &x.gpu).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te
