"""Symbolic tensors: what a traced function (a composite's __call__, or a
loss function under te_client.value_and_grad) computes with.

A Symbol has a shape and a dtype, no values. Its ops record te.v1.GraphSpec
nodes in their Trace (graph.py) and return new Symbols, so traced code may
compute with shapes and dtypes as ordinary code does:

  * elementwise + - * / ** with Python scalars and numpy broadcasting,
    comparisons (bool), unary functions (negative, exp, log, tanh, sqrt,
    rsqrt, abs, square, sigmoid, relu, silu, gelu), where;
  * reductions (sum, mean, max, min over axes, keepdims), softmax / log_softmax;
  * einsum of two operands and x @ y, reshape, transpose / swapaxes /
    moveaxis, static slicing and indexing (x[:, 0], x[..., 1:3], x[None]),
    split, concatenate, stack, squeeze, expand_dims, astype.

Dtypes promote as JAX's do (a cast node where they differ): float32 with
anything gives float32, bfloat16 with float16 gives float32, an int32 or
bool tensor with a float one gives the float, and a Python scalar is weakly
typed (x_bf16 * 2.0 stays bfloat16). GraphSpec's arithmetic is on floats: an
int32 tensor in arithmetic is cast to float32 first (as JAX does with a
float scalar), and comparisons of int32 tensors compare them as float32
(exact below 2^24).

What GraphSpec has no node for raises TypeError naming the op and the ops it
has (numpy functions and ufuncs included, through numpy's dispatch
protocols): a trace never records less than the code does.
"""
import numbers
import re

import numpy as np

from te_client import dtypes
from te_client._pb import layers_pb2

GraphSpec = layers_pb2.GraphSpec

# What a traced tensor takes, for the messages of what it does not.
SUPPORTED_OPS = ("+ - * / ** with scalars and broadcasting, comparisons, negative, exp, log, tanh, sqrt, "
                 "rsqrt, abs, square, sigmoid, relu, silu, gelu, maximum, minimum, where, sum, mean, max, min, "
                 "softmax, log_softmax, einsum, matmul (@), reshape, transpose, swapaxes, moveaxis, static "
                 "slicing and indexing, split, concatenate, stack, squeeze, expand_dims, astype")

# numpy functions a traced tensor accepts (np.sum(x) and the like): te_client.numpy fills this in,
# so this module never imports it (numpy.py builds on this one).
HANDLERS = {}

# ---- dtypes ----------------------------------------------------------------------------

_FLOATS = (dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16)
_CASTABLE = _FLOATS


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
    if not wires <= set(_FLOATS):
        raise TypeError("%s: traced tensors of %s; GraphSpec's %s takes float tensors" % (
            op, " and ".join(sorted(dtypes.dtype_name(w) for w in wires)), op))
    if len(wires) == 1:
        return wires.pop()
    return dtypes.FLOAT32   # f32 with anything, and bf16 with f16, give f32


def result_wire(wires):
    """jnp.result_type of tensors of these wires (bool < int32 < the floats; no scalars)."""
    wires = set(wires)
    floats = wires & set(_FLOATS)
    if floats:
        return _promoted(floats, "promotion")
    return dtypes.INT32 if dtypes.INT32 in wires else dtypes.BOOL


def normalized_axis(axis, ndim, op):
    """axis in [0, ndim), negative counting from the end, as numpy takes it."""
    if not isinstance(axis, numbers.Integral) or not -ndim <= axis < ndim:
        raise ValueError("%s: axis %r is out of bounds for a traced tensor of rank %d" % (op, axis, ndim))
    return int(axis) % ndim


def _axes(axis, ndim, op):
    if axis is None:
        return tuple(range(ndim))
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    out = tuple(sorted({normalized_axis(a, ndim, op) for a in items}))
    if len(out) != len(items):
        raise ValueError("%s: repeated axis in %r" % (op, axis))
    return out


def _is_constant(value):
    return isinstance(value, (numbers.Real, np.number, np.bool_)) or (
        isinstance(value, np.ndarray) and value.ndim == 0)


def broadcast_shapes(a, b, op):
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x != y and 1 not in (x, y):
            raise ValueError("%s: shapes %s and %s do not broadcast" % (op, list(a), list(b)))
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _no_constants(value, op):
    raise TypeError("%s of a traced tensor and a %s%s: a GraphSpec has no constant tensors (pass the array as an "
                    "argument of the traced function, or use a Python scalar)" % (
                        op, type(value).__name__, " of shape %s" % list(np.shape(value)) if hasattr(value, "shape")
                        else ""))


# ---- symbolic tensors ------------------------------------------------------------------

_BINARY = GraphSpec.Binary
_UNARY = GraphSpec.Unary
_COMPARISONS = {_BINARY.GREATER, _BINARY.GREATER_EQUAL, _BINARY.LESS, _BINARY.LESS_EQUAL, _BINARY.EQUAL,
                _BINARY.NOT_EQUAL}
_BINARY_NAMES = {_BINARY.ADD: "add (+)", _BINARY.SUBTRACT: "subtract (-)", _BINARY.MULTIPLY: "multiply (*)",
                 _BINARY.DIVIDE: "divide (/)", _BINARY.MAXIMUM: "maximum", _BINARY.MINIMUM: "minimum",
                 _BINARY.POWER: "power (**)", _BINARY.GREATER: ">", _BINARY.GREATER_EQUAL: ">=",
                 _BINARY.LESS: "<", _BINARY.LESS_EQUAL: "<=", _BINARY.EQUAL: "==", _BINARY.NOT_EQUAL: "!="}
# x op scalar == scalar op' x, for the comparisons written the other way round.
_FLIPPED = {_BINARY.GREATER: _BINARY.LESS, _BINARY.LESS: _BINARY.GREATER,
            _BINARY.GREATER_EQUAL: _BINARY.LESS_EQUAL, _BINARY.LESS_EQUAL: _BINARY.GREATER_EQUAL}


class Symbol:
    """A tensor of a traced function: shape and dtype, no values.

    Supports what GraphSpec has nodes for; everything else raises TypeError
    naming the op (numpy functions and ufuncs included, through numpy's
    dispatch protocols), so a trace never records less than the code does."""
    __array_priority__ = 1000
    __slots__ = ("trace", "shape", "wire", "node", "index", "input_name", "is_mask", "origin", "from_extra",
                 "__weakref__")

    def __init__(self, trace, shape, wire, node=None, index=0, input_name=None, is_mask=False):
        self.trace = trace
        self.shape = tuple(int(d) for d in shape)
        self.wire = wire
        self.node = node               # the _Node writing it, or None for a graph input
        self.index = index             # which of the node's outputs
        self.input_name = input_name   # "x", "attention_mask", "extra_inputs[i]"
        self.is_mask = is_mask         # the request's attention_mask or a causal mask: only a module reads it
        self.origin = None             # (base, index) when it is base[index]: nn.make_causal_mask reads base
        # Its shape derives from an extra input, which te_server does not know at init (graph.py).
        self.from_extra = bool(input_name and input_name.startswith("extra_inputs"))

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

    def _record(self, op, message, inputs, outputs, **kwargs):
        return self.trace.record(op, message, inputs, outputs, **kwargs)

    # ---- shape ops -------------------------------------------------------------------

    def reshape(self, *shape, order="C"):
        if order != "C":
            raise TypeError("reshape(order=%r): GraphSpec's reshape is row-major (order='C')" % order)
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        shape = _resolved_shape(shape, self.shape, self.size)
        if shape == self.shape:
            return self
        return self._record("reshape", GraphSpec.Reshape(shape=list(shape)), [self], [(shape, self.wire)])[0]

    def as_known_scalar(self):
        """This scalar through a reshape to [] that the trace keeps even though
        it changes no shape. te_server infers a graph's shapes from x alone:
        an op reading an extra input (labels, a target) has an unknown shape
        there, and a reduction of it too, though a full one is a scalar
        whatever its input; a reshape to an explicit shape is known, so a loss
        whose y passes through one is accepted (y's shape must be known)."""
        if self.shape != ():
            raise TypeError("as_known_scalar: shape %s, not a scalar" % (self.shape,))
        return self._record("reshape", GraphSpec.Reshape(shape=[]), [self], [((), self.wire)])[0]

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(reversed(range(self.ndim))) if not axes or axes == (None,) else tuple(
            normalized_axis(a, self.ndim, "transpose") for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError("transpose: axes %s are not a permutation of %d axes" % (list(axes), self.ndim))
        if axes == tuple(range(self.ndim)):
            return self
        return self._record("transpose", GraphSpec.Transpose(axes=list(axes)), [self],
                            [(tuple(self.shape[a] for a in axes), self.wire)])[0]

    def swapaxes(self, axis1, axis2):
        return swapaxes(self, axis1, axis2)

    def squeeze(self, axis=None):
        return squeeze(self, axis)

    def flatten(self):
        return self.reshape(-1)

    ravel = flatten

    def astype(self, dtype):
        wire = wire_of(dtype, "astype")
        if wire == self.wire:
            return self
        return self._cast(wire, "astype(%s)" % dtypes.dtype_name(wire))

    def _cast(self, wire, op):
        if wire not in _CASTABLE:
            raise TypeError("%s: GraphSpec's cast gives float32, bfloat16 or float16" % op)
        if wire == self.wire:
            return self
        return self._record("cast", GraphSpec.Cast(dtype=wire), [self], [(self.shape, wire)])[0]

    def _scale(self, factor, op):
        if self.wire not in _FLOATS:
            raise TypeError("%s: GraphSpec's scale takes float tensors, not %s" % (op, dtypes.dtype_name(self.wire)))
        return self._record("scale", GraphSpec.Scale(factor=float(factor)), [self], [(self.shape, self.wire)])[0]

    def __getitem__(self, index):
        return getitem(self, index)

    # ---- reductions ------------------------------------------------------------------

    def sum(self, axis=None, keepdims=False, dtype=None):
        return reduce(GraphSpec.Reduce.SUM, self, axis, keepdims, "sum", dtype)

    def mean(self, axis=None, keepdims=False, dtype=None):
        return reduce(GraphSpec.Reduce.MEAN, self, axis, keepdims, "mean", dtype)

    def max(self, axis=None, keepdims=False):
        return reduce(GraphSpec.Reduce.MAX, self, axis, keepdims, "max")

    def min(self, axis=None, keepdims=False):
        return reduce(GraphSpec.Reduce.MIN, self, axis, keepdims, "min")

    # ---- arithmetic ------------------------------------------------------------------

    def __add__(self, other):
        return binary(_BINARY.ADD, self, other)

    def __radd__(self, other):
        return binary(_BINARY.ADD, other, self)

    def __sub__(self, other):
        return binary(_BINARY.SUBTRACT, self, other)

    def __rsub__(self, other):
        return binary(_BINARY.SUBTRACT, other, self)

    def __mul__(self, other):
        return binary(_BINARY.MULTIPLY, self, other)

    def __rmul__(self, other):
        return binary(_BINARY.MULTIPLY, other, self)

    def __truediv__(self, other):
        return binary(_BINARY.DIVIDE, self, other)

    def __rtruediv__(self, other):
        return binary(_BINARY.DIVIDE, other, self)

    def __pow__(self, other):
        return binary(_BINARY.POWER, self, other)

    def __rpow__(self, other):
        return binary(_BINARY.POWER, other, self)

    def __neg__(self):
        return unary(_UNARY.NEGATIVE, self, "negative")

    def __pos__(self):
        return self

    def __abs__(self):
        return unary(_UNARY.ABS, self, "abs")

    def __matmul__(self, other):
        return matmul(self, other)

    def __rmatmul__(self, other):
        return matmul(other, self)

    def __gt__(self, other):
        return binary(_BINARY.GREATER, self, other)

    def __ge__(self, other):
        return binary(_BINARY.GREATER_EQUAL, self, other)

    def __lt__(self, other):
        return binary(_BINARY.LESS, self, other)

    def __le__(self, other):
        return binary(_BINARY.LESS_EQUAL, self, other)

    def __eq__(self, other):
        return binary(_BINARY.EQUAL, self, other)

    def __ne__(self, other):
        return binary(_BINARY.NOT_EQUAL, self, other)

    def __invert__(self):
        if self.wire != dtypes.BOOL:
            raise TypeError("~x of a traced %s tensor: GraphSpec's logical_not takes bool" % dtypes.dtype_name(self.wire))
        return unary(_UNARY.LOGICAL_NOT, self, "logical_not")

    __hash__ = object.__hash__

    # ---- what a trace cannot do ----------------------------------------------------------

    def _no_node(op):
        def refuse(self, *args):
            raise TypeError("%s of a traced tensor: GraphSpec has no node for it; traced tensors take %s" % (
                op, SUPPORTED_OPS))
        return refuse

    __floordiv__ = __rfloordiv__ = _no_node("floor_divide (x // y)")
    __mod__ = __rmod__ = _no_node("remainder (x % y)")
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _no_node("bitwise and / or / xor")
    del _no_node

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "%r has no values while it is traced (numpy cannot compute with it): use te_client.numpy (import "
            "te_client.numpy as jnp), whose functions record graph nodes: %s" % (self, SUPPORTED_OPS))

    def __bool__(self):
        raise TypeError("the truth value of a traced tensor depends on its values: traced code may branch on "
                        "shapes, dtypes and arguments only (use jnp.where)")

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __float__(self):
        raise TypeError("float() of a traced tensor: it has no value while it is traced")

    __int__ = __index__ = __complex__ = __float__

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "__call__" and not kwargs and ufunc.__name__ in HANDLERS:
            return HANDLERS[ufunc.__name__](*inputs)
        raise TypeError("np.%s%s on a traced tensor: GraphSpec has no %s node; traced tensors take %s" % (
            ufunc.__name__, "" if method == "__call__" else "." + method, ufunc.__name__, SUPPORTED_OPS))

    def __array_function__(self, func, types, args, kwargs):
        handler = HANDLERS.get(func.__name__)
        if handler is None:
            raise TypeError("np.%s on a traced tensor: GraphSpec has no node for it; traced tensors take %s" % (
                func.__name__, SUPPORTED_OPS))
        return handler(*args, **kwargs)


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


def _index_text(index):
    items = index if isinstance(index, tuple) else (index,)
    return ", ".join("..." if i is Ellipsis else ":" if isinstance(i, slice) and i == slice(None) else repr(i) for i in items)


# ---- elementwise -------------------------------------------------------------------------

def _as_float(s, op):
    """An int32 or bool tensor as float32 for GraphSpec's float arithmetic."""
    return s if s.wire in _FLOATS else s._cast(dtypes.FLOAT32, op)


def binary(op, a, b):
    """a op b for Symbols, Python scalars (weakly typed) and 0-d arrays, with broadcasting."""
    name = _BINARY_NAMES[op]
    a_sym, b_sym = isinstance(a, Symbol), isinstance(b, Symbol)
    if not (a_sym or b_sym):
        raise TypeError("%s: no traced operand" % name)
    comparison = op in _COMPARISONS
    if a_sym and b_sym:
        if a.trace is not b.trace:
            raise TypeError("%s of tensors from two different traces" % name)
        wire = result_wire((a.wire, b.wire))
        if wire not in _FLOATS:
            if not comparison:
                a, b = _as_float(a, name), _as_float(b, name)
                wire = dtypes.FLOAT32
            elif a.wire == b.wire == dtypes.BOOL and op in (_BINARY.EQUAL, _BINARY.NOT_EQUAL):
                a, b, wire = a._cast(dtypes.FLOAT32, name), b._cast(dtypes.FLOAT32, name), dtypes.FLOAT32
            else:
                wire = dtypes.FLOAT32
        a, b = (s if s.wire == wire else s._cast(wire, name) for s in (a, b))
        shape = broadcast_shapes(a.shape, b.shape, name)
        if op == _BINARY.ADD and a.shape == b.shape:
            # The plain sum keeps its own node (the graphs traced before broadcasting existed).
            return a._record("add", GraphSpec.Add(), [a, b], [(shape, wire)])[0]
        return a._record("binary", _BINARY(op=op), [a, b], [(shape, dtypes.BOOL if comparison else wire)],
                         label=_label(op))[0]
    symbol, constant = (a, b) if a_sym else (b, a)
    if not _is_constant(constant):
        _no_constants(constant, name)
    value = float(constant)
    if symbol.wire not in _FLOATS:
        symbol = symbol._cast(dtypes.FLOAT32, name)
    if op == _BINARY.MULTIPLY:
        return symbol._scale(value, "x * constant")
    if op == _BINARY.DIVIDE and a_sym and value != 0.0:
        return symbol._scale(1.0 / value, "x / constant")
    if op == _BINARY.SUBTRACT and a_sym and value == 0.0 or op == _BINARY.ADD and value == 0.0:
        return symbol
    message = _BINARY(op=op, scalar=value, scalar_first=not a_sym)
    if not a_sym and op in _FLIPPED:
        message = _BINARY(op=_FLIPPED[op], scalar=value)
    elif not a_sym and op in (_BINARY.EQUAL, _BINARY.NOT_EQUAL, _BINARY.ADD, _BINARY.MAXIMUM, _BINARY.MINIMUM):
        message = _BINARY(op=op, scalar=value)   # symmetric: always x op scalar
    return symbol._record("binary", message, [symbol],
                          [(symbol.shape, dtypes.BOOL if comparison else symbol.wire)], label=_label(op))[0]


def _label(op):
    return _BINARY.Op.Name(op).lower()


_UNARY_FLOAT_ONLY = True


def unary(op, x, name):
    if not isinstance(x, Symbol):
        raise TypeError("%s: not a traced tensor" % name)
    if op == _UNARY.LOGICAL_NOT:
        return x._record("unary", _UNARY(op=op), [x], [(x.shape, dtypes.BOOL)], label="logical_not")[0]
    x = _as_float(x, name)
    return x._record("unary", _UNARY(op=op), [x], [(x.shape, x.wire)], label=_UNARY.Op.Name(op).lower())[0]


def where(condition, x, y):
    """jnp.where(condition, x, y): x or y may be a Python scalar; a non-bool condition is `!= 0`."""
    symbols = [v for v in (condition, x, y) if isinstance(v, Symbol)]
    trace = symbols[0].trace
    if not isinstance(condition, Symbol):
        raise TypeError("where: the condition is a %s; with a constant condition pick x or y in Python" %
                        type(condition).__name__)
    if condition.wire != dtypes.BOOL:
        condition = binary(_BINARY.NOT_EQUAL, condition, 0.0)
    message = GraphSpec.Where()
    values = []
    for which, v in (("x", x), ("y", y)):
        if isinstance(v, Symbol):
            values.append(v)
        elif _is_constant(v):
            setattr(message, which + "_scalar", float(v))
        else:
            _no_constants(v, "where")
    if not values:
        raise TypeError("where(condition, constant, constant): at least one of x and y is a traced tensor "
                        "(GraphSpec's where takes one constant)")
    wire = result_wire([v.wire for v in values])
    if wire not in _FLOATS:
        wire = dtypes.FLOAT32
    values = [v if v.wire == wire else v._cast(wire, "where") for v in values]
    shape = condition.shape
    for v in values:
        if v.trace is not trace:
            raise TypeError("where: tensors from two different traces")
        shape = broadcast_shapes(shape, v.shape, "where")
    return condition._record("where", message, [condition] + values, [(shape, wire)])[0]


def reduce(op, x, axis, keepdims, name, dtype=None):
    if dtype is not None:
        x = x.astype(dtype)
    x = _as_float(x, name)
    axes = _axes(axis, x.ndim, name)
    if not axes:
        return x
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape)) if keepdims else tuple(
        d for i, d in enumerate(x.shape) if i not in axes)
    every = len(axes) == x.ndim
    return x._record("reduce", GraphSpec.Reduce(op=op, axes=[] if every else list(axes), keepdims=bool(keepdims)),
                     [x], [(shape, x.wire)], label=name)[0]


def softmax(x, axis=-1, log=False):
    x = _as_float(x, "softmax")
    if isinstance(axis, (tuple, list)):
        if len(axis) != 1:
            raise TypeError("softmax over several axes %r: GraphSpec's softmax takes one axis" % (axis,))
        axis = axis[0]
    axis = normalized_axis(axis, x.ndim, "softmax")
    return x._record("softmax", GraphSpec.Softmax(axis=axis, log=bool(log)), [x], [(x.shape, x.wire)],
                     label="log_softmax" if log else "softmax")[0]


# ---- contractions ---------------------------------------------------------------------------

_PRECISIONS = {None: layers_pb2.PRECISION_DEFAULT, "default": layers_pb2.PRECISION_DEFAULT,
               "highest": layers_pb2.PRECISION_HIGHEST, "float32": layers_pb2.PRECISION_HIGHEST}


def precision_proto(precision, field="precision"):
    """A jnp `precision` (None, "default", "highest", jax.lax.Precision.X) as te.v1.Precision."""
    name = precision if precision is None or isinstance(precision, str) else getattr(precision, "name", str(precision))
    key = None if name is None else str(name).rsplit(".", 1)[-1].lower()
    if key not in _PRECISIONS:
        raise NotImplementedError("%s: %r; te.v1 has DEFAULT (TensorFloat-32 on a GPU) and HIGHEST (float32)" % (
            field, precision))
    return _PRECISIONS[key]


def _einsum_operand(spec, shape, ellipsis_rank, op):
    if "..." in spec:
        head, tail = spec.split("...")
        n = len(shape) - len(head) - len(tail)
        if n < 0:
            raise ValueError("%s: operand %s has rank %d" % (op, spec, len(shape)))
        labels = list(head) + ["."+str(i + ellipsis_rank - n) for i in range(n)] + list(tail)
    else:
        labels = list(spec)
    if len(labels) != len(shape):
        raise ValueError("%s: operand %r has %d indices for a tensor of rank %d" % (op, spec, len(labels), len(shape)))
    return labels


def einsum_shapes(equation, a_shape, b_shape, op="einsum"):
    """(output shape, validated) of a two-operand einsum; ValueError for what GraphSpec's einsum cannot do."""
    eq = equation.replace(" ", "")
    if "->" not in eq:
        raise ValueError("%s(%r): give the output explicitly (\"ab,bc->ac\")" % (op, equation))
    inputs, out = eq.split("->")
    specs = inputs.split(",")
    if len(specs) != 2:
        raise TypeError("%s(%r): GraphSpec's einsum takes two operands" % (op, equation))
    if not all(re.fullmatch(r"[a-zA-Z]*(\.\.\.)?[a-zA-Z]*", s) for s in specs + [out]):
        raise ValueError("%s(%r): indices are letters and one '...'" % (op, equation))
    ranks = [len(a_shape) - len(s.replace("...", "")) if "..." in s else 0 for s, a_shape in zip(specs, (a_shape, b_shape))]
    ell = max(ranks)
    la = _einsum_operand(specs[0], a_shape, ell, op)
    lb = _einsum_operand(specs[1], b_shape, ell, op)
    sizes = {}
    for labels, shape in ((la, a_shape), (lb, b_shape)):
        if len(set(labels)) != len(labels):
            raise ValueError("%s(%r): an index repeated within one operand (a trace or diagonal) is not a GEMM" % (
                op, equation))
        for label, d in zip(labels, shape):
            if label in sizes and sizes[label] != d and not (label.startswith(".") and 1 in (d, sizes[label])):
                raise ValueError("%s(%r): index %s is %d in one operand and %d in the other" % (
                    op, equation, label, sizes[label], d))
            sizes[label] = max(d, sizes.get(label, d)) if label.startswith(".") else d
    lo = _einsum_operand(out, (0,) * (len(out.replace("...", "")) + (ell if "..." in out else 0)), ell, op)
    for label in lo:
        if label not in sizes:
            raise ValueError("%s(%r): output index %s is in no operand" % (op, equation, label))
    for label in sizes:
        if label not in lo and not (label in la and label in lb):
            raise ValueError("%s(%r): index %s is summed within one operand (GraphSpec's einsum contracts indices "
                             "in both operands only)" % (op, equation, label))
    return tuple(sizes[label] for label in lo)


def einsum(equation, a, b, precision=None):
    if not (isinstance(a, Symbol) and isinstance(b, Symbol)):
        other = b if isinstance(a, Symbol) else a
        _no_constants(other, "einsum")
    if a.trace is not b.trace:
        raise TypeError("einsum of tensors from two different traces")
    wire = result_wire((a.wire, b.wire))
    if wire not in _FLOATS:
        wire = dtypes.FLOAT32
    a, b = (s if s.wire == wire else s._cast(wire, "einsum") for s in (a, b))
    shape = einsum_shapes(equation, a.shape, b.shape)
    return a._record("einsum", GraphSpec.Einsum(equation=equation.replace(" ", ""),
                                                precision=precision_proto(precision, "einsum precision")),
                     [a, b], [(shape, wire)])[0]


def matmul(a, b, precision=None):
    """jnp.matmul as an einsum: [..., m, k] @ [..., k, n], a vector on either side, or a batch with a matrix."""
    if not (isinstance(a, Symbol) and isinstance(b, Symbol)):
        _no_constants(b if isinstance(a, Symbol) else a, "matmul (x @ y)")
    letters = "abcdefghijklmnopqrstuvw"
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError("matmul: a 0-d operand")
    if b.ndim == 1:
        return einsum("...k,k->...", a, b, precision)
    if a.ndim == 1:
        return einsum("k,...kn->...n", a, b, precision)
    if b.ndim == 2:
        return einsum("...mk,kn->...mn", a, b, precision)
    if a.ndim != b.ndim:
        raise ValueError("matmul: batched operands of ranks %d and %d; GraphSpec's einsum wants equal ranks "
                         "(or a matrix on the right)" % (a.ndim, b.ndim))
    batch = letters[:a.ndim - 2]
    return einsum("%sxy,%syz->%sxz" % (batch, batch, batch), a, b, precision)


# ---- indexing and shapes ----------------------------------------------------------------------

def getitem(x, index):
    """Static basic indexing: integers, slices with positive steps, ..., None."""
    items = list(index) if isinstance(index, tuple) else [index]
    for i in items:
        if isinstance(i, Symbol) or isinstance(i, (list, np.ndarray)) and not _is_constant(i):
            raise TypeError("x[%s] of a traced tensor: GraphSpec slices with static integers and slices (no "
                            "gather by an index array)" % _index_text(tuple(items)))
        if not (i is None or i is Ellipsis or isinstance(i, (slice, numbers.Integral, np.integer))):
            raise TypeError("x[%s] of a traced tensor: an index of %s" % (_index_text(tuple(items)), type(i).__name__))
    if sum(i is Ellipsis for i in items) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    if used > x.ndim:
        raise IndexError("too many indices for a traced tensor of rank %d" % x.ndim)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (x.ndim - used) + items[at + 1:]
    else:
        items += [slice(None)] * (x.ndim - used)
    start, limit, stride, shape = [], [], [], []
    axis = 0
    for i in items:
        if i is None:
            shape.append(1)
            continue
        n = x.shape[axis]
        if isinstance(i, slice):
            s, e, st = i.indices(n)
            if st <= 0:
                raise TypeError("x[%s] of a traced tensor: GraphSpec's slice takes positive steps" %
                                _index_text(tuple(items)))
            count = max(0, (e - s + st - 1) // st)
            start.append(s)
            limit.append(s + (count - 1) * st + 1 if count else s)
            stride.append(st)
            shape.append(count)
        else:
            k = int(i)
            if not -n <= k < n:
                raise IndexError("index %d is out of bounds for axis %d with size %d" % (k, axis, n))
            k %= n
            start.append(k)
            limit.append(k + 1)
            stride.append(1)
        axis += 1
    sliced = x
    if start != [0] * x.ndim or limit != list(x.shape) or any(s != 1 for s in stride):
        kept = tuple(len(range(s, e, st)) for s, e, st in zip(start, limit, stride))
        message = GraphSpec.Slice(start=start, limit=limit, stride=[] if all(s == 1 for s in stride) else stride)
        sliced = x._record("slice", message, [x], [(kept, x.wire)])[0]
    out = sliced.reshape(tuple(shape)) if tuple(shape) != sliced.shape else sliced
    if out is not x:
        out.origin = (x, index)
    return out


def swapaxes(x, axis1, axis2):
    axes = list(range(x.ndim))
    a, b = normalized_axis(axis1, x.ndim, "swapaxes"), normalized_axis(axis2, x.ndim, "swapaxes")
    axes[a], axes[b] = axes[b], axes[a]
    return x.transpose(axes)


def moveaxis(x, source, destination):
    src = [normalized_axis(a, x.ndim, "moveaxis") for a in (source if isinstance(source, (tuple, list)) else [source])]
    dst = [normalized_axis(a, x.ndim, "moveaxis") for a in (
        destination if isinstance(destination, (tuple, list)) else [destination])]
    if len(src) != len(dst):
        raise ValueError("moveaxis: source and destination differ in length")
    order = [a for a in range(x.ndim) if a not in src]
    for d, s in sorted(zip(dst, src)):
        order.insert(d, s)
    return x.transpose(order)


def expand_dims(x, axis):
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    ndim = x.ndim + len(axes)
    axes = sorted(normalized_axis(a, ndim, "expand_dims") for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return x.reshape(tuple(shape))


def squeeze(x, axis=None):
    if axis is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    else:
        axes = list(_axes(axis, x.ndim, "squeeze"))
        for a in axes:
            if x.shape[a] != 1:
                raise ValueError("squeeze: axis %d has size %d, not 1" % (a, x.shape[a]))
    return x.reshape(tuple(d for i, d in enumerate(x.shape) if i not in axes))


def split(x, indices_or_sections, axis=0):
    axis = normalized_axis(axis, x.ndim, "split")
    if not isinstance(indices_or_sections, numbers.Integral):
        # Uneven cuts at given indices: slices.
        cuts = [0] + [int(i) for i in indices_or_sections] + [x.shape[axis]]
        out = []
        for s, e in zip(cuts[:-1], cuts[1:]):
            index = [slice(None)] * x.ndim
            index[axis] = slice(s, e)
            out.append(getitem(x, tuple(index)))
        return out
    parts = int(indices_or_sections)
    if parts < 1 or x.shape[axis] % parts:
        raise ValueError("split: %d does not divide axis %d of size %d into equal parts" % (
            parts, axis, x.shape[axis]))
    if parts == 1:
        return [x]
    shape = x.shape[:axis] + (x.shape[axis] // parts,) + x.shape[axis + 1:]
    return x._record("split", GraphSpec.Split(axis=axis, parts=parts), [x], [(shape, x.wire)] * parts)


def concatenate(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    for a in arrays:
        if not isinstance(a, Symbol):
            _no_constants(a, "concatenate")
    first = arrays[0]
    if len(arrays) == 1:
        return first
    ndim = first.ndim
    axis = normalized_axis(axis, ndim, "concatenate")
    for a in arrays:
        if a.ndim != ndim or a.shape[:axis] + a.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError("concatenate: shapes %s differ off axis %d" % ([list(s.shape) for s in arrays], axis))
    wire = _promoted([a.wire for a in arrays], "concatenate")
    arrays = [a if a.wire == wire else a._cast(wire, "concatenate") for a in arrays]
    shape = first.shape[:axis] + (sum(a.shape[axis] for a in arrays),) + first.shape[axis + 1:]
    return first._record("concatenate", GraphSpec.Concatenate(axis=axis), arrays, [(shape, wire)])[0]


def stack(arrays, axis=0):
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to stack")
    shapes = {tuple(a.shape) for a in arrays}
    if len(shapes) != 1:
        raise ValueError("stack: arrays of shapes %s; want one shape" % sorted(list(s) for s in shapes))
    axis = normalized_axis(axis, arrays[0].ndim + 1, "stack")
    return concatenate([expand_dims(a, axis) if isinstance(a, Symbol) else a for a in arrays], axis)


def add(a, b, op="x + y"):
    return binary(_BINARY.ADD, a, b)


def multiply(a, b):
    return binary(_BINARY.MULTIPLY, a, b)
