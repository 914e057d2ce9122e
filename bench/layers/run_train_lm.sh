#!/usr/bin/env bash
# The byte-level LM of client/python/examples/train_lm.py trained on the GPU
# machine with each recipe (bf16, FP8 DelayedScaling HYBRID, Float8CurrentScaling),
# same seed and steps, one te_server --device=cuda:0, then the loss curves
# plotted (matplotlib) into $OUT/lm_curves.png.
#
#   BUNDLE/run_train_lm.sh BUNDLE [STEPS]   # BUNDLE: te_server, run.sh, py/ (te_client, examples, proto)
set -u
bundle="$(cd "$1" && pwd)"; steps="${2:-1000}"
out="${OUT:-$(mktemp -d)}"
py=python3
$py -c "import grpc, google.protobuf, numpy" 2>/dev/null || py=/opt/torch/.venv/bin/python
port_file="$(mktemp)"; rm -f "$port_file"
"$bundle/run.sh" te_server --device=cuda:0 --host=127.0.0.1 --port=0 --port_file="$port_file" \
  >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do [ -s "$port_file" ] && break; sleep 0.1; done
for recipe in bf16 delayed current; do
  TE_CLIENT_STUBS_DIR="$bundle/py/proto" timeout 170 $py "$bundle/py/examples/train_lm.py" \
    --address="127.0.0.1:$(cat "$port_file")" --recipe="$recipe" --steps="$steps" \
    --csv="$out/lm_$recipe.csv" >"$out/lm_$recipe.txt" 2>&1
  echo "train_lm --recipe=$recipe: exit $?"; tail -n 3 "$out/lm_$recipe.txt"
done
kill "$server"; wait "$server" 2>/dev/null
$py - "$out" <<'PY' || /opt/torch/.venv/bin/python - "$out" <<'PY2'
import csv, os, sys
import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
out = sys.argv[1]
for recipe in ("bf16", "delayed", "current"):
    path = os.path.join(out, "lm_%s.csv" % recipe)
    if not os.path.exists(path): continue
    rows = list(csv.DictReader(open(path)))
    keys = list(rows[0].keys()) if rows else []
    print(recipe, keys[:6], len(rows))
    step = [float(r[keys[0]]) for r in rows]
    for k in keys[1:]:
        vals = [float(r[k]) if r[k] not in ("", "nan") else float("nan") for r in rows]
        if "loss" in k: plt.plot(step, vals, label="%s %s" % (recipe, k))
plt.xlabel("step"); plt.ylabel("loss (nats / byte)"); plt.legend(); plt.grid(alpha=0.3)
plt.savefig(os.path.join(out, "lm_curves.png"), dpi=120)
PY
import sys; print("matplotlib missing on", sys.executable)
PY2
