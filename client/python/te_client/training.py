"""The quickstart's speedometer, over te_server.

    te_client.speedometer(model_apply_fn=layer.apply, variables=params, input=x, output_grad=dy,
                          forward_kwargs={"attention_mask": None, "deterministic": False},
                          autocast_kwargs={"enabled": True, "recipe": fp8_recipe},
                          rngs={"dropout": dropout_key})

The loss is the quickstart's vdot(apply(variables, x), dy). Timed by the
client, the next step is sent while the last one's answer comes back
(pipeline_depth=2), as JAX's async dispatch runs the quickstart's loop. Unlike the
quickstart's jitted step, which throws its updated fp8_metas away, each step
here is a real training step on the server: under DelayedScaling the
session's FP8 scales move from step to step.
"""
import collections
import statistics
import time

from te_client import dtypes, errors, graph, precision as precision_lib, recipe as recipe_lib
from te_client import module as module_lib
from te_client import variables as variables_lib
from te_client._pb import recipe_pb2, service_pb2
from te_client.session import ResidentTensor


def _module_of(apply_fn):
    module = getattr(apply_fn, "__self__", None)
    if not isinstance(module, module_lib.Module) or getattr(apply_fn, "__name__", "") != "apply":
        raise errors.InvalidArgumentError("model_apply_fn: want a module's bound apply (layer.apply)")
    return module


def speedometer(model_apply_fn, variables, input, output_grad, dropout_key=None, model_init_fn=None,
                forward_kwargs=None, autocast_kwargs=None, fp8_autocast_kwargs=None, rngs=None,
                timing_iters=50, warmup_iters=50, server_side=False, queued=False, print_result=True,
                pipeline_depth=2):
    """Times forward + backward steps and prints "Mean time: X ms" (as the
    quickstart's helper; both its older and newer argument names work).
    Returns {"mean_ms", "median_ms", "steps", "timed_by"}; server_side adds the
    timed steps' memory as JAX's device.memory_stats() reports it:
    "peak_bytes_in_use" (the session's), "bytes_reserved" and
    "peak_bytes_reserved" (the device allocator's).

    A TE module, or a composite (one graph layer on the server), uploads x
    and dy once and runs each step as one ForwardBackward call that returns
    nothing, so only the step travels; server_side=True times it with the
    Benchmark RPC instead (no network in the loop); with queued=True too, the
    server queues the timed steps back to back as JAX's jit'd loop runs them
    (one wait, after the last), "mean_ms" is that loop's wall time per step
    and "median_ms" is 0.0 (no step is timed alone). Timed by the client,
    pipeline_depth steps are in flight at once: 2 (the default) sends the next
    step while the last one's answer comes back, as JAX's async dispatch runs
    the quickstart's loop, so the device does not idle for the round trip;
    "mean_ms" is then the timed loop's wall time per step (the last answer
    awaited) and "median_ms" that of the intervals between answers; 1 waits
    for each step. A layer with several array inputs (q, k, v) runs its
    value_and_grad per step, one at a time."""
    if not isinstance(pipeline_depth, int) or isinstance(pipeline_depth, bool) or pipeline_depth < 1:
        raise errors.InvalidArgumentError("speedometer: pipeline_depth %r steps in flight; give an int >= 1"
                                          % (pipeline_depth,))
    if queued and not server_side:
        raise errors.InvalidArgumentError("speedometer: queued=True times on the server; pass server_side=True")
    del model_init_fn  # the quickstart passes it; the server keeps the layer
    module = _module_of(model_apply_fn)
    forward_kwargs = dict(forward_kwargs or {})
    autocast_kwargs = autocast_kwargs if autocast_kwargs is not None else fp8_autocast_kwargs
    autocast_kwargs = dict(autocast_kwargs or {"enabled": False})
    if "fp8_recipe" in autocast_kwargs:   # fp8_autocast's spelling
        autocast_kwargs["recipe"] = autocast_kwargs.pop("fp8_recipe")
    seed = module_lib.seed_of(rngs if rngs is not None else dropout_key, "dropout")
    session = variables.session

    with recipe_lib.autocast(**autocast_kwargs):
        call = module.capture_call(variables, input, **forward_kwargs)
        if not call.extra:
            timed = _time_single(session, variables, call, output_grad, seed, warmup_iters, timing_iters,
                                 server_side, queued, pipeline_depth)
        elif server_side:
            raise errors.InvalidArgumentError("speedometer: server_side times a layer with one array input; "
                                              "%s takes %d" % (type(module).__name__, 1 + len(call.extra)))
        else:
            def step(i):
                module.value_and_grad(variables, input, output_grad,
                                      rngs={"dropout": graph.derive_seed(seed, "step/%d" % i)},
                                      **forward_kwargs)
                return lambda: None   # answered already
            timed = _time_client(step, warmup_iters, timing_iters, "client", 1)
    if print_result:
        print(f"Mean time: {timed['mean_ms']} ms")
        if "peak_bytes_in_use" in timed:
            print(f"Peak memory: {timed['peak_bytes_in_use'] / 2**20:.1f} MiB in use, "
                  f"{timed['peak_bytes_reserved'] / 2**20:.1f} MiB reserved")
    return timed


def _time_client(send, warmup_iters, timing_iters, timed_by, depth):
    """send(i) sends step i and returns a callable that waits for its answer
    (raising the server's error). Up to `depth` steps are in flight; the
    warmup's are all answered before the clock starts."""
    in_flight = collections.deque()
    for i in range(warmup_iters):
        if len(in_flight) >= depth:
            in_flight.popleft()()
        in_flight.append(send(i))
    while in_flight:
        in_flight.popleft()()
    intervals = []
    start = last = time.perf_counter()

    def answered():
        nonlocal last
        in_flight.popleft()()
        now = time.perf_counter()
        intervals.append((now - last) * 1000.0)
        last = now

    for i in range(timing_iters):
        if len(in_flight) >= depth:
            answered()
        in_flight.append(send(warmup_iters + i))
    while in_flight:
        answered()
    if not intervals:
        return {"mean_ms": 0.0, "median_ms": 0.0, "steps": 0, "timed_by": timed_by}
    return {"mean_ms": (last - start) * 1000.0 / timing_iters, "median_ms": statistics.median(intervals),
            "steps": timing_iters, "timed_by": timed_by}


def _time_single(session, variables, call, dy, seed, warmup_iters, timing_iters, server_side, queued, depth):
    handle, version = variables_lib.refs_version(variables)
    uploads = []
    try:
        # Uploaded once and kept on the server, so a step names x and dy by id and
        # moves no tensor (an inline or shared-memory one would be copied in again
        # on every step: 64 MiB each at the quickstart's size).
        dy = dtypes.cast_to_wire(dy, handle.output_wire_dtype)   # dy has y's dtype
        x_t, dy_t = _resident(session, call.x, uploads, "x"), _resident(session, dy, uploads, "dy")
        mask_t = _resident(session, call.mask, uploads, "attention_mask") if call.mask is not None else None
        deterministic = call.deterministic
        autocast = recipe_lib.autocast_proto(recipe_lib.current_autocast(), recipe_pb2)

        def batch(i):
            b = service_pb2.MicroBatch(x=x_t, dy=dy_t, dropout_seed=graph.derive_seed(seed, "step/%d" % i))
            if mask_t is not None:
                b.attention_mask.CopyFrom(mask_t)
            return b

        if server_side:
            response = session.call("Benchmark", service_pb2.BenchmarkRequest(
                layer_id=handle.layer_id, inputs=batch(0), deterministic=deterministic, autocast=autocast,
                warmup_iters=warmup_iters, timing_iters=timing_iters, queued=queued, version=version.number,
                matmul_precision=precision_lib.current()))
            # The timed steps' memory, as JAX's device.memory_stats() reports it.
            return {"mean_ms": response.mean_ms, "median_ms": response.median_ms, "steps": response.steps,
                    "timed_by": response.device, "peak_bytes_in_use": response.peak_bytes_in_use,
                    "bytes_reserved": response.bytes_reserved,
                    "peak_bytes_reserved": response.peak_bytes_reserved}

        def step(i):
            answer = session.call_async("ForwardBackward", service_pb2.ForwardBackwardRequest(
                layer_id=handle.layer_id, micro_batches=[batch(i)], deterministic=deterministic,
                autocast=autocast, return_dx=False, return_grads=False, version=version.number,
                matmul_precision=precision_lib.current(),
                discard_grads=True))  # as JAX's speedometer drops them
            return answer.result
        return _time_client(step, warmup_iters, timing_iters, "client", depth)
    finally:
        session.delete_all(uploads)


def _resident(session, array, uploads, field):
    """A te.v1.Tensor naming `array` on the server: uploaded (its id appended to `uploads`) unless it already is."""
    if not isinstance(array, ResidentTensor):
        array = session.put(array, field)
        uploads.append(array.id)
    return session.send(array, uploads, field)
