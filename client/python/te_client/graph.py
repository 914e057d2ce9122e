"""Tracing a composite module into a te.v1.GraphSpec (DESIGN.md section 11).

A composite's init runs its __call__ once on Symbols: tensors with a shape
and a dtype but no values. Each glue op on a Symbol (te_client.numpy's
reshape, split, concatenate, transpose, +, * constant, astype; nn.Dropout;
nn.make_causal_mask) and each TE module called on one records a node in the
Trace; Trace.build turns the record into the GraphSpec that the server runs
as one layer, so a step of the composite is one RPC and no activation leaves
the device.

Names (what the spec's nodes and edges, and so the variables, are called):
  * a module node is the module's Flax scope path ("TEUnfusedMLP_0/DenseGeneral_0");
    nn.Dropout is a Flax module too ("Dropout_0");
  * a glue node is "<scope>/<op>_<n>", n counting that op in that scope in
    call order ("reshape_0", "TEUnfusedMLP_0/reshape_1"), passing over names a
    module holds; <op> is the GraphSpec.Node field ("split", "causal_mask"),
    "activation" for te.activation.activation;
  * a node's one output is the tensor named as the node; several are "<node>:<i>";
  * the graph's inputs are "x", "attention_mask" and "extra_inputs[i]".

Glue whose result the output does not depend on is left out (the quickstart's
TEUnfusedTransformerLayer makes a causal mask that only its Flax-attention
branch reads); module nodes always stay, since Flax creates their variables
whether or not the output uses them. An op that GraphSpec has no node for is
a TypeError naming the op, never a silently wrong graph.
"""
import dataclasses
import numbers
from typing import Optional

import numpy as np

from te_client import dtypes

_M64 = (1 << 64) - 1

# ---- seeds (kernels/rng.h) ------------------------------------------------------------


def mix_bits(z):
    """kernels/rng.h's MixBits: splitmix64's finaliser on a uint64."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & _M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & _M64
    return z ^ (z >> 31)


def name_hash(name):
    """kernels/rng.h's NameHash: FNV-1a (64-bit) of the name's UTF-8 bytes."""
    h = 0xcbf29ce484222325
    for byte in name.encode("utf-8") if isinstance(name, str) else bytes(name):
        h = ((h ^ byte) * 0x100000001b3) & _M64
    return h


def node_seed(seed, name):
    """A graph node's init key or dropout seed from the layer's: the rule the
    server applies (kernels/rng.h's NodeSeed), so a module run on its own with
    node_seed(seed, "DenseGeneral_0") draws the numbers the graph's node does."""
    return mix_bits((int(seed) & _M64) ^ mix_bits(name_hash(name)))


# ---- dtypes ----------------------------------------------------------------------------

_CASTABLE = (dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16)


def wire_of(dtype, op):
    """The te.v1.DType of a dtype a user names (np.float32, jnp.bfloat16, "bool"...)."""
    if dtypes._is_bf16(dtype):
        return dtypes.BFLOAT16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError("%s: dtype %r has no te.v1 DType" % (op, dtype)) from None
    wire = {np.dtype(np.float32): dtypes.FLOAT32, np.dtype(np.float16): dtypes.FLOAT16,
            np.dtype(np.bool_): dtypes.BOOL, np.dtype(np.int32): dtypes.INT32}.get(dt)
    if wire is None:
        raise TypeError("%s: dtype %s has no te.v1 DType (float32, bfloat16, float16, int32, bool)" % (op, dt))
    return wire


def dtype_of_wire(wire):
    """What x.dtype says for a traced tensor: a numpy dtype, or te_client.bfloat16."""
    numpy_dtype = dtypes._numpy_dtype_of(wire)
    return numpy_dtype if numpy_dtype is not None else dtypes.bfloat16


def _promoted(wires, op):
    """JAX's promotion among the float dtypes GraphSpec casts between."""
    wires = set(wires)
    if not wires <= set(_CASTABLE):
        raise TypeError("%s: traced tensors of %s; GraphSpec's %s takes float tensors" % (
            op, " and ".join(sorted(dtypes.dtype_name(w) for w in wires)), op))
    if len(wires) == 1:
        return wires.pop()
    return dtypes.FLOAT32   # f32 with anything, and bf16 with f16, give f32


def _axis(axis, ndim, op):
    if not isinstance(axis, numbers.Integral) or not -ndim <= axis < ndim:
        raise ValueError("%s: axis %r is out of bounds for a traced tensor of rank %d" % (op, axis, ndim))
    return int(axis) % ndim


def _is_constant(value):
    return isinstance(value, numbers.Real) or (isinstance(value, np.ndarray) and value.ndim == 0)


# ---- symbolic tensors ------------------------------------------------------------------

class Symbol:
    """A tensor of a composite being traced: shape and dtype, no values.

    Supports what GraphSpec has nodes for; everything else raises TypeError
    naming the op (numpy functions and ufuncs included, through numpy's
    dispatch protocols), so a trace never records less than the code does."""
    __array_priority__ = 1000
    __slots__ = ("trace", "shape", "wire", "node", "index", "input_name", "is_mask")

    def __init__(self, trace, shape, wire, node=None, index=0, input_name=None, is_mask=False):
        self.trace = trace
        self.shape = tuple(int(d) for d in shape)
        self.wire = wire
        self.node = node               # the _Node writing it, or None for a graph input
        self.index = index             # which of the node's outputs
        self.input_name = input_name   # "x", "attention_mask", "extra_inputs[i]"
        self.is_mask = is_mask         # the request's attention_mask or a causal mask: only a module reads it

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    dtype = property(lambda self: dtype_of_wire(self.wire))
    T = property(lambda self: self.transpose())

    def __repr__(self):
        return "Symbol(%s%s)" % (dtypes.dtype_name(self.wire), list(self.shape))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d traced tensor")
        return self.shape[0]

    # ---- glue ops that record nodes ----------------------------------------------------

    def reshape(self, *shape, order="C"):
        if order != "C":
            raise TypeError("reshape(order=%r): GraphSpec's reshape is row-major (order='C')" % order)
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = _resolved_shape(shape, self.shape, self.size)
        if shape == self.shape:
            return self
        return self.trace.record("reshape", _pb().GraphSpec.Reshape(shape=list(shape)), [self],
                                 [(shape, self.wire)])[0]

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(reversed(range(self.ndim))) if not axes or axes == (None,) else tuple(
            _axis(a, self.ndim, "transpose") for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError("transpose: axes %s are not a permutation of %d axes" % (list(axes), self.ndim))
        if axes == tuple(range(self.ndim)):
            return self
        return self.trace.record("transpose", _pb().GraphSpec.Transpose(axes=list(axes)), [self],
                                 [(tuple(self.shape[a] for a in axes), self.wire)])[0]

    def astype(self, dtype):
        wire = wire_of(dtype, "astype")
        if wire == self.wire:
            return self
        return self._cast(wire, "astype(%s)" % dtypes.dtype_name(wire))

    def _cast(self, wire, op):
        if wire not in _CASTABLE:
            raise TypeError("%s: GraphSpec's cast gives float32, bfloat16 or float16" % op)
        return self.trace.record("cast", _pb().GraphSpec.Cast(dtype=wire), [self], [(self.shape, wire)])[0]

    def _scale(self, factor, op):
        if self.wire not in _CASTABLE:
            raise TypeError("%s: GraphSpec's scale takes float tensors, not %s" % (op, dtypes.dtype_name(self.wire)))
        return self.trace.record("scale", _pb().GraphSpec.Scale(factor=float(factor)), [self],
                                 [(self.shape, self.wire)])[0]

    def __getitem__(self, index):
        return Indexed(self, index)

    def __add__(self, other):
        return add(self, other)

    def __radd__(self, other):
        return add(other, self)

    def __sub__(self, other):
        return add(self, _negated(other, "x - y"), op="x - y")

    def __rsub__(self, other):
        return add(other, -self, op="x - y")

    def __mul__(self, other):
        return multiply(self, other)

    def __rmul__(self, other):
        return multiply(other, self)

    def __truediv__(self, other):
        if not _is_constant(other):
            raise TypeError("x / y of traced tensors: GraphSpec divides only by a constant (x / 2.0)")
        return self._scale(1.0 / float(other), "x / constant")

    def __neg__(self):
        return self._scale(-1.0, "-x")

    def __pos__(self):
        return self

    # ---- what a trace cannot do ----------------------------------------------------------

    def _no_node(op, hint=""):
        def refuse(self, *args):
            raise TypeError("%s of a traced tensor: GraphSpec has no %s node%s" % (op, op, hint))
        return refuse

    __matmul__ = __rmatmul__ = _no_node("matmul (x @ y)", "; a TE module (DenseGeneral) does the GEMMs")
    __pow__ = __rpow__ = _no_node("power (x ** y)")
    __floordiv__ = __rfloordiv__ = _no_node("floor_divide (x // y)")
    __mod__ = __rmod__ = _no_node("remainder (x % y)")
    __rtruediv__ = _no_node("divide (constant / x)")
    __abs__ = _no_node("absolute (abs(x))")
    del _no_node

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "%r has no values while its composite is traced (numpy cannot compute with it): use "
            "te_client.numpy's reshape, split, concatenate, transpose, +, * constant and astype" % self)

    def __bool__(self):
        raise TypeError("the truth value of a traced tensor depends on its values: a traced __call__ "
                        "may branch on shapes, dtypes and arguments only")

    def __iter__(self):
        raise TypeError("iterating over a traced tensor: GraphSpec has no indexing node; use "
                        "te_client.numpy.split(x, n, axis)")

    def __float__(self):
        raise TypeError("float() of a traced tensor: it has no value while its composite is traced")

    __int__ = __index__ = __complex__ = __float__

    def _compare(self, other):
        raise TypeError("comparing traced tensors (==, <, ...): GraphSpec has no comparison node")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _compare
    __hash__ = object.__hash__

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        binary = {np.add: add, np.multiply: multiply}
        if method == "__call__" and not kwargs:
            if ufunc in binary and len(inputs) == 2:
                return binary[ufunc](*inputs)
            if ufunc is np.subtract and len(inputs) == 2:
                return add(inputs[0], _negated(inputs[1], "x - y"), op="x - y")
            if ufunc is np.negative:
                return -inputs[0]
            if ufunc is np.true_divide and len(inputs) == 2 and inputs[0] is self:
                return self / inputs[1]
        raise TypeError("%s on a traced tensor: GraphSpec has no %s node (it records reshape, split, "
                        "concatenate, transpose, +, * constant, astype, dropout and causal masks)" % (
                            "np.%s%s" % (ufunc.__name__, "" if method == "__call__" else "." + method),
                            ufunc.__name__))

    def __array_function__(self, func, types, args, kwargs):
        from te_client import numpy as tnp
        handler = getattr(tnp, func.__name__, None) if func.__name__ in tnp.TRACED else None
        if handler is None:
            raise TypeError("np.%s on a traced tensor: GraphSpec has no node for it (te_client.numpy traces "
                            "%s)" % (func.__name__, ", ".join(sorted(tnp.TRACED))))
        return handler(*args, **kwargs)


def _negated(value, op):
    if isinstance(value, Symbol):
        return -value
    raise TypeError("%s with a constant: GraphSpec's add takes two traced tensors" % op)


class Indexed:
    """x[..., 0] of a traced tensor: kept only as nn.make_causal_mask's input
    (GraphSpec has no indexing node; its causal_mask node reads x [B, S, ...]
    itself). `shape`, `ndim` and `dtype` work; anything else is a TypeError."""
    __array_priority__ = 1000

    def __init__(self, base, index):
        self.base = base
        self.index = index
        self.shape = _indexed_shape(base.shape, index)

    ndim = property(lambda self: len(self.shape))
    dtype = property(lambda self: self.base.dtype)

    def __repr__(self):
        return "Indexed(%r[%s])" % (self.base, _index_text(self.index))

    def _unsupported(self, *args, **kwargs):
        raise TypeError("%r: an indexed traced tensor can only be passed to nn.make_causal_mask "
                        "(GraphSpec has no indexing node)" % self)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __neg__ = _unsupported
    __getitem__ = reshape = transpose = astype = __array__ = __bool__ = __iter__ = _unsupported
    __array_ufunc__ = __array_function__ = _unsupported


def _index_text(index):
    items = index if isinstance(index, tuple) else (index,)
    return ", ".join("..." if i is Ellipsis else ":" if i == slice(None) else repr(i) for i in items)


def _indexed_shape(shape, index):
    """The shape of x[index] for the picks nn.make_causal_mask's input needs:
    whole leading axes (: or ...) then integers, as in x[..., 0] or x[:, :, 0]."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    bad = [i for i in items if not (i is Ellipsis or i == slice(None) or isinstance(i, numbers.Integral))]
    if bad:
        raise TypeError("indexing a traced tensor with [%s]: GraphSpec has no indexing node (x[..., 0] is "
                        "taken as nn.make_causal_mask's input)" % _index_text(tuple(items)))
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - (len(items) - 1)
        items = items[:at] + [slice(None)] * fill + items[at + 1:]
    if len(items) > len(shape):
        raise IndexError("too many indices for a traced tensor of rank %d" % len(shape))
    items += [slice(None)] * (len(shape) - len(items))
    kept = 0
    while kept < len(items) and items[kept] == slice(None):
        kept += 1
    if any(not isinstance(i, numbers.Integral) for i in items[kept:]):
        raise TypeError("indexing a traced tensor with [%s]: only whole leading axes then integers "
                        "(x[..., 0])" % _index_text(index if isinstance(index, tuple) else (index,)))
    for i, n in zip(items[kept:], shape[kept:]):
        if not -n <= i < n:
            raise IndexError("index %d is out of bounds for an axis of size %d" % (i, n))
    return tuple(shape[:kept])


def _resolved_shape(shape, from_shape, size):
    shape = tuple(int(d) for d in shape)
    unknown = [i for i, d in enumerate(shape) if d == -1]
    if len(unknown) > 1 or any(d < -1 for d in shape):
        raise ValueError("reshape: shape %s may hold one -1 and otherwise sizes >= 0" % list(shape))
    known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
    if unknown:
        if known == 0 or size % known:
            raise ValueError("cannot reshape a traced tensor of shape %s into %s" % (list(from_shape), list(shape)))
        shape = shape[:unknown[0]] + (size // known,) + shape[unknown[0] + 1:]
    elif known != size:
        raise ValueError("cannot reshape a traced tensor of size %d (shape %s) into shape %s" % (
            size, list(from_shape), list(shape)))
    return shape


# ---- ops taking several tensors (te_client.numpy's functions call these) ----------------------

def _traced_pair(a, b, op):
    """Both operands as Symbols of one trace, cast to their promoted dtype."""
    for v in (a, b):
        if isinstance(v, Indexed):
            v._unsupported()
        if not isinstance(v, Symbol):
            raise TypeError("%s of a traced tensor and %s: GraphSpec has no constant tensors" % (
                op, "a constant %r" % v if _is_constant(v) else "a %s" % type(v).__name__))
    if a.trace is not b.trace:
        raise TypeError("%s of tensors from two different traces" % op)
    wire = _promoted((a.wire, b.wire), op)
    return [s if s.wire == wire else s._cast(wire, op) for s in (a, b)]


def add(a, b, op="x + y"):
    a, b = _traced_pair(a, b, op)
    if a.shape != b.shape:
        raise TypeError("%s of shapes %s and %s: GraphSpec's add takes equal shapes (no broadcasting)" % (
            op, list(a.shape), list(b.shape)))
    return a.trace.record("add", _pb().GraphSpec.Add(), [a, b], [(a.shape, a.wire)])[0]


def multiply(a, b):
    for v in (a, b):
        if isinstance(v, Indexed):
            v._unsupported()
    if isinstance(a, Symbol) and isinstance(b, Symbol):
        raise TypeError("x * y of two traced tensors: GraphSpec multiplies a traced tensor by a constant "
                        "only (x * 0.5)")
    symbol, constant = (a, b) if isinstance(a, Symbol) else (b, a)
    if not _is_constant(constant):
        raise TypeError("x * y of a traced tensor and a %s: GraphSpec multiplies a traced tensor by a "
                        "constant only (x * 0.5)" % type(constant).__name__)
    return symbol._scale(float(constant), "x * constant")


def split(x, indices_or_sections, axis=0):
    if not isinstance(x, Symbol):
        Indexed._unsupported(x)
    axis = _axis(axis, x.ndim, "split")
    if not isinstance(indices_or_sections, numbers.Integral):
        raise TypeError("split(x, %r): GraphSpec's split cuts equal parts (split(x, n, axis))" % (
            indices_or_sections,))
    parts = int(indices_or_sections)
    if parts < 1 or x.shape[axis] % parts:
        raise ValueError("split: %d does not divide axis %d of size %d into equal parts" % (
            parts, axis, x.shape[axis]))
    if parts == 1:
        return [x]
    shape = x.shape[:axis] + (x.shape[axis] // parts,) + x.shape[axis + 1:]
    return x.trace.record("split", _pb().GraphSpec.Split(axis=axis, parts=parts), [x],
                          [(shape, x.wire)] * parts)


def concatenate(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    first = arrays[0]
    if len(arrays) == 1 and isinstance(first, Symbol):
        return first
    for a in arrays:
        if isinstance(a, Indexed):
            a._unsupported()
        if not isinstance(a, Symbol):
            raise TypeError("concatenate of a traced tensor and a %s: GraphSpec has no constant tensors"
                            % type(a).__name__)
    ndim = first.ndim
    axis = _axis(axis, ndim, "concatenate")
    for a in arrays:
        if a.ndim != ndim or a.shape[:axis] + a.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError("concatenate: shapes %s differ off axis %d" % ([list(s.shape) for s in arrays], axis))
    wire = _promoted([a.wire for a in arrays], "concatenate")
    arrays = [a if a.wire == wire else a._cast(wire, "concatenate") for a in arrays]
    shape = first.shape[:axis] + (sum(a.shape[axis] for a in arrays),) + first.shape[axis + 1:]
    return first.trace.record("concatenate", _pb().GraphSpec.Concatenate(axis=axis), arrays, [(shape, wire)])[0]


def _pb():
    from te_client import client
    return client.layers_pb2


# ---- the record and the spec -----------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Node:
    op: str                  # the GraphSpec.Node oneof field: "module", "reshape", "dropout"...
    message: object          # that field's message
    label: str               # a glue node's name stem ("reshape", "activation")
    scope: tuple             # the module scope it was recorded in
    name: Optional[str]      # a module's scope path; glue is named by build()
    inputs: list
    mask: Optional[Symbol]
    outputs: list = dataclasses.field(default_factory=list)
    keep: bool = False       # stays even when the output does not depend on it (owns variables)


@dataclasses.dataclass
class Traced:
    """A composite traced for one input signature: the spec and what it holds."""
    spec: object             # te.v1.GraphSpec
    shapes: dict             # every edge (inputs included) -> its shape
    dtypes: dict             # every edge -> its dtype name ("bfloat16")
    inputs: list             # the graph inputs it reads, of "x", "attention_mask", "extra_inputs[i]"
    output_shape: tuple
    output_wire: int

    def node(self, name):
        return next(n for n in self.spec.nodes if n.name == name)


class Trace:
    """The nodes one run of a composite's __call__ recorded. `scope` gives the
    module scope path ops run in now; `deterministic` is the value the
    composite was traced with (every dropout in the graph follows the request's)."""

    def __init__(self, scope, deterministic):
        self.nodes = []
        self.inputs = {}
        self.scope = scope
        self.deterministic = bool(deterministic)
        self.closed = False
        self._owners = {}    # module node name -> the module instance

    def input(self, name, shape, wire):
        self.inputs[name] = Symbol(self, shape, wire, input_name=name, is_mask=name == "attention_mask")
        return self.inputs[name]

    def record(self, op, message, inputs, outputs, label=None, name=None, mask=None, keep=False,
               makes_mask=False):
        """Records a node reading `inputs` (and `mask`) and returns Symbols for
        its `outputs` [(shape, wire)...]. `name` for a module node, else it is
        named at build()."""
        if self.closed:
            raise TypeError("a traced tensor was used after its composite's trace ended (kept on self?)")
        for s in list(inputs) + ([mask] if mask is not None else []):
            if s.trace is not self:
                raise TypeError("%s: a tensor from another trace" % (name or op))
        for s in inputs:
            if s.is_mask:
                raise TypeError("%s: an attention mask (the composite's attention_mask, or a causal mask) as the "
                                "input of %s: in a GraphSpec a mask is read only as a module's mask" % (
                                    name or op, "module " + name if name else op))
        if mask is not None and not mask.is_mask:
            raise TypeError("%s: its mask is a computed tensor; a module's mask is the composite's attention_mask "
                            "or nn.make_causal_mask's result" % name)
        node = _Node(op, message, label or op, tuple(self.scope()), name, list(inputs), mask, keep=keep)
        node.outputs = [Symbol(self, shape, wire, node, i, is_mask=makes_mask) for i, (shape, wire) in enumerate(outputs)]
        self.nodes.append(node)
        return node.outputs

    def claim(self, name, module):
        """A module node's name, once: Flax gives each module its own variables."""
        owner = self._owners.get(name)
        if owner is module:
            raise NotImplementedError(
                "%s (%s) is called twice: in Flax both calls share its parameters; a GraphSpec module node "
                "has its own, so call two modules" % (name, type(module).__name__))
        if owner is not None:
            raise ValueError("%s: the name is already used by another module in the same scope (%s)" % (
                name, type(owner).__name__))
        self._owners[name] = module

    def build(self, result):
        """The GraphSpec whose output is `result` (the Symbol __call__ returned)."""
        if isinstance(result, tuple) and result and isinstance(result[0], Symbol) and all(
                r is None for r in result[1:]):
            result = result[0]   # (y, None): a TE module's (y, ln_out) without ln_out
        if not isinstance(result, Symbol) or result.trace is not self or result.is_mask:
            raise TypeError("__call__ returned %s: a traced composite returns one traced tensor (y)" % (
                "a mask" if isinstance(result, Symbol) else type(result).__name__
                if not isinstance(result, (tuple, list)) else "a %s of %d" % (type(result).__name__, len(result))))
        self.closed = True
        live = self._live(result)
        names = self._name_glue(live)
        edges = {}
        for name, s in self.inputs.items():
            edges[id(s)] = name
        nodes_pb = []
        pb = _pb()
        for node in self.nodes:
            if node not in live:
                continue
            name = names[node]
            for i, s in enumerate(node.outputs):
                edge = name if len(node.outputs) == 1 else "%s:%d" % (name, i)
                if edge in self.inputs:
                    raise ValueError("%s: a node's output would be named like the graph input %r" % (name, edge))
                edges[id(s)] = edge
            msg = pb.GraphSpec.Node(name=name, inputs=[edges[id(s)] for s in node.inputs],
                                    outputs=[edges[id(s)] for s in node.outputs])
            if node.mask is not None:
                msg.mask = edges[id(node.mask)]
            getattr(msg, node.op).CopyFrom(node.message)
            nodes_pb.append(msg)
        spec = pb.GraphSpec(nodes=nodes_pb, outputs=[edges[id(result)]])
        symbols = list(self.inputs.values()) + [s for n in self.nodes if n in live for s in n.outputs]
        read = {edges[id(s)] for n in self.nodes if n in live for s in n.inputs + [n.mask] if s is not None}
        read.add(edges[id(result)])
        return Traced(spec=spec, shapes={edges[id(s)]: s.shape for s in symbols},
                      dtypes={edges[id(s)]: dtypes.dtype_name(s.wire) for s in symbols},
                      inputs=[n for n in self.inputs if n in read],
                      output_shape=result.shape, output_wire=result.wire)

    def _live(self, result):
        live, stack = set(), [n for n in self.nodes if n.keep]
        if result.node is not None:
            stack.append(result.node)
        while stack:
            node = stack.pop()
            if node in live:
                continue
            live.add(node)
            stack.extend(s.node for s in node.inputs + [node.mask] if s is not None and s.node is not None)
        return live

    def _name_glue(self, live):
        taken = set(self.inputs) | {n.name for n in self.nodes if n.name is not None}
        counters, names = {}, {}
        for node in self.nodes:
            if node not in live:
                continue
            if node.name is not None:
                names[node] = node.name
                continue
            key = (node.scope, node.label)
            k = counters.get(key, 0)
            while "/".join(node.scope + ("%s_%d" % (node.label, k),)) in taken:
                k += 1
            names[node] = "/".join(node.scope + ("%s_%d" % (node.label, k),))
            taken.add(names[node])
            counters[key] = k + 1
        return names
