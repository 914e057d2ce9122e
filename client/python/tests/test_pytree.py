"""Variables as a pytree: tree_map over several trees, VariableRef under numpy and arithmetic, an SGD step
as JAX writes it, and registration with JAX's pytree registry."""
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import variables as variables_lib
from conftest import PYTHON_ROOT


def test_tree_map_over_several_trees_follows_jax():
    got = te.tree_map(lambda a, b, c: a + 10 * b + 100 * c, {"z": [1, (2,)], "a": 3, "n": None},
                      {"a": 4, "z": [5, (6,)], "n": None}, {"z": [7, (8,)], "a": 9, "n": None})
    assert got == {"a": 943, "n": None, "z": [751, (862,)]}
    assert list(got) == ["a", "n", "z"]     # keys sorted, as jax.tree_util rebuilds dicts
    calls = []
    te.tree_map(lambda v: calls.append(v), {"a": None, "b": [None, 1]})
    assert calls == [1]                       # None is an empty subtree: fn never sees it


@pytest.mark.parametrize("other,where", [({"a": {"k": 1, "j": 1}, "b": [1]}, "b"),
                                         ({"a": {"k": 1, "x": 2}, "b": [1, 2]}, "a"),
                                         ({"a": {"k": 1, "j": 1}, "b": (1, 2)}, "b"),
                                         ({"a": {"k": 1, "j": [1]}, "b": [1, 2]}, "a/j")])
def test_tree_map_names_where_the_trees_differ(other, where):
    tree = {"a": {"k": 1, "j": 1}, "b": [1, 2]}
    with pytest.raises(te.InvalidArgumentError, match="differ at %s:" % where):
        te.tree_map(lambda *leaves: leaves, tree, other)


def _counting(session, monkeypatch):
    calls = []
    real = session.call

    def call(method, request, timeout=None):
        calls.append(method)
        return real(method, request, timeout)
    monkeypatch.setattr(session, "call", call)
    return calls


def test_sgd_step_as_jax_writes_it(session, rng, monkeypatch):
    layer = te_flax.DenseGeneral(features=6)
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 6)).astype(np.float32)
    params = layer.init(1, x)
    before = session.get_variables(params)["params"]
    _, (grads, _) = te.value_and_grad(layer.apply)(params, x, dy)
    lr = 0.125
    calls = _counting(session, monkeypatch)
    new = te.tree_map(lambda p, g: p - lr * g, params["params"], grads["params"])
    assert calls == ["GetVariables"]          # one download of the collection for both leaves
    for name in ("kernel", "bias"):
        assert type(new[name]) is np.ndarray
        np.testing.assert_array_equal(new[name], before[name] - lr * grads["params"][name])
    # Pure: the server's values are untouched until written back.
    np.testing.assert_array_equal(np.asarray(params["params"]["kernel"]), before["kernel"])
    written = session.set_variables(params, {"params": new})     # a new version; params stay as they were
    np.testing.assert_array_equal(np.asarray(written["params"]["kernel"]), new["kernel"])
    np.testing.assert_array_equal(np.asarray(params["params"]["kernel"]), before["kernel"])
    np.testing.assert_array_equal(layer.apply(written, x), np.einsum("bsi,io->bso", x, new["kernel"]) + new["bias"])


def test_variable_ref_under_numpy_and_arithmetic(session, rng, monkeypatch):
    params = te_flax.DenseGeneral(features=4).init(2, rng.standard_normal((2, 3)).astype(np.float32))
    kernel = params["params"]["kernel"]
    value = np.asarray(kernel)
    assert value.shape == (3, 4) and value.dtype == np.float32
    calls = _counting(session, monkeypatch)
    assert te.tree_map(lambda v: v.shape, params) == {"params": {"bias": (4,), "kernel": (3, 4)}}
    assert calls == []                        # shapes come from init's answer
    np.testing.assert_array_equal(kernel * 2, value * 2)
    np.testing.assert_array_equal(2 * kernel, value * 2)
    np.testing.assert_array_equal(kernel - value, np.zeros((3, 4), np.float32))
    np.testing.assert_array_equal(-kernel, -value)
    np.testing.assert_array_equal(kernel @ np.ones(4, np.float32), value @ np.ones(4, np.float32))
    assert np.sum(kernel) == pytest.approx(float(value.sum()))
    np.testing.assert_array_equal(kernel[1], value[1])
    assert type(kernel * 2) is np.ndarray and len(kernel) == 3
    assert kernel == kernel and kernel != params["params"]["bias"] and len({kernel, kernel}) == 1
    with pytest.raises(TypeError, match="read-only"):
        kernel += 1                             # would change a fetched copy, not the server's value


class _FakeTreeUtil:
    """What te_client needs of jax.tree_util: register_pytree_node, recorded."""

    def __init__(self):
        self.registered = {}

    def register_pytree_node(self, cls, flatten, unflatten):
        self.registered[cls] = (flatten, unflatten)


def test_variables_register_with_jax_pytrees(session, rng, monkeypatch):
    fake = _FakeTreeUtil()
    jax = types.ModuleType("jax")
    jax.tree_util = fake
    monkeypatch.setitem(sys.modules, "jax", jax)
    monkeypatch.setitem(sys.modules, "jax.tree_util", fake)
    monkeypatch.setattr(variables_lib, "_jax_registered", False)
    assert variables_lib.register_with_jax() and variables_lib.register_with_jax()
    assert list(fake.registered) == [te.Variables]        # once
    flatten, unflatten = fake.registered[te.Variables]
    params = te_flax.DenseGeneral(features=4).init(3, rng.standard_normal((2, 3)).astype(np.float32))
    children, aux = flatten(params)
    assert children == [params["params"]] and hash(aux) == hash(flatten(params)[1]) and aux == flatten(params)[1]
    assert unflatten(aux, children) is params             # the same VariableRefs: still the layer's variables
    shapes = unflatten(aux, [{"bias": (4,), "kernel": (3, 4)}])
    assert type(shapes) is dict and shapes == {"params": {"bias": (4,), "kernel": (3, 4)}}


def test_import_registers_with_jax_where_it_is_importable(tmp_path):
    # A stand-in jax package on the path: importing te_client must register Variables with it.
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("from jax import tree_util\n")
    (tmp_path / "jax" / "tree_util.py").write_text("registered = []\n"
                                                   "def register_pytree_node(cls, flatten, unflatten):\n"
                                                   "    registered.append(cls.__module__ + '.' + cls.__name__)\n")
    code = textwrap.dedent("""
        import te_client, jax.tree_util
        print(jax.tree_util.registered)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), PYTHON_ROOT]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['te_client.variables.Variables']"


def test_with_real_jax(session, rng):
    jax = pytest.importorskip("jax")
    params = te_flax.DenseGeneral(features=4).init(4, rng.standard_normal((2, 3)).astype(np.float32))
    assert jax.tree_util.tree_map(lambda v: v.shape, params) == {"params": {"bias": (4,), "kernel": (3, 4)}}
    assert jax.tree_util.tree_map(lambda v: v, params) is params
    assert len(jax.tree_util.tree_leaves(params)) == 2
