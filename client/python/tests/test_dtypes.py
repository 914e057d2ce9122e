"""dtypes.py without a server: bf16 rounding, the float32 fallback, FP8 decoding, wire bytes."""
import math
import struct

import grpc
import numpy as np
import pytest

import te_client
from te_client import dtypes


def _bf16_reference(value):
    """Nearest bf16 by comparing the two neighbours in float64 (ties to even; past the top: inf)."""
    if math.isnan(value) or math.isinf(value):
        return value
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    magnitude = bits & 0x7FFFFFFF
    down = magnitude & 0xFFFF0000
    up = down + 0x10000
    as_float = lambda b: struct.unpack("<f", struct.pack("<I", b))[0]
    lo = as_float(down)
    hi = 2.0**128 if up >= 0x7F800000 else as_float(up)
    a = abs(value)
    if a - lo < hi - a or (a - lo == hi - a and not (down >> 16) & 1):
        result = lo
    else:
        result = math.inf if up >= 0x7F800000 else hi
    return -result if bits & 0x80000000 else result


def test_bf16_rounding_matches_an_independent_reference(rng):
    specials = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20, -1.0 - 2**-8,
                         3.0e38, -3.4028235e38, 1e-40, -1e-42, 0.0, -0.0, np.inf, -np.inf], dtype=np.float32)
    values = np.concatenate([specials, rng.standard_normal(2000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 2000)]).astype(np.float32)
    rounded = dtypes.round_to_bf16(values)
    want = np.array([_bf16_reference(float(v)) for v in values], dtype=np.float32)
    np.testing.assert_array_equal(rounded, want)
    assert dtypes.round_to_bf16(np.float32(1.0 + 2**-8)) == 1.0          # tie: to even (down)
    assert dtypes.round_to_bf16(np.float32(1.0 + 3 * 2**-8)) == 1.0 + 2**-6  # tie: to even (up)


def test_bf16_nan_stays_a_quiet_nan():
    signalling = np.array([0x7F800001, 0xFF800001], dtype="<u4").view("<f4")
    bits = dtypes.float32_to_bf16_bits(signalling)
    assert np.all(np.isnan(dtypes.bf16_bits_to_float32(bits)))
    assert np.all(bits & 0x0040)


def test_bfloat16_array_rounds_elementwise_results(rng):
    a = dtypes.asarray(rng.standard_normal(64), te_client.bfloat16)
    b = dtypes.asarray(rng.standard_normal(64), te_client.bfloat16)
    if dtypes.ml_dtypes is not None:
        pytest.skip("ml_dtypes is installed: bfloat16 is a numpy dtype, not Bfloat16Array")
    total = a + b
    assert isinstance(total, dtypes.Bfloat16Array)
    np.testing.assert_array_equal(np.asarray(total), dtypes.round_to_bf16(np.asarray(a) + np.asarray(b)))
    mixed = a + np.asarray(b) * np.float32(1.0001)   # bf16 + float32 promotes to float32, unrounded
    assert type(mixed) is np.ndarray and mixed.dtype == np.float32
    assert type(a.astype(np.float32)) is np.ndarray and type(np.asarray(a)) is np.ndarray
    pieces = np.split(a.reshape(4, 16), 2, axis=1)
    assert all(isinstance(p, dtypes.Bfloat16Array) for p in pieces)
    assert dtypes.dtype_of(pieces[0]) == "bfloat16" and dtypes.dtype_of(np.asarray(a)) == "float32"


@pytest.mark.parametrize("code,value", [(0x7E, 448.0), (0x01, 2.0**-9), (0x08, 2.0**-6), (0x38, 1.0),
                                        (0xFE, -448.0), (0x80, -0.0), (0x3D, 1.625)])
def test_e4m3_decoding(code, value):
    got = dtypes.from_wire(dtypes.FLOAT8_E4M3, [1], bytes([code]))
    assert float(np.asarray(got, np.float32)[0]) == value


@pytest.mark.parametrize("code,value", [(0x7B, 57344.0), (0x01, 2.0**-16), (0x3C, 1.0), (0x7C, math.inf),
                                        (0xFC, -math.inf), (0x3E, 1.5)])
def test_e5m2_decoding(code, value):
    got = dtypes.from_wire(dtypes.FLOAT8_E5M2, [1], bytes([code]))
    assert float(np.asarray(got, np.float32)[0]) == value


def test_fp8_nan_codes():
    e4m3 = np.asarray(dtypes.from_wire(dtypes.FLOAT8_E4M3, [2], bytes([0x7F, 0xFF])), np.float32)
    e5m2 = np.asarray(dtypes.from_wire(dtypes.FLOAT8_E5M2, [2], bytes([0x7D, 0xFF])), np.float32)
    assert np.all(np.isnan(e4m3)) and np.all(np.isnan(e5m2))


def test_fp8_tables_agree_with_ml_dtypes_where_installed():
    if dtypes.ml_dtypes is None:
        pytest.skip("ml_dtypes is not installed")
    codes = np.arange(256, dtype=np.uint8)
    for table, dt in ((dtypes._E4M3_VALUES, dtypes.ml_dtypes.float8_e4m3fn),
                      (dtypes._E5M2_VALUES, dtypes.ml_dtypes.float8_e5m2)):
        np.testing.assert_array_equal(table, codes.view(dt).astype(np.float32))


@pytest.mark.parametrize("make,wire", [
    (lambda r: r.standard_normal((3, 5)).astype(np.float32), dtypes.FLOAT32),
    (lambda r: r.standard_normal((2, 7)).astype(np.float16), dtypes.FLOAT16),
    (lambda r: r.integers(-1000, 1000, (4, 3)).astype(np.int32), dtypes.INT32),
    (lambda r: r.random((6,)) < 0.5, dtypes.BOOL),
    (lambda r: dtypes.asarray(r.standard_normal((3, 4)), te_client.bfloat16), dtypes.BFLOAT16),
])
def test_wire_round_trip_is_exact(rng, make, wire):
    array = make(rng)
    got_wire, shape, data = dtypes.to_wire(array)
    assert got_wire == wire and shape == array.shape
    assert len(data) == array.size * dtypes.ITEMSIZE[wire]
    back = dtypes.from_wire(got_wire, shape, data)
    np.testing.assert_array_equal(np.asarray(back, np.float64), np.asarray(array, np.float64))
    assert dtypes.dtype_of(back) == dtypes.NAMES[wire]


def test_wire_bytes_are_little_endian_bf16_bits():
    wire, _, data = dtypes.to_wire(dtypes.asarray(np.array([1.0, -2.0], np.float32), te_client.bfloat16))
    assert wire == dtypes.BFLOAT16 and data == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_float64_and_int64_narrow_as_jax_does(rng):
    values = rng.standard_normal(5)
    assert dtypes.to_wire(values)[0] == dtypes.FLOAT32
    np.testing.assert_array_equal(np.frombuffer(dtypes.to_wire(values)[2], "<f4"), values.astype(np.float32))
    assert dtypes.to_wire(np.array([1, -2], np.int64))[0] == dtypes.INT32


def test_unrepresentable_arrays_are_invalid_argument():
    with pytest.raises(te_client.InvalidArgumentError, match="x: dtype complex64"):
        dtypes.to_wire(np.ones(3, np.complex64), "x")
    with pytest.raises(te_client.InvalidArgumentError, match="int32"):
        dtypes.to_wire(np.array([2**40], np.int64))


def test_truncated_bytes_from_the_server_are_data_loss():
    with pytest.raises(te_client.TeError) as info:
        dtypes.from_wire(dtypes.FLOAT32, [2, 3], b"\0" * 20, "y")
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "y: 20 bytes" in str(info.value)
