"""Whole-model training benchmark: the byte-level LM of client/python/examples/train_lm.py trained
through te_server (one ForwardBackward with apply_update a step, steps pipelined and donating the
state they read as train_lm.py sends them) against the same LM trained locally in plain JAX/Flax/optax
(../shared/peers/jax_lm_peer.py: bf16 compute, float32 params, cuDNN attention, adamw), in one run,
with the floor of each size next to it.

Rows per size: ours in bf16 and under FP8 (DelayedScaling HYBRID, history 1024, as train_lm.py
--recipe=delayed), each with and without TE's relative position bias (TransformerLayer's default
enable_relative_embedding=True; rotary on in both), and the JAX peer with and without the same
bias. tokens/s = batch * seq * steps over the timed steps (after --warmup; at least --steps and
--min_seconds), the last loss read. The peer times its own 30 steps, reading each step's loss.

The floor: the step's FLOPs over the measured ceilings. GEMMs 6 * 12 * hidden^2 a token a layer
(qkv, out, the 4x MLP) plus the tied projection 6 * 256 * hidden a token; causal attention
6 * seq * hidden a token a layer (half of the S^2 scores, q.k and p.v, forward and 2x backward).
bf16 rows: everything over --bf16_tflops; FP8 rows: the layers' GEMMs over --fp8_tflops, the rest
over --bf16_tflops. The defaults are the H200's cuBLASLt ceilings measured by
../shared/peers/torch_peers.py (813 and 1492 TFLOP/s); pass this run's when they are measured.

    # on the GPU machine: the bundle (deploy/bundle.sh), the Python client's stubs
    TE_CLIENT_STUBS_DIR=.gpubundle/proto python3 bench/lm_bench.py \\
        --server="bundle/run.sh te_server" --peer=../shared/peers/jax_lm_peer.py
    # here, on the CPU: a tiny size, no peer
    python3 bench/lm_bench.py --server=bazel-bin/server/te_server --device=cpu --sizes=2x64x4x32x2 \\
        --steps=3 --warmup=1 --peer=
"""
import argparse
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))

import te_client as te  # noqa: E402
import te_client.optim as optim  # noqa: E402
from local_server import te_server  # noqa: E402
from train_lm import DecoderLM, recipe_scope  # noqa: E402


def parse_size(text):
    """LxHxAxSxB: layers, hidden, heads, seq, batch."""
    parts = [int(v) for v in text.split("x")]
    if len(parts) != 5 or min(parts) <= 0:
        raise argparse.ArgumentTypeError("a size is LAYERSxHIDDENxHEADSxSEQxBATCH, got %r" % text)
    return tuple(parts)


def floor_ms(size, fp8, args):
    layers, hidden, _, seq, batch = size
    tokens = batch * seq
    layer_gemm = 6.0 * 12 * hidden * hidden * tokens * layers
    other = 6.0 * 256 * hidden * tokens + 6.0 * seq * hidden * tokens * layers
    gemm_rate = (args.fp8_tflops if fp8 else args.bf16_tflops) * 1e12
    return 1e3 * (layer_gemm / gemm_rate + other / (args.bf16_tflops * 1e12))


def ours(session, size, recipe, relative_bias, args):
    layers, hidden, heads, seq, batch = size
    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 256, size=(batch, seq + 1), dtype=np.int32) for _ in range(4)]
    model = DecoderLM(layers, hidden, heads, rotary=True, relative_bias=relative_bias)
    with recipe_scope(recipe):
        params = model.init(0, windows[0][:, :-1], windows[0][:, 1:], session=session)
        tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(
            optim.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000, 1e-4), weight_decay=0.01))
        state = optim.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        metrics = None
        for step in range(args.warmup):
            state, metrics = optim.train_step(state, *split(windows[step % len(windows)]), donate=args.donate)
        if metrics is not None:
            metrics["loss"].block_until_ready()
        # At least --steps steps and --min_seconds: a small LM's step is a few ms, and a span of
        # 0.1 s ranks nothing. The client keeps two steps in flight, so its clock tracks the device's.
        start, timed = time.perf_counter(), 0
        while timed < args.steps or time.perf_counter() - start < args.min_seconds:
            state, metrics = optim.train_step(state, *split(windows[timed % len(windows)]), donate=args.donate)
            timed += 1
        loss = float(metrics["loss"])
        elapsed = time.perf_counter() - start
    return batch * seq * timed / elapsed, 1e3 * elapsed / timed, loss


def split(window):
    return window[:, :-1], window[:, 1:]


def peer(size, relative_bias, args):
    layers, hidden, heads, seq, batch = size
    spec = "%d,%d,%d,%d,%d,%d" % (layers, hidden, heads, seq, batch, int(relative_bias))
    try:
        done = subprocess.run([args.peer_python, args.peer, spec], capture_output=True, text=True,
                              timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        return None, "timed out after %d s" % args.peer_timeout
    match = re.search(r"LMPEER .*tokens_per_s=(\d+) ms_per_step=([\d.]+)", done.stdout)
    if not match:
        return None, (done.stdout + done.stderr)[-400:].replace("\n", " | ")
    return (float(match.group(1)), float(match.group(2))), ""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051", help="a running te_server (without --server)")
    parser.add_argument("--server", help="start this te_server command (e.g. 'bundle/run.sh te_server')")
    parser.add_argument("--device", default="cuda:0", help="with --server: its --device")
    parser.add_argument("--server_flags", default="--session_memory_bytes=%d" % (96 << 30),
                        help="more flags for --server (a 24-layer LM's step needs more than the default 8 GiB)")
    parser.add_argument("--sizes", type=lambda s: [parse_size(v) for v in s.split(",")],
                        default=[(4, 256, 8, 128, 16), (24, 1024, 16, 1024, 8), (24, 2048, 16, 1024, 8)])
    parser.add_argument("--recipes", default="bf16,delayed", help="ours: bf16 and/or delayed (FP8)")
    parser.add_argument("--bias", default="on,off", help="TE's relative position bias: on and/or off")
    parser.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                        help="ours: each step donates the state it reads, as train_lm.py's do (no copy of "
                             "the params and moments for it); --no-donate keeps it")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--min_seconds", type=float, default=3.0, help="ours: time at least this long")
    parser.add_argument("--peer", default=os.path.join(REPO, "..", "shared", "peers", "jax_lm_peer.py"),
                        help="jax_lm_peer.py ('' for none)")
    parser.add_argument("--peer_python", default=sys.executable)
    parser.add_argument("--peer_timeout", type=int, default=300)
    parser.add_argument("--bf16_tflops", type=float, default=813.0)
    parser.add_argument("--fp8_tflops", type=float, default=1492.0)
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    biases = [{"on": True, "off": False}[b] for b in args.bias.split(",") if b]

    rows = []
    with te_server(args.address, args.server, args.device, flags=args.server_flags, prefix="lm_bench_") as address:
        client = te.connect(address, pipeline_depth=2, rpc_timeout=3600.0)
        for size in args.sizes:
            for relative_bias in biases:
                for recipe in recipes:
                    with client.session() as session:
                        rate, ms, loss = ours(session, size, recipe, relative_bias, args)
                    rows.append((size, "te_server " + recipe, relative_bias, rate, ms, loss,
                                 floor_ms(size, recipe != "bf16", args)))
                    print("ours %s bias=%s %s: %.0f tokens/s, %.2f ms/step, loss %.3f" % (
                        "x".join(map(str, size)), relative_bias, recipe, rate, ms, loss), flush=True)
    if args.peer:
        for size in args.sizes:
            for relative_bias in biases:
                result, error = peer(size, relative_bias, args)
                if result is None:
                    print("peer %s bias=%s failed: %s" % ("x".join(map(str, size)), relative_bias, error))
                    continue
                rows.append((size, "JAX bf16 (local)", relative_bias, result[0], result[1], float("nan"),
                             floor_ms(size, False, args)))
                print("peer %s bias=%s: %.0f tokens/s, %.2f ms/step" % (
                    "x".join(map(str, size)), relative_bias, result[0], result[1]), flush=True)

    print("\n| LM (layers x hidden x heads, seq, batch) | relative bias | what | tokens/s | ms/step | "
          "vs JAX (same bias) | floor ms | of floor |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    jax = {(r[0], r[2]): r[3] for r in rows if r[1].startswith("JAX")}
    for size, what, relative_bias, rate, ms, _, floor in rows:
        layers, hidden, heads, seq, batch = size
        versus = jax.get((size, relative_bias))
        print("| %d x %d x %d, %d, %d | %s | %s | %.0f | %.2f | %s | %.3g | %.0f%% |" % (
            layers, hidden, heads, seq, batch, "on" if relative_bias else "off", what, rate, ms,
            "%.2fx" % (rate / versus) if versus else "-", floor, 100.0 * floor / ms))


if __name__ == "__main__":
    main()
