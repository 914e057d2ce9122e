"""Element types on the wire (te.v1.DType) <-> numpy arrays.

bfloat16 and the FP8 formats are numpy dtypes where `ml_dtypes` is installed
(JAX installs it): arrays of those dtypes go out and come back as they are.
Without ml_dtypes:
  * bfloat16 values live in a `Bfloat16Array`: an ndarray subclass whose
    values are exactly bf16, kept in float32 storage, and that travels as
    BFLOAT16, so the server computes in bf16 as it would for a JAX bf16 array.
    Its `.dtype` is `te_client.bfloat16` (prints "bfloat16", itemsize 2, the
    same answer as dtype_of), never float32; numpy has no bf16 dtype here, so
    numpy itself computes on the float32 storage (`a.itemsize` and `a.nbytes`
    count it, 4 bytes an element). Its elementwise results are rounded back to
    bf16 (as XLA rounds a bf16 add); mixing it with a float32 array gives
    float32. `np.asarray(a)` and `a.astype(np.float32)` are the plain float32
    array (what np.save, np.issubdtype and friends need).
  * FP8 tensors come back as float32 (exact).
Casts round to nearest even, as kernels/fp8.h does (bf16 NaN stays a quiet NaN).
"""
import grpc
import numpy as np

from te_client import errors

try:
    import ml_dtypes
except ImportError:  # the Debian machine: no ml_dtypes
    ml_dtypes = None

# te.v1.DType values (tensor.proto), kept here so this module needs no stubs.
FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3, FLOAT8_E5M2, INT32, BOOL = 1, 2, 3, 4, 5, 6, 7
NAMES = {FLOAT32: "float32", BFLOAT16: "bfloat16", FLOAT16: "float16", FLOAT8_E4M3: "float8_e4m3fn",
         FLOAT8_E5M2: "float8_e5m2", INT32: "int32", BOOL: "bool"}
ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2, FLOAT16: 2, FLOAT8_E4M3: 1, FLOAT8_E5M2: 1, INT32: 4, BOOL: 1}


class _Bfloat16Marker:
    """te_client.bfloat16 where ml_dtypes is missing, and a Bfloat16Array's
    .dtype: names the type (name, str, itemsize 2: bf16's own), compares equal
    to itself and "bfloat16" only. Attributes bf16 has no numpy spelling for
    (char, type...) are those of the float32 storage numpy computes in, so
    numpy's helpers (np.testing) treat the array as a float array."""
    name = "bfloat16"
    itemsize = 2
    kind = "f"
    _storage = np.dtype(np.float32)

    def __getattr__(self, attr):
        if attr.startswith("__") or attr == "dtype":   # np.dtype(te.bfloat16) is refused: it is not float32
            raise AttributeError(attr)
        return getattr(self._storage, attr)

    def __eq__(self, other):
        return isinstance(other, _Bfloat16Marker) or (isinstance(other, str) and other == "bfloat16")

    def __hash__(self):
        return hash("bfloat16")

    def __str__(self):
        return "bfloat16"

    def __repr__(self):
        return "te_client.bfloat16 (float32 storage: ml_dtypes is not installed)"


bfloat16 = ml_dtypes.bfloat16 if ml_dtypes is not None else _Bfloat16Marker()


# ---- bf16 bit arithmetic (float32 <-> the top 16 bits, nearest even) --------------------

def float32_to_bf16_bits(values):
    """uint16 bf16 bits of float32 values: round to nearest even; NaN -> quiet NaN."""
    u = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16   # uint32 arithmetic wraps like the C++
    return np.where(nan, (u >> 16) | 0x0040, rounded).astype("<u2")


def bf16_bits_to_float32(bits):
    return (np.asarray(bits, dtype="<u2").astype("<u4") << 16).view("<f4")


def round_to_bf16(values):
    """float32 values rounded to the nearest bf16 (still float32)."""
    return bf16_bits_to_float32(float32_to_bf16_bits(values)).reshape(np.shape(values))


class Bfloat16Array(np.ndarray):
    """bf16 values in float32 storage (used where ml_dtypes is missing).

    Create with te_client.asarray(x, te_client.bfloat16). Views (reshape, split,
    slices) stay Bfloat16Array; elementwise results are rounded to bf16 unless a
    plain float array takes part (then float32, as JAX promotes bf16 + f32).
    """

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        all_bf16 = all(isinstance(i, Bfloat16Array) or not isinstance(i, np.ndarray)
                       or not np.issubdtype(i.dtype, np.floating) for i in inputs)
        plain = [i.view(np.ndarray) if isinstance(i, Bfloat16Array) else i for i in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Bfloat16Array) else o for o in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None:
            for o in out:
                if isinstance(o, Bfloat16Array):
                    o.view(np.ndarray)[...] = round_to_bf16(o.view(np.ndarray))
            return out[0] if len(out) == 1 else out
        wrap = (lambda r: _as_bf16_result(r) if all_bf16 else r)
        return tuple(wrap(r) for r in result) if isinstance(result, tuple) else wrap(result)

    @property
    def dtype(self):
        """te_client.bfloat16: what the values are and how they travel (the storage is float32)."""
        return bfloat16

    def astype(self, dtype, *args, **kwargs):
        if _is_bf16(dtype):
            return self.copy()
        return self.view(np.ndarray).astype(dtype, *args, **kwargs)

    def __repr__(self):
        return "Bfloat16Array(%s)" % np.array2string(self.view(np.ndarray), separator=", ")


def _as_bf16_result(result):
    if isinstance(result, np.ndarray) and np.issubdtype(result.dtype, np.floating):
        return round_to_bf16(result.astype(np.float32)).view(Bfloat16Array)
    if isinstance(result, np.floating):
        return np.float32(round_to_bf16(np.float32(result)))
    return result


def _is_bf16(dtype):
    if dtype is bfloat16 or isinstance(dtype, _Bfloat16Marker):
        return True
    if isinstance(dtype, str):
        return dtype == "bfloat16"
    return ml_dtypes is not None and np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)


# ---- FP8 (decode only without ml_dtypes: FP8 never has to be sent from float32) ---------

def _fp8_table(exponent_bits, mantissa_bits, bias, ieee_specials):
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> mantissa_bits) & ((1 << exponent_bits) - 1)
    man = codes & ((1 << mantissa_bits) - 1)
    frac = man / float(1 << mantissa_bits)
    normal = (1.0 + frac) * np.power(2.0, exp - bias)
    subnormal = frac * np.power(2.0, 1 - bias)
    values = sign * np.where(exp == 0, subnormal, normal)
    top = (1 << exponent_bits) - 1
    if ieee_specials:  # E5M2: exponent all ones is inf (mantissa 0) or NaN
        values = np.where((exp == top) & (man == 0), sign * np.inf, values)
        values = np.where((exp == top) & (man != 0), np.nan, values)
    else:              # E4M3 "fn": only S.1111.111 is NaN; no inf
        values = np.where((exp == top) & (man == (1 << mantissa_bits) - 1), np.nan, values)
    return values.astype(np.float32)


_E4M3_VALUES = _fp8_table(4, 3, 7, ieee_specials=False)
_E5M2_VALUES = _fp8_table(5, 2, 15, ieee_specials=True)


# ---- numpy <-> wire ---------------------------------------------------------------------

def _numpy_dtype_of(wire):
    """The numpy dtype a wire dtype is decoded to, or None for the fallbacks."""
    if wire == FLOAT32:
        return np.dtype("<f4")
    if wire == FLOAT16:
        return np.dtype("<f2")
    if wire == INT32:
        return np.dtype("<i4")
    if wire == BOOL:
        return np.dtype(np.bool_)
    if ml_dtypes is not None:
        return {BFLOAT16: np.dtype(ml_dtypes.bfloat16), FLOAT8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
                FLOAT8_E5M2: np.dtype(ml_dtypes.float8_e5m2)}.get(wire)
    return None


def as_numpy(x):
    """x (numpy, JAX array, nested lists, scalar) as a numpy array, not copied when it is one."""
    if isinstance(x, np.ndarray):
        return x
    return np.asarray(x)


def wire_dtype(array, field="tensor"):
    """The te.v1.DType that `array` travels as (float64 and int64 narrowed as JAX does)."""
    if isinstance(array, Bfloat16Array):
        return BFLOAT16
    dt = array.dtype
    if dt in (np.float32, np.float64):
        return FLOAT32
    if dt == np.float16:
        return FLOAT16
    if dt in (np.int32, np.int64):
        return INT32
    if dt == np.bool_:
        return BOOL
    if ml_dtypes is not None:
        for wire in (BFLOAT16, FLOAT8_E4M3, FLOAT8_E5M2):
            if dt == _numpy_dtype_of(wire):
                return wire
    raise errors.InvalidArgumentError("%s: dtype %s has no te.v1 DType (float32, bfloat16, float16, "
                                      "float8_e4m3fn, float8_e5m2, int32, bool)" % (field, dt))


def to_wire(x, field="tensor"):
    """(te.v1.DType, shape, little-endian bytes) of an array-like."""
    array = as_numpy(x)
    wire = wire_dtype(array, field)
    if wire == BFLOAT16 and isinstance(array, Bfloat16Array):
        data = float32_to_bf16_bits(array.view(np.ndarray)).tobytes()
    elif wire == INT32 and array.dtype == np.int64:
        if array.size and (array.min() < -2**31 or array.max() >= 2**31):
            raise errors.InvalidArgumentError("%s: int64 values do not fit int32" % field)
        data = array.astype("<i4").tobytes()
    else:
        data = np.ascontiguousarray(array, dtype=_numpy_dtype_of(wire)).tobytes()
    return wire, tuple(int(d) for d in array.shape), data


def to_wire_view(x, field="tensor"):
    """As to_wire, but the bytes are a memoryview of the array itself, not a
    copy, where its memory already is the wire layout (C-contiguous, the wire
    dtype); a copy otherwise. For the large-tensor paths, whose copy into a
    message or shared memory is the only one then. Do not change the array
    while the view is in use."""
    array = as_numpy(x)
    wire = wire_dtype(array, field)
    target = _numpy_dtype_of(wire)
    if (target is not None and not isinstance(array, Bfloat16Array) and array.dtype == target
            and array.flags.c_contiguous):
        return wire, tuple(int(d) for d in array.shape), memoryview(array.reshape(-1).view(np.uint8))
    return to_wire(array, field)


def from_wire(wire, shape, data, field="tensor"):
    """A numpy array from wire bytes (see the module comment for the fallbacks)."""
    shape = tuple(int(d) for d in shape)
    if wire not in ITEMSIZE:
        raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: unknown dtype %d from the server" % (field, wire))
    want = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[wire]
    if len(data) != want:
        raise errors.error(grpc.StatusCode.DATA_LOSS, "%s: %d bytes for %s%s; want %d" % (
            field, len(data), NAMES[wire], list(shape), want))
    numpy_dtype = _numpy_dtype_of(wire)
    if numpy_dtype is not None:
        return np.frombuffer(data, dtype=numpy_dtype).reshape(shape).copy()
    if wire == BFLOAT16:
        return bf16_bits_to_float32(np.frombuffer(data, dtype="<u2")).reshape(shape).view(Bfloat16Array)
    table = _E4M3_VALUES if wire == FLOAT8_E4M3 else _E5M2_VALUES
    return table[np.frombuffer(data, dtype=np.uint8)].reshape(shape)


def dtype_name(wire):
    return NAMES.get(wire, "dtype(%d)" % wire)


def dtype_of(x):
    """The element type x travels as, by name: "bfloat16" for a Bfloat16Array
    (as its .dtype says)."""
    if hasattr(x, "wire_dtype"):
        return dtype_name(x.wire_dtype)
    return dtype_name(wire_dtype(as_numpy(x)))


def asarray(x, dtype=None):
    """x as a numpy array of `dtype` (numpy dtype, "bfloat16", te_client.bfloat16...).

    jnp.asarray(x).astype(dtype) for te_client: bfloat16 gives an ml_dtypes
    array, or a Bfloat16Array without ml_dtypes.
    """
    array = as_numpy(x)
    if dtype is None:
        return array
    if _is_bf16(dtype):
        if ml_dtypes is not None:
            return array.astype(ml_dtypes.bfloat16)
        if isinstance(array, Bfloat16Array):
            return array
        return round_to_bf16(array.astype(np.float32)).view(Bfloat16Array)
    return array.astype(dtype)


def cast_to_wire(x, wire):
    """x converted to travel as `wire` (a float32 dy for a bf16 layer...); as is when it already does."""
    if hasattr(x, "wire_dtype"):   # a ResidentTensor: the server checks it
        return x
    array = as_numpy(x)
    if wire_dtype(array) == wire:
        return array
    if wire == BFLOAT16:
        return asarray(np.asarray(array, np.float32), bfloat16)
    numpy_dtype = _numpy_dtype_of(wire)
    if numpy_dtype is None:
        raise errors.InvalidArgumentError("cannot convert to %s without ml_dtypes" % dtype_name(wire))
    return np.asarray(array, np.float32).astype(numpy_dtype) if np.issubdtype(numpy_dtype, np.floating) \
        else array.astype(numpy_dtype)


def zeros(shape, wire):
    """Zeros of a wire dtype, as from_wire would return them."""
    numpy_dtype = _numpy_dtype_of(wire)
    if numpy_dtype is not None:
        return np.zeros(shape, numpy_dtype)
    if wire == BFLOAT16:
        return np.zeros(shape, np.float32).view(Bfloat16Array)
    return np.zeros(shape, np.float32)


def is_floating(array):
    return isinstance(array, Bfloat16Array) or wire_dtype(array) in (
        FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3, FLOAT8_E5M2)
