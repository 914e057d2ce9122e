"""te_client.numpy on traced tensors against the same code run eagerly on numpy (float64).

Each case is a function of arrays written with te_client.numpy / linen; it is
traced into a GraphSpec (no server needed) and the graph evaluated by
graph_reference.py, whose forward and reverse mode are checked against the
eager numpy run and central finite differences. This ties what the tracer
records to what the user's code means, op by op."""
import numpy as np
import pytest

import graph_reference
import te_client.numpy as jnp
from te_client import graph as graph_lib, linen as nn, symbolic
from tolerances import FINITE_DIFF, rel_err

CASES = {
    "add_scalar_broadcast": (lambda x, y: (x + 1.0) * y[0] - 2.0 / (x * x + 1.0), [(3, 4), (1, 4)]),
    "sub_div_pow": (lambda x, y: (x - y) / (y * y + 2.0) + x ** 2.0 - 3.0 ** (0.1 * y), [(2, 3), (2, 3)]),
    "unary": (lambda x, y: jnp.exp(0.3 * x) + jnp.log(y * y + 1.0) + jnp.tanh(x) + jnp.sqrt(y * y + 1.0)
              + jnp.rsqrt(x * x + 2.0) + jnp.abs(x) * 0.5 + jnp.square(y), [(2, 5), (2, 5)]),
    "activations": (lambda x, y: nn.relu(x) + nn.silu(y) + nn.sigmoid(x) + nn.tanh(y), [(4, 3), (4, 3)]),
    "max_min_where": (lambda x, y: jnp.maximum(x, y) + jnp.minimum(x, 0.2) + jnp.where(x > y, x, -1.5)
                      + jnp.where(y < 0.0, 2.0, y), [(3, 3), (3, 3)]),
    "reductions": (lambda x, y: jnp.sum(x, axis=1, keepdims=True) * jnp.mean(y, axis=(0, 1))
                   + jnp.max(x * y, axis=-1, keepdims=True) + x.min(axis=0), [(2, 3, 4), (2, 3, 4)]),
    "einsum_matmul": (lambda x, y: jnp.einsum("bqd,bkd->bqk", x, y) + (x @ jnp.swapaxes(y, 1, 2)),
                      [(2, 3, 4), (2, 3, 4)]),
    "softmax": (lambda x, y: nn.softmax(x, axis=-1) * y + nn.log_softmax(y, axis=1), [(2, 5), (2, 5)]),
    "indexing": (lambda x, y: (x[:, 0] * y[..., 1:3].sum(-1))[:, None] + x[1][None] + y[:, ::2].mean(),
                 [(3, 4), (3, 4)]),
    "shapes": (lambda x, y: jnp.moveaxis(jnp.stack([x, y], axis=1), 1, -1).reshape(2, -1)
               + jnp.expand_dims(jnp.squeeze(x[:, :1], 1), -1).repeat(1, -1).sum(), [(2, 3), (2, 3)]),
    "split_concat": (lambda x, y: jnp.concatenate(jnp.split(x, 2, axis=1)[::-1] + [y], axis=1), [(2, 4), (2, 4)]),
}


def _trace(fn, shapes):
    trace = graph_lib.Trace(lambda: (), True)
    names = ["x", "extra_inputs[0]"]
    symbols = [trace.input(n, s, 1) for n, s in zip(names, shapes)]   # 1: float32
    out = fn(*symbols)
    return trace.build(out), names


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_traced_op_computes_what_numpy_computes_eagerly(name, rng):
    fn, shapes = CASES[name]
    if name == "shapes":
        fn = lambda x, y: jnp.moveaxis(jnp.stack([x, y], axis=1), 1, -1).reshape(2, -1) + jnp.expand_dims(  # noqa: E731
            jnp.squeeze(x[:, :1], 1), -1).sum()
    traced, names = _trace(fn, shapes)
    xs = [rng.standard_normal(s) for s in shapes]
    eager = fn(*xs)
    ev = graph_reference.Evaluation(traced.spec, {}, dict(zip(names, xs)))
    got = ev.outputs()[0]
    assert got.shape == np.shape(eager)
    assert rel_err(got, eager) <= 1e-12, name
    # Reverse mode against central differences of the eager function (float64).
    dy = rng.standard_normal(np.shape(eager))
    _, grads = ev.gradients({traced.spec.outputs[0]: dy})
    for i, n in enumerate(names):
        if grads.get(n) is None:
            continue
        direction = rng.standard_normal(shapes[i])
        h = 1e-6
        plus = [x + h * direction if j == i else x for j, x in enumerate(xs)]
        minus = [x - h * direction if j == i else x for j, x in enumerate(xs)]
        numeric = (np.vdot(fn(*plus), dy) - np.vdot(fn(*minus), dy)) / (2 * h)
        analytic = np.vdot(grads[n], direction)
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), (name, n, numeric, analytic)


def test_dtype_promotion_is_jaxs():
    trace = graph_lib.Trace(lambda: (), True)
    x16 = trace.input("x", (2, 3), 2)           # bfloat16
    x32 = trace.input("extra_inputs[0]", (2, 3), 1)
    i32 = trace.input("extra_inputs[1]", (2, 3), 6)
    assert (x16 * 2.0).dtype == jnp.bfloat16          # a Python scalar is weakly typed
    assert (x16 + x32).dtype == np.float32
    assert (i32 + 1.5).dtype == np.float32            # int with a float scalar: float32
    assert (x16 > 0.0).dtype == np.bool_
    assert jnp.where(i32 > 0, x16, 0.0).dtype == jnp.bfloat16


@pytest.mark.parametrize("what,fn", [
    ("floor_divide", lambda x: x // 2),
    ("a constant array", lambda x: x + np.ones((2, 3))),
    ("gather by an index array", lambda x: x[np.array([0, 1])]),
    ("np.cumsum", lambda x: np.cumsum(x)),
    ("three-operand einsum", lambda x: jnp.einsum("ab,bc,cd->ad", x, x.T, x)),
    ("a trace in einsum", lambda x: jnp.einsum("aa->a", x.reshape(3, 2)[:2])),
    ("negative step", lambda x: x[:, ::-1]),
])
def test_what_a_graph_cannot_hold_raises_naming_it(what, fn):
    trace = graph_lib.Trace(lambda: (), True)
    x = trace.input("x", (2, 3), 1)
    with pytest.raises((TypeError, ValueError)) as e:
        fn(x)
    text = str(e.value)
    assert any(w in text for w in ("GraphSpec", "graph", "traced")), text


def test_an_unsupported_numpy_function_names_the_ops_a_traced_tensor_takes():
    trace = graph_lib.Trace(lambda: (), True)
    x = trace.input("x", (2, 3), 1)
    with pytest.raises(TypeError, match="np.cumsum.*einsum"):
        np.cumsum(x)
    assert symbolic.SUPPORTED_OPS in str(pytest.raises(TypeError, np.cumsum, x).value)
