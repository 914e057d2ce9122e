#!/usr/bin/env python3
"""Where two kernel_trace.csv(.gz) runs of the same workload differ: device time and count per
kernel (and per runtime call, memcpy and memset), A against B, largest differences first.

    kernel_trace_diff.py A.csv.gz B.csv.gz [--top 25]

Made for one change at a time (TE's relative bias on against off): the rows that the change adds
or slows are at the top. Names are cut at 90 characters.
"""
import argparse
import collections
import csv
import gzip


def totals(path, kind):
    opener = gzip.open if path.endswith(".gz") else open
    out = collections.defaultdict(lambda: [0.0, 0])
    with opener(path, "rt") as f:
        for row in csv.DictReader(f):
            if row["kind"] != kind:
                continue
            entry = out[row["name"][:90]]
            entry[0] += (int(row["end_ns"]) - int(row["start_ns"])) / 1e6
            entry[1] += 1
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for kind in ("kernel", "memcpy", "runtime"):
        a, b = totals(args.a, kind), totals(args.b, kind)
        print("== %s: A %.1f ms, B %.1f ms (ms, count in A | in B | A - B ms)" % (
            kind, sum(v[0] for v in a.values()), sum(v[0] for v in b.values())))
        names = sorted(set(a) | set(b), key=lambda n: -abs(a.get(n, [0, 0])[0] - b.get(n, [0, 0])[0]))
        for name in names[:args.top]:
            x, y = a.get(name, [0.0, 0]), b.get(name, [0.0, 0])
            print("%9.1f %6d | %9.1f %6d | %+9.1f  %s" % (x[0], x[1], y[0], y[1], x[0] - y[0], name))


if __name__ == "__main__":
    main()
