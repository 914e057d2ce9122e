// CudaOps::Gemm (cuBLASLt) against CpuOps::Gemm on random data: f32 / bf16 /
// f16 / mixed operands, FP8 pairs (E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2),
// bias, accumulate, every transpose combination, shapes with M not a multiple
// of 128 and N, K not multiples of 64 (and odd ones, served by the f32 route).
//
// Tolerances: relative error ||gpu - cpu|| / ||cpu|| within the output dtype's
// bound (kernels/cpu/test_util.h: f32 1e-5, f16 1e-3, bf16 1e-2). FP8
// operands are exact in both, but Hopper's FP8 tensor cores add products with
// ~14-bit mantissas, and by default (TE's fast accumulation, gemm.cu) never
// promote to f32 within a GEMM, so FP8 into f32 is held to 1e-3 at K <= 128
// and to kFp8LongSumTolerance from K = kLongSum (the LM's weight gradients sum
// over a step's 8192 tokens; an H100 measured 7.4e-4 at K = 8192, E5M2 x
// E4M3); bf16 out keeps 1e-2 (2.3e-3 measured at K = 4096).
// FP8 kernels need K % 16 == 0 (16-byte rows in the TN layout); other K are
// tested too and take the exact f32 route.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/gemm_cache.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

using ::te::testing::RandomValues;
using ::te::testing::RelativeError;
using ::te::testing::Tolerance;

constexpr double kFp8IntoF32Tolerance = 1e-3;
constexpr int64_t kLongSum = 4096;
constexpr double kFp8LongSumTolerance = 2e-3;

struct GemmCase {
  std::string name;
  DType a, b, out;
  int64_t m, n, k;
  bool bias = false;
  DType bias_dtype = DType::kF32;
  bool accumulate = false;
};

// A GPU stream next to the CPU reference; skipped without a GPU.
class GpuGemmFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{8} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    gpu_ = *std::move(ops);
  }

  Tensor ToGpu(const Tensor& host) {
    if (!host.defined() || host.data() == nullptr) return Tensor();
    auto t = gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(gpu_->Upload(host.data(), &*t).ok());
    return *t;
  }

  Tensor FromGpu(const Tensor& dev) {
    Tensor host = ::te::testing::MakeEmpty(cpu_, dev.dtype(), dev.shape());
    EXPECT_TRUE(gpu_->Download(dev, host.data()).ok());
    return host;
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

class GpuGemmTest : public GpuGemmFixture,
                    public ::testing::WithParamInterface<std::tuple<GemmCase, bool, bool>> {};

TEST_P(GpuGemmTest, MatchesCpu) {
  const auto& [c, transpose_a, transpose_b] = GetParam();
  const Shape a_shape = transpose_a ? Shape{c.k, c.m} : Shape{c.m, c.k};
  const Shape b_shape = transpose_b ? Shape{c.n, c.k} : Shape{c.k, c.n};
  Ops::GemmArgs host;
  host.a = ::te::testing::MakeRandom(cpu_, c.a, a_shape, 21);
  host.b = ::te::testing::MakeRandom(cpu_, c.b, b_shape, 22);
  host.transpose_a = transpose_a;
  host.transpose_b = transpose_b;
  if (IsFloat8(c.a)) {
    host.a_scale_inv = ::te::testing::Scalar(cpu_, 0.75f);  // not a power of two
    host.b_scale_inv = ::te::testing::Scalar(cpu_, 1.25f);
  }
  if (c.bias) host.bias = ::te::testing::MakeRandom(cpu_, c.bias_dtype, {c.n}, 23);
  host.accumulate = c.accumulate;
  Tensor cpu_out = ::te::testing::MakeRandom(cpu_, c.out, {c.m, c.n}, 24);  // the old out

  Ops::GemmArgs dev = host;
  dev.a = ToGpu(host.a);
  dev.b = ToGpu(host.b);
  dev.a_scale_inv = ToGpu(host.a_scale_inv);
  dev.b_scale_inv = ToGpu(host.b_scale_inv);
  dev.bias = ToGpu(host.bias);
  Tensor gpu_out = ToGpu(cpu_out);

  ASSERT_TRUE(cpu_.Gemm(host, &cpu_out).ok());
  const absl::Status s = gpu_->Gemm(dev, &gpu_out);
  ASSERT_TRUE(s.ok()) << s;
  Tensor got = ::te::testing::MakeEmpty(cpu_, c.out, {c.m, c.n});
  ASSERT_TRUE(gpu_->Download(gpu_out, got.data()).ok());
  const bool fp8_into_f32 = IsFloat8(c.a) && c.out == DType::kF32;
  const double tolerance = !fp8_into_f32     ? Tolerance(c.out)
                           : c.k >= kLongSum ? kFp8LongSumTolerance
                                             : kFp8IntoF32Tolerance;
  const double error = RelativeError(got, ::te::testing::ToDoubles(cpu_out));
  EXPECT_LT(error, tolerance);
  // FP8's errors in the log: where the fast accumulator's bound stands.
  if (IsFloat8(c.a)) {
    std::printf("%s: relative error %.3g (bound %.3g)\n", c.name.c_str(), error, tolerance);
  }
}

std::vector<GemmCase> Cases() {
  const DType f32 = DType::kF32, bf16 = DType::kBF16, f16 = DType::kF16;
  const DType e4m3 = DType::kE4M3, e5m2 = DType::kE5M2;
  return {
      // Floats: M not a multiple of 128, N and K not of 64.
      {"f32", f32, f32, f32, 200, 72, 40},
      {"f32_bias", f32, f32, f32, 130, 96, 56, true, f32},
      {"f32_accumulate", f32, f32, f32, 64, 48, 24, false, f32, true},
      {"bf16", bf16, bf16, bf16, 200, 72, 40},
      {"bf16_bias", bf16, bf16, bf16, 256, 128, 64, true, bf16},
      {"bf16_accumulate", bf16, bf16, bf16, 136, 80, 48, false, f32, true},
      {"bf16_into_f32_bias", bf16, bf16, f32, 200, 72, 40, true, f32},
      {"f16_bias", f16, f16, f16, 96, 40, 72, true, f16},
      // Output or bias dtypes without a cuBLASLt kernel: f32 product + epilogue.
      {"f32_into_bf16", f32, f32, bf16, 100, 40, 24},
      {"bf16_f32_bias", bf16, bf16, bf16, 128, 64, 32, true, f32},
      // Mixed float operands: converted to f32.
      {"bf16_times_f32", bf16, f32, f32, 70, 30, 20},
      // Odd sizes everywhere.
      {"bf16_odd", bf16, bf16, bf16, 33, 17, 9, true, bf16},
      {"f32_odd", f32, f32, f32, 7, 5, 3, false, f32, true},
      // FP8, K % 16 == 0.
      {"e4m3_e4m3_bf16", e4m3, e4m3, bf16, 200, 48, 80},
      {"e4m3_e4m3_bias", e4m3, e4m3, bf16, 256, 128, 64, true, bf16},
      {"e4m3_e4m3_f32_bias", e4m3, e4m3, f32, 136, 64, 96, true, bf16},
      {"e5m2_e4m3_bf16", e5m2, e4m3, bf16, 200, 48, 80},
      {"e4m3_e5m2_accumulate", e4m3, e5m2, bf16, 128, 96, 64, false, f32, true},
      {"e5m2_e4m3_f32_accumulate", e5m2, e4m3, f32, 64, 32, 128, false, f32, true},
      // The LM's long sums: a weight gradient's K is a step's tokens.
      {"e5m2_e4m3_k8192_f32", e5m2, e4m3, f32, 128, 64, 8192},
      {"e4m3_e4m3_k4096_bf16", e4m3, e4m3, bf16, 64, 128, 4096},
      // M not a multiple of 4: the byte-wise transpose for the TN copy of a.
      {"e4m3_m130", e4m3, e4m3, bf16, 130, 40, 48, true, bf16},
      // FP8 with K % 16 != 0 (and odd M, N): no FP8 kernel, exact f32 route.
      {"e4m3_odd_k", e4m3, e4m3, bf16, 45, 27, 24, true, bf16},
  };
}

INSTANTIATE_TEST_SUITE_P(
    All, GpuGemmTest,
    ::testing::Combine(::testing::ValuesIn(Cases()), ::testing::Bool(), ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<GemmCase, bool, bool>>& info) {
      return std::get<0>(info.param).name + (std::get<1>(info.param) ? "_aT" : "_aN") +
             (std::get<2>(info.param) ? "_bT" : "_bN");
    });

// ---- fused epilogues (ops.h): a residual add, and GELU keeping its input,
// against the CPU reference ------------------------------------------------------

struct EpilogueCase {
  std::string name;
  DType operand, out;
  int64_t m, n, k;
  Ops::GemmEpilogue epilogue = Ops::GemmEpilogue::kNone;
  bool bias = false;      // a bias in out's dtype
  bool residual = false;  // kNone only
  // kGeluAux: 1, cuBLASLt's own epilogue must run; 0, the fallback kernel.
  int route = 1;
};

class GpuGemmEpilogueTest : public GpuGemmFixture,
                            public ::testing::WithParamInterface<EpilogueCase> {};

TEST_P(GpuGemmEpilogueTest, MatchesCpu) {
  const EpilogueCase& c = GetParam();
  auto* gpu = dynamic_cast<cuda::CudaOps*>(gpu_.get());
  ASSERT_NE(gpu, nullptr);
  CpuOps& cpu = cpu_;

  Ops::GemmArgs host;
  host.a = ::te::testing::MakeRandom(cpu, c.operand, {c.m, c.k}, 41);
  host.b = ::te::testing::MakeRandom(cpu, c.operand, {c.k, c.n}, 42);
  if (IsFloat8(c.operand)) {
    host.a_scale_inv = ::te::testing::Scalar(cpu, 0.5f);
    host.b_scale_inv = ::te::testing::Scalar(cpu, 0.25f);
  }
  host.epilogue = c.epilogue;
  if (c.bias) host.bias = ::te::testing::MakeRandom(cpu, c.out, {c.n}, 43);
  if (c.residual) host.residual = ::te::testing::MakeRandom(cpu, c.out, {c.m, c.n}, 44);
  const bool gelu = c.epilogue == Ops::GemmEpilogue::kGeluAux;
  if (gelu) host.aux = ::te::testing::MakeEmpty(cpu, c.out, {c.m, c.n});

  Ops::GemmArgs dev = host;
  dev.a = ToGpu(host.a);
  dev.b = ToGpu(host.b);
  dev.a_scale_inv = ToGpu(host.a_scale_inv);
  dev.b_scale_inv = ToGpu(host.b_scale_inv);
  dev.bias = ToGpu(host.bias);
  dev.residual = ToGpu(host.residual);
  if (gelu) dev.aux = *gpu->Allocate(c.out, {c.m, c.n});

  Tensor cpu_out = ::te::testing::MakeEmpty(cpu, c.out, {c.m, c.n});
  Tensor gpu_out = *gpu->Allocate(c.out, {c.m, c.n});
  ASSERT_TRUE(cpu.Gemm(host, &cpu_out).ok());
  const absl::Status s = gpu->Gemm(dev, &gpu_out);
  ASSERT_TRUE(s.ok()) << s;

  const double tolerance = Tolerance(c.out);
  EXPECT_LT(RelativeError(FromGpu(gpu_out), ::te::testing::ToDoubles(cpu_out)), tolerance)
      << "out";
  if (!gelu) return;
  EXPECT_LT(RelativeError(FromGpu(dev.aux), ::te::testing::ToDoubles(host.aux)), tolerance)
      << "aux (the GELU's input)";
  // Which route ran: cuBLASLt's fused epilogue where the shape suits it.
  bool native = false;
  for (const auto& [key, status] : gpu->gemm_plans()->Entries()) {
    if (key.activation == c.epilogue && key.d_type == c.out && status.ok()) native = true;
  }
  EXPECT_EQ(native, c.route == 1);
  ASSERT_TRUE(gpu->Synchronize().ok());
}

std::vector<EpilogueCase> EpilogueCases() {
  const DType f32 = DType::kF32, bf16 = DType::kBF16, e4m3 = DType::kE4M3;
  using E = Ops::GemmEpilogue;
  return {
      // The MLP's fc1 (NN, GELU on) and fc2 with the residual.
      {"bf16_gelu_bias", bf16, bf16, 256, 512, 128, E::kGeluAux, true},
      {"bf16_gelu", bf16, bf16, 200, 128, 64, E::kGeluAux},
      {"bf16_residual", bf16, bf16, 256, 128, 512, E::kNone, true, true},
      {"f32_residual", f32, f32, 130, 72, 40, E::kNone, false, true},
      {"e4m3_residual_bf16", e4m3, bf16, 256, 128, 64, E::kNone, true, true},
      // f32 out: cuBLASLt's approximate GELU is not asked; the fallback's tanhf.
      {"f32_gelu_bias", f32, f32, 130, 72, 40, E::kGeluAux, true, false, 0},
      // N not a multiple of 8: cuBLASLt is not asked; the fallback epilogue.
      {"bf16_gelu_odd", bf16, bf16, 33, 70, 24, E::kGeluAux, true, false, 0},
  };
}

INSTANTIATE_TEST_SUITE_P(All, GpuGemmEpilogueTest, ::testing::ValuesIn(EpilogueCases()),
                         [](const ::testing::TestParamInfo<EpilogueCase>& info) {
                           return info.param.name;
                         });

// Dot (the step's vdot) against the CPU's, at the benchmark's size and odd ones.
TEST(GpuDotTest, MatchesCpu) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{2} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Ops& gpu = **ops;
  CpuOps cpu;
  for (const int64_t n : {int64_t{1}, int64_t{13}, int64_t{4099}, int64_t{4} * 2048 * 4096}) {
    for (const DType dtype : {DType::kBF16, DType::kF32}) {
      const Tensor a = ::te::testing::MakeRandom(cpu, dtype, {n}, 81);
      const Tensor b = ::te::testing::MakeRandom(cpu, dtype, {n}, 82);
      Tensor want = ::te::testing::MakeEmpty(cpu, DType::kF32, {1});
      ASSERT_TRUE(cpu.Dot(a, b, &want).ok());
      Tensor a_dev = *gpu.Allocate(dtype, {n}), b_dev = *gpu.Allocate(dtype, {n});
      ASSERT_TRUE(gpu.Upload(a.data(), &a_dev).ok());
      ASSERT_TRUE(gpu.Upload(b.data(), &b_dev).ok());
      Tensor out = *gpu.Allocate(DType::kF32, {1});
      ASSERT_TRUE(gpu.Dot(a_dev, b_dev, &out).ok());
      float got = 0.0f;
      ASSERT_TRUE(gpu.Download(out, &got).ok());
      // Float32 sums in two orders: relative to the sum of |a_i b_i| (the
      // signed sum may cancel).
      const std::vector<double> av = ::te::testing::ToDoubles(a), bv = ::te::testing::ToDoubles(b);
      double magnitude = 0.0;
      for (int64_t i = 0; i < n; ++i) magnitude += std::abs(av[i] * bv[i]);
      EXPECT_LE(std::abs(got - ::te::testing::ScalarValue(want)), 1e-5 * magnitude)
          << "n=" << n << " " << DTypeName(dtype);
      if (n > 1) {  // views one element in: the unaligned path
        const Tensor a_view = a_dev.Slice0(1, n), b_view = b_dev.Slice0(1, n);
        ASSERT_TRUE(gpu.Dot(a_view, b_view, &out).ok());
        ASSERT_TRUE(gpu.Download(out, &got).ok());
        double ref = 0.0;
        for (int64_t i = 1; i < n; ++i) ref += av[i] * bv[i];
        EXPECT_LE(std::abs(got - ref), 1e-5 * magnitude) << "unaligned n=" << n;
      }
    }
  }
}

// The second call of a shape reuses the first's plan: no new cache entries.
TEST(GpuGemmCacheTest, SecondCallReusesThePlan) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{1} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  auto* cuda_ops = dynamic_cast<cuda::CudaOps*>(ops->get());
  ASSERT_NE(cuda_ops, nullptr);
  CpuOps cpu;
  auto upload = [&](const Tensor& host) {
    auto t = cuda_ops->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok());
    EXPECT_TRUE(cuda_ops->Upload(host.data(), &*t).ok());
    return *t;
  };
  Ops::GemmArgs args;
  args.a = upload(::te::testing::MakeRandom(cpu, DType::kBF16, {256, 128}, 31));
  args.b = upload(::te::testing::MakeRandom(cpu, DType::kBF16, {128, 64}, 32));
  Tensor out = *cuda_ops->Allocate(DType::kBF16, {256, 64});
  ASSERT_TRUE(cuda_ops->Gemm(args, &out).ok());
  ASSERT_NE(cuda_ops->gemm_plans(), nullptr);
  const size_t plans = cuda_ops->gemm_plans()->size();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(cuda_ops->Gemm(args, &out).ok());
  EXPECT_EQ(cuda_ops->gemm_plans()->size(), plans);
  ASSERT_TRUE(cuda_ops->Synchronize().ok());
}

TEST(GpuGemmArgsTest, RejectsMismatchedShapesAndMixedFp8) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{1} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Ops& gpu = **ops;
  Ops::GemmArgs args;
  args.a = *gpu.Allocate(DType::kBF16, {8, 16});
  args.b = *gpu.Allocate(DType::kBF16, {12, 4});
  Tensor out = *gpu.Allocate(DType::kBF16, {8, 4});
  EXPECT_EQ(gpu.Gemm(args, &out).code(), absl::StatusCode::kInvalidArgument);
  args.b = *gpu.Allocate(DType::kE4M3, {16, 4});
  args.b_scale_inv = *gpu.Allocate(DType::kF32, {1});
  EXPECT_EQ(gpu.Gemm(args, &out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace te
