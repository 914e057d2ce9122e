"""Why a float32 run's bf16 gradient sits near 1e-4 from the CPU reference's.

The quickstart layer's float32 case (bf16 params, float32 input) computes wo's
gradient h^T dy in float32 and stores it in bf16. The GPU's h is GELU from
cuBLASLt's fused epilogue, the CPU's its own GELU: float32 values that differ
by ~1e-6 relative. Rounded once to bf16, the elements whose two values straddle
a rounding boundary land one bf16 ulp (2^-8) apart. This models that at the
test's size (74 tokens, ffn 160, hidden 96) and prints the relative error
||a - b|| / ||b|| of the bf16 gradients, median and max over 20 draws, for each
relative perturbation of h. Run: /usr/bin/python3 bf16_flip_model.py
"""
import numpy as np

SQRT_2_OVER_PI = np.float32(0.7978845608028654)
CUBIC = np.float32(0.044715)


def to_bf16(a):
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def gelu(x):
    u = (SQRT_2_OVER_PI * (x + CUBIC * x * x * x)).astype(np.float32)
    return (x / (np.float32(1) + np.exp(np.float32(-2) * u))).astype(np.float32)


for rel in [0.0, 3e-7, 1e-6, 3e-6, 1e-5]:
    errors = []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        pre = rng.standard_normal((74, 160)).astype(np.float32)
        dy = rng.standard_normal((74, 96)).astype(np.float32)
        h = gelu(pre)
        h_other = (h * (1 + rel * rng.standard_normal(h.shape))).astype(np.float32)
        a, b = to_bf16(h_other.T @ dy), to_bf16(h.T @ dy)
        errors.append(np.linalg.norm(a - b) / np.linalg.norm(b))
    print(f"h perturbed {rel:.0e}: bf16 gradient error median {np.median(errors):.3g}, "
          f"max {np.max(errors):.3g}")
