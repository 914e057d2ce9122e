// TE's relative-position bias through causal self-attention on the GPU
// against the CPU reference's dense path (the bias made, AttentionBackward's
// dbias, then RelativeBiasBackward), on random data with TE's causal T5
// buckets: the far/band split (relative_band_split.cu: cuDNN's bias-free far
// part, the band kernels for the rest and for dtable) with the bias named by
// its table or made dense, and under GQA cuDNN reading the dense bias with
// the band kernel of relative_bias_grad.cu forming dtable. Packed and
// separate q, k, v, head_dim 32 / 64 / 128, bf16 and f16, sequences shorter
// and longer than the band, the bias in float32 and in the operands' dtype,
// more heads than the stream's group counters. Each case asserts through the
// call counters which path ran; where none may (a sequence not a multiple of
// 16), the dense default answers. dtable repeats its bits from run to run.
//
// Tolerances as attention_gpu_test's (kernels/cpu/test_util.h's Tolerance:
// relative error ||gpu - cpu|| / ||cpu||, 1e-2 for bf16, and 2e-3 for f16
// gradients, which cuDNN rounds twice).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

using ::te::testing::MakeEmpty;
using ::te::testing::MakeTensor;
using ::te::testing::RandomValues;
using ::te::testing::RelativeError;
using ::te::testing::ToDoubles;

constexpr double kF16AttentionGradTolerance = 2e-3;
constexpr int kNumBuckets = 32;    // TE's RelativePositionBiases defaults
constexpr int kMaxDistance = 128;

// TE's causal bucket of a key `n` positions before its query (n >= 0).
int32_t CausalBucket(int64_t n, int num_buckets) {
  const int max_exact = num_buckets / 2;
  if (n < max_exact) return static_cast<int32_t>(n);
  const float ratio = static_cast<float>(n) / max_exact + std::numeric_limits<float>::epsilon();
  const double scaled = static_cast<double>(std::log(ratio)) /
                        std::log(static_cast<double>(kMaxDistance) / max_exact) *
                        (num_buckets - max_exact);
  return std::min(max_exact + static_cast<int32_t>(scaled), num_buckets - 1);
}

struct Case {
  std::string name;
  DType dtype;
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  bool packed;
  bool band;  // the band kernel must serve it
  // The bias in the operands' dtype, as a layer passes it (cuDNN reads it in
  // place; the unfused kernels widen it); else float32.
  bool operand_bias = false;
  // 64 buckets over 128 positions settle at distance 123: a band of nine
  // key tiles behind each query tile, past the eight warps of a block.
  int num_buckets = kNumBuckets;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Reference;
struct GpuRun;

class RelativeBandTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    cuda::SetRelativeSplit(true);  // the split is under test, whatever the default
    auto ops = device_->NewOps(int64_t{8} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    gpu_ = *std::move(ops);
  }

  Tensor ToGpu(const Tensor& host) {
    auto t = gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(gpu_->Upload(host.data(), &*t).ok());
    return *t;
  }
  Tensor GpuNan(DType dtype, const Shape& shape) {
    auto t = gpu_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(gpu_->Fill(NAN, &*t).ok());  // every element the op writes starts NaN
    return *t;
  }
  std::vector<double> FromGpu(const Tensor& t) {
    Tensor host = MakeEmpty(cpu_, t.dtype(), t.shape());
    const absl::Status s = gpu_->Download(t, host.data());
    EXPECT_TRUE(s.ok()) << s;
    return ToDoubles(host);
  }

  void MakeReference(const Case& c, uint64_t seed, Reference* ref);
  void RunCpu(const Case& c, const AttentionArgs& cpu_args, Reference* ref);
  void Run(const Case& c, const Reference& ref, const AttentionArgs& gpu_args,
           const RelativeBuckets& gpu_relative, GpuRun* run);

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

// [B, S, 3, H, D] from three [B, S, H, D] (q, k and v of one head count).
std::vector<float> Pack(const Tensor& q, const Tensor& k, const Tensor& v) {
  const std::vector<double> parts[3] = {ToDoubles(q), ToDoubles(k), ToDoubles(v)};
  const int64_t tokens = q.dim(0) * q.dim(1), row = q.dim(2) * q.dim(3);
  std::vector<float> packed(static_cast<size_t>(3 * tokens * row));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int p = 0; p < 3; ++p) {
      for (int64_t e = 0; e < row; ++e) {
        packed[static_cast<size_t>((t * 3 + p) * row + e)] =
            static_cast<float>(parts[p][static_cast<size_t>(t * row + e)]);
      }
    }
  }
  return packed;
}

// The part p of a packed [B, S, 3, H, D] gradient, as a flat [B, S, H, D].
std::vector<double> Part(const std::vector<double>& packed, int64_t tokens, int64_t row, int p) {
  std::vector<double> out(static_cast<size_t>(tokens * row));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < row; ++e) {
      out[static_cast<size_t>(t * row + e)] = packed[static_cast<size_t>((t * 3 + p) * row + e)];
    }
  }
  return out;
}

// TE's causal buckets [S, S] (on the host) and where they settle.
struct CausalBuckets {
  Tensor buckets;
  int64_t uniform_from = 0;
};
CausalBuckets MakeCausalBuckets(CpuOps& cpu, const Case& c) {
  std::vector<float> values(static_cast<size_t>(c.seq * c.seq));
  for (int64_t i = 0; i < c.seq; ++i) {
    for (int64_t j = 0; j < c.seq; ++j) {
      values[static_cast<size_t>(i * c.seq + j)] =
          static_cast<float>(CausalBucket(std::max<int64_t>(i - j, 0), c.num_buckets));
    }
  }
  CausalBuckets b;
  b.buckets = MakeTensor(cpu, DType::kI32, {c.seq, c.seq}, values);
  b.uniform_from = c.seq - 1;
  while (b.uniform_from > 1 && CausalBucket(b.uniform_from - 1, c.num_buckets) ==
                                   CausalBucket(c.seq - 1, c.num_buckets)) {
    --b.uniform_from;
  }
  return b;
}

// One case's inputs on the host, and the CPU's dense path on them.
struct Reference {
  Shape q_shape, kv_shape, lse_shape, table_shape;
  Tensor q, k, v, dout;
  CausalBuckets buckets;
  Tensor out, lse, dq, dk, dv, dtable;
};

// What the GPU gave: the forward, then two backwards (dtable from each).
struct GpuRun {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<double> dtable[2];
  int64_t heads_outer_forward = 0;  // cuDNN calls viewed heads outer, in the forward
};

void RelativeBandTest::Run(const Case& c, const Reference& ref, const AttentionArgs& gpu_args,
                           const RelativeBuckets& gpu_relative, GpuRun* run) {
  const Tensor gdout = ToGpu(ref.dout);
  Tensor gout = GpuNan(c.dtype, ref.q_shape);
  Tensor glse = GpuNan(DType::kF32, ref.lse_shape);
  const int64_t heads_outer_before = cuda::CudnnHeadsOuterCalls();
  if (c.packed) {
    const Shape qkv_shape = {c.batch, c.seq, 3, c.q_heads, c.head_dim};
    const Tensor gqkv = ToGpu(MakeTensor(cpu_, c.dtype, qkv_shape, Pack(ref.q, ref.k, ref.v)));
    ASSERT_TRUE(gpu_->AttentionForwardPacked(gpu_args, gqkv, &gout, &glse).ok());
    run->heads_outer_forward = cuda::CudnnHeadsOuterCalls() - heads_outer_before;
    for (auto& dtable : run->dtable) {
      Tensor gdqkv = GpuNan(c.dtype, qkv_shape);
      Tensor gdtable = GpuNan(DType::kF32, ref.table_shape);
      const absl::Status bwd = gpu_->AttentionBackwardPackedRelative(
          gpu_args, gqkv, gout, gdout, glse, gpu_relative, &gdqkv, &gdtable);
      ASSERT_TRUE(bwd.ok()) << bwd;
      const std::vector<double> all = FromGpu(gdqkv);
      const int64_t tokens = c.batch * c.seq, row = c.q_heads * c.head_dim;
      run->dq = Part(all, tokens, row, 0);
      run->dk = Part(all, tokens, row, 1);
      run->dv = Part(all, tokens, row, 2);
      dtable = FromGpu(gdtable);
    }
  } else {
    const Tensor gq = ToGpu(ref.q), gk = ToGpu(ref.k), gv = ToGpu(ref.v);
    ASSERT_TRUE(gpu_->AttentionForward(gpu_args, gq, gk, gv, &gout, &glse).ok());
    run->heads_outer_forward = cuda::CudnnHeadsOuterCalls() - heads_outer_before;
    for (auto& dtable : run->dtable) {
      Tensor gdq = GpuNan(c.dtype, ref.q_shape), gdk = GpuNan(c.dtype, ref.kv_shape),
             gdv = GpuNan(c.dtype, ref.kv_shape);
      Tensor gdtable = GpuNan(DType::kF32, ref.table_shape);
      const absl::Status bwd = gpu_->AttentionBackwardRelative(
          gpu_args, gq, gk, gv, gout, gdout, glse, gpu_relative, &gdq, &gdk, &gdv, &gdtable);
      ASSERT_TRUE(bwd.ok()) << bwd;
      run->dq = FromGpu(gdq);
      run->dk = FromGpu(gdk);
      run->dv = FromGpu(gdv);
      dtable = FromGpu(gdtable);
    }
  }
  run->out = FromGpu(gout);
  run->lse = FromGpu(glse);
}

// The case's random inputs (seeds from `seed`) and the CPU's results with
// `cpu_args` (its bias set by the caller, dense or by its table).
void RelativeBandTest::MakeReference(const Case& c, uint64_t seed, Reference* ref) {
  ref->q_shape = {c.batch, c.seq, c.q_heads, c.head_dim};
  ref->kv_shape = {c.batch, c.seq, c.kv_heads, c.head_dim};
  ref->lse_shape = {c.batch, c.q_heads, c.seq};
  ref->table_shape = {c.q_heads, c.num_buckets};  // TE's rel_embedding layout
  ref->q = MakeTensor(cpu_, c.dtype, ref->q_shape, RandomValues(NumElements(ref->q_shape), seed));
  ref->k = MakeTensor(cpu_, c.dtype, ref->kv_shape,
                      RandomValues(NumElements(ref->kv_shape), seed + 1, -1.0f, 3.0f));
  ref->v = MakeTensor(cpu_, c.dtype, ref->kv_shape,
                      RandomValues(NumElements(ref->kv_shape), seed + 2, -0.5f, 1.5f));
  ref->dout =
      MakeTensor(cpu_, c.dtype, ref->q_shape, RandomValues(NumElements(ref->q_shape), seed + 3));
  ref->buckets = MakeCausalBuckets(cpu_, c);
}

void RelativeBandTest::RunCpu(const Case& c, const AttentionArgs& cpu_args, Reference* ref) {
  ref->out = MakeEmpty(cpu_, c.dtype, ref->q_shape);
  ref->lse = MakeEmpty(cpu_, DType::kF32, ref->lse_shape);
  ASSERT_TRUE(cpu_.AttentionForward(cpu_args, ref->q, ref->k, ref->v, &ref->out, &ref->lse).ok());
  ref->dq = MakeEmpty(cpu_, c.dtype, ref->q_shape);
  ref->dk = MakeEmpty(cpu_, c.dtype, ref->kv_shape);
  ref->dv = MakeEmpty(cpu_, c.dtype, ref->kv_shape);
  ref->dtable = MakeEmpty(cpu_, DType::kF32, ref->table_shape);
  RelativeBuckets relative;
  relative.buckets = ref->buckets.buckets;
  relative.uniform_from = ref->buckets.uniform_from;
  const absl::Status bwd =
      cpu_.AttentionBackwardRelative(cpu_args, ref->q, ref->k, ref->v, ref->out, ref->dout,
                                     ref->lse, relative, &ref->dq, &ref->dk, &ref->dv, &ref->dtable);
  ASSERT_TRUE(bwd.ok()) << bwd;
}

// The GPU's gradients against the CPU's, and dtable's bits from run to run.
void ExpectGradientsMatch(const Case& c, const Reference& ref, const GpuRun& run) {
  const double tolerance = c.dtype == DType::kF16 ? kF16AttentionGradTolerance
                                                  : ::te::testing::Tolerance(c.dtype);
  EXPECT_LT(RelativeError(run.dq, ToDoubles(ref.dq)), tolerance) << "dq";
  EXPECT_LT(RelativeError(run.dk, ToDoubles(ref.dk)), tolerance) << "dk";
  EXPECT_LT(RelativeError(run.dv, ToDoubles(ref.dv)), tolerance) << "dv";
  const std::vector<double> cpu_dtable = ToDoubles(ref.dtable);
  EXPECT_LT(RelativeError(run.dtable[0], cpu_dtable), tolerance) << "dtable";
  EXPECT_EQ(run.dtable[0], run.dtable[1]) << "dtable differs between two runs";
  // The far bucket (formed as minus the band's sum) of head 0, alone: within
  // the tolerance of the whole table's norm.
  const size_t far = static_cast<size_t>(CausalBucket(c.seq - 1, c.num_buckets));
  const double norm = std::sqrt(
      std::inner_product(cpu_dtable.begin(), cpu_dtable.end(), cpu_dtable.begin(), 0.0));
  EXPECT_NE(cpu_dtable[far], 0.0);
  EXPECT_LT(std::abs(run.dtable[0][far] - cpu_dtable[far]), tolerance * norm)
      << "the far bucket, formed as minus the band";
}

// The bias made dense (args.bias, float32 or the operands' dtype): cuDNN's
// forward reads it; the backward splits (reading it on its last row) or,
// under GQA, runs cuDNN reading it and the band kernel for dtable.
TEST_P(RelativeBandTest, TableGradientMatchesTheDensePathOnTheCpu) {
  const Case& c = GetParam();
  Reference ref;
  MakeReference(c, 31, &ref);
  const Tensor table = MakeTensor(cpu_, DType::kF32, ref.table_shape,
                                  RandomValues(c.num_buckets * c.q_heads, 35));
  Tensor bias =
      MakeEmpty(cpu_, c.operand_bias ? c.dtype : DType::kF32, {c.q_heads, c.seq, c.seq});
  ASSERT_TRUE(cpu_.RelativeBiasForward(table, ref.buckets.buckets, Tensor(), &bias).ok());
  AttentionArgs cpu_args;
  cpu_args.mask = MaskType::kCausal;
  cpu_args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  cpu_args.bias = bias;
  RunCpu(c, cpu_args, &ref);
  if (HasFatalFailure()) return;

  AttentionArgs gpu_args = cpu_args;
  gpu_args.bias = ToGpu(bias);
  RelativeBuckets gpu_relative;
  gpu_relative.buckets = ToGpu(ref.buckets.buckets);
  gpu_relative.uniform_from = ref.buckets.uniform_from;
  const int64_t band_before = cuda::RelativeBandCalls();
  const int64_t split_before = cuda::RelativeSplitCalls();
  GpuRun run;
  Run(c, ref, gpu_args, gpu_relative, &run);
  if (HasFatalFailure()) return;
  EXPECT_EQ(cuda::RelativeBandCalls() - band_before, c.band ? 2 : 0)
      << (c.band ? "the band kernels did not serve the call" : "the band kernels ran");
  EXPECT_EQ(cuda::RelativeSplitCalls() - split_before, c.band && c.q_heads == c.kv_heads ? 2 : 0);
  // Without GQA the forward cuDNN served with the bias viewed the batch heads
  // outer (the bias read through L2 by the batch's rows at once).
  EXPECT_EQ(run.heads_outer_forward, c.band && c.q_heads == c.kv_heads ? 1 : 0);
  ExpectGradientsMatch(c, ref, run);
}

// The bias named by its table (AttentionArgs::relative_bias, as a layer
// passes it): the forward and the backward split into cuDNN's bias-free far
// part and the band kernels, against the CPU's dense path; nothing [H, S, S]
// is made. GQA's backward makes the bias and takes the dense path; a
// sequence not a multiple of 16 makes it in both directions.
TEST_P(RelativeBandTest, SplitByTheTableMatchesTheDensePathOnTheCpu) {
  const Case& c = GetParam();
  Reference ref;
  MakeReference(c, 41, &ref);
  // The table in the operands' dtype where the case says so (a bf16 parameter).
  const Tensor table = MakeTensor(cpu_, c.operand_bias ? c.dtype : DType::kF32, ref.table_shape,
                                  RandomValues(c.num_buckets * c.q_heads, 45, -2.0f, 2.0f));
  AttentionArgs cpu_args;
  cpu_args.mask = MaskType::kCausal;
  cpu_args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  cpu_args.relative_bias.table = table;
  cpu_args.relative_bias.buckets = ref.buckets.buckets;
  cpu_args.relative_bias.uniform_from = ref.buckets.uniform_from;
  RunCpu(c, cpu_args, &ref);
  if (HasFatalFailure()) return;

  AttentionArgs gpu_args = cpu_args;
  gpu_args.relative_bias.table = ToGpu(table);
  gpu_args.relative_bias.buckets = ToGpu(ref.buckets.buckets);
  RelativeBuckets gpu_relative;
  gpu_relative.buckets = gpu_args.relative_bias.buckets;
  gpu_relative.uniform_from = ref.buckets.uniform_from;
  const int64_t split_before = cuda::RelativeSplitCalls();
  GpuRun run;
  Run(c, ref, gpu_args, gpu_relative, &run);
  if (HasFatalFailure()) return;
  // The forward, and both backwards unless GQA keeps them on the dense path.
  EXPECT_EQ(cuda::RelativeSplitCalls() - split_before,
            c.band ? (c.q_heads == c.kv_heads ? 3 : 1) : 0);
  EXPECT_LT(RelativeError(run.out, ToDoubles(ref.out)), ::te::testing::Tolerance(c.dtype))
      << "out";
  EXPECT_LT(RelativeError(run.lse, ToDoubles(ref.lse)), 1e-3) << "lse";
  ExpectGradientsMatch(c, ref, run);
}

static_assert(cuda::kFoldGroups < 130, "the 130-head case takes the table's own kernel");

INSTANTIATE_TEST_SUITE_P(
    Band, RelativeBandTest,
    ::testing::Values(
        // The decoder LM's attention (16 heads of 64 at hidden 1024), smaller.
        Case{"bf16_packed_s256_d64", DType::kBF16, 2, 256, 4, 4, 64, true, true},
        Case{"bf16_packed_s320_d128", DType::kBF16, 1, 320, 2, 2, 128, true, true},
        Case{"f16_separate_gqa_s192_d32", DType::kF16, 2, 192, 4, 2, 32, false, true},
        // Shorter than the band: every key is in it, no far bucket.
        Case{"bf16_packed_s64_d64", DType::kBF16, 2, 64, 2, 2, 64, true, true},
        // cuDNN declines a bias at a length not a multiple of 64: the dense default.
        Case{"bf16_packed_s100_dense", DType::kBF16, 1, 100, 2, 2, 64, true, false},
        // The bias in the operands' dtype: in place on cuDNN, widened unfused.
        Case{"bf16_packed_s256_d64_bf16_bias", DType::kBF16, 2, 256, 4, 4, 64, true, true, true},
        Case{"f16_separate_gqa_s192_d32_f16_bias", DType::kF16, 2, 192, 4, 2, 32, false, true,
             true},
        Case{"bf16_packed_s100_dense_bf16_bias", DType::kBF16, 1, 100, 2, 2, 64, true, false,
             true},
        // A band wider than a block's warps (two offsets for the first warp),
        // and a last block of 64 queries.
        Case{"bf16_packed_s320_d64_64_buckets", DType::kBF16, 2, 320, 2, 2, 64, true, true, true,
             64},
        Case{"f16_separate_s192_d128_64_buckets", DType::kF16, 1, 192, 2, 2, 128, false, true,
             false, 64},
        // More work items (128 rows of one head and sequence) than the blocks
        // an H100 or H200 holds at once (264 at D 64, two an SM; 132 at D
        // 128): the split's persistent blocks walk several.
        Case{"bf16_packed_s512_d64_many_items", DType::kBF16, 8, 512, 16, 16, 64, true, true,
             true},
        Case{"f16_packed_s384_d128_many_items", DType::kF16, 2, 384, 24, 24, 128, true, true},
        // More heads than the stream's group counters: the table's own kernel
        // sums the blocks (kFoldGroups); below it the heads' last blocks do.
        Case{"bf16_packed_s128_d32_130_heads", DType::kBF16, 1, 128, 130, 130, 32, true, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

}  // namespace
}  // namespace te
