"""Large tensors against a real te_server: chunked streams, resident tensors, results kept on the server."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from tolerances import F32, rel_err

MIB = 1 << 20


@pytest.mark.parametrize("make", [
    lambda r: r.standard_normal((3, 700, 512)).astype(np.float32),                    # 4.1 MiB: 5 chunks
    lambda r: te.asarray(r.standard_normal((1500, 1001)), te.bfloat16),               # odd size, 2.9 MiB
    lambda r: r.integers(-2**31, 2**31 - 1, (1 << 19) + 3, dtype=np.int64).astype(np.int32),
    lambda r: r.random(3 * MIB + 1) < 0.5,
])
def test_put_get_round_trip_is_exact(session, rng, make):
    array = make(rng)
    resident = session.put(array)
    assert resident.shape == array.shape and resident.dtype == te.dtype_of(array)
    back = session.get(resident)
    assert te.dtype_of(back) == te.dtype_of(array)
    np.testing.assert_array_equal(np.asarray(back, np.float64), np.asarray(array, np.float64))
    session.delete(resident)
    with pytest.raises(te.NotFoundError):
        session.get(resident)


def test_large_inputs_and_outputs_match_small_inline_calls(session, rng):
    layer = te_flax.LayerNormDenseGeneral(features=512, return_layernorm_output=False)
    x = rng.standard_normal((4, 512, 512)).astype(np.float32)      # 4 MiB in, 4 MiB out: streamed both ways
    params = layer.init(0, x)
    before = session.transport_counts.as_dict()
    y, _ = layer.apply(params, x)
    after = session.transport_counts.as_dict()
    # This server runs without --enable_shm: auto streams x up and y down.
    assert after["stream"] - before["stream"] == 2 and after["shm"] == 0
    pieces = [layer.apply(params, x[i:i + 1, j:j + 128])[0] for i in range(4) for j in range(0, 512, 128)]
    small = np.concatenate(pieces, axis=1).reshape(4, 4, 128, 512).reshape(4, 512, 512)
    assert x[0:1, 0:128].nbytes <= MIB // 2                         # the pieces travel inline
    assert rel_err(y, small) < F32
    dy = rng.standard_normal(y.shape).astype(np.float32)
    value, (grads, dx) = te.value_and_grad(layer.apply)(params, x, dy)
    assert dx.shape == x.shape and value == pytest.approx(float(np.vdot(y.astype(np.float64), dy)), rel=1e-4)
    assert grads["params"]["kernel"].shape == (512, 512)


def test_resident_tensors_are_accepted_as_inputs(session, rng):
    layer = te_flax.DenseGeneral(features=64)
    x = rng.standard_normal((4, 256, 256)).astype(np.float32)
    params = layer.init(0, x)
    resident = session.put(x)
    np.testing.assert_array_equal(layer.apply(params, resident), layer.apply(params, x))
    np.testing.assert_array_equal(session.get(resident), x)        # a call does not consume it


def test_small_inline_limit_streams_everything(client, rng):
    small = te.connect(client.address, inline_tensor_bytes=256, chunk_bytes=1 << 20)
    try:
        with small.session() as session:
            layer = te_flax.DenseGeneral(features=16)
            x = rng.standard_normal((2, 8, 32)).astype(np.float32)  # 2 KiB > 256 B: uploaded, fetched
            params = layer.init(0, x)
            dy = rng.standard_normal((2, 8, 16)).astype(np.float32)
            y = layer.apply(params, x)
            k = np.asarray(params["params"]["kernel"], np.float64)
            assert rel_err(y, x @ k + np.asarray(params["params"]["bias"])) < F32
            _, (_, dx) = te.value_and_grad(layer.apply)(params, x, dy)
            assert rel_err(dx, dy @ k.T) < F32
    finally:
        small.close()
