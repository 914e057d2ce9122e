"""The benchmarks' scripts on the CPU at tiny sizes against a real te_server, so that what the GPU
runs (bench/lm_bench.py, bench/decode_bench.py) does not rot between GPU sessions: every row the
table promises is printed with a positive rate."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_bench(script, *args):
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_lm_bench_prints_every_recipe_and_bias(server_address):
    out = run_bench("lm_bench.py", "--address=" + server_address, "--sizes=2x32x4x16x2", "--steps=2",
                    "--warmup=1", "--min_seconds=0", "--peer=", "--recipes=bf16,delayed",
                    "--bias=on,off")
    rows = [line for line in out.splitlines() if line.startswith("| 2 x 32 x 4, 16, 2 |")]
    assert len(rows) == 4, out
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        seen.add((cells[1], cells[2]))
        assert float(cells[3]) > 0, row          # tokens/s
        assert float(cells[6]) > 0, row          # the floor, ms
    assert seen == {("on", "te_server bf16"), ("on", "te_server delayed"),
                    ("off", "te_server bf16"), ("off", "te_server delayed")}, seen


def test_decode_bench_tiny_generates(server_address):
    out = run_bench("decode_bench.py", "--tiny", "--address=" + server_address, "--peer_param_dtypes=",
                    "--recipes=bf16", "--no-client_rows")
    rates = re.findall(r"\| (\d) \| te_server Generate bf16 \| [\d.]+ \| ([\d.]+) \|", out)
    assert [batch for batch, _ in rates] == ["1", "2"], out
    assert all(float(rate) > 0 for _, rate in rates), out
