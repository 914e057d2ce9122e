// The CPU backend: the reference implementation of every op in kernels/ops.h.
// Written for clarity over speed: float32 accumulation, each output rounded
// once to its dtype with the exact casts of kernels/fp8.h. GEMMs go through
// Eigen. Work runs synchronously on the calling thread.
#ifndef TE_KERNELS_CPU_CPU_OPS_H_
#define TE_KERNELS_CPU_CPU_OPS_H_

#include <string>
#include <vector>

#include "kernels/ops.h"

namespace te {

class CpuOps : public Ops {
 public:
  std::string device_name() const override { return "cpu"; }

  absl::Status Upload(const void* src, Tensor* dst) override;
  absl::Status Download(const Tensor& src, void* dst) override;
  absl::Status Copy(const Tensor& src, Tensor* dst) override;
  absl::Status CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Fill(float value, Tensor* y) override;
  absl::Status AddScalarI32(int32_t value, Tensor* y) override;
  absl::Status Cast(const Tensor& x, Tensor* y) override;
  absl::Status Axpby(float alpha, const Tensor& a, float beta, const Tensor& b,
                     Tensor* y) override;
  absl::Status Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) override;
  absl::Status SumRows(const Tensor& x, Tensor* y) override;

  absl::Status Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) override;
  absl::Status Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) override;
  absl::Status Amax(const Tensor& x, Tensor* amax) override;
  absl::Status ScaleFromAmax(const Tensor& amax, float fp8_max, float margin, float epsilon,
                             Tensor* scale, Tensor* scale_inv) override;
  absl::Status DelayedScalingUpdate(const DelayedScalingArgs& args, Tensor* amax_history,
                                    Tensor* scale, Tensor* scale_inv) override;
  absl::Status FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x, Tensor* y) override;

  absl::Status Gemm(const GemmArgs& args, Tensor* out) override;

  absl::Status NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                           const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                           const Fp8Output* fp8) override;
  absl::Status NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                            const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                            Tensor* dx, Tensor* dgamma, Tensor* dbeta,
                            const Tensor& residual_grad = Tensor()) override;

  absl::Status ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                 Tensor* y, const Fp8Output* fp8) override;
  absl::Status ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                  const Tensor& x, Tensor* dx) override;

  absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                              Tensor* mask) override;
  absl::Status DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                               Tensor* dx) override;

  // kernels/cpu/numpy_ops.cc
  absl::Status Binary(const BinaryArgs& args, const Tensor& a, const Tensor& b,
                      Tensor* y) override;
  absl::Status BinaryBackward(const BinaryArgs& args, const Tensor& dy, const Tensor& a,
                              const Tensor& b, Tensor* da, Tensor* db) override;
  absl::Status Unary(UnaryOp op, const Tensor& x, Tensor* y) override;
  absl::Status UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, Tensor* dx) override;
  absl::Status Where(const WhereArgs& args, const Tensor& cond, const Tensor& x, const Tensor& y,
                     Tensor* out) override;
  absl::Status Reduce(ReduceOp op, const Tensor& x, Tensor* y) override;
  absl::Status Softmax(bool log, int axis, const Tensor& x, Tensor* y) override;
  absl::Status SoftmaxBackward(bool log, int axis, const Tensor& dy, const Tensor& y,
                               Tensor* dx) override;
  absl::Status Slice(const Tensor& x, const std::vector<int64_t>& start,
                     const std::vector<int64_t>& stride, Tensor* y) override;
  absl::Status SliceBackward(const Tensor& dy, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& stride, Tensor* dx) override;

  // kernels/cpu/attention.cc
  absl::Status AttentionForward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                const Tensor& v, Tensor* out, Tensor* softmax_lse) override;
  absl::Status AttentionBackward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& out, const Tensor& dout,
                                 const Tensor& softmax_lse, Tensor* dq, Tensor* dk, Tensor* dv,
                                 Tensor* dbias) override;

  // kernels/cpu/optimizer.cc
  absl::Status OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                               const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                               Tensor* nu) override;
  absl::StatusOr<std::unique_ptr<OptimizerPlan>> NewOptimizerPlan(
      const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
      const Tensor& count, const Tensor& total_notfinite) override;
  absl::Status OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                             const std::vector<Tensor>& grads, Tensor* count,
                             Tensor* total_notfinite) override;

  // kernels/cpu/position.cc
  absl::Status Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) override;
  absl::StatusOr<Tensor> RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim) override;
  absl::Status EmbedForward(const Tensor& table, const Tensor& ids, Tensor* y) override;
  absl::Status EmbedBackward(const Tensor& dy, const Tensor& ids, Tensor* dtable) override;
  absl::Status SoftmaxCrossEntropyForward(const Tensor& logits, const Tensor& labels, Tensor* loss,
                                          Tensor* lse) override;
  absl::Status SoftmaxCrossEntropyBackward(const Tensor& logits, const Tensor& labels,
                                           const Tensor& lse, const Tensor& dloss,
                                           Tensor* dlogits) override;
  absl::Status ArgmaxLast(const Tensor& x, Tensor* y) override;
  absl::Status RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                   const Tensor& first_row, Tensor* bias) override;
  absl::Status RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                    Tensor* dtable) override;

 protected:
  absl::StatusOr<std::shared_ptr<void>> AllocateBytes(size_t bytes) override;
};

// Element access shared by the CPU op files: read any float dtype as float32,
// write float32 rounded to the tensor's dtype (FP8 written without scaling).
float LoadAsFloat(const Tensor& t, int64_t i);
void StoreFromFloat(Tensor* t, int64_t i, float v);
// Tensor -> std::vector<float> (float dtypes), and back.
std::vector<float> ToFloatVector(const Tensor& t);
void FromFloatVector(const std::vector<float>& v, Tensor* t);

}  // namespace te

#endif  // TE_KERNELS_CPU_CPU_OPS_H_
