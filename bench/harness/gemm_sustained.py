"""The GEMM ceiling as a long run sees it (python3 gemm_sustained.py [SECONDS]).

The peers' CEIL lines time 20 GEMMs of 8192^3 (about 30 ms of work) from a
cool start. A benchmark of 30 layer steps runs the GPU for a third of a second
or more, and the H200 lowers its clocks under sustained FP8 and bf16 matrix
work, so the ceiling that bounds a step is the one measured the same way.

For bf16 (torch.matmul) and FP8 e4m3 (torch._scaled_mm, bf16 output), this
runs the quickstart TransformerLayer's 12 GEMMs (forward, dgrad and wgrad of
qkv, proj, fc1, fc2 at 8192 tokens, hidden 4096, FFN 16384: 9.90 TFLOP) back
to back as one "step", over and over for SECONDS (default 4), on random
operands, and prints per dtype:

  GEMMSTEP <dtype> first <ms> after1s <ms> last <ms> (<TFLOP/s> sustained)
  GEMM8192 <dtype> burst <TFLOP/s> sustained <TFLOP/s>

first: the median of steps 2-6; after1s: the median of the steps that start
about one second in; last: the median of the final 30 steps.
"""
import statistics
import sys
import time

import torch

dev = "cuda"
T, H, F = 8192, 4096, 16384
# (M, N, K) of each GEMM, A [M, K] times B [K, N], with B K-major as Hopper's
# FP8 GEMMs need: forward, then dgrad, then wgrad of qkv, proj, fc1, fc2.
SHAPES = [
    (T, 3 * H, H), (T, H, H), (T, F, H), (T, H, F),
    (T, H, 3 * H), (T, H, H), (T, H, F), (T, F, H),
    (3 * H, H, T), (H, H, T), (F, H, T), (H, F, T),
]
FLOPS = 2 * sum(m * n * k for m, n, k in SHAPES)


def operands(dtype):
    out = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        if dtype == "fp8":
            a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        out.append((a, b.t()))  # b.t(): [K, N], K-major
    return out


def gemm(dtype):
    if dtype == "bf16":
        return lambda a, b: a @ b
    one = torch.tensor(1.0, device=dev)
    return lambda a, b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def timed_steps(run, seconds):
    """[(start_s, ms)] of each call of run(), timed with events, for `seconds`."""
    events, t0 = [], time.time()
    while time.time() - t0 < seconds:
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        run()
        e1.record()
        events.append((time.time() - t0, e0, e1))
        if len(events) % 8 == 0:
            e1.synchronize()  # keep the queue short, so start_s means something
    torch.cuda.synchronize()
    return [(s, e0.elapsed_time(e1)) for s, e0, e1 in events]


def main():
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    for dtype in ("bf16", "fp8"):
        mm = gemm(dtype)
        ops = operands(dtype)
        step = lambda: [mm(a, b) for a, b in ops]
        time.sleep(2)  # let the previous dtype's heat go, as a fresh benchmark would see
        times = timed_steps(step, seconds)
        first = statistics.median(ms for _, ms in times[1:6])
        after1 = statistics.median(ms for s, ms in times if 0.9 <= s <= 1.3)
        last = statistics.median(ms for _, ms in times[-30:])
        print(f"GEMMSTEP {dtype} first {first:.3f} ms after1s {after1:.3f} ms last {last:.3f} ms "
              f"({FLOPS / last / 1e9:.0f} TFLOP/s sustained, {FLOPS / first / 1e9:.0f} first; "
              f"{len(times)} steps)", flush=True)
        del ops
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        if dtype == "fp8":
            a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        for _ in range(3):
            mm(a, b)
        torch.cuda.synchronize()
        time.sleep(2)
        burst = timed_steps(lambda: [mm(a, b) for _ in range(20)], 0.001)[0][1] / 20
        long = timed_steps(lambda: mm(a, b), seconds)
        sustained = statistics.median(ms for _, ms in long[-50:])
        print(f"GEMM8192 {dtype} burst {2 * n**3 / burst / 1e9:.0f} TFLOP/s "
              f"sustained {2 * n**3 / sustained / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
