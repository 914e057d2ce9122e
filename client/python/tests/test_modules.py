"""init / apply / value_and_grad of every TE module against a real te_server (CPU, float32).

apply is checked against a float64 numpy reference where the math is short
(LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP, attention,
activation); for every module, value_and_grad's value is vdot(apply(x), dy)
and its dx and one parameter gradient match central differences.
"""
import inspect

import numpy as np
import pytest

import helpers
import te_client as te
import te_client.flax as te_flax
from te_client import variables as variables_lib
from tolerances import BF16, F32, rel_err

B, S, H = 2, 8, 32


def _x(rng, *shape):
    return rng.standard_normal(shape or (B, S, H)).astype(np.float32)


def _values(session, params):
    return variables_lib.flatten(session.get_variables(params, ["params"]))


def _gradient_checks(session, module, params, x, rng, param_name, others=(), **kwargs):
    if "deterministic" in inspect.signature(module.__call__).parameters:
        kwargs["deterministic"] = True
    y = helpers.first(module.apply(params, x, *others, **kwargs))
    dy = rng.standard_normal(np.shape(y)).astype(np.float32)
    value, (grads, dx) = te.value_and_grad(module.apply)(params, x, dy, *others, **kwargs)
    assert value == pytest.approx(float(np.vdot(np.asarray(y, np.float64), dy)), rel=F32 * 10)
    assert set(variables_lib.flatten(grads)) == set(_values(session, params))
    for name, g in variables_lib.flatten(grads).items():
        assert np.shape(g) == params_shape(params, name) and np.all(np.isfinite(g))
    dx_main = dx[0] if isinstance(dx, tuple) else dx
    apply = lambda t, *o: module.apply(params, t, *o, **kwargs)
    helpers.check_input_gradient(apply, x, dx_main, dy, rng, others)
    helpers.check_param_gradient(session, module, params, grads, x, dy, rng, param_name, kwargs, others)
    return dx


def params_shape(params, name):
    return variables_lib.flatten(params)[name].shape


# ---- LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP, activation ----------------------

@pytest.mark.parametrize("layernorm_type,zero_centered_gamma", [("layernorm", False), ("layernorm", True),
                                                                ("rmsnorm", False)])
def test_layer_norm(session, rng, layernorm_type, zero_centered_gamma):
    layer = te_flax.LayerNorm(epsilon=1e-5, layernorm_type=layernorm_type, zero_centered_gamma=zero_centered_gamma)
    x = _x(rng)
    params = layer.init(0, x)
    want_names = {"params/scale", "params/ln_bias"} if layernorm_type == "layernorm" else {"params/scale"}
    assert set(variables_lib.flatten(params)) == want_names
    # Random parameters, so that a wrong scale or bias shows.
    params = session.set_variables(params, {n: rng.standard_normal(H).astype(np.float32) for n in want_names})
    v = _values(session, params)
    y = layer.apply(params, x)
    assert y.shape == x.shape and te.dtype_of(y) == "float32"
    if layernorm_type == "rmsnorm":
        want = helpers.rmsnorm(x, v["params/scale"], eps=1e-5)
    else:
        want = helpers.layernorm(x, v["params/scale"], v["params/ln_bias"], 1e-5, zero_centered_gamma)
    assert rel_err(y, want) < F32
    _gradient_checks(session, layer, params, x, rng, "params/scale")


def test_dense_general(session, rng):
    layer = te_flax.DenseGeneral(features=24)
    x = _x(rng)
    params = layer.init(1, x)
    assert te.tree_map(lambda v: v.shape, params) == {"params": {"bias": (24,), "kernel": (H, 24)}}
    params = session.set_variables(params, {"params/bias": rng.standard_normal(24).astype(np.float32)})
    v = _values(session, params)
    y = layer.apply(params, x)
    assert rel_err(y, x.astype(np.float64) @ v["params/kernel"] + v["params/bias"]) < F32
    dx = _gradient_checks(session, layer, params, x, rng, "params/kernel")
    assert dx.shape == x.shape


def test_dense_general_multi_dim_features_and_axes(session, rng):
    layer = te_flax.DenseGeneral(features=(3, 8), use_bias=False)
    x = _x(rng)
    params = layer.init(2, x)
    assert params["params"]["kernel"].shape == (H, 3, 8) and "bias" not in params["params"]
    y = layer.apply(params, x)
    assert y.shape == (B, S, 3, 8)
    out = te_flax.DenseGeneral(features=H, axis=(-2, -1))
    out_params = out.init(3, y)
    assert out_params["params"]["kernel"].shape == (3, 8, H)
    k = _values(session, out_params)["params/kernel"]
    z = out.apply(out_params, y)
    assert rel_err(z, np.einsum("bsij,ijh->bsh", y.astype(np.float64), k) + _values(session, out_params)[
        "params/bias"]) < F32


def test_dense_general_seed_is_deterministic(session, rng):
    layer = te_flax.DenseGeneral(features=16)
    x = _x(rng)
    k = lambda seed: _values(session, layer.init(seed, x))["params/kernel"]
    a, b, c = k(5), k(5), k(6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # TE's kernel init: variance_scaling(1, fan_in, truncated_normal): std about 1/sqrt(fan_in).
    assert 0.5 / np.sqrt(H) < a.std() < 1.5 / np.sqrt(H)


def test_layernorm_dense_general_returns_ln_out(session, rng):
    layer = te_flax.LayerNormDenseGeneral(features=24, use_bias=True, return_layernorm_output=True)
    x = _x(rng)
    params = layer.init(3, x)
    assert set(variables_lib.flatten(params)) == {"params/scale", "params/ln_bias", "params/kernel",
                                                  "params/bias"}
    v = _values(session, params)
    y, ln_out = layer.apply(params, x)
    want_ln = helpers.layernorm(x, v["params/scale"], v["params/ln_bias"])
    assert rel_err(ln_out, want_ln) < F32
    assert rel_err(y, want_ln @ v["params/kernel"] + v["params/bias"]) < F32
    _gradient_checks(session, layer, params, x, rng, "params/kernel")


def test_layernorm_dense_general_without_ln_out(session, rng):
    layer = te_flax.LayerNormDenseGeneral(features=24, return_layernorm_output=False)
    x = _x(rng)
    y, ln_out = layer.apply(layer.init(3, x), x)
    assert ln_out is None and y.shape == (B, S, 24)


def test_layernorm_mlp(session, rng):
    layer = te_flax.LayerNormMLP(intermediate_dim=48, activations=("gelu",), intermediate_dropout_rate=0.0,
                                 use_bias=True, return_layernorm_output=True)
    x = _x(rng)
    params = layer.init(4, x)
    shapes = te.tree_map(lambda v: v.shape, params)["params"]
    assert shapes["wi_kernel"] == (H, 1, 48) and shapes["wo_kernel"] == (48, H)
    assert shapes["wi_bias"] == (1, 48) and shapes["wo_bias"] == (H,)
    params = session.set_variables(params, {"params/wi_bias": rng.standard_normal((1, 48)).astype(np.float32)})
    v = _values(session, params)
    y, ln_out = layer.apply(params, x)
    ln = helpers.layernorm(x, v["params/scale"], v["params/ln_bias"])
    hidden = helpers.gelu(ln @ v["params/wi_kernel"][:, 0, :] + v["params/wi_bias"][0])
    assert rel_err(y, hidden @ v["params/wo_kernel"] + v["params/wo_bias"]) < F32
    assert rel_err(ln_out, ln) < F32
    _gradient_checks(session, layer, params, x, rng, "params/wi_kernel")


def test_layernorm_mlp_gated(session, rng):
    layer = te_flax.LayerNormMLP(intermediate_dim=16, activations=("silu", "linear"),
                                 intermediate_dropout_rate=0.0)
    x = _x(rng)
    params = layer.init(5, x)
    assert params["params"]["wi_kernel"].shape == (H, 2, 16)
    v = _values(session, params)
    y, _ = layer.apply(params, x)
    ln = helpers.layernorm(x, v["params/scale"], v["params/ln_bias"])
    gate, linear = ln @ v["params/wi_kernel"][:, 0, :], ln @ v["params/wi_kernel"][:, 1, :]
    assert rel_err(y, (gate / (1 + np.exp(-gate)) * linear) @ v["params/wo_kernel"]) < F32
    _gradient_checks(session, layer, params, x, rng, "params/wo_kernel")


@pytest.mark.parametrize("activations,shape", [(("gelu",), (B, S, 1, 16)), (("gelu",), (B, S, 16)),
                                               (("gelu", "linear"), (B, S, 2, 16))])
def test_activation_function(session, rng, activations, shape):
    x = _x(rng, *shape)
    y = te.activation.activation(x, activation_type=activations)
    assert y.shape == (B, S, 16)
    x2 = x.reshape(B, S, -1, 16).astype(np.float64)
    want = helpers.gelu(x2[..., 0, :]) * (x2[..., 1, :] if len(activations) == 2 else 1.0)
    assert rel_err(y, want) < F32


def test_activation_gated_needs_two_rows(session, rng):
    with pytest.raises(te.InvalidArgumentError, match="activation"):
        te.activation.activation(_x(rng, B, S, 16), activation_type=("gelu", "linear"))


# ---- attention ----------------------------------------------------------------------------------

def _qkv(rng, heads=4, groups=4, d=8):
    return (_x(rng, B, S, heads, d), _x(rng, B, S, groups, d), _x(rng, B, S, groups, d))


@pytest.mark.parametrize("groups", [4, 2])
def test_dot_product_attention_causal(session, rng, groups):
    layer = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=groups,
                                        attn_mask_type="causal")
    q, k, v = _qkv(rng, groups=groups)
    params = layer.init(0, q, k, v)
    assert dict(params) == {}                      # no parameters, as in TE
    y = layer.apply(params, q, k, v, deterministic=True)
    assert rel_err(y, helpers.attention(q, k, v, helpers.causal_mask(B, S))) < F32
    dy = _x(rng, *y.shape)
    value, (grads, (dq, dk, dv)) = te.value_and_grad(layer.apply)(params, q, dy, k, v, deterministic=True)
    assert grads == {} and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert value == pytest.approx(float(np.vdot(y.astype(np.float64), dy)), rel=F32 * 10)
    apply = lambda q_, k_, v_: layer.apply(params, q_, k_, v_, deterministic=True)
    helpers.check_input_gradient(apply, q, dq, dy, rng, (k, v))
    helpers.check_input_gradient(lambda k_, q_, v_: apply(q_, k_, v_), k, dk, dy, rng, (q, v))
    helpers.check_input_gradient(lambda v_, q_, k_: apply(q_, k_, v_), v, dv, dy, rng, (q, k))


def test_dot_product_attention_packed_equals_separate(session, rng):
    q, k, v = _qkv(rng)
    separate = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="no_mask")
    packed = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="no_mask",
                                         qkv_layout="bs3hd")
    qkv = np.stack([q, k, v], axis=2)
    y_packed = packed.apply(packed.init(0, qkv), qkv, deterministic=True)
    y_separate = separate.apply(separate.init(0, q, k, v), q, k, v, deterministic=True)
    assert rel_err(y_packed, y_separate) < F32
    assert rel_err(y_separate, helpers.attention(q, k, v)) < F32


def test_dot_product_attention_padding_mask(session, rng):
    layer = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="padding")
    q, k, v = _qkv(rng)
    lengths = [S, 5]
    mask = np.zeros((B, 1, S, S), bool)
    for b, n in enumerate(lengths):
        mask[b, :, n:, :] = True
        mask[b, :, :, n:] = True
    y = layer.apply(layer.init(0, q, k, v), q, k, v, sequence_descriptor=mask, deterministic=True)
    want = helpers.attention(q, k, v, mask)
    # Rows of padded queries are undefined in TE; compare the valid rows only.
    for b, n in enumerate(lengths):
        assert rel_err(y[b, :n], want[b, :n]) < F32


def test_dot_product_attention_takes_q_k_v_or_packed(session, rng):
    layer = te_flax.DotProductAttention(head_dim=8, num_attention_heads=4)
    q, _, _ = _qkv(rng)
    with pytest.raises(te.InvalidArgumentError, match="query, key and value"):
        layer.init(0, q)


def test_multi_head_attention(session, rng):
    layer = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=4, attention_dropout=0.0)
    x = _x(rng)
    params = layer.init(7, x)
    names = set(variables_lib.flatten(params))
    assert {"params/qkv/kernel", "params/qkv/scale", "params/out/kernel"} <= names
    assert params["params"]["qkv"]["kernel"].shape == (H, 3, 32)
    y, ln_out = layer.apply(params, x, deterministic=True)
    assert y.shape == x.shape and ln_out is None
    _gradient_checks(session, layer, params, x, rng, "params/qkv/kernel")


def test_transformer_layer(session, rng):
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4,
                                     mlp_activations=("gelu",), hidden_dropout=0.0, attention_dropout=0.0,
                                     intermediate_dropout=0.0)
    x = _x(rng)
    params = layer.init(8, x)
    names = set(variables_lib.flatten(params))
    assert any(n.startswith("params/attention/") for n in names) and any("relpos" in n for n in names)
    assert any(n.startswith("params/mlp/") for n in names)
    y = layer.apply(params, x, deterministic=True)
    assert y.shape == x.shape and np.all(np.isfinite(y))
    _gradient_checks(session, layer, params, x, rng, sorted(n for n in names if n.endswith("wi_kernel"))[0])


def test_transformer_layer_decoder_attends_over_encoded_under_its_mask(session, rng):
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4,
                                     hidden_dropout=0.0, attention_dropout=0.0,
                                     layer_type=te_flax.TransformerLayerType.DECODER)
    x = _x(rng)
    encoded = rng.standard_normal((x.shape[0], 5, H)).astype(np.float32)
    mask = np.zeros((x.shape[0], 1, 1, 5), np.uint8)
    mask[0, ..., 3:] = 1   # row 0's last two encoded positions are padding
    params = layer.init(8, x, encoded, encoder_decoder_mask=mask)
    names = set(variables_lib.flatten(params))
    assert any(n.startswith("params/encoder_decoder_attention/") for n in names)
    assert any(n.startswith("params/self_attention/") for n in names)
    y = layer.apply(params, x, encoded, encoder_decoder_mask=mask, deterministic=True)
    assert y.shape == x.shape and np.all(np.isfinite(y))
    padded = encoded.copy()
    padded[0, 3:] += 10.0     # masked out: row 0 cannot see it
    y_padded = layer.apply(params, x, padded, encoder_decoder_mask=mask, deterministic=True)
    np.testing.assert_array_equal(y_padded[0], y[0])
    seen = encoded.copy()
    seen[0, 0] += 10.0        # visible: row 0 changes, row 1 does not
    y_seen = layer.apply(params, x, seen, encoder_decoder_mask=mask, deterministic=True)
    assert rel_err(y_seen[0], y[0]) > 1e-3
    np.testing.assert_array_equal(y_seen[1], y[1])
    with pytest.raises(te.InvalidArgumentError, match="encoded is required"):
        layer.apply(params, x, deterministic=True)
    with pytest.raises(te.InvalidArgumentError, match="DECODER"):
        te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4).init(8, x, encoded)


def test_dropout_follows_rngs_and_deterministic(session, rng):
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4,
                                     hidden_dropout=0.3, attention_dropout=0.3, intermediate_dropout=0.3)
    x = _x(rng)
    params = layer.init(8, x)
    run = lambda key, det: layer.apply(params, x, deterministic=det, rngs={"dropout": key})
    np.testing.assert_array_equal(run(1, False), run(1, False))
    assert not np.array_equal(run(1, False), run(2, False))
    np.testing.assert_array_equal(run(1, True), run(2, True))
    assert not np.array_equal(run(1, True), run(1, False))


def test_te_module_dropout_without_a_dropout_rng_raises_as_flax_does(session, rng):
    x = _x(rng)
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4)   # TE's 0.1 rates
    params = layer.init(8, x)
    with pytest.raises(te.InvalidArgumentError, match='TransformerLayer needs PRNG for "dropout"'):
        layer.apply(params, x, deterministic=False)
    with pytest.raises(te.InvalidArgumentError, match='TransformerLayer needs PRNG for "dropout"'):
        te.value_and_grad(layer.apply)(params, x, x, deterministic=False)
    layer.apply(params, x, deterministic=False, rngs={"dropout": 0})    # any key, 0 included
    layer.apply(params, x, deterministic=True)                           # no dropout runs: no key needed
    mlp = te_flax.LayerNormMLP(intermediate_dim=64, intermediate_dropout_rate=0.0)   # no rate above 0
    mlp.apply(mlp.init(0, x), x, deterministic=False)


def test_bf16_inputs_compute_in_bf16(session, rng):
    layer = te_flax.DenseGeneral(features=24)
    x32 = _x(rng)
    x = te.asarray(x32, te.bfloat16)
    params = layer.init(1, x)
    y = layer.apply(params, x)
    assert te.dtype_of(y) == "bfloat16" and y.shape == (B, S, 24)
    v = _values(session, params)
    assert rel_err(np.asarray(y, np.float32), np.asarray(x, np.float64) @ v["params/kernel"] + v["params/bias"]) < BF16
    dy = te.asarray(_x(rng, B, S, 24), te.bfloat16)
    _, (grads, dx) = te.value_and_grad(layer.apply)(params, x, dy)
    assert te.dtype_of(dx) == "bfloat16" and te.dtype_of(grads["params"]["kernel"]) == "float32"
    want = np.asarray(x, np.float64).reshape(-1, H).T @ np.asarray(dy, np.float64).reshape(-1, 24)
    assert rel_err(grads["params"]["kernel"], want) < BF16
