"""Session affinity over real sockets: the x-te-session key on a session's
calls, and sessions pinned to CreateSession's server_address. A small gRPC
proxy in the test forwards raw bytes to a real te_server and records each
call's method and key, as a load balancer would see them."""
import concurrent.futures
import re
import socket
import threading

import grpc
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from conftest import start_server

_MESSAGE_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class RecordingProxy(grpc.GenericRpcHandler):
    """Forwards every call, unchanged, to `target`; records (method, x-te-session or None)."""

    def __init__(self, target):
        self._upstream = grpc.insecure_channel(target, options=_MESSAGE_OPTIONS)
        self._lock = threading.Lock()
        self._calls = []
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8), handlers=[self],
                                   options=_MESSAGE_OPTIONS)
        self.address = "127.0.0.1:%d" % self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def calls(self):
        with self._lock:
            return list(self._calls)

    def clear(self):
        with self._lock:
            self._calls.clear()

    def stop(self):
        self._server.stop(grace=None)
        self._upstream.close()

    def service(self, details):
        metadata = [(m.key, m.value) for m in details.invocation_metadata]
        with self._lock:
            self._calls.append((details.method.rsplit("/", 1)[-1], dict(metadata).get("x-te-session")))
        forwarded = [(k, v) for k, v in metadata if k.startswith("x-")]
        # Identity serializers: bytes in, bytes out. A unary call is a stream
        # of one message each way, so one handler kind serves every method.
        upstream = self._upstream.stream_stream(details.method)

        def forward(requests, context):
            try:
                yield from upstream(requests, metadata=forwarded)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        return grpc.stream_stream_rpc_method_handler(forward)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exercise(session, rng):
    """Init, apply, value_and_grad, put / get / delete and info: a session's usual calls."""
    layer = te_flax.DenseGeneral(features=8)
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    params = layer.init(0, x)
    layer.apply(params, x)
    te.value_and_grad(layer.apply)(params, x, rng.standard_normal((2, 4, 8)).astype(np.float32))
    resident = session.put(rng.standard_normal(64).astype(np.float32))
    session.get(resident)
    session.delete(resident)
    session.info()


@pytest.fixture
def proxy_to(request):
    proxies = []

    def make(target):
        proxies.append(RecordingProxy(target))
        return proxies[-1]
    yield make
    for p in proxies:
        p.stop()


def test_a_sessions_calls_carry_its_key_and_server_info_none(server_address, proxy_to, rng):
    proxy = proxy_to(server_address)
    client = te.connect(proxy.address)
    try:
        client.server_info()
        assert proxy.calls() == [("GetServerInfo", None)]
        keys = []
        for _ in range(2):
            proxy.clear()
            with client.session() as session:
                assert session.address == proxy.address and not session.pinned   # no --advertise_address
                _exercise(session, rng)
            calls = proxy.calls()
            methods = [m for m, _ in calls]
            assert methods[0] == "CreateSession" and methods[-1] == "CloseSession"
            assert {"InitLayer", "Forward", "ForwardBackward", "PutTensor", "GetTensor", "GetSessionInfo"} <= set(methods)
            assert {key for _, key in calls} == {session.affinity_key}, calls
            assert re.fullmatch(r"[0-9a-f]{32}", session.affinity_key)
            keys.append(session.affinity_key)
        assert keys[0] != keys[1]
    finally:
        client.close()


def test_a_chosen_affinity_key_is_sent_on_every_call(server_address, proxy_to, rng):
    # As the C++ client's SessionOptions.affinity_key: sessions given one key hash to one replica.
    proxy = proxy_to(server_address)
    client = te.connect(proxy.address)
    try:
        for _ in range(2):
            proxy.clear()
            with client.session(affinity_key="tenant-7/job 3") as session:
                assert session.affinity_key == "tenant-7/job 3"
                _exercise(session, rng)
            calls = proxy.calls()
            assert [m for m, _ in calls][0] == "CreateSession" and calls[-1][0] == "CloseSession"
            assert {key for _, key in calls} == {"tenant-7/job 3"}, calls
        proxy.clear()
        for bad in ("", "caf\u00e9", "a\nb", 7):
            with pytest.raises(te.InvalidArgumentError, match="affinity_key"):
                client.session(affinity_key=bad)
        assert proxy.calls() == []          # refused before anything is sent
    finally:
        client.close()


@pytest.fixture(scope="module")
def advertising_server(tmp_path_factory):
    port = _free_port()
    with start_server(tmp_path_factory.mktemp("te_server_advertised"),
                      "--advertise_address=127.0.0.1:%d" % port, port=port) as server:
        assert server.address == "127.0.0.1:%d" % port
        yield server


def test_a_session_is_pinned_to_its_replica(advertising_server, proxy_to, rng):
    proxy = proxy_to(advertising_server.address)
    client = te.connect(proxy.address)
    try:
        with client.session() as session:
            assert session.pinned and session.address == advertising_server.address
            _exercise(session, rng)
        # Only the creation went through the proxy; the rest went to the replica.
        assert proxy.calls() == [("CreateSession", session.affinity_key)]
    finally:
        client.close()


def test_without_pinning_calls_keep_going_through_the_proxy(advertising_server, proxy_to, rng):
    proxy = proxy_to(advertising_server.address)
    client = te.connect(proxy.address, pin_to_replica=False)
    try:
        with client.session() as session:
            assert not session.pinned and session.address == proxy.address
            _exercise(session, rng)
        methods = [m for m, _ in proxy.calls()]
        assert methods[0] == "CreateSession" and methods[-1] == "CloseSession" and len(methods) >= 8
        assert {key for _, key in proxy.calls()} == {session.affinity_key}
    finally:
        client.close()


def test_an_unreachable_replica_is_unavailable_naming_it(tmp_path, proxy_to):
    nowhere = "127.0.0.1:%d" % _free_port()                 # nothing listens there
    with start_server(tmp_path, "--advertise_address=" + nowhere) as server:
        proxy = proxy_to(server.address)
        client = te.connect(proxy.address, timeout=1.0)
        try:
            with pytest.raises(te.UnavailableError, match=re.escape(nowhere)) as raised:
                client.session()
            assert raised.value.code == grpc.StatusCode.UNAVAILABLE
            # The session it made was closed again through the proxy, with its key.
            methods = [m for m, _ in proxy.calls()]
            assert methods == ["CreateSession", "CloseSession"]
            assert len({key for _, key in proxy.calls()}) == 1
            # Unpinned, the same server works.
            with te.connect(proxy.address, pin_to_replica=False) as unpinned, unpinned.session() as session:
                assert session.info().resident_tensors == 0
        finally:
            client.close()
