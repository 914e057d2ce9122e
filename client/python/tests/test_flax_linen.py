"""Flax's own modules (te_client.linen's Dense, DenseGeneral, LayerNorm, MultiHeadDotProductAttention,
gelu) against a real te_server: Flax's parameter trees and initialisers, Flax's dtype rule, and the
quickstart's plain-Flax layer, written as the notebook writes it, against a float64 numpy reference
of Flax's definitions and against central differences.
"""
import os
import sys

import numpy as np
import pytest

import helpers
import te_client as te
from te_client import linen as nn
from te_client import variables as variables_lib
from tolerances import BF16, F32, rel_err

B, S, H, HEADS, FFN = 2, 8, 32, 4, 64
QKV = H // HEADS   # the quickstart's qkv_features=kv_channels: head_dim QKV // HEADS


# The quickstart's plain-Flax layer, as the notebook writes it (examples/quickstart.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from quickstart import FlaxTransformerLayer  # noqa: E402


def _x(rng, *shape):
    return rng.standard_normal(shape or (B, S, H)).astype(np.float32)


def _flat(session, variables):
    return {k: np.asarray(v, np.float64) for k, v in
            variables_lib.flatten(session.get_variables(variables, ["params"])).items()}


# ---- a float64 reference of Flax's definitions -----------------------------------------------

def _layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _mhdpa(q_in, k_in, v_in, p, heads, causal):
    proj = lambda t, name: np.einsum("bsf,fhd->bshd", t, p[name]["kernel"]) + p[name]["bias"]
    q, k, v = proj(q_in, "query"), proj(k_in, "key"), proj(v_in, "value")
    logits = np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
    if causal:
        seq = logits.shape[-1]
        logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, np.finfo(np.float64).min)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    a = np.einsum("bhqk,bkhd->bqhd", w, v)
    return np.einsum("bqhd,hdo->bqo", a, p["out"]["kernel"]) + p["out"]["bias"]


def _reference(values, x, heads=HEADS, eps=1e-5):
    """FlaxTransformerLayer's y in float64 (deterministic) from the server's parameters."""
    tree = variables_lib.unflatten(values)["params"]
    x = np.asarray(x, np.float64)
    b, s, h = x.shape
    qkv = np.asarray(_layer_norm(x, tree["LayerNorm_0"], eps) @ tree["Dense_0"]["kernel"] + tree["Dense_0"]["bias"])
    q, k, v = (t.reshape(b, s, h) for t in np.split(qkv.reshape(b, s, heads, -1), 3, axis=3))
    h1 = x + _mhdpa(q, k, v, tree["MultiHeadDotProductAttention_0"], heads, causal=True)
    mlp = tree["FlaxMLP_0"]
    f = _gelu(_layer_norm(h1, tree["LayerNorm_1"], eps) @ mlp["Dense_0"]["kernel"] + mlp["Dense_0"]["bias"])
    return h1 + f @ mlp["Dense_1"]["kernel"] + mlp["Dense_1"]["bias"]


# ---- the quickstart's plain-Flax layer -----------------------------------------------------------

def test_plain_flax_layer_has_flaxs_tree(session, rng):
    params = FlaxTransformerLayer(H, FFN, HEADS).init(0, _x(rng), attention_mask=None, deterministic=False)
    dense = lambda i, o: {"bias": (o,), "kernel": (i, o)}
    proj = {"bias": (HEADS, QKV // HEADS), "kernel": (H, HEADS, QKV // HEADS)}
    assert te.tree_map(lambda v: v.shape, params) == {"params": {
        "Dense_0": dense(H, 3 * H), "FlaxMLP_0": {"Dense_0": dense(H, FFN), "Dense_1": dense(FFN, H)},
        "LayerNorm_0": {"bias": (H,), "scale": (H,)}, "LayerNorm_1": {"bias": (H,), "scale": (H,)},
        "MultiHeadDotProductAttention_0": {"key": proj, "query": proj, "value": proj,
                                           "out": {"bias": (H,), "kernel": (HEADS, QKV // HEADS, H)}}}}
    assert all(te.dtype_of(v) == "float32" for v in variables_lib.flatten(session.get_variables(params, ["params"])).values())


def test_plain_flax_layer_equals_flaxs_definition(session, rng):
    layer, x = FlaxTransformerLayer(H, FFN, HEADS), _x(rng)
    params = layer.init(0, x, attention_mask=None, deterministic=False)
    y = layer.apply(params, x, attention_mask=None, deterministic=True)
    assert rel_err(y, _reference(_flat(session, params), x)) < F32


def test_bf16_input_with_float32_params_computes_and_returns_float32(session, rng):
    layer, x32 = FlaxTransformerLayer(H, FFN, HEADS), _x(rng)
    x = te.asarray(x32, te.bfloat16)
    params = layer.init(0, x, attention_mask=None, deterministic=False)
    y = layer.apply(params, x, attention_mask=None, deterministic=True)
    assert te.dtype_of(y) == "float32" and y.shape == (B, S, H)
    # The float32 computation of the bf16-rounded input: float32 accuracy, not bf16's.
    x_rounded = np.asarray(te.asarray(x, np.float32), np.float64)
    err = rel_err(y, _reference(_flat(session, params), x_rounded))
    assert err < F32 and err < BF16 / 100


def test_plain_flax_layer_gradients_match_central_differences(session, rng):
    layer, x, dy = FlaxTransformerLayer(H, FFN, HEADS), _x(rng), _x(rng)
    params = layer.init(0, x, attention_mask=None, deterministic=True)
    _, (grads, dx) = te.value_and_grad(layer.apply)(params, x, dy, deterministic=True)
    helpers.check_input_gradient(lambda t: layer.apply(params, t, deterministic=True), x, dx, dy, rng)
    for name in ("params/MultiHeadDotProductAttention_0/query/kernel", "params/FlaxMLP_0/Dense_0/bias",
                 "params/LayerNorm_0/scale"):
        helpers.check_param_gradient(session, layer, params, grads, x, dy, rng, name, {"deterministic": True})


def test_attention_dropout_follows_deterministic_and_the_dropout_key(session, rng):
    layer, x = FlaxTransformerLayer(H, FFN, HEADS), _x(rng)
    params = layer.init(0, x, deterministic=False)
    y0 = layer.apply(params, x, deterministic=False, rngs={"dropout": 5})
    assert rel_err(layer.apply(params, x, deterministic=False, rngs={"dropout": 5}), y0) == 0.0
    assert rel_err(layer.apply(params, x, deterministic=False, rngs={"dropout": 6}), y0) > 1e-3
    assert rel_err(layer.apply(params, x, deterministic=True), y0) > 1e-3


# ---- the modules on their own ------------------------------------------------------------------------

def test_dense_kernel_is_lecun_normal_and_bias_zeros(session, rng):
    fan_in, features = 512, 256
    params = nn.Dense(features=features).init(3, _x(rng, 4, fan_in))
    values = _flat(session, params)
    kernel = values["params/kernel"]
    assert kernel.shape == (fan_in, features) and not np.any(values["params/bias"])
    # lecun_normal: truncated normal with variance 1 / fan_in (4 standard errors of the estimate).
    assert abs(kernel.var() * fan_in - 1.0) < 4 * np.sqrt(2.0 / kernel.size) + 0.01
    assert abs(kernel.mean()) < 4 / np.sqrt(fan_in * kernel.size)


def test_dense_general_contracts_its_axes(session, rng):
    x = _x(rng, B, S, H)
    layer = nn.DenseGeneral(features=(HEADS, 3))
    params = layer.init(0, x)
    y = layer.apply(params, x)
    p = variables_lib.unflatten(_flat(session, params))["params"]
    assert y.shape == (B, S, HEADS, 3)
    assert rel_err(y, np.einsum("bsf,fhd->bshd", x, p["kernel"]) + p["bias"]) < F32


@pytest.mark.parametrize("param_dtype,dtype,want", [
    (np.float32, None, "float32"), (te.bfloat16, None, "bfloat16"), (np.float32, te.bfloat16, "bfloat16"),
    (te.bfloat16, np.float32, "float32")])
def test_dtype_rule_is_flaxs(session, rng, param_dtype, dtype, want):
    x = te.asarray(_x(rng), te.bfloat16)
    for layer in (nn.Dense(features=16, dtype=dtype, param_dtype=param_dtype),
                  nn.LayerNorm(dtype=dtype, param_dtype=param_dtype)):
        params = layer.init(0, x)
        assert te.dtype_of(layer.apply(params, x)) == want, type(layer).__name__
        stored = variables_lib.flatten(session.get_variables(params, ["params"]))
        assert {te.dtype_of(v) for v in stored.values()} == {"float32" if param_dtype is np.float32 else "bfloat16"}


def test_layer_norm_on_its_own_is_flaxs(session, rng):
    x = _x(rng) * 3.0 + 1.0
    layer = nn.LayerNorm()
    params = layer.init(0, x)
    values = variables_lib.unflatten(_flat(session, params))["params"]
    assert set(values) == {"scale", "bias"}
    assert rel_err(layer.apply(params, x), _layer_norm(np.asarray(x, np.float64), values, 1e-6)) < F32


def test_gelu_is_the_tanh_approximation_and_erfs_exactly():
    a = np.linspace(-4, 4, 33, dtype=np.float32)
    np.testing.assert_allclose(nn.gelu(a), _gelu(a.astype(np.float64)), rtol=1e-6, atol=1e-7)
    import math
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in a.astype(np.float64)])
    np.testing.assert_allclose(nn.gelu(a.astype(np.float64), approximate=False), exact, rtol=1e-12)

    class Exact(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.gelu(x, approximate=False)
    node = Exact().trace(np.zeros((2, 3), np.float32)).spec.nodes[0]
    assert node.unary.op == te.client.layers_pb2.GraphSpec.Unary.GELU_EXACT


def test_attention_mask_array_at_the_top_level_is_refused(session, rng):
    x = _x(rng)
    attention = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    with pytest.raises(NotImplementedError, match="mask"):
        attention.init(0, x, mask=np.ones((B, 1, S, S), bool))


def test_attention_with_dropout_needs_deterministic():
    x = te.asarray(np.zeros((B, S, H), np.float32), np.float32)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.1)(x)

    with pytest.raises(ValueError, match='"deterministic" must be passed'):
        Layer().trace(x)


def test_precision_is_sent_and_default_is_exact_float32_on_the_cpu(session, rng, server_device):
    x = _x(rng, 4, 64)
    assert nn.Dense(features=8).spec().flax_dense.precision == 0   # DEFAULT: JAX's default
    assert nn.Dense(features=8, precision="highest").spec().flax_dense.precision == 1
    with pytest.raises(NotImplementedError, match="Dense.precision"):
        nn.Dense(features=8, precision="bfloat16_3x").spec()
    if server_device != "cpu":
        pytest.skip("DEFAULT is TensorFloat-32 on a GPU; exact float32 only on the CPU")
    default, highest = nn.Dense(features=8), nn.Dense(features=8, precision="highest")
    y_default = default.apply(default.init(0, x), x)
    np.testing.assert_array_equal(y_default, highest.apply(highest.init(0, x), x))


def test_dropout_without_a_dropout_rng_raises_as_flax_does(session, rng):
    layer, x = FlaxTransformerLayer(H, FFN, HEADS), _x(rng)
    params = layer.init(0, x, deterministic=False)
    with pytest.raises(te.InvalidArgumentError, match='MultiHeadDotProductAttention_0 needs PRNG for "dropout"'):
        layer.apply(params, x, deterministic=False)
    with pytest.raises(te.InvalidArgumentError, match='needs PRNG for "dropout"'):
        te.value_and_grad(layer.apply)(params, x, _x(rng), deterministic=False, rngs={"params": 1})
    layer.apply(params, x, deterministic=False, rngs={"dropout": 3})
    layer.apply(params, x, deterministic=True)   # no dropout runs: no key needed
    dense = nn.Dense(features=8)                 # no dropout at all
    dense.apply(dense.init(0, x), x)
