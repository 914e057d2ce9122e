"""jax.default_matmul_precision for te_client's calls.

    with te_client.default_matmul_precision("highest"):     # as jax.default_matmul_precision("highest")
        y = model.apply(variables, x)                         # exact float32 GEMMs on the GPU too

Every Forward, ForwardBackward and Benchmark request carries the precision
of its float32 GEMMs (te.v1.Precision; a Flax module's own `precision`
field wins where set): DEFAULT, JAX's default, runs TensorFloat-32 on a GPU
(exact on the CPU); HIGHEST runs exact float32. JAX's names are accepted:
"default", "high" and "tensorfloat32" are DEFAULT, "highest" and "float32"
are HIGHEST. "bfloat16" / "fastest" (one bf16 pass) has no te.v1 value and
is refused. Outside any te_client context, JAX's own setting
(jax.config.jax_default_matmul_precision, set by jax.default_matmul_precision)
applies when JAX is imported.
"""
import contextlib
import contextvars
import sys

from te_client._pb import layers_pb2

_NAMES = {"default": layers_pb2.PRECISION_DEFAULT, "high": layers_pb2.PRECISION_DEFAULT,
          "tensorfloat32": layers_pb2.PRECISION_DEFAULT, "highest": layers_pb2.PRECISION_HIGHEST,
          "float32": layers_pb2.PRECISION_HIGHEST}
_current = contextvars.ContextVar("te_client_matmul_precision", default=None)


def to_proto(name):
    """A precision name (or jax.lax.Precision) as te.v1.Precision; ValueError naming the accepted ones."""
    key = name if isinstance(name, str) else getattr(name, "name", str(name))
    key = str(key).rsplit(".", 1)[-1].lower()
    if key not in _NAMES:
        raise ValueError("default_matmul_precision(%r): te.v1 runs %s (bfloat16 / fastest, one bf16 pass, has no "
                         "te.v1 Precision)" % (name, ", ".join(sorted(_NAMES))))
    return _NAMES[key]


@contextlib.contextmanager
def default_matmul_precision(name):
    """jax.default_matmul_precision(name) for te_client's requests in this block."""
    token = _current.set(to_proto(name))
    try:
        yield
    finally:
        _current.reset(token)


def current():
    """The te.v1.Precision the next request carries."""
    value = _current.get()
    if value is not None:
        return value
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            configured = jax.config.jax_default_matmul_precision
        except AttributeError:
            configured = None
        if configured:
            try:
                return to_proto(configured)
            except ValueError:
                pass   # JAX's bfloat16: the server's default is the nearest it runs
    return layers_pb2.PRECISION_DEFAULT
