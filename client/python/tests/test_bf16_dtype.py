"""A bf16 result's .dtype says what te.dtype_of says, with ml_dtypes and without it."""
import numpy as np
import pytest

import te_client as te
import te_client.flax as te_flax
from te_client import dtypes


def test_bf16_dtype_says_what_dtype_of_says(session, rng):
    x = te.asarray(rng.standard_normal((2, 3, 4)), te.bfloat16)
    layer = te_flax.DenseGeneral(features=5)
    y = layer.apply(layer.init(0, x), x)
    for a in (x, y, x * 2, x.reshape(6, 4), np.split(x, 2, axis=-1)[0]):
        assert str(a.dtype) == te.dtype_of(a) == "bfloat16", type(a)
        assert a.dtype == te.bfloat16 and a.dtype != np.float32 and a.dtype.itemsize == 2
    if dtypes.ml_dtypes is None:
        # The float32 storage is named as such, and np.testing still compares the values.
        assert isinstance(y, te.Bfloat16Array) and np.asarray(y).dtype == np.float32 and y.itemsize == 4
        np.testing.assert_array_equal(y, np.asarray(y))
        assert repr(te.bfloat16).startswith("te_client.bfloat16 (float32 storage")
        with pytest.raises(TypeError):
            np.dtype(y.dtype)            # numpy has no bf16 dtype here: it is not float32 in disguise
