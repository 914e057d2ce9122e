// CUDA attention against the CPU reference (kernels/cpu/attention.cc) on
// random data: forward (out, softmax_lse) and backward (dq, dk, dv, dbias), for
// every mask type, GQA, padding lengths, odd sequence lengths, f32 / f16 /
// bf16, post-scale bias with dbias, on both paths: cuDNN's fused SDPA and the
// unfused fallback (forced, and where cuDNN declines).
//
// Tolerances (DESIGN.md section 6, kernels/cpu/test_util.h): relative error
// ||gpu - cpu|| / ||cpu|| under 1e-5 for f32, 1e-3 for f16 and 1e-2 for bf16.
// cuDNN rounds the probabilities to the operand dtype before P @ V; that stays
// inside the bf16 bound. In the backward, P and dS are both rounded to the
// operand dtype before their matmuls: for f16 the gradients get two f16
// roundings, kF16AttentionGradTolerance (bf16's 1e-2 already covers 2.5 of
// its ulps). Seen on the H200: dq of a packed f16 case 1.025e-3.
//
// Dropout: the fallback draws kernels/rng.h's DropoutUniform, so it must match
// the CPU exactly (same elements dropped). cuDNN draws from its own Philox
// stream, which no CPU code reproduces: for it the test checks rate 0 against
// the CPU, and with rate 0.25 the fraction of dropped probabilities, the
// scaling of the kept ones, and that backward drops the same elements as
// forward (dv recomputed from the forward's mask).
//
// Small head_dim (D <= 32, no bias): the small-head kernels answer wherever
// the unfused path runs, and each case asserts through their call counter
// which unfused kernels ran. Their matrix: D 1, 4, 8, 16, 32 x f32 / bf16 x
// every mask x dropout 0 / 0.1, with odd and unequal sequence lengths (37,
// 130) and GQA groups of 1, 2 and 4 spread over it, plus a few long rows and
// the general fallback on the same kind of shapes.
//
// One query row per sequence (a decode step) on the decode kernel
// (attention_decode.cu), asserted through its call counter, against the CPU
// for every dtype, mask type, GQA and bias dtype it takes.
//
// The packed ops (qkv [B, S, 3, H, D] -> out; dqkv) against the CPU on the
// parts and against the GPU's own unpacked ops: cuDNN reading and writing the
// packed tensors in place where it takes them (asserted through the packed
// call counter), the split default where it declines (f32, a bias at seq 37,
// a misaligned qkv) or the unfused path is forced, and cuDNN's dropout with
// the same mask in both packed directions.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"

namespace te {
namespace {

using ::te::testing::RandomValues;
using ::te::testing::RelativeError;
using ::te::testing::Tolerance;

constexpr double kF16AttentionGradTolerance = 2e-3;

// kCudnn: cuDNN must take the call. kFallback: cuDNN switched off.
// kDeclined: cuDNN asked first, must decline (f32, bias with padding or a
// sequence not a multiple of 64), and the unfused path answers. kGeneral:
// cuDNN and the small-head kernels switched off (the general fallback).
// Where the unfused path runs, the small-head kernels must answer exactly
// when head_dim <= 32 and there is no bias.
enum class Path { kCudnn, kFallback, kDeclined, kGeneral };

struct Case {
  std::string name;
  Path path;
  DType dtype;
  int64_t batch, q_seq, kv_seq, q_heads, kv_heads, head_dim;
  MaskType mask;
  float dropout = 0.0f;
  bool bias = false;
  bool zero_kv_length = false;  // one batch with kv_seqlens = 0 (every row masked)
  // Small-head backward with dropout: no scratch for the dq pass's dropout
  // bits, so the dk/dv pass draws them itself.
  bool no_dropout_bits = false;
  // An arbitrary elementwise mask (AttentionArgs::elementwise_mask) on top
  // of the mask type: cuDNN and the small-head kernels decline it, the
  // general fallback computes it.
  bool elementwise = false;
  bool per_head = false;  // that mask one plane per query head: [B, Hq, Sq, Skv]
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class GpuAttentionTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{16} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    gpu_ = *std::move(ops);
  }
  void TearDown() override {
    cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
    if (saved_bits_limit_ >= 0) cuda::SetSmallHeadDropoutBitsLimit(saved_bits_limit_);
  }

  Tensor Host(DType dtype, const Shape& shape, const std::vector<float>& values) {
    return ::te::testing::MakeTensor(cpu_, dtype, shape, values);
  }
  Tensor ToGpu(const Tensor& host) {
    auto t = gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(gpu_->Upload(host.data(), &*t).ok());
    return *t;
  }
  Tensor GpuEmpty(DType dtype, const Shape& shape) {
    auto t = gpu_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    // Poison: every element the op must write starts as NaN.
    if (IsFloating(dtype)) {
      EXPECT_TRUE(gpu_->Fill(NAN, &*t).ok());
    }
    return *t;
  }
  std::vector<double> FromGpu(const Tensor& t) {
    Tensor host = ::te::testing::MakeEmpty(cpu_, t.dtype(), t.shape());
    const absl::Status s = gpu_->Download(t, host.data());
    EXPECT_TRUE(s.ok()) << s;
    return ::te::testing::ToDoubles(host);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
  int64_t saved_bits_limit_ = -1;
};

// lse: equal infinities, relative error over the finite entries.
void ExpectLseNear(const std::vector<double>& gpu, const Tensor& cpu_lse, double tolerance) {
  const std::vector<double> cpu = ::te::testing::ToDoubles(cpu_lse);
  std::vector<double> gpu_finite, cpu_finite;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isinf(cpu[i])) {
      EXPECT_TRUE(std::isinf(gpu[i]) && gpu[i] > 0) << "lse row " << i << " = " << gpu[i];
      continue;
    }
    gpu_finite.push_back(gpu[i]);
    cpu_finite.push_back(cpu[i]);
  }
  EXPECT_LT(RelativeError(gpu_finite, cpu_finite), tolerance);
}

TEST_P(GpuAttentionTest, ForwardAndBackwardMatchCpu) {
  const Case& c = GetParam();
  cuda::SetAttentionPath(c.path == Path::kFallback  ? cuda::AttentionPath::kFallbackOnly
                         : c.path == Path::kGeneral ? cuda::AttentionPath::kGeneralFallbackOnly
                                                    : cuda::AttentionPath::kAuto);
  if (c.no_dropout_bits) saved_bits_limit_ = cuda::SetSmallHeadDropoutBitsLimit(0);
  const Shape q_shape = {c.batch, c.q_seq, c.q_heads, c.head_dim};
  const Shape kv_shape = {c.batch, c.kv_seq, c.kv_heads, c.head_dim};
  const Shape lse_shape = {c.batch, c.q_heads, c.q_seq};
  const Tensor q = Host(c.dtype, q_shape, RandomValues(NumElements(q_shape), 1));
  const Tensor k = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 2));
  const Tensor v = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 3));
  const Tensor dout = Host(c.dtype, q_shape, RandomValues(NumElements(q_shape), 4));

  AttentionArgs cpu_args;
  cpu_args.mask = c.mask;
  cpu_args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  cpu_args.dropout_rate = c.dropout;
  cpu_args.dropout_seed = 0x5eed;
  if (c.bias) {
    cpu_args.bias = Host(DType::kF32, {c.q_heads, c.q_seq, c.kv_seq},
                         RandomValues(c.q_heads * c.q_seq * c.kv_seq, 5, -1.0f, 1.0f));
  }
  if (IsPaddingMask(c.mask)) {
    std::vector<float> q_lens, kv_lens;
    for (int64_t b = 0; b < c.batch; ++b) {
      q_lens.push_back(static_cast<float>(c.q_seq - (b * 37) % (c.q_seq / 2 + 1)));
      kv_lens.push_back(static_cast<float>(c.kv_seq - (b * 53) % (c.kv_seq / 2 + 1)));
    }
    if (c.zero_kv_length) kv_lens.back() = 0.0f;
    cpu_args.q_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
    cpu_args.kv_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
    for (int64_t b = 0; b < c.batch; ++b) {
      cpu_args.q_seqlens.data_as<int32_t>()[b] = static_cast<int32_t>(q_lens[b]);
      cpu_args.kv_seqlens.data_as<int32_t>()[b] = static_cast<int32_t>(kv_lens[b]);
    }
  }
  if (c.elementwise) {
    // About 40% masked at random; batch 0's (head 0's) query 1 sees nothing.
    const Shape mask_shape = c.per_head ? Shape{c.batch, c.q_heads, c.q_seq, c.kv_seq}
                                        : Shape{c.batch, c.q_seq, c.kv_seq};
    const int64_t count = NumElements(mask_shape);
    cpu_args.elementwise_mask = ::te::testing::MakeEmpty(cpu_, DType::kBool, mask_shape);
    const std::vector<float> u = RandomValues(count, 6, 0.0f, 1.0f);
    for (int64_t n = 0; n < count; ++n) {
      cpu_args.elementwise_mask.data_as<bool>()[n] = u[n] < 0.4f || n / c.kv_seq == 1;
    }
  }
  AttentionArgs gpu_args = cpu_args;
  if (c.bias) gpu_args.bias = ToGpu(cpu_args.bias);
  if (cpu_args.q_seqlens.data() != nullptr) {
    gpu_args.q_seqlens = ToGpu(cpu_args.q_seqlens);
    gpu_args.kv_seqlens = ToGpu(cpu_args.kv_seqlens);
  }
  if (c.elementwise) gpu_args.elementwise_mask = ToGpu(cpu_args.elementwise_mask);

  // Forward.
  Tensor cpu_out = ::te::testing::MakeEmpty(cpu_, c.dtype, q_shape);
  Tensor cpu_lse = ::te::testing::MakeEmpty(cpu_, DType::kF32, lse_shape);
  ASSERT_TRUE(cpu_.AttentionForward(cpu_args, q, k, v, &cpu_out, &cpu_lse).ok());
  const Tensor gq = ToGpu(q), gk = ToGpu(k), gv = ToGpu(v), gdout = ToGpu(dout);
  Tensor gout = GpuEmpty(c.dtype, q_shape);
  Tensor glse = GpuEmpty(DType::kF32, lse_shape);
  const int64_t cudnn_calls_before = cuda::CudnnAttentionCalls();
  const int64_t heads_outer_before = cuda::CudnnHeadsOuterCalls();
  const int64_t small_head_calls_before = cuda::SmallHeadAttentionCalls();
  const absl::Status fwd = gpu_->AttentionForward(gpu_args, gq, gk, gv, &gout, &glse);
  ASSERT_TRUE(fwd.ok()) << fwd;
  // A bias shared by the batch, without lengths, dropout or GQA, runs on
  // heads-outer views; the backward writes dBias here, so it keeps the plain ones.
  const bool heads_outer = c.path == Path::kCudnn && c.bias && !IsPaddingMask(c.mask) &&
                           c.dropout == 0.0f && c.q_heads == c.kv_heads;
  EXPECT_EQ(cuda::CudnnHeadsOuterCalls() - heads_outer_before, heads_outer ? 1 : 0)
      << "heads-outer views";
  const double tolerance = Tolerance(c.dtype);
  EXPECT_LT(RelativeError(FromGpu(gout), ::te::testing::ToDoubles(cpu_out)), tolerance) << "out";
  ExpectLseNear(FromGpu(glse), cpu_lse, tolerance);

  // Backward, each side from its own forward.
  Tensor cdq = ::te::testing::MakeEmpty(cpu_, c.dtype, q_shape);
  Tensor cdk = ::te::testing::MakeEmpty(cpu_, c.dtype, kv_shape);
  Tensor cdv = ::te::testing::MakeEmpty(cpu_, c.dtype, kv_shape);
  Tensor cdbias, gdbias;
  if (c.bias) {
    cdbias = ::te::testing::MakeEmpty(cpu_, DType::kF32, {c.q_heads, c.q_seq, c.kv_seq});
    gdbias = GpuEmpty(DType::kF32, {c.q_heads, c.q_seq, c.kv_seq});
  }
  ASSERT_TRUE(cpu_.AttentionBackward(cpu_args, q, k, v, cpu_out, dout, cpu_lse, &cdq, &cdk, &cdv,
                                     c.bias ? &cdbias : nullptr)
                  .ok());
  Tensor gdq = GpuEmpty(c.dtype, q_shape);
  Tensor gdk = GpuEmpty(c.dtype, kv_shape);
  Tensor gdv = GpuEmpty(c.dtype, kv_shape);
  const absl::Status bwd = gpu_->AttentionBackward(gpu_args, gq, gk, gv, gout, gdout, glse, &gdq,
                                                   &gdk, &gdv, c.bias ? &gdbias : nullptr);
  ASSERT_TRUE(bwd.ok()) << bwd;
  EXPECT_LT(RelativeError(FromGpu(gdq), ::te::testing::ToDoubles(cdq)), tolerance) << "dq";
  EXPECT_LT(RelativeError(FromGpu(gdk), ::te::testing::ToDoubles(cdk)), tolerance) << "dk";
  EXPECT_LT(RelativeError(FromGpu(gdv), ::te::testing::ToDoubles(cdv)), tolerance) << "dv";
  if (c.bias) {
    EXPECT_LT(RelativeError(FromGpu(gdbias), ::te::testing::ToDoubles(cdbias)), tolerance)
        << "dbias";
  }
  const int64_t cudnn_calls = cuda::CudnnAttentionCalls() - cudnn_calls_before;
  EXPECT_EQ(cudnn_calls, c.path == Path::kCudnn ? 2 : 0)
      << "the test meant the " << (c.path == Path::kCudnn ? "cuDNN" : "unfused") << " path";
  const bool small_head = (c.path == Path::kFallback || c.path == Path::kDeclined) &&
                          c.head_dim <= cuda::kSmallHeadMaxHeadDim && !c.bias && !c.elementwise &&
                          !IsBottomRightMask(c.mask);
  EXPECT_EQ(cuda::SmallHeadAttentionCalls() - small_head_calls_before, small_head ? 2 : 0)
      << "the test meant the " << (small_head ? "small-head" : "general") << " unfused kernels";
}

// Odd sizes on purpose: sequence lengths not multiples of 64, head_dim above
// the 128 threads of a block (two values per thread), GQA groups of 2 and 4.
INSTANTIATE_TEST_SUITE_P(
    Fallback, GpuAttentionTest,
    ::testing::Values(
        Case{"f32_nomask", Path::kFallback, DType::kF32, 2, 33, 47, 4, 2, 24, MaskType::kNoMask},
        Case{"f32_causal_bias", Path::kFallback, DType::kF32, 2, 40, 40, 2, 2, 16,
             MaskType::kCausal, 0.0f, true},
        Case{"f32_padding_dropout", Path::kFallback, DType::kF32, 3, 29, 70, 4, 1, 32,
             MaskType::kPadding, 0.2f, false, true},
        Case{"f32_padding_causal_bias_dropout", Path::kFallback, DType::kF32, 2, 45, 45, 4, 2,
             8, MaskType::kPaddingCausal, 0.1f, true},
        Case{"bf16_causal_gqa_dropout", Path::kFallback, DType::kBF16, 2, 100, 100, 8, 2, 64,
             MaskType::kCausal, 0.1f},
        Case{"f16_padding_causal", Path::kFallback, DType::kF16, 2, 77, 77, 4, 4, 160,
             MaskType::kPaddingCausal},
        // Shapes the small-head kernels would take, on the general fallback.
        Case{"general_f32_nomask", Path::kGeneral, DType::kF32, 2, 33, 47, 4, 2, 24,
             MaskType::kNoMask},
        Case{"general_f32_padding_dropout", Path::kGeneral, DType::kF32, 3, 29, 70, 4, 1, 32,
             MaskType::kPadding, 0.2f, false, true},
        Case{"general_bf16_causal_dropout_d4", Path::kGeneral, DType::kBF16, 2, 37, 37, 4, 4, 4,
             MaskType::kCausal, 0.1f}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

const char* MaskLabel(MaskType mask) {
  switch (mask) {
    case MaskType::kNoMask: return "nomask";
    case MaskType::kCausal: return "causal";
    case MaskType::kPadding: return "padding";
    case MaskType::kPaddingCausal: return "padding_causal";
    case MaskType::kCausalBottomRight: return "causal_bottom_right";
    case MaskType::kPaddingCausalBottomRight: return "padding_causal_bottom_right";
  }
  return "mask";
}

// The small-head matrix. f32 goes through the automatic dispatch (cuDNN
// declines f32, so the small-head kernels must answer); bf16 with cuDNN
// switched off, since cuDNN takes some bf16 shapes (D 8, 16, 32) itself.
std::vector<Case> SmallHeadCases() {
  struct Geometry {
    int64_t batch, q_seq, kv_seq, q_heads, kv_heads;
  };
  // Odd lengths across the 128-row blocks and 64-key tiles, cross attention
  // both ways (causal then has rows that see every key, or keys no row sees),
  // GQA groups of 1, 2 and 4.
  const Geometry geometries[] = {
      {2, 37, 37, 4, 4}, {2, 130, 130, 4, 2}, {3, 37, 130, 4, 1}, {2, 130, 37, 6, 3}};
  std::vector<Case> cases;
  int n = 0;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t dim : {1, 4, 8, 16, 32}) {
      for (MaskType mask :
           {MaskType::kNoMask, MaskType::kCausal, MaskType::kPadding, MaskType::kPaddingCausal}) {
        for (float dropout : {0.0f, 0.1f}) {
          const Geometry& g = geometries[n++ % 4];
          Case c;
          c.name = std::string(DTypeName(dtype)) + "_d" + std::to_string(dim) + "_" +
                   MaskLabel(mask) + (dropout > 0.0f ? "_dropout" : "") + "_s" +
                   std::to_string(g.q_seq) + "x" + std::to_string(g.kv_seq) + "_h" +
                   std::to_string(g.q_heads) + "kv" + std::to_string(g.kv_heads);
          c.path = dtype == DType::kF32 ? Path::kDeclined : Path::kFallback;
          c.dtype = dtype;
          c.batch = g.batch;
          c.q_seq = g.q_seq;
          c.kv_seq = g.kv_seq;
          c.q_heads = g.q_heads;
          c.kv_heads = g.kv_heads;
          c.head_dim = dim;
          c.mask = mask;
          c.dropout = dropout;
          cases.push_back(c);
        }
      }
    }
  }
  // Long rows: many tiles, the causal block order, the quickstart's D 4
  // with dropout 0.1; f16; a batch whose every key is padded away.
  cases.push_back(Case{"f32_d4_causal_dropout_s2048", Path::kDeclined, DType::kF32, 1, 2048,
                       2048, 2, 2, 4, MaskType::kCausal, 0.1f});
  cases.push_back(Case{"bf16_d32_padding_causal_dropout_s600", Path::kFallback, DType::kBF16, 2,
                       600, 600, 2, 1, 32, MaskType::kPaddingCausal, 0.1f});
  cases.push_back(Case{"f16_d8_causal_dropout_s130", Path::kFallback, DType::kF16, 2, 130, 130,
                       4, 2, 8, MaskType::kCausal, 0.1f});
  cases.push_back(Case{"f16_d24_padding", Path::kFallback, DType::kF16, 2, 37, 70, 4, 4, 24,
                       MaskType::kPadding});
  cases.push_back(Case{"f32_d8_padding_zero_kv_length", Path::kDeclined, DType::kF32, 3, 37, 37,
                       4, 2, 8, MaskType::kPadding, 0.1f, false, true});
  cases.push_back(Case{"f32_d12_padding_causal_zero_kv_length", Path::kDeclined, DType::kF32, 2,
                       130, 130, 2, 2, 12, MaskType::kPaddingCausal, 0.0f, false, true});
  // The dk/dv pass drawing its own dropout bits (no scratch for the dq pass's).
  cases.push_back(Case{"f32_d4_causal_dropout_s130_no_dropout_bits", Path::kDeclined,
                       DType::kF32, 2, 130, 130, 4, 2, 4, MaskType::kCausal, 0.1f, false, false,
                       true});
  cases.push_back(Case{"f32_d8_nomask_dropout_s37x130_no_dropout_bits", Path::kDeclined,
                       DType::kF32, 2, 37, 130, 4, 4, 8, MaskType::kNoMask, 0.1f, false, false,
                       true});
  cases.push_back(Case{"bf16_d32_padding_causal_dropout_s130_no_dropout_bits", Path::kFallback,
                       DType::kBF16, 3, 130, 130, 4, 1, 32, MaskType::kPaddingCausal, 0.2f, false,
                       true, true});
  return cases;
}

// An arbitrary elementwise mask (TE's unfused softmax applies any mask it is
// given) under every mask type, with bias, dropout and GQA: cuDNN declines
// it (no cuDNN call), and so do the small-head kernels at head_dim <= 32;
// the general fallback matches the CPU reference.
std::vector<Case> ElementwiseCases() {
  std::vector<Case> cases;
  for (MaskType mask : {MaskType::kNoMask, MaskType::kPadding, MaskType::kCausal,
                        MaskType::kPaddingCausal}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      Case c{"elementwise_", Path::kDeclined, dtype, 2, 37, 45, 4, 2, 64, mask};
      c.name += std::string(mask == MaskType::kNoMask      ? "nomask"
                            : mask == MaskType::kPadding   ? "padding"
                            : mask == MaskType::kCausal    ? "causal"
                                                           : "paddingcausal") +
                (dtype == DType::kF32 ? "_f32" : "_bf16");
      c.elementwise = true;
      cases.push_back(c);
    }
  }
  Case bias{"elementwise_bias_dropout_f32", Path::kDeclined, DType::kF32, 2, 33, 33, 4, 4, 32,
            MaskType::kPaddingCausal, 0.2f, true};
  bias.elementwise = true;
  cases.push_back(bias);
  Case small{"elementwise_smallhead_d4_f32", Path::kDeclined, DType::kF32, 2, 40, 40, 4, 4, 4,
             MaskType::kCausal, 0.1f};
  small.elementwise = true;
  cases.push_back(small);
  return cases;
}

// Bottom-right causal masks (TE's causal_bottom_right and
// padding_causal_bottom_right): the general fallback where the diagonal is
// not top-left (cross attention both ways, per-batch lengths), with GQA,
// bias, dropout and a per-head elementwise mask, small heads included (the
// small-head kernels decline them); cuDNN's causal graph where Sq == Skv and
// no lengths move the diagonal. Per-head elementwise masks under the other
// types too.
std::vector<Case> BottomRightAndPerHeadCases() {
  std::vector<Case> cases = {
      {"bottom_right_cross_bf16", Path::kDeclined, DType::kBF16, 2, 37, 45, 4, 2, 64,
       MaskType::kCausalBottomRight},
      {"bottom_right_fewer_keys_f32_dropout", Path::kDeclined, DType::kF32, 2, 45, 37, 4, 4, 64,
       MaskType::kCausalBottomRight, 0.1f},
      {"bottom_right_smallhead_d8_f32", Path::kDeclined, DType::kF32, 2, 40, 70, 4, 4, 8,
       MaskType::kCausalBottomRight, 0.1f},
      {"padding_bottom_right_bf16", Path::kDeclined, DType::kBF16, 3, 37, 45, 4, 2, 64,
       MaskType::kPaddingCausalBottomRight},
      {"padding_bottom_right_bias_dropout_f32", Path::kDeclined, DType::kF32, 2, 45, 37, 4, 4,
       32, MaskType::kPaddingCausalBottomRight, 0.2f, true},
      {"padding_bottom_right_square_bf16", Path::kDeclined, DType::kBF16, 2, 128, 128, 4, 4, 64,
       MaskType::kPaddingCausalBottomRight},
      {"cudnn_bottom_right_square_bf16", Path::kCudnn, DType::kBF16, 2, 128, 128, 8, 2, 64,
       MaskType::kCausalBottomRight},
  };
  Case per_head{"per_head_padding_bottom_right_f32", Path::kDeclined, DType::kF32, 2, 33, 41, 4,
                2, 64, MaskType::kPaddingCausalBottomRight, 0.1f};
  per_head.elementwise = per_head.per_head = true;
  cases.push_back(per_head);
  for (MaskType mask : {MaskType::kNoMask, MaskType::kPadding, MaskType::kPaddingCausal}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      Case c{std::string("per_head_") + MaskLabel(mask) + (dtype == DType::kF32 ? "_f32" : "_bf16"),
             Path::kDeclined, dtype, 2, 37, 45, 4, 2, 64, mask};
      c.elementwise = c.per_head = true;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(BottomRightAndPerHead, GpuAttentionTest,
                         ::testing::ValuesIn(BottomRightAndPerHeadCases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(Elementwise, GpuAttentionTest, ::testing::ValuesIn(ElementwiseCases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

INSTANTIATE_TEST_SUITE_P(SmallHead, GpuAttentionTest, ::testing::ValuesIn(SmallHeadCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

INSTANTIATE_TEST_SUITE_P(
    Cudnn, GpuAttentionTest,
    ::testing::Values(
        Case{"bf16_nomask", Path::kCudnn, DType::kBF16, 2, 128, 128, 4, 4, 64, MaskType::kNoMask},
        Case{"bf16_causal_gqa", Path::kCudnn, DType::kBF16, 2, 256, 256, 8, 2, 128,
             MaskType::kCausal},
        Case{"bf16_causal_odd_seq", Path::kCudnn, DType::kBF16, 2, 200, 200, 4, 4, 64,
             MaskType::kCausal},
        Case{"bf16_padding", Path::kCudnn, DType::kBF16, 3, 192, 160, 4, 4, 64,
             MaskType::kPadding},
        Case{"bf16_padding_causal_gqa", Path::kCudnn, DType::kBF16, 2, 130, 130, 8, 4, 128,
             MaskType::kPaddingCausal},
        Case{"f16_nomask_cross", Path::kCudnn, DType::kF16, 1, 96, 160, 2, 1, 64,
             MaskType::kNoMask},
        Case{"bf16_dropout_rate0", Path::kCudnn, DType::kBF16, 2, 128, 128, 4, 4, 64,
             MaskType::kCausal, 0.0f},
        // Post-scale bias (T5 relative position bias) with dbias.
        Case{"bf16_causal_bias", Path::kCudnn, DType::kBF16, 2, 128, 128, 4, 4, 64,
             MaskType::kCausal, 0.0f, true},
        Case{"bf16_nomask_bias_gqa", Path::kCudnn, DType::kBF16, 2, 192, 192, 8, 2, 128,
             MaskType::kNoMask, 0.0f, true},
        // cuDNN declines these; the fallback answers.
        Case{"declined_f32_causal", Path::kDeclined, DType::kF32, 2, 64, 64, 4, 2, 64,
             MaskType::kCausal},
        Case{"declined_bf16_padding_bias", Path::kDeclined, DType::kBF16, 2, 64, 80, 4, 4, 64,
             MaskType::kPadding, 0.0f, true},
        // A bias at a sequence not a multiple of 64 (layer tests at 37 were off).
        Case{"declined_bf16_causal_bias_seq37", Path::kDeclined, DType::kBF16, 2, 37, 37, 4, 4, 24,
             MaskType::kCausal, 0.0f, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// A forward that no backward reads (AttentionArgs::forward_only: a decode
// step) takes a bias with a padding mask, at generation's shapes: one new
// token over a cache of 192 rows of which each sequence sees its own count
// (the decode kernel), and a prompt of 128 over the same cache, padding and
// causal (cuDNN). An odd cache length must still answer right.
enum class ForwardOnlyPath { kCudnn, kDecode };
struct ForwardOnlyShape {
  int64_t q_seq, kv_seq;
  MaskType mask;
  ForwardOnlyPath path;
};

class GpuAttentionForwardOnlyTest : public GpuAttentionTest {};

TEST_F(GpuAttentionForwardOnlyTest, BiasWithPaddingRunsOnCudnnAndMatchesCpu) {
  for (const ForwardOnlyShape& c :
       {ForwardOnlyShape{1, 192, MaskType::kPadding, ForwardOnlyPath::kDecode},
        ForwardOnlyShape{128, 192, MaskType::kPaddingCausal, ForwardOnlyPath::kCudnn},
        ForwardOnlyShape{1, 191, MaskType::kPadding, ForwardOnlyPath::kDecode}}) {
    SCOPED_TRACE(::testing::Message() << "q " << c.q_seq << " kv " << c.kv_seq);
    const int64_t batch = 2, heads = 16, head_dim = 64;
    const Shape q_shape = {batch, c.q_seq, heads, head_dim};
    const Shape kv_shape = {batch, c.kv_seq, heads, head_dim};
    const Shape lse_shape = {batch, heads, c.q_seq};
    const Tensor q = Host(DType::kBF16, q_shape, RandomValues(NumElements(q_shape), 11));
    const Tensor k = Host(DType::kBF16, kv_shape, RandomValues(NumElements(kv_shape), 12));
    const Tensor v = Host(DType::kBF16, kv_shape, RandomValues(NumElements(kv_shape), 13));
    AttentionArgs cpu_args;
    cpu_args.mask = c.mask;
    cpu_args.scale = 0.125f;
    cpu_args.forward_only = true;
    cpu_args.bias = Host(DType::kF32, {heads, c.q_seq, c.kv_seq},
                         RandomValues(heads * c.q_seq * c.kv_seq, 14, -1.0f, 1.0f));
    cpu_args.q_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {batch});
    cpu_args.kv_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {batch});
    const int32_t kv_lens[2] = {static_cast<int32_t>(c.q_seq == 1 ? 150 : c.q_seq), 
                                static_cast<int32_t>(c.q_seq == 1 ? 7 : c.q_seq)};
    for (int64_t b = 0; b < batch; ++b) {
      cpu_args.q_seqlens.data_as<int32_t>()[b] = static_cast<int32_t>(c.q_seq);
      cpu_args.kv_seqlens.data_as<int32_t>()[b] = kv_lens[b];
    }
    Tensor cpu_out = ::te::testing::MakeEmpty(cpu_, DType::kBF16, q_shape);
    Tensor cpu_lse = ::te::testing::MakeEmpty(cpu_, DType::kF32, lse_shape);
    ASSERT_TRUE(cpu_.AttentionForward(cpu_args, q, k, v, &cpu_out, &cpu_lse).ok());
    AttentionArgs gpu_args = cpu_args;
    gpu_args.bias = ToGpu(cpu_args.bias);
    gpu_args.q_seqlens = ToGpu(cpu_args.q_seqlens);
    gpu_args.kv_seqlens = ToGpu(cpu_args.kv_seqlens);
    Tensor gout = GpuEmpty(DType::kBF16, q_shape);
    Tensor glse = GpuEmpty(DType::kF32, lse_shape);
    const int64_t cudnn_before = cuda::CudnnAttentionCalls();
    const int64_t decode_before = cuda::DecodeAttentionCalls();
    ASSERT_TRUE(gpu_->AttentionForward(gpu_args, ToGpu(q), ToGpu(k), ToGpu(v), &gout, &glse).ok());
    const bool decode = c.path == ForwardOnlyPath::kDecode;
    EXPECT_EQ(cuda::CudnnAttentionCalls() - cudnn_before, decode ? 0 : 1) << "cuDNN";
    EXPECT_EQ(cuda::DecodeAttentionCalls() - decode_before, decode ? 1 : 0) << "decode kernel";
    EXPECT_LT(RelativeError(FromGpu(gout), ::te::testing::ToDoubles(cpu_out)),
              Tolerance(DType::kBF16)) << "out";
    ExpectLseNear(FromGpu(glse), cpu_lse, Tolerance(DType::kBF16));
  }
}

// The decode kernel (one query row per sequence) against the CPU, over what a
// decode step can bring: every float dtype, GQA groups of 1, 2 and 4,
// head_dim 32 to 128, caches of odd lengths with per-sequence lengths (one
// of them 0, and one sequence whose query row is padding), a bias in float32
// or the operands' dtype, and each mask type a single row can meet (top-left
// causal: the row sees key 0 alone). Cases the kernel must decline (head_dim
// other than 32, 64, 128) go elsewhere and still match.
struct DecodeRowCase {
  std::string name;
  DType dtype;
  int64_t batch, kv_seq, q_heads, kv_heads, head_dim;
  MaskType mask;
  DType bias;  // kI32: none
};

TEST_F(GpuAttentionForwardOnlyTest, DecodeRowsMatchCpu) {
  const DType kNone = DType::kI32;
  const DecodeRowCase cases[] = {
      {"bf16_padding_bias", DType::kBF16, 8, 384, 16, 16, 64, MaskType::kPadding, DType::kBF16},
      {"bf16_padding_f32_bias_gqa4", DType::kBF16, 3, 200, 8, 2, 128, MaskType::kPadding,
       DType::kF32},
      {"f16_nomask_gqa2", DType::kF16, 2, 77, 4, 2, 64, MaskType::kNoMask, kNone},
      {"f32_padding_causal_bottom_right", DType::kF32, 3, 130, 4, 4, 32,
       MaskType::kPaddingCausalBottomRight, DType::kF32},
      {"bf16_causal_top_left", DType::kBF16, 2, 50, 4, 4, 64, MaskType::kCausal, kNone},
      {"f16_padding_causal_d32", DType::kF16, 2, 33, 2, 1, 32, MaskType::kPaddingCausal,
       DType::kF16},
      {"declined_f16_padding_causal_d40", DType::kF16, 2, 33, 2, 1, 40,
       MaskType::kPaddingCausal, DType::kF16},
      {"bf16_long_cache", DType::kBF16, 1, 4000, 16, 16, 64, MaskType::kPadding, DType::kBF16},
      {"declined_d36", DType::kBF16, 2, 64, 4, 4, 36, MaskType::kNoMask, kNone},
  };
  for (const DecodeRowCase& c : cases) {
    SCOPED_TRACE(c.name);
    const Shape q_shape = {c.batch, 1, c.q_heads, c.head_dim};
    const Shape kv_shape = {c.batch, c.kv_seq, c.kv_heads, c.head_dim};
    const Shape lse_shape = {c.batch, c.q_heads, 1};
    const Tensor q = Host(c.dtype, q_shape, RandomValues(NumElements(q_shape), 21));
    const Tensor k = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 22));
    const Tensor v = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 23));
    AttentionArgs cpu_args;
    cpu_args.mask = c.mask;
    cpu_args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    cpu_args.forward_only = true;
    if (c.bias != kNone) {
      cpu_args.bias = Host(c.bias, {c.q_heads, 1, c.kv_seq},
                           RandomValues(c.q_heads * c.kv_seq, 24, -2.0f, 2.0f));
    }
    if (IsPaddingMask(c.mask)) {
      cpu_args.q_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      cpu_args.kv_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) {
        // Sequence 1 (where there is one) sees no key; the last one's query
        // row is padding; the others see their own share of the cache.
        const int64_t kv_len = b == 1 ? 0 : c.kv_seq - (b * 29) % (c.kv_seq / 2 + 1);
        cpu_args.kv_seqlens.data_as<int32_t>()[b] = static_cast<int32_t>(kv_len);
        cpu_args.q_seqlens.data_as<int32_t>()[b] = b == c.batch - 1 && c.batch > 2 ? 0 : 1;
      }
    }
    Tensor cpu_out = ::te::testing::MakeEmpty(cpu_, c.dtype, q_shape);
    Tensor cpu_lse = ::te::testing::MakeEmpty(cpu_, DType::kF32, lse_shape);
    ASSERT_TRUE(cpu_.AttentionForward(cpu_args, q, k, v, &cpu_out, &cpu_lse).ok());
    AttentionArgs gpu_args = cpu_args;
    if (c.bias != kNone) gpu_args.bias = ToGpu(cpu_args.bias);
    if (IsPaddingMask(c.mask)) {
      gpu_args.q_seqlens = ToGpu(cpu_args.q_seqlens);
      gpu_args.kv_seqlens = ToGpu(cpu_args.kv_seqlens);
    }
    Tensor gout = GpuEmpty(c.dtype, q_shape);
    Tensor glse = GpuEmpty(DType::kF32, lse_shape);
    const int64_t decode_before = cuda::DecodeAttentionCalls();
    const absl::Status fwd =
        gpu_->AttentionForward(gpu_args, ToGpu(q), ToGpu(k), ToGpu(v), &gout, &glse);
    ASSERT_TRUE(fwd.ok()) << fwd;
    const bool specialised = c.head_dim == 32 || c.head_dim == 64 || c.head_dim == 128;
    EXPECT_EQ(cuda::DecodeAttentionCalls() - decode_before, specialised ? 1 : 0);
    EXPECT_LT(RelativeError(FromGpu(gout), ::te::testing::ToDoubles(cpu_out)),
              Tolerance(c.dtype)) << "out";
    ExpectLseNear(FromGpu(glse), cpu_lse, Tolerance(c.dtype));
    // Rows that see no key are exactly zero.
    const std::vector<double> out = FromGpu(gout);
    const std::vector<double> ref = ::te::testing::ToDoubles(cpu_out);
    for (size_t i = 0; i < out.size(); ++i) {
      if (ref[i] == 0.0) EXPECT_EQ(out[i], 0.0) << "element " << i;
    }
  }
}

// A decode step's relative bias named by its table (AttentionArgs::
// relative_bias): the decode kernel looks each key's bias up and gives the
// bits it gives with the bias made (RelativeBiasForward, same dtype), at a
// device position inside the buckets' rows and past them (bias 0); a case
// the kernel declines (head_dim 40) makes the bias and still matches; all
// within the tolerance of the CPU with the bias made.
TEST_F(GpuAttentionForwardOnlyTest, DecodeRowsWithTheRelativeTableMatchTheBiasMade) {
  struct Case {
    std::string name;
    DType dtype, table;
    int64_t batch, kv_seq, heads, head_dim;
  };
  const Case cases[] = {
      {"bf16_lm_step", DType::kBF16, DType::kBF16, 8, 384, 16, 64},
      {"bf16_f32_table", DType::kBF16, DType::kF32, 3, 130, 4, 128},
      {"f32_d32", DType::kF32, DType::kF32, 2, 70, 4, 32},
      {"declined_d40", DType::kF16, DType::kF16, 2, 33, 2, 40},
  };
  const int64_t num_buckets = 32;
  for (const Case& c : cases) {
    const Shape q_shape = {c.batch, 1, c.heads, c.head_dim};
    const Shape kv_shape = {c.batch, c.kv_seq, c.heads, c.head_dim};
    const Shape lse_shape = {c.batch, c.heads, 1};
    const Tensor q = Host(c.dtype, q_shape, RandomValues(NumElements(q_shape), 31));
    const Tensor k = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 32));
    const Tensor v = Host(c.dtype, kv_shape, RandomValues(NumElements(kv_shape), 33));
    const Tensor table =
        Host(c.table, {c.heads, num_buckets}, RandomValues(num_buckets * c.heads, 34, -2.0f, 2.0f));
    Tensor buckets = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.kv_seq, c.kv_seq});
    for (int64_t i = 0; i < c.kv_seq; ++i) {
      for (int64_t j = 0; j < c.kv_seq; ++j) {
        buckets.data_as<int32_t>()[i * c.kv_seq + j] =
            static_cast<int32_t>(std::min<int64_t>(std::abs(i - j), num_buckets - 1));
      }
    }
    for (const int64_t row : {c.kv_seq / 3, c.kv_seq /* past the rows: no bias */}) {
      SCOPED_TRACE(c.name + " at row " + std::to_string(row));
      Tensor position = ::te::testing::MakeEmpty(cpu_, DType::kI32, {1});
      position.data_as<int32_t>()[0] = static_cast<int32_t>(row);
      AttentionArgs made;
      made.mask = MaskType::kPadding;
      made.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      made.forward_only = true;
      made.q_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      made.kv_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) {
        made.q_seqlens.data_as<int32_t>()[b] = 1;
        made.kv_seqlens.data_as<int32_t>()[b] =
            static_cast<int32_t>(std::max<int64_t>(1, std::min(row + 1, c.kv_seq) - b));
      }
      made.bias = ::te::testing::MakeEmpty(cpu_, c.table, {c.heads, 1, c.kv_seq});
      ASSERT_TRUE(cpu_.RelativeBiasForward(table, buckets, position, &made.bias).ok());
      Tensor cpu_out = ::te::testing::MakeEmpty(cpu_, c.dtype, q_shape);
      Tensor cpu_lse = ::te::testing::MakeEmpty(cpu_, DType::kF32, lse_shape);
      ASSERT_TRUE(cpu_.AttentionForward(made, q, k, v, &cpu_out, &cpu_lse).ok());

      AttentionArgs gpu_made = made;
      gpu_made.bias = ToGpu(made.bias);
      gpu_made.q_seqlens = ToGpu(made.q_seqlens);
      gpu_made.kv_seqlens = ToGpu(made.kv_seqlens);
      AttentionArgs gpu_table = gpu_made;
      gpu_table.bias = Tensor();
      gpu_table.relative_bias.table = ToGpu(table);
      gpu_table.relative_bias.buckets = ToGpu(buckets);
      gpu_table.relative_bias.first_row = ToGpu(position);
      const Tensor gq = ToGpu(q), gk = ToGpu(k), gv = ToGpu(v);
      Tensor out_made = GpuEmpty(c.dtype, q_shape), out_table = GpuEmpty(c.dtype, q_shape);
      Tensor lse_made = GpuEmpty(DType::kF32, lse_shape), lse_table = GpuEmpty(DType::kF32, lse_shape);
      ASSERT_TRUE(gpu_->AttentionForward(gpu_made, gq, gk, gv, &out_made, &lse_made).ok());
      const int64_t decode_before = cuda::DecodeAttentionCalls();
      const absl::Status fwd = gpu_->AttentionForward(gpu_table, gq, gk, gv, &out_table, &lse_table);
      ASSERT_TRUE(fwd.ok()) << fwd;
      EXPECT_EQ(cuda::DecodeAttentionCalls() - decode_before, c.head_dim == 40 ? 0 : 1);
      EXPECT_EQ(FromGpu(out_table), FromGpu(out_made));
      EXPECT_EQ(FromGpu(lse_table), FromGpu(lse_made));
      EXPECT_LT(RelativeError(FromGpu(out_table), ::te::testing::ToDoubles(cpu_out)),
                Tolerance(c.dtype)) << "out";
      ExpectLseNear(FromGpu(lse_table), cpu_lse, Tolerance(c.dtype));
    }
  }
}

// Ops::DecodeAttentionFromQkv: the decode kernel writing the step's rows from
// the fused projection's qkv itself gives the bits of DecodeQkvRows then
// AttentionForward (q, both caches, out, lse), for rotary in both pair
// layouts or none, a relative table or a made bias, positions inside the
// cache and past it (no row written); a case the kernel declines (head_dim
// 40, or two tokens) runs the two ops and gives the same.
TEST_F(GpuAttentionForwardOnlyTest, DecodeFromQkvIsDecodeQkvRowsThenAttention) {
  struct Case {
    std::string name;
    DType dtype;
    int64_t batch, tokens, length, heads, head_dim;
    int rotary;  // 0: none, 1: consecutive pairs, 2: alternate halves
    bool relative;
    bool fused;  // the one-launch path takes it
  };
  const Case cases[] = {
      {"bf16_lm_step", DType::kBF16, 8, 1, 384, 16, 64, 2, true, true},
      {"bf16_consecutive_made_bias", DType::kBF16, 3, 1, 130, 4, 128, 1, false, true},
      {"f32_d32_no_rotary", DType::kF32, 2, 1, 70, 4, 32, 0, false, true},
      {"f16_d40_declined", DType::kF16, 2, 1, 33, 2, 40, 1, false, false},
      {"bf16_two_tokens_declined", DType::kBF16, 2, 2, 64, 4, 64, 2, true, false},
  };
  const int64_t num_buckets = 32;
  for (const Case& c : cases) {
    const Shape qkv_shape = {c.batch, c.tokens, 3, c.heads, c.head_dim};
    const Shape cache_shape = {c.batch, c.length, c.heads, c.head_dim};
    const Shape q_shape = {c.batch, c.tokens, c.heads, c.head_dim};
    const Shape lse_shape = {c.batch, c.heads, c.tokens};
    const Tensor qkv = ToGpu(Host(c.dtype, qkv_shape, RandomValues(NumElements(qkv_shape), 41)));
    const Tensor keys = Host(c.dtype, cache_shape, RandomValues(NumElements(cache_shape), 42));
    const Tensor values = Host(c.dtype, cache_shape, RandomValues(NumElements(cache_shape), 43));
    Tensor buckets = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.length, c.length});
    for (int64_t i = 0; i < c.length; ++i) {
      for (int64_t j = 0; j < c.length; ++j) {
        buckets.data_as<int32_t>()[i * c.length + j] =
            static_cast<int32_t>(std::min<int64_t>(std::abs(i - j), num_buckets - 1));
      }
    }
    const Tensor table = Host(c.dtype, {c.heads, num_buckets},
                              RandomValues(num_buckets * c.heads, 44, -2.0f, 2.0f));
    for (const int64_t row : {c.length / 2, c.length - c.tokens, c.length /* no row written */}) {
      SCOPED_TRACE(c.name + " at row " + std::to_string(row));
      Tensor position = ::te::testing::MakeEmpty(cpu_, DType::kI32, {1});
      position.data_as<int32_t>()[0] = static_cast<int32_t>(row);
      const Tensor gpu_position = ToGpu(position);
      RotaryArgs rotary;
      rotary.consecutive = c.rotary == 1;
      rotary.position = gpu_position;
      const RotaryArgs* rotation = c.rotary == 0 ? nullptr : &rotary;
      AttentionArgs args;
      args.mask = c.tokens == 1 ? MaskType::kPadding : MaskType::kPaddingCausalBottomRight;
      args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      args.forward_only = true;
      Tensor q_lens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      Tensor kv_lens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
      for (int64_t b = 0; b < c.batch; ++b) {
        q_lens.data_as<int32_t>()[b] = static_cast<int32_t>(c.tokens);
        kv_lens.data_as<int32_t>()[b] =
            static_cast<int32_t>(std::min(row + c.tokens, c.length));
      }
      args.q_seqlens = ToGpu(q_lens);
      args.kv_seqlens = ToGpu(kv_lens);
      if (c.relative) {
        args.relative_bias.table = ToGpu(table);
        args.relative_bias.buckets = ToGpu(buckets);
        args.relative_bias.first_row = gpu_position;
      } else {
        args.bias = ToGpu(Host(c.dtype, {c.heads, c.tokens, c.length},
                               RandomValues(c.heads * c.tokens * c.length, 45, -2.0f, 2.0f)));
      }
      // The two ops, on their own copies of the caches.
      Tensor key_two = ToGpu(keys), value_two = ToGpu(values);
      Tensor q_two = GpuEmpty(c.dtype, q_shape), out_two = GpuEmpty(c.dtype, q_shape);
      Tensor lse_two = GpuEmpty(DType::kF32, lse_shape);
      ASSERT_TRUE(gpu_->DecodeQkvRows(qkv, rotation, gpu_position, &q_two, &key_two, &value_two)
                      .ok());
      ASSERT_TRUE(
          gpu_->AttentionForward(args, q_two, key_two, value_two, &out_two, &lse_two).ok());
      // In one op.
      Tensor key_one = ToGpu(keys), value_one = ToGpu(values);
      Tensor q_one = GpuEmpty(c.dtype, q_shape), out_one = GpuEmpty(c.dtype, q_shape);
      Tensor lse_one = GpuEmpty(DType::kF32, lse_shape);
      const int64_t decode_before = cuda::DecodeAttentionCalls();
      const absl::Status one = gpu_->DecodeAttentionFromQkv(
          args, qkv, rotation, gpu_position, &q_one, &key_one, &value_one, &out_one, &lse_one);
      ASSERT_TRUE(one.ok()) << one;
      EXPECT_EQ(cuda::DecodeAttentionCalls() - decode_before, c.fused ? 1 : 0);
      EXPECT_EQ(FromGpu(q_one), FromGpu(q_two)) << "q";
      EXPECT_EQ(FromGpu(key_one), FromGpu(key_two)) << "key cache";
      EXPECT_EQ(FromGpu(value_one), FromGpu(value_two)) << "value cache";
      EXPECT_EQ(FromGpu(out_one), FromGpu(out_two)) << "out";
      EXPECT_EQ(FromGpu(lse_one), FromGpu(lse_two)) << "lse";
      if (row < c.length) {
        // The new rows landed: the caches differ from what they were.
        EXPECT_NE(FromGpu(value_one), ::te::testing::ToDoubles(values));
      } else {
        EXPECT_EQ(FromGpu(value_one), ::te::testing::ToDoubles(values));
      }
    }
  }
}

// cuDNN with dropout: v = one-hot rows (v[b, j, h, d] = [d == j], so D >= Skv)
// makes out[i, j] = P_ij * M_ij exactly, which exposes the dropout mask M.

// The one-hot-v dropout probe read back: out [b, i, h, j] (j < kv, D >= kv)
// is P_ij after dropout, 0 where dropped; p the undropped P. Returns the
// dropped fraction, the kept values against P / (1 - rate), and the dv the
// forward's mask implies: dv[b, j, h, :] = sum_i P_ij M_ij / (1 - rate) dout[b, i, h, :].
struct DropoutProbe {
  double fraction = 0.0;
  std::vector<double> kept_gpu, kept_ref, dv_ref;
};
DropoutProbe ReadDropoutProbe(const std::vector<float>& o, const std::vector<float>& p,
                              const std::vector<float>& dy, int64_t batch, int64_t seq,
                              int64_t kv, int64_t heads, int64_t dim, double rate) {
  DropoutProbe probe;
  probe.dv_ref.assign(static_cast<size_t>(batch * kv * heads * dim), 0.0);
  int64_t dropped = 0, total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < seq; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < kv; ++j) {
          const int64_t at = ((b * seq + i) * heads + h) * dim + j;
          ++total;
          if (o[at] == 0.0f) {
            ++dropped;
            continue;
          }
          probe.kept_gpu.push_back(o[at]);
          probe.kept_ref.push_back(p[at] / (1.0 - rate));
          for (int64_t d = 0; d < dim; ++d) {
            probe.dv_ref[((b * kv + j) * heads + h) * dim + d] +=
                p[at] / (1.0 - rate) * dy[((b * seq + i) * heads + h) * dim + d];
          }
        }
      }
    }
  }
  probe.fraction = static_cast<double>(dropped) / static_cast<double>(total);
  return probe;
}

TEST(GpuAttentionDropoutTest, CudnnDropsTheRateAndBackwardUsesTheSameMask) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{4} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Ops& gpu = **ops;
  CpuOps cpu;
  cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
  constexpr int64_t kB = 2, kS = 128, kKv = 64, kH = 4, kD = 64;
  constexpr float kRate = 0.25f;
  const Shape q_shape = {kB, kS, kH, kD}, kv_shape = {kB, kKv, kH, kD};
  const Tensor q = ::te::testing::MakeTensor(cpu, DType::kBF16, q_shape,
                                             RandomValues(kB * kS * kH * kD, 11));
  const Tensor k = ::te::testing::MakeTensor(cpu, DType::kBF16, kv_shape,
                                             RandomValues(kB * kKv * kH * kD, 12));
  std::vector<float> one_hot(static_cast<size_t>(kB * kKv * kH * kD), 0.0f);
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t j = 0; j < kKv; ++j)
      for (int64_t h = 0; h < kH; ++h) one_hot[((b * kKv + j) * kH + h) * kD + j] = 1.0f;
  const Tensor v = ::te::testing::MakeTensor(cpu, DType::kBF16, kv_shape, one_hot);
  const Tensor dout = ::te::testing::MakeTensor(cpu, DType::kBF16, q_shape,
                                                RandomValues(kB * kS * kH * kD, 13));

  AttentionArgs args;
  args.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  // Reference probabilities: the CPU without dropout.
  Tensor p_ref = ::te::testing::MakeEmpty(cpu, DType::kF32, q_shape);
  Tensor lse_ref = ::te::testing::MakeEmpty(cpu, DType::kF32, {kB, kH, kS});
  const Tensor q32 = ::te::testing::MakeTensor(cpu, DType::kF32, q_shape, ToFloatVector(q));
  const Tensor k32 = ::te::testing::MakeTensor(cpu, DType::kF32, kv_shape, ToFloatVector(k));
  const Tensor v32 = ::te::testing::MakeTensor(cpu, DType::kF32, kv_shape, one_hot);
  ASSERT_TRUE(cpu.AttentionForward(args, q32, k32, v32, &p_ref, &lse_ref).ok());

  auto upload = [&](const Tensor& host) {
    auto t = gpu.Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok());
    EXPECT_TRUE(gpu.Upload(host.data(), &*t).ok());
    return *t;
  };
  const Tensor gq = upload(q), gk = upload(k), gv = upload(v), gdout = upload(dout);
  Tensor gout = *gpu.Allocate(DType::kBF16, q_shape);
  Tensor glse = *gpu.Allocate(DType::kF32, {kB, kH, kS});
  args.dropout_rate = kRate;
  args.dropout_seed = 1234;
  const int64_t calls_before = cuda::CudnnAttentionCalls();
  ASSERT_TRUE(gpu.AttentionForward(args, gq, gk, gv, &gout, &glse).ok());
  Tensor gdq = *gpu.Allocate(DType::kBF16, q_shape);
  Tensor gdk = *gpu.Allocate(DType::kBF16, kv_shape);
  Tensor gdv = *gpu.Allocate(DType::kBF16, kv_shape);
  ASSERT_TRUE(
      gpu.AttentionBackward(args, gq, gk, gv, gout, gdout, glse, &gdq, &gdk, &gdv, nullptr).ok());
  ASSERT_EQ(cuda::CudnnAttentionCalls() - calls_before, 2) << "cuDNN did not take dropout";

  Tensor out = ::te::testing::MakeEmpty(cpu, DType::kBF16, q_shape);
  Tensor dv = ::te::testing::MakeEmpty(cpu, DType::kBF16, kv_shape);
  ASSERT_TRUE(gpu.Download(gout, out.data()).ok());
  ASSERT_TRUE(gpu.Download(gdv, dv.data()).ok());
  const std::vector<float> o = ToFloatVector(out), p = ToFloatVector(p_ref);
  const std::vector<float> dy = ToFloatVector(dout);
  const DropoutProbe probe = ReadDropoutProbe(o, p, dy, kB, kS, kKv, kH, kD, kRate);
  // 32768 Bernoulli draws: one standard deviation is 0.0024.
  EXPECT_NEAR(probe.fraction, kRate, 0.015);
  EXPECT_LT(RelativeError(probe.kept_gpu, probe.kept_ref), Tolerance(DType::kBF16))
      << "kept probabilities";
  EXPECT_LT(RelativeError(::te::testing::ToDoubles(dv), probe.dv_ref), Tolerance(DType::kBF16))
      << "dv with the forward's mask";
}

// ---- packed qkv [B, S, 3, H, D] ----------------------------------------------

// [B, S, 3, H, D] from q, k, v values [B, S, H, D] (row-major floats).
std::vector<float> PackValues(const std::vector<float>& q, const std::vector<float>& k,
                              const std::vector<float>& v, int64_t rows, int64_t row) {
  const std::vector<float>* parts[3] = {&q, &k, &v};
  std::vector<float> packed(static_cast<size_t>(3 * rows * row));
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < 3; ++p)
      for (int64_t e = 0; e < row; ++e) packed[(r * 3 + p) * row + e] = (*parts[p])[r * row + e];
  return packed;
}

// Part p (0: q, 1: k, 2: v) of packed values [B, S, 3, H, D].
std::vector<double> PartOf(const std::vector<double>& packed, int p, int64_t rows, int64_t row) {
  std::vector<double> part(static_cast<size_t>(rows * row));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < row; ++e) part[r * row + e] = packed[(r * 3 + p) * row + e];
  return part;
}

// kCudnn: the packed cuDNN path takes both calls. kDeclined: cuDNN declines
// (packed and, after the split, unpacked). kFallback: unfused forced.
// kEither: cuDNN may take the call or not; only the results are checked.
enum class PackedPath { kCudnn, kDeclined, kFallback, kEither };

struct PackedCase {
  std::string name;
  PackedPath path;
  DType dtype;
  int64_t batch, seq, heads, head_dim;
  MaskType mask;
  float dropout = 0.0f;  // only where the unfused path draws it (as the CPU does)
  bool bias = false;
};

void PrintTo(const PackedCase& c, std::ostream* os) { *os << c.name; }

class GpuPackedAttentionTest : public ::testing::TestWithParam<PackedCase> {
 protected:
  void SetUp() override {
    auto device = OpenCudaDevice(0);
    if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
    device_ = *std::move(device);
    auto ops = device_->NewOps(int64_t{16} << 30);
    ASSERT_TRUE(ops.ok()) << ops.status();
    gpu_ = *std::move(ops);
  }
  void TearDown() override { cuda::SetAttentionPath(cuda::AttentionPath::kAuto); }

  Tensor ToGpu(const Tensor& host) {
    auto t = gpu_->Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(gpu_->Upload(host.data(), &*t).ok());
    return *t;
  }
  Tensor GpuEmpty(DType dtype, const Shape& shape) {
    auto t = gpu_->Allocate(dtype, shape);
    EXPECT_TRUE(t.ok()) << t.status();
    if (IsFloating(dtype)) {
      EXPECT_TRUE(gpu_->Fill(NAN, &*t).ok());  // poison
    }
    return *t;
  }
  std::vector<double> FromGpu(const Tensor& t) {
    Tensor host = ::te::testing::MakeEmpty(cpu_, t.dtype(), t.shape());
    const absl::Status s = gpu_->Download(t, host.data());
    EXPECT_TRUE(s.ok()) << s;
    return ::te::testing::ToDoubles(host);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> gpu_;
  CpuOps cpu_;
};

TEST_P(GpuPackedAttentionTest, MatchesCpuAndUnpacked) {
  const PackedCase& c = GetParam();
  cuda::SetAttentionPath(c.path == PackedPath::kFallback ? cuda::AttentionPath::kFallbackOnly
                                                         : cuda::AttentionPath::kAuto);
  const Shape part_shape = {c.batch, c.seq, c.heads, c.head_dim};
  const Shape qkv_shape = {c.batch, c.seq, 3, c.heads, c.head_dim};
  const Shape lse_shape = {c.batch, c.heads, c.seq};
  const Shape bias_shape = {c.heads, c.seq, c.seq};
  const int64_t rows = c.batch * c.seq, row = c.heads * c.head_dim;
  const int64_t n = NumElements(part_shape);
  // k and v on other ranges than q, so a swapped part shows.
  const Tensor q = ::te::testing::MakeTensor(cpu_, c.dtype, part_shape, RandomValues(n, 21));
  const Tensor k =
      ::te::testing::MakeTensor(cpu_, c.dtype, part_shape, RandomValues(n, 22, -1.0f, 3.0f));
  const Tensor v =
      ::te::testing::MakeTensor(cpu_, c.dtype, part_shape, RandomValues(n, 23, -0.5f, 1.5f));
  const Tensor dout = ::te::testing::MakeTensor(cpu_, c.dtype, part_shape, RandomValues(n, 24));
  const Tensor qkv = ::te::testing::MakeTensor(
      cpu_, c.dtype, qkv_shape,
      PackValues(ToFloatVector(q), ToFloatVector(k), ToFloatVector(v), rows, row));

  AttentionArgs cpu_args;
  cpu_args.mask = c.mask;
  cpu_args.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  cpu_args.dropout_rate = c.dropout;
  cpu_args.dropout_seed = 0xbeef;
  if (c.bias) {
    cpu_args.bias = ::te::testing::MakeTensor(cpu_, DType::kF32, bias_shape,
                                              RandomValues(NumElements(bias_shape), 25));
  }
  if (IsPaddingMask(c.mask)) {
    cpu_args.q_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
    cpu_args.kv_seqlens = ::te::testing::MakeEmpty(cpu_, DType::kI32, {c.batch});
    for (int64_t b = 0; b < c.batch; ++b) {
      cpu_args.q_seqlens.data_as<int32_t>()[b] =
          static_cast<int32_t>(c.seq - (b * 29) % (c.seq / 2 + 1));
      cpu_args.kv_seqlens.data_as<int32_t>()[b] =
          static_cast<int32_t>(c.seq - (b * 41) % (c.seq / 2 + 1));
    }
  }
  AttentionArgs gpu_args = cpu_args;
  if (c.bias) gpu_args.bias = ToGpu(cpu_args.bias);
  if (cpu_args.q_seqlens.data() != nullptr) {
    gpu_args.q_seqlens = ToGpu(cpu_args.q_seqlens);
    gpu_args.kv_seqlens = ToGpu(cpu_args.kv_seqlens);
  }

  // The CPU on the separate parts.
  Tensor cpu_out = ::te::testing::MakeEmpty(cpu_, c.dtype, part_shape);
  Tensor cpu_lse = ::te::testing::MakeEmpty(cpu_, DType::kF32, lse_shape);
  ASSERT_TRUE(cpu_.AttentionForward(cpu_args, q, k, v, &cpu_out, &cpu_lse).ok());
  Tensor cdq = ::te::testing::MakeEmpty(cpu_, c.dtype, part_shape);
  Tensor cdk = ::te::testing::MakeEmpty(cpu_, c.dtype, part_shape);
  Tensor cdv = ::te::testing::MakeEmpty(cpu_, c.dtype, part_shape);
  Tensor cdbias;
  if (c.bias) cdbias = ::te::testing::MakeEmpty(cpu_, DType::kF32, bias_shape);
  ASSERT_TRUE(cpu_.AttentionBackward(cpu_args, q, k, v, cpu_out, dout, cpu_lse, &cdq, &cdk, &cdv,
                                     c.bias ? &cdbias : nullptr)
                  .ok());

  // The GPU, packed.
  const Tensor gqkv = ToGpu(qkv), gdout = ToGpu(dout);
  Tensor gout = GpuEmpty(c.dtype, part_shape);
  Tensor glse = GpuEmpty(DType::kF32, lse_shape);
  Tensor gdqkv = GpuEmpty(c.dtype, qkv_shape);
  Tensor gdbias;
  if (c.bias) gdbias = GpuEmpty(DType::kF32, bias_shape);
  const int64_t calls_before = cuda::CudnnAttentionCalls();
  const int64_t packed_before = cuda::CudnnPackedAttentionCalls();
  const absl::Status fwd = gpu_->AttentionForwardPacked(gpu_args, gqkv, &gout, &glse);
  ASSERT_TRUE(fwd.ok()) << fwd;
  const absl::Status bwd = gpu_->AttentionBackwardPacked(gpu_args, gqkv, gout, gdout, glse,
                                                         &gdqkv, c.bias ? &gdbias : nullptr);
  ASSERT_TRUE(bwd.ok()) << bwd;
  const int64_t calls = cuda::CudnnAttentionCalls() - calls_before;
  const int64_t packed_calls = cuda::CudnnPackedAttentionCalls() - packed_before;
  switch (c.path) {
    case PackedPath::kCudnn:
      EXPECT_EQ(packed_calls, 2) << "cuDNN did not take the packed layout";
      EXPECT_EQ(calls, 2);
      break;
    case PackedPath::kDeclined:
    case PackedPath::kFallback:
      EXPECT_EQ(packed_calls, 0);
      EXPECT_EQ(calls, 0);
      break;
    case PackedPath::kEither:
      break;
  }

  const double tolerance = Tolerance(c.dtype);
  const std::vector<double> out = FromGpu(gout), dqkv = FromGpu(gdqkv);
  EXPECT_LT(RelativeError(out, ::te::testing::ToDoubles(cpu_out)), tolerance) << "out";
  ExpectLseNear(FromGpu(glse), cpu_lse, tolerance);
  const char* names[3] = {"dq", "dk", "dv"};
  const Tensor* cpu_grads[3] = {&cdq, &cdk, &cdv};
  const double grad_tolerance = c.dtype == DType::kF16 ? kF16AttentionGradTolerance : tolerance;
  for (int p = 0; p < 3; ++p) {
    EXPECT_LT(RelativeError(PartOf(dqkv, p, rows, row), ::te::testing::ToDoubles(*cpu_grads[p])),
              grad_tolerance)
        << names[p] << " (dqkv part " << p << ")";
  }
  if (c.bias) {
    EXPECT_LT(RelativeError(FromGpu(gdbias), ::te::testing::ToDoubles(cdbias)), tolerance)
        << "dbias";
  }

  // The GPU, unpacked, on the same values.
  const Tensor gq = ToGpu(q), gk = ToGpu(k), gv = ToGpu(v);
  Tensor uout = GpuEmpty(c.dtype, part_shape);
  Tensor ulse = GpuEmpty(DType::kF32, lse_shape);
  ASSERT_TRUE(gpu_->AttentionForward(gpu_args, gq, gk, gv, &uout, &ulse).ok());
  Tensor udq = GpuEmpty(c.dtype, part_shape);
  Tensor udk = GpuEmpty(c.dtype, part_shape);
  Tensor udv = GpuEmpty(c.dtype, part_shape);
  Tensor udbias;
  if (c.bias) udbias = GpuEmpty(DType::kF32, bias_shape);
  ASSERT_TRUE(gpu_->AttentionBackward(gpu_args, gq, gk, gv, uout, gdout, ulse, &udq, &udk, &udv,
                                      c.bias ? &udbias : nullptr)
                  .ok());
  EXPECT_LT(RelativeError(out, FromGpu(uout)), tolerance) << "out vs unpacked";
  const std::vector<double> lse = FromGpu(glse), unpacked_lse = FromGpu(ulse);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(unpacked_lse[i])) {
      EXPECT_EQ(lse[i], unpacked_lse[i]) << "lse row " << i << " vs unpacked";
    } else {
      EXPECT_NEAR(lse[i], unpacked_lse[i], 1e-3 * (1.0 + std::abs(unpacked_lse[i])))
          << "lse row " << i << " vs unpacked";
    }
  }
  const Tensor* unpacked_grads[3] = {&udq, &udk, &udv};
  for (int p = 0; p < 3; ++p) {
    EXPECT_LT(RelativeError(PartOf(dqkv, p, rows, row), FromGpu(*unpacked_grads[p])), tolerance)
        << names[p] << " vs unpacked";
  }
  if (c.bias) {
    EXPECT_LT(RelativeError(FromGpu(gdbias), FromGpu(udbias)), tolerance) << "dbias vs unpacked";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Packed, GpuPackedAttentionTest,
    ::testing::Values(
        // The benchmark's head size.
        PackedCase{"bf16_causal_d128", PackedPath::kCudnn, DType::kBF16, 2, 256, 4, 128,
                   MaskType::kCausal},
        PackedCase{"bf16_nomask_d128", PackedPath::kCudnn, DType::kBF16, 2, 128, 8, 128,
                   MaskType::kNoMask},
        PackedCase{"bf16_padding_d64", PackedPath::kCudnn, DType::kBF16, 3, 192, 4, 64,
                   MaskType::kPadding},
        PackedCase{"bf16_padding_causal_d128_seq130", PackedPath::kCudnn, DType::kBF16, 2, 130,
                   4, 128, MaskType::kPaddingCausal},
        PackedCase{"bf16_causal_bias_d64", PackedPath::kCudnn, DType::kBF16, 2, 128, 4, 64,
                   MaskType::kCausal, 0.0f, true},
        PackedCase{"f16_nomask_d64", PackedPath::kCudnn, DType::kF16, 1, 128, 2, 64,
                   MaskType::kNoMask},
        // A small odd sequence: cuDNN may take it or not; either way correct.
        PackedCase{"bf16_causal_seq37", PackedPath::kEither, DType::kBF16, 2, 37, 4, 64,
                   MaskType::kCausal},
        PackedCase{"bf16_padding_seq37_d128", PackedPath::kEither, DType::kBF16, 3, 37, 2, 128,
                   MaskType::kPadding},
        // cuDNN declines: the split default answers (unfused).
        PackedCase{"declined_bf16_causal_bias_seq37", PackedPath::kDeclined, DType::kBF16, 2, 37,
                   4, 64, MaskType::kCausal, 0.0f, true},
        PackedCase{"declined_f32_causal", PackedPath::kDeclined, DType::kF32, 2, 64, 4, 32,
                   MaskType::kCausal},
        // The unfused path forced: the split default, rng.h's dropout (as the CPU).
        PackedCase{"fallback_bf16_padding_causal_dropout", PackedPath::kFallback, DType::kBF16, 2,
                   45, 4, 64, MaskType::kPaddingCausal, 0.2f},
        PackedCase{"fallback_f32_nomask_bias_dropout", PackedPath::kFallback, DType::kF32, 2, 33,
                   3, 16, MaskType::kNoMask, 0.1f, true}),
    [](const ::testing::TestParamInfo<PackedCase>& info) { return info.param.name; });

// A qkv whose base is not 16-byte aligned (a view one element into a
// buffer): cuDNN must not get the packed pointers, and the split default
// (whose parts are fresh, aligned buffers) still answers correctly.
TEST(GpuPackedAttentionAlignmentTest, MisalignedQkvTakesTheSplitDefault) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{4} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Ops& gpu = **ops;
  CpuOps cpu;
  cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
  constexpr int64_t kB = 2, kS = 128, kH = 4, kD = 64;
  const Shape part_shape = {kB, kS, kH, kD}, qkv_shape = {kB, kS, 3, kH, kD};
  const int64_t n = NumElements(part_shape), rows = kB * kS, row = kH * kD;
  const Tensor q = ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 31));
  const Tensor k = ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 32));
  const Tensor v = ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 33));
  const Tensor dout =
      ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 34));
  const Tensor qkv = ::te::testing::MakeTensor(
      cpu, DType::kBF16, qkv_shape,
      PackValues(ToFloatVector(q), ToFloatVector(k), ToFloatVector(v), rows, row));
  AttentionArgs args;
  args.mask = MaskType::kCausal;
  args.scale = 0.125f;
  Tensor cpu_out = ::te::testing::MakeEmpty(cpu, DType::kBF16, part_shape);
  Tensor cpu_lse = ::te::testing::MakeEmpty(cpu, DType::kF32, {kB, kH, kS});
  ASSERT_TRUE(cpu.AttentionForward(args, q, k, v, &cpu_out, &cpu_lse).ok());
  Tensor cdq = ::te::testing::MakeEmpty(cpu, DType::kBF16, part_shape);
  Tensor cdk = ::te::testing::MakeEmpty(cpu, DType::kBF16, part_shape);
  Tensor cdv = ::te::testing::MakeEmpty(cpu, DType::kBF16, part_shape);
  ASSERT_TRUE(
      cpu.AttentionBackward(args, q, k, v, cpu_out, dout, cpu_lse, &cdq, &cdk, &cdv, nullptr)
          .ok());

  // One element (2 bytes) into a buffer: every part's base is misaligned.
  auto shifted = [&](const Shape& shape) {
    auto buffer = gpu.Allocate(DType::kBF16, {NumElements(shape) + 8});
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    const Tensor owner = *buffer;
    return Tensor(std::shared_ptr<void>(owner.data(), [owner](void*) {}),
                  static_cast<char*>(owner.data()) + DTypeSize(DType::kBF16), DType::kBF16,
                  shape);
  };
  Tensor gqkv = shifted(qkv_shape);
  ASSERT_TRUE(gpu.Upload(qkv.data(), &gqkv).ok());
  Tensor gdout = *gpu.Allocate(DType::kBF16, part_shape);
  ASSERT_TRUE(gpu.Upload(dout.data(), &gdout).ok());
  Tensor gout = *gpu.Allocate(DType::kBF16, part_shape);
  Tensor glse = *gpu.Allocate(DType::kF32, {kB, kH, kS});
  Tensor gdqkv = shifted(qkv_shape);
  const int64_t packed_before = cuda::CudnnPackedAttentionCalls();
  ASSERT_TRUE(gpu.AttentionForwardPacked(args, gqkv, &gout, &glse).ok());
  ASSERT_TRUE(gpu.AttentionBackwardPacked(args, gqkv, gout, gdout, glse, &gdqkv, nullptr).ok());
  EXPECT_EQ(cuda::CudnnPackedAttentionCalls() - packed_before, 0)
      << "cuDNN got misaligned packed pointers";

  auto download = [&](const Tensor& t) {
    Tensor host = ::te::testing::MakeEmpty(cpu, t.dtype(), t.shape());
    EXPECT_TRUE(gpu.Download(t, host.data()).ok());
    return ::te::testing::ToDoubles(host);
  };
  const double tolerance = Tolerance(DType::kBF16);
  EXPECT_LT(RelativeError(download(gout), ::te::testing::ToDoubles(cpu_out)), tolerance) << "out";
  const std::vector<double> dqkv = download(gdqkv);
  EXPECT_LT(RelativeError(PartOf(dqkv, 0, rows, row), ::te::testing::ToDoubles(cdq)), tolerance)
      << "dq";
  EXPECT_LT(RelativeError(PartOf(dqkv, 1, rows, row), ::te::testing::ToDoubles(cdk)), tolerance)
      << "dk";
  EXPECT_LT(RelativeError(PartOf(dqkv, 2, rows, row), ::te::testing::ToDoubles(cdv)), tolerance)
      << "dv";
}

// cuDNN's dropout on the packed layout: the one-hot-v probe of the unpacked
// test above (out[i, j] = P_ij M_ij) with v inside qkv, and dv (dqkv's part
// 2) recomputed from the forward's mask: the packed backward draws the
// packed forward's mask.
TEST(GpuAttentionDropoutTest, PackedCudnnDropsTheRateAndBackwardUsesTheSameMask) {
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  auto ops = (*device)->NewOps(int64_t{4} << 30);
  ASSERT_TRUE(ops.ok()) << ops.status();
  Ops& gpu = **ops;
  CpuOps cpu;
  cuda::SetAttentionPath(cuda::AttentionPath::kAuto);
  constexpr int64_t kB = 2, kS = 64, kH = 4, kD = 64;  // D >= S for the one-hot rows
  constexpr float kRate = 0.25f;
  const Shape part_shape = {kB, kS, kH, kD};
  const int64_t n = NumElements(part_shape), rows = kB * kS, row = kH * kD;
  std::vector<float> one_hot(static_cast<size_t>(n), 0.0f);
  for (int64_t b = 0; b < kB; ++b)
    for (int64_t j = 0; j < kS; ++j)
      for (int64_t h = 0; h < kH; ++h) one_hot[((b * kS + j) * kH + h) * kD + j] = 1.0f;
  const Tensor q = ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 41));
  const Tensor k = ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 42));
  const Tensor dout =
      ::te::testing::MakeTensor(cpu, DType::kBF16, part_shape, RandomValues(n, 43));
  const Tensor qkv = ::te::testing::MakeTensor(
      cpu, DType::kBF16, {kB, kS, 3, kH, kD},
      PackValues(ToFloatVector(q), ToFloatVector(k), one_hot, rows, row));

  AttentionArgs args;
  args.scale = 1.0f / std::sqrt(static_cast<float>(kD));
  // Reference probabilities: the CPU without dropout.
  Tensor p_ref = ::te::testing::MakeEmpty(cpu, DType::kF32, part_shape);
  Tensor lse_ref = ::te::testing::MakeEmpty(cpu, DType::kF32, {kB, kH, kS});
  const Tensor q32 = ::te::testing::MakeTensor(cpu, DType::kF32, part_shape, ToFloatVector(q));
  const Tensor k32 = ::te::testing::MakeTensor(cpu, DType::kF32, part_shape, ToFloatVector(k));
  const Tensor v32 = ::te::testing::MakeTensor(cpu, DType::kF32, part_shape, one_hot);
  ASSERT_TRUE(cpu.AttentionForward(args, q32, k32, v32, &p_ref, &lse_ref).ok());

  auto upload = [&](const Tensor& host) {
    auto t = gpu.Allocate(host.dtype(), host.shape());
    EXPECT_TRUE(t.ok());
    EXPECT_TRUE(gpu.Upload(host.data(), &*t).ok());
    return *t;
  };
  const Tensor gqkv = upload(qkv), gdout = upload(dout);
  Tensor gout = *gpu.Allocate(DType::kBF16, part_shape);
  Tensor glse = *gpu.Allocate(DType::kF32, {kB, kH, kS});
  Tensor gdqkv = *gpu.Allocate(DType::kBF16, qkv.shape());
  args.dropout_rate = kRate;
  args.dropout_seed = 4321;
  const int64_t packed_before = cuda::CudnnPackedAttentionCalls();
  ASSERT_TRUE(gpu.AttentionForwardPacked(args, gqkv, &gout, &glse).ok());
  ASSERT_TRUE(gpu.AttentionBackwardPacked(args, gqkv, gout, gdout, glse, &gdqkv, nullptr).ok());
  ASSERT_EQ(cuda::CudnnPackedAttentionCalls() - packed_before, 2)
      << "cuDNN did not take packed dropout";

  Tensor out = ::te::testing::MakeEmpty(cpu, DType::kBF16, part_shape);
  Tensor dqkv = ::te::testing::MakeEmpty(cpu, DType::kBF16, qkv.shape());
  ASSERT_TRUE(gpu.Download(gout, out.data()).ok());
  ASSERT_TRUE(gpu.Download(gdqkv, dqkv.data()).ok());
  const std::vector<float> o = ToFloatVector(out), p = ToFloatVector(p_ref);
  const std::vector<float> dy = ToFloatVector(dout);
  const DropoutProbe probe = ReadDropoutProbe(o, p, dy, kB, kS, kS, kH, kD, kRate);
  // 32768 Bernoulli draws: one standard deviation is 0.0024.
  EXPECT_NEAR(probe.fraction, kRate, 0.015);
  EXPECT_LT(RelativeError(probe.kept_gpu, probe.kept_ref), Tolerance(DType::kBF16))
      << "kept probabilities";
  EXPECT_LT(RelativeError(PartOf(::te::testing::ToDoubles(dqkv), 2, rows, row), probe.dv_ref),
            Tolerance(DType::kBF16))
      << "dv (dqkv part 2) with the forward's mask";
}

}  // namespace
}  // namespace te
