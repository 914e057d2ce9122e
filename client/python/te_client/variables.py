"""Variables: what init returns, shaped like Flax's variable dict, and tree_map over it.

    params = layer.init(key, x)
    params["params"]["qkv"]["kernel"]        # a VariableRef: .shape, .dtype; np.asarray(ref), ref * 2 fetch it
    te_client.tree_map(lambda v: v.shape, params)   # as jax.tree_util.tree_map prints it; fetches nothing

    # An SGD step as JAX writes it, then written back to the server:
    loss, (grads, dx) = te_client.value_and_grad(layer.apply)(params, x, dy)
    new = te_client.tree_map(lambda p, g: p - lr * g, params["params"], grads["params"])   # numpy arrays
    session.set_variables(params, {"params": new})

The values stay on the server (a layer's parameters can be gigabytes). A
VariableRef is a handle: shape and dtype here, its current value fetched when
numpy or arithmetic needs it (np.asarray(ref), ref * 2, ref - g: the result
is a numpy array; `==` compares handles, not values). tree_map is JAX's:
pure, it returns a new tree of what `fn` returns and writes nothing to the
server, so a tree of fetched arrays stays on this side until
Session.set_variables writes it back (the Variables object keeps naming
the server's values). Within one tree_map, each layer's collection is
downloaded at most once, for the first leaf whose value `fn` reads.

A Variables object also remembers the server layer that holds them (one for
a TE module, and one for a composite Module, whose graph holds its
submodules' variables under their Flax paths). Where JAX is importable,
Variables is a JAX pytree node (jax.tree_util.tree_map, tree_leaves... see
its VariableRef leaves); JAX rebuilds a tree of the same VariableRefs as the
layer's Variables, and a tree of anything else as plain dicts, as tree_map
here does.
"""
import contextlib
import contextvars
import dataclasses

import numpy as np
import numpy.lib.mixins

from te_client import dtypes, errors
from te_client._pb import service_pb2


@dataclasses.dataclass(frozen=True)
class VariableInfo:
    collection: str      # "params" | "fp8_metas"
    path: str            # the server layer's path: "qkv/kernel"
    shape: tuple
    wire_dtype: int

    @property
    def dtype(self):
        return dtypes.dtype_name(self.wire_dtype)


@dataclasses.dataclass
class LayerHandle:
    """One server layer (a TE module, or a composite's graph) and what it holds."""
    session: object
    layer_id: str
    scope: tuple                 # where its variables sit in the tree: () for the root
    infos: list
    output_shape: tuple
    output_wire_dtype: int
    input_shape: tuple = ()
    input_wire_dtype: int = 0
    traced: object = None        # a composite's graph.Traced (the GraphSpec it was created from)
    trace_key: object = None     # the arguments it was traced for
    verified_keys: set = dataclasses.field(default_factory=set)   # other arguments found to trace the same


def join(*parts):
    """"params", ("A_0", "B_0"), "kernel" -> "params/A_0/B_0/kernel" (empty parts dropped)."""
    out = []
    for part in parts:
        if isinstance(part, (tuple, list)):
            out.extend(p for p in part if p)
        elif part:
            out.append(part)
    return "/".join(out)


# Inside tree_map: (layer_id, collection) -> {path: array}, so one map
# downloads each collection once however many of its leaves `fn` reads.
_fetched = contextvars.ContextVar("te_client_fetched", default=None)


@contextlib.contextmanager
def _fetching_once():
    token = _fetched.set({}) if _fetched.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _fetched.reset(token)


class VariableRef(numpy.lib.mixins.NDArrayOperatorsMixin):
    """A variable held by the server: shape and dtype here, the value on
    demand. numpy functions and arithmetic take it as its current value
    (fetched then) and return numpy arrays. `==` and hash are the handle's."""
    __slots__ = ("handle", "info")
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __init__(self, handle, info):
        self.handle = handle
        self.info = info

    shape = property(lambda self: self.info.shape)
    dtype = property(lambda self: self.info.dtype)
    ndim = property(lambda self: len(self.info.shape))
    size = property(lambda self: int(np.prod(self.info.shape, dtype=np.int64)))

    def value(self):
        """Downloads this variable's current value (the whole collection
        travels; inside tree_map, once per map)."""
        cache = _fetched.get()
        key = (self.handle.layer_id, self.info.collection)
        if cache is not None and key in cache:
            values = cache[key]
        else:
            session = self.handle.session
            request = service_pb2.GetVariablesRequest(layer_id=self.handle.layer_id,
                                                             collections=[self.info.collection])
            values = {v.path: v.value for v in session.call("GetVariables", request).variables}
            if cache is not None:
                cache[key] = values
        if self.info.path not in values:
            raise errors.NotFoundError("variable %s/%s is not in layer %s" % (
                self.info.collection, self.info.path, self.handle.layer_id))
        return self.handle.session.receive(values[self.info.path], self.info.path)

    def __array__(self, dtype=None, copy=None):
        value = np.asarray(self.value())
        return value if dtype is None else value.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # Each VariableRef among the inputs stands for its value (a bf16 one
        # without ml_dtypes as a Bfloat16Array, so bf16 rounding still applies).
        # A result written into one (ref += g, out=ref) would land in a fetched copy and never
        # reach the server, so it is refused.
        if any(isinstance(o, VariableRef) for o in kwargs.get("out", ())):
            raise TypeError("%r is read-only here: compute a new array and write it with "
                            "session.set_variables" % (self,))
        inputs = tuple(i.value() if isinstance(i, VariableRef) else i for i in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __len__(self):
        if not self.info.shape:
            raise TypeError("len() of a 0-d variable")
        return self.info.shape[0]

    def __getitem__(self, index):
        return self.value()[index]

    def __repr__(self):
        return "VariableRef(%s, %s%s)" % (
            join(self.info.collection, self.handle.scope, self.info.path), self.dtype, list(self.shape))


class Variables(dict):
    """{'params': {...}, 'fp8_metas': {...}} of VariableRefs, keys sorted as JAX prints them."""

    def __init__(self, handles, module=None):
        self.handles = dict(handles)      # scope tuple -> LayerHandle
        self.module = module
        flat = {}
        for handle in self.handles.values():
            for info in handle.infos:
                flat[join(info.collection, handle.scope, info.path)] = VariableRef(handle, info)
        super().__init__(unflatten(flat))

    @property
    def session(self):
        return next(iter(self.handles.values())).session if self.handles else None

    def collections(self):
        return sorted(self.keys())


def handles_of(variables):
    if not isinstance(variables, Variables):
        raise errors.InvalidArgumentError(
            "variables: want what init returned (a te_client Variables), got %s" % type(variables).__name__)
    return list(variables.handles.values())


def _index(handles):
    return {join(info.collection, h.scope, info.path): (h, info) for h in handles for info in h.infos}


def locate(handles, name):
    """(handle, collection, server path) of "params/A_0/kernel". InvalidArgumentError if unknown."""
    found = _index(handles).get(name)
    if found is None:
        raise errors.InvalidArgumentError("variables: no variable %r in this layer" % name)
    handle, info = found
    return handle, info.collection, info.path


def info_of(handles, name):
    found = _index(handles).get(name)
    return found[1] if found else None


def flatten(tree, prefix=""):
    """Nested dicts -> {"a/b/c": leaf}. Keys that already hold "/" are kept as they are."""
    flat = {}
    for key, value in tree.items():
        name = prefix + "/" + key if prefix else key
        if isinstance(value, dict):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def unflatten(flat):
    """{"a/b/c": leaf} -> nested dicts with keys sorted (as jax.tree_util rebuilds dicts)."""
    root = {}
    for name in sorted(flat):
        node = root
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = flat[name]
    return root


def tree_map(fn, tree, *rest):
    """jax.tree_util.tree_map(fn, tree, *rest): fn of the leaves at the same
    place in every tree, as a new tree shaped like `tree` (dicts with keys
    sorted, lists, tuples; None is an empty subtree, as in JAX). The other
    trees must have the same structure (InvalidArgumentError naming the first
    place they differ). Nothing is written to the server; see the module's
    comment for what reading a VariableRef's value costs."""
    with _fetching_once():
        return _map(fn, tree, rest, "")


def _map(fn, tree, rest, where):
    if tree is None:
        for other in rest:
            if other is not None:
                raise _mismatch(where, "None", other)
        return None
    if isinstance(tree, dict):
        keys = sorted(tree)
        for other in rest:
            if not isinstance(other, dict) or sorted(other) != keys:
                raise _mismatch(where, "a dict with keys %s" % keys, other)
        return {k: _map(fn, tree[k], [o[k] for o in rest], join(where, str(k))) for k in keys}
    if isinstance(tree, (list, tuple)):
        for other in rest:
            if type(other) is not type(tree) or len(other) != len(tree):
                raise _mismatch(where, "a %s of %d" % (type(tree).__name__, len(tree)), other)
        return type(tree)(_map(fn, v, [o[i] for o in rest], join(where, str(i))) for i, v in enumerate(tree))
    for other in rest:
        if isinstance(other, (dict, list, tuple)) or other is None:
            raise _mismatch(where, "a leaf", other)
    return fn(tree, *rest)


def _mismatch(where, want, got):
    if isinstance(got, dict):
        got = "a dict with keys %s" % sorted(got)
    elif isinstance(got, (list, tuple)):
        got = "a %s of %d" % (type(got).__name__, len(got))
    elif got is None:
        got = "None"
    else:
        got = "a leaf (%s)" % type(got).__name__
    return errors.InvalidArgumentError("tree_map: the trees differ at %s: the first has %s, another %s" % (
        where or "the root", want, got))


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [] if tree is None else [tree]


class _JaxAux:
    """A Variables' treedef data: its collections, and the object itself
    (equal and hashed by identity: JAX hashes treedefs, e.g. for jit's cache)."""
    __slots__ = ("keys", "original")

    def __init__(self, keys, original):
        self.keys, self.original = keys, original

    def __eq__(self, other):
        return isinstance(other, _JaxAux) and self.keys == other.keys and self.original is other.original

    def __hash__(self):
        return hash((self.keys, id(self.original)))


def _flatten_for_jax(variables):
    keys = tuple(sorted(variables))
    return [variables[k] for k in keys], _JaxAux(keys, variables)


def _unflatten_for_jax(aux, children):
    tree = dict(zip(aux.keys, children))
    before, after = _leaves(dict(aux.original)), _leaves(tree)
    if len(before) == len(after) and all(a is b for a, b in zip(before, after)):
        return aux.original      # the same VariableRefs: still the layer's variables
    return tree


_jax_registered = False


def register_with_jax(tree_util=None):
    """Makes Variables a JAX pytree node (jax.tree_util.register_pytree_node).
    Done at import where JAX is importable; True once registered."""
    global _jax_registered
    if _jax_registered:
        return True
    if tree_util is None:
        try:
            from jax import tree_util
        except Exception:      # no JAX (or a broken one): Variables stays a dict subclass to te_client alone
            return False
    tree_util.register_pytree_node(Variables, _flatten_for_jax, _unflatten_for_jax)
    _jax_registered = True
    return True


register_with_jax()
