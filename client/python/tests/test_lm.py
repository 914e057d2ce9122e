"""A decoder LM in one server graph: nn.Embed, Embed.attend and optax's softmax
cross entropy (te_client.losses) against float64 numpy, and a tiny LM of TE
TransformerLayers trained through a real te_server with only int32 ids sent."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
import te_client.optim as optim
from te_client import dtypes, linen as nn, losses, variables as variables_lib

# Tolerances and targets, stated once.
# The server's gather is exact; its float32 loss and gradients (sums in
# float64 on the CPU, GEMMs in float32) agree with float64 to ~1e-6.
F32_TOL = 1e-5
# The tiny LM: about ln(256) = 5.55 at the start (near-uniform over bytes);
# 300 adam steps on a repeated English paragraph bring it to 0.37 (held-out
# windows 0.27; measured on the CPU); unigram statistics alone stop near 3.
LM_STEPS = 300
LM_FINAL_LOSS = 1.0
V, F = 37, 8


def _params(session, params):
    tree = session.get_variables(params, collections=["params"])
    return {k: np.asarray(v, np.float64) for k, v in variables_lib.flatten(tree).items()}


class Tied(nn.Module):
    """Embed, then its tied projection and the mean token loss."""
    @nn.compact
    def __call__(self, tokens, labels):
        embed = nn.Embed(V, F)
        logits = embed.attend(embed(tokens))
        return losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _tied_reference(e, tokens, labels):
    """float64 loss and d loss / d embedding of Tied."""
    h = e[tokens]                                   # [B, S, F]
    logits = h @ e.T
    n = labels.size
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - top)
    p /= p.sum(-1, keepdims=True)
    loss = losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    g = p.copy()
    np.put_along_axis(g, labels[..., None], np.take_along_axis(g, labels[..., None], -1) - 1.0, -1)
    g /= n
    de = np.einsum("bsv,bsf->vf", g, h)             # through attend
    dh = g @ e
    np.add.at(de, tokens.reshape(-1), dh.reshape(-1, F))   # through the gather
    return loss, de


def test_embed_is_flax_embed(session, rng):
    tokens = rng.integers(0, V, size=(3, 4)).astype(np.int32)
    embed = nn.Embed(V, F)
    params = embed.init(0, tokens)
    e = _params(session, params)["params/embedding"]
    assert e.shape == (V, F)
    np.testing.assert_array_equal(np.asarray(embed.apply(params, tokens), np.float64), e[tokens])
    # default_embed_init: normal with std 1/sqrt(features); V * F = 296 draws.
    assert abs(e.std() * np.sqrt(F) - 1.0) < 0.25


def test_tied_loss_and_gradients_match_float64(session, rng):
    tokens = rng.integers(0, V, size=(2, 6)).astype(np.int32)
    labels = rng.integers(0, V, size=(2, 6)).astype(np.int32)
    model = Tied()
    traced = model.trace(tokens, labels)
    assert [n.WhichOneof("op") for n in traced.spec.nodes] == ["module", "attend", "softmax_cross_entropy"]
    assert traced.spec.nodes[1].attend.embed == "Embed_0"
    params = model.init(0, tokens, labels)
    e = _params(session, params)["params/Embed_0/embedding"]
    want_loss, want_de = _tied_reference(e, tokens, labels)
    loss = float(model.apply(params, tokens, labels))
    assert abs(loss - want_loss) < F32_TOL * abs(want_loss)
    value, (grads, _) = model.value_and_grad(params, tokens, np.float32(1.0), labels)
    de = np.asarray(variables_lib.flatten(grads)["params/Embed_0/embedding"], np.float64)
    assert np.linalg.norm(de - want_de) < F32_TOL * np.linalg.norm(want_de)
    assert abs(value - want_loss) < F32_TOL * abs(want_loss)


def test_loss_on_arrays_is_optax(rng):
    logits = rng.standard_normal((4, 5))
    labels = np.array([0, 4, 2, 2])
    want = np.log(np.exp(logits).sum(-1)) - logits[np.arange(4), labels]
    np.testing.assert_allclose(losses.softmax_cross_entropy_with_integer_labels(logits, labels), want, rtol=1e-12)


class TinyLM(nn.Module):
    """A byte-level decoder: Embed, TE TransformerLayers (causal, T5 relative
    position bias), a final LayerNorm, the tied projection and the loss."""
    num_layers: int = 2
    hidden: int = 32
    heads: int = 4
    vocab: int = 256

    @nn.compact
    def __call__(self, tokens, labels, deterministic=True):
        embed = nn.Embed(self.vocab, self.hidden)
        x = embed(tokens)
        for _ in range(self.num_layers):
            x = te_flax.TransformerLayer(hidden_size=self.hidden, mlp_hidden_size=4 * self.hidden,
                                         num_attention_heads=self.heads, hidden_dropout=0.0,
                                         attention_dropout=0.0, intermediate_dropout=0.0)(
                                             x, deterministic=deterministic)
        x = nn.LayerNorm()(x)
        return losses.softmax_cross_entropy_with_integer_labels(embed.attend(x), labels).mean()


TEXT = (b"It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        b"must be in want of a wife. However little known the feelings or views of such a man may be "
        b"on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        b"surrounding families, that he is considered the rightful property of some one or other "
        b"of their daughters. ") * 8


def _batch(rng, data, batch, seq):
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    window = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
    return window[:, :-1], window[:, 1:]


def test_tiny_lm_trains_with_only_ids_on_the_wire(session, rng):
    data = np.frombuffer(TEXT, np.uint8)
    batch, seq = 8, 32
    tokens, labels = _batch(rng, data, batch, seq)
    model = TinyLM()
    params = model.init(0, tokens, labels)
    state = optim.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=optim.chain(optim.clip_by_global_norm(1.0), optim.adam(3e-3)))
    sent = []
    real_call = session.call

    def recording_call(method, request, *args, **kwargs):
        if method == "ForwardBackward":
            sent.append(request)
        return real_call(method, request, *args, **kwargs)

    session.call = recording_call
    try:
        first = None
        for _ in range(LM_STEPS):
            tokens, labels = _batch(rng, data, batch, seq)
            state, metrics = optim.train_step(state, tokens, labels)
            first = metrics["loss"] if first is None else first
    finally:
        session.call = real_call
    assert abs(first - np.log(256)) < 1.0, first
    held_tokens, held_labels = _batch(np.random.default_rng(123), data, batch, seq)
    held = float(model.apply(state.params, held_tokens, held_labels))
    assert metrics["loss"] < LM_FINAL_LOSS and held < LM_FINAL_LOSS, (metrics["loss"], held)
    assert state.step == LM_STEPS and metrics["count"] == LM_STEPS
    # Every step sent x and the labels as int32 and nothing else (no dy, no target):
    for request in sent:
        (mb,) = request.micro_batches
        assert not mb.HasField("dy") and not mb.HasField("target")
        assert [t.dtype for t in [mb.x] + list(mb.extra_inputs)] == [dtypes.INT32, dtypes.INT32]
    ids_bytes = 2 * batch * seq * 4
    assert ids_bytes <= metrics["request_bytes"] < ids_bytes + 256, metrics["request_bytes"]


def test_tiny_lm_trains_under_fp8_delayed_scaling(session, rng):
    """The same LM under FP8 DelayedScaling (TE's HYBRID format): every update
    applied (the FP8 weight copies the update writes feed the next forward),
    the amax histories moved, and the loss below the same target as bf16."""
    from te_client.recipe import DelayedScaling, Format
    data = np.frombuffer(TEXT, np.uint8)
    batch, seq = 8, 32
    tokens, labels = _batch(rng, data, batch, seq)
    model = TinyLM()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    with te.autocast(enabled=True, recipe=recipe):
        params = model.init(0, tokens, labels)
        state = optim.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optim.chain(optim.clip_by_global_norm(1.0), optim.adam(3e-3)))
        for _ in range(LM_STEPS):
            tokens, labels = _batch(rng, data, batch, seq)
            state, metrics = optim.train_step(state, tokens, labels)
        held_tokens, held_labels = _batch(np.random.default_rng(123), data, batch, seq)
        held = float(model.apply(state.params, held_tokens, held_labels))
    assert metrics["count"] == LM_STEPS and metrics["total_notfinite"] == 0, metrics
    assert metrics["loss"] < LM_FINAL_LOSS and held < LM_FINAL_LOSS, (metrics["loss"], held)
    histories = {k: np.asarray(v) for k, v in variables_lib.flatten(
        session.get_variables(state.params, collections=["fp8_metas"])).items() if k.endswith("amax_history")}
    assert histories and all(np.count_nonzero(h) > 1 for h in histories.values()), list(histories)
