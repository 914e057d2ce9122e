// Building blocks shared by every module: Dense, Norm, LayerNormDense, Mlp,
// dropout and residual add. Each block has a forward that fills a Saved struct
// (what its backward needs) and a backward that returns the input gradient
// and writes its parameter gradients into a Variables map.
//
// Conventions for every block:
//  * Activations are 2-D: x [N, H] with N = prod(leading dims); callers
//    flatten with Tensor::As2D(). The compute dtype is x's dtype (f32 or
//    bf16): outputs and input gradients are allocated by the block in it.
//  * Parameters are read from `vars` by full name ("params/<scope>/kernel")
//    in the param dtype and cast to the compute dtype (or quantized under FP8).
//    Parameter gradients are written to `grads` under the same names, in the
//    param dtype (overwriting).
//  * Under FP8 (opts.fp8 non-null) each Dense quantizes its GEMM operands with
//    its QuantizerSet (fp8_state.h); DelayedScaling writes amaxes into `vars`.
//  * A Saved struct may be reused only with the block (and vars) that made it.
//  * Memory: a Saved struct holds only what the backward reads (under
//    per-tensor FP8 an activation's codes in the wgrad's layout alone), and
//    backwards take their Saved struct and dy by value: a caller that moves
//    them in (a step that will not run the backward again) has each tensor
//    freed as soon as its last reader is queued, as JAX frees residuals;
//    one that passes copies keeps its own.
#ifndef TE_SERVER_LAYERS_BLOCKS_H_
#define TE_SERVER_LAYERS_BLOCKS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/ops.h"
#include "kernels/rng.h"  // DeriveSeed: each dropout site's seed
#include "server/layers/fp8_state.h"
#include "server/layers/init.h"
#include "server/layers/init.h"
#include "server/layers/layer.h"

namespace te::layers {

// Allocates a tensor on `ops` (convenience for blocks and layers).
absl::StatusOr<Tensor> NewTensor(Ops& ops, DType dtype, const Shape& shape);
// x in `dtype`: x itself when it already is, else a cast copy.
absl::StatusOr<Tensor> CastTo(Ops& ops, const Tensor& x, DType dtype);

// ---- Dense: y [N, out] = x [N, in] @ kernel [in, out] (+ bias [out]) --------
// The kernel is stored as TE stores it, [in_dims..., features...]
// (DenseGeneral features [3, 4096] -> kernel (in, 3, 4096)), the bias as
// [features...]; in = prod(in_dims), out = prod(features).
struct DenseConfig {
  std::string scope;                 // module path: "params/<scope>/<kernel_name>"
  std::string kernel_name = "kernel";
  std::string bias_name = "bias";
  bool use_bias = true;
  std::string fp8_postfix;           // quantizer names: "x<postfix>_scale", ...
  Shape in_dims;                     // e.g. {hidden}
  Shape features;                    // e.g. {3, hidden} or {n_act, inter}
  DType param_dtype = DType::kF32;
  std::optional<Initializer> kernel_init;  // default: KernelInit(kernel shape)
  // The module's own matmul precision is HIGHEST (a Flax module's
  // `precision`): its float32 GEMMs are exact whatever the call's.
  bool highest_precision = false;
};

// What a Dense's GEMM does besides x @ kernel + bias: ops.h's fused GEMM
// epilogues, so the tensors in between never make a trip through memory.
struct DenseFusion {
  // y = x @ kernel + bias + residual: a residual connection's add.
  Tensor residual;
  // Float compute only: y = gelu(x @ kernel + bias), the GELU's input written
  // to *gelu_input (what its backward needs).
  Tensor* gelu_input = nullptr;
};
class Dense {
 public:
  explicit Dense(DenseConfig config);
  const DenseConfig& config() const { return config_; }
  int64_t in() const { return in_; }
  int64_t out() const { return out_; }
  Shape kernel_shape() const;
  std::string kernel_name() const;  // full: "params/<scope>/kernel"
  std::string bias_name() const;
  const QuantizerSet& quantizers() const { return quantizers_; }

  // kernel (+ bias) (+ the quantizer set's fp8_metas under DelayedScaling).
  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const;

  struct Saved {
    std::optional<Fp8Recipe> fp8;
    bool tf32 = false;  // the forward's GEMM precision, the backward's too
    // The GEMM's a operand (FP8 under per-tensor scaling). With
    // x_transposed, x.data is x^T [in, N] alone: the wgrad's layout, all the
    // backward reads of a quantized x.
    GemmOperand x;
    bool x_transposed = false;
    // b operand: [in, out], compute dtype or FP8 (the dgrad's layout only).
    GemmOperand kernel;
    Tensor x_hp;         // high-precision x, kept for block scaling's wgrad
    Tensor kernel_hp;    // high-precision kernel [in, out], for block scaling
    bool kernel_owned = true;  // false when `kernel` shares the variable's memory
    int64_t bytes() const;
  };
  // x [N, in] -> *y [N, out] in x's dtype. `saved` may be null (no backward).
  // tf32: the call's matmul precision (ForwardOptions::tf32), for float32
  // operands; the config's highest_precision overrides it.
  absl::Status Forward(Ops& ops, Variables* vars, const Tensor& x, const Fp8Recipe* fp8,
                       bool tf32, Tensor* y, Saved* saved, const DenseFusion& fusion = {}) const;
  // As Forward, for an x its producer already quantized with this Dense's
  // "x" quantizer (AllocateFusedOperand): FP8 [N, in], per-tensor recipes.
  absl::Status ForwardQuantized(Ops& ops, Variables* vars, const GemmOperand& x, DType compute,
                                const Fp8Recipe& fp8, Tensor* y, Saved* saved,
                                const DenseFusion& fusion = {}) const;
  // dy [N, out] -> *dx [N, in] (skipped when dx is null); kernel and bias
  // gradients into *grads. Under DelayedScaling dy's amax goes to the grad
  // quantizer's history[0].
  // Each of saved's and dy's tensors is released once its last GEMM is queued.
  absl::Status Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy, Tensor* dx,
                        Variables* grads) const;
  // As Backward, for a dy its producer already quantized with this Dense's
  // grad quantizer in both layouts (data [N, out], data_t [out, N]; TE's
  // dact-cast-transpose-dbias), after a per-tensor FP8 forward; dbias [out]
  // (AllocateBiasGrad) holds dy's column sums iff the Dense has a bias. dx
  // in `compute`.
  absl::Status BackwardQuantized(Ops& ops, Saved saved, GemmOperand dy, Tensor dbias,
                                 DType compute, Tensor* dx, Variables* grads) const;
  // The bias gradient's tensor, [out] in the params' dtype.
  absl::StatusOr<Tensor> AllocateBiasGrad(Ops& ops) const;
  // What a producer writes dy into for BackwardQuantized, after a per-tensor
  // FP8 forward: dy's operand in both layouts (data [rows, out], data_t [out,
  // rows], in the grad quantizer's dtype), the Fp8Output that writes it (the
  // grad quantizer's, AllocateFusedOperand), and the bias gradient's tensor
  // where the Dense has a bias (undefined otherwise).
  struct QuantizedGrad {
    GemmOperand dy;
    Fp8Output fp8;
    Tensor dbias;
  };
  absl::StatusOr<QuantizedGrad> AllocateQuantizedGrad(Ops& ops, const Fp8Recipe& fp8,
                                                      int64_t rows, Variables* vars) const;
  bool use_bias() const { return config_.use_bias; }

 private:
  // The wgrad, then (dx non-null) the dgrad, from operands ready for them.
  absl::Status RunBackwardGemms(Ops& ops, GemmOperand dy_a, GemmOperand kernel_b,
                                GemmOperand x_a, GemmOperand dy_b, bool tf32, DType compute,
                                int64_t n, Tensor* dx, Variables* grads) const;
  // *y [N, out] = op(a) @ op(b) + bias (+ the fusion's epilogue), in `compute`.
  absl::Status RunGemm(Ops& ops, const Variables& vars, const GemmOperand& a,
                       const GemmOperand& b, DType compute, bool tf32,
                       const DenseFusion& fusion, Tensor* y) const;
  // Whether this Dense's float32 GEMMs run TensorFloat-32 for a call's `tf32`.
  bool Tf32For(bool call_tf32) const { return call_tf32 && !config_.highest_precision; }

  DenseConfig config_;
  QuantizerSet quantizers_;
  SpecsMemo specs_;  // of Defs
  int64_t in_ = 0;
  int64_t out_ = 0;
};

// ---- Norm: LayerNorm / RMSNorm over the last dimension ----------------------
// Params "params/<scope>/<scale_name>" [hidden] (ones; zeros when
// zero_centered_gamma) and, for LayerNorm, "<bias_name>" [hidden] (zeros).
struct NormConfig {
  std::string scope;
  std::string scale_name = "scale";
  std::string bias_name = "ln_bias";
  NormArgs args;
  int64_t hidden = 0;
  DType param_dtype = DType::kF32;
};

class Norm {
 public:
  explicit Norm(NormConfig config) : config_(std::move(config)) {}
  const NormConfig& config() const { return config_; }
  bool has_bias() const { return config_.args.type == NormType::kLayerNorm; }
  std::vector<VariableDef> Defs() const;

  struct Saved {
    Tensor x, mu, rsigma, gamma;  // gamma in the compute dtype
    int64_t bytes() const;
  };
  // x [N, hidden] -> *y [N, hidden] in x's dtype. With `fp8` (fused
  // quantization), *y must be an allocated FP8 [N, hidden] tensor instead,
  // and *y_t (if not null) an FP8 [hidden, N] one for the transposed codes.
  absl::Status Forward(Ops& ops, const Variables& vars, const Tensor& x, Tensor* y,
                       Saved* saved, const Fp8Output* fp8 = nullptr,
                       Tensor* y_t = nullptr) const;
  // residual_grad (optional, [N, hidden]) is added to *dx: the gradient that
  // reaches x around the norm through a residual connection.
  absl::Status Backward(Ops& ops, Saved saved, Tensor dy, Tensor* dx, Variables* grads,
                        const Tensor& residual_grad = Tensor()) const;

 private:
  NormConfig config_;
};

// ---- LayerNormDense: norm (optional) then Dense (TE's LayerNormDenseGeneral) --
struct LayerNormDenseConfig {
  bool enable_layernorm = true;
  NormConfig norm;    // scope usually equals dense.scope
  DenseConfig dense;
};

class LayerNormDense {
 public:
  explicit LayerNormDense(LayerNormDenseConfig config);
  const Norm& norm() const { return norm_; }
  const Dense& dense() const { return dense_; }
  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const;

  struct Saved {
    Norm::Saved norm;
    Dense::Saved dense;
    int64_t bytes() const { return norm.bytes() + dense.bytes(); }
  };
  // x [N, in] -> *y [N, out]; *ln_out (if non-null) the Dense's input [N, in]
  // (x itself when the norm is disabled). Without ln_out under DelayedScaling
  // the norm writes FP8 directly (TE's fused layernorm + quantize). tf32 as
  // Dense::Forward's.
  absl::Status Forward(Ops& ops, Variables* vars, const Tensor& x, const Fp8Recipe* fp8,
                       bool tf32, Tensor* y, Tensor* ln_out, Saved* saved,
                       const DenseFusion& fusion = {}) const;
  // residual_grad (optional) is added to *dx (Norm::Backward's). The Dense's
  // saved tensors and dy go before the norm's backward runs.
  absl::Status Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy, Tensor* dx,
                        Variables* grads, const Tensor& residual_grad = Tensor()) const;
  // Backward with a dy already quantized for the Dense (Dense::BackwardQuantized).
  absl::Status BackwardQuantized(Ops& ops, Saved saved, GemmOperand dy, Tensor dbias,
                                 DType compute, Tensor* dx, Variables* grads,
                                 const Tensor& residual_grad = Tensor()) const;

 private:
  // The norm's backward (or, without one, the residual's add) after the
  // Dense's: dln is the gradient at the Dense's input.
  absl::Status FinishBackward(Ops& ops, Norm::Saved norm, Tensor dln, Tensor* dx,
                              Variables* grads, const Tensor& residual_grad) const;
  // Where the Dense's backward writes its dgrad: dln, unless nothing wants it
  // (no norm and a null dx).
  Tensor* DenseDx(Tensor* dx, Tensor* dln) const;

  bool enable_layernorm_;
  Norm norm_;
  Dense dense_;
  SpecsMemo specs_;  // of Defs
};

// ---- Dropout (inverted) and residual add ------------------------------------
struct DropoutSaved {
  float rate = 0.0f;
  Tensor mask;  // undefined when dropout was off
  int64_t bytes() const { return TensorBytes(mask); }
};
// Off (y = x, sharing memory) when rate is 0 or deterministic.
absl::Status Dropout(Ops& ops, float rate, bool deterministic, uint64_t seed, const Tensor& x,
                     Tensor* y, DropoutSaved* saved);
absl::Status DropoutGrad(Ops& ops, const DropoutSaved& saved, const Tensor& dy, Tensor* dx);

// *y = a + b (allocated in a's dtype when undefined; may alias a or b).
absl::Status ResidualAdd(Ops& ops, const Tensor& a, const Tensor& b, Tensor* y);

// ---- Mlp: TE's LayerNormMLP --------------------------------------------------
//   ln = norm(x)                         [N, hidden]    (optional)
//   h  = ln @ wi_kernel + wi_bias        [N, n_act * inter]; wi_kernel (hidden, n_act, inter)
//   a  = act_0(h_0) (* act_1(h_1))       [N, inter]
//   a' = dropout(a, intermediate_dropout_rate)
//   y  = a' @ wo_kernel + wo_bias        [N, hidden];       wo_kernel (inter, hidden)
// Params "scale", "ln_bias", "wi_kernel", "wi_bias" (n_act, inter),
// "wo_kernel", "wo_bias" (hidden); quantizer sets postfix "_0" and "_1".
struct MlpConfig {
  std::string scope;  // "" standalone, "mlp" in TransformerLayer
  bool enable_layernorm = true;
  NormArgs norm;
  int64_t hidden = 0;
  int64_t intermediate = 2048;
  std::vector<Activation> activations = {Activation::kGelu};  // normalised order
  float intermediate_dropout_rate = 0.0f;
  bool use_bias = false;
  DType param_dtype = DType::kF32;
};

class Mlp {
 public:
  explicit Mlp(MlpConfig config);
  const MlpConfig& config() const { return config_; }
  std::vector<VariableDef> Defs(const Fp8Recipe* fp8) const;

  struct Saved {
    LayerNormDense::Saved ln_wi;
    Tensor h;  // pre-activation [N, n_act * inter]
    DropoutSaved dropout;
    Dense::Saved wo;
    int64_t bytes() const;
  };
  // x [N, hidden] -> *y [N, hidden]; *ln_out (if non-null) the norm output.
  // Dropout uses DeriveSeed(opts.dropout_seed, scope + "/intermediate_dropout").
  // Under DelayedScaling the norm (without ln_out) and the activation (when
  // dropout is off) write their outputs in FP8 directly. Without FP8 a lone
  // GELU runs in wi's GEMM epilogue. With
  // `residual` ([N, hidden]) y = mlp(x) + residual, added in wo's GEMM.
  absl::Status Forward(Ops& ops, Variables* vars, const Tensor& x, const ForwardOptions& opts,
                       Tensor* y, Tensor* ln_out, Saved* saved,
                       const Tensor& residual = Tensor()) const;
  // residual_grad (optional, [N, hidden]) is added to *dx. wo's saved input
  // and the pre-activation go as soon as their backwards have read them.
  // Under DelayedScaling with one activation, wi's output gradient is
  // written in FP8 by the activation's backward pass itself
  // (Ops::ActivationBackwardQuantizeTranspose), never in the compute dtype.
  absl::Status Backward(Ops& ops, Variables* vars, Saved saved, Tensor dy, Tensor* dx,
                        Variables* grads, const Tensor& residual_grad = Tensor()) const;

 private:
  // A single GELU (not gated): what cuBLASLt's GELU epilogues compute.
  bool LoneGelu() const;

  MlpConfig config_;
  LayerNormDense ln_wi_;  // norm (optional) + wi
  Dense wo_;
  SpecsMemo specs_;  // of Defs
};

// TE activation names -> ops' Activation list, normalised as TE does
// (("linear", "gelu") -> (gelu, linear)). INVALID_ARGUMENT naming `field`
// for an unknown name or a combination TE does not implement.
absl::StatusOr<std::vector<Activation>> ParseActivations(const std::vector<std::string>& names,
                                                         absl::string_view field);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_BLOCKS_H_
