"""Peer for decode: the byte-level LM of client/python/examples/train_lm.py generating greedily in
plain JAX, as a user would without the server.

The model is the one ../shared/peers/jax_lm_peer.py trains (byte embedding, pre-LayerNorm layers
with fused QKV, rotary positions, TE's causal relative position bias (32 buckets, max distance 128,
a [buckets, heads] table per layer), a 4x tanh-GELU MLP, a final LayerNorm and the tied projection),
bf16 compute. Generation, jit'd with static shapes: a prefill over the prompt that writes every
layer's keys and values into a cache of prompt + new - 1 rows (attention through cuDNN on a GPU),
then one lax.scan of one-token steps, each writing its row in place (the cache is the loop's
carry) and attending over the rows so far. Weights are bf16 (cast once, what one would do for
inference), or with --param_dtype=float32 train_lm's float32 params, cast to bf16 in every step as a
Flax module with dtype=bfloat16 does. Random weights and prompt: decode speed does not depend on them.

Prints one line per batch size:
  DECODEPEER layers=L hidden=H heads=A batch=B prompt=P new=N rel_bias=R param_dtype=D
    prefill_ms=... decode_ms=... tokens_per_s=... decode_tokens_per_s=...
(prefill_ms: the prompt and the first new token; decode_ms: the other new-1 tokens; tokens_per_s:
batch * new over both; decode_tokens_per_s: batch * (new - 1) over decode_ms; medians of --iters.)

    python3 bench/jax_decode_peer.py                     # 24 x 1024, 16 heads, prompt 128, 256 new, batches 1 and 8
    python3 bench/jax_decode_peer.py --tiny              # a CPU-sized check: 2 x 64, prompt 8, 8 new
    python3 bench/jax_decode_peer.py --check             # decode steps give the full causal forward's rows
"""
import argparse
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

BF16 = jnp.bfloat16
F32 = jnp.float32
VOCAB = 256
BUCKETS, MAX_DISTANCE = 32, 128


def attention_impl():
    """cuDNN's fused attention on a GPU (as jax_lm_peer.py trains with); XLA's elsewhere."""
    return "cudnn" if jax.default_backend() == "gpu" else None


def init_params(key, layers, hidden, heads, param_dtype):
    """Per-layer dicts of weights (param_dtype) and norms and bias tables (float32)."""
    d = hidden // heads
    keys = iter(jax.random.split(key, 6 * layers + 1))

    def w(shape, fan_in):
        return (jax.random.normal(next(keys), shape, F32) / math.sqrt(fan_in)).astype(param_dtype)

    ones, zeros = jnp.ones((hidden,), F32), jnp.zeros((hidden,), F32)
    blocks = [dict(ln1_g=ones, ln1_b=zeros, wqkv=w((hidden, 3, heads, d), hidden), wo=w((heads, d, hidden), hidden),
                   ln2_g=ones, ln2_b=zeros, w1=w((hidden, 4 * hidden), hidden), w2=w((4 * hidden, hidden), 4 * hidden),
                   rel=jax.random.normal(next(keys), (BUCKETS, heads), F32) * 0.02)
              for _ in range(layers)]
    return dict(embed=(jax.random.normal(next(keys), (VOCAB, hidden), F32) / math.sqrt(hidden)).astype(param_dtype),
                blocks=blocks, ln_g=ones, ln_b=zeros)


def layer_norm(x, g, b, eps=1e-6):
    x = x.astype(F32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * g + b


def rotary(x, positions):
    """x [b, s, h, d] at absolute positions [s]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (jnp.arange(half, dtype=F32) / half))
    ang = positions.astype(F32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def relative_bias(table, q_pos, k_pos):
    """TE's causal T5 bias: table [buckets, heads] at (query, key) positions -> [heads, sq, sk] float32."""
    n = jnp.maximum(q_pos[:, None] - k_pos[None, :], 0)
    exact = BUCKETS // 2
    large = exact + (jnp.log(jnp.maximum(n, 1) / exact) / math.log(MAX_DISTANCE / exact)
                     * (BUCKETS - exact)).astype(jnp.int32)
    bucket = jnp.where(n < exact, n, jnp.minimum(large, BUCKETS - 1))
    return jnp.transpose(table[bucket], (2, 0, 1))


def block(p, x, k_cache, v_cache, start, positions, prefill, rel_bias):
    """One layer on x [b, s, hidden] bf16 at `positions` (= start + arange(s)): writes its keys and
    values into rows start.. of the caches [b, T, heads, d] and attends causally over rows 0..pos."""
    h = layer_norm(x, p["ln1_g"], p["ln1_b"]).astype(BF16)
    qkv = jnp.einsum("bsh,hcad->bscad", h, p["wqkv"].astype(BF16))
    q, k, v = rotary(qkv[:, :, 0], positions), rotary(qkv[:, :, 1], positions), qkv[:, :, 2]
    k_cache = lax.dynamic_update_slice(k_cache, k, (0, start, 0, 0))
    v_cache = lax.dynamic_update_slice(v_cache, v, (0, start, 0, 0))
    scale = 1.0 / math.sqrt(q.shape[-1])
    if prefill:  # the prompt alone: its own keys, causal
        bias = relative_bias(p["rel"], positions, positions)[None].astype(BF16) if rel_bias else None
        a = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation=attention_impl())
    else:  # new tokens over the cache's rows so far (a static-shape loop reads all T, masking the rest)
        k_pos = jnp.arange(k_cache.shape[1])
        s = jnp.einsum("bqad,btad->baqt", q, k_cache, preferred_element_type=F32) * scale
        if rel_bias:
            s = s + relative_bias(p["rel"], positions, k_pos)[None]
        s = jnp.where(k_pos[None, None, None, :] <= positions[None, None, :, None], s, -jnp.inf)
        a = jnp.einsum("baqt,btad->bqad", jax.nn.softmax(s, axis=-1).astype(BF16), v_cache)
    x = x + jnp.einsum("bsad,adh->bsh", a, p["wo"].astype(BF16))
    h = layer_norm(x, p["ln2_g"], p["ln2_b"]).astype(BF16)
    h = jax.nn.gelu(h @ p["w1"].astype(BF16), approximate=True)
    return x + h @ p["w2"].astype(BF16), k_cache, v_cache


def forward(params, tokens, caches, start, prefill, rel_bias):
    """Logits [b, s, vocab] float32 of tokens [b, s] at positions start.., and the written caches."""
    positions = start + jnp.arange(tokens.shape[1])
    x = params["embed"][tokens].astype(BF16)
    new = []
    for p, (kc, vc) in zip(params["blocks"], caches):
        x, kc, vc = block(p, x, kc, vc, start, positions, prefill, rel_bias)
        new.append((kc, vc))
    x = layer_norm(x, params["ln_g"], params["ln_b"])
    return jnp.einsum("bsh,vh->bsv", x, params["embed"].astype(F32)), new


def make_generate(rel_bias, new_tokens):
    """(prefill, decode), each one jit'd call: prefill(params, prompt, caches) -> (caches, first
    token [b]); decode(params, caches, token, start) -> the other new_tokens - 1 tokens [b, n - 1]."""

    def prefill(params, prompt, caches):
        logits, caches = forward(params, prompt, caches, 0, True, rel_bias)
        return caches, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def decode(params, caches, token, start):
        def step(carry, _):
            caches, token, pos = carry
            logits, caches = forward(params, token[:, None], caches, pos, False, rel_bias)
            token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            return (caches, token, pos + 1), token

        _, tokens = lax.scan(step, (caches, token, start), None, length=new_tokens - 1)
        return tokens.T

    return jax.jit(prefill, donate_argnums=(2,)), jax.jit(decode, donate_argnums=(1,))


def empty_caches(layers, batch, length, heads, d):
    return [(jnp.zeros((batch, length, heads, d), BF16), jnp.zeros((batch, length, heads, d), BF16))
            for _ in range(layers)]


def run(layers, hidden, heads, batch, prompt_len, new_tokens, rel_bias, param_dtype, iters):
    params = init_params(jax.random.PRNGKey(0), layers, hidden, heads, param_dtype)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 0, VOCAB, dtype=jnp.int32)
    prefill, decode = make_generate(rel_bias, new_tokens)
    length = prompt_len + new_tokens - 1   # the last new token is not fed back
    prefill_ms, decode_ms = [], []
    for it in range(iters + 1):            # the first compiles
        caches = empty_caches(layers, batch, length, heads, hidden // heads)
        jax.block_until_ready(caches)
        t0 = time.perf_counter()
        caches, token = prefill(params, prompt, caches)
        jax.block_until_ready(token)
        t1 = time.perf_counter()
        tokens = decode(params, caches, token, jnp.int32(prompt_len))
        jax.block_until_ready(tokens)
        t2 = time.perf_counter()
        if it:
            prefill_ms.append((t1 - t0) * 1e3)
            decode_ms.append((t2 - t1) * 1e3)
    pre, dec = statistics.median(prefill_ms), statistics.median(decode_ms)
    print(f"DECODEPEER layers={layers} hidden={hidden} heads={heads} batch={batch} prompt={prompt_len} "
          f"new={new_tokens} rel_bias={int(rel_bias)} param_dtype={jnp.dtype(param_dtype).name} "
          f"prefill_ms={pre:.3f} decode_ms={dec:.3f} tokens_per_s={batch * new_tokens / ((pre + dec) / 1e3):.1f} "
          f"decode_tokens_per_s={batch * (new_tokens - 1) / (dec / 1e3):.1f}", flush=True)


def check(rel_bias, tolerance=2e-2):
    """The cache's steps give the full causal forward's logits rows (the prompt at once, then one
    token a step; bf16 activations, so within `tolerance` relative to the row), and the jit'd
    generation gives the tokens of the same steps run one by one."""
    layers, hidden, heads, batch, prompt_len, new_tokens = 2, 64, 4, 2, 5, 6
    params = init_params(jax.random.PRNGKey(0), layers, hidden, heads, F32)
    seq = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len + new_tokens), 0, VOCAB, dtype=jnp.int32)
    d, length = hidden // heads, prompt_len + new_tokens
    full, _ = forward(params, seq, empty_caches(layers, batch, length, heads, d), 0, True, rel_bias)
    logits, caches = forward(params, seq[:, :prompt_len], empty_caches(layers, batch, length, heads, d), 0, True,
                             rel_bias)
    rows = [logits]
    for pos in range(prompt_len, length):
        logits, caches = forward(params, seq[:, pos:pos + 1], caches, jnp.int32(pos), False, rel_bias)
        rows.append(logits)
    stepped = jnp.concatenate(rows, axis=1)
    error = float(jnp.max(jnp.linalg.norm(stepped - full, axis=-1) / jnp.linalg.norm(full, axis=-1)))
    rows_ok = error <= tolerance

    prompt = seq[:, :prompt_len]
    prefill, decode = make_generate(rel_bias, new_tokens)
    caches, first = prefill(params, prompt, empty_caches(layers, batch, length - 1, heads, d))
    made = jnp.concatenate([first[:, None], decode(params, caches, first, jnp.int32(prompt_len))], axis=1)
    logits, caches = forward(params, prompt, empty_caches(layers, batch, length - 1, heads, d), 0, True, rel_bias)
    want = [jnp.argmax(logits[:, -1], -1).astype(jnp.int32)]
    for pos in range(prompt_len, length - 1):
        logits, caches = forward(params, want[-1][:, None], caches, jnp.int32(pos), False, rel_bias)
        want.append(jnp.argmax(logits[:, -1], -1).astype(jnp.int32))
    tokens_ok = bool((made == jnp.stack(want, axis=1)).all())
    print(f"DECODEPEER check rel_bias={int(rel_bias)}: steps vs full forward max row error {error:.2e} "
          f"(<= {tolerance}: {rows_ok}); jit'd generation == steps one by one: {tokens_ok}", flush=True)
    return rows_ok and tokens_ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rel_bias", type=int, default=1, help="TE's relative position bias (TransformerLayer's default)")
    parser.add_argument("--param_dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="2 x 64, 4 heads, prompt 8, 8 new, batches 1,2, 2 iters")
    parser.add_argument("--check", action="store_true", help="check the steps against the full forward, then exit")
    args = parser.parse_args()
    print("jax", jax.__version__, jax.devices(), flush=True)
    if args.check:
        sys.exit(0 if all(check(r) for r in (False, True)) else 1)
    if args.tiny:
        args.layers, args.hidden, args.heads, args.prompt, args.new, args.batches, args.iters = 2, 64, 4, 8, 8, "1,2", 2
    dtype = BF16 if args.param_dtype == "bfloat16" else F32
    for b in [int(v) for v in args.batches.split(",")]:
        try:
            run(args.layers, args.hidden, args.heads, b, args.prompt, args.new, bool(args.rel_bias), dtype, args.iters)
        except Exception as e:  # one size failing still lets the others report
            print(f"DECODEPEER batch={b} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
