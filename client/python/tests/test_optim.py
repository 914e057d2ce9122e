"""te_client.optim against a real te_server: optax's update rules (float64
references on random values), schedules, the train-step loop, and bad input."""
import math

import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
import te_client.optim as optim
from te_client import client as client_lib, variables as variables_lib
from tolerances import F32, rel_err

B, S, H, F = 4, 8, 16, 8
STEPS = 200
FINAL_LOSS = 1e-2     # the teacher is linear: the loss can reach 0; it starts near 4


def _problem(rng):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    w = (0.5 * rng.standard_normal((H, F))).astype(np.float32)
    b = (0.5 * rng.standard_normal(F)).astype(np.float32)
    return x, (x.astype(np.float64) @ w + b).astype(np.float32)


def _values(session, params):
    """The layer's params and opt_state, flat ("params/kernel"), in float64."""
    tree = session.get_variables(params, collections=["params", "opt_state"])
    return {k: np.asarray(v, dtype=np.float64) for k, v in variables_lib.flatten(tree).items()}


def _numpy_grads(v, x, t):
    """d mean((x @ kernel + bias - t)^2), float64."""
    x64 = x.astype(np.float64).reshape(-1, H)
    r = x64 @ v["params/kernel"] + v["params/bias"] - t.reshape(-1, F)
    g = 2 * r / r.size
    return {"kernel": x64.T @ g, "bias": g.sum(0)}, float((r * r).mean())


def _optax_step(name, p, g, state, t, lr, momentum=0.9, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4):
    """optax's update for one parameter (float64); returns the new parameter."""
    if name.startswith("sgd"):
        if name == "sgd":
            return p - lr * g
        state["trace"] = g + momentum * state.get("trace", 0.0)
        u = g + momentum * state["trace"] if name == "sgd_nesterov" else state["trace"]
        return p - lr * u
    if name == "rmsprop":
        state["nu"] = (1 - 0.9) * g * g + 0.9 * state.get("nu", 0.0)
        return p - lr * g / np.sqrt(state["nu"] + eps)
    if name == "lion":   # optax.lion(lr, b1=0.9, b2=0.99, weight_decay=1e-3)
        mu = state.get("mu", 0.0)
        u = np.sign((1 - b1) * g + b1 * mu) + 1e-3 * p
        state["mu"] = (1 - 0.99) * g + 0.99 * mu
        return p - lr * u
    state["mu"] = (1 - b1) * g + b1 * state.get("mu", 0.0)
    state["nu"] = (1 - b2) * g * g + b2 * state.get("nu", 0.0)
    u = (state["mu"] / (1 - b1 ** t)) / (np.sqrt(state["nu"] / (1 - b2 ** t)) + eps)
    if name == "adamw":
        u = u + wd * p
    return p - lr * u


TXS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9),
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(0.05),
    "adamw": lambda: optim.adamw(0.05, weight_decay=1e-4),
    "rmsprop": lambda: optim.rmsprop(0.01),
    "lion": lambda: optim.lion(0.01),
}
LEARNING_RATES = {"sgd": 0.1, "sgd_momentum": 0.1, "sgd_nesterov": 0.1, "adam": 0.05, "adamw": 0.05,
                  "rmsprop": 0.01, "lion": 0.01}


@pytest.mark.parametrize("name", sorted(TXS))
def test_each_update_matches_float64_optax(session, rng, name):
    layer = te_flax.DenseGeneral(features=F)
    x, t = _problem(rng)
    params = layer.init(3, x)
    state = optim.TrainState.create(apply_fn=layer.apply, params=params, tx=TXS[name]())
    lr = LEARNING_RATES[name]
    ref_state = {"kernel": {}, "bias": {}}
    for step in range(1, 4):
        before = _values(session, state.params)
        grads, loss = _numpy_grads(before, x, t)
        state, metrics = optim.train_step(state, x, target=t, micro_batches=2)
        assert metrics["applied"] and metrics["count"] == step
        assert metrics["loss"] == pytest.approx(loss, rel=F32)
        after = _values(session, state.params)
        for p in ("kernel", "bias"):
            want = _optax_step(name, before["params/" + p], grads[p], ref_state[p], step, lr)
            # The change, not the parameter: a wrong update would hide under |p| ~ 1.
            assert rel_err(after["params/" + p] - before["params/" + p], want - before["params/" + p]) < 10 * F32


def test_chain_clips_after_the_optimizer_as_optax_does(session, rng):
    # optax.chain(adam, clip_by_global_norm): adam's update (-lr * direction) is clipped to the norm.
    layer = te_flax.DenseGeneral(features=F)
    x, t = _problem(rng)
    params = layer.init(7, x)
    lr, max_norm = 0.05, 0.02
    state = optim.TrainState.create(apply_fn=layer.apply, params=params,
                                    tx=optim.chain(optim.adam(lr), optim.clip_by_global_norm(max_norm)))
    ref_state = {"kernel": {}, "bias": {}}
    for step in range(1, 4):
        before = _values(session, state.params)
        grads, _ = _numpy_grads(before, x, t)
        state, metrics = optim.train_step(state, x, target=t)
        assert metrics["applied"] and metrics["count"] == step
        after = _values(session, state.params)
        updates = {p: _optax_step("adam", before["params/" + p], grads[p], ref_state[p], step, lr) -
                   before["params/" + p] for p in ("kernel", "bias")}
        norm = math.sqrt(sum(float(np.sum(u * u)) for u in updates.values()))
        assert norm > max_norm        # the clip bites
        for p, u in updates.items():
            assert rel_err(after["params/" + p] - before["params/" + p], u * max_norm / norm) < 10 * F32
        assert "0/mu/kernel" in state.opt_state     # a chain's links name their state by index


def test_adamw_with_schedule_and_clipping_fits_the_teacher(session, rng):
    layer = te_flax.DenseGeneral(features=F)
    x, t = _problem(rng)
    params = layer.init(4, x)
    schedule = optim.warmup_cosine_decay_schedule(init_value=0.0, peak_value=0.05, warmup_steps=10,
                                                  decay_steps=STEPS, end_value=1e-3)
    tx = optim.chain(optim.clip_by_global_norm(5.0), optim.adamw(learning_rate=schedule, weight_decay=1e-4))
    state = optim.TrainState.create(apply_fn=layer.apply, params=params, tx=tx)
    losses = []
    for step in range(STEPS):
        state, metrics = optim.train_step(state, x, target=t, micro_batches=2)
        assert metrics["learning_rate"] == pytest.approx(schedule(step), rel=1e-12)
        losses.append(metrics["loss"])
    assert losses[0] > 1.0 and losses[-1] < FINAL_LOSS, (losses[0], losses[-1])
    assert state.step == STEPS
    opt_state = state.opt_state
    assert int(opt_state["count"][0]) == STEPS and int(opt_state["total_notfinite"][0]) == 0
    assert opt_state["mu/kernel"].shape == (H, F)


def test_schedule_is_optaxs():
    s = optim.warmup_cosine_decay_schedule(0.01, 0.5, 7, 40, end_value=0.02, exponent=1.5)
    assert s(0) == pytest.approx(0.01) and s(7) == pytest.approx(0.5) and s(40) == pytest.approx(0.02)
    t = 20 - 7
    assert s(20) == pytest.approx(0.5 * ((1 - 0.04) * (0.5 * (1 + math.cos(math.pi * t / 33))) ** 1.5 + 0.04))


def test_non_finite_gradient_skips_the_step(session, rng):
    layer = te_flax.DenseGeneral(features=F)
    x, t = _problem(rng)
    params = layer.init(5, x)
    state = optim.TrainState.create(apply_fn=layer.apply, params=params, tx=optim.adam(0.05))
    state, _ = optim.train_step(state, x, target=t)
    before = _values(session, state.params)
    bad = x.copy()
    bad[0, 0, 0] = np.inf
    state, metrics = optim.train_step(state, bad, target=t)
    assert not metrics["applied"] and metrics["count"] == 1 and metrics["total_notfinite"] == 1
    after = _values(session, state.params)
    assert after.pop("opt_state/total_notfinite") == 1 and before.pop("opt_state/total_notfinite") == 0
    for k in before:   # params, moments and count as they were
        np.testing.assert_array_equal(after[k], before[k])


def test_bad_input_is_invalid_argument_naming_the_field(session, rng):
    layer = te_flax.DenseGeneral(features=F)
    x, t = _problem(rng)
    params = layer.init(6, x)
    with pytest.raises(te.InvalidArgumentError, match=r"^INVALID_ARGUMENT: optimizer\.adamw\.learning_rate\.constant: nan"):
        optim.adamw(learning_rate=float("nan")).init(params)
    handle = params.handles[()] if () in params.handles else next(iter(params.handles.values()))
    with pytest.raises(te.InvalidArgumentError, match=r"^INVALID_ARGUMENT: optimizer: no optimizer"):
        session.call("SetOptimizer", client_lib.service_pb2.SetOptimizerRequest(layer_id=handle.layer_id))
    _, metrics = optim.train_step(optim.TrainState(0, layer.apply, params, optim.sgd(0.1)), x, target=t)
    with pytest.raises(te.FailedPreconditionError, match="apply_update"):
        float(metrics["loss"])     # the server's answer: raised where the step's result is read
    optim.sgd(0.1, momentum=0.9).init(params)
    with pytest.raises(te.InvalidArgumentError, match=r"^INVALID_ARGUMENT: variables\[0\]\.value: \[3\]"):
        session.call("SetVariables", client_lib.service_pb2.SetVariablesRequest(
            layer_id=handle.layer_id, variables=[client_lib.service_pb2.Variable(
                collection="opt_state", path="trace/kernel",
                value=session.send(np.ones(3, np.float32), [], "value"))]))
    # optax's chain takes any order: clipping after the optimizer is a chain of transforms.
    spec = optim.chain(optim.adam(0.1), optim.clip_by_global_norm(1.0)).proto()
    assert [t.WhichOneof("kind") for t in spec.chain] == ["adam", "clip_by_global_norm"]
    with pytest.raises(te.InvalidArgumentError, match="warmup_cosine_decay_schedule"):
        optim.adam(lambda count: 0.1)     # a callable schedule: the server cannot run Python
