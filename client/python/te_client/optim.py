"""optax's optimizers and flax's TrainState, run on te_server: parameters,
gradients and optimizer state stay on the server, and a training step is one call.

    import te_client.optim as optax

    variables = model.init(key, x)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000), weight_decay=1e-4))
    state = optax.TrainState.create(apply_fn=model.apply, params=variables, tx=tx, rng=dropout_key)

    def loss_fn(params, x, labels):
        logits = state.apply_fn(params, x, deterministic=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    for x, labels in batches:
        state, metrics = optax.train_step(state, x, labels, loss_fn=loss_fn)   # one ForwardBackward
        # or, as flax's loop writes it (two calls):
        loss, grads = te.value_and_grad(loss_fn)(state.params, x, labels)
        state = state.apply_gradients(grads=grads)

Names, arguments and defaults are optax's (sgd, adam, adamw, rmsprop, lion;
the schedule constructors; clip_by_global_norm, clip, scale,
add_decayed_weights, chain in any order optax accepts) and the state is
flax.training.train_state's. A step's gradients are summed over its
micro-batches on the server and the update applied there, under the active
autocast (a DelayedScaling step moves fp8_metas); a step whose gradients
hold an inf or NaN is skipped and counted (optax.apply_if_finite;
metrics["applied"]). Without loss_fn a step's loss is the model's own y (a
composite that ends in softmax_cross_entropy_with_integer_labels(...).mean()),
or the mean of optax.squared_error(y, target), or vdot(y, dy).

save_checkpoint / restore_checkpoint write and read a TrainState's
variables (params, opt_state, fp8_metas) and step to a file (numpy's .npz),
bit for bit; Session.checkpoint writes the whole session on the server.
"""
import dataclasses
import math
import numbers

import numpy as np

from te_client import dtypes, errors, graph, initializers, layer_calls, pipeline, precision as precision_lib
from te_client import transforms
from te_client import module as module_lib
from te_client import variables as variables_lib
from te_client._pb import service_pb2
from te_client.losses import softmax_cross_entropy, softmax_cross_entropy_with_integer_labels  # noqa: F401 (optax's names, here too)


# ---- schedules ---------------------------------------------------------------------

_SCHEDULES = ("constant_schedule, linear_schedule, cosine_decay_schedule, warmup_cosine_decay_schedule, "
              "exponential_decay, piecewise_constant_schedule, join_schedules")


class Schedule:
    """An optax schedule as data: callable on the step count (optax's formula,
    in float64 here) and sent as a te.v1.LearningRate."""

    def __call__(self, count):
        raise NotImplementedError

    def proto(self):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Constant(Schedule):
    value: float

    def __call__(self, count):
        return float(self.value)

    def proto(self):
        return service_pb2.LearningRate(constant=float(self.value))


@dataclasses.dataclass(frozen=True)
class _Linear(Schedule):
    init_value: float
    end_value: float
    transition_steps: int
    transition_begin: int = 0

    def __call__(self, count):
        if self.transition_steps <= 0:
            return self.init_value
        frac = min(max(count - self.transition_begin, 0), self.transition_steps) / self.transition_steps
        return (self.end_value - self.init_value) * frac + self.init_value

    def proto(self):
        return service_pb2.LearningRate(linear=service_pb2.LinearSchedule(
            init_value=self.init_value, end_value=self.end_value, transition_steps=self.transition_steps,
            transition_begin=self.transition_begin))


@dataclasses.dataclass(frozen=True)
class _CosineDecay(Schedule):
    init_value: float
    decay_steps: int
    alpha: float = 0.0
    exponent: float = 1.0

    def __call__(self, count):
        t = min(count, self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1 + math.cos(math.pi * t))
        return self.init_value * ((1 - self.alpha) * cosine ** self.exponent + self.alpha)

    def proto(self):
        return service_pb2.LearningRate(cosine_decay=service_pb2.CosineDecaySchedule(
            init_value=self.init_value, decay_steps=self.decay_steps, alpha=self.alpha, exponent=self.exponent))


@dataclasses.dataclass(frozen=True)
class _WarmupCosineDecay(Schedule):
    init_value: float
    peak_value: float
    warmup_steps: int
    decay_steps: int
    end_value: float = 0.0
    exponent: float = 1.0

    def __call__(self, count):
        """The schedule's value at step `count`, as optax computes it (float64 here)."""
        if count < self.warmup_steps:
            frac = 1.0 - count / self.warmup_steps
            return (self.init_value - self.peak_value) * frac + self.peak_value
        span = self.decay_steps - self.warmup_steps
        t = min(count - self.warmup_steps, span)
        alpha = 0.0 if self.peak_value == 0 else self.end_value / self.peak_value
        cosine = 0.5 * (1 + math.cos(math.pi * t / span))
        return self.peak_value * ((1 - alpha) * cosine ** self.exponent + alpha)

    def proto(self):
        return service_pb2.LearningRate(warmup_cosine_decay=service_pb2.WarmupCosineDecaySchedule(
            init_value=self.init_value, peak_value=self.peak_value, warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps, end_value=self.end_value, exponent=self.exponent))


@dataclasses.dataclass(frozen=True)
class _ExponentialDecay(Schedule):
    init_value: float
    transition_steps: int
    decay_rate: float
    transition_begin: int = 0
    staircase: bool = False
    end_value: float = None

    def __call__(self, count):
        t = max(count - self.transition_begin, 0)
        p = t / self.transition_steps
        if self.staircase:
            p = math.floor(p)
        value = self.init_value * self.decay_rate ** p
        if self.end_value is not None:
            value = max(value, self.end_value) if self.decay_rate < 1 else min(value, self.end_value)
        return value

    def proto(self):
        msg = service_pb2.ExponentialDecaySchedule(
            init_value=self.init_value, transition_steps=self.transition_steps, decay_rate=self.decay_rate,
            transition_begin=self.transition_begin, staircase=self.staircase)
        if self.end_value is not None:
            msg.end_value = self.end_value
        return service_pb2.LearningRate(exponential_decay=msg)


@dataclasses.dataclass(frozen=True)
class _PiecewiseConstant(Schedule):
    init_value: float
    boundaries_and_scales: tuple = ()

    def __call__(self, count):
        value = self.init_value
        for step, scale in self.boundaries_and_scales:
            if count >= step:
                value *= scale
        return value

    def proto(self):
        msg = service_pb2.PiecewiseConstantSchedule(init_value=self.init_value)
        for step, scale in self.boundaries_and_scales:
            msg.boundaries_and_scales.add(step=int(step), scale=float(scale))
        return service_pb2.LearningRate(piecewise_constant=msg)


@dataclasses.dataclass(frozen=True)
class _Join(Schedule):
    schedules: tuple
    boundaries: tuple

    def __call__(self, count):
        start = 0
        chosen = self.schedules[0]
        for schedule, boundary in zip(self.schedules[1:], self.boundaries):
            if count >= boundary:
                chosen, start = schedule, boundary
        return chosen(count - start)

    def proto(self):
        return service_pb2.LearningRate(join=service_pb2.JoinSchedules(
            schedules=[s.proto() for s in self.schedules], boundaries=[int(b) for b in self.boundaries]))


def constant_schedule(value):
    return _Constant(float(value))


def linear_schedule(init_value, end_value, transition_steps, transition_begin=0):
    return _Linear(float(init_value), float(end_value), int(transition_steps), int(transition_begin))


def polynomial_schedule(init_value, end_value, power, transition_steps, transition_begin=0):
    if power != 1:
        raise NotImplementedError("polynomial_schedule(power=%r): te.v1 has the linear one (power 1)" % (power,))
    return linear_schedule(init_value, end_value, transition_steps, transition_begin)


def cosine_decay_schedule(init_value, decay_steps, alpha=0.0, exponent=1.0):
    if int(decay_steps) <= 0:
        raise ValueError("cosine_decay_schedule: decay_steps %r; want > 0" % (decay_steps,))
    return _CosineDecay(float(init_value), int(decay_steps), float(alpha), float(exponent))


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0,
                                 exponent=1.0):
    """optax.warmup_cosine_decay_schedule: decay_steps counts the warmup too."""
    return _WarmupCosineDecay(float(init_value), float(peak_value), int(warmup_steps), int(decay_steps),
                              float(end_value), float(exponent))


def exponential_decay(init_value, transition_steps, decay_rate, transition_begin=0, staircase=False,
                      end_value=None):
    if int(transition_steps) <= 0:
        raise ValueError("exponential_decay: transition_steps %r; want > 0" % (transition_steps,))
    return _ExponentialDecay(float(init_value), int(transition_steps), float(decay_rate), int(transition_begin),
                             bool(staircase), None if end_value is None else float(end_value))


def piecewise_constant_schedule(init_value, boundaries_and_scales=None):
    items = tuple(sorted((int(k), float(v)) for k, v in (boundaries_and_scales or {}).items()))
    return _PiecewiseConstant(float(init_value), items)


def join_schedules(schedules, boundaries):
    schedules = tuple(_learning_rate(s) for s in schedules)
    if len(boundaries) != len(schedules) - 1:
        raise ValueError("join_schedules: %d boundaries for %d schedules; want one fewer" % (
            len(boundaries), len(schedules)))
    return _Join(schedules, tuple(int(b) for b in boundaries))


def _learning_rate(learning_rate):
    if isinstance(learning_rate, Schedule):
        return learning_rate
    if isinstance(learning_rate, (numbers.Real, np.floating, np.integer)) and not isinstance(learning_rate, bool):
        return _Constant(float(learning_rate))
    if callable(learning_rate):
        raise errors.InvalidArgumentError(
            "learning_rate: %r is a Python callable, which the server cannot run; build the schedule with "
            "te_client.optim's constructors (optax's): %s" % (learning_rate, _SCHEDULES))
    raise errors.InvalidArgumentError("learning_rate: want a float or a te_client.optim schedule (%s), got %s" % (
        _SCHEDULES, type(learning_rate).__name__))


# ---- optimizers and transforms ---------------------------------------------------------

_OPTIMIZERS = {"sgd": service_pb2.Sgd, "adam": service_pb2.Adam, "adamw": service_pb2.AdamW,
               "rmsprop": service_pb2.Rmsprop, "lion": service_pb2.Lion}


@dataclasses.dataclass(frozen=True)
class GradientTransformation:
    """An optimizer the server runs: one of optax's, or a chain of transforms."""
    kind: str                      # "sgd" | "adam" | "adamw" | "rmsprop" | "lion" | "chain" | a transform's
    learning_rate: object = None   # a Schedule (optimizers, scale_by_learning_rate)
    hyperparams: dict = dataclasses.field(default_factory=dict)
    clip_by_global_norm: float = None
    links: tuple = ()              # a chain's transforms, in order
    value: float = None            # a one-number transform's (clip, scale, add_decayed_weights...)

    def _optimizer_message(self):
        return _OPTIMIZERS[self.kind](learning_rate=self.learning_rate.proto(),
                                      **{k: v for k, v in self.hyperparams.items() if v is not None})

    def _transform(self):
        if self.kind in _OPTIMIZERS:
            return service_pb2.Transform(**{self.kind: self._optimizer_message()})
        if self.kind == "scale_by_learning_rate":
            return service_pb2.Transform(scale_by_learning_rate=self.learning_rate.proto())
        return service_pb2.Transform(**{self.kind: float(self.value)})

    def proto(self):
        if self.kind == "chain":
            return service_pb2.Optimizer(chain=[t._transform() for t in self.links])
        if self.kind not in _OPTIMIZERS:
            return service_pb2.Optimizer(chain=[self._transform()])
        spec = service_pb2.Optimizer(**{self.kind: self._optimizer_message()})
        if self.clip_by_global_norm is not None:
            spec.clip_by_global_norm = float(self.clip_by_global_norm)
        return spec

    def init(self, params):
        """tx.init(params): gives the server layer holding `params` (what
        init returned) this optimizer and a fresh state; returns the state's
        variable names ("opt_state/mu/kernel", ...)."""
        handle = _handle_of(params)
        response = handle.session.call("SetOptimizer", service_pb2.SetOptimizerRequest(
            layer_id=handle.layer_id, optimizer=self.proto()))
        names = ["%s/%s" % (v.collection, v.path) for v in response.variables]
        known = {(i.collection, i.path) for i in handle.infos}
        handle.infos.extend(variables_lib.VariableInfo(v.collection, v.path, tuple(v.shape), v.dtype)
                            for v in response.variables if (v.collection, v.path) not in known)
        return names


def _hyper(**values):
    return {k: (None if v is None else (bool(v) if isinstance(v, bool) else float(v))) for k, v in values.items()}


def sgd(learning_rate, momentum=None, nesterov=False):
    return GradientTransformation("sgd", _learning_rate(learning_rate),
                                  {"momentum": None if momentum is None else float(momentum),
                                   "nesterov": bool(nesterov)})


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    return GradientTransformation("adam", _learning_rate(learning_rate), _hyper(b1=b1, b2=b2, eps=eps, eps_root=eps_root))


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4):
    return GradientTransformation("adamw", _learning_rate(learning_rate), _hyper(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay))


def rmsprop(learning_rate, decay=0.9, eps=1e-8, initial_scale=0.0, eps_in_sqrt=True, centered=False,
            momentum=None, nesterov=False):
    """optax.rmsprop."""
    return GradientTransformation("rmsprop", _learning_rate(learning_rate), {
        "decay": float(decay), "eps": float(eps), "initial_scale": float(initial_scale),
        "eps_in_sqrt": bool(eps_in_sqrt), "centered": bool(centered),
        "momentum": None if momentum is None else float(momentum), "nesterov": bool(nesterov)})


def lion(learning_rate, b1=0.9, b2=0.99, weight_decay=1e-3):
    """optax.lion."""
    return GradientTransformation("lion", _learning_rate(learning_rate), _hyper(b1=b1, b2=b2, weight_decay=weight_decay))


def clip_by_global_norm(max_norm):
    return GradientTransformation("clip_by_global_norm", value=float(max_norm))


def clip(max_delta):
    return GradientTransformation("clip", value=float(max_delta))


def scale(step_size):
    return GradientTransformation("scale", value=float(step_size))


def add_decayed_weights(weight_decay=0.0, mask=None):
    if mask is not None:
        raise NotImplementedError("add_decayed_weights(mask=...): te.v1 decays every parameter")
    return GradientTransformation("add_decayed_weights", value=float(weight_decay))


def scale_by_learning_rate(learning_rate, flip_sign=True):
    if not flip_sign:
        raise NotImplementedError("scale_by_learning_rate(flip_sign=False): te.v1's is updates * -lr")
    return GradientTransformation("scale_by_learning_rate", _learning_rate(learning_rate))


def chain(*transforms):
    """optax.chain, in the order given. clip_by_global_norm then one optimizer
    is sent as the optimizer with its clip (what every te_server runs); any
    other order or mix as te.v1's chain of transforms."""
    for t in transforms:
        if not isinstance(t, GradientTransformation):
            raise errors.InvalidArgumentError(
                "chain: %r is not a te_client.optim transform (sgd, adam, adamw, rmsprop, lion, clip_by_global_norm, "
                "clip, scale, add_decayed_weights, scale_by_learning_rate, chain)" % (t,))
    links = []
    for t in transforms:
        links.extend(t.links if t.kind == "chain" else [t])
    if len(links) == 1:
        return links[0]
    if len(links) == 2 and links[0].kind == "clip_by_global_norm" and links[1].kind in _OPTIMIZERS and \
            links[1].clip_by_global_norm is None:
        return dataclasses.replace(links[1], clip_by_global_norm=links[0].value)
    return GradientTransformation("chain", links=tuple(links))


# ---- the training state and step --------------------------------------------------------

def _handle_of(variables):
    found = variables_lib.refs_version(variables)
    if found is None:
        raise errors.InvalidArgumentError("params: want init's variables (or a tree of their VariableRefs), got %s" %
                                          type(variables).__name__)
    return found[0]


def _same_kind(params, new):
    """`new` (Variables) as the kind `params` was: Variables, or its params subtree."""
    if isinstance(params, variables_lib.Variables):
        return new
    return new["params"] if "params" in new and "params" not in params else new


@dataclasses.dataclass(frozen=True)
class TrainState:
    """flax.training.train_state.TrainState, with params and opt_state on the
    server. `params` are values (Variables of one version): each step returns
    a new state whose params are the step's new version. `rng` (optional): the
    key fresh dropout keys are drawn from, one per step (fold_in(rng, step))."""
    step: int
    apply_fn: object
    params: object
    tx: GradientTransformation
    rng: object = None

    @classmethod
    def create(cls, *, apply_fn, params, tx, rng=None, **kwargs):
        if kwargs:
            raise TypeError("TrainState.create: %s; te_client's TrainState holds step, apply_fn, params, tx and rng" %
                            ", ".join(sorted(kwargs)))
        tx.init(params)
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx, rng=rng)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @property
    def variables(self):
        handle, version = variables_lib.refs_version(self.params)
        return self.params if isinstance(self.params, variables_lib.Variables) else variables_lib.Variables(
            {handle.scope: handle}, getattr(self.apply_fn, "__self__", None), version)

    @property
    def opt_state(self):
        """The optimizer state, downloaded: {"count": ..., "mu/kernel": ...}."""
        tree = self.variables.fetch(["opt_state"])
        return variables_lib.flatten(tree.get("opt_state", {}))

    def dropout_seed(self):
        """This step's dropout key: fold_in(rng, step) (None without rng)."""
        if self.rng is None:
            return None
        return graph.derive_seed(module_lib.seed_of(self.rng, "dropout"), "step/%d" % self.step)

    def apply_gradients(self, *, grads, **kwargs):
        """optax's update with `grads` (value_and_grad's, or any tree of arrays
        shaped like the params), applied on the server in one ForwardBackward
        with apply_update over a graph that has each gradient as an input:
        its loss is sum_p vdot(p, g_p), whose gradient is g_p exactly, so the
        optimizer steps with `grads` as given (_gradient_graph). Continues
        from the variables the gradients' step left (grads.variables: its FP8
        state), else from self.params."""
        base = grads.variables if isinstance(grads, variables_lib.Gradients) and grads.variables is not None \
            else self.variables
        handle, version = variables_lib.refs_version(base)
        tree = grads["params"] if isinstance(grads, dict) and set(grads) == {"params"} else grads
        if isinstance(tree, variables_lib.Variables):
            raise errors.InvalidArgumentError("grads: Variables; want the gradients (value_and_grad's)")
        made = _apply_gradients(handle, version, variables_lib.flatten(dict(tree)))
        new = variables_lib.Variables({handle.scope: handle}, base.module, made)
        return dataclasses.replace(self, step=self.step + 1, params=_same_kind(self.params, new), **kwargs)


def _apply_gradients(handle, version, flat):
    """Sends the optimizer's update on `version` with the gradients `flat`
    ({"A_0/kernel": array} under params) as a pipelined step (pipeline.py):
    the PendingVersion it makes.

    The update takes the gradients of a ForwardBackward's micro-batches, so
    the gradients travel as the inputs of a graph over the layer's params
    whose loss is sum_p sum(p * g_p): its gradient in p is g_p, bit for bit
    (the backward multiplies g_p by the seed 1.0). No module runs, so the
    call leaves fp8_metas as they are and sends no autocast."""
    session = handle.session
    prefix = len(variables_lib.join(*handle.scope)) + 1 if handle.scope else 0
    infos = {i.path: i for i in handle.infos if i.collection == "params"}
    scope = variables_lib.join(*handle.scope)
    grads = []
    for name, value in sorted(flat.items()):
        path = name[len("params/"):] if name.startswith("params/") else name
        if scope and path.startswith(scope + "/"):
            path = path[prefix:]
        info = infos.get(path)
        if info is None:
            raise errors.InvalidArgumentError("grads: %r is none of the layer's params (%s)" % (
                name, ", ".join(sorted(infos)) or "none"))
        array = dtypes.as_numpy(value)
        if tuple(array.shape) != tuple(info.shape):
            raise errors.InvalidArgumentError("grads: %r is %s; the param is %s" % (
                name, list(array.shape), list(info.shape)))
        array = dtypes.cast_to_wire(array, info.wire_dtype)
        grads.append((path, info, array.reshape(-1) if array.size else array))
    grads = [g for g in grads if g[2].size]
    if not grads:
        raise errors.InvalidArgumentError("grads: empty; want a gradient for at least one param")
    traced = _gradient_graph([(path, tuple(info.shape), info.wire_dtype, a.shape[0]) for path, info, a in grads])
    info = layer_calls.add_graph(handle, traced, grads[0][2].shape, grads[0][1].wire_dtype)
    uploads = []
    try:
        batch = service_pb2.MicroBatch(x=session.send(grads[0][2], uploads, "grads/" + grads[0][0]))
        for path, _, array in grads[1:]:
            batch.extra_inputs.add().CopyFrom(session.send(array, uploads, "grads/" + path))
    except BaseException:
        session.delete_all(uploads)
        raise
    step = pipeline.dispatch(session, handle, version, service_pb2.ForwardBackwardRequest(
        layer_id=handle.layer_id, micro_batches=[batch], deterministic=True, apply_update=True,
        graph=info.index, matmul_precision=precision_lib.current()), uploads)
    return variables_lib.PendingVersion(handle, step)


def _gradient_graph(params):
    """The graph of _apply_gradients: inputs x, extra_inputs[0..] the
    flattened gradients of `params` [(path, shape, wire, size)], in order;
    y = sum_p sum(reshape(p, [-1]) * g_p) in float32."""
    from te_client._pb import layers_pb2
    trace = graph.Trace(lambda: (), True)
    total = None
    for i, (path, shape, wire, size) in enumerate(params):
        g = trace.input("x" if i == 0 else "extra_inputs[%d]" % (i - 1), (size,), wire)
        # The layer's own param (AddGraph matches it by name, shape and dtype); its
        # initializer is never run, but must suit any shape.
        p = trace.record("param", layers_pb2.GraphSpec.Param(shape=list(shape), dtype=wire,
                                                              initializer=initializers.zeros.proto()),
                         [], [(shape, wire)], name=path, keep=True)[0]
        term = (p.reshape(size) * g).sum(dtype=np.float32)
        total = term if total is None else total + term
    return trace.build(total.as_known_scalar() if total.from_extra else total)


def train_step(state, *batch, loss_fn=None, has_aux=False, target=None, dy=None, micro_batches=1,
               deterministic=True, rngs=None, timeout=None, donate=False):
    """One training step, one call: forward, loss and backward over
    `micro_batches` parts of the batch (each array split along axis 0, the
    gradients summed), then the optimizer's update, under the active autocast.

    The loss: `loss_fn(params, *batch)` (any function value_and_grad takes:
    it applies state.apply_fn and computes the loss, with aux when has_aux),
    else the model's own y (a composite whose y is its loss, its extra inputs
    the labels), or with `target` the mean of optax.squared_error(y, target),
    or with `dy` vdot(y, dy). Dropout: `rngs` ({"dropout": key}) when given,
    else a fresh key per step from state.rng (fold_in(rng, step)); a
    loss_fn that passes its own rngs to apply keeps them. Returns (new state,
    metrics): loss (before the update), applied, learning_rate, grad_norm,
    count, total_notfinite, request_bytes, and aux (per micro-batch) with has_aux.

    Dispatched as JAX dispatches a jitted step (pipeline.py): it returns once
    the step is sent, with the metrics and aux as lazy arrays (float(),
    np.asarray, .item(), block_until_ready()) and the new params as values
    whose version comes with the answer; the next step is sent before it,
    so reading a loss never leaves the device idle. A failure the server
    answers raises where the step's results are read (its metrics, its
    params, or a later step from them), with the server's code; steps sent
    on top of a failed one never change what the program holds. `timeout`:
    the step's deadline in seconds (from when it is sent), when shorter than
    rpc_timeout.

    `donate=True` donates `state`'s variables to the step, as
    jax.jit(train_step, donate_argnums=0) does: the server updates them in
    place without first copying them for `state` (a read and a write of all
    params and optimizer moments a step, and a second copy of them held while
    steps are in flight), and releases them. `state`'s variables are then
    unreadable (InvalidArgumentError naming the donation) whatever the step's
    outcome; continue from the state returned, as
    `state, metrics = train_step(state, batch, donate=True)` does. A step
    sent on top of a step still in flight that did not donate does not
    donate either: were that step to fail, the server's newest version,
    which this one reads, would be one the program still holds. So donate
    from a loop's first step on: a loop whose steps stay in flight goes on
    not donating after one that did not."""
    seed = module_lib.seed_of(rngs, "dropout") if rngs is not None else state.dropout_seed()
    if loss_fn is not None:
        if target is not None or dy is not None:
            raise errors.InvalidArgumentError("train_step: loss_fn computes the loss; target and dy are for the "
                                              "model's own y")
        return _loss_fn_step(state, batch, loss_fn, has_aux, micro_batches, seed, timeout, donate)
    if not batch:
        raise errors.InvalidArgumentError("train_step: no x")
    if target is not None and dy is not None:
        raise errors.InvalidArgumentError("train_step: give target (squared error) or dy (vdot), not both")
    module = getattr(state.apply_fn, "__self__", None)
    if not isinstance(module, module_lib.Module):
        raise errors.InvalidArgumentError("train_step: without loss_fn, state.apply_fn must be a module's apply")
    handle, version = variables_lib.refs_version(state.params) or (None, None)
    if handle is None:
        raise errors.InvalidArgumentError("train_step: state.params are not init's variables")
    session = handle.session
    parts = [np.array_split(np.asarray(a), micro_batches) for a in batch]
    other = target if target is not None else dy
    uploads = []
    try:
        call, info = module._call_for(handle, tuple(p[0] for p in parts), {"deterministic": deterministic}
                                      if _takes(module, "deterministic") else {})
        if info is not None and info.traced.output_shape != () and other is None:
            raise errors.InvalidArgumentError(
                "train_step: %s's y is %s, not a loss: give loss_fn, target or dy" % (
                    type(module).__name__, list(info.traced.output_shape)))
        wire = info.output_wire if info is not None else handle.output_wire_dtype
        others = np.array_split(dtypes.cast_to_wire(np.asarray(other), wire), micro_batches) if other is not None \
            else None
        request = service_pb2.ForwardBackwardRequest(
            layer_id=handle.layer_id, deterministic=call.deterministic, apply_update=True,
            autocast=layer_calls.autocast(), graph=info.index if info else 0,
            matmul_precision=precision_lib.current())
        for i in range(micro_batches):
            mb = request.micro_batches.add(dropout_seed=(seed or 0) + i)
            mb.x.CopyFrom(session.send(parts[0][i], uploads, "micro_batches[%d].x" % i))
            for j, p in enumerate(parts[1:]):
                mb.extra_inputs.add().CopyFrom(session.send(p[i], uploads, "micro_batches[%d].extra_inputs[%d]" % (i, j)))
            if others is not None:
                field = "target" if target is not None else "dy"
                getattr(mb, field).CopyFrom(session.send(others[i], uploads, "micro_batches[%d].%s" % (i, field)))
        request_bytes = request.ByteSize() + _VERSION_BYTES
    except BaseException:
        session.delete_all(uploads)
        raise
    step = pipeline.dispatch(session, handle, version, request, uploads, timeout, donate)
    new = variables_lib.Variables({handle.scope: handle}, module, variables_lib.PendingVersion(handle, step))
    return dataclasses.replace(state, step=state.step + 1, params=_same_kind(state.params, new)), \
        pipeline.metrics(step, request_bytes)


def _takes(module, name):
    import inspect
    try:
        return name in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


# The request's `version` field, set as it is sent (pipeline.dispatch): counted in
# request_bytes as the synchronous step counted it (a tag and a varint of the number).
_VERSION_BYTES = 2


def _loss_fn_step(state, batch, loss_fn, has_aux, micro_batches, seed, timeout, donate):
    parts = [np.array_split(np.asarray(a), micro_batches) if transforms._is_array(a) else None for a in batch]
    first = tuple(p[0] if p is not None else a for p, a in zip(parts, batch))
    prepared = transforms.Prepared(loss_fn, (state.params,) + first, {}, (0,), has_aux, default_seed=seed)
    session = prepared.handle.session
    uploads = []
    try:
        batches = []
        for i in range(micro_batches):
            values = []
            for name, value in prepared.inputs.values:
                at = next(k for k, a in enumerate(first) if a is value) if any(a is value for a in first) else None
                values.append((name, parts[at][i] if at is not None and parts[at] is not None else value))
            batches.append(prepared.micro_batch(session, uploads, seed=prepared.seed(i), values=values))
        request = prepared.request(batches, apply_update=True, read_version=False)
        request_bytes = request.ByteSize() + _VERSION_BYTES
    except BaseException:
        session.delete_all(uploads)
        raise
    step = pipeline.dispatch(session, prepared.handle, prepared.version, request, uploads, timeout, donate)
    metrics = pipeline.metrics(step, request_bytes)
    if has_aux:
        metrics["aux"] = [_lazy_aux(prepared, session, step, i) for i in range(micro_batches)]
        if micro_batches == 1:
            metrics["aux"] = metrics["aux"][0]
    new = variables_lib.Variables({prepared.handle.scope: prepared.handle}, prepared.loss.module,
                                  variables_lib.PendingVersion(prepared.handle, step))
    return dataclasses.replace(state, step=state.step + 1, params=_same_kind(state.params, new)), metrics


def _lazy_aux(prepared, session, step, index):
    """Micro-batch `index`'s aux tree of a step in flight: its traced leaves
    lazy arrays (received, all at once, by the first read), the rest as they are."""
    received = pipeline.Memo(lambda response: variables_lib.tree_leaves(prepared.aux(session, response, index)))
    leaves = [pipeline.LazyArray(step, lambda response, k=k: received(response)[k])
              if isinstance(v, transforms.symbolic.Symbol) else v for k, v in enumerate(prepared.aux_leaves)]
    return variables_lib.tree_unflatten(prepared.aux_def, leaves)


# ---- checkpoints ---------------------------------------------------------------------------

def save_checkpoint(path, state):
    """Writes the state's variables (params, opt_state, fp8_metas: every
    collection but grads) and step to `path` (.npz), bit for bit (bfloat16
    values travel as their float32 widening, which narrows back exactly)."""
    tree = state.variables.fetch()
    flat = {name: value for name, value in variables_lib.flatten(tree).items() if not name.startswith("grads/")}
    arrays = {}
    for name, value in flat.items():
        array = np.asarray(value)
        if dtypes.wire_dtype(dtypes.as_numpy(value)) == dtypes.BFLOAT16:
            array = np.asarray(value, np.float32)
        arrays["v:" + name] = array
    arrays["__step__"] = np.asarray(state.step, np.int64)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def restore_checkpoint(path, state):
    """The state with its variables and step as save_checkpoint wrote them:
    one SetVariables over state.params's version (any collection the file
    holds: params, opt_state, fp8_metas), as a new version. `state` gives the
    layer (init's, in this session, with the same tx)."""
    with np.load(path) as data:
        flat = {name[2:]: data[name] for name in data.files if name.startswith("v:")}
        step = int(data["__step__"])
    handle, version = variables_lib.refs_version(state.params)
    number = handle.session.set_version(handle, version.number, flat)
    new = variables_lib.Variables({handle.scope: handle}, state.variables.module, variables_lib.Version(
        handle, number))
    return dataclasses.replace(state, step=step, params=_same_kind(state.params, new))
