"""te_client's tensor transports on one host: one float32 tensor (64 MiB by
default) up and down, inline vs streamed vs shared memory; medians and
ratios to inline. The Python counterpart of bench/transport/transport_bench.cc.

    inline  the tensor inside one message each way (SetVariables / GetVariables
            of a DenseGeneral kernel of that size)
    stream  PutTensor / GetTensor in chunk_bytes pieces
    shm     a copy into the session's registered region, then PutTensor /
            GetTensor naming region + offset

Starts its own server (bazel-bin/server/te_server, --enable_shm and
--max_message_bytes=512 MiB so one inline message fits) unless --address
names one started with those flags. Every download is checked byte for byte.

    python3 bench/transport/transport_bench.py [--mib=64] [--reps=5] [--chunk_mib=1]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import te_client as te                     # noqa: E402
import te_client.flax as te_flax           # noqa: E402

REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
MAX_MESSAGE = 512 << 20


def start_server(binary):
    folder = tempfile.mkdtemp(prefix="te_transport_bench_")
    port_file = os.path.join(folder, "port")
    log = open(os.path.join(folder, "server.log"), "w")
    process = subprocess.Popen([binary, "--device=cpu", "--host=127.0.0.1", "--port=0", "--port_file=" + port_file,
                                "--enable_shm", "--max_message_bytes=%d" % MAX_MESSAGE,
                                "--max_tensor_bytes=%d" % MAX_MESSAGE], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if os.path.exists(port_file) and open(port_file).read().strip():
            return process, "127.0.0.1:" + open(port_file).read().strip()
        time.sleep(0.05)
    process.kill()
    sys.exit("te_server did not start; see %s" % log.name)


def timed(fn, reps):
    fn()                                             # one untimed run: regions, pages, caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(client, data, reps, way):
    nbytes = data.nbytes
    with client.session(transport=way) as session:
        if way == "inline":
            side = int(round((data.size) ** 0.5))
            kernel = data.reshape(side, side)
            layer = te_flax.DenseGeneral(features=side)
            variables = layer.init(0, np.ones((1, side), np.float32))
            up = timed(lambda: session.set_variables(variables, {"params/kernel": kernel}), reps)
            back = session.get_variables(variables, ["params"])["params"]["kernel"]
            down = timed(lambda: session.get_variables(variables, ["params"]), reps)
            got = back
        else:
            resident = session.put(data)
            up = timed(lambda: session.delete(session.put(data)), reps)
            down = timed(lambda: session.get(resident), reps)
            got = session.get(resident)
        if not np.array_equal(np.asarray(got).reshape(-1), data.reshape(-1)):
            sys.exit("%s: the bytes that came back differ from those sent" % way)
        counts = session.transport_counts.as_dict()
        if way != "inline" and counts[way] == 0:
            sys.exit("%s: the session moved nothing that way (%s)" % (way, counts))
    return nbytes / up / 1e9, nbytes / down / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="a te_server started with --enable_shm and a large --max_message_bytes")
    parser.add_argument("--server_bin", default=os.environ.get(
        "TE_SERVER_BIN", os.path.join(REPO, "bazel-bin", "server", "te_server")))
    parser.add_argument("--mib", type=int, default=64, help="tensor size; a square kernel for inline (64: 4096^2)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk_mib", type=int, default=1, help="stream chunk size, 1-4")
    args = parser.parse_args()

    process, address = (None, args.address) if args.address else start_server(args.server_bin)
    try:
        client = te.connect(address, max_message_bytes=MAX_MESSAGE, chunk_bytes=args.chunk_mib << 20)
        side = int((args.mib * (1 << 20) // 4) ** 0.5)
        data = np.random.default_rng(0).standard_normal(side * side).astype(np.float32)
        print("one float32 tensor of %.1f MiB each way, median of %d, %s" % (
            data.nbytes / (1 << 20), args.reps, address))
        rates = {way: bench(client, data, args.reps, way) for way in ("inline", "stream", "shm")}
        client.close()
        base = rates["inline"]
        print("| transport | upload GB/s | download GB/s | upload x inline | download x inline |")
        print("| --- | --- | --- | --- | --- |")
        for way, (up, down) in rates.items():
            print("| %s | %.3f | %.3f | %.2f | %.2f |" % (way, up, down, up / base[0], down / base[1]))
    finally:
        if process is not None:
            process.terminate()
            process.wait()


if __name__ == "__main__":
    main()
