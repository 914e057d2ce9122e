#!/usr/bin/env python3
"""The busy and idle time of each GPU step in a kernel_trace.csv.

    kernel_trace_report.py TRACE.csv [--steps N] [--min-gap-us 2]

A step is the span between two host synchronisations that has device work in
it (the Benchmark RPC synchronises before and after each step, so its steps
are exactly these spans), or with --step-starts NAME the span from one start
of a kernel whose name holds NAME to the next (a pipelined training loop
synchronises more than once a step, and not at its edges: the LM's steps
each start with one embedding lookup). For the last N steps it prints the step's wall time,
the device's busy time (the union of kernel, memcpy and memset intervals), the
idle time, the idle gaps grouped by the kernel that ends each gap, with the
host calls made during the gaps, and the kernel time by kernel class. With
--by-kernel N it also splits each class into its N costliest kernels (by name:
a template's instances apart), so a missed target's class says which kernels
make it. With --largest-gap it lists the host calls made during the last
reported step's longest idle gap, by thread (runs of one call on one thread
counted), so a gap the host causes says which thread was doing what. With
--timeline it also lists the device work of the reported step with the most
kernels (a training step's short read-back spans are steps too) in launch order (each
kernel's class, duration and the idle before it), so a class's time can be
split into the kernels that make it. Last it lists the reported steps'
memsets and memcpys by name, each with the host call that issued it and the
kernel its thread launched next, so a library's small memsets (before its own
GEMM or attention kernel) tell apart from the server's.
"""
import argparse
import collections
import csv
import itertools
import re
import sys

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")

CLASSES = [
    ("attention (cuDNN)", re.compile(r"cudnn|fmha|sdpa|flash", re.I)),
    ("gemm", re.compile(r"gemm|xmma|cutlass|sm90_|sm100_|nvjet", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("scaling update", re.compile(r"DelayedScaling|ScaleFromAmax|KeptQuantization", re.I)),
    ("quantize / transpose / cast", re.compile(r"quant|transpose|cast|amax", re.I)),
    ("activation", re.compile(r"gelu|relu|activation|swiglu|geglu", re.I)),
    ("dropout / rng", re.compile(r"dropout|rng|philox", re.I)),
    ("memcpy / memset", re.compile(r"^mem")),
]


def kernel_class(name):
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def short_name(name):
    """A kernel's name with its namespaces dropped and FP8 formats named, so a
    template's arguments fit a line."""
    for long, short in (("te::cuda::", ""), ("(anonymous namespace)::", ""),
                        ("Fp8Format<(__nv_fp8_interpretation_t)0>", "E4M3"),
                        ("Fp8Format<(__nv_fp8_interpretation_t)1>", "E5M2")):
        name = name.replace(long, short)
    return name


def load(path):
    device, host = [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rec = (int(row["start_ns"]), int(row["end_ns"]), row["name"], row["kind"])
            if row["kind"] in ("kernel", "memcpy", "memset"):
                device.append(rec)
            else:  # a host call's stream column holds its thread's id
                host.append(rec + (row["stream"],))
    device.sort()
    host.sort()
    return device, host


def load_issuers(path):
    """The device work of each correlation id (kernel, memcpy or memset name),
    the host calls in start order per thread as (start, name, correlation),
    and the memcpys and memsets as (start, name, correlation): what issued a
    copy and what its thread issued next."""
    work, calls, copies = {}, collections.defaultdict(list), []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rec = (int(row["start_ns"]), row["name"], row["correlation"])
            if row["kind"] in ("kernel", "memcpy", "memset"):
                work.setdefault(row["correlation"], row["name"])
                if row["kind"] != "kernel":
                    copies.append(rec)
            else:
                calls[row["stream"]].append(rec)
    for thread_calls in calls.values():
        thread_calls.sort()
    return work, calls, copies


def print_copies(path, spans):
    """Memsets and memcpys of the spans by name (calls per step), each with
    the host call that issued it and the next kernel its thread launched."""
    work, calls, copies = load_issuers(path)
    issued = {}  # correlation -> (the call's name, the next kernel's name)
    for thread_calls in calls.values():
        for i, (_, name, corr) in enumerate(thread_calls):
            if not work.get(corr, "").startswith("mem"):
                continue
            later = (work.get(c) for _, _, c in itertools.islice(thread_calls, i + 1, None))
            nxt = next((w for w in later if w is not None and not w.startswith("mem")), "-")
            issued[corr] = (name.split("_v")[0], nxt)
    counts = collections.Counter()
    for start, name, corr in copies:
        if any(t0 <= start < t1 for t0, t1 in spans):
            call, nxt = issued.get(corr, ("?", "-"))
            counts[(name, call, nxt)] += 1
    print("\nmemsets and memcpys (per step), by the call that issued them and the next kernel "
          "their thread launched:")
    for (name, call, nxt), c in counts.most_common(12):
        print(f"  {c / len(spans):6.1f}  {name:22s} {call:24s} {short_name(nxt)[:70]}")


def steps(device, host):
    """Spans (t0, t1) between the ends of successive synchronisations that hold device work."""
    sync_ends = sorted(h[1] for h in host if h[2].startswith(SYNC_CALLS))
    spans, i = [], 0
    for t0, t1 in zip(sync_ends, sync_ends[1:]):
        while i < len(device) and device[i][0] < t0:
            i += 1
        if i < len(device) and device[i][0] < t1:
            spans.append((t0, t1))
    return spans


def marked_steps(device, marker):
    """Spans (t0, t1) between the starts of successive kernels named with `marker`."""
    starts = [d[0] for d in device if d[3] == "kernel" and marker in d[2]]
    return list(zip(starts, starts[1:]))


def analyse(span, device, host, min_gap_ns, end_label="(end of step: host sync)"):
    t0, t1 = span
    recs = [d for d in device if d[0] >= t0 and d[1] <= t1]
    busy, cursor, gaps = 0, t0, []
    for s, e, name, kind in recs:
        if s > cursor:
            gaps.append((cursor, s, name))
        if e > cursor:
            busy += e - max(s, cursor)
            cursor = e
    if t1 > cursor:
        gaps.append((cursor, t1, end_label))
    gaps = [g for g in gaps if g[1] - g[0] >= min_gap_ns]
    return recs, busy, gaps


def host_calls_in(host, g0, g1):
    """The host calls overlapping [g0, g1) in start order, each with the
    nanoseconds of it inside the span."""
    for s, e, name, kind, thread in host:
        if s >= g1:
            break
        if e > g0:
            yield name, kind, thread, s, min(e, g1) - max(s, g0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=3, help="the last N steps")
    p.add_argument("--min-gap-us", type=float, default=2.0)
    p.add_argument("--step-starts", metavar="NAME",
                   help="a step runs from one start of a kernel whose name holds NAME to the "
                        "next, instead of between host synchronisations")
    p.add_argument("--by-kernel", type=int, default=0, metavar="N",
                   help="also list each class's N costliest kernels (ms and launches per step)")
    p.add_argument("--largest-gap", action="store_true",
                   help="list the host calls (by thread) made during the last reported step's "
                        "longest idle gap")
    p.add_argument("--timeline", action="store_true",
                   help="list the kernels of the reported step with the most kernels (the "
                        "last such) in launch order: a training step's short read-back spans "
                        "between its synchronisations are passed over")
    args = p.parse_args()
    device, host = load(args.trace)
    if args.step_starts:
        all_spans = marked_steps(device, args.step_starts)
        end_label = f"(end of step: the next {args.step_starts})"
        if not all_spans:
            sys.exit(f"no step found: fewer than two kernels named with {args.step_starts}")
    else:
        all_spans = steps(device, host)
        end_label = "(end of step: host sync)"
        if not all_spans:
            sys.exit("no step found: no device work between two synchronisations")
    spans = all_spans[-args.steps:]
    idle_by_next = collections.defaultdict(lambda: [0, 0])
    # per runtime call's name: its nanoseconds inside gaps, and the calls
    # themselves (thread, start), so one long call spanning several gaps
    # (an after-turn wait) counts once
    host_in_gaps = collections.defaultdict(lambda: [0, set()])
    by_class = collections.defaultdict(lambda: [0, 0])
    by_kernel = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    walls, busies, counts = [], [], []
    for span in spans:
        recs, busy, gaps = analyse(span, device, host, args.min_gap_us * 1e3, end_label)  # the last span's: --largest-gap
        walls.append(span[1] - span[0])
        busies.append(busy)
        counts.append(sum(1 for r in recs if r[3] == "kernel"))
        for s, e, name, kind in recs:
            label = kernel_class(name) if kind == "kernel" else "memcpy / memset"
            for c in (by_class[label], by_kernel[label][name]):
                c[0] += e - s
                c[1] += 1
        for g0, g1, nxt in gaps:
            entry = idle_by_next[nxt]
            entry[0] += g1 - g0
            entry[1] += 1
            for name, kind, thread, start, inside in host_calls_in(host, g0, g1):
                if kind == "runtime":
                    h = host_in_gaps[name]
                    h[0] += inside
                    h[1].add((thread, start))
    n = len(spans)
    ms = lambda ns: ns / n / 1e6
    wall, busy = sum(walls), sum(busies)
    print(f"steps: {n} (the last of {len(all_spans)})")
    print(f"step wall {ms(wall):.3f} ms, device busy {ms(busy):.3f} ms "
          f"({busy / wall:.3f} of the step), idle {ms(wall - busy):.3f} ms, "
          f"{sum(counts) / n:.0f} kernels per step")
    print("\nkernel time by class (ms per step, launches per step):")
    for label, (t, c) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
        print(f"  {label:30s} {ms(t):8.3f}  {c / n:5.0f}")
    if args.by_kernel > 0:
        print(f"\neach class's {args.by_kernel} costliest kernels (ms per step, launches per step):")
        for label, _ in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
            print(f"  {label}")
            kernels = sorted(by_kernel[label].items(), key=lambda kv: -kv[1][0])
            for name, (t, c) in kernels[:args.by_kernel]:
                print(f"    {ms(t):8.3f}  {c / n:6.1f}  {short_name(name)[:120]}")
    print(f"\nidle gaps >= {args.min_gap_us} us, by the work that ends them (ms per step, gaps per step):")
    for name, (t, c) in sorted(idle_by_next.items(), key=lambda kv: -kv[1][0])[:25]:
        print(f"  {ms(t):8.3f}  {c / n:5.1f}  {name[:110]}")
    print("\nruntime API time inside those gaps (ms per step, calls per step):")
    for name, (t, calls) in sorted(host_in_gaps.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {ms(t):8.3f}  {len(calls) / n:6.1f}  {name}")
    print_copies(args.trace, spans)
    if args.largest_gap:
        print_largest_gap(gaps, host)
    if args.timeline:
        busiest = max(range(n), key=lambda i: (counts[i], i))  # the last of the most kernels
        print_timeline(spans[busiest], device, n - busiest)


def print_largest_gap(gaps, host):
    """The host calls overlapping the longest of the last reported step's
    `gaps`: start (us after the gap's start), thread, and the call,
    consecutive calls of one name on one thread folded into one line with
    their count and summed time."""
    if not gaps:
        print("\nthe last reported step has no idle gap")
        return
    g0, g1, nxt = max(gaps, key=lambda g: g[1] - g[0])
    print(f"\nthe last reported step's longest idle gap: {(g1 - g0) / 1e3:.1f} us, ended by "
          f"{nxt[:80]}; host calls in it (us after its start, thread, calls, us in them):")
    runs = []  # [start, thread, name, count, ns]
    for name, _, thread, s, inside in host_calls_in(host, g0, g1):
        if runs and runs[-1][1] == thread and runs[-1][2] == name:
            runs[-1][3] += 1
            runs[-1][4] += inside
        else:
            runs.append([s, thread, name, 1, inside])
    for s, thread, name, count, ns in runs[:60]:
        print(f"  {(s - g0) / 1e3:9.1f}  {thread:>10}  {count:4d}x  {ns / 1e3:8.1f}  {name}")
    if len(runs) > 60:
        print(f"  ... {len(runs) - 60} more")


def print_timeline(span, device, from_end):
    """The step's device records in order: idle before, duration (us), class, name."""
    recs = [d for d in device if d[0] >= span[0] and d[1] <= span[1]]
    print(f"\nthe busiest reported step (the {from_end}. from the end) in launch order "
          "(us idle before, us duration, class, name):")
    cursor = span[0]
    for s, e, name, kind in recs:
        label = kernel_class(name) if kind == "kernel" else "memcpy / memset"
        print(f"  {max(0, s - cursor) / 1e3:7.1f} {(e - s) / 1e3:9.1f}  {label:28s} {name[:100]}")
        cursor = max(cursor, e)


if __name__ == "__main__":
    main()
