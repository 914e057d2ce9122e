"""jax.numpy's glue functions for te_client composites.

    import te_client.numpy as jnp            # was: import jax.numpy as jnp

Inside a composite's traced __call__ (init / apply of a te_client.linen
Module) tensors are symbolic.Symbols and these functions record te.v1.GraphSpec
nodes: reshape (-1 allowed), split(x, n, axis) into equal parts, concatenate,
transpose, x + y (equal shapes; float dtypes promote as JAX's do), x * constant,
astype(float32 | bfloat16 | float16). x.shape, x.ndim and x.dtype are known
while tracing, so code may compute with them. On numpy arrays every function
is numpy's, and every other name (jnp.zeros, jnp.tril, ...) is numpy's too:
ordinary code keeps working. A numpy function or ufunc GraphSpec has no node
for raises TypeError naming it when it meets a traced tensor.
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

# The numpy functions a traced tensor accepts (Symbol.__array_function__ sends them here).
TRACED = frozenset(["reshape", "split", "concatenate", "transpose", "shape", "ndim", "add", "multiply",
                    "subtract", "negative", "astype", "size"])


def _traced(*values):
    return any(isinstance(v, (_symbolic.Symbol, _symbolic.Indexed)) for v in values)


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


def transpose(a, axes=None):
    if _traced(a):
        return a.transpose(axes) if axes is not None else a.transpose()
    return _np.transpose(a, axes)


def add(x1, x2):
    return _symbolic.add(x1, x2) if _traced(x1, x2) else _np.add(x1, x2)


def subtract(x1, x2):
    return x1 - x2 if _traced(x1, x2) else _np.subtract(x1, x2)


def multiply(x1, x2):
    return _symbolic.multiply(x1, x2) if _traced(x1, x2) else _np.multiply(x1, x2)


def negative(x):
    return -x if _traced(x) else _np.negative(x)


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


def __getattr__(name):
    # jnp.zeros, jnp.tril, jnp.vdot...: numpy's, for code that computes on arrays.
    try:
        return getattr(_np, name)
    except AttributeError:
        raise AttributeError("module 'te_client.numpy' has no attribute %r (nor has numpy)" % name) from None
