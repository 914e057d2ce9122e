"""Symbolic tensors: what a composite's __call__ computes with while it is traced.

A Symbol has a shape and a dtype, no values. Its glue ops (reshape,
transpose, astype, +, * constant, and te_client.numpy's split and
concatenate) record nodes in their Trace (graph.py) and return new Symbols,
so a traced __call__ may compute with shapes and dtypes as ordinary code
does. What GraphSpec has no node for raises TypeError naming the op (numpy
functions and ufuncs included, through numpy's dispatch protocols): a trace
never records less than the code does. Float dtypes promote as JAX's do
(a cast node where they differ); adds take equal shapes.
"""
import numbers

import numpy as np

from te_client import client as client_lib, dtypes

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


def normalized_axis(axis, ndim, op):
    """axis in [0, ndim), negative counting from the end, as numpy takes it."""
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
        return self.trace.record("reshape", client_lib.layers_pb2.GraphSpec.Reshape(shape=list(shape)), [self],
                                 [(shape, self.wire)])[0]

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(reversed(range(self.ndim))) if not axes or axes == (None,) else tuple(
            normalized_axis(a, self.ndim, "transpose") for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError("transpose: axes %s are not a permutation of %d axes" % (list(axes), self.ndim))
        if axes == tuple(range(self.ndim)):
            return self
        return self.trace.record("transpose", client_lib.layers_pb2.GraphSpec.Transpose(axes=list(axes)), [self],
                                 [(tuple(self.shape[a] for a in axes), self.wire)])[0]

    def astype(self, dtype):
        wire = wire_of(dtype, "astype")
        if wire == self.wire:
            return self
        return self._cast(wire, "astype(%s)" % dtypes.dtype_name(wire))

    def _cast(self, wire, op):
        if wire not in _CASTABLE:
            raise TypeError("%s: GraphSpec's cast gives float32, bfloat16 or float16" % op)
        return self.trace.record("cast", client_lib.layers_pb2.GraphSpec.Cast(dtype=wire), [self], [(self.shape, wire)])[0]

    def _scale(self, factor, op):
        if self.wire not in _CASTABLE:
            raise TypeError("%s: GraphSpec's scale takes float tensors, not %s" % (op, dtypes.dtype_name(self.wire)))
        return self.trace.record("scale", client_lib.layers_pb2.GraphSpec.Scale(factor=float(factor)), [self],
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
    return a.trace.record("add", client_lib.layers_pb2.GraphSpec.Add(), [a, b], [(a.shape, a.wire)])[0]


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
    axis = normalized_axis(axis, x.ndim, "split")
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
    return x.trace.record("split", client_lib.layers_pb2.GraphSpec.Split(axis=axis, parts=parts), [x],
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
    axis = normalized_axis(axis, ndim, "concatenate")
    for a in arrays:
        if a.ndim != ndim or a.shape[:axis] + a.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError("concatenate: shapes %s differ off axis %d" % ([list(s.shape) for s in arrays], axis))
    wire = _promoted([a.wire for a in arrays], "concatenate")
    arrays = [a if a.wire == wire else a._cast(wire, "concatenate") for a in arrays]
    shape = first.shape[:axis] + (sum(a.shape[axis] for a in arrays),) + first.shape[axis + 1:]
    return first.trace.record("concatenate", client_lib.layers_pb2.GraphSpec.Concatenate(axis=axis), arrays, [(shape, wire)])[0]
