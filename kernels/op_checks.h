// Argument checks of the ops in kernels/ops.h, shared by every backend so that
// the CPU reference and CUDA reject the same calls with the same message.
//
// Each check runs on the host before an op reads or writes device memory, so a
// failing op writes nothing. Every failure is INVALID_ARGUMENT, worded
// "<Op>: <argument> has shape [..], want [..]" (or dtype, or value): it names
// the argument, the value it has and the one the contract wants. What only one
// backend cannot do (a CUDA kernel's size limit, a dtype pair a kernel does not
// dispatch) is checked in that backend, after the shared check.
//
// Optional tensors: an optional output (mu, rsigma, mask) is skipped when null
// or without memory (Wanted). A GEMM bias or scale_inv is absent when it has no
// memory; an attention bias or padding lengths tensor when !defined(), as
// ops.h words it, so an empty one (e.g. int32 [0] lengths for B = 0) is given.
#ifndef TE_KERNELS_OP_CHECKS_H_
#define TE_KERNELS_OP_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace te {

// ---- building blocks --------------------------------------------------------

bool IsComputeFloat(DType dtype);  // f32, bf16, f16: the "float" dtypes of ops.h

// Non-null, and with memory unless it has no elements.
absl::Status RequireDefined(const char* op, const char* name, const Tensor* t);
// Defined, with dtype f32, bf16 or f16.
absl::Status RequireFloat(const char* op, const char* name, const Tensor* t);
// Defined, with dtype `want`.
absl::Status RequireDType(const char* op, const char* name, const Tensor* t, DType want);
// Defined, float32 [1] (scales, amaxes).
absl::Status RequireScalarF32(const char* op, const char* name, const Tensor* t);
// `want_text` spells the wanted shape with its symbols, e.g. "[K=5, N]".
absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want,
                          const std::string& want_text);
absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want);
absl::Status RequireSameCount(const char* op, const char* name, const Tensor& t,
                              const char* other_name, const Tensor& other);
// An op's output y: float (and fp8 null), or FP8 with an Fp8Output of three
// float32 [1] tensors.
absl::Status CheckOutput(const char* op, const Tensor* y, const Fp8Output* fp8);

// Rows of a [..., H] tensor: prod(shape[:-1]).
int64_t Rows(const Tensor& t);
// Whether the caller asked for an optional output: non-null, with memory.
bool Wanted(const Tensor* t);
// A position that lives on the device (RotaryArgs::position, first_row,
// CopyRowsAt's position): int32 with one element. An optional one is given
// when it is defined and has elements (HasDevicePosition).
absl::Status CheckDevicePosition(const char* op, const char* name, const Tensor& t);
bool HasDevicePosition(const Tensor& t);

// ---- memory and elementwise -------------------------------------------------

// src may be null when dst has no bytes (the op then does nothing).
absl::Status CheckUploadArgs(const void* src, const Tensor* dst);
absl::Status CheckDownloadArgs(const Tensor& src, const void* dst);
absl::Status CheckCopyArgs(const Tensor& src, const Tensor* dst);
// CheckCopyArgs for every pair, and as many dst as src.
absl::Status CheckCopyAllArgs(const std::vector<const Tensor*>& src,
                              const std::vector<Tensor*>& dst);
// src [B, S, ...] and dst [B, L, ...]: one dtype, the same B and trailing
// dims; position a device position (CheckDevicePosition).
absl::Status CheckCopyRowsAtArgs(const Tensor& src, const Tensor& position, const Tensor* dst);
absl::Status CheckDecodeQkvRowsArgs(const Tensor& qkv, const RotaryArgs* rotary,
                                    const Tensor& position, const Tensor* q,
                                    const Tensor* key_cache, const Tensor* value_cache);
absl::Status CheckCastArgs(const Tensor& x, const Tensor* y);
// y int32 (any shape).
absl::Status CheckAddScalarI32Args(const Tensor* y);
// A term with a zero coefficient is not checked (the op does not read it).
absl::Status CheckAxpbyArgs(float alpha, const Tensor& a, float beta, const Tensor& b,
                            const Tensor* y);
constexpr int kPermuteMaxRank = 5;
absl::Status CheckPermuteArgs(const Tensor& x, const std::vector<int>& perm, const Tensor* y);
absl::Status CheckSumRowsArgs(const Tensor& x, const Tensor* y);
// a, b: float, one dtype, the same element count; out: f32 with one element.
absl::Status CheckDotArgs(const Tensor& a, const Tensor& b, const Tensor* out);

// ---- FP8 scaling ------------------------------------------------------------

absl::Status CheckQuantizeArgs(const Tensor& x, const Fp8Output& fp8, const Tensor* y);
// x [N, H] float; y [N, H] and y_t [H, N] FP8 of one dtype.
absl::Status CheckQuantizeTransposeArgs(const Tensor& x, const Fp8Output& fp8, const Tensor* y,
                                        const Tensor* y_t);
absl::Status CheckDequantizeArgs(const Tensor& x, const Tensor& scale_inv, const Tensor* y);
absl::Status CheckAmaxArgs(const Tensor& x, const Tensor* amax);
absl::Status CheckScaleFromAmaxArgs(const Tensor& amax, float fp8_max, float epsilon,
                                    const Tensor* scale, const Tensor* scale_inv);
// Ops::KeptQuantization: scale and amax [1] f32.
absl::Status CheckKeptQuantization(const Fp8Output& fp8, const Ops::KeptQuantization& kept);
// Each item as QuantizeTransposeKept checks it; no item's y, y_t, amax,
// scale_inv or record shared with another item (INVALID_ARGUMENT naming the
// item otherwise).
absl::Status CheckQuantizeTransposeKeptManyArgs(const std::vector<Ops::KeptQuantizeItem>& items);
// scale_inv may be null (Ops::DelayedScalingUpdates writes none).
absl::Status CheckDelayedScalingArgs(const DelayedScalingArgs& args, const Tensor* amax_history,
                                     const Tensor* scale, const Tensor* scale_inv);
// Every entry as CheckDelayedScalingArgs (no scale_inv); non_finite null or [1] f32.
absl::Status CheckDelayedScalingUpdatesArgs(const std::vector<Ops::DelayedScalingItem>& items,
                                            const Tensor* non_finite);
// Elements per block, along the last dimension, of each BlockFormat.
constexpr int kMxfp8BlockSize = 32;
constexpr int kNvfp4BlockSize = 16;
absl::Status CheckFakeQuantizeBlockScaledArgs(BlockFormat format, const Tensor& x, const Tensor* y);

// ---- GEMM -------------------------------------------------------------------

// out [M, N] = op(a) [M, K] @ op(b) [K, N].
struct GemmDims {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
};
// Operands both float or both FP8 (each FP8 one with its scale_inv); a bias
// (given when it has memory) excludes accumulate.
absl::StatusOr<GemmDims> CheckGemmArgs(const Ops::GemmArgs& args, const Tensor* out);

// ---- normalisation ----------------------------------------------------------

// x [rows, hidden]; x may have any rank >= 1, rows = prod(shape[:-1]).
struct NormDims {
  int64_t rows = 0;
  int64_t hidden = 0;
};
// mu and rsigma are optional outputs (Wanted); beta is given for LayerNorm only.
absl::StatusOr<NormDims> CheckNormForwardArgs(const NormArgs& args, const Tensor& x,
                                              const Tensor& gamma, const Tensor& beta,
                                              const Tensor* y, const Tensor* mu,
                                              const Tensor* rsigma, const Fp8Output* fp8);
// NormForward's checks with an FP8 y, and y_t [H, N] of y's dtype.
absl::Status CheckNormForwardTransposedArgs(const NormArgs& args, const Tensor& x,
                                            const Tensor& gamma, const Tensor& beta,
                                            const Fp8Output& fp8, const Tensor* y,
                                            const Tensor* y_t, const Tensor* mu,
                                            const Tensor* rsigma);
absl::StatusOr<NormDims> CheckNormBackwardArgs(const NormArgs& args, const Tensor& dy,
                                               const Tensor& x, const Tensor& mu,
                                               const Tensor& rsigma, const Tensor& gamma,
                                               const Tensor* dx, const Tensor* dgamma,
                                               const Tensor* dbeta,
                                               const Tensor& residual_grad = Tensor());

// ---- activations and dropout ------------------------------------------------

// Both return I, the width of y and dy: x is [..., n * I] with n = acts.size().
absl::StatusOr<int64_t> CheckActivationForwardArgs(const std::vector<Activation>& acts,
                                                   const Tensor& x, const Tensor* y,
                                                   const Fp8Output* fp8);
// CheckActivationForwardArgs with an FP8 y, and y_t [width, rows] of y's dtype.
absl::StatusOr<int64_t> CheckActivationForwardTransposedArgs(const std::vector<Activation>& acts,
                                                             const Tensor& x,
                                                             const Fp8Output& fp8,
                                                             const Tensor* y, const Tensor* y_t);
absl::StatusOr<int64_t> CheckActivationBackwardArgs(const std::vector<Activation>& acts,
                                                    const Tensor& dy, const Tensor& x,
                                                    const Tensor* dx);
// x 2-D [N, n * I], dy [N, I] (not null: the op may write over it), y and
// y_t as CheckQuantizeTransposeArgs's for x's shape; dbias null or [n * I]
// float.
absl::StatusOr<int64_t> CheckActivationBackwardQuantizeTransposeArgs(
    const std::vector<Activation>& acts, const Tensor* dy, const Tensor& x,
    const Fp8Output& fp8, const Tensor* y, const Tensor* y_t, const Tensor* dbias);
// `mask` is an optional output (Wanted).
absl::Status CheckDropoutForwardArgs(float rate, const Tensor& x, const Tensor* y,
                                     const Tensor* mask);
absl::Status CheckDropoutBackwardArgs(float rate, const Tensor& dy, const Tensor& mask,
                                      const Tensor* dx);

// ---- attention --------------------------------------------------------------

// Sizes of one attention call: q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D].
struct AttentionShape {
  int64_t batch = 0;
  int64_t q_seq = 0;
  int64_t kv_seq = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
};
// These check the padding lengths' dtype and shape, not their values, which
// may live on the device (the CPU checks them as it reads them; the CUDA
// kernels clamp them to [0, S]).
// qkv: float [B, S, 3, H, D] (TE's BS3HD), named `name` in errors.
absl::Status CheckPackedQkv(const char* op, const char* name, const Tensor& qkv);
absl::StatusOr<AttentionShape> CheckAttentionForwardArgs(const AttentionArgs& args, const Tensor& q,
                                                         const Tensor& k, const Tensor& v,
                                                         const Tensor* out,
                                                         const Tensor* softmax_lse);
absl::StatusOr<AttentionShape> CheckAttentionBackwardArgs(
    const AttentionArgs& args, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& dout, const Tensor& softmax_lse, const Tensor* dq, const Tensor* dk,
    const Tensor* dv, const Tensor* dbias);

// ---- position encodings -----------------------------------------------------

absl::Status CheckRotaryArgs(const RotaryArgs& args, const Tensor& x, const Tensor* y);
// args as CheckRotaryArgs checks them, with no position or table, seq >= 0
// and dim even.
absl::Status CheckRotaryTableArgs(const RotaryArgs& args, int64_t seq, int64_t dim);
// qkv [B, S, 3, H, D], D even, float; args as CheckRotaryArgs checks them.
absl::Status CheckRotaryQkArgs(const RotaryArgs& args, const Tensor& qkv);
// A packed qkv [B, S, 3, H, D] as the rows a GEMM reads: [B * S, 3 * H * D].
Tensor PackedQkvRows(const Tensor& qkv);
// qkv as CheckRotaryQkArgs checks it; fp8, y and y_t as
// CheckQuantizeTransposeArgs checks them for PackedQkvRows(qkv); dbias null or
// as CheckSumRowsArgs checks it.
absl::Status CheckRotaryQkQuantizeTransposeArgs(const RotaryArgs& args, const Tensor* qkv,
                                                const Fp8Output& fp8, const Tensor* y,
                                                const Tensor* y_t, const Tensor* dbias);
// table / dtable [heads, num_buckets].
struct RelativeBiasDims {
  int64_t num_buckets = 0;
  int64_t heads = 0;
};
// These check the buckets' dtype and shape, not their values, which may live
// on the device (the CPU checks them as it reads them; the CUDA kernels write
// NaN for a bucket outside the table, and backward skips it).
// With first_row (HasDevicePosition) bias is [heads, Sq, Skv] for any Sq;
// without it Sq is buckets' row count.
absl::StatusOr<RelativeBiasDims> CheckRelativeBiasForwardArgs(const Tensor& table,
                                                              const Tensor& buckets,
                                                              const Tensor& first_row,
                                                              const Tensor* bias);
inline absl::StatusOr<RelativeBiasDims> CheckRelativeBiasForwardArgs(const Tensor& table,
                                                                     const Tensor& buckets,
                                                                     const Tensor* bias) {
  return CheckRelativeBiasForwardArgs(table, buckets, Tensor(), bias);
}
absl::StatusOr<RelativeBiasDims> CheckRelativeBiasBackwardArgs(const Tensor& dbias,
                                                               const Tensor& buckets,
                                                               const Tensor* dtable);

// ---- language-model ops ------------------------------------------------------
// [rows, width] of an Embed or cross-entropy call: Embed's table [V, F] gives
// rows = N ids and width = F; the cross entropy's logits [N, V] width = V.
// The ids' / labels' values are not checked (they may live on the device).
struct LmDims {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t vocab = 0;
};
absl::StatusOr<LmDims> CheckEmbedForwardArgs(const Tensor& table, const Tensor& ids,
                                             const Tensor* y);
absl::StatusOr<LmDims> CheckEmbedBackwardArgs(const Tensor& dy, const Tensor& ids,
                                              const Tensor* dtable);
absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyArgs(const char* op, const Tensor& logits,
                                                    const Tensor& labels, const Tensor* lse);
// The two directions' whole checks: the above, plus loss [1] f32 (forward);
// dloss [1] f32 and dlogits float of logits' shape (backward).
absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyForwardArgs(const Tensor& logits,
                                                           const Tensor& labels, const Tensor* loss,
                                                           const Tensor* lse);
absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyBackwardArgs(const Tensor& logits,
                                                            const Tensor& labels,
                                                            const Tensor& lse,
                                                            const Tensor& dloss,
                                                            const Tensor* dlogits);

// x [..., V] float with V >= 1, y int32 with x.numel() / V elements; gives
// rows = x.numel() / V, width = V.
absl::StatusOr<LmDims> CheckArgmaxLastArgs(const Tensor& x, const Tensor* y);

// ---- optimizers ---------------------------------------------------------------

absl::Status CheckOptimizerUpdateArgs(const OptimizerUpdateArgs& args, const Tensor& grad,
                                      const Tensor& grad_norm_sq, const Tensor* param,
                                      const Tensor* mu, const Tensor* nu);

}  // namespace te

#endif  // TE_KERNELS_OP_CHECKS_H_
