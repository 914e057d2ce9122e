// Memory movement and plain elementwise ops: Upload, Download, Copy, CopyAll,
// CopyRowsAt, Fill, AddScalarI32, Cast, Axpby, Permute, SumRows.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// ---- kernels -------------------------------------------------------------------

__global__ void AddScalarI32Kernel(int32_t* y, int32_t value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] += value;
  }
}

// y[i] = value, as stored in y's format (precomputed on the host: a fill is a
// bit pattern).
template <typename T>
__global__ void FillKernel(T* y, T value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    y[i] = value;
  }
}

// y = x in y's format; kVec at a time where aligned (`vec`), then the tail.
// (MapElements's loop, written out: through the shared helper nvcc does not
// unroll the f32 -> f32 and bf16 -> f32 pack loops, nor DotPartialKernel's
// below, and these are the memory-bound ones.)
template <typename In, typename Out>
__global__ void CastKernel(const typename In::Storage* x, typename Out::Storage* y, int64_t n,
                           bool vec) {
  using InPack = Pack<typename In::Storage>;
  using OutPack = Pack<typename Out::Storage>;
  const int64_t start = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t packs = vec ? n / kVec : 0;
  for (int64_t k = start; k < packs; k += stride) {
    const InPack a = reinterpret_cast<const InPack*>(x)[k];
    OutPack o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) o.v[j] = Out::Store(In::Load(a.v[j]));
    reinterpret_cast<OutPack*>(y)[k] = o;
  }
  for (int64_t i = packs * kVec + start; i < n; i += stride) y[i] = Out::Store(In::Load(x[i]));
}

// y = alpha a + beta b; a term with a zero coefficient is not read (its
// pointer may be null), as in BLAS.
template <typename A, typename B, typename Y>
__global__ void AxpbyKernel(float alpha, const typename A::Storage* a, float beta,
                            const typename B::Storage* b, typename Y::Storage* y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float v = 0.0f;
    if (alpha != 0.0f) v += alpha * A::Load(a[i]);
    if (beta != 0.0f) v += beta * B::Load(b[i]);
    y[i] = Y::Store(v);
  }
}

constexpr int kMaxRank = kPermuteMaxRank;  // what CheckPermuteArgs lets through
struct PermuteGeometry {
  int rank;
  int64_t y_dims[kMaxRank];
  int64_t x_step[kMaxRank];  // x's stride along y's dimension i
};

// One thread per output element (coalesced writes; reads gather).
template <typename T>
__global__ void PermuteKernel(const T* x, T* y, PermuteGeometry g, int64_t n) {
  for (int64_t out = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; out < n;
       out += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = out, offset = 0;
    for (int i = g.rank - 1; i >= 0; --i) {
      const int64_t index = rest % g.y_dims[i];
      rest /= g.y_dims[i];
      offset += index * g.x_step[i];
    }
    y[out] = x[offset];
  }
}

// Batched 2D transpose, y[b, j, i] = x[b, i, j] with x [batch, rows, cols]:
// 32 x 32 tiles through shared memory so reads and writes are both coalesced
// (the padding column keeps the column reads free of bank conflicts).
constexpr int kTile = 32, kTileRows = 8;
template <typename T>
__global__ void TransposeKernel(const T* x, T* y, int64_t rows, int64_t cols) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t batch = blockIdx.z;
  const T* in = x + batch * rows * cols;
  T* out = y + batch * rows * cols;
  const int64_t row0 = blockIdx.y * int64_t(kTile), col0 = blockIdx.x * int64_t(kTile);
  for (int k = threadIdx.y; k < kTile; k += kTileRows) {
    const int64_t r = row0 + k, c = col0 + threadIdx.x;
    if (r < rows && c < cols) tile[k][threadIdx.x] = in[r * cols + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < kTile; k += kTileRows) {
    const int64_t c = col0 + k, r = row0 + threadIdx.x;  // y row c, column r
    if (r < rows && c < cols) out[c * rows + r] = tile[threadIdx.x][k];
  }
}

// SumRows, pass 1: block (column tile, row split) sums its rows of N
// neighbouring columns per thread (one N-element access per row: N = kVec
// where cols and x allow, else 1) into partial[split, col]. Threads of a warp
// read neighbouring columns (coalesced); no two threads write one address, so
// no atomics.
template <typename In, int N>
__global__ void SumRowsPartialKernel(const typename In::Storage* x, float* partial, int64_t rows,
                                     int64_t cols, int64_t rows_per_split) {
  using P = Pack<typename In::Storage, N>;
  const int64_t col = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * N;
  if (col >= cols) return;
  const int64_t begin = blockIdx.y * rows_per_split;
  const int64_t end = min(rows, begin + rows_per_split);
  float sum[N] = {};
  for (int64_t r = begin; r < end; ++r) {
    const P p = *reinterpret_cast<const P*>(x + r * cols + col);
#pragma unroll
    for (int j = 0; j < N; ++j) sum[j] += In::Load(p.v[j]);
  }
#pragma unroll
  for (int j = 0; j < N; ++j) partial[blockIdx.y * cols + col + j] = sum[j];
}

// Dot, pass 1: each block's share of sum a[i] * b[i] (grid-stride, kVec
// elements per access where aligned) into partial[blockIdx.x].
template <typename In>
__global__ void DotPartialKernel(const typename In::Storage* a, const typename In::Storage* b,
                                 int64_t n, bool vec, float* partial) {
  __shared__ float scratch[32];
  using P = Pack<typename In::Storage>;
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  float sum = 0.0f;
  int64_t tail = 0;
  if (vec) {
    const int64_t packs = n / kVec;
    for (int64_t p = thread; p < packs; p += threads) {
      const P pa = reinterpret_cast<const P*>(a)[p];
      const P pb = reinterpret_cast<const P*>(b)[p];
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += In::Load(pa.v[j]) * In::Load(pb.v[j]);
    }
    tail = packs * kVec;
  }
  for (int64_t i = tail + thread; i < n; i += threads) sum += In::Load(a[i]) * In::Load(b[i]);
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2, one block: the partials in a fixed order (deterministic).
__global__ void DotFinalKernel(const float* partial, int blocks, float* out) {
  __shared__ float scratch[32];
  float sum = 0.0f;
  for (int i = threadIdx.x; i < blocks; i += blockDim.x) sum += partial[i];
  sum = BlockSum(sum, scratch);
  if (threadIdx.x == 0) *out = sum;
}

// The stored bytes of `value` in `dtype` (host side, the same casts as the CPU).
uint32_t StoredBits(DType dtype, float value) {
  switch (dtype) {
    case DType::kF32: return FloatBits(value);
    case DType::kBF16: return FloatToBf16(value);
    case DType::kF16: return FloatToFp16(value);
    case DType::kE4M3: return FloatToE4M3(value);
    case DType::kE5M2: return FloatToE5M2(value);
    case DType::kI32: return static_cast<uint32_t>(static_cast<int32_t>(value));
    case DType::kBool: return value != 0.0f ? 1u : 0u;
  }
  return 0;
}

}  // namespace

// ---- memory ----------------------------------------------------------------------

absl::Status CudaOps::Upload(const void* src, Tensor* dst) {
  RETURN_IF_ERROR(CheckUploadArgs(src, dst));
  if (dst->nbytes() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(NotRecording("Upload"));
  RETURN_IF_ERROR(Enter());
  // Small copies go through the stream's page-locked buffers: the host does
  // not wait for the work queued before them (staging.cc).
  if (staged_uploads_ == nullptr) staged_uploads_ = NewStagedUploads(context_->staging_pool);
  ASSIGN_OR_RETURN(const bool staged,
                   StageUpload(*staged_uploads_, src, dst->data(), dst->nbytes(), stream()));
  if (staged) return absl::OkStatus();
  // From pageable memory this may first wait for the stream, and returns
  // once `src` has been staged, so the caller may reuse it at once.
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst->data(), src, dst->nbytes(), cudaMemcpyHostToDevice, stream()));
  return absl::OkStatus();
}

absl::Status CudaOps::Download(const Tensor& src, void* dst) {
  RETURN_IF_ERROR(CheckDownloadArgs(src, dst));
  if (src.nbytes() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(NotRecording("Download"));
  RETURN_IF_ERROR(Enter());
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost, stream()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
  return absl::OkStatus();
}

absl::Status CudaOps::Copy(const Tensor& src, Tensor* dst) {
  RETURN_IF_ERROR(CheckCopyArgs(src, dst));
  if (src.nbytes() == 0 || src.data() == dst->data()) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst->data(), src.data(), src.nbytes(),
                                       cudaMemcpyDeviceToDevice, stream()));
  return absl::OkStatus();
}

namespace {

// Up to kCopyAllBatch (src, dst, bytes) triples, passed by value as the
// kernel's argument (under its 4 KiB limit), so a batch is one launch.
constexpr int kCopyAllBatch = 64;
struct CopyBatch {
  const uint8_t* src[kCopyAllBatch];
  uint8_t* dst[kCopyAllBatch];
  int64_t bytes[kCopyAllBatch];
};

// One block per pair; its threads copy the pair's bytes.
__global__ void CopyAllKernel(const CopyBatch batch) {
  const uint8_t* src = batch.src[blockIdx.x];
  uint8_t* dst = batch.dst[blockIdx.x];
  for (int64_t i = threadIdx.x; i < batch.bytes[blockIdx.x]; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

absl::Status CudaOps::CopyAll(const std::vector<const Tensor*>& src,
                              const std::vector<Tensor*>& dst) {
  RETURN_IF_ERROR(CheckCopyAllArgs(src, dst));
  // Large tensors go by the copy engine; only small ones are worth batching.
  constexpr int64_t kSmallBytes = 64 * 1024;
  RETURN_IF_ERROR(Enter());
  CopyBatch batch;
  int n = 0;
  auto flush = [&]() -> absl::Status {
    if (n == 0) return absl::OkStatus();
    CopyAllKernel<<<n, 128, 0, stream()>>>(batch);
    CUDA_RETURN_IF_LAUNCH_ERROR();
    n = 0;
    return absl::OkStatus();
  };
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(src[i]->nbytes());
    if (bytes == 0 || src[i]->data() == dst[i]->data()) continue;
    if (bytes > kSmallBytes) {
      RETURN_IF_ERROR(Copy(*src[i], dst[i]));
      continue;
    }
    batch.src[n] = static_cast<const uint8_t*>(src[i]->data());
    batch.dst[n] = static_cast<uint8_t*>(dst[i]->data());
    batch.bytes[n] = bytes;
    if (++n == kCopyAllBatch) RETURN_IF_ERROR(flush());
  }
  return flush();
}

namespace {

// dst[b, p + s] = src[b, s] for rows of `units` T's each: src [B, S, units],
// dst [B, L, units]. p = *position, read here so that one launch serves every
// position of a replayed step; rows with p + s outside [0, L) are skipped.
template <typename T>
__global__ void CopyRowsAtKernel(const T* src, T* dst, const int32_t* position, int64_t seq,
                                 int64_t length, int64_t units, int64_t n) {
  const int64_t p = *position;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = k / units, u = k - row * units;
    const int64_t b = row / seq, s = row - b * seq;
    const int64_t t = p + s;
    if (t < 0 || t >= length) continue;
    dst[(b * length + t) * units + u] = src[k];
  }
}

}  // namespace

absl::Status CudaOps::CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) {
  RETURN_IF_ERROR(CheckCopyRowsAtArgs(src, position, dst));
  const int64_t batch = src.dim(0), seq = src.dim(1), length = dst->dim(1);
  const int64_t bytes = static_cast<int64_t>(src.nbytes());
  if (bytes == 0 || length == 0) return absl::OkStatus();
  const int64_t row_bytes = bytes / (batch * seq);
  RETURN_IF_ERROR(Enter());
  // The widest unit that divides a row and both rows' starting addresses.
  const uint64_t align = static_cast<uint64_t>(row_bytes) |
                         reinterpret_cast<uintptr_t>(src.data()) |
                         reinterpret_cast<uintptr_t>(dst->data());
  auto launch = [&](auto unit) {
    using T = decltype(unit);
    const int64_t units = row_bytes / static_cast<int64_t>(sizeof(T));
    const int64_t n = bytes / static_cast<int64_t>(sizeof(T));
    CopyRowsAtKernel<T><<<GridFor(n), kThreads, 0, stream()>>>(
        static_cast<const T*>(src.data()), static_cast<T*>(dst->data()),
        position.data_as<const int32_t>(), seq, length, units, n);
  };
  if (align % 16 == 0) {
    launch(uint4());
  } else if (align % 8 == 0) {
    launch(uint2());
  } else if (align % 4 == 0) {
    launch(uint32_t());
  } else if (align % 2 == 0) {
    launch(uint16_t());
  } else {
    launch(uint8_t());
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

// ---- elementwise ---------------------------------------------------------------

absl::Status CudaOps::Fill(float value, Tensor* y) {
  RETURN_IF_ERROR(RequireDefined("Fill", "y", y));
  const int64_t n = y->numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const uint32_t bits = StoredBits(y->dtype(), value);
  switch (DTypeSize(y->dtype())) {
    case 1:
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(y->data(), static_cast<int>(bits), n, stream()));
      return absl::OkStatus();
    case 2:
      FillKernel<uint16_t><<<GridFor(n), kThreads, 0, stream()>>>(
          y->data_as<uint16_t>(), static_cast<uint16_t>(bits), n);
      break;
    default:
      FillKernel<uint32_t><<<GridFor(n), kThreads, 0, stream()>>>(y->data_as<uint32_t>(), bits,
                                                                   n);
      break;
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::AddScalarI32(int32_t value, Tensor* y) {
  RETURN_IF_ERROR(CheckAddScalarI32Args(y));
  const int64_t n = y->numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  AddScalarI32Kernel<<<GridFor(n), kThreads, 0, stream()>>>(y->data_as<int32_t>(), value, n);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Cast(const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckCastArgs(x, y));
  const int64_t n = x.numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  DispatchFloatPair(x.dtype(), y->dtype(), [&](auto in, auto out) {
    using In = decltype(in);
    using Out = decltype(out);
    const bool vec = PackAligned<In, Out>(x, *y);
    CastKernel<In, Out><<<GridFor(vec ? n / kVec : n), kThreads, 0, stream()>>>(
        static_cast<const typename In::Storage*>(x.data()),
        static_cast<typename Out::Storage*>(y->data()), n, vec);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Axpby(float alpha, const Tensor& a, float beta, const Tensor& b, Tensor* y) {
  RETURN_IF_ERROR(CheckAxpbyArgs(alpha, a, beta, b, y));
  const int64_t n = y->numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  // An unread operand takes y's dtype so the dispatch stays small.
  const DType a_dtype = alpha != 0.0f ? a.dtype() : y->dtype();
  const DType b_dtype = beta != 0.0f ? b.dtype() : y->dtype();
  DispatchFloat(a_dtype, [&](auto fa) {
    DispatchFloat(b_dtype, [&](auto fb) {
      DispatchFloat(y->dtype(), [&](auto fy) {
        using A = decltype(fa);
        using B = decltype(fb);
        using Y = decltype(fy);
        AxpbyKernel<A, B, Y><<<GridFor(n), kThreads, 0, stream()>>>(
            alpha, static_cast<const typename A::Storage*>(alpha != 0.0f ? a.data() : nullptr),
            beta, static_cast<const typename B::Storage*>(beta != 0.0f ? b.data() : nullptr),
            static_cast<typename Y::Storage*>(y->data()), n);
      });
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) {
  RETURN_IF_ERROR(CheckPermuteArgs(x, perm, y));
  const int rank = x.rank();
  const int64_t n = x.numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());

  // Dimensions of size 1 move nothing: drop them, so more cases reduce to the
  // fast paths below.
  std::vector<int64_t> dims;     // x's dims, size-1 dims dropped
  std::vector<int> order;        // the kept dims, in y's order, as indices into dims
  {
    std::vector<int> new_index(rank, -1);
    for (int d = 0; d < rank; ++d) {
      if (x.dim(d) != 1) {
        new_index[d] = static_cast<int>(dims.size());
        dims.push_back(x.dim(d));
      }
    }
    for (int i = 0; i < rank; ++i) {
      if (new_index[perm[i]] >= 0) order.push_back(new_index[perm[i]]);
    }
  }
  const int kept = static_cast<int>(dims.size());
  bool identity = true;
  for (int i = 0; i < kept; ++i) identity = identity && order[i] == i;
  const size_t elem = DTypeSize(x.dtype());
  if (identity) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(y->data(), x.data(), x.nbytes(),
                                         cudaMemcpyDeviceToDevice, stream()));
    return absl::OkStatus();
  }
  // Leading dims in place and the last two swapped: a batched transpose.
  bool swap_last_two = kept >= 2 && order[kept - 1] == kept - 2 && order[kept - 2] == kept - 1;
  for (int i = 0; swap_last_two && i < kept - 2; ++i) swap_last_two = order[i] == i;
  if (swap_last_two) {
    const int64_t rows = dims[kept - 2], cols = dims[kept - 1];
    const int64_t batch = n / (rows * cols);
    if (batch <= 65535) {
      const dim3 grid((cols + kTile - 1) / kTile, (rows + kTile - 1) / kTile, batch);
      const dim3 block(kTile, kTileRows);
      switch (elem) {
        case 1:
          TransposeKernel<uint8_t><<<grid, block, 0, stream()>>>(
              x.data_as<const uint8_t>(), y->data_as<uint8_t>(), rows, cols);
          break;
        case 2:
          TransposeKernel<uint16_t><<<grid, block, 0, stream()>>>(
              x.data_as<const uint16_t>(), y->data_as<uint16_t>(), rows, cols);
          break;
        default:
          TransposeKernel<uint32_t><<<grid, block, 0, stream()>>>(
              x.data_as<const uint32_t>(), y->data_as<uint32_t>(), rows, cols);
          break;
      }
      CUDA_RETURN_IF_LAUNCH_ERROR();
      return absl::OkStatus();
    }
  }
  // General gather. When the last dim stays last, its elements move together:
  // the widest unit (up to 16 bytes) that divides its bytes and both pointers'
  // alignment becomes the element.
  size_t unit = elem;
  if (order[kept - 1] == kept - 1) {
    const size_t inner_bytes = static_cast<size_t>(dims[kept - 1]) * elem;
    const uintptr_t addresses = reinterpret_cast<uintptr_t>(x.data()) |
                                reinterpret_cast<uintptr_t>(y->data());
    for (size_t u : {size_t{16}, size_t{8}, size_t{4}, size_t{2}}) {
      if (u > elem && inner_bytes % u == 0 && addresses % u == 0) {
        unit = u;
        break;
      }
    }
    dims[kept - 1] = static_cast<int64_t>(inner_bytes / unit);
  }
  PermuteGeometry g{};
  g.rank = kept;
  int64_t x_strides[kMaxRank];
  for (int d = kept - 1; d >= 0; --d) {
    x_strides[d] = d == kept - 1 ? 1 : x_strides[d + 1] * dims[d + 1];
  }
  for (int i = 0; i < kept; ++i) {
    g.y_dims[i] = dims[order[i]];
    g.x_step[i] = x_strides[order[i]];
  }
  const int64_t units = static_cast<int64_t>(x.nbytes() / unit);
  switch (unit) {
    case 1:
      PermuteKernel<uint8_t><<<GridFor(units), kThreads, 0, stream()>>>(
          x.data_as<const uint8_t>(), y->data_as<uint8_t>(), g, units);
      break;
    case 2:
      PermuteKernel<uint16_t><<<GridFor(units), kThreads, 0, stream()>>>(
          x.data_as<const uint16_t>(), y->data_as<uint16_t>(), g, units);
      break;
    case 4:
      PermuteKernel<uint32_t><<<GridFor(units), kThreads, 0, stream()>>>(
          x.data_as<const uint32_t>(), y->data_as<uint32_t>(), g, units);
      break;
    case 8:
      PermuteKernel<uint2><<<GridFor(units), kThreads, 0, stream()>>>(
          x.data_as<const uint2>(), y->data_as<uint2>(), g, units);
      break;
    default:
      PermuteKernel<uint4><<<GridFor(units), kThreads, 0, stream()>>>(
          x.data_as<const uint4>(), y->data_as<uint4>(), g, units);
      break;
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::SumRows(const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckSumRowsArgs(x, y));
  const int64_t cols = x.dim(-1);
  if (cols == 0) return absl::OkStatus();
  const int64_t rows = Rows(x);
  RETURN_IF_ERROR(Enter());
  // Enough (column tile x row split) blocks to fill the GPU; each split sums
  // at least 16 rows so pass 2 stays small.
  const bool vec = cols % kVec == 0 && reinterpret_cast<uintptr_t>(x.data()) %
                                           (kVec * DTypeSize(x.dtype())) == 0;
  const int64_t per_thread = vec ? kVec : 1;
  const int64_t col_tiles = (cols + kThreads * per_thread - 1) / (kThreads * per_thread);
  int64_t splits = std::max<int64_t>(1, 4 * sm_count() / col_tiles);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, rows / 16));
  splits = std::min<int64_t>(splits, 65535);
  const int64_t rows_per_split = std::max<int64_t>(1, (rows + splits - 1) / splits);
  splits = rows == 0 ? 1 : (rows + rows_per_split - 1) / rows_per_split;
  ASSIGN_OR_RETURN(Tensor partial, Allocate(DType::kF32, {splits, cols}));
  DispatchFloat(x.dtype(), [&](auto in) {
    using In = decltype(in);
    auto kernel = vec ? SumRowsPartialKernel<In, kVec> : SumRowsPartialKernel<In, 1>;
    kernel<<<dim3(col_tiles, splits), kThreads, 0, stream()>>>(
        static_cast<const typename In::Storage*>(x.data()), partial.data_as<float>(), rows,
        cols, rows_per_split);
  });
  LaunchPartialColumnSums(partial.data_as<const float>(), splits, cols, y->dtype(), y->data(),
                          stream());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::Dot(const Tensor& a, const Tensor& b, Tensor* out) {
  RETURN_IF_ERROR(CheckDotArgs(a, b, out));
  RETURN_IF_ERROR(Enter());
  const int64_t n = a.numel();
  // Two blocks per SM: enough loads in flight to stream both inputs.
  const int blocks = 2 * context().properties.multiProcessorCount;
  ASSIGN_OR_RETURN(Tensor partial, Allocate(DType::kF32, {blocks}));
  DispatchFloat(a.dtype(), [&](auto in) {
    using In = decltype(in);
    using Storage = typename In::Storage;
    const bool vec = PackAligned<Storage>(a.data()) && PackAligned<Storage>(b.data());
    DotPartialKernel<In><<<blocks, 1024, 0, stream()>>>(static_cast<const Storage*>(a.data()),
                                                        static_cast<const Storage*>(b.data()), n,
                                                        vec, partial.data_as<float>());
  });
  DotFinalKernel<<<1, 256, 0, stream()>>>(partial.data_as<const float>(), blocks,
                                          out->data_as<float>());
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
