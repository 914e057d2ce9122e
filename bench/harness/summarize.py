#!/usr/bin/env python3
"""Summarises a GPU benchmark run (bench/harness/run_gpu_bench.sh) as a Markdown table.

Reads the run's lines (files named on the command line, or stdin):
  OURS <variant> <server ms|-> <client ms|-> <peak MiB|->     (layer_bench)
  OURS <variant> FAILED <message>
  MODULE <variant> <module> <server ms>                      (a chained variant's parts; older runs)
  PEER <name> <ms per step> [...]  |  PEER <name> FAILED ...  (jax_peers.py, torch_peers.py)
  PEERMEM <name> <peak MiB>                                  (jax_memory.py)
  CEIL bf16 gemm 8192^3: <T> TFLOP/s  |  CEIL fp8 gemm ...    (torch_peers.py)
  CONFIG batch B seq S hidden E ffn F heads H ...            (layer_bench; default: the quickstart's)
  SETUP <text>                                               (the harness: GPU, commit, command)
  STAGE <name> FAILED|TIMED OUT|SKIPPED ...                  (the harness: a stage that did not finish)
and, with --te_bench_json, te_bench's JSON report (the many-client figures).

Prints the table (and the targets of issues 3 and 4) and writes it to $OUT/bench.md when OUT is
set (or to --out).

FLOPs of one forward + backward step of the layer (tokens M = B*S, head dim D = E/H):
  GEMMs: the forward has 4 (qkv: M x E -> 3E, proj: E -> E, fc1: E -> F, fc2: F -> E), each
         2*M*N*K FLOPs; the backward has a dgrad and a wgrad of the same size per GEMM, so the
         12 GEMMs of a step cost 3 * 2*M*E*(3E + E + F + F).
  attention: forward Q K^T and P V, 2*B*H*S*S*D each (4*B*H*S^2*D); backward dV, dP, dQ, dK,
         2*B*H*S^2*D each (8*B*H*S^2*D; flash attention's recompute of Q K^T not counted);
         causal masking halves both: 6*B*H*S^2*D.
The floor of a variant is the time at the measured ceilings: GEMM FLOPs / GEMM ceiling (the FP8
ceiling for FP8 variants, whose GEMMs all run in FP8 as HYBRID does; bf16 otherwise) plus the
attention FLOPs / the bf16 ceiling (attention stays bf16). "x floor" is ms / floor ms (>= 1).
Elementwise work (norms, GELU, casts, dropout) is not counted: it is memory-bound and part of what
the floor ratio measures.
"""
import argparse
import json
import os
import re
import sys

# ENV.md's H200 ceilings, used only when the run printed no CEIL line (and said so).
FALLBACK_CEIL_TFLOPS = {"bf16": 813.0, "fp8": 1492.0}

QUICKSTART = {"batch": 4, "seq": 2048, "hidden": 4096, "ffn": 16384, "heads": 32}

# The performance targets: ours / best peer (FP8 and bf16), client / server with
# resident tensors, and many clients on one and two GPUs.
TARGETS = {
    "v6_te_transformer_fp8": 0.75,
    "v7_te_transformer_bf16": 1.0,
}
CLIENT_OVER_SERVER_MAX = 1.03
MULTI_CLIENT_THROUGHPUT_MIN = 0.95
MULTI_CLIENT_FAIRNESS_MIN = 0.8


def gemm_flops(c):
    m = c["batch"] * c["seq"]
    e, f = c["hidden"], c["ffn"]
    return 3 * 2 * m * e * (3 * e + e + f + f)


def attention_flops(c):
    d = c["hidden"] // c["heads"]
    return 6 * c["batch"] * c["heads"] * c["seq"] ** 2 * d


def is_fp8(name):
    return "fp8" in name


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def parse(lines):
    """The run's figures from its output lines; unknown lines are ignored."""
    run = {"ours": {}, "modules": {}, "peers": {}, "peer_mem": {}, "ceil": {}, "config": dict(QUICKSTART),
           "setup": [], "failed": {}}
    for raw in lines:
        line = raw.strip()
        parts = line.split()
        if not parts:
            continue
        kind = parts[0]
        if kind == "OURS" and len(parts) >= 3:
            name = parts[1]
            if parts[2] == "FAILED":
                run["failed"][name] = " ".join(parts[2:])
                continue
            vals = [(_number(p) if p != "-" else None) for p in (parts[2:5] + ["-"] * 3)[:3]]
            run["ours"][name] = {"server": vals[0], "client": vals[1], "mem": vals[2]}
        elif kind == "MODULE" and len(parts) >= 4:
            run["modules"].setdefault(parts[1], []).append((parts[2], _number(parts[3])))
        elif kind == "PEER" and len(parts) >= 3:
            if parts[2] == "FAILED":
                run["failed"][parts[1]] = " ".join(parts[2:])
            elif _number(parts[2]) is not None:
                run["peers"][parts[1]] = _number(parts[2])
        elif kind == "PEERMEM" and len(parts) >= 3:
            if _number(parts[2]) is not None:
                run["peer_mem"][parts[1]] = _number(parts[2])
        elif kind == "CEIL":
            m = re.match(r"CEIL (bf16|fp8) gemm .*?:\s*([0-9.]+)\s*TFLOP/s", line)
            if m:
                run["ceil"][m.group(1)] = float(m.group(2))
        elif kind == "CONFIG":
            for key in QUICKSTART:
                m = re.search(r"\b%s (\d+)" % key, line)
                if m:
                    run["config"][key] = int(m.group(1))
        elif kind == "STAGE" and len(parts) >= 3:  # the harness: a stage failed, timed out or was skipped
            run["failed"]["stage " + parts[1]] = " ".join(parts[2:])
        elif kind == "SETUP":
            run["setup"].append(line[len("SETUP "):])
    return run


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def summarize(run, te_bench=None):
    """The Markdown report: setup, the table, the formula, the targets."""
    c = run["config"]
    g, a = gemm_flops(c), attention_flops(c)
    total = g + a
    ceil = {}
    notes = []
    for kind in ("bf16", "fp8"):
        if kind in run["ceil"]:
            ceil[kind] = run["ceil"][kind]
        else:
            ceil[kind] = FALLBACK_CEIL_TFLOPS[kind]
            notes.append(f"no CEIL {kind} line in this run: the floor uses ENV.md's {ceil[kind]:.0f} TFLOP/s")

    def floor_ms(fp8):
        gemm_ceil = ceil["fp8"] if fp8 else ceil["bf16"]
        return g / (gemm_ceil * 1e9) + a / (ceil["bf16"] * 1e9)

    best_peer = min(run["peers"].items(), key=lambda kv: kv[1]) if run["peers"] else None
    out = ["# GPU benchmark: the quickstart layer, forward + backward", ""]
    if run["setup"]:
        out += [f"- {s}" for s in run["setup"]] + [""]
    out.append(f"Layer: batch {c['batch']}, seq {c['seq']}, hidden {c['hidden']}, FFN {c['ffn']}, "
               f"{c['heads']} heads, bf16 inputs, causal. FLOPs per step: {g / 1e12:.3f} T in the 12 GEMMs "
               f"+ {a / 1e12:.3f} T in attention = {total / 1e12:.3f} T. Ceilings (measured): bf16 "
               f"{ceil['bf16']:.0f}, FP8 {ceil['fp8']:.0f} TFLOP/s; floor bf16 {floor_ms(False):.2f} ms, "
               f"FP8 {floor_ms(True):.2f} ms. Best peer: "
               + (f"{best_peer[0]} {best_peer[1]:.2f} ms." if best_peer else "none measured."))
    out.append("")
    out.append("| variant | timed by | ms/step | TFLOP/s | x floor | x best peer | client ms | client/server | peak MiB |")
    out.append("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def row(name, timed_by, ms, fp8, client=None, server=None, mem=None):
        tflops = total / (ms * 1e9) if ms else None
        x_floor = ms / floor_ms(fp8) if ms else None
        x_peer = ms / best_peer[1] if (ms and best_peer) else None
        c_over_s = client / server if (client and server) else None
        out.append(f"| {name} | {timed_by} | {_fmt(ms)} | {_fmt(tflops, 0)} | {_fmt(x_floor)} | {_fmt(x_peer)} "
                   f"| {_fmt(client)} | {_fmt(c_over_s, 3)} | {_fmt(mem, 0)} |")
        return x_peer, c_over_s

    ratios = {}
    for name in sorted(run["ours"]):
        r = run["ours"][name]
        modules = run["modules"].get(name, [])
        if r["server"] is not None:
            ms = r["server"]
            timed_by = f"server (sum of {len(modules)} modules)" if modules else "server"
        else:
            ms, timed_by = r["client"], "client"
        ratios[name] = row(name, timed_by, ms, is_fp8(name), r["client"], r["server"], r["mem"])
    for name in sorted(run["failed"]):
        out.append(f"| {name} | {run['failed'][name][:120]} | - | - | - | - | - | - | - |")
    for name, ms in sorted(run["peers"].items(), key=lambda kv: kv[1]):
        row(f"peer: {name}", "peer", ms, False, mem=run["peer_mem"].get(name))
    out.append("")
    out.append("ms/step: the server's Benchmark RPC where there is one (variants 1-5 run as one server "
               "graph each), else the client's wall time; client ms: per step as the client sees it, "
               "inputs resident. x floor: ms over the FLOPs at the measured GEMM ceilings (see summarize.py). "
               "Peak MiB: the device memory a variant's session added (ours: nvidia-smi before and after, "
               "which includes the caching allocator's slack); JAX's: peak_bytes_in_use of one step.")
    for n in notes:
        out.append(f"Note: {n}.")

    out += ["", "## Targets", ""]
    for name, limit in TARGETS.items():
        x_peer = ratios.get(name, (None, None))[0]
        out.append(f"- {name}: {_fmt(x_peer)} x the best peer (target <= {limit}): " + _verdict(x_peer, limit))
    c_over_s = ratios.get("v6_te_transformer_fp8", (None, None))[1]
    out.append(f"- v6_te_transformer_fp8 client / server time: {_fmt(c_over_s, 3)} (target <= "
               f"{CLIENT_OVER_SERVER_MAX}): " + _verdict(c_over_s, CLIENT_OVER_SERVER_MAX))
    if te_bench is not None:
        out += multi_client_lines(te_bench)
    return "\n".join(out) + "\n"


def _verdict(value, limit, at_least=False):
    if value is None:
        return "not measured"
    ok = value >= limit if at_least else value <= limit
    return "met" if ok else "missed"


def multi_client_lines(report):
    """N clients on one GPU against one client, from te_bench's JSON."""
    points = sorted(report.get("points", []), key=lambda p: p["clients"])
    if not points:
        return ["- te_bench: no points"]
    one = next((p for p in points if p["clients"] == 1), None)
    many = points[-1]
    out = [f"- te_bench ({report.get('layer')} {report.get('op')}, fp8 {report.get('fp8')}): " + "; ".join(
        f"{p['clients']} clients {p['steps_per_s']:.1f} steps/s, p50 {p['latency_ms']['p50']:.2f} ms, "
        f"slowest/fastest {p['fairness']['slowest_over_fastest']:.2f}, errors {sum(p['errors'].values())}"
        for p in points)]
    if one is not None and many is not one and one["steps_per_s"] > 0:
        ratio = many["steps_per_s"] / one["steps_per_s"]
        out.append(f"- {many['clients']} clients' aggregate throughput / 1 client's: {ratio:.3f} (target >= "
                   f"{MULTI_CLIENT_THROUGHPUT_MIN}): " + _verdict(ratio, MULTI_CLIENT_THROUGHPUT_MIN, True))
        fair = many["fairness"]["slowest_over_fastest"]
        out.append(f"- {many['clients']} clients' slowest / fastest: {fair:.3f} (target >= "
                   f"{MULTI_CLIENT_FAIRNESS_MIN}): " + _verdict(fair, MULTI_CLIENT_FAIRNESS_MIN, True))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="*", help="files with the run's lines (default: stdin)")
    ap.add_argument("--te_bench_json", help="te_bench's JSON report")
    ap.add_argument("--out", help="write the table here (default: $OUT/bench.md when OUT is set)")
    args = ap.parse_args(argv)
    lines = []
    if args.logs:
        for path in args.logs:
            try:
                with open(path, errors="replace") as f:
                    lines += f.readlines()
            except OSError as e:
                print(f"summarize: cannot read {path}: {e}", file=sys.stderr)
    else:
        lines = sys.stdin.readlines()
    te_bench = None
    if args.te_bench_json:
        try:
            with open(args.te_bench_json) as f:
                te_bench = json.load(f)
        except (OSError, ValueError) as e:
            print(f"summarize: no te_bench report ({e})", file=sys.stderr)
    report = summarize(parse(lines), te_bench)
    print(report, end="")
    out = args.out or (os.path.join(os.environ["OUT"], "bench.md") if os.environ.get("OUT") else None)
    if out:
        with open(out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
