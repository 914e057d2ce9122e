"""te_client.flax's module defaults are TE's: every field default against tests/data/te_module_defaults.json.

The table was read in TE's current transformer_engine/jax/flax/module.py and
transformer.py; a default changed on either side fails here. Needs no server.
"""
import dataclasses
import json
import os

import numpy as np
import pytest

import te_client.flax as te_flax

_TABLE_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "data", "te_module_defaults.json")
with open(_TABLE_PATH) as f:
    TABLE = json.load(f)
MODULES = [name for name in TABLE if not name.startswith("_") and name != "deviations"]


def _client_default(cls, field):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert field in fields, "%s has no field %s (TE's module has it)" % (cls.__name__, field)
    f = fields[field]
    assert f.default is not dataclasses.MISSING, "%s.%s has no default" % (cls.__name__, field)
    value = f.default
    if field == "dtype":
        return np.dtype(value).name
    if isinstance(value, tuple):
        return list(value)
    return value


def test_the_table_covers_every_te_module_te_client_has():
    assert set(MODULES) == {"LayerNorm", "DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP",
                            "DotProductAttention", "MultiHeadAttention", "TransformerLayer"}


@pytest.mark.parametrize("module", MODULES)
def test_every_field_default_is_te_s(module):
    cls = getattr(te_flax, module)
    for field, want in TABLE[module].items():
        deviation = TABLE["deviations"].get("%s.%s" % (module, field))
        if deviation is not None:
            want = deviation["clients"]
        got = _client_default(cls, field)
        assert got == want, "%s.%s: te_client %r, TE %r" % (module, field, got, want)


def test_transformer_layer_keeps_te_s_dropout_and_activation():
    # The two defaults most often remembered wrong: since TE 2.10 TransformerLayer has
    # intermediate_dropout=0.0 and mlp_activations=('gelu',) (transformer.py:2060, 2065 at
    # d0067d0); older copies of TE's source show 0.1 and ('relu',).
    layer = te_flax.TransformerLayer()
    assert layer.intermediate_dropout == 0.0 and tuple(layer.mlp_activations) == ("gelu",)
    assert te_flax.LayerNormMLP().intermediate_dropout_rate == 0.0
