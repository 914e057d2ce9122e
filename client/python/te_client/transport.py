"""How tensors travel between te_client and te_server, and the client's side of
same-host shared memory. The same rules as the C++ client (client/transport.h):

    "auto"    tensors up to inline_tensor_bytes inside the messages; larger ones
              through shared memory when the server is on this host and allows
              it (probed once, by registering the session's first region), else
              through the PutTensor / GetTensor streams
    "inline"  inside the request and response messages (bounded by the
              message size limit)
    "stream"  the chunk streams, whatever the size
    "shm"     shared memory, whatever the size; FailedPreconditionError when
              the server cannot use it (no --enable_shm, another host)

Shared memory (SharedMemoryPool): a session creates POSIX objects in /dev/shm
(stdlib os + mmap, Linux), registers each with RegisterSharedMemory, and
carves it into page-aligned blocks; a tensor is copied into a block and the
request names region + offset (or the server writes a result there). The
server opens names, never paths: "/te_client_<pid>_<n>_<16 hex>" passes its
check ("/" then [A-Za-z0-9_.-], no "..").
"""
import dataclasses
import ipaddress
import itertools
import mmap
import os
import secrets
import socket
import threading

import grpc

from te_client import errors

AUTO, INLINE, STREAM, SHM = "auto", "inline", "stream", "shm"
TRANSPORTS = (AUTO, INLINE, STREAM, SHM)

SHM_DIR = "/dev/shm"          # where Linux keeps POSIX shared-memory objects
_BLOCK_ALIGNMENT = 4096
_names = itertools.count()

# Registration errors that retrying will not change: the server runs without
# --enable_shm (FAILED_PRECONDITION), is on another host and cannot see the
# object (NOT_FOUND), may not open it, rejects it, or does not know the RPC.
_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
             grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.UNIMPLEMENTED)


def check_transport(name, field="transport"):
    """`name` when it is one of TRANSPORTS; InvalidArgumentError otherwise."""
    if name not in TRANSPORTS:
        raise errors.InvalidArgumentError("%s: %r; want one of auto, inline, stream, shm" % (field, name))
    return name


def choose(chosen, nbytes, inline_bytes, shm_usable):
    """The way one tensor of `nbytes` goes: INLINE, STREAM or SHM. For AUTO,
    `shm_usable()` is asked only above `inline_bytes` (asking may register
    the session's first region)."""
    if chosen != AUTO:
        return chosen
    if nbytes <= inline_bytes:
        return INLINE
    return SHM if shm_usable() else STREAM


def _host_of(address):
    """The host part of a gRPC target ("host:port", "[v6]:port", "ipv4:h:p",
    "dns:///h:p"); None for unix sockets (always this host)."""
    if address.startswith(("unix:", "unix-abstract:")):
        return None
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme):]
            break
    if address.startswith("["):
        return address[1:address.find("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def is_same_host(address):
    """Whether `address` reaches a server on this machine: a unix socket, a
    loopback name or address, or an address one of this machine's interfaces
    holds (a bind to it succeeds). A wrong True costs one refused
    registration (the server answers NOT_FOUND for an object it cannot see)."""
    host = _host_of(address)
    if host is None or host in ("localhost", "localhost.localdomain"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if ip.is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


class TransportCounts:
    """Tensors moved by each transport, both directions (what "auto" chose). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = {INLINE: 0, STREAM: 0, SHM: 0}

    def add(self, transport):
        with self._lock:
            self._counts[transport] += 1

    def __getitem__(self, transport):
        with self._lock:
            return self._counts[transport]

    def as_dict(self):
        with self._lock:
            return dict(self._counts)

    def __repr__(self):
        return "TransportCounts(%s)" % ", ".join("%s=%d" % kv for kv in self.as_dict().items())


def _round_up(n, to):
    return (n + to - 1) // to * to


@dataclasses.dataclass(frozen=True)
class Block:
    """[offset, offset + size) of a registered region; size rounded up to pages."""
    region_id: str
    offset: int
    size: int


@dataclasses.dataclass
class _Region:
    id: str
    name: str        # the object's name, for tests and logs (unlinked once registered)
    map: mmap.mmap
    size: int
    free: dict       # offset -> bytes, coalesced


class SharedMemoryPool:
    """One session's shared-memory regions. Thread-safe.

    Contract (the C++ client's):
      1. A region is made when no region has room: at least min_region_bytes,
         its pages reserved up front (posix_fallocate, so a full /dev/shm
         fails here as ResourceExhaustedError, not as SIGBUS on a later
         write), registered, then unlinked: only the two mappings keep it,
         and nothing is left in /dev/shm if either process dies.
      2. The first registration the server refuses (no --enable_shm, another
         host, not permitted) makes the pool unavailable for good: allocate
         then raises FailedPreconditionError with the server's reason, at
         once, without asking again. Other errors (a full queue, a lost
         connection) are raised as they are, and a later allocate tries again.
      3. At most max_regions regions (the server allows 16 per session).
    `register(name, size)` returns the server's region id; `unregister(id)`
    drops it (release()). `refused`, when given, is a reason known beforehand
    (the client saw this server refuse): contract 2 from the start.
    """

    def __init__(self, register, unregister, min_region_bytes=64 << 20, max_regions=8, refused=None):
        self._register = register
        self._unregister = unregister
        self._min_region_bytes = _round_up(max(int(min_region_bytes), 1), _BLOCK_ALIGNMENT)
        self._max_regions = max_regions
        self._lock = threading.Lock()
        self._regions = []
        self._unavailable = refused      # a FailedPreconditionError once contract 2 applies

    @property
    def available(self):
        with self._lock:
            return self._unavailable is None

    @property
    def unavailable_reason(self):
        with self._lock:
            return self._unavailable

    def region_names(self):
        with self._lock:
            return [r.name for r in self._regions]

    def probe(self):
        """True when shared memory works for the session: registers the first
        region if there is none yet (contract 2's probe). Raises only errors
        that may pass (contract 2)."""
        with self._lock:
            if self._unavailable is not None:
                return False
            if not self._regions:
                try:
                    self._new_region_locked(0)
                except errors.FailedPreconditionError:
                    return False
            return True

    def allocate(self, nbytes):
        """A Block of `nbytes`. FailedPreconditionError when shared memory is
        unavailable (contract 2); ResourceExhaustedError when no region has
        room and no more may be made, or /dev/shm is full (the caller may stream)."""
        need = _round_up(max(int(nbytes), 1), _BLOCK_ALIGNMENT)
        with self._lock:
            if self._unavailable is not None:
                raise self._unavailable
            for region in self._regions:
                block = self._take(region, need)
                if block is not None:
                    return block
            return self._take(self._new_region_locked(need), need)

    def free(self, block):
        with self._lock:
            for region in self._regions:
                if region.id != block.region_id:
                    continue
                if block.offset in region.free:
                    return                      # freed twice: ignore
                region.free[block.offset] = block.size
                _coalesce(region.free)
                return

    def write(self, block, data):
        """Copies the bytes-like `data` (at most block.size bytes) into `block`."""
        region = self._region(block.region_id)
        region.map[block.offset:block.offset + len(data)] = data

    def read(self, region_id, offset, nbytes, decode, field="tensor"):
        """decode(view) of [offset, offset + nbytes) of one of this pool's
        regions, where `view` is a memoryview valid during the call only
        (decode copies what it keeps). InvalidArgumentError naming `field`
        when the range is not inside a region."""
        with self._lock:
            region = next((r for r in self._regions if r.id == region_id), None)
        if region is None or offset < 0 or nbytes < 0 or offset + nbytes > region.size:
            raise errors.InvalidArgumentError("%s: shared memory %s at %d (%d bytes) is not this session's" % (
                field, region_id, offset, nbytes))
        view = memoryview(region.map)[offset:offset + nbytes]
        try:
            return decode(view)
        finally:
            try:
                view.release()
            except BufferError:   # decode kept a reference: the map then closes when it is collected
                pass

    def release(self, unregister=True):
        """Unregisters (when asked; best effort) and unmaps every region. The
        pool stays usable: a later allocate makes a new region."""
        with self._lock:
            regions, self._regions = self._regions, []
        first = None
        for region in regions:
            if unregister:
                try:
                    self._unregister(region.id)
                except errors.TeError as e:
                    first = first or e
            try:
                region.map.close()
            except BufferError:   # a view is still exported: unmapped when collected
                pass
        return first

    # ---- internals ----------------------------------------------------------------

    def _region(self, region_id):
        with self._lock:
            for region in self._regions:
                if region.id == region_id:
                    return region
        raise errors.InvalidArgumentError("shared memory region %s is not this session's" % region_id)

    @staticmethod
    def _take(region, need):
        for offset in sorted(region.free):
            size = region.free[offset]
            if size < need:
                continue
            del region.free[offset]
            if size > need:
                region.free[offset + need] = size - need
            return Block(region.id, offset, need)
        return None

    def _new_region_locked(self, at_least):
        if len(self._regions) >= self._max_regions:
            raise errors.ResourceExhaustedError(
                "the session's %d shared-memory regions are full" % self._max_regions)
        size = max(self._min_region_bytes, _round_up(at_least, _BLOCK_ALIGNMENT))
        name = "/te_client_%d_%d_%s" % (os.getpid(), next(_names), secrets.token_hex(8))
        path = SHM_DIR + name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise errors.ResourceExhaustedError("creating %s: %s" % (path, e.strerror)) from None
        try:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)     # contract 1: fail now, not with SIGBUS later
                region_map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as e:
            os.unlink(path)
            raise errors.ResourceExhaustedError("a shared-memory region of %d bytes in %s: %s" % (
                size, SHM_DIR, e.strerror)) from None
        try:
            region_id = self._register(name, size)
        except errors.TeError as e:
            region_map.close()
            if e.code not in _REFUSALS:
                raise                           # busy or unreachable: maybe later
            self._unavailable = errors.FailedPreconditionError(
                "shared memory is unavailable for this session: %s: %s" % (e.code.name, e.message))
            raise self._unavailable from None
        finally:
            os.unlink(path)                     # registered or not, the name has served
        region = _Region(region_id, name, region_map, size, {0: size})
        self._regions.append(region)
        return region


def _coalesce(free):
    """Merges adjacent (offset, bytes) entries of a free map, in place."""
    merged, last = {}, None
    for offset in sorted(free):
        if last is not None and last + merged[last] == offset:
            merged[last] += free[offset]
        else:
            merged[offset] = free[offset]
            last = offset
    free.clear()
    free.update(merged)
