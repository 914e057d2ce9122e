// Attention inside the CUDA backend: the pieces attention.cu dispatches to.
//
//   attention.cu           CudaOps::AttentionForward/Backward(Packed): checks,
//                          then cuDNN's fused SDPA where it accepts the call,
//                          else the unfused path (packed: the split default),
//                          logged once per configuration.
//   attention_cudnn.cc     cuDNN 9 graph (backend) API: graphs built by hand,
//                          one execution plan per shape, cached per stream.
//   attention_small_head.cu  the unfused path for head_dim <= 32 without a
//                          bias (Flax's float32 attention at D 4): a thread
//                          per query (or key) row, tiles in shared memory.
//   attention_fallback.cu  a straightforward tiled kernel for every case
//                          (f32/f16/bf16, bias, any mask, DropoutUniform).
//
// Semantics are those of kernels/ops.h and the CPU reference
// (kernels/cpu/attention.cc): a query row with no visible key outputs zeros
// and gets softmax_lse = +inf.
#ifndef TE_KERNELS_CUDA_ATTENTION_INTERNAL_H_
#define TE_KERNELS_CUDA_ATTENTION_INTERNAL_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "kernels/op_checks.h"  // AttentionShape
#include "kernels/ops.h"

namespace te {
namespace cuda {

class CudaOps;

// Device pointers and flags of one call, as the kernels read them. Padding
// lengths are int32 [B] on the device, clamped to [0, S] by every reader.
struct AttentionProblem {
  AttentionShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType q_dtype = DType::kBF16;
  DType k_dtype = DType::kBF16;
  DType v_dtype = DType::kBF16;
  const float* bias = nullptr;        // [Hq, Sq, Skv] or null
  const int32_t* q_seqlens = nullptr;  // null: every row valid
  const int32_t* kv_seqlens = nullptr;
  // AttentionArgs::elementwise_mask: bool [B, Sq, Skv] (mask_per_head
  // false) or [B, Hq, Sq, Skv] (true), true = masked out, or null. Only the
  // general fallback reads it (cuDNN and the small-head kernels decline such
  // a call).
  const bool* mask = nullptr;
  bool mask_per_head = false;
  bool causal = false;
  // With causal: the diagonal is bottom-right aligned (key j visible to query
  // i iff j <= i + kv_len - q_len, the lengths per batch row where padding
  // lengths are given, else Skv and Sq). Only the general fallback reads it.
  bool bottom_right = false;
  float scale = 1.0f;
  float dropout_rate = 0.0f;
  uint64_t dropout_seed = 0;
};

// Unfused forward: out [B, Sq, Hq, D] in out_dtype, lse [B, Hq, Sq] f32.
absl::Status FallbackAttentionForward(const AttentionProblem& problem, void* out,
                                      DType out_dtype, float* lse, cudaStream_t stream);

// Unfused backward. row_dot: f32 scratch of B*Hq*Sq floats. dbias: f32
// [Hq, Sq, Skv] or null (summed over the batch; zeroed here first).
absl::Status FallbackAttentionBackward(const AttentionProblem& problem, const void* dout,
                                       DType dout_dtype, const float* lse, void* dq,
                                       DType dq_dtype, void* dk, DType dk_dtype, void* dv,
                                       DType dv_dtype, float* dbias, float* row_dot,
                                       cudaStream_t stream);

// Rows with no visible key (padding masks): out row = 0, lse = +inf, as the
// CPU reference. cuDNN leaves rows past q_seqlens unspecified.
absl::Status ZeroInvisibleRows(const AttentionProblem& problem, void* out, DType out_dtype,
                               float* lse, cudaStream_t stream);

// cuDNN's dropout seed and offset: dst[0] = seed, dst[1] = 0 (int64 on the
// device), written in stream order by a one-thread kernel (no host sync).
absl::Status WriteDropoutSeed(int64_t* dst, uint64_t seed, cudaStream_t stream);

// The largest head_dim the fallback handles.
constexpr int64_t kFallbackMaxHeadDim = 512;

// ---- small head_dim (attention_small_head.cu) ------------------------------
// The largest head_dim of the small-head kernels. Each thread holds one row's
// q (or k, v) and its accumulators in registers: 4 * 32 floats in the dk/dv
// pass at D 32, about 160 registers; at D 64 they would spill, and from D 32
// up the general fallback's warp-per-dot-product keeps its lanes busy anyway.
constexpr int64_t kSmallHeadMaxHeadDim = 32;

// Whether the small-head kernels compute this call: head_dim <= 32, no bias
// (a [Hq, Sq, Skv] bias and its dbias would make them memory-bound; the
// general fallback keeps them), no elementwise mask (their tiles assume
// each row's visible keys are a prefix) and a top-left causal diagonal if
// any (their diagonal tiles assume it). Every dtype, GQA and dropout is
// covered.
bool SmallHeadAttentionFits(const AttentionProblem& problem);

// The same results as FallbackAttentionForward (within float32 rounding).
absl::Status SmallHeadAttentionForward(const AttentionProblem& problem, void* out,
                                       DType out_dtype, float* lse, cudaStream_t stream);

// The same results as FallbackAttentionBackward with dbias null. out is the
// forward's output: where it is f32, rowsum(P * dP) is taken as
// rowsum(dout * out) (equal up to f32 rounding); for bf16 / f16 out it is
// recomputed from P, as the CPU reference does, so out's rounding stays out
// of the gradients. row_dot: f32 scratch of B*Hq*Sq floats. dropout_bits:
// scratch of SmallHeadDropoutBitsBytes(problem) bytes (16-byte aligned) where
// that is not 0, else null: the dq pass keeps its dropout draws there for
// the dk/dv pass, which then skips the hash (a quarter of the backward at D 4).
absl::Status SmallHeadAttentionBackward(const AttentionProblem& problem, const void* out,
                                        DType out_dtype, const void* dout, DType dout_dtype,
                                        const float* lse, void* dq, DType dq_dtype, void* dk,
                                        DType dk_dtype, void* dv, DType dv_dtype,
                                        float* row_dot, uint32_t* dropout_bits,
                                        cudaStream_t stream);

// The dropout-bit scratch SmallHeadAttentionBackward can use: one bit per
// score, ceil(Skv / 32) * B*Hq*Sq words; 0 without dropout, or past the limit
// (256 MiB by default; SetSmallHeadDropoutBitsLimit below).
size_t SmallHeadDropoutBitsBytes(const AttentionProblem& problem);

// ---- cuDNN (attention_cudnn.cc) ------------------------------------------
// Where cuDNN reads q, k and v: separate [B, S, H, D] tensors, or the three
// parts of one packed qkv [B, S, 3, H, D] (TE's BS3HD, at element offsets 0,
// H*D and 2*H*D). Only the token stride (elements from token s to s+1 of one
// part) differs: H*D for a separate tensor, 3*H*D inside qkv; the head stride
// is D and the batch stride S times the token stride either way.
struct QkvMemory {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::kBF16;  // of all three
  int64_t q_token_stride = 0;
  int64_t kv_token_stride = 0;
  // Tokens from one batch row to the next in q, k, v, out, dout and their
  // gradients; 0: the call's own lengths (Sq, Skv). Larger where the call
  // views rows inside longer sequences (the relative bias's far part,
  // relative_band_split.cu). The softmax statistics stay [B, Hq, Sq].
  int64_t batch_rows = 0;
};
// Where cuDNN writes dq, dk and dv: the same layout (token strides) as the
// QkvMemory they are the gradients of.
struct DqkvMemory {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  DType dtype = DType::kBF16;
};

// Each returns UNIMPLEMENTED when cuDNN cannot run this configuration (the
// caller falls back), any other error for a failure of a supported call.
// out, dout: [B, Sq, Hq, D] (contiguous); softmax_lse [B, Hq, Sq] f32.
absl::Status CudnnAttentionForward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& shape, const QkvMemory& qkv,
                                   Tensor* out, Tensor* softmax_lse);
absl::Status CudnnAttentionBackward(CudaOps* ops, const AttentionArgs& args,
                                    const AttentionShape& shape, const QkvMemory& qkv,
                                    const Tensor& out, const Tensor& dout,
                                    const Tensor& softmax_lse, const DqkvMemory& grads,
                                    Tensor* dbias);

// ---- one query row per sequence (attention_decode.cu) ----------------------
// Whether the decode kernel computes this forward: Sq == 1 (a decode step's
// new token), no dropout or elementwise mask, q, k, v and out of one float
// dtype, a bias f32 or in that dtype, head_dim 32, 64 or 128 with k and v
// aligned to whole 8-element packs, at most 10240 keys. Any mask type.
bool DecodeAttentionFits(const AttentionArgs& args, const AttentionShape& s, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& out);
// AttentionForward's results (out, and softmax_lse where defined) for a call
// DecodeAttentionFits takes, enqueued on `stream`.
absl::Status DecodeAttentionForward(const AttentionArgs& args, const AttentionShape& s,
                                    const Tensor& q, const Tensor& k, const Tensor& v, Tensor* out,
                                    Tensor* softmax_lse, cudaStream_t stream);

// The same with q, the key and the value of each sequence's one new token
// taken from the fused projection's qkv [B, 1, 3, H, D] (q_heads ==
// kv_heads), rotated by `rotary` where non-null and written to q and into
// the caches at row *position as Ops::DecodeQkvRows writes them, in the
// same launch (Ops::DecodeAttentionFromQkv). The caller has checked both
// ops' arguments and DecodeAttentionFits(args, s, *q, *key_cache,
// *value_cache, *out).
absl::Status DecodeAttentionFromQkvForward(const AttentionArgs& args, const AttentionShape& s,
                                           const Tensor& qkv, const RotaryArgs* rotary,
                                           const Tensor& position, Tensor* q, Tensor* key_cache,
                                           Tensor* value_cache, Tensor* out, Tensor* softmax_lse,
                                           cudaStream_t stream);

// ---- a relative-position table's gradient (relative_bias_grad.cu) ----------
// The most diagonals the band kernel covers (RelativeBuckets::uniform_from).
constexpr int kRelativeBandMax = 128;
// OK when the band kernel can serve this backward: causal self-attention
// (top-left), no dropout or elementwise mask, bf16/f16 q, k, v 16-byte
// aligned, a sequence a multiple of 16, head_dim 32, 64 or 128, buckets
// uniform from a distance of at most kRelativeBandMax.
absl::Status RelativeBandApplies(const AttentionArgs& args, const AttentionShape& s,
                                 const QkvMemory& qkv, const RelativeBuckets& relative);
// dtable f32 [H, NB] (ops.h's AttentionBackwardRelative) from the forward's
// q, k, v (qkv), out, softmax_lse, the output gradient and args.bias (the
// dense relative bias, read at each distance), enqueued on ops' stream. The
// caller has checked RelativeBandApplies.
absl::Status RelativeBandTableGrad(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& s, const QkvMemory& qkv,
                                   const Tensor& out, const Tensor& dout,
                                   const Tensor& softmax_lse, const RelativeBuckets& relative,
                                   Tensor* dtable);

// The table's gradient from the band's per-block sums, partial [B, H, tiles,
// W + 1] (the band kernels' fold where the stream's group counters cannot
// hold every head), enqueued on `stream`.
absl::Status LaunchRelativeBandTable(const float* partial, const int32_t* buckets, float* dtable,
                                     int batch, int heads, int tiles, int seq, int band,
                                     int num_buckets, cudaStream_t stream);

// ---- the relative bias without [H, S, S] (relative_band_split.cu) ---------
// Where the band kernels find the bias at each distance: the relative table
// [H, NB] looked up through the last query's buckets [S, S], or a dense bias
// [H, S, S] made from it, read on its last row; float32 or q's dtype (then
// rounded to q's dtype, as cuDNN adds it).
struct BandBias {
  const void* table = nullptr;
  const int32_t* buckets = nullptr;
  int num_buckets = 0;
  const void* dense = nullptr;
  bool f32 = false;  // the table's (or the dense bias's) dtype
};
// OK when the split serves this call: RelativeBandApplies' cases with `band`
// as uniform_from, a causal mask without lengths, and for a backward one kv
// head per query head; UNIMPLEMENTED otherwise.
absl::Status RelativeSplitApplies(const AttentionArgs& args, const AttentionShape& s,
                                  const QkvMemory& qkv, int64_t band, bool backward);
// AttentionForward's out and softmax_lse with the relative bias applied by
// distance: cuDNN's bias-free far part, then the band kernel merging into
// it. UNIMPLEMENTED (nothing written) where the split or cuDNN declines.
absl::Status RelativeSplitForward(CudaOps* ops, const AttentionArgs& args,
                                  const AttentionShape& s, const QkvMemory& qkv,
                                  const BandBias& bias, int64_t band, Tensor* out,
                                  Tensor* softmax_lse);
// AttentionBackwardRelative's gradients (into `grads`, in qkv's layout) and
// dtable [H, NB], the same way, with band = relative.uniform_from.
absl::Status RelativeSplitBackward(CudaOps* ops, const AttentionArgs& args,
                                   const AttentionShape& s, const QkvMemory& qkv,
                                   const Tensor& out, const Tensor& dout,
                                   const Tensor& softmax_lse, const BandBias& bias,
                                   const RelativeBuckets& relative, const DqkvMemory& grads,
                                   Tensor* dtable);

// ---- test hooks ------------------------------------------------------------
// Process-wide: kAuto tries cuDNN first; kFallbackOnly skips it (tests, and
// the server's --attention=unfused): the unfused kernels, small-head where
// they fit. kGeneralFallbackOnly also skips the small-head kernels, so tests
// and benchmarks can hold them against the general fallback.
enum class AttentionPath { kAuto, kFallbackOnly, kGeneralFallbackOnly };
void SetAttentionPath(AttentionPath path);
AttentionPath GetAttentionPath();
// Calls served by cuDNN (forward + backward), for tests to see which ran.
int64_t CudnnAttentionCalls();
// Of those, the calls whose plan views the batch's bias-sharing rows heads
// outer (PlanConfig::heads_outer).
int64_t CudnnHeadsOuterCalls();
// Calls served by the small-head kernels (forward + backward).
int64_t SmallHeadAttentionCalls();
// Process-wide: the most bytes SmallHeadDropoutBitsBytes grants (tests set 0
// to check the backward that draws the dropout bits in both passes). Returns
// the previous limit.
int64_t SetSmallHeadDropoutBitsLimit(int64_t bytes);
// Process-wide: whether the far/band split serves a relative bias
// (CudaDeviceOptions::relative_bias_split; OpenCudaDevice sets it).
void SetRelativeSplit(bool on);
bool RelativeSplitOn();
// Relative backwards whose table gradient the band kernels formed (the
// dense bias's band kernel or the split).
int64_t RelativeBandCalls();
// Of those, and of the forwards with a relative bias, the calls the split
// served (no [H, S, S] bias made).
int64_t RelativeSplitCalls();
// Forwards the decode kernel served.
int64_t DecodeAttentionCalls();
// Of the cuDNN calls, the packed ops' calls that cuDNN served on the packed layout
// itself (not after the split default).
int64_t CudnnPackedAttentionCalls();

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ATTENTION_INTERNAL_H_
