// LayerNorm / RMSNorm over the last dimension of x [N, H].
//
// Forward: one block per row; the row's statistics by block reduction (mean,
// then the centred second moment, as the CPU reference computes them), then
// y = (x - mu) * rsigma * g + beta, written as float or, fused, as FP8 with
// amax (TE's norm + quantize).
// Backward: one block per row again for dx; dgamma / dbeta are summed per block
// into a partial row [blocks, H] (shared memory, each column owned by one
// thread: no atomics), then a second kernel adds the partials in block order,
// so the result is deterministic.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/args.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// Shared memory above this needs an opt-in per kernel; above the second limit
// the backward partials stay in global memory instead.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// x, y: [rows, cols]; gamma, beta: [cols] (beta null for RMSNorm); mu, rsigma:
// [rows] or null. FP8 y: scale, amax (zeroed before), scale_inv non-null.
template <typename In, typename G, typename Out>
__global__ void NormForwardKernel(const typename In::Storage* x, const typename G::Storage* gamma,
                                  const typename G::Storage* beta, typename Out::Storage* y,
                                  float* mu, float* rsigma, int64_t rows, int64_t cols,
                                  float epsilon, bool layernorm, bool zero_centered,
                                  const float* scale, float* amax, float* scale_inv) {
  __shared__ float sum_scratch[32];
  __shared__ unsigned max_scratch[32];
  const float s = scale != nullptr ? *scale : 1.0f;
  unsigned amax_bits = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const typename In::Storage* row = x + r * cols;
    float mean = 0.0f;
    if (layernorm) {
      float sum = 0.0f;
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += In::Load(row[c]);
      mean = BlockSum(sum, sum_scratch) / static_cast<float>(cols);
    }
    float sq = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float d = In::Load(row[c]) - mean;
      sq += d * d;
    }
    const float second_moment = BlockSum(sq, sum_scratch) / static_cast<float>(cols);
    const float rs = 1.0f / sqrtf(second_moment + epsilon);
    if (threadIdx.x == 0) {
      if (mu != nullptr) mu[r] = mean;
      if (rsigma != nullptr) rsigma[r] = rs;
    }
    typename Out::Storage* out = y + r * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = G::Load(gamma[c]);
      if (zero_centered) g += 1.0f;
      float v = (In::Load(row[c]) - mean) * rs * g;
      if (beta != nullptr) v += G::Load(beta[c]);
      amax_bits = max(amax_bits, AbsBits(v));
      out[c] = Out::Store(v * s);
    }
  }
  if (amax != nullptr) {
    amax_bits = BlockMaxBits(amax_bits, max_scratch);
    if (threadIdx.x == 0) {
      AtomicMaxAbsBits(amax, amax_bits);
      if (blockIdx.x == 0) *scale_inv = 1.0f / s;
    }
  }
}

// dx for each row; this block's dgamma / dbeta sums over its rows into
// partial[blockIdx.x] (dgamma) and partial[gridDim.x + blockIdx.x] (dbeta),
// each [cols]. With `shared_partials`, the sums accumulate in shared memory
// (2 * cols floats) and are copied out at the end.
template <typename In, typename G, typename Out>
__global__ void NormBackwardKernel(const typename In::Storage* dy, const typename In::Storage* x,
                                   const float* mu, const float* rsigma,
                                   const typename G::Storage* gamma, typename Out::Storage* dx,
                                   float* partial, int64_t rows, int64_t cols, bool layernorm,
                                   bool zero_centered, bool shared_partials) {
  extern __shared__ float shared[];
  __shared__ float scratch[32];
  float* dgamma_acc = shared_partials ? shared : partial + blockIdx.x * cols;
  float* dbeta_acc = shared_partials ? shared + cols : partial + (gridDim.x + blockIdx.x) * cols;
  // Each column is touched only by thread (c % blockDim.x): no races.
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    dgamma_acc[c] = 0.0f;
    dbeta_acc[c] = 0.0f;
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float m = layernorm ? mu[r] : 0.0f;
    const float rs = rsigma[r];
    const typename In::Storage* x_row = x + r * cols;
    const typename In::Storage* dy_row = dy + r * cols;
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = G::Load(gamma[c]);
      if (zero_centered) g += 1.0f;
      const float xhat = (In::Load(x_row[c]) - m) * rs;
      const float d = In::Load(dy_row[c]);
      const float dxhat = d * g;
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      dgamma_acc[c] += d * xhat;
      dbeta_acc[c] += d;
    }
    const float mean_dxhat =
        layernorm ? BlockSum(sum_dxhat, scratch) / static_cast<float>(cols) : 0.0f;
    const float mean_dxhat_xhat = BlockSum(sum_dxhat_xhat, scratch) / static_cast<float>(cols);
    typename Out::Storage* dx_row = dx + r * cols;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float g = G::Load(gamma[c]);
      if (zero_centered) g += 1.0f;
      const float xhat = (In::Load(x_row[c]) - m) * rs;
      const float dxhat = In::Load(dy_row[c]) * g;
      dx_row[c] = Out::Store(rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
  }
  if (shared_partials) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      partial[blockIdx.x * cols + c] = dgamma_acc[c];
      partial[(gridDim.x + blockIdx.x) * cols + c] = dbeta_acc[c];
    }
  }
}

// dgamma[c] = sum over blocks of partial[b, c]; dbeta likewise from the second
// half. In block order: deterministic.
template <typename Out>
__global__ void NormParamGradKernel(const float* partial, int blocks, int64_t cols,
                                    typename Out::Storage* dgamma, typename Out::Storage* dbeta) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  float dg = 0.0f, db = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    dg += partial[b * cols + c];
    db += partial[(blocks + b) * cols + c];
  }
  dgamma[c] = Out::Store(dg);
  if (dbeta != nullptr) dbeta[c] = Out::Store(db);
}

int RowThreads(int64_t cols) { return cols >= 1024 ? 256 : 128; }

}  // namespace

absl::Status CudaOps::NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                  const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                                  const Fp8Output* fp8) {
  const char* op = "NormForward";
  const bool layernorm = args.type == NormType::kLayerNorm;
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  if (x.rank() < 1) return absl::InvalidArgumentError("NormForward: x is a scalar, want [N, H]");
  const int64_t cols = x.dim(-1);
  const int64_t rows = Rows(x);
  RETURN_IF_ERROR(RequireFloat(op, "gamma", &gamma));
  RETURN_IF_ERROR(RequireShape(op, "gamma", gamma, {cols}));
  if (layernorm) {
    RETURN_IF_ERROR(RequireFloat(op, "beta", &beta));
    RETURN_IF_ERROR(RequireShape(op, "beta", beta, {cols}));
    if (beta.dtype() != gamma.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat("NormForward: beta has dtype ",
                                                     DTypeName(beta.dtype()), ", want gamma's ",
                                                     DTypeName(gamma.dtype())));
    }
  } else if (beta.data() != nullptr) {
    return absl::InvalidArgumentError("NormForward: beta is given for RMSNorm, which has none");
  }
  RETURN_IF_ERROR(CheckOutput(op, y, fp8));
  RETURN_IF_ERROR(RequireShape(op, "y", *y, x.shape()));
  const bool want_mu = layernorm && Wanted(mu);
  const bool want_rsigma = Wanted(rsigma);
  if (want_mu) {
    RETURN_IF_ERROR(RequireDType(op, "mu", mu, DType::kF32));
    RETURN_IF_ERROR(RequireShape(op, "mu", *mu, {rows}));
  }
  if (want_rsigma) {
    RETURN_IF_ERROR(RequireDType(op, "rsigma", rsigma, DType::kF32));
    RETURN_IF_ERROR(RequireShape(op, "rsigma", *rsigma, {rows}));
  }
  if (!(args.epsilon >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NormForward: epsilon is ", args.epsilon, ", want >= 0"));
  }
  RETURN_IF_ERROR(Enter());
  const bool quantized = IsFloat8(y->dtype());
  if (quantized) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(fp8->amax.data(), 0, sizeof(float), stream()));
  }
  // An FP8 y with no rows still gets amax 0 and its scale_inv: one idle block.
  if (!quantized && (rows == 0 || cols == 0)) return absl::OkStatus();
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, 132 * 16)));
  const int threads = RowThreads(cols);
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloatOrFp8(y->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        NormForwardKernel<In, G, Out><<<blocks, threads, 0, stream()>>>(
            static_cast<const typename In::Storage*>(x.data()),
            static_cast<const typename G::Storage*>(gamma.data()),
            layernorm ? static_cast<const typename G::Storage*>(beta.data()) : nullptr,
            static_cast<typename Out::Storage*>(y->data()),
            want_mu ? mu->data_as<float>() : nullptr,
            want_rsigma ? rsigma->data_as<float>() : nullptr, rows, cols, args.epsilon,
            layernorm, args.zero_centered_gamma,
            quantized ? fp8->scale.data_as<const float>() : nullptr,
            quantized ? fp8->amax.data_as<float>() : nullptr,
            quantized ? fp8->scale_inv.data_as<float>() : nullptr);
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                                   const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                                   Tensor* dx, Tensor* dgamma, Tensor* dbeta) {
  const char* op = "NormBackward";
  const bool layernorm = args.type == NormType::kLayerNorm;
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  if (x.rank() < 1) return absl::InvalidArgumentError("NormBackward: x is a scalar, want [N, H]");
  const int64_t cols = x.dim(-1);
  const int64_t rows = Rows(x);
  RETURN_IF_ERROR(RequireFloat(op, "dy", &dy));
  RETURN_IF_ERROR(RequireShape(op, "dy", dy, x.shape()));
  if (dy.dtype() != x.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("NormBackward: dy has dtype ",
                                                   DTypeName(dy.dtype()), ", want x's ",
                                                   DTypeName(x.dtype())));
  }
  if (layernorm) {
    RETURN_IF_ERROR(RequireDType(op, "mu", &mu, DType::kF32));
    RETURN_IF_ERROR(RequireShape(op, "mu", mu, {rows}));
  }
  RETURN_IF_ERROR(RequireDType(op, "rsigma", &rsigma, DType::kF32));
  RETURN_IF_ERROR(RequireShape(op, "rsigma", rsigma, {rows}));
  RETURN_IF_ERROR(RequireFloat(op, "gamma", &gamma));
  RETURN_IF_ERROR(RequireShape(op, "gamma", gamma, {cols}));
  RETURN_IF_ERROR(RequireFloat(op, "dx", dx));
  RETURN_IF_ERROR(RequireShape(op, "dx", *dx, x.shape()));
  RETURN_IF_ERROR(RequireFloat(op, "dgamma", dgamma));
  RETURN_IF_ERROR(RequireShape(op, "dgamma", *dgamma, {cols}));
  if (layernorm) {
    RETURN_IF_ERROR(RequireFloat(op, "dbeta", dbeta));
    RETURN_IF_ERROR(RequireShape(op, "dbeta", *dbeta, {cols}));
    if (dbeta->dtype() != dgamma->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat("NormBackward: dbeta has dtype ",
                                                     DTypeName(dbeta->dtype()), ", want dgamma's ",
                                                     DTypeName(dgamma->dtype())));
    }
  }
  if (cols == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  // Enough blocks to fill the GPU twice; each adds one partial row.
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 2 * 132)));
  const int threads = RowThreads(cols);
  ASSIGN_OR_RETURN(Tensor partial, Allocate(DType::kF32, {2 * blocks, cols}));
  const size_t shared_bytes = 2 * static_cast<size_t>(cols) * sizeof(float);
  const bool shared_partials = shared_bytes <= kMaxSharedBytes;
  absl::Status status;
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(gamma.dtype(), [&](auto g) {
      DispatchFloat(dx->dtype(), [&](auto out) {
        using In = decltype(in);
        using G = decltype(g);
        using Out = decltype(out);
        auto kernel = NormBackwardKernel<In, G, Out>;
        if (shared_partials && shared_bytes > kDefaultSharedBytes) {
          const cudaError_t e = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
          if (e != cudaSuccess) {
            status.Update(CudaErrorToStatus(e, "cudaFuncSetAttribute(NormBackwardKernel)",
                                            __FILE__, __LINE__));
            return;
          }
        }
        kernel<<<blocks, threads, shared_partials ? shared_bytes : 0, stream()>>>(
            static_cast<const typename In::Storage*>(dy.data()),
            static_cast<const typename In::Storage*>(x.data()),
            layernorm ? mu.data_as<const float>() : nullptr, rsigma.data_as<const float>(),
            static_cast<const typename G::Storage*>(gamma.data()),
            static_cast<typename Out::Storage*>(dx->data()), partial.data_as<float>(), rows, cols,
            layernorm, args.zero_centered_gamma, shared_partials);
      });
    });
  });
  RETURN_IF_ERROR(status);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  DispatchFloat(dgamma->dtype(), [&](auto out) {
    using Out = decltype(out);
    NormParamGradKernel<Out><<<(cols + kThreads - 1) / kThreads, kThreads, 0, stream()>>>(
        partial.data_as<const float>(), blocks, cols,
        static_cast<typename Out::Storage*>(dgamma->data()),
        layernorm ? static_cast<typename Out::Storage*>(dbeta->data()) : nullptr);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
