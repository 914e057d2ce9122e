"""Samples text from the byte-level LM that train_lm.py trained, generated on te_server.

train_lm.py --save writes the trained variables (te.save_checkpoint's .npz)
and the model's sizes (.json beside it). This rebuilds the same DecoderLM,
inits it in a new session under the recipe it was trained with (traced as in
training, so the server graph is the same), writes the saved params and
fp8_metas over it (one SetVariables), and generates: one Generate call per
batch of samples, the prompt's bytes in, new bytes streamed back as the
server makes them (the first sample is printed as it comes).

    bazel build //server:te_server
    python3 client/python/examples/train_lm.py --spawn --steps=300 --layers=2 --hidden=64 --seq=64 --save=/tmp/lm.npz
    python3 client/python/examples/generate.py --spawn --load=/tmp/lm.npz --prompt="def " --max_new_tokens=200
    python3 client/python/examples/generate.py --address=gpu-host:50051 --load=lm.npz --temperature=0.8 --top_k=40

Greedy unless --temperature, --top_k or --top_p is given; --seed makes a
sampled run repeatable. Generation stops at --max_new_tokens, or for each
sample at its first --stop byte sequence's last byte (default: none).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import te_client as te  # noqa: E402
from train_lm import DecoderLM, recipe_scope, server  # noqa: E402


def load_model(session, path):
    """The trained LM in `session`: (model, variables, its sizes)."""
    with open(path + ".json") as f:
        sizes = json.load(f)
    model = DecoderLM(sizes["layers"], sizes["hidden"], sizes["heads"], rotary=sizes["rotary"],
                      relative_bias=sizes.get("relative_bias", True))
    traced = np.zeros((sizes["batch"], sizes["seq"]), np.int32)
    variables = model.init(0, traced, traced, session=session)
    with np.load(path) as data:
        saved = {name[2:]: data[name] for name in data.files
                 if name.startswith(("v:params/", "v:fp8_metas/"))}
    return model, session.set_variables(variables, saved), sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="localhost:50051")
    parser.add_argument("--spawn", action="store_true", help="start bazel-bin/server/te_server here")
    parser.add_argument("--device", default="cpu", help="with --spawn: te_server's --device")
    parser.add_argument("--load", required=True, help="train_lm.py --save's file (.npz, with its .json)")
    parser.add_argument("--prompt", default="def ", help="the text each sample starts from")
    parser.add_argument("--samples", type=int, default=1, help="sequences generated together (the batch)")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[],
                        help="a byte that ends a sample (repeatable; \\n escapes allowed)")
    args = parser.parse_args()

    stops = [ord(s.encode().decode("unicode_escape")) for s in args.stop]
    prompt_bytes = np.frombuffer(args.prompt.encode(), np.uint8)
    if not prompt_bytes.size:
        sys.exit("--prompt is empty: generation starts from at least one byte")
    prompt = np.tile(prompt_bytes.astype(np.int32), (args.samples, 1))
    with server(args) as address, te.connect(address).session() as session:
        with open(args.load + ".json") as f:
            recipe = json.load(f)["recipe"]
        with recipe_scope(recipe):
            _, variables, sizes = load_model(session, args.load)
            print("model: %d TE TransformerLayers, hidden %d, %d heads, recipe %s, device %s" % (
                sizes["layers"], sizes["hidden"], sizes["heads"], recipe, session.device))
            sys.stdout.write(args.prompt)
            sys.stdout.flush()
            first_stopped = [False]

            def show(step):
                # The first sample's bytes as they come, its stop byte included.
                if not first_stopped[0]:
                    sys.stdout.buffer.write(bytes([int(step.tokens[0]) & 0xFF]))
                    sys.stdout.buffer.flush()
                first_stopped[0] = bool(step.stopped[0])

            out = te.generate(variables, prompt, args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=stops, on_step=show)
    print()
    for i, row in enumerate(out[1:], start=1):
        print("--- sample %d ---\n%s" % (i, bytes(int(t) & 0xFF for t in row).decode("utf-8", "replace")))
    print("generated %d tokens per sample" % (out.shape[1] - prompt.shape[1]))


if __name__ == "__main__":
    main()
