"""Numpy references and gradient checks shared by the server tests (float64 throughout)."""
import numpy as np

import tolerances
from te_client import variables as variables_lib


def layernorm(x, scale, bias=None, eps=1e-6, zero_centered_gamma=False):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    gamma = np.asarray(scale, np.float64) + (1.0 if zero_centered_gamma else 0.0)
    y = (x - mu) / np.sqrt(var + eps) * gamma
    return y if bias is None else y + np.asarray(bias, np.float64)


def rmsnorm(x, scale, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def attention(q, k, v, masked_out=None, scale=None):
    """q [B, Sq, H, D], k and v [B, Skv, G, D] (G divides H); masked_out [B, 1, Sq, Skv] True = masked."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    heads, groups = q.shape[2], k.shape[2]
    k, v = np.repeat(k, heads // groups, axis=2), np.repeat(v, heads // groups, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if masked_out is not None:
        logits = np.where(masked_out, -np.inf, logits)
    top = logits.max(-1, keepdims=True)
    logits -= np.where(np.isfinite(top), top, 0.0)   # fully masked rows stay all -inf (NaN, unused)
    p = np.exp(logits)
    with np.errstate(invalid="ignore"):
        p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def causal_mask(batch, seq):
    """TE convention: True = masked out (key after query)."""
    return np.broadcast_to(np.triu(np.ones((seq, seq), bool), k=1), (batch, 1, seq, seq)).copy()


def first(y):
    return y[0] if isinstance(y, tuple) else y


def check_input_gradient(apply, x, dx, dy, rng, others=()):
    """Central difference of f(x) = vdot(apply(x, *others), dy) along a random
    direction against vdot(dx, direction)."""
    direction = rng.standard_normal(np.shape(x)).astype(np.float32)
    h = tolerances.FD_EPS * float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))
    f = lambda t: float(np.vdot(np.asarray(first(apply(t, *others)), np.float64), np.asarray(dy, np.float64)))
    plus = (np.asarray(x, np.float32) + h * direction).astype(np.float32)
    minus = (np.asarray(x, np.float32) - h * direction).astype(np.float32)
    numeric = (f(plus) - f(minus)) / (2 * h)
    analytic = float(np.vdot(np.asarray(dx, np.float64), direction.astype(np.float64)))
    assert abs(numeric - analytic) <= tolerances.FINITE_DIFF * max(abs(analytic), 1e-3), (numeric, analytic)


def check_param_gradient(session, module, params, grads, x, dy, rng, name, apply_kwargs=None, others=()):
    """The same check for one parameter ("params/..."), perturbed on the server with set_variables."""
    apply_kwargs = apply_kwargs or {}
    values = variables_lib.flatten(session.get_variables(params, ["params"]))
    base = np.asarray(values[name], np.float32)
    g = np.asarray(variables_lib.flatten(grads)[name], np.float64)
    direction = rng.standard_normal(base.shape).astype(np.float32)
    h = tolerances.FD_EPS * float(np.sqrt(np.mean(np.square(base.astype(np.float64))))) + 1e-3

    def f(value):
        # set_variables makes a new version (params stay as they were): apply that one.
        perturbed = session.set_variables(params, {name: value.astype(np.float32)})
        y = first(module.apply(perturbed, x, *others, **apply_kwargs))
        return float(np.vdot(np.asarray(y, np.float64), np.asarray(dy, np.float64)))
    numeric = (f(base + h * direction) - f(base - h * direction)) / (2 * h)
    np.testing.assert_array_equal(
        np.asarray(variables_lib.flatten(session.get_variables(params, ["params"]))[name], np.float32), base)
    analytic = float(np.vdot(g, direction.astype(np.float64)))
    assert abs(numeric - analytic) <= tolerances.FINITE_DIFF * max(abs(analytic), 1e-3), (name, numeric, analytic)
