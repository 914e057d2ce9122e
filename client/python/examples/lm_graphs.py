"""The GraphSpec of the byte-level decoder LM of train_lm.py, as the Python tracer builds it.

tests/data/lm_graphs/<name>.textproto holds it at two sizes: "tiny" (2 layers, hidden 32, 4 heads,
batch 4 x 16 tokens: the size tests/integration:lm_test trains) and "train_lm" (train_lm.py's
defaults: 4 layers, hidden 256, 8 heads, batch 16 x 128). //client:lm_graphs_test checks that the
C++ client's Graph (Embed, Attend, SoftmaxCrossEntropyWithIntegerLabels) builds the same graphs,
node for node, so both clients send the server the same LM. Regenerate after a deliberate change to
the tracer or to train_lm.DecoderLM:

    python3 client/python/examples/lm_graphs.py --write tests/data/lm_graphs
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import train_lm                         # noqa: E402  (the LM's class)
from google.protobuf import text_format  # noqa: E402

# name -> (num_layers, hidden, heads, batch, seq)
SIZES = {"tiny": (2, 32, 4, 4, 16), "train_lm": (4, 256, 8, 16, 128)}


def traced(name):
    layers, hidden, heads, batch, seq = SIZES[name]
    ids = np.zeros((batch, seq), np.int32)
    return train_lm.DecoderLM(layers, hidden, heads).trace(ids, ids, deterministic=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", required=True, help="where the .textproto files go")
    args = parser.parse_args()
    os.makedirs(args.write, exist_ok=True)
    for name in SIZES:
        path = os.path.join(args.write, name + ".textproto")
        with open(path, "w") as f:
            f.write("# te.v1.GraphSpec of train_lm.DecoderLM%s (layers, hidden, heads, batch, seq), as the\n"
                    "# Python tracer builds it (client/python/examples/lm_graphs.py).\n" % (SIZES[name],))
            f.write(text_format.MessageToString(traced(name).spec))
        print("wrote", path)


if __name__ == "__main__":
    main()
