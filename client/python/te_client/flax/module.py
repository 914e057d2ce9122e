"""transformer_engine.jax.flax's modules, running on te_server.

    import te_client.flax as te_flax          # was: import transformer_engine.jax.flax as te_flax

Fields, defaults and __call__ signatures are TE's (the subset te.v1 carries;
an unknown field is a TypeError, as a dataclass reports it). `dtype` is the
parameter dtype; compute runs in the input's dtype unless FP8 is active.
Modules that TE has return (y, ln_out) do so here too. Masks follow TE: bool
[batch, 1, q_len, kv_len], True = masked out. FlaxTransformerLayer is the
quickstart's plain-Flax layer (its mask follows Flax: True = attend).

Called on arrays at the top level, a module is one server layer of its own;
called on traced tensors inside a composite's __call__, it records a module
node of the composite's graph (module.py), with output_shapes() giving the
shapes the rest of __call__ sees. Every module computes in, and returns, its
input's dtype.
"""
from typing import Optional, Sequence, Union

import numpy as np

from te_client import client as client_lib, dtypes, errors, symbolic
from te_client.module import ServerModule

layers_pb2 = client_lib.layers_pb2

_LAYERNORM_TYPES = {"layernorm": layers_pb2.LAYERNORM, "rmsnorm": layers_pb2.RMSNORM}
_MASK_TYPES = {"no_mask": layers_pb2.NO_MASK, "padding": layers_pb2.PADDING, "causal": layers_pb2.CAUSAL,
               "padding_causal": layers_pb2.PADDING_CAUSAL, "causal_padding": layers_pb2.PADDING_CAUSAL}
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
    return_layernorm_output: bool = True
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
    activations: Sequence[str] = ("relu",)
    intermediate_dropout_rate: float = 0.1
    use_bias: bool = False
    return_layernorm_output: bool = True
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


class DotProductAttention(ServerModule):
    """Inputs [batch, seq, heads, head_dim] (q, k, v), or the packed
    [batch, seq, 3, heads, head_dim] qkv as query with qkv_layout="bs3hd"."""
    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: Optional[float] = None
    transpose_batch_sequence: bool = False
    dtype: object = np.float32

    def spec(self):
        _no_transpose(self)
        msg = layers_pb2.DotProductAttention(
            head_dim=self.head_dim, num_attention_heads=self.num_attention_heads,
            attention_dropout=self.attention_dropout,
            attn_mask_type=_choice(_MASK_TYPES, self.attn_mask_type, "attn_mask_type"),
            qkv_layout=_choice(_QKV_LAYOUTS, self.qkv_layout, "qkv_layout"),
            dtype=_param_dtype(self.dtype, "DotProductAttention"))
        if self.num_gqa_groups is not None:
            msg.num_gqa_groups = self.num_gqa_groups
        if self.scale_factor is not None:
            msg.scale_factor = self.scale_factor
        return layers_pb2.LayerSpec(dot_product_attention=msg)

    def output_shapes(self, input_shapes):
        q = tuple(input_shapes[0])
        if _choice(_QKV_LAYOUTS, self.qkv_layout, "qkv_layout") == layers_pb2.BS3HD:
            if len(q) != 5:
                raise errors.InvalidArgumentError("DotProductAttention: a bs3hd qkv is [batch, seq, 3, heads, "
                                                  "head_dim], got %s" % list(q))
            return [q[:2] + q[3:]]
        return [q]

    def dropout_rates(self):
        return (self.attention_dropout,)

    def __call__(self, query, key=None, value=None, sequence_descriptor=None, bias=None, *,
                 deterministic=False, mask=None):
        if bias is not None:
            raise errors.UnimplementedError("DotProductAttention: an attention bias input is not in te.v1")
        packed = _choice(_QKV_LAYOUTS, self.qkv_layout, "qkv_layout") == layers_pb2.BS3HD
        if packed != (key is None and value is None):
            raise errors.InvalidArgumentError(
                "DotProductAttention: qkv_layout %r takes %s" % (self.qkv_layout, "the packed qkv as query only"
                                                                  if packed else "query, key and value"))
        mask = sequence_descriptor if sequence_descriptor is not None else mask
        return self._call(query, [] if packed else [key, value], mask, deterministic)


class MultiHeadAttention(ServerModule):
    """Self-attention with TE's fused QKV projection: returns (out, ln_out)."""
    returns_ln_out = True
    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    use_bias: bool = False
    attn_mask_type: str = "causal"
    enable_rotary_pos_emb: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    return_layernorm_output: bool = False
    transpose_batch_sequence: bool = False
    dtype: object = np.float32

    def spec(self):
        _no_transpose(self)
        msg = layers_pb2.MultiHeadAttention(
            head_dim=self.head_dim, num_attention_heads=self.num_attention_heads,
            attention_dropout=self.attention_dropout, input_layernorm=self.input_layernorm,
            layernorm_type=_choice(_LAYERNORM_TYPES, self.layernorm_type, "layernorm_type"),
            layernorm_epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            use_bias=self.use_bias, attn_mask_type=_choice(_MASK_TYPES, self.attn_mask_type, "attn_mask_type"),
            enable_rotary_pos_emb=self.enable_rotary_pos_emb, scale_attn_logits=self.scale_attn_logits,
            scaled_query_init=self.scaled_query_init, return_layernorm_output=self.return_layernorm_output,
            dtype=_param_dtype(self.dtype, "MultiHeadAttention"))
        if self.num_gqa_groups is not None:
            msg.num_gqa_groups = self.num_gqa_groups
        return layers_pb2.LayerSpec(multi_head_attention=msg)

    def output_shapes(self, input_shapes):
        x = tuple(input_shapes[0])
        return [x, x] if self.return_layernorm_output else [x]

    def dropout_rates(self):
        return (self.attention_dropout,)

    def __call__(self, inputs_q, inputs_kv=None, mask=None, bias=None, *, decode=False, deterministic=False):
        if inputs_kv is not None and inputs_kv is not inputs_q:
            raise errors.UnimplementedError("MultiHeadAttention: te_server runs self-attention only "
                                            "(inputs_kv must be None or inputs_q)")
        if bias is not None or decode:
            raise errors.UnimplementedError("MultiHeadAttention: bias and decode are not in te.v1")
        return self._call(inputs_q, [], mask, deterministic)


class TransformerLayer(ServerModule):
    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.1
    mlp_activations: Sequence[str] = ("relu",)
    use_bias: bool = False
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    enable_rotary_pos_emb: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    transpose_batch_sequence: bool = False
    dtype: object = np.float32

    def spec(self):
        _no_transpose(self)
        msg = layers_pb2.TransformerLayer(
            hidden_size=self.hidden_size, mlp_hidden_size=self.mlp_hidden_size,
            num_attention_heads=self.num_attention_heads,
            layernorm_type=_choice(_LAYERNORM_TYPES, self.layernorm_type, "layernorm_type"),
            layernorm_epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            hidden_dropout=self.hidden_dropout, attention_dropout=self.attention_dropout,
            intermediate_dropout=self.intermediate_dropout, mlp_activations=list(self.mlp_activations),
            use_bias=self.use_bias,
            self_attn_mask_type=_choice(_MASK_TYPES, self.self_attn_mask_type, "self_attn_mask_type"),
            self_attn_bias_type=_choice(_BIAS_TYPES, self.self_attn_bias_type, "self_attn_bias_type"),
            enable_relative_embedding=self.enable_relative_embedding,
            enable_rotary_pos_emb=self.enable_rotary_pos_emb, scale_attn_logits=self.scale_attn_logits,
            scaled_query_init=self.scaled_query_init, dtype=_param_dtype(self.dtype, "TransformerLayer"))
        if self.num_gqa_groups is not None:
            msg.num_gqa_groups = self.num_gqa_groups
        return layers_pb2.LayerSpec(transformer_layer=msg)

    def dropout_rates(self):
        return (self.hidden_dropout, self.attention_dropout, self.intermediate_dropout)

    def __call__(self, inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
                 deterministic=False, decode=False, max_decode_length=None):
        if encoded is not None or encoder_decoder_mask is not None or decode:
            raise errors.UnimplementedError("TransformerLayer: te_server runs the encoder layer type only "
                                            "(no encoded input, no decode)")
        return self._call(inputs, [], attention_mask, deterministic)


class FlaxTransformerLayer(ServerModule):
    """The quickstart's plain-Flax layer (flax.linen LayerNorm, Dense, dot-product
    attention with a causal mask, Dropout, a gelu MLP), on the server."""
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    layernorm_eps: float = 1e-5
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    dtype: object = np.float32

    def spec(self):
        return layers_pb2.LayerSpec(flax_transformer_layer=layers_pb2.FlaxTransformerLayer(
            hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads, layernorm_eps=self.layernorm_eps,
            attention_dropout=self.attention_dropout, hidden_dropout=self.hidden_dropout,
            dtype=_param_dtype(self.dtype, "FlaxTransformerLayer")))

    def dropout_rates(self):
        return (self.attention_dropout, self.hidden_dropout)

    def __call__(self, x, attention_mask=None, deterministic=False):
        """attention_mask: Flax's (True = attend). None or a causal mask: the
        layer's own causal mask; else it is sent (inverted) as a padding mask."""
        mask = None
        if isinstance(attention_mask, (symbolic.Symbol, symbolic.Indexed)):
            raise NotImplementedError("FlaxTransformerLayer inside a composite: a traced attention_mask "
                                      "cannot be inverted to a padding mask; leave it None (the layer's "
                                      "own causal mask)")
        if attention_mask is not None:
            attend = np.asarray(attention_mask, dtype=bool)
            if not np.array_equal(attend, np.broadcast_to(_causal(attend.shape[-1]), attend.shape)):
                mask = ~attend
        return self._call(x, [], mask, deterministic)


def _causal(seq):
    return np.tril(np.ones((seq, seq), dtype=bool))
