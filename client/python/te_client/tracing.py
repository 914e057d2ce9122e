"""Reverse-mode gradients through a composite Module's client-side glue.

During value_and_grad of a composite Module, the values flowing through its
__call__ are Tracers: numpy-like wrappers that record each operation on a
Tape. Server modules record a node whose backward is the Backward RPC; the
glue between them (reshape, split, concatenate, indexing, +, -, *, astype,
transpose, client-side dropout) records its own small backward. Tape.backward
then runs the nodes in reverse, as jax.vjp would.

Tracers accept both methods (x.reshape(...)) and numpy functions
(np.split(x, 3, axis=3)); a numpy function or ufunc that is not listed here
raises TypeError instead of silently dropping the gradient.
"""
import numpy as np

from te_client import dtypes


class Node:
    __slots__ = ("inputs", "outputs", "backward")

    def __init__(self, inputs, backward):
        self.inputs = inputs      # Tracers (or None for constants), in backward's order
        self.outputs = []
        self.backward = backward  # list of output grads (None: no gradient) -> list of input grads


class Tape:
    def __init__(self):
        self.nodes = []

    def leaf(self, value):
        return Tracer(dtypes.as_numpy(value), self)

    def record(self, inputs, output_values, backward):
        """Outputs of a node whose inputs are `inputs` (Tracers or constants)."""
        node = Node([i if isinstance(i, Tracer) else None for i in inputs], backward)
        node.outputs = [Tracer(v, self, node) for v in output_values]
        self.nodes.append(node)
        return node.outputs

    def backward(self, outputs_and_grads):
        """Runs the tape in reverse from {output Tracer: its gradient}. Returns
        {id(tracer): gradient} for every Tracer that received one."""
        grads = {}
        for tracer, g in outputs_and_grads:
            _accumulate(grads, tracer, g)
        for node in reversed(self.nodes):
            out_grads = [grads.get(id(t)) for t in node.outputs]
            if all(g is None for g in out_grads):
                continue
            in_grads = node.backward(out_grads)
            for tracer, g in zip(node.inputs, in_grads):
                if tracer is not None and g is not None:
                    _accumulate(grads, tracer, g)
        return grads


def _accumulate(grads, tracer, g):
    g = _like(g, tracer.value)
    key = id(tracer)
    grads[key] = g if key not in grads else _like(grads[key] + g, tracer.value)


def _like(g, value):
    """g in value's dtype and shape (a gradient has its primal's type)."""
    g = dtypes.as_numpy(g)
    if g.shape != value.shape:
        g = _unbroadcast(g, value.shape)
    if isinstance(value, dtypes.Bfloat16Array) and not isinstance(g, dtypes.Bfloat16Array):
        return dtypes.asarray(np.asarray(g, np.float32), dtypes.bfloat16)
    if not isinstance(value, dtypes.Bfloat16Array) and g.dtype != value.dtype:
        return g.astype(value.dtype)
    return g


def _unbroadcast(g, shape):
    """Sums g over the axes that broadcasting added to reach g.shape from `shape`."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


def value_of(x):
    return x.value if isinstance(x, Tracer) else x


def _zeros_if_none(grads, values):
    return [np.zeros(v.shape, np.float32) if g is None else np.asarray(g, np.float32)
            for g, v in zip(grads, values)]


class Tracer:
    """A value on the tape. Behaves like its numpy array for the supported ops."""
    __array_priority__ = 1000

    def __init__(self, value, tape, node=None):
        self.value = value
        self.tape = tape
        self.node = node

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)
    size = property(lambda self: self.value.size)
    T = property(lambda self: self.transpose())

    def __repr__(self):
        return "Tracer(%s%s)" % (self.dtype, list(self.shape))

    def __len__(self):
        return len(self.value)

    def __array__(self, dtype=None, copy=None):
        # A concrete copy (e.g. for printing); no gradient flows through it.
        return np.asarray(self.value, dtype=dtype)

    def _unary(self, out, backward):
        return self.tape.record([self], [out], lambda g: [backward(g[0])])[0]

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        in_shape = self.shape
        return self._unary(self.value.reshape(shape), lambda g: g.reshape(in_shape))

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(axes) if axes else tuple(reversed(range(self.ndim)))
        inverse = tuple(np.argsort(axes))
        return self._unary(self.value.transpose(axes), lambda g: g.transpose(inverse))

    def astype(self, dtype):
        source = self.value
        return self._unary(dtypes.asarray(source, dtype), lambda g: _like(g, source))

    def __getitem__(self, index):
        index = value_of(index)
        shape, value = self.shape, self.value

        def backward(g):
            full = np.zeros(shape, np.float32)
            np.add.at(full, index, np.asarray(g, np.float32))
            return _like(full, value)
        return self._unary(self.value[index], backward)

    def _binary(self, other, forward, grad_self, grad_other):
        a, b = self.value, value_of(other)
        out = forward(a, b)
        return self.tape.record([self, other], [out], lambda g: [grad_self(g[0], a, b), grad_other(g[0], a, b)])[0]

    def __add__(self, other):
        return self._binary(other, lambda a, b: a + b, lambda g, a, b: g, lambda g, a, b: g)

    def __radd__(self, other):
        return self.__add__(other)

    def __sub__(self, other):
        return self._binary(other, lambda a, b: a - b, lambda g, a, b: g, lambda g, a, b: -g)

    def __rsub__(self, other):
        return self._binary(other, lambda a, b: b - a, lambda g, a, b: -g, lambda g, a, b: g)

    def __mul__(self, other):
        return self._binary(other, lambda a, b: a * b, lambda g, a, b: g * b, lambda g, a, b: g * a)

    def __rmul__(self, other):
        return self.__mul__(other)

    def __neg__(self):
        return self._unary(-self.value, lambda g: -g)

    # ---- numpy protocols --------------------------------------------------------------

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs:
            return NotImplemented
        if ufunc in (np.add, np.subtract, np.multiply) and len(inputs) == 2:
            a, b = inputs
            if isinstance(a, Tracer):
                return {np.add: a.__add__, np.subtract: a.__sub__, np.multiply: a.__mul__}[ufunc](b)
            return {np.add: b.__radd__, np.subtract: b.__rsub__, np.multiply: b.__rmul__}[ufunc](a)
        if ufunc is np.negative:
            return -inputs[0]
        return NotImplemented

    def __array_function__(self, func, types, args, kwargs):
        handler = _FUNCTIONS.get(func)
        if handler is None:
            return NotImplemented
        return handler(*args, **kwargs)


def _split(x, indices_or_sections, axis=0):
    tape = x.tape
    pieces = np.split(x.value, indices_or_sections, axis=axis)
    return list(tape.record([x], pieces, lambda grads: [
        _like(np.concatenate(_zeros_if_none(grads, pieces), axis=axis), x.value)]))


def _concatenate(arrays, axis=0, **kwargs):
    arrays = list(arrays)
    tape = next(a.tape for a in arrays if isinstance(a, Tracer))
    values = [value_of(a) for a in arrays]
    bounds = np.cumsum([v.shape[axis] for v in values])[:-1]
    out = np.concatenate(values, axis=axis, **kwargs)
    return tape.record(arrays, [out], lambda g: [
        _like(p, v) for p, v in zip(np.split(g[0], bounds, axis=axis), values)])[0]


def _squeeze(x, axis=None):
    in_shape = x.shape
    return x._unary(np.squeeze(x.value, axis=axis), lambda g: np.reshape(g, in_shape))


def _expand_dims(x, axis):
    in_shape = x.shape
    return x._unary(np.expand_dims(x.value, axis), lambda g: np.reshape(g, in_shape))


_FUNCTIONS = {
    np.split: _split,
    np.concatenate: _concatenate,
    np.reshape: lambda x, newshape=None, **kw: x.reshape(newshape if newshape is not None else kw["shape"]),
    np.transpose: lambda x, axes=None: x.transpose(*(axes or ())),
    np.squeeze: _squeeze,
    np.expand_dims: _expand_dims,
    np.shape: lambda x: x.shape,
    np.ndim: lambda x: x.ndim,
}
