"""Variables as values, pytrees, pickling, resources, precision and reattaching (te_client as JAX users expect)."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
import te_client.numpy as jnp
import te_client.optim as optax
from te_client import linen as nn, variables as variables_lib
from conftest import start_server
from te_client.recipe import DelayedScaling
from test_affinity import _free_port
from tolerances import F32, rel_err


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def _loss(params, x, t):
    return jnp.mean((Net().apply(params, x) - t) ** 2)


def _data(rng, b=4):
    return rng.standard_normal((b, 5)).astype(np.float32), rng.standard_normal((b, 3)).astype(np.float32)


def test_a_variable_ref_dtype_is_a_numpy_dtype(session, rng):
    v = te_flax.DenseGeneral(features=4).init(0, rng.standard_normal((2, 3)).astype(np.float32))
    ref = v["params"]["kernel"]
    assert ref.dtype == np.float32 and ref.dtype.itemsize == 4


def test_mutable_intermediates_is_refused_naming_what_is_kept(session, rng):
    x, _ = _data(rng)
    model = Net()
    v = model.init(0, x)
    with pytest.raises(NotImplementedError, match="intermediates"):
        model.apply(v, x, mutable=["intermediates"])


def test_variables_are_values_a_snapshot_stays_and_pickles_by_value(session, rng):
    x, t = _data(rng)
    model = Net()
    variables = model.init(1, x)
    snapshot = variables
    before = variables_lib.flatten(variables.fetch(["params"]))
    state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.5))
    state, _ = te.train_step(state, x, t, loss_fn=_loss)
    after = variables_lib.flatten(state.variables.fetch(["params"]))
    again = variables_lib.flatten(snapshot.fetch(["params"]))
    for k in before:
        np.testing.assert_array_equal(again[k], before[k])       # the old variables did not move
    assert any(not np.array_equal(after[k], before[k]) for k in before)
    tree = pickle.loads(pickle.dumps(snapshot))
    assert type(tree) is dict
    for k, v in variables_lib.flatten(tree).items():
        if k.startswith("params/"):
            np.testing.assert_array_equal(v, before[k])
    # apply takes any pytree of arrays (uploaded into a new version): the pickled one gives init's outputs
    np.testing.assert_allclose(model.apply({"params": tree["params"]}, x), model.apply(snapshot, x), rtol=1e-6)
    leaves, treedef = te.tree_flatten(snapshot)
    assert te.tree_unflatten(treedef, leaves) is snapshot
    assert len(leaves) == len(before)


def test_value_and_grad_of_a_users_loss_with_argnums_and_grad(session, rng):
    x, t = _data(rng)
    model = Net()
    variables = model.init(2, x)
    loss, (g_params, g_x) = te.value_and_grad(_loss, argnums=(0, 1))(variables, x, t)
    assert set(variables_lib.flatten(g_params)) == set(variables_lib.flatten(variables.fetch(["params"])))
    assert g_x.shape == x.shape
    grads = te.grad(_loss)(variables, x, t)
    for k, v in variables_lib.flatten(grads).items():
        assert rel_err(v, variables_lib.flatten(g_params)[k]) <= F32
    y = model.apply(variables, x)
    assert abs(loss - float(np.mean((np.asarray(y, np.float64) - t) ** 2))) <= 1e-5


def test_state_apply_gradients_follows_flaxs_loop(session, rng):
    x, t = _data(rng)
    model = Net()
    variables = model.init(3, x)
    for tx in (optax.sgd(0.1), optax.adam(0.05)):
        state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
        loss, grads = te.value_and_grad(_loss)(state.params, x, t)
        applied = state.apply_gradients(grads=grads)
        stepped, metrics = te.train_step(state, x, t, loss_fn=_loss)       # the same step in one call
        assert applied.step == stepped.step == 1 and metrics["loss"] == loss
        a = variables_lib.flatten(applied.variables.fetch(["params", "opt_state"]))
        b = variables_lib.flatten(stepped.variables.fetch(["params", "opt_state"]))
        assert sorted(a) == sorted(b)
        for k in b:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        loss1, _ = te.value_and_grad(_loss)(applied.params, x, t)
        assert loss1 < loss
    # Any tree of arrays shaped like the params: sgd's p - lr * g with those values.
    state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.1))
    _, grads = te.value_and_grad(_loss)(state.params, x, t)
    mine = te.tree_map(lambda g: np.asarray(g) * np.float32(0.5), dict(grads))
    new = state.apply_gradients(grads=mine)
    before = variables_lib.flatten(variables.fetch(["params"]))
    after = variables_lib.flatten(new.variables.fetch(["params"]))
    for k, g in variables_lib.flatten(mine).items():
        assert rel_err(after[k] - before[k], -0.1 * g.astype(np.float64)) <= F32, k


def test_train_step_draws_a_fresh_dropout_key_per_step(session, rng):
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x, deterministic=False):
            return nn.Dense(3)(nn.Dropout(0.5)(nn.Dense(16)(x), deterministic=deterministic))

    def loss(params, x, t):
        return jnp.mean((Drop().apply(params, x) - t) ** 2)
    x, t = _data(rng)
    model = Drop()
    variables = model.init(4, x, deterministic=True)
    state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.sgd(0.0), rng=7)
    losses = []
    for _ in range(3):
        state, metrics = te.train_step(state, x, t, loss_fn=loss)
        losses.append(metrics["loss"])
    # learning rate 0: only the dropout mask changes the loss (read as floats: a step's
    # loss is a lazy array, unhashable as JAX's arrays are)
    assert len({float(v) for v in losses}) == 3
    _, same = te.train_step(state, x, t, loss_fn=loss, rngs={"dropout": 1})
    _, again = te.train_step(state, x, t, loss_fn=loss, rngs={"dropout": 1})
    assert same["loss"] == again["loss"]


def test_init_again_replaces_the_layer(session, rng):
    x, _ = _data(rng)
    model = Net()
    held = [model.init(seed, x) for seed in range(4)]     # every result still referenced
    assert session.info().layers == 1
    model.apply(held[-1], x)
    del held
    import gc
    gc.collect()
    assert session.info().layers == 0      # a layer no one references any more is freed


def test_set_variables_writes_every_collection_get_variables_returns(session, rng):
    x, t = _data(rng)
    model = Net()
    variables = model.init(5, x)
    state = te.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(0.1))
    state, _ = te.train_step(state, x, t, loss_fn=_loss)
    tree = state.variables.fetch()
    assert int(np.asarray(tree["opt_state"]["count"]).ravel()[0]) == 1
    tree["opt_state"]["count"] = np.zeros_like(np.asarray(tree["opt_state"]["count"]))
    new = session.set_variables(state.variables, {"opt_state": tree["opt_state"]})
    assert int(np.asarray(new.fetch(["opt_state"])["opt_state"]["count"]).ravel()[0]) == 0


def test_reattach_by_id_and_token(client, rng):
    x, _ = _data(rng)
    with client.session() as session:
        Net().init(0, x)
        again = client.attach(session.id, session.token)
        assert again.info().layers == 1
        with pytest.raises(te.TeError):
            client.attach(session.id, "0" * len(session.token))


def test_sessions_left_open_are_closed_at_exit(server_address, client):
    code = textwrap.dedent("""
        import sys, te_client as te
        c = te.connect(sys.argv[1])
        s = c.session()
        print(s.id, s.token)
    """)
    import os
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(te.__file__))))
    run = subprocess.run([sys.executable, "-c", code, server_address], capture_output=True, text=True, timeout=60,
                         env=env)
    assert run.returncode == 0, run.stderr
    session_id, token = run.stdout.split()
    with pytest.raises(te.NotFoundError):
        client.attach(session_id, token)


def test_a_detached_session_outlives_its_process(server_address, client):
    code = textwrap.dedent("""
        import sys, te_client as te
        c = te.connect(sys.argv[1])
        s = c.session()
        s.detach()
        print(s.id, s.token)
    """)
    import os
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(te.__file__))))
    run = subprocess.run([sys.executable, "-c", code, server_address], capture_output=True, text=True, timeout=60,
                         env=env)
    assert run.returncode == 0, run.stderr
    session_id, token = run.stdout.split()
    attached = client.attach(session_id, token)
    assert attached.id == session_id
    attached.close()


def test_default_matmul_precision_reaches_every_step_request(session, rng, monkeypatch):
    x, t = _data(rng)
    model = Net()
    variables = model.init(6, x)
    sent = []
    real = session.call

    def spy(method, request, timeout=None):
        if hasattr(request, "matmul_precision"):
            sent.append((method, request.matmul_precision))
        return real(method, request, timeout)
    monkeypatch.setattr(session, "call", spy)
    with te.default_matmul_precision("highest"):
        model.apply(variables, x)
    model.apply(variables, x)
    pb = te.client.layers_pb2
    assert sent[0] == ("Forward", pb.PRECISION_HIGHEST) and sent[-1] == ("Forward", pb.PRECISION_DEFAULT)
    with pytest.raises(ValueError, match="bfloat16"):
        with te.default_matmul_precision("bfloat16"):
            pass


class TENet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(te_flax.DenseGeneral(features=16)(x)))


def _te_loss(params, x, t):
    return jnp.mean((TENet().apply(params, x) - t) ** 2)


def _train(state, x, t, steps):
    losses = []
    for _ in range(steps):
        state, metrics = te.train_step(state, x, t, loss_fn=_te_loss)
        losses.append(metrics["loss"])
    return state, losses


def test_a_session_checkpoint_resumes_after_a_server_restart_bit_for_bit(client, rng, tmp_path):
    x, t = _data(rng)
    recipe = DelayedScaling(amax_history_len=4)
    with client.session(recipes=[recipe], policy="emulate"), te.autocast(enabled=True, recipe=recipe):
        state = te.TrainState.create(apply_fn=TENet().apply, params=TENet().init(1, x), tx=optax.adam(0.05))
        state, straight = _train(state, x, t, 4)
        want = variables_lib.flatten(state.variables.fetch())
    assert any(k.startswith("fp8_metas/") for k in want) and any(k.startswith("opt_state/") for k in want)
    port, state_dir = _free_port(), str(tmp_path / "state")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with start_server(tmp_path / "a", "--state_dir=" + state_dir, port=port) as server:
        restarted = te.connect(server.address)
        session = restarted.session(recipes=[recipe], policy="emulate")
        with session, te.autocast(enabled=True, recipe=recipe):
            state = te.TrainState.create(apply_fn=TENet().apply, params=TENet().init(1, x), tx=optax.adam(0.05))
            state, first = _train(state, x, t, 2)
            # Every step answered before the crash: a step whose answer the kill cuts
            # off is one the client abandons, though the checkpoint holds it.
            first = [float(loss) for loss in first]
            assert session.checkpoint()
            os.kill(server.pid, signal.SIGKILL)   # what comes back is what Checkpoint wrote, nothing later
            # Gone before the next server starts, as restart_test.cc reaps it: a process
            # still dying holds its listening socket, which shares the port with the new one.
            os.waitpid(server.pid, 0)
            with start_server(tmp_path / "b", "--state_dir=" + state_dir, port=port):
                deadline = time.monotonic() + 30
                while True:                     # the channel reconnects to the new process
                    try:
                        restarted.server_info()
                        break
                    except te.UnavailableError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
                # The same Session, TrainState and version go on where the checkpoint left them.
                state, second = _train(state, x, t, 2)
                got = variables_lib.flatten(state.variables.fetch())
                assert restarted.attach(session.id, session.token).info().layers == 1
                session.close()
        restarted.close()
    assert first + second == straight
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


class Residual(nn.Module):
    @nn.compact
    def __call__(self, x, skip):
        return te_flax.DenseGeneral(features=8)(x) + skip


def test_a_steps_backward_version_is_what_its_gradients_continue_from(client, rng):
    # value_and_grad(model.apply) of a model with an extra input runs Forward + Backward; under
    # DelayedScaling the Backward makes a version (BackwardResponse.version): the FP8 state moved there.
    recipe = DelayedScaling(amax_history_len=4)
    x, skip = rng.standard_normal((4, 16)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    dy = rng.standard_normal((4, 8)).astype(np.float32)
    with client.session(recipes=[recipe], policy="emulate"), te.autocast(enabled=True, recipe=recipe):
        model = Residual()
        variables = model.init(0, x, skip)
        before = variables_lib.flatten(variables.fetch(["fp8_metas"]))
        _, (grads, (dx, dskip)) = te.value_and_grad(model.apply)(variables, x, dy, skip)
        np.testing.assert_array_equal(dskip, dy)
        assert dx.shape == x.shape
        moved = grads.variables
        assert moved.version.number > variables.version.number
        after = variables_lib.flatten(moved.fetch(["fp8_metas"]))
        assert before and any(not np.array_equal(after[k], before[k]) for k in before)
        again = variables_lib.flatten(variables.fetch(["fp8_metas"]))
        assert all(np.array_equal(again[k], before[k]) for k in before)     # the old version is a value


def test_one_version_object_per_number_so_a_number_is_released_once(session, rng):
    # A step that makes no version answers the one it read: the client must not hold two
    # Versions of one number, or dropping one would release the number under the other.
    x, t = _data(rng)
    model = Net()
    variables = model.init(8, x)
    dy = rng.standard_normal((4, 3)).astype(np.float32)
    _, (grads, _) = te.value_and_grad(model.apply)(variables, x, dy)
    assert grads.variables.version is variables.version
    assert variables_lib.Version(variables.handle, variables.version.number) is variables.version
    del grads
    import gc
    gc.collect()
    model.apply(variables, x)      # still readable: nothing released it
