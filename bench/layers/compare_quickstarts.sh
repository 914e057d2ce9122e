#!/usr/bin/env bash
# The quickstart's six sections from both clients against one te_server on the
# GPU, in one run: the C++ quickstart, then the Python one (the same graphs:
# tests/data/quickstart_graphs), then JAX's own plain-Flax layer
# (jax_peers.py), with a table of the mean step times and the Python/C++ ratio.
#
#   BUNDLE/compare_quickstarts.sh BUNDLE [ITERS] [WARMUP]
#
# BUNDLE is deploy/bundle.sh's folder with te_server and quickstart, plus py/
# (client/python's te_client and examples, and the generated stubs in
# py/proto) and jax_peers.py. Outputs go to $OUT (or a temp folder).
set -u
bundle="$(cd "$1" && pwd)"; iters="${2:-10}"; warmup="${3:-3}"
out="${OUT:-$(mktemp -d)}"
. "$(dirname "$0")/start_te_server.sh"
start_te_server --session_memory_bytes=68719476736
timeout 240 "$bundle/run.sh" quickstart --server="$address" --config=quickstart --iters="$iters" \
  --warmup="$warmup" >"$out/quickstart_cc.txt" 2>&1
echo "C++ quickstart: exit $?"
TE_CLIENT_STUBS_DIR="$bundle/py/proto" timeout 240 $py "$bundle/py/examples/quickstart.py" \
  --address="$address" --config=quickstart --timing_iters="$iters" --warmup_iters="$warmup" \
  >"$out/quickstart_py.txt" 2>&1
echo "Python quickstart: exit $?"
# The TransformerLayer in FP8 and in bf16 (layer_bench's variants 6 and 7,
# the C++ client, the next step in flight as the quickstart keeps it).
timeout 240 "$bundle/run.sh" layer_bench --server="$address" --config=quickstart --variants=6,7 \
  --iters="$iters" --warmup="$warmup" --server_side=false --queued=false \
  >"$out/layer_bench.txt" 2>&1
echo "layer_bench 6,7: exit $?"
kill "$server"; wait "$server" 2>/dev/null
if [ -f "$bundle/jax_peers.py" ]; then
  timeout 150 python3 "$bundle/jax_peers.py" >"$out/jax_peers.txt" 2>&1
  echo "jax peers: exit $?"
fi
$py - "$out" <<'PY'
import re, sys, os
out = sys.argv[1]
def means(name):
    text = open(os.path.join(out, name)).read() if os.path.exists(os.path.join(out, name)) else ""
    return [float(m) for m in re.findall(r"Mean time: ([0-9.]+) ms", text)]
cc, py = means("quickstart_cc.txt"), means("quickstart_py.txt")
titles = ["1 plain Flax", "2 TE modules, Flax attention", "3 TE modules, TE attention", "4 3 under FP8",
          "5 fused TE modules, FP8", "6 TransformerLayer, FP8"]
print("| section | C++ ms | Python ms | Python / C++ |")
print("| --- | ---: | ---: | ---: |")
for i, t in enumerate(titles):
    c = cc[i] if i < len(cc) else float("nan"); p = py[i] if i < len(py) else float("nan")
    print("| %s | %.2f | %.2f | %.3f |" % (t, c, p, p / c if c else float("nan")))
bench = open(os.path.join(out, "layer_bench.txt")).read() if os.path.exists(os.path.join(out, "layer_bench.txt")) else ""
for name, title in (("v6_te_transformer_fp8", "TransformerLayer FP8 (layer_bench 6)"),
                    ("v7_te_transformer_bf16", "TransformerLayer bf16 (layer_bench 7)")):
    # The pipelined loop's mean, as the speedometers time theirs (OURS is the
    # serial loop's: each step waits for the answer before it, a round trip more).
    m = re.search(r"^OURSPIPE %s depth \d+ ([0-9.]+) ms serial ([0-9.]+) ms" % name, bench, re.M)
    print("| %s | %s | | | (serial: %s)" % (title, m.group(1) if m else "-", m.group(2) if m else "-"))
peers = open(os.path.join(out, "jax_peers.txt")).read() if os.path.exists(os.path.join(out, "jax_peers.txt")) else ""
for line in peers.splitlines():
    if line.startswith("PEER"):
        print(line)
PY
