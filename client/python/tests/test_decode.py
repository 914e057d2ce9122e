"""TE's decode through a real te_server, as Flax users write it:

    variables = model.init(key, x_full, decode=True)
    y_t, variables = model.apply(variables, x_t, decode=True, mutable=["cache"])

Decoding a sequence token by token gives, row for row, what one causal apply
of the whole sequence gives (MultiHeadAttention, a DECODER TransformerLayer, a
traced LM; float32, bfloat16, FP8 under DelayedScaling); the new variables are
references (the cache stays on the server); TE's and Flax's refusals."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import errors, linen as nn, variables as variables_lib
from te_client.flax.transformer import TransformerLayerType
from te_client.recipe import DelayedScaling, Format

# The largest relative L2 error of one output row, a decode step's against the
# full apply's row, stated once (the server's decode tests state the same).
# float32: each row from the same float32 operands; sums over another row
# count may add in another order.
F32 = 1e-5
# bfloat16: each stage rounds once; where a sum's order differs, one ulp
# (2^-8) in an element, carried on: 2^-7. FP8 under DelayedScaling quantizes
# with the scales in fp8_metas, the same for a token as for the sequence (a
# functional apply moves none), so the forward's codes and the same bound.
BF16 = 1.0 / 128
FP8 = BF16
TOLERANCE = {"float32": F32, "bfloat16": BF16, "fp8": FP8}

H, V, L = 32, 13, 6
HYBRID = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, amax_compute_algo="max")


def _rows(y):
    return np.asarray(y, np.float64)


def _row_error(full, step, t):
    """Worst over the batch of ||step[b, 0] - full[b, t]|| / ||full[b, t]||."""
    full, step = _rows(full), _rows(step)
    return max(float(np.linalg.norm(step[b, 0] - full[b, t]) / max(np.linalg.norm(full[b, t]), 1e-30))
               for b in range(full.shape[0]))


def _first(y):
    return y[0] if isinstance(y, tuple) else y


def _mha():
    return te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=4, num_gqa_groups=2,
                                      enable_rotary_pos_emb=True, use_bias=True)


def _decoder():
    return te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4,
                                    enable_rotary_pos_emb=True, use_bias=True,
                                    layer_type=TransformerLayerType.DECODER)


class TinyLM(nn.Module):
    """ids -> Embed -> MultiHeadAttention (causal, rotary) -> Dense -> logits."""
    dtype: object = np.float32

    @nn.compact
    def __call__(self, ids, decode=False):
        h = nn.Embed(V, H, dtype=self.dtype)(ids)
        h = _first(_mha()(h, decode=decode, deterministic=True))
        return nn.Dense(V)(h)


def _precision(name):
    """(x's dtype, the autocast to run under)."""
    if name == "fp8":
        return te.bfloat16, te.autocast(enabled=True, recipe=HYBRID)
    return (np.float32 if name == "float32" else te.bfloat16), te.autocast(enabled=False)


def _decode_all(module, variables, x, *args, **kwargs):
    """Each position of x in turn through apply(decode=True, mutable=["cache"]): [(y_t, variables)]."""
    out = []
    for t in range(x.shape[1]):
        y, variables = module.apply(variables, x[:, t:t + 1], *args, decode=True, mutable=["cache"], **kwargs)
        out.append((_first(y), variables))
    return out


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "fp8"])
def test_multi_head_attention_decodes_as_one_causal_apply(session, rng, precision):
    dtype, scope = _precision(precision)
    layer = _mha()
    x = te.asarray(rng.standard_normal((2, L, H)), dtype)
    with scope:
        variables = layer.init(0, x, decode=True)
        # TE's names and shapes: [batch, length, kv heads, head_dim] in x's dtype, an int32 scalar index.
        assert te.tree_map(lambda v: v.shape, variables)["cache"] == {
            "cached_key": (2, L, 2, 8), "cached_value": (2, L, 2, 8), "cache_index": ()}
        assert te.dtype_of(variables["cache"]["cached_key"].value()) == te.dtype_of(x)
        assert np.asarray(variables["cache"]["cache_index"]).dtype == np.int32
        full = _first(layer.apply(variables, x))
        steps = _decode_all(layer, variables, x)
    for t, (y, _) in enumerate(steps):
        assert y.shape == (2, 1, H)
        assert _row_error(full, y, t) <= TOLERANCE[precision], t
    last = steps[-1][1]
    assert int(np.asarray(last["cache"]["cache_index"])) == L
    # Each step's variables are their own version: the first step's still hold one token.
    assert int(np.asarray(steps[0][1]["cache"]["cache_index"])) == 1
    assert int(np.asarray(variables["cache"]["cache_index"])) == 0


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "fp8"])
def test_decoder_transformer_layer_decodes_as_one_causal_apply(session, rng, precision):
    dtype, scope = _precision(precision)
    layer = _decoder()
    x = te.asarray(rng.standard_normal((2, L, H)), dtype)
    encoded = te.asarray(rng.standard_normal((2, 5, H)), dtype)
    with scope:
        variables = layer.init(0, x, encoded, decode=True)
        assert set(variables["cache"]) == {"self_attention"}
        full = layer.apply(variables, x, encoded, deterministic=True)
        steps = _decode_all(layer, variables, x, encoded, deterministic=True)
    for t, (y, _) in enumerate(steps):
        assert _row_error(full, y, t) <= TOLERANCE[precision], t


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "fp8"])
def test_traced_lm_decodes_as_one_causal_apply(session, rng, precision):
    _, scope = _precision(precision)
    model = TinyLM(dtype=np.float32 if precision == "float32" else te.bfloat16)
    ids = rng.integers(0, V, (2, L)).astype(np.int32)
    with scope:
        variables = model.init(0, ids, decode=True)
        assert "cached_key" in variables["cache"]["MultiHeadAttention_0"]
        full = model.apply(variables, ids)
        steps = _decode_all(model, variables, ids)
    for t, (y, _) in enumerate(steps):
        assert y.shape == (2, 1, V)
        assert _row_error(full, y, t) <= TOLERANCE[precision], t


# ---- the new variables, and the errors ---------------------------------------------------

@pytest.fixture
def decoding(session, rng):
    """A MultiHeadAttention initialised for decoding, x, its full apply, and one step."""
    layer = _mha()
    x = rng.standard_normal((2, 4, H)).astype(np.float32)
    variables = layer.init(0, x, decode=True)
    full = _first(layer.apply(variables, x))
    y, after_one = layer.apply(variables, x[:, :1], decode=True, mutable=["cache"])
    return layer, x, variables, full, after_one


def test_new_variables_are_references_to_a_new_version(decoding):
    layer, x, variables, full, after_one = decoding
    assert isinstance(after_one, variables_lib.Variables)
    assert after_one.version.number == variables.version.number + 1
    # The cache stayed on the server: references, fetched when read.
    assert isinstance(after_one["cache"]["cached_key"], variables_lib.VariableRef)
    assert isinstance(after_one["params"]["out"]["kernel"], variables_lib.VariableRef)
    key = np.asarray(after_one["cache"]["cached_key"])
    assert np.abs(key[:, 0]).sum() > 0 and np.abs(key[:, 1:]).sum() == 0   # row 0 written, the rest as init made it
    values = variables_lib.flatten(after_one.fetch(["cache"]))
    assert int(values["cache/cache_index"]) == 1


def test_decode_without_mutable_cache_is_refused_as_flax_does(decoding):
    layer, x, variables, _, _ = decoding
    for mutable in (False, ["fp8_metas"]):
        with pytest.raises(errors.InvalidArgumentError, match='collection "cache" is immutable'):
            layer.apply(variables, x[:, :1], decode=True, mutable=mutable)


def test_more_than_one_new_token_names_x(decoding):
    layer, x, _, full, after_one = decoding
    with pytest.raises(errors.InvalidArgumentError, match=r"x\.shape \[2, 2, 32\]"):
        layer.apply(after_one, x[:, 1:3], decode=True, mutable=["cache"])
    # The failed step left the cache as it was: the next token is x's row 1.
    y, _ = layer.apply(after_one, x[:, 1:2], decode=True, mutable=["cache"])
    assert _row_error(full, _first(y), 1) <= F32


def test_a_full_cache_names_cache_index(decoding):
    layer, x, _, _, variables = decoding
    for t in range(1, 4):
        _, variables = layer.apply(variables, x[:, t:t + 1], decode=True, mutable=["cache"])
    with pytest.raises(errors.InvalidArgumentError, match="cache_index is 4"):
        layer.apply(variables, x[:, :1], decode=True, mutable=["cache"])


def test_a_layer_initialised_without_decode_has_no_cache(session, rng):
    layer = _mha()
    x = rng.standard_normal((2, 4, H)).astype(np.float32)
    variables = layer.init(0, x)
    assert "cache" not in variables
    with pytest.raises(errors.FailedPreconditionError, match="InitLayer with decode"):
        layer.apply(variables, x[:, :1], decode=True, mutable=["cache"])


def test_te_refuses_to_decode_an_encoder(session, rng):
    layer = te_flax.TransformerLayer(hidden_size=H, mlp_hidden_size=64, num_attention_heads=4,
                                     enable_rotary_pos_emb=True)
    x = rng.standard_normal((2, 4, H)).astype(np.float32)
    with pytest.raises(errors.InvalidArgumentError,
                       match="decode should be False when layer_type == TransformerLayerType.ENCODER"):
        layer.init(0, x, decode=True)
    fused = te_flax.MultiHeadAttention(head_dim=8, num_attention_heads=4)
    with pytest.raises(errors.InvalidArgumentError, match="decode mode requires QKVLayout.BSHD_BSHD_BSHD"):
        fused.init(0, x, decode=True)


def test_get_and_set_variables_read_and_write_the_cache(session, decoding):
    layer, x, variables, full, after_one = decoding
    cache = variables_lib.flatten(session.get_variables(after_one, ["cache"]))
    assert sorted(cache) == ["cache/cache_index", "cache/cached_key", "cache/cached_value"]
    # The one-token cache set into init's version decodes on from position 1.
    restored = session.set_variables(variables, cache)
    assert int(np.asarray(restored["cache"]["cache_index"])) == 1
    y, _ = layer.apply(restored, x[:, 1:2], decode=True, mutable=["cache"])
    assert _row_error(full, _first(y), 1) <= F32
