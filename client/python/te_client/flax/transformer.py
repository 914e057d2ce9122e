"""transformer_engine.jax.flax.transformer's modules, running on te_server:
DotProductAttention, MultiHeadAttention and TransformerLayer (with
TransformerLayerType). (The quickstart's plain-Flax layer is no TE module:
write it as the notebook does, with te_client.linen's Flax modules.)

    from te_client.flax.transformer import DotProductAttention   # was: transformer_engine.jax.flax.transformer

As in module.py, fields, defaults and __call__ signatures are TE's. Masks
follow TE: bool [batch, 1, q_len, kv_len], True = masked out.
"""
import enum
from typing import Optional, Sequence

import numpy as np

from te_client import errors, symbolic
from te_client.flax.module import (_BIAS_TYPES, _LAYERNORM_TYPES, _MASK_TYPES, _QKV_LAYOUTS, _choice,
                                   _no_transpose, _not_in_te_v1, _param_dtype, layers_pb2)
from te_client.module import ServerModule


class TransformerLayerType(str, enum.Enum):
    """TE's layer types: ENCODER (self-attention, then the MLP) and DECODER
    (self-attention, cross-attention over `encoded`, then the MLP)."""
    ENCODER = "encoder"
    DECODER = "decoder"


def extend_logical_axis_rules(rules):
    """TE adds its logical axes to Flax's sharding rules; te_server runs
    unsharded layers, so there is nothing to add: `rules` as a tuple."""
    return tuple(rules)


RelativePositionBiases = _not_in_te_v1(
    "RelativePositionBiases", "te.v1 has no layer of its own for it; TransformerLayer's enable_relative_embedding="
                              "True (the default) runs TE's T5-style buckets inside the layer")


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
        if bias is not None:
            raise errors.UnimplementedError("MultiHeadAttention: an attention bias input is not in te.v1")
        # decode: init creates the cache (cached_key, cached_value, cache_index) for
        # the full-length input; apply(..., mutable=["cache"]) runs one token.
        return self._call(inputs_q, [], mask, deterministic, decode)


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
    intermediate_dropout: float = 0.0
    mlp_activations: Sequence[str] = ("gelu",)
    use_bias: bool = False
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    enable_rotary_pos_emb: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    transpose_batch_sequence: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
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
        if self._decoder():   # an encoder leaves it unset, as the C++ client does (stable goldens)
            msg.layer_type = layers_pb2.DECODER
        return layers_pb2.LayerSpec(transformer_layer=msg)

    def _decoder(self):
        try:
            return TransformerLayerType(self.layer_type) == TransformerLayerType.DECODER
        except ValueError:
            raise errors.InvalidArgumentError("TransformerLayer.layer_type: %r; want TransformerLayerType.ENCODER "
                                              "or DECODER" % (self.layer_type,)) from None

    def dropout_rates(self):
        return (self.hidden_dropout, self.attention_dropout, self.intermediate_dropout)

    def __call__(self, inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
                 deterministic=False, decode=False, max_decode_length=None):
        # decode: a DECODER's self-attention cache (the server refuses an
        # ENCODER with TE's assertion, naming decode). max_decode_length is not
        # sent: the cache's length, which a decode step's relative bias spans,
        # is that of init's x.
        if not self._decoder():
            if encoded is not None or encoder_decoder_mask is not None:
                raise errors.InvalidArgumentError("TransformerLayer: encoded and encoder_decoder_mask are a DECODER's "
                                                  "(layer_type=TransformerLayerType.DECODER)")
            return self._call(inputs, [], attention_mask, deterministic, decode)
        if encoded is None:
            raise errors.InvalidArgumentError("TransformerLayer (DECODER): encoded is required, as TE asserts")
        # On the wire `encoded` is extra_inputs[0] and the request's mask is
        # the cross-attention's; the decoder's self-attention is causal (or
        # no_mask) and reads no mask, as TE's causal types ignore theirs.
        return self._call(inputs, [encoded], encoder_decoder_mask, deterministic, decode)
