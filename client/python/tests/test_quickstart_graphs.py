"""The quickstart's composite sections traced exactly as tests/data/quickstart_graphs records them.

The C++ client's //client:quickstart_graphs_test compares its graphs with the same files, so a passing
pair means both clients send the server the same GraphSpec, node for node: the same variables, seeds
and numbers. No server is needed.
"""
import os
import sys

import pytest
from google.protobuf import text_format

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(EXAMPLES)))
GOLDEN_DIR = os.path.join(REPO_ROOT, "tests", "data", "quickstart_graphs")
sys.path.insert(0, EXAMPLES)

import quickstart_graphs  # noqa: E402
from te_client import client as client_lib  # noqa: E402


def _golden(section):
    with open(quickstart_graphs.golden_path(GOLDEN_DIR, section)) as f:
        return text_format.Parse(f.read(), client_lib.layers_pb2.GraphSpec())


@pytest.mark.parametrize("section", quickstart_graphs.COMPOSITES)
def test_traced_graph_is_the_recorded_one(section):
    traced = quickstart_graphs.traced(section).spec
    want = _golden(section)
    assert [n.name for n in traced.nodes] == [n.name for n in want.nodes]
    assert traced == want, text_format.MessageToString(traced)


def test_plain_flax_graph_is_flaxs_modules_with_flaxs_output_dtype():
    traced = quickstart_graphs.traced("flax")
    modules = {n.name: n.module.WhichOneof("module") for n in traced.spec.nodes if n.WhichOneof("op") == "module"}
    assert modules == {"LayerNorm_0": "flax_layer_norm", "Dense_0": "flax_dense",
                       "MultiHeadDotProductAttention_0": "flax_multi_head_dot_product_attention",
                       "LayerNorm_1": "flax_layer_norm", "FlaxMLP_0/Dense_0": "flax_dense",
                       "FlaxMLP_0/gelu_0": "activation", "FlaxMLP_0/Dense_1": "flax_dense"}
    # bf16 x with float32 parameters: Flax computes and returns float32 (the residual x is cast).
    assert traced.dtypes["x"] == "bfloat16" and traced.dtypes[traced.spec.outputs[0]] == "float32"
    assert traced.node("MultiHeadDotProductAttention_0").mask == "causal_mask_0"


def test_section_two_runs_flaxs_attention():
    nodes = {n.name for n in quickstart_graphs.traced("te_flax_attention").spec.nodes}
    assert "MultiHeadDotProductAttention_0" in nodes and "DotProductAttention_0" not in nodes
    assert "DotProductAttention_0" in {n.name for n in quickstart_graphs.traced("te_attention").spec.nodes}
