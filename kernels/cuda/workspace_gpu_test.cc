// The workspace sizing functions (workspace.h: GemmWorkspaceBytes,
// AttentionWorkspaceBytes) bound what the ops actually draw, and what they
// draw is charged to the stream's memory (session.h contract 3). Each case
// runs one op on a fresh CudaOps, whose Workspace block grows to exactly the
// largest request, so workspace_bytes() afterwards is the op's own draw.
// Values are left uninitialised: only sizes matter here.
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/workspace.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

// One device; each test makes its own stream (a fresh workspace).
class WorkspaceGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{16} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    owned_ = *std::move(ops);
    ops_ = dynamic_cast<cuda::CudaOps*>(owned_.get());
    ASSERT_NE(ops_, nullptr);
  }

  Tensor Make(DType dtype, const Shape& shape) {
    auto t = ops_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : Tensor();
  }

  // A scale_inv of 1 for an FP8 operand.
  Tensor One() {
    Tensor t = Make(DType::kF32, {1});
    const float one = 1.0f;
    EXPECT_TRUE(ops_->Upload(&one, &t).ok());
    return t;
  }

  // After `run`: the op drew at most `bound` bytes of workspace (and some,
  // where `expect_some`), and the block it holds is in bytes_in_use().
  void ExpectWithin(int64_t bound, bool expect_some, const std::function<absl::Status()>& run) {
    ASSERT_EQ(ops_->workspace_bytes(), 0u) << "each case wants a fresh stream";
    const int64_t before = ops_->bytes_in_use();
    const absl::Status status = run();
    ASSERT_TRUE(status.ok()) << status;
    ASSERT_TRUE(ops_->Synchronize().ok());
    const int64_t drawn = static_cast<int64_t>(ops_->workspace_bytes());
    EXPECT_LE(drawn, bound);
    if (expect_some) { EXPECT_GT(drawn, 0); }
    EXPECT_GE(ops_->bytes_in_use() - before, drawn) << "the workspace is not charged";
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> owned_;
  cuda::CudaOps* ops_ = nullptr;
};

// A call that failed gives back the workspace it grew (Session::EndCall):
// ShrinkScratch returns bytes_in_use() to what it was at that size, and never
// grows a smaller workspace.
TEST_F(WorkspaceGpuTest, ShrinkScratchReturnsTheGrowth) {
  ASSERT_TRUE(ops_->Workspace(1 << 20).ok());
  const int64_t small = ops_->bytes_in_use();
  EXPECT_EQ(ops_->scratch_bytes(), 1 << 20);
  ASSERT_TRUE(ops_->Workspace(64 << 20).ok());
  EXPECT_EQ(ops_->bytes_in_use(), small + (63 << 20));
  ASSERT_TRUE(ops_->ShrinkScratch(1 << 20).ok());
  EXPECT_EQ(ops_->scratch_bytes(), 1 << 20);
  EXPECT_EQ(ops_->bytes_in_use(), small);
  ASSERT_TRUE(ops_->ShrinkScratch(4 << 20).ok());
  EXPECT_EQ(ops_->scratch_bytes(), 1 << 20) << "ShrinkScratch grew the workspace";
  ASSERT_TRUE(ops_->ShrinkScratch(0).ok());
  EXPECT_EQ(ops_->scratch_bytes(), 0);
  EXPECT_EQ(ops_->bytes_in_use(), small - (1 << 20));
  ASSERT_TRUE(ops_->Synchronize().ok());
}

struct GemmShape {
  std::string name;
  DType a, b, out;
  int64_t m, n, k;
  bool transpose_a = false, transpose_b = false;
  bool bias = false;
};

class GemmWorkspaceTest : public WorkspaceGpuTest,
                          public ::testing::WithParamInterface<GemmShape> {};

TEST_P(GemmWorkspaceTest, DrawsNoMoreThanItsSizingFunction) {
  const GemmShape& c = GetParam();
  Ops::GemmArgs args;
  args.a = Make(c.a, c.transpose_a ? Shape{c.k, c.m} : Shape{c.m, c.k});
  args.transpose_a = c.transpose_a;
  args.b = Make(c.b, c.transpose_b ? Shape{c.n, c.k} : Shape{c.k, c.n});
  args.transpose_b = c.transpose_b;
  if (IsFloat8(c.a)) args.a_scale_inv = One();
  if (IsFloat8(c.b)) args.b_scale_inv = One();
  if (c.bias) args.bias = Make(c.out, {c.n});
  Tensor out = Make(c.out, {c.m, c.n});
  absl::StatusOr<int64_t> bound = cuda::GemmWorkspaceBytes(args, out);
  ASSERT_TRUE(bound.ok()) << bound.status();
  ExpectWithin(*bound, /*expect_some=*/true, [&] { return ops_->Gemm(args, &out); });
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmWorkspaceTest,
    ::testing::Values(
        GemmShape{"bf16_native", DType::kBF16, DType::kBF16, DType::kBF16, 256, 512, 128},
        GemmShape{"bf16_bias_nt", DType::kBF16, DType::kBF16, DType::kBF16, 384, 256, 1024, false,
                  true, true},
        GemmShape{"f32_tf32", DType::kF32, DType::kF32, DType::kF32, 128, 192, 256},
        GemmShape{"fp8_tn", DType::kE4M3, DType::kE4M3, DType::kBF16, 256, 256, 512, false, true},
        GemmShape{"fp8_copies_both", DType::kE4M3, DType::kE5M2, DType::kBF16, 128, 384, 256, true,
                  false},
        GemmShape{"fp8_into_f32", DType::kE4M3, DType::kE4M3, DType::kF32, 192, 128, 256, false,
                  true},
        GemmShape{"odd_f32_operands", DType::kBF16, DType::kF16, DType::kBF16, 33, 17, 7},
        GemmShape{"fp8_odd_k", DType::kE4M3, DType::kE4M3, DType::kBF16, 64, 64, 24, false, true}),
    [](const ::testing::TestParamInfo<GemmShape>& info) { return info.param.name; });

struct AttentionShapeCase {
  std::string name;
  int64_t b, sq, skv, hq, hk, d;
  MaskType mask = MaskType::kCausal;
  bool bias = false;
  float dropout = 0.0f;
};

class AttentionWorkspaceTest : public WorkspaceGpuTest,
                               public ::testing::WithParamInterface<AttentionShapeCase> {
 protected:
  void SetUp() override {
    WorkspaceGpuTest::SetUp();
    cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
  }

  struct Tensors {
    Tensor q, k, v, out, lse, dout, dq, dk, dv, dbias;
  };

  AttentionArgs Args(const AttentionShapeCase& c) {
    AttentionArgs args;
    args.mask = c.mask;
    args.scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    args.dropout_rate = c.dropout;
    args.dropout_seed = 7;
    if (c.bias) args.bias = Make(DType::kF32, {c.hq, c.sq, c.skv});
    if (c.mask == MaskType::kPadding || c.mask == MaskType::kPaddingCausal) {
      std::vector<int32_t> q_lengths(static_cast<size_t>(c.b)), kv_lengths(q_lengths.size());
      for (int64_t i = 0; i < c.b; ++i) {
        q_lengths[i] = static_cast<int32_t>(c.sq - i);
        kv_lengths[i] = static_cast<int32_t>(c.skv - 2 * i);
      }
      args.q_seqlens = Make(DType::kI32, {c.b});
      args.kv_seqlens = Make(DType::kI32, {c.b});
      EXPECT_TRUE(ops_->Upload(q_lengths.data(), &args.q_seqlens).ok());
      EXPECT_TRUE(ops_->Upload(kv_lengths.data(), &args.kv_seqlens).ok());
    }
    return args;
  }

  Tensors Make4(const AttentionShapeCase& c) {
    Tensors t;
    const Shape q_shape = {c.b, c.sq, c.hq, c.d}, kv_shape = {c.b, c.skv, c.hk, c.d};
    t.q = Make(DType::kBF16, q_shape);
    t.k = Make(DType::kBF16, kv_shape);
    t.v = Make(DType::kBF16, kv_shape);
    t.out = Make(DType::kBF16, q_shape);
    t.lse = Make(DType::kF32, {c.b, c.hq, c.sq});
    t.dout = Make(DType::kBF16, q_shape);
    t.dq = Make(DType::kBF16, q_shape);
    t.dk = Make(DType::kBF16, kv_shape);
    t.dv = Make(DType::kBF16, kv_shape);
    if (c.bias) t.dbias = Make(DType::kF32, {c.hq, c.sq, c.skv});
    return t;
  }
};

TEST_P(AttentionWorkspaceTest, ForwardDrawsNoMoreThanItsSizingFunction) {
  const AttentionShapeCase& c = GetParam();
  const AttentionArgs args = Args(c);
  Tensors t = Make4(c);
  absl::StatusOr<int64_t> bound =
      cuda::AttentionWorkspaceBytes(ops_, /*backward=*/false, args, t.q, t.k, t.v);
  ASSERT_TRUE(bound.ok()) << bound.status();
  const int64_t cudnn_before = cuda::CudnnAttentionCalls();
  ExpectWithin(*bound, /*expect_some=*/true,
               [&] { return ops_->AttentionForward(args, t.q, t.k, t.v, &t.out, &t.lse); });
  EXPECT_GT(cuda::CudnnAttentionCalls(), cudnn_before) << "cuDNN did not take the call";
}

TEST_P(AttentionWorkspaceTest, BackwardDrawsNoMoreThanItsSizingFunction) {
  const AttentionShapeCase& c = GetParam();
  const AttentionArgs args = Args(c);
  Tensors t = Make4(c);
  // The forward on another stream makes out and lse without touching this
  // stream's workspace; the backward is measured alone.
  {
    auto forward_ops = device_->NewOps(int64_t{16} << 30);
    ASSERT_TRUE(forward_ops.ok()) << forward_ops.status();
    ASSERT_TRUE((*forward_ops)->AttentionForward(args, t.q, t.k, t.v, &t.out, &t.lse).ok());
    ASSERT_TRUE((*forward_ops)->Synchronize().ok());
  }
  absl::StatusOr<int64_t> bound =
      cuda::AttentionWorkspaceBytes(ops_, /*backward=*/true, args, t.q, t.k, t.v);
  ASSERT_TRUE(bound.ok()) << bound.status();
  const int64_t cudnn_before = cuda::CudnnAttentionCalls();
  ExpectWithin(*bound, /*expect_some=*/true, [&] {
    return ops_->AttentionBackward(args, t.q, t.k, t.v, t.out, t.dout, t.lse, &t.dq, &t.dk, &t.dv,
                                   c.bias ? &t.dbias : nullptr);
  });
  EXPECT_GT(cuda::CudnnAttentionCalls(), cudnn_before) << "cuDNN did not take the call";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionWorkspaceTest,
    ::testing::Values(AttentionShapeCase{"causal", 2, 128, 128, 4, 4, 64},
                      AttentionShapeCase{"gqa_d128", 2, 256, 256, 8, 2, 128},
                      AttentionShapeCase{"padding", 3, 96, 80, 4, 4, 64, MaskType::kPadding},
                      AttentionShapeCase{"bias", 2, 128, 128, 4, 4, 64, MaskType::kNoMask, true},
                      AttentionShapeCase{"dropout", 2, 128, 128, 4, 4, 64, MaskType::kCausal, false,
                                         0.1f}),
    [](const ::testing::TestParamInfo<AttentionShapeCase>& info) { return info.param.name; });

}  // namespace
}  // namespace te
