#include "kernels/workspace/workspace_bytes.h"

#include <gtest/gtest.h>

namespace te {
namespace workspace {
namespace {

constexpr int64_t kLib = int64_t{32} << 20;  // cuBLASLt's per-stream workspace
constexpr int64_t kMiB = int64_t{1} << 20;

TEST(RoundUp, ToMultiplesOf256) {
  EXPECT_EQ(RoundUp(0), 0);
  EXPECT_EQ(RoundUp(1), 256);
  EXPECT_EQ(RoundUp(256), 256);
  EXPECT_EQ(RoundUp(257), 512);
}

// The quickstart's fc1 in bf16: x [8192, 4096] @ W [4096, 16384].
GemmOperands Fc1(DType dtype) {
  GemmOperands g;
  g.a_dtype = g.b_dtype = dtype;
  g.a_numel = 8192 * 4096;
  g.b_numel = 4096 * 16384;
  g.m = 8192;
  g.n = 16384;
  return g;
}

TEST(GemmWorkspace, NativeRouteIsTheLibraryWorkspaceOnly) {
  const GemmWorkspace w = GemmWorkspaceFor(GemmRoute::kNative, kLib, Fc1(DType::kBF16));
  EXPECT_EQ(w.total(), kLib);
  EXPECT_EQ(w.product, 0);
}

TEST(GemmWorkspace, F32ProductAddsMTimesNFloats) {
  const GemmWorkspace w = GemmWorkspaceFor(GemmRoute::kF32Product, kLib, Fc1(DType::kBF16));
  EXPECT_EQ(w.product, 8192 * 16384 * 4);  // 512 MiB
  EXPECT_EQ(w.total(), kLib + 512 * kMiB);
  EXPECT_EQ(w.product_offset(), kLib);
}

TEST(GemmWorkspace, F32OperandsConvertsBothOperands) {
  const GemmWorkspace w = GemmWorkspaceFor(GemmRoute::kF32Operands, kLib, Fc1(DType::kBF16));
  EXPECT_EQ(w.a_copy, 8192 * 4096 * 4);
  EXPECT_EQ(w.b_copy, 4096 * 16384 * 4);
  EXPECT_EQ(w.a_offset(), kLib);                   // a32 first, as gemm.cu lays it out
  EXPECT_EQ(w.b_offset(), kLib + w.a_copy);
  EXPECT_EQ(w.product_offset(), kLib + w.a_copy + w.b_copy);
  EXPECT_EQ(w.total(), kLib + (128 + 256 + 512) * kMiB);
}

TEST(GemmWorkspace, Fp8CopiesOnlyTheOperandsNotInTnLayout) {
  GemmOperands g = Fc1(DType::kE4M3);
  // transpose_b false: b [K, N] goes to [N, K]; a as is.
  GemmWorkspace w = GemmWorkspaceFor(GemmRoute::kNative, kLib, g);
  EXPECT_EQ(w.b_copy, 4096 * 16384);  // one byte per element
  EXPECT_EQ(w.a_copy, 0);
  EXPECT_EQ(w.b_offset(), kLib);
  // The wgrad's layout: a transposed too, b already [N, K].
  g.transpose_a = true;
  g.transpose_b = true;
  w = GemmWorkspaceFor(GemmRoute::kNative, kLib, g);
  EXPECT_EQ(w.b_copy, 0);
  EXPECT_EQ(w.a_copy, 8192 * 4096);
  EXPECT_EQ(w.a_offset(), kLib);
}

TEST(GemmWorkspace, OddSizesRoundEachRegion) {
  GemmOperands g;
  g.a_dtype = g.b_dtype = DType::kE5M2;
  g.a_numel = 3 * 5;
  g.b_numel = 5 * 7;
  g.m = 3;
  g.n = 7;
  const GemmWorkspace w = GemmWorkspaceFor(GemmRoute::kF32Product, 0, g);
  EXPECT_EQ(w.b_copy, 256);
  EXPECT_EQ(w.product, 256);
  EXPECT_EQ(w.total(), 512);
}

TEST(GemmWorkspace, BoundIsTheLargestRouteTheCallCanTake) {
  const GemmOperands same = Fc1(DType::kBF16);
  EXPECT_EQ(GemmWorkspaceBound(kLib, same),
            GemmWorkspaceFor(GemmRoute::kF32Operands, kLib, same).total());
  // FP8 operands are one byte, so converting them to f32 is the largest.
  const GemmOperands fp8 = Fc1(DType::kE4M3);
  EXPECT_EQ(GemmWorkspaceBound(kLib, fp8),
            GemmWorkspaceFor(GemmRoute::kF32Operands, kLib, fp8).total());
  for (GemmRoute route : {GemmRoute::kNative, GemmRoute::kF32Product, GemmRoute::kF32Operands}) {
    EXPECT_GE(GemmWorkspaceBound(kLib, same), GemmWorkspaceFor(route, kLib, same).total());
    EXPECT_GE(GemmWorkspaceBound(kLib, fp8), GemmWorkspaceFor(route, kLib, fp8).total());
  }
}

// The quickstart's attention: B 4, S 2048, H 32, D 128.
AttentionDims Quickstart() {
  AttentionDims d;
  d.batch = 4;
  d.q_seq = d.kv_seq = 2048;
  d.q_heads = 32;
  d.head_dim = 128;
  return d;
}

TEST(CudnnAttentionWorkspace, ForwardWithoutBiasIsLibraryAndSeed) {
  const CudnnAttentionWorkspace w =
      CudnnAttentionWorkspaceFor(false, 1000, Quickstart(), DType::kBF16, false, false);
  EXPECT_EQ(w.library, 1024);  // rounded to 256
  EXPECT_EQ(w.total(), 1024 + 16);
  EXPECT_EQ(w.seed_offset_offset(), 1024);
}

TEST(CudnnAttentionWorkspace, BackwardAccumulatesDqInF32) {
  const CudnnAttentionWorkspace w =
      CudnnAttentionWorkspaceFor(true, 0, Quickstart(), DType::kBF16, false, false);
  EXPECT_EQ(w.softmax_sum, 4 * 32 * 2048 * 4);        // 1 MiB
  EXPECT_EQ(w.dq_accum, 4 * 32 * 2048 * 128 * 4);     // 128 MiB
  EXPECT_EQ(w.bias + w.dbias, 0);
  EXPECT_EQ(w.dq_accum_offset(), w.softmax_sum);
  EXPECT_EQ(w.total(), (1 + 128) * kMiB + 16);
}

TEST(CudnnAttentionWorkspace, BiasReplacesTheDqAccumulatorWithBiasAndDbias) {
  const CudnnAttentionWorkspace w =
      CudnnAttentionWorkspaceFor(true, 512, Quickstart(), DType::kF16, true, true);
  const int64_t bias = int64_t{32} * 2048 * 2048 * 2;  // [Hq, Sq, Skv] f16: 256 MiB
  EXPECT_EQ(w.dq_accum, 0);
  EXPECT_EQ(w.bias, bias);
  EXPECT_EQ(w.dbias, bias);
  EXPECT_EQ(w.bias_offset(), 512 + kMiB);
  EXPECT_EQ(w.dbias_offset(), 512 + kMiB + bias);
  EXPECT_EQ(w.total(), 512 + kMiB + 2 * bias + 16);
  const CudnnAttentionWorkspace fwd =
      CudnnAttentionWorkspaceFor(false, 512, Quickstart(), DType::kF16, true, false);
  EXPECT_EQ(fwd.total(), 512 + bias + 16);
}

TEST(FallbackAttentionWorkspace, RowDotAndTheSmallHeadDropoutBits) {
  AttentionDims d;
  d.batch = 1;
  d.q_seq = 3;
  d.kv_seq = 5;
  d.q_heads = 1;
  d.head_dim = 4;
  EXPECT_EQ(FallbackAttentionBackwardWorkspace(d, false, 0), 12);
  EXPECT_EQ(FallbackAttentionBackwardWorkspace(d, true, 0), 16);   // aligned to 16
  EXPECT_EQ(FallbackAttentionBackwardWorkspace(d, true, 12), 28);
  EXPECT_EQ(FallbackAttentionBackwardWorkspace(Quickstart(), true, 64 * kMiB),
            kMiB + 64 * kMiB);
}

}  // namespace
}  // namespace workspace
}  // namespace te
