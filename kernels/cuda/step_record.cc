// CudaOps::CaptureStep / Replay: a step recorded as a CUDA graph from this
// Ops' stream, then issued again as one cudaGraphLaunch.
#include <cuda_runtime_api.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

class CudaStepRecord final : public Ops::StepRecord {
 public:
  CudaStepRecord(int ordinal, cudaStream_t stream) : ordinal_(ordinal), stream_(stream) {}
  ~CudaStepRecord() override {
    // A replay still in flight finishes first: the executable graph is
    // freed on completion, and the held blocks return in stream order.
    (void)cudaSetDevice(ordinal_);
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
  }

  cudaStream_t stream() const { return stream_; }
  cudaGraphExec_t exec() const { return exec_; }
  std::vector<std::shared_ptr<void>>* held() { return &held_; }
  void KeepWorkspace(std::shared_ptr<void> workspace) { workspace_ = std::move(workspace); }
  absl::Status Instantiate(cudaGraph_t graph) {
    graph_ = graph;
    CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec_, graph_, 0));
    return absl::OkStatus();
  }

 private:
  const int ordinal_;
  const cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  // Every block the recorded launches read or write: what the step
  // allocated, and the library workspace as it was when recording began
  // (a later growth replaces CudaOps' block, not the one recorded).
  std::vector<std::shared_ptr<void>> held_;
  std::shared_ptr<void> workspace_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Ops::StepRecord>> CudaOps::CaptureStep(
    const std::function<absl::Status()>& step) {
  RETURN_IF_ERROR(Enter());
  if (capturing_) return absl::FailedPreconditionError("CaptureStep: already recording a step");
  auto record = std::make_unique<CudaStepRecord>(ordinal(), stream());
  record->KeepWorkspace(workspace_);
  // No other session may synchronise the device while this stream records
  // (the allocator's releases wait for the recording to end).
  CachingAllocator& allocator = *context_->allocator;
  allocator.BeginCapture(stream());
  const cudaError_t began = cudaStreamBeginCapture(stream(), cudaStreamCaptureModeRelaxed);
  if (began != cudaSuccess) {
    allocator.EndCapture(stream());
    return CudaErrorToStatus(began, "cudaStreamBeginCapture", __FILE__, __LINE__);
  }
  capturing_ = true;
  set_allocation_hold(record->held());
  const absl::Status ran = step();
  set_allocation_hold(nullptr);
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream(), &graph);
  allocator.EndCapture(stream());
  // A call the capture refused left its error behind; it is not the next
  // launch's.
  (void)cudaGetLastError();
  if (!ran.ok() || ended != cudaSuccess) {
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    const absl::Status why = !ran.ok() ? ran : CudaErrorToStatus(ended, "cudaStreamEndCapture",
                                                                 __FILE__, __LINE__);
    return absl::Status(why.code(), absl::StrCat("recording a step on ", device_name(),
                                                 " failed: ", why.message()));
  }
  // The workspace recorded may be a later, larger one: keep that too.
  record->held()->push_back(workspace_);
  RETURN_IF_ERROR(record->Instantiate(graph));
  return std::unique_ptr<Ops::StepRecord>(std::move(record));
}

absl::Status CudaOps::Replay(StepRecord& record) {
  auto* recorded = dynamic_cast<CudaStepRecord*>(&record);
  if (recorded == nullptr || recorded->stream() != stream()) {
    return absl::InvalidArgumentError("Replay: the record was made on another stream");
  }
  RETURN_IF_ERROR(Enter());
  CUDA_RETURN_IF_ERROR(cudaGraphLaunch(recorded->exec(), stream()));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
