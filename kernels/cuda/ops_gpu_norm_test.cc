// LayerNorm and RMSNorm on the GPU against the CPU reference: forward and
// backward (type x dtype x output format x shape), the register-resident fast
// paths and their general fallbacks, and NormForwardTransposed.
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

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
                           // few rows (a decode step's): each row spread over more
                           // warps than it needs, a pack a thread (1024: 4 warps,
                           // 2048: 8)
                           Shape{8, 1024}, Shape{1, 2048},
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
                           // fused, few rows: each row over 4 warps
                           Shape{8, 1024},
                           // fallback: rows % 4 != 0; H % 8 != 0
                           Shape{37, 200}, Shape{64, 100})),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == NormType::kLayerNorm ? "ln" : "rms") + "_" +
             NormDTypesName(std::get<1>(info.param)) + "_" + Short(std::get<2>(info.param)) +
             "_" + ShapeName(std::get<3>(info.param));
    });

}  // namespace
}  // namespace gpu_test
}  // namespace te
