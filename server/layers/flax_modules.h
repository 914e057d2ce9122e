// Flax's own modules (flax.linen) with Flax's semantics, so that a composite
// mixing them with TE's, and the quickstart's plain-Flax layer, run as one
// server graph exactly as the Flax code writes them (DESIGN.md section 11).
//
//   FlaxDense        x [..., in] -> [..., features]
//                    params kernel (in, features), bias (features)
//   FlaxDenseGeneral x contracted over `axis`: kernel (x.shape[axis]...,
//                    features...), bias (features...)
//   FlaxLayerNorm    over the last axis: scale (F) ones, bias (F) zeros
//   FlaxMultiHeadDotProductAttention
//                    x = inputs_q [B, Sq, F]; extra inputs k, v [B, Skv, F]
//                    query/key/value: kernel (F, heads, head_dim), bias (heads, head_dim)
//                    out: kernel (heads, head_dim, out_features), bias (out_features)
//                    y = out(softmax(q k^T / sqrt(head_dim) + mask) v)
// nn.gelu (approximate=True) is TE's Activation "gelu": the same tanh formula.
//
// Initialisers, Flax's defaults: kernels lecun_normal = variance_scaling(1,
// "fan_in", "truncated_normal"), with fan_in the product of the contracted
// input axes, because Flax's DenseGeneral draws its kernel flattened to
// [prod(in), prod(features)]: F for query/key/value (not F * heads, as
// init.h's KernelFanIn would say for that shape), heads * head_dim for out.
// Biases zeros, LayerNorm scale ones. Values are deterministic from (seed,
// variable name), as every module's here.
//
// Dtypes, Flax's rules: parameters in param_dtype (float32 by default); the
// computation in `dtype` when set, else in jnp.result_type(x, params)
// (PromoteFloat), which is also y's dtype (Layer::OutputDType): a bfloat16 x
// with float32 params computes and returns float32. Backward gives each
// input's gradient in that input's dtype and each parameter's in its own.
// They ignore TE's FP8 autocast, as plain Flax does: no fp8_metas.
//
// float32 matmuls: JAX's default precision for a float32 dot on a GPU with
// TF32 tensor cores (A100, H100, H200) is TF32 (lax.Precision.DEFAULT: XLA
// rounds the operands to TF32 and accumulates in float32; docs.jax.dev
// "Matmul precision"); precision="highest" is exact float32. A module's
// `precision` HIGHEST is exact float32 on every backend; DEFAULT (Flax's None)
// follows the call's matmul precision (ForwardOptions::tf32, the request's
// jax.default_matmul_precision), which at its own DEFAULT runs TF32 GEMMs on
// the GPU (Ops::GemmArgs::tf32). The CPU reference is exact float32 either
// way, as JAX's CPU backend is. An explicit precision="default" under a
// "highest" default_matmul_precision is exact here (JAX keeps it TF32): the
// wire's DEFAULT is also Flax's None.
//
// Where these differ from Flax:
//  * Attention dropout draws one mask element per (batch, head, query, key)
//    (the attention core's; Ops::AttentionForward's element index) whatever
//    broadcast_dropout says; Flax's default (true) shares one [Sq, Skv] mask
//    over batch and heads. Same rate and 1/(1-rate) scaling.
//  * A query row with no visible key (a padded query under a padding mask)
//    outputs zeros; Flax's finfo.min logits give it the mean of v.
//  * Softmax runs in float32 whatever the compute dtype (the attention
//    core's); Flax's runs in the compute dtype.
//  * key and value kernels are sized from x's features: InitLayer gives a
//    layer x's shape alone, so k and v must have q's features.
//  * LayerNorm's variance is two-pass (Flax's use_fast_variance computes
//    E[x^2] - E[x]^2); a Dense's bias is added before the one rounding to
//    the compute dtype (Flax rounds the product, then the sum). Both within
//    the compute dtype's rounding.
#ifndef TE_SERVER_LAYERS_FLAX_MODULES_H_
#define TE_SERVER_LAYERS_FLAX_MODULES_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// jnp.result_type of two of float32, bfloat16 and float16: equal dtypes stay,
// anything else is float32 (bfloat16 with float16 too: neither holds the other).
DType PromoteFloat(DType a, DType b);

// Each validates its spec (INVALID_ARGUMENT naming the field, e.g.
// "spec.flax_dense.features") and applies Flax's defaults.
absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxDense(const te::v1::FlaxDense& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxDenseGeneral(const te::v1::FlaxDenseGeneral& spec);
absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxLayerNorm(const te::v1::FlaxLayerNorm& spec);

// `causal`: the attention is causal (query i sees keys j <= i), what a
// graph's causal_mask node makes of it; otherwise it reads the request's
// padding mask when one is given, and no mask when none is.
absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxMultiHeadDotProductAttention(
    const te::v1::FlaxMultiHeadDotProductAttention& spec, bool causal = false);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_FLAX_MODULES_H_
