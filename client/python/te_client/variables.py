"""Variables: what init returns, shaped like Flax's variable dict.

    params = layer.init(key, x)
    params["params"]["qkv"]["kernel"]        # a VariableRef: .shape, .dtype, np.asarray() fetches it
    te_client.tree_map(lambda v: v.shape, params)   # as jax.tree_util.tree_map prints it

The values stay on the server (a layer's parameters can be gigabytes); a
VariableRef downloads its collection when converted with np.asarray, and
Session.get_variables / set_variables move whole trees. A Variables object
also remembers the server layer that holds them (one for a TE module, and one
for a composite Module, whose graph holds its submodules' variables under
their Flax paths).
"""
import dataclasses

import numpy as np

from te_client import dtypes, errors


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


class VariableRef:
    """A variable held by the server: shape and dtype here, the value on demand."""
    __slots__ = ("handle", "info")

    def __init__(self, handle, info):
        self.handle = handle
        self.info = info

    shape = property(lambda self: self.info.shape)
    dtype = property(lambda self: self.info.dtype)
    ndim = property(lambda self: len(self.info.shape))
    size = property(lambda self: int(np.prod(self.info.shape, dtype=np.int64)))

    def value(self):
        """Downloads this variable's current value (the whole collection travels)."""
        from te_client import client
        session = self.handle.session
        request = client.service_pb2.GetVariablesRequest(layer_id=self.handle.layer_id,
                                                         collections=[self.info.collection])
        for v in session.call("GetVariables", request).variables:
            if v.path == self.info.path:
                return session.receive(v.value, self.info.path)
        raise errors.NotFoundError("variable %s/%s is not in layer %s" % (
            self.info.collection, self.info.path, self.handle.layer_id))

    def __array__(self, dtype=None, copy=None):
        value = np.asarray(self.value())
        return value if dtype is None else value.astype(dtype)

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


def tree_map(fn, tree):
    """jax.tree_util.tree_map over nested dicts, lists and tuples: a new tree, dict keys sorted."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, tree[k]) for k in sorted(tree)}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return fn(tree)
