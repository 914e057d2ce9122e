"""te_client.generate on the LM of examples/train_lm.py through a real te_server:
greedy tokens are those of re-running the full causal forward on the growing
prefix (bf16 and FP8 DelayedScaling), the variables stay bit for bit, sampling
is reproducible for a seed, stop tokens end each sequence, a deadline or a
closed stream stops the server between tokens, bad input names its field, and
examples/generate.py samples from what train_lm.py --save wrote."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import te_client as te
import te_client.optim as optim
from te_client import linen as nn, losses, variables as variables_lib
from te_client.generate import generate_stream
from te_client.recipe import DelayedScaling, Format

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

from train_lm import DecoderLM  # noqa: E402

TRACED = (4, 12)   # the batch and length init traces the LM with (as train_lm.py's --batch, --seq)
TEXT = b"the quick brown fox jumps over the lazy dog; " * 4


class LmLogits(DecoderLM):
    """DecoderLM's graph up to its logits (the same nodes, so the same
    variables): the reference forward, with no labels."""

    @nn.compact
    def __call__(self, tokens, deterministic=True):
        embed = nn.Embed(self.vocab, self.hidden)
        x = embed(tokens).astype(self.compute_dtype)
        for _ in range(self.num_layers):
            x = te.flax.TransformerLayer(hidden_size=self.hidden, mlp_hidden_size=4 * self.hidden,
                                         num_attention_heads=self.heads, mlp_activations=("gelu",),
                                         hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                                         enable_rotary_pos_emb=self.rotary)(x, deterministic=deterministic)
        return embed.attend(nn.LayerNorm()(x))


def _windows(step, batch=TRACED[0], seq=TRACED[1]):
    data = np.frombuffer(TEXT, np.uint8).astype(np.int32)
    starts = [(step * 5 + b * 11) % (len(data) - seq - 1) for b in range(batch)]
    return (np.stack([data[s:s + seq] for s in starts]), np.stack([data[s + 1:s + seq + 1] for s in starts]))


def _trained(layers=2, hidden=32, steps=3, lr=1e-3):
    """The LM after a few steps (under the current autocast), so neither its
    parameters nor its FP8 scales are init's; lr small enough that its
    greedy tokens still vary."""
    model = DecoderLM(layers, hidden, 4)
    tokens, labels = _windows(0)
    params = model.init(0, tokens, labels)
    state = optim.TrainState.create(apply_fn=model.apply, params=params, tx=optim.adam(lr))
    for step in range(steps):
        state, _ = optim.train_step(state, *_windows(step + 1))
    return model, state.params


def _greedy_by_full_forwards(model, params, prompt, new_tokens):
    reference = LmLogits(model.num_layers, model.hidden, model.heads)
    seqs = prompt.copy()
    for _ in range(new_tokens):
        logits = np.asarray(reference.apply(params, seqs), np.float32)
        assert logits.shape == seqs.shape + (256,)
        seqs = np.concatenate([seqs, logits[:, -1].argmax(-1).astype(np.int32)[:, None]], axis=1)
    return seqs


def _bytes_of(variables):
    return {k: np.asarray(v).tobytes() for k, v in variables_lib.flatten(variables.fetch()).items()}


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_greedy_is_the_full_forward_on_the_growing_prefix(session, recipe):
    scope = (te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16))
             if recipe == "delayed" else te.autocast(enabled=False))
    with scope:
        model, params = _trained()
        before = _bytes_of(params)
        prompt = np.array([list(b"the qu"), list(b"lazy d")], np.int32)
        steps = []
        out = te.generate(params, prompt, 6, on_step=steps.append)
        want = _greedy_by_full_forwards(model, params, prompt, 6)
    assert out.dtype == np.int32 and out.shape == (2, 12)
    np.testing.assert_array_equal(out, want)
    assert len(set(want[:, 6:].ravel())) >= 3, "a comparison that could pass by accident"
    assert [s.step for s in steps] == list(range(6))
    np.testing.assert_array_equal(np.stack([s.tokens for s in steps], 1), out[:, 6:])
    assert not any(s.stopped.any() for s in steps)
    # The layer's variables (params, fp8_metas, opt_state) are bit for bit as they were.
    assert _bytes_of(params) == before
    if recipe == "delayed":
        assert any(k.startswith("fp8_metas/") for k in before)


def test_sampling_is_reproducible_for_a_seed(session):
    _, params = _trained(steps=1)
    prompt = np.array([list(b"def f"), list(b"def g")], np.int32)
    kwargs = dict(temperature=1.5, top_k=50, top_p=0.95)
    a = te.generate(params, prompt, 16, seed=3, **kwargs)
    b = te.generate(params, prompt, 16, seed=3, **kwargs)
    c = te.generate(params, prompt, 16, seed=4, **kwargs)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # greedy=True is the argmax, whatever the seed.
    np.testing.assert_array_equal(te.generate(params, prompt, 16, greedy=True, seed=3),
                                  te.generate(params, prompt, 16))


def test_stop_tokens_end_each_sequence(session):
    _, params = _trained(steps=1)
    prompt = np.array([list(b"abc"), list(b"xyz")], np.int32)
    greedy = te.generate(params, prompt, 10)[:, 3:]
    stop = int(greedy[0, 3])
    first = int(np.argmax(greedy[0] == stop))
    steps = list(generate_stream(params, prompt, 10, stop_tokens=[stop]))
    # The call ends when every sequence has stopped: at max_new_tokens when
    # the second never makes the stop token.
    others = np.flatnonzero(greedy[1] == stop)
    ends = 10 if others.size == 0 else max(first, int(others[0])) + 1
    assert len(steps) == ends
    for k, step in enumerate(steps):
        assert bool(step.stopped[0]) == (k >= first)
        assert step.tokens[0] == (stop if k >= first else greedy[0, k])


def _slow_lm():
    """Large enough on the CPU server that 4000 tokens take far longer than the deadlines below."""
    model = DecoderLM(4, 256, 4)
    return model.init(0, *_windows(0))


def _session_answers_at_once(session):
    start = time.monotonic()
    session.info()
    assert time.monotonic() - start < 10.0


def test_deadline_ends_the_call_after_the_tokens_sent(session):
    params = _slow_lm()
    prompt = np.array([list(b"hello")], np.int32)
    start = time.monotonic()
    with pytest.raises(te.DeadlineExceededError) as raised:
        te.generate(params, prompt, 4000, timeout=3.0)
    assert time.monotonic() - start < 10.0
    made = raised.value.tokens
    np.testing.assert_array_equal(made[:, :5], prompt)
    assert 5 < made.shape[1] < 5 + 4000
    _session_answers_at_once(session)


def test_closing_the_stream_cancels_the_call(session):
    params = _slow_lm()
    prompt = np.array([list(b"hello")], np.int32)
    stream = generate_stream(params, prompt, 4000)
    taken = [next(stream) for _ in range(3)]
    stream.close()
    assert [s.step for s in taken] == [0, 1, 2]
    _session_answers_at_once(session)
    # The session goes on.
    assert te.generate(params, prompt, 2).shape == (1, 7)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=np.zeros((1, 3), np.float32)), "prompt"),
    (dict(prompt=np.zeros((3,), np.int32)), "prompt"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=1 << 40), "max_new_tokens"),
    (dict(temperature=0.0), "sampling.temperature"),
    (dict(temperature=-1.0, greedy=True), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(graph=7), "graph"),
])
def test_bad_input_names_the_field(session, kwargs, field):
    model = DecoderLM(1, 32, 4)
    params = model.init(0, *_windows(0))
    call = dict(prompt=np.array([[1, 2, 3]], np.int32), max_new_tokens=4)
    call.update(kwargs)
    with pytest.raises(te.InvalidArgumentError) as raised:
        te.generate(params, call.pop("prompt"), call.pop("max_new_tokens"), **call)
    assert field in raised.value.message
    # Nothing changed: generation still runs.
    assert te.generate(params, np.array([[1, 2, 3]], np.int32), 2).shape == (1, 5)


def test_a_model_that_takes_no_ids_cannot_generate(session):
    dense = te.flax.DenseGeneral(features=8)
    params = dense.init(0, np.ones((1, 3, 8), np.float32))
    with pytest.raises(te.InvalidArgumentError) as raised:
        te.generate(params, np.array([[1, 2]], np.int32), 2)
    assert "layer_id" in raised.value.message
    with pytest.raises(te.InvalidArgumentError) as raised:
        te.generate({"params": {"kernel": np.ones((8, 8), np.float32)}}, np.array([[1, 2]], np.int32), 2)
    assert "variables" in raised.value.message


def test_generate_example_samples_from_what_train_lm_saved(server_address, tmp_path):
    saved = str(tmp_path / "lm.npz")
    common = ["--address=" + server_address]
    subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_lm.py"), *common, "--layers=1", "--hidden=32",
                    "--heads=4", "--seq=16", "--batch=2", "--steps=2", "--eval_every=2", "--eval_batches=1",
                    "--final_eval_batches=1", "--save=" + saved], check=True, capture_output=True, timeout=300)
    assert os.path.exists(saved) and os.path.exists(saved + ".json")
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "generate.py"), *common, "--load=" + saved,
                          "--prompt=def ", "--samples=2", "--max_new_tokens=12", "--temperature=0.9", "--seed=1"],
                         check=True, capture_output=True, timeout=300)
    out = run.stdout.decode("utf-8", "replace")
    assert "generated 12 tokens per sample" in out, out
    assert "--- sample 1 ---\ndef " in out, out
