"""Composite modules as one server graph, against a real te_server: the quickstart's layers equal the same
TE modules run one by one (each its own layer, the glue in numpy), init / apply / value_and_grad are one
call each, and a step moves no activation.

Needs a server that runs te.v1.GraphSpec (LayerSpec.graph); against one that predates it every test
here is skipped with the server's answer.
"""

import numpy as np
import pytest

import helpers
import te_client as te
import te_client.flax as te_flax
import te_client.numpy as jnp
from te_client import client as client_lib, graph
from te_client import linen as nn
from te_client import variables as variables_lib
from te_client.activation import _Activation
from te_client.recipe import DelayedScaling
from test_graph import TEFusedTransformerLayer, TEUnfusedTransformerLayer
from tolerances import BF16, F32, rel_err

B, S, H, HEADS, FFN = 2, 8, 32, 4, 64
KV = H // HEADS
RATE = 0.1
service_pb2 = client_lib.service_pb2


def _x(rng, *shape):
    return rng.standard_normal(shape or (B, S, H)).astype(np.float32)


def _same_value(value, want, y, dy):
    """value = <y, dy>, a sum that cancels: y agreeing within F32 in norm bounds the values' gap by
    F32 * ||y|| * ||dy|| (Cauchy-Schwarz), not by F32 of the (small) sum itself."""
    norms = np.linalg.norm(np.asarray(y, np.float64)) * np.linalg.norm(np.asarray(dy, np.float64))
    return abs(value - want) <= F32 * norms


def _values(session, variables):
    return variables_lib.flatten(session.get_variables(variables, ["params"]))


def _dropout_kept(seed, shape, rate):
    """Ops::DropoutForward's mask: element i kept iff DropoutUniform(seed, i) >= rate (kernels/rng.h)."""
    def mix(z):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
        return z ^ (z >> np.uint64(31))
    with np.errstate(over="ignore"):
        base = mix(np.array([(seed + 0x9e3779b97f4a7c15) % 2**64], np.uint64))
        bits = mix(base ^ np.arange(int(np.prod(shape)), dtype=np.uint64))
    uniform = (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    return (uniform >= np.float32(rate)).reshape(shape)


class OneByOne:
    """The composite's TE modules as layers of their own, given the graph's parameters: the path a
    composite took before it was one graph (each module a call, every activation on the wire)."""

    def __init__(self, session, graph_values, dropout_seed=0, deterministic=True):
        self.session, self.values = session, graph_values
        self.dropout_seed, self.deterministic = dropout_seed, deterministic
        self.params, self.grads = {}, {}

    def _params(self, name, module, inputs):
        if name not in self.params:
            params = module.init(0, *inputs)
            prefix = "params/%s/" % name
            own = {"params/" + k[len(prefix):]: v for k, v in self.values.items() if k.startswith(prefix)}
            if own:
                params = self.session.set_variables(params, own)
            self.params[name] = params
        return self.params[name]

    def _kwargs(self, name, module):
        if not module.dropout_rates():
            return {}
        return {"deterministic": self.deterministic, "rngs": {"dropout": graph.derive_seed(self.dropout_seed, name)}}

    def fwd(self, name, module, *inputs):
        return helpers.first(module.apply(self._params(name, module, inputs), *inputs, **self._kwargs(name, module)))

    def bwd(self, name, module, dy, *inputs):
        params = self._params(name, module, inputs)
        _, (grads, dx) = te.value_and_grad(module.apply)(params, inputs[0], dy, *inputs[1:],
                                                         **self._kwargs(name, module))
        for k, g in variables_lib.flatten(grads).items():
            self.grads["params/%s/%s" % (name, k[len("params/"):])] = g
        return dx

    def dropout(self, name, x, dy=None):
        if self.deterministic:
            return x if dy is None else dy
        kept = _dropout_kept(graph.derive_seed(self.dropout_seed, name), np.shape(x), RATE)
        scale = np.float32(1.0) / (np.float32(1.0) - np.float32(RATE))
        t = np.asarray(x if dy is None else dy, np.float32)
        return te.asarray(np.where(kept, t * scale, np.float32(0.0)).astype(np.float32), te.dtype_of(x))


def _attention():
    return te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, num_gqa_groups=HEADS,
                                       attention_dropout=RATE, attn_mask_type="causal", dtype=te.bfloat16)


def _split_heads(qkv):
    return [np.ascontiguousarray(t) for t in np.split(qkv.reshape(B, S, HEADS, 3 * KV), 3, axis=3)]


def _merge_heads(dq, dk, dv):
    return np.concatenate([np.asarray(dq), np.asarray(dk), np.asarray(dv)], axis=3).reshape(B, S, 3 * H)


def unfused_one_by_one(run, x, dy=None):
    """TEUnfusedTransformerLayer (use_te_attention=True): y, or (value, dx) with run.grads filled."""
    ln0, dg0, dpa, dg1 = (te_flax.LayerNorm(epsilon=1e-5), te_flax.DenseGeneral(features=3 * H), _attention(),
                          te_flax.DenseGeneral(features=H))
    ln1, m0, act, m1 = (te_flax.LayerNorm(epsilon=1e-5), te_flax.DenseGeneral(features=FFN), _Activation(("gelu",)),
                        te_flax.DenseGeneral(features=H))
    l0 = run.fwd("LayerNorm_0", ln0, x)
    qkv = run.fwd("DenseGeneral_0", dg0, l0)
    q, k, v = _split_heads(qkv)
    att = run.fwd("DotProductAttention_0", dpa, q, k, v)
    a = att.reshape(B, S, H)
    p = run.fwd("DenseGeneral_1", dg1, a)
    h1 = x + run.dropout("Dropout_0", p)
    l1 = run.fwd("LayerNorm_1", ln1, h1)
    f0 = run.fwd("TEUnfusedMLP_0/DenseGeneral_0", m0, l1)
    f1 = run.fwd("TEUnfusedMLP_0/activation_0", act, f0)
    f2 = run.fwd("TEUnfusedMLP_0/DenseGeneral_1", m1, f1)
    y = f2 + h1
    if dy is None:
        return y
    d = run.bwd("TEUnfusedMLP_0/DenseGeneral_1", m1, dy, f1)
    d = run.bwd("TEUnfusedMLP_0/activation_0", act, d, f0)
    d = run.bwd("TEUnfusedMLP_0/DenseGeneral_0", m0, d, l1)
    dh1 = dy + run.bwd("LayerNorm_1", ln1, d, h1)
    da = run.bwd("DenseGeneral_1", dg1, run.dropout("Dropout_0", p, dh1), a)
    dq, dk, dv = run.bwd("DotProductAttention_0", dpa, da.reshape(att.shape), q, k, v)
    dl0 = run.bwd("DenseGeneral_0", dg0, _merge_heads(dq, dk, dv), l0)
    dx = dh1 + run.bwd("LayerNorm_0", ln0, dl0, x)
    return float(np.vdot(np.asarray(y, np.float64), np.asarray(dy, np.float64))), dx


def fused_one_by_one(run, x, dy=None):
    """TEFusedTransformerLayer: y, or (value, dx) with run.grads filled."""
    lndg = te_flax.LayerNormDenseGeneral(features=3 * H, epsilon=1e-5, use_bias=True, return_layernorm_output=False)
    dpa, dg0 = _attention(), te_flax.DenseGeneral(features=H)
    mlp = te_flax.LayerNormMLP(intermediate_dim=FFN, epsilon=1e-5, use_bias=True, activations=("gelu",),
                               intermediate_dropout_rate=0.0, return_layernorm_output=False)
    qkv = run.fwd("LayerNormDenseGeneral_0", lndg, x)
    q, k, v = _split_heads(qkv)
    att = run.fwd("DotProductAttention_0", dpa, q, k, v)
    a = att.reshape(B, S, H)
    p = run.fwd("DenseGeneral_0", dg0, a)
    h1 = x + run.dropout("Dropout_0", p)
    y = run.fwd("LayerNormMLP_0", mlp, h1) + h1
    if dy is None:
        return y
    dh1 = dy + run.bwd("LayerNormMLP_0", mlp, dy, h1)
    da = run.bwd("DenseGeneral_0", dg0, run.dropout("Dropout_0", p, dh1), a)
    dq, dk, dv = run.bwd("DotProductAttention_0", dpa, da.reshape(att.shape), q, k, v)
    dx = dh1 + run.bwd("LayerNormDenseGeneral_0", lndg, _merge_heads(dq, dk, dv), x)
    return float(np.vdot(np.asarray(y, np.float64), np.asarray(dy, np.float64))), dx


LAYERS = {"unfused": (lambda: TEUnfusedTransformerLayer(H, FFN, HEADS), unfused_one_by_one),
          "fused": (lambda: TEFusedTransformerLayer(H, FFN, HEADS), fused_one_by_one)}


# ---- the quickstart's layers against their modules one by one --------------------------------

def test_variables_are_named_as_flax_names_them(session, rng):
    params = TEUnfusedTransformerLayer(H, FFN, HEADS).init(0, _x(rng), attention_mask=None, deterministic=False)
    dense = lambda i, o: {"bias": (o,), "kernel": (i, o)}
    norm = {"ln_bias": (H,), "scale": (H,)}
    assert te.tree_map(lambda v: v.shape, params) == {"params": {
        "DenseGeneral_0": dense(H, 3 * H), "DenseGeneral_1": dense(H, H), "LayerNorm_0": norm, "LayerNorm_1": norm,
        "TEUnfusedMLP_0": {"DenseGeneral_0": dense(H, FFN), "DenseGeneral_1": dense(FFN, H)}}}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_module_node_is_initialised_with_its_derived_seed(session, rng, layer):
    composite = LAYERS[layer][0]()
    x, key = _x(rng), 1234
    values = _values(session, composite.init(key, x, deterministic=True))
    traced = composite.trace(x, deterministic=True)
    seen = 0
    for node in traced.spec.nodes:
        if node.WhichOneof("op") != "module":
            continue
        # The node's own LayerSpec as a layer of its own, seeded DeriveSeed(key, node name).
        response = session.call("InitLayer", service_pb2.InitLayerRequest(
            spec=node.module, seed=graph.derive_seed(key, node.name), input_dtype=te.dtypes.FLOAT32,
            input_shape=traced.shapes[node.inputs[0]]))
        alone = session.call("GetVariables", service_pb2.GetVariablesRequest(layer_id=response.layer_id,
                                                                             collections=["params"]))
        for v in alone.variables:
            name = "params/%s/%s" % (node.name, v.path)
            np.testing.assert_array_equal(values[name], session.receive(v.value, name), err_msg=name)
            seen += 1
    assert seen == len(values)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_apply_and_value_and_grad_equal_the_modules_one_by_one(session, rng, layer):
    make, one_by_one = LAYERS[layer]
    composite = make()
    x, dy = _x(rng), _x(rng)
    params = composite.init(0, x, attention_mask=None, deterministic=True)
    values = _values(session, params)
    y = composite.apply(params, x, attention_mask=None, deterministic=True)
    assert rel_err(y, one_by_one(OneByOne(session, values), x)) < F32

    value, (grads, dx) = te.value_and_grad(composite.apply)(params, x, dy, attention_mask=None, deterministic=True)
    run = OneByOne(session, values)
    want_value, want_dx = one_by_one(run, x, dy)
    assert _same_value(value, want_value, y, dy)
    assert rel_err(dx, want_dx) < F32
    grads = variables_lib.flatten(grads)
    assert set(grads) == set(run.grads) == set(values)
    for name, g in grads.items():
        assert rel_err(g, run.grads[name]) < F32, name


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_dropout_follows_derived_seeds(session, rng, layer):
    # DotProductAttention_0 drops with DeriveSeed(seed, its name) as its own dropout seed; Dropout_0 is
    # inverted dropout drawn with DeriveSeed(seed, "Dropout_0").
    make, one_by_one = LAYERS[layer]
    composite = make()
    x, dy, seed = _x(rng), _x(rng), 77
    params = composite.init(0, x, attention_mask=None, deterministic=False)
    values = _values(session, params)
    y = composite.apply(params, x, deterministic=False, rngs={"dropout": seed})
    assert rel_err(y, one_by_one(OneByOne(session, values, seed, deterministic=False), x)) < F32
    assert rel_err(y, composite.apply(params, x, deterministic=False, rngs={"dropout": seed + 1})) > 1e-3
    assert rel_err(y, composite.apply(params, x, deterministic=True)) > 1e-3

    value, (grads, dx) = te.value_and_grad(composite.apply)(params, x, dy, deterministic=False, rngs={"dropout": seed})
    run = OneByOne(session, values, seed, deterministic=False)
    want_value, want_dx = one_by_one(run, x, dy)
    assert _same_value(value, want_value, y, dy) and rel_err(dx, want_dx) < F32
    for name, g in variables_lib.flatten(grads).items():
        assert rel_err(g, run.grads[name]) < F32, name


def test_bf16_apply_equals_the_modules_one_by_one(session, rng):
    composite = TEUnfusedTransformerLayer(H, FFN, HEADS)
    x = te.asarray(_x(rng), te.bfloat16)
    params = composite.init(0, x, attention_mask=None, deterministic=True)
    y = composite.apply(params, x, deterministic=True)
    assert te.dtype_of(y) == "bfloat16"
    assert rel_err(y, unfused_one_by_one(OneByOne(session, _values(session, params)), x)) < BF16


def test_fp8_metas_per_module_node(session, rng):
    composite = TEFusedTransformerLayer(H, FFN, HEADS)
    x, dy = _x(rng), _x(rng)
    recipe = DelayedScaling(amax_history_len=16)
    with te.autocast(enabled=True, recipe=recipe):
        params = composite.init(0, x, deterministic=True)
        y = composite.apply(params, x, deterministic=True)
        te.value_and_grad(composite.apply)(params, x, dy, deterministic=True)
    fp8 = te.tree_map(lambda v: v.shape, params)["fp8_metas"]
    assert set(fp8) == {"LayerNormDenseGeneral_0", "DenseGeneral_0", "LayerNormMLP_0"}
    assert fp8["DenseGeneral_0"]["kernel_amax_history"] == (16,)
    # A forward moves no FP8 state, so it equals the modules one by one, each under its own fresh state.
    with te.autocast(enabled=True, recipe=recipe):
        alone = fused_one_by_one(OneByOne(session, _values(session, params)), x)
    assert rel_err(y, alone) < F32


# ---- one call per step, no activation on the wire --------------------------------------------------

class _Meter:
    """The calls a block makes and the tensors it moves (either way, by any transport)."""

    def __init__(self, session, monkeypatch):
        self.session, self.log = session, []
        for name in ("call", "call_async"):   # the speedometer's steps go out async
            real = getattr(session, name)
            monkeypatch.setattr(session, name, lambda method, request, *a, real=real, **k: (
                self.log.append((method, request)), real(method, request, *a, **k))[1])

    def __enter__(self):
        del self.log[:]
        self.before = sum(self.session.transport_counts.as_dict().values())
        return self

    def __exit__(self, *exc):
        self.calls = [method for method, _ in self.log]
        self.requests = [request for _, request in self.log]
        self.moved = sum(self.session.transport_counts.as_dict().values()) - self.before


def test_one_call_per_step_and_no_activation_on_the_wire(session, rng, monkeypatch, capsys):
    composite = TEUnfusedTransformerLayer(H, FFN, HEADS)
    x, dy = _x(rng), _x(rng)
    meter = _Meter(session, monkeypatch)
    with meter:
        variables = composite.init(0, x, attention_mask=None, deterministic=False)
    assert (meter.calls, meter.moved) == (["InitLayer"], 0)
    with meter:
        composite.apply(variables, x, deterministic=True)
    assert (meter.calls, meter.moved) == (["Forward"], 2)                      # x in, y out
    with meter:
        te.value_and_grad(composite.apply)(variables, x, dy, rngs={"dropout": 1})
    assert (meter.calls, meter.moved) == (["ForwardBackward"], 3 + len(variables_lib.flatten(variables)))
    # The speedometer uploads x and dy once (then deletes them); each step is one call that moves no tensor.
    with meter:
        te.speedometer(model_apply_fn=composite.apply, variables=variables, input=x, output_grad=dy,
                       forward_kwargs={"deterministic": False}, rngs={"dropout": 7}, warmup_iters=2, timing_iters=3)
    assert (meter.calls, meter.moved) == (["ForwardBackward"] * 5 + ["DeleteTensor"] * 2, 2)
    for step in meter.requests[:5]:   # named by id: nothing is copied into a step, whatever the transport
        assert [t.WhichOneof("data") for b in step.micro_batches for t in (b.x, b.dy)] == ["resident_id"] * 2
        assert not step.return_dx and not step.return_grads
    assert "Mean time: " in capsys.readouterr().out


# ---- masks, shapes, structure ------------------------------------------------------------------

class PaddedAttention(nn.Module):
    @nn.compact
    def __call__(self, x, attention_mask=None, deterministic=False):
        q = te_flax.DenseGeneral(features=(HEADS, KV))(x)
        return te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, attn_mask_type="padding")(
            q, q, q, mask=attention_mask, deterministic=deterministic)


def test_the_request_mask_reaches_the_module_that_reads_it(session, rng):
    composite, x = PaddedAttention(), _x(rng)
    mask = np.zeros((B, 1, S, S), bool)
    mask[1, :, :, 5:] = mask[1, :, 5:, :] = True   # sequence 1 has 5 tokens (TE: True = masked out)
    params = composite.init(0, x, attention_mask=mask)
    y = composite.apply(params, x, attention_mask=mask, deterministic=True)
    run = OneByOne(session, _values(session, params))
    q = run.fwd("DenseGeneral_0", te_flax.DenseGeneral(features=(HEADS, KV)), x)
    dpa = te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, attn_mask_type="padding")
    want = dpa.apply(dpa.init(0, q, q, q), q, q, q, mask=mask, deterministic=True)
    assert rel_err(y[:, :5], np.asarray(want)[:, :5]) < F32 and rel_err(y[0], np.asarray(want)[0]) < F32


def test_a_causal_mask_node_is_the_modules_own_causality(session, rng):
    class Causal(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=False):
            mask = nn.make_causal_mask(x[..., 0], dtype=jnp.bool_)
            q = te_flax.DenseGeneral(features=(HEADS, KV))(x)
            return te_flax.DotProductAttention(head_dim=KV, num_attention_heads=HEADS, attn_mask_type="causal")(
                q, q, q, mask=mask, deterministic=deterministic)

    composite, x = Causal(), _x(rng)
    params = composite.init(0, x)
    assert composite.trace(x).node("DotProductAttention_0").mask == "causal_mask_0"
    run = OneByOne(session, _values(session, params))
    q = run.fwd("DenseGeneral_0", te_flax.DenseGeneral(features=(HEADS, KV)), x)
    want = helpers.attention(q, q, q, helpers.causal_mask(B, S))
    assert rel_err(composite.apply(params, x, deterministic=True), want) < F32


def test_composite_of_one_module_equals_the_module(session, rng):
    class Wrapper(nn.Module):
        @nn.compact
        def __call__(self, x):
            return te_flax.DenseGeneral(features=16)(x)

    x, dy = _x(rng), _x(rng, B, S, 16)
    inner, outer = te_flax.DenseGeneral(features=16), Wrapper()
    p_inner, p_outer = inner.init(3, x), outer.init(3, x)
    p_outer = session.set_variables(p_outer, {"params": {"DenseGeneral_0": session.get_variables(p_inner)["params"]}})
    np.testing.assert_array_equal(outer.apply(p_outer, x), inner.apply(p_inner, x))
    v_in, (g_in, dx_in) = te.value_and_grad(inner.apply)(p_inner, x, dy)
    v_out, (g_out, dx_out) = te.value_and_grad(outer.apply)(p_outer, x, dy)
    assert v_out == pytest.approx(v_in, rel=1e-6)
    np.testing.assert_allclose(dx_out, dx_in, rtol=1e-6)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(g_out["params"]["DenseGeneral_0"][name], g_in["params"][name], rtol=1e-6)


def test_value_and_grad_matches_central_differences(session, rng):
    composite, x, dy = TEFusedTransformerLayer(H, FFN, HEADS), _x(rng), _x(rng)
    params = composite.init(0, x, deterministic=True)
    _, (grads, dx) = te.value_and_grad(composite.apply)(params, x, dy, deterministic=True)
    helpers.check_input_gradient(lambda t: composite.apply(params, t, deterministic=True), x, dx, dy, rng)
    helpers.check_param_gradient(session, composite, params, grads, x, dy, rng,
                                 "params/LayerNormDenseGeneral_0/kernel", {"deterministic": True})


def test_apply_at_another_batch_size_adds_a_graph_over_the_same_variables(session, rng):
    # Flax inits on a dummy batch and applies to any: the composite is traced again for
    # the new shape and added to its layer (AddGraph), reading the same variables.
    composite = TEFusedTransformerLayer(H, FFN, HEADS)
    x = _x(rng)
    params = composite.init(0, x, deterministic=True)
    small = composite.apply(params, x[:1], deterministic=True)
    assert small.shape == (1,) + x.shape[1:]
    np.testing.assert_allclose(small, composite.apply(params, x, deterministic=True)[:1], rtol=1e-5, atol=1e-6)


def test_apply_with_another_structures_variables_is_failed_precondition(session, rng):
    x = _x(rng)
    params = te_flax.DenseGeneral(features=8).init(0, x)
    with pytest.raises(te.FailedPreconditionError, match="DenseGeneral"):
        TEFusedTransformerLayer(H, FFN, HEADS).apply(params, x, deterministic=True)


def test_a_module_reading_ln_out_is_refused_by_the_server(session, rng):
    class UsesLnOut(nn.Module):
        @nn.compact
        def __call__(self, x):
            y, ln_out = te_flax.LayerNormDenseGeneral(features=H, return_layernorm_output=True)(x)
            return y + ln_out

    assert _table_kinds(UsesLnOut().trace(_x(rng))) == ["layer_norm_dense_general", "add"]
    with pytest.raises(te.InvalidArgumentError, match="ln_out"):
        UsesLnOut().init(0, _x(rng))


def _table_kinds(traced):
    return [n.module.WhichOneof("module") if n.WhichOneof("op") == "module" else n.WhichOneof("op")
            for n in traced.spec.nodes]


def test_speedometer_times_single_and_composite_modules(session, rng, capsys, server_device):
    x, dy = _x(rng), _x(rng)
    single = te_flax.DenseGeneral(features=H)
    timed = te.speedometer(model_apply_fn=single.apply, variables=single.init(0, x), input=x, output_grad=dy,
                           warmup_iters=1, timing_iters=2)
    assert timed["steps"] == 2 and timed["mean_ms"] > 0 and timed["timed_by"] == "client"
    composite = TEUnfusedTransformerLayer(H, FFN, HEADS)
    variables = composite.init(0, x, attention_mask=None, deterministic=False)
    on_server = te.speedometer(model_apply_fn=composite.apply, variables=variables, input=x, output_grad=dy,
                               forward_kwargs={"attention_mask": None, "deterministic": False},
                               rngs={"dropout": 7}, warmup_iters=1, timing_iters=3, server_side=True)
    assert on_server["steps"] == 3 and on_server["timed_by"] == server_device
    assert capsys.readouterr().out.count("Mean time: ") == 2
