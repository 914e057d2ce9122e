// Position encodings on the GPU against the CPU reference: rotary embeddings
// and the relative position bias (forward and its table gradient), each also
// at a position that lives on the device, CopyRowsAt (a decode step's rows
// written into the cache at such a position) and DecodeQkvRows (the same
// rows out of the packed QKV projection, rotated on the way).
#include <utility>

#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

// ---- position encodings --------------------------------------------------------------------

// GpuTest with a position that lives on the device: int32 [1] on both backends.
class DevicePositionTest : public GpuTest {
 protected:
  Pair Position(int32_t value) {
    Tensor cpu = NewCpu(DType::kI32, {1});
    cpu.data_as<int32_t>()[0] = value;
    return Mirror(cpu);
  }
};


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

// q and k rotated inside the packed qkv [B, S, 3, H, D], against the CPU's
// (its default: split, Rotary, stack): the grouped kernel (bf16, S 77 and
// 2048), the pair-a-thread one (f32; bf16 D 8 alternate, whose half of 4 is
// not a group of 8) and the default for short sequences (S 5); v untouched.
TEST_F(GpuTest, RotaryQkInPlaceMatchesCpu) {
  for (const Shape& shape : {Shape{2, 77, 3, 3, 64}, Shape{1, 2048, 3, 2, 128},
                             Shape{2, 40, 3, 2, 8}, Shape{3, 5, 3, 2, 16}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (const bool consecutive : {false, true}) {
        RotaryArgs args;
        args.consecutive = consecutive;
        const Pair qkv = Random(dtype, shape, 18);
        Pair rotated = Clone(qkv.cpu);
        ASSERT_TRUE(cpu_->RotaryQkInPlace(args, &rotated.cpu).ok());
        const absl::Status s = gpu_->RotaryQkInPlace(args, &rotated.gpu);
        ASSERT_TRUE(s.ok()) << s;
        ExpectMatches(rotated, "RotaryQkInPlace " + ShapeName(shape) +
                                   (consecutive ? " consecutive" : " alternate"));
      }
    }
  }
}

// A table made once (RotaryTable, as a layer keeps it) and handed to the
// rotary ops gives the bits each op gives making its own: Rotary,
// RotaryQkInPlace (forward) and the FP8 backward's RotaryQkQuantizeTranspose
// (inverse); and the table matches the CPU's.
TEST_F(GpuTest, KeptRotaryTablesGiveTheOpsOwnBits) {
  const Shape shape = {2, 77, 3, 3, 64};
  const int64_t seq = shape[1], dim = shape[4];
  for (const bool inverse : {false, true}) {
    SCOPED_TRACE(inverse ? "inverse" : "forward");
    RotaryArgs args;
    args.inverse = inverse;
    absl::StatusOr<Tensor> gpu_table = gpu_->RotaryTable(args, seq, dim);
    ASSERT_TRUE(gpu_table.ok()) << gpu_table.status();
    Pair table{*cpu_->RotaryTable(args, seq, dim), *gpu_table};
    ExpectMatches(table, "RotaryTable");
    RotaryArgs kept = args;
    kept.table = *gpu_table;

    const Pair qkv = Random(DType::kBF16, shape, 19);
    Pair own = Clone(qkv.cpu), with_table = Clone(qkv.cpu);
    ASSERT_TRUE(gpu_->RotaryQkInPlace(args, &own.gpu).ok());
    ASSERT_TRUE(gpu_->RotaryQkInPlace(kept, &with_table.gpu).ok());
    ExpectSameBits(own.gpu, with_table.gpu, "RotaryQkInPlace");

    const Shape split = {shape[0], seq, shape[3], dim};
    const Pair x = Random(DType::kBF16, split, 20);
    Pair y_own = Output(DType::kBF16, split), y_kept = Output(DType::kBF16, split);
    ASSERT_TRUE(gpu_->Rotary(args, x.gpu, &y_own.gpu).ok());
    ASSERT_TRUE(gpu_->Rotary(kept, x.gpu, &y_kept.gpu).ok());
    ExpectSameBits(y_own.gpu, y_kept.gpu, "Rotary");

    const int64_t rows = shape[0] * seq, cols = 3 * shape[3] * dim;
    Pair codes_own = Output(DType::kE5M2, {rows, cols}), codes_kept = Output(DType::kE5M2, {rows, cols});
    Pair t_own = Output(DType::kE5M2, {cols, rows}), t_kept = Output(DType::kE5M2, {cols, rows});
    Fp8Pair fp8_own = Fp8Side(64.0f), fp8_kept = Fp8Side(64.0f);
    Pair consumed_own = Clone(qkv.cpu), consumed_kept = Clone(qkv.cpu);
    absl::Status s = gpu_->RotaryQkQuantizeTranspose(args, &consumed_own.gpu, fp8_own.gpu(),
                                                      &codes_own.gpu, &t_own.gpu, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    s = gpu_->RotaryQkQuantizeTranspose(kept, &consumed_kept.gpu, fp8_kept.gpu(), &codes_kept.gpu,
                                        &t_kept.gpu, nullptr);
    ASSERT_TRUE(s.ok()) << s;
    ExpectSameBits(codes_own.gpu, codes_kept.gpu, "RotaryQkQuantizeTranspose codes");
    ExpectSameBits(t_own.gpu, t_kept.gpu, "RotaryQkQuantizeTranspose transposed codes");
  }
}

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

// A decode step's position lives on the device: RotaryArgs::position adds to
// position_offset when the kernels run.
TEST_F(DevicePositionTest, RotaryFromADevicePositionMatchesCpu) {
  const Pair position = Position(4000);
  // Up to 16 positions compute their angles in the rotation; more make a table.
  for (const Shape& shape : {Shape{3, 1, 4, 64}, Shape{2, 9, 2, 16}, Shape{1, 40, 2, 16}}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (bool consecutive : {true, false}) {
        RotaryArgs args;
        args.consecutive = consecutive;
        args.position_offset = 93;
        const Pair x = Random(dtype, shape, 21);
        Pair y = Output(dtype, shape);
        args.position = position.cpu;
        ASSERT_TRUE(cpu_->Rotary(args, x.cpu, &y.cpu).ok());
        args.position = position.gpu;
        const absl::Status s = gpu_->Rotary(args, x.gpu, &y.gpu);
        ASSERT_TRUE(s.ok()) << s;
        ExpectMatches(y, "Rotary from 93 + device 4000 " + ShapeName(shape) +
                             (consecutive ? " consecutive" : " alternate"));
      }
    }
  }
}

class RelativeBiasTest : public DevicePositionTest,
                         public ::testing::WithParamInterface<DType> {};

// A decode step's rows of the [L, L] bucket table, from a device first_row;
// rows past the table give 0 (the GPU output starts as NaN: every element
// must be written). L 24 takes the kernel's eight-column path, 20 its
// column-by-column one.
TEST_P(RelativeBiasTest, ForwardFromAFirstRow) {
  const DType dtype = GetParam();
  const int64_t num_buckets = 32, heads = 3;
  const Pair table = Random(dtype, {heads, num_buckets}, 22);
  for (const int64_t length : {20, 24}) {
    Tensor buckets_cpu = NewCpu(DType::kI32, {length, length});
    std::mt19937 gen(23);
    for (int64_t i = 0; i < buckets_cpu.numel(); ++i) {
      buckets_cpu.data_as<int32_t>()[i] = static_cast<int32_t>(gen() % num_buckets);
    }
    const Pair buckets = Mirror(buckets_cpu);
    const int32_t last = static_cast<int32_t>(length - 1);
    for (const auto& [r0, q_rows] : std::vector<std::pair<int32_t, int64_t>>{
             {0, 1}, {7, 1}, {last, 1}, {0, 5}, {9, 5}, {last - 1, 5}, {last + 1, 1}}) {
      for (const DType bias_dtype : {DType::kF32, DType::kBF16}) {
        const Pair first_row = Position(r0);
        Pair bias = Output(bias_dtype, {heads, q_rows, length});
        ASSERT_TRUE(
            cpu_->RelativeBiasForward(table.cpu, buckets.cpu, first_row.cpu, &bias.cpu).ok());
        const absl::Status s =
            gpu_->RelativeBiasForward(table.gpu, buckets.gpu, first_row.gpu, &bias.gpu);
        ASSERT_TRUE(s.ok()) << s;
        ExpectMatches(bias, "RelativeBiasForward L " + std::to_string(length) + " from row " +
                                std::to_string(r0) + ", " + std::to_string(q_rows) + " rows into " +
                                DTypeName(bias_dtype));
      }
    }
  }
}

TEST_P(RelativeBiasTest, ForwardAndBackward) {
  const DType dtype = GetParam();
  for (const auto& [num_buckets, heads, q_seq, kv_seq] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>{
           {32, 8, 77, 100}, {128, 3, 300, 300}, {600, 2, 64, 64},
           // a table over the 48 KiB the forward keeps in shared memory
           {1000, 13, 16, 24}}) {
    const Pair table = Random(dtype, {heads, num_buckets}, 17);
    Tensor buckets_cpu = NewCpu(DType::kI32, {q_seq, kv_seq});
    std::mt19937 gen(18);
    for (int64_t i = 0; i < buckets_cpu.numel(); ++i) {
      buckets_cpu.data_as<int32_t>()[i] = static_cast<int32_t>(gen() % num_buckets);
    }
    const Pair buckets = Mirror(buckets_cpu);
    // The bias in float32 and in the attention operands' dtypes.
    for (const DType bias_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      Pair bias = Output(bias_dtype, {heads, q_seq, kv_seq});
      ASSERT_TRUE(cpu_->RelativeBiasForward(table.cpu, buckets.cpu, Tensor(), &bias.cpu).ok());
      ASSERT_TRUE(gpu_->RelativeBiasForward(table.gpu, buckets.gpu, Tensor(), &bias.gpu).ok());
      ExpectMatches(bias, std::string("RelativeBiasForward into ") + DTypeName(bias_dtype));
    }
    const Pair dbias = Random(DType::kF32, {heads, q_seq, kv_seq}, 19);
    Pair dtable = Output(dtype, {heads, num_buckets});
    ASSERT_TRUE(cpu_->RelativeBiasBackward(dbias.cpu, buckets.cpu, &dtable.cpu).ok());
    const absl::Status s = gpu_->RelativeBiasBackward(dbias.gpu, buckets.gpu, &dtable.gpu);
    ASSERT_TRUE(s.ok()) << s;
    ExpectMatches(dtable, "RelativeBiasBackward NB=" + std::to_string(num_buckets));
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, RelativeBiasTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(Short(info.param)); });

// ---- rows copied at a device position ---------------------------------------------------------

// (dtype, S): src [B=3, S, 2, 8] into dst [3, L=16, 2, 8] at positions inside,
// partly past the end, wholly past it, and before the start; compared with the
// CPU's bytes exactly (a copy rounds nothing), dst random beforehand on both.
using CopyRowsAtCase = std::tuple<DType, int64_t>;
class CopyRowsAtTest : public DevicePositionTest,
                       public ::testing::WithParamInterface<CopyRowsAtCase> {};

TEST_P(CopyRowsAtTest, MatchesCpuExactly) {
  const auto [dtype, seq] = GetParam();
  const int64_t batch = 3, length = 16;
  for (int32_t p : {0, 7, 11, 13, 15, 16, -2}) {
    const uint32_t seed = static_cast<uint32_t>(30 + p);
    const Pair src = Random(dtype, {batch, seq, 2, 8}, seed);
    const Pair dst = Random(dtype, {batch, length, 2, 8}, seed + 100);
    const Pair position = Position(p);
    Tensor dst_cpu = dst.cpu, dst_gpu = dst.gpu;
    ASSERT_TRUE(cpu_->CopyRowsAt(src.cpu, position.cpu, &dst_cpu).ok());
    const absl::Status s = gpu_->CopyRowsAt(src.gpu, position.gpu, &dst_gpu);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(gpu_->Synchronize().ok());
    const Tensor got = Fetch(dst.gpu);
    EXPECT_EQ(0, std::memcmp(got.data(), dst.cpu.data(), dst.cpu.nbytes()))
        << "CopyRowsAt " << Short(dtype) << " S=" << seq << " at " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, CopyRowsAtTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(int64_t{1}, int64_t{5})),
                         [](const auto& info) {
                           return std::string(Short(std::get<0>(info.param))) + "_S" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ---- a decode step's rows out of the packed qkv ----------------------------------------------

// The one-pass kernel against the CPU (Ops' default: Permute, Rotary,
// CopyRowsAt): q and the cache after the step, at positions inside, partly
// past the end and wholly past it, with and without rotation, T up to the
// kernel's 16 and past it (the default's path on the GPU too). The values,
// copied rows, must match exactly, and so must every cache row the step does
// not write; q and the rotated keys within the dtype's tolerance.
using DecodeQkvRowsCase = std::tuple<DType, int64_t, bool>;  // T, rotate
class DecodeQkvRowsTest : public DevicePositionTest,
                          public ::testing::WithParamInterface<DecodeQkvRowsCase> {};

TEST_P(DecodeQkvRowsTest, MatchesCpu) {
  const auto [dtype, tokens, rotate] = GetParam();
  const int64_t batch = 3, heads = 4, dim = 64, length = 40;
  for (int32_t p : {0, 17, 38, 40}) {
    SCOPED_TRACE(::testing::Message() << "p " << p);
    const uint32_t seed = static_cast<uint32_t>(50 + p);
    const Pair qkv = Random(dtype, {batch, tokens, 3, heads, dim}, seed);
    const Pair key = Random(dtype, {batch, length, heads, dim}, seed + 100);
    const Pair value = Random(dtype, {batch, length, heads, dim}, seed + 200);
    Pair q = Output(dtype, {batch, tokens, heads, dim});
    const Pair position = Position(p);
    RotaryArgs rotary;
    Tensor key_cpu = key.cpu, key_gpu = key.gpu, value_cpu = value.cpu, value_gpu = value.gpu;
    rotary.position = position.cpu;
    ASSERT_TRUE(cpu_->DecodeQkvRows(qkv.cpu, rotate ? &rotary : nullptr, position.cpu, &q.cpu,
                                    &key_cpu, &value_cpu)
                    .ok());
    rotary.position = position.gpu;
    const absl::Status s = gpu_->DecodeQkvRows(qkv.gpu, rotate ? &rotary : nullptr,
                                               position.gpu, &q.gpu, &key_gpu, &value_gpu);
    ASSERT_TRUE(s.ok()) << s;
    ExpectMatches(q, "q");
    ExpectMatches(key, "key cache");
    const Tensor got_value = Fetch(value.gpu);
    EXPECT_EQ(0, std::memcmp(got_value.data(), value.cpu.data(), value.cpu.nbytes()))
        << "value cache";
    if (!rotate) {
      const Tensor got_key = Fetch(key.gpu);
      EXPECT_EQ(0, std::memcmp(got_key.data(), key.cpu.data(), key.cpu.nbytes())) << "key cache";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Matrix, DecodeQkvRowsTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16,
                                                              DType::kF16),
                                            ::testing::Values(int64_t{1}, int64_t{5},
                                                              int64_t{20}),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(Short(std::get<0>(info.param))) + "_T" +
                                  std::to_string(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_rotated" : "_plain");
                         });

}  // namespace
}  // namespace gpu_test
}  // namespace te
