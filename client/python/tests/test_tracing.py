"""tracing.py without a server: the glue's gradients against central differences in float64."""
import numpy as np
import pytest

from te_client import tracing

# Each case: f(x) built from the glue ops a composite's __call__ uses; x is [2, 3, 4, 6].
CASES = {
    "reshape_split_add": lambda x: (lambda q, k, v: q * 2.0 + k - v)(*np.split(x.reshape(2, 3, 4, 6), 3, axis=3)),
    "split_sections_concatenate": lambda x: np.concatenate(np.split(x, [1, 4], axis=3)[::-1], axis=3) * 0.5,
    "getitem_mul": lambda x: x[..., 1:5] * x[..., 0:4],
    "transpose_sub": lambda x: x.transpose(0, 2, 1, 3).reshape(2, 4, 18) - 1.0,
    "np_functions": lambda x: np.squeeze(np.expand_dims(np.transpose(x, (3, 2, 1, 0)), 0), 0),
    "residual_fan_out": lambda x: (lambda r: r + r * r)(x + 0.25),
    "ufuncs_with_constants": lambda x: np.subtract(3.0, x) + np.multiply(np.arange(6.0), x) - np.negative(x),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_central_differences(name, rng):
    f = CASES[name]
    x = rng.standard_normal((2, 3, 4, 6))
    tape = tracing.Tape()
    leaf = tape.leaf(x)
    y = f(leaf)
    assert isinstance(y, tracing.Tracer), "the op dropped out of the tape"
    np.testing.assert_allclose(y.value, f(x))
    dy = rng.standard_normal(y.shape)
    grads = tape.backward([(y, dy)])
    analytic = grads[id(leaf)]

    numeric = np.zeros_like(x)
    eps = 1e-5
    for i in range(x.size):
        e = np.zeros(x.size)
        e[i] = eps
        e = e.reshape(x.shape)
        numeric.flat[i] = (np.vdot(f(x + e), dy) - np.vdot(f(x - e), dy)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-8)


def test_unsupported_numpy_function_raises_instead_of_dropping_the_gradient(rng):
    tape = tracing.Tape()
    x = tape.leaf(rng.standard_normal((3, 3)))
    with pytest.raises(TypeError):
        np.tanh(x)
    with pytest.raises(TypeError):
        np.linalg.norm(x)


def test_outputs_without_gradient_leave_inputs_untouched(rng):
    tape = tracing.Tape()
    x = tape.leaf(rng.standard_normal((4,)))
    unused = x * 3.0
    y = x + 1.0
    grads = tape.backward([(y, np.ones(4))])
    np.testing.assert_array_equal(grads[id(x)], np.ones(4))
    assert id(unused) not in grads
