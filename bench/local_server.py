"""A te_server for a benchmark: the one at --address, or one this process starts from a command
(a bundle's `run.sh te_server`, bazel-bin's binary) on a free port, stopped at the end."""
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time


@contextlib.contextmanager
def te_server(address, command, device, flags="", prefix="bench_"):
    """Yields the address to use: `address` when `command` is empty; else that of a te_server
    started as `command --device=DEVICE FLAGS` on 127.0.0.1, whose log stays in a temporary folder
    (its tail is printed if it exits before listening)."""
    if not command:
        yield address
        return
    folder = tempfile.mkdtemp(prefix=prefix)
    port_file, log_path = os.path.join(folder, "port"), os.path.join(folder, "server.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(shlex.split(command) + shlex.split(flags) +
                                   ["--device=" + device, "--host=127.0.0.1", "--port=0",
                                    "--port_file=" + port_file],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if process.poll() is not None:
                sys.exit("te_server exited; its log: %s\n%s" % (log_path, open(log_path).read()[-3000:]))
            time.sleep(0.1)
        else:
            sys.exit("te_server wrote no port within 60 s; its log: %s" % log_path)
        yield "127.0.0.1:%s" % open(port_file).read().strip()
    finally:
        process.terminate()
        process.wait()
