"""Training steps sent ahead of their answers, as JAX's async dispatch runs a jitted train step.

    for step in range(steps):
        state, metrics = te.train_step(state, tokens, labels)   # returns once the step is sent
        losses.append(metrics["loss"])                          # a lazy scalar: nothing waits yet
        if step % 100 == 0:
            print(float(np.mean(losses)))                       # waits for those steps only

A step (optim.train_step, TrainState.apply_gradients: one ForwardBackward with
apply_update) is sent and returns at once. Its metrics are lazy scalars
(LazyArray: float(), np.asarray, .item(), block_until_ready(), printing,
arithmetic) and its new params are Variables of a version whose number comes
with the step's answer (variables.PendingVersion): a value, as every step's
result is, that any call reading it waits for. The next step is sent before
that answer: the session numbers its calls (session.py, Call order), so the
server runs it right after the one before, and the device never idles while
the client reads a loss.

How the next step names the variables it reads: the version the step before
is making has no number yet, so it reads the layer's newest (version 0).
That is the step before's version when (a) that step succeeds and (b) no
call that makes versions of the layer (a synchronous step, SetVariables, a
Backward, a Forward that updates FP8 metas or decodes) was numbered between
the two: the session keeps, per layer, the step whose version will be the
newest (its tail), and any such call clears it; a step whose base is not
its layer's tail waits for that base's number instead. For (a), a step that
fails poisons the steps sent on top of it: their calls are cancelled (the
server drops one still waiting and undoes one it is running), one that ran
anyway has its version released unseen, and each raises, at its read, an
error of the failed step's code naming it. So a failed step never lets a
later one change what the program holds; a later step that depends on a
failed one (a step from its state, a read of its params or metrics) raises
at once once the failure is known.

At most Options.pipeline_depth steps (2: the one running and the one queued
behind it) are in flight per session; the next waits for the oldest to
answer (without raising: its failure surfaces where it is read). A step's
deadline (rpc_timeout, or train_step's timeout) counts from when it is
sent, so it includes the wait behind the steps before it.
"""
import threading

import numpy as np
import numpy.lib.mixins

from te_client import errors, transport as transport_lib, variables as variables_lib
from te_client._pb import service_pb2


class StepCall:
    """One step call (a ForwardBackward that makes a new version) and its
    outcome: its own answer, and, when it reads the version the step before
    it is still making (`parent`), that step's outcome. Settled once both
    are known; thread-safe (answers arrive on gRPC's threads)."""

    def __init__(self, session, layer_id, parent, method="ForwardBackward"):
        self.session = session
        self.layer_id = layer_id
        self.method = method
        self.parent = parent        # the StepCall whose version this one reads as version 0
        self.sequence = 0           # its number in the session's order
        self.error = None           # the outcome: a TeError, or None with `response`
        self.response = None
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._settled = threading.Event()
        self._own = None            # (response, error) of its own call
        self._children = []         # the steps sent on top of this one
        self._cancel = None         # cancels its call (session.send_step)
        self._cleanup = []          # run once its call has ended (frees its shared-memory blocks)
        self._dropped = False       # the PendingVersion naming its version is gone
        self._claimed = False       # that PendingVersion took the number as its own
        self._released = False
        # The Version the call reads (its parent's PendingVersion when chained), kept
        # until it has answered: released earlier, the server might run the release
        # (unnumbered in a reattached session) before this step reads it.
        self.holds = None
        self.handle_ref = None      # a weakref to its layer's LayerHandle (variables.PendingVersion)
        self.donates = False        # it donates the version it reads (dispatch)

    # ---- the session's side ----------------------------------------------------------

    def add_child(self, child):
        """Called before `child` is sent: cancel it should this step fail."""
        with self._lock:
            if not self._settled.is_set():
                self._children.append(child)
                return
            failed = self.error is not None
        if failed:
            child.cancel()

    def on_cleanup(self, fn):
        self._cleanup.append(fn)

    def answer(self, response, error):
        """Its call ended: the response, or the TeError."""
        for fn in self._cleanup:
            try:
                fn()
            except Exception:   # freeing a block of a pool already released: nothing to free
                pass
        self._cleanup = []
        with self._lock:
            self._own = (response, error)
            held, self.holds = self.holds, None
        self._answered.set()
        del held    # may release that version (its finalizer), outside the lock
        self._try_settle()

    def cancel(self):
        cancel = self._cancel
        if cancel is not None and not self._answered.is_set():
            cancel()

    def _try_settle(self):
        release = 0
        with self._lock:
            if self._settled.is_set() or not self._answered.is_set():
                return
            parent = self.parent
            if parent is not None and not parent._settled.is_set():
                return      # the parent's settling settles this one
            response, error = self._own
            if parent is not None and parent.error is not None:
                self.error = _dependent(parent.error)
                if error is None and response is not None and response.version:
                    release = response.version     # ran on the wrong variables: never seen
            else:
                self.error, self.response = error, response
            self.parent = None
            children, self._children = self._children, []
            self._settled.set()
            if self.error is None and self._dropped:
                release = self._number_to_release()
        if release:
            self._release(release)
        for child in children:
            if self.error is not None:
                child.cancel()
            child._try_settle()

    # ---- readers -------------------------------------------------------------------

    @property
    def answered(self):
        return self._answered.is_set()

    def wait_answered(self):
        self._answered.wait()

    def settled(self):
        return self._settled.is_set()

    def result(self):
        """The step's response once settled; raises its failure (a fresh
        TeError of the same code and message each time)."""
        self._settled.wait()
        if self.error is not None:
            raise errors.error(self.error.code, self.error.message)
        return self.response

    # ---- its version (variables.PendingVersion) --------------------------------------

    def claim(self):
        """The PendingVersion took the number as its own (LayerHandle.versions)."""
        with self._lock:
            self._claimed = True

    def version_dropped(self):
        """The PendingVersion naming this step's version is gone (nothing
        reads it any more: a step reading it holds it until answered):
        release the version, now or once the step has settled, unless
        another Version object holds the number."""
        with self._lock:
            self._dropped = True
            release = self._number_to_release() if self._settled.is_set() and self.error is None else 0
        if release:
            self._release(release)

    def _number_to_release(self):
        if self._released or self.response is None or not self.response.version:
            return 0
        handle = self.handle_ref() if self.handle_ref is not None else None
        if not self._claimed and handle is not None and handle.versions.get(self.response.version) is not None:
            return 0    # another Version object holds the number: it releases it
        self._released = True
        return self.response.version

    def _release(self, number):
        variables_lib._queue(self.session, ("release", self.layer_id, int(number)))


def _dependent(failed):
    """The error a step sent on top of `failed` raises: the failed step's code, naming it."""
    message = failed.message
    marker = "not run on the variables the program meant: "
    if not message.startswith(marker):
        message = marker + "the step it continues from failed (%s: %s)" % (failed.code.name, message)
    return errors.error(failed.code, message)


def dispatch(session, handle, version, request, uploads, timeout=None, donate=False):
    """Sends `request`, a step that reads `version` (a Version, or a
    PendingVersion) of `handle`'s layer and makes a new version, as a
    pipelined step; returns its StepCall. Its `version` field is set here:
    the pending base's layer-newest (0) while that base is its layer's tail,
    else the base's number (waiting for it, and raising its failure: the
    step is then not sent). `uploads` (session.send's): the shared-memory
    blocks are freed once the step has answered; the resident tensors are
    deleted by calls numbered after it (run after it, not waited for).
    `donate`: the step donates what it reads (ForwardBackwardRequest.donate;
    `version` is marked donated_to it), unless it is sent on top of a step
    in flight that does not donate (optim.train_step says why)."""
    blocks = [u for u in uploads if isinstance(u, transport_lib.Block)]
    residents = [u for u in uploads if not isinstance(u, transport_lib.Block)]
    step = None
    try:
        # A reattached session's calls run in arrival order: one step at a time, by number.
        depth = session.client.options.pipeline_depth if session.owned else 1
        wait_for_room(session, depth)
        pending = isinstance(version, variables_lib.PendingVersion)
        parent = version.step if pending and session.owned and depth > 1 else None
        while True:
            if parent is not None and parent.settled():
                parent = None        # answered: name its number
            if parent is None:
                request.version = version.number
            request.donate = donate and (parent is None or parent.donates)
            step = StepCall(session, handle.layer_id, parent)
            step.donates = request.donate
            step.holds = version
            for block in blocks:
                step.on_cleanup(lambda block=block: session._shm.free(block))
            if session.send_step(step, request, timeout):
                break
            step, parent = None, None    # the base is no longer its layer's newest-to-be: wait for it
    except BaseException:
        if step is None:
            session.delete_all(uploads)
        else:
            _delete_after(session, residents)
        raise
    _delete_after(session, residents)
    if step.donates:
        version.donated_to = step
    return step


def _delete_after(session, tensor_ids):
    for tensor_id in tensor_ids:
        session.call_async("DeleteTensor", service_pb2.DeleteTensorRequest(tensor_id=tensor_id))


class Memo:
    """fn(response) of a step, computed once (by the first reader) for several LazyArrays."""

    def __init__(self, fn):
        self._fn = fn
        self._lock = threading.Lock()
        self._done = False
        self._value = None

    def __call__(self, response):
        with self._lock:
            if not self._done:
                self._value = self._fn(response)
                self._done, self._fn = True, None
            return self._value


def metrics(step, request_bytes):
    """optim.train_step's metrics of a step in flight: lazy scalars (the
    same values the synchronous step returned), request_bytes known now."""
    lazy = lambda fn: LazyArray(step, fn)  # noqa: E731
    return {"loss": lazy(lambda r: np.float64(sum(r.values))),
            "applied": lazy(lambda r: np.bool_(r.update.applied)),
            "learning_rate": lazy(lambda r: np.float64(r.update.learning_rate)),
            "grad_norm": lazy(lambda r: np.float64(r.update.grad_norm)),
            "count": lazy(lambda r: np.int64(r.update.count)),
            "total_notfinite": lazy(lambda r: np.int64(r.update.total_notfinite)),
            "request_bytes": request_bytes}


def wait_for_room(session, depth):
    """Blocks until fewer than `depth` of the session's steps are in flight
    (answered or not: none raises here)."""
    while True:
        with session._steps_lock:
            while session._steps and session._steps[0].answered:
                session._steps.popleft()
            in_flight = [s for s in session._steps if not s.answered]
            if len(in_flight) < max(int(depth), 1):
                return
            oldest = in_flight[0]
        oldest.wait_answered()


class LazyArray(numpy.lib.mixins.NDArrayOperatorsMixin):
    """A value a step in flight will answer (its loss, a metric, an aux
    output), behaving like the JAX array a jitted step returns: reading it
    (float(), int(), bool(), np.asarray, .item(), arithmetic, printing)
    waits for that step alone and raises its failure; block_until_ready()
    waits and returns it; is_ready() asks without waiting."""
    __slots__ = ("_step", "_fn", "_value", "_lock")

    def __init__(self, step, fn):
        self._step = step
        self._fn = fn           # response -> the value
        self._value = None
        self._lock = threading.Lock()

    def _get(self):
        response = self._step.result()
        with self._lock:
            if self._value is None:
                self._value = np.asanyarray(self._fn(response))   # a Bfloat16Array stays one
                self._fn = None
            return self._value

    def block_until_ready(self):
        self._get()
        return self

    def is_ready(self):
        return self._step.settled()

    def __array__(self, dtype=None, copy=None):
        value = self._get()
        return value if dtype is None else value.astype(dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(i._get() if isinstance(i, LazyArray) else i for i in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    shape = property(lambda self: self._get().shape)
    dtype = property(lambda self: self._get().dtype)
    ndim = property(lambda self: self._get().ndim)
    size = property(lambda self: self._get().size)

    def item(self, *args):
        return self._get().item(*args)

    def tolist(self):
        return self._get().tolist()

    def astype(self, dtype):
        return self._get().astype(dtype)

    def __float__(self):
        return float(self._get())

    def __int__(self):
        return int(self._get())

    def __index__(self):
        return self._get().__index__()

    def __bool__(self):
        return bool(self._get())

    def __complex__(self):
        return complex(self._get())

    def __len__(self):
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __getitem__(self, index):
        return self._get()[index]

    def __format__(self, spec):
        value = self._get()
        return format(value.item() if value.ndim == 0 else value, spec)

    def __str__(self):
        return str(self._get())

    def __repr__(self):
        if not self._step.settled():
            return "LazyArray(<step in flight>)"
        try:
            value = self._get()
        except errors.TeError as e:
            return "LazyArray(<failed: %s>)" % e
        return "LazyArray(%s, dtype=%s)" % (np.array2string(value, separator=", "), value.dtype)

    def __reduce__(self):
        return (np.asarray, (self._get(),))   # by value
