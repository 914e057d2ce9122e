#!/usr/bin/env bash
# The byte-level LM of client/python/examples/train_lm.py trained on the GPU
# machine with each recipe (bf16, FP8 DelayedScaling HYBRID, Float8CurrentScaling),
# same seeds and steps, one te_server --device=cuda:0, then the loss curves
# plotted (matplotlib) into $OUT/lm_curves.png and the final losses per recipe
# (each seed's, their mean, and the mean against bf16's) into $OUT/summary.txt.
#
#   BUNDLE/run_train_lm.sh BUNDLE [STEPS] [SEEDS]   # SEEDS: "0 1" (default "0")
#   BUNDLE: te_server, run.sh, py/ (te_client, examples, proto)
# TRAIN_LM_ARGS adds train_lm.py flags (e.g. "--no-rotary").
set -u
bundle="$(cd "$1" && pwd)"; steps="${2:-1000}"; seeds="${3:-0}"
out="${OUT:-$(mktemp -d)}"
. "$(dirname "$0")/start_te_server.sh"
start_te_server
for seed in $seeds; do
  for recipe in bf16 delayed current; do
    name="lm_${recipe}_s${seed}"
    # shellcheck disable=SC2086
    TE_CLIENT_STUBS_DIR="$bundle/py/proto" timeout 170 $py "$bundle/py/examples/train_lm.py" \
      --address="$address" --recipe="$recipe" --steps="$steps" --seed="$seed" \
      --csv="$out/$name.csv" ${TRAIN_LM_ARGS:-} >"$out/$name.txt" 2>&1
    echo "train_lm --recipe=$recipe --seed=$seed: exit $?"; tail -n 2 "$out/$name.txt"
  done
done
kill "$server"; wait "$server" 2>/dev/null
plot() {
  "$1" - "$out" <<'PY'
import collections, csv, glob, os, re, sys
out = sys.argv[1]
curves = []
final = collections.defaultdict(dict)   # recipe -> seed -> (train, held-out, tokens/s)
colors = {"bf16": "tab:blue", "delayed": "tab:orange", "current": "tab:green"}
for path in sorted(glob.glob(os.path.join(out, "lm_*_s*.csv"))):
    recipe, seed = re.match(r"lm_(\w+?)_s(\d+)\.csv", os.path.basename(path)).groups()
    rows = list(csv.DictReader(open(path)))
    if not rows:
        continue
    curves.append((recipe, seed, [float(r["step"]) for r in rows], [float(r["heldout_loss"]) for r in rows]))
    last = rows[-1]
    final[recipe][seed] = (float(last["train_loss"]), float(last["heldout_loss"]),
                           sum(float(r["tokens_per_s"]) for r in rows[1:]) / max(len(rows) - 1, 1))
mean = lambda xs: sum(xs) / len(xs)
base = mean([v[1] for v in final["bf16"].values()]) if final.get("bf16") else None
with open(os.path.join(out, "summary.txt"), "w") as f:
    for recipe in ("bf16", "delayed", "current"):
        if recipe not in final:
            continue
        runs = final[recipe]
        held = mean([v[1] for v in runs.values()])
        line = "%-8s seeds %s  train %s  held-out %s  mean held-out %.4f%s  tokens/s %.0f" % (
            recipe, ",".join(sorted(runs)), " ".join("%.4f" % v[0] for v in runs.values()),
            " ".join("%.4f" % v[1] for v in runs.values()), held,
            "" if base is None or recipe == "bf16" else "  vs bf16 %+.2f%%" % (100 * (held / base - 1)),
            mean([v[2] for v in runs.values()]))
        print(line); f.write(line + "\n")
try:
    import matplotlib; matplotlib.use("Agg"); import matplotlib.pyplot as plt
except ImportError:
    sys.exit("matplotlib missing on %s: no plot" % sys.executable)
for recipe, seed, step, held in curves:
    plt.plot(step, held, color=colors.get(recipe), alpha=0.9 if seed == "0" else 0.5,
             label="%s held-out (seed %s)" % (recipe, seed))
plt.xlabel("step"); plt.ylabel("held-out loss (nats / byte)"); plt.legend(fontsize=7); plt.grid(alpha=0.3)
plt.savefig(os.path.join(out, "lm_curves.png"), dpi=120)
PY
}
plot "$py" || plot /opt/torch/.venv/bin/python || echo "matplotlib missing"
