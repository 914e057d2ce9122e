"""optax's optimizers, run on te_server: parameters, gradients and optimizer
state stay on the server, and a training step is one call.

    import te_client.optim as optim

    variables = layer.init(42, x)
    tx = optim.chain(optim.clip_by_global_norm(1.0),
                     optim.adamw(learning_rate=optim.warmup_cosine_decay_schedule(
                         init_value=0.0, peak_value=1e-3, warmup_steps=100, decay_steps=1000),
                         weight_decay=1e-4))
    state = optim.TrainState.create(apply_fn=layer.apply, params=variables, tx=tx)
    for x, y in batches:
        state, metrics = optim.train_step(state, x, target=y)    # metrics["loss"]

Names, arguments and defaults are optax's (optax.sgd, adam, adamw,
warmup_cosine_decay_schedule, clip_by_global_norm, chain) and the loop is
flax.training.train_state's. The loss is the mean of optax.squared_error(y,
target) (or vdot(y, dy) with a dy), its gradients summed over micro-batches on
the server, and the update applied there; a step whose gradients hold an inf
or NaN is skipped and counted (optax.apply_if_finite; metrics["applied"]).
"""
import dataclasses
import math

import numpy as np

from te_client import dtypes, errors
from te_client import variables as variables_lib
from te_client._pb import service_pb2


# ---- schedules ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Constant:
    value: float

    def __call__(self, count):
        return float(self.value)

    def proto(self):
        return service_pb2.LearningRate(constant=float(self.value))


@dataclasses.dataclass(frozen=True)
class _WarmupCosineDecay:
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
        pb = service_pb2
        return pb.LearningRate(warmup_cosine_decay=pb.WarmupCosineDecaySchedule(
            init_value=self.init_value, peak_value=self.peak_value, warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps, end_value=self.end_value, exponent=self.exponent))


def constant_schedule(value):
    return _Constant(value)


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0,
                                 exponent=1.0):
    """optax.warmup_cosine_decay_schedule: decay_steps counts the warmup too."""
    return _WarmupCosineDecay(float(init_value), float(peak_value), int(warmup_steps), int(decay_steps),
                              float(end_value), float(exponent))


def _learning_rate(learning_rate):
    if isinstance(learning_rate, (_Constant, _WarmupCosineDecay)):
        return learning_rate
    if isinstance(learning_rate, (int, float, np.floating, np.integer)):
        return _Constant(float(learning_rate))
    raise errors.InvalidArgumentError("learning_rate: want a float or a te_client.optim schedule, got %s"
                                      % type(learning_rate).__name__)


# ---- optimizers --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GradientTransformation:
    """An optimizer the server runs: a te.v1.Optimizer and its learning rate."""
    kind: str                      # "sgd" | "adam" | "adamw"
    learning_rate: object          # a schedule (callable of the step count)
    hyperparams: dict
    clip_by_global_norm: float = None

    def proto(self):
        pb = service_pb2
        message = {"sgd": pb.Sgd, "adam": pb.Adam, "adamw": pb.AdamW}[self.kind](
            learning_rate=self.learning_rate.proto(),
            **{k: v for k, v in self.hyperparams.items() if v is not None})
        spec = pb.Optimizer(**{self.kind: message})
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
        return ["%s/%s" % (v.collection, v.path) for v in response.variables]


def sgd(learning_rate, momentum=None, nesterov=False):
    return GradientTransformation("sgd", _learning_rate(learning_rate),
                                  {"momentum": None if momentum is None else float(momentum),
                                   "nesterov": bool(nesterov)})


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    return GradientTransformation("adam", _learning_rate(learning_rate),
                                  {"b1": float(b1), "b2": float(b2), "eps": float(eps), "eps_root": float(eps_root)})


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=1e-4):
    return GradientTransformation("adamw", _learning_rate(learning_rate),
                                  {"b1": float(b1), "b2": float(b2), "eps": float(eps), "eps_root": float(eps_root),
                                   "weight_decay": float(weight_decay)})


@dataclasses.dataclass(frozen=True)
class _Clip:
    max_norm: float


def clip_by_global_norm(max_norm):
    return _Clip(float(max_norm))


def chain(*transforms):
    """optax.chain of what the server runs: optionally clip_by_global_norm, then one optimizer."""
    clips = [t for t in transforms if isinstance(t, _Clip)]
    txs = [t for t in transforms if isinstance(t, GradientTransformation)]
    if len(txs) != 1 or len(clips) > 1 or len(clips) + len(txs) != len(transforms) or \
            (clips and transforms[0] is not clips[0]):
        raise errors.InvalidArgumentError(
            "chain: the server runs clip_by_global_norm (optional, first) then one of sgd, adam, adamw")
    return dataclasses.replace(txs[0], clip_by_global_norm=clips[0].max_norm if clips else None)


# ---- the training loop ---------------------------------------------------------------

def _handle_of(variables):
    handles = variables_lib.handles_of(variables)
    if len(handles) != 1:
        raise errors.InvalidArgumentError("params: want one server layer's variables (a module or a composite's "
                                          "graph), got %d layers" % len(handles))
    return handles[0]


@dataclasses.dataclass(frozen=True)
class TrainState:
    """flax.training.train_state.TrainState, with params and opt_state on the server."""
    step: int
    apply_fn: object
    params: object            # what init returned: references to the server's variables
    tx: GradientTransformation

    @classmethod
    def create(cls, *, apply_fn, params, tx):
        tx.init(params)
        return cls(step=0, apply_fn=apply_fn, params=params, tx=tx)

    @property
    def opt_state(self):
        """The optimizer state, downloaded: {"count": ..., "mu/kernel": ...}."""
        handle = _handle_of(self.params)
        response = handle.session.call("GetVariables", service_pb2.GetVariablesRequest(
            layer_id=handle.layer_id, collections=["opt_state"]))
        return {v.path: handle.session.receive(v.value, v.path) for v in response.variables}


def train_step(state, x, target=None, dy=None, micro_batches=1, deterministic=True, dropout_seed=0):
    """One step, one call: forward, loss and backward over `micro_batches`
    parts of x (split along axis 0, gradients summed), then the update.
    Returns (new state, metrics) with metrics loss, applied, learning_rate,
    grad_norm and count."""
    if (target is None) == (dy is None):
        raise errors.InvalidArgumentError("train_step: give target (squared error) or dy (vdot), one of them")
    handle = _handle_of(state.params)
    session = handle.session
    pb = service_pb2
    xs = np.array_split(np.asarray(x), micro_batches)
    other = target if target is not None else dy
    others = np.array_split(dtypes.cast_to_wire(np.asarray(other), handle.output_wire_dtype), micro_batches)
    uploads = []
    try:
        request = pb.ForwardBackwardRequest(layer_id=handle.layer_id, deterministic=deterministic,
                                            apply_update=True)
        for i, (xi, oi) in enumerate(zip(xs, others)):
            mb = request.micro_batches.add(dropout_seed=dropout_seed + i)
            mb.x.CopyFrom(session.send(xi, uploads, "micro_batches[%d].x" % i))
            field = "target" if target is not None else "dy"
            getattr(mb, field).CopyFrom(session.send(oi, uploads, "micro_batches[%d].%s" % (i, field)))
        response = session.call("ForwardBackward", request)
    finally:
        session.delete_all(uploads)
    update = response.update
    metrics = {"loss": float(sum(response.values)), "applied": update.applied,
               "learning_rate": update.learning_rate, "grad_norm": update.grad_norm, "count": update.count,
               "total_notfinite": update.total_notfinite}
    return dataclasses.replace(state, step=state.step + 1), metrics
