"""Same-host shared memory against real te_servers: one started with
--enable_shm (shm_server) and the default one without it (client)."""
import os

import grpc
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import errors, transport

MIB = 1 << 20


@pytest.fixture(scope="module")
def shm_client(shm_server):
    c = te.connect(shm_server.address)
    yield c
    c.close()


def _server_maps(server):
    with open("/proc/%d/maps" % server.pid) as f:
        return f.read()


def _our_shm_entries():
    prefix = "te_client_%d_" % os.getpid()
    return [n for n in os.listdir(transport.SHM_DIR) if n.startswith(prefix)]


def _delta(session, before):
    after = session.transport_counts.as_dict()
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("make", [
    lambda r: r.standard_normal((3, 700, 512)).astype(np.float32),                    # 4.1 MiB
    lambda r: te.asarray(r.standard_normal((1500, 1001)), te.bfloat16),               # odd size, 2.9 MiB
    lambda r: r.integers(-2**31, 2**31 - 1, (1 << 19) + 3, dtype=np.int64).astype(np.int32),
    lambda r: r.random(3 * MIB + 1) < 0.5,
])
def test_put_get_round_trip_is_exact_through_shared_memory(shm_client, shm_server, rng, make):
    array = make(rng)
    with shm_client.session() as session:
        before = session.transport_counts.as_dict()
        resident = session.put(array)
        back = session.get(resident)
        assert _delta(session, before) == {"inline": 0, "stream": 0, "shm": 2}
        assert te.dtype_of(back) == te.dtype_of(array)
        np.testing.assert_array_equal(np.asarray(back, np.float64), np.asarray(array, np.float64))
        assert session.info().shm_regions == 1
        maps = _server_maps(shm_server)
        assert session.shm_region_names and all(n.lstrip("/") in maps for n in session.shm_region_names)


def test_apply_and_value_and_grad_match_the_streams_bit_for_bit(shm_client, rng):
    layer = te_flax.LayerNormDenseGeneral(features=512, return_layernorm_output=False)
    x = rng.standard_normal((4, 512, 512)).astype(np.float32)      # 4 MiB in, 4 MiB out
    dy = rng.standard_normal((4, 512, 512)).astype(np.float32)
    with shm_client.session() as session:
        params = layer.init(0, x)
        results = {}
        for way in ("shm", "stream"):
            session.transport = way
            before = session.transport_counts.as_dict()
            y, _ = layer.apply(params, x)
            value, (grads, dx) = te.value_and_grad(layer.apply)(params, x, dy)
            moved = _delta(session, before)
            assert moved[way] >= 4 and moved["stream" if way == "shm" else "shm"] == 0, moved
            results[way] = (y, value, np.asarray(grads["params"]["kernel"]), dx)
        for a, b in zip(results["shm"], results["stream"]):
            np.testing.assert_array_equal(a, b)
        assert results["shm"][3].shape == x.shape


def test_auto_takes_shared_memory_for_large_tensors_only(shm_client, rng):
    layer = te_flax.DenseGeneral(features=256)
    small = rng.standard_normal((2, 8, 256)).astype(np.float32)
    large = rng.standard_normal((8, 512, 256)).astype(np.float32)   # 4 MiB
    with shm_client.session() as session:
        params = layer.init(0, small)
        before = session.transport_counts.as_dict()
        layer.apply(params, small)
        assert _delta(session, before) == {"inline": 2, "stream": 0, "shm": 0}
        assert session.info().shm_regions == 0                     # registered lazily
        y = layer.apply(params, large)
        assert _delta(session, before) == {"inline": 2, "stream": 0, "shm": 2}
        assert session.info().shm_regions == 1
        k = np.asarray(params["params"]["kernel"], np.float64)
        np.testing.assert_allclose(y, large @ k + np.asarray(params["params"]["bias"]), rtol=1e-4, atol=1e-4)


def test_forced_shm_without_enable_shm_is_failed_precondition(server_address, rng):
    forced = te.connect(server_address, transport="shm")
    try:
        with forced.session() as session:
            with pytest.raises(te.FailedPreconditionError) as raised:
                session.put(rng.standard_normal(1000).astype(np.float32))
            assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "disabled" in raised.value.message and "--enable_shm" in raised.value.message
            layer = te_flax.DenseGeneral(features=8)
            x = rng.standard_normal((2, 4, 8)).astype(np.float32)
            params = layer.init(0, x)                                   # sends no tensor
            with pytest.raises(te.FailedPreconditionError):
                layer.apply(params, x)
            assert session.info().shm_regions == 0
        assert _our_shm_entries() == []                           # the refused object was unlinked
    finally:
        forced.close()


def test_auto_without_enable_shm_streams_and_asks_once(server_address, rng, monkeypatch):
    auto = te.connect(server_address)
    asked = []
    try:
        for _ in range(2):
            with auto.session() as session:
                original = session._register_region
                monkeypatch.setattr(session._shm, "_register",
                                    lambda name, size, _o=original: asked.append(name) or _o(name, size))
                array = rng.standard_normal((3, MIB // 2)).astype(np.float32)       # 6 MiB
                before = session.transport_counts.as_dict()
                for _ in range(2):
                    np.testing.assert_array_equal(session.get(session.put(array)), array)
                assert _delta(session, before) == {"inline": 0, "stream": 4, "shm": 0}
        # One refused registration for the client: the second session knew already.
        assert len(asked) == 1
        assert isinstance(auto._shm_refusal(server_address), te.FailedPreconditionError)
    finally:
        auto.close()


def test_close_unregisters_and_unmaps(shm_client, shm_server, rng):
    session = shm_client.session()
    try:
        session.put(rng.standard_normal(MIB).astype(np.float32))
        first = list(session.shm_region_names)
        assert session.info().shm_regions == 1 and first[0].lstrip("/") in _server_maps(shm_server)
        assert _our_shm_entries() == []                  # unlinked once registered: nothing to leak
        session.release_shared_memory()
        assert session.info().shm_regions == 0 and first[0].lstrip("/") not in _server_maps(shm_server)
        array = rng.standard_normal(MIB).astype(np.float32)
        np.testing.assert_array_equal(session.get(session.put(array)), array)      # a new region
        second = list(session.shm_region_names)
        assert second != first and session.info().shm_regions == 1
    finally:
        session.close()
    maps = _server_maps(shm_server)
    assert second[0].lstrip("/") not in maps
    with open("/proc/self/maps") as f:
        assert second[0].lstrip("/") not in f.read()
    assert _our_shm_entries() == []
    with pytest.raises(te.NotFoundError):
        session.info()


def test_forced_inline_and_stream(shm_client, rng):
    small = rng.standard_normal(16).astype(np.float32)
    with shm_client.session(transport="stream") as session:
        before = session.transport_counts.as_dict()
        np.testing.assert_array_equal(session.get(session.put(small)), small)
        assert _delta(session, before) == {"inline": 0, "stream": 2, "shm": 0}
    layer = te_flax.DenseGeneral(features=16)
    x = rng.standard_normal((4, 16, 1 << 14)).astype(np.float32)                # 4 MiB inline
    with shm_client.session(transport="inline") as session:
        params = layer.init(0, x[:1, :1])
        before = session.transport_counts.as_dict()
        layer.apply(params, x)
        assert _delta(session, before) == {"inline": 2, "stream": 0, "shm": 0}
        assert session.info().shm_regions == 0


def test_unknown_transport_is_invalid_argument(shm_server):
    with pytest.raises(te.InvalidArgumentError, match="transport"):
        te.connect(shm_server.address, transport="carrier-pigeon")
    c = te.connect(shm_server.address)
    try:
        with pytest.raises(te.InvalidArgumentError, match="transport"):
            c.session(transport="udp")
    finally:
        c.close()


# ---- the pool and the helpers, without a server ----------------------------------------

class _FakeServer:
    def __init__(self, refuse=None):
        self.refuse, self.regions, self.calls = refuse, {}, 0

    def register(self, name, size):
        self.calls += 1
        if self.refuse is not None:
            raise errors.error(self.refuse, "no")
        with open(transport.SHM_DIR + name, "rb"):    # the object exists while being registered
            pass
        self.regions["r%d" % len(self.regions)] = (name, size)
        return "r%d" % (len(self.regions) - 1)

    def unregister(self, region_id):
        del self.regions[region_id]


def test_pool_carves_frees_and_coalesces_blocks():
    server = _FakeServer()
    pool = transport.SharedMemoryPool(server.register, server.unregister, min_region_bytes=64 << 10)
    a, b, c = pool.allocate(1), pool.allocate(5000), pool.allocate(4096)
    assert (a.offset, b.offset, c.offset) == (0, 4096, 4096 + 8192) and len(server.regions) == 1
    pool.write(b, b"\x01" * 5000)
    assert pool.read(b.region_id, b.offset, 5000, bytes) == b"\x01" * 5000
    pool.free(a)
    pool.free(b)
    assert pool.allocate(12288).offset == 0                      # a and b merged
    big = pool.allocate(100 << 10)                               # no room: a second region
    assert big.region_id != a.region_id and len(server.regions) == 2
    with pytest.raises(te.InvalidArgumentError):
        pool.read(a.region_id, (64 << 10) - 10, 11, bytes)
    assert pool.release() is None and server.regions == {}
    assert _our_shm_entries() == []


@pytest.mark.parametrize("code,remembered", [
    (grpc.StatusCode.FAILED_PRECONDITION, True), (grpc.StatusCode.NOT_FOUND, True),
    (grpc.StatusCode.UNAVAILABLE, False), (grpc.StatusCode.RESOURCE_EXHAUSTED, False)])
def test_pool_remembers_refusals_only(code, remembered):
    server = _FakeServer(refuse=code)
    pool = transport.SharedMemoryPool(server.register, server.unregister, min_region_bytes=4096)
    with pytest.raises(te.TeError) as raised:
        pool.allocate(10)
    assert isinstance(raised.value, te.FailedPreconditionError) == remembered
    with pytest.raises(te.TeError):
        pool.allocate(10)
    assert server.calls == (1 if remembered else 2) and pool.available != remembered
    assert _our_shm_entries() == []


def test_pool_region_limit_is_resource_exhausted():
    server = _FakeServer()
    pool = transport.SharedMemoryPool(server.register, server.unregister, min_region_bytes=4096, max_regions=2)
    pool.allocate(4096)
    pool.allocate(4096)
    with pytest.raises(te.ResourceExhaustedError):
        pool.allocate(4096)
    pool.release()


@pytest.mark.parametrize("address,same", [
    ("127.0.0.1:50051", True), ("localhost:1", True), ("[::1]:9", True), ("unix:/tmp/te.sock", True),
    ("ipv4:127.0.0.2:5", True), ("192.0.2.7:50051", False), ("[2001:db8::1]:5", False)])
def test_same_host(address, same):
    assert transport.is_same_host(address) == same


def test_choose():
    never = lambda: pytest.fail("asked")                          # noqa: E731
    assert transport.choose("auto", 10, 100, never) == "inline"
    assert transport.choose("auto", 101, 100, lambda: True) == "shm"
    assert transport.choose("auto", 101, 100, lambda: False) == "stream"
    for forced in ("inline", "stream", "shm"):
        assert transport.choose(forced, 1 << 30, 100, never) == forced
