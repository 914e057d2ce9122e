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
  * True / nonzero means masked out, in bool or uint8 (TE's tests' dtype) or int.
"""
import numpy as np
import pytest

import helpers
import te_client.flax as te_flax
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
