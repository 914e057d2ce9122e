"""Module: Flax-style modules whose layers run on te_server.

Two kinds, used exactly as Flax modules are:
  * ServerModule: one TE module (te_client.flax.DenseGeneral ...): one server
    layer. init(key, x) creates it; apply(variables, x) runs it.
  * a composite: subclass Module, declare fields, and write __call__ in
    Flax's compact style (or create submodules in setup), gluing TE modules
    with te_client.numpy, + and nn.Dropout:

        import te_client.numpy as jnp

        class MLP(te_client.linen.Module):
            hidden_size: int
            ffn_hidden_size: int

            @te_client.linen.compact
            def __call__(self, x):
                x = te_flax.DenseGeneral(features=self.ffn_hidden_size)(x)
                x = te.activation.activation(x.reshape(*x.shape[:-1], 1, x.shape[-1]), ("gelu",))
                return te_flax.DenseGeneral(features=self.hidden_size)(x)

    init runs __call__ once on symbolic tensors (symbolic.py, graph.py) and sends the
    te.v1.GraphSpec it recorded as one server layer; apply is one Forward
    and value_and_grad one ForwardBackward, so no activation crosses the wire.
    Submodules are named as Flax names them (ClassName_N per parent scope in
    call order, the attribute's name when made in setup, or name=), so the
    variable tree has Flax's paths ("params/TEUnfusedMLP_0/DenseGeneral_0/kernel").

Composite arguments: the first is the graph's "x"; an array passed as
`attention_mask` (or `mask`) is its "attention_mask"; other arrays are its
"extra_inputs[i]" in order; everything else is passed to __call__ as it is.
The graph is traced for init's arguments; apply and value_and_grad with other
ones (a mask where init had none, deterministic=True...) trace again and must
give the same graph (FailedPreconditionError naming the first node that
differs). Every dropout in the graph follows the request's `deterministic`
(the composite's own argument), so a submodule must receive that value.
"""
import contextvars
import dataclasses
import functools
import inspect
import weakref
from typing import Optional

import numpy as np

from te_client import dtypes, errors, graph, layer_calls, symbolic
from te_client import variables as variables_lib
from te_client._pb import layers_pb2, service_pb2
from te_client.session import ResidentTensor, current_session

_frame = contextvars.ContextVar("te_client_frame", default=None)
_MASK_ARGUMENTS = ("attention_mask", "mask")


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


# ---- frames and scopes ----------------------------------------------------------------

class _Scope:
    __slots__ = ("path", "counters", "in_setup")

    def __init__(self, path):
        self.path = path
        self.counters = {}
        self.in_setup = False


class Frame:
    """One run of a root module's __call__: "capture" (a TE module: what its
    call sends) or "trace" (a composite: the graph it records)."""

    def __init__(self, mode, deterministic=False, trace=None):
        self.mode = mode
        self.scopes = []
        self.captured = None
        self.shared = trace is not None   # a loss function's trace, which this module's apply records into
        self.trace = trace if trace is not None else graph.Trace(
            self.scope, deterministic) if mode == "trace" else None

    def scope(self):
        return self.scopes[-1].path if self.scopes else ()

    def child_scope(self, type_name, name=None):
        parent = self.scopes[-1]
        if name is None:
            n = parent.counters.get(type_name, 0)
            parent.counters[type_name] = n + 1
            name = "%s_%d" % (type_name, n)
        return parent.path + (name,)


def current_frame(module):
    frame = _frame.get()
    if frame is None:
        raise errors.FailedPreconditionError(
            "%s is not bound: call module.init(key, x) or module.apply(variables, x), or call it "
            "inside another Module's __call__" % type(module).__name__)
    return frame


def compact(fn):
    """flax.linen.compact: marks __call__ as creating its submodules inline."""
    return fn


def _scoped_call(fn):
    """Wraps a composite's __call__: setup runs first, and submodules are named inside its scope."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        frame = current_frame(self)
        scope = _Scope(self._scope_in(frame))
        frame.scopes.append(scope)
        try:
            scope.in_setup = True
            object.__setattr__(self, "_in_setup", True)
            try:
                self.setup()
            finally:
                scope.in_setup = False
                object.__setattr__(self, "_in_setup", False)
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
        # As in Flax: a submodule made in its parent's __call__ is named now
        # (ClassName_N); one made in setup is named by the attribute it is assigned to.
        frame = _frame.get()
        object.__setattr__(self, "_setup_parent", None)
        bound = None
        if frame is not None and frame.scopes:
            parent = frame.scopes[-1]
            if parent.in_setup:
                object.__setattr__(self, "_setup_parent", (frame, parent))
            else:
                bound = (frame, frame.child_scope(type(self).__name__, self.name))
        object.__setattr__(self, "_bound", bound)

    def __setattr__(self, key, value):
        if getattr(self, "_in_setup", False):
            _name_setup_submodules(key, value)
        object.__setattr__(self, key, value)

    def setup(self):
        """Flax's setup: runs before each __call__ (derived attributes, submodules)."""

    def param(self, name, init_fn, *init_args, unbox=True):
        """Flax's self.param(name, init_fn, shape[, dtype]) in a traced
        __call__ (or setup): a Param node named "<scope>/<name>", whose variable
        params/<scope>/<name> the server creates at init from `init_fn` (one of
        te_client.linen.initializers) and the optimizer trains. Returns the
        traced tensor."""
        from te_client import initializers   # initializers <- linen <- module: the data it reads
        frame = current_frame(self)
        if frame.mode != "trace":
            raise TypeError("%s.param(%r): parameters belong to composites (a Module's traced __call__)" % (
                type(self).__name__, name))
        if not init_args:
            raise TypeError("%s.param(%r, init_fn): give the shape, as Flax's initializers take it" % (
                type(self).__name__, name))
        shape = tuple(int(d) for d in (init_args[0] if isinstance(init_args[0], (tuple, list)) else (init_args[0],)))
        dtype = init_args[1] if len(init_args) > 1 else np.float32
        wire = symbolic.wire_of(dtype, "%s.param(%r) dtype" % (type(self).__name__, name))
        if wire not in (dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16):
            raise TypeError("%s.param(%r): dtype %s; a Param is float32, bfloat16 or float16" % (
                type(self).__name__, name, dtypes.dtype_name(wire)))
        init = initializers.as_initializer(init_fn, "%s.param(%r) init_fn" % (type(self).__name__, name))
        node = "/".join(tuple(self._scope_in(frame)) + (name,))
        frame.trace.claim(node, ("param", self, name))
        return frame.trace.record("param", layers_pb2.GraphSpec.Param(shape=list(shape), dtype=wire,
                                                                      initializer=init.proto()),
                                  [], [(shape, wire)], name=node, keep=True)[0]

    def variable(self, collection, name, *args, **kwargs):
        raise NotImplementedError(
            "%s.variable(%r, %r): a composite's own variables are its params (self.param); te.v1's GraphSpec has "
            "no other collection" % (type(self).__name__, collection, name))

    def _scope_in(self, frame):
        if self._bound is None or self._bound[0] is not frame:
            object.__setattr__(self, "_bound", (
                frame, frame.child_scope(type(self).__name__, self.name) if frame.scopes else ()))
        return self._bound[1]

    def _run_root(self, frame, args, kwargs):
        token = _frame.set(frame)
        outer_scope = frame.trace.scope if frame.shared else None
        if frame.shared:
            frame.trace.scope = frame.scope   # names inside the model are the model's own (its init's)
        try:
            object.__setattr__(self, "_bound", (frame, ()))
            return self(*args, **kwargs)
        finally:
            if frame.shared:
                frame.trace.scope = outer_scope
            _frame.reset(token)

    # ---- the layer this module holds in a session --------------------------------------------

    def _layer(self, session):
        """This module's layer in `session` while anything still refers to it, else None."""
        ref = self.__dict__.get("_layers", {}).get(id(session))
        handle = ref() if ref is not None else None
        return handle if handle is not None and handle.session is session and not handle.deleted else None

    def _remember_layer(self, handle):
        self.__dict__.setdefault("_layers", {})[id(handle.session)] = weakref.ref(handle)

    def _variables(self, variables, args, kwargs):
        """(layer, Version) that `variables` name: init's result or a tree of
        its VariableRefs as they are; any other pytree of arrays ({'params':
        {...}} of numpy arrays, an unpickled tree, a tree_map's result)
        uploaded with SetVariables into a new version of this module's layer
        (made now, from these arguments, if it has none in the session)."""
        found = variables_lib.refs_version(variables)
        if found is not None:
            handle = found[0]
            if handle.module_type is not None and handle.module_type is not type(self) and not (
                    issubclass(type(self), handle.module_type) or issubclass(handle.module_type, type(self))):
                raise errors.FailedPreconditionError(
                    "variables: init returned these for %s; %s.apply takes the variables init returned for a module "
                    "of the same structure" % (handle.module_type.__name__, type(self).__name__))
            return found
        if not isinstance(variables, dict):
            raise errors.InvalidArgumentError(
                "variables: want what init returned, or a pytree of arrays {'params': {...}}, got %s" %
                type(variables).__name__)
        unknown = sorted(set(variables) - set(variables_lib.COLLECTIONS))
        if unknown:
            raise errors.InvalidArgumentError(
                "variables: top-level keys %s; want collections (%s): apply takes {'params': params}, as Flax's" % (
                    unknown, ", ".join(variables_lib.COLLECTIONS)))
        flat = variables_lib.flatten(variables)
        refs = [v for v in flat.values() if isinstance(v, variables_lib.VariableRef)]
        session = refs[0].handle.session if refs else current_session()
        if session is None:
            raise errors.FailedPreconditionError("apply: no session for these arrays; open one with `with "
                                                 "client.session():`")
        handle = refs[0].handle if refs else self._layer(session)
        base = refs[0].version if refs else None
        if handle is None:
            made = self.init(0, *args, session=session, **kwargs)
            handle, base = made.handle, made.version
        upload = {name: (np.asarray(v) if isinstance(v, variables_lib.VariableRef) else v)
                  for name, v in flat.items()
                  if not (isinstance(v, variables_lib.VariableRef) and v.version is base)}
        number = session.set_version(handle, base.number if base is not None else 0, upload)
        return handle, variables_lib.Version(handle, number)

    # ---- Flax's entry points ------------------------------------------------------------

    def init(self, rngs, *args, session=None, **kwargs):
        """Creates the variables on the server (under the current autocast: a
        DelayedScaling one adds fp8_metas) and returns them. `rngs`: an int, a
        JAX PRNGKey, or {'params': key}. `session`: default the current one.
        A composite is traced here and created as one graph layer. With TE's
        decode=True (a MultiHeadAttention, a DECODER TransformerLayer, or a
        composite passing it to them) x is the full-length input and the
        cache collection is created for its batch and length."""
        session = session or current_session()
        if session is None:
            raise errors.FailedPreconditionError(
                "init: no session; open one with `with client.session() as session:` or pass session=")
        if isinstance(self, ServerModule):
            spec, call, traced, key = self.spec(), self.capture(args, kwargs), None, None
        else:
            bound = _Bound(self, args, kwargs)
            traced, key = self._trace(bound), bound.key
            spec, call = layers_pb2.LayerSpec(graph=traced.spec), bound.call(traced)
        old = self._layer(session)
        decode = traced.decode if traced is not None else call.decode
        handle = layer_calls.init_layer(session, spec, seed_of(rngs), call.x, self, traced, key, decode=decode)
        if old is not None:
            # init again replaces the layer this module made before (as Flax's init makes
            # new variables): the old one is freed now rather than left to its references.
            old.deleted = True
            session.call("DeleteLayer", service_pb2.DeleteLayerRequest(layer_id=old.layer_id))
        self._remember_layer(handle)
        return variables_lib.Variables({(): handle}, module=self, version=variables_lib.Version(handle, 1))

    def apply(self, variables, *args, rngs=None, mutable=False, **kwargs):
        """Runs the module on the server (one Forward): y (a tuple for TE
        modules that also return their layernorm output). `rngs`: {'dropout': key}.
        `variables`: init's result, or any pytree of arrays ({'params': ...},
        uploaded into a new version). Any batch size: a composite traced for
        other shapes than init's is added to its layer as another graph
        (AddGraph, once per shape), as jax.jit retraces per shape.

        Functional, as TE's: under DelayedScaling a forward leaves fp8_metas
        as they were (only a step moves them). As in Flax, mutable=["fp8_metas"]
        (or True) lets it change them: the forward ends its step on the server
        (amaxes recorded, scales updated), and the call returns (y, variables),
        new variables with the state moved. Inside a function traced by
        te_client.value_and_grad, apply records the model's graph into it.

        TE's decode=True (x: the next token, [batch, 1, ...]) runs one
        autoregressive step on the cache collection init(..., decode=True)
        made: as in Flax it needs mutable=["cache"] and returns (y,
        variables), the new version with the cache advanced; the cache stays
        on the server (its values are fetched only when read)."""
        if mutable is not False and mutable is not True and not isinstance(mutable, (list, tuple, set, str)):
            raise TypeError("apply: mutable=%r; want False, True or collection names" % (mutable,))
        names = {mutable} if isinstance(mutable, str) else set(mutable) if mutable not in (False, True) else set()
        unsupported = sorted(names - {"fp8_metas", "params", "cache"})
        if unsupported:
            raise NotImplementedError(
                "apply(mutable=%s): te_client's modules keep the collections params, fp8_metas and cache only "
                "(no intermediates: sow is not recorded); mutable=['fp8_metas'] ends the forward's FP8 step, "
                "mutable=['cache'] returns a decode step's cache" % unsupported)
        loss = graph.current_loss()
        if loss is not None:
            if mutable is not False:
                raise NotImplementedError("apply(mutable=...) inside a traced loss function: the step's new "
                                          "variables are what value_and_grad / train_step return")
            return self._apply_traced(loss, variables, args, kwargs, rngs)
        update_fp8_metas = mutable is True or "fp8_metas" in names
        handle, version = self._variables(variables, args, kwargs)
        call, info = self._call_for(handle, args, kwargs)
        decode = info.traced.decode if info is not None else call.decode
        if decode and mutable is not True and "cache" not in names:
            cache = next((i for i in handle.infos if i.collection == "cache"), None)
            raise errors.InvalidArgumentError(
                'Cannot update variable "%s" in "/%s" because collection "cache" is immutable: a decode=True '
                'step writes the cache; apply(..., decode=True, mutable=["cache"]) returns (y, variables) '
                "with it advanced (Flax's ModifyScopeVariableError)" % (
                    cache.path.rsplit("/", 1)[-1] if cache else "cached_key",
                    cache.path.rsplit("/", 1)[0] if cache and "/" in cache.path else ""))
        uploads, session = [], handle.session
        try:
            request = layer_calls.forward_request(handle, call, self._dropout_seed(handle, call, rngs, info), uploads,
                                                  update_fp8_metas=update_fp8_metas,
                                                  graph=info.index if info else 0, version=version.number,
                                                  decode=decode)
            response = session.call("Forward", request)
        finally:
            session.delete_all(uploads)
        y = session.receive(response.y, "y")
        if isinstance(self, ServerModule):
            ln_out = session.receive(response.ln_out, "ln_out") if response.ln_out.WhichOneof("data") else None
            y = self._pack(y, ln_out)
        if mutable is False:
            return y
        moved = variables_lib.Variables({handle.scope: handle}, self, variables_lib.Version(handle, response.version)) \
            if response.version and response.version != version.number else (
                variables if isinstance(variables, variables_lib.Variables) else
                variables_lib.Variables({handle.scope: handle}, self, version))
        return y, moved

    def _apply_traced(self, loss, variables, args, kwargs, rngs):
        """apply inside a traced loss function: the model's graph, inlined (its
        module nodes keep their names, so they are the layer's own variables)."""
        loss.bind(self, variables)
        if rngs is not None:
            loss.dropout_key(rngs)
        return self._run_root(Frame("trace", trace=loss.trace), args, kwargs)

    def value_and_grad(self, variables, x, dy, *args, rngs=None, **kwargs):
        """jax.value_and_grad(lambda v, x: vdot(apply(v, x, ...)[0], dy), argnums=(0, 1)):
        returns (value, (param_grads, dx)); param_grads is {'params': {...}}
        of numpy arrays, whose .variables are the variables after the step
        (under DelayedScaling its FP8 scale update). dx is a tuple when several
        array inputs are given (q, k, v). One ForwardBackward call (Forward +
        Backward where there are extra inputs, whose gradients only Backward returns)."""
        handle, version = self._variables(variables, (x,) + args, kwargs)
        call, info = self._call_for(handle, (x,) + args, kwargs)
        value, grads, input_grads, new_version = layer_calls.step(
            handle, call, dy, self._dropout_seed(handle, call, rngs, info), info, version.number)
        grads = variables_lib.Gradients(variables_lib.unflatten(grads))
        grads.variables = variables_lib.Variables({handle.scope: handle}, self, variables_lib.Version(
            handle, new_version)) if new_version and new_version != version.number else (
                variables if isinstance(variables, variables_lib.Variables) else
                variables_lib.Variables({handle.scope: handle}, self, version))
        return value, (grads, input_grads[0] if len(input_grads) == 1 else tuple(input_grads))

    def _dropout_seed(self, handle, call, rngs, info=None):
        """The dropout seed of a call; as in Flax, a dropout that runs (deterministic=False,
        rate > 0) without apply's rngs['dropout'] is an error, not seed 0."""
        has_key = rngs is not None and (not isinstance(rngs, dict) or "dropout" in rngs)
        traced = info.traced if info is not None else handle.traced
        if not call.deterministic and not has_key:
            users = (traced.dropouts if traced is not None else
                     [type(self).__name__] if any(r > 0 for r in self.dropout_rates()) else [])
            if users:
                raise errors.InvalidArgumentError(
                    '%s needs PRNG for "dropout": with deterministic=False pass rngs={"dropout": key}, as '
                    "Flax requires" % ", ".join(users))
        return seed_of(rngs, "dropout")

    def capture_call(self, variables, *args, **kwargs):
        """What apply(variables, *args, **kwargs) would send (x, extra inputs,
        mask, deterministic) as a Call, without sending it (for speedometer)."""
        handle, _ = self._variables(variables, args, kwargs)
        return self._call_for(handle, args, kwargs)[0]

    def trace(self, *args, **kwargs):
        """The graph.Traced (GraphSpec, edge shapes and dtypes) init would
        create for these arguments; no server is needed. Composites only."""
        if isinstance(self, ServerModule):
            raise TypeError("%s is one TE module (one server layer), not a composite" % type(self).__name__)
        return self._trace(_Bound(self, args, kwargs))

    def _trace(self, bound):
        frame = Frame("trace", bound.deterministic)
        symbols = {name: frame.trace.input(name, *layer_calls.shape_and_wire(value, name)) for name, value in bound.inputs}
        args, kwargs = bound.substituted(symbols)
        return frame.trace.build(self._run_root(frame, args, kwargs))

    def _call_for(self, handle, args, kwargs):
        """(the Call for these arguments, the layer's GraphInfo of their graph:
        None for graph 0 of a TE module), checking the layer is a module of
        this kind. A composite's arguments of another signature than init's
        (another batch size, a mask...) trace again, once per signature."""
        composite = not isinstance(self, ServerModule)
        if (handle.traced is not None) != composite:
            raise errors.FailedPreconditionError(
                "variables: init returned these for %s; %s.apply takes the variables init returned for a "
                "module of the same structure" % (handle.module_type.__name__ if handle.module_type else
                                                   "another module", type(self).__name__))
        if not composite:
            return self.capture(args, kwargs), None
        bound = _Bound(self, args, kwargs)
        if bound.key == handle.trace_key:
            info = variables_lib.GraphInfo(0, handle.traced, tuple(handle.output_shape), handle.output_wire_dtype)
        else:
            info = handle.graphs.get(bound.key)
            if info is None:
                traced = self._trace(bound)
                shape, wire = layer_calls.shape_and_wire(dict(bound.inputs)["x"], "x")
                info = layer_calls.add_graph(handle, traced, shape, wire)
                if info.traced.decode != traced.decode:
                    # The same graph called with and without decode: one
                    # server graph, and this call's own decode.
                    info = dataclasses.replace(info, traced=traced)
                handle.graphs[bound.key] = info
        return bound.call(info.traced), info


def _name_setup_submodules(attribute, value):
    """Flax's setup naming: `self.dense = Dense(...)` is "dense"; a list's items "layers_0", "layers_1"."""
    items = [(attribute, value)] if isinstance(value, Module) else [
        ("%s_%d" % (attribute, i), v) for i, v in enumerate(value)] if isinstance(value, (list, tuple)) else []
    for name, module in items:
        if isinstance(module, Module) and module._bound is None and module._setup_parent is not None:
            frame, parent = module._setup_parent
            object.__setattr__(module, "_bound", (frame, parent.path + (module.name or name,)))


# ---- a composite's arguments ---------------------------------------------------------------

def _is_array(a):
    return isinstance(a, (np.ndarray, ResidentTensor)) or (
        hasattr(a, "__array__") and hasattr(a, "shape") and hasattr(a, "dtype"))


class _Bound:
    """A composite's __call__ arguments, split into the graph's inputs and the rest."""

    def __init__(self, module, args, kwargs):
        self.module = module
        self.signature = inspect.signature(type(module).__call__)
        try:
            bound = self.signature.bind(module, *args, **kwargs)
        except TypeError as e:
            raise TypeError("%s.__call__: %s" % (type(module).__name__, e)) from None
        bound.apply_defaults()
        self.arguments = dict(bound.arguments)
        params = list(self.signature.parameters.values())[1:]
        if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
            raise TypeError("%s.__call__ takes no input x" % type(module).__name__)
        self.inputs = []            # (graph input name, value)
        self._where = {}            # graph input name -> (parameter, index in a *args / key in a **kwargs)
        key = [repr(module)]
        for p in params:
            value = self.arguments.get(p.name)
            if p.kind == inspect.Parameter.VAR_POSITIONAL:
                places = list(enumerate(value))
            elif p.kind == inspect.Parameter.VAR_KEYWORD:
                places = sorted(value.items())
            else:
                places = [(None, value)]
            for at, v in places:
                if not _is_array(v):
                    key.append((p.name, at, repr(v)))
                    continue
                if p is params[0]:
                    name = "x"
                elif p.name in _MASK_ARGUMENTS and at is None:
                    name = "attention_mask"
                else:
                    name = "extra_inputs[%d]" % sum(n.startswith("extra_inputs") for n, _ in self.inputs)
                self.inputs.append((name, v))
                self._where[name] = (p.name, at)
                key.append((p.name, at, name) + layer_calls.shape_and_wire(v, name))
        if not self.inputs or self.inputs[0][0] != "x":
            raise TypeError("%s.__call__: x (%s) must be an array, got %s" % (
                type(module).__name__, params[0].name, type(self.arguments.get(params[0].name)).__name__))
        self.deterministic = bool(self.arguments.get("deterministic") or False)
        self.key = tuple(key)

    def substituted(self, symbols):
        """(args, kwargs) for __call__ with each graph input replaced by its Symbol."""
        arguments = {k: (list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, dict) else v)
                     for k, v in self.arguments.items()}
        for name, (param, at) in self._where.items():
            if at is None:
                arguments[param] = symbols[name]
            else:
                arguments[param][at] = symbols[name]
        for p in self.signature.parameters.values():
            if p.kind == inspect.Parameter.VAR_POSITIONAL and p.name in arguments:
                arguments[p.name] = tuple(arguments[p.name])
        bound = inspect.BoundArguments(self.signature, arguments)
        return bound.args[1:], bound.kwargs

    def call(self, traced):
        """The Call a request sends: the mask only when the graph reads it, and
        the extra inputs up to the last it reads (the server takes exactly those)."""
        values = dict(self.inputs)
        read = [i for i, (n, _) in enumerate(n for n in self.inputs if n[0].startswith("extra_inputs"))
                if n in traced.inputs]
        extra = [v for n, v in self.inputs if n.startswith("extra_inputs")][:read[-1] + 1 if read else 0]
        mask = values.get("attention_mask") if "attention_mask" in traced.inputs else None
        return layer_calls.Call(values["x"], extra, mask, self.deterministic)


# ---- TE modules -------------------------------------------------------------------------

class ServerModule(Module):
    """A TE module that is one server layer. Subclasses give spec(),
    output_shapes() and a __call__ with TE's signature that calls
    self._call(x, extra, mask, deterministic). At the top level its call is
    captured and sent; inside a traced composite it records a module node."""
    _server_module = True
    returns_ln_out = False   # __call__ returns (y, ln_out): LayerNormDenseGeneral, LayerNormMLP, MHA

    def spec(self):
        raise NotImplementedError

    def output_shapes(self, input_shapes):
        """[y's shape] (and ln_out's, when the module returns it) for inputs of `input_shapes` (x, k, v)."""
        return [tuple(input_shapes[0])]

    def dropout_rates(self):
        """The module's own dropout rates: any above 0 makes `deterministic` matter."""
        return ()

    def output_wire(self, input_wire):
        """y's te.v1 DType for an input of `input_wire`: TE's modules compute in their input's."""
        return input_wire

    def _pack(self, y, ln_out):
        return (y, ln_out) if self.returns_ln_out else y

    def capture(self, args, kwargs):
        frame = Frame("capture")
        self._run_root(frame, args, kwargs)
        return frame.captured

    def _call(self, x, extra=(), mask=None, deterministic=False, decode=False):
        frame = current_frame(self)
        if frame.mode == "trace":
            return self._record(frame, x, list(extra), mask, deterministic, decode)
        frame.captured = layer_calls.Call(x, list(extra), mask, bool(deterministic), bool(decode))
        return self._pack(None, None)

    def _record(self, frame, x, extra, mask, deterministic, decode=False):
        trace = frame.trace
        name = "/".join(self._scope_in(frame))
        if decode:
            # The graph is the same; the layer decodes (its caches are its
            # module nodes' own) when init and apply say so.
            trace.decodes.append(name)
        for i, t in enumerate([x] + extra):
            if not isinstance(t, symbolic.Symbol):
                raise TypeError("%s (%s): input %d is a %s, not a traced tensor: inside a composite every "
                                "module input comes from the composite's inputs (GraphSpec has no constants)" % (
                                    name, type(self).__name__, i, type(t).__name__))
        if mask is not None and not (isinstance(mask, symbolic.Symbol) and mask.is_mask):
            raise TypeError("%s (%s): the mask is a %s, not a traced mask: pass it to the composite as "
                            "attention_mask, or make it with nn.make_causal_mask" % (
                                name, type(self).__name__, "computed tensor" if isinstance(mask, symbolic.Symbol)
                                else type(mask).__name__))
        if any(r > 0 for r in self.dropout_rates()):
            check_deterministic(trace, name, type(self).__name__, deterministic)
        trace.claim(name, self)
        shapes = self.output_shapes([t.shape for t in [x] + extra])
        outputs = trace.record("module", self.spec(), [x] + extra, [(s, self.output_wire(x.wire)) for s in shapes],
                               name=name, mask=mask, keep=True)
        return self._pack(outputs[0], outputs[1] if len(outputs) > 1 else None)


def check_deterministic(trace, name, type_name, deterministic):
    """A traced dropout follows the request's deterministic; refuse one told otherwise.
    A loss function's trace takes the first value a dropout is called with."""
    trace.dropouts.append(name)
    if trace.deterministic is None:
        trace.deterministic = bool(deterministic)
    if bool(deterministic) != trace.deterministic:
        raise NotImplementedError(
            "%s (%s): called with deterministic=%s inside a composite traced with deterministic=%s: every "
            "dropout of a te.v1 GraphSpec follows apply's deterministic, so pass the composite's own "
            "deterministic down (or make the rate 0)" % (name, type_name, bool(deterministic), trace.deterministic))
