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
    assert "Pure Flax FlaxTransformerLayer initialized successfully!" in out
    assert "Parameter shapes: {'params': {'BasicMLP_0'" in out
    assert "Output shape: (2, 128, 256)" in out and "Output dtype: bfloat16" in out
    assert "'fp8_metas': {'DenseGeneral_0': {'grad_amax_history': (16,)" in out
    assert "'MultiHeadDotProductAttention_0': {'key'" in out
