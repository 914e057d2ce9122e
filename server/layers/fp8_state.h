// FP8 recipes and quantizer state: resolving a te.v1.Recipe with TE's
// defaults, the per-GEMM quantizer sets (TE's generate_quantizer_set), turning
// a GEMM operand into what Ops::Gemm takes under each recipe, and the
// end-of-step delayed-scaling update.
//
// Quantizer variables (DelayedScaling only), per GEMM, in "fp8_metas/<scope>/":
//   x<postfix>_scale [1] f32 = 1        x<postfix>_amax_history [L] f32 = 0
//   kernel<postfix>_scale ...           kernel<postfix>_amax_history ...
//   grad<postfix>_scale ...             grad<postfix>_amax_history ...
// "x" and "kernel" quantize to the forward dtype (E4M3 under HYBRID), "grad"
// to the backward dtype (E5M2 under HYBRID).
#ifndef TE_SERVER_LAYERS_FP8_STATE_H_
#define TE_SERVER_LAYERS_FP8_STATE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/layers/init.h"
#include "server/layers/layer.h"
#include "te/v1/recipe.pb.h"

namespace te::layers {

// TE's defaults: DelayedScaling(margin 0, HYBRID, amax_history_len 1024,
// "max"); Float8CurrentScaling(HYBRID, amax_epsilon 0); MXFP8BlockScaling(E4M3).
// INVALID_ARGUMENT naming the field ("recipe.delayed_scaling.amax_history_len"
// outside 1..65536, "recipe.delayed_scaling.amax_compute_algo" not "max" /
// "most_recent", a negative margin or epsilon, an unset recipe).
absl::StatusOr<Fp8Recipe> ResolveRecipe(const te::v1::Recipe& recipe);

// True for DelayedScaling: the only recipe with state (the fp8_metas collection).
bool HasFp8Metas(const Fp8Recipe* fp8);
// Delayed and current scaling quantize whole tensors with one scale, so one
// quantized copy serves every GEMM that reads the tensor (either transpose).
bool IsPerTensorScaling(const Fp8Recipe& fp8);

enum class QuantizerRole { kX, kKernel, kGrad };
const char* QuantizerName(QuantizerRole role);  // "x", "kernel", "grad"
DType QuantizerDType(const Fp8Recipe& fp8, QuantizerRole role);

// One GEMM's quantizers: TE's generate_quantizer_set(postfix) in module
// `scope` ("" for a standalone module, "qkv", "mlp"...; postfix "" or "_0",
// "_1"). The six variable names are made once, here: every quantization of
// a step looks two of them up.
class QuantizerSet {
 public:
  QuantizerSet(const std::string& scope, const std::string& postfix);
  // "fp8_metas/<scope>/x<postfix>_scale"
  const std::string& ScaleName(QuantizerRole role) const {
    return scale_names_[static_cast<int>(role)];
  }
  // ".../x<postfix>_amax_history"
  const std::string& HistoryName(QuantizerRole role) const {
    return history_names_[static_cast<int>(role)];
  }

 private:
  std::array<std::string, 3> scale_names_, history_names_;  // by QuantizerRole
};

// The six fp8_metas variables of a set; empty unless `fp8` is DelayedScaling.
std::vector<VariableDef> QuantizerSetDefs(const QuantizerSet& set, const Fp8Recipe* fp8);

// FAILED_PRECONDITION with TE's ScopeCollectionNotFound advice when `fp8` is
// DelayedScaling and the set's variables are missing from `vars`.
absl::Status CheckQuantizerSet(const Variables& vars, const QuantizerSet& set,
                               const Fp8Recipe* fp8);

// Device bytes a kept tensor holds (0 for an undefined one).
inline int64_t TensorBytes(const Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
}

// An operand as Ops::Gemm takes it: `data` enters as op(data) with
// `transpose`; FP8 data carries its scale_inv.
struct GemmOperand {
  Tensor data;
  bool transpose = false;
  Tensor scale_inv;  // defined iff data is FP8
  // data^T, when the quantize wrote it too (cast-transpose): FP8 GEMMs take
  // operands in one layout only (TN), and this copy spares the GEMM its own
  // transpose. Same scale_inv.
  Tensor data_t;
  int64_t bytes() const {
    return TensorBytes(data) + TensorBytes(scale_inv) + TensorBytes(data_t);
  }
};
enum class GemmSide { kA, kB };  // a: op(a) [M, K]; b: op(b) [K, N]

// The layout of `op` that enters `side` of an FP8 GEMM without a copy (a as
// [M, K], b as [N, K]) when op carries both; otherwise op as it is.
GemmOperand ForGemm(const GemmOperand& op, GemmSide side);

// The operand `x` (2-D float, entering side `side` of a GEMM with
// `transpose`) quantized for `role` under `fp8`:
//  * DelayedScaling: quantized with the set's current scale; its amax goes to
//    history[0] (a view of the first element), unless fp8.inference. FAILED_PRECONDITION when the
//    set's variables are missing.
//  * Float8CurrentScaling: scale = fp8_max / max(amax(x), epsilon).
//  * MXFP8 / NVFP4: fake-quantized in blocks along the contraction axis (x
//    transposed first when that axis is not the last); the result stays in
//    x's dtype and the GEMM runs unquantized. INVALID_ARGUMENT when the
//    contraction length is not a multiple of the block (32 / 16).
absl::StatusOr<GemmOperand> QuantizeGemmOperand(Ops& ops, const Fp8Recipe& fp8,
                                                const QuantizerSet& set, QuantizerRole role,
                                                const Tensor& x, GemmSide side, bool transpose,
                                                Variables* vars);

// QuantizeGemmOperand that, under per-tensor scaling, also writes data_t in
// the same pass (Ops::QuantizeTranspose), for an operand that enters GEMMs
// in both layouts (x: forward and wgrad; kernel: forward and dgrad; dy: dgrad
// and wgrad). Block scalings: as QuantizeGemmOperand. With `dbias` ([cols],
// float), also its column sums: a bias gradient from the same read of x
// (Ops::QuantizeTransposeDbias, TE's cast-transpose-dbias).
absl::StatusOr<GemmOperand> QuantizeGemmOperandBothLayouts(Ops& ops, const Fp8Recipe& fp8,
                                                           const QuantizerSet& set,
                                                           QuantizerRole role, const Tensor& x,
                                                           GemmSide side, bool transpose,
                                                           Variables* vars,
                                                           Tensor* dbias = nullptr);

// Fused quantization: under DelayedScaling the op that produces a GEMM
// operand (a norm, an activation) can write it straight in FP8 with the
// quantizer's scale, as TE's fused kernels do. Current scaling cannot: its
// scale needs the finished tensor's amax. Block scalings are emulated.
bool CanFuseQuantize(const Fp8Recipe* fp8);
// Allocates the FP8 operand [shape] for `role` (side a, not transposed) and
// fills *out with the quantizer's scale, history[0] as amax (none under
// fp8.inference), and the operand's scale_inv, for the producing op to
// write through.
// FAILED_PRECONDITION when the set's variables are missing.
absl::StatusOr<GemmOperand> AllocateFusedOperand(Ops& ops, const Fp8Recipe& fp8,
                                                 const QuantizerSet& set, QuantizerRole role,
                                                 const Shape& shape, Variables* vars,
                                                 Fp8Output* out);

// TE's end-of-step update, for every "fp8_metas/.../<q>_amax_history" in
// `vars` with its "<q>_scale": roll the history, amax = max (or most recent),
// scale = fp8_max * 2^-margin / amax (kept where amax is 0, inf or NaN).
// fp8_max follows the quantizer's format (grad: backward dtype). No-op for
// recipes without state. FAILED_PRECONDITION when a history has no scale.
// non_finite: null, or [1] f32 to which the number of quantizers whose amax
// was inf or NaN is added on the device (Ops::DelayedScalingUpdates).
absl::Status UpdateFp8Metas(Ops& ops, const Fp8Recipe& fp8, Variables* vars,
                            Tensor* non_finite = nullptr);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_FP8_STATE_H_
