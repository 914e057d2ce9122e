// OptimizerUpdate: optax's elementwise update rules (ops.h) as one kernel per
// parameter tensor; OptimizerStep: the same rules over every parameter of a
// layer in three launches (global norm, the step's decision, the update),
// and a fourth where slots carry FP8 copies (their transposes and records).
// A chain (rmsprop, lion, optax.chain) runs ApplyLinks in its update launch,
// plus two launches per clip_by_global_norm after its first link.
//
// Memory-bound. AdamW reads grad, param, mu, nu and writes param, mu, nu (7
// accesses per element) and the norm reads grad once more: 8 accesses, so
// for the quickstart TransformerLayer's 201 M bf16 parameters 201e6 x 8 x 2 B
// = 3.2 GB per step, 0.75 ms at 4.3 TB/s (0.66 ms of it the update itself).
// Hence one launch for every slot, with the norm and count kept on the
// device: a launch per parameter, each reading them back to the host, costs
// about three times the update itself.
//
// FP8 copies (OptimizerSlot::fp8, the GEMM kernels' kept copies under
// DelayedScaling): the update writes the row-major codes from the new value
// it already holds (+1 B written per element) and folds max |param| into the
// copy's amax; then the transpose reads those codes (1 B) and writes the
// transposed ones (1 B). 3 B per element, against the 4 B per element of the
// next forward's cast-transpose of a bf16 weight (a 2 B read and two 1 B
// writes; 6 B from f32): 1 B saved per bf16 element (3 B per f32 one), and
// the forward's pass over the weights becomes a check of two scalars. For
// the quickstart layer's 201 M kernel elements (bf16): 0.60 GB moved per step
// instead of 0.80 GB, about 0.05 ms at 4 TB/s.
//
// Compute copies (OptimizerSlot::compute_copy, a bf16 layer's kept casts of
// its float32 weights): the update writes the 2 B code from the value it
// holds. The next forward's cast would read the 4 B weight again and write
// the same 2 B: 4 B saved per element (1.21 G parameters in the 24 x 2048
// LM: 4.8 GB a step, about 1.4 ms at 3.5 TB/s), and one launch per weight.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/optimizer_math.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// param, mu, nu: [n] in T's format; grad: [n] in G's; grad_norm_sq: f32 [1].
// The whole update is skipped (nothing written) when the norm is not finite,
// so a step with an inf or NaN gradient costs one read per thread.
template <typename T, typename G, bool kAdam, bool kTrace>
__global__ void OptimizerUpdateKernel(OptimizerUpdateArgs args, const typename G::Storage* grad,
                                      const float* grad_norm_sq, typename T::Storage* param,
                                      typename T::Storage* mu, typename T::Storage* nu,
                                      int64_t n) {
  const float norm_sq = *grad_norm_sq;
  if (!isfinite(norm_sq)) return;
  const float norm = sqrtf(norm_sq);
  const bool clip = args.max_norm > 0.0f && !(norm < args.max_norm);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float g = G::Load(grad[i]);
    if (clip) g = g / norm * args.max_norm;
    const float p = T::Load(param[i]);
    float u = g;
    if (kAdam) {
      const float m = (1.0f - args.b1) * g + args.b1 * T::Load(mu[i]);
      const float v = (1.0f - args.b2) * (g * g) + args.b2 * T::Load(nu[i]);
      mu[i] = T::Store(m);
      nu[i] = T::Store(v);
      u = (m / args.bias_correction1) / (sqrtf(v / args.bias_correction2 + args.eps_root) + args.eps);
    } else if (kTrace) {
      const float t = g + args.momentum * T::Load(mu[i]);
      mu[i] = T::Store(t);
      u = args.nesterov ? g + args.momentum * t : t;
    }
    u += args.weight_decay * p;
    param[i] = T::Store(p - args.learning_rate * u);
  }
}

}  // namespace

absl::Status CudaOps::OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                                      const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                                      Tensor* nu) {
  RETURN_IF_ERROR(CheckOptimizerUpdateArgs(args, grad, grad_norm_sq, param, mu, nu));
  const int64_t n = param->numel();
  if (n == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  const bool adam = args.rule == OptimizerUpdateArgs::Rule::kAdam;
  const bool trace = !adam && Wanted(mu);
  DispatchFloat(param->dtype(), [&](auto tp) {
    DispatchFloat(grad.dtype(), [&](auto tg) {
      using T = decltype(tp);
      using G = decltype(tg);
      using S = typename T::Storage;
      auto kernel = adam ? OptimizerUpdateKernel<T, G, true, false>
                         : (trace ? OptimizerUpdateKernel<T, G, false, true>
                                  : OptimizerUpdateKernel<T, G, false, false>);
      kernel<<<GridFor(n), kThreads, 0, stream()>>>(
          args, static_cast<const typename G::Storage*>(grad.data()),
          grad_norm_sq.data_as<const float>(), static_cast<S*>(param->data()),
          Wanted(mu) ? static_cast<S*>(mu->data()) : nullptr,
          Wanted(nu) ? static_cast<S*>(nu->data()) : nullptr, n);
    });
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

// ---- the multi-tensor step ---------------------------------------------------------
namespace {

// A plan's parameters go out in segments of one param dtype and at most
// kSegmentSlots slots: the segment's gradient pointers (new tensors every
// step) travel in the launch's own arguments (StepPointers, 3 KiB, inside
// the classic 4 KiB kernel-argument limit), everything else is in the
// plan's device tables.
constexpr int kSegmentSlots = 320;
// And at most kSegmentFp8Copies slots with an FP8 copy, whose scales (new
// tensors every step, as the gradients) travel in the arguments too.
constexpr int kSegmentFp8Copies = 64;
// Work is split into chunks of kChunk elements of one slot (the last of a
// slot shorter); blocks take chunks grid-stride. 16 K elements: 8 passes of
// a 256-thread block at kVec per thread, and few enough chunks (12 K for
// 201 M parameters) that the table is read in the noise.
constexpr int64_t kChunk = 16384;
constexpr int kStepThreads = 256;
constexpr int kFinalizeThreads = 256;

// A slot's compute copy (OptimizerSlot::compute_copy): 16-bit codes.
enum ComputeCopyKind : int32_t { kNoComputeCopy = 0, kBf16Copy = 1, kF16Copy = 2 };
// One slot in device memory.
struct SlotTable {
  void* param;
  void* mu;  // null: no moment (sgd without a trace)
  void* nu;
  uint16_t* copy;  // the compute copy, written as the param is; null: none
  int64_t numel;
  int32_t fp8;  // the slot's FP8 copy in its segment's Fp8Table; -1: none
  int32_t copy_kind;  // ComputeCopyKind
};

// The compute copy's code for the param as stored: Cast's rounding.
__device__ __forceinline__ uint16_t ComputeCopyCode(int32_t kind, float stored) {
  return kind == kBf16Copy ? BF16::Store(stored) : F16::Store(stored);
}
// One FP8 copy (OptimizerFp8Copy) in device memory.
struct Fp8Table {
  uint8_t* data;  // [rows, cols]
  uint8_t* data_t;  // [cols, rows]
  float* scale_inv;
  float* kept_scale;
  float* kept_amax;
  // The step's running max |param| (as bits), in the plan's tables: the
  // update folds into it, the transpose moves it to kept_amax and zeroes it,
  // so it is 0 between steps.
  unsigned* amax;
  int64_t rows, cols;
  int64_t first_tile;  // its first 64 x 64 tile among the segment's copies
  int32_t slot;        // within its segment
  int32_t e5m2;        // else E4M3
  int32_t words;       // rows, cols multiples of 4 and 4-byte aligned rows: word loads
  int32_t wide;        // rows, cols multiples of 16 and 16-byte aligned rows: 16-byte moves
};
struct Chunk {
  int32_t slot;  // within its segment
  int32_t unused;
  int64_t begin;
};
// Written by the finalize kernel, read by every update block.
struct Decision {
  OptimizerUpdateArgs args;
  float norm;
  int32_t applied;
  // Under a chain: its links' scalars; a clip's norm after link 0 is
  // written by its own pass (ClipNormKernel) before the update reads it.
  ChainStepArgs chain;
};
// The decision kernel takes the hyperparams (schedules and links included)
// as its argument.
static_assert(sizeof(OptimizerHyperparams) + 128 < 4096, "kernel arguments stay under 4 KiB");
// What changes every step, in the launches' own arguments.
struct StepPointers {
  const void* grad[kSegmentSlots];  // null: this launch leaves the slot alone
  const float* fp8_scale[kSegmentFp8Copies];  // by Fp8Table index
};
static_assert(sizeof(StepPointers) + 64 < 4096, "kernel arguments stay under 4 KiB");

template <typename S>
__device__ __forceinline__ bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<S>) == 0;
}

// partial[blockIdx.x] = this block's sum of g^2 over its chunks (float32).
// The grid is fixed per plan, so the partial sums, and the order the
// finalize kernel adds them in, are the same on every run.
template <typename G>
__global__ void __launch_bounds__(kStepThreads)
    GradNormPartialKernel(StepPointers grads, const SlotTable* slots, const Chunk* chunks,
                          int64_t num_chunks, float* partial) {
  using S = typename G::Storage;
  __shared__ float scratch[32];
  float acc = 0.0f;
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    const S* g = static_cast<const S*>(grads.grad[chunk.slot]);
    if (g == nullptr) continue;
    const int64_t slot_end = slots[chunk.slot].numel;
    const int64_t end = chunk.begin + kChunk < slot_end ? chunk.begin + kChunk : slot_end;
    int64_t i = chunk.begin + int64_t(threadIdx.x) * kVec;
    if (Aligned<S>(g)) {
      for (; i + kVec <= end; i += int64_t(kStepThreads) * kVec) {
        const Pack<S> v = *reinterpret_cast<const Pack<S>*>(g + i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float x = G::Load(v.v[j]);
          acc += x * x;
        }
      }
    } else {
      for (; i + kVec <= end; i += int64_t(kStepThreads) * kVec) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float x = G::Load(g[i + j]);
          acc += x * x;
        }
      }
    }
    // The tail: fewer than kVec elements, at the thread whose pack it starts.
    for (; i < end; ++i) {
      const float x = G::Load(g[i]);
      acc += x * x;
    }
  }
  const float sum = BlockSum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// One block: the norm from the partial sums (in a fixed order), then the
// step's decision from the count on the device, the counters and the info
// record. Nothing here waits for the host.
__global__ void __launch_bounds__(kFinalizeThreads)
    StepDecisionKernel(const float* partial, int64_t num_partials, OptimizerHyperparams h,
                       int32_t* count, int32_t* total_notfinite, Decision* decision,
                       OptimizerStepInfo* info) {
  __shared__ float scratch[32];
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < num_partials; i += kFinalizeThreads) acc += partial[i];
  const float norm_sq = BlockSum(acc, scratch);
  if (threadIdx.x != 0) return;
  const int32_t c = *count;
  const bool applied = isfinite(norm_sq);
  decision->args = UpdateArgsAt(h, c);
  decision->norm = sqrtf(norm_sq);
  decision->applied = applied ? 1 : 0;
  if (h.num_links > 0) {
    decision->chain = ChainArgsAt(h, c);
    // A clip at link 0 sees the gradients; later ones are overwritten.
    for (int k = 0; k < kMaxOptimizerLinks; ++k) decision->chain.clip_norm[k] = sqrtf(norm_sq);
  }
  const int32_t new_count = SaturatingIncrement(c, applied);
  const int32_t new_notfinite = SaturatingIncrement(*total_notfinite, !applied);
  *count = new_count;
  *total_notfinite = new_notfinite;
  info->learning_rate = LearningRateAt(h.schedules, h.learning_rate, c);
  info->grad_norm_sq = norm_sq;
  info->applied = applied ? 1 : 0;
  info->count = new_count;
  info->total_notfinite = new_notfinite;
}

// The elementwise rule of OptimizerUpdateKernel, the same float32 formula.
template <bool kAdam>
__device__ __forceinline__ float UpdateOne(const OptimizerUpdateArgs& a, bool clip, float norm,
                                           bool trace, float g, float p, float* m, float* v) {
  if (clip) g = g / norm * a.max_norm;
  float u = g;
  if (kAdam) {
    *m = (1.0f - a.b1) * g + a.b1 * *m;
    *v = (1.0f - a.b2) * (g * g) + a.b2 * *v;
    u = (*m / a.bias_correction1) / (sqrtf(*v / a.bias_correction2 + a.eps_root) + a.eps);
  } else if (trace) {
    const float t = g + a.momentum * *m;
    *m = t;
    u = a.nesterov ? g + a.momentum * t : t;
  }
  u += a.weight_decay * p;
  return p - a.learning_rate * u;
}

// No FP8 copy: no codes, no amax.
struct NoCodes {
  static constexpr bool kWrites = false;
  static __device__ __forceinline__ uint8_t Store(float) { return 0; }
};
template <typename Code>
struct CodesOf {
  static constexpr bool kWrites = true;
  static __device__ __forceinline__ uint8_t Store(float v) { return Code::Store(v); }
};

// One chunk [begin, end) of one slot: the update, and with Code the FP8
// codes of the new param (as stored) * scale into codes, the same float32
// product and rounding as fp8.cu's cast-transpose, so the copy equals what
// the next forward would make. Every thread of the block calls it for the
// same chunk (the amax is reduced over the block).
template <typename T, typename G, bool kAdam, typename Code>
__device__ __forceinline__ void UpdateChunk(const OptimizerUpdateArgs& a, bool clip, float norm,
                                            const typename G::Storage* g, const SlotTable& slot,
                                            int64_t begin, int64_t end, uint8_t* codes,
                                            float scale, unsigned* amax, unsigned* scratch) {
  using S = typename T::Storage;
  using GS = typename G::Storage;
  S* p = static_cast<S*>(slot.param);
  S* mu = static_cast<S*>(slot.mu);
  S* nu = static_cast<S*>(slot.nu);
  uint16_t* copy = slot.copy;
  const int32_t copy_kind = slot.copy_kind;
  const bool trace = mu != nullptr;
  unsigned local = 0;  // max |param| bits over this thread's elements
  int64_t i = begin + int64_t(threadIdx.x) * kVec;
  const bool vec = Aligned<GS>(g) && Aligned<S>(p) && (mu == nullptr || Aligned<S>(mu)) &&
                   (nu == nullptr || Aligned<S>(nu)) && (!Code::kWrites || Aligned<uint8_t>(codes)) &&
                   (copy == nullptr || Aligned<uint16_t>(copy));
  if (vec) {
    for (; i + kVec <= end; i += int64_t(kStepThreads) * kVec) {
      const Pack<GS> gv = *reinterpret_cast<const Pack<GS>*>(g + i);
      Pack<S> pv = *reinterpret_cast<const Pack<S>*>(p + i);
      Pack<S> mv, nv;
      Pack<uint8_t> cv;
      Pack<uint16_t> yv;
      if (kAdam || trace) mv = *reinterpret_cast<const Pack<S>*>(mu + i);
      if (kAdam) nv = *reinterpret_cast<const Pack<S>*>(nu + i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float m = (kAdam || trace) ? T::Load(mv.v[j]) : 0.0f;
        float v = kAdam ? T::Load(nv.v[j]) : 0.0f;
        const float np = UpdateOne<kAdam>(a, clip, norm, trace, G::Load(gv.v[j]),
                                          T::Load(pv.v[j]), &m, &v);
        pv.v[j] = T::Store(np);
        if (kAdam || trace) mv.v[j] = T::Store(m);
        if (kAdam) nv.v[j] = T::Store(v);
        if (Code::kWrites) {
          const float stored = T::Load(pv.v[j]);
          local = max(local, AbsBits(stored));
          cv.v[j] = Code::Store(stored * scale);
        }
        if (copy != nullptr) yv.v[j] = ComputeCopyCode(copy_kind, T::Load(pv.v[j]));
      }
      *reinterpret_cast<Pack<S>*>(p + i) = pv;
      if (kAdam || trace) *reinterpret_cast<Pack<S>*>(mu + i) = mv;
      if (kAdam) *reinterpret_cast<Pack<S>*>(nu + i) = nv;
      if (Code::kWrites) *reinterpret_cast<Pack<uint8_t>*>(codes + i) = cv;
      if (copy != nullptr) *reinterpret_cast<Pack<uint16_t>*>(copy + i) = yv;
    }
  }
  auto scalar = [&](int64_t from, int64_t to) {
    for (int64_t k = from; k < to; ++k) {
      float m = (kAdam || trace) ? T::Load(mu[k]) : 0.0f;
      float v = kAdam ? T::Load(nu[k]) : 0.0f;
      const float np =
          UpdateOne<kAdam>(a, clip, norm, trace, G::Load(g[k]), T::Load(p[k]), &m, &v);
      const S stored = T::Store(np);
      p[k] = stored;
      if (kAdam || trace) mu[k] = T::Store(m);
      if (kAdam) nu[k] = T::Store(v);
      if (Code::kWrites) {
        local = max(local, AbsBits(T::Load(stored)));
        codes[k] = Code::Store(T::Load(stored) * scale);
      }
      if (copy != nullptr) copy[k] = ComputeCopyCode(copy_kind, T::Load(stored));
    }
  };
  // Unaligned slots: the same packs, element by element.
  if (!vec) {
    for (; i + kVec <= end; i += int64_t(kStepThreads) * kVec) scalar(i, i + kVec);
  }
  // The tail: fewer than kVec elements, at the thread whose pack it starts.
  scalar(i, end);
  if (Code::kWrites) {
    local = BlockMaxBits(local, scratch);
    if (threadIdx.x == 0) atomicMax(amax, local);
  }
}

// param, mu, nu: T; grad: G. Every block reads the decision and returns at
// once when the step is skipped.
template <typename T, typename G, bool kAdam>
__global__ void __launch_bounds__(kStepThreads)
    MultiTensorUpdateKernel(StepPointers ptrs, const SlotTable* slots, const Chunk* chunks,
                            int64_t num_chunks, const Decision* decision, const Fp8Table* fp8) {
  using GS = typename G::Storage;
  __shared__ unsigned scratch[32];
  if (!decision->applied) return;
  const OptimizerUpdateArgs a = decision->args;
  const float norm = decision->norm;
  const bool clip = a.max_norm > 0.0f && !(norm < a.max_norm);
  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const Chunk chunk = chunks[c];
    const GS* g = static_cast<const GS*>(ptrs.grad[chunk.slot]);
    if (g == nullptr) continue;
    const SlotTable slot = slots[chunk.slot];
    const int64_t end = chunk.begin + kChunk < slot.numel ? chunk.begin + kChunk : slot.numel;
    if (slot.fp8 < 0) {
      UpdateChunk<T, G, kAdam, NoCodes>(a, clip, norm, g, slot, chunk.begin, end, nullptr, 0.0f,
                                        nullptr, scratch);
      continue;
    }
    const Fp8Table& copy = fp8[slot.fp8];
    const float scale = *ptrs.fp8_scale[slot.fp8];
    if (copy.e5m2) {
      UpdateChunk<T, G, kAdam, CodesOf<E5M2>>(a, clip, norm, g, slot, chunk.begin, end,
                                              copy.data, scale, copy.amax, scratch);
    } else {
      UpdateChunk<T, G, kAdam, CodesOf<E4M3>>(a, clip, norm, g, slot, chunk.begin, end,
                                              copy.data, scale, copy.amax, scratch);
    }
  }
}

// ---- chains: ApplyLinks per element ------------------------------------------------
// One element at a time (i = begin + thread, strided by the block: coalesced
// without packs), the slot's state read into a local array through the
// plan's state table (state[j] for the slot's j-th tensor). Correctness
// first: a chain moves the same bytes as the fused rule plus its extra
// state, but without vector loads.

// partial[blockIdx.x] = this block's sum of u^2, u the update after links
// [0, upto) (the state read, not written), float32 like the gradients' norm.
template <typename T, typename G>
__global__ void __launch_bounds__(kStepThreads)
    ChainNormPartialKernel(StepPointers grads, const SlotTable* slots, void* const* state,
                           const Chunk* chunks, int64_t num_chunks, const Decision* decision,
                           int upto, float* partial) {
  using S = typename T::Storage;
  using GS = typename G::Storage;
  __shared__ float scratch[32];
  if (!decision->applied) return;
  const ChainStepArgs& c = decision->chain;
  const int ns = c.num_state;
  float acc = 0.0f;
  for (int64_t k = blockIdx.x; k < num_chunks; k += gridDim.x) {
    const Chunk chunk = chunks[k];
    const GS* g = static_cast<const GS*>(grads.grad[chunk.slot]);
    if (g == nullptr) continue;
    const SlotTable slot = slots[chunk.slot];
    const S* p = static_cast<const S*>(slot.param);
    void* const* st_ptrs = state + int64_t(chunk.slot) * ns;
    const int64_t end = chunk.begin + kChunk < slot.numel ? chunk.begin + kChunk : slot.numel;
    for (int64_t i = chunk.begin + threadIdx.x; i < end; i += kStepThreads) {
      float st[kMaxSlotState];
      for (int j = 0; j < ns; ++j) st[j] = T::Load(static_cast<const S*>(st_ptrs[j])[i]);
      const float u = ApplyLinks(c, upto, G::Load(g[i]), T::Load(p[i]), st);
      acc += u * u;
    }
  }
  const float sum = BlockSum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// The norm of link `link`'s clip from the partial sums, in a fixed order.
__global__ void __launch_bounds__(kFinalizeThreads)
    ClipNormKernel(const float* partial, int64_t num_partials, Decision* decision, int link) {
  __shared__ float scratch[32];
  if (!decision->applied) return;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < num_partials; i += kFinalizeThreads) acc += partial[i];
  const float norm_sq = BlockSum(acc, scratch);
  if (threadIdx.x == 0) decision->chain.clip_norm[link] = sqrtf(norm_sq);
}

// One chunk of one slot through every link: state and param written, and
// with Code the FP8 codes and amax as UpdateChunk writes them.
template <typename T, typename G, typename Code>
__device__ __forceinline__ void ChainChunk(const ChainStepArgs& c, const typename G::Storage* g,
                                           void* const* st_ptrs, const SlotTable& slot,
                                           int64_t begin, int64_t end, uint8_t* codes, float scale,
                                           unsigned* amax, unsigned* scratch) {
  using S = typename T::Storage;
  S* p = static_cast<S*>(slot.param);
  const int ns = c.num_state;
  unsigned local = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kStepThreads) {
    float st[kMaxSlotState];
    for (int j = 0; j < ns; ++j) st[j] = T::Load(static_cast<const S*>(st_ptrs[j])[i]);
    const float pv = T::Load(p[i]);
    const float u = ApplyLinks(c, c.num_links, G::Load(g[i]), pv, st);
    for (int j = 0; j < ns; ++j) static_cast<S*>(st_ptrs[j])[i] = T::Store(st[j]);
    const S stored = T::Store(pv + u);
    p[i] = stored;
    if (slot.copy != nullptr) slot.copy[i] = ComputeCopyCode(slot.copy_kind, T::Load(stored));
    if (Code::kWrites) {
      const float v = T::Load(stored);
      local = max(local, AbsBits(v));
      codes[i] = Code::Store(v * scale);
    }
  }
  if (Code::kWrites) {
    local = BlockMaxBits(local, scratch);
    if (threadIdx.x == 0) atomicMax(amax, local);
  }
}

template <typename T, typename G>
__global__ void __launch_bounds__(kStepThreads)
    ChainUpdateKernel(StepPointers ptrs, const SlotTable* slots, void* const* state,
                      const Chunk* chunks, int64_t num_chunks, const Decision* decision,
                      const Fp8Table* fp8) {
  using GS = typename G::Storage;
  __shared__ unsigned scratch[32];
  if (!decision->applied) return;
  const ChainStepArgs& c = decision->chain;
  for (int64_t k = blockIdx.x; k < num_chunks; k += gridDim.x) {
    const Chunk chunk = chunks[k];
    const GS* g = static_cast<const GS*>(ptrs.grad[chunk.slot]);
    if (g == nullptr) continue;
    const SlotTable slot = slots[chunk.slot];
    void* const* st_ptrs = state + int64_t(chunk.slot) * c.num_state;
    const int64_t end = chunk.begin + kChunk < slot.numel ? chunk.begin + kChunk : slot.numel;
    if (slot.fp8 < 0) {
      ChainChunk<T, G, NoCodes>(c, g, st_ptrs, slot, chunk.begin, end, nullptr, 0.0f, nullptr,
                                scratch);
      continue;
    }
    const Fp8Table& copy = fp8[slot.fp8];
    const float scale = *ptrs.fp8_scale[slot.fp8];
    if (copy.e5m2) {
      ChainChunk<T, G, CodesOf<E5M2>>(c, g, st_ptrs, slot, chunk.begin, end, copy.data, scale,
                                      copy.amax, scratch);
    } else {
      ChainChunk<T, G, CodesOf<E4M3>>(c, g, st_ptrs, slot, chunk.begin, end, copy.data, scale,
                                      copy.amax, scratch);
    }
  }
}

// Where tile t of a segment's copies lies: the copy (searched forward from k:
// a block's tiles only grow) and the tile's first row and column.
struct TilePos {
  int k;
  int64_t row0, col0;
};
__device__ __forceinline__ TilePos LocateTile(const Fp8Table* fp8, int num_fp8, int k,
                                              int64_t t) {
  while (k + 1 < num_fp8 && fp8[k + 1].first_tile <= t) ++k;
  const int64_t local = t - fp8[k].first_tile;
  const int64_t col_tiles = (fp8[k].cols + 63) / 64;
  return {k, local / col_tiles * 64, local % col_tiles * 64};
}

// The wide path's read of a tile: thread t's 16 bytes, bytes 16 (t % 4) .. + 15
// of the tile's row t / 4; zeros where the copy takes another path, was not
// updated, or the row or column is past its edge.
__device__ __forceinline__ uint4 LoadWidePiece(const StepPointers& ptrs, const Fp8Table& copy,
                                               const TilePos& at) {
  const int part = threadIdx.x % 4, line = threadIdx.x / 4;
  if (!copy.wide || ptrs.grad[copy.slot] == nullptr || at.row0 + line >= copy.rows ||
      at.col0 + 16 * part >= copy.cols) {
    return make_uint4(0u, 0u, 0u, 0u);
  }
  return *reinterpret_cast<const uint4*>(copy.data + (at.row0 + line) * copy.cols + at.col0 +
                                         16 * part);
}

// After the update: data_t = data^T for every FP8 copy the update wrote
// ([rows, cols] codes, read 1 B per element instead of the weight's 2-4 B),
// one 64 x 64 tile per block and turn (grid-stride over the copies' tiles,
// in the order of Fp8Table::first_tile), and each copy's record: kept_amax
// from the update's amax (then zeroed for the next step), kept_scale and
// scale_inv = 1 / scale as the cast-transpose writes them. On the wide path
// each turn issues the next tile's read before it transposes this one, so a
// block has a read in flight while it writes (one 16-byte read a thread and a
// barrier between reading and writing left the reads idle half the turn).
// On an H100 the 24 x 2048 LM's copies took 1.23 ms a step against 1.39, the
// 24 x 1024 LM's 0.288 against 0.298: still about 60% of the bandwidth.
__global__ void __launch_bounds__(kStepThreads)
    Fp8CopyTransposeKernel(StepPointers ptrs, const Fp8Table* fp8, int num_fp8, int64_t num_tiles,
                           const Decision* decision) {
  __shared__ __align__(16) ByteTile tile;  // the wide path stores words into it
  if (!decision->applied) return;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  if (int64_t(blockIdx.x) >= num_tiles) return;
  TilePos at = LocateTile(fp8, num_fp8, 0, blockIdx.x);
  uint4 piece = LoadWidePiece(ptrs, fp8[at.k], at);
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Fp8Table copy = fp8[at.k];
    const int64_t row0 = at.row0, col0 = at.col0;
    const int64_t rows = copy.rows, cols = copy.cols;
    const int64_t t_next = t + gridDim.x;
    const TilePos next = t_next < num_tiles ? LocateTile(fp8, num_fp8, at.k, t_next) : at;
    if (ptrs.grad[copy.slot] == nullptr) {  // not updated: still current
      if (t_next < num_tiles) piece = LoadWidePiece(ptrs, fp8[next.k], next);
      at = next;
      continue;
    }
    if (row0 == 0 && col0 == 0 && threadIdx.x == 0) {
      const float s = *ptrs.fp8_scale[at.k];
      *copy.kept_amax = __uint_as_float(*copy.amax);
      *copy.amax = 0u;
      *copy.kept_scale = s;
      *copy.scale_inv = 1.0f / s;
    }
    __syncthreads();  // the previous turn's stores have read the tile
    if (copy.wide) {
      // Thread t holds 16 bytes of the tile's row t / 4 (read last turn) and
      // writes rows 16 (t % 4) .. + 15 of its column t / 4 as one 16-byte
      // piece of data_t.
      const int part = threadIdx.x % 4, line = threadIdx.x / 4;
      uint32_t* dst = reinterpret_cast<uint32_t*>(&tile[line][16 * part]);
      dst[0] = piece.x;
      dst[1] = piece.y;
      dst[2] = piece.z;
      dst[3] = piece.w;
      __syncthreads();
      if (t_next < num_tiles) piece = LoadWidePiece(ptrs, fp8[next.k], next);
      if (col0 + line < cols && row0 + 16 * part < rows) {
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int r = 16 * part + 4 * q;
          w[q] = uint32_t(tile[r][line]) | uint32_t(tile[r + 1][line]) << 8 |
                 uint32_t(tile[r + 2][line]) << 16 | uint32_t(tile[r + 3][line]) << 24;
        }
        *reinterpret_cast<uint4*>(copy.data_t + (col0 + line) * rows + row0 + 16 * part) =
            make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else if (copy.words) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty + 16 * i;
        const int64_t c = col0 + tx * 4;
        if (row0 + r < rows && c < cols) {
          const uint32_t word = *reinterpret_cast<const uint32_t*>(copy.data + (row0 + r) * cols + c);
#pragma unroll
          for (int j = 0; j < 4; ++j) tile[r][tx * 4 + j] = static_cast<uint8_t>(word >> (8 * j));
        }
      }
      __syncthreads();
      StoreTileTransposed(tile, copy.data_t, rows, cols, row0, col0, tx, ty);
    } else {
      // Any shape: single bytes, a row of the tile per 64 threads.
      const int lane = threadIdx.x % 64, group = threadIdx.x / 64;
      for (int r = group; r < 64; r += kStepThreads / 64) {
        if (row0 + r < rows && col0 + lane < cols) {
          tile[r][lane] = copy.data[(row0 + r) * cols + col0 + lane];
        }
      }
      __syncthreads();
      for (int c = group; c < 64; c += kStepThreads / 64) {
        if (col0 + c < cols && row0 + lane < rows) {
          copy.data_t[(col0 + c) * rows + row0 + lane] = tile[lane][c];
        }
      }
    }
    if (!copy.wide && t_next < num_tiles) piece = LoadWidePiece(ptrs, fp8[next.k], next);
    at = next;
  }
}

class CudaOptimizerPlan : public OptimizerPlan {
 public:
  struct Segment {
    DType dtype;              // the params'
    int first_slot;           // into the plan's slots
    int num_slots;
    const SlotTable* slots;   // in `tables`
    void* const* state;       // under a chain: num_state pointers per slot
    const Chunk* chunks;
    int64_t num_chunks;
    unsigned grid;
    // The segment's FP8 copies: their table, their slots (into the plan's
    // slots), and the transpose launch over all their tiles.
    const Fp8Table* fp8;
    std::vector<int> fp8_slots;
    int64_t fp8_tiles;
    unsigned fp8_grid;
  };
  std::vector<Segment> segments;
  // Every segment's SlotTable, Chunk and Fp8Table arrays, then partials,
  // Decision and the FP8 copies' amax words.
  Tensor tables;
  float* partial = nullptr;
  Decision* decision = nullptr;
  const CudaOps* owner = nullptr;

  void Init(const OptimizerHyperparams& h, const std::vector<OptimizerSlot>& slots,
            const Tensor& count, const Tensor& total_notfinite, Tensor info) {
    Remember(h, slots, count, total_notfinite);
    info_ = std::move(info);
  }
};

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

bool HasFp8Copy(const OptimizerSlot& s) {
  return s.fp8.data.data() != nullptr && s.param.numel() > 0;
}

}  // namespace

absl::StatusOr<std::unique_ptr<OptimizerPlan>> CudaOps::NewOptimizerPlan(
    const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
    const Tensor& count, const Tensor& total_notfinite) {
  RETURN_IF_ERROR(CheckOptimizerPlanArgs(hyperparams, slots, count, total_notfinite));
  RETURN_IF_ERROR(Enter());
  auto plan = std::make_unique<CudaOptimizerPlan>();
  plan->owner = this;
  // Segments: runs of one param dtype, at most kSegmentSlots slots and
  // kSegmentFp8Copies FP8 copies, in slot order (a layer's params are mostly
  // one dtype: one segment).
  struct Pending {
    DType dtype;
    int first, count;
    std::vector<SlotTable> table;
    std::vector<void*> state;
    std::vector<Chunk> chunks;
    std::vector<Fp8Table> fp8;
    std::vector<int> fp8_slots;
    int64_t fp8_tiles = 0;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
    const OptimizerSlot& s = slots[i];
    const DType dtype = s.param.dtype();
    const bool fp8 = HasFp8Copy(s);
    if (pending.empty() || pending.back().dtype != dtype ||
        pending.back().count == kSegmentSlots ||
        (fp8 && pending.back().fp8.size() == kSegmentFp8Copies)) {
      pending.push_back({dtype, i, 0, {}, {}, {}, {}, {}, 0});
    }
    Pending& seg = pending.back();
    const int32_t local = seg.count++;
    const int64_t n = s.param.numel();
    const DType copy_dtype = s.compute_copy.dtype();
    SlotTable entry{s.param.data(),
                    s.mu.data(),
                    s.nu.data(),
                    static_cast<uint16_t*>(s.compute_copy.data()),
                    n,
                    -1,
                    s.compute_copy.data() == nullptr ? kNoComputeCopy
                    : copy_dtype == DType::kBF16     ? kBf16Copy
                                                     : kF16Copy};
    if (fp8) {
      entry.fp8 = static_cast<int32_t>(seg.fp8.size());
      Fp8Table copy{};
      copy.data = static_cast<uint8_t*>(s.fp8.data.data());
      copy.data_t = static_cast<uint8_t*>(s.fp8.data_t.data());
      copy.scale_inv = s.fp8.scale_inv.data_as<float>();
      copy.kept_scale = s.fp8.kept_scale.data_as<float>();
      copy.kept_amax = s.fp8.kept_amax.data_as<float>();
      copy.rows = s.fp8.data.dim(0);
      copy.cols = s.fp8.data.dim(1);
      copy.first_tile = seg.fp8_tiles;
      copy.slot = local;
      copy.e5m2 = s.fp8.data.dtype() == DType::kE5M2 ? 1 : 0;
      copy.words = copy.rows % 4 == 0 && copy.cols % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(copy.data) % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(copy.data_t) % 4 == 0;
      copy.wide = copy.rows % 16 == 0 && copy.cols % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(copy.data) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(copy.data_t) % 16 == 0;
      seg.fp8_tiles += ((copy.rows + 63) / 64) * ((copy.cols + 63) / 64);
      seg.fp8.push_back(copy);
      seg.fp8_slots.push_back(i);
    }
    seg.table.push_back(entry);
    for (int j = 0; j < hyperparams.num_state; ++j) {
      seg.state.push_back(j < static_cast<int>(s.state.size()) ? s.state[j].data() : nullptr);
    }
    for (int64_t begin = 0; begin < n; begin += kChunk) seg.chunks.push_back({local, 0, begin});
  }
  // Enough blocks to keep every SM's memory pipes busy, no more: each block
  // loops over chunks. The SM count is the device's, asked once at open.
  const int per_sm =
      ResidentBlocksPerSm(context(), MultiTensorUpdateKernel<BF16, BF16, true>, kStepThreads, 0);
  const int64_t max_grid =
      std::max<int64_t>(1, int64_t(per_sm) * sm_count());
  const int64_t max_transpose_grid = std::max<int64_t>(
      1, int64_t(ResidentBlocksPerSm(context(), Fp8CopyTransposeKernel, kStepThreads, 0)) *
             sm_count());
  // Layout of the one table allocation.
  size_t bytes = 0;
  std::vector<size_t> slot_offset, state_offset, chunk_offset, fp8_offset;
  int64_t partial_count = 0, fp8_count = 0;
  for (const Pending& seg : pending) {
    bytes = AlignUp(bytes, 16);
    slot_offset.push_back(bytes);
    bytes += seg.table.size() * sizeof(SlotTable);
    bytes = AlignUp(bytes, 16);
    state_offset.push_back(bytes);
    bytes += seg.state.size() * sizeof(void*);
    bytes = AlignUp(bytes, 16);
    chunk_offset.push_back(bytes);
    bytes += seg.chunks.size() * sizeof(Chunk);
    bytes = AlignUp(bytes, 16);
    fp8_offset.push_back(bytes);
    bytes += seg.fp8.size() * sizeof(Fp8Table);
    const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(max_grid, seg.chunks.size()));
    partial_count += 3 * grid;  // at most one norm launch per grad dtype
    fp8_count += static_cast<int64_t>(seg.fp8.size());
  }
  bytes = AlignUp(bytes, 16);
  const size_t partial_offset = bytes;
  bytes += static_cast<size_t>(std::max<int64_t>(partial_count, 1)) * sizeof(float);
  bytes = AlignUp(bytes, 16);
  const size_t decision_offset = bytes;
  bytes += sizeof(Decision);
  bytes = AlignUp(bytes, 16);
  const size_t amax_offset = bytes;  // uploaded as zeros: 0 between steps
  bytes += static_cast<size_t>(fp8_count) * sizeof(unsigned);
  bytes = AlignUp(bytes, 16);
  ASSIGN_OR_RETURN(plan->tables, Allocate(DType::kI32, {static_cast<int64_t>(bytes / 4)}));
  std::vector<uint8_t> host(bytes, 0);
  char* base = static_cast<char*>(plan->tables.data());
  unsigned* amax = reinterpret_cast<unsigned*>(base + amax_offset);
  for (size_t k = 0; k < pending.size(); ++k) {
    Pending& seg = pending[k];
    for (Fp8Table& copy : seg.fp8) copy.amax = amax++;
    std::memcpy(host.data() + slot_offset[k], seg.table.data(), seg.table.size() * sizeof(SlotTable));
    std::memcpy(host.data() + state_offset[k], seg.state.data(), seg.state.size() * sizeof(void*));
    std::memcpy(host.data() + chunk_offset[k], seg.chunks.data(), seg.chunks.size() * sizeof(Chunk));
    std::memcpy(host.data() + fp8_offset[k], seg.fp8.data(), seg.fp8.size() * sizeof(Fp8Table));
    CudaOptimizerPlan::Segment out;
    out.dtype = seg.dtype;
    out.first_slot = seg.first;
    out.num_slots = seg.count;
    out.slots = reinterpret_cast<const SlotTable*>(base + slot_offset[k]);
    out.state = reinterpret_cast<void* const*>(base + state_offset[k]);
    out.chunks = reinterpret_cast<const Chunk*>(base + chunk_offset[k]);
    out.num_chunks = static_cast<int64_t>(seg.chunks.size());
    out.grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(max_grid, out.num_chunks)));
    out.fp8 = reinterpret_cast<const Fp8Table*>(base + fp8_offset[k]);
    out.fp8_slots = seg.fp8_slots;
    out.fp8_tiles = seg.fp8_tiles;
    out.fp8_grid = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>(max_transpose_grid, seg.fp8_tiles)));
    plan->segments.push_back(std::move(out));
  }
  plan->partial = reinterpret_cast<float*>(base + partial_offset);
  plan->decision = reinterpret_cast<Decision*>(base + decision_offset);
  RETURN_IF_ERROR(Upload(host.data(), &plan->tables));
  ASSIGN_OR_RETURN(Tensor info, Allocate(DType::kI32, {6}));
  const OptimizerStepInfo zero_info;
  RETURN_IF_ERROR(Upload(&zero_info, &info));
  plan->Init(hyperparams, slots, count, total_notfinite, std::move(info));
  return std::unique_ptr<OptimizerPlan>(std::move(plan));
}

absl::Status CudaOps::OptimizerStep(OptimizerPlan& generic_plan,
                                    const std::vector<OptimizerSlot>& slots,
                                    const std::vector<Tensor>& grads, Tensor* count,
                                    Tensor* total_notfinite) {
  RETURN_IF_ERROR(CheckOptimizerStepArgs(generic_plan, slots, grads, count, total_notfinite));
  auto* plan = dynamic_cast<CudaOptimizerPlan*>(&generic_plan);
  if (plan == nullptr || plan->owner != this) {
    return absl::InvalidArgumentError(
        "OptimizerStep: the plan was made by another Ops; plans belong to their stream");
  }
  RETURN_IF_ERROR(Enter());
  // Host work only: which gradients go to which launch. One launch per
  // segment and gradient dtype (one in all for a layer of one dtype).
  struct Launch {
    const CudaOptimizerPlan::Segment* segment;
    DType grad_dtype;
    StepPointers ptrs;
  };
  std::vector<Launch> launches;
  for (const CudaOptimizerPlan::Segment& seg : plan->segments) {
    for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
      Launch launch{&seg, g, {}};
      bool any = false;
      for (int j = 0; j < seg.num_slots; ++j) {
        const Tensor& grad = grads[seg.first_slot + j];
        if (grad.data() == nullptr || grad.dtype() != g) continue;
        launch.ptrs.grad[j] = grad.data();
        any = true;
      }
      if (!any) continue;
      for (size_t k = 0; k < seg.fp8_slots.size(); ++k) {
        launch.ptrs.fp8_scale[k] = slots[seg.fp8_slots[k]].fp8.scale.data_as<const float>();
      }
      launches.push_back(launch);
    }
  }
  int64_t partials = 0;
  for (const Launch& l : launches) {
    DispatchFloat(l.grad_dtype, [&](auto tg) {
      using G = decltype(tg);
      GradNormPartialKernel<G><<<l.segment->grid, kStepThreads, 0, stream()>>>(
          l.ptrs, l.segment->slots, l.segment->chunks, l.segment->num_chunks,
          plan->partial + partials);
    });
    partials += l.segment->grid;
  }
  StepDecisionKernel<<<1, kFinalizeThreads, 0, stream()>>>(
      plan->partial, partials, plan->hyperparams(), count->data_as<int32_t>(),
      total_notfinite->data_as<int32_t>(), plan->decision,
      static_cast<OptimizerStepInfo*>(plan->info().data()));
  const OptimizerHyperparams& h = plan->hyperparams();
  const bool adam = h.rule == OptimizerUpdateArgs::Rule::kAdam;
  const bool chain = h.num_links > 0;
  // A clip after link 0: a pass for the norm of the updates that reach it
  // (the partials are free again once the decision has read them).
  for (int k = 1; chain && k < h.num_links; ++k) {
    if (h.links[k].kind != OptimizerLink::Kind::kClipByGlobalNorm) continue;
    int64_t clip_partials = 0;
    for (const Launch& l : launches) {
      DispatchFloat(l.segment->dtype, [&](auto tp) {
        DispatchFloat(l.grad_dtype, [&](auto tg) {
          using T = decltype(tp);
          using G = decltype(tg);
          ChainNormPartialKernel<T, G><<<l.segment->grid, kStepThreads, 0, stream()>>>(
              l.ptrs, l.segment->slots, l.segment->state, l.segment->chunks, l.segment->num_chunks,
              plan->decision, k, plan->partial + clip_partials);
        });
      });
      clip_partials += l.segment->grid;
    }
    ClipNormKernel<<<1, kFinalizeThreads, 0, stream()>>>(plan->partial, clip_partials,
                                                         plan->decision, k);
  }
  for (const Launch& l : launches) {
    DispatchFloat(l.segment->dtype, [&](auto tp) {
      DispatchFloat(l.grad_dtype, [&](auto tg) {
        using T = decltype(tp);
        using G = decltype(tg);
        if (chain) {
          ChainUpdateKernel<T, G><<<l.segment->grid, kStepThreads, 0, stream()>>>(
              l.ptrs, l.segment->slots, l.segment->state, l.segment->chunks, l.segment->num_chunks,
              plan->decision, l.segment->fp8);
          return;
        }
        auto kernel = adam ? MultiTensorUpdateKernel<T, G, true> : MultiTensorUpdateKernel<T, G, false>;
        kernel<<<l.segment->grid, kStepThreads, 0, stream()>>>(
            l.ptrs, l.segment->slots, l.segment->chunks, l.segment->num_chunks, plan->decision,
            l.segment->fp8);
      });
    });
    if (l.segment->fp8_tiles > 0) {
      Fp8CopyTransposeKernel<<<l.segment->fp8_grid, kStepThreads, 0, stream()>>>(
          l.ptrs, l.segment->fp8, static_cast<int>(l.segment->fp8_slots.size()),
          l.segment->fp8_tiles, plan->decision);
    }
  }
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
