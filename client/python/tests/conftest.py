"""Fixtures: a real te_server on a loopback port (built beforehand; this file builds nothing).

The server is bazel-bin/server/te_server (or $TE_SERVER_BIN), started once per
test run with --device=cpu (or $TE_SERVER_DEVICE) --port=0 and stopped at the
end; its log goes to the pytest temp folder and is printed when it fails to start.

$TE_SERVER_ADDRESS ("host:port") runs the tests that use the default server
against one already running there instead (a CUDA te_server on a GPU host;
set TE_SERVER_DEVICE=cuda to match); tests that start servers of their own
still need the binary, so select the others, e.g. the zoo:

    TE_SERVER_ADDRESS=127.0.0.1:50051 TE_SERVER_DEVICE=cuda \
        python3 -m pytest client/python/tests/test_zoo.py -k "mlp or gpt"
"""
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PYTHON_ROOT = os.path.dirname(TESTS_DIR)
REPO_ROOT = os.path.dirname(os.path.dirname(PYTHON_ROOT))
sys.path.insert(0, PYTHON_ROOT)

import te_client  # noqa: E402  (after the path is set)

SERVER_BIN = os.environ.get("TE_SERVER_BIN", os.path.join(REPO_ROOT, "bazel-bin", "server", "te_server"))
SERVER_DEVICE = os.environ.get("TE_SERVER_DEVICE", "cpu")
SERVER_ADDRESS = os.environ.get("TE_SERVER_ADDRESS", "")   # a running server to use instead of starting one
START_TIMEOUT_S = 60.0


def _read_port(port_file, process, log_path):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    with open(log_path) as f:
        log = f.read()[-4000:]
    pytest.fail("te_server did not write its port within %gs (exit code %s); log tail:\n%s" % (
        START_TIMEOUT_S, process.poll(), log), pytrace=False)


@dataclasses.dataclass(frozen=True)
class Server:
    address: str
    pid: int
    log_path: str


@contextlib.contextmanager
def start_server(folder, *flags, port=0):
    """A te_server on 127.0.0.1 (`port` 0: one it picks) with extra `flags`,
    stopped (SIGTERM) when the block ends."""
    if not os.access(SERVER_BIN, os.X_OK):
        pytest.fail("no te_server at %s: build it first (bazel build //server:te_server) or set "
                    "TE_SERVER_BIN" % SERVER_BIN, pytrace=False)
    port_file, log_path = str(folder / "port"), str(folder / "server.log")
    with open(log_path, "w") as log:
        process = subprocess.Popen([SERVER_BIN, "--device=" + SERVER_DEVICE, "--host=127.0.0.1",
                                    "--port=%d" % port, "--port_file=" + port_file] + list(flags),
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Server("127.0.0.1:%d" % _read_port(port_file, process, log_path), process.pid, log_path)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def server_address(tmp_path_factory):
    """The default server: no --enable_shm ($TE_SERVER_ADDRESS when set)."""
    if SERVER_ADDRESS:
        yield SERVER_ADDRESS
        return
    with start_server(tmp_path_factory.mktemp("te_server")) as server:
        yield server.address


@pytest.fixture(scope="session")
def shm_server(tmp_path_factory):
    """A second server, started with --enable_shm (a Server: address, pid)."""
    with start_server(tmp_path_factory.mktemp("te_server_shm"), "--enable_shm") as server:
        yield server


@pytest.fixture(scope="session")
def server_device():
    return SERVER_DEVICE


@pytest.fixture(scope="session")
def client(server_address):
    c = te_client.connect(server_address)
    yield c
    c.close()


@pytest.fixture
def session(client):
    """A fresh session per test, current for module calls, closed afterwards."""
    with client.session() as s:
        yield s


@pytest.fixture
def rng(request):
    # Random data, never zeros; a fixed seed per test (its name) so failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))
