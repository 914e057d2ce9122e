// CudaOps: the per-stream state (memory, cuDNN handle, workspace). The ops
// themselves live in the .cu files named in cuda_ops.h.
#include "kernels/cuda/cuda_ops.h"

#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {

CudaContext::~CudaContext() {
  if (cublaslt != nullptr) {
    (void)cudaSetDevice(ordinal);
    (void)cublasLtDestroy(cublaslt);
  }
}

absl::StatusOr<std::shared_ptr<FoldSlotPool>> FoldSlotPool::Make(int ordinal) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  void* base = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMalloc(&base, kSlots * sizeof(GridFoldSlot)));
  const cudaError_t zeroed = cudaMemset(base, 0, kSlots * sizeof(GridFoldSlot));
  if (zeroed != cudaSuccess) {
    (void)cudaFree(base);
    return CudaErrorToStatus(zeroed, "cudaMemset(fold slots)", __FILE__, __LINE__);
  }
  return std::shared_ptr<FoldSlotPool>(
      new FoldSlotPool(ordinal, static_cast<GridFoldSlot*>(base)));
}

FoldSlotPool::FoldSlotPool(int ordinal, GridFoldSlot* base) : ordinal_(ordinal), base_(base) {
  free_.reserve(kSlots);
  for (int i = kSlots - 1; i >= 0; --i) free_.push_back(base_ + i);
}

FoldSlotPool::~FoldSlotPool() {
  (void)cudaSetDevice(ordinal_);
  (void)cudaFree(base_);
}

absl::StatusOr<GridFoldSlot*> FoldSlotPool::Take() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuda:", ordinal_, " already has ", kSlots, " streams open"));
  }
  GridFoldSlot* slot = free_.back();
  free_.pop_back();
  return slot;
}

void FoldSlotPool::Give(GridFoldSlot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(slot);
}

CudaOps::CudaOps(std::shared_ptr<CudaContext> context, SharedStream stream,
                 GridFoldSlot* fold_slot)
    : context_(std::move(context)), stream_(std::move(stream)), fold_slot_(fold_slot) {}

CudaOps::~CudaOps() {
  // Library objects must not be destroyed while queued work uses them; after
  // the wait, this stream's freed blocks are idle for every other stream.
  (void)cudaSetDevice(context_->ordinal);
  (void)cudaStreamSynchronize(stream_.get());
  workspace_.reset();
  context_->fold_slots->Give(fold_slot_);
  gemm_plans_.reset();
  attention_plans_.reset();
  if (cudnn_ != nullptr) (void)cudnnDestroy(cudnn_);
  context_->allocator->ForgetStream(stream_.get());
}

std::string CudaOps::device_name() const { return absl::StrCat("cuda:", context_->ordinal); }

absl::Status CudaOps::Enter() const {
  if (!DeviceHealthy(context_->ordinal)) {
    return absl::UnavailableError(absl::StrCat(
        device_name(), " hit a sticky CUDA error earlier and cannot run work until the server "
                       "restarts"));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(context_->ordinal));
  return absl::OkStatus();
}

absl::Status CudaOps::NotRecording(const char* op) const {
  if (!capturing_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      op, " inside a recorded step: a replay would neither wait for the device nor read the "
          "host again"));
}

absl::Status CudaOps::Synchronize() {
  RETURN_IF_ERROR(NotRecording("Synchronize"));
  RETURN_IF_ERROR(Enter());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_.get()));
  return absl::OkStatus();
}

DeviceMemoryStats CudaOps::device_memory_stats() const {
  const CachingAllocator::Stats a = context_->allocator->stats();
  DeviceMemoryStats stats;
  stats.bytes_in_use = a.bytes_in_use;
  stats.peak_bytes_in_use = a.peak_bytes_in_use;
  stats.bytes_reserved = a.bytes_reserved;
  stats.peak_bytes_reserved = a.peak_bytes_reserved;
  return stats;
}

void CudaOps::ResetDevicePeaks() { context_->allocator->ResetPeaks(); }

absl::StatusOr<cudnnHandle_t> CudaOps::CudnnHandle() {
  if (cudnn_ == nullptr) {
    RETURN_IF_ERROR(Enter());
    cudnnHandle_t handle = nullptr;
    CUDNN_RETURN_IF_ERROR(cudnnCreate(&handle));
    const cudnnStatus_t bound = cudnnSetStream(handle, stream_.get());
    if (bound != CUDNN_STATUS_SUCCESS) {
      (void)cudnnDestroy(handle);
      return CudnnErrorToStatus(bound, "cudnnSetStream(handle, stream)", __FILE__, __LINE__);
    }
    cudnn_ = handle;
  }
  return cudnn_;
}

absl::StatusOr<void*> CudaOps::Workspace(size_t bytes) {
  if (bytes <= workspace_bytes_) return workspace_.get();
  RETURN_IF_ERROR(Enter());
  // The old block returns to the cache in stream order: ops queued before
  // this one finish with it first.
  workspace_.reset();
  workspace_bytes_ = 0;
  // Through Allocate, so the workspace is the session's memory like its
  // tensors (session.h contract 3): charged while held, refused past the
  // limit.
  absl::StatusOr<Tensor> block = Allocate(DType::kBool, {static_cast<int64_t>(bytes)});
  if (!block.ok()) {
    if (!absl::IsResourceExhausted(block.status())) return block.status();
    return absl::ResourceExhaustedError(absl::StrCat("the op's workspace of ", bytes,
                                                     " bytes: ", block.status().message()));
  }
  // The block goes back (uncharged) when the last holder of the Tensor does.
  workspace_ = std::shared_ptr<void>(block->data(), [held = *std::move(block)](void*) {});
  workspace_bytes_ = bytes;
  return workspace_.get();
}

absl::Status CudaOps::ShrinkScratch(int64_t bytes) {
  if (bytes < 0 || static_cast<size_t>(bytes) >= workspace_bytes_) return absl::OkStatus();
  // The grown block goes back in stream order, as when it grows; one of the
  // old size takes its place (it fits: the larger one was just returned).
  workspace_.reset();
  workspace_bytes_ = 0;
  if (bytes == 0) return absl::OkStatus();
  return Workspace(static_cast<size_t>(bytes)).status();
}

absl::StatusOr<std::shared_ptr<void>> CudaOps::AllocateBytes(size_t bytes) {
  RETURN_IF_ERROR(Enter());
  return context_->allocator->Allocate(bytes, stream_, /*recording=*/capturing_);
}

}  // namespace cuda
}  // namespace te
