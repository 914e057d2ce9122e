// Unfused attention: correct for every configuration ops.h allows (f32 / f16 /
// bf16 operands, an f32 bias, every mask type, top-left or bottom-right
// causal, an elementwise mask shared over the heads or per head, GQA,
// dropout by DropoutUniform with ops.h's element index), so the backend is
// complete wherever cuDNN's fused kernels decline. Written for clarity: one thread block per query row
// (forward, dq) or per key row (dk, dv), keys/queries visited in tiles of
// kTile, each dot product done by one warp with its lanes across head_dim
// (coalesced), each tile's weights applied by all threads across head_dim.
//
// Cost: about 2x (forward) and 5x (backward) the FLOPs of the fused kernels on
// CUDA cores rather than tensor cores; for B4 H32 S2048 D128 some tens of ms.
// It is the path of last resort, not the fast path.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_elem.cuh"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/fp8.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;  // keys (or queries) per tile; warp 0 reduces a tile as 2 per lane
constexpr int kMaxDPerThread = static_cast<int>(kFallbackMaxHeadDim) / kThreads;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t ClampedLength(const int32_t* lengths, int64_t b, int64_t max) {
  if (lengths == nullptr) return max;
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > max ? max : len);
}

// Where batch b's causal diagonal lies: key j is visible to query i iff
// j <= i + offset; 0 top-left, the key count minus the query count
// bottom-right (ops.h's MaskType).
__device__ __forceinline__ int64_t DiagonalOffset(const AttentionProblem& p, int64_t b) {
  if (!p.bottom_right) return 0;
  return ClampedLength(p.kv_seqlens, b, p.shape.kv_seq) -
         ClampedLength(p.q_seqlens, b, p.shape.q_seq);
}

// One past the last key query i of batch b sees (the visible keys are always
// a prefix); 0 when it sees none.
__device__ __forceinline__ int64_t VisibleEnd(const AttentionProblem& p, int64_t b, int64_t i) {
  if (i >= ClampedLength(p.q_seqlens, b, p.shape.q_seq)) return 0;
  int64_t end = ClampedLength(p.kv_seqlens, b, p.shape.kv_seq);
  if (p.causal) {
    const int64_t diagonal_end = i + 1 + DiagonalOffset(p, b);
    if (diagonal_end < end) end = diagonal_end < 0 ? 0 : diagonal_end;
  }
  return end;
}

// Inverted-dropout multiplier of probability (row, j): row = (b*Hq + h)*Sq + i.
__device__ __forceinline__ float DropoutMultiplier(const AttentionProblem& p, int64_t row,
                                                   int64_t j) {
  if (p.dropout_rate == 0.0f) return 1.0f;
  const uint64_t index = static_cast<uint64_t>(row * p.shape.kv_seq + j);
  return DropoutUniform(p.dropout_seed, index) >= p.dropout_rate
             ? 1.0f / (1.0f - p.dropout_rate)
             : 0.0f;
}

// sum_d x[d] * y[offset + d], x in shared memory; every lane gets the sum.
__device__ __forceinline__ float WarpDot(const float* x, const void* y, DType y_dtype,
                                         int64_t offset, int64_t dim, int lane) {
  float sum = 0.0f;
  for (int64_t d = lane; d < dim; d += 32) sum += x[d] * LoadElem(y, y_dtype, offset + d);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFullMask, sum, o);
  return sum;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ int64_t QOffset(const AttentionShape& s, int64_t b, int64_t i,
                                           int64_t h) {
  return ((b * s.q_seq + i) * s.q_heads + h) * s.head_dim;
}

__device__ __forceinline__ int64_t KvOffset(const AttentionShape& s, int64_t b, int64_t j,
                                            int64_t kvh) {
  return ((b * s.kv_seq + j) * s.kv_heads + kvh) * s.head_dim;
}

// Whether the elementwise mask masks key j for query i of batch b, head h.
__device__ __forceinline__ bool ElementMasked(const AttentionProblem& p, int64_t b, int64_t h,
                                              int64_t i, int64_t j) {
  if (p.mask == nullptr) return false;
  const int64_t plane = p.mask_per_head ? b * p.shape.q_heads + h : b;
  return p.mask[(plane * p.shape.q_seq + i) * p.shape.kv_seq + j];
}

// acc[c] += sum over jj < n of weights[jj] * x[b, t0 + jj, kvh, d], for this
// thread's elements d = tid + c * kThreads of the head (x: k or v).
__device__ __forceinline__ void AccumulateWeightedRows(float (&acc)[kMaxDPerThread],
                                                       const float* weights, int n,
                                                       const void* x, DType x_dtype,
                                                       const AttentionShape& s, int64_t b,
                                                       int64_t t0, int64_t kvh, int tid) {
#pragma unroll
  for (int c = 0; c < kMaxDPerThread; ++c) {
    const int64_t d = tid + c * kThreads;
    if (d >= s.head_dim) break;
    for (int jj = 0; jj < n; ++jj) {
      acc[c] += weights[jj] * LoadElem(x, x_dtype, KvOffset(s, b, t0 + jj, kvh) + d);
    }
  }
}

// dst[offset + d] = acc[c] for this thread's elements d of the head.
__device__ __forceinline__ void StoreHeadRow(void* dst, DType dst_dtype, int64_t offset,
                                             const float (&acc)[kMaxDPerThread],
                                             int64_t head_dim, int tid) {
#pragma unroll
  for (int c = 0; c < kMaxDPerThread; ++c) {
    const int64_t d = tid + c * kThreads;
    if (d < head_dim) StoreElem(dst, dst_dtype, offset + d, acc[c]);
  }
}

// scale * q_row . k[b, j, kvh] + bias[h, i, j], or -inf where the elementwise
// mask masks (b, i, j); warp-collective.
__device__ __forceinline__ float Logit(const AttentionProblem& p, const float* q_row, int64_t b,
                                       int64_t h, int64_t kvh, int64_t i, int64_t j, int lane) {
  const AttentionShape& s = p.shape;
  float logit = p.scale * WarpDot(q_row, p.k, p.k_dtype, KvOffset(s, b, j, kvh), s.head_dim, lane);
  if (p.bias != nullptr) logit += p.bias[(h * s.q_seq + i) * s.kv_seq + j];
  return ElementMasked(p, b, h, i, j) ? -INFINITY : logit;
}

// acc (this thread's elements d of the head) = sum over keys j < end of
// weight(j) * x[b, j, kvh, d] (x: k or v), a tile of kTile keys at a time:
// the warps evaluate weight(j) (warp-collective; lane 0's value is kept) into
// tile[], then every thread sums its elements.
template <typename WeightFn>
__device__ __forceinline__ void WeightedKeySum(float (&acc)[kMaxDPerThread], float* tile,
                                               int64_t end, const void* x, DType x_dtype,
                                               const AttentionShape& s, int64_t b, int64_t kvh,
                                               WeightFn weight) {
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
#pragma unroll
  for (int c = 0; c < kMaxDPerThread; ++c) acc[c] = 0.0f;
  for (int64_t t0 = 0; t0 < end; t0 += kTile) {
    const int n = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
    for (int jj = warp; jj < n; jj += kWarps) {
      const float w = weight(t0 + jj);
      if (lane == 0) tile[jj] = w;
    }
    __syncthreads();
    AccumulateWeightedRows(acc, tile, n, x, x_dtype, s, b, t0, kvh, tid);
    __syncthreads();
  }
}

// Query row r = (b*Hq + h)*Sq + i: its batch, head, position and kv head.
struct QueryRow {
  int64_t b, h, i, kvh;
};
__device__ __forceinline__ QueryRow QueryRowOf(const AttentionShape& s, int64_t row) {
  QueryRow r;
  r.i = row % s.q_seq;
  r.h = (row / s.q_seq) % s.q_heads;
  r.b = row / (s.q_seq * s.q_heads);
  r.kvh = r.h / (s.q_heads / s.kv_heads);
  return r;
}

// For query row `row` and key j, with P = exp(logit - lse) and M the dropout
// multiplier: *prob = P and *dprob = (dout . v_j) M; warp-collective.
__device__ __forceinline__ void ProbAndDprob(const AttentionProblem& p, const float* q_row,
                                             const float* dout_row, const QueryRow& q, int64_t row,
                                             int64_t j, float lse, int lane, float* prob,
                                             float* dprob) {
  const AttentionShape& s = p.shape;
  *prob = expf(Logit(p, q_row, q.b, q.h, q.kvh, q.i, j, lane) - lse);
  *dprob = WarpDot(dout_row, p.v, p.v_dtype, KvOffset(s, q.b, j, q.kvh), s.head_dim, lane) *
           DropoutMultiplier(p, row, j);
}

// One block per query row r = (b*Hq + h)*Sq + i. Pass 1: running max and sum
// of exp over the visible keys (online softmax, tile by tile) -> lse. Pass 2:
// out = sum_j exp(logit_j - lse) * dropout_j * v_j.
// Shared memory: q_row [D] | weights [kTile].
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(AttentionProblem p, void* out, DType out_dtype, float* lse_out) {
  extern __shared__ float shared[];
  const AttentionShape& s = p.shape;
  float* q_row = shared;
  float* weights = shared + s.head_dim;
  __shared__ float running_max;
  __shared__ float running_sum;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int64_t row = blockIdx.x;
  const QueryRow q = QueryRowOf(s, row);
  const int64_t i = q.i, h = q.h, b = q.b, kvh = q.kvh;
  const int64_t end = VisibleEnd(p, b, i);
  const int64_t q_offset = QOffset(s, b, i, h);

  for (int64_t d = tid; d < s.head_dim; d += kThreads) q_row[d] = LoadElem(p.q, p.q_dtype, q_offset + d);
  if (tid == 0) {
    running_max = -INFINITY;
    running_sum = 0.0f;
  }
  __syncthreads();

  for (int64_t t0 = 0; t0 < end; t0 += kTile) {
    const int n = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
    for (int jj = warp; jj < n; jj += kWarps) {
      const float logit = Logit(p, q_row, b, h, kvh, i, t0 + jj, lane);
      if (lane == 0) weights[jj] = logit;
    }
    __syncthreads();
    if (warp == 0) {
      const float a = lane < n ? weights[lane] : -INFINITY;
      const float c = lane + 32 < n ? weights[lane + 32] : -INFINITY;
      const float old_max = running_max;
      const float new_max = fmaxf(old_max, WarpMax(fmaxf(a, c)));
      float part = 0.0f;
      if (new_max != -INFINITY) part = expf(a - new_max) + expf(c - new_max);
      part = WarpSum(part);
      if (lane == 0) {
        running_sum = (old_max == -INFINITY ? 0.0f : running_sum * expf(old_max - new_max)) + part;
        running_max = new_max;
      }
    }
    __syncthreads();
  }
  // A row whose keys are all masked (or all biased to -inf) outputs zeros.
  const float lse = (end == 0 || running_max == -INFINITY) ? INFINITY
                                                           : running_max + logf(running_sum);

  float acc[kMaxDPerThread];
  WeightedKeySum(
      acc, weights, lse != INFINITY ? end : 0, p.v, p.v_dtype, s, b, kvh, [&](int64_t j) {
        return expf(Logit(p, q_row, b, h, kvh, i, j, lane) - lse) * DropoutMultiplier(p, row, j);
      });
  StoreHeadRow(out, out_dtype, q_offset, acc, s.head_dim, tid);
  if (tid == 0) lse_out[row] = lse;
}

// With P = exp(logit - lse), M the dropout multipliers, dP = (dout . v) * M:
//   row_dot = sum_j P dP;  dS = P (dP - row_dot);  dq = scale sum_j dS k_j;
//   dbias[h, i, j] += dS (atomically: summed over the batch).
// One block per query row. Shared memory: q_row [D] | dout_row [D] | tile [kTile].
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardRowsKernel(AttentionProblem p, const void* dout, DType dout_dtype,
                                const float* lse_in, void* dq, DType dq_dtype, float* dbias,
                                float* row_dot_out) {
  extern __shared__ float shared[];
  const AttentionShape& s = p.shape;
  float* q_row = shared;
  float* dout_row = shared + s.head_dim;
  float* tile = shared + 2 * s.head_dim;
  __shared__ float dot_sum;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int64_t row = blockIdx.x;
  const QueryRow q = QueryRowOf(s, row);
  const int64_t i = q.i, h = q.h, b = q.b, kvh = q.kvh;
  const float lse = lse_in[row];
  const int64_t end = isfinite(lse) ? VisibleEnd(p, b, i) : 0;
  const int64_t q_offset = QOffset(s, b, i, h);

  for (int64_t d = tid; d < s.head_dim; d += kThreads) {
    q_row[d] = LoadElem(p.q, p.q_dtype, q_offset + d);
    dout_row[d] = LoadElem(dout, dout_dtype, q_offset + d);
  }
  if (tid == 0) dot_sum = 0.0f;
  __syncthreads();

  for (int64_t t0 = 0; t0 < end; t0 += kTile) {
    const int n = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
    for (int jj = warp; jj < n; jj += kWarps) {
      float prob, dprob;
      ProbAndDprob(p, q_row, dout_row, q, row, t0 + jj, lse, lane, &prob, &dprob);
      if (lane == 0) tile[jj] = prob * dprob;
    }
    __syncthreads();
    if (warp == 0) {
      float part = (lane < n ? tile[lane] : 0.0f) + (lane + 32 < n ? tile[lane + 32] : 0.0f);
      part = WarpSum(part);
      if (lane == 0) dot_sum += part;
    }
    __syncthreads();
  }
  const float row_dot = dot_sum;

  float acc[kMaxDPerThread];
  WeightedKeySum(acc, tile, end, p.k, p.k_dtype, s, b, kvh, [&](int64_t j) {
    float prob, dprob;
    ProbAndDprob(p, q_row, dout_row, q, row, j, lse, lane, &prob, &dprob);
    const float dlogit = prob * (dprob - row_dot);
    if (lane == 0 && dbias != nullptr) {
      atomicAdd(&dbias[(h * s.q_seq + i) * s.kv_seq + j], dlogit);
    }
    return p.scale * dlogit;
  });
  StoreHeadRow(dq, dq_dtype, q_offset, acc, s.head_dim, tid);
  if (tid == 0) row_dot_out[row] = row_dot;
}

// dv_j = sum over the query heads of its group and the rows that see key j of
// P M dout_i;  dk_j = scale sum dS q_i. One block per key row
// c = (b*Skv + j)*Hkv + kvh, so every dk/dv element has one writer.
// Shared memory: k_row [D] | v_row [D] | pm [kTile] | ds [kTile].
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardColumnsKernel(AttentionProblem p, const void* dout, DType dout_dtype,
                                   const float* lse_in, const float* row_dot, void* dk,
                                   DType dk_dtype, void* dv, DType dv_dtype) {
  extern __shared__ float shared[];
  const AttentionShape& s = p.shape;
  float* k_row = shared;
  float* v_row = shared + s.head_dim;
  float* pm = shared + 2 * s.head_dim;
  float* ds = pm + kTile;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int64_t column = blockIdx.x;
  const int64_t kvh = column % s.kv_heads;
  const int64_t j = (column / s.kv_heads) % s.kv_seq;
  const int64_t b = column / (s.kv_heads * s.kv_seq);
  const int64_t group = s.q_heads / s.kv_heads;
  const int64_t kv_offset = KvOffset(s, b, j, kvh);
  const bool key_valid = j < ClampedLength(p.kv_seqlens, b, s.kv_seq);
  const int64_t q_valid = ClampedLength(p.q_seqlens, b, s.q_seq);
  // Rows that see key j: i < q_valid, and i >= j - offset under a causal mask.
  int64_t first_row = 0;
  if (p.causal) {
    first_row = j - DiagonalOffset(p, b);
    if (first_row < 0) first_row = 0;
  }

  for (int64_t d = tid; d < s.head_dim; d += kThreads) {
    k_row[d] = LoadElem(p.k, p.k_dtype, kv_offset + d);
    v_row[d] = LoadElem(p.v, p.v_dtype, kv_offset + d);
  }
  __syncthreads();

  float acc_dk[kMaxDPerThread];
  float acc_dv[kMaxDPerThread];
#pragma unroll
  for (int c = 0; c < kMaxDPerThread; ++c) acc_dk[c] = acc_dv[c] = 0.0f;

  if (key_valid) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      for (int64_t t0 = first_row; t0 < q_valid; t0 += kTile) {
        const int n = static_cast<int>(q_valid - t0 < kTile ? q_valid - t0 : kTile);
        for (int ii = warp; ii < n; ii += kWarps) {
          const int64_t i = t0 + ii;
          const int64_t row = (b * s.q_heads + h) * s.q_seq + i;
          const float lse = lse_in[row];
          float weight = 0.0f;
          float dlogit_scaled = 0.0f;
          if (isfinite(lse)) {  // uniform across the warp
            const int64_t q_offset = QOffset(s, b, i, h);
            float logit = p.scale * WarpDot(k_row, p.q, p.q_dtype, q_offset, s.head_dim, lane);
            if (p.bias != nullptr) logit += p.bias[(h * s.q_seq + i) * s.kv_seq + j];
            if (ElementMasked(p, b, h, i, j)) logit = -INFINITY;
            const float prob = expf(logit - lse);
            const float multiplier = DropoutMultiplier(p, row, j);
            const float dprob =
                WarpDot(v_row, dout, dout_dtype, q_offset, s.head_dim, lane) * multiplier;
            weight = prob * multiplier;
            dlogit_scaled = p.scale * prob * (dprob - row_dot[row]);
          }
          if (lane == 0) {
            pm[ii] = weight;
            ds[ii] = dlogit_scaled;
          }
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < kMaxDPerThread; ++c) {
          const int64_t d = tid + c * kThreads;
          if (d >= s.head_dim) break;
          for (int ii = 0; ii < n; ++ii) {
            const int64_t q_offset = QOffset(s, b, t0 + ii, h);
            acc_dv[c] += pm[ii] * LoadElem(dout, dout_dtype, q_offset + d);
            acc_dk[c] += ds[ii] * LoadElem(p.q, p.q_dtype, q_offset + d);
          }
        }
        __syncthreads();
      }
    }
  }
  StoreHeadRow(dk, dk_dtype, kv_offset, acc_dk, s.head_dim, tid);
  StoreHeadRow(dv, dv_dtype, kv_offset, acc_dv, s.head_dim, tid);
}

// Rows with no visible key: out = 0, lse = +inf. One thread per row.
__global__ void ZeroInvisibleRowsKernel(AttentionProblem p, void* out, DType out_dtype,
                                        float* lse) {
  const AttentionShape& s = p.shape;
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; row < rows;
       row += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const QueryRow q = QueryRowOf(s, row);
    if (VisibleEnd(p, q.b, q.i) != 0) continue;
    const int64_t q_offset = QOffset(s, q.b, q.i, q.h);
    for (int64_t d = 0; d < s.head_dim; ++d) StoreElem(out, out_dtype, q_offset + d, 0.0f);
    lse[row] = INFINITY;
  }
}

absl::Status CheckLaunchable(const AttentionShape& s) {
  if (s.head_dim > kFallbackMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat("attention: head_dim ", s.head_dim,
                                                   " is over the unfused path's limit of ",
                                                   kFallbackMaxHeadDim));
  }
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  const int64_t columns = s.batch * s.kv_heads * s.kv_seq;
  if (rows > std::numeric_limits<int32_t>::max() || columns > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention: ", rows, " query rows / ", columns, " key rows is too many"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FallbackAttentionForward(const AttentionProblem& problem, void* out,
                                      DType out_dtype, float* lse, cudaStream_t stream) {
  const AttentionShape& s = problem.shape;
  RETURN_IF_ERROR(CheckLaunchable(s));
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  if (rows == 0) return absl::OkStatus();
  const size_t shared = static_cast<size_t>(s.head_dim + kTile) * sizeof(float);
  AttentionForwardKernel<<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(problem, out,
                                                                                   out_dtype, lse);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status FallbackAttentionBackward(const AttentionProblem& problem, const void* dout,
                                       DType dout_dtype, const float* lse, void* dq,
                                       DType dq_dtype, void* dk, DType dk_dtype, void* dv,
                                       DType dv_dtype, float* dbias, float* row_dot,
                                       cudaStream_t stream) {
  const AttentionShape& s = problem.shape;
  RETURN_IF_ERROR(CheckLaunchable(s));
  if (dbias != nullptr) {
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
        dbias, 0, static_cast<size_t>(s.q_heads * s.q_seq * s.kv_seq) * sizeof(float), stream));
  }
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  const int64_t columns = s.batch * s.kv_heads * s.kv_seq;
  if (rows > 0) {
    const size_t shared = static_cast<size_t>(2 * s.head_dim + kTile) * sizeof(float);
    AttentionBackwardRowsKernel<<<static_cast<unsigned>(rows), kThreads, shared, stream>>>(
        problem, dout, dout_dtype, lse, dq, dq_dtype, dbias, row_dot);
    CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  if (columns > 0) {
    const size_t shared = static_cast<size_t>(2 * s.head_dim + 2 * kTile) * sizeof(float);
    AttentionBackwardColumnsKernel<<<static_cast<unsigned>(columns), kThreads, shared, stream>>>(
        problem, dout, dout_dtype, lse, row_dot, dk, dk_dtype, dv, dv_dtype);
    CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

absl::Status ZeroInvisibleRows(const AttentionProblem& problem, void* out, DType out_dtype,
                               float* lse, cudaStream_t stream) {
  const AttentionShape& s = problem.shape;
  const int64_t rows = s.batch * s.q_heads * s.q_seq;
  if (rows == 0) return absl::OkStatus();
  const int threads = 256;
  const int64_t blocks = (rows + threads - 1) / threads;
  ZeroInvisibleRowsKernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), threads, 0,
                            stream>>>(problem, out, out_dtype, lse);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
