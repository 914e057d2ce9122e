"""Trains a byte-level decoder LM on te_server: one RPC per step, only int32 ids on the wire.

Steps are dispatched as JAX dispatches a jitted step: train_step returns once
the step is sent, the next one is queued on the server behind it, and the
losses (lazy scalars) are read only at evaluation, so the device never waits
for the client (--pipeline_depth=1 sends each step after the one before has
answered).

The model is Flax code traced into one server graph (DESIGN.md sections 11, 12):
nn.Embed -> N TE TransformerLayers (causal self-attention with rotary
positions) -> nn.LayerNorm -> the tied
projection Embed.attend -> optax's softmax cross entropy with integer labels
(te_client.losses), trained with optax's adamw + warmup-cosine + clipping held
in the session. Each step is one ForwardBackward with apply_update carrying
the token ids and the labels (int32 [batch, seq] each), nothing else.

Corpus: the Python standard library's top-level modules, /usr/lib/python3.X/*.py
(Debian / Ubuntu package libpython3.X-stdlib, installed wherever python3 is;
about 4.7 MB for 3.11), files in name order; the last 10% of the files are the
held-out split.

    bazel build //server:te_server
    python3 client/python/examples/train_lm.py --spawn --steps=300 --layers=2 --hidden=64 --seq=64
    python3 client/python/examples/train_lm.py --address=gpu-host:50051 --recipe=delayed --csv=loss.csv
    python3 client/python/examples/train_lm.py --spawn --steps=300 --save=/tmp/lm.npz   # then examples/generate.py

--recipe: bf16 (bfloat16 activations, no FP8), delayed (FP8 DelayedScaling,
Format.HYBRID: E4M3 forward, E5M2 gradients, amax history 1024), current
(Float8CurrentScaling, HYBRID). The CSV has step, train_loss, heldout_loss,
tokens_per_s, elapsed_s per evaluation.
"""
import argparse
import contextlib
import csv
import glob
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import te_client as te  # noqa: E402
import te_client.flax as te_flax  # noqa: E402
import te_client.optim as optim  # noqa: E402
from te_client import linen as nn, losses  # noqa: E402
from te_client.recipe import DelayedScaling, Float8CurrentScaling, Format  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class DecoderLM(nn.Module):
    num_layers: int
    hidden: int
    heads: int
    compute_dtype: object = te.bfloat16
    vocab: int = 256
    rotary: bool = True
    relative_bias: bool = True   # TE's default enable_relative_embedding

    @nn.compact
    def __call__(self, tokens, labels, deterministic=True):
        embed = nn.Embed(self.vocab, self.hidden)
        x = embed(tokens).astype(self.compute_dtype)
        for _ in range(self.num_layers):
            x = te_flax.TransformerLayer(hidden_size=self.hidden, mlp_hidden_size=4 * self.hidden,
                                         num_attention_heads=self.heads, mlp_activations=("gelu",),
                                         hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                                         enable_rotary_pos_emb=self.rotary,
                                         enable_relative_embedding=self.relative_bias)(
                                             x, deterministic=deterministic)
        x = nn.LayerNorm()(x)   # float32 params: promotes to float32
        return losses.softmax_cross_entropy_with_integer_labels(embed.attend(x), labels).mean()


def corpus():
    folder = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(folder, "*.py")))
    if not files:
        sys.exit("no corpus: %s/*.py is empty (install libpython3-stdlib)" % folder)
    cut = int(len(files) * 0.9)
    read = lambda names: np.frombuffer(b"".join(open(f, "rb").read() for f in names), np.uint8)
    return folder, read(files[:cut]), read(files[cut:])


def batch(rng, data, size, seq):
    starts = rng.integers(0, len(data) - seq - 1, size=size)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    return window[:, :-1], window[:, 1:]


def recipe_scope(name):
    if name == "bf16":
        return contextlib.nullcontext()
    recipe = (DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
              if name == "delayed" else Float8CurrentScaling(fp8_format=Format.HYBRID))
    return te.autocast(enabled=True, recipe=recipe)


@contextlib.contextmanager
def server(args):
    if not args.spawn:
        yield args.address
        return
    folder = tempfile.mkdtemp(prefix="train_lm_")
    port_file = os.path.join(folder, "port")
    log = open(os.path.join(folder, "server.log"), "w")
    process = subprocess.Popen([os.path.join(REPO, "bazel-bin", "server", "te_server"), "--device=" + args.device,
                                "--host=127.0.0.1", "--port=0", "--port_file=" + port_file],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if process.poll() is not None:
                sys.exit("te_server exited; see %s" % log.name)
            time.sleep(0.1)
        yield "127.0.0.1:%s" % open(port_file).read().strip()
    finally:
        process.terminate()
        process.wait()


def save(args, state):
    """The trained variables (params and fp8_metas: te.save_checkpoint's
    file) and what rebuilds the model (its sizes, recipe and traced shape)."""
    te.save_checkpoint(args.save, state)
    with open(args.save + ".json", "w") as f:
        json.dump({"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "rotary": args.rotary,
                   "relative_bias": args.relative_bias,
                   "batch": args.batch, "seq": args.seq, "recipe": args.recipe}, f)
    print("variables: %s (model: %s.json)" % (args.save, args.save))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--spawn", action="store_true", help="start bazel-bin/server/te_server here")
    parser.add_argument("--device", default="cpu", help="with --spawn: te_server's --device")
    parser.add_argument("--recipe", choices=["bf16", "delayed", "current"], default="bf16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval_every", type=int, default=100)
    parser.add_argument("--eval_batches", type=int, default=4)
    parser.add_argument("--final_eval_batches", type=int, default=64,
                        help="held-out batches of the last evaluation (the number compared across recipes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rotary", action=argparse.BooleanOptionalAction, default=True,
                        help="rotary position embedding in every layer (without it a causal LM has no "
                             "position signal and stalls near a bigram model's loss)")
    parser.add_argument("--relative_bias", action=argparse.BooleanOptionalAction, default=False,
                        help="TE's relative position bias in every layer (TransformerLayer's default "
                             "enable_relative_embedding=True). Off here: rotary already gives every layer "
                             "the positions, and a second position signal costs attention time (the bias "
                             "and its gradient over every query-key pair)")
    parser.add_argument("--pipeline_depth", type=int, default=2,
                        help="training steps in flight (te.connect's pipeline_depth; 1: each waits for the one "
                             "before)")
    parser.add_argument("--csv", help="write the loss curve here")
    parser.add_argument("--save", help="write the trained variables here (.npz, te.save_checkpoint) and the "
                                       "model's sizes beside it (.json), for examples/generate.py")
    args = parser.parse_args()

    folder, train, heldout = corpus()
    print("corpus: %s/*.py: %d train bytes, %d held-out bytes (last 10%% of the files)" % (
        folder, len(train), len(heldout)))
    rng = np.random.default_rng(args.seed)
    eval_rng = np.random.default_rng(args.seed + 1)
    # The same held-out windows for every recipe; the last evaluation reads
    # more of them, so its loss is the one to compare runs by.
    held = [batch(eval_rng, heldout, args.batch, args.seq)
            for _ in range(max(args.eval_batches, args.final_eval_batches))]
    model = DecoderLM(args.layers, args.hidden, args.heads, rotary=args.rotary, relative_bias=args.relative_bias)
    rows = []
    with server(args) as address, te.connect(address, pipeline_depth=args.pipeline_depth).session() as session, \
            recipe_scope(args.recipe):
        tokens, labels = batch(rng, train, args.batch, args.seq)
        params = model.init(args.seed, tokens, labels)
        tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(
            optim.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps,
                                               args.lr * 0.1), weight_decay=0.01))
        state = optim.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        print("model: %d TE TransformerLayers, hidden %d, %d heads, seq %d, batch %d, recipe %s, rotary %s, "
              "relative bias %s, device %s" % (args.layers, args.hidden, args.heads, args.seq, args.batch,
                                               args.recipe, args.rotary, args.relative_bias, session.device))
        start = last = time.perf_counter()
        tokens_since, train_losses = 0, []
        for step in range(1, args.steps + 1):
            tokens, labels = batch(rng, train, args.batch, args.seq)
            # Returns once sent. donate: `state` is not read again, so the server updates it in
            # place instead of first copying every param and moment for it (jax.jit's donate_argnums).
            state, metrics = optim.train_step(state, tokens, labels, donate=True)
            train_losses.append(metrics["loss"])                        # lazy: read at evaluation
            tokens_since += tokens.size
            if step % args.eval_every == 0 or step == args.steps:
                metrics["loss"].block_until_ready()   # the steps timed have run, not only been sent
                now = time.perf_counter()
                rate = tokens_since / (now - last)
                windows = held if step == args.steps else held[:args.eval_batches]
                held_loss = float(np.mean([float(model.apply(state.params, t, l)) for t, l in windows]))
                train_loss = float(np.mean(train_losses))
                print("step %5d  train %.4f  held-out %.4f  %8.0f tokens/s  (%d request bytes/step)" % (
                    step, train_loss, held_loss, rate, metrics["request_bytes"]), flush=True)
                rows.append((step, train_loss, held_loss, rate, now - start))
                train_losses, tokens_since, last = [], 0, time.perf_counter()
        if args.save:
            save(args, state)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "train_loss", "heldout_loss", "tokens_per_s", "elapsed_s"])
            writer.writerows(rows)
        print("loss curve: %s" % args.csv)


if __name__ == "__main__":
    main()
