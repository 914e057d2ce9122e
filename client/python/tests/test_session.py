"""Sessions against a real te_server: recipe negotiation, close, authentication, bad input."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import client as client_lib
from te_client.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling


def _x(rng, *shape):
    return rng.standard_normal(shape or (2, 8, 32)).astype(np.float32)


def test_server_info_lists_the_device(client, server_device):
    info = client.server_info()
    assert info.version and any(d.name == server_device and d.healthy for d in info.devices)
    assert info.limits.max_message_bytes > 0


def test_no_recipes_negotiates_none(client, server_device):
    with client.session() as session:
        assert session.recipe is None and session.id and session.device == server_device and session.ttl > 0


def test_fallback_skips_what_the_device_only_emulates(client):
    with client.session(recipes=[MXFP8BlockScaling(), DelayedScaling(amax_history_len=16)],
                        policy="fallback") as session:
        assert session.recipe == DelayedScaling(amax_history_len=16) and not session.emulated
        assert "MXFP8" in session.negotiation or "mxfp8" in session.negotiation.lower()


def test_strict_fails_unless_the_first_runs_natively(client):
    with pytest.raises(te.FailedPreconditionError, match="(?i)mxfp8"):
        client.session(recipes=[MXFP8BlockScaling(), DelayedScaling()], policy="strict")
    with client.session(recipes=[Float8CurrentScaling()], policy="strict") as session:
        assert session.recipe == Float8CurrentScaling()


def test_emulate_takes_an_emulated_recipe(client):
    with client.session(recipes=[NVFP4BlockScaling()], policy="emulate") as session:
        assert session.recipe == NVFP4BlockScaling() and session.emulated


def test_unknown_policy_is_invalid_argument(client):
    with pytest.raises(te.InvalidArgumentError, match="policy"):
        client.session(policy="best")


def test_ttl_is_honoured(client):
    with client.session(ttl=60) as session:
        assert session.ttl == 60


def test_with_block_makes_the_session_current_and_closes_it(client, rng):
    assert te.current_session() is None
    with client.session() as outer:
        with client.session() as inner:
            assert te.current_session() is inner
        assert te.current_session() is outer and inner.closed
    assert te.current_session() is None and outer.closed
    with pytest.raises(te.NotFoundError, match="closed"):
        te_flax.LayerNorm().init(0, _x(rng), session=outer)


def test_closed_session_calls_are_not_found_and_close_twice_is_a_no_op(client, rng):
    session = client.session()
    layer = te_flax.DenseGeneral(features=4)
    params = layer.init(0, _x(rng), session=session)
    session.close()
    session.close()
    with pytest.raises(te.NotFoundError, match=session.id):
        layer.apply(params, _x(rng))


def test_wrong_token_is_unauthenticated_and_another_sessions_id_is_permission_denied(client):
    with client.session() as a, client.session() as b:
        def forged(**fields):
            # Unnumbered: the server refuses it before it takes a place in a's
            # order, so one of a's numbers would be a gap a's later calls wait for.
            ref = client_lib.service_pb2.SessionRef()
            ref.CopyFrom(a._ref)
            for name, value in fields.items():
                setattr(ref, name, value)
            assert ref.sequence == 0
            return client_lib.service_pb2.GetVariablesRequest(session=ref, layer_id="none")

        with pytest.raises(te.UnauthenticatedError):
            client._call("GetVariables", forged(token="0" * len(a._ref.token)), metadata=a._metadata)
        with pytest.raises(te.PermissionDeniedError):
            client._call("GetVariables", forged(session_id=b.id), metadata=a._metadata)
        a.info()   # a's own order goes on


def test_layers_of_one_session_are_invisible_to_another(client, rng):
    with client.session() as a, client.session() as b:
        params = te_flax.DenseGeneral(features=4).init(0, _x(rng), session=a)
        layer_id = next(iter(params.handles.values())).layer_id
        with pytest.raises(te.NotFoundError, match="layer_id"):
            b.call("GetVariables", client_lib.service_pb2.GetVariablesRequest(layer_id=layer_id))


def test_bad_shape_names_the_field_and_leaves_the_session_working(session, rng):
    layer = te_flax.DenseGeneral(features=8)
    params = layer.init(0, _x(rng))
    with pytest.raises(te.InvalidArgumentError) as info:
        layer.apply(params, _x(rng, 2, 8, 31))
    assert "x.shape" in info.value.message
    assert layer.apply(params, _x(rng)).shape == (2, 8, 8)


def test_bad_spec_is_invalid_argument_naming_the_field(session, rng):
    with pytest.raises(te.InvalidArgumentError, match="features"):
        te_flax.DenseGeneral(features=-3).init(0, _x(rng))
    with pytest.raises(te.InvalidArgumentError, match="hidden_size|num_attention_heads"):
        te_flax.TransformerLayer(hidden_size=30, num_attention_heads=4).init(0, _x(rng, 2, 8, 30))


def test_bad_dy_names_the_field(session, rng):
    layer = te_flax.DenseGeneral(features=8)
    params = layer.init(0, _x(rng))
    with pytest.raises(te.InvalidArgumentError, match="dy"):
        te.value_and_grad(layer.apply)(params, _x(rng), _x(rng, 2, 8, 9))


def test_unsupported_input_dtype_is_invalid_argument(session):
    with pytest.raises(te.InvalidArgumentError, match="dtype"):
        te_flax.LayerNorm().init(0, np.ones((2, 4, 8), np.int32))


def test_set_variables_checks_names_and_shapes(session, rng):
    layer = te_flax.DenseGeneral(features=8)
    params = layer.init(0, _x(rng))
    with pytest.raises(te.InvalidArgumentError, match="params/nope"):
        session.set_variables(params, {"params/nope": np.ones(3, np.float32)})
    with pytest.raises(te.InvalidArgumentError):
        session.set_variables(params, {"params/bias": np.ones(9, np.float32)})
    written = session.set_variables(params, {"params": {"bias": np.arange(8, dtype=np.float32)}})
    np.testing.assert_array_equal(np.asarray(written["params"]["bias"]), np.arange(8))
    assert not np.array_equal(np.asarray(params["params"]["bias"]), np.arange(8))   # a new version
