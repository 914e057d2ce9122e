// One query row per sequence (a decode step: Sq == 1) in one launch. cuDNN's
// fused kernel tiles 64 queries against 64 keys, so a decode step pays a
// whole tile for its one row and then ZeroInvisibleRows for the rows cuDNN
// leaves unspecified: about 9.5 us a layer on the H200 for what is a few
// hundred dot products. Here a block of 512 threads takes one (sequence,
// query head): a thread per key for the logits (the key row's 16-byte loads
// issued together), one block-wide max and sum, then a thread per 8 value
// columns for a strided share of the keys, summed by shuffles within a warp
// and in shared memory across warps. Each thread walks as few keys as the
// block allows: with 128 threads, a dozen dependent trips to HBM made the
// kernel 12-14 us at 8 x 16 heads x 190 keys on the H200, slower than cuDNN.
// The loads that need only the row's lengths (the first key row, its bias,
// the first value rows) are all issued before the first wait. A relative
// bias named by its table (AttentionArgs::relative_bias) is looked up per
// key, so a decode step launches no kernel to make [H, 1, Skv].
// float32 arithmetic, with cuDNN's one rounding of the probabilities to the
// operands' dtype before P @ V.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rotary.cuh"
#include "kernels/op_checks.h"

namespace te {
namespace cuda {
namespace {

constexpr int kDecodeThreads = 512;
// The weights of one row live in shared memory: at most this many keys
// (48 KiB less q and the value partials).
constexpr int64_t kDecodeMaxKeys = 10240;

struct DecodeParams {
  AttentionShape shape;
  const void* q;
  const void* k;
  const void* v;
  const void* bias;  // [Hq, 1, Skv] in bias format, or null
  // Or the bias by its table (AttentionArgs::relative_bias): table [Hq, NB]
  // in bias format, row first_row (null: 0) of buckets [rows, Skv].
  const void* rel_table;
  int64_t rel_num_buckets;
  const int32_t* rel_buckets;
  const int32_t* rel_first_row;
  int64_t rel_rows;
  const int32_t* q_seqlens;   // null: the row is valid
  const int32_t* kv_seqlens;  // null: every key
  bool causal;
  bool bottom_right;
  float scale;
  void* out;
  float* lse;  // [B, Hq, 1] or null
  // Set when the step's q, key and value come from the fused projection's
  // qkv [B, 1, 3, H, D] (Ops::DecodeAttentionFromQkv): the block rotates
  // its head's q and key (rotate) as DecodeQkvRows does, writes q to q_out
  // and the key and value into the caches (k and v, as key_rows and
  // value_rows) at row *position, then attends as without.
  const void* qkv;
  void* q_out;
  void* key_rows;
  void* value_rows;
  const int32_t* position;
  bool rotate;
  bool consecutive;
  RotaryAngles angles;
};

// This thread's element of the block's head from qkv (thread d < D: element
// d of q, the key and the value), rotated and written as DecodeQkvRows
// writes it; returns q's element as the attention reads it.
template <typename T, int kDim>
__device__ __forceinline__ float NewRowsFromQkv(const DecodeParams& p, int64_t b, int64_t h) {
  using Storage = typename T::Storage;
  const AttentionShape& s = p.shape;
  const int d = threadIdx.x;
  if (d >= kDim) return 0.0f;
  constexpr int kHalf = kDim / 2;
  const int i = p.consecutive ? d / 2 : d % kHalf;
  const int first = p.consecutive ? 2 * i : i, second = p.consecutive ? 2 * i + 1 : i + kHalf;
  const Storage* qkv = static_cast<const Storage*>(p.qkv);
  const Storage* q_src = qkv + (b * 3 * s.q_heads + h) * kDim;
  const Storage* k_src = q_src + s.q_heads * kDim;
  const Storage* v_src = k_src + s.q_heads * kDim;
  const float qa = T::Load(q_src[first]), qb = T::Load(q_src[second]);
  const float ka = T::Load(k_src[first]), kb = T::Load(k_src[second]);
  const Storage v = v_src[d];
  const int64_t row = *p.position;
  Storage q_value = q_src[d], k_value = k_src[d];
  if (p.rotate) {
    float c, sn;
    RotaryCosSin(p.angles.Start(), i, p.angles.dim, p.angles.min_timescale, p.angles.ratio,
                 p.angles.inverse, &c, &sn);
    const float2 q_rotated = RotatePair(qa, qb, c, sn), k_rotated = RotatePair(ka, kb, c, sn);
    q_value = T::Store(d == first ? q_rotated.x : q_rotated.y);
    k_value = T::Store(d == first ? k_rotated.x : k_rotated.y);
  }
  static_cast<Storage*>(p.q_out)[(b * s.q_heads + h) * kDim + d] = q_value;
  if (row >= 0 && row < s.kv_seq) {
    const int64_t at = ((b * s.kv_seq + row) * s.kv_heads + h) * kDim + d;
    static_cast<Storage*>(p.key_rows)[at] = k_value;
    static_cast<Storage*>(p.value_rows)[at] = v;
  }
  return T::Load(q_value);
}

__device__ __forceinline__ int64_t Clamped(const int32_t* lengths, int64_t b, int64_t max) {
  if (lengths == nullptr) return max;
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > max ? max : len);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kDecodeThreads / 32 ? scratch[lane] : -INFINITY;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Key j's bias for query head h: made, or looked up in the relative table
// (bucket row rel_row, 0 past the buckets' rows as RelativeBiasForward).
template <typename B>
__device__ __forceinline__ float BiasAt(const DecodeParams& p, int64_t h, int64_t j,
                                        int64_t rel_row) {
  using Storage = typename B::Storage;
  if (p.bias != nullptr) return B::Load(static_cast<const Storage*>(p.bias)[h * p.shape.kv_seq + j]);
  if (p.rel_table == nullptr || rel_row < 0 || rel_row >= p.rel_rows) return 0.0f;
  const int32_t bucket = p.rel_buckets[rel_row * p.shape.kv_seq + j];
  return B::Load(static_cast<const Storage*>(p.rel_table)[h * p.rel_num_buckets + bucket]);
}

// A key row's logit against q (float, shared memory): kPacks 16-byte loads
// issued together, then the products.
template <typename T, int kPacks>
__device__ __forceinline__ float KeyDot(const Pack<typename T::Storage>* key, const float* q) {
  Pack<typename T::Storage> k[kPacks];
#pragma unroll
  for (int c = 0; c < kPacks; ++c) k[c] = key[c];
  float dot = 0.0f;
#pragma unroll
  for (int c = 0; c < kPacks; ++c) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) dot = fmaf(q[c * kVec + e], T::Load(k[c].v[e]), dot);
  }
  return dot;
}

// Grid (Hq, B), kDecodeThreads threads; kPacks = D / kVec (4, 8 or 16).
// Shared memory: q [D], the weights [Skv], a partial output per warp
// [kDecodeThreads / 32][D], all float.
template <typename T, typename B, int kPacks>
__global__ void __launch_bounds__(kDecodeThreads) DecodeAttentionKernel(DecodeParams p) {
  using Storage = typename T::Storage;
  using Vec = Pack<Storage>;
  constexpr int kDim = kPacks * kVec;
  static_assert(kDim <= kDecodeThreads, "q is loaded a thread an element");
  constexpr int kShares = kDecodeThreads / kPacks;  // keys a value pass takes at once
  // Value trips whose rows are loaded up front (registers: kPrefetched
  // 16-byte packs): 256 keys at head_dim 64, 128 at 128.
  constexpr int kPrefetched = 4;
  extern __shared__ float shared[];
  __shared__ float scratch[32];
  const AttentionShape& s = p.shape;
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t kvh = h / (s.q_heads / s.kv_heads);
  const int64_t row = b * s.q_heads + h;
  Storage* out = static_cast<Storage*>(p.out) + row * kDim;

  // q's load is issued before the lengths are waited for (registers now,
  // shared memory below).
  const Storage* q_row = static_cast<const Storage*>(p.q) + row * kDim;
  const float q_element = p.qkv != nullptr   ? NewRowsFromQkv<T, kDim>(p, b, h)
                          : threadIdx.x < kDim ? T::Load(q_row[threadIdx.x])
                                               : 0.0f;
  const int64_t rel_row = p.rel_first_row != nullptr ? p.rel_first_row[0] : 0;
  const bool has_bias = p.bias != nullptr || p.rel_table != nullptr;

  // The keys this row sees: a prefix, as the unfused kernels define it.
  int64_t end = 0;
  if (Clamped(p.q_seqlens, b, 1) > 0) {
    const int64_t kv_len = Clamped(p.kv_seqlens, b, s.kv_seq);
    end = kv_len;
    if (p.causal) {
      const int64_t diagonal_end =
          1 + (p.bottom_right ? kv_len - Clamped(p.q_seqlens, b, 1) : 0);
      end = min(end, max(diagonal_end, int64_t{0}));
    }
  }
  if (end == 0) {
    for (int d = threadIdx.x; d < kDim; d += blockDim.x) out[d] = T::Store(0.0f);
    if (p.lse != nullptr && threadIdx.x == 0) p.lse[row] = INFINITY;
    return;
  }
  // The new key and value rows, written above, are read below.
  if (p.qkv != nullptr) __syncthreads();

  float* q = shared;
  float* weights = q + kDim;
  float* partials = weights + s.kv_seq;
  const Storage* keys = static_cast<const Storage*>(p.k);
  const Storage* values = static_cast<const Storage*>(p.v);
  const int64_t key_stride = s.kv_heads * kDim;  // elements from key j to j + 1
  const int64_t first_key = (b * s.kv_seq * s.kv_heads + kvh) * kDim;
  // Every load that needs only the lengths is issued before the next wait:
  // this thread's first key row, its bias, and the value rows of its first
  // kPrefetched value trips. At a decode step's sizes the kernel is a chain
  // of round trips to memory, and q, the keys and the values were three of
  // them one after another; now the lengths are one and these the other.
  const int share = threadIdx.x / kPacks, pack = threadIdx.x % kPacks;
  const int64_t first = threadIdx.x;
  Vec first_key_row[kPacks];
  float first_bias = 0.0f;
  if (first < end) {
    const Vec* key = reinterpret_cast<const Vec*>(keys + first_key + first * key_stride);
#pragma unroll
    for (int c = 0; c < kPacks; ++c) first_key_row[c] = key[c];
    if (has_bias) first_bias = BiasAt<B>(p, h, first, rel_row);
  }
  Vec early_values[kPrefetched];
#pragma unroll
  for (int i = 0; i < kPrefetched; ++i) {
    const int64_t j = share + int64_t(i) * kShares;
    if (j < end) {
      early_values[i] = reinterpret_cast<const Vec*>(values + first_key + j * key_stride)[pack];
    }
  }
  if (threadIdx.x < kDim) q[threadIdx.x] = q_element;
  __syncthreads();

  float local_max = -INFINITY;
  if (first < end) {
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < kPacks; ++c) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) dot = fmaf(q[c * kVec + e], T::Load(first_key_row[c].v[e]), dot);
    }
    const float logit = p.scale * dot + first_bias;
    weights[first] = logit;
    local_max = logit;
  }
  for (int64_t j = first + blockDim.x; j < end; j += blockDim.x) {
    const Vec* key = reinterpret_cast<const Vec*>(keys + first_key + j * key_stride);
    float logit = p.scale * KeyDot<T, kPacks>(key, q);
    if (has_bias) logit += BiasAt<B>(p, h, j, rel_row);
    weights[j] = logit;
    local_max = fmaxf(local_max, logit);
  }
  const float row_max = BlockMax(local_max, scratch);
  // The row's sum from the float32 exponentials; the products with v from
  // them rounded to the operands' dtype, as cuDNN's kernel feeds P to its
  // P @ V (so a decode step rounds as the forward over the whole sequence).
  float local_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < end; j += blockDim.x) {
    const float e = expf(weights[j] - row_max);
    weights[j] = T::Load(T::Store(e));
    local_sum += e;
  }
  const float sum = BlockSum(local_sum, scratch);  // its barriers publish the weights

  // Thread (share, column pack): keys share, share + kShares, ... of one
  // pack; the shares of a warp (lanes kPacks apart) summed by shuffles, the
  // warps' sums in shared memory.
  float acc[kVec] = {};
#pragma unroll
  for (int i = 0; i < kPrefetched; ++i) {
    const int64_t j = share + int64_t(i) * kShares;
    if (j < end) {
      const float w = weights[j];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w, T::Load(early_values[i].v[e]), acc[e]);
    }
  }
#pragma unroll 4
  for (int64_t j = share + int64_t(kPrefetched) * kShares; j < end; j += kShares) {
    const Vec vv = reinterpret_cast<const Vec*>(values + first_key + j * key_stride)[pack];
    const float w = weights[j];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w, T::Load(vv.v[e]), acc[e]);
  }
#pragma unroll
  for (int offset = kPacks; offset < 32; offset *= 2) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], offset);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane < kPacks) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) partials[warp * kDim + pack * kVec + e] = acc[e];
  }
  __syncthreads();
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < kDim; d += blockDim.x) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeThreads / 32; ++w) total += partials[w * kDim + d];
    out[d] = T::Store(total * inv);
  }
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[row] = row_max + logf(sum);
}

size_t SharedBytes(const AttentionShape& s) {
  return static_cast<size_t>(s.head_dim + s.kv_seq + (kDecodeThreads / 32) * s.head_dim) *
         sizeof(float);
}

}  // namespace

bool DecodeAttentionFits(const AttentionArgs& args, const AttentionShape& s, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& out) {
  if (s.q_seq != 1 || args.dropout_rate != 0.0f || args.elementwise_mask.defined()) return false;
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || out.dtype() != q.dtype()) return false;
  for (const Tensor* bias : {&args.bias, &args.relative_bias.table}) {
    if (bias->defined() && bias->dtype() != DType::kF32 && bias->dtype() != q.dtype()) {
      return false;
    }
  }
  // The head sizes the kernel is specialised for; rows of whole 16-byte packs.
  if ((s.head_dim != 32 && s.head_dim != 64 && s.head_dim != 128) || s.batch > 65535) {
    return false;
  }
  bool aligned = false;
  DispatchFloat(q.dtype(), [&](auto t) {
    using Storage = typename decltype(t)::Storage;
    aligned = PackAligned<Storage>(k.data()) && PackAligned<Storage>(v.data());
  });
  return aligned && s.kv_seq <= kDecodeMaxKeys && SharedBytes(s) <= 48 * 1024;
}

namespace {

absl::Status Launch(const DecodeParams& p, const AttentionShape& s, DType dtype, DType bias_dtype,
                    cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(s.q_heads), static_cast<unsigned>(s.batch));
  const size_t shared = SharedBytes(s);
  DispatchFloat(dtype, [&](auto t) {
    DispatchFloat(bias_dtype, [&](auto bias) {
      using T = decltype(t);
      using B = decltype(bias);
      switch (s.head_dim) {
        case 32: DecodeAttentionKernel<T, B, 4><<<grid, kDecodeThreads, shared, stream>>>(p); break;
        case 64: DecodeAttentionKernel<T, B, 8><<<grid, kDecodeThreads, shared, stream>>>(p); break;
        default: DecodeAttentionKernel<T, B, 16><<<grid, kDecodeThreads, shared, stream>>>(p);
      }
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

DecodeParams ParamsOf(const AttentionArgs& args, const AttentionShape& s, const Tensor& q,
                      const Tensor& k, const Tensor& v, Tensor* out, Tensor* softmax_lse) {
  DecodeParams p{};
  p.shape = s;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.bias = args.bias.defined() ? args.bias.data() : nullptr;
  const AttentionArgs::RelativeBiasTable& relative = args.relative_bias;
  p.rel_table = relative.defined() ? relative.table.data() : nullptr;
  p.rel_num_buckets = relative.defined() ? relative.table.dim(1) : 0;
  p.rel_buckets = relative.defined() ? relative.buckets.data_as<const int32_t>() : nullptr;
  p.rel_first_row = relative.defined() && relative.first_row.defined()
                        ? relative.first_row.data_as<const int32_t>()
                        : nullptr;
  p.rel_rows = relative.defined() ? relative.buckets.dim(0) : 0;
  const bool padding = IsPaddingMask(args.mask);
  p.q_seqlens = padding ? args.q_seqlens.data_as<const int32_t>() : nullptr;
  p.kv_seqlens = padding ? args.kv_seqlens.data_as<const int32_t>() : nullptr;
  p.causal = IsCausalMask(args.mask);
  p.bottom_right = IsBottomRightMask(args.mask);
  p.scale = args.scale;
  p.out = out->data();
  p.lse = softmax_lse != nullptr && softmax_lse->defined() ? softmax_lse->data_as<float>()
                                                            : nullptr;
  return p;
}

DType BiasDType(const AttentionArgs& args) {
  if (args.bias.defined()) return args.bias.dtype();
  return args.relative_bias.defined() ? args.relative_bias.table.dtype() : DType::kF32;
}

}  // namespace

absl::Status DecodeAttentionForward(const AttentionArgs& args, const AttentionShape& s,
                                    const Tensor& q, const Tensor& k, const Tensor& v, Tensor* out,
                                    Tensor* softmax_lse, cudaStream_t stream) {
  return Launch(ParamsOf(args, s, q, k, v, out, softmax_lse), s, q.dtype(), BiasDType(args),
                stream);
}

absl::Status DecodeAttentionFromQkvForward(const AttentionArgs& args, const AttentionShape& s,
                                           const Tensor& qkv, const RotaryArgs* rotary,
                                           const Tensor& position, Tensor* q, Tensor* key_cache,
                                           Tensor* value_cache, Tensor* out, Tensor* softmax_lse,
                                           cudaStream_t stream) {
  DecodeParams p = ParamsOf(args, s, *q, *key_cache, *value_cache, out, softmax_lse);
  p.qkv = qkv.data();
  p.q_out = q->data();
  p.key_rows = key_cache->data();
  p.value_rows = value_cache->data();
  p.position = position.data_as<const int32_t>();
  p.rotate = rotary != nullptr;
  p.consecutive = rotary == nullptr || rotary->consecutive;
  if (rotary != nullptr) p.angles = AnglesOf(*rotary, s.head_dim);
  return Launch(p, s, q->dtype(), BiasDType(args), stream);
}

}  // namespace cuda
}  // namespace te
