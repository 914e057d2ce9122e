"""The parts of flax.linen the quickstart's composed layers use, for te_client.

    from te_client import linen as nn          # was: from flax import linen as nn

Module and compact are te_client's (module.py): a composite's __call__ is
traced into one server graph. Dropout is Flax's module (named "Dropout_N"),
recorded as a dropout node: inverted dropout on the server, seeded with
NodeSeed(apply's rngs['dropout'], its name) and off when apply's
deterministic is True. make_causal_mask on a traced x[..., 0] records a
causal-mask node (read only as the mask of a module with a causal
attn_mask_type); on arrays it is Flax's function in numpy.

Flax's own layers (Dense, LayerNorm, MultiHeadDotProductAttention) keep
Flax's semantics (parameter names, initialisers, dtype rules: DESIGN.md
section 11), which te.v1 has no server module for yet: calling one raises
NotImplementedError naming it. TE's modules (te_client.flax) are the ones a
composite can use today.
"""
from typing import Optional, Sequence

import numpy as np

from te_client import client as client_lib, dtypes, symbolic
from te_client.module import Module, check_deterministic, compact, current_frame

__all__ = ["Module", "compact", "merge_param", "Dropout", "make_causal_mask", "Dense", "LayerNorm",
           "MultiHeadDotProductAttention"]


def merge_param(name, a, b):
    """flax.linen.merge_param: the one of a module field and a call argument that is set."""
    if a is None and b is None:
        raise ValueError('Parameter "%s" must be passed to the constructor or at call time.' % name)
    if a is not None and b is not None:
        raise ValueError('Parameter "%s" was passed to the constructor and at call time. Should be passed '
                         'just once.' % name)
    return a if b is None else b


def make_causal_mask(x, extra_batch_dims=0, dtype=np.float32):
    """flax.linen.make_causal_mask: [batch..., 1, len, len], 1 where key <= query (attend).

    On a traced [batch, seq] tensor (the quickstart's x[..., 0]) it records a
    causal_mask node: a bool [B, 1, S, S] mask that only a module with a
    causal attn_mask_type reads (as TE's causal types apply causality
    themselves), so `dtype` changes nothing there."""
    if isinstance(x, (symbolic.Symbol, symbolic.Indexed)):
        return _traced_causal_mask(x, extra_batch_dims, dtype)
    shape = tuple(x.shape)
    mask = np.tril(np.ones((shape[-1], shape[-1]), dtype=bool))
    mask = np.broadcast_to(mask, shape[:-1] + (1,) + mask.shape)
    mask = mask.reshape((1,) * extra_batch_dims + mask.shape)
    return mask.astype(dtype)


def _traced_causal_mask(x, extra_batch_dims, dtype):
    symbolic.wire_of(dtype, "make_causal_mask")
    if extra_batch_dims:
        raise TypeError("make_causal_mask(extra_batch_dims=%d) of a traced tensor: GraphSpec's causal_mask "
                        "gives [B, 1, S, S]" % extra_batch_dims)
    if x.ndim != 2:
        raise TypeError("make_causal_mask of a traced %s: GraphSpec's causal_mask takes [batch, seq] "
                        "(x[..., 0] of x [batch, seq, hidden])" % list(x.shape))
    # The node reads x [B, S, ...] itself: x[..., 0] only names the batch and sequence axes.
    source = x.base if isinstance(x, symbolic.Indexed) else x
    batch, seq = x.shape
    return source.trace.record("causal_mask", client_lib.layers_pb2.GraphSpec.CausalMask(), [source],
                               [((batch, 1, seq, seq), dtypes.BOOL)], makes_mask=True)[0]


class Dropout(Module):
    """flax.linen.Dropout: inverted dropout, off when deterministic or rate == 0."""
    rate: float
    broadcast_dims: Sequence[int] = ()
    deterministic: Optional[bool] = None
    rng_collection: str = "dropout"

    @compact
    def __call__(self, inputs, deterministic=None, rng=None):
        deterministic = merge_param("deterministic", self.deterministic, deterministic)
        frame = current_frame(self)
        name = "/".join(frame.scopes[-1].path) or "Dropout"   # a Dropout at the root has no scope path
        if not isinstance(inputs, symbolic.Symbol):
            raise TypeError("%s (Dropout): input is a %s, not a traced tensor: a composite's dropout runs in "
                            "its graph" % (name, type(inputs).__name__))
        if self.rate == 0.0:
            return inputs
        if not 0.0 < self.rate < 1.0:
            raise NotImplementedError("%s (Dropout): rate %r; a GraphSpec dropout takes a rate in [0, 1)" % (
                name, self.rate))
        check_deterministic(frame.trace, name, "Dropout", deterministic)
        if rng is not None or self.rng_collection != "dropout":
            raise NotImplementedError("%s (Dropout): an explicit rng or rng_collection; a graph's dropout seeds "
                                      "are NodeSeed(apply's rngs['dropout'], node name)" % name)
        dims = sorted({symbolic.normalized_axis(d, inputs.ndim, "Dropout.broadcast_dims") for d in self.broadcast_dims})
        frame.trace.claim(name, self)
        return frame.trace.record("dropout", client_lib.layers_pb2.GraphSpec.Dropout(
            rate=float(self.rate), broadcast_dims=dims), [inputs], [(inputs.shape, inputs.wire)], name=name)[0]


class _FlaxLayer:
    """A Flax layer te.v1 has no server module for: constructs as Flax's does,
    and refuses to run, naming itself."""
    replacement = ""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            "nn.%s (Flax's own module) has no server-side module yet: te.v1's LayerSpec has no kind for it, "
            "so a composite cannot record it as a graph node%s" % (type(self).__name__, self.replacement))


class Dense(_FlaxLayer):
    replacement = "; te_client.flax.DenseGeneral is TE's (its own initialiser and dtype rules)"


class LayerNorm(_FlaxLayer):
    replacement = "; te_client.flax.LayerNorm is TE's (params scale, ln_bias)"


class MultiHeadDotProductAttention(_FlaxLayer):
    replacement = ("; te_client.flax.DotProductAttention is TE's (and te_client.flax.FlaxTransformerLayer "
                   "serves the quickstart's whole plain-Flax layer)")
