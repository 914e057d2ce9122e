// FP8 scaling on the device: Quantize (fused amax), cast-transpose (with
// dbias), Dequantize, Amax, ScaleFromAmax, DelayedScalingUpdate(s) (no host
// sync; a step's updates in one launch) and emulated block scaling (MXFP8, NVFP4). The math follows the CPU reference exactly; see
// kernels/cpu/cpu_ops.cc for the definitions.
#include <algorithm>
#include <cfloat>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr int kMxfp8Block = kMxfp8BlockSize;
constexpr int kNvfp4Block = kNvfp4BlockSize;
constexpr int kE8M0MinExp = -127;
constexpr int kE8M0MaxExp = 127;
// DelayedScalingUpdate keeps the history in shared memory.
constexpr int64_t kMaxHistory = 32768;

// ---- kernels -------------------------------------------------------------------

// y = cast(x * scale); amax (or not recorded) = max |x|; scale_inv = 1 / scale.
// `vec`: x and y aligned for Pack access; the first n / kVec * kVec elements
// then move kVec at a time, the rest one at a time.
template <typename In, typename Out>
__global__ void QuantizeKernel(const typename In::Storage* x, typename Out::Storage* y,
                               const float* scale, AmaxOut amax, float* scale_inv, int64_t n,
                               bool vec) {
  __shared__ unsigned scratch[32];
  const float s = *scale;
  unsigned local = 0;
  MapElements<In, Out>(x, y, n, vec, [&](float v, int64_t) {
    local = max(local, AbsBits(v));
    return v * s;
  });
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) {
    FoldAmax(amax, local);
    if (blockIdx.x == 0) *scale_inv = 1.0f / s;
  }
}

template <typename In, typename Out>
__global__ void DequantizeKernel(const typename In::Storage* x, const float* scale_inv,
                                 typename Out::Storage* y, int64_t n) {
  const float s = *scale_inv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = Out::Store(In::Load(x[i]) * s);
  }
}

// amax = max |x|.
template <typename In>
__global__ void AmaxKernel(const typename In::Storage* x, AmaxOut amax, int64_t n) {
  __shared__ unsigned scratch[32];
  unsigned local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    local = max(local, AbsBits(In::Load(x[i])));
  }
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x == 0) FoldAmax(amax, local);
}

__global__ void ScaleFromAmaxKernel(const float* amax, float fp8_max, float margin,
                                    float epsilon, float* scale, float* scale_inv) {
  float a = *amax;
  if (a < epsilon) a = epsilon;
  float s = 1.0f;
  if (isfinite(a) && a > 0.0f) s = fminf(fp8_max * exp2f(-margin) / a, FLT_MAX);
  *scale = s;
  *scale_inv = 1.0f / s;
}

// The quantizers one DelayedScalingKernel launch updates: passed by value as
// the kernel's argument, so a step's updates need no upload and no host sync.
// 48 entries keep the argument under the 4 KiB every GPU takes.
constexpr int kScalingBatch = 48;
struct DelayedScalingBatch {
  float* history[kScalingBatch];
  float* scale[kScalingBatch];
  float* scale_inv[kScalingBatch];  // null: not wanted
  int length[kScalingBatch];
  float fp8_max[kScalingBatch];
  float margin[kScalingBatch];
  bool most_recent[kScalingBatch];
  float* non_finite;  // null, or [1]: += the quantizers whose amax was inf or NaN
};

// One block per quantizer: the window's amax, the roll, the new scale.
// history: [length], held in shared memory (the largest length of the batch).
__global__ void DelayedScalingKernel(DelayedScalingBatch batch) {
  extern __shared__ float window[];
  __shared__ unsigned scratch[32];
  const int q = blockIdx.x;
  float* history = batch.history[q];
  const int length = batch.length[q];
  unsigned local = 0;
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    window[i] = history[i];
    local = max(local, AbsBits(window[i]));
  }
  const unsigned max_bits = BlockMaxBits(local, scratch);  // syncs: window is complete
  // roll(-1): history[i] = old[i + 1], history[L - 1] = old[0]; then history[0] = 0.
  for (int i = threadIdx.x; i < length; i += blockDim.x) {
    history[i] = i == 0 ? 0.0f : window[(i + 1) % length];
  }
  if (threadIdx.x == 0) {
    const float amax = batch.most_recent[q] ? window[0] : __uint_as_float(max_bits);
    float s = *batch.scale[q];
    if (isfinite(amax) && amax > 0.0f) s = batch.fp8_max[q] * exp2f(-batch.margin[q]) / amax;
    if (!isfinite(amax) && batch.non_finite != nullptr) atomicAdd(batch.non_finite, 1.0f);
    *batch.scale[q] = s;
    if (batch.scale_inv[q] != nullptr) *batch.scale_inv[q] = 1.0f / s;
  }
}

// A block-scaled kernel's kBlock elements from x as floats; returns their
// max |v| as AbsBits.
template <typename In, int kBlock>
__device__ __forceinline__ unsigned LoadBlock(const typename In::Storage* x, float (&v)[kBlock]) {
  unsigned bits = 0;
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
    v[i] = In::Load(x[i]);
    bits = max(bits, AbsBits(v[i]));
  }
  return bits;
}
template <typename Out, int kBlock>
__device__ __forceinline__ void StoreBlock(const float (&v)[kBlock], typename Out::Storage* y) {
#pragma unroll
  for (int i = 0; i < kBlock; ++i) y[i] = Out::Store(v[i]);
}

// MXFP8: one thread per 32-element block along the rows. A zero block stays
// zero; a block with inf or NaN becomes NaN (no E8M0 scale exists for it).
template <typename In, typename Out>
__global__ void Mxfp8Kernel(const typename In::Storage* x, typename Out::Storage* y,
                            int64_t blocks) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    float v[kMxfp8Block];
    const float amax = __uint_as_float(LoadBlock<In>(x + b * kMxfp8Block, v));
    if (amax != 0.0f) {
      if (!isfinite(amax)) {
#pragma unroll
        for (int i = 0; i < kMxfp8Block; ++i) v[i] = NAN;
      } else {
        // TE's scale (float_to_e8m0 rounding up): 2^e, e = ceil(log2(amax / 448)),
        // so the block max never saturates. amax / 448 = f * 2^e2, f in
        // [0.5, 1): the ceiling is e2, or e2 - 1 when f is exactly 0.5.
        int e2;
        const double f = frexp(static_cast<double>(amax) / kE4M3Max, &e2);
        const int exp = min(max(f == 0.5 ? e2 - 1 : e2, kE8M0MinExp), kE8M0MaxExp);
#pragma unroll
        for (int i = 0; i < kMxfp8Block; ++i) {
          const float q = E4M3::Load(E4M3::Store(ldexpf(v[i], -exp)));
          v[i] = ldexpf(q, exp);
        }
      }
    }
    StoreBlock<Out>(v, y + b * kMxfp8Block);
  }
}

// NVFP4: global encode scale S from the tensor's amax, then per 16-element
// block a decode scale s = E4M3(block_amax / 6 * S); y = E2M1(x S / s) s / S.
template <typename In, typename Out>
__global__ void Nvfp4Kernel(const typename In::Storage* x, const float* tensor_amax,
                            typename Out::Storage* y, int64_t blocks) {
  const float amax = *tensor_amax;
  float global = fminf(kE4M3Max * kE2M1Max / amax, FLT_MAX);
  if (amax == 0.0f || global == 0.0f) global = 1.0f;
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < blocks;
       b += int64_t(gridDim.x) * blockDim.x) {
    float v[kNvfp4Block];
    const unsigned bits = LoadBlock<In>(x + b * kNvfp4Block, v);
    if (isnan(amax)) {
#pragma unroll
      for (int i = 0; i < kNvfp4Block; ++i) v[i] = NAN;
    } else {
      const float block_amax = __uint_as_float(bits);
      const float block_scale = E4M3::Load(E4M3::Store(block_amax / kE2M1Max * global));
      if (block_scale == 0.0f) {
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i) v[i] = 0.0f;
      } else {
        const float encode = global / block_scale;
        const float decode = block_scale / global;
#pragma unroll
        for (int i = 0; i < kNvfp4Block; ++i) v[i] = RoundToE2M1(v[i] * encode) * decode;
      }
    }
    StoreBlock<Out>(v, y + b * kNvfp4Block);
  }
}

// One cast-transpose of x [rows, cols] (shapes TileKernelFits takes);
// column_partial: null, or [CastTransposePartialRows, cols] f32; kept: null,
// or QuantizeTransposeKept's record of y's scale and amax.
void LaunchQuantizeTranspose(const Tensor& x, const Fp8Output& fp8, AmaxOut amax, Tensor* y,
                             Tensor* y_t, float* column_partial, const CudaContext& device,
                             cudaStream_t stream, const Ops::KeptQuantization* kept = nullptr) {
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFp8(y->dtype(), [&](auto out) {
      auto launch = [&](auto column_sums) {
        LaunchCastTranspose<decltype(in), decltype(out), decltype(column_sums)::value>(
            device, stream, x, y, y_t, fp8.scale.data_as<const float>(), amax,
            fp8.scale_inv.data_as<float>(), column_partial,
            kept != nullptr ? kept->scale.data_as<float>() : nullptr,
            kept != nullptr ? kept->amax.data_as<float>() : nullptr);
      };
      if (column_partial != nullptr) {
        launch(std::true_type{});
      } else {
        launch(std::false_type{});
      }
    });
  });
}

}  // namespace

// ---- host launchers --------------------------------------------------------------

absl::Status CudaOps::Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) {
  RETURN_IF_ERROR(CheckQuantizeArgs(x, fp8, y));
  RETURN_IF_ERROR(Enter());
  const int64_t n = x.numel();
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFp8(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const bool vec = PackAligned<In, Out>(x, *y);
      QuantizeKernel<In, Out><<<GridFor(vec ? n / kVec : n), kThreads, 0, stream()>>>(
          static_cast<const typename In::Storage*>(x.data()),
          static_cast<typename Out::Storage*>(y->data()), fp8.scale.data_as<const float>(),
          AmaxOutFor(fp8), fp8.scale_inv.data_as<float>(), n, vec);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::QuantizeTranspose(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                        Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  // Shapes the tile kernel cannot take: quantize, then transpose.
  if (!TileKernelFits(x, *y, *y_t)) return Ops::QuantizeTranspose(x, fp8, y, y_t);
  RETURN_IF_ERROR(Enter());
  LaunchQuantizeTranspose(x, fp8, AmaxOutFor(fp8), y, y_t, nullptr, context(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::QuantizeTransposeKept(const Tensor& x, const Fp8Output& fp8,
                                            const KeptQuantization& kept, Tensor* y,
                                            Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(CheckKeptQuantization(fp8, kept));
  // Shapes the tile kernel cannot take: the reference's host-side decision.
  if (!TileKernelFits(x, *y, *y_t)) return Ops::QuantizeTransposeKept(x, fp8, kept, y, y_t);
  RETURN_IF_ERROR(Enter());
  LaunchQuantizeTranspose(x, fp8, AmaxOutFor(fp8), y, y_t, nullptr, context(), stream(), &kept);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::QuantizeTransposeDbias(const Tensor& x, const Fp8Output& fp8, Tensor* y,
                                             Tensor* y_t, Tensor* dbias) {
  RETURN_IF_ERROR(CheckQuantizeTransposeArgs(x, fp8, y, y_t));
  RETURN_IF_ERROR(CheckSumRowsArgs(x, dbias));
  // Shapes the tile kernel cannot take: QuantizeTranspose, then SumRows.
  if (!TileKernelFits(x, *y, *y_t)) return Ops::QuantizeTransposeDbias(x, fp8, y, y_t, dbias);
  RETURN_IF_ERROR(Enter());
  const int64_t cols = x.dim(1);
  // One partial row of column sums per tile row: 1 MiB at [8192, 4096].
  const int64_t row_tiles = CastTransposePartialRows(x, *y, *y_t);
  ASSIGN_OR_RETURN(Tensor partial, Allocate(DType::kF32, {row_tiles, cols}));
  LaunchQuantizeTranspose(x, fp8, AmaxOutFor(fp8), y, y_t, partial.data_as<float>(),
                          context(), stream());
  LaunchPartialColumnSums(partial.data_as<const float>(), row_tiles, cols, dbias->dtype(),
                          dbias->data(), stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) {
  RETURN_IF_ERROR(CheckDequantizeArgs(x, scale_inv, y));
  const int64_t n = x.numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  DispatchFp8(x.dtype(), [&](auto in) {
    DispatchFloat(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      DequantizeKernel<In, Out><<<GridFor(n), kThreads, 0, stream()>>>(
          static_cast<const typename In::Storage*>(x.data()), scale_inv.data_as<const float>(),
          static_cast<typename Out::Storage*>(y->data()), n);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Amax(const Tensor& x, Tensor* amax) {
  RETURN_IF_ERROR(CheckAmaxArgs(x, amax));
  RETURN_IF_ERROR(Enter());
  const int64_t n = x.numel();
  DispatchFloatOrFp8(x.dtype(), [&](auto in) {
    using In = decltype(in);
    AmaxKernel<In><<<GridFor(n), kThreads, 0, stream()>>>(
        static_cast<const typename In::Storage*>(x.data()),
        AmaxOut{amax->data_as<float>(), fold_slot_}, n);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::ScaleFromAmax(const Tensor& amax, float fp8_max, float margin,
                                    float epsilon, Tensor* scale, Tensor* scale_inv) {
  RETURN_IF_ERROR(CheckScaleFromAmaxArgs(amax, fp8_max, epsilon, scale, scale_inv));
  RETURN_IF_ERROR(Enter());
  ScaleFromAmaxKernel<<<1, 1, 0, stream()>>>(amax.data_as<const float>(), fp8_max, margin,
                                             epsilon, scale->data_as<float>(),
                                             scale_inv->data_as<float>());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::DelayedScalingUpdate(const DelayedScalingArgs& args, Tensor* amax_history,
                                           Tensor* scale, Tensor* scale_inv) {
  RETURN_IF_ERROR(CheckDelayedScalingArgs(args, amax_history, scale, scale_inv));
  return LaunchDelayedScaling({{args, *amax_history, *scale}}, scale_inv, nullptr);
}

absl::Status CudaOps::DelayedScalingUpdates(const std::vector<DelayedScalingItem>& items,
                                            Tensor* non_finite) {
  // Every entry is checked before any is launched, so a bad one changes nothing.
  RETURN_IF_ERROR(CheckDelayedScalingUpdatesArgs(items, non_finite));
  return LaunchDelayedScaling(items, nullptr, non_finite);
}

absl::Status CudaOps::LaunchDelayedScaling(const std::vector<DelayedScalingItem>& items,
                                           Tensor* scale_inv, Tensor* non_finite) {
  // CUDA only: the kernel holds a whole history in one block's shared memory.
  for (const DelayedScalingItem& item : items) {
    if (item.amax_history.numel() > kMaxHistory) {
      return absl::InvalidArgumentError(
          absl::StrCat("DelayedScalingUpdate: amax_history has shape ",
                       ShapeString(item.amax_history.shape()), ", want [L], 1 <= L <= ",
                       kMaxHistory));
    }
  }
  if (items.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  for (size_t first = 0; first < items.size(); first += kScalingBatch) {
    const size_t count = std::min<size_t>(kScalingBatch, items.size() - first);
    DelayedScalingBatch batch{};
    int64_t longest = 0;
    for (size_t i = 0; i < count; ++i) {
      const DelayedScalingItem& item = items[first + i];
      batch.history[i] = item.amax_history.data_as<float>();
      batch.scale[i] = item.scale.data_as<float>();
      batch.scale_inv[i] = scale_inv != nullptr ? scale_inv->data_as<float>() : nullptr;
      batch.length[i] = static_cast<int>(item.amax_history.numel());
      batch.fp8_max[i] = item.args.fp8_max;
      batch.margin[i] = item.args.margin;
      batch.most_recent[i] = item.args.most_recent;
      longest = std::max(longest, item.amax_history.numel());
    }
    batch.non_finite = non_finite != nullptr ? non_finite->data_as<float>() : nullptr;
    const size_t shared = static_cast<size_t>(longest) * sizeof(float);
    RETURN_IF_ERROR(AllowSharedBytes(context(), DelayedScalingKernel, shared,
                                     "cudaFuncSetAttribute(DelayedScalingKernel)"));
    DelayedScalingKernel<<<static_cast<unsigned>(count), 1024, shared, stream()>>>(batch);
    CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

absl::Status CudaOps::FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckFakeQuantizeBlockScaledArgs(format, x, y));
  const bool mxfp8 = format == BlockFormat::kMXFP8;
  const int block = mxfp8 ? kMxfp8Block : kNvfp4Block;
  const int64_t blocks = x.numel() / block;
  if (blocks == 0) return absl::OkStatus();
  Tensor tensor_amax;
  if (!mxfp8) {
    ASSIGN_OR_RETURN(tensor_amax, Allocate(DType::kF32, {1}));
    RETURN_IF_ERROR(Amax(x, &tensor_amax));
  }
  RETURN_IF_ERROR(Enter());
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      const auto* src = static_cast<const typename In::Storage*>(x.data());
      auto* dst = static_cast<typename Out::Storage*>(y->data());
      if (mxfp8) {
        Mxfp8Kernel<In, Out><<<GridFor(blocks, 128), 128, 0, stream()>>>(src, dst, blocks);
      } else {
        Nvfp4Kernel<In, Out><<<GridFor(blocks, 128), 128, 0, stream()>>>(
            src, tensor_amax.data_as<const float>(), dst, blocks);
      }
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
