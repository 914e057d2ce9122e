"""Client (a connection) and Session (one server-side session) of te_server.

    client = te_client.connect("localhost:50051")
    with client.session(recipes=[DelayedScaling()], policy="fallback") as session:
        ...   # modules' init / apply use this session while the block runs

A Client is thread-safe. A Session's calls are thread-safe; the server runs
one session's calls one at a time, in arrival order. Every failure is a
TeError carrying the server's gRPC code and message (errors.py).

Transport: a tensor of at most `inline_tensor_bytes` travels inside the
request; a larger one is uploaded first through the PutTensor stream in
`chunk_bytes` pieces and referenced by its resident id, and a large result is
kept on the server and fetched through the GetTensor stream. (The API's
shared-memory transport has no region registration yet, so it is not used.)
"""
import contextvars
import dataclasses

import grpc
import numpy as np

from te_client import _stubs, dtypes, errors, recipe as recipe_lib

tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc = _stubs.load()

_POLICIES = {"strict": service_pb2.STRICT, "fallback": service_pb2.FALLBACK,
             "emulate": service_pb2.EMULATE}
_current_session = contextvars.ContextVar("te_client_session", default=None)


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


@dataclasses.dataclass(frozen=True)
class Options:
    inline_tensor_bytes: int = 1 << 20
    chunk_bytes: int = 1 << 20               # the API allows 1-4 MiB chunks
    rpc_timeout: float = 1800.0              # seconds; a CPU server's full-size layer takes minutes
    max_message_bytes: int = 64 << 20


def connect(address, timeout=10.0, **options):
    """Opens a channel to `address` ("host:port") and waits up to `timeout` s
    for it: UnavailableError when nothing answers. `options`: see Options."""
    return Client(address, Options(**options), timeout)


class Client:
    def __init__(self, address, options=Options(), timeout=10.0):
        self.address = address
        self.options = options
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.max_receive_message_length", options.max_message_bytes)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise errors.UnavailableError("no te_server answered at %s within %g s" % (address, timeout)) from None
        self._stub = service_pb2_grpc.TeServiceStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout=None):
        try:
            return getattr(self._stub, method)(request, timeout=timeout or self.options.rpc_timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def server_info(self):
        """te.v1.ServerInfo: version, devices (recipes native / emulated), dtypes, limits."""
        return self._call("GetServerInfo", service_pb2.GetServerInfoRequest())

    def session(self, recipes=(), policy="fallback", device="", ttl=None):
        """Opens a session. `recipes`: preferred FP8 recipes, in order; `policy`:
        "strict" (the first, natively, or FailedPreconditionError), "fallback"
        (the first the device runs natively), "emulate" (natively or emulated).
        ResourceExhaustedError when the server is at its session limit."""
        if policy not in _POLICIES:
            raise errors.InvalidArgumentError("policy: %r; want one of %s" % (policy, sorted(_POLICIES)))
        request = service_pb2.CreateSessionRequest(
            preferred_recipes=[recipe_lib.to_proto(r, recipe_pb2) for r in recipes],
            policy=_POLICIES[policy], device=device, ttl_seconds=int(ttl or 0))
        return Session(self, self._call("CreateSession", request))


class Session:
    """One server session. `with session:` makes it the current one for module
    calls and closes it at the end of the block."""

    def __init__(self, client, created):
        self.client = client
        self._ref = created.session
        self.id = created.session.session_id
        self.device = created.device
        self.recipe = recipe_lib.from_proto(created.recipe, recipe_pb2) if created.HasField("recipe") else None
        self.emulated = created.emulated
        self.negotiation = created.negotiation   # what the server skipped and why
        self.ttl = created.ttl_seconds
        self.closed = False
        self._tokens = []

    def __repr__(self):
        return "Session(id=%s, device=%s, recipe=%s)" % (self.id, self.device, self.recipe)

    def __enter__(self):
        self._tokens.append(_current_session.set(self))
        return self

    def __exit__(self, *exc):
        _current_session.reset(self._tokens.pop())
        self.close()

    def close(self):
        """Frees everything the session holds. A second close is a no-op;
        NotFoundError when the server had already expired or evicted it."""
        if not self.closed:
            self.closed = True
            self.call("CloseSession", service_pb2.CloseSessionRequest())

    def call(self, method, request):
        """A raw TeService call with this session's reference filled in."""
        if hasattr(request, "session"):
            request.session.CopyFrom(self._ref)
        return self.client._call(method, request)

    # ---- resident tensors -----------------------------------------------------------

    def put(self, array, field="tensor"):
        """Uploads `array` (PutTensor stream); it lives until delete() or the
        session's end. ResourceExhaustedError over the session's memory limit."""
        wire, shape, data = dtypes.to_wire(array, field)
        step = max(int(self.client.options.chunk_bytes), 1)

        def chunks():
            header = service_pb2.PutTensorHeader(tensor=tensor_pb2.TensorHeader(dtype=wire, shape=shape))
            header.session.CopyFrom(self._ref)
            yield service_pb2.PutTensorChunk(header=header)
            view = memoryview(data)
            for offset in range(0, len(data), step):
                yield service_pb2.PutTensorChunk(data=bytes(view[offset:offset + step]))

        response = self.client._call("PutTensor", chunks())
        return ResidentTensor(response.tensor_id, wire, shape)

    def get(self, tensor_id, field="tensor"):
        """Downloads a resident tensor (GetTensor stream). NotFoundError for an unknown id."""
        tensor_id = getattr(tensor_id, "id", tensor_id)
        request = service_pb2.GetTensorRequest(tensor_id=tensor_id, chunk_bytes=self.client.options.chunk_bytes)
        request.session.CopyFrom(self._ref)
        header, parts = None, []
        try:
            for chunk in self.client._stub.GetTensor(request, timeout=self.client.options.rpc_timeout):
                if chunk.WhichOneof("part") == "header":
                    header = chunk.header
                else:
                    parts.append(chunk.data)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        if header is None:
            raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: GetTensor sent no header" % field)
        return dtypes.from_wire(header.dtype, header.shape, b"".join(parts), field)

    def delete(self, tensor_id):
        request = service_pb2.DeleteTensorRequest(tensor_id=getattr(tensor_id, "id", tensor_id))
        self.call("DeleteTensor", request)

    # ---- tensors in requests and responses --------------------------------------------

    def send(self, array, uploads, field):
        """A te.v1.Tensor for `array`: inline when small, else uploaded (its id
        appended to `uploads`, for the caller to delete after the call)."""
        if isinstance(array, ResidentTensor):
            return tensor_pb2.Tensor(dtype=array.wire_dtype, shape=array.shape, resident_id=array.id)
        array = dtypes.as_numpy(array)
        if array.nbytes <= self.client.options.inline_tensor_bytes:
            wire, shape, data = dtypes.to_wire(array, field)
            return tensor_pb2.Tensor(dtype=wire, shape=shape, inline_data=data)
        resident = self.put(array, field)
        uploads.append(resident.id)
        return tensor_pb2.Tensor(dtype=resident.wire_dtype, shape=resident.shape, resident_id=resident.id)

    def receive(self, tensor, field):
        """A response tensor as a numpy array (a resident one is fetched, then deleted)."""
        kind = tensor.WhichOneof("data")
        if kind == "inline_data" or kind is None:
            return dtypes.from_wire(tensor.dtype, tensor.shape, tensor.inline_data, field)
        if kind == "resident_id":
            try:
                return self.get(tensor.resident_id, field)
            finally:
                self.delete(tensor.resident_id)
        raise errors.UnimplementedError("%s: the server answered with shared memory, which te_client "
                                        "does not map" % field)

    def delete_all(self, tensor_ids):
        """Deletes each id; keeps going past failures and raises the first."""
        first = None
        for tensor_id in tensor_ids:
            try:
                self.delete(tensor_id)
            except errors.TeError as e:
                first = first or e
        if first is not None:
            raise first

    def large(self, nbytes):
        """Whether a result of about `nbytes` should come back by stream."""
        return nbytes > self.client.options.inline_tensor_bytes

    # ---- variables ------------------------------------------------------------------

    def get_variables(self, variables, collections=None):
        """The current values of a layer's variables as a nested dict of numpy
        arrays ({'params': {...}, 'fp8_metas': {...}, 'grads': {...}}), as
        Flax's init would return them. `collections` None: all."""
        from te_client import variables as variables_lib
        flat = {}
        for handle in variables_lib.handles_of(variables):
            request = service_pb2.GetVariablesRequest(layer_id=handle.layer_id, collections=collections or [])
            for v in self.call("GetVariables", request).variables:
                name = variables_lib.join(v.collection, handle.scope, v.path)
                flat[name] = self.receive(v.value, name)
        return variables_lib.unflatten(flat)

    def set_variables(self, variables, values):
        """Writes `values` (a nested dict like get_variables', or a flat dict
        "params/qkv/kernel" -> array) into the layer's variables on the server.
        Each must exist with the same shape (InvalidArgumentError otherwise);
        arrays are converted to the variable's dtype by the server's rules."""
        from te_client import variables as variables_lib
        flat = variables_lib.flatten(values)
        handles = variables_lib.handles_of(variables)
        per_layer = {}
        for name, value in flat.items():
            handle, collection, path = variables_lib.locate(handles, name)
            per_layer.setdefault(handle.layer_id, []).append((collection, path, name, value))
        for layer_id, items in per_layer.items():
            uploads = []
            try:
                request = service_pb2.SetVariablesRequest(layer_id=layer_id)
                for collection, path, name, value in items:
                    value = _match_dtype(value, variables_lib.info_of(handles, name))
                    request.variables.add(collection=collection, path=path,
                                          value=self.send(value, uploads, name))
                self.call("SetVariables", request)
            finally:
                self.delete_all(uploads)


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
