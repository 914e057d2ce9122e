"""Decode benchmark: the LM of client/python/examples/train_lm.py generating on te_server (one
Generate call per generation) against the same model's jit'd decode loop in JAX
(bench/jax_decode_peer.py), in one run, with the floor of a decode step.

For each batch size: a random prompt of --prompt bytes, --new greedy tokens (no stop token, so
every generation makes all of them). Timed from the client: the first token's arrival (the prompt's
step: "first ms"), then the other new - 1 tokens ("decode tokens/s" = batch * (new - 1) over
their time), and end to end ("tokens/s" = batch * new over the whole call); medians of --iters runs
after one warm-up. Next to each, one forward of the same LM over the prompt from the client
(model.apply, its loss back): the time the prompt's step would take at full-forward speed. The JAX peer reports the same three figures (its prefill and first token, then
its decode loop). The floor is the decode step's bytes over --bandwidth_tbs: every weight read
once in bf16 (2 bytes a parameter) plus the keys and values the step attends over (bf16, the
context's mean over the steps), per step of `batch` tokens.

    # on the GPU machine: the server bundle (deploy/bundle.sh), the repo's client/python with its
    # generated stubs (client/python/build/proto, made by client/python/run_tests.sh), jax there
    TE_CLIENT_STUBS_DIR=client/python/build/proto python3 bench/decode_bench.py \\
        --server="bundle/run.sh te_server" --device=cuda:0
    # here, on the CPU, a tiny size (the peer runs where jax is importable)
    python3 bench/decode_bench.py --tiny --server=bazel-bin/server/te_server

--recipes adds rows for te_server under FP8 (delayed: DelayedScaling HYBRID, history 1024, as
train_lm.py --recipe=delayed; the layer initialised under it). --peer_param_dtypes: the peer's
weights in bf16 (cast once: inference as one would write it) and/or float32 (train_lm's params,
cast in every step as a Flax module with dtype=bfloat16 does).

The per-token apply path from a client ("client apply(decode=True)" rows, --client_rows): TE's
own decode, as a Flax user writes it, one Forward call per token:

    variables = model.init(0, ids_full, decode=True)
    y, variables = model.apply(variables, ids[:, t:t + 1], decode=True, mutable=["cache"])

with the next token the argmax of y on the client. TE decodes MultiHeadAttention (separate q, k,
v: rotary) and DECODER TransformerLayers, and refuses the LM's ENCODER TransformerLayers, so this
row's model is the LM's shape built from what TE decodes: per layer TE's MultiHeadAttention
(rotary, causal) and LayerNormMLP (4x, gelu) with residuals, no relative bias (TE's
MultiHeadAttention has none), the same embedding, final LayerNorm and tied projection. The
prompt goes in one token per call too (TE's decode takes one), so "first ms" is prompt + 1 calls;
each run starts from the init's variables (its first step branches the cache: one copy).
"""
import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "client", "python", "examples"))

import te_client as te  # noqa: E402
import te_client.flax as te_flax  # noqa: E402
from te_client import linen as nn  # noqa: E402
from te_client.generate import generate_stream  # noqa: E402
from te_client.recipe import DelayedScaling, Format  # noqa: E402
from local_server import te_server  # noqa: E402
from train_lm import DecoderLM  # noqa: E402


def recipe_scope(name):
    if name == "bf16":
        return te.autocast(enabled=False)
    return te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024,
                                                           amax_compute_algo="max"))


def time_forward(model, variables, prompt, iters):
    """Median seconds of one forward of the LM over the prompt (model.apply, the loss back on the client):
    what the prompt's step of a generation computes, and so the time its first token should take."""
    def once():
        start = time.perf_counter()
        float(model.apply(variables, prompt, prompt))
        return time.perf_counter() - start
    once()   # warm-up
    return statistics.median(once() for _ in range(iters))


def time_generation(variables, prompt, new_tokens):
    """(first token's seconds, the other tokens' seconds) of one Generate, seen from the client."""
    start = time.perf_counter()
    first, steps = None, 0
    for _ in generate_stream(variables, prompt, new_tokens):
        steps += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    if steps != new_tokens:
        raise RuntimeError("Generate made %d steps of %d" % (steps, new_tokens))
    return first - start, end - first


class ClientDecodeLM(nn.Module):
    """The LM's sizes from modules TE decodes (the module comment): ids -> logits [B, S, 256]."""
    num_layers: int
    hidden: int
    heads: int
    compute_dtype: object = te.bfloat16
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens, decode=False):
        embed = nn.Embed(self.vocab, self.hidden)
        x = embed(tokens).astype(self.compute_dtype)
        for _ in range(self.num_layers):
            a = te_flax.MultiHeadAttention(head_dim=self.hidden // self.heads, num_attention_heads=self.heads,
                                           enable_rotary_pos_emb=True)(x, decode=decode, deterministic=True)
            x = x + (a[0] if isinstance(a, tuple) else a)
            z = te_flax.LayerNormMLP(intermediate_dim=4 * self.hidden, activations=("gelu",))(
                x, deterministic=True)
            x = x + (z[0] if isinstance(z, tuple) else z)
        return embed.attend(nn.LayerNorm()(x))


def _next_tokens(y):
    """Greedy: the argmax of the last position's logits, int32 [B, 1]."""
    logits = np.asarray(y).astype(np.float32)[:, -1]
    return np.argmax(logits, axis=-1).astype(np.int32)[:, None]


def time_client_decode(model, variables, prompt, new_tokens):
    """(prompt and first token's seconds, the other tokens' seconds) of decoding through one
    apply(decode=True, mutable=["cache"]) per token from the client."""
    start = time.perf_counter()
    for t in range(prompt.shape[1]):
        y, variables = model.apply(variables, prompt[:, t:t + 1], decode=True, mutable=["cache"])
    tokens = _next_tokens(y)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        y, variables = model.apply(variables, tokens, decode=True, mutable=["cache"])
        tokens = _next_tokens(y)
    end = time.perf_counter()
    return first - start, end - first


def client_rows(args, recipe, rng):
    """The per-token client path's rows under `recipe` (the session's current)."""
    rows = []
    model = ClientDecodeLM(args.layers, args.hidden, args.heads)
    for batch in args.batch_sizes:
        full = np.zeros((batch, args.prompt + args.new - 1), np.int32)
        variables = model.init(0, full, decode=True)
        prompt = rng.integers(0, 256, size=(batch, args.prompt)).astype(np.int32)
        time_client_decode(model, variables, prompt, args.new)   # warm-up
        runs = [time_client_decode(model, variables, prompt, args.new) for _ in range(args.iters)]
        first = statistics.median(r[0] for r in runs)
        rest = statistics.median(r[1] for r in runs)
        total = statistics.median(r[0] + r[1] for r in runs)
        rows.append(dict(what="client apply(decode=True) per token %s (MHA + MLP layers)" % recipe, batch=batch,
                         first_ms=first * 1e3, decode=batch * (args.new - 1) / rest, total=batch * args.new / total))
        print("  %s batch %d: first %.2f ms, decode %.1f tokens/s" % (
            rows[-1]["what"], batch, rows[-1]["first_ms"], rows[-1]["decode"]), flush=True)
        del variables
    return rows


def server_rows(address, args):
    rows = []
    rng = np.random.default_rng(0)
    client = te.connect(address, rpc_timeout=3600.0)
    with client.session() as session:
        print("te_server at %s: session on %s" % (address, session.device), flush=True)
        for recipe in args.recipes.split(","):
            with recipe_scope(recipe):
                model = DecoderLM(args.layers, args.hidden, args.heads)
                traced = np.zeros((1, args.prompt), np.int32)
                variables = model.init(0, traced, traced)
                for batch in args.batch_sizes:
                    prompt = rng.integers(0, 256, size=(batch, args.prompt)).astype(np.int32)
                    # First, so that a trace's last spans are the generation's tokens
                    # (bench/tools/trace_decode.sh).
                    forward = time_forward(model, variables, prompt, args.iters)
                    time_generation(variables, prompt, args.new)   # warm-up
                    runs = [time_generation(variables, prompt, args.new) for _ in range(args.iters)]
                    first = statistics.median(r[0] for r in runs)
                    rest = statistics.median(r[1] for r in runs)
                    total = statistics.median(r[0] + r[1] for r in runs)
                    rows.append(dict(what="te_server Generate %s" % recipe, batch=batch, first_ms=first * 1e3,
                                     decode=batch * (args.new - 1) / rest, total=batch * args.new / total))
                    print("  %s batch %d: first %.2f ms, decode %.1f tokens/s" % (
                        rows[-1]["what"], batch, rows[-1]["first_ms"], rows[-1]["decode"]), flush=True)
                    rows.append(dict(what="te_server forward of the prompt (one apply) %s" % recipe, batch=batch,
                                     first_ms=forward * 1e3, decode=None, total=None))
                    print("  %s batch %d: %.2f ms" % (rows[-1]["what"], batch, rows[-1]["first_ms"]), flush=True)
                del variables
                if args.client_rows:
                    rows += client_rows(args, recipe, rng)
    return rows


def peer_rows(args):
    rows = []
    peer = os.path.join(HERE, "jax_decode_peer.py")
    for dtype in [d for d in args.peer_param_dtypes.split(",") if d]:
        command = shlex.split(args.peer_python) + [
            peer, "--layers=%d" % args.layers, "--hidden=%d" % args.hidden, "--heads=%d" % args.heads,
            "--prompt=%d" % args.prompt, "--new=%d" % args.new, "--batches=" + ",".join(map(str, args.batch_sizes)),
            "--rel_bias=1", "--param_dtype=" + dtype, "--iters=%d" % args.iters]
        print("peer: %s" % " ".join(command), flush=True)
        run = subprocess.run(command, capture_output=True, text=True)
        out = run.stdout + run.stderr
        found = re.findall(r"^DECODEPEER .*batch=(\d+) .*prefill_ms=([\d.]+) decode_ms=([\d.]+) "
                           r"tokens_per_s=([\d.]+) decode_tokens_per_s=([\d.]+)", out, re.M)
        if not found:
            print("peer (%s weights) gave no figures (exit %d):\n%s" % (dtype, run.returncode, out[-2000:]), flush=True)
        for line in re.findall(r"^DECODEPEER .*FAILED.*$", out, re.M):
            print(line, flush=True)
        for batch, prefill_ms, _, total, decode in found:
            rows.append(dict(what="JAX jit'd decode (%s weights)" % dtype, batch=int(batch),
                             first_ms=float(prefill_ms), decode=float(decode), total=float(total)))
    return rows


def floor_tokens_per_s(args, batch):
    """batch over a decode step's bytes / bandwidth (the module's comment)."""
    weights = args.layers * 12 * args.hidden ** 2 + 256 * args.hidden   # QKV, out, MLP; the tied projection
    context = args.prompt + (args.new - 1) / 2.0                            # mean rows attended over
    kv = 2 * args.layers * batch * context * args.hidden * 2
    return batch / ((2 * weights + kv) / (args.bandwidth_tbs * 1e12))


def print_table(args, rows):
    print()
    print("Decode: the %d x %d LM of train_lm.py (%d heads, rotary and relative bias), prompt %d, %d new tokens, "
          "greedy; floor at %.1f TB/s" % (args.layers, args.hidden, args.heads, args.prompt, args.new,
                                          args.bandwidth_tbs))
    print("| batch | what | first ms | decode tokens/s | tokens/s | decode vs best JAX | of floor |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for batch in args.batch_sizes:
        mine = [r for r in rows if r["batch"] == batch]
        jax_rows = [r for r in mine if r["what"].startswith("JAX")]
        best = max((r["decode"] for r in jax_rows), default=None)
        floor = floor_tokens_per_s(args, batch)
        for r in mine:
            if r["decode"] is None:   # a forward: its time alone
                print("| %d | %s | %.2f | | | | |" % (batch, r["what"], r["first_ms"]))
                continue
            ratio = "%.2fx" % (r["decode"] / best) if best else "n/a"
            print("| %d | %s | %.2f | %.1f | %.1f | %s | %.3g%% |" % (
                batch, r["what"], r["first_ms"], r["decode"], r["total"], ratio, 100 * r["decode"] / floor))
        print("| %d | floor (weights + KV read per step) | | %.1f | | | 100%% |" % (batch, floor))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051", help="a running te_server (without --server)")
    parser.add_argument("--server", help="the command that starts te_server (e.g. 'bundle/run.sh te_server')")
    parser.add_argument("--device", default="cuda:0", help="with --server: its --device")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--recipes", default="bf16,delayed", help="te_server rows: bf16 and/or delayed (FP8)")
    parser.add_argument("--peer_python", default=sys.executable, help="the Python that has jax")
    parser.add_argument("--peer_param_dtypes", default="bfloat16,float32", help="'' skips the JAX peer")
    parser.add_argument("--client_rows", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the per-token client path (apply(decode=True) per token)")
    parser.add_argument("--bandwidth_tbs", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU-sized run: 2 x 64, 4 heads, prompt 8, 8 new, batches 1,2, 2 iters, --device=cpu")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.heads, args.prompt, args.new = 2, 64, 4, 8, 8
        args.batches, args.iters, args.device = "1,2", 2, "cpu"
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    with te_server(args.address, args.server, args.device, prefix="decode_bench_") as address:
        rows = server_rows(address, args)
    rows += peer_rows(args)
    print_table(args, rows)


if __name__ == "__main__":
    main()
