"""jax.numpy for te_client: the same functions on traced tensors and on arrays.

    import te_client.numpy as jnp            # was: import jax.numpy as jnp

Inside a traced function (a composite's __call__ at init / apply, or a loss
function under te_client.value_and_grad) tensors are symbolic.Symbols and
these functions record te.v1.GraphSpec nodes (symbolic.py lists them and
JAX's dtype promotion). On numpy arrays each computes eagerly with numpy (in
the arrays' own dtype: float64 stays float64), so the same code runs on
either. Every other name (jnp.zeros, jnp.tril, ...) is numpy's: ordinary
code keeps working, and a numpy function or ufunc GraphSpec has no node for
raises TypeError naming it and the ops a traced tensor takes.
"""
import numpy as _np

from te_client import dtypes as _dtypes
from te_client import symbolic as _symbolic

ndarray = _np.ndarray
bool_ = _np.bool_
float32 = _np.float32
float16 = _np.float16
int32 = _np.int32
bfloat16 = _dtypes.bfloat16

_Symbol = _symbolic.Symbol
_B = _symbolic.GraphSpec.Binary
_U = _symbolic.GraphSpec.Unary
_R = _symbolic.GraphSpec.Reduce


def _traced(*values):
    return any(isinstance(v, _Symbol) for v in values)


def _binary(op, numpy_fn):
    def fn(x1, x2):
        return _symbolic.binary(op, x1, x2) if _traced(x1, x2) else numpy_fn(x1, x2)
    fn.__name__ = numpy_fn.__name__
    fn.__doc__ = "jnp.%s: a binary node on traced tensors (broadcasting, scalars), numpy's on arrays." % fn.__name__
    return fn


add = _binary(_B.ADD, _np.add)
subtract = _binary(_B.SUBTRACT, _np.subtract)
multiply = _binary(_B.MULTIPLY, _np.multiply)
divide = _binary(_B.DIVIDE, _np.divide)
true_divide = divide
maximum = _binary(_B.MAXIMUM, _np.maximum)
minimum = _binary(_B.MINIMUM, _np.minimum)
power = _binary(_B.POWER, _np.power)
greater = _binary(_B.GREATER, _np.greater)
greater_equal = _binary(_B.GREATER_EQUAL, _np.greater_equal)
less = _binary(_B.LESS, _np.less)
less_equal = _binary(_B.LESS_EQUAL, _np.less_equal)
equal = _binary(_B.EQUAL, _np.equal)
not_equal = _binary(_B.NOT_EQUAL, _np.not_equal)


def _rsqrt(x):
    return 1.0 / _np.sqrt(x)


def _sigmoid(x):
    return 1.0 / (1.0 + _np.exp(-x))


def _unary(op, numpy_fn, name):
    def fn(x):
        return _symbolic.unary(op, x, name) if _traced(x) else numpy_fn(_np.asarray(x))
    fn.__name__ = name
    fn.__doc__ = "jnp.%s: a unary node on a traced tensor, numpy on an array." % name
    return fn


negative = _unary(_U.NEGATIVE, _np.negative, "negative")
exp = _unary(_U.EXP, _np.exp, "exp")
log = _unary(_U.LOG, _np.log, "log")
tanh = _unary(_U.TANH, _np.tanh, "tanh")
sqrt = _unary(_U.SQRT, _np.sqrt, "sqrt")
rsqrt = _unary(_U.RSQRT, _rsqrt, "rsqrt")
abs = absolute = _unary(_U.ABS, _np.abs, "abs")  # noqa: A001 (jnp's name)
square = _unary(_U.SQUARE, _np.square, "square")
logical_not = _unary(_U.LOGICAL_NOT, _np.logical_not, "logical_not")


def where(condition, x=None, y=None):
    if x is None or y is None:
        raise TypeError("where(condition) without x and y (jnp.nonzero) has a data-dependent shape")
    if _traced(condition, x, y):
        return _symbolic.where(condition, x, y)
    return _np.where(condition, x, y)


def _reduction(op, numpy_fn, name):
    def fn(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
        if _traced(a):
            if out is not None or kwargs:
                raise TypeError("%s(%s) of a traced tensor: GraphSpec's reduce takes axis and keepdims" % (
                    name, ", ".join(["out"] * (out is not None) + list(kwargs))))
            return _symbolic.reduce(op, a, axis, keepdims, name, dtype)
        extra = {"dtype": dtype} if dtype is not None else {}
        return numpy_fn(_np.asarray(a), axis=tuple(axis) if isinstance(axis, list) else axis, out=out,
                        keepdims=keepdims, **extra, **kwargs)
    fn.__name__ = name
    return fn


sum = _reduction(_R.SUM, _np.sum, "sum")  # noqa: A001
mean = _reduction(_R.MEAN, _np.mean, "mean")
max = _reduction(_R.MAX, lambda a, dtype=None, **k: _np.max(a, **k), "max")  # noqa: A001
min = _reduction(_R.MIN, lambda a, dtype=None, **k: _np.min(a, **k), "min")  # noqa: A001
amax, amin = max, min


def einsum(subscripts, *operands, precision=None, **kwargs):
    if _traced(*operands):
        if len(operands) != 2 or kwargs:
            raise TypeError("einsum(%r) of traced tensors: GraphSpec's einsum takes two operands" % subscripts)
        return _symbolic.einsum(subscripts, operands[0], operands[1], precision)
    return _np.einsum(subscripts, *operands, **kwargs)


def matmul(a, b, precision=None):
    return _symbolic.matmul(a, b, precision) if _traced(a, b) else _np.matmul(a, b)


def dot(a, b, precision=None):
    return matmul(a, b, precision) if _traced(a, b) else _np.dot(a, b)


def reshape(a, newshape=None, order="C", *, shape=None):
    shape = newshape if shape is None else shape
    if _traced(a):
        return a.reshape(shape, order=order)
    return _np.reshape(a, shape, order=order)


def split(ary, indices_or_sections, axis=0):
    if _traced(ary):
        return _symbolic.split(ary, indices_or_sections, axis)
    return _np.split(ary, indices_or_sections, axis=axis)


def concatenate(arrays, axis=0, **kwargs):
    arrays = list(arrays)
    if _traced(*arrays):
        if kwargs:
            raise TypeError("concatenate(%s) of traced tensors: GraphSpec's concatenate takes axis only"
                            % ", ".join(kwargs))
        return _symbolic.concatenate(arrays, axis)
    return _np.concatenate(arrays, axis=axis, **kwargs)


def stack(arrays, axis=0):
    arrays = list(arrays)
    return _symbolic.stack(arrays, axis) if _traced(*arrays) else _np.stack(arrays, axis=axis)


def transpose(a, axes=None):
    if _traced(a):
        return a.transpose(axes) if axes is not None else a.transpose()
    return _np.transpose(a, axes)


def swapaxes(a, axis1, axis2):
    return _symbolic.swapaxes(a, axis1, axis2) if _traced(a) else _np.swapaxes(a, axis1, axis2)


def moveaxis(a, source, destination):
    return _symbolic.moveaxis(a, source, destination) if _traced(a) else _np.moveaxis(a, source, destination)


def expand_dims(a, axis):
    return _symbolic.expand_dims(a, axis) if _traced(a) else _np.expand_dims(a, axis)


def squeeze(a, axis=None):
    return _symbolic.squeeze(a, axis) if _traced(a) else _np.squeeze(a, axis)


def astype(x, dtype):
    if _traced(x):
        return x.astype(dtype)
    return _dtypes.asarray(x, dtype)


def asarray(a, dtype=None):
    if _traced(a):
        return a if dtype is None else a.astype(dtype)
    return _dtypes.asarray(a, dtype)


def shape(a):
    return tuple(a.shape) if _traced(a) else _np.shape(a)


def ndim(a):
    return a.ndim if _traced(a) else _np.ndim(a)


def size(a):
    return int(_np.prod(a.shape, dtype=_np.int64)) if _traced(a) else _np.size(a)


def result_type(*args):
    """jnp.result_type of arrays and traced tensors (scalars are weakly typed)."""
    traced = [a for a in args if _traced(a)]
    if not traced:
        return _np.result_type(*args)
    wires = [a.wire for a in traced] + [_symbolic.wire_of(_np.asarray(a).dtype, "result_type")
                                        for a in args if not _traced(a) and hasattr(a, "dtype") and _np.ndim(a)]
    return _symbolic.dtype_of_wire(_symbolic.result_wire(wires))


# What numpy's own functions and ufuncs do on a traced tensor (np.sum(x), np.exp(x), x.__array_ufunc__).
_symbolic.HANDLERS.update({
    "add": add, "subtract": subtract, "multiply": multiply, "divide": divide, "true_divide": divide,
    "maximum": maximum, "minimum": minimum, "power": power, "greater": greater, "greater_equal": greater_equal,
    "less": less, "less_equal": less_equal, "equal": equal, "not_equal": not_equal, "negative": negative,
    "exp": exp, "log": log, "tanh": tanh, "sqrt": sqrt, "absolute": abs, "square": square,
    "logical_not": logical_not, "where": where, "sum": sum, "mean": mean, "max": max, "min": min, "amax": max,
    "amin": min, "einsum": einsum, "matmul": matmul, "dot": dot, "reshape": reshape, "split": split,
    "concatenate": concatenate, "stack": stack, "transpose": transpose, "swapaxes": swapaxes, "moveaxis": moveaxis,
    "expand_dims": expand_dims, "squeeze": squeeze, "shape": shape, "ndim": ndim, "size": size,
    "result_type": result_type,
})
TRACED = frozenset(_symbolic.HANDLERS)


def __getattr__(name):
    # jnp.zeros, jnp.tril, jnp.vdot...: numpy's, for code that computes on arrays.
    try:
        return getattr(_np, name)
    except AttributeError:
        raise AttributeError("module 'te_client.numpy' has no attribute %r (nor has numpy)" % name) from None
