// FP8 on the GPU against the CPU reference: Quantize / Dequantize (input
// dtype x FP8 format x scale x shape), the fused cast-transpose (with and
// without the bias gradient), scale from amax, the delayed-scaling update and
// block scaling (MXFP8, NVFP4); amax and scale_inv checked with the codes.
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

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
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(DType::kE4M3, DType::kE5M2),
                       // tiles: whole 128 x 64 ones (the wide kernel; 8320 x 1088: 1105
                       // tiles, more than the grid's blocks), ragged for it (the 64 x 64
                       // kernel: multiples of 4; cols a multiple of 8 or not, rows of 16
                       // or not: the 16-byte and the 4-byte paths; 2116 x 2180: 1190
                       // tiles, a block takes several), and shapes both decline (odd:
                       // the fallback)
                       ::testing::Values(Shape{128, 256}, Shape{8320, 1088}, Shape{100, 36},
                                         Shape{516, 1028}, Shape{4, 4}, Shape{12, 12},
                                         Shape{144, 520}, Shape{20, 5000}, Shape{2116, 2180},
                                         Shape{37, 24}, Shape{64, 30})),
    [](const auto& info) {
      return std::string(Short(std::get<0>(info.param))) + "_" + Short(std::get<1>(info.param)) +
             "_" + ShapeName(std::get<2>(info.param));
    });

// Cast-transpose-dbias: the tile kernel's codes (bit-exact, as above), and
// dbias, its column sums of x, against the CPU's SumRows within the float
// tolerance of dbias's dtype.
class CastTransposeDbiasTest : public GpuTest {
 protected:
  // QuantizeTransposeDbias of x on both backends into q, q_t and dbias
  // (which may be views), then the checks above.
  void ExpectDbiasMatchesCpu(const Pair& x, Fp8Pair& side, Pair& q, Pair& q_t, Pair& dbias,
                             const std::string& what) {
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
    EXPECT_EQ(Fetch(side.amax.gpu).data_as<float>()[0], side.amax.cpu.data_as<float>()[0])
        << what;
    ExpectMatches(dbias, what);
  }
};

class QuantizeTransposeDbiasTest : public CastTransposeDbiasTest,
                                   public ::testing::WithParamInterface<QuantizeTransposeCase> {};

TEST_P(QuantizeTransposeDbiasTest, CodesAndColumnSumsMatchTheCpu) {
  const auto [dtype, fp8, shape] = GetParam();
  const Pair x = Random(dtype, shape, 26, -4.0f, 4.0f);
  for (DType dbias_dtype : {DType::kF32, DType::kBF16}) {
    Fp8Pair side = Fp8Side(SaturatingScale(fp8) * 0.5f);
    Pair q = Output(fp8, shape);
    Pair q_t = Output(fp8, {shape[1], shape[0]});
    Pair dbias = Output(dbias_dtype, {shape[1]});
    ExpectDbiasMatchesCpu(x, side, q, q_t, dbias, std::string("dbias ") + Short(dbias_dtype));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, QuantizeTransposeDbiasTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                       ::testing::Values(DType::kE4M3, DType::kE5M2),
                       // tiles: whole 128 x 64 ones (the wide kernel, its partial rows
                       // a 128-row tile each: 1 and 65 of them), ragged edges for it
                       // (the 64 x 64 kernel: multiples of 4), many row tiles (the
                       // partial rows' reduction), more tiles than the grid's blocks,
                       // and shapes both decline (odd: the fallback)
                       ::testing::Values(Shape{128, 256}, Shape{8320, 1088}, Shape{100, 36},
                                         Shape{516, 1028}, Shape{4, 4}, Shape{1000, 200},
                                         Shape{2052, 64},
                                         Shape{144, 520}, Shape{20, 5000}, Shape{2116, 2180},
                                         Shape{37, 24}, Shape{64, 30})),
    [](const auto& info) {
      return std::string(Short(std::get<0>(info.param))) + "_" + Short(std::get<1>(info.param)) +
             "_" + ShapeName(std::get<2>(info.param));
    });

// Each launch's amax is its own: the blocks fold through the stream's slot
// with no memset before them, so a slot the last launch left dirty would
// show here as the previous, larger amax. Large and small inputs alternate
// through every quantizing path of this file, the amax poisoned before each.
TEST_F(GpuTest, EachQuantizingLaunchRecordsItsOwnAmax) {
  const Shape shape{192, 320};  // 15 x 3 tiles, a grid-stride grid of many blocks
  for (int round = 0; round < 6; ++round) {
    const float range = round % 2 == 0 ? 100.0f : 0.5f;
    const Pair x = Random(DType::kBF16, shape, 40 + round, -range, range);
    const std::string what = "round " + std::to_string(round);
    Fp8Pair side = Fp8Side(1.0f);
    side.amax = Scalar(1e30f);
    Pair q = Output(DType::kE5M2, shape), q_t = Output(DType::kE5M2, {shape[1], shape[0]});
    switch (round % 3) {
      case 0:
        ASSERT_TRUE(cpu_->Quantize(x.cpu, side.cpu(), &q.cpu).ok());
        ASSERT_TRUE(gpu_->Quantize(x.gpu, side.gpu(), &q.gpu).ok());
        break;
      case 1:
        ASSERT_TRUE(cpu_->QuantizeTranspose(x.cpu, side.cpu(), &q.cpu, &q_t.cpu).ok());
        ASSERT_TRUE(gpu_->QuantizeTranspose(x.gpu, side.gpu(), &q.gpu, &q_t.gpu).ok());
        break;
      default: {
        Pair dbias = Output(DType::kF32, {shape[1]});
        ASSERT_TRUE(
            cpu_->QuantizeTransposeDbias(x.cpu, side.cpu(), &q.cpu, &q_t.cpu, &dbias.cpu).ok());
        ASSERT_TRUE(
            gpu_->QuantizeTransposeDbias(x.gpu, side.gpu(), &q.gpu, &q_t.gpu, &dbias.gpu).ok());
      }
    }
    ASSERT_TRUE(gpu_->Synchronize().ok());
    EXPECT_EQ(Fetch(side.amax.gpu).data_as<float>()[0], side.amax.cpu.data_as<float>()[0])
        << what;
    Pair amax = Scalar(1e30f);
    ASSERT_TRUE(cpu_->Amax(x.cpu, &amax.cpu).ok());
    ASSERT_TRUE(gpu_->Amax(x.gpu, &amax.gpu).ok());
    EXPECT_EQ(Fetch(amax.gpu).data_as<float>()[0], amax.cpu.data_as<float>()[0]) << what;
  }
}

// Views 4 elements into their allocations: x, y and y_t keep the 64 x 64
// kernel's 4-element alignment but not 16 bytes, so a shape that would take
// the 16-byte loads and stores (144 x 520), or the wide kernel (256 x 512),
// takes the 4-element words instead, with the same codes, amax and column
// sums.
TEST_F(CastTransposeDbiasTest, QuantizeTransposeDbiasOfViewsOffByFourElements) {
  for (const Shape& shape : {Shape{144, 520}, Shape{256, 512}}) {
    const int64_t n = NumElements(shape);
    auto view = [&](const Pair& flat, const Shape& s) {
      return Pair{flat.cpu.Slice0(4, n + 4).Reshaped(s), flat.gpu.Slice0(4, n + 4).Reshaped(s)};
    };
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const std::string what = std::string("views ") + Short(dtype) + " " + ShapeName(shape);
      const Pair x = view(Random(dtype, {n + 4}, 27, -4.0f, 4.0f), shape);
      Fp8Pair side = Fp8Side(SaturatingScale(DType::kE4M3) * 0.5f);
      Pair q = view(Output(DType::kE4M3, {n + 4}), shape);
      Pair q_t = view(Output(DType::kE4M3, {n + 4}), {shape[1], shape[0]});
      Pair dbias = Output(DType::kF32, {shape[1]});
      ExpectDbiasMatchesCpu(x, side, q, q_t, dbias, what);
    }
  }
}

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

}  // namespace
}  // namespace gpu_test
}  // namespace te
