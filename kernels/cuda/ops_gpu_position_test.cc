// Position encodings on the GPU against the CPU reference: rotary embeddings
// and the relative position bias (forward and its table gradient).
#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

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

// A decode step rotates its one token at the token's position.
TEST_F(GpuTest, RotaryFromAPositionOffsetMatchesCpu) {
  for (const Shape& shape : {Shape{3, 1, 4, 64}, Shape{2, 9, 2, 16}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      RotaryArgs args;
      args.position_offset = 4093;
      const Pair x = Random(dtype, shape, 17);
      Pair y = Output(dtype, shape);
      ASSERT_TRUE(cpu_->Rotary(args, x.cpu, &y.cpu).ok());
      ASSERT_TRUE(gpu_->Rotary(args, x.gpu, &y.gpu).ok());
      ExpectMatches(y, "Rotary from 4093");
    }
  }
}

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

}  // namespace
}  // namespace gpu_test
}  // namespace te
