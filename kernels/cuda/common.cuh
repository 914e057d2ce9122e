// Device-side building blocks shared by the kernel files: element formats as
// types, dtype dispatch, launch geometry and block reductions.
//
// Conversions round exactly as kernels/fp8.h does (nearest even; FP8
// saturating; NaN as 0x7f / 0x7e00), so GPU outputs are bit-identical to the
// CPU reference for the same float32 value. FP8 and fp16 use the hardware
// converts (cvt.rn.satfinite), which agree with fp8.h on every float32 input
// apart from NaN's bit pattern, which is fixed up here.
#ifndef TE_KERNELS_CUDA_COMMON_CUH_
#define TE_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/fp8.h"
#include "kernels/tensor.h"

namespace te {
namespace cuda {

// ---- GELU (tanh approximation, ops.h's) -----------------------------------------
// Shared by the activation kernels and the GEMM's fallback epilogue, so both
// compute the same float32 value. The tanh form through the logistic
// function, as the CPU reference writes it: 0.5 (1 + tanh(u)) = s =
// 1 / (1 + e^-2u), so GELU(x) = x s and GELU'(x) = s + 2 x s (1 - s) u'.
// One exponential and one reciprocal on the special-function unit where
// tanhf spends some twenty instructions and a branch; the MLP's FP8
// cast-transposes apply it to every element and are issue-bound on it.
// It also keeps GELU's small negative tail, which 1 + tanh(u) cancels to 0
// below x of about -4.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
__device__ __forceinline__ float GeluLogistic(float x) {
  const float u = kSqrt2OverPi * (x + kGeluCubic * x * x * x);
  // __fdividef(1, inf) is 0: s -> 0 as u -> -inf.
  return __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
}
__device__ __forceinline__ float GeluTanh(float x) { return x * GeluLogistic(x); }
__device__ __forceinline__ float GeluTanhDerivative(float x) {
  const float s = GeluLogistic(x);
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du;
}

// ---- element formats ---------------------------------------------------------
// Each has Storage (the bytes in memory), Load (to float) and Store (from float,
// rounded once).
struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float Load(float v) { return v; }
  static __device__ __forceinline__ float Store(float v) { return v; }
};
struct BF16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float Load(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }
  static __device__ __forceinline__ uint16_t Store(float v) { return FloatToBf16(v); }
};
struct F16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float Load(uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ uint16_t Store(float v) {
    if (v != v) return 0x7e00;
    return __half_as_ushort(__float2half_rn(v));
  }
};
// Both FP8 formats: the hardware converts, NaN stored as 0x7f (fp8.h's).
template <__nv_fp8_interpretation_t kFormat>
struct Fp8Format {
  using Storage = uint8_t;
  static __device__ __forceinline__ float Load(uint8_t v) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v, kFormat)));
  }
  static __device__ __forceinline__ uint8_t Store(float v) {
    if (v != v) return 0x7f;
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFormat));
  }
  // Store(a) | Store(b) << 8 in one conversion where neither is NaN.
  static __device__ __forceinline__ uint16_t Store2(float a, float b) {
    if (a != a || b != b) return uint16_t(Store(a) | Store(b) << 8);
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kFormat);
  }
};
using E4M3 = Fp8Format<__NV_E4M3>;
using E5M2 = Fp8Format<__NV_E5M2>;

// Calls f(Format{}) for a float dtype (f32, bf16, f16); false for others.
template <typename F>
bool DispatchFloat(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: f(F32{}); return true;
    case DType::kBF16: f(BF16{}); return true;
    case DType::kF16: f(F16{}); return true;
    default: return false;
  }
}
// Calls f(In{}, Out{}) for an input and an output float dtype; false unless
// both are float dtypes.
template <typename F>
bool DispatchFloatPair(DType in_dtype, DType out_dtype, F&& f) {
  bool both = false;
  DispatchFloat(in_dtype,
                [&](auto in) { both = DispatchFloat(out_dtype, [&](auto out) { f(in, out); }); });
  return both;
}
// Float dtypes and the two FP8 formats.
template <typename F>
bool DispatchFloatOrFp8(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kE4M3: f(E4M3{}); return true;
    case DType::kE5M2: f(E5M2{}); return true;
    default: return DispatchFloat(dtype, f);
  }
}
template <typename F>
bool DispatchFp8(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kE4M3: f(E4M3{}); return true;
    case DType::kE5M2: f(E5M2{}); return true;
    default: return false;
  }
}

// ---- vector access -------------------------------------------------------------
// Memory-bound kernels move kVec elements per thread with one (or two) 16-byte
// accesses where the pointers allow it, and fall back to single elements
// otherwise (views into a tensor need not be aligned).
constexpr int kVec = 8;
template <typename T, int N = kVec>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};
template <typename T>
inline bool PackAligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<T>) == 0;
}
// Whether an elementwise pass reading x as In and writing y as Out (float
// formats) can move both a Pack at a time.
template <typename In, typename Out>
inline bool PackAligned(const Tensor& x, const Tensor& y) {
  return PackAligned<typename In::Storage>(x.data()) &&
         PackAligned<typename Out::Storage>(y.data());
}

// A grid-stride pass over n elements, kVec at a time where `vec` (the
// pointers allow Pack access), then the n % kVec tail (all of them otherwise)
// one at a time: pack(k) handles elements [k * kVec, (k + 1) * kVec), one(i)
// element i. Launch with GridFor(vec ? n / kVec : n) blocks.
template <typename PackFn, typename OneFn>
__device__ __forceinline__ void ForEachPackThenElement(int64_t n, bool vec, PackFn pack,
                                                       OneFn one) {
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = vec ? n / kVec : 0;
  for (int64_t k = start; k < packs; k += stride) pack(k);
  for (int64_t i = packs * kVec + start; i < n; i += stride) one(i);
}

// y[i] = Out(f(In(x[i]), i)) over n elements, by ForEachPackThenElement: f
// takes the float value and its index and returns the float to store (rounded
// once into Out).
template <typename In, typename Out, typename F>
__device__ __forceinline__ void MapElements(const typename In::Storage* x,
                                            typename Out::Storage* y, int64_t n, bool vec, F f) {
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  ForEachPackThenElement(
      n, vec,
      [&](int64_t k) {
        const InPack a = reinterpret_cast<const InPack*>(x)[k];
        OutPack o;
#pragma unroll
        for (int j = 0; j < kVec; ++j) o.v[j] = Out::Store(f(In::Load(a.v[j]), k * kVec + j));
        reinterpret_cast<OutPack*>(y)[k] = o;
      },
      [&](int64_t i) { y[i] = Out::Store(f(In::Load(x[i]), i)); });
}

// ---- launch geometry ---------------------------------------------------------
constexpr int kThreads = 256;
// Grid-stride kernels: enough blocks to fill the GPU several times over (16
// per SM), no more: each thread loops, and more blocks only add tail.
// `sm_count` is the device's (CudaOps::sm_count(), read once when the device
// was opened); inside CudaOps, GridFor(n) is the member that passes it.
inline unsigned GridFor(int64_t n, SmCount sms, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  const int64_t cap = 16 * static_cast<int64_t>(sms.value > 0 ? sms.value : 1);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}
inline unsigned CudaOps::GridFor(int64_t n, int threads) const {
  return cuda::GridFor(n, sms(), threads);
}

// ---- reductions ----------------------------------------------------------------
// max |v| as the bits of a non-negative float: integer order equals float
// order for non-negative floats, and NaN (0x7fc00000 after fabs) orders above
// inf, so a NaN anywhere propagates, as the CPU reference's AbsMax does.
__device__ __forceinline__ unsigned AbsBits(float v) { return __float_as_uint(fabsf(v)); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ unsigned WarpMaxBits(unsigned v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block; every thread gets the result. `scratch`: 32 floats of
// shared memory, reusable after the call returns.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__device__ __forceinline__ unsigned BlockMaxBits(unsigned v, unsigned* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = WarpMaxBits(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0u;
  return WarpMaxBits(v);
}

__device__ __forceinline__ unsigned long long WarpMaxU64(unsigned long long v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
// Max over the block; every thread gets the result. `scratch`: 32 values of
// shared memory, reusable after the call returns.
__device__ __forceinline__ unsigned long long BlockMaxU64(unsigned long long v,
                                                          unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = WarpMaxU64(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0ull;
  return WarpMaxU64(v);
}

// The fold itself, over `blocks` blocks meeting at `bits` and `done` (zero at
// rest, left at zero): true in the last block, after it wrote their amax.
__device__ __forceinline__ bool FoldBlockBits(unsigned* bits, unsigned* done, unsigned blocks,
                                              unsigned block_bits, float* amax) {
  atomicMax(bits, block_bits);
  __threadfence();  // this block's max lands before its count
  if (atomicAdd(done, 1u) != blocks - 1) return false;
  __threadfence();  // every block's max is in: read it after the count
  *amax = __uint_as_float(atomicExch(bits, 0u));
  *done = 0;  // the next launch on this stream sees it
  return true;
}

// Folds a block's amax into an AmaxOut (cuda_ops.h): the blocks combine their
// maxima in the stream's slot and the last block to finish writes the grid's
// into *amax and leaves the slot at zero again, so no memset of the amax
// goes before the launch (one a quantizer, hundreds a training step).
// Thread 0 of every block of the grid calls it once, with its block's max
// |v| bits. Returns true in the block that finished last, after it wrote the
// grid's amax (false everywhere when the amax is not recorded).
__device__ __forceinline__ bool FoldAmax(const AmaxOut& out, unsigned block_bits) {
  if (out.amax == nullptr) return false;
  return FoldBlockBits(&out.slot->bits, &out.slot->blocks_done,
                       gridDim.x * gridDim.y * gridDim.z, block_bits, out.amax);
}

// ---- column sums of partial rows -------------------------------------------------
// out[c] = sum over parts of partial[part, c] (f32 [parts, cols]): the last
// pass of each deterministic column reduction (SumRows, cast-transpose-dbias,
// the norms' dgamma / dbeta). Group k of 8 sums parts k, k + 8, ... (many
// loads in flight), then the groups are added in order: no atomics, the same
// result on every run.
constexpr int kColumnSumColumns = 32, kColumnSumGroups = 8;
template <typename Out>
__global__ void PartialColumnSumsKernel(const float* partial, int64_t parts, int64_t cols,
                                        typename Out::Storage* out) {
  __shared__ float group_sums[kColumnSumGroups][kColumnSumColumns + 1];
  const int64_t c = blockIdx.x * int64_t(kColumnSumColumns) + threadIdx.x;
  float sum = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t part = threadIdx.y; part < parts; part += kColumnSumGroups) {
      sum += partial[part * cols + c];
    }
  }
  group_sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || c >= cols) return;
  sum = 0.0f;
  for (int k = 0; k < kColumnSumGroups; ++k) sum += group_sums[k][threadIdx.x];
  out[c] = Out::Store(sum);
}

// Launches PartialColumnSumsKernel writing `out` (float dtype `dtype`, [cols]).
inline void LaunchPartialColumnSums(const float* partial, int64_t parts, int64_t cols,
                                    DType dtype, void* out, cudaStream_t stream) {
  DispatchFloat(dtype, [&](auto format) {
    using Out = decltype(format);
    PartialColumnSumsKernel<Out>
        <<<static_cast<unsigned>((cols + kColumnSumColumns - 1) / kColumnSumColumns),
           dim3(kColumnSumColumns, kColumnSumGroups), 0, stream>>>(
            partial, parts, cols, static_cast<typename Out::Storage*>(out));
  });
}

// ---- byte tiles ----------------------------------------------------------------------
// A 64 x 64 tile of a [rows, cols] byte matrix (FP8 codes), at (row0, col0),
// held in shared memory as tile[r][c] (4 bytes of padding per row against
// bank conflicts), written transposed into out [cols, rows] as 4-byte words
// of 4 consecutive rows of one column: coalesced stores, 4x the bandwidth of
// single bytes. 256 threads as 16 x 16 (tx, ty); rows and cols multiples of 4.
using ByteTile = uint8_t[64][64 + 4];
__device__ __forceinline__ void StoreTileTransposed(const ByteTile& tile, uint8_t* out,
                                                    int64_t rows, int64_t cols, int64_t row0,
                                                    int64_t col0, int tx, int ty) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = ty + 16 * i;
    const int64_t r = row0 + tx * 4;
    if (col0 + c < cols && r < rows) {
      const uint32_t word = static_cast<uint32_t>(tile[tx * 4 + 0][c]) |
                            static_cast<uint32_t>(tile[tx * 4 + 1][c]) << 8 |
                            static_cast<uint32_t>(tile[tx * 4 + 2][c]) << 16 |
                            static_cast<uint32_t>(tile[tx * 4 + 3][c]) << 24;
      *reinterpret_cast<uint32_t*>(out + (col0 + c) * rows + r) = word;
    }
  }
}

// ---- launch configuration, asked once ---------------------------------------------
// Shared memory per block: above the first, a kernel needs an opt-in; the
// second is what the kernels here plan for at most (H200: 227 KiB).
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr size_t kMaxSharedBytes = 200 * 1024;
// Room left for a kernel's static shared memory (reduction scratch, under
// 1 KiB) when deciding whether its dynamic bytes need the opt-in: at exactly
// 48 KiB of dynamic memory a launch failed without it.
constexpr size_t kStaticSharedReserve = 1024;

// Blocks of `kernel` that fit on one SM of the device at once (at least 1);
// the driver is asked once per configuration (the context's launch_memo).
template <typename Kernel>
int ResidentBlocksPerSm(const CudaContext& device, Kernel kernel, int threads,
                        size_t shared_bytes) {
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, shared_bytes);
  KernelLaunchMemo& memo = device.launch_memo;
  std::lock_guard<std::mutex> lock(memo.mu);
  auto it = memo.blocks_per_sm.find(key);
  if (it != memo.blocks_per_sm.end()) return it->second;
  int per_sm = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    per_sm = 1;
  }
  return memo.blocks_per_sm[key] = per_sm < 1 ? 1 : per_sm;
}

// Blocks of `kernel` that fit on the device at once.
template <typename Kernel>
int64_t ResidentBlocks(const CudaContext& device, Kernel kernel, int threads, size_t shared_bytes) {
  return static_cast<int64_t>(ResidentBlocksPerSm(device, kernel, threads, shared_bytes)) *
         device.properties.multiProcessorCount;
}

// Opts `kernel` in to `bytes` of dynamic shared memory where that and its
// static shared memory may pass the default; `what` names it in errors.
template <typename Kernel>
absl::Status AllowSharedBytes(const CudaContext& device, Kernel kernel, size_t bytes,
                              const char* what) {
  if (bytes + kStaticSharedReserve <= kDefaultSharedBytes) return absl::OkStatus();
  const void* key = reinterpret_cast<const void*>(kernel);
  KernelLaunchMemo& memo = device.launch_memo;
  std::lock_guard<std::mutex> lock(memo.mu);
  auto it = memo.shared_allowed.find(key);
  if (it != memo.shared_allowed.end() && it->second >= bytes) return absl::OkStatus();
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes));
  if (e != cudaSuccess) return CudaErrorToStatus(e, what, __FILE__, __LINE__);
  memo.shared_allowed[key] = bytes;
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_COMMON_CUH_
