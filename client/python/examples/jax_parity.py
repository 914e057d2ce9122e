"""Parity of te_server's plain-Flax layer with the same layer in JAX, on identical parameters.

Builds the quickstart's plain-Flax decoder layer (the layer te_server serves
as FlaxTransformerLayer: LayerNorm_0, Dense_0 (qkv, no bias), causal
dot-product attention, Dense_1 (no bias), dropout, LayerNorm_1, BasicMLP_0
with a tanh-gelu), initialises it in JAX, sends the same parameters to the
server with SetVariables, runs forward and backward (value_and_grad of
vdot(y, dy), dropout off) in both on the same x and dy, and prints the
relative error ||server - jax|| / ||jax|| of y, dx and every parameter
gradient. It exits 1 when one exceeds the bound (bf16: 1e-2).

Needs JAX and Flax (the GPU machine has both; the build machine has neither):

    te_server --device=cuda:0 --port=50051 &       # or --device=cpu
    python3 client/python/examples/jax_parity.py --address=localhost:50051 [--config=quickstart]

By default JAX computes in the input's dtype (dtype=x.dtype on every Flax
module), which is what the server does; --jax_dtype=promote keeps Flax's
default (bf16 inputs with float32 parameters compute in float32).
"""
import argparse
import json
import os
import sys
from typing import Any, Optional

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # share the GPU with te_server

import numpy as np                                  # noqa: E402
import jax                                          # noqa: E402
import jax.numpy as jnp                             # noqa: E402
from flax import linen as nn                        # noqa: E402
from flax import traverse_util                      # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import te_client as te                              # noqa: E402
import te_client.flax as te_flax                    # noqa: E402
from te_client import variables as variables_lib    # noqa: E402

CONFIGS = {
    "small": dict(hidden_size=256, sequence_length=128, batch_size=2, ffn_hidden_size=1024, num_attention_heads=4),
    "quickstart": dict(hidden_size=4096, sequence_length=2048, batch_size=4, ffn_hidden_size=16384,
                       num_attention_heads=32),
}
BOUNDS = {"bfloat16": 1e-2, "float32": 1e-4}   # relative error, server vs JAX


class BasicMLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(features=self.ffn_hidden_size, use_bias=True, dtype=self.dtype)(x)
        x = nn.gelu(x, approximate=True)
        return nn.Dense(features=self.hidden_size, use_bias=True, dtype=self.dtype)(x)


class BasicTransformerLayer(nn.Module):
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    dtype: Any = None

    @nn.compact
    def __call__(self, x, attention_mask: Optional[jnp.ndarray] = None, deterministic: bool = False):
        if attention_mask is None:
            attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        kv_channels = self.hidden_size // self.num_attention_heads
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps, dtype=self.dtype)(x)
        qkv = nn.Dense(features=3 * self.hidden_size, use_bias=False, dtype=self.dtype)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * kv_channels)
        q, k, v = jnp.split(qkv, 3, axis=3)
        dropout_rng = None
        if not deterministic and self.attention_dropout > 0:
            dropout_rng = self.make_rng("dropout")
        x = nn.dot_product_attention(q, k, v, mask=attention_mask, dropout_rng=dropout_rng,
                                     dropout_rate=self.attention_dropout, deterministic=deterministic,
                                     broadcast_dropout=True, dtype=self.dtype)
        x = x.reshape(x.shape[0], x.shape[1], self.hidden_size)
        x = nn.Dense(features=self.hidden_size, use_bias=False, dtype=self.dtype)(x)
        x = nn.Dropout(rate=self.hidden_dropout)(x, deterministic=deterministic)
        x = res + x
        res = x
        x = nn.LayerNorm(epsilon=self.layernorm_eps, dtype=self.dtype)(x)
        x = BasicMLP(hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size, dtype=self.dtype)(x)
        x = nn.Dropout(rate=self.hidden_dropout)(x, deterministic=deterministic)
        return x + res


def rel_err(server, reference):
    a = np.asarray(server, np.float64)
    b = np.asarray(reference, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def flat(tree):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(tree, sep="/").items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--dtype", choices=sorted(BOUNDS), default="bfloat16", help="x and dy")
    parser.add_argument("--jax_dtype", choices=["input", "promote"], default="input")
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
    model = BasicTransformerLayer(c["hidden_size"], c["ffn_hidden_size"], c["num_attention_heads"],
                                  dtype=jx.dtype if args.jax_dtype == "input" else None)
    jax_vars = model.init(jax.random.PRNGKey(args.seed), jx, deterministic=True)
    loss = lambda v, inp: jnp.vdot(model.apply(v, inp, deterministic=True).astype(jnp.float32),
                                   jdy.astype(jnp.float32))
    jy = model.apply(jax_vars, jx, deterministic=True)
    j_value, (j_grads, j_dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jax_vars, jx)
    jax_params = flat(jax_vars)

    # The server: the same layer, given JAX's parameters.
    client = te.connect(args.address)
    with client.session() as session:
        layer = te_flax.FlaxTransformerLayer(c["hidden_size"], c["ffn_hidden_size"], c["num_attention_heads"])
        variables = layer.init(0, x)
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

    bound = BOUNDS[args.dtype]
    rows = [("y", rel_err(sy, jy)), ("dx", rel_err(s_dx, j_dx)),
            ("vdot(y, dy)", abs(s_value - float(j_value)) / max(abs(float(j_value)), 1e-30))]
    s_flat, j_flat = variables_lib.flatten(s_grads), flat(j_grads)
    rows += [("grad " + name, rel_err(s_flat[name], j_flat[name])) for name in sorted(j_flat)]

    print("te_server %s vs JAX %s (%s), config %s %s, x/dy %s, JAX computes in %s" % (
        device, jax.__version__, jax.default_backend(), args.config, list(shape), args.dtype,
        args.dtype if args.jax_dtype == "input" else "float32 (Flax promotion)"))
    print("%-40s %12s" % ("quantity", "rel. error"))
    for name, err in rows:
        print("%-40s %12.3e%s" % (name, err, "" if err <= bound else "   > %g" % bound))
    worst = max(err for _, err in rows)
    print("worst %.3e (bound %g): %s" % (worst, bound, "OK" if worst <= bound else "FAIL"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "jax_backend": jax.default_backend(), "config": args.config,
                       "dtype": args.dtype, "jax_dtype": args.jax_dtype, "bound": bound,
                       "errors": dict(rows)}, f, indent=1)
    client.close()
    sys.exit(0 if worst <= bound else 1)


if __name__ == "__main__":
    main()
