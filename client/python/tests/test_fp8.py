"""autocast against a real te_server: the fp8_metas rule, FP8 numerics, TE's delayed-scaling update."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import variables as variables_lib
from te_client.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from tolerances import FP8, rel_err

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
HYBRID16 = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def _x(rng, *shape):
    return rng.standard_normal(shape or (4, 16, 64)).astype(np.float32)


def test_init_under_delayed_scaling_creates_fp8_metas(session, rng):
    layer = te_flax.DenseGeneral(features=32)
    x = _x(rng)
    assert "fp8_metas" not in layer.init(0, x)
    with te.autocast(enabled=True, recipe=HYBRID16):
        params = layer.init(0, x)
    metas = te.tree_map(lambda v: v.shape, params)["fp8_metas"]
    assert metas == {"x_scale": (1,), "x_amax_history": (16,), "kernel_scale": (1,),
                     "kernel_amax_history": (16,), "grad_scale": (1,), "grad_amax_history": (16,)}
    values = variables_lib.flatten(session.get_variables(params, ["fp8_metas"]))
    np.testing.assert_array_equal(values["fp8_metas/x_scale"], [1.0])          # TE's initial state
    np.testing.assert_array_equal(values["fp8_metas/x_amax_history"], np.zeros(16))


def test_fp8_apply_of_a_layer_initialised_without_autocast_is_failed_precondition(session, rng):
    layer = te_flax.LayerNormMLP(intermediate_dim=64, activations=("gelu",))
    x = _x(rng)
    params = layer.init(0, x)
    with te.autocast(enabled=True, recipe=HYBRID16):
        with pytest.raises(te.FailedPreconditionError) as info:
            layer.apply(params, x, deterministic=True)
    assert "fp8_metas" in info.value.message and "ScopeCollectionNotFound" in info.value.message
    layer.apply(params, x, deterministic=True)   # the session is unharmed: bf16/f32 still runs


def test_current_scaling_needs_no_fp8_metas(session, rng):
    layer = te_flax.DenseGeneral(features=32)
    x = _x(rng)
    params = layer.init(0, x)
    y_ref = layer.apply(params, x)
    with te.autocast(enabled=True, recipe=Float8CurrentScaling()):
        y = layer.apply(params, x)
    assert 1e-4 < rel_err(y, y_ref) < FP8          # FP8 took effect, within the format's error


def test_delayed_scaling_forward_is_fp8_and_close(session, rng):
    layer = te_flax.LayerNormDenseGeneral(features=32, return_layernorm_output=False)
    x = _x(rng)
    with te.autocast(enabled=True, recipe=HYBRID16):
        params = layer.init(0, x)
        y, _ = layer.apply(params, x)
    y_ref, _ = layer.apply(params, x)
    assert 1e-4 < rel_err(y, y_ref) < FP8


def test_each_step_applies_te_delayed_scaling_update(session, rng):
    layer = te_flax.DenseGeneral(features=32, use_bias=False)
    x = _x(rng) * 3.0
    dy = _x(rng, 4, 16, 32) * 0.01
    with te.autocast(enabled=True, recipe=HYBRID16):
        params = layer.init(0, x)
        kernel = variables_lib.flatten(session.get_variables(params, ["params"]))["params/kernel"]
        before = variables_lib.flatten(session.get_variables(params, ["fp8_metas"]))
        layer.apply(params, x)      # functional, as TE's: no fp8_metas move without a step
        unchanged = variables_lib.flatten(session.get_variables(params, ["fp8_metas"]))
        for name, value in before.items():
            np.testing.assert_array_equal(unchanged[name], value, err_msg=name)
        # Flax's mutable: the forward ends its step on the server, with TE's update.
        y, moved = layer.apply(params, x, mutable=["fp8_metas"])
        # A new version (Flax's updated variables); params stay as they were.
        assert moved.version.number > params.version.number and y.shape == (4, 16, 32)
        np.testing.assert_array_equal(variables_lib.flatten(session.get_variables(params, ["fp8_metas"]))[
            "fp8_metas/x_scale"], before["fp8_metas/x_scale"])
        params = moved
        metas = variables_lib.flatten(session.get_variables(params, ["fp8_metas"]))
        # scale = fp8_max / amax (margin 0), amax = max over the history window.
        assert metas["fp8_metas/x_amax_history"].max() == pytest.approx(np.abs(x).max(), rel=1e-6)
        assert metas["fp8_metas/x_scale"][0] == pytest.approx(E4M3_MAX / np.abs(x).max(), rel=1e-6)
        assert metas["fp8_metas/kernel_scale"][0] == pytest.approx(E4M3_MAX / np.abs(kernel).max(), rel=1e-6)
        np.testing.assert_array_equal(metas["fp8_metas/grad_scale"], [1.0])   # amax 0 keeps the scale
        _, (grads, _) = te.value_and_grad(layer.apply)(params, x, dy)
    metas = variables_lib.flatten(session.get_variables(grads.variables, ["fp8_metas"]))
    assert metas["fp8_metas/grad_scale"][0] == pytest.approx(E5M2_MAX / np.abs(dy).max(), rel=1e-6)  # HYBRID
    assert metas["fp8_metas/x_scale"][0] == pytest.approx(E4M3_MAX / np.abs(x).max(), rel=1e-6)


def test_autocast_without_a_recipe_uses_the_sessions(client, rng):
    with client.session(recipes=[DelayedScaling(amax_history_len=8)]) as session:
        assert session.recipe == DelayedScaling(amax_history_len=8)
        layer = te_flax.DenseGeneral(features=8)
        with te.autocast(enabled=True):
            params = layer.init(0, _x(rng))
        assert params["fp8_metas"]["x_amax_history"].shape == (8,)
    with client.session() as bf16_only:
        with te.autocast(enabled=True):
            with pytest.raises(te.FailedPreconditionError, match="recipe"):
                te_flax.DenseGeneral(features=8).init(0, _x(rng), session=bf16_only)


def test_emulated_recipes_need_the_emulate_policy(client, rng):
    x = _x(rng)
    with client.session(recipes=[MXFP8BlockScaling()], policy="emulate") as session:
        assert session.recipe == MXFP8BlockScaling() and session.emulated
        layer = te_flax.DenseGeneral(features=32)
        params = layer.init(0, x)
        with te.autocast(enabled=True):
            y = layer.apply(params, x)
        assert 1e-4 < rel_err(y, layer.apply(params, x)) < FP8
    with client.session(policy="fallback") as session:
        layer = te_flax.DenseGeneral(features=32)
        params = layer.init(0, x)
        with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
            with pytest.raises(te.FailedPreconditionError, match="MXFP8|mxfp8|emulat"):
                layer.apply(params, x)
