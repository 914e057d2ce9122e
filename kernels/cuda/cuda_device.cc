// The CUDA device: opening a GPU (or saying why not), and one stream per Ops.
// These strong definitions replace the weak fallbacks in kernels/cpu when the
// CUDA backend is linked in.
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

class CudaDevice : public Device {
 public:
  explicit CudaDevice(std::shared_ptr<CudaContext> context) : context_(std::move(context)) {}

  DeviceInfo info() const override {
    const cudaDeviceProp& prop = context_->properties;
    DeviceInfo info;
    info.name = absl::StrCat("cuda:", context_->ordinal);
    info.description = prop.name;
    info.compute_capability = prop.major * 10 + prop.minor;
    info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
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
    auto ops = std::make_unique<CudaOps>(context_, std::move(stream));
    ops->set_memory_limit(memory_limit);
    return std::unique_ptr<Ops>(std::move(ops));
  }

  bool healthy() const override { return DeviceHealthy(context_->ordinal); }

 private:
  std::shared_ptr<CudaContext> context_;
};

}  // namespace

}  // namespace cuda

absl::StatusOr<std::unique_ptr<Device>> OpenCudaDevice(int ordinal) {
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
  auto context = std::make_shared<cuda::CudaContext>();
  context->ordinal = ordinal;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&context->properties, ordinal));
  context->allocator = std::make_shared<cuda::CachingAllocator>(ordinal);
  CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&context->cublaslt));
  return std::unique_ptr<Device>(std::make_unique<cuda::CudaDevice>(std::move(context)));
}

bool CudaBackendBuilt() { return true; }

}  // namespace te
