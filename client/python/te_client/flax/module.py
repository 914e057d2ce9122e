"""transformer_engine.jax.flax.module's modules, running on te_server:
LayerNorm, DenseGeneral, LayerNormDenseGeneral, LayerNormMLP (and the
helpers that turn TE's fields into te.v1 LayerSpecs, shared with
transformer.py).

    from te_client.flax.module import DenseGeneral   # was: from transformer_engine.jax.flax.module import ...

Fields, defaults and __call__ signatures are TE's (the subset te.v1 carries;
an unknown field is a TypeError, as a dataclass reports it). `dtype` is the
parameter dtype; compute runs in the input's dtype unless FP8 is active.
Modules that TE has return (y, ln_out) do so here too.

Called on arrays at the top level, a module is one server layer of its own;
called on traced tensors inside a composite's __call__, it records a module
node of the composite's graph (te_client/module.py), with output_shapes()
giving the shapes the rest of __call__ sees. Every module computes in, and
returns, its input's dtype.
"""
from typing import Sequence, Union

import numpy as np

from te_client import dtypes, errors
from te_client.module import ServerModule
from te_client._pb import layers_pb2

# TE's base class of its modules; here the base of every module that runs as a server layer.
TransformerEngineBase = ServerModule


_LAYERNORM_TYPES = {"layernorm": layers_pb2.LAYERNORM, "rmsnorm": layers_pb2.RMSNORM}
# TE's canonicalize_attn_mask_type (transformer_engine/jax/attention.py), aliases included.
_MASK_TYPES = {"no_mask": layers_pb2.NO_MASK, "padding": layers_pb2.PADDING, "causal": layers_pb2.CAUSAL,
               "padding_causal": layers_pb2.PADDING_CAUSAL, "causal_padding": layers_pb2.PADDING_CAUSAL,
               "causal_bottom_right": layers_pb2.CAUSAL_BOTTOM_RIGHT,
               "bottom_right_causal": layers_pb2.CAUSAL_BOTTOM_RIGHT,
               "padding_causal_bottom_right": layers_pb2.PADDING_CAUSAL_BOTTOM_RIGHT,
               "causal_padding_bottom_right": layers_pb2.PADDING_CAUSAL_BOTTOM_RIGHT,
               "bottom_right_causal_padding": layers_pb2.PADDING_CAUSAL_BOTTOM_RIGHT,
               "bottom_right_padding_causal": layers_pb2.PADDING_CAUSAL_BOTTOM_RIGHT}
_QKV_LAYOUTS = {"bshd_bshd_bshd": layers_pb2.BSHD_BSHD_BSHD, "bs3hd": layers_pb2.BS3HD}
_BIAS_TYPES = {None: layers_pb2.ATTN_BIAS_TYPE_UNSPECIFIED, "no_bias": layers_pb2.NO_BIAS,
               "post_scale_bias": layers_pb2.POST_SCALE_BIAS}


def _choice(table, value, field):
    key = value.lower() if isinstance(value, str) else value
    if key not in table:
        raise errors.InvalidArgumentError("%s: %r; want one of %s" % (
            field, value, ", ".join(repr(k) for k in table if k is not None)))
    return table[key]


def _param_dtype(dtype, field):
    if dtype is None:
        return layers_pb2.PARAM_DTYPE_UNSPECIFIED
    if dtypes._is_bf16(dtype):
        return layers_pb2.PARAM_BFLOAT16
    try:
        if np.dtype(dtype) == np.float32:
            return layers_pb2.PARAM_FLOAT32
    except TypeError:
        pass
    raise errors.InvalidArgumentError("%s.dtype: %r; want float32 or bfloat16" % (field, dtype))


def _ints(value):
    return [int(v) for v in value] if isinstance(value, (tuple, list)) else [int(value)]


def _dense_output_shape(shape, axis, features, name):
    axes = [a % len(shape) if -len(shape) <= a < len(shape) else None for a in _ints(axis)]
    if None in axes or len(set(axes)) != len(axes):
        raise errors.InvalidArgumentError("%s.axis: %s for an input of rank %d" % (name, _ints(axis), len(shape)))
    return tuple(d for i, d in enumerate(shape) if i not in axes) + tuple(_ints(features))


def _no_transpose(module):
    if getattr(module, "transpose_batch_sequence", False):
        raise errors.InvalidArgumentError("%s.transpose_batch_sequence: te_server takes [batch, seq, ...] "
                                          "inputs only" % type(module).__name__)


class LayerNorm(ServerModule):
    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    dtype: object = np.float32

    def spec(self):
        return layers_pb2.LayerSpec(layer_norm=layers_pb2.LayerNorm(
            epsilon=self.epsilon, layernorm_type=_choice(_LAYERNORM_TYPES, self.layernorm_type, "layernorm_type"),
            zero_centered_gamma=self.zero_centered_gamma, dtype=_param_dtype(self.dtype, "LayerNorm")))

    def __call__(self, x):
        return self._call(x)


class DenseGeneral(ServerModule):
    features: Union[int, Sequence[int]]
    use_bias: bool = True
    axis: Union[int, Sequence[int]] = -1
    dtype: object = np.float32

    def spec(self):
        return layers_pb2.LayerSpec(dense_general=layers_pb2.DenseGeneral(
            features=_ints(self.features), use_bias=self.use_bias, axis=_ints(self.axis),
            dtype=_param_dtype(self.dtype, "DenseGeneral")))

    def output_shapes(self, input_shapes):
        return [_dense_output_shape(input_shapes[0], self.axis, self.features, "DenseGeneral")]

    def __call__(self, inputs):
        return self._call(inputs)


class LayerNormDenseGeneral(ServerModule):
    returns_ln_out = True
    features: Union[int, Sequence[int]]
    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    use_bias: bool = False
    return_layernorm_output: bool = False
    enable_layernorm: bool = True
    dtype: object = np.float32

    def spec(self):
        return layers_pb2.LayerSpec(layer_norm_dense_general=layers_pb2.LayerNormDenseGeneral(
            features=_ints(self.features), epsilon=self.epsilon,
            layernorm_type=_choice(_LAYERNORM_TYPES, self.layernorm_type, "layernorm_type"),
            zero_centered_gamma=self.zero_centered_gamma, use_bias=self.use_bias,
            return_layernorm_output=self.return_layernorm_output, enable_layernorm=self.enable_layernorm,
            dtype=_param_dtype(self.dtype, "LayerNormDenseGeneral")))

    def output_shapes(self, input_shapes):
        x = tuple(input_shapes[0])
        return [_dense_output_shape(x, -1, self.features, "LayerNormDenseGeneral")] + (
            [x] if self.return_layernorm_output else [])

    def __call__(self, inputs):
        """(z, ln_output); ln_output is None unless return_layernorm_output."""
        return self._call(inputs)


class LayerNormMLP(ServerModule):
    returns_ln_out = True
    intermediate_dim: int = 2048
    activations: Sequence[str] = ("gelu",)
    intermediate_dropout_rate: float = 0.0
    use_bias: bool = False
    return_layernorm_output: bool = False
    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    enable_layernorm: bool = True
    dtype: object = np.float32

    def spec(self):
        return layers_pb2.LayerSpec(layer_norm_mlp=layers_pb2.LayerNormMLP(
            intermediate_dim=self.intermediate_dim, activations=list(self.activations),
            intermediate_dropout_rate=self.intermediate_dropout_rate, use_bias=self.use_bias,
            return_layernorm_output=self.return_layernorm_output, epsilon=self.epsilon,
            layernorm_type=_choice(_LAYERNORM_TYPES, self.layernorm_type, "layernorm_type"),
            zero_centered_gamma=self.zero_centered_gamma, enable_layernorm=self.enable_layernorm,
            dtype=_param_dtype(self.dtype, "LayerNormMLP")))

    def output_shapes(self, input_shapes):
        x = tuple(input_shapes[0])
        return [x, x] if self.return_layernorm_output else [x]

    def dropout_rates(self):
        return (self.intermediate_dropout_rate,)

    def __call__(self, inputs, deterministic=False):
        """(z, ln_output); ln_output is None unless return_layernorm_output."""
        return self._call(inputs, deterministic=deterministic)


def _not_in_te_v1(name, why):
    """A class of TE's that te.v1 has no server layer for: importable under
    TE's name, so a notebook's imports still work, and NotImplementedError
    naming it when one is made."""
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("%s: %s" % (name, why))
    return type(name, (), {"__init__": __init__, "__doc__": "Not available: " + why,
                           "__module__": __name__})


Softmax = _not_in_te_v1("Softmax", "te.v1 has no softmax layer (DotProductAttention's softmax runs inside "
                                   "it on the server)")
