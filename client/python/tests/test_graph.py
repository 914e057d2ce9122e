"""Tracing composites into te.v1.GraphSpec, without a server: the quickstart's layers node by node,
Flax's naming, te_client.numpy on arrays, DeriveSeed, and the errors for what a graph cannot hold."""
import os
import sys

import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
import te_client.numpy as jnp
from te_client import client as client_lib, dtypes, graph, symbolic
from te_client import linen as nn
from te_client import variables as variables_lib

layers_pb2 = client_lib.layers_pb2
B, S, H, HEADS, FFN = 2, 8, 32, 4, 64
KV = H // HEADS


# The quickstart's seed classes, as the notebook writes them (examples/quickstart.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from quickstart import TEFusedTransformerLayer, TEUnfusedTransformerLayer  # noqa: E402


def _x(dtype=te.bfloat16, shape=(B, S, H)):
    return te.asarray(np.zeros(shape, np.float32), dtype)


def _kind(node):
    op = node.WhichOneof("op")
    return node.module.WhichOneof("module") if op == "module" else op


def _table(traced):
    """[(name, kind, inputs, outputs)] of every node."""
    return [(n.name, _kind(n), list(n.inputs), list(n.outputs)) for n in traced.spec.nodes]


# ---- the quickstart's layers ---------------------------------------------------------------

def test_te_unfused_transformer_layer_graph():
    traced = TEUnfusedTransformerLayer(H, FFN, HEADS).trace(_x(), attention_mask=None, deterministic=False)
    mlp = "TEUnfusedMLP_0/"
    assert _table(traced) == [
        ("LayerNorm_0", "layer_norm", ["x"], ["LayerNorm_0"]),
        ("DenseGeneral_0", "dense_general", ["LayerNorm_0"], ["DenseGeneral_0"]),
        ("reshape_0", "reshape", ["DenseGeneral_0"], ["reshape_0"]),
        ("split_0", "split", ["reshape_0"], ["split_0:0", "split_0:1", "split_0:2"]),
        ("DotProductAttention_0", "dot_product_attention", ["split_0:0", "split_0:1", "split_0:2"],
         ["DotProductAttention_0"]),
        ("reshape_1", "reshape", ["DotProductAttention_0"], ["reshape_1"]),
        ("DenseGeneral_1", "dense_general", ["reshape_1"], ["DenseGeneral_1"]),
        ("Dropout_0", "dropout", ["DenseGeneral_1"], ["Dropout_0"]),
        ("add_0", "add", ["x", "Dropout_0"], ["add_0"]),
        ("LayerNorm_1", "layer_norm", ["add_0"], ["LayerNorm_1"]),
        (mlp + "DenseGeneral_0", "dense_general", ["LayerNorm_1"], [mlp + "DenseGeneral_0"]),
        (mlp + "reshape_0", "reshape", [mlp + "DenseGeneral_0"], [mlp + "reshape_0"]),   # [..., 1, ffn]
        (mlp + "reshape_1", "reshape", [mlp + "reshape_0"], [mlp + "reshape_1"]),        # activation's [..., ffn]
        (mlp + "activation_0", "activation", [mlp + "reshape_1"], [mlp + "activation_0"]),
        (mlp + "DenseGeneral_1", "dense_general", [mlp + "activation_0"], [mlp + "DenseGeneral_1"]),
        ("add_1", "add", [mlp + "DenseGeneral_1", "add_0"], ["add_1"]),
    ]
    assert list(traced.spec.outputs) == ["add_1"]
    # The causal mask only the Flax-attention branch reads is not in the graph; nor is the request's mask.
    assert traced.inputs == ["x"] and all(not n.mask for n in traced.spec.nodes)
    assert traced.shapes == {
        "x": (B, S, H), "LayerNorm_0": (B, S, H), "DenseGeneral_0": (B, S, 3 * H), "reshape_0": (B, S, HEADS, 3 * KV),
        "split_0:0": (B, S, HEADS, KV), "split_0:1": (B, S, HEADS, KV), "split_0:2": (B, S, HEADS, KV),
        "DotProductAttention_0": (B, S, HEADS, KV), "reshape_1": (B, S, H), "DenseGeneral_1": (B, S, H),
        "Dropout_0": (B, S, H), "add_0": (B, S, H), "LayerNorm_1": (B, S, H), mlp + "DenseGeneral_0": (B, S, FFN),
        mlp + "reshape_0": (B, S, 1, FFN), mlp + "reshape_1": (B, S, FFN), mlp + "activation_0": (B, S, FFN),
        mlp + "DenseGeneral_1": (B, S, H), "add_1": (B, S, H)}
    assert set(traced.dtypes.values()) == {"bfloat16"}   # TE modules compute in the input's dtype
    assert (traced.output_shape, traced.output_wire) == ((B, S, H), dtypes.BFLOAT16)

    node = traced.node
    assert list(node("reshape_0").reshape.shape) == [B, S, HEADS, 3 * KV]
    assert list(node("reshape_1").reshape.shape) == [B, S, H]
    assert (node("split_0").split.axis, node("split_0").split.parts) == (3, 3)
    assert node("Dropout_0").dropout.rate == pytest.approx(0.1) and not node("Dropout_0").dropout.broadcast_dims
    attention = node("DotProductAttention_0").module.dot_product_attention
    assert (attention.head_dim, attention.num_attention_heads, attention.num_gqa_groups) == (KV, HEADS, HEADS)
    assert attention.attention_dropout == pytest.approx(0.1) and attention.attn_mask_type == layers_pb2.CAUSAL
    assert attention.dtype == layers_pb2.PARAM_BFLOAT16 and attention.qkv_layout == layers_pb2.BSHD_BSHD_BSHD
    assert list(node("DenseGeneral_0").module.dense_general.features) == [3 * H]
    assert node("DenseGeneral_0").module.dense_general.use_bias
    assert node("LayerNorm_1").module.layer_norm.epsilon == pytest.approx(1e-5)
    assert list(node(mlp + "activation_0").module.activation.activations) == ["gelu"]
    assert list(node(mlp + "DenseGeneral_0").module.dense_general.features) == [FFN]


def test_te_fused_transformer_layer_graph():
    traced = TEFusedTransformerLayer(H, FFN, HEADS).trace(_x(), attention_mask=None, deterministic=False)
    assert _table(traced) == [
        ("LayerNormDenseGeneral_0", "layer_norm_dense_general", ["x"], ["LayerNormDenseGeneral_0"]),
        ("reshape_0", "reshape", ["LayerNormDenseGeneral_0"], ["reshape_0"]),
        ("split_0", "split", ["reshape_0"], ["split_0:0", "split_0:1", "split_0:2"]),
        ("DotProductAttention_0", "dot_product_attention", ["split_0:0", "split_0:1", "split_0:2"],
         ["DotProductAttention_0"]),
        ("reshape_1", "reshape", ["DotProductAttention_0"], ["reshape_1"]),
        ("DenseGeneral_0", "dense_general", ["reshape_1"], ["DenseGeneral_0"]),
        ("Dropout_0", "dropout", ["DenseGeneral_0"], ["Dropout_0"]),
        ("add_0", "add", ["x", "Dropout_0"], ["add_0"]),
        ("LayerNormMLP_0", "layer_norm_mlp", ["add_0"], ["LayerNormMLP_0"]),
        ("add_1", "add", ["LayerNormMLP_0", "add_0"], ["add_1"]),
    ]
    assert traced.shapes["LayerNormDenseGeneral_0"] == (B, S, 3 * H) and traced.shapes["LayerNormMLP_0"] == (B, S, H)
    lndg = traced.node("LayerNormDenseGeneral_0").module.layer_norm_dense_general
    assert list(lndg.features) == [3 * H] and lndg.use_bias and not lndg.return_layernorm_output
    assert lndg.epsilon == pytest.approx(1e-5)
    mlp = traced.node("LayerNormMLP_0").module.layer_norm_mlp
    assert (mlp.intermediate_dim, list(mlp.activations), mlp.use_bias) == (FFN, ["gelu"], True)
    assert mlp.intermediate_dropout_rate == 0.0 and not mlp.return_layernorm_output


def test_a_traced_mask_reaches_the_module_that_reads_it():
    class Masked(nn.Module):
        @nn.compact
        def __call__(self, x, attention_mask=None, deterministic=False):
            if attention_mask is None:
                attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
            q = x.reshape(B, S, HEADS, KV)
            return te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, attn_mask_type="padding")(
                q, q, q, mask=attention_mask, deterministic=deterministic)

    own = Masked().trace(_x(np.float32))
    mask = own.node("causal_mask_0")
    assert list(mask.inputs) == ["x"] and own.shapes["causal_mask_0"] == (B, 1, S, S)
    assert own.dtypes["causal_mask_0"] == "bool" and own.node("DotProductAttention_0").mask == "causal_mask_0"
    given = Masked().trace(_x(np.float32), attention_mask=np.zeros((B, 1, S, S), bool))
    assert given.inputs == ["x", "attention_mask"] and given.node("DotProductAttention_0").mask == "attention_mask"
    assert all(n.WhichOneof("op") != "causal_mask" for n in given.spec.nodes)


def test_glue_ops_and_dtype_promotion():
    class Glue(nn.Module):
        @nn.compact
        def __call__(self, x):
            a, b = jnp.split(x, 2, axis=-1)                          # [B, S, H/2] twice
            c = jnp.concatenate([b, a], axis=-1) * 0.5               # scale
            d = jnp.transpose(c.reshape(B, S, 2, -1), (0, 2, 1, 3))  # [B, 2, S, H/2]
            e = d.T.transpose(3, 2, 1, 0).reshape(B, S, H) - x      # x - y: add of a scaled copy
            return e.astype(jnp.float32) + x.astype(jnp.bfloat16)    # bf16 + f32 promotes to f32

    traced = Glue().trace(_x(np.float32))
    kinds = [_kind(n) for n in traced.spec.nodes]
    assert kinds == ["split", "concatenate", "scale", "reshape", "transpose", "transpose", "transpose",
                     "reshape", "binary", "cast", "cast", "add"]
    assert traced.node("split_0").split.axis == 2 and traced.node("concatenate_0").concatenate.axis == 2
    assert traced.node("scale_0").scale.factor == 0.5
    assert traced.node("subtract_0").binary.op == layers_pb2.GraphSpec.Binary.SUBTRACT
    assert list(traced.node("reshape_0").reshape.shape) == [B, S, 2, H // 2]   # -1 resolved
    assert list(traced.node("transpose_0").transpose.axes) == [0, 2, 1, 3]
    assert list(traced.node("transpose_1").transpose.axes) == [3, 2, 1, 0]   # .T
    assert traced.shapes["transpose_0"] == (B, 2, S, H // 2)
    # x.astype(bfloat16) is cast_0; the sum promotes it back to float32 (cast_1), as JAX would.
    assert traced.node("cast_0").cast.dtype == dtypes.BFLOAT16 and traced.node("cast_1").cast.dtype == dtypes.FLOAT32
    assert list(traced.node("add_0").inputs) == ["subtract_0", "cast_1"] and traced.output_wire == dtypes.FLOAT32


def test_numpy_functions_on_traced_tensors_dispatch_to_te_client_numpy():
    class ViaNumpy(nn.Module):
        @nn.compact
        def __call__(self, x):
            q, k = np.split(np.reshape(x, (B, S, 2, H // 2)), 2, axis=2)
            return np.add(np.concatenate([k, q], axis=2), np.multiply(np.concatenate([q, k], axis=2), 2.0))

    kinds = [_kind(n) for n in ViaNumpy().trace(_x(np.float32)).spec.nodes]
    assert kinds == ["reshape", "split", "concatenate", "concatenate", "scale", "add"]


def test_te_client_numpy_on_arrays_is_numpy(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(jnp.reshape(x, (6, -1)), x.reshape(6, 4))
    for got, want in zip(jnp.split(x, 2, axis=2), np.split(x, 2, axis=2)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jnp.concatenate([x, x], axis=1), np.concatenate([x, x], axis=1))
    np.testing.assert_array_equal(jnp.transpose(x, (2, 0, 1)), x.transpose(2, 0, 1))
    np.testing.assert_array_equal(jnp.add(x, x), x + x)
    np.testing.assert_array_equal(jnp.zeros((2,)), np.zeros((2,)))   # every other name is numpy's
    assert jnp.shape(x) == (2, 3, 4) and jnp.ndim(x) == 3 and jnp.bool_ is np.bool_ and jnp.float32 is np.float32
    assert dtypes.dtype_of(jnp.astype(x, jnp.bfloat16)) == "bfloat16" and jnp.bfloat16 is te.bfloat16
    mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
    assert mask.shape == (2, 1, 3, 3) and mask[0, 0, 2, 1] and not mask[0, 0, 1, 2]


def test_traced_tensors_know_shape_ndim_and_dtype():
    seen = {}

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen.update(shape=x.shape, ndim=x.ndim, dtype=x.dtype, size=x.size, len=len(x),
                        picked=x[..., 0].shape, cast=x.astype(jnp.float32).dtype)
            return x

    Probe().trace(_x())
    assert seen == {"shape": (B, S, H), "ndim": 3, "dtype": symbolic.dtype_of_wire(dtypes.BFLOAT16), "size": B * S * H,
                    "len": B, "picked": (B, S), "cast": np.dtype(np.float32)}
    assert dtypes._is_bf16(seen["dtype"])


# ---- Flax's naming -------------------------------------------------------------------------

class Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = te_flax.DenseGeneral(features=H)(x)
        return te_flax.DenseGeneral(features=H, name="out")(x)


class Middle(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Inner()(x)
        x = te_flax.LayerNorm()(x)
        return Inner()(x) + x


class WithSetup(nn.Module):
    def setup(self):
        self.proj = te_flax.DenseGeneral(features=H)
        self.blocks = [Inner(), Inner()]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=False):
        x = te_flax.DenseGeneral(features=H)(x)
        x = Middle()(x)
        x = Middle(name="second")(x)
        x = WithSetup()(x)
        return nn.Dropout(0.2)(te_flax.DenseGeneral(features=H)(x), deterministic=deterministic)


def test_submodules_are_named_as_flax_names_them():
    modules = [n.name for n in Outer().trace(_x(np.float32)).spec.nodes if n.WhichOneof("op") in ("module", "dropout")]
    assert modules == [
        "DenseGeneral_0",
        "Middle_0/Inner_0/DenseGeneral_0", "Middle_0/Inner_0/out", "Middle_0/LayerNorm_0",
        "Middle_0/Inner_1/DenseGeneral_0", "Middle_0/Inner_1/out",
        "second/Inner_0/DenseGeneral_0", "second/Inner_0/out", "second/LayerNorm_0",
        "second/Inner_1/DenseGeneral_0", "second/Inner_1/out",
        "WithSetup_0/blocks_0/DenseGeneral_0", "WithSetup_0/blocks_0/out",   # setup: the attribute's name
        "WithSetup_0/blocks_1/DenseGeneral_0", "WithSetup_0/blocks_1/out",
        "WithSetup_0/proj",
        "DenseGeneral_1", "Dropout_0"]
    glue = [n.name for n in Outer().trace(_x(np.float32)).spec.nodes if n.WhichOneof("op") == "add"]
    assert glue == ["Middle_0/add_0", "second/add_0"]   # counted per scope


def test_glue_names_pass_over_names_modules_hold():
    class Taken(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = x + x
            return te_flax.DenseGeneral(features=H, name="add_0")(y) + y

    traced = Taken().trace(_x(np.float32))
    assert [(n.name, _kind(n)) for n in traced.spec.nodes] == [
        ("add_1", "add"), ("add_0", "dense_general"), ("add_2", "add")]


def test_variable_tree_paths_follow_node_names():
    # init's variables are the server's paths under the graph's root: "params/<node>/<variable>".
    handle = variables_lib.LayerHandle(None, "layer", (), [
        variables_lib.VariableInfo("params", "TEUnfusedMLP_0/DenseGeneral_0/kernel", (H, FFN), dtypes.FLOAT32),
        variables_lib.VariableInfo("fp8_metas", "DenseGeneral_1/kernel_amax_history", (16,), dtypes.FLOAT32)],
        (B, S, H), dtypes.FLOAT32)
    tree = te.tree_map(lambda v: v.shape, variables_lib.Variables({(): handle}))
    assert tree == {"fp8_metas": {"DenseGeneral_1": {"kernel_amax_history": (16,)}},
                    "params": {"TEUnfusedMLP_0": {"DenseGeneral_0": {"kernel": (H, FFN)}}}}


# ---- what a graph cannot hold ----------------------------------------------------------------

def _traced_with(body):
    class Body(nn.Module):
        @nn.compact
        def __call__(self, x):
            return body(x)
    return Body().trace(_x(np.float32))


@pytest.mark.parametrize("body,op", [
    (lambda x: x - np.ones(x.shape, np.float32), "no constant tensors"),
    (lambda x: x // 2.0, "floor_divide"),
    (lambda x: x[np.array([0, 1])], "gather"),
    (lambda x: jnp.einsum("abc,abc,abc->a", x, x, x), "two operands"),
    (lambda x: np.asarray(x), "no values"),
    (lambda x: x if x else x, "truth value"),
    (lambda x: x.astype(jnp.int32), "cast"),
    (lambda x: te_flax.DenseGeneral(features=H)(np.ones((B, S, H), np.float32)), "constants"),
    (lambda x: nn.make_causal_mask(x, dtype=jnp.bool_), "[batch, seq]"),
    (lambda x: (x, x), "one traced tensor"),
])
def test_unsupported_glue_is_a_type_error_naming_the_op(body, op):
    with pytest.raises(TypeError, match=op.replace("[", r"\[").replace("]", r"\]")):
        _traced_with(body)


def test_flax_own_modules_record_flax_module_nodes():
    traced = TEUnfusedTransformerLayer(H, FFN, HEADS, use_te_attention=False).trace(_x(), deterministic=False)
    attention = traced.node("MultiHeadDotProductAttention_0")
    assert attention.module.WhichOneof("module") == "flax_multi_head_dot_product_attention"
    assert list(attention.inputs) == ["reshape_1", "reshape_2", "reshape_3"] and attention.mask == "causal_mask_0"
    dense = _traced_with(lambda x: nn.Dense(features=7)(x))
    assert dense.node("Dense_0").module.flax_dense.features == 7 and dense.output_shape[-1] == 7


def test_a_module_called_twice_and_a_name_used_twice_are_refused():
    def twice(x):
        dense = te_flax.DenseGeneral(features=H)
        return dense(dense(x))
    with pytest.raises(NotImplementedError, match="DenseGeneral_0 .*called twice"):
        _traced_with(twice)
    with pytest.raises(ValueError, match="proj: the name is already used"):
        _traced_with(lambda x: te_flax.DenseGeneral(features=H, name="proj")(te_flax.DenseGeneral(features=H, name="proj")(x)))


def test_dropout_that_ignores_the_requests_deterministic_is_refused():
    class Hardcoded(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=False):
            return nn.Dropout(0.5)(x, deterministic=True)

    with pytest.raises(NotImplementedError, match=r"Dropout_0 \(Dropout\): called with deterministic=True"):
        Hardcoded().trace(_x(np.float32))
    Hardcoded().trace(_x(np.float32), deterministic=True)   # the same value: follows the request
    with pytest.raises(ValueError, match='"deterministic" must be passed'):
        _traced_with(lambda x: nn.Dropout(0.5)(x))
    # A module whose dropout is 0 does not care.
    _traced_with(lambda x: te_flax.LayerNormMLP(intermediate_dropout_rate=0.0)(x, deterministic=True)[0])


class _AddGraphSession:
    """Answers AddGraph as a server would (the next index), recording each request."""
    closed = False

    def __init__(self):
        self.added = []

    def call(self, method, request):
        assert method == "AddGraph", method
        self.added.append(request)
        return te.client.service_pb2.AddGraphResponse(graph=len(self.added))


def test_apply_with_arguments_that_trace_otherwise_adds_a_graph_once():
    class MaskOrCausal(nn.Module):
        @nn.compact
        def __call__(self, x, attention_mask=None, deterministic=False):
            if attention_mask is None:
                attention_mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
            q = x.reshape(x.shape[0], x.shape[1], HEADS, KV)
            return te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, attn_mask_type="padding",
                                               attention_dropout=0.1)(q, q, q, mask=attention_mask,
                                                                      deterministic=deterministic)

    layer, x = MaskOrCausal(), _x(np.float32)
    bound = layer.trace(x)
    session = _AddGraphSession()
    handle = variables_lib.LayerHandle(session, "layer", (), [], (B, S, HEADS, KV), dtypes.FLOAT32,
                                       input_shape=(B, S, H), input_wire_dtype=dtypes.FLOAT32, traced=bound,
                                       trace_key=te.module._Bound(layer, (x,), {}).key, module_type=MaskOrCausal)
    call, info = layer._call_for(handle, (x,), {"deterministic": True})   # traces again: the same graph
    assert call.deterministic and call.mask is None and info.index == 0 and not session.added
    call, info = layer._call_for(handle, (x,), {"attention_mask": np.zeros((B, 1, S, S), bool)})
    assert info.index == 1 and call.mask is not None
    # Another batch size and sequence length: one AddGraph, then the cached index.
    for _ in range(2):
        _, info = layer._call_for(handle, (_x(np.float32, (B + 1, 2 * S, H)),), {})
    assert info.index == 2 and len(session.added) == 2
    assert list(session.added[1].input_shape) == [B + 1, 2 * S, H]
    dense = variables_lib.LayerHandle(session, "d", (), [], (B, S, H), dtypes.FLOAT32,
                                      module_type=te_flax.DenseGeneral)
    with pytest.raises(te.FailedPreconditionError, match="init returned these for DenseGeneral"):
        layer._call_for(dense, (x,), {})


def test_masks_are_read_only_as_a_modules_mask():
    class MaskAsInput(nn.Module):
        @nn.compact
        def __call__(self, x, attention_mask=None):
            return x + attention_mask.astype(jnp.float32)

    with pytest.raises(TypeError, match="an attention mask .* as the input of cast"):
        MaskAsInput().trace(_x(np.float32), attention_mask=np.zeros((B, 1, S, S), bool))
    with pytest.raises(TypeError, match="the mask is a computed tensor"):
        _traced_with(lambda x: te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS)(
            *[x.reshape(B, S, HEADS, KV)] * 3, mask=x.reshape(B, 1, S, H)))
    with pytest.raises(TypeError, match="returned a mask"):
        _traced_with(lambda x: nn.make_causal_mask(x[..., 0]))
    with pytest.raises(NotImplementedError, match=r"rate 1\.0"):
        _traced_with(lambda x: nn.Dropout(1.0)(x, deterministic=False))


def test_an_older_servers_answer_to_a_graph_is_recognised():
    unknown = te.InvalidArgumentError("spec: no module set (one of layer_norm, dense_general, activation, "
                                      "layer_norm_dense_general, layer_norm_mlp, dot_product_attention, "
                                      "multi_head_attention, transformer_layer, flax_transformer_layer, sequential)")
    assert te.layer_calls.graph_unknown(unknown)
    assert not te.layer_calls.graph_unknown(te.InvalidArgumentError("spec.graph.nodes[3] (add_0): adds bfloat16 ..."))
    assert te.layer_calls.graph_unknown(te.UnimplementedError("spec.graph: not built into this server"))


def test_a_top_level_te_module_is_not_traced():
    with pytest.raises(TypeError, match="not a composite"):
        te_flax.DenseGeneral(features=H).trace(_x())


# ---- DeriveSeed ----------------------------------------------------------------------------------

def test_derive_seed_matches_kernels_rng_h():
    # Published test vectors: FNV-1a 64 of "", "a", "foobar"; splitmix64's first output from state 0.
    assert graph.name_hash("") == 0xcbf29ce484222325
    assert graph.name_hash("a") == 0xaf63dc4c8601ec8c
    assert graph.name_hash("foobar") == 0x85944171f73967e8
    assert graph.mix_bits(0x9e3779b97f4a7c15) == 0xe220a8397b1dcdaf
    # MixBits(FNV-1a("")), one step at a time as rng.h writes it.
    z = 0xcbf29ce484222325
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) % 2**64
    assert z == 0x660642d8f212073f
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) % 2**64
    assert z == 0xf52a15e843e1c34b
    assert graph.mix_bits(0xcbf29ce484222325) == z ^ (z >> 31) == 0xf52a15e9a9b5e89b
    # DeriveSeed(seed, name) as kernels/rng_test.cc asserts it (RngTest.DeriveSeedGivesTheClientsGoldenValues).
    known = {
        (0, ""): 0x8932c885a3fe960e,
        (0, "Dropout_0"): 0x4c3291c547f85d1d,
        (42, "a"): 0x9d55d2a4d2693451,
        (42, "Dropout_0"): 0x44346a0803b9d8dc,
        (42, "DotProductAttention_0"): 0x188db220d65b62e9,
        (42, "TEUnfusedMLP_0/DenseGeneral_0"): 0x9c21957203262f62,
        (2**64 - 1, "foobar"): 0x2fb3c296aca49c6d,
        (7, "step/3"): 0x213ae32250bc5b2b,
        (1, "mlp/intermediate_dropout"): 0xe04ff5fd1b976eac,
    }
    for (seed, name), want in known.items():
        assert graph.derive_seed(seed, name) == want, (seed, name)
    assert graph.derive_seed(2**64 + 42, "a") == known[(42, "a")]   # seeds are uint64
