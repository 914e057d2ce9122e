"""The hand-written API without a server: specs, recipes, autocast, keys, masks, errors."""
import grpc
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import client as client_lib, graph as te_graph, linen as nn, module as module_lib
from te_client.recipe import (DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling,
                              NVFP4BlockScaling)

layers_pb2, recipe_pb2 = client_lib.layers_pb2, client_lib.recipe_pb2


def test_transformer_layer_spec_writes_te_defaults():
    spec = te_flax.TransformerLayer().spec().transformer_layer
    assert (spec.hidden_size, spec.mlp_hidden_size, spec.num_attention_heads) == (512, 2048, 8)
    assert spec.HasField("hidden_dropout") and spec.hidden_dropout == pytest.approx(0.1)
    assert list(spec.mlp_activations) == ["gelu"] and not spec.use_bias   # TE >= 2.10
    assert spec.self_attn_mask_type == layers_pb2.CAUSAL and spec.enable_relative_embedding
    assert not spec.HasField("num_gqa_groups")   # None: the server's "equal to num_attention_heads"
    assert spec.dtype == layers_pb2.PARAM_FLOAT32


def test_quickstart_transformer_layer_fields_reach_the_spec():
    spec = te_flax.TransformerLayer(hidden_size=64, mlp_hidden_size=256, num_attention_heads=4,
                                    mlp_activations=("gelu",), layernorm_epsilon=1e-5, use_bias=True,
                                    intermediate_dropout=0.0, enable_relative_embedding=False,
                                    self_attn_bias_type="no_bias", hidden_dropout=0.0,
                                    dtype=te.bfloat16).spec().transformer_layer
    assert spec.self_attn_bias_type == layers_pb2.NO_BIAS and spec.dtype == layers_pb2.PARAM_BFLOAT16
    assert spec.layernorm_epsilon == pytest.approx(1e-5) and spec.use_bias and not spec.enable_relative_embedding


def test_dense_general_features_and_axes_are_lists():
    spec = te_flax.DenseGeneral(features=(3, 64), axis=(-2, -1), use_bias=False).spec().dense_general
    assert list(spec.features) == [3, 64] and list(spec.axis) == [-2, -1] and not spec.use_bias


@pytest.mark.parametrize("module,field", [
    (te_flax.LayerNorm(layernorm_type="batchnorm"), "layernorm_type"),
    (te_flax.DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type="sliding"), "attn_mask_type"),
    (te_flax.DotProductAttention(head_dim=8, num_attention_heads=2, qkv_layout="thd"), "qkv_layout"),
    (te_flax.DenseGeneral(features=4, dtype=np.int32), "DenseGeneral.dtype"),
    (te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=2, transpose_batch_sequence=True),
     "transpose_batch_sequence"),
])
def test_bad_string_fields_are_invalid_argument_naming_the_field(module, field):
    with pytest.raises(te.InvalidArgumentError, match=field):
        module.spec()


def test_unknown_te_field_is_a_type_error():
    with pytest.raises(TypeError):
        te_flax.DenseGeneral(features=4, kernel_axes=("embed",))


@pytest.mark.parametrize("recipe", [
    DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
    DelayedScaling(margin=1.0, fp8_format=Format.E4M3, amax_history_len=4, amax_compute_algo="most_recent"),
    Float8CurrentScaling(fp8_format=Format.E5M2, amax_epsilon=1e-3), MXFP8BlockScaling(), NVFP4BlockScaling(),
])
def test_recipe_proto_round_trip(recipe):
    msg = te.recipe.to_proto(recipe, recipe_pb2)
    assert te.recipe.from_proto(recipe_pb2.Recipe.FromString(msg.SerializeToString()), recipe_pb2) == \
        te.recipe.from_proto(msg, recipe_pb2)
    got = te.recipe.from_proto(msg, recipe_pb2)
    assert type(got) is type(recipe)
    for field in getattr(recipe, "__dataclass_fields__", {}):
        assert getattr(got, field) == pytest.approx(getattr(recipe, field)) if isinstance(
            getattr(recipe, field), float) else getattr(got, field) == getattr(recipe, field)


def test_recipe_defaults_are_te_defaults():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == (0.0, Format.HYBRID, 1024, "max")
    assert MXFP8BlockScaling().fp8_format == Format.E4M3
    empty = te.recipe.from_proto(recipe_pb2.Recipe(delayed_scaling=recipe_pb2.DelayedScaling()), recipe_pb2)
    assert empty == DelayedScaling()


def test_bad_amax_compute_algo_is_invalid_argument():
    with pytest.raises(te.InvalidArgumentError, match="amax_compute_algo"):
        te.recipe.to_proto(DelayedScaling(amax_compute_algo="mean"), recipe_pb2)


def test_autocast_nests_and_restores():
    outer, inner = DelayedScaling(amax_history_len=16), Float8CurrentScaling()
    assert not te.recipe.current_autocast().enabled
    with te.autocast(enabled=True, recipe=outer):
        assert te.recipe.current_autocast().recipe == outer
        with te.fp8_autocast(enabled=True, fp8_recipe=inner):
            state = te.recipe.current_autocast()
            msg = te.recipe.autocast_proto(state, recipe_pb2)
            assert msg.enabled and msg.recipe.WhichOneof("kind") == "float8_current_scaling"
        assert te.recipe.current_autocast().recipe == outer
        with te.autocast(enabled=False):
            assert not te.recipe.autocast_proto(te.recipe.current_autocast(), recipe_pb2).HasField("recipe")
    assert te.recipe.current_autocast() == te.recipe.AutocastState()


def test_autocast_rejects_what_the_server_cannot_do():
    with pytest.raises(te.InvalidArgumentError, match="mesh_resource"):
        with te.autocast(enabled=True, mesh_resource=object()):
            pass
    with pytest.raises(te.InvalidArgumentError, match="recipe"):
        with te.autocast(enabled=True, recipe="hybrid"):
            pass


def test_keys_become_stable_seeds():
    assert module_lib.seed_of(42) == 42
    assert module_lib.seed_of(np.array([0, 42], np.uint32)) == 42                   # jax.random.PRNGKey(42)
    assert module_lib.seed_of(np.array([1, 2], np.uint32)) == (1 << 32) | 2
    assert module_lib.seed_of({"params": 7, "dropout": 9}) == 7
    assert module_lib.seed_of({"params": 7, "dropout": 9}, "dropout") == 9
    a, b = te_graph.derive_seed(42, "DenseGeneral_0"), te_graph.derive_seed(42, "DenseGeneral_1")
    assert a != b and a == te_graph.derive_seed(42, "DenseGeneral_0") and 0 <= a < 2**64


def test_make_causal_mask_is_flax_convention():
    mask = nn.make_causal_mask(np.zeros((2, 5)), dtype=np.bool_)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == np.bool_
    assert mask[1, 0, 3, 2] and not mask[1, 0, 2, 3]           # True = attend, key <= query
    assert nn.make_causal_mask(np.zeros((1, 3))).dtype == np.float32


def test_module_call_outside_init_or_apply_is_failed_precondition(rng):
    with pytest.raises(te.FailedPreconditionError, match="init"):
        te_flax.LayerNorm()(rng.standard_normal((2, 8)))


def test_init_without_a_session_is_failed_precondition(rng):
    with pytest.raises(te.FailedPreconditionError, match="session"):
        te_flax.LayerNorm().init(0, rng.standard_normal((2, 8)))


def test_rpc_errors_keep_code_and_message():
    class FakeRpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "layer was initialised without autocast"
    err = te.errors.from_rpc_error(FakeRpcError())
    assert isinstance(err, te.FailedPreconditionError) and isinstance(err, te.TeError)
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.message == "layer was initialised without autocast"
    assert str(err) == "FAILED_PRECONDITION: layer was initialised without autocast"
    assert te.errors.error(grpc.StatusCode.INTERNAL, "x").code == grpc.StatusCode.INTERNAL


def test_connect_to_nothing_is_unavailable():
    with pytest.raises(te.UnavailableError, match="127.0.0.1:1"):
        te.connect("127.0.0.1:1", timeout=0.5)


def test_variables_tree_helpers():
    flat = {"params/b/kernel": 1, "params/a/scale": 2, "fp8_metas/b/x_scale": 3}
    tree = te.variables.unflatten(flat)
    assert list(tree) == ["fp8_metas", "params"] and list(tree["params"]) == ["a", "b"]
    assert te.variables.flatten(tree) == {k: flat[k] for k in sorted(flat)}
    assert te.tree_map(lambda v: v * 10, {"z": [1, (2,)], "a": 3}) == {"a": 30, "z": [10, (20,)]}
    assert str(te.tree_map(lambda v: v.shape, {"p": {"k": np.zeros((2, 3)), "b": np.zeros(3)}})) == \
        "{'p': {'b': (3,), 'k': (2, 3)}}"
