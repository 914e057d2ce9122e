"""A float64 numpy evaluator of te.v1 GraphSpecs, forward and reverse mode:
the reference the zoo's losses and gradients are checked against.

Each node is evaluated by its te.v1 definition (layers.proto), independently
of te_client's tracer; tests/test_numpy_ops.py checks the tracer against the
same code run eagerly on numpy arrays, so together they tie the server's
numbers to the user's code. Casts are identities here (float64 throughout),
dropout runs deterministic, and module nodes are the ones the zoo uses
(flax_dense, flax_embed, TE's dense_general with axis -1)."""
import numpy as np

from te_client._pb import layers_pb2

G = layers_pb2.GraphSpec
B = G.Binary
U = G.Unary
R = G.Reduce


def _unbroadcast(g, shape):
    g = np.asarray(g)
    while g.ndim > len(shape):
        g = g.sum(0)
    for i, d in enumerate(shape):
        if d == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdims=True)
    return g


def _param(variables, node_name, leaf):
    key = "params/" + "/".join(p for p in (node_name, leaf) if p)
    return key, np.asarray(variables[key], np.float64)


_BINARY = {B.ADD: np.add, B.SUBTRACT: np.subtract, B.MULTIPLY: np.multiply, B.DIVIDE: np.divide,
           B.MAXIMUM: np.maximum, B.MINIMUM: np.minimum, B.POWER: np.power, B.GREATER: np.greater,
           B.GREATER_EQUAL: np.greater_equal, B.LESS: np.less, B.LESS_EQUAL: np.less_equal, B.EQUAL: np.equal,
           B.NOT_EQUAL: np.not_equal}
_COMPARE = {B.GREATER, B.GREATER_EQUAL, B.LESS, B.LESS_EQUAL, B.EQUAL, B.NOT_EQUAL}


_C = np.sqrt(2.0 / np.pi)


def _gelu(x):
    """TE's gelu: the tanh approximation (flax.linen.gelu's default)."""
    return 0.5 * x * (1.0 + np.tanh(_C * (x + 0.044715 * x ** 3)))


def _gelu_grad(x):
    t = np.tanh(_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x * x)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _unary(op, x):
    if op == U.NEGATIVE:
        return -x
    if op == U.EXP:
        return np.exp(x)
    if op == U.LOG:
        return np.log(x)
    if op == U.TANH:
        return np.tanh(x)
    if op == U.SQRT:
        return np.sqrt(x)
    if op == U.RSQRT:
        return 1 / np.sqrt(x)
    if op == U.ABS:
        return np.abs(x)
    if op == U.SQUARE:
        return x * x
    if op == U.SIGMOID:
        return _sigmoid(x)
    if op == U.RELU:
        return np.maximum(x, 0)
    if op == U.SILU:
        return x * _sigmoid(x)
    if op == U.LOGICAL_NOT:
        return np.logical_not(x)
    raise NotImplementedError(U.Op.Name(op))


def _unary_grad(op, x, y, g):
    if op == U.NEGATIVE:
        return -g
    if op == U.EXP:
        return g * y
    if op == U.LOG:
        return g / x
    if op == U.TANH:
        return g * (1 - y * y)
    if op == U.SQRT:
        return g * 0.5 / y
    if op == U.RSQRT:
        return g * -0.5 * y ** 3
    if op == U.ABS:
        return g * np.sign(x)
    if op == U.SQUARE:
        return g * 2 * x
    if op == U.SIGMOID:
        return g * y * (1 - y)
    if op == U.RELU:
        return g * (x > 0)
    if op == U.SILU:
        s = _sigmoid(x)
        return g * (s + x * s * (1 - s))
    raise NotImplementedError(U.Op.Name(op))


def _explicit(eq, a, b):
    """`eq` with its "..." spelled out as letters it does not use (numpy broadcasts them alike)."""
    if "..." not in eq:
        return eq
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    n = max(x.ndim - (len(s) - 3) for x, s in ((a, sa), (b, sb)) if "..." in s)
    dots = "".join(free[:n])

    def spell(sub, ndim):
        return sub.replace("...", dots[n - (ndim - (len(sub) - 3)):]) if "..." in sub else sub
    return "%s,%s->%s" % (spell(sa, a.ndim), spell(sb, b.ndim), out.replace("...", dots))


def _einsum_grads(eq, a, b, g):
    eq = _explicit(eq, a, b)
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    return np.einsum("%s,%s->%s" % (out, sb, sa), g, b), np.einsum("%s,%s->%s" % (sa, out, sb), a, g)


class Evaluation:
    def __init__(self, spec, variables, inputs, deterministic=True):
        self.spec = spec
        self.variables = {k: np.asarray(v, np.float64) for k, v in variables.items()}
        self.env = {k: (np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v))
                    for k, v in inputs.items()}
        self.saved = {}
        for node in spec.nodes:
            outs = self._forward(node, [self.env[i] for i in node.inputs])
            for name, value in zip(node.outputs, outs):
                self.env[name] = value

    def outputs(self):
        return [self.env[o] for o in self.spec.outputs]

    def _forward(self, node, xs):
        op = node.WhichOneof("op")
        if op == "module":
            kind = node.module.WhichOneof("module")
            x = xs[0]
            if kind == "flax_dense":
                _, k = _param(self.variables, node.name, "kernel")
                y = x @ k
                if not node.module.flax_dense.HasField("use_bias") or node.module.flax_dense.use_bias:
                    y = y + _param(self.variables, node.name, "bias")[1]
                return [y]
            if kind == "dense_general":
                _, k = _param(self.variables, node.name, "kernel")
                y = np.tensordot(x, k, axes=([-1], [0]))
                m = node.module.dense_general
                if not m.HasField("use_bias") or m.use_bias:
                    y = y + _param(self.variables, node.name, "bias")[1]
                return [y]
            if kind == "activation":
                if list(node.module.activation.activations) != ["gelu"]:
                    raise NotImplementedError("activation %s" % list(node.module.activation.activations))
                return [_gelu(x)]
            if kind == "flax_embed":
                _, e = _param(self.variables, node.name, "embedding")
                return [e[x.astype(np.int64)]]
            raise NotImplementedError("module " + kind)
        if op == "param":
            return [np.asarray(self.variables["params/" + node.name], np.float64)]
        if op == "binary":
            m = node.binary
            f = _BINARY[m.op]
            if m.HasField("scalar"):
                return [f(m.scalar, xs[0]) if m.scalar_first else f(xs[0], m.scalar)]
            return [f(xs[0], xs[1])]
        if op == "unary":
            return [_unary(node.unary.op, xs[0])]
        if op == "where":
            m = node.where
            c, rest = xs[0], list(xs[1:])
            x = m.x_scalar if m.HasField("x_scalar") else rest.pop(0)
            y = m.y_scalar if m.HasField("y_scalar") else rest.pop(0)
            return [np.where(c, x, y)]
        if op == "reduce":
            m = node.reduce
            axes = tuple(m.axes) if m.axes else None
            f = {R.SUM: np.sum, R.MEAN: np.mean, R.MAX: np.max, R.MIN: np.min}[m.op]
            return [f(xs[0], axis=axes, keepdims=m.keepdims)]
        if op == "einsum":
            return [np.einsum(node.einsum.equation, xs[0], xs[1])]
        if op == "slice":
            m = node.slice
            stride = list(m.stride) or [1] * len(m.start)
            return [xs[0][tuple(slice(s, e, st) for s, e, st in zip(m.start, m.limit, stride))]]
        if op == "softmax":
            x = xs[0]
            a = node.softmax.axis
            shifted = x - x.max(axis=a, keepdims=True)
            lse = np.log(np.exp(shifted).sum(axis=a, keepdims=True))
            return [shifted - lse if node.softmax.log else np.exp(shifted - lse)]
        if op == "reshape":
            return [xs[0].reshape(tuple(node.reshape.shape))]
        if op == "transpose":
            return [np.transpose(xs[0], tuple(node.transpose.axes))]
        if op in ("cast", "dropout"):
            return [xs[0]]
        if op == "add":
            return [sum(xs[1:], xs[0])]
        if op == "scale":
            return [xs[0] * node.scale.factor]
        if op == "split":
            return np.split(xs[0], node.split.parts, axis=node.split.axis)
        if op == "concatenate":
            return [np.concatenate(xs, axis=node.concatenate.axis)]
        if op == "softmax_cross_entropy":
            logits, labels = xs
            top = logits.max(-1, keepdims=True)
            lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
            picked = np.take_along_axis(logits, labels[..., None].astype(np.int64), -1)[..., 0]
            return [np.asarray((lse - picked).mean())]
        raise NotImplementedError(op)

    def gradients(self, seeds):
        """Reverse mode from {edge: cotangent}: ({"params/...": grad}, {input edge: grad})."""
        grads = {k: np.asarray(v, np.float64) for k, v in seeds.items()}
        pgrads = {}

        def acc(edge, g):
            grads[edge] = grads[edge] + g if edge in grads else g

        def pacc(key, g):
            pgrads[key] = pgrads[key] + g if key in pgrads else g
        for node in reversed(self.spec.nodes):
            outs = [grads.get(o) for o in node.outputs]
            if all(g is None for g in outs):
                continue
            xs = [self.env[i] for i in node.inputs]
            ys = [self.env[o] for o in node.outputs]
            g = outs[0]
            op = node.WhichOneof("op")
            if op == "module":
                kind = node.module.WhichOneof("module")
                x = xs[0]
                if kind in ("flax_dense", "dense_general"):
                    kkey, k = _param(self.variables, node.name, "kernel")
                    acc(node.inputs[0], np.tensordot(g, k, axes=([-1], [1])) if k.ndim == 2 else
                        np.tensordot(g, k, axes=(list(range(g.ndim - k.ndim + 1, g.ndim)), list(range(1, k.ndim)))))
                    lead = x.reshape(-1, x.shape[-1])
                    pacc(kkey, (lead.T @ g.reshape(lead.shape[0], -1)).reshape(k.shape))
                    bkey = "params/" + "/".join(p for p in (node.name, "bias") if p)
                    if bkey in self.variables:
                        pacc(bkey, g.reshape(-1, *self.variables[bkey].shape).sum(0))
                elif kind == "activation":
                    acc(node.inputs[0], g * _gelu_grad(x))
                elif kind == "flax_embed":
                    ekey, e = _param(self.variables, node.name, "embedding")
                    de = np.zeros_like(e)
                    np.add.at(de, x.astype(np.int64).ravel(), g.reshape(-1, e.shape[1]))
                    pacc(ekey, de)
                else:
                    raise NotImplementedError(kind)
            elif op == "param":
                pacc("params/" + node.name, g)
            elif op == "binary":
                m = node.binary
                if m.op in _COMPARE:
                    continue
                if m.HasField("scalar"):
                    x, c = xs[0], m.scalar
                    y = ys[0]
                    if m.op == B.ADD:
                        dx = g
                    elif m.op == B.SUBTRACT:
                        dx = -g if m.scalar_first else g
                    elif m.op == B.MULTIPLY:
                        dx = g * c
                    elif m.op == B.DIVIDE:
                        dx = -g * c / (x * x) if m.scalar_first else g / c
                    elif m.op == B.POWER:
                        dx = g * y * np.log(c) if m.scalar_first else g * c * x ** (c - 1)
                    elif m.op == B.MAXIMUM:   # jax.lax.max: a tie's gradient in halves
                        dx = g * ((x > c) + 0.5 * (x == c))
                    elif m.op == B.MINIMUM:
                        dx = g * ((x < c) + 0.5 * (x == c))
                    acc(node.inputs[0], dx)
                else:
                    a, b = xs
                    if m.op == B.ADD:
                        da, db = g, g
                    elif m.op == B.SUBTRACT:
                        da, db = g, -g
                    elif m.op == B.MULTIPLY:
                        da, db = g * b, g * a
                    elif m.op == B.DIVIDE:
                        da, db = g / b, -g * a / (b * b)
                    elif m.op == B.MAXIMUM:   # jax.lax.max: a tie's gradient in halves
                        da, db = g * ((a > b) + 0.5 * (a == b)), g * ((b > a) + 0.5 * (a == b))
                    elif m.op == B.MINIMUM:
                        da, db = g * ((a < b) + 0.5 * (a == b)), g * ((b < a) + 0.5 * (a == b))
                    elif m.op == B.POWER:
                        da, db = g * b * a ** (b - 1), g * ys[0] * np.log(a)
                    acc(node.inputs[0], _unbroadcast(da, a.shape))
                    acc(node.inputs[1], _unbroadcast(db, b.shape))
            elif op == "unary":
                if node.unary.op != U.LOGICAL_NOT:
                    acc(node.inputs[0], _unary_grad(node.unary.op, xs[0], ys[0], g))
            elif op == "where":
                m = node.where
                c = xs[0]
                names = list(node.inputs[1:])
                if not m.HasField("x_scalar"):
                    acc(names[0], _unbroadcast(np.where(c, g, 0.0), self.env[names[0]].shape))
                    names = names[1:]
                if not m.HasField("y_scalar"):
                    acc(names[0], _unbroadcast(np.where(c, 0.0, g), self.env[names[0]].shape))
            elif op == "reduce":
                m = node.reduce
                x = xs[0]
                axes = tuple(m.axes) if m.axes else tuple(range(x.ndim))
                gk = g if m.keepdims else np.expand_dims(g, axes)
                if m.op == R.SUM:
                    dx = np.broadcast_to(gk, x.shape)
                elif m.op == R.MEAN:
                    dx = np.broadcast_to(gk, x.shape) / np.prod([x.shape[a] for a in axes])
                else:
                    yk = ys[0] if m.keepdims else np.expand_dims(ys[0], axes)
                    hit = (x == yk)
                    dx = gk * hit / hit.sum(axis=axes, keepdims=True)
                acc(node.inputs[0], np.array(dx))
            elif op == "einsum":
                da, db = _einsum_grads(node.einsum.equation, xs[0], xs[1], g)
                acc(node.inputs[0], da)
                acc(node.inputs[1], db)
            elif op == "slice":
                m = node.slice
                stride = list(m.stride) or [1] * len(m.start)
                dx = np.zeros_like(xs[0])
                dx[tuple(slice(s, e, st) for s, e, st in zip(m.start, m.limit, stride))] = g
                acc(node.inputs[0], dx)
            elif op == "softmax":
                a = node.softmax.axis
                y = ys[0]
                if node.softmax.log:
                    dx = g - np.exp(y) * g.sum(axis=a, keepdims=True)
                else:
                    dx = y * (g - (g * y).sum(axis=a, keepdims=True))
                acc(node.inputs[0], dx)
            elif op == "reshape":
                acc(node.inputs[0], g.reshape(xs[0].shape))
            elif op == "transpose":
                acc(node.inputs[0], np.transpose(g, np.argsort(node.transpose.axes)))
            elif op in ("cast", "dropout"):
                acc(node.inputs[0], g)
            elif op == "add":
                for i in node.inputs:
                    acc(i, g)
            elif op == "scale":
                acc(node.inputs[0], g * node.scale.factor)
            elif op == "split":
                parts = [o if o is not None else np.zeros_like(y) for o, y in zip(outs, ys)]
                acc(node.inputs[0], np.concatenate(parts, axis=node.split.axis))
            elif op == "concatenate":
                cuts = np.cumsum([x.shape[node.concatenate.axis] for x in xs])[:-1]
                for i, part in zip(node.inputs, np.split(g, cuts, axis=node.concatenate.axis)):
                    acc(i, part)
            elif op == "softmax_cross_entropy":
                logits, labels = xs
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                onehot = np.zeros_like(p)
                np.put_along_axis(onehot, labels[..., None].astype(np.int64), 1.0, -1)
                acc(node.inputs[0], g * (p - onehot) / labels.size)
            else:
                raise NotImplementedError(op)
        return pgrads, grads


def loss_and_grads(traced, variables, inputs):
    """(loss, {"params/...": dloss/dparam}, {input: dloss/dinput}, aux outputs) of a loss graph in float64."""
    ev = Evaluation(traced.spec, variables, inputs)
    outs = ev.outputs()
    pgrads, grads = ev.gradients({traced.spec.outputs[0]: np.asarray(1.0)})
    return float(outs[0]), pgrads, {k: grads.get(k) for k in inputs}, outs[1:]
