"""flax.linen.initializers (jax.nn.initializers) as te.v1 Initializers.

    from te_client import linen as nn
    scale = self.param("scale", nn.initializers.ones, (features,))
    nn.Dense(8, kernel_init=nn.initializers.normal(0.02))

Inside a traced module an initializer names what the server draws a
variable from (te.v1.Initializer: the distribution, seeded per variable with
DeriveSeed(the layer's seed, the node's name), so values follow the
initializer's distribution, not JAX's bits). Called as JAX calls one,
init(key, shape, dtype), it draws the same distribution with numpy (key: an
int or a PRNGKey's words), for code that builds arrays itself.
"""
import dataclasses
import math
from typing import Optional

import numpy as np

from te_client._pb import layers_pb2

Kind = layers_pb2.Initializer


@dataclasses.dataclass(frozen=True)
class Initializer:
    """One of jax.nn.initializers' functions, as data."""
    kind: int
    value: float = 0.0
    stddev: Optional[float] = None
    scale: Optional[float] = None
    mode: str = ""
    distribution: str = ""
    in_axis: int = -2
    out_axis: int = -1

    def proto(self):
        msg = layers_pb2.Initializer(kind=self.kind, value=float(self.value), mode=self.mode,
                                     distribution=self.distribution, in_axis=int(self.in_axis),
                                     out_axis=int(self.out_axis))
        if self.stddev is not None:
            msg.stddev = float(self.stddev)
        if self.scale is not None:
            msg.scale = float(self.scale)
        return msg

    def __call__(self, key, shape, dtype=np.float32):
        rng = np.random.default_rng(np.asarray(key, np.uint64).ravel().tolist() if np.ndim(key) else int(key))
        shape = tuple(int(d) for d in shape)
        k = self.kind
        if k == Kind.ZEROS:
            out = np.zeros(shape)
        elif k == Kind.ONES:
            out = np.ones(shape)
        elif k == Kind.CONSTANT:
            out = np.full(shape, self.value)
        elif k == Kind.NORMAL:
            out = rng.standard_normal(shape) * (1e-2 if self.stddev is None else self.stddev)
        elif k == Kind.UNIFORM:
            out = rng.uniform(0.0, 1e-2 if self.scale is None else self.scale, shape)
        elif k == Kind.TRUNCATED_NORMAL:
            out = _truncated(rng, shape) * (1e-2 if self.stddev is None else self.stddev)
        else:
            scale, mode, distribution = self._variance_scaling()
            fan_in, fan_out = _fans(shape, self.in_axis, self.out_axis)
            denominator = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
            variance = scale / max(denominator, 1)
            if distribution == "truncated_normal":
                out = _truncated(rng, shape) * math.sqrt(variance) / 0.87962566103423978
            elif distribution == "normal":
                out = rng.standard_normal(shape) * math.sqrt(variance)
            else:
                limit = math.sqrt(3 * variance)
                out = rng.uniform(-limit, limit, shape)
        return out.astype(dtype)

    def _variance_scaling(self):
        named = {Kind.KIND_UNSPECIFIED: (1.0, "fan_in", "truncated_normal"),
                 Kind.LECUN_NORMAL: (1.0, "fan_in", "truncated_normal"), Kind.LECUN_UNIFORM: (1.0, "fan_in", "uniform"),
                 Kind.GLOROT_NORMAL: (1.0, "fan_avg", "truncated_normal"),
                 Kind.GLOROT_UNIFORM: (1.0, "fan_avg", "uniform"),
                 Kind.HE_NORMAL: (2.0, "fan_in", "truncated_normal"), Kind.HE_UNIFORM: (2.0, "fan_in", "uniform")}
        if self.kind in named:
            return named[self.kind]
        return (1.0 if self.scale is None else self.scale), self.mode, self.distribution


def _truncated(rng, shape):
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2
    return out


def _fans(shape, in_axis, out_axis):
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = int(np.prod([d for i, d in enumerate(shape) if i not in (in_axis % len(shape), out_axis % len(shape))]))
    return shape[in_axis] * receptive, shape[out_axis] * receptive


def as_initializer(fn, field):
    """`fn` as an Initializer; a JAX function or any other callable is refused naming what is accepted."""
    if isinstance(fn, Initializer):
        return fn
    raise TypeError("%s: %r is not one of te_client.linen.initializers' (zeros, ones, constant, normal, uniform, "
                    "truncated_normal, lecun_normal, lecun_uniform, glorot_normal, glorot_uniform, xavier_normal, "
                    "xavier_uniform, he_normal, he_uniform, kaiming_normal, kaiming_uniform, variance_scaling): the "
                    "server draws the values, so it needs the initializer as data" % (field, fn))


zeros = Initializer(Kind.ZEROS)
ones = Initializer(Kind.ONES)


def zeros_init():
    return zeros


def ones_init():
    return ones


def constant(value, dtype=None):
    return Initializer(Kind.CONSTANT, value=float(value))


def normal(stddev=1e-2, dtype=None):
    return Initializer(Kind.NORMAL, stddev=float(stddev))


def uniform(scale=1e-2, dtype=None):
    return Initializer(Kind.UNIFORM, scale=float(scale))


def truncated_normal(stddev=1e-2, dtype=None, lower=-2.0, upper=2.0):
    if (lower, upper) != (-2.0, 2.0):
        raise NotImplementedError("truncated_normal(lower=%r, upper=%r): te.v1 truncates at +-2 stddev" % (lower, upper))
    return Initializer(Kind.TRUNCATED_NORMAL, stddev=float(stddev))


def _named(kind):
    def make(in_axis=-2, out_axis=-1, batch_axis=(), dtype=None):
        if batch_axis:
            raise NotImplementedError("batch_axis: te.v1's initializers take in_axis and out_axis")
        return Initializer(kind, in_axis=in_axis, out_axis=out_axis)
    return make


lecun_normal = _named(Kind.LECUN_NORMAL)
lecun_uniform = _named(Kind.LECUN_UNIFORM)
glorot_normal = xavier_normal = _named(Kind.GLOROT_NORMAL)
glorot_uniform = xavier_uniform = _named(Kind.GLOROT_UNIFORM)
he_normal = kaiming_normal = _named(Kind.HE_NORMAL)
he_uniform = kaiming_uniform = _named(Kind.HE_UNIFORM)


def variance_scaling(scale, mode, distribution, in_axis=-2, out_axis=-1, batch_axis=(), dtype=None):
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError("variance_scaling: mode %r; want fan_in, fan_out or fan_avg" % mode)
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError("variance_scaling: distribution %r; want truncated_normal, normal or uniform" % distribution)
    return Initializer(Kind.VARIANCE_SCALING, scale=float(scale), mode=mode, distribution=distribution,
                       in_axis=in_axis, out_axis=out_axis)


__all__ = ["Initializer", "zeros", "ones", "zeros_init", "ones_init", "constant", "normal", "uniform",
           "truncated_normal", "lecun_normal", "lecun_uniform", "glorot_normal", "glorot_uniform", "xavier_normal",
           "xavier_uniform", "he_normal", "he_uniform", "kaiming_normal", "kaiming_uniform", "variance_scaling"]
