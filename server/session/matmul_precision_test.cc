// A step request's matmul_precision (jax.default_matmul_precision) reaches
// the layer's float32 GEMMs: a session on the CPU reference that records each
// GEMM's TensorFloat-32 flag sees DEFAULT (the field's default) ask for TF32
// and HIGHEST not, in Forward, the Backward of a kept forward (at its
// forward's precision), ForwardBackward and Benchmark; a value that is
// neither is INVALID_ARGUMENT naming the field, with the session left as it
// was. (The CPU computes exact float32 either way; the GPU tests check the
// numbers.)
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

constexpr int64_t kBatch = 2, kSeq = 3, kHidden = 8, kFeatures = 12;

// Records the layer's float32 GEMMs: not the step's loss vdot(y, dy), which
// the CPU computes as a [1, n] x [n, 1] GEMM (Ops::Dot) and the GPU as a
// reduction.
class RecordingOps : public CpuOps {
 public:
  absl::Status Gemm(const GemmArgs& args, Tensor* out) override {
    if (args.a.dtype() == DType::kF32 && out->numel() > 1) flags.push_back(args.tf32);
    return CpuOps::Gemm(args, out);
  }
  std::vector<bool> flags;  // of the float32 GEMMs, in order
};

te::v1::Tensor F32(const std::vector<int64_t>& shape, float first) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) v[i] = first + 0.125f * static_cast<float>(i % 11) - 0.5f;
  te::v1::Tensor t;
  t.set_dtype(te::v1::FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(v.data(), v.size() * sizeof(float));
  return t;
}

class MatmulPrecisionSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCpuDevice();
    ASSERT_TRUE(device.ok());
    auto ops = std::make_unique<RecordingOps>();
    ops_ = ops.get();
    session_ = std::make_unique<Session>("precision", (*device)->info(), std::move(ops),
                                         SessionConfig(), te::v1::EMULATE, std::nullopt);
    te::v1::InitLayerRequest init;
    init.mutable_spec()->mutable_dense_general()->add_features(kFeatures);
    init.set_seed(1);
    init.set_input_dtype(te::v1::FLOAT32);
    for (int64_t d : {kBatch, kSeq, kHidden}) init.add_input_shape(d);
    te::v1::InitLayerResponse layer;
    ASSERT_TRUE(session_->InitLayer(init, &layer).ok());
    layer_id_ = layer.layer_id();
  }

  // The flags recorded since the last call, cleared.
  std::vector<bool> Flags() {
    std::vector<bool> flags;
    flags.swap(ops_->flags);
    return flags;
  }

  te::v1::ForwardRequest ForwardOf(te::v1::Precision precision) const {
    te::v1::ForwardRequest request;
    request.set_layer_id(layer_id_);
    *request.mutable_x() = F32({kBatch, kSeq, kHidden}, 0.25f);
    request.set_deterministic(true);
    request.set_matmul_precision(precision);
    return request;
  }

  RecordingOps* ops_ = nullptr;
  std::unique_ptr<Session> session_;
  std::string layer_id_;
};

// Every float32 GEMM recorded asks for TF32 exactly when `want`.
void ExpectAll(const std::vector<bool>& flags, bool want, size_t at_least) {
  ASSERT_GE(flags.size(), at_least);
  for (size_t i = 0; i < flags.size(); ++i) EXPECT_EQ(flags[i], want) << "GEMM " << i;
}

TEST_F(MatmulPrecisionSessionTest, ForwardAndItsBackward) {
  for (te::v1::Precision precision : {te::v1::PRECISION_DEFAULT, te::v1::PRECISION_HIGHEST}) {
    const bool tf32 = precision == te::v1::PRECISION_DEFAULT;
    SCOPED_TRACE(tf32 ? "DEFAULT" : "HIGHEST");
    te::v1::ForwardRequest forward = ForwardOf(precision);
    forward.set_keep_for_backward(true);
    te::v1::ForwardResponse y;
    ASSERT_TRUE(session_->Forward(forward, &y).ok());
    ExpectAll(Flags(), tf32, 1);
    te::v1::BackwardRequest backward;
    backward.set_forward_id(y.forward_id());
    *backward.mutable_dy() = F32({kBatch, kSeq, kFeatures}, -0.25f);
    te::v1::BackwardResponse grads;
    ASSERT_TRUE(session_->Backward(backward, &grads).ok());
    ExpectAll(Flags(), tf32, 2);  // wgrad and dgrad
  }
}

TEST_F(MatmulPrecisionSessionTest, ForwardBackwardAndBenchmark) {
  te::v1::MicroBatch batch;
  *batch.mutable_x() = F32({kBatch, kSeq, kHidden}, 0.25f);
  *batch.mutable_dy() = F32({kBatch, kSeq, kFeatures}, -0.25f);
  for (te::v1::Precision precision : {te::v1::PRECISION_DEFAULT, te::v1::PRECISION_HIGHEST}) {
    const bool tf32 = precision == te::v1::PRECISION_DEFAULT;
    SCOPED_TRACE(tf32 ? "DEFAULT" : "HIGHEST");
    te::v1::ForwardBackwardRequest step;
    step.set_layer_id(layer_id_);
    *step.add_micro_batches() = batch;
    *step.add_micro_batches() = batch;
    step.set_deterministic(true);
    step.set_matmul_precision(precision);
    te::v1::ForwardBackwardResponse stepped;
    ASSERT_TRUE(session_->ForwardBackward(step, &stepped).ok());
    ExpectAll(Flags(), tf32, 6);  // two micro-batches of three GEMMs

    te::v1::BenchmarkRequest bench;
    bench.set_layer_id(layer_id_);
    *bench.mutable_inputs() = batch;
    bench.set_deterministic(true);
    bench.set_warmup_iters(1);
    bench.set_timing_iters(1);
    bench.set_matmul_precision(precision);
    te::v1::BenchmarkResponse timed;
    ASSERT_TRUE(session_->Benchmark(bench, CallContext(), &timed).ok());
    ExpectAll(Flags(), tf32, 6);  // two steps of three GEMMs
  }
}

TEST_F(MatmulPrecisionSessionTest, UnknownPrecisionIsRefusedAndChangesNothing) {
  const te::v1::Precision bad = static_cast<te::v1::Precision>(5);
  const int64_t bytes = session_->bytes_in_use();
  te::v1::ForwardRequest forward = ForwardOf(bad);
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  const absl::Status refused = session_->Forward(forward, &y);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("matmul_precision: 5"), std::string::npos) << refused;

  te::v1::ForwardBackwardRequest step;
  step.set_layer_id(layer_id_);
  te::v1::MicroBatch* mb = step.add_micro_batches();
  *mb->mutable_x() = F32({kBatch, kSeq, kHidden}, 0.25f);
  *mb->mutable_dy() = F32({kBatch, kSeq, kFeatures}, -0.25f);
  step.set_matmul_precision(bad);
  te::v1::ForwardBackwardResponse stepped;
  const absl::Status step_refused = session_->ForwardBackward(step, &stepped);
  EXPECT_EQ(step_refused.code(), absl::StatusCode::kInvalidArgument) << step_refused;

  te::v1::BenchmarkRequest bench;
  bench.set_layer_id(layer_id_);
  *bench.mutable_inputs() = *mb;
  bench.set_matmul_precision(bad);
  te::v1::BenchmarkResponse timed;
  const absl::Status bench_refused = session_->Benchmark(bench, CallContext(), &timed);
  EXPECT_EQ(bench_refused.code(), absl::StatusCode::kInvalidArgument) << bench_refused;

  EXPECT_TRUE(Flags().empty());  // nothing ran
  EXPECT_EQ(session_->bytes_in_use(), bytes);
  te::v1::SessionInfo info;
  session_->GetSessionInfo(&info);
  EXPECT_EQ(info.saved_forwards(), 0);
}

}  // namespace
}  // namespace te::session
