"""autocast, and the FP8 recipes (te_client.common.recipe, re-exported here).

    from te_client.recipe import Format, DelayedScaling   # the same classes as te_client.common.recipe's
    fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    with te_client.autocast(enabled=True, recipe=fp8_recipe):
        params = layer.init(key, x)     # creates the fp8_metas collection

A module's init / apply / value_and_grad and speedometer read the autocast
current at call time. Autocasts nest (the inner one wins until it exits) and
are per thread and per asyncio task (a contextvars.ContextVar).
"""
import contextlib
import contextvars
import dataclasses

from te_client import errors
from te_client.common.recipe import (RECIPES, DelayedScaling, Float8CurrentScaling, Format,
                                     MXFP8BlockScaling, NVFP4BlockScaling, Recipe)  # noqa: F401


def to_proto(recipe, recipe_pb2):
    """te.v1.Recipe with every field written, TE's defaults included."""
    msg = recipe_pb2.Recipe()
    fmt = lambda f: recipe_pb2.Fp8Format.Value(Format(f).value)
    if isinstance(recipe, DelayedScaling):
        if recipe.amax_compute_algo not in ("max", "most_recent"):
            raise errors.InvalidArgumentError(
                "recipe.amax_compute_algo: %r; want 'max' or 'most_recent'" % (recipe.amax_compute_algo,))
        d = msg.delayed_scaling
        d.margin = recipe.margin
        d.fp8_format = fmt(recipe.fp8_format)
        d.amax_history_len = recipe.amax_history_len
        d.amax_compute_algo = recipe.amax_compute_algo
    elif isinstance(recipe, Float8CurrentScaling):
        msg.float8_current_scaling.fp8_format = fmt(recipe.fp8_format)
        msg.float8_current_scaling.amax_epsilon = recipe.amax_epsilon
    elif isinstance(recipe, MXFP8BlockScaling):
        msg.mxfp8_block_scaling.fp8_format = fmt(recipe.fp8_format)
    elif isinstance(recipe, NVFP4BlockScaling):
        msg.nvfp4_block_scaling.SetInParent()
    else:
        raise errors.InvalidArgumentError("recipe: %r is not one of %s" % (
            recipe, ", ".join(r.__name__ for r in RECIPES)))
    return msg


def from_proto(msg, recipe_pb2):
    """The recipe of a te.v1.Recipe (unset fields take TE's defaults); None when none is set."""
    kind = msg.WhichOneof("kind")
    fmt = lambda v, default: Format(recipe_pb2.Fp8Format.Name(v)) if v else default
    if kind == "delayed_scaling":
        d = msg.delayed_scaling
        return DelayedScaling(
            margin=d.margin if d.HasField("margin") else 0.0,
            fp8_format=fmt(d.fp8_format, Format.HYBRID),
            amax_history_len=d.amax_history_len if d.HasField("amax_history_len") else 1024,
            amax_compute_algo=d.amax_compute_algo if d.HasField("amax_compute_algo") else "max")
    if kind == "float8_current_scaling":
        c = msg.float8_current_scaling
        return Float8CurrentScaling(fmt(c.fp8_format, Format.HYBRID),
                                    c.amax_epsilon if c.HasField("amax_epsilon") else 0.0)
    if kind == "mxfp8_block_scaling":
        return MXFP8BlockScaling(fmt(msg.mxfp8_block_scaling.fp8_format, Format.E4M3))
    if kind == "nvfp4_block_scaling":
        return NVFP4BlockScaling()
    return None


# ---- autocast -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AutocastState:
    enabled: bool = False
    recipe: object = None   # None with enabled: the session's negotiated recipe


_current = contextvars.ContextVar("te_client_autocast", default=AutocastState())


def current_autocast():
    return _current.get()


@contextlib.contextmanager
def autocast(enabled=False, recipe=None, mesh_resource=None):
    """te.autocast: FP8 on (with `recipe`, or the session's recipe when None) in the block."""
    if mesh_resource is not None:
        raise errors.InvalidArgumentError("autocast.mesh_resource: te_server runs unsharded layers")
    if recipe is not None and not isinstance(recipe, RECIPES):
        raise errors.InvalidArgumentError("autocast.recipe: %r is not a recipe" % (recipe,))
    token = _current.set(AutocastState(bool(enabled), recipe))
    try:
        yield
    finally:
        _current.reset(token)


def fp8_autocast(enabled=False, fp8_recipe=None, mesh_resource=None):
    """te.fp8_autocast, the older spelling of autocast."""
    return autocast(enabled, fp8_recipe, mesh_resource)


def autocast_proto(state, recipe_pb2):
    msg = recipe_pb2.Autocast(enabled=state.enabled)
    if state.enabled and state.recipe is not None:
        msg.recipe.CopyFrom(to_proto(state.recipe, recipe_pb2))
    return msg
