"""A zoo of models written as Flax users write them, run through te_client end to end.

Each model inits, applies at two batch sizes, and trains with
te.value_and_grad + train_step without FP8 (autocast off) and under
DelayedScaling; its checkpoint resumes bit for bit. Losses and gradients are
checked against the same loss function's traced graph evaluated in float64 by
graph_reference.py (a reverse-mode numpy evaluator; test_numpy_ops.py ties
that graph to the code run eagerly on numpy). Tolerances: tolerances.py
(ZOO_LOSS, ZOO_GRAD: float32 server compute against float64)."""
import os

import numpy as np
import pytest

import graph_reference
import te_client as te
import te_client.flax as te_flax
import te_client.numpy as jnp
import te_client.optim as optax
from te_client import linen as nn, transforms
from te_client import variables as variables_lib
from te_client.recipe import DelayedScaling
from tolerances import ZOO_GRAD, ZOO_LOSS, rel_err

V, D, S = 11, 16, 6


class MLPClassifier(nn.Module):
    hidden: int = 32
    classes: int = 5

    @nn.compact
    def __call__(self, x):
        x = te_flax.DenseGeneral(features=self.hidden)(x)      # TE: FP8 under DelayedScaling
        x = nn.relu(x)
        return nn.Dense(self.classes)(x)


def mlp_loss(params, x, labels, model=MLPClassifier()):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class GPTBlock(nn.Module):
    heads: int = 2

    @nn.compact
    def __call__(self, tokens, causal):
        h = nn.Embed(V, D)(tokens)
        x = nn.RMSNorm()(h)
        qkv = nn.Dense(3 * D, use_bias=False)(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        b, s = tokens.shape
        q, k, v = (t.reshape(b, s, self.heads, D // self.heads) for t in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // self.heads)
        logits = jnp.where(causal > 0, logits, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(logits, axis=-1), v).reshape(b, s, D)
        h = h + nn.Dense(D, use_bias=False)(att)
        x = nn.RMSNorm()(h)
        gate, up = nn.Dense(2 * D, use_bias=False)(x), nn.Dense(2 * D, use_bias=False)(x)
        h = h + nn.Dense(D, use_bias=False)(nn.silu(gate) * up)                   # SwiGLU
        return nn.Dense(V)(nn.RMSNorm()(h))


def gpt_loss(params, tokens, causal, labels, model=GPTBlock()):
    logits = model.apply(params, tokens, causal)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x, pad):
        h = nn.Dense(D)(x)
        scores = jnp.einsum("bqd,bkd->bqk", h, h) / np.sqrt(D)
        scores = jnp.where(pad[:, None, :] > 0, scores, -1e9)          # padded keys get no weight
        h = h + jnp.einsum("bqk,bkd->bqd", nn.softmax(scores), nn.Dense(D)(h))
        pooled = jnp.sum(h * pad[..., None], axis=1) / jnp.sum(pad, axis=1, keepdims=True)
        return nn.Dense(1)(nn.gelu(pooled))[:, 0]


def encoder_loss(params, x, pad, target, model=Encoder()):
    y = model.apply(params, x, pad)
    return jnp.mean((y - target) ** 2)


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(24, kernel_init=nn.initializers.normal(0.3))(x)
        scale = self.param("temperature", nn.initializers.ones, (1,))
        return nn.Dense(3)(nn.tanh(x) * scale)


def custom_loss(params, x, target, model=Regressor()):
    pred = model.apply(params, x)
    d = pred - target
    huber = jnp.where(jnp.abs(d) < 0.5, 0.5 * d * d, 0.5 * (jnp.abs(d) - 0.25))
    loss = jnp.mean(huber) + 1e-2 * jnp.mean(jnp.square(pred))
    return loss, {"pred": pred, "abs_err": jnp.mean(jnp.abs(d), axis=0)}


def _batch(name, rng, b):
    if name == "mlp":
        return (rng.standard_normal((b, 12)).astype(np.float32), rng.integers(0, 5, b).astype(np.int32))
    if name == "gpt":
        causal = np.broadcast_to(np.tril(np.ones((S, S), np.float32)), (b, 1, S, S)).copy()
        return (rng.integers(0, V, (b, S)).astype(np.int32), causal, rng.integers(0, V, (b, S)).astype(np.int32))
    if name == "encoder":
        pad = (np.arange(S)[None, :] < rng.integers(2, S + 1, (b, 1))).astype(np.float32)
        return (rng.standard_normal((b, S, 8)).astype(np.float32), pad, rng.standard_normal(b).astype(np.float32))
    return (rng.standard_normal((b, 7)).astype(np.float32), rng.standard_normal((b, 3)).astype(np.float32))


ZOO = {"mlp": (MLPClassifier, mlp_loss, False, True), "gpt": (GPTBlock, gpt_loss, False, False),
       "encoder": (Encoder, encoder_loss, False, False), "custom": (Regressor, custom_loss, True, False)}


def _init(name, session, batch, seed=3):
    cls, loss_fn, has_aux, params_only = ZOO[name]
    model = cls()
    variables = model.init(seed, *batch[:-1]) if name != "mlp" else model.init(seed, batch[0])
    params = variables["params"] if params_only else variables
    return model, variables, params


@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_zoo_model_applies_at_two_batch_sizes_and_its_loss_and_grads_match_float64(name, session, rng):
    cls, loss_fn, has_aux, _ = ZOO[name]
    model, variables, params = _init(name, session, _batch(name, rng, 4))
    for b in (4, 3):                                    # init's batch, then another: AddGraph
        batch = _batch(name, rng, b)
        args = batch[:1] if name == "mlp" else batch[:-1]
        y = model.apply(variables, *args)
        assert np.shape(y)[0] == b and np.all(np.isfinite(np.asarray(y, np.float64)))
        out, grads = te.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
        loss, aux = out if has_aux else (out, None)
        traced = transforms.make_graph(loss_fn, params, *batch, has_aux=has_aux)
        values = variables_lib.flatten(variables.fetch(["params"]))
        inputs = {n: v for n, v in zip(["x"] + ["extra_inputs[%d]" % i for i in range(len(batch) - 1)], batch)}
        want_loss, want_grads, _, want_aux = graph_reference.loss_and_grads(traced, values, inputs)
        assert abs(loss - want_loss) <= ZOO_LOSS * max(1.0, abs(want_loss)), (name, b, loss, want_loss)
        flat = variables_lib.flatten(grads if "params" in grads else {"params": grads})
        assert set(flat) == set(want_grads), (sorted(flat), sorted(want_grads))
        for key, want in want_grads.items():
            assert rel_err(flat[key], want) <= ZOO_GRAD, (name, b, key, rel_err(flat[key], want))
        if has_aux:
            assert rel_err(aux["pred"], want_aux[0]) <= ZOO_LOSS
            assert rel_err(aux["abs_err"], want_aux[1]) <= ZOO_LOSS


def _train(name, session, rng_seed, steps, recipe=None, state_from=None):
    rng = np.random.default_rng(rng_seed)
    cls, loss_fn, has_aux, _ = ZOO[name]
    batches = [_batch(name, rng, 4) for _ in range(steps)]
    model, variables, params = _init(name, session, batches[0])
    state = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    losses = []
    for batch in batches:
        state, metrics = te.train_step(state, *batch, loss_fn=loss_fn, has_aux=has_aux)
        losses.append(metrics["loss"])
    return state, losses


@pytest.mark.parametrize("name", sorted(ZOO))
def test_a_zoo_model_trains_and_its_checkpoint_resumes_bit_for_bit(name, client, rng, tmp_path):
    with client.session() as session:
        state, losses = _train(name, session, 7, 4)
        assert losses[-1] < losses[0], losses
    # 2 steps, a checkpoint file, 2 more; against a fresh session restored from the file.
    rng2 = np.random.default_rng(11)
    cls, loss_fn, has_aux, _ = ZOO[name]
    batches = [_batch(name, rng2, 4) for _ in range(4)]
    path = str(tmp_path / "state.npz")
    with client.session() as session:
        model, variables, params = _init(name, session, batches[0])
        state = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        for batch in batches[:2]:
            state, _ = te.train_step(state, *batch, loss_fn=loss_fn, has_aux=has_aux)
        te.save_checkpoint(path, state)
        straight = [te.train_step(state, *b, loss_fn=loss_fn, has_aux=has_aux) for b in batches[2:3]][0]
        state2, m2 = straight
        state3, m3 = te.train_step(state2, *batches[3], loss_fn=loss_fn, has_aux=has_aux)
        want = variables_lib.flatten(state3.variables.fetch(["params"]))
    with client.session() as session:
        model, variables, params = _init(name, session, batches[0], seed=99)   # other values: the file's win
        fresh = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        resumed = te.restore_checkpoint(path, fresh)
        assert resumed.step == 2
        r2, n2 = te.train_step(resumed, *batches[2], loss_fn=loss_fn, has_aux=has_aux)
        r3, n3 = te.train_step(r2, *batches[3], loss_fn=loss_fn, has_aux=has_aux)
        got = variables_lib.flatten(r3.variables.fetch(["params"]))
    assert (n2["loss"], n3["loss"]) == (m2["loss"], m3["loss"])
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def test_train_step_under_delayed_scaling_moves_fp8_metas_and_differs_from_bf16(client, rng):
    batches = [_batch("mlp", rng, 4) for _ in range(3)]
    runs = {}
    for fp8 in (False, True):
        with client.session(recipes=[DelayedScaling()], policy="emulate") as session:
            with te.autocast(enabled=fp8, recipe=DelayedScaling(amax_history_len=4) if fp8 else None):
                model = MLPClassifier()
                variables = model.init(5, batches[0][0])
                state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
                first = variables.fetch()
                losses = []
                for batch in batches:
                    state, metrics = te.train_step(state, *batch, loss_fn=lambda p, x, y: mlp_loss(p["params"], x, y))
                    losses.append(metrics["loss"])
                runs[fp8] = losses
                if fp8:
                    after = variables_lib.flatten(state.variables.fetch(["fp8_metas"]))
                    before = variables_lib.flatten({"fp8_metas": first["fp8_metas"]})
                    assert any(not np.array_equal(after[k], before[k]) for k in before), "fp8_metas did not move"
                    # the old variables are values: still what init made
                    np.testing.assert_array_equal(
                        variables_lib.flatten(variables.fetch(["fp8_metas"]))[sorted(before)[0]],
                        before[sorted(before)[0]])
    assert runs[True] != runs[False]
    assert rel_err(runs[True], runs[False]) < 0.2
