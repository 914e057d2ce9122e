// Position encodings: rotary embedding, and the T5 relative position bias (a
// gather from a [heads, buckets] table; its backward a deterministic
// scatter-add). Semantics as in the CPU reference (kernels/cpu/position.cc).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/rotary.cuh"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// cos / sin at [s * half + i] for rows s of S.
__global__ void RotaryTableKernel(float* cos_table, float* sin_table, int64_t seq, int64_t half,
                                  RotaryAngles angles) {
  const int64_t n = seq * half;
  const int64_t start = angles.Start();
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = k / half, i = k - row * half;
    RotaryCosSin(start + row, i, angles.dim, angles.min_timescale, angles.ratio, angles.inverse,
                 &cos_table[k], &sin_table[k]);
  }
}

// One thread per rotated pair; it reads both elements before writing, so y may
// alias x. x, y: [B, S, H, D] viewed as rows of D. cos_table null: each
// thread computes its own angle (a few rows, a decode step's: one launch, no
// table).
template <typename In, typename Out>
__global__ void RotaryKernel(const typename In::Storage* x, typename Out::Storage* y,
                             const float* cos_table, const float* sin_table, int64_t rows,
                             int64_t seq, int64_t heads, int64_t dim, bool consecutive,
                             RotaryAngles angles) {
  const int64_t half = dim / 2;
  const int64_t pairs = rows * half;
  const int64_t start = cos_table == nullptr ? angles.Start() : 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < pairs;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / half, i = k - r * half;
    const int64_t p = (r / heads) % seq;
    // TE JAX: "consecutive" pairs (2i, 2i+1); "alternate" pairs (i, i + D/2).
    const int64_t first = r * dim + (consecutive ? 2 * i : i);
    const int64_t second = r * dim + (consecutive ? 2 * i + 1 : i + half);
    float c, s;
    if (cos_table != nullptr) {
      c = cos_table[p * half + i];
      s = sin_table[p * half + i];
    } else {
      RotaryCosSin(start + p, i, angles.dim, angles.min_timescale, angles.ratio, angles.inverse,
                   &c, &s);
    }
    const float2 rotated = RotatePair(In::Load(x[first]), In::Load(x[second]), c, s);
    y[first] = Out::Store(rotated.x);
    y[second] = Out::Store(rotated.y);
  }
}

// RotaryQkInPlace: parts 0 and 1 of qkv [B, S, 3, H, D] rotated in place,
// one thread a pair (RotaryKernel's arithmetic and table, so the same bits as
// rotating the split q and k).
template <typename T>
__global__ void RotaryQkKernel(typename T::Storage* qkv, const float* cos_table,
                               const float* sin_table, int64_t rows, int64_t seq,
                               int64_t heads, int64_t dim, bool consecutive) {
  const int64_t half = dim / 2;
  const int64_t pairs = rows * half;  // of one part; rows = B * S * H
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < 2 * pairs;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t part = k / pairs, n = k - part * pairs;
    const int64_t r = n / half, i = n - r * half;  // r = (b * S + s) * H + h
    const int64_t token = r / heads, h = r - token * heads, p = token % seq;
    typename T::Storage* row = qkv + ((token * 3 + part) * heads + h) * dim;
    const int64_t first = consecutive ? 2 * i : i;
    const int64_t second = consecutive ? 2 * i + 1 : i + half;
    const float2 rotated =
        RotatePair(T::Load(row[first]), T::Load(row[second]), cos_table[p * half + i],
                   sin_table[p * half + i]);
    row[first] = T::Store(rotated.x);
    row[second] = T::Store(rotated.y);
  }
}

// RotaryKernel's table path for 2-byte elements, a thread a group of pairs:
// kPairs pairs' elements in one or two 16-byte loads and stores, their cos and
// sin as float4s, one index division per group instead of three per pair
// (the pair-a-thread kernel took 34 us for the 24 x 1024 LM's q [8, 1024, 16,
// 64] bf16 on the H200, four times its bytes over bandwidth). Alternate pairs
// (i, i + D/2): 8 pairs from the row's two halves; consecutive (2i, 2i+1): 4
// pairs from 8 adjacent elements. Same arithmetic as RotaryKernel (RotatePair),
// so the same bits; reads a group before writing it, so y may alias x.
//
// Rows: `rows` rows of D, `row_heads` of them a token, token t's rows at
// t * token_rows + (0 .. row_heads) rows of memory: [B, S, H, D] is row_heads
// = token_rows = H; the q and k of a packed qkv [B, S, 3, H, D], rotated in
// place, are row_heads 2H of token_rows 3H (v, the third part, untouched).
template <typename In, typename Out, bool kConsecutive>
__global__ void RotaryGroupKernel(const uint16_t* x, uint16_t* y, const float* cos_table,
                                  const float* sin_table, int64_t rows, int64_t seq,
                                  int64_t row_heads, int64_t token_rows, int64_t dim) {
  constexpr int kPairs = kConsecutive ? 4 : 8;
  const int64_t half = dim / 2;
  const int64_t groups = half / kPairs;  // per row
  const int64_t n = rows * groups;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / groups, i0 = (k - r * groups) * kPairs;
    const int64_t token = r / row_heads, p = token % seq;
    const int64_t offset = (token * token_rows + (r - token * row_heads)) * dim;
    float c[kPairs], s[kPairs];
#pragma unroll
    for (int q = 0; q < kPairs / 4; ++q) {
      const float4 cv = reinterpret_cast<const float4*>(cos_table + p * half + i0)[q];
      const float4 sv = reinterpret_cast<const float4*>(sin_table + p * half + i0)[q];
      c[4 * q] = cv.x, c[4 * q + 1] = cv.y, c[4 * q + 2] = cv.z, c[4 * q + 3] = cv.w;
      s[4 * q] = sv.x, s[4 * q + 1] = sv.y, s[4 * q + 2] = sv.z, s[4 * q + 3] = sv.w;
    }
    const uint16_t* src = x + offset;
    uint16_t* dst = y + offset;
    if constexpr (kConsecutive) {
      uint4 v = *reinterpret_cast<const uint4*>(src + 2 * i0);
      uint16_t* e = reinterpret_cast<uint16_t*>(&v);
#pragma unroll
      for (int m = 0; m < kPairs; ++m) {
        const float2 rotated = RotatePair(In::Load(e[2 * m]), In::Load(e[2 * m + 1]), c[m], s[m]);
        e[2 * m] = Out::Store(rotated.x);
        e[2 * m + 1] = Out::Store(rotated.y);
      }
      *reinterpret_cast<uint4*>(dst + 2 * i0) = v;
    } else {
      uint4 a = *reinterpret_cast<const uint4*>(src + i0);
      uint4 b = *reinterpret_cast<const uint4*>(src + i0 + half);
      uint16_t* ea = reinterpret_cast<uint16_t*>(&a);
      uint16_t* eb = reinterpret_cast<uint16_t*>(&b);
#pragma unroll
      for (int m = 0; m < kPairs; ++m) {
        const float2 rotated = RotatePair(In::Load(ea[m]), In::Load(eb[m]), c[m], s[m]);
        ea[m] = Out::Store(rotated.x);
        eb[m] = Out::Store(rotated.y);
      }
      *reinterpret_cast<uint4*>(dst + i0) = a;
      *reinterpret_cast<uint4*>(dst + i0 + half) = b;
    }
  }
}

// A decode step's q, k and v out of the packed qkv [B, T, 3, H, D], one thread
// a pair of elements (Rotary's pairs): part 0 to q [B, T, H, D], parts 1 and
// 2 to the caches [B, L, H, D] at row p + t (p = *position; rows outside [0,
// L) are skipped), q and k rotated where `rotate` (angles.Start() is the
// rotation's position of token 0, as RotaryKernel's folded path computes it).
template <typename T>
__global__ void DecodeQkvRowsKernel(const typename T::Storage* qkv, typename T::Storage* q,
                                    typename T::Storage* key_cache,
                                    typename T::Storage* value_cache, const int32_t* position,
                                    int64_t batch, int64_t tokens, int64_t heads, int64_t dim,
                                    int64_t length, bool rotate, bool consecutive,
                                    RotaryAngles angles) {
  const int64_t half = dim / 2;
  const int64_t pairs = batch * tokens * heads * half;  // of one part
  const int64_t p = *position;
  const int64_t start = rotate ? angles.Start() : 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < 3 * pairs;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t part = k / pairs, n = k - part * pairs;
    const int64_t r = n / half, i = n - r * half;  // r = (b * T + t) * H + h
    const int64_t h = r % heads, bt = r / heads, t = bt % tokens, b = bt / tokens;
    const int64_t first = consecutive ? 2 * i : i;
    const int64_t second = consecutive ? 2 * i + 1 : i + half;
    const typename T::Storage* src = qkv + ((bt * 3 + part) * heads + h) * dim;
    typename T::Storage* dst;
    if (part == 0) {
      dst = q + r * dim;
    } else {
      const int64_t row = p + t;
      if (row < 0 || row >= length) continue;
      dst = (part == 1 ? key_cache : value_cache) + ((b * length + row) * heads + h) * dim;
    }
    if (!rotate || part == 2) {
      dst[first] = src[first];
      dst[second] = src[second];
      continue;
    }
    float c, s;
    RotaryCosSin(start + t, i, angles.dim, angles.min_timescale, angles.ratio, angles.inverse, &c,
                 &s);
    const float2 rotated = RotatePair(T::Load(src[first]), T::Load(src[second]), c, s);
    dst[first] = T::Store(rotated.x);
    dst[second] = T::Store(rotated.y);
  }
}

// bias[h, i, j] = table[buckets[r0 + i, j], h], bias [H, Sq, Skv], buckets
// [R, Skv]; r0 = *first_row (device int32, read here; null: 0), and rows
// r0 + i outside [0, R) give 0. Buckets are device data, checked here rather
// than with a host round trip: an out-of-range bucket yields NaN, which shows
// in any result it reaches.
//
// A thread reads kBiasColumns adjacent buckets of one row once (two 16-byte
// loads where Skv is a multiple of kBiasColumns, else one column) and writes
// them for every head, looking each up in the block's copy of the table in
// shared memory (head-major: a warp's lookups of one head fall in distinct
// banks). A thread per column group of one head had read the [Sq, Skv]
// buckets once a head and gathered from the table in global memory: 35 us
// for the 24 x 1024 LM's [16, 1024, 1024] bf16 on the H100 and the H200,
// against 9 to 13 us to write its 32 MB; reading the buckets once for all
// heads took it to 21 us on the H100 (relative_bias_bench, one machine).
// A table too large for shared memory is read from global memory instead.
constexpr int kBiasColumns = 8;

template <typename O>
struct alignas(16) BiasColumns {
  typename O::Storage v[kBiasColumns];
};

template <typename T, typename O, int kColumns>
__global__ void RelativeBiasForwardKernel(const typename T::Storage* table,
                                          const int32_t* buckets, const int32_t* first_row,
                                          typename O::Storage* bias, int64_t bucket_rows,
                                          int64_t q_rows, int64_t cols, int heads,
                                          int num_buckets, bool shared_table) {
  extern __shared__ float head_table[];  // [heads][num_buckets] when shared_table
  if (shared_table) {
    for (int x = threadIdx.x; x < heads * num_buckets; x += blockDim.x) {
      head_table[x] = T::Load(table[x]);
    }
    __syncthreads();
  }
  auto lookup = [&](int32_t b, int h) {
    if (b < 0 || b >= num_buckets) return NAN;
    return shared_table ? head_table[h * num_buckets + b]
                        : T::Load(table[static_cast<int64_t>(h) * num_buckets + b]);
  };
  const int64_t r0 = first_row != nullptr ? *first_row : 0;
  const int64_t groups = cols / kColumns, plane = q_rows * cols;
  for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < q_rows * groups;
       n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = n / groups, j = (n % groups) * kColumns, r = r0 + i;
    const bool inside = r >= 0 && r < bucket_rows;
    int32_t b[kColumns];
    if (!inside) {
#pragma unroll
      for (int c = 0; c < kColumns; ++c) b[c] = 0;
    } else if constexpr (kColumns == kBiasColumns) {
      const int4* src = reinterpret_cast<const int4*>(buckets + r * cols + j);
      const int4 lo = src[0], hi = src[1];
      const int32_t loaded[kBiasColumns] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int c = 0; c < kColumns; ++c) b[c] = loaded[c];
    } else {
      b[0] = buckets[r * cols + j];
    }
    typename O::Storage* dst = bias + i * cols + j;
    for (int h = 0; h < heads; ++h, dst += plane) {
      if constexpr (kColumns == kBiasColumns) {
        BiasColumns<O> out;
#pragma unroll
        for (int c = 0; c < kColumns; ++c) out.v[c] = O::Store(inside ? lookup(b[c], h) : 0.0f);
        *reinterpret_cast<BiasColumns<O>*>(dst) = out;
      } else {
        *dst = O::Store(inside ? lookup(b[0], h) : 0.0f);
      }
    }
  }
}

// Pass 1, block (chunk, h): each thread sums its strided positions of the chunk
// into its own column of a shared histogram hist[bucket][thread] (no atomics),
// then the block adds the columns in thread order into
// partial[(chunk * heads + h) * num_buckets + bucket].
__global__ void RelativeBiasPartialKernel(const float* dbias, const int32_t* buckets,
                                          float* partial, int64_t positions, int64_t chunk_len,
                                          int64_t heads, int num_buckets) {
  extern __shared__ float hist[];
  const int threads = blockDim.x;
  for (int b = 0; b < num_buckets; ++b) hist[b * threads + threadIdx.x] = 0.0f;
  const int64_t chunk = blockIdx.x, h = blockIdx.y;
  const int64_t begin = chunk * chunk_len;
  const int64_t end = min(positions, begin + chunk_len);
  const float* grad = dbias + h * positions;
  for (int64_t n = begin + threadIdx.x; n < end; n += threads) {
    const int32_t b = buckets[n];
    if (b >= 0 && b < num_buckets) hist[b * threads + threadIdx.x] += grad[n];
  }
  __syncthreads();
  for (int b = threadIdx.x; b < num_buckets; b += threads) {
    float sum = 0.0f;
    for (int t = 0; t < threads; ++t) sum += hist[b * threads + t];
    partial[(chunk * heads + h) * num_buckets + b] = sum;
  }
}

// Pass 2: dtable[h, b] = sum over chunks, in chunk order.
template <typename T>
__global__ void RelativeBiasFinalKernel(const float* partial, typename T::Storage* dtable,
                                        int64_t chunks, int64_t heads, int64_t num_buckets) {
  const int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;  // h * num_buckets + b
  if (k >= num_buckets * heads) return;
  const int64_t h = k / num_buckets, b = k - h * num_buckets;
  float sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) sum += partial[(c * heads + h) * num_buckets + b];
  dtable[k] = T::Store(sum);
}

// RotaryGroupKernel over x's rows into y's (RotaryGroupKernel's row layout),
// where it fits: 2-byte elements on both sides, whole groups of pairs a row,
// 16-byte aligned data. Returns whether it launched.
bool LaunchRotaryGroups(const RotaryArgs& args, const Tensor& x, Tensor* y,
                        const float* cos_table, const float* sin_table, int64_t rows,
                        int64_t seq, int64_t row_heads, int64_t token_rows, int64_t dim,
                        SmCount sms, cudaStream_t stream) {
  const int64_t half = dim / 2;
  const int64_t group_pairs = args.consecutive ? 4 : 8;
  if (DTypeSize(x.dtype()) != 2 || DTypeSize(y->dtype()) != 2 || half % group_pairs != 0 ||
      reinterpret_cast<uintptr_t>(x.data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(y->data()) % 16 != 0) {
    return false;
  }
  const int64_t groups = rows * (half / group_pairs);
  const auto* src = static_cast<const uint16_t*>(x.data());
  auto* dst = static_cast<uint16_t*>(y->data());
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      if constexpr (sizeof(typename In::Storage) == 2 && sizeof(typename Out::Storage) == 2) {
        if (args.consecutive) {
          RotaryGroupKernel<In, Out, true><<<GridFor(groups, sms), kThreads, 0, stream>>>(
              src, dst, cos_table, sin_table, rows, seq, row_heads, token_rows, dim);
        } else {
          RotaryGroupKernel<In, Out, false><<<GridFor(groups, sms), kThreads, 0, stream>>>(
              src, dst, cos_table, sin_table, rows, seq, row_heads, token_rows, dim);
        }
      }
    });
  });
  return true;
}

}  // namespace

absl::StatusOr<RotaryTable> MakeRotaryTable(CudaOps& ops, const RotaryAngles& angles,
                                            int64_t seq) {
  const int64_t half = angles.dim / 2;
  RotaryTable table;
  ASSIGN_OR_RETURN(table.memory, ops.Allocate(DType::kF32, {2, seq, half}));
  float* cos_table = table.memory.data_as<float>();
  float* sin_table = cos_table + seq * half;
  RotaryTableKernel<<<GridFor(seq * half, ops.sms()), kThreads, 0, ops.stream()>>>(
      cos_table, sin_table, seq, half, angles);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  table.cos = cos_table;
  table.sin = sin_table;
  return table;
}

absl::StatusOr<RotaryTable> TableFor(CudaOps& ops, const RotaryArgs& args, int64_t seq,
                                     int64_t dim) {
  if (!args.table.defined()) return MakeRotaryTable(ops, AnglesOf(args, dim), seq);
  RotaryTable table;
  table.memory = args.table;
  table.cos = args.table.data_as<const float>();
  table.sin = table.cos + seq * (dim / 2);
  return table;
}

absl::StatusOr<Tensor> CudaOps::RotaryTable(const RotaryArgs& args, int64_t seq, int64_t dim) {
  RETURN_IF_ERROR(CheckRotaryTableArgs(args, seq, dim));
  RETURN_IF_ERROR(Enter());
  if (seq * dim == 0) return Allocate(DType::kF32, {2, seq, dim / 2});
  ASSIGN_OR_RETURN(const cuda::RotaryTable table, MakeRotaryTable(*this, AnglesOf(args, dim), seq));
  return table.memory;
}

absl::Status CudaOps::Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckRotaryArgs(args, x, y));
  const int64_t seq = x.dim(1), heads = x.dim(2), dim = x.dim(3), half = dim / 2;
  const int64_t rows = dim == 0 ? 0 : x.numel() / dim;
  if (rows == 0 || half == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const RotaryAngles angles = AnglesOf(args, dim);
  // A table of angles pays for its launch when many rows share a position;
  // a few positions (a decode step's one) compute their angles in place.
  cuda::RotaryTable table;
  if (seq > kFoldedRotaryMaxSeq || args.table.defined()) {
    ASSIGN_OR_RETURN(table, TableFor(*this, args, seq, dim));
  }
  const float* cos_table = table.cos;
  const float* sin_table = table.sin;
  // Whole 16-byte groups of 2-byte elements: the grouped kernel.
  if (cos_table != nullptr &&
      LaunchRotaryGroups(args, x, y, cos_table, sin_table, rows, seq, heads, heads, dim, sms(),
                         stream())) {
    CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }
  DispatchFloat(x.dtype(), [&](auto in) {
    DispatchFloat(y->dtype(), [&](auto out) {
      using In = decltype(in);
      using Out = decltype(out);
      RotaryKernel<In, Out><<<GridFor(rows * half), kThreads, 0, stream()>>>(
          static_cast<const typename In::Storage*>(x.data()),
          static_cast<typename Out::Storage*>(y->data()), cos_table, sin_table, rows, seq, heads,
          dim, args.consecutive, angles);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::RotaryQkInPlace(const RotaryArgs& args, Tensor* qkv) {
  RETURN_IF_ERROR(CheckRotaryQkArgs(args, *qkv));
  const int64_t seq = qkv->dim(1), heads = qkv->dim(3), dim = qkv->dim(4), half = dim / 2;
  const int64_t rows = qkv->dim(0) * seq * heads;
  if (rows == 0 || half == 0) return absl::OkStatus();
  // Short sequences and device positions: the default's split and Rotary
  // (which computes those angles in place).
  if (seq <= kFoldedRotaryMaxSeq || HasDevicePosition(args.position)) {
    return Ops::RotaryQkInPlace(args, qkv);
  }
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const cuda::RotaryTable table, TableFor(*this, args, seq, dim));
  const float* cos_table = table.cos;
  const float* sin_table = table.sin;
  // q and k are rows 0 .. 2H of each token's 3H.
  if (LaunchRotaryGroups(args, *qkv, qkv, cos_table, sin_table, 2 * rows, seq, 2 * heads,
                         3 * heads, dim, sms(), stream())) {
    CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }
  DispatchFloat(qkv->dtype(), [&](auto format) {
    using T = decltype(format);
    RotaryQkKernel<T><<<GridFor(2 * rows * half), kThreads, 0, stream()>>>(
        static_cast<typename T::Storage*>(qkv->data()), cos_table, sin_table, rows, seq, heads,
        dim, args.consecutive);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::DecodeQkvRows(const Tensor& qkv, const RotaryArgs* rotary,
                                    const Tensor& position, Tensor* q, Tensor* key_cache,
                                    Tensor* value_cache) {
  RETURN_IF_ERROR(CheckDecodeQkvRowsArgs(qkv, rotary, position, q, key_cache, value_cache));
  const int64_t batch = qkv.dim(0), tokens = qkv.dim(1), heads = qkv.dim(3), dim = qkv.dim(4);
  const int64_t pairs = 3 * batch * tokens * heads * (dim / 2);
  // An odd head_dim (no rotation: Rotary needs D even) moves element pairs
  // that do not exist: the default's copies take it.
  if (dim % 2 != 0 || (rotary != nullptr && tokens > kFoldedRotaryMaxSeq)) {
    return Ops::DecodeQkvRows(qkv, rotary, position, q, key_cache, value_cache);
  }
  if (pairs == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const RotaryAngles angles = rotary != nullptr ? AnglesOf(*rotary, dim) : RotaryAngles{};
  DispatchFloat(qkv.dtype(), [&](auto format) {
    using T = decltype(format);
    using S = typename T::Storage;
    DecodeQkvRowsKernel<T><<<GridFor(pairs), kThreads, 0, stream()>>>(
        static_cast<const S*>(qkv.data()), static_cast<S*>(q->data()),
        static_cast<S*>(key_cache->data()), static_cast<S*>(value_cache->data()),
        position.data_as<const int32_t>(), batch, tokens, heads, dim, key_cache->dim(1),
        rotary != nullptr, rotary == nullptr || rotary->consecutive, angles);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                          const Tensor& first_row, Tensor* bias) {
  ASSIGN_OR_RETURN(const RelativeBiasDims dims,
                   CheckRelativeBiasForwardArgs(table, buckets, first_row, bias));
  const int64_t num_buckets = dims.num_buckets, heads = dims.heads;
  const int64_t bucket_rows = buckets.dim(0), q_rows = bias->dim(1), cols = buckets.dim(1);
  const int64_t n = bias->numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const int32_t* r0 = HasDevicePosition(first_row) ? first_row.data_as<const int32_t>() : nullptr;
  if (heads * num_buckets > std::numeric_limits<int32_t>::max()) {
    return absl::UnimplementedError(absl::StrCat("RelativeBiasForward: a table of ", heads,
                                                 " heads x ", num_buckets,
                                                 " buckets (the GPU kernel indexes it in int32)"));
  }
  // Whole 16-byte bucket loads and bias stores: every row starts aligned.
  const bool vector = cols % kBiasColumns == 0 &&
                      reinterpret_cast<uintptr_t>(bias->data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(buckets.data()) % 16 == 0 &&
                      (cols * static_cast<int64_t>(DTypeSize(bias->dtype()))) % 16 == 0;
  const int64_t groups = vector ? cols / kBiasColumns : cols;
  const size_t table_bytes = static_cast<size_t>(heads * num_buckets) * sizeof(float);
  const bool shared_table = table_bytes <= kDefaultSharedBytes;
  const size_t shared_bytes = shared_table ? table_bytes : 0;
  const unsigned grid = GridFor(q_rows * groups);
  const int heads_arg = static_cast<int>(heads), buckets_arg = static_cast<int>(num_buckets);
  DispatchFloatPair(table.dtype(), bias->dtype(), [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    const auto* table_data = static_cast<const typename T::Storage*>(table.data());
    auto* bias_data = static_cast<typename O::Storage*>(bias->data());
    if (vector) {
      RelativeBiasForwardKernel<T, O, kBiasColumns><<<grid, kThreads, shared_bytes, stream()>>>(
          table_data, buckets.data_as<const int32_t>(), r0, bias_data, bucket_rows, q_rows, cols,
          heads_arg, buckets_arg, shared_table);
    } else {
      RelativeBiasForwardKernel<T, O, 1><<<grid, kThreads, shared_bytes, stream()>>>(
          table_data, buckets.data_as<const int32_t>(), r0, bias_data, bucket_rows, q_rows, cols,
          heads_arg, buckets_arg, shared_table);
    }
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudaOps::RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                           Tensor* dtable) {
  constexpr const char* kOp = "RelativeBiasBackward";
  ASSIGN_OR_RETURN(const RelativeBiasDims dims,
                   CheckRelativeBiasBackwardArgs(dbias, buckets, dtable));
  const int64_t num_buckets = dims.num_buckets, heads = dims.heads;
  if (num_buckets * heads == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const int64_t positions = buckets.numel();
  // Per-thread histogram columns: as many threads as shared memory allows.
  int threads = 128;
  while (threads > 32 && num_buckets * threads * sizeof(float) > kDefaultSharedBytes) threads /= 2;
  const size_t shared_bytes = static_cast<size_t>(num_buckets) * threads * sizeof(float);
  if (shared_bytes > kMaxSharedBytes) {
    return absl::UnimplementedError(absl::StrCat(kOp, ": ", num_buckets,
                                                 " buckets exceed the GPU kernel's limit of ",
                                                 kMaxSharedBytes / (32 * sizeof(float))));
  }
  RETURN_IF_ERROR(AllowSharedBytes(context(), RelativeBiasPartialKernel, shared_bytes,
                                   "cudaFuncSetAttribute(RelativeBiasPartialKernel)"));
  // Enough (chunk, head) blocks to fill the GPU; each chunk at least 4K positions.
  int64_t chunks = std::max<int64_t>(1, (2 * sm_count() + heads - 1) / heads);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, positions / 4096));
  const int64_t chunk_len = std::max<int64_t>(1, (positions + chunks - 1) / chunks);
  chunks = positions == 0 ? 1 : (positions + chunk_len - 1) / chunk_len;
  ASSIGN_OR_RETURN(Tensor partial, Allocate(DType::kF32, {chunks, heads, num_buckets}));
  RelativeBiasPartialKernel<<<dim3(chunks, heads), threads, shared_bytes, stream()>>>(
      dbias.data_as<const float>(), buckets.data_as<const int32_t>(), partial.data_as<float>(),
      positions, chunk_len, heads, static_cast<int>(num_buckets));
  CUDA_RETURN_IF_LAUNCH_ERROR();
  const int64_t outputs = num_buckets * heads;
  DispatchFloat(dtable->dtype(), [&](auto t) {
    using T = decltype(t);
    RelativeBiasFinalKernel<T><<<(outputs + kThreads - 1) / kThreads, kThreads, 0, stream()>>>(
        partial.data_as<const float>(), static_cast<typename T::Storage*>(dtable->data()),
        chunks, heads, num_buckets);
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
