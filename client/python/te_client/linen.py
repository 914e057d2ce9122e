"""The parts of flax.linen the quickstart's composed layers use, for te_client.

    from te_client import linen as nn          # was: from flax import linen as nn

Module and compact are te_client's (module.py). Dropout runs on the client
(inverted dropout, seeded from apply's rngs={'dropout': key} and the module's
path). MultiHeadDotProductAttention is Flax's module built from server layers:
DenseGeneral "query", "key", "value" and "out" (Flax's parameter names and
shapes) around a DotProductAttention; its mask must be None, causal, or a
padding mask.
"""
from typing import Optional

import numpy as np

from te_client import dtypes, errors, tracing
from te_client import flax as te_flax
from te_client.module import Module, compact, current_frame

__all__ = ["Module", "compact", "Dropout", "make_causal_mask", "MultiHeadDotProductAttention"]


def make_causal_mask(x, extra_batch_dims=0, dtype=np.float32):
    """flax.linen.make_causal_mask: [batch..., 1, len, len], 1 where key <= query (attend)."""
    shape = tuple(x.shape)
    mask = np.tril(np.ones((shape[-1], shape[-1]), dtype=bool))
    mask = np.broadcast_to(mask, shape[:-1] + (1,) + mask.shape)
    mask = mask.reshape((1,) * extra_batch_dims + mask.shape)
    return mask.astype(dtype)


def _in_dtype_of(values32, like):
    """float32 results in the dtype of `like` (rounded to bf16 where it is bf16)."""
    return dtypes.asarray(values32, dtypes.bfloat16) if _is_bf16_value(like) else values32.astype(like.dtype)


def _is_bf16_value(a):
    return isinstance(a, dtypes.Bfloat16Array) or dtypes.wire_dtype(a) == dtypes.BFLOAT16


class Dropout(Module):
    rate: float = 0.0
    broadcast_dims: tuple = ()
    deterministic: Optional[bool] = None

    @compact
    def __call__(self, inputs, deterministic=None, rng=None):
        deterministic = self.deterministic if deterministic is None else deterministic
        frame = current_frame(self)
        if deterministic or self.rate == 0.0 or frame.mode == "init":
            return inputs
        value = dtypes.as_numpy(tracing.value_of(inputs))
        keep_prob = 1.0 - self.rate
        if keep_prob == 0.0:
            return inputs * 0.0
        seed = frame.dropout_seed_for(frame.scopes[-1].path) if rng is None else rng
        mask_shape = tuple(1 if i in [d % value.ndim for d in self.broadcast_dims] else n
                           for i, n in enumerate(value.shape))
        keep = np.random.default_rng(seed).random(mask_shape) < keep_prob
        scale = lambda a: _in_dtype_of(np.where(keep, np.asarray(a, np.float32) / keep_prob, 0.0).astype(np.float32), a)
        out = scale(value)
        if not isinstance(inputs, tracing.Tracer):
            return out
        return inputs.tape.record([inputs], [out], lambda g: [scale(g[0]) if g[0] is not None else None])[0]


class MultiHeadDotProductAttention(Module):
    num_heads: int = 1
    qkv_features: Optional[int] = None
    out_features: Optional[int] = None
    dropout_rate: float = 0.0
    deterministic: Optional[bool] = None
    use_bias: bool = True
    dtype: object = np.float32

    @compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                 deterministic=None, dropout_rng=None):
        if inputs_kv is not None:
            inputs_k = inputs_v = inputs_kv
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        features = self.qkv_features or inputs_q.shape[-1]
        if features % self.num_heads:
            raise errors.InvalidArgumentError("MultiHeadDotProductAttention: qkv_features (%d) must be a "
                                              "multiple of num_heads (%d)" % (features, self.num_heads))
        head_dim = features // self.num_heads
        dense = lambda name: te_flax.DenseGeneral(features=(self.num_heads, head_dim), axis=-1,
                                                  use_bias=self.use_bias, dtype=self.dtype, name=name)
        query, key, value = dense("query")(inputs_q), dense("key")(inputs_k), dense("value")(inputs_v)
        mask_type, te_mask = _te_mask(mask)
        deterministic = self.deterministic if deterministic is None else deterministic
        x = te_flax.DotProductAttention(head_dim=head_dim, num_attention_heads=self.num_heads,
                                        attention_dropout=self.dropout_rate, attn_mask_type=mask_type,
                                        dtype=self.dtype, name="attention")(
            query, key, value, te_mask, deterministic=bool(deterministic))
        return te_flax.DenseGeneral(features=self.out_features or inputs_q.shape[-1], axis=(-2, -1),
                                    use_bias=self.use_bias, dtype=self.dtype, name="out")(x)


def _te_mask(mask):
    """Flax's mask (True = attend) -> (TE mask type, TE mask (True = masked out) or None)."""
    if mask is None:
        return "no_mask", None
    attend = np.asarray(mask, dtype=bool)
    causal = np.tril(np.ones(attend.shape[-2:], dtype=bool))
    if np.array_equal(attend, np.broadcast_to(causal, attend.shape)):
        return "causal", None
    return "padding", ~attend
