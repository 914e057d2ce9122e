"""Training steps sent ahead of their answers (te_client/pipeline.py) against a real te_server.

The pipelined loop (several steps in flight, losses read at the end) against
the synchronous one (pipeline_depth=1, each loss read before the next step
is sent): the same losses, learning rates, step counts and final variables
(params, opt_state and, under FP8 DelayedScaling, the fp8_metas that move
every step) bit for bit, in the order the steps were issued; a step that
fails raises where it is read, with the server's code, and the steps sent
on top of it change nothing the program holds; a step past its deadline;
a session closed with steps in flight. Server-free: LazyArray's behaviour as
a JAX scalar.
"""
import threading
import time

import grpc
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
import te_client.numpy as jnp
import te_client.optim as optim
from te_client import client as client_lib, linen as nn, losses, pipeline, variables as variables_lib
from te_client.recipe import DelayedScaling

service_pb2 = client_lib.service_pb2
EXPIRED = -1.0      # a deadline already past when the call starts (test_pipelined.py)
STEPS = 8
DEPTH = 4           # steps in flight in the pipelined loop
ATTEMPTS = 8        # runs of a loop whose interleaving with the server's answers is a race
V, S, B = 32, 16, 4
RECIPE = DelayedScaling(amax_history_len=4)


class TENet(nn.Module):
    """Flax Dense over a TE DenseGeneral (FP8 under DelayedScaling): trained with loss_fn."""
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(te_flax.DenseGeneral(features=16)(x)))


def _mse(params, x, t):
    return jnp.mean((TENet().apply(params, x) - t) ** 2)


class TinyLM(nn.Module):
    """Embed -> TE LayerNormMLP -> tied logits -> optax's loss: y is the loss (train_step without loss_fn)."""
    @nn.compact
    def __call__(self, tokens, labels):
        embed = nn.Embed(V, 16)
        x = embed(tokens)
        x = x + te_flax.LayerNormMLP(intermediate_dim=32, activations=("gelu",))(x, deterministic=True)[0]
        return losses.softmax_cross_entropy_with_integer_labels(embed.attend(x), labels).mean()


def _mse_batches(seed, steps):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((B, 16)).astype(np.float32), rng.standard_normal((B, 3)).astype(np.float32))
            for _ in range(steps)]


def _lm_batches(seed, steps):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        window = rng.integers(0, V, size=(B, S + 1)).astype(np.int32)
        out.append((window[:, :-1], window[:, 1:]))
    return out


MODELS = {
    # name: (model, loss_fn, batches, tx)
    "mse_loss_fn": (TENet, _mse, _mse_batches, lambda: optim.adam(optim.linear_schedule(0.05, 0.01, STEPS))),
    "lm_own_loss": (TinyLM, None, _lm_batches, lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(
        optim.warmup_cosine_decay_schedule(0.0, 0.02, 3, STEPS, 0.002), weight_decay=0.01))),
}


def _scope(fp8):
    return te.autocast(enabled=True, recipe=RECIPE) if fp8 else te.autocast(enabled=False)


def _session(client, fp8):
    return client.session(recipes=[RECIPE], policy="emulate") if fp8 else client.session()


def _state(name, batches):
    model_cls, loss_fn, _, tx = MODELS[name]
    model = model_cls()
    init_args = batches[0][:1] if loss_fn is not None else batches[0]    # a model with a loss_fn takes x alone
    return optim.TrainState.create(apply_fn=model.apply, params=model.init(3, *init_args), tx=tx()), loss_fn


def _loop(client, name, fp8, batches, read_each, counts=None, donate=False):
    """Trains on `batches`; returns ([(loss, learning_rate, count)] per step as floats, final variables
    flat). `counts`: a dict updated with the session's transport counts."""
    with _session(client, fp8) as session, _scope(fp8):
        state, loss_fn = _state(name, batches)
        got = []
        for batch in batches:
            state, metrics = optim.train_step(state, *batch, loss_fn=loss_fn, donate=donate)
            got.append(metrics)
            if read_each:
                float(metrics["loss"])
        rows = [(float(m["loss"]), float(m["learning_rate"]), int(m["count"])) for m in got]
        final = variables_lib.flatten(state.variables.fetch())
        if counts is not None:
            counts.update(session.transport_counts.as_dict())
    return rows, final


def _assert_same_variables(got, want):
    """Two flat variable dicts (variables_lib.flatten): the same names, values bit for bit."""
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.fixture(scope="module")
def clients(server_address):
    sync, piped = te.connect(server_address, pipeline_depth=1), te.connect(server_address, pipeline_depth=DEPTH)
    yield sync, piped
    sync.close()
    piped.close()


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8_delayed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_pipelined_loop_equals_the_synchronous_loop_bit_for_bit(clients, name, fp8):
    sync, piped = clients
    batches = MODELS[name][2](7, STEPS)
    want_rows, want = _loop(sync, name, fp8, batches, read_each=True)
    rows, final = _loop(piped, name, fp8, batches, read_each=False)
    assert [r[2] for r in rows] == list(range(1, STEPS + 1))        # in the order issued
    assert rows == want_rows                                        # losses and learning rates, bit for bit
    assert sorted(final) == sorted(want)
    if fp8:
        assert any(k.startswith("fp8_metas/") for k in final)
    for k in want:
        np.testing.assert_array_equal(np.asarray(final[k]), np.asarray(want[k]), err_msg=k)
    # The steps moved what they train (fp8_metas among them), so equality means something.
    with _session(sync, fp8) as session, _scope(fp8):
        start = variables_lib.flatten(_state(name, batches)[0].variables.fetch())
    moved = [k for k in want if not np.array_equal(np.asarray(start[k]), np.asarray(want[k]))]
    assert any(k.startswith("params/") for k in moved)
    if fp8:
        assert any(k.startswith("fp8_metas/") for k in moved), moved


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8_delayed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_donating_loop_equals_the_loop_that_keeps_its_states_bit_for_bit(clients, name, fp8):
    sync, piped = clients
    batches = MODELS[name][2](8, STEPS)
    want_rows, want = _loop(sync, name, fp8, batches, read_each=True)
    for client in (sync, piped):
        rows, final = _loop(client, name, fp8, batches, read_each=False, donate=True)
        assert rows == want_rows
        _assert_same_variables(final, want)


def test_a_donated_state_is_released_unreadable_with_the_same_values(clients, rng):
    _, piped = clients
    x, t = _dense_problem(rng)
    layer = te_flax.DenseGeneral(features=8)
    with piped.session() as session:
        state = optim.TrainState.create(apply_fn=layer.apply, params=layer.init(1, x), tx=optim.adam(0.01))
        state, m = optim.train_step(state, x, target=t)
        float(m["loss"])
        one_version = session.info().memory_bytes
        # A step that keeps `state`: the server copies its params and moments for it.
        kept, m = optim.train_step(state, x, target=t)
        float(m["loss"])
        assert session.info().memory_bytes > one_version
        want = variables_lib.flatten(kept.variables.fetch())
        del kept, m
        # The same step donating `state`: released though still referenced here.
        new, m = optim.train_step(state, x, target=t, donate=True)
        float(m["loss"])
        assert session.info().memory_bytes == one_version
        _assert_same_variables(variables_lib.flatten(new.variables.fetch()), want)
        for read in (lambda: state.variables.fetch(), lambda: layer.apply(state.params, x),
                     lambda: optim.train_step(state, x, target=t)):
            with pytest.raises(te.InvalidArgumentError, match="donated"):
                read()


def test_a_step_on_top_of_a_non_donating_step_in_flight_does_not_donate(clients):
    """Were the step below to fail, the server's newest version, which the step
    on top reads, would be the one the program still holds from before it.
    Whether a step is still in flight when the next is sent is a race a fast
    server can win (it answered before the client sent the next): the loop
    runs again, in a new session, until both cases have been seen, the
    donation checked in every run."""
    _, piped = clients
    batches = _lm_batches(13, STEPS)
    asked = [i != STEPS // 2 for i in range(STEPS)]   # one step in the middle keeps its state
    seen_on_non_donating = seen_on_donating = False
    for _ in range(ATTEMPTS):
        with piped.session() as session:
            state, _ = _state("lm_own_loss", batches)
            sent = []
            send_step = session.send_step

            def recording(step, request, timeout=None):
                ok = send_step(step, request, timeout)
                if ok:
                    sent.append((step.parent.donates if step.parent is not None else None, request.donate))
                return ok
            session.send_step = recording
            for batch, donate in zip(batches, asked):
                state, metrics = optim.train_step(state, *batch, donate=donate)
            float(metrics["loss"])
        assert [donates for _, donates in sent] == [
            donate and parent_donates is not False for donate, (parent_donates, _) in zip(asked, sent)], sent
        seen_on_non_donating |= any(parent is False for parent, _ in sent)
        seen_on_donating |= any(parent is True and donates for parent, donates in sent)
        if seen_on_non_donating and seen_on_donating:
            break
    assert seen_on_non_donating, "no step went on top of a non-donating one in flight in %d runs" % ATTEMPTS
    assert seen_on_donating, "no step went on top of a donating one in flight in %d runs" % ATTEMPTS


@pytest.mark.parametrize("transport", ["shm", "stream"])
def test_inputs_through_shared_memory_or_streams_stay_until_their_step_has_run(clients, shm_server, transport):
    """Each step's batch goes through a shared-memory block (freed once the
    step answers: the next step's batch must not overwrite it before the
    server has read it) or a resident upload (deleted by a call numbered
    after the step): the same numbers as the synchronous inline loop."""
    sync, _ = clients
    batches = _lm_batches(17, STEPS)
    want_rows, want = _loop(sync, "lm_own_loss", False, batches, read_each=True)
    piped = te.connect(shm_server.address, transport=transport, pipeline_depth=DEPTH)
    try:
        counts = {}
        rows, final = _loop(piped, "lm_own_loss", False, batches, read_each=False, counts=counts)
    finally:
        piped.close()
    assert counts[transport] >= 2 * STEPS, counts     # each step's tokens and labels went that way
    assert rows == want_rows
    for k in want:
        np.testing.assert_array_equal(np.asarray(final[k]), np.asarray(want[k]), err_msg=k)


def test_steps_are_sent_before_the_one_before_answers(clients):
    _, piped = clients
    batches = _lm_batches(11, STEPS)
    with piped.session() as session:
        state, _ = _state("lm_own_loss", batches)
        sent = []
        send_step = session.send_step

        def recording(step, request, timeout=None):
            parent_open = bool(session._steps) and not session._steps[-1].answered
            ok = send_step(step, request, timeout)
            if ok:
                sent.append((parent_open, step.parent is not None, request.version))
            return ok
        session.send_step = recording
        metrics = []
        for batch in batches:
            state, m = optim.train_step(state, *batch)
            metrics.append(m)
        counts = [int(m["count"]) for m in metrics]
    assert counts == list(range(1, STEPS + 1))
    # A step sent while the one before was still in flight reads the layer's newest version (0).
    assert all(version == 0 for _, chained, version in sent if chained)
    assert any(parent_open and chained for parent_open, chained, _ in sent), sent


def test_at_most_pipeline_depth_steps_are_in_flight(server_address):
    depth = 2
    client = te.connect(server_address, pipeline_depth=depth)
    batches = _lm_batches(12, STEPS)
    try:
        with client.session() as session:
            state, _ = _state("lm_own_loss", batches)
            most = []
            for batch in batches:
                state, metrics = optim.train_step(state, *batch)
                most.append(sum(not s.answered for s in session._steps))
            float(metrics["loss"])
        assert max(most) <= depth, most
    finally:
        client.close()
    with pytest.raises(te.InvalidArgumentError, match="pipeline_depth"):
        te.connect(server_address, pipeline_depth=0)


def _dense_problem(rng):
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)
    return x, (x @ rng.standard_normal((16, 8))).astype(np.float32)


def _raises_now_or_at_read(code_error, issue, read):
    """A step that depends on a failed one raises at issue when the failure
    is already known, else where its results are read. Returns the error."""
    try:
        result = issue()
    except te.TeError as e:
        assert isinstance(e, code_error), e
        return e
    with pytest.raises(code_error) as info:
        read(result)
    return info.value


def test_a_failed_step_raises_at_its_read_and_the_steps_after_it_do_not_apply(clients, rng):
    sync, piped = clients
    x, t = _dense_problem(rng)
    bad_t = t[:, :, :3]               # the server refuses a target of another shape than y
    layer = te_flax.DenseGeneral(features=8)
    tx = lambda: optim.adam(optim.linear_schedule(0.05, 0.01, 10))   # noqa: E731

    # The synchronous reference: two steps, then two more (the bad one never sent).
    with sync.session():
        state = optim.TrainState.create(apply_fn=layer.apply, params=layer.init(1, x), tx=tx())
        want = []
        for _ in range(4):
            state, m = optim.train_step(state, x, target=t)
            want.append((float(m["loss"]), float(m["learning_rate"])))
        want_final = variables_lib.flatten(state.variables.fetch())

    with piped.session() as session:
        state = optim.TrainState.create(apply_fn=layer.apply, params=layer.init(1, x), tx=tx())
        state, m1 = optim.train_step(state, x, target=t)
        good, m2 = optim.train_step(state, x, target=t)
        failed, m3 = optim.train_step(good, x, target=bad_t)          # sent; fails on the server
        steps = [failed.params.version.step]
        later = []

        def issue_from(s):
            new, m = optim.train_step(s, x, target=t)
            steps.append(new.params.version.step)
            later.append((new, m))
            return new, m
        # Sent on top of the failed step, before its answer is read.
        _raises_now_or_at_read(te.InvalidArgumentError, lambda: issue_from(failed),
                               lambda r: float(r[1]["loss"]))
        if later:
            _raises_now_or_at_read(te.InvalidArgumentError, lambda: issue_from(later[-1][0]),
                                   lambda r: float(r[1]["loss"]))
        with pytest.raises(te.InvalidArgumentError, match="target") as info:
            float(m3["loss"])                                            # the failed step's own error
        assert "continues from" not in info.value.message
        for new, m in later:
            with pytest.raises(te.InvalidArgumentError, match="continues from"):
                m["count"].item()
            with pytest.raises(te.InvalidArgumentError):
                new.variables.fetch()                                    # its params: the same failure
        with pytest.raises(te.InvalidArgumentError):
            optim.train_step(failed, x, target=t)                        # a step from it: at once, known now
        # A step sent on top of the failed one was cancelled, or ran and its version is released unseen.
        for step in steps[1:]:
            response = step._own[0]
            assert step._own[1] is not None or ("release", step.layer_id, response.version) in session.pending \
                or step._released, step._own
        got = [(float(m["loss"]), float(m["learning_rate"])) for m in (m1, m2)]
        # The program goes on from the last good state as if the failed steps were never sent.
        state = good
        for _ in range(2):
            state, m = optim.train_step(state, x, target=t)
            got.append((float(m["loss"]), float(m["learning_rate"])))
        final = variables_lib.flatten(state.variables.fetch())
    assert got == want
    _assert_same_variables(final, want_final)


def test_a_step_past_its_deadline_fails_at_its_read_and_the_session_goes_on(clients, rng):
    _, piped = clients
    x, t = _dense_problem(rng)
    layer = te_flax.DenseGeneral(features=8)
    with piped.session():
        state = optim.TrainState.create(apply_fn=layer.apply, params=layer.init(2, x), tx=optim.sgd(0.1))
        state, m1 = optim.train_step(state, x, target=t)
        expired, m2 = optim.train_step(state, x, target=t, timeout=EXPIRED)
        with pytest.raises(te.DeadlineExceededError):
            float(m2["loss"])
        with pytest.raises(te.DeadlineExceededError):
            optim.train_step(expired, x, target=t)        # depends on it: raises at once
        start = time.monotonic()
        again, m3 = optim.train_step(state, x, target=t)  # from the last good state: not held up
        assert int(m3["count"]) == 2 and time.monotonic() - start < 5.0
        assert float(m3["loss"]) < float(m1["loss"])


def test_a_session_closed_with_steps_in_flight_answers_them_first(clients):
    _, piped = clients
    batches = _lm_batches(13, 4)
    session = piped.session()
    with session:
        state, _ = _state("lm_own_loss", batches)
        metrics = []
        for batch in batches:
            state, m = optim.train_step(state, *batch)
            metrics.append(m)
    # Closed (numbered after the steps) before any answer was read: the steps ran first.
    assert [int(m["count"]) for m in metrics] == [1, 2, 3, 4]
    assert all(np.isfinite(float(m["loss"])) for m in metrics)


def test_pending_params_are_values_any_call_reads(clients, rng):
    _, piped = clients
    x, t = _dense_problem(rng)
    layer = te_flax.DenseGeneral(features=8)
    with piped.session() as session:
        state0 = optim.TrainState.create(apply_fn=layer.apply, params=layer.init(3, x), tx=optim.sgd(0.1))
        state1, _ = optim.train_step(state0, x, target=t)
        state2, m2 = optim.train_step(state1, x, target=t)
        kernel1 = np.asarray(state1.params["params"]["kernel"])          # waits for step 1 only
        y2 = layer.apply(state2.params, x)                               # waits for step 2
        assert m2["loss"].is_ready()
        assert not np.array_equal(kernel1, np.asarray(state2.params["params"]["kernel"]))
        np.testing.assert_array_equal(np.asarray(state1.params["params"]["kernel"]), kernel1)   # still a value
        np.testing.assert_allclose(y2, layer.apply(state2.params, x), rtol=0, atol=0)
        assert isinstance(state2.params.version, variables_lib.PendingVersion)
        assert state2.params.version.number > state1.params.version.number > state0.params.version.number
        # A call that makes a version numbered between two steps (sent without waiting, so the
        # step before is still in flight): the next step waits for its base's number instead of
        # reading the layer's newest, which that call made (bias 1).
        state3, _ = optim.train_step(state2, x, target=t)
        handle = state0.params.handle
        other = session.call_async("SetVariables", service_pb2.SetVariablesRequest(
            layer_id=handle.layer_id, version=state0.params.version.number, variables=[service_pb2.Variable(
                collection="params", path="bias", value=session.send(np.ones(8, np.float32), [], "bias"))]))
        state4, m4 = optim.train_step(state3, x, target=t)
        assert state4.params.version.step.parent is None
        assert state4.params.version.number > other.result().version > state3.params.version.number
        bias3, bias4 = np.asarray(state3.params["params"]["bias"]), np.asarray(state4.params["params"]["bias"])
        assert np.abs(bias4 - bias3).max() < 0.5, (bias3, bias4)
        # apply_gradients is a pipelined step too; it continues from a pending state.
        grads = te.tree_map(lambda p: np.ones(p.shape, np.float32), state4.params["params"])
        state5 = state4.apply_gradients(grads={"params": grads})
        assert isinstance(state5.params.version, variables_lib.PendingVersion)
        np.testing.assert_allclose(np.asarray(state5.params["params"]["bias"]),
                                   np.asarray(state4.params["params"]["bias"]) - 0.1, rtol=1e-6)


def test_has_aux_outputs_are_lazy_arrays(clients, rng):
    _, piped = clients
    x, t = rng.standard_normal((4, 16)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)

    def loss_with_aux(params, x, t):
        y = TENet().apply(params, x)
        return jnp.mean((y - t) ** 2), {"y": y, "tag": 7}

    with piped.session():
        model = TENet()
        state = optim.TrainState.create(apply_fn=model.apply, params=model.init(0, x), tx=optim.sgd(0.1))
        params0 = state.params
        state, metrics = optim.train_step(state, x, t, loss_fn=loss_with_aux, has_aux=True)
        aux = metrics["aux"]
        assert aux["tag"] == 7 and isinstance(aux["y"], pipeline.LazyArray)
        y = np.asarray(aux["y"])
        np.testing.assert_allclose(y, model.apply(params0, x), rtol=1e-6, atol=1e-6)
        assert float(metrics["loss"]) == pytest.approx(float(np.mean((y.astype(np.float64) - t) ** 2)), rel=1e-5)


# ---- LazyArray, server-free ----------------------------------------------------------------------

class _Response:
    def __init__(self, values, version=5):
        self.values, self.version = values, version


def _step_answering(response=None, error=None, delay=0.0):
    step = pipeline.StepCall(session=None, layer_id="L1", parent=None)

    def answer():
        time.sleep(delay)
        step.answer(response, error)
    threading.Thread(target=answer).start()
    return step


def test_a_lazy_scalar_reads_as_the_jax_scalar_a_step_returns():
    step = _step_answering(_Response([1.25, 1.0]), delay=0.05)
    loss = pipeline.LazyArray(step, lambda r: np.float64(sum(r.values)))
    assert "in flight" in repr(loss) or "2.25" in repr(loss)
    assert loss.block_until_ready() is loss and loss.is_ready()
    assert float(loss) == 2.25 and loss.item() == 2.25 and np.asarray(loss).dtype == np.float64
    assert str(loss) == "2.25" and "%.1f" % loss == "2.2" and f"{loss:.3f}" == "2.250"
    assert loss * 2 == 4.5 and loss + np.float32(1) == 3.25 and loss > 2 and -loss == -2.25
    assert float(np.mean([loss, loss])) == 2.25 and loss.shape == () and loss.ndim == 0
    assert loss == pytest.approx(2.25) and repr(loss) == "LazyArray(2.25, dtype=float64)"
    with pytest.raises(TypeError):
        hash(loss)


def test_a_lazy_value_of_a_failed_step_raises_at_every_read():
    step = _step_answering(error=te.ResourceExhaustedError("session memory: 9 GiB over 8"))
    loss = pipeline.LazyArray(step, lambda r: np.float64(sum(r.values)))
    for read in (float, np.asarray, lambda v: v.item(), lambda v: v.block_until_ready(), str):
        with pytest.raises(te.ResourceExhaustedError, match="session memory"):
            read(loss)
    assert "failed" in repr(loss)
    # A step sent on top of it fails with its code, naming it.
    child = pipeline.StepCall(session=None, layer_id="L1", parent=step)
    step.add_child(child)
    child.answer(None, te.errors.error(grpc.StatusCode.CANCELLED, "cancelled"))
    with pytest.raises(te.ResourceExhaustedError, match="continues from failed.*session memory"):
        child.result()
