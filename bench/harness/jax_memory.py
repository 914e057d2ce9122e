#!/usr/bin/env python3
"""Peak device memory of one forward + backward step of a JAX peer, for the benchmark table's
peak-MiB column beside ours.

  python3 jax_memory.py [--peers PATH/jax_peers.py] [--layer cudnn|xla|flax]

Takes the layer classes from jax_peers.py (its imports and class definitions only, so the peer and
this measure share one definition and its benchmark does not run), jits the quickstart's step
(value_and_grad of vdot(apply(x), dy) over params and x) at the quickstart's sizes, runs it three
times, and prints
  PEERMEM <peer name as jax_peers.py prints it> <peak MiB>
from the device allocator's peak_bytes_in_use: parameters, x, dy, gradients and every temporary of
the step. One layer per process, because the peak is the process's.
"""
import argparse
import ast
import os
import sys
import types

NAMES = {"cudnn": "jax_bf16_cudnn_attention", "xla": "jax_bf16_xla_attention", "flax": "flax_quickstart_baseline"}


def load_peer_classes(path):
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.ClassDef))]
    # A registered module, as an import would make, for code that looks classes' modules up
    # (dataclasses, which flax.linen modules are).
    module = types.ModuleType("jax_peers_classes")
    module.__file__ = path
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=kept, type_ignores=[]), path, "exec"), module.__dict__)
    return module.__dict__


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=os.path.join(here, "jax_peers.py"))
    ap.add_argument("--layer", choices=sorted(NAMES), default="cudnn")
    args = ap.parse_args()
    name = NAMES[args.layer]
    try:
        peers = load_peer_classes(args.peers)
        import jax
        import jax.numpy as jnp

        B, S, H, F, NH = 4, 2048, 4096, 16384, 32  # the quickstart's, as jax_peers.py
        key, dkey = jax.random.split(jax.random.PRNGKey(42))
        x = jax.random.normal(key, (B, S, H)).astype(jnp.bfloat16)
        dy = jax.random.normal(dkey, (B, S, H)).astype(jnp.bfloat16)
        if args.layer == "flax":
            layer = peers["FlaxTransformerLayer"](H, F, NH)
            variables = layer.init(key, x, attention_mask=None, deterministic=False)
            kwargs = {"attention_mask": None, "deterministic": False}
        else:
            peers["IMPL"] = args.layer  # CudnnLayer reads the module-level IMPL
            layer = peers["CudnnLayer"](H, F, NH)
            variables = layer.init(key, x)
            kwargs = {}

        def loss(v, inp, g, k):
            return jnp.vdot(layer.apply(v, inp, rngs={"dropout": k}, **kwargs), g)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        for _ in range(3):
            jax.block_until_ready(step(variables, x, dy, dkey))
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        if peak is None:
            print(f"PEERMEM {name} FAILED the device reports no peak_bytes_in_use", flush=True)
            return 1
        print(f"PEERMEM {name} {peak / 2**20:.0f}", flush=True)
        return 0
    except Exception as e:  # report and let the harness go on
        print(f"PEERMEM {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
