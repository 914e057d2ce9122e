// The shared argument checks, called directly: the exact messages both
// backends now give, and the conditions that one backend used to miss (the
// CPU's null outputs in position ops, CUDA's empty padding lengths).
#include "kernels/op_checks.h"

#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace te {
namespace {

// A host tensor with memory (the checks read shapes and dtypes, never values).
Tensor Host(DType dtype, Shape shape) {
  const size_t bytes = static_cast<size_t>(NumElements(shape)) * DTypeSize(dtype);
  if (bytes == 0) return Tensor(nullptr, nullptr, dtype, std::move(shape));
  std::shared_ptr<void> memory(new char[bytes], [](void* p) { delete[] static_cast<char*>(p); });
  void* data = memory.get();
  return Tensor(std::move(memory), data, dtype, std::move(shape));
}

void ExpectInvalid(const absl::Status& status, const std::string& message) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(status.message(), message);
}

TEST(RequireTest, MessagesNameTheOpTheArgumentAndTheValue) {
  const Tensor f32 = Host(DType::kF32, {2, 3});
  const Tensor i32 = Host(DType::kI32, {2, 3});
  const Tensor undefined(nullptr, nullptr, DType::kF32, {4});
  ExpectInvalid(RequireDefined("Op", "x", nullptr), "Op: x is null");
  ExpectInvalid(RequireDefined("Op", "x", &undefined), "Op: x is undefined");
  EXPECT_TRUE(RequireDefined("Op", "x", &f32).ok());
  ExpectInvalid(RequireFloat("Op", "x", &i32),
                "Op: x has dtype int32, want float32, bfloat16 or float16");
  ExpectInvalid(RequireDType("Op", "mask", &f32, DType::kBool),
                "Op: mask has dtype float32, want bool");
  ExpectInvalid(RequireScalarF32("Op", "scale", &f32),
                "Op: scale is float32 [2, 3], want float32 [1]");
  ExpectInvalid(RequireShape("Op", "y", f32, {3, 2}), "Op: y has shape [2, 3], want [3, 2]");
  ExpectInvalid(RequireShape("Op", "y", f32, {3}, "[H=3]"), "Op: y has shape [2, 3], want [H=3]");
  ExpectInvalid(RequireSameCount("Op", "y", f32, "x", Host(DType::kF32, {5})),
                "Op: y has 6 elements [2, 3], want 5 like x [5]");
}

TEST(CheckOutputTest, Fp8OutputGoesWithAnFp8YOnly) {
  const Tensor scalar = Host(DType::kF32, {1});
  const Fp8Output fp8{scalar, scalar, scalar};
  const Tensor e4m3 = Host(DType::kE4M3, {4});
  const Tensor bf16 = Host(DType::kBF16, {4});
  EXPECT_TRUE(CheckOutput("Op", &e4m3, &fp8).ok());
  EXPECT_TRUE(CheckOutput("Op", &bf16, nullptr).ok());
  ExpectInvalid(CheckOutput("Op", &e4m3, nullptr),
                "Op: y has dtype float8_e4m3fn but no Fp8Output (scale, amax) is given");
  ExpectInvalid(CheckOutput("Op", &bf16, &fp8),
                "Op: an Fp8Output is given but y has dtype bfloat16, not FP8");
}

TEST(GemmChecksTest, ReturnsDimsAfterTheTransposes) {
  Ops::GemmArgs args;
  args.a = Host(DType::kBF16, {5, 3});  // transposed: [K=5, M=3]
  args.transpose_a = true;
  args.b = Host(DType::kBF16, {7, 5});  // transposed: [N=7, K=5]
  args.transpose_b = true;
  Tensor out = Host(DType::kF32, {3, 7});
  const absl::StatusOr<GemmDims> dims = CheckGemmArgs(args, &out);
  ASSERT_TRUE(dims.ok()) << dims.status();
  EXPECT_EQ(dims->m, 3);
  EXPECT_EQ(dims->n, 7);
  EXPECT_EQ(dims->k, 5);

  Tensor wrong_out = Host(DType::kF32, {7, 3});
  ExpectInvalid(CheckGemmArgs(args, &wrong_out).status(),
                "Gemm: out has shape [7, 3], want [M=3, N=7]");
  args.bias = Host(DType::kF32, {7});
  args.accumulate = true;
  EXPECT_EQ(CheckGemmArgs(args, &out).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NormChecksTest, NamesTheSymbolicShapes) {
  const Tensor x = Host(DType::kBF16, {2, 3, 8});
  const Tensor gamma = Host(DType::kF32, {8});
  const Tensor beta = Host(DType::kF32, {8});
  Tensor y = Host(DType::kBF16, {2, 3, 8});
  Tensor rsigma = Host(DType::kF32, {6});
  Tensor short_rsigma = Host(DType::kF32, {5});
  const NormArgs layernorm;
  const absl::StatusOr<NormDims> dims =
      CheckNormForwardArgs(layernorm, x, gamma, beta, &y, nullptr, &rsigma, nullptr);
  ASSERT_TRUE(dims.ok()) << dims.status();
  EXPECT_EQ(dims->rows, 6);
  EXPECT_EQ(dims->hidden, 8);
  ExpectInvalid(
      CheckNormForwardArgs(layernorm, x, gamma, beta, &y, nullptr, &short_rsigma, nullptr).status(),
      "NormForward: rsigma has shape [5], want [N=6]");
  NormArgs rmsnorm;
  rmsnorm.type = NormType::kRMSNorm;
  ExpectInvalid(
      CheckNormForwardArgs(rmsnorm, x, gamma, beta, &y, nullptr, &rsigma, nullptr).status(),
      "NormForward: beta is given for RMSNorm, which has none");
}

TEST(PositionChecksTest, MissingOutputsAreRejectedNotDereferenced) {
  const Tensor x = Host(DType::kF32, {1, 2, 2, 4});
  ExpectInvalid(CheckRotaryArgs(RotaryArgs(), x, nullptr), "Rotary: y is null");
  const Tensor table = Host(DType::kF32, {2, 6});  // [heads, buckets]
  const Tensor buckets = Host(DType::kI32, {3, 4});
  ExpectInvalid(CheckRelativeBiasForwardArgs(table, buckets, nullptr).status(),
                "RelativeBiasForward: bias is null");
  ExpectInvalid(
      CheckRelativeBiasBackwardArgs(Host(DType::kF32, {2, 3, 4}), buckets, nullptr).status(),
      "RelativeBiasBackward: dtable is null");
  Tensor bias = Host(DType::kF32, {2, 3, 4});
  const absl::StatusOr<RelativeBiasDims> dims = CheckRelativeBiasForwardArgs(table, buckets, &bias);
  ASSERT_TRUE(dims.ok()) << dims.status();
  EXPECT_EQ(dims->num_buckets, 6);
  EXPECT_EQ(dims->heads, 2);
  ExpectInvalid(CheckRelativeBiasForwardArgs(table, Host(DType::kF32, {3, 4}), &bias).status(),
                "RelativeBiasForward: buckets must be int32 [Sq, Skv], got float32 [3, 4]");
}

TEST(AttentionChecksTest, PaddingLengthsAreGivenWhenDefined) {
  AttentionArgs args;
  args.mask = MaskType::kPadding;
  // An empty batch: int32 [0] lengths have no memory and are still given.
  const Tensor q0 = Host(DType::kBF16, {0, 4, 2, 8});
  const Tensor kv0 = Host(DType::kBF16, {0, 5, 1, 8});
  Tensor out0 = Host(DType::kBF16, {0, 4, 2, 8});
  Tensor lse0 = Host(DType::kF32, {0, 2, 4});
  args.q_seqlens = Host(DType::kI32, {0});
  args.kv_seqlens = Host(DType::kI32, {0});
  EXPECT_TRUE(CheckAttentionForwardArgs(args, q0, kv0, kv0, &out0, &lse0).ok());

  const Tensor q = Host(DType::kBF16, {2, 4, 2, 8});
  const Tensor kv = Host(DType::kBF16, {2, 5, 1, 8});
  Tensor out = Host(DType::kBF16, {2, 4, 2, 8});
  Tensor lse = Host(DType::kF32, {2, 2, 4});
  args.q_seqlens = Host(DType::kI32, {2});
  args.kv_seqlens = Tensor();
  ExpectInvalid(CheckAttentionForwardArgs(args, q, kv, kv, &out, &lse).status(),
                "AttentionForward: a padding mask needs kv_seqlens as int32 [2], got none");
  args.kv_seqlens = Host(DType::kI32, {2});
  const absl::StatusOr<AttentionShape> shape =
      CheckAttentionForwardArgs(args, q, kv, kv, &out, &lse);
  ASSERT_TRUE(shape.ok()) << shape.status();
  EXPECT_EQ(shape->q_heads, 2);
  EXPECT_EQ(shape->kv_heads, 1);
  EXPECT_EQ(shape->kv_seq, 5);
  ExpectInvalid(CheckAttentionForwardArgs(args, q, kv, kv, &out, &out).status(),
                "AttentionForward: softmax_lse has dtype bfloat16, want float32");
}

TEST(ElementwiseChecksTest, PermuteAndSumRows) {
  const Tensor x = Host(DType::kBF16, {2, 3, 4});
  Tensor y = Host(DType::kBF16, {4, 2, 3});
  EXPECT_TRUE(CheckPermuteArgs(x, {2, 0, 1}, &y).ok());
  ExpectInvalid(CheckPermuteArgs(x, {2, 0, 0}, &y),
                "Permute: perm [2, 0, 0] is not a permutation of x's 3 dimensions");
  const Tensor rank6 = Host(DType::kF32, {1, 1, 1, 1, 1, 1});
  Tensor y6 = Host(DType::kF32, {1, 1, 1, 1, 1, 1});
  ExpectInvalid(CheckPermuteArgs(rank6, {0, 1, 2, 3, 4, 5}, &y6),
                "Permute: x has rank 6 ([1, 1, 1, 1, 1, 1]), want <= 5");
  Tensor sums = Host(DType::kF32, {3});
  ExpectInvalid(CheckSumRowsArgs(x, &sums), "SumRows: y has shape [3], want [H=4]");
}

TEST(Fp8ChecksTest, DelayedScalingAndBlockSizes) {
  Tensor history = Host(DType::kF32, {0});
  Tensor scale = Host(DType::kF32, {1});
  Tensor scale_inv = Host(DType::kF32, {1});
  ExpectInvalid(CheckDelayedScalingArgs(DelayedScalingArgs(), &history, &scale, &scale_inv),
                "DelayedScalingUpdate: amax_history has shape [0], want [L], L >= 1");
  const Tensor x = Host(DType::kF32, {2, 48});
  Tensor y = Host(DType::kF32, {2, 48});
  EXPECT_TRUE(CheckFakeQuantizeBlockScaledArgs(BlockFormat::kNVFP4, x, &y).ok());
  ExpectInvalid(CheckFakeQuantizeBlockScaledArgs(BlockFormat::kMXFP8, x, &y),
                "FakeQuantizeBlockScaled: x has last dimension 48, want a multiple of the MXFP8 "
                "block size 32");
}

}  // namespace
}  // namespace te
