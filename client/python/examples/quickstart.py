"""TE's JAX quickstart (docs/examples/quickstart_jax.ipynb), section by section, on a te_server.

Only the imports changed, plus three things JAX has and this client does not:
a PRNG (numpy's generator and integer keys stand in for jax.random), bf16
casts (te.asarray(x, dtype) for .astype(dtype)), and the printed dtype
(te.dtype_of(y) names bfloat16 where numpy would show its float32 storage).
Every composed layer's class is the notebook's, the plain-Flax one too: init
traces its __call__ (te_client.numpy's reshape and split, +, nn.Dropout,
Flax's nn.Dense / nn.LayerNorm / nn.MultiHeadDotProductAttention and TE's
modules) into one server graph, so a step is one call and no activation
crosses the wire.

    python3 client/python/examples/quickstart.py --address=localhost:50051
    python3 client/python/examples/quickstart.py --address=... --config=quickstart   # the notebook's sizes
"""
import argparse
import os
import sys
from typing import Optional

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import te_client.numpy as jnp                          # was: import jax.numpy as jnp
import te_client as te                                 # was: import transformer_engine.jax as te
import te_client.flax as te_flax                       # was: import transformer_engine.jax.flax as te_flax
from te_client import linen as nn                      # was: from flax import linen as nn
from te_client.recipe import Format, DelayedScaling    # was: from transformer_engine.common.recipe import ...

# The notebook's sections.
SECTIONS = ["flax", "te_flax_attention", "te_attention", "fp8", "fused", "transformer_layer"]

CONFIGS = {
    # Small enough for the CPU reference backend; the C++ quickstart's "small" too.
    "small": dict(hidden_size=64, sequence_length=32, batch_size=2, ffn_hidden_size=256, num_attention_heads=4),
    # The notebook's GPT decoder layer.
    "quickstart": dict(hidden_size=4096, sequence_length=2048, batch_size=4, ffn_hidden_size=16384,
                       num_attention_heads=32),
}


class FlaxMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True)(x)
        x = nn.gelu(x, approximate=True)  # Use tanh approximation
        x = nn.Dense(features=self.hidden_size, use_bias=True)(x)
        return x


class FlaxTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(self, x: jnp.ndarray, attention_mask: Optional[jnp.ndarray] = None,
                 deterministic: bool = False) -> jnp.ndarray:
        # Create causal mask if not provided
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # Fused QKV projection
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # q, k, v now have shape [batch, seq_len, num_heads, kv_channels]
        # which is the correct shape for dot_product_attention
        q_reshaped = q.reshape(q.shape[0], q.shape[1], self.hidden_size)
        k_reshaped = k.reshape(k.shape[0], k.shape[1], self.hidden_size)
        v_reshaped = v.reshape(v.shape[0], v.shape[1], self.hidden_size)

        attention = nn.MultiHeadDotProductAttention(
            num_heads=self.num_attention_heads,
            qkv_features=self.kv_channels,
            dropout_rate=self.attention_dropout,
        )
        x = attention(q_reshaped, k_reshaped, v_reshaped, mask=attention_mask, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)

        # MLP
        mlp = FlaxMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size)
        x = mlp(x)

        return x + res


class TEUnfusedMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        x = te_flax.DenseGeneral(features=self.ffn_hidden_size, use_bias=True)(x)
        x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
        x = te.activation.activation(x, activation_type=("gelu",))
        x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)
        return x


class TEUnfusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    use_te_attention: bool = True  # True for TE attention, False for Flax attention

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(self, x: jnp.ndarray, attention_mask: Optional[jnp.ndarray] = None,
                 deterministic: bool = False) -> jnp.ndarray:
        # Create causal mask if not provided
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)

        res = x
        x = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)

        # Fused QKV projection
        qkv = te_flax.DenseGeneral(features=3 * self.hidden_size, use_bias=True)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # Attention - either TE or Flax implementation
        if self.use_te_attention:
            attention = te_flax.DotProductAttention(
                head_dim=self.kv_channels,
                num_attention_heads=self.num_attention_heads,
                num_gqa_groups=self.num_attention_heads,  # No GQA
                attention_dropout=self.attention_dropout,
                attn_mask_type="causal",
                dtype=te.bfloat16,
            )
            x = attention(q, k, v, sequence_descriptor=None, deterministic=deterministic)
            # Reshape from [batch, seq_len, num_heads, head_dim] to [batch, seq_len, hidden_size]
            x = x.reshape((x.shape[0], x.shape[1], x.shape[2] * x.shape[3]))
            x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)
            x = nn.Dropout(rate=self.attention_dropout)(x, deterministic=deterministic)
        else:
            q_reshaped = q.reshape(q.shape[0], q.shape[1], self.hidden_size)
            k_reshaped = k.reshape(k.shape[0], k.shape[1], self.hidden_size)
            v_reshaped = v.reshape(v.shape[0], v.shape[1], self.hidden_size)
            attention = nn.MultiHeadDotProductAttention(
                num_heads=self.num_attention_heads,
                qkv_features=self.kv_channels,
                dropout_rate=self.attention_dropout,
            )
            x = attention(q_reshaped, k_reshaped, v_reshaped, mask=attention_mask, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x = te_flax.LayerNorm(epsilon=self.layernorm_eps)(x)

        # MLP
        mlp = TEUnfusedMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size)
        x = mlp(x, deterministic=deterministic)

        return x + res


class TEFusedTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(self, x: jnp.ndarray, attention_mask: Optional[jnp.ndarray] = None,
                 deterministic: bool = False) -> jnp.ndarray:
        res = x

        # Fused QKV projection
        qkv, _ = te_flax.LayerNormDenseGeneral(features=3 * self.hidden_size, epsilon=self.layernorm_eps,
                                               use_bias=True, return_layernorm_output=False)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)

        # Attention using TE's DotProductAttention
        attention = te_flax.DotProductAttention(
            head_dim=self.kv_channels,
            num_attention_heads=self.num_attention_heads,
            num_gqa_groups=self.num_attention_heads,
            attention_dropout=self.attention_dropout,
            attn_mask_type="causal",
            dtype=te.bfloat16,
        )
        x = attention(q, k, v, sequence_descriptor=None, deterministic=deterministic)
        # Reshape from [batch, seq_len, num_heads, head_dim] to [batch, seq_len, hidden_size]
        x = x.reshape((x.shape[0], x.shape[1], x.shape[2] * x.shape[3]))
        x = te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)
        x = nn.Dropout(rate=self.attention_dropout)(x, deterministic=deterministic)

        x = res + x

        # Second residual connection
        res = x
        x, _ = te_flax.LayerNormMLP(intermediate_dim=self.ffn_hidden_size, epsilon=self.layernorm_eps,
                                    use_bias=True, activations=("gelu",), intermediate_dropout_rate=0.0,
                                    return_layernorm_output=False)(x, deterministic=deterministic)

        return x + res


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--warmup_iters", type=int, default=3)   # the notebook: 50 on a GPU
    parser.add_argument("--timing_iters", type=int, default=10)  # the notebook: 50
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error("unknown sections: %s" % ", ".join(sorted(sections - set(SECTIONS))))
    timing = dict(warmup_iters=args.warmup_iters, timing_iters=args.timing_iters)

    client = te.connect(args.address)
    fp8_format = Format.HYBRID
    fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16, amax_compute_algo="max")
    with client.session(recipes=[fp8_recipe], policy="fallback") as session:
        print(f"Session {session.id} on {session.device}; FP8 recipe: {session.recipe}")

        # Layer configuration
        config = CONFIGS[args.config]
        hidden_size = config["hidden_size"]
        sequence_length = config["sequence_length"]
        batch_size = config["batch_size"]
        ffn_hidden_size = config["ffn_hidden_size"]
        num_attention_heads = config["num_attention_heads"]
        dtype = te.bfloat16

        # Synthetic data
        key, dropout_key = 42, 43
        rng = np.random.default_rng(key)
        x = te.asarray(rng.standard_normal((batch_size, sequence_length, hidden_size), dtype=np.float32), dtype)
        dy = te.asarray(rng.standard_normal((batch_size, sequence_length, hidden_size), dtype=np.float32), dtype)

        if "flax" in sections:
            print("\n# The plain-Flax layer")
            flax_transformer = FlaxTransformerLayer(
                hidden_size=hidden_size,
                ffn_hidden_size=ffn_hidden_size,
                num_attention_heads=num_attention_heads,
            )
            params = flax_transformer.init(key, x, attention_mask=None, deterministic=False)
            print("Pure Flax FlaxTransformerLayer initialized successfully!")
            print(f"Parameter shapes: {te.tree_map(lambda x: x.shape, params)}")

            y = flax_transformer.apply(params, x, attention_mask=None, deterministic=True)
            print(f"Input shape: {x.shape}")
            print(f"Output shape: {y.shape}")
            print(f"Output dtype: {te.dtype_of(y)}")
            print("Forward pass completed successfully!")

            te.speedometer(model_apply_fn=flax_transformer.apply, variables=params, input=x, output_grad=dy,
                           forward_kwargs={"attention_mask": None, "deterministic": False},
                           rngs={"dropout": dropout_key}, **timing)

        if "te_flax_attention" in sections:
            print("\n# TE modules, Flax attention")
            te_unfused_transformer_with_flax_MHA = TEUnfusedTransformerLayer(
                hidden_size, ffn_hidden_size, num_attention_heads, use_te_attention=False)
            te_params = te_unfused_transformer_with_flax_MHA.init(key, x, attention_mask=None, deterministic=False)
            print(f"Parameter shapes: {te.tree_map(lambda x: x.shape, te_params)}")
            te.speedometer(model_apply_fn=te_unfused_transformer_with_flax_MHA.apply, variables=te_params,
                           input=x, output_grad=dy, forward_kwargs={"attention_mask": None, "deterministic": False},
                           rngs={"dropout": dropout_key}, **timing)

        if "te_attention" in sections:
            print("\n# TE modules, TE attention")
            te_unfused_transformer = TEUnfusedTransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
            te_params = te_unfused_transformer.init(key, x, attention_mask=None, deterministic=False)
            te.speedometer(model_apply_fn=te_unfused_transformer.apply, variables=te_params, input=x,
                           output_grad=dy, forward_kwargs={"attention_mask": None, "deterministic": False},
                           rngs={"dropout": dropout_key}, **timing)

        if "fp8" in sections:
            print("\n# FP8")
            te_unfused_transformer = TEUnfusedTransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
            with te.autocast(enabled=True, recipe=fp8_recipe):
                te_unfused_params = te_unfused_transformer.init(key, x, attention_mask=None, deterministic=False)
                # Example usage of forward
                y = te_unfused_transformer.apply(te_unfused_params, x, attention_mask=None, deterministic=True)
            print(f"Parameter shapes: {te.tree_map(lambda x: x.shape, te_unfused_params)}")
            print(f"Output shape: {y.shape}")
            te.speedometer(model_apply_fn=te_unfused_transformer.apply, variables=te_unfused_params, input=x,
                           output_grad=dy, forward_kwargs={"attention_mask": None, "deterministic": False},
                           autocast_kwargs={"enabled": True, "recipe": fp8_recipe},
                           rngs={"dropout": dropout_key}, **timing)

        if "fused" in sections:
            print("\n# Fused TE modules")
            te_fused_transformer = TEFusedTransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
            with te.autocast(enabled=True, recipe=fp8_recipe):
                te_fused_params = te_fused_transformer.init(key, x, attention_mask=None, deterministic=False)
                # Example usage of forward
                y = te_fused_transformer.apply(te_fused_params, x, attention_mask=None, deterministic=True)
            print(f"Output shape: {y.shape}")
            te.speedometer(model_apply_fn=te_fused_transformer.apply, variables=te_fused_params, input=x,
                           output_grad=dy, forward_kwargs={"attention_mask": None, "deterministic": False},
                           autocast_kwargs={"enabled": True, "recipe": fp8_recipe},
                           rngs={"dropout": dropout_key}, **timing)

        if "transformer_layer" in sections:
            print("\n# TransformerLayer")
            te_transformer = te_flax.TransformerLayer(
                hidden_size=hidden_size,
                mlp_hidden_size=ffn_hidden_size,
                num_attention_heads=num_attention_heads,
                mlp_activations=("gelu",),
                self_attn_mask_type="causal",
                layernorm_epsilon=1e-5,
                use_bias=True,
                intermediate_dropout=0.0,
                enable_relative_embedding=False,
                self_attn_bias_type="no_bias",
                hidden_dropout=0.0,
                dtype=te.bfloat16,
            )
            with te.autocast(enabled=True, recipe=fp8_recipe):
                te_transformer_params = te_transformer.init(key, x, deterministic=False)
                y = te_transformer.apply(te_transformer_params, x, attention_mask=None, deterministic=True)
            print(f"Output shape: {y.shape}")
            te.speedometer(model_apply_fn=te_transformer.apply, model_init_fn=te_transformer.init,
                           variables=te_transformer_params, input=x, output_grad=dy,
                           forward_kwargs={"attention_mask": None, "deterministic": False},
                           autocast_kwargs={"enabled": True, "recipe": fp8_recipe},
                           rngs={"dropout": dropout_key}, **timing)
    client.close()


if __name__ == "__main__":
    main()
