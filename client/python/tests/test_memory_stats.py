"""The timed steps' memory from the Benchmark RPC and GetSessionInfo, as JAX's
device.memory_stats() reports it (peak_bytes_in_use, bytes_reserved), on the
server's backend (the CPU's host allocations count the same way)."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax

B, S, H, F = 2, 8, 32, 64


def test_benchmark_reports_the_timed_steps_peak_and_reserved_memory(session, rng, capsys):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dy = rng.standard_normal((B, S, F)).astype(np.float32)
    dense = te_flax.DenseGeneral(features=F)
    variables = dense.init(0, x)
    held = session.info().memory_bytes  # the kernel and bias, float32
    params = (H * F + F) * 4
    assert held >= params
    timed = te.speedometer(model_apply_fn=dense.apply, variables=variables, input=x, output_grad=dy,
                           warmup_iters=1, timing_iters=3, server_side=True)
    assert "Peak memory:" in capsys.readouterr().out
    peak = timed["peak_bytes_in_use"]
    # At least the variables and the resident x and dy held through the steps;
    # at most those plus one step's y, dx and parameter gradients (each as
    # large as what it is the gradient of) and 64 KiB of small scratch.
    inputs = x.nbytes + dy.nbytes
    assert peak >= held + inputs
    assert peak <= held + inputs + (B * S * F + B * S * H) * 4 + params + (64 << 10)
    assert timed["peak_bytes_reserved"] >= peak
    assert timed["bytes_reserved"] >= 0
    info = session.info()
    # The benchmark freed its step's memory; the session's peak is the steps'.
    assert info.memory_bytes < peak
    assert info.peak_memory_bytes >= peak
    assert info.device_peak_bytes_in_use >= info.peak_memory_bytes
    assert info.device_peak_bytes_reserved >= info.device_peak_bytes_in_use
    assert info.device_bytes_reserved >= info.device_bytes_in_use >= info.memory_bytes


def test_queued_benchmark_times_the_loop_and_holds_the_same_memory(session, rng, capsys):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dy = rng.standard_normal((B, S, F)).astype(np.float32)
    dense = te_flax.DenseGeneral(features=F)
    variables = dense.init(0, x)
    kwargs = dict(model_apply_fn=dense.apply, variables=variables, input=x, output_grad=dy,
                  warmup_iters=1, timing_iters=3, server_side=True, print_result=False)
    alone = te.speedometer(**kwargs)
    queued = te.speedometer(queued=True, **kwargs)
    assert queued["steps"] == 3 and queued["mean_ms"] > 0.0
    assert queued["median_ms"] == 0.0  # no step was timed alone
    assert alone["median_ms"] > 0.0
    assert queued["peak_bytes_in_use"] == alone["peak_bytes_in_use"]
    with pytest.raises(te.InvalidArgumentError, match="server_side"):
        te.speedometer(queued=True, **dict(kwargs, server_side=False))


def test_client_side_speedometer_keeps_no_gradients(session, rng):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dy = rng.standard_normal((B, S, F)).astype(np.float32)
    dense = te_flax.DenseGeneral(features=F)
    variables = dense.init(0, x)
    held = session.info().memory_bytes
    timed = te.speedometer(model_apply_fn=dense.apply, variables=variables, input=x, output_grad=dy,
                           warmup_iters=1, timing_iters=3, print_result=False)
    assert timed["steps"] == 3 and timed["timed_by"] == "client"
    # The steps dropped their gradients, as JAX's speedometer does.
    assert session.info().memory_bytes == held


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_client_side_speedometer_keeps_depth_steps_in_flight(session, rng, monkeypatch, depth):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dy = rng.standard_normal((B, S, F)).astype(np.float32)
    dense = te_flax.DenseGeneral(features=F)
    variables = dense.init(0, x)
    events = []
    sent = session.call_async

    def recording(method, request, timeout=None):
        answer = sent(method, request, timeout)
        if method != "ForwardBackward":
            return answer
        step = sum(1 for e in events if e[0] == "send")
        events.append(("send", step))
        real_result = answer.result

        def result(timeout=None):
            events.append(("wait", step))
            return real_result(timeout)
        answer.result = result
        return answer

    monkeypatch.setattr(session, "call_async", recording)
    timed = te.speedometer(model_apply_fn=dense.apply, variables=variables, input=x, output_grad=dy,
                           warmup_iters=0, timing_iters=5, print_result=False, pipeline_depth=depth)
    assert timed["steps"] == 5 and timed["mean_ms"] > 0.0 and timed["median_ms"] > 0.0
    # Step i is sent once step i - depth has been waited for, and no sooner.
    for i in range(5):
        sent_at = events.index(("send", i))
        waited = {s for kind, s in events[:sent_at] if kind == "wait"}
        assert waited == set(range(max(0, i - depth + 1))), (i, events)
    assert [s for kind, s in events if kind == "wait"] == list(range(5))


def test_speedometer_refuses_a_depth_below_one(session, rng):
    x = rng.standard_normal((B, S, H)).astype(np.float32)
    dense = te_flax.DenseGeneral(features=F)
    variables = dense.init(0, x)
    with pytest.raises(te.InvalidArgumentError, match="pipeline_depth"):
        te.speedometer(model_apply_fn=dense.apply, variables=variables, input=x,
                       output_grad=np.ones((B, S, F), np.float32), pipeline_depth=0)
