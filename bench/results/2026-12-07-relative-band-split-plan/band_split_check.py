"""Checks, in float64 numpy, that causal attention with TE's T5 relative bias
splits into a bias-free causal attention on shifted views (the keys W or more
positions back, all in the saturated far bucket) and a band of W diagonals,
forward (outputs merged by their log-sum-exps) and backward (each part's
gradients from the merged output and log-sum-exp), with the table's gradient
from the band alone. W is where the causal buckets saturate (uniform_from).

    /usr/bin/python3 band_split_check.py
"""
import math

import numpy as np


def t5_buckets(seq, num_buckets=32, max_distance=128):
    """Causal T5 buckets [S, S] of i - j (TE's RelativePositionBiases, bidirectional=False)."""
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    n = np.maximum(i - j, 0)
    exact = num_buckets // 2
    large = exact + (np.log(np.maximum(n, 1) / exact) / math.log(max_distance / exact)
                     * (num_buckets - exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return np.where(n < exact, n, large)


def dense_reference(q, k, v, do, table, buckets, scale):
    B, H, S, D = q.shape
    bias = table[:, buckets]  # [H, S, S]
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale + bias[None]
    mask = np.tril(np.ones((S, S), bool))
    s = np.where(mask, s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    p = np.exp(s - lse[..., None])
    o = np.einsum("bhij,bhjd->bhid", p, v)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    delta = (do * o).sum(-1)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhij,bhjd->bhid", ds, k) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * scale
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    dtable = np.zeros_like(table)
    for h in range(H):
        np.add.at(dtable[h], buckets[mask], ds[:, h][:, mask].sum(0))
    return o, lse, dq, dk, dv, dtable


def causal_no_bias(q, k, v, scale):
    """What cuDNN's plain causal forward gives: O and the log-sum-exp per row."""
    S = q.shape[2]
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    return np.einsum("bhij,bhjd->bhid", np.exp(s - lse[..., None]), v), lse


def causal_no_bias_backward(q, k, v, o, do, stats, scale):
    """cuDNN's plain causal backward: P recomputed as exp(s - stats), delta from o."""
    S = q.shape[2]
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    p = np.exp(s - stats[..., None])
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (do * o).sum(-1)[..., None])
    return (np.einsum("bhij,bhjd->bhid", ds, k) * scale, np.einsum("bhij,bhid->bhjd", ds, q) * scale,
            np.einsum("bhij,bhid->bhjd", p, do))


def split(q, k, v, do, table, buckets, scale, W):
    B, H, S, D = q.shape
    far_bucket = buckets[S - 1, S - 1 - W] if S > W else 0
    c = table[:, far_bucket][None, :, None]  # the far keys' one bias value, per head
    i = np.arange(S)[:, None]
    j = np.arange(S)[None, :]
    band = (i - j >= 0) & (i - j < W)
    # Band forward (the fused kernel's work): S x W scores, the bias looked up by distance.
    s_band = np.einsum("bhid,bhjd->bhij", q, k) * scale + table[:, buckets][None]
    s_band = np.where(band, s_band, -np.inf)
    lse_band = np.logaddexp.reduce(s_band, axis=-1)
    o_band = np.einsum("bhij,bhjd->bhid", np.exp(s_band - lse_band[..., None]), v)
    # Far forward: plain causal attention of queries W.. against keys ..S-W, no bias.
    o_far = np.zeros_like(q)
    lse_far = np.full(q.shape[:3], -np.inf)
    if S > W:
        o_f, l_f = causal_no_bias(q[:, :, W:], k[:, :, :S - W], v[:, :, :S - W], scale)
        o_far[:, :, W:] = o_f
        lse_far[:, :, W:] = l_f + c  # the far bias shifts the log-sum-exp only
    # Merge by log-sum-exp.
    lse = np.logaddexp(lse_band, lse_far)
    o = (o_band * np.exp(lse_band - lse)[..., None]
         + o_far * np.exp(np.where(np.isinf(lse_far), -np.inf, lse_far - lse))[..., None])
    # Backward. Far: cuDNN's plain backward on the shifted views with the merged o and
    # stats = lse - c (its P = exp(s - stats) is then the merged softmax on far keys).
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    if S > W:
        dq_f, dk_f, dv_f = causal_no_bias_backward(
            q[:, :, W:], k[:, :, :S - W], v[:, :, :S - W], o[:, :, W:], do[:, :, W:],
            lse[:, :, W:] - c, scale)
        dq[:, :, W:] += dq_f
        dk[:, :, :S - W] += dk_f
        dv[:, :, :S - W] += dv_f
    # Band backward (the fused kernel's work), with the merged lse and delta.
    p = np.where(band, np.exp(s_band - lse[..., None]), 0.0)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = np.where(band, p * (dp - (do * o).sum(-1)[..., None]), 0.0)
    dq += np.einsum("bhij,bhjd->bhid", ds, k) * scale
    dk += np.einsum("bhij,bhid->bhjd", ds, q) * scale
    dv += np.einsum("bhij,bhid->bhjd", p, do)
    # dtable from the band alone: each row's dS sums to zero, so the far bucket takes
    # minus the band's sum of every row that has far keys.
    dtable = np.zeros_like(table)
    for h in range(H):
        np.add.at(dtable[h], buckets[band], ds[:, h][:, band].sum(0))
        dtable[h, far_bucket] -= ds[:, h, W:, :].sum()
    return o, lse, dq, dk, dv, dtable


def main():
    rng = np.random.default_rng(7)
    for (B, H, S, D) in [(2, 3, 200, 16), (1, 2, 130, 8), (2, 2, 96, 8)]:
        buckets = t5_buckets(S)
        # W: the first distance from which every bucket is the last one (113 for TE's
        # 32 buckets over 128 positions); S when no key is that far back.
        by_distance = buckets[S - 1, ::-1]  # bucket of distance 0 .. S-1
        W = next((d for d in range(S) if np.all(by_distance[d:] == 31)), S)
        q, k, v, do = (rng.standard_normal((B, H, S, D)) for _ in range(4))
        table = rng.standard_normal((H, 32))
        scale = 1.0 / math.sqrt(D)
        ref = dense_reference(q, k, v, do, table, buckets, scale)
        got = split(q, k, v, do, table, buckets, scale, W)
        names = ["out", "lse", "dq", "dk", "dv", "dtable"]
        worst = max(np.max(np.abs(a - b)) / max(1.0, np.max(np.abs(a))) for a, b in zip(ref, got))
        print(f"B{B} H{H} S{S} D{D} W{W}: largest relative difference over "
              f"{', '.join(names)}: {worst:.2e}")
        assert worst < 1e-10, worst
    print("the split matches the dense-bias attention in float64")


if __name__ == "__main__":
    main()
