"""Variables: what init returns, shaped like Flax's variable dict; values, not handles.

    variables = layer.init(key, x)
    variables["params"]["qkv"]["kernel"]       # a VariableRef: .shape, .dtype (numpy); np.asarray(ref) fetches it
    snapshot = variables                       # stays what it is: a training step returns new variables
    te_client.tree_map(lambda v: v.shape, variables)
    pickle.dumps(variables)                    # by value: a tree of numpy arrays

A layer's variables live on the server in versions (te.v1's ReleaseVersions):
InitLayer makes version 1, and every call that changes them (a step, an
update, SetVariables) makes a new one from the version it read, leaving that
one as it was. A Variables object names one version of one layer, so what a
client holds never changes under it: a step returns new Variables and the
old ones stay readable. When the last Python reference to a version goes,
its release is queued and sent, batched, ahead of the session's next call
(never from the garbage collector itself: a finalizer only appends to a
queue); a layer none of whose Variables, modules or versions is referenced
any more is deleted the same way (DeleteLayer).

The values stay on the server (a layer's parameters can be gigabytes). A
VariableRef has shape and dtype here, and its value is fetched when numpy or
arithmetic needs it (np.asarray(ref), ref * 2, ref - g: the result is a
numpy array; `==` compares refs, not values). tree_map is JAX's: pure, it
returns a new tree of what `fn` returns, and within one map each collection
of a version is downloaded at most once. Where JAX is importable, Variables
is a JAX pytree node (jax.tree_util.tree_map, tree_leaves...); tree_flatten
and tree_unflatten here are JAX's for te_client's trees.
"""
import collections
import contextlib
import contextvars
import dataclasses
import threading
import weakref

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
        """A numpy dtype (ml_dtypes' bfloat16, or te_client.bfloat16's marker without ml_dtypes)."""
        numpy_dtype = dtypes._numpy_dtype_of(self.wire_dtype)
        return numpy_dtype if numpy_dtype is not None else dtypes.bfloat16


@dataclasses.dataclass(eq=False)
class GraphInfo:
    """One graph of a layer (AddGraph): its index and what it was traced as."""
    index: int
    traced: object
    output_shape: tuple
    output_wire: int


@dataclasses.dataclass(eq=False)
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
    graphs: dict = dataclasses.field(default_factory=dict)        # spec bytes + input signature -> GraphInfo
    deleted: bool = False         # replaced by another init of its module (DeleteLayer sent)
    # The Versions held, by number (one object per number: see Version).
    versions: object = dataclasses.field(default_factory=weakref.WeakValueDictionary, repr=False)
    module_type: object = None    # the module class init traced
    __weakref__: object = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        # The layer goes when nothing refers to it any more; as for versions, its
        # DeleteLayer is queued and sent ahead of the session's next call.
        weakref.finalize(self, _queue, self.session, ("delete", self.layer_id, 0))


def _queue(session, item):
    pending = getattr(session, "pending", None)
    if pending is not None and not getattr(session, "closed", True):
        pending.append(item)   # deque.append: atomic, takes no lock (safe inside a finalizer)


COLLECTIONS = ("params", "fp8_metas", "opt_state", "grads", "cache")


class Gradients(dict):
    """A gradient tree ({'params': {...}} of numpy arrays, or shaped like the
    argument it differentiates) that remembers the step it came from:
    `variables`, the layer's variables after that step (under DelayedScaling
    the FP8 state moved), which TrainState.apply_gradients continues from."""
    variables = None


class Version:
    """One version of a layer's variables that this client holds; released
    when the last reference goes (queued, sent with the session's next call).
    Number 0 is the server's newest (a server without versions answers 0).
    One object per number of a layer (LayerHandle.versions): a response that
    names a version already held (a step that made none) gets that object, so
    the number is released once, when no one holds it any more.

    `donated_to`: the training step it was donated to (train_step(...,
    donate=True)), which releases it on the server; reading the number (what
    every call that reads these variables does) then raises, whatever that
    step's outcome, as a donated JAX array is gone."""
    __slots__ = ("handle", "_number", "donated_to", "__weakref__")

    def __new__(cls, handle, number):
        number = int(number)
        live = getattr(handle, "versions", None)
        found = live.get(number) if number and live is not None else None
        if found is not None:
            return found
        self = object.__new__(cls)
        self.handle = handle
        self._number = number
        self.donated_to = None
        if number:
            weakref.finalize(self, _queue, handle.session, ("release", handle.layer_id, number))
            if live is not None:
                live[number] = self
        return self

    @property
    def number(self):
        _check_not_donated(self)
        return self._number

    def __repr__(self):
        return "Version(%s, %d)" % (self.handle.layer_id, self._number)


def _check_not_donated(version):
    if version.donated_to is None:
        return
    raise errors.InvalidArgumentError(
        "variables: these variables of layer %s were donated to a training step "
        "(train_step(..., donate=True)), which writes them in place and releases them; "
        "read the state that step returned" % version.handle.layer_id)


_NUMBER = Version.__dict__["_number"]   # Version's slot, under PendingVersion's property
_claim_lock = threading.Lock()


class PendingVersion(Version):
    """The version a step still in flight is making (pipeline.py): a value
    like any Version, whose number comes with the step's answer. Reading
    `number` (what every call that reads these variables does) waits for
    that step and raises its failure. Once known, the number is held as any
    Version's: released when the last reference goes (or, should the step
    answer after that, when it answers)."""
    __slots__ = ("step", "_alias")

    def __new__(cls, handle, step):
        self = object.__new__(cls)
        self.handle = handle
        self.step = step
        self._alias = None
        self.donated_to = None
        step.handle_ref = weakref.ref(handle)
        weakref.finalize(self, step.version_dropped)
        return self

    @property
    def number(self):
        _check_not_donated(self)
        try:
            return _NUMBER.__get__(self, Version)
        except AttributeError:
            pass
        number = int(self.step.result().version)
        with _claim_lock:
            try:
                return _NUMBER.__get__(self, Version)
            except AttributeError:
                pass
            live = self.handle.versions
            found = live.get(number) if number else None
            if found is not None and found is not self:
                self._alias = found     # that object holds (and releases) the number
            elif number:
                live[number] = self
                self.step.claim()
            _NUMBER.__set__(self, number)
        return number

    def ready(self):
        """Whether the number is known (the step has settled) without waiting."""
        return self.step.settled()

    def __repr__(self):
        if not self.step.settled():
            return "PendingVersion(%s, <step in flight>)" % self.handle.layer_id
        if self.step.error is not None:
            return "PendingVersion(%s, <step failed>)" % self.handle.layer_id
        return "Version(%s, %d)" % (self.handle.layer_id, int(self.step.response.version))


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
    __slots__ = ("handle", "info", "version")
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __init__(self, handle, info, version):
        self.handle = handle
        self.info = info
        self.version = version     # the Version it belongs to (kept alive by it)

    shape = property(lambda self: self.info.shape)
    dtype = property(lambda self: self.info.dtype)
    ndim = property(lambda self: len(self.info.shape))
    size = property(lambda self: int(np.prod(self.info.shape, dtype=np.int64)))

    def value(self):
        """Downloads this variable's current value (the whole collection
        travels; inside tree_map, once per map)."""
        cache = _fetched.get()
        key = (self.handle.layer_id, self.version.number, self.info.collection)
        if cache is not None and key in cache:
            values = cache[key]
        else:
            session = self.handle.session
            request = service_pb2.GetVariablesRequest(layer_id=self.handle.layer_id, version=self.version.number,
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

    @property
    def name(self):
        return join(self.info.collection, self.handle.scope, self.info.path)

    def __repr__(self):
        return "VariableRef(%s, %s%s, %r)" % (self.name, self.dtype, list(self.shape), self.version)

    def __reduce__(self):
        return (np.asarray, (self.__array__(),))   # by value


class Variables(dict):
    """{'params': {...}, 'fp8_metas': {...}} of VariableRefs of one version of
    a layer, keys sorted as JAX prints them."""

    def __init__(self, handles, module=None, version=None):
        self.handles = dict(handles)      # scope tuple -> LayerHandle (one: the module's layer)
        self.module = module
        handle = next(iter(self.handles.values()), None)
        self.version = version if version is not None or handle is None else Version(handle, 0)
        flat = {}
        for h in self.handles.values():
            for info in h.infos:
                flat[join(info.collection, h.scope, info.path)] = VariableRef(h, info, self.version)
        super().__init__(unflatten(flat))

    @property
    def session(self):
        return next(iter(self.handles.values())).session if self.handles else None

    @property
    def handle(self):
        return next(iter(self.handles.values()))

    def collections(self):
        return sorted(self.keys())

    def at_version(self, number):
        """The same layer's variables at version `number` (a step's result)."""
        handle = self.handle
        if not number and self.version.number == 0:
            return self
        return Variables(self.handles, self.module, Version(handle, number))

    def fetch(self, collections=None):
        """The variables' values as a nested dict of numpy arrays (one GetVariables)."""
        return self.session.get_variables(self, collections)

    def __reduce__(self):
        # By value: a pickled Variables is the tree of its values (what apply, and a new process, take).
        return (dict, (self.fetch(),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self   # a value: copying it is sharing it


def handles_of(variables):
    found = refs_version(variables)
    if found is None:
        raise errors.InvalidArgumentError(
            "variables: want what init returned (a te_client Variables) or a tree of its VariableRefs, got %s"
            % type(variables).__name__)
    return [found[0]]


def refs_version(tree):
    """(handle, Version) when every leaf of `tree` is a VariableRef of one
    version of one layer (a Variables, {'params': variables['params']}...),
    else None."""
    if isinstance(tree, Variables):
        return tree.handle, tree.version
    leaves = _leaves(tree) if isinstance(tree, (dict, list, tuple)) else []
    if not leaves or not all(isinstance(v, VariableRef) for v in leaves):
        return None
    first = leaves[0]
    if any(v.handle is not first.handle or v.version is not first.version for v in leaves):
        if any(v.handle is not first.handle for v in leaves):
            raise errors.InvalidArgumentError("variables: VariableRefs of several layers in one tree")
        return None
    return first.handle, first.version


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


def tree_leaves(tree):
    """jax.tree_util.tree_leaves: the leaves in JAX's order (dict keys sorted; None is no leaf)."""
    return _leaves(tree)


@dataclasses.dataclass(frozen=True)
class TreeDef:
    """tree_flatten's structure: rebuilds a tree of the same shape from new leaves."""
    kind: str                  # "dict", "list", "tuple", "none", "leaf"
    keys: tuple = ()
    children: tuple = ()
    original: object = dataclasses.field(default=None, compare=False, hash=False)

    @property
    def num_leaves(self):
        return 1 if self.kind == "leaf" else sum(c.num_leaves for c in self.children)


def tree_flatten(tree):
    """jax.tree_util.tree_flatten: (leaves, treedef)."""
    return _leaves(tree), _treedef(tree)


def _treedef(tree):
    if tree is None:
        return TreeDef("none")
    if isinstance(tree, dict):
        keys = tuple(sorted(tree))
        return TreeDef("dict", keys, tuple(_treedef(tree[k]) for k in keys),
                       original=tree if isinstance(tree, Variables) else None)
    if isinstance(tree, (list, tuple)):
        return TreeDef(type(tree).__name__, (), tuple(_treedef(v) for v in tree))
    return TreeDef("leaf")


def tree_unflatten(treedef, leaves):
    """jax.tree_util.tree_unflatten: a Variables again when the leaves are its own refs."""
    leaves = list(leaves)
    if len(leaves) != treedef.num_leaves:
        raise errors.InvalidArgumentError("tree_unflatten: %d leaves for a structure of %d" % (
            len(leaves), treedef.num_leaves))
    if isinstance(treedef.original, Variables):
        mine = _leaves(treedef.original)
        if all(a is b for a, b in zip(mine, leaves)):
            return treedef.original
    it = iter(leaves)
    return _build(treedef, it)


def _build(treedef, it):
    if treedef.kind == "none":
        return None
    if treedef.kind == "leaf":
        return next(it)
    children = [_build(c, it) for c in treedef.children]
    if treedef.kind == "dict":
        return dict(zip(treedef.keys, children))
    return list(children) if treedef.kind == "list" else tuple(children)


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
