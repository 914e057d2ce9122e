// The CUDA device: opening a GPU (or saying why not), and one stream per Ops.
// Every session's Ops on a device draws on one SharedMemoryAccount (as the
// CPU device's sessions share the host's), sized when the device is opened
// from the memory the driver reports free then, less a reserve for what does
// not pass through Ops::Allocate (CudaDeviceOptions in kernels/ops.h). So
// sessions that each fit --session_memory_bytes cannot together exhaust the
// GPU: the allocation that would is RESOURCE_EXHAUSTED, naming what did not
// fit and what is left, before cudaMalloc or any kernel sees it.
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"  // SetRelativeSplit
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

class CudaDevice : public Device {
 public:
  CudaDevice(std::shared_ptr<CudaContext> context, std::shared_ptr<SharedMemoryAccount> memory)
      : context_(std::move(context)), memory_(std::move(memory)) {}

  DeviceInfo info() const override {
    const cudaDeviceProp& prop = context_->properties;
    DeviceInfo info;
    info.name = absl::StrCat("cuda:", context_->ordinal);
    info.description = prop.name;
    info.compute_capability = prop.major * 10 + prop.minor;
    // What the sessions may hold together (the CPU device reports the same).
    info.memory_bytes = memory_->limit;
    info.fp8_native = info.compute_capability >= 89;
    info.block_scaling_native = info.compute_capability >= 100;
    return info;
  }

  absl::StatusOr<std::unique_ptr<Ops>> NewOps(int64_t memory_limit) override {
    if (memory_limit <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("NewOps: memory_limit must be positive, got ", memory_limit));
    }
    if (!healthy()) {
      return absl::UnavailableError(absl::StrCat(
          "cuda:", context_->ordinal, " hit a sticky CUDA error and takes no new sessions"));
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(context_->ordinal));
    cudaStream_t raw = nullptr;
    // Non-blocking: a session's stream never waits on the legacy default stream.
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    const int ordinal = context_->ordinal;
    SharedStream stream(raw, [ordinal](cudaStream_t s) {
      (void)cudaSetDevice(ordinal);
      (void)cudaStreamDestroy(s);
    });
    ASSIGN_OR_RETURN(GridFoldSlot* const fold_slot, context_->fold_slots->Take());
    auto ops = std::make_unique<CudaOps>(context_, std::move(stream), fold_slot);
    ops->set_memory_limit(memory_limit);
    ops->set_shared_account(memory_);
    return std::unique_ptr<Ops>(std::move(ops));
  }

  bool healthy() const override { return DeviceHealthy(context_->ordinal); }

 private:
  std::shared_ptr<CudaContext> context_;
  const std::shared_ptr<SharedMemoryAccount> memory_;
};

}  // namespace

absl::StatusOr<int64_t> SessionsMemoryBytes(int ordinal, int64_t free_bytes,
                                            const CudaDeviceOptions& options) {
  if (options.memory_bytes < 0 || options.memory_reserve_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda:", ordinal, ": memory_bytes (", options.memory_bytes, ") and memory_reserve_bytes (",
        options.memory_reserve_bytes, ") must not be negative"));
  }
  const int64_t available = free_bytes - options.memory_reserve_bytes;
  if (available <= 0) {
    return absl::UnavailableError(absl::StrCat(
        "cuda:", ordinal, " has ", free_bytes, " bytes free, not more than the ",
        options.memory_reserve_bytes, " bytes kept back for the libraries (memory reserve)"));
  }
  if (options.memory_bytes == 0) return available;
  if (options.memory_bytes > available) {
    return absl::UnavailableError(absl::StrCat(
        "cuda:", ordinal, ": the sessions were given ", options.memory_bytes, " bytes, but only ",
        available, " are free beyond the ", options.memory_reserve_bytes, " byte reserve"));
  }
  return options.memory_bytes;
}

}  // namespace cuda

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal,
                                                       const CudaDeviceOptions& options) {
  // No driver, an old driver or no GPU all show up here as errors, never as a
  // crash: the server then runs on the CPU.
  int count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("cuda:", ordinal, " unavailable: ",
                                               cudaGetErrorName(probe), " (",
                                               cudaGetErrorString(probe), ")"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::UnavailableError(absl::StrCat("cuda:", ordinal, " unavailable: this host has ",
                                               count, " CUDA device(s)"));
  }
  cuda::SetRelativeSplit(options.relative_bias_split);
  auto context = std::make_shared<cuda::CudaContext>();
  context->ordinal = ordinal;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&context->properties, ordinal));
  CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&context->cublaslt));
  ASSIGN_OR_RETURN(context->fold_slots, cuda::FoldSlotPool::Make(ordinal));
  // Measured once the context, cuBLASLt and the amax slots exist, so none
  // counts against the sessions.
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  ASSIGN_OR_RETURN(const int64_t sessions_bytes,
                   cuda::SessionsMemoryBytes(ordinal, static_cast<int64_t>(free_bytes), options));
  // The allocator may cache up to what the driver had free less the reserve:
  // past that it gives its cache back before taking more.
  context->allocator = std::make_shared<cuda::CachingAllocator>(
      ordinal, static_cast<int64_t>(free_bytes) - options.memory_reserve_bytes);
  if (options.fault_after_launches >= 0) {
    cuda::InjectLaunchFault(ordinal, options.fault_after_launches);
  }
  return std::unique_ptr<Device>(std::make_unique<cuda::CudaDevice>(
      std::move(context), std::make_shared<SharedMemoryAccount>(sessions_bytes)));
}

bool CudaBackendBuilt() { return true; }

}  // namespace te
