"""Client: a connection to te_server (a channel, plus one per pinned replica).

    client = te_client.connect("localhost:50051")
    with client.session(recipes=[DelayedScaling()], policy="fallback") as session:
        ...   # modules' init / apply use this session while the block runs
    again = client.attach(session.id, session.token)   # the same session, from another process

A Client is thread-safe; its sessions are session.py's. Every failure is a
TeError carrying the server's gRPC code and message (errors.py).

Session affinity: every call of a session carries the metadata
`x-te-session: <session.affinity_key>` (a random 128-bit key, chosen before
CreateSession, which carries it too), so a load balancer can keep a session
on one replica. When CreateSession answers with the replica's own
`server_address` and it differs from the address connected to, the session's
later calls go straight there (Options.pin_to_replica; same channel settings).

Deadlines and failures to connect: every call has a deadline,
Options.rpc_timeout (300 s unless connect(..., rpc_timeout=...) says
otherwise: a server that stops answering, a paused process say, fails the
call with DeadlineExceededError naming the method and the address instead
of leaving it waiting). connect() and a pinned replica's first call wait up
to the connect timeout for the server; a refused connection (nothing
listening at the address) raises UnavailableError naming the address at
once, without waiting out the timeout. Calls are sent without
wait_for_ready, so a server that goes away fails them at once too
(UNAVAILABLE). After client.close(), every call of the client and of its
sessions raises FailedPreconditionError ("... is closed").
"""
import atexit
import dataclasses
import secrets
import threading
import weakref

import grpc

from te_client import errors, recipe as recipe_lib, transport as transport_lib
from te_client._pb import recipe_pb2, service_pb2, service_pb2_grpc
from te_client import session as session_lib
from te_client.session import AFFINITY_HEADER, Session, described

_POLICIES = {"strict": service_pb2.STRICT, "fallback": service_pb2.FALLBACK,
             "emulate": service_pb2.EMULATE}


@dataclasses.dataclass(frozen=True)
class Options:
    inline_tensor_bytes: int = 1 << 20
    chunk_bytes: int = 1 << 20               # the API allows 1-4 MiB chunks
    # Seconds a call may take. A CPU server's step at the quickstart's full size
    # takes minutes: raise it there (connect(addr, rpc_timeout=1800)).
    rpc_timeout: float = 300.0
    max_message_bytes: int = 64 << 20
    transport: str = "auto"                  # "auto", "inline", "stream", "shm" (transport.py)
    shm_region_bytes: int = 64 << 20         # shared-memory regions are made in pieces at least this big
    pin_to_replica: bool = True              # later calls of a session go to CreateSession's server_address
    # Training steps a session keeps in flight (pipeline.py): 2 queues the next step
    # behind the running one; 1 sends each once the one before has answered.
    pipeline_depth: int = 2


# Clients their users never closed. A gRPC channel left to the interpreter's
# finalizers can wait forever at exit on its connectivity thread (already
# frozen by then), so each is closed while gRPC's threads still run. Closing
# a client closes only its channels: its sessions stay open on the server.
_open_clients = weakref.WeakSet()


@atexit.register
def _close_open_clients():
    session_lib.close_open_sessions()   # first, while their channels are still open
    for client in list(_open_clients):
        try:
            client.close()
        except Exception:   # at exit, a channel already torn down is fine
            pass


def connect(address, timeout=10.0, **options):
    """Opens a channel to `address` ("host:port") and waits up to `timeout` s
    for it: UnavailableError when nothing answers. `options`: see Options
    (e.g. transport="shm", pin_to_replica=False)."""
    return Client(address, Options(**options), timeout)


class Client:
    def __init__(self, address, options=Options(), timeout=10.0):
        transport_lib.check_transport(options.transport)
        if not isinstance(options.pipeline_depth, int) or options.pipeline_depth < 1:
            raise errors.InvalidArgumentError("pipeline_depth: %r; want an int >= 1 (steps in flight per session)" %
                                              (options.pipeline_depth,))
        self.address = address
        self.options = options
        self._timeout = timeout
        self._lock = threading.Lock()
        self._replicas = {}          # pinned address -> (channel, stub)
        self.closed = False
        self._same_host = {}         # address -> bool
        self._shm_refused = {}       # address -> FailedPreconditionError: that server refused shm
        self._channel = self._open_channel(address)
        self._stub = service_pb2_grpc.TeServiceStub(self._channel)
        _open_clients.add(self)

    def _open_channel(self, address):
        """A channel to `address`, ready within the connect timeout; every
        channel of this client (pinned replicas too) has the same settings."""
        channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", self.options.max_message_bytes),
            ("grpc.max_receive_message_length", self.options.max_message_bytes)])
        try:
            _wait_connected(channel, address, self._timeout)
        except BaseException:
            channel.close()
            raise
        return channel

    def _replica_stub(self, address):
        """The stub of a pinned replica's channel (opened once per address)."""
        with self._lock:
            if address in self._replicas:
                return self._replicas[address][1]
        channel = self._open_channel(address)
        with self._lock:
            if address in self._replicas:        # another thread opened it meanwhile
                channel.close()
            else:
                self._replicas[address] = (channel, service_pb2_grpc.TeServiceStub(channel))
            return self._replicas[address][1]

    def _is_same_host(self, address):
        with self._lock:
            if address not in self._same_host:
                self._same_host[address] = transport_lib.is_same_host(address)
            return self._same_host[address]

    def _shm_refusal(self, address):
        with self._lock:
            return self._shm_refused.get(address)

    def _remember_shm_refusal(self, address, reason):
        # A refusal is the server's (no --enable_shm) or the host's (another
        # machine): later sessions on that address skip the probe.
        with self._lock:
            self._shm_refused.setdefault(address, reason)

    def close(self):
        """Closes the channels. Later calls, of the client and of its sessions,
        raise FailedPreconditionError; a second close is a no-op."""
        with self._lock:
            self.closed = True
            replicas, self._replicas = list(self._replicas.values()), {}
        for channel, _ in replicas:
            channel.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check_open(self, method):
        if self.closed:
            raise errors.FailedPreconditionError("%s: the client of %s is closed (client.close()); connect "
                                                 "again" % (method, self.address))

    def _call(self, method, request, timeout=None, metadata=None):
        self.check_open(method)
        timeout = timeout or self.options.rpc_timeout
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:
            raise described(errors.from_rpc_error(e), method, self.address, timeout) from None
        except ValueError:
            self.check_open(method)     # closed by another thread meanwhile
            raise

    def server_info(self):
        """te.v1.ServerInfo: version, devices (recipes native / emulated), dtypes, limits."""
        return self._call("GetServerInfo", service_pb2.GetServerInfoRequest())

    def attach(self, session_id, token, transport=None):
        """The session `session_id` again, from this client (another process's,
        or one a restarted server restored from its checkpoint): its calls
        carry the id and token, and run in arrival order (the session's
        numbering is its opener's). Closing it is the opener's business: it is
        not closed at this process's exit. NotFoundError (from the server) when
        it is gone; UnauthenticatedError for a wrong token."""
        transport = transport_lib.check_transport(transport or self.options.transport)
        created = service_pb2.CreateSessionResponse(
            session=service_pb2.SessionRef(session_id=session_id, token=token))
        session = Session(self, created, secrets.token_hex(16), self._stub, self.address, transport, owned=False)
        info = session.info()                      # reaches it now: a wrong id or token fails here
        session.device = info.device
        return session

    def session(self, recipes=(), policy="fallback", device="", ttl=None, transport=None, affinity_key=None):
        """Opens a session. `recipes`: preferred FP8 recipes, in order; `policy`:
        "strict" (the first, natively, or FailedPreconditionError), "fallback"
        (the first the device runs natively), "emulate" (natively or emulated).
        `transport`: this session's (default Options.transport).
        `affinity_key`: the x-te-session key its calls carry (a load balancer
        hashes it to pick the replica); default a random 128-bit one. Sessions
        given one key land on one replica; InvalidArgumentError for an empty
        key or one gRPC metadata cannot carry (printable ASCII only).
        ResourceExhaustedError when the server is at its session limit;
        UnavailableError naming the replica when the session is pinned
        (Options.pin_to_replica) to an address that does not answer."""
        if policy not in _POLICIES:
            raise errors.InvalidArgumentError("policy: %r; want one of %s" % (policy, sorted(_POLICIES)))
        transport = transport_lib.check_transport(transport or self.options.transport)
        request = service_pb2.CreateSessionRequest(
            preferred_recipes=[recipe_lib.to_proto(r, recipe_pb2) for r in recipes],
            policy=_POLICIES[policy], device=device, ttl_seconds=int(ttl or 0))
        affinity_key = secrets.token_hex(16) if affinity_key is None else _check_affinity_key(affinity_key)
        metadata = ((AFFINITY_HEADER, affinity_key),)
        created = self._call("CreateSession", request, metadata=metadata)
        replica = created.server_address
        if not (self.options.pin_to_replica and replica and replica != self.address):
            return Session(self, created, affinity_key, self._stub, self.address, transport)
        try:
            stub = self._replica_stub(replica)
        except errors.UnavailableError as e:
            # Not left behind until its TTL: closed through the address that created it.
            try:
                self._call("CloseSession", service_pb2.CloseSessionRequest(session=created.session),
                           timeout=min(self.options.rpc_timeout, 10.0), metadata=metadata)
            except errors.TeError:
                pass
            raise errors.UnavailableError("session %s is pinned to the replica at %s (CreateSession's "
                                          "server_address), which did not answer: %s" % (
                                              created.session.session_id, replica, e.message)) from None
        return Session(self, created, affinity_key, stub, replica, transport, pinned=True)


def _check_affinity_key(key):
    """`key` as a metadata value: a non-empty str of printable ASCII (what gRPC's metadata carries)."""
    if not isinstance(key, str) or not key or not all(" " <= c <= "~" for c in key):
        raise errors.InvalidArgumentError(
            "affinity_key: %r; want a non-empty str of printable ASCII (sent as %s metadata)" % (key, AFFINITY_HEADER))
    return key


def _wait_connected(channel, address, timeout):
    """Waits up to `timeout` s for `channel` to connect. UnavailableError
    naming the address: at once when a connection attempt fails (refused,
    unknown host), with gRPC's reason; after `timeout` when attempts hang."""
    settled = threading.Event()
    states = []

    def watch(state):
        states.append(state)
        if state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                     grpc.ChannelConnectivity.SHUTDOWN):
            settled.set()

    channel.subscribe(watch, try_to_connect=True)
    try:
        settled.wait(timeout)
    finally:
        channel.unsubscribe(watch)
    if grpc.ChannelConnectivity.READY in states:
        return
    if not settled.is_set():
        raise errors.UnavailableError("no te_server answered at %s within %g s (the connect timeout)" % (
            address, timeout))
    # The attempt failed: a call without wait_for_ready fails at once with gRPC's reason.
    try:
        service_pb2_grpc.TeServiceStub(channel).GetServerInfo(service_pb2.GetServerInfoRequest(),
                                                              timeout=min(timeout, 5.0), wait_for_ready=False)
        return                                    # it connected after all
    except grpc.RpcError as e:
        reason = e.details() or e.code().name
    if "refused" in reason.lower():
        raise errors.UnavailableError("connection refused at %s: nothing listens there (is te_server running, "
                                      "on that port?); gRPC: %s" % (address, reason)) from None
    raise errors.UnavailableError("cannot connect to %s: %s" % (address, reason)) from None

