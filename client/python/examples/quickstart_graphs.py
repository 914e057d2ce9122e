"""The GraphSpec of each composite section of the quickstart, as the Python tracer builds it.

tests/data/quickstart_graphs/<section>.textproto holds them at the notebook's
sizes (--config=quickstart; bf16 x, traced with deterministic=False as the
speedometer runs them). Both clients are tested against these files
(client/python/tests/test_quickstart_graphs.py and //client:quickstart_graphs_test),
so the two build the same graph, node for node, and so the same variables and
numbers. Regenerate after a deliberate change to the tracer or the notebook:

    python3 client/python/examples/quickstart_graphs.py --write tests/data/quickstart_graphs
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import quickstart                       # noqa: E402  (the notebook's classes)
import te_client as te                  # noqa: E402
from google.protobuf import text_format  # noqa: E402

# The sections whose layer is a composite (one traced graph each); "fp8" runs
# te_attention's graph under autocast, "transformer_layer" is one TE module.
COMPOSITES = ("flax", "te_flax_attention", "te_attention", "fused")


def module_for(section, config):
    h, f, n = config["hidden_size"], config["ffn_hidden_size"], config["num_attention_heads"]
    if section == "flax":
        return quickstart.FlaxTransformerLayer(hidden_size=h, ffn_hidden_size=f, num_attention_heads=n)
    if section == "te_flax_attention":
        return quickstart.TEUnfusedTransformerLayer(h, f, n, use_te_attention=False)
    if section == "te_attention":
        return quickstart.TEUnfusedTransformerLayer(h, f, n)
    if section == "fused":
        return quickstart.TEFusedTransformerLayer(h, f, n)
    raise ValueError("section %r is not one of %s" % (section, ", ".join(COMPOSITES)))


def traced(section, config_name="quickstart"):
    """The graph.Traced of `section` at `config_name`'s sizes."""
    c = quickstart.CONFIGS[config_name]
    x = te.asarray(np.zeros((c["batch_size"], c["sequence_length"], c["hidden_size"]), np.float32), te.bfloat16)
    return module_for(section, c).trace(x, attention_mask=None, deterministic=False)


def golden_path(directory, section):
    return os.path.join(directory, section + ".textproto")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="DIR", required=True, help="where the .textproto files go")
    args = parser.parse_args()
    os.makedirs(args.write, exist_ok=True)
    for section in COMPOSITES:
        path = golden_path(args.write, section)
        with open(path, "w") as f:
            f.write("# te.v1.GraphSpec of the quickstart's %r section at --config=quickstart, as the Python\n"
                    "# tracer builds it (client/python/examples/quickstart_graphs.py).\n" % section)
            f.write(text_format.MessageToString(traced(section).spec))
        print("wrote", path)


if __name__ == "__main__":
    main()
