"""Attention masks as TE's Flax modules take them, through a real te_server (CPU, float32).

Each case's expectation is TE's (transformer_engine/jax/flax/transformer.py and
attention.py, current release):
  * no_mask and causal ignore the mask ("mask is ignored for no_mask and
    causal_mask", _UnfusedDotProductAttention.convert_to_softmax_type);
  * padding applies the mask as given, elementwise (SCALED_MASKED), whatever
    its pattern;
  * padding_causal is "a combination of both causal and padding masks": the
    mask and causality together (TE's tests pass it the causal triangle,
    tests/jax/test_layer.py EncoderRunner.generate_inputs; TE's fused path
    applies causality from the mask type);
  * True / nonzero means masked out, in bool or uint8 (TE's tests' dtype) or int;
  * the mask is combined with the logits [B, H, Sq, Skv] by broadcasting
    (module.py Softmax), so it may be per head ([B, H, Sq, Skv]) and any dim
    may be 1; no_mask and causal drop it before looking at it, whatever its shape;
  * causal_bottom_right / padding_causal_bottom_right (AttnMaskType
    CAUSAL_BOTTOM_RIGHT_MASK, PADDING_CAUSAL_BOTTOM_RIGHT_MASK): key j is
    visible to query i iff j <= i + (Skv - Sq), per batch row with the actual
    lengths for the padding variant.
"""
import numpy as np
import pytest

import helpers
import te_client.flax as te_flax
from te_client import errors
from tolerances import F32, rel_err

B, S, HEADS, D = 2, 8, 4, 8


def _qkv(rng):
    return tuple(rng.standard_normal((B, S, HEADS, D)).astype(np.float32) for _ in range(3))


def _dpa(mask_type):
    return te_flax.DotProductAttention(head_dim=D, num_attention_heads=HEADS, attn_mask_type=mask_type)


def _apply(layer, q, k, v, mask=None):
    return layer.apply(layer.init(0, q, k, v), q, k, v, sequence_descriptor=mask, deterministic=True)


def _triu_uint8():
    # TE's tests: jnp.triu(jnp.ones((batch, 1, seqlen, seqlen), dtype=jnp.uint8), k=1).
    return np.triu(np.ones((B, 1, S, S), np.uint8), k=1)


def _arbitrary(rng):
    mask = rng.random((B, 1, S, S)) < 0.4
    mask[0, 0, 3, :] = True   # a query that sees nothing
    mask[:, 0, :, 0] = False  # every other query sees key 0
    mask[0, 0, 3, 0] = True
    return mask


def _valid_rows(y, want, mask):
    """Rows with at least one visible key (TE leaves a fully masked row's output to the backend)."""
    seen = ~np.all(mask[:, 0], axis=-1)   # [B, S]
    return rel_err(y[seen], want[seen])


def test_causal_triu_uint8_mask_to_a_causal_layer_is_ignored(session, rng):
    # The server once refused this mask ("not a padding mask"); TE ignores it for causal.
    q, k, v = _qkv(rng)
    layer = _dpa("causal")
    y = _apply(layer, q, k, v, _triu_uint8())
    assert rel_err(y, _apply(layer, q, k, v)) < F32
    assert rel_err(y, helpers.attention(q, k, v, helpers.causal_mask(B, S))) < F32


def test_any_mask_to_a_no_mask_layer_is_ignored(session, rng):
    q, k, v = _qkv(rng)
    layer = _dpa("no_mask")
    y = _apply(layer, q, k, v, _arbitrary(rng))
    assert rel_err(y, helpers.attention(q, k, v)) < F32


def test_padding_mask_to_padding_causal_adds_causality(session, rng):
    q, k, v = _qkv(rng)
    pad = np.zeros((B, 1, S, S), bool)
    pad[1, :, 5:, :] = True
    pad[1, :, :, 5:] = True
    want = helpers.attention(q, k, v, pad | helpers.causal_mask(B, S))
    layer = _dpa("padding_causal")
    assert _valid_rows(_apply(layer, q, k, v, pad), want, pad) < F32
    # The same padding with the causal triangle in it, as uint8 (TE's tests' form): the same result.
    combined = (pad | helpers.causal_mask(B, S)).astype(np.uint8)
    assert _valid_rows(_apply(layer, q, k, v, combined), want, pad) < F32


def test_arbitrary_mask_to_a_padding_layer_applies_elementwise(session, rng):
    q, k, v = _qkv(rng)
    mask = _arbitrary(rng)
    y = _apply(_dpa("padding"), q, k, v, mask)
    want = helpers.attention(q, k, v, mask)
    assert _valid_rows(y, want, mask) < F32
    assert np.all(y[0, 3] == 0)   # the row that sees nothing is zero (cuDNN's convention)


def test_arbitrary_mask_to_padding_causal_combines_with_causality(session, rng):
    q, k, v = _qkv(rng)
    mask = _arbitrary(rng)
    y = _apply(_dpa("padding_causal"), q, k, v, mask)
    effective = mask | helpers.causal_mask(B, S)
    assert _valid_rows(y, helpers.attention(q, k, v, effective), effective) < F32


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int32, np.int64, np.float32])
def test_mask_dtypes_mean_nonzero_is_masked(session, rng, dtype):
    q, k, v = _qkv(rng)
    mask = _arbitrary(rng)
    layer = _dpa("padding")
    assert rel_err(_apply(layer, q, k, v, mask.astype(dtype)), _apply(layer, q, k, v, mask)) == 0.0


def test_transformer_layer_takes_the_masks_te_tests_pass(session, rng):
    # TE's EncoderRunner: a causal layer gets triu(ones, k=1) uint8, a padding layer zeros (uint8).
    x = rng.standard_normal((B, S, 32)).astype(np.float32)
    for mask_type, mask in (("causal", _triu_uint8()), ("padding_causal", _triu_uint8()),
                            ("padding", np.zeros((B, 1, S, S), np.uint8))):
        layer = te_flax.TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4,
                                         self_attn_mask_type=mask_type, hidden_dropout=0.0,
                                         attention_dropout=0.0, intermediate_dropout=0.0)
        params = layer.init(0, x, attention_mask=mask)
        y = layer.apply(params, x, attention_mask=mask, deterministic=True)
        assert np.all(np.isfinite(y)) and y.shape == x.shape


def _cross_qkv(rng, sq, skv, heads=HEADS, groups=HEADS):
    q = rng.standard_normal((B, sq, heads, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, skv, groups, D)).astype(np.float32) for _ in range(2))
    return q, k, v


def _bottom_right(sq, skv, q_len=None, kv_len=None):
    """True = masked: key j after query i's bottom-right aligned diagonal j <= i + (kv_len - q_len)."""
    q_len = np.full(B, sq) if q_len is None else np.asarray(q_len)
    kv_len = np.full(B, skv) if kv_len is None else np.asarray(kv_len)
    i = np.arange(sq)[None, :, None]
    j = np.arange(skv)[None, None, :]
    offset = (kv_len - q_len)[:, None, None]
    visible = (i < q_len[:, None, None]) & (j < kv_len[:, None, None]) & (j <= i + offset)
    return ~visible[:, None]


def test_per_head_mask_masks_each_head_by_its_plane(session, rng):
    q, k, v = _cross_qkv(rng, S, S, heads=HEADS, groups=2)
    mask = rng.random((B, HEADS, S, S)) < 0.4
    mask[:, :, :, 0] = False   # every query sees a key
    layer = te_flax.DotProductAttention(head_dim=D, num_attention_heads=HEADS, num_gqa_groups=2,
                                        attn_mask_type="padding")
    y = _apply(layer, q, k, v, mask)
    assert rel_err(y, helpers.attention(q, k, v, mask)) < F32
    # [1, H, S, S] broadcasts over the batch; a key mask [B, 1, 1, S] over heads and queries.
    assert rel_err(_apply(layer, q, k, v, mask[:1]), helpers.attention(q, k, v, mask[:1])) < F32
    keys = rng.random((B, 1, 1, S)) < 0.3
    keys[..., 0] = False
    assert rel_err(_apply(layer, q, k, v, keys), helpers.attention(q, k, v, keys)) < F32


def test_per_head_mask_of_other_heads_is_invalid_argument(session, rng):
    q, k, v = _qkv(rng)
    with pytest.raises(errors.InvalidArgumentError, match="attention_mask"):
        _apply(_dpa("padding"), q, k, v, np.zeros((B, HEADS - 1, S, S), bool))


@pytest.mark.parametrize("shape,dtype", [((S, S), np.bool_), ((B, 1, S // 2, S), np.float32),
                                         ((3, 1, S, S), np.int32), ((1, 1, 1, S, S), np.uint8)])
def test_no_mask_and_causal_ignore_a_mask_of_any_shape(session, rng, shape, dtype):
    q, k, v = _qkv(rng)
    mask = np.ones(shape, dtype)
    for mask_type in ("no_mask", "causal"):
        layer = _dpa(mask_type)
        assert rel_err(_apply(layer, q, k, v, mask), _apply(layer, q, k, v)) == 0.0
    # A type that reads the mask refuses what TE could not broadcast, naming the field.
    for mask_type in ("padding", "padding_causal", "causal_bottom_right"):
        with pytest.raises(errors.InvalidArgumentError, match="attention_mask"):
            _apply(_dpa(mask_type), q, k, v, mask)


@pytest.mark.parametrize("sq,skv", [(4, 9), (9, 4)])
def test_causal_bottom_right_in_cross_attention(session, rng, sq, skv):
    q, k, v = _cross_qkv(rng, sq, skv)
    y = _apply(_dpa("causal_bottom_right"), q, k, v)
    masked = _bottom_right(sq, skv)
    seen = ~np.all(masked[:, 0], axis=-1)
    assert rel_err(y[seen], helpers.attention(q, k, v, masked)[seen]) < F32
    assert np.all(y[~seen] == 0)   # fewer keys than queries: the first queries see nothing
    assert rel_err(y, _apply(_dpa("causal"), q, k, v)) > 1e-3   # not top-left


def test_causal_bottom_right_equals_causal_for_self_attention(session, rng):
    q, k, v = _qkv(rng)
    assert rel_err(_apply(_dpa("causal_bottom_right"), q, k, v), _apply(_dpa("causal"), q, k, v)) == 0.0
    # TE's aliases name the same types.
    assert rel_err(_apply(_dpa("bottom_right_causal"), q, k, v), _apply(_dpa("causal"), q, k, v)) == 0.0


def test_padding_causal_bottom_right_uses_each_rows_lengths(session, rng):
    sq, skv = 5, 8
    q, k, v = _cross_qkv(rng, sq, skv)
    q_len, kv_len = np.array([5, 3]), np.array([8, 4])
    pad = (np.arange(sq)[None, :, None] >= q_len[:, None, None]) | \
          (np.arange(skv)[None, None, :] >= kv_len[:, None, None])
    pad = pad[:, None]
    want = helpers.attention(q, k, v, _bottom_right(sq, skv, q_len, kv_len))
    for name in ("padding_causal_bottom_right", "bottom_right_padding_causal"):
        y = _apply(_dpa(name), q, k, v, pad.astype(np.uint8))
        assert _valid_rows(y, want, _bottom_right(sq, skv, q_len, kv_len)) < F32
