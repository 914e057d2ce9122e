"""Module: Flax-style modules whose layers run on te_server.

Two kinds, used exactly as Flax modules are:
  * ServerModule: one TE module (te_client.flax.DenseGeneral ...): one server
    layer. init(key, x) creates it; apply(variables, x) runs it.
  * a composite: subclass Module, declare fields, and write __call__ in
    Flax's compact style, creating submodules inline and gluing them with
    numpy (reshape, np.split, +):

        class MLP(te_client.linen.Module):
            hidden_size: int
            ffn_hidden_size: int

            @te_client.linen.compact
            def __call__(self, x):
                x = te_flax.DenseGeneral(features=self.ffn_hidden_size)(x)
                x = te.activation.activation(x.reshape(*x.shape[:-1], 1, x.shape[-1]), ("gelu",))
                return te_flax.DenseGeneral(features=self.hidden_size)(x)

    Submodules are named as Flax names them ("DenseGeneral_0", or name=...),
    so the variable tree has Flax's paths; each is its own server layer.
    value_and_grad runs the glue on the client with a tape (tracing.py) and
    every server layer's Backward on the server.

A call runs in a Frame (one init / apply / gradient step): which session,
keys, the server layers by scope, and the tape.
"""
import contextvars
import dataclasses
import functools
import hashlib
from typing import Optional

import grpc
import numpy as np

from te_client import client as client_lib, dtypes, errors, recipe as recipe_lib, tracing
from te_client import variables as variables_lib

service_pb2 = client_lib.service_pb2
_frame = contextvars.ContextVar("te_client_frame", default=None)


def derive_seed(seed, *parts):
    """A 64-bit seed for a submodule or a step, stable across runs and machines."""
    text = "/".join([str(int(seed))] + [str(p) for p in parts])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def seed_of(key, purpose="params"):
    """A 64-bit seed from an int, a JAX PRNGKey (uint32[2] or a typed key) or
    Flax's {'params': key} dict."""
    if isinstance(key, dict):
        key = key.get(purpose, next(iter(key.values())) if key else 0)
    if key is None:
        return 0
    if isinstance(key, (int, np.integer)):
        return int(key) & (2**64 - 1)
    try:
        words = np.asarray(key).astype(np.uint64).ravel()
    except (TypeError, ValueError):   # a typed JAX key: jax.random.key(0)
        import jax
        words = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel()
    seed = 0
    for w in words:
        seed = ((seed << 32) | int(w)) & (2**64 - 1)
    return seed


class _Scope:
    __slots__ = ("path", "counters")

    def __init__(self, path):
        self.path = path
        self.counters = {}


class Frame:
    """One init / apply / value_and_grad run of a root module."""

    def __init__(self, mode, session, seed=0, dropout_seed=0, handles=None, dy=None):
        self.mode = mode                 # "init" | "apply" | "grad" | "step" | "capture"
        self.session = session
        self.seed = seed
        self.dropout_seed = dropout_seed
        self.handles = dict(handles or {})
        self.scopes = []
        self.tape = tracing.Tape() if mode == "grad" else None
        self.grads = {}                  # "params/<scope>/<path>" -> gradient
        self.dy = dy                     # "step": the root's output gradient
        self.step_result = None          # "step": (value, input grads)
        self.captured = None             # "capture": the root's Call

    def child_scope(self, type_name, name=None):
        parent = self.scopes[-1]
        if name is None:
            n = parent.counters.get(type_name, 0)
            parent.counters[type_name] = n + 1
            name = "%s_%d" % (type_name, n)
        return parent.path + (name,)

    def handle(self, scope, module):
        handle = self.handles.get(scope)
        if handle is None:
            raise errors.FailedPreconditionError(
                "variables: no layer for %s at %r; apply takes the variables init returned for the "
                "same module structure" % (type(module).__name__, "/".join(scope) or "<root>"))
        return handle

    def seed_for(self, scope):
        return self.seed if not scope else derive_seed(self.seed, *scope)

    def dropout_seed_for(self, scope):
        return self.dropout_seed if not scope else derive_seed(self.dropout_seed, "dropout", *scope)

    def add_grad(self, name, g):
        self.grads[name] = g if name not in self.grads else self.grads[name] + g


def current_frame(module):
    frame = _frame.get()
    if frame is None:
        raise errors.FailedPreconditionError(
            "%s is not bound: call module.init(key, x) or module.apply(variables, x), or call it "
            "inside another Module's __call__" % type(module).__name__)
    return frame


def compact(fn):
    """flax.linen.compact: marks __call__ as creating its submodules inline (the only style here)."""
    return fn


def _scoped_call(fn):
    """Wraps a composite's __call__: its submodules are named inside its scope."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        frame = current_frame(self)
        frame.scopes.append(_Scope(self._scope_in(frame)))
        try:
            self.setup()
            return fn(self, *args, **kwargs)
        finally:
            frame.scopes.pop()
    call._te_scoped = True
    return call


@dataclasses.dataclass
class Module:
    name: Optional[str] = dataclasses.field(default=None, kw_only=True)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(cls, "_server_module", False) and not getattr(call, "_te_scoped", False):
            cls.__call__ = _scoped_call(call)
        dataclasses.dataclass(cls)

    def __post_init__(self):
        # Like Flax, a submodule is named when it is constructed inside its parent's __call__.
        frame = _frame.get()
        self._bound = (frame, frame.child_scope(type(self).__name__, self.name)) if frame and frame.scopes else None

    def setup(self):
        """Flax's setup: runs before each __call__ (for derived attributes)."""

    def _scope_in(self, frame):
        if self._bound is None or self._bound[0] is not frame:
            self._bound = (frame, frame.child_scope(type(self).__name__, self.name) if frame.scopes else ())
        return self._bound[1]

    def _run_root(self, frame, args, kwargs):
        token = _frame.set(frame)
        try:
            self._bound = (frame, ())
            return self(*args, **kwargs)
        finally:
            _frame.reset(token)

    # ---- Flax's entry points ------------------------------------------------------------

    def init(self, rngs, *args, session=None, **kwargs):
        """Creates the variables on the server (under the current autocast: a
        DelayedScaling one adds fp8_metas) and returns them. `rngs`: an int, a
        JAX PRNGKey, or {'params': key}. `session`: default the current one."""
        session = session or client_lib.current_session()
        if session is None:
            raise errors.FailedPreconditionError(
                "init: no session; open one with `with client.session() as session:` or pass session=")
        frame = Frame("init", session, seed=seed_of(rngs))
        self._run_root(frame, args, kwargs)
        return variables_lib.Variables(frame.handles, module=self)

    def apply(self, variables, *args, rngs=None, **kwargs):
        """Runs the module on the server: y (a tuple for modules that also return
        their layernorm output). `rngs`: {'dropout': key} for dropout."""
        handles = variables_lib.handles_of(variables)
        frame = Frame("apply", variables.session, dropout_seed=seed_of(rngs, "dropout"),
                      handles={h.scope: h for h in handles})
        return self._run_root(frame, args, kwargs)

    def value_and_grad(self, variables, x, dy, *args, rngs=None, **kwargs):
        """jax.value_and_grad(lambda v, x: vdot(apply(v, x, ...)[0], dy), argnums=(0, 1)):
        returns (value, (param_grads, dx)); param_grads is {'params': {...}}
        of numpy arrays. dx is a tuple when several array inputs are given (q, k, v).
        Under DelayedScaling the step ends with the server's FP8 scale update."""
        handles = {h.scope: h for h in variables_lib.handles_of(variables)}
        dropout_seed = seed_of(rngs, "dropout")
        if isinstance(self, ServerModule):
            frame = Frame("step", variables.session, dropout_seed=dropout_seed, handles=handles, dy=dy)
            self._run_root(frame, (x,) + args, kwargs)
            value, input_grads = frame.step_result
        else:
            frame = Frame("grad", variables.session, dropout_seed=dropout_seed, handles=handles)
            inputs = [frame.tape.leaf(a) if _is_array(a) else a for a in (x,) + args]
            out = self._run_root(frame, inputs, kwargs)
            y = out[0] if isinstance(out, tuple) else out
            dy = dtypes.as_numpy(dy)
            value = float(np.vdot(np.asarray(tracing.value_of(y), np.float64), np.asarray(dy, np.float64)))
            grads = frame.tape.backward([(y, dy)]) if isinstance(y, tracing.Tracer) else {}
            input_grads = [grads.get(id(t), dtypes.zeros(t.shape, dtypes.wire_dtype(t.value)))
                           for t in inputs if isinstance(t, tracing.Tracer)]
        param_grads = variables_lib.unflatten(frame.grads)
        return value, (param_grads, input_grads[0] if len(input_grads) == 1 else tuple(input_grads))


def _is_array(a):
    """An input value_and_grad differentiates (a ResidentTensor is passed on as it is)."""
    return isinstance(a, np.ndarray) or (hasattr(a, "__array__") and hasattr(a, "shape")
                                         and not isinstance(a, client_lib.ResidentTensor))


def _shape_and_wire(x, field):
    if isinstance(x, client_lib.ResidentTensor):
        return tuple(x.shape), x.wire_dtype
    x = dtypes.as_numpy(tracing.value_of(x))
    return tuple(x.shape), dtypes.wire_dtype(x, field)


def _nbytes(x):
    if isinstance(x, client_lib.ResidentTensor):
        return int(np.prod(x.shape, dtype=np.int64)) * dtypes.ITEMSIZE[x.wire_dtype]
    return dtypes.as_numpy(tracing.value_of(x)).nbytes


@dataclasses.dataclass
class Call:
    x: object
    extra: list
    mask: object
    deterministic: bool


class ServerModule(Module):
    """A TE module that is one server layer. Subclasses give spec() and a
    __call__ with TE's signature that calls self._call(x, extra, mask, deterministic)."""
    _server_module = True
    returns_ln_out = False   # __call__ returns (y, ln_out): LayerNormDenseGeneral, LayerNormMLP, MHA

    def spec(self):
        raise NotImplementedError

    def _pack(self, y, ln_out):
        return (y, ln_out) if self.returns_ln_out else y

    def _call(self, x, extra=(), mask=None, deterministic=False):
        frame = current_frame(self)
        scope = self._scope_in(frame)
        run = {"init": self._init, "apply": self._forward, "grad": self._forward, "step": self._step,
               "capture": self._capture}[frame.mode]
        return run(frame, scope, x, list(extra), mask, bool(deterministic))

    def capture_call(self, variables, *args, **kwargs):
        """What apply(variables, *args, **kwargs) would send (x, extra inputs,
        mask, deterministic) as a Call, without sending it (for speedometer)."""
        frame = Frame("capture", variables.session,
                      handles={h.scope: h for h in variables_lib.handles_of(variables)})
        self._run_root(frame, args, kwargs)
        return frame.captured

    def _capture(self, frame, scope, x, extra, mask, deterministic):
        frame.captured = Call(x, extra, mask, deterministic)
        return None

    def _init(self, frame, scope, x, extra, mask, deterministic):
        shape, wire = _shape_and_wire(x, "x")
        handle = frame.handles.get(scope)
        if handle is None:   # a module called twice shares its layer, as Flax shares params
            request = service_pb2.InitLayerRequest(
                spec=self.spec(), seed=frame.seed_for(scope), input_dtype=wire, input_shape=shape,
                autocast=recipe_lib.autocast_proto(recipe_lib.current_autocast(), client_lib.recipe_pb2))
            response = frame.session.call("InitLayer", request)
            infos = [variables_lib.VariableInfo(v.collection, v.path, tuple(v.shape), v.dtype)
                     for v in response.variables]
            handle = variables_lib.LayerHandle(frame.session, response.layer_id, scope, infos,
                                               tuple(response.output_shape), response.output_dtype)
            frame.handles[scope] = handle
        y = dtypes.zeros(handle.output_shape, handle.output_wire_dtype)
        ln_out = dtypes.zeros(shape, wire) if getattr(self, "return_layernorm_output", False) else None
        return self._pack(y, ln_out)

    def _request(self, frame, handle, scope, x, extra, mask, deterministic, uploads):
        session = frame.session
        request = service_pb2.ForwardRequest(
            layer_id=handle.layer_id, x=session.send(tracing.value_of(x), uploads, "x"),
            extra_inputs=[session.send(tracing.value_of(e), uploads, "extra_inputs[%d]" % i)
                          for i, e in enumerate(extra)],
            deterministic=deterministic, dropout_seed=frame.dropout_seed_for(scope),
            autocast=recipe_lib.autocast_proto(recipe_lib.current_autocast(), client_lib.recipe_pb2),
            keep_outputs=session.large(4 * _nbytes(x)))
        if mask is not None:
            request.attention_mask.CopyFrom(session.send(tracing.value_of(mask), uploads, "attention_mask"))
        return request

    def _forward(self, frame, scope, x, extra, mask, deterministic):
        handle, session = frame.handle(scope, self), frame.session
        uploads = []
        try:
            request = self._request(frame, handle, scope, x, extra, mask, deterministic, uploads)
            request.keep_for_backward = frame.mode == "grad"
            response = session.call("Forward", request)
        finally:
            session.delete_all(uploads)
        y = session.receive(response.y, "y")
        ln_out = session.receive(response.ln_out, "ln_out") if response.ln_out.WhichOneof("data") else None
        if frame.mode != "grad":
            return self._pack(y, ln_out)
        outputs = frame.tape.record([x] + extra, [y] if ln_out is None else [y, ln_out],
                                    lambda grads: self._backward(frame, scope, response.forward_id, y, grads))
        return self._pack(outputs[0], outputs[1] if ln_out is not None else None)

    def _backward(self, frame, scope, forward_id, y, grads):
        if len(grads) > 1 and grads[1] is not None:
            raise errors.UnimplementedError(
                "%s: a gradient through ln_out cannot be sent (te.v1 Backward takes dy only)" % type(self).__name__)
        session = frame.session
        dy = grads[0] if grads[0] is not None else dtypes.zeros(y.shape, dtypes.wire_dtype(y))
        uploads = []
        try:
            request = service_pb2.BackwardRequest(forward_id=forward_id, dy=session.send(dy, uploads, "dy"),
                                                  keep_outputs=session.large(dtypes.as_numpy(dy).nbytes))
            response = session.call("Backward", request)
        finally:
            session.delete_all(uploads)
        self._collect_grads(frame, scope, response.grads)
        return [session.receive(response.dx, "dx")] + [
            session.receive(g, "extra_input_grads[%d]" % i) for i, g in enumerate(response.extra_input_grads)]

    def _collect_grads(self, frame, scope, grads):
        for v in grads:
            name = variables_lib.join("params", scope, v.path)
            frame.add_grad(name, frame.session.receive(v.value, "grads/" + v.path))

    def _step(self, frame, scope, x, extra, mask, deterministic):
        """value_and_grad of a root TE module: one ForwardBackward round trip
        (Forward + Backward when there are extra inputs, whose gradients only Backward returns)."""
        session, handle = frame.session, frame.handle(scope, self)
        if extra:
            frame.mode = "grad"
            frame.tape = tracing.Tape()
            leaves = [frame.tape.leaf(a) for a in [x] + extra]
            out = self._forward(frame, scope, leaves[0], leaves[1:], mask, deterministic)
            y = out[0] if isinstance(out, tuple) else out
            grads = frame.tape.backward([(y, frame.dy)])
            value = float(np.vdot(np.asarray(y.value, np.float64), np.asarray(frame.dy, np.float64)))
            frame.step_result = (value, [grads[id(t)] for t in leaves])
            return out
        uploads = []
        dy = dtypes.cast_to_wire(frame.dy, _shape_and_wire(x, "x")[1])   # the server wants dy in x's dtype
        try:
            batch = service_pb2.MicroBatch(x=session.send(x, uploads, "x"), dy=session.send(dy, uploads, "dy"),
                                           dropout_seed=frame.dropout_seed_for(scope))
            if mask is not None:
                batch.attention_mask.CopyFrom(session.send(mask, uploads, "attention_mask"))
            request = service_pb2.ForwardBackwardRequest(
                layer_id=handle.layer_id, micro_batches=[batch], deterministic=deterministic,
                autocast=recipe_lib.autocast_proto(recipe_lib.current_autocast(), client_lib.recipe_pb2),
                return_dx=True, return_grads=True)
            response = session.call("ForwardBackward", request)
        finally:
            session.delete_all(uploads)
        if len(response.values) != 1 or len(response.dx) != 1:
            raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward answered %d values and %d dx "
                               "for one micro-batch" % (len(response.values), len(response.dx)))
        self._collect_grads(frame, scope, response.grads)
        frame.step_result = (response.values[0], [session.receive(response.dx[0], "dx")])
        return None
