// Cast, Axpby, Fill, Copy, SumRows, Amax and Permute on the GPU against the
// CPU reference (the matrix and tolerances: ops_gpu_test.h).
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

// ---- elementwise: op x dtype x shape ---------------------------------------------

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

// CopyAll: more small pairs than one launch takes (so two launches), odd
// byte counts, and one large enough for the copy engine.
TEST_F(GpuTest, CopyAllCopiesEveryPair) {
  std::vector<Pair> src, dst;
  std::vector<Shape> shapes;
  for (int i = 0; i < 70; ++i) shapes.push_back({1 + (i * 7) % 19});
  shapes.push_back({300, 301});
  for (size_t i = 0; i < shapes.size(); ++i) {
    const DType dtype = i % 2 ? DType::kBF16 : DType::kF32;
    src.push_back(Random(dtype, shapes[i], 40 + static_cast<int>(i)));
    dst.push_back(Output(dtype, shapes[i]));
  }
  std::vector<const Tensor*> from;
  std::vector<Tensor*> to;
  for (size_t i = 0; i < src.size(); ++i) {
    from.push_back(&src[i].gpu);
    to.push_back(&dst[i].gpu);
  }
  ASSERT_TRUE(gpu_->CopyAll(from, to).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  for (size_t i = 0; i < src.size(); ++i) {
    const Tensor got = Fetch(dst[i].gpu);
    EXPECT_EQ(0, std::memcmp(got.data(), src[i].cpu.data(), got.nbytes())) << "pair " << i;
  }
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

INSTANTIATE_TEST_SUITE_P(Matrix, ElementwiseTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::ValuesIn(kShapes)),
                         DTypeShapeName);

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

}  // namespace
}  // namespace gpu_test
}  // namespace te
