"""How a client fails: its default deadline, a refused connection, a stopped server, a closed client."""
import os
import signal
import socket
import time

import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import client as client_lib
from conftest import start_server


def test_default_deadline_is_minutes_not_half_an_hour():
    assert 60 <= client_lib.Options().rpc_timeout <= 300
    assert te.connect.__defaults__[0] <= 30        # connect's own wait


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]     # closed again: nothing listens there


def test_connection_refused_says_so_at_once():
    address = "127.0.0.1:%d" % _free_port()
    start = time.monotonic()
    with pytest.raises(te.UnavailableError, match="connection refused at %s" % address) as raised:
        te.connect(address, timeout=30.0)
    assert time.monotonic() - start < 5.0       # not the 30 s connect timeout
    assert raised.value.code.name == "UNAVAILABLE"


def test_a_stopped_server_fails_the_call_at_its_deadline(tmp_path, rng):
    with start_server(tmp_path) as server:
        client = te.connect(server.address, rpc_timeout=1.5)
        try:
            with client.session():
                x = rng.standard_normal((2, 4)).astype(np.float32)
                params = te_flax.DenseGeneral(features=3).init(0, x)
                os.kill(server.pid, signal.SIGSTOP)
                try:
                    _wait_stopped(server.pid)
                    start = time.monotonic()
                    with pytest.raises(te.DeadlineExceededError,
                                       match=r"Forward: no answer from the te_server at %s within 1.5 s" %
                                       server.address):
                        te_flax.DenseGeneral(features=3).apply(params, x)
                    assert time.monotonic() - start < 10.0
                    with pytest.raises(te.DeadlineExceededError, match="GetServerInfo"):
                        client.server_info()
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                assert layer_still_answers(params, x)
        finally:
            client.close()


def _wait_stopped(pid):
    # The stop reaches a multi-threaded process a moment after kill() returns.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open("/proc/%d/stat" % pid) as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    pytest.fail("te_server (pid %d) did not stop" % pid)


def layer_still_answers(params, x):
    return te_flax.DenseGeneral(features=3).apply(params, x).shape == (2, 3)


def test_calls_after_close_raise_a_te_error(server_address, rng):
    client = te.connect(server_address)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    with client.session() as session:
        params = te_flax.DenseGeneral(features=3).init(0, x)
        client.close()
        client.close()                                           # a second close is a no-op
        with pytest.raises(te.FailedPreconditionError, match="client of %s is closed" % server_address):
            client.server_info()
        with pytest.raises(te.FailedPreconditionError, match="closed"):
            session.info()
        with pytest.raises(te.FailedPreconditionError, match="closed"):
            session.call_async("GetSessionInfo", client_lib.service_pb2.GetSessionInfoRequest())
        with pytest.raises(te.FailedPreconditionError, match="closed"):
            session.put(np.zeros(4 << 20, np.float32))            # a stream
        with pytest.raises(te.FailedPreconditionError, match="closed"):
            te_flax.DenseGeneral(features=3).apply(params, x)
        with pytest.raises(te.FailedPreconditionError, match="closed"):
            client.session()
        with pytest.raises(te.FailedPreconditionError, match="CloseSession"):
            session.close()        # the server drops it at its TTL; the block's own close is then a no-op


def test_a_process_that_never_closes_its_client_exits_at_once(server_address, tmp_path):
    # deploy/container/container_check.py's `hold` steps a DelayedScaling session and exits with it
    # open (the container test restarts the server under it). gRPC's channel must be closed at exit,
    # not left to a finalizer: that one waited forever on its frozen connectivity thread.
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(te.__file__))))
    start = time.monotonic()
    run = subprocess.run([sys.executable, os.path.join(repo, "deploy", "container", "container_check.py"), "hold",
                          server_address, str(tmp_path / "held.json")], capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "open with a stepped layer" in run.stdout and time.monotonic() - start < 30
