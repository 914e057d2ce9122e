"""A zoo of models written as Flax users write them, run through te_client end to end.

Each model inits, applies at two batch sizes, and trains with te.value_and_grad
+ TrainState.apply_gradients and with train_step (alternating), in float32,
with bf16 inputs and under FP8 DelayedScaling; its checkpoint resumes bit for
bit. Losses and gradients are checked at every step against the same loss
function's traced graph evaluated in float64 by graph_reference.py (a
reverse-mode numpy evaluator; test_numpy_ops.py ties that graph to the code
run eagerly on numpy). Tolerances: tolerances.py (ZOO_*).

Labels are one-hot floats (optax.softmax_cross_entropy): te_server takes a
step's extra inputs in x's dtype, which int labels beside a float x are not.

bf16: every input is bfloat16. The MLP's TE
DenseGeneral then computes in bf16 (TE's rule: the input's dtype), and the GPT
block is built with dtype=bfloat16 (Flax's activation dtype: its norms, TE
projections and attention compute in bf16, its logits in float32); the encoder
and the regressor have float32 params, so Flax's promotion computes them in
float32 from the bf16-rounded inputs. FP8: the MLP and the GPT block hold TE
modules (te_flax.DenseGeneral), whose GEMMs run in FP8 under DelayedScaling
(fp8_metas move); the other two have none, so there FP8 changes nothing.

Shapes keep every TE GEMM's dimensions multiples of 16 (FP8 GEMMs on the GPU
need them), so the MLP and GPT cases also run on the H200: see conftest.py
($TE_SERVER_ADDRESS)."""
import functools

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
from tolerances import ZOO, rel_err

V, D, S = 11, 32, 8
BATCHES = {"mlp": (32, 16), "gpt": (4, 2), "encoder": (4, 3), "custom": (4, 3)}   # init's, then another


class MLPClassifier(nn.Module):
    hidden: int = 64
    classes: int = 5

    @nn.compact
    def __call__(self, x):
        x = te_flax.DenseGeneral(features=self.hidden)(x)      # TE: FP8 under DelayedScaling
        x = nn.relu(x)
        return nn.Dense(self.classes)(x)


def mlp_loss(params, x, one_hot, model=MLPClassifier()):
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy(logits, one_hot).mean()


class GPTBlock(nn.Module):
    """A decoder block over hidden states x [b, s, D], then logits over V."""
    heads: int = 2
    dtype: object = None          # the activations' dtype, as Flax's modules take it

    @nn.compact
    def __call__(self, x, causal):
        dense = functools.partial(te_flax.DenseGeneral, use_bias=False)   # TE: FP8 under DelayedScaling
        h = x if self.dtype is None else x.astype(self.dtype)
        y = nn.RMSNorm(dtype=self.dtype)(h)
        qkv = dense(3 * D)(y)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, D // self.heads) for t in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // self.heads)
        logits = jnp.where(causal > 0, logits, -1e9)
        att = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(logits, axis=-1), v).reshape(b, s, D)
        h = h + dense(D)(att)
        y = nn.RMSNorm(dtype=self.dtype)(h)
        gate, up = dense(2 * D)(y), dense(2 * D)(y)
        h = h + dense(D)(nn.silu(gate) * up)                   # SwiGLU
        return nn.Dense(V, dtype=np.float32)(nn.RMSNorm(dtype=self.dtype)(h))


def gpt_loss(params, x, causal, one_hot, model=GPTBlock()):
    logits = model.apply(params, x, causal)
    return optax.softmax_cross_entropy(logits, one_hot).mean()


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


def _batch(name, rng, b, bf16=False):
    """A batch: the model's inputs, then its labels or targets (float ones bfloat16 with bf16)."""
    if name == "mlp":
        # Labels one-hot, in x's dtype: te_server takes a step's extra inputs in x's dtype.
        arrays = (rng.standard_normal((b, 32)).astype(np.float32), np.eye(5, dtype=np.float32)[rng.integers(0, 5, b)])
    elif name == "gpt":
        causal = np.broadcast_to(np.tril(np.ones((S, S), np.float32)), (b, 1, S, S)).copy()
        arrays = (rng.standard_normal((b, S, D)).astype(np.float32), causal,
                  np.eye(V, dtype=np.float32)[rng.integers(0, V, (b, S))])
    elif name == "encoder":
        pad = (np.arange(S)[None, :] < rng.integers(2, S + 1, (b, 1))).astype(np.float32)
        arrays = (rng.standard_normal((b, S, 8)).astype(np.float32), pad, rng.standard_normal(b).astype(np.float32))
    else:
        arrays = (rng.standard_normal((b, 7)).astype(np.float32), rng.standard_normal((b, 3)).astype(np.float32))
    if not bf16:
        return arrays
    return tuple(te.asarray(a, te.bfloat16) if a.dtype == np.float32 else a for a in arrays)


# name -> (model class, loss function, has_aux, state.params is variables["params"] rather than variables)
ZOO_MODELS = {"mlp": (MLPClassifier, mlp_loss, False, True), "gpt": (GPTBlock, gpt_loss, False, False),
              "encoder": (Encoder, encoder_loss, False, False), "custom": (Regressor, custom_loss, True, False)}
TE_MODELS = ("gpt", "mlp")          # hold TE modules: FP8 is real there
PRECISIONS = ("float32", "bf16", "fp8")


def _model(name, precision="float32"):
    """(model, its loss function bound to it, has_aux, params_only)."""
    cls, loss_fn, has_aux, params_only = ZOO_MODELS[name]
    model = cls(dtype=te.bfloat16) if name == "gpt" and precision == "bf16" else cls()
    return model, functools.partial(loss_fn, model=model), has_aux, params_only


def _init(name, model, batch, params_only, seed=3):
    variables = model.init(seed, *(batch[:1] if name == "mlp" else batch[:-1]))
    return variables, (variables["params"] if params_only else variables)


def _inputs(batch):
    return {n: np.asarray(v) for n, v in zip(["x"] + ["extra_inputs[%d]" % i for i in range(len(batch) - 1)], batch)}


def _reference(loss_fn, has_aux, params, variables, batch):
    """(loss, {"params/...": grad}, aux outputs) of the traced loss in float64 at `variables`' values."""
    traced = transforms.make_graph(loss_fn, params, *batch, has_aux=has_aux)
    values = variables_lib.flatten(variables.fetch(["params"]))
    loss, grads, _, aux = graph_reference.loss_and_grads(traced, values, _inputs(batch))
    return loss, grads, aux


def _check_loss(name, what, loss, want, tolerance):
    assert abs(loss - want) <= tolerance * max(1.0, abs(want)), (name, what, loss, want)


def _check_grads(name, what, grads, want, tolerance):
    flat = variables_lib.flatten(grads if "params" in grads else {"params": grads})
    assert set(flat) == set(want), (sorted(flat), sorted(want))
    for key, w in want.items():
        assert rel_err(flat[key], w) <= tolerance, (name, what, key, rel_err(flat[key], w))


def _matmuls():
    # float32 GEMMs as float32 on every device (a GPU's default may take TF32 or bf16 passes).
    return te.default_matmul_precision("highest")


def _autocast(precision):
    if precision == "fp8":
        return te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=4))
    return te.autocast(enabled=False)


@pytest.mark.parametrize("name", sorted(ZOO_MODELS))
def test_a_zoo_model_applies_at_two_batch_sizes_and_its_loss_and_grads_match_float64(name, session, rng):
    model, loss_fn, has_aux, params_only = _model(name)
    tol_loss, tol_grad = ZOO["float32"]
    sizes = BATCHES[name]
    with _matmuls():
        variables, params = _init(name, model, _batch(name, rng, sizes[0]), params_only)
        for b in sizes:                                  # init's batch, then another: AddGraph
            batch = _batch(name, rng, b)
            y = model.apply(variables, *(batch[:1] if name == "mlp" else batch[:-1]))
            assert np.shape(y)[0] == b and np.all(np.isfinite(np.asarray(y, np.float64)))
            out, grads = te.value_and_grad(loss_fn, has_aux=has_aux)(params, *batch)
            loss, aux = out if has_aux else (out, None)
            want_loss, want_grads, want_aux = _reference(loss_fn, has_aux, params, variables, batch)
            _check_loss(name, b, loss, want_loss, tol_loss)
            _check_grads(name, b, grads, want_grads, tol_grad)
            if has_aux:   # the graph's aux outputs are the aux tree's leaves, keys sorted
                assert rel_err(aux["abs_err"], want_aux[0]) <= tol_loss
                assert rel_err(aux["pred"], want_aux[1]) <= tol_loss


def _step(name, state, loss_fn, has_aux, batch, step, precision):
    """One training step, checked against float64 at the params it starts from:
    te.value_and_grad then state.apply_gradients on even steps, train_step on odd ones."""
    tol_loss, tol_grad = ZOO[precision]
    want_loss, want_grads, _ = _reference(loss_fn, has_aux, state.params, state.variables, batch)
    if step % 2 == 0:
        out, grads = te.value_and_grad(loss_fn, has_aux=has_aux)(state.params, *batch)
        loss = out[0] if has_aux else out
        _check_grads(name, (precision, step), grads, want_grads, tol_grad)
        state = state.apply_gradients(grads=grads)
    else:
        state, metrics = te.train_step(state, *batch, loss_fn=loss_fn, has_aux=has_aux)
        assert metrics["applied"] and metrics["count"] == step + 1
        loss = metrics["loss"]
    _check_loss(name, (precision, step), loss, want_loss, tol_loss)
    assert state.step == step + 1
    return state, loss


def _session(client):
    return client.session(recipes=[DelayedScaling()], policy="emulate")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(ZOO_MODELS))
def test_a_zoo_model_trains_and_its_checkpoint_resumes_bit_for_bit(name, precision, client, rng, tmp_path):
    batch = _batch(name, rng, BATCHES[name][0], bf16=precision == "bf16")
    path = str(tmp_path / "state.npz")
    steps = 6
    with _session(client), _autocast(precision), _matmuls():
        model, loss_fn, has_aux, params_only = _model(name, precision)
        variables, params = _init(name, model, batch, params_only)
        first = variables_lib.flatten(variables.fetch(["params", "fp8_metas"]))
        state = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        losses = []
        for step in range(steps):
            if step == steps - 2:
                te.save_checkpoint(path, state)
            state, loss = _step(name, state, loss_fn, has_aux, batch, step, precision)
            losses.append(loss)
        want = variables_lib.flatten(state.variables.fetch())
        # The old variables are values: still what init made.
        assert all(np.array_equal(v, first[k]) for k, v in variables_lib.flatten(
            variables.fetch(["params", "fp8_metas"])).items())
    assert losses[-1] < losses[0], losses
    fp8_metas = sorted(k for k in want if k.startswith("fp8_metas/"))
    if precision == "fp8" and name in TE_MODELS:
        assert fp8_metas and any(not np.array_equal(want[k], first[k]) for k in fp8_metas), "fp8_metas did not move"
    else:
        assert not fp8_metas
    with _session(client), _autocast(precision), _matmuls():
        model, loss_fn, has_aux, params_only = _model(name, precision)
        _, params = _init(name, model, batch, params_only, seed=99)     # other values: the file's win
        fresh = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
        resumed = te.restore_checkpoint(path, fresh)
        assert resumed.step == steps - 2
        again = []
        for step in range(steps - 2, steps):
            resumed, loss = _step(name, resumed, loss_fn, has_aux, batch, step, precision)
            again.append(loss)
        got = variables_lib.flatten(resumed.variables.fetch())
    assert again == losses[-2:]
    assert sorted(got) == sorted(want)
    for key in want:      # params, opt_state (count, mu, nu) and fp8_metas
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


@pytest.mark.parametrize("name", TE_MODELS)
def test_fp8_moves_fp8_metas_and_differs_from_float32(name, client, rng):
    batch = _batch(name, rng, BATCHES[name][0])
    runs = {}
    for precision in ("float32", "fp8"):
        with _session(client), _autocast(precision), _matmuls():
            model, loss_fn, has_aux, params_only = _model(name, precision)
            variables, params = _init(name, model, batch, params_only, seed=5)
            state = te.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
            losses = []
            for _ in range(3):
                state, metrics = te.train_step(state, *batch, loss_fn=loss_fn, has_aux=has_aux)
                losses.append(metrics["loss"])
            runs[precision] = losses
            if precision == "fp8":
                before = variables_lib.flatten(variables.fetch(["fp8_metas"]))
                after = variables_lib.flatten(state.variables.fetch(["fp8_metas"]))
                assert before and any(not np.array_equal(after[k], before[k]) for k in before)
    assert runs["fp8"] != runs["float32"]
    assert rel_err(runs["fp8"], runs["float32"]) < ZOO["fp8"][0]
