"""Loss functions as Flax users write them, beyond the model's own inputs:

  * int32 labels beside a float32 x: the traced function's extra inputs keep
    their dtypes (AddGraph declares each one's dtype and shape), so an MLP
    classifier trains on integer class labels with te.value_and_grad and
    optax.softmax_cross_entropy_with_integer_labels;
  * a loss that reads parameters itself (an L2 penalty over params): each
    becomes a param node over the layer's own variable, and its gradient is
    the sum of what flows through the model and through the penalty.

Losses and gradients are checked against the traced graph evaluated in
float64 by graph_reference.py, and the penalty's share against 2 c W
computed here. Tolerances: tolerances.py (ZOO float32: matmuls at
"highest")."""
import numpy as np
import pytest

import graph_reference
import te_client as te
import te_client.numpy as jnp
import te_client.optim as optax
from te_client import errors, layer_calls, linen as nn, transforms
from te_client import variables as variables_lib
from tolerances import ZOO, rel_err

FEATURES, CLASSES = 12, 4
PENALTY = 1e-2
TOL_LOSS, TOL_GRAD = ZOO["float32"]


class MLP(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(self.hidden)(x)))


MODEL = MLP()


def ce_loss(params, x, labels):
    logits = MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def l2(params):
    return sum(jnp.sum(p ** 2) for p in te.tree_leaves(params))


def penalised_loss(params, x, labels):
    """The cross-entropy plus an L2 penalty that reads every parameter itself."""
    return ce_loss(params, x, labels) + PENALTY * l2(params)


def _data(rng, batch):
    # Classes a linear map of x separates, so training has something to learn.
    x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    labels = np.argmax(x[:, :CLASSES] + 0.5 * x[:, CLASSES:2 * CLASSES], axis=1).astype(np.int32)
    return x, labels


def _reference(loss_fn, params, variables, x, labels):
    traced = transforms.make_graph(loss_fn, params, x, labels)
    values = variables_lib.flatten(variables.fetch(["params"]))
    loss, grads, _, _ = graph_reference.loss_and_grads(traced, values, {"x": x, "extra_inputs[0]": labels})
    return traced, values, loss, grads


def _flat(grads):
    return variables_lib.flatten(grads if "params" in grads else {"params": grads})


@pytest.fixture
def matmuls():
    with te.default_matmul_precision("highest"):
        yield


def test_int32_labels_and_a_param_penalty_match_float64_at_two_batch_sizes(session, rng, matmuls):
    variables = MODEL.init(0, _data(rng, 8)[0])
    params = variables["params"]
    for batch in (8, 5):       # init's batch, then another (a new AddGraph)
        x, labels = _data(rng, batch)
        assert labels.dtype == np.int32 and x.dtype == np.float32
        for loss_fn in (ce_loss, penalised_loss):
            loss, grads = te.value_and_grad(loss_fn)(params, x, labels)
            traced, values, want_loss, want_grads = _reference(loss_fn, params, variables, x, labels)
            assert abs(loss - want_loss) <= TOL_LOSS * max(1.0, abs(want_loss)), (batch, loss_fn, loss, want_loss)
            flat = _flat(grads)
            assert set(flat) == set(want_grads)
            for key, want in want_grads.items():
                assert rel_err(flat[key], want) <= TOL_GRAD, (batch, loss_fn.__name__, key)
            # The graph declares the labels as the call had them: int32 [batch].
            declared = layer_calls.extra_input_headers(traced)
            assert [(h.dtype, list(h.shape)) for h in declared] == [(te.dtypes.INT32, [batch])]
        # The penalty reads every kernel and bias through a param node: its share of the gradient is 2 c W.
        params_read = {n.name for n in traced.spec.nodes if n.WhichOneof("op") == "param"}
        assert params_read == {"Dense_0/kernel", "Dense_0/bias", "Dense_1/kernel", "Dense_1/bias"}
        plain = _flat(te.value_and_grad(ce_loss)(params, x, labels)[1])
        with_penalty = _flat(te.value_and_grad(penalised_loss)(params, x, labels)[1])
        for key, w in values.items():
            assert rel_err(with_penalty[key] - plain[key], 2 * PENALTY * np.asarray(w, np.float64)) <= TOL_GRAD, key


def test_a_loss_reading_variables_directly_through_init_s_result(session, rng, matmuls):
    """The variables argument may be init's result itself: model.apply(variables, x) and
    variables["params"][...] in the same function read the same variables."""
    variables = MODEL.init(1, _data(rng, 6)[0])
    x, labels = _data(rng, 6)

    def loss_fn(variables, x, labels):
        logits = MODEL.apply(variables, x)
        kernel = variables["params"]["Dense_1"]["kernel"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + PENALTY * jnp.sum(kernel ** 2)

    loss, grads = te.value_and_grad(loss_fn)(variables, x, labels)
    _, _, want_loss, want_grads = _reference(loss_fn, variables, variables, x, labels)
    assert abs(loss - want_loss) <= TOL_LOSS * max(1.0, abs(want_loss))
    flat = _flat(grads)
    for key, want in want_grads.items():
        assert rel_err(flat[key], want) <= TOL_GRAD, key


def test_an_mlp_classifier_trains_on_int32_labels(session, rng, matmuls):
    x, labels = _data(rng, 64)
    variables = MODEL.init(2, x)
    state = optax.TrainState.create(apply_fn=MODEL.apply, params=variables["params"], tx=optax.adam(3e-2))

    def accuracy(params):
        return float(np.mean(np.argmax(np.asarray(MODEL.apply({"params": params}, x)), -1) == labels))

    first = accuracy(state.params)
    losses = []
    for _ in range(40):
        loss, grads = te.value_and_grad(penalised_loss)(state.params, x, labels)
        losses.append(loss)
        state = state.apply_gradients(grads=grads)
    assert losses[-1] < 0.5 * losses[0], losses
    assert accuracy(state.params) >= max(0.9, first), (first, accuracy(state.params))
    # train_step takes the same loss, int labels and all.
    state, metrics = te.train_step(state, x, labels, loss_fn=penalised_loss)
    assert metrics["applied"] and np.isfinite(metrics["loss"])


def test_extra_inputs_of_a_dtype_the_graph_cannot_take_are_named(session, rng):
    """int32 in float arithmetic: the server refuses the graph at AddGraph naming the node
    (GraphSpec's ops and casts are on floats), not at a later step."""
    x, labels = _data(rng, 4)
    variables = MODEL.init(3, x)

    def loss_fn(params, x, labels):
        logits = MODEL.apply({"params": params}, x)
        return jnp.mean(logits[:, 0] * labels)

    with pytest.raises(errors.InvalidArgumentError, match=r"cast takes float32, bfloat16 or float16, got int32"):
        te.value_and_grad(loss_fn)(variables["params"], x, labels)
