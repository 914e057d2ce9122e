"""Every tolerance the Python tests use, in one place, with the measure it bounds.

rel_err(a, b) = ||a - b|| / ||b|| over all elements, in float64.
"""
import numpy as np

F32 = 1e-5           # float32 compute on the server vs a float64 numpy reference
BF16 = 1e-2          # bf16 inputs / compute (8 mantissa bits, DESIGN.md section 6)
FP8 = 0.1            # FP8 (E4M3 forward, 3 mantissa bits: 2^-4 relative per cast, a few casts per GEMM)
FINITE_DIFF = 2e-2   # a central difference of a float32 layer vs its analytic directional derivative
FD_EPS = 1e-2        # the central difference's step, relative to the input's RMS


def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

# The zoo (test_zoo.py): a loss graph run on the server against graph_reference.py's float64
# evaluation of the same graph, as (|loss - reference| / max(1, |reference|), rel_err of each
# parameter's gradient; aux outputs as rel_err within the loss's bound):
ZOO = {
    "float32": (1e-4, 1e-3),   # float32 compute (matmul precision "highest")
    # bf16 inputs (and bf16 compute in the MLP and GPT block): a weight gradient sums bf16-rounded
    # products of bf16-rounded activations and dy, a few roundings deep (measured up to 4.1e-2).
    "bf16": (BF16, 6 * BF16),
    # The TE GEMMs in FP8 against an unquantized float64 reference: E4M3 activations and weights
    # (2^-4 relative per element), E5M2 gradients (2^-3) in the dgrad / wgrad GEMMs, and relu gates
    # that flip where the FP8 forward moves a pre-activation across 0 (measured up to 0.28, the
    # MLP's first bias after 4 steps; the losses stay within FP8).
    "fp8": (FP8, 3 * FP8),
}
