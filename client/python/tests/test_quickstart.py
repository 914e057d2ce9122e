"""examples/quickstart.py end to end against the test server (small config, few iterations)."""
import os
import subprocess
import sys


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "quickstart.py")


def test_quickstart_runs_every_section(server_address):
    run = subprocess.run([sys.executable, EXAMPLE, "--address=" + server_address, "--warmup_iters=1",
                          "--timing_iters=1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout
    assert out.count("Mean time: ") == 6, out
    assert "Skipped" not in out
    # The plain-Flax layer is the notebook's class: Flax's own modules, Flax's tree, float32 out of bf16 in.
    assert "Parameter shapes: {'params': {'Dense_0': {'bias': (192,), 'kernel': (64, 192)}, 'FlaxMLP_0'" in out
    assert "'MultiHeadDotProductAttention_0': {'key': {'bias': (4, 4), 'kernel': (64, 4, 4)}" in out
    assert "Output shape: (2, 32, 64)" in out and "Output dtype: float32" in out
    # The composed layers are one graph each, their variables under Flax's paths.
    assert "'fp8_metas': {'DenseGeneral_0': {'grad_amax_history': (16,)" in out
    assert "'TEUnfusedMLP_0': {'DenseGeneral_0': {'bias': (256,), 'kernel': (64, 256)}" in out
