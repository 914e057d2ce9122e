"""Parity of the quickstart's plain-Flax layer on te_server with the same layer in JAX, on identical parameters.

The notebook's FlaxTransformerLayer (nn.LayerNorm, nn.Dense, nn.MultiHeadDotProductAttention with a
causal mask, FlaxMLP with a tanh-gelu) twice: in JAX with Flax itself, and on the server as the
graph te_client's tracer records from the same class (examples/quickstart.py). JAX's parameters go
to the server with SetVariables; both run forward and backward (value_and_grad of vdot(y, dy),
dropout off) on the same x and dy, and the relative error ||server - jax|| / ||jax|| of y, dx and
every parameter gradient is printed. It exits 1 when one exceeds the bound. Both follow Flax's dtype
rule (bf16 x with float32 parameters computes in float32) at the default matmul precision
(TensorFloat-32 on a GPU for JAX and for te_server).

Needs JAX and Flax (the GPU machine has both; the build machine has neither):

    te_server --device=cuda:0 --port=50051 &       # or --device=cpu
    python3 client/python/examples/jax_parity.py --address=localhost:50051 [--config=quickstart]
"""
import argparse
import json
import os
import sys
from typing import Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU with te_server

import numpy as np                                  # noqa: E402
import jax                                          # noqa: E402
import jax.numpy as jnp                             # noqa: E402
from flax import linen as nn                        # noqa: E402
from flax import traverse_util                      # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import te_client as te                              # noqa: E402
from te_client import variables as variables_lib    # noqa: E402
import quickstart                                   # noqa: E402  (the notebook's classes, traced)

CONFIGS = quickstart.CONFIGS   # the same layer sizes as the quickstart's run
# Relative error, server vs JAX: both compute in float32 (Flax's promotion) at the notebook's default
# matmul precision, TensorFloat-32 on a GPU on both sides (operands rounded to 10 mantissa bits,
# 2^-11); on the CPU both are exact float32.
BOUND = 1e-2


class FlaxMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True)(x)
        x = nn.gelu(x, approximate=True)
        return nn.Dense(features=self.hidden_size, use_bias=True)(x)


class FlaxTransformerLayer(nn.Module):
    """The notebook's plain-Flax layer, in Flax."""
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        kv_channels = self.hidden_size // self.num_attention_heads
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=True)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)
        q = q.reshape(q.shape[0], q.shape[1], self.hidden_size)
        k = k.reshape(k.shape[0], k.shape[1], self.hidden_size)
        v = v.reshape(v.shape[0], v.shape[1], self.hidden_size)
        attention = nn.MultiHeadDotProductAttention(num_heads=self.num_attention_heads, qkv_features=kv_channels,
                                                    dropout_rate=self.attention_dropout)
        x = attention(q, k, v, mask=attention_mask, deterministic=deterministic)
        x = res + x
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps)(x)
        x = FlaxMLP(self.hidden_size, self.ffn_hidden_size)(x)
        return x + res


def rel_err(server, reference):
    a = np.asarray(server, np.float64)
    b = np.asarray(reference, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def zero_err(server, reference, name):
    """The attention's key bias gets a gradient that is exactly zero (softmax ignores a shift of a
    query's logits, and q . b_key shifts them all): both sides hold rounding noise, so it is judged
    by its size against the key kernel's gradient, not by a relative difference. The same rule
    as the C++ comparisons' ZeroGradientError (server/layers/testing.h)."""
    kernel = np.linalg.norm(np.asarray(reference[name[:-len("bias")] + "kernel"], np.float64))
    size = max(np.linalg.norm(np.asarray(server[name], np.float64)), np.linalg.norm(np.asarray(reference[name], np.float64)))
    return float(size / max(kernel, 1e-30))


def flat(tree):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="x and dy")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    c = CONFIGS[args.config]
    shape = (c["batch_size"], c["sequence_length"], c["hidden_size"])

    rng = np.random.default_rng(args.seed)
    dtype = te.bfloat16 if args.dtype == "bfloat16" else np.float32
    x = te.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    dy = te.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    jx, jdy = jnp.asarray(x), jnp.asarray(dy)

    # JAX: init, forward, value_and_grad of vdot(y, dy).
    model = FlaxTransformerLayer(c["hidden_size"], c["ffn_hidden_size"], c["num_attention_heads"])
    jax_vars = model.init(jax.random.PRNGKey(args.seed), jx, deterministic=True)
    loss = lambda v, inp: jnp.vdot(model.apply(v, inp, deterministic=True).astype(jnp.float32),
                                   jdy.astype(jnp.float32))
    jy = model.apply(jax_vars, jx, deterministic=True)
    j_value, (j_grads, j_dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jax_vars, jx)
    jax_params = flat(jax_vars)

    # The server: the same layer, given JAX's parameters.
    client = te.connect(args.address)
    with client.session() as session:
        layer = quickstart.FlaxTransformerLayer(c["hidden_size"], c["ffn_hidden_size"], c["num_attention_heads"])
        variables = layer.init(0, x, deterministic=True)
        server_names = set(variables_lib.flatten(variables))
        if server_names != set(jax_params):
            sys.exit("parameter names differ: server only %s, JAX only %s" % (
                sorted(server_names - set(jax_params)), sorted(set(jax_params) - server_names)))
        session.set_variables(variables, jax_params)
        back = variables_lib.flatten(session.get_variables(variables, ["params"]))
        assert all(np.array_equal(back[n], jax_params[n]) for n in jax_params), "SetVariables changed values"
        sy = layer.apply(variables, x, deterministic=True)
        s_value, (s_grads, s_dx) = te.value_and_grad(layer.apply)(variables, x, dy, deterministic=True)
        device = session.device

    bound = BOUND
    rows = [("y", rel_err(sy, jy)), ("dx", rel_err(s_dx, j_dx)),
            ("vdot(y, dy)", abs(s_value - float(j_value)) / max(abs(float(j_value)), 1e-30))]
    s_flat, j_flat = variables_lib.flatten(s_grads), flat(j_grads)
    rows += [("grad " + name, zero_err(s_flat, j_flat, name) if name.endswith("/key/bias") else
              rel_err(s_flat[name], j_flat[name])) for name in sorted(j_flat)]

    print("te_server %s vs JAX %s (%s), config %s %s, x/dy %s, both compute in float32" % (
        device, jax.__version__, jax.default_backend(), args.config, list(shape), args.dtype))
    print("%-40s %12s" % ("quantity", "rel. error"))
    for name, err in rows:
        print("%-40s %12.3e%s" % (name, err, "" if err <= bound else "   > %g" % bound))
    worst = max(err for _, err in rows)
    print("worst %.3e (bound %g): %s" % (worst, bound, "OK" if worst <= bound else "FAIL"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "jax_backend": jax.default_backend(), "config": args.config,
                       "dtype": args.dtype, "bound": bound,
                       "errors": dict(rows)}, f, indent=1)
    client.close()
    sys.exit(0 if worst <= bound else 1)


if __name__ == "__main__":
    main()
