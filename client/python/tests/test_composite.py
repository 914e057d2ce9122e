"""Composite Modules (Flax compact style) against a real te_server: naming, apply, gradients, dropout."""
from typing import Optional

import numpy as np
import pytest

import helpers
import te_client as te
import te_client.flax as te_flax
from te_client import linen as nn
from te_client import variables as variables_lib
from tolerances import F32, rel_err

B, S, H, HEADS = 2, 8, 32, 4


def _x(rng, *shape):
    return rng.standard_normal(shape or (B, S, H)).astype(np.float32)


class MLP(nn.Module):
    hidden_size: int
    ffn_hidden_size: int

    @nn.compact
    def __call__(self, x, deterministic: bool):
        x = te_flax.DenseGeneral(features=self.ffn_hidden_size, use_bias=True)(x)
        x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
        x = te.activation.activation(x, activation_type=("gelu",))
        return te_flax.DenseGeneral(features=self.hidden_size, use_bias=True)(x)


class Block(nn.Module):
    """The quickstart's TEUnfusedTransformerLayer, small, with a named submodule."""
    hidden_size: int
    num_attention_heads: int
    dropout: float = 0.0

    def setup(self):
        self.kv_channels = self.hidden_size // self.num_attention_heads

    @nn.compact
    def __call__(self, x, attention_mask: Optional[np.ndarray] = None, deterministic: bool = False):
        res = x
        x = te_flax.LayerNorm(epsilon=1e-5)(x)
        qkv = te_flax.DenseGeneral(features=3 * self.hidden_size)(x)
        qkv = qkv.reshape(qkv.shape[0], qkv.shape[1], self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = np.split(qkv, 3, axis=3)
        x = te_flax.DotProductAttention(head_dim=self.kv_channels, num_attention_heads=self.num_attention_heads,
                                        attn_mask_type="causal")(q, k, v, deterministic=deterministic)
        x = x.reshape((x.shape[0], x.shape[1], x.shape[2] * x.shape[3]))
        x = te_flax.DenseGeneral(features=self.hidden_size, name="proj")(x)
        x = nn.Dropout(rate=self.dropout)(x, deterministic=deterministic)
        x = res + x
        res = x
        x = te_flax.LayerNorm(epsilon=1e-5)(x)
        return MLP(self.hidden_size, 2 * self.hidden_size)(x, deterministic=deterministic) + res


def _reference_block(v, x):
    """Block in float64 numpy from the downloaded parameters."""
    ln0 = helpers.layernorm(x, v["params/LayerNorm_0/scale"], v["params/LayerNorm_0/ln_bias"], 1e-5)
    qkv = (ln0 @ v["params/DenseGeneral_0/kernel"] + v["params/DenseGeneral_0/bias"]).reshape(B, S, HEADS, -1)
    q, k, w = np.split(qkv, 3, axis=3)
    a = helpers.attention(q, k, w, helpers.causal_mask(B, S)).reshape(B, S, H)
    h = x + a @ v["params/proj/kernel"] + v["params/proj/bias"]
    ln1 = helpers.layernorm(h, v["params/LayerNorm_1/scale"], v["params/LayerNorm_1/ln_bias"], 1e-5)
    f = helpers.gelu(ln1 @ v["params/MLP_0/DenseGeneral_0/kernel"] + v["params/MLP_0/DenseGeneral_0/bias"])
    return h + f @ v["params/MLP_0/DenseGeneral_1/kernel"] + v["params/MLP_0/DenseGeneral_1/bias"]


def test_submodules_get_flax_names(session, rng):
    params = Block(H, HEADS).init(0, _x(rng), deterministic=True)
    assert te.tree_map(lambda v: v.shape, params) == {"params": {
        "DenseGeneral_0": {"bias": (3 * H,), "kernel": (H, 3 * H)},
        "LayerNorm_0": {"ln_bias": (H,), "scale": (H,)}, "LayerNorm_1": {"ln_bias": (H,), "scale": (H,)},
        "MLP_0": {"DenseGeneral_0": {"bias": (2 * H,), "kernel": (H, 2 * H)},
                  "DenseGeneral_1": {"bias": (H,), "kernel": (2 * H, H)}},
        "proj": {"bias": (H,), "kernel": (H, H)}}}


def test_apply_matches_the_composed_math(session, rng):
    block = Block(H, HEADS)
    x = _x(rng)
    params = block.init(0, x, deterministic=True)
    values = variables_lib.flatten(session.get_variables(params))
    assert rel_err(block.apply(params, x, deterministic=True), _reference_block(values, x)) < F32


def test_value_and_grad_matches_central_differences(session, rng):
    block = Block(H, HEADS)
    x = _x(rng)
    params = block.init(0, x, deterministic=True)
    dy = _x(rng)
    value, (grads, dx) = te.value_and_grad(block.apply)(params, x, dy, deterministic=True)
    y = block.apply(params, x, deterministic=True)
    assert value == pytest.approx(float(np.vdot(y.astype(np.float64), dy)), rel=1e-5)
    assert set(variables_lib.flatten(grads)) == set(variables_lib.flatten(params))
    helpers.check_input_gradient(lambda t: block.apply(params, t, deterministic=True), x, dx, dy, rng)
    for name in ("params/DenseGeneral_0/kernel", "params/MLP_0/DenseGeneral_0/kernel", "params/LayerNorm_1/scale"):
        helpers.check_param_gradient(session, block, params, grads, x, dy, rng, name, {"deterministic": True})


def test_composite_of_one_module_equals_the_module(session, rng):
    class Wrapper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return te_flax.DenseGeneral(features=16)(x)

    x, dy = _x(rng), _x(rng, B, S, 16)
    inner, outer = te_flax.DenseGeneral(features=16), Wrapper()
    p_inner, p_outer = inner.init(3, x), outer.init(3, x)
    session.set_variables(p_outer, {"params": {"DenseGeneral_0": session.get_variables(p_inner)["params"]}})
    np.testing.assert_array_equal(outer.apply(p_outer, x), inner.apply(p_inner, x))
    v_in, (g_in, dx_in) = te.value_and_grad(inner.apply)(p_inner, x, dy)
    v_out, (g_out, dx_out) = te.value_and_grad(outer.apply)(p_outer, x, dy)
    assert v_out == pytest.approx(v_in, rel=1e-6)
    np.testing.assert_allclose(dx_out, dx_in, rtol=1e-6)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(g_out["params"]["DenseGeneral_0"][name], g_in["params"][name], rtol=1e-6)


def test_client_dropout_is_seeded_inverted_and_differentiated(session, rng):
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=False):
            return nn.Dropout(rate=0.5)(te_flax.DenseGeneral(features=H)(x), deterministic=deterministic)

    layer, x = Drop(), _x(rng)
    params = layer.init(0, x)
    y_det = layer.apply(params, x, deterministic=True)
    y1 = layer.apply(params, x, rngs={"dropout": 1})
    np.testing.assert_array_equal(y1, layer.apply(params, x, rngs={"dropout": 1}))
    assert not np.array_equal(y1, layer.apply(params, x, rngs={"dropout": 2}))
    kept = y1 != 0
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(y1[kept], 2.0 * y_det[kept], rtol=1e-6)
    dy = _x(rng)
    _, (_, dx) = te.value_and_grad(layer.apply)(params, x, dy, rngs={"dropout": 1})
    k = np.asarray(params["params"]["DenseGeneral_0"]["kernel"], np.float64)
    assert rel_err(dx, (np.where(kept, 2.0 * dy, 0.0)) @ k.T) < F32


def test_flax_multi_head_attention_builds_flax_parameters(session, rng):
    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(x[..., 0], dtype=np.bool_)
            return nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=16)(x, x, x, mask=mask,
                                                                                   deterministic=True)
    layer, x = Attn(), _x(rng)
    params = layer.init(0, x)
    shapes = te.tree_map(lambda v: v.shape, params)["params"]["MultiHeadDotProductAttention_0"]
    assert shapes == {"query": {"bias": (HEADS, 4), "kernel": (H, HEADS, 4)},
                      "key": {"bias": (HEADS, 4), "kernel": (H, HEADS, 4)},
                      "value": {"bias": (HEADS, 4), "kernel": (H, HEADS, 4)},
                      "out": {"bias": (H,), "kernel": (HEADS, 4, H)}}
    v = variables_lib.flatten(session.get_variables(params))
    p = "params/MultiHeadDotProductAttention_0/"
    proj = lambda n: np.einsum("bsh,hnd->bsnd", x.astype(np.float64), v[p + n + "/kernel"]) + v[p + n + "/bias"]
    ctx = helpers.attention(proj("query"), proj("key"), proj("value"), helpers.causal_mask(B, S))
    want = np.einsum("bsnd,ndh->bsh", ctx, v[p + "out/kernel"]) + v[p + "out/bias"]
    assert rel_err(layer.apply(params, x), want) < F32


def test_apply_with_another_structures_variables_is_failed_precondition(session, rng):
    x = _x(rng)
    params = te_flax.DenseGeneral(features=8).init(0, x)
    with pytest.raises(te.FailedPreconditionError, match="LayerNorm"):
        Block(H, HEADS).apply(params, x, deterministic=True)


def test_a_gradient_through_ln_out_is_unimplemented(session, rng):
    class UsesLnOut(nn.Module):
        @nn.compact
        def __call__(self, x):
            y, ln_out = te_flax.LayerNormDenseGeneral(features=H, return_layernorm_output=True)(x)
            return y + ln_out

    layer, x = UsesLnOut(), _x(rng)
    params = layer.init(0, x)
    with pytest.raises(te.UnimplementedError, match="ln_out"):
        te.value_and_grad(layer.apply)(params, x, _x(rng))


def test_speedometer_times_single_and_composite_modules(session, rng, capsys, server_device):
    x, dy = _x(rng), _x(rng)
    single = te_flax.DenseGeneral(features=H)
    timed = te.speedometer(model_apply_fn=single.apply, variables=single.init(0, x), input=x, output_grad=dy,
                           warmup_iters=1, timing_iters=2)
    assert timed["steps"] == 2 and timed["mean_ms"] > 0 and timed["timed_by"] == "client"
    on_server = te.speedometer(model_apply_fn=single.apply, variables=single.init(0, x), input=x,
                               output_grad=dy, warmup_iters=1, timing_iters=3, server_side=True)
    assert on_server["steps"] == 3 and on_server["timed_by"] == server_device
    block = Block(H, HEADS, dropout=0.1)
    te.speedometer(model_apply_fn=block.apply, variables=block.init(0, x), input=x, output_grad=dy,
                   forward_kwargs={"attention_mask": None, "deterministic": False}, rngs={"dropout": 7},
                   warmup_iters=1, timing_iters=2)
    assert capsys.readouterr().out.count("Mean time: ") == 3
