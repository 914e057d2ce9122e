"""Session: one server-side session, and the tensors it moves.

    with client.session() as session:    # current for module calls; closed at the end of the block
        ...

A Session's calls are thread-safe; the server runs one session's calls one at
a time, in the order the session numbers them. Sessions a process opened and
did not close are closed when it exits (atexit), so the server frees their
memory at once rather than at their TTL; a session reattached by id and token
(Client.attach) is the opener's to close and is left open.

Call order: every call of a session (Session.call and call_async, the
PutTensor header of put / send, get's GetTensor request, close) carries the
session's next number (SessionRef.sequence: 1, 2, 3, ...), taken in the
calling thread as the request is sent; a call made again gets a new number.
The server runs the session's calls in that order whatever order they arrive
in, so call_async may send the next call before the last one has answered:

    set_ = session.call_async("SetVariables", write)
    got = session.call_async("GetVariables", read)   # sees what `write` set
    got.result()

A call that ends here without the server's answer (DEADLINE_EXCEEDED,
CANCELLED, UNAVAILABLE: it may never have been sent) would leave a gap the
session's later calls wait for, so the session names its number in every
later call (SessionRef.abandoned) until a call numbered above it is answered:
the server does not wait for it, and refuses it should it arrive after all. A
gap remains only for calls sent before the failure was known (call_async
calls already in flight), when no later call follows to name the number: they
fail with a TeError of code ABORTED (naming the missing number) after the
server's --sequence_gap_seconds. Every call also names the lowest number
still in flight, its own included (SessionRef.first_unanswered): a session
the server restored from a checkpoint continues its order from there, so
calls sent together still run in their order whichever arrives first.

Transport (transport.py; Options.transport, or per session): with "auto", a
tensor of at most `inline_tensor_bytes` travels inside the request; a larger
one goes through shared memory when the server is on this host and started
with --enable_shm (a region is registered once per session, when the first
large tensor needs it), else it is uploaded through the PutTensor stream in
`chunk_bytes` pieces and referenced by its resident id. A large result is kept
on the server and fetched the same way (GetTensor into shared memory, or its
stream). "inline", "stream" and "shm" force one way.
"""
import atexit
import collections
import concurrent.futures
import contextvars
import dataclasses
import threading
import weakref

import grpc
import numpy as np

from te_client import dtypes, errors, recipe as recipe_lib, transport as transport_lib
from te_client import variables as variables_lib
from te_client._pb import recipe_pb2, service_pb2, tensor_pb2

_current_session = contextvars.ContextVar("te_client_session", default=None)
# Sessions this process opened and has not closed: closed at exit (connection.py's
# atexit hook, ahead of the channels), so the server frees them now, not at their TTL.
_open_sessions = weakref.WeakSet()


def close_open_sessions(timeout=5.0):
    for session in list(_open_sessions):
        try:
            session.close(timeout=timeout)
        except Exception:   # at exit, a server already gone is fine
            pass
AFFINITY_HEADER = "x-te-session"
# How a call ends at the client without the server's answer: it may never
# have reached the server (SessionRef.abandoned).
_UNANSWERED = frozenset((grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                         grpc.StatusCode.UNAVAILABLE))


def _makes_versions(method, request):
    """Whether the call may make a new version of a layer's variables (te.v1 ReleaseVersionsRequest)."""
    if method in ("ForwardBackward", "SetVariables", "Backward"):
        return True
    return method == "Forward" and (request.update_fp8_metas or request.decode or request.keep_for_backward)


def current_session():
    """The innermost session entered with `with session:` (None outside any)."""
    return _current_session.get()


@dataclasses.dataclass(frozen=True)
class ResidentTensor:
    """A tensor held by the server in a session (Session.put). Pass it wherever
    an array is accepted: only its id travels."""
    id: str
    wire_dtype: int
    shape: tuple

    @property
    def dtype(self):
        return dtypes.dtype_name(self.wire_dtype)

    @property
    def ndim(self):
        return len(self.shape)



class Session:
    """One server session. `with session:` makes it the current one for module
    calls and closes it at the end of the block.

    `affinity_key`: sent as x-te-session with each of its calls; `address`:
    where its calls go (the pinned replica, or the address connected to);
    `transport` and `transport_counts`: how its tensors travel (transport.py)."""

    def __init__(self, client, created, affinity_key, stub, address, transport, pinned=False, owned=True):
        self.client = client
        self._ref = created.session
        self.id = created.session.session_id
        self.token = created.session.token
        # Opened here (closed at exit when left open) or reattached (Client.attach: the opener's to close).
        self.owned = owned
        # Releases and deletions queued by finalizers (variables.py), sent ahead of the next call.
        self.pending = collections.deque()
        self.device = created.device
        self.recipe = recipe_lib.from_proto(created.recipe, recipe_pb2) if created.HasField("recipe") else None
        self.emulated = created.emulated
        self.negotiation = created.negotiation   # what the server skipped and why
        self.ttl = created.ttl_seconds
        self.affinity_key = affinity_key
        self.address = address
        self.pinned = pinned
        self.transport = transport
        self.transport_counts = transport_lib.TransportCounts()
        self.closed = False
        self._tokens = []
        # The session's order: the next number, and the numbers of calls that
        # ended without the server's answer, not yet passed by an answered call.
        self._order_lock = threading.Lock()
        self._next_sequence = 1
        self._abandoned = set()
        self._in_flight_numbers = set()   # sent, not yet ended: SessionRef.first_unanswered
        # Pipelined steps (pipeline.py): per layer, the step whose version will be the
        # newest when it succeeds (cleared by any other call that makes versions; under
        # _order_lock, with the numbering); and the steps sent, oldest first.
        self._tails = {}
        self._steps = collections.deque()
        self._steps_lock = threading.Lock()
        self._stub = stub
        self._metadata = ((AFFINITY_HEADER, affinity_key),)
        self._shm = transport_lib.SharedMemoryPool(
            self._register_region, self._unregister_region, client.options.shm_region_bytes,
            refused=client._shm_refusal(address))
        if owned:
            _open_sessions.add(self)

    def __repr__(self):
        return "Session(id=%s, device=%s, recipe=%s)" % (self.id, self.device, self.recipe)

    def __enter__(self):
        self._tokens.append(_current_session.set(self))
        return self

    def __exit__(self, *exc):
        _current_session.reset(self._tokens.pop())
        self.close()

    def detach(self):
        """Leaves the session open when this process exits (it is closed at
        exit otherwise): for a session another process resumes with
        Client.attach, or that the server saves at shutdown (--state_dir)."""
        _open_sessions.discard(self)

    def close(self, timeout=None):
        """Frees everything the session holds: the server drops its tensors and
        unmaps its shared-memory regions with it (one RPC, not one per
        region), and this side unmaps them too, whatever the server answers.
        A second close is a no-op; NotFoundError when the server had already
        expired or evicted it."""
        if self.closed:
            return
        self.pending.clear()
        self.closed = True
        _open_sessions.discard(self)
        try:
            self.call("CloseSession", service_pb2.CloseSessionRequest(), timeout=timeout)
        finally:
            self._shm.release(unregister=False)

    def checkpoint(self):
        """Writes the session (layers, variables, optimizer state, recipe) to
        the server's --state_dir (CheckpointRequest); a restarted server
        restores it, and Client.attach(session.id, session.token) reaches it
        again. Returns the path written, relative to --state_dir."""
        return self.call("Checkpoint", service_pb2.CheckpointRequest()).path

    def info(self):
        """te.v1.SessionInfo: memory, layers, saved forwards, resident tensors, shm regions."""
        return self.call("GetSessionInfo", service_pb2.GetSessionInfoRequest())

    def release_shared_memory(self):
        """Unregisters and unmaps the session's shared-memory regions now (a
        later large tensor makes a new one). Raises the first failure."""
        failure = self._shm.release(unregister=True)
        if failure is not None:
            raise failure

    @property
    def shm_region_names(self):
        """The POSIX names of the session's regions (already unlinked from /dev/shm)."""
        return self._shm.region_names()

    def call(self, method, request, timeout=None):
        """A raw TeService call with this session's reference (and its next
        number in the session's order) and affinity key filled in. `timeout`:
        its deadline in seconds, when shorter than Options.rpc_timeout."""
        self.flush_pending()
        sequence = self._number(request.session, method, request) if hasattr(request, "session") else 0
        timeout = self._timeout(timeout)
        return self._invoke(lambda: getattr(self._stub, method)(
            request, timeout=timeout, metadata=self._metadata), sequence, method, timeout)

    def call_async(self, method, request, timeout=None):
        """`call` without waiting: takes the call's number in the session's
        order now, in the calling thread, sends the request and returns a
        concurrent.futures.Future. Its result() is what `call` returns, or
        raises what `call` raises (the server's TeError; code ABORTED when the
        server gave up waiting for a lower number of this session). The
        request's tensors must already be inline, resident or in shared
        memory (send); receive the response's. Thread-safe."""
        if method not in ("ReleaseVersions", "DeleteLayer"):
            self.flush_pending()
        sequence = self._number(request.session, method, request) if hasattr(request, "session") else 0
        result = concurrent.futures.Future()
        result.set_running_or_notify_cancel()

        def finish(response, error):
            if error is None:
                result.set_result(response)
            else:
                result.set_exception(error)

        self._send(method, request, sequence, self._timeout(timeout), finish)
        return result

    def send_step(self, step, request, timeout=None):
        """pipeline.py's: sends `request` (a step of `step.layer_id`'s layer)
        as call_async does, numbered in the session's order, with step.answer
        called once it ends. When `step.parent` is set, the request reads the
        layer's newest version (0), and that is the parent's only while the
        parent is the layer's tail: checked with the numbering, under one
        lock; False (nothing sent, no number taken) when it no longer is.
        `step` becomes the layer's tail."""
        self.flush_pending()
        sequence = self._number(request.session, step.method, request, step=step)
        if sequence is None:
            return False
        parent = step.parent
        if parent is not None:
            parent.add_child(step)
        with self._steps_lock:
            self._steps.append(step)
        step.sequence = sequence
        try:
            step._cancel = self._send(step.method, request, sequence, self._timeout(timeout), step.answer)
        except BaseException as e:
            # Never sent: the step ends here (so nothing waits for it), failed.
            step.answer(None, e if isinstance(e, errors.TeError) else errors.error(
                grpc.StatusCode.CANCELLED, "%s: not sent (%s)" % (step.method, type(e).__name__)))
            raise
        if parent is not None and parent.settled() and parent.error is not None:
            step.cancel()   # the parent failed before this one could be cancelled with it
        return True

    def _send(self, method, request, sequence, timeout, finish):
        """Sends the numbered call without waiting; `finish(response, error)`
        runs once when it ends (on a gRPC thread), after the session's order
        has taken note of how, so the caller's next call names it if it was
        abandoned. Returns what cancels the call."""
        def done(call):
            try:
                response = call.result()
            except grpc.RpcError as e:
                error = self._error(e, method, timeout)
                self._ended(sequence, error.code)
                finish(None, error)
            except grpc.FutureCancelledError:
                self._ended(sequence, grpc.StatusCode.CANCELLED)
                finish(None, errors.error(grpc.StatusCode.CANCELLED, "%s: cancelled" % method))
            else:
                self._ended(sequence, grpc.StatusCode.OK)
                finish(response, None)

        try:
            self.client.check_open(method)
            sent = getattr(self._stub, method).future(request, timeout=timeout, metadata=self._metadata)
        except BaseException:
            self._ended(sequence, grpc.StatusCode.CANCELLED)   # never sent
            self.client.check_open(method)
            raise
        sent.add_done_callback(done)
        return sent.cancel

    def flush_pending(self):
        """Sends the queued releases (one ReleaseVersions per layer) and layer
        deletions without waiting for their answers. They are numbered, so
        they run in the session's order ahead of the call that follows
        (GetSessionInfo sees a dropped layer gone); a failure of theirs (a
        layer already gone) concerns nothing the client still holds."""
        if not self.pending or self.closed:
            return
        releases, deletes = {}, []
        while True:
            try:
                kind, layer_id, number = self.pending.popleft()
            except IndexError:
                break
            if kind == "delete":
                deletes.append(layer_id)
            else:
                releases.setdefault(layer_id, []).append(number)
        requests = [("ReleaseVersions", service_pb2.ReleaseVersionsRequest(layer_id=layer_id, versions=sorted(n)))
                    for layer_id, n in releases.items() if layer_id not in deletes]
        requests += [("DeleteLayer", service_pb2.DeleteLayerRequest(layer_id=layer_id)) for layer_id in deletes]
        for method, request in requests:
            # A server without these RPCs answers UNIMPLEMENTED before it takes the
            # number: _ended names it abandoned, so no later call waits for it.
            try:
                self.call_async(method, request)
            except Exception:
                return

    def _timeout(self, timeout):
        rpc_timeout = self.client.options.rpc_timeout
        return rpc_timeout if timeout is None else min(timeout, rpc_timeout)

    def _number(self, ref, method=None, request=None, step=None):
        """Fills `ref` (a request's SessionRef) in as this session's, with the
        next number of its order and the abandoned numbers (every one was
        given out before, so all are below it); returns the number. A call
        `method` that makes versions of a layer ends that layer's pipeline of
        steps (pipeline.py: the next step waits for the number it reads); a
        `step` (send_step) whose parent is no longer its layer's tail takes no
        number (None)."""
        ref.CopyFrom(self._ref)
        with self._order_lock:
            if step is not None:
                if step.parent is not None and self._tails.get(step.layer_id) is not step.parent:
                    return None
                if step.parent is not None:
                    request.version = 0
                self._tails[step.layer_id] = step
            elif method is not None and self._tails and _makes_versions(method, request):
                if getattr(request, "layer_id", ""):
                    self._tails.pop(request.layer_id, None)
                else:
                    self._tails.clear()   # a Backward: its layer is its forward's
            if not self.owned:
                return 0   # reattached: the opener numbers its calls; ours run in arrival order
            sequence = self._next_sequence
            self._next_sequence += 1
            ref.abandoned.extend(sorted(self._abandoned))
            self._in_flight_numbers.add(sequence)
            ref.first_unanswered = min(self._in_flight_numbers)
        ref.sequence = sequence
        return sequence

    def _ended(self, sequence, code):
        """Keeps how the call numbered `sequence` (0: unnumbered) ended: a code
        of _UNANSWERED abandons its number; any other is the server's answer,
        after which it waits for no lower number (each arrived, was named
        abandoned, or was skipped)."""
        if not sequence:
            return
        with self._order_lock:
            self._in_flight_numbers.discard(sequence)
            # UNIMPLEMENTED: an RPC this server lacks is refused before it takes its number.
            if code in _UNANSWERED or code == grpc.StatusCode.UNIMPLEMENTED:
                self._abandoned.add(sequence)
            else:
                self._abandoned = {lost for lost in self._abandoned if lost >= sequence}

    def _invoke(self, rpc, sequence=0, method="call", timeout=None):
        """Runs `rpc`, the call `method` numbered `sequence` (0: unnumbered),
        keeping how it ended in the session's order."""
        try:
            self.client.check_open(method)
            response = rpc()
        except grpc.RpcError as e:
            error = self._error(e, method, timeout)
            self._ended(sequence, error.code)
            raise error from None
        except BaseException:
            # Ended here (an interrupt, a request gRPC could not send, a
            # channel closed meanwhile): the server may never have seen it.
            self._ended(sequence, grpc.StatusCode.CANCELLED)
            self.client.check_open(method)
            raise
        self._ended(sequence, grpc.StatusCode.OK)
        return response

    def _error(self, rpc_error, method="call", timeout=None):
        """A grpc.RpcError of this session's as a TeError; an UNAVAILABLE
        from a pinned replica names its address."""
        error = described(errors.from_rpc_error(rpc_error), method, self.address,
                           timeout or self.client.options.rpc_timeout)
        if self.pinned and error.code == grpc.StatusCode.UNAVAILABLE:
            error = errors.UnavailableError("the replica at %s (this session's pinned server_address): %s" % (
                self.address, error.message))
        return error

    # ---- transport ------------------------------------------------------------------

    def _register_region(self, name, size):
        request = service_pb2.RegisterSharedMemoryRequest(name=name, size=size)
        return self.call("RegisterSharedMemory", request).region_id

    def _unregister_region(self, region_id):
        self.call("UnregisterSharedMemory", service_pb2.UnregisterSharedMemoryRequest(region_id=region_id))

    def _shm_usable(self):
        """Auto's question (asked for large tensors only): same host, and the
        server accepts the session's first region (registered now if needed)."""
        if not self.client._is_same_host(self.address):
            return False
        usable = self._shm.probe()
        if not usable:
            self.client._remember_shm_refusal(self.address, self._shm.unavailable_reason)
        return usable

    def transport_for(self, nbytes):
        """The way a tensor of `nbytes` goes now: "inline", "stream" or "shm"."""
        return transport_lib.choose(self.transport, nbytes, self.client.options.inline_tensor_bytes,
                                    self._shm_usable)

    def _allocate(self, nbytes):
        """A shared-memory block, or None where "auto" should stream instead
        (forced "shm" raises: FailedPreconditionError when the server refuses)."""
        try:
            return self._shm.allocate(nbytes)
        except errors.TeError as e:
            if isinstance(e, errors.FailedPreconditionError):
                self.client._remember_shm_refusal(self.address, e)
            if self.transport == transport_lib.SHM:
                raise
            return None

    def large(self, nbytes):
        """Whether a result of about `nbytes` should be kept on the server and
        fetched (stream or shared memory) rather than come back inline."""
        if self.transport == transport_lib.AUTO:
            return nbytes > self.client.options.inline_tensor_bytes
        return self.transport != transport_lib.INLINE

    # ---- resident tensors -----------------------------------------------------------

    def put(self, array, field="tensor"):
        """Uploads `array` (through shared memory or the PutTensor stream, by
        the session's transport); it lives until delete() or the session's
        end. ResourceExhaustedError over the session's memory limit."""
        wire, shape, data = dtypes.to_wire_view(array, field)
        block = self._allocate(len(data)) if self.transport_for(len(data)) == transport_lib.SHM else None
        if block is None:
            return self._put_streamed(wire, shape, data)
        try:
            self._shm.write(block, data)
            header = service_pb2.PutTensorHeader(
                tensor=tensor_pb2.TensorHeader(dtype=wire, shape=shape),
                shm=tensor_pb2.SharedMemoryRef(region_id=block.region_id, offset=block.offset))
            sequence = self._number(header.session)
            response = self._invoke(lambda: self._stub.PutTensor(
                iter([service_pb2.PutTensorChunk(header=header)]),
                timeout=self.client.options.rpc_timeout, metadata=self._metadata), sequence, "PutTensor")
        finally:
            self._shm.free(block)
        self.transport_counts.add(transport_lib.SHM)
        return ResidentTensor(response.tensor_id, wire, shape)

    def _put_streamed(self, wire, shape, data):
        step = max(int(self.client.options.chunk_bytes), 1)
        # Numbered here, not in the generator: gRPC may draw the chunks on a thread of its own.
        header = service_pb2.PutTensorHeader(tensor=tensor_pb2.TensorHeader(dtype=wire, shape=shape))
        sequence = self._number(header.session)

        def chunks():
            yield service_pb2.PutTensorChunk(header=header)
            view = memoryview(data)
            for offset in range(0, len(data), step):
                yield service_pb2.PutTensorChunk(data=bytes(view[offset:offset + step]))

        response = self._invoke(lambda: self._stub.PutTensor(
            chunks(), timeout=self.client.options.rpc_timeout, metadata=self._metadata), sequence, "PutTensor")
        self.transport_counts.add(transport_lib.STREAM)
        return ResidentTensor(response.tensor_id, wire, shape)

    def get(self, tensor_id, field="tensor"):
        """Downloads a resident tensor: through shared memory when the
        session's transport picks it for a ResidentTensor's size, else the
        GetTensor stream (always for a bare id, whose size is unknown).
        NotFoundError for an unknown id."""
        block = None
        if isinstance(tensor_id, ResidentTensor) and tensor_id.wire_dtype in dtypes.ITEMSIZE:
            nbytes = _wire_bytes(tensor_id.wire_dtype, tensor_id.shape)
            if self.transport_for(nbytes) == transport_lib.SHM:
                block = self._allocate(nbytes)
        request = service_pb2.GetTensorRequest(tensor_id=getattr(tensor_id, "id", tensor_id),
                                               chunk_bytes=self.client.options.chunk_bytes)
        if block is not None:
            request.destination.region_id, request.destination.offset = block.region_id, block.offset
        sequence = self._number(request.session)
        try:
            chunks = self._invoke(lambda: list(self._stub.GetTensor(
                request, timeout=self.client.options.rpc_timeout, metadata=self._metadata)),
                sequence, "GetTensor")
            header = next((c.header for c in chunks if c.WhichOneof("part") == "header"), None)
            if header is None:
                raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: GetTensor sent no header" % field)
            if block is None:
                data = _join_chunks(chunks)
            elif header.dtype != tensor_id.wire_dtype or tuple(header.shape) != tuple(tensor_id.shape):
                # The server wrote its tensor's bytes into a block sized for ours.
                raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: GetTensor(%s) answered %s%s; the "
                                   "session's record says %s%s" % (
                                       field, tensor_id.id, dtypes.dtype_name(header.dtype), list(header.shape),
                                       tensor_id.dtype, list(tensor_id.shape)))
            else:
                array = self._shm.read(block.region_id, block.offset, _wire_bytes(header.dtype, header.shape),
                                       lambda view: dtypes.from_wire(header.dtype, header.shape, view, field), field)
        finally:
            if block is not None:
                self._shm.free(block)
        if block is None:
            self.transport_counts.add(transport_lib.STREAM)
            return dtypes.from_wire(header.dtype, header.shape, data, field)
        self.transport_counts.add(transport_lib.SHM)
        return array

    def delete(self, tensor_id):
        request = service_pb2.DeleteTensorRequest(tensor_id=getattr(tensor_id, "id", tensor_id))
        self.call("DeleteTensor", request)

    # ---- tensors in requests and responses --------------------------------------------

    def send(self, array, uploads, field):
        """A te.v1.Tensor for `array`, by the session's transport: inline,
        written to shared memory, or uploaded (the block or the resident id
        appended to `uploads`, for the caller's delete_all after the call)."""
        if isinstance(array, ResidentTensor):
            return tensor_pb2.Tensor(dtype=array.wire_dtype, shape=array.shape, resident_id=array.id)
        wire, shape, data = dtypes.to_wire_view(array, field)
        how = self.transport_for(len(data))
        if how == transport_lib.INLINE:
            self.transport_counts.add(transport_lib.INLINE)
            return tensor_pb2.Tensor(dtype=wire, shape=shape, inline_data=bytes(data))
        block = self._allocate(len(data)) if how == transport_lib.SHM else None
        if block is not None:
            uploads.append(block)
            self._shm.write(block, data)
            self.transport_counts.add(transport_lib.SHM)
            return tensor_pb2.Tensor(dtype=wire, shape=shape, shm=tensor_pb2.SharedMemoryRef(
                region_id=block.region_id, offset=block.offset))
        resident = self._put_streamed(wire, shape, data)
        uploads.append(resident.id)
        return tensor_pb2.Tensor(dtype=resident.wire_dtype, shape=resident.shape, resident_id=resident.id)

    def receive(self, tensor, field):
        """A response tensor as a numpy array: inline bytes, bytes in this
        session's shared memory, or a resident one fetched and then deleted."""
        kind = tensor.WhichOneof("data")
        if kind == "inline_data" or kind is None:
            self.transport_counts.add(transport_lib.INLINE)
            return dtypes.from_wire(tensor.dtype, tensor.shape, tensor.inline_data, field)
        if kind == "resident_id":
            try:
                return self.get(ResidentTensor(tensor.resident_id, tensor.dtype, tuple(tensor.shape)), field)
            finally:
                self.delete(tensor.resident_id)
        if tensor.dtype not in dtypes.ITEMSIZE:
            raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: unknown dtype %d from the server" % (
                field, tensor.dtype))
        array = self._shm.read(tensor.shm.region_id, tensor.shm.offset, _wire_bytes(tensor.dtype, tensor.shape),
                               lambda view: dtypes.from_wire(tensor.dtype, tensor.shape, view, field), field)
        self.transport_counts.add(transport_lib.SHM)
        return array

    def delete_all(self, uploads):
        """Frees each shared-memory block and deletes each resident id; keeps
        going past failures and raises the first."""
        first = None
        for upload in uploads:
            if isinstance(upload, transport_lib.Block):
                self._shm.free(upload)
                continue
            try:
                self.delete(upload)
            except errors.TeError as e:
                first = first or e
        if first is not None:
            raise first

    # ---- variables ------------------------------------------------------------------

    def get_variables(self, variables, collections=None):
        """The values of a layer's variables (at the version `variables`
        names) as a nested dict of numpy arrays ({'params': {...},
        'fp8_metas': {...}, 'opt_state': {...}, 'grads': {...}}), as Flax's
        init would return them. `collections` None: all."""
        handle, version = _version_of(variables)
        request = service_pb2.GetVariablesRequest(layer_id=handle.layer_id, collections=collections or [],
                                                  version=version.number)
        flat = {}
        for v in self.call("GetVariables", request).variables:
            name = variables_lib.join(v.collection, handle.scope, v.path)
            flat[name] = self.receive(v.value, name)
        return variables_lib.unflatten(flat)

    def set_variables(self, variables, values):
        """New variables: those of `variables` with `values` (a nested dict
        like get_variables', or a flat dict "params/qkv/kernel" -> array)
        written over them, in any collection GetVariables returns (params,
        fp8_metas, opt_state, grads). Returns the new Variables (a new version;
        `variables` stay as they were). Each must exist with the same shape
        (InvalidArgumentError otherwise); floats are converted to the
        variable's dtype."""
        handle, version = _version_of(variables)
        response = self.set_version(handle, version.number, values)
        module = getattr(variables, "module", None)
        if isinstance(variables, variables_lib.Variables):
            return variables.at_version(response)
        return variables_lib.Variables({handle.scope: handle}, module,
                                       variables_lib.Version(handle, response))

    def set_version(self, handle, version, values):
        """SetVariables of `values` over `version` of the layer: the new version's number."""
        flat = variables_lib.flatten(values) if isinstance(values, dict) else dict(values)
        infos = {variables_lib.join(i.collection, handle.scope, i.path): i for i in handle.infos}
        uploads = []
        try:
            request = service_pb2.SetVariablesRequest(layer_id=handle.layer_id, version=int(version))
            prefix = len(variables_lib.join(*handle.scope)) + 1 if handle.scope else 0
            for name, value in sorted(flat.items()):
                collection, _, rest = name.partition("/")
                path = rest[prefix:] if prefix else rest
                if not collection or not path:
                    raise errors.InvalidArgumentError("variables: %r is not <collection>/<path>" % name)
                value = _match_dtype(value, infos.get(name))
                request.variables.add(collection=collection, path=path, value=self.send(value, uploads, name))
            return self.call("SetVariables", request).version
        finally:
            self.delete_all(uploads)


def _version_of(variables):
    found = variables_lib.refs_version(variables)
    if found is None:
        raise errors.InvalidArgumentError(
            "variables: want what init returned (a te_client Variables) or a tree of its VariableRefs, got %s"
            % type(variables).__name__)
    return found


def described(error, method, address, timeout):
    """gRPC's own client-side "Deadline Exceeded" made to say which call, where, and which deadline."""
    if error.code == grpc.StatusCode.DEADLINE_EXCEEDED and error.message == "Deadline Exceeded":
        return errors.DeadlineExceededError("%s: no answer from the te_server at %s within %g s (the call's "
                                            "deadline; connect(..., rpc_timeout=...) sets it)" % (
                                                method, address, timeout))
    return error


def _match_dtype(value, info):
    """`value` cast to the variable's dtype (a float32 JAX param for a bf16 variable...)."""
    array = dtypes.as_numpy(value)
    if info is None or dtypes.wire_dtype(array) == info.wire_dtype:
        return array
    if info.wire_dtype == dtypes.BFLOAT16:
        return dtypes.asarray(array.astype(np.float32), dtypes.bfloat16)
    if info.wire_dtype == dtypes.FLOAT32:
        return np.asarray(array, dtype=np.float32)
    return array


def _wire_bytes(wire, shape):
    """Bytes of a tensor of te.v1.DType `wire` and `shape` (a negative dimension counts as 0)."""
    count = 1
    for d in shape:
        count *= max(int(d), 0)
    return count * dtypes.ITEMSIZE[wire]


def _join_chunks(chunks):
    """The data chunks' bytes end to end, in a numpy buffer: numpy allocates
    large buffers in transparent huge pages, where a fresh 64 MiB bytes object
    pays a page fault per 4 KiB (about 10x slower on the build VM)."""
    parts = [c.data for c in chunks if c.WhichOneof("part") == "data"]
    joined = np.empty(sum(len(p) for p in parts), np.uint8)
    offset = 0
    for part in parts:
        joined[offset:offset + len(part)] = np.frombuffer(part, np.uint8)
        offset += len(part)
    return memoryview(joined)
