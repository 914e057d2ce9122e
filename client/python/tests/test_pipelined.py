"""A session's call order (SessionRef.sequence) and Session.call_async.

The numbering, against a fake TeService in this process that records the
number each call carries: every call of a session takes the next one as it is
sent (the PutTensor header and GetTensor included), a repeated call a new one,
concurrent callers unique ones, and call_async its own before it returns; a
call that ended at the client without an answer is named abandoned by the
later calls until one numbered above it is answered. The ordering, against a
real te_server: calls all sent before any answer is read run in the order they
were numbered, so each read sees the write sent just before it, and a call
that expired at the client does not hold up the next one.
"""
import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest

import te_client as te
from conftest import start_server
from te_client import client as client_lib

service_pb2, service_pb2_grpc = client_lib.service_pb2, client_lib.service_pb2_grpc
tensor_pb2, layers_pb2 = client_lib.tensor_pb2, client_lib.layers_pb2

HIDDEN = 8
# A deadline already past when the call starts: gRPC ends it here without
# sending it. (One a microsecond ahead is not enough: gRPC rounds it up to its
# millisecond clock, and the call may be sent and answered in time.)
EXPIRED = -1.0


class RecordingService(service_pb2_grpc.TeServiceServicer):
    """Answers at once and records (method, sequence) of every session call,
    and the numbers it named abandoned; GetVariables answers one variable
    whose path is the number it carried. ForwardBackward waits for `release`
    (or the client's cancel)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = []
        self._abandoned = {}
        self._first_unanswered = {}
        self.release = threading.Event()

    def calls(self):
        with self._lock:
            return list(self._calls)

    def sequences(self):
        return sorted(number for _, number in self.calls())

    def abandoned_by(self, sequence):
        """The numbers the call numbered `sequence` named abandoned (None: it never arrived)."""
        with self._lock:
            return self._abandoned.get(sequence)

    def first_unanswered_by(self, sequence):
        """The first_unanswered the call numbered `sequence` carried (None: it never arrived)."""
        with self._lock:
            return self._first_unanswered.get(sequence)

    def _record(self, method, ref):
        with self._lock:
            self._calls.append((method, ref.sequence))
            self._abandoned[ref.sequence] = list(ref.abandoned)
            self._first_unanswered[ref.sequence] = ref.first_unanswered

    def CreateSession(self, request, context):
        return service_pb2.CreateSessionResponse(
            session=service_pb2.SessionRef(session_id="s1", token="t1"), device="cpu")

    def CloseSession(self, request, context):
        self._record("CloseSession", request.session)
        return service_pb2.CloseSessionResponse()

    def PutTensor(self, request_iterator, context):
        for chunk in request_iterator:
            if chunk.WhichOneof("part") == "header":
                self._record("PutTensor", chunk.header.session)
        return service_pb2.PutTensorResponse(tensor_id="r1", bytes=4)

    def GetTensor(self, request, context):
        self._record("GetTensor", request.session)
        yield service_pb2.TensorChunk(header=tensor_pb2.TensorHeader(dtype=tensor_pb2.FLOAT32, shape=[1]))
        yield service_pb2.TensorChunk(data=np.float32(2.0).tobytes())

    def DeleteTensor(self, request, context):
        self._record("DeleteTensor", request.session)
        return service_pb2.DeleteTensorResponse()

    def Forward(self, request, context):
        # Refused, as a bad request is: the number is spent all the same.
        self._record("Forward", request.session)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "x: missing")

    def GetVariables(self, request, context):
        self._record("GetVariables", request.session)
        return service_pb2.GetVariablesResponse(
            variables=[service_pb2.Variable(path=str(request.session.sequence))])

    def SetVariables(self, request, context):
        self._record("SetVariables", request.session)
        return service_pb2.SetVariablesResponse()

    def ReleaseVersions(self, request, context):
        self._record("ReleaseVersions", request.session)
        return service_pb2.ReleaseVersionsResponse()

    def DeleteLayer(self, request, context):
        self._record("DeleteLayer", request.session)
        return service_pb2.DeleteLayerResponse()

    def ForwardBackward(self, request, context):
        self._record("ForwardBackward", request.session)
        while not self.release.wait(0.02):
            if not context.is_active():
                return service_pb2.ForwardBackwardResponse()
        return service_pb2.ForwardBackwardResponse(values=[1.0])


@pytest.fixture
def fake():
    service = RecordingService()
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_TeServiceServicer_to_server(service, server)
    address = "127.0.0.1:%d" % server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = te.connect(address, transport="stream")
    yield client, service
    client.close()
    server.stop(grace=None)


def test_every_call_takes_the_next_number_as_it_is_sent(fake):
    client, service = fake
    session = client.session()
    resident = session.put(np.full(1, 2.0, np.float32))
    np.testing.assert_array_equal(session.get(resident), [2.0])
    session.delete(resident)
    for _ in range(2):          # made again: a new number
        with pytest.raises(te.InvalidArgumentError, match="x: missing"):
            session.call("Forward", service_pb2.ForwardRequest())
    session.call("SetVariables", service_pb2.SetVariablesRequest())
    session.close()
    assert service.calls() == [("PutTensor", 1), ("GetTensor", 2), ("DeleteTensor", 3), ("Forward", 4),
                               ("Forward", 5), ("SetVariables", 6), ("CloseSession", 7)]


def test_call_async_numbers_in_program_order_before_any_answer(fake):
    client, service = fake
    with client.session() as session:
        rounds = 50
        sent = []
        for _ in range(rounds):
            sent.append((session.call_async("SetVariables", service_pb2.SetVariablesRequest()),
                         session.call_async("GetVariables", service_pb2.GetVariablesRequest())))
        for i, (set_, get) in enumerate(sent):
            set_.result(timeout=30)
            # The i-th pair took 2i+1 and 2i+2, whatever order they reached the fake in.
            assert [v.path for v in get.result(timeout=30).variables] == [str(2 * i + 2)]
        assert service.sequences() == list(range(1, 2 * rounds + 1))
        session.call("SetVariables", service_pb2.SetVariablesRequest())   # the same order goes on
        assert service.calls()[-1] == ("SetVariables", 2 * rounds + 1)


def test_call_async_failures_are_the_same_te_errors(fake):
    client, _ = fake
    with client.session() as session:
        future = session.call_async("Forward", service_pb2.ForwardRequest())
        with pytest.raises(te.InvalidArgumentError, match="x: missing"):
            future.result(timeout=30)
        assert isinstance(future.exception(), te.InvalidArgumentError)


def test_concurrent_callers_get_unique_numbers(fake):
    client, service = fake
    with client.session() as session:
        def work(t):
            for i in range(25):
                if (t + i) % 2:
                    session.call_async("GetVariables", service_pb2.GetVariablesRequest()).result(timeout=30)
                else:
                    session.call("SetVariables", service_pb2.SetVariablesRequest())

        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(work, range(8)))
        assert service.sequences() == list(range(1, 8 * 25 + 1))


def test_a_call_ended_at_the_client_is_named_abandoned_until_a_later_call_is_answered(fake):
    client, service = fake
    session = client.session()
    with pytest.raises(te.DeadlineExceededError):
        session.call("SetVariables", service_pb2.SetVariablesRequest(), timeout=EXPIRED)            # 1
    with pytest.raises(te.DeadlineExceededError):
        session.call_async("GetVariables", service_pb2.GetVariablesRequest(),
                           timeout=EXPIRED).result(timeout=30)                                      # 2
    resident = session.put(np.full(1, 2.0, np.float32))                                             # 3
    np.testing.assert_array_equal(session.get(resident), [2.0])                                     # 4
    with pytest.raises(te.DeadlineExceededError):
        session.call("Forward", service_pb2.ForwardRequest(), timeout=EXPIRED)                      # 5
    with pytest.raises(te.InvalidArgumentError):     # refused by the fake: still the server's answer
        session.call("Forward", service_pb2.ForwardRequest())                                       # 6
    session.delete(resident)                                                                        # 7
    with pytest.raises(te.DeadlineExceededError):
        session.call("SetVariables", service_pb2.SetVariablesRequest(), timeout=EXPIRED)            # 8
    session.close()                                                                                 # 9
    assert service.abandoned_by(3) == [1, 2], "the PutTensor header"
    assert service.abandoned_by(4) == [], "GetTensor, after the PutTensor's answer"
    assert service.abandoned_by(6) == [5], "Forward"
    assert service.abandoned_by(7) == [], "DeleteTensor, after Forward's refusal"
    assert service.abandoned_by(9) == [8], "CloseSession"


def test_an_answer_forgets_only_the_abandoned_numbers_below_it(fake):
    client, service = fake
    with client.session() as session:
        step = session.call_async("ForwardBackward", service_pb2.ForwardBackwardRequest())          # 1, held
        with pytest.raises(te.DeadlineExceededError):
            session.call("SetVariables", service_pb2.SetVariablesRequest(), timeout=EXPIRED)        # 2
        service.release.set()
        assert list(step.result(timeout=30).values) == [1.0]      # 1's answer says nothing of 2
        session.call_async("GetVariables", service_pb2.GetVariablesRequest()).result(timeout=30)    # 3
        session.call("SetVariables", service_pb2.SetVariablesRequest())                             # 4
        assert service.abandoned_by(1) == []
        assert service.abandoned_by(3) == [2]
        assert service.abandoned_by(4) == []


def test_each_call_names_the_lowest_number_still_in_flight(fake):
    # SessionRef.first_unanswered: where a restored session's order goes on. A call
    # that ended without an answer is no longer in flight.
    client, service = fake
    with client.session() as session:
        step = session.call_async("ForwardBackward", service_pb2.ForwardBackwardRequest())          # 1, held
        session.call("SetVariables", service_pb2.SetVariablesRequest())                             # 2
        session.call_async("GetVariables", service_pb2.GetVariablesRequest()).result(timeout=30)    # 3
        with pytest.raises(te.DeadlineExceededError):
            session.call("SetVariables", service_pb2.SetVariablesRequest(), timeout=EXPIRED)        # 4
        service.release.set()
        step.result(timeout=30)
        session.call("SetVariables", service_pb2.SetVariablesRequest())                             # 5
        assert service.first_unanswered_by(1) == 1
        assert service.first_unanswered_by(2) == 1, "1 is held"
        assert service.first_unanswered_by(3) == 1, "1 is held"
        assert service.first_unanswered_by(5) == 5, "1 answered, 4 abandoned"


def test_queued_releases_and_deletions_take_numbers_ahead_of_the_next_call(fake):
    # What finalizers queue (variables.py) runs before the call that follows it, so
    # GetSessionInfo after a dropped layer never sees it still there.
    client, service = fake
    with client.session() as session:
        session.pending.extend([("release", "a", 2), ("delete", "b", 0), ("release", "a", 3)])
        session.call("SetVariables", service_pb2.SetVariablesRequest())
        # The queued calls are sent without waiting for their answers: the fake may
        # answer SetVariables before they arrive. Their numbers are what is checked.
        deadline = time.monotonic() + 10
        while len(service.calls()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        calls = service.calls()
        assert ("SetVariables", 3) in calls
        assert sorted(calls) == [("DeleteLayer", 2), ("ReleaseVersions", 1), ("SetVariables", 3)]


# ---- against the real server ---------------------------------------------------------

@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A server of this module's own: every call is sent before any answer is
    read, so its device queue has room for all of them (the default 64 would
    refuse the excess with RESOURCE_EXHAUSTED, back-pressure, not order)."""
    with start_server(tmp_path_factory.mktemp("te_server_pipelined"), "--executor_queue=1024") as server:
        c = te.connect(server.address)
        yield c
        c.close()


def _init_layer_norm(session):
    """A LayerNorm over HIDDEN features (params/scale, params/bias); its layer id."""
    request = service_pb2.InitLayerRequest(spec=layers_pb2.LayerSpec(layer_norm=layers_pb2.LayerNorm()),
                                           seed=1, input_dtype=tensor_pb2.FLOAT32, input_shape=[2, HIDDEN])
    return session.call("InitLayer", request).layer_id


def _set_scale(layer_id, value):
    scale = tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[HIDDEN],
                              inline_data=np.full(HIDDEN, value, np.float32).tobytes())
    return service_pb2.SetVariablesRequest(
        layer_id=layer_id, variables=[service_pb2.Variable(collection="params", path="scale", value=scale)])


def _scale_of(response):
    found = [v.value for v in response.variables if (v.collection, v.path) == ("params", "scale")]
    assert len(found) == 1, [(v.collection, v.path) for v in response.variables]
    return np.frombuffer(found[0].inline_data, np.float32)


def _pipeline_set_then_get(session, rounds):
    """`rounds` of SetVariables(scale = i) then GetVariables, all sent before
    any answer is read; each read sees its own round's value, and the session
    ends with the last."""
    layer_id = _init_layer_norm(session)
    read = service_pb2.GetVariablesRequest(layer_id=layer_id, collections=["params"])
    sent = [(session.call_async("SetVariables", _set_scale(layer_id, i)),
             session.call_async("GetVariables", read)) for i in range(1, rounds + 1)]
    for i, (set_, get) in enumerate(sent, start=1):
        set_.result(timeout=120)
        np.testing.assert_array_equal(_scale_of(get.result(timeout=120)), np.full(HIDDEN, i, np.float32),
                                      err_msg="the GetVariables sent after SetVariables(%d)" % i)
    final = session.call("GetVariables", service_pb2.GetVariablesRequest(layer_id=layer_id, collections=["params"]))
    np.testing.assert_array_equal(_scale_of(final), np.full(HIDDEN, rounds, np.float32))


def test_each_get_variables_reads_the_set_variables_just_before_it(client):
    with client.session() as session:
        _pipeline_set_then_get(session, rounds=50)


def test_sessions_pipelined_at_once_keep_their_own_order(client):
    sessions = [client.session() for _ in range(4)]
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(sessions)) as pool:
            list(pool.map(lambda s: _pipeline_set_then_get(s, rounds=25), sessions))
    finally:
        for session in sessions:
            session.close()


def test_each_forward_uses_the_scale_set_just_before_it(client, rng):
    with client.session() as session:
        layer_id = _init_layer_norm(session)
        x = rng.standard_normal((2, HIDDEN)).astype(np.float32)
        forward = service_pb2.ForwardRequest(layer_id=layer_id, deterministic=True, x=tensor_pb2.Tensor(
            dtype=tensor_pb2.FLOAT32, shape=list(x.shape), inline_data=x.tobytes()))
        # y = normalized(x) * scale + bias, bias 0 from init: y(scale s) = s * y(scale 1).
        session.call("SetVariables", _set_scale(layer_id, 1.0))
        unit = np.frombuffer(session.call("Forward", forward).y.inline_data, np.float32)
        rounds = 20
        sent = [(session.call_async("SetVariables", _set_scale(layer_id, i)),
                 session.call_async("Forward", forward)) for i in range(1, rounds + 1)]
        for i, (set_, y) in enumerate(sent, start=1):
            set_.result(timeout=120)
            np.testing.assert_allclose(np.frombuffer(y.result(timeout=120).y.inline_data, np.float32), i * unit,
                                       rtol=1e-5, atol=1e-6 * i,
                                       err_msg="the Forward sent after SetVariables(%d)" % i)


def test_a_call_that_expires_at_the_client_does_not_hold_up_the_next_one(client):
    """Had the next call waited for an expired call's number, it would have
    waited the server's --sequence_gap_seconds (10 s) and failed ABORTED."""
    prompt = 5.0
    with client.session() as session:
        layer_id = _init_layer_norm(session)
        read = service_pb2.GetVariablesRequest(layer_id=layer_id, collections=["params"])
        session.call("SetVariables", _set_scale(layer_id, 2.0))
        with pytest.raises(te.DeadlineExceededError):
            session.call("SetVariables", _set_scale(layer_id, 5.0), timeout=EXPIRED)
        start = time.monotonic()
        scale = _scale_of(session.call("GetVariables", read))
        assert time.monotonic() - start < prompt
        np.testing.assert_array_equal(scale, np.full(HIDDEN, 2.0, np.float32), err_msg="the expired SetVariables ran")

        # The same through call_async.
        with pytest.raises(te.DeadlineExceededError):
            session.call_async("SetVariables", _set_scale(layer_id, 6.0), timeout=EXPIRED).result(timeout=30)
        start = time.monotonic()
        set_ = session.call_async("SetVariables", _set_scale(layer_id, 3.0))
        got = session.call_async("GetVariables", read)
        set_.result(timeout=30)
        scale = _scale_of(got.result(timeout=30))
        assert time.monotonic() - start < prompt
        np.testing.assert_array_equal(scale, np.full(HIDDEN, 3.0, np.float32))

        # The PutTensor and GetTensor streams, each after a read that expired.
        array = np.arange(4 * HIDDEN, dtype=np.float32).reshape(4, HIDDEN)
        with pytest.raises(te.DeadlineExceededError):
            session.call("GetVariables", read, timeout=EXPIRED)
        start = time.monotonic()
        resident = session.put(array)
        assert time.monotonic() - start < prompt
        with pytest.raises(te.DeadlineExceededError):
            session.call("GetVariables", read, timeout=EXPIRED)
        start = time.monotonic()
        np.testing.assert_array_equal(session.get(resident), array)
        assert time.monotonic() - start < prompt

        # And the close.
        with pytest.raises(te.DeadlineExceededError):
            session.call("GetVariables", read, timeout=EXPIRED)
        start = time.monotonic()
        session.close()
        assert time.monotonic() - start < prompt
