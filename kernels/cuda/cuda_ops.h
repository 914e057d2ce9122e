// The CUDA backend: every op of kernels/ops.h on one CUDA stream of one GPU.
//
// A CudaOps is one session's stream. Like every Ops it is not thread-safe: one
// thread at a time calls it. Ops are asynchronous: a launch failure surfaces
// from that op, a fault inside a kernel from a later op or Synchronize().
//
// Shared state lives in a CudaContext, one per device (made by
// OpenCudaDevice, kernels/cuda/cuda_device.cc) and shared by its streams:
// the caching allocator and the cuBLASLt handle. State that must not be shared
// between streams (the cuDNN handle, bound to one stream; the library
// workspace; GEMM and attention plan caches) lives in the CudaOps.
//
// Files: staging.cc (page-locked staging, async uploads),
// elementwise.cu (memory, Fill, Cast, Axpby, Permute, SumRows),
// fp8.cu (scaling), norm.cu, activation.cu, dropout.cu, position.cu,
// gemm.cu (cuBLASLt), attention.cu (cuDNN + an unfused fallback), optimizer.cu
// (optax's update rules), numpy_elementwise.cu / numpy_reduce.cu /
// numpy_slice.cu (jax.numpy's broadcasting ops, reductions, softmax, slices).
#ifndef TE_KERNELS_CUDA_CUDA_OPS_H_
#define TE_KERNELS_CUDA_CUDA_OPS_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/allocator.h"
#include "kernels/ops.h"

namespace te {
namespace cuda {

// A device's streaming multiprocessor count: what launch geometry sizes
// grids by (common.cuh's GridFor). Launchers that take only a stream take it
// too, from their op's CudaOps::sms(): the device was asked once, when it was
// opened.
struct SmCount {
  int value;
};

// Driver answers about a kernel on one device (its occupancy, its
// shared-memory opt-in): host work a hot path should not repeat, so each is
// asked once per kernel and configuration and remembered with the device's
// context (common.cuh's ResidentBlocksPerSm, AllowSharedBytes).
struct KernelLaunchMemo {
  std::mutex mu;
  std::map<std::tuple<const void*, int, size_t>, int> blocks_per_sm;
  std::map<const void*, size_t> shared_allowed;
};

// Page-locked host buffers kept for reuse (staging.cc). Thread-safe.
class PinnedStagingPool;
std::shared_ptr<PinnedStagingPool> NewPinnedStagingPool();
class CompletionEventPool;  // staging.cc: NewCompletion's events
// A stream's small uploads through page-locked buffers (staging.cc): Upload
// copies `bytes` of `src` to device `dst` on `stream` and returns true, with
// `src` free at once and the host never waiting for the stream; false when
// `bytes` is too large for them (nothing done).
class StagedUploads;
std::shared_ptr<StagedUploads> NewStagedUploads(std::shared_ptr<PinnedStagingPool> pool);
absl::StatusOr<bool> StageUpload(StagedUploads& uploads, const void* src, void* dst, size_t bytes,
                                 cudaStream_t stream);

// A stream's fold slot: where the blocks of one kernel meet so that the last
// to finish folds the grid's result, with no memset launched before it and
// no second kernel after it. Zero at rest, and left at zero by every kernel
// that folds through it. Kernels of one stream run one after another, so one
// slot serves all of them.
//   - bits, blocks_done: FP8 amaxes (common.cuh's AmaxOut, FoldAmax);
//   - groups_done: kernels whose result is summed per group of blocks (the
//     relative bias table's gradient per head: relative_bias_grad.cu) count
//     the blocks of each group here, the group's last block summing it;
//   - group_bits: FP8 amaxes per group, for kernels that quantize several
//     tensors, a group of blocks each (fp8_kept_many.cu).
inline constexpr int kFoldGroups = 128;
struct GridFoldSlot {
  unsigned bits;         // the maxima folded so far, as AbsBits
  unsigned blocks_done;  // blocks of the running kernel that have folded
  unsigned groups_done[kFoldGroups];  // blocks of each group that are done
  unsigned group_bits[kFoldGroups];   // each group's maxima so far, as AbsBits
};

// Where a kernel folds an FP8 output's amax (common.cuh's FoldAmax): `amax`
// (null: not recorded) through its stream's slot.
struct AmaxOut {
  float* amax = nullptr;
  GridFoldSlot* slot = nullptr;
};

// The device's GridFoldSlots, one for each stream (CudaOps) while it lives:
// one block cudaMalloc'd and zeroed when the device opens, outside the
// caching allocator (no session is charged for it, nothing to order).
class FoldSlotPool {
 public:
  static constexpr int kSlots = 4096;  // streams open at once on a device
  static absl::StatusOr<std::shared_ptr<FoldSlotPool>> Make(int ordinal);
  ~FoldSlotPool();
  FoldSlotPool(const FoldSlotPool&) = delete;
  FoldSlotPool& operator=(const FoldSlotPool&) = delete;

  // A slot at zero; RESOURCE_EXHAUSTED when every slot has a stream.
  absl::StatusOr<GridFoldSlot*> Take();
  // Back from a stream with no work pending (its slot at zero again).
  void Give(GridFoldSlot* slot);

 private:
  FoldSlotPool(int ordinal, GridFoldSlot* base);
  const int ordinal_;
  GridFoldSlot* const base_;
  std::mutex mu_;
  std::vector<GridFoldSlot*> free_;
};

// Per-device state shared by all streams on the device. Thread-safe: the
// allocator locks; cuBLASLt handles may be used from several threads and
// streams at once (cublasLtMatmul takes the stream per call).
struct CudaContext {
  int ordinal = 0;
  cudaDeviceProp properties{};
  std::shared_ptr<CachingAllocator> allocator;
  cublasLtHandle_t cublaslt = nullptr;  // created by OpenCudaDevice
  // AllocateStaging's buffers: cudaHostAlloc costs milliseconds for the
  // megabytes a PutTensor stages, so released buffers are kept for the next.
  std::shared_ptr<PinnedStagingPool> staging_pool = NewPinnedStagingPool();
  mutable KernelLaunchMemo launch_memo;  // filled by launches, not a property
  std::shared_ptr<FoldSlotPool> fold_slots;  // made by OpenCudaDevice

  ~CudaContext();
};

// Owned by gemm.cu / attention.cu, defined there: per-shape descriptors and
// algorithm choices (GEMM), compiled graphs (attention). shared_ptr so that
// this header needs no complete type.
struct GemmPlanCache;
struct AttentionPlanCache;

// A stream that is destroyed when the last holder lets go: tensors freed
// after their CudaOps is gone still return memory in stream order.
using SharedStream = std::shared_ptr<CUstream_st>;


class CudaOps : public Ops {
 public:
  // `fold_slot`: from context->fold_slots, given back when this is destroyed.
  CudaOps(std::shared_ptr<CudaContext> context, SharedStream stream, GridFoldSlot* fold_slot);
  ~CudaOps() override;

  std::string device_name() const override;
  bool AppliesRelativeBiasByTable() const override;

  absl::Status Upload(const void* src, Tensor* dst) override;
  absl::Status Download(const Tensor& src, void* dst) override;
  absl::Status Copy(const Tensor& src, Tensor* dst) override;
  absl::Status CopyAll(const std::vector<const Tensor*>& src,
                       const std::vector<Tensor*>& dst) override;
  absl::Status CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) override;
  absl::Status Synchronize() override;
  // step_record.cc: a CUDA graph captured from this stream (relaxed mode:
  // other sessions' threads may allocate meanwhile) and replayed on it.
  absl::StatusOr<std::unique_ptr<StepRecord>> CaptureStep(
      const std::function<absl::Status()>& step) override;
  absl::Status Replay(StepRecord& record) override;
  // FAILED_PRECONDITION naming `op` while a step is being recorded: host
  // copies and waits cannot be part of one (Upload, Download, Synchronize).
  absl::Status NotRecording(const char* op) const;
  // The device's caching allocator (every session on this GPU).
  DeviceMemoryStats device_memory_stats() const override;
  void ResetDevicePeaks() override;

  // staging.cc. AllocateStaging: page-locked host memory (cudaHostAlloc,
  // portable), from the device's pool when a released buffer of that size is
  // there; host memory, so not counted against the memory limit.
  // RESOURCE_EXHAUSTED when the host cannot pin that much. The buffer goes
  // back to the pool when the last pointer to it goes away, which must be
  // after every UploadAsync reading it has finished (a Synchronize()).
  absl::StatusOr<std::shared_ptr<void>> AllocateStaging(size_t bytes) override;
  // UploadAsync is Ops's, Upload: its cudaMemcpyAsync on this stream, from
  // page-locked memory, returns at once and the DMA engine reads `src` later,
  // in stream order, so `src` must stay unchanged until the next
  // Synchronize() (as ops.h states).
  // NewCompletion: a CUDA event (no timing); DownloadAsync: a
  // cudaMemcpyAsync on this stream, then the event recorded behind it, which
  // Wait() waits for.
  absl::StatusOr<std::unique_ptr<Completion>> NewCompletion() override;
  absl::Status DownloadAsync(const Tensor& src, void* dst, Completion* done) override;

  // elementwise.cu
  absl::Status Fill(float value, Tensor* y) override;
  absl::Status AddScalarI32(int32_t value, Tensor* y) override;
  absl::Status Cast(const Tensor& x, Tensor* y) override;
  absl::Status Axpby(float alpha, const Tensor& a, float beta, const Tensor& b,
                     Tensor* y) override;
  absl::Status Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) override;
  absl::Status SumRows(const Tensor& x, Tensor* y) override;
  absl::Status Dot(const Tensor& a, const Tensor& b, Tensor* out) override;

  // numpy_elementwise.cu
  absl::Status Binary(const BinaryArgs& args, const Tensor& a, const Tensor& b,
                      Tensor* y) override;
  absl::Status BinaryBackward(const BinaryArgs& args, const Tensor& dy, const Tensor& a,
                              const Tensor& b, Tensor* da, Tensor* db) override;
  absl::Status Unary(UnaryOp op, const Tensor& x, Tensor* y) override;
  absl::Status UnaryBackward(UnaryOp op, const Tensor& dy, const Tensor& x, Tensor* dx) override;
  absl::Status Where(const WhereArgs& args, const Tensor& cond, const Tensor& x, const Tensor& y,
                     Tensor* out) override;
  // numpy_reduce.cu
  absl::Status Reduce(ReduceOp op, const Tensor& x, Tensor* y) override;
  absl::Status Softmax(bool log, int axis, const Tensor& x, Tensor* y) override;
  absl::Status SoftmaxBackward(bool log, int axis, const Tensor& dy, const Tensor& y,
                               Tensor* dx) override;
  // numpy_slice.cu
  absl::Status Slice(const Tensor& x, const std::vector<int64_t>& start,
                     const std::vector<int64_t>& stride, Tensor* y) override;
  absl::Status SliceBackward(const Tensor& dy, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& stride, Tensor* dx) override;

  // fp8.cu
  absl::Status Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) override;
  absl::Status QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                 Tensor* y_t) override;
  absl::Status QuantizeTransposeDbias(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                      Tensor* y_t, Tensor* dbias) override;
  absl::Status QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                     const KeptQuantization& kept, Tensor* y,
                                     Tensor* y_t) override;
  // fp8_kept_many.cu
  absl::Status QuantizeTransposeKeptMany(const std::vector<KeptQuantizeItem>& items) override;
  absl::Status Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) override;
  absl::Status Amax(const Tensor& x, Tensor* amax) override;
  absl::Status ScaleFromAmax(const Tensor& amax, float fp8_max, float margin, float epsilon,
                             Tensor* scale, Tensor* scale_inv) override;
  absl::Status DelayedScalingUpdate(const DelayedScalingArgs& args, Tensor* amax_history,
                                    Tensor* scale, Tensor* scale_inv) override;
  absl::Status DelayedScalingUpdates(const std::vector<DelayedScalingItem>& items,
                                     Tensor* non_finite) override;
  absl::Status FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x, Tensor* y) override;

  // gemm.cu
  absl::Status Gemm(const GemmArgs& args, Tensor* out) override;

  // norm.cu
  absl::Status NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                           const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                           const Fp8Output* fp8) override;
  absl::Status NormForwardTransposed(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                     const Tensor& beta, const Fp8Output& fp8, Tensor* y,
                                     Tensor* y_t, Tensor* mu, Tensor* rsigma) override;
  absl::Status NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                            const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                            Tensor* dx, Tensor* dgamma, Tensor* dbeta,
                            const Tensor& residual_grad = Tensor()) override;

  // activation.cu
  absl::Status ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                 Tensor* y, const Fp8Output* fp8) override;
  absl::Status ActivationForwardTransposed(const std::vector<Activation>& acts, const Tensor& x,
                                           const Fp8Output& fp8, Tensor* y,
                                           Tensor* y_t) override;
  absl::Status ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                  const Tensor& x, Tensor* dx) override;
  absl::Status ActivationBackwardQuantizeTranspose(const std::vector<Activation>& acts,
                                                   Tensor* dy, const Tensor& x,
                                                   const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                                   Tensor* dbias) override;

  // dropout.cu
  absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                              Tensor* mask) override;
  absl::Status DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                               Tensor* dx) override;

  // attention.cu
  absl::Status AttentionForward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                const Tensor& v, Tensor* out, Tensor* softmax_lse) override;
  absl::Status AttentionBackward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& out, const Tensor& dout,
                                 const Tensor& softmax_lse, Tensor* dq, Tensor* dk, Tensor* dv,
                                 Tensor* dbias) override;
  absl::Status AttentionForwardPacked(const AttentionArgs& args, const Tensor& qkv, Tensor* out,
                                      Tensor* softmax_lse) override;
  absl::Status AttentionBackwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                       const Tensor& out, const Tensor& dout,
                                       const Tensor& softmax_lse, Tensor* dqkv,
                                       Tensor* dbias) override;
  absl::Status AttentionBackwardRelative(const AttentionArgs& args, const Tensor& q,
                                         const Tensor& k, const Tensor& v, const Tensor& out,
                                         const Tensor& dout, const Tensor& softmax_lse,
                                         const RelativeBuckets& relative, Tensor* dq, Tensor* dk,
                                         Tensor* dv, Tensor* dtable) override;
  absl::Status AttentionBackwardPackedRelative(const AttentionArgs& args, const Tensor& qkv,
                                               const Tensor& out, const Tensor& dout,
                                               const Tensor& softmax_lse,
                                               const RelativeBuckets& relative, Tensor* dqkv,
                                               Tensor* dtable) override;

  // optimizer.cu
  absl::Status OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                               const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                               Tensor* nu) override;
  absl::StatusOr<std::unique_ptr<OptimizerPlan>> NewOptimizerPlan(
      const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
      const Tensor& count, const Tensor& total_notfinite) override;
  absl::Status OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                             const std::vector<Tensor>& grads, Tensor* count,
                             Tensor* total_notfinite) override;

  // position.cu
  absl::Status Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) override;
  absl::StatusOr<Tensor> RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim) override;
  absl::Status RotaryQkInPlace(const RotaryArgs& args, Tensor* qkv) override;
  // rotary_quantize.cu
  absl::Status RotaryQkQuantizeTranspose(const RotaryArgs& args, Tensor* qkv,
                                         const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                         Tensor* dbias) override;
  absl::Status DecodeQkvRows(const Tensor& qkv, const RotaryArgs* rotary, const Tensor& position,
                             Tensor* q, Tensor* key_cache, Tensor* value_cache) override;
  absl::Status DecodeAttentionFromQkv(const AttentionArgs& args, const Tensor& qkv,
                                      const RotaryArgs* rotary, const Tensor& position,
                                      Tensor* q, Tensor* key_cache, Tensor* value_cache,
                                      Tensor* out, Tensor* softmax_lse) override;
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

  // ---- for the op files ---------------------------------------------------
  // Every op calls Enter() first: it makes this device current on the calling
  // thread (sessions of several GPUs share threads) and answers UNAVAILABLE
  // once the device has had a sticky error.
  absl::Status Enter() const;
  cudaStream_t stream() const { return stream_.get(); }
  int ordinal() const { return context_->ordinal; }
  const CudaContext& context() const { return *context_; }
  // The device's streaming multiprocessors, from the cudaDeviceProp read once
  // when the device was opened: launch geometry sizes grids by it (no host
  // query per launch).
  int sm_count() const { return context_->properties.multiProcessorCount; }
  SmCount sms() const { return SmCount{sm_count()}; }
  // Blocks of `threads` for a grid-stride kernel over n items on this device
  // (cuda::GridFor in common.cuh with sm_count()). Defined in common.cuh.
  inline unsigned GridFor(int64_t n, int threads = 256) const;
  cublasLtHandle_t cublaslt() const { return context_->cublaslt; }
  // An FP8 output's amax for a kernel on this stream (common.cuh's
  // FoldAmax): fp8's amax (none when undefined) with this stream's slot.
  AmaxOut AmaxOutFor(const Fp8Output& fp8) const {
    return fp8.amax.defined() ? AmaxOut{fp8.amax.data_as<float>(), fold_slot_} : AmaxOut{};
  }
  // This stream's group counters (GridFoldSlot::groups_done, kFoldGroups of
  // them, at zero between kernels) for a kernel whose last block per group
  // folds the group's result.
  unsigned* fold_groups() const { return fold_slot_->groups_done; }
  // This stream's cuDNN handle, created on first use.
  absl::StatusOr<cudnnHandle_t> CudnnHandle();
  // A library workspace of at least `bytes` on this stream, grown on demand and
  // kept (stream order makes reuse by the next op safe). Allocated through
  // Allocate, so it counts in bytes_in_use() and a growth past the memory
  // limit is RESOURCE_EXHAUSTED; ops size their requests with workspace.h.
  absl::StatusOr<void*> Workspace(size_t bytes);
  size_t workspace_bytes() const { return workspace_bytes_; }
  int64_t scratch_bytes() const override { return static_cast<int64_t>(workspace_bytes_); }
  absl::Status ShrinkScratch(int64_t bytes) override;
  // Lazily filled by gemm.cu / attention.cu.
  std::shared_ptr<GemmPlanCache>& gemm_plans() { return gemm_plans_; }
  std::shared_ptr<AttentionPlanCache>& attention_plans() { return attention_plans_; }

 protected:
  absl::StatusOr<std::shared_ptr<void>> AllocateBytes(size_t bytes) override;

 private:
  // fp8.cu: DelayedScalingUpdate(s) in launches of up to 48 quantizers.
  absl::Status LaunchDelayedScaling(const std::vector<DelayedScalingItem>& items,
                                    Tensor* scale_inv, Tensor* non_finite);

  std::shared_ptr<CudaContext> context_;
  SharedStream stream_;
  cudnnHandle_t cudnn_ = nullptr;
  std::shared_ptr<void> workspace_;
  size_t workspace_bytes_ = 0;
  GridFoldSlot* const fold_slot_;
  std::shared_ptr<CompletionEventPool> completion_events_;  // made on first use
  std::shared_ptr<StagedUploads> staged_uploads_;            // made on first use
  bool capturing_ = false;  // inside CaptureStep
  std::shared_ptr<GemmPlanCache> gemm_plans_;
  std::shared_ptr<AttentionPlanCache> attention_plans_;
};

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_CUDA_OPS_H_
