"""The parts of flax.linen the quickstart's composed layers use, for te_client.

    from te_client import linen as nn          # was: from flax import linen as nn

Module and compact are te_client's (module.py): a composite's __call__ is
traced into one server graph. Dropout is Flax's module (named "Dropout_N"),
recorded as a dropout node: inverted dropout on the server, seeded with
DeriveSeed(apply's rngs['dropout'], its name) and off when apply's
deterministic is True. make_causal_mask on a traced x[..., 0] records a
causal-mask node (read only as an attention module's mask, as TE reads it:
the causal types and no_mask ignore it, padding applies its ones as masked
out); on arrays it is Flax's function in numpy.

Flax's own layers (Dense, DenseGeneral, LayerNorm,
MultiHeadDotProductAttention) are server modules with Flax's semantics
(te.v1's flax_* LayerSpecs: parameter names, initialisers and dtype rules,
DESIGN.md section 11); nn.gelu is TE's tanh gelu, Flax's default. Inside a
composite each records a module node, so the quickstart's plain-Flax layer,
written as Flax writes it, is one server graph.
"""
from typing import Optional, Sequence, Union

import numpy as np

from te_client import dtypes, initializers, symbolic
from te_client.flax import _dense_output_shape, _ints
from te_client.module import Module, ServerModule, check_deterministic, compact, current_frame
from te_client._pb import layers_pb2

__all__ = ["Module", "compact", "merge_param", "Dropout", "make_causal_mask", "gelu", "relu", "silu", "swish",
           "sigmoid", "tanh", "softmax", "log_softmax", "initializers", "Dense", "DenseGeneral", "LayerNorm", "RMSNorm",
           "MultiHeadDotProductAttention", "Embed", "Sequential"]


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
    causal_mask node: a bool [B, 1, S, S] mask read only as an attention
    module's mask (TE's causal types and no_mask ignore it, as TE does; a
    padding module applies it elementwise, its ones masked out), so `dtype`
    changes nothing there."""
    if isinstance(x, symbolic.Symbol):
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
    source = x.origin[0] if x.origin is not None and x.origin[0].shape[:2] == x.shape else x
    batch, seq = x.shape
    return source.trace.record("causal_mask", layers_pb2.GraphSpec.CausalMask(), [source],
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
                                      "are DeriveSeed(apply's rngs['dropout'], node name)" % name)
        dims = sorted({symbolic.normalized_axis(d, inputs.ndim, "Dropout.broadcast_dims") for d in self.broadcast_dims})
        frame.trace.claim(name, self)
        return frame.trace.record("dropout", layers_pb2.GraphSpec.Dropout(
            rate=float(self.rate), broadcast_dims=dims), [inputs], [(inputs.shape, inputs.wire)], name=name)[0]


# ---- Flax's own modules, on the server with Flax's semantics ------------------------------

def _dtype_wire(dtype, field):
    """A Flax dtype field as te.v1's DType (None: unset, Flax's "promote")."""
    return 0 if dtype is None else symbolic.wire_of(dtype, field)   # 0: te.v1.DTYPE_UNSPECIFIED


def _precision(precision, field):
    """A Flax `precision` (None, "default", "highest", jax.lax.Precision.X) as te.v1.Precision.
    DEFAULT is JAX's default: TensorFloat-32 float32 matmuls on a GPU, exact float32 on the CPU."""
    pb = layers_pb2
    name = precision if precision is None or isinstance(precision, str) else getattr(precision, "name", str(precision))
    name = "default" if name is None else str(name).rsplit(".", 1)[-1].lower()
    table = {"default": pb.PRECISION_DEFAULT, "highest": pb.PRECISION_HIGHEST, "float32": pb.PRECISION_HIGHEST}
    if name not in table:
        raise NotImplementedError("%s: %r; te.v1 has DEFAULT (TensorFloat-32 on a GPU) and HIGHEST (float32)" % (
            field, precision))
    return table[name]


class _FlaxModule(ServerModule):
    """A flax.linen module that is one server module (DESIGN.md section 11):
    Flax's parameter names, shapes and initialisers, and Flax's dtype rule:
    without `dtype` the computation (and the result) is jnp's promotion of
    the input and `param_dtype`, so a bfloat16 x with float32 parameters
    gives float32."""
    has_params = True

    def _wire_fields(self, *names):
        """The spec's fields of the same name for each of `names` ("dtype",
        "param_dtype", "precision"), as te.v1 takes them; an unsupported value
        is an error naming "<Module>.<field>"."""
        convert = {"dtype": _dtype_wire, "param_dtype": _dtype_wire, "precision": _precision}
        module = type(self).__name__
        return {name: convert[name](getattr(self, name), "%s.%s" % (module, name)) for name in names}

    def output_wire(self, input_wire):
        if self.dtype is not None:
            return symbolic.wire_of(self.dtype, type(self).__name__ + ".dtype")
        if not self.has_params:
            return input_wire
        return symbolic._promoted((input_wire, symbolic.wire_of(self.param_dtype, type(self).__name__ + ".param_dtype")),
                                  type(self).__name__)


class Dense(_FlaxModule):
    """flax.linen.Dense: kernel (in, features) lecun_normal, bias (features) zeros.

    With kernel_init or bias_init (te_client.linen.initializers) it is traced
    as Flax computes it: Param nodes kernel and bias (the same variable paths)
    and an einsum plus the bias, instead of the server's flax_dense module,
    whose initialisers are Flax's defaults."""
    features: int
    use_bias: bool = True
    dtype: Optional[object] = None
    param_dtype: object = np.float32
    precision: Optional[object] = None
    kernel_init: object = None
    bias_init: object = None

    def spec(self):
        pb = layers_pb2
        return pb.LayerSpec(flax_dense=pb.FlaxDense(
            features=int(self.features), use_bias=self.use_bias,
            **self._wire_fields("dtype", "param_dtype", "precision")))

    def output_shapes(self, input_shapes):
        return [tuple(input_shapes[0][:-1]) + (int(self.features),)]

    def __call__(self, inputs):
        if self.kernel_init is None and self.bias_init is None:
            return self._call(inputs)
        frame = current_frame(self)
        if frame.mode != "trace" or not isinstance(inputs, symbolic.Symbol):
            raise NotImplementedError("Dense(kernel_init=..., bias_init=...) runs inside a composite (a Module's "
                                      "traced __call__) or a traced loss function")
        frame.trace.claim("/".join(self._scope_in(frame)), self)
        kernel = Module.param(self, "kernel", self.kernel_init or initializers.lecun_normal(),
                              (inputs.shape[-1], int(self.features)), self.param_dtype)
        wire = self.output_wire(inputs.wire)
        y = symbolic.einsum("...k,kn->...n", inputs._cast(wire, "Dense") if wire != inputs.wire else inputs,
                            kernel._cast(wire, "Dense") if wire != kernel.wire else kernel, self.precision)
        if self.use_bias:
            bias = Module.param(self, "bias", self.bias_init or initializers.zeros, (int(self.features),),
                                self.param_dtype)
            y = y + (bias._cast(wire, "Dense") if wire != bias.wire else bias)
        return y


class DenseGeneral(_FlaxModule):
    """flax.linen.DenseGeneral: x contracted over `axis` with kernel (x.shape[axis]..., features...)."""
    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    dtype: Optional[object] = None
    param_dtype: object = np.float32
    precision: Optional[object] = None

    def spec(self):
        pb = layers_pb2
        return pb.LayerSpec(flax_dense_general=pb.FlaxDenseGeneral(
            features=_ints(self.features), axis=_ints(self.axis), use_bias=self.use_bias,
            **self._wire_fields("dtype", "param_dtype", "precision")))

    def output_shapes(self, input_shapes):
        return [_dense_output_shape(input_shapes[0], self.axis, self.features, "DenseGeneral")]

    def __call__(self, inputs):
        return self._call(inputs)


class LayerNorm(_FlaxModule):
    """flax.linen.LayerNorm over the last axis: scale (ones) and bias (zeros)."""
    epsilon: float = 1e-6
    dtype: Optional[object] = None
    param_dtype: object = np.float32
    use_bias: bool = True
    use_scale: bool = True

    @property
    def has_params(self):
        return self.use_bias or self.use_scale

    def spec(self):
        pb = layers_pb2
        return pb.LayerSpec(flax_layer_norm=pb.FlaxLayerNorm(
            epsilon=float(self.epsilon), use_bias=self.use_bias, use_scale=self.use_scale,
            **self._wire_fields("dtype", "param_dtype")))

    def __call__(self, x):
        return self._call(x)


class MultiHeadDotProductAttention(_FlaxModule):
    """flax.linen.MultiHeadDotProductAttention: query/key/value projections
    (features, num_heads, qkv_features / num_heads), dot-product attention
    with dropout on its weights, and the out projection. Its mask is Flax's
    (True = attend): inside a composite, nn.make_causal_mask's result."""
    num_heads: int
    qkv_features: Optional[int] = None
    out_features: Optional[int] = None
    dropout_rate: float = 0.0
    deterministic: Optional[bool] = None
    broadcast_dropout: bool = True
    use_bias: bool = True
    dtype: Optional[object] = None
    param_dtype: object = np.float32
    precision: Optional[object] = None

    def spec(self):
        pb = layers_pb2
        msg = pb.FlaxMultiHeadDotProductAttention(
            num_heads=int(self.num_heads), dropout_rate=float(self.dropout_rate), use_bias=self.use_bias,
            broadcast_dropout=self.broadcast_dropout, **self._wire_fields("dtype", "param_dtype", "precision"))
        if self.qkv_features is not None:
            msg.qkv_features = int(self.qkv_features)
        if self.out_features is not None:
            msg.out_features = int(self.out_features)
        return pb.LayerSpec(flax_multi_head_dot_product_attention=msg)

    def output_shapes(self, input_shapes):
        q = tuple(input_shapes[0])
        return [q[:-1] + (int(self.out_features) if self.out_features is not None else q[-1],)]

    def dropout_rates(self):
        return (self.dropout_rate,)

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                 deterministic=None, dropout_rng=None, sow_weights=False):
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None.")
            inputs_k = inputs_v = inputs_kv
        if dropout_rng is not None or sow_weights:
            raise NotImplementedError("MultiHeadDotProductAttention: dropout_rng and sow_weights; a graph's "
                                      "dropout seeds are DeriveSeed(apply's rngs['dropout'], node name)")
        # Flax: inputs_k defaults to inputs_q, inputs_v to inputs_k.
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        # Flax: deterministic matters (and must be given) only with dropout.
        deterministic = merge_param("deterministic", self.deterministic, deterministic) if self.dropout_rate > 0.0 else True
        if mask is not None and not isinstance(mask, symbolic.Symbol):
            raise NotImplementedError(
                "MultiHeadDotProductAttention: a mask array; inside a composite pass nn.make_causal_mask's "
                "result (a causal mask), or None")
        return self._call(inputs_q, [inputs_k, inputs_v], mask, deterministic)


def _activation(op, name, eager):
    def fn(x):
        if isinstance(x, symbolic.Symbol):
            return symbolic.unary(op, x, name)
        return eager(_eager_array(x))
    fn.__name__ = name
    fn.__doc__ = "flax.linen.%s (jax.nn.%s): a unary node on a traced tensor, numpy on an array." % (name, name)
    return fn


def _eager_array(x):
    a = np.asarray(x)
    return a if a.dtype.kind == "f" else a.astype(np.float32)


_U = layers_pb2.GraphSpec.Unary
relu = _activation(_U.RELU, "relu", lambda a: np.maximum(a, 0))
silu = swish = _activation(_U.SILU, "silu", lambda a: a / (1 + np.exp(-a)))
sigmoid = _activation(_U.SIGMOID, "sigmoid", lambda a: 1 / (1 + np.exp(-a)))
tanh = _activation(_U.TANH, "tanh", np.tanh)


def gelu(x, approximate=True):
    """flax.linen.gelu (jax.nn.gelu): on a traced tensor, the tanh formula
    (approximate=True, Flax's default) as TE's activation node, erf's as a
    unary node; on an array numpy's."""
    if isinstance(x, symbolic.Symbol):
        if not approximate:
            return symbolic.unary(_U.GELU_EXACT, x, "gelu")
        from te_client.activation import _Activation   # activation <- module <- linen
        return x.trace.record("module", _Activation.spec_of(("gelu",)), [x], [(x.shape, x.wire)], label="gelu")[0]
    a = _eager_array(x)
    if not approximate:
        from math import erf
        return a * 0.5 * (1.0 + np.vectorize(erf)(a / np.sqrt(2.0)).astype(a.dtype))
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def softmax(x, axis=-1):
    """jax.nn.softmax: one numerically stable node on a traced tensor."""
    if isinstance(x, symbolic.Symbol):
        return symbolic.softmax(x, axis, log=False)
    a = _eager_array(x)
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax(x, axis=-1):
    """jax.nn.log_softmax: one numerically stable node on a traced tensor."""
    if isinstance(x, symbolic.Symbol):
        return symbolic.softmax(x, axis, log=True)
    a = _eager_array(x)
    shifted = a - a.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


class RMSNorm(Module):
    """flax.linen.RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * scale,
    statistics in float32, param "scale" (features) from scale_init (ones).
    Traced as glue (reduce, rsqrt, multiply) around a Param node, so its
    variable is params/<scope>/scale as in Flax."""
    epsilon: float = 1e-6
    dtype: Optional[object] = None
    param_dtype: object = np.float32
    use_scale: bool = True
    scale_init: object = initializers.ones
    reduction_axes: object = -1
    feature_axes: object = -1

    @compact
    def __call__(self, x):
        if self.reduction_axes not in (-1, (-1,)) or self.feature_axes not in (-1, (-1,)):
            raise NotImplementedError("RMSNorm: reduction_axes and feature_axes other than -1")
        from te_client import numpy as jnp   # numpy <- symbolic: no cycle, but linen is imported by te_client first
        x32 = x.astype(np.float32) if x.dtype != np.float32 else x
        y = x32 * jnp.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        out = x.dtype
        if self.use_scale:
            scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
            y = y * scale
            out = jnp.result_type(x, scale) if self.dtype is None else self.dtype
        elif self.dtype is not None:
            out = self.dtype
        return y.astype(out)


class Sequential(Module):
    """flax.linen.Sequential: calls each of `layers` on the previous one's
    result; modules among them are named layers_<i> (their index), as Flax names them."""
    layers: Sequence[object] = ()

    def __call__(self, *args, **kwargs):
        if not self.layers:
            raise ValueError("Empty Sequential module %s." % self.name)
        frame = current_frame(self)
        scope = frame.scopes[-1].path
        outputs = None
        for i, layer in enumerate(self.layers):
            if isinstance(layer, Module):
                object.__setattr__(layer, "_bound", (frame, tuple(scope) + (layer.name or "layers_%d" % i,)))
            outputs = layer(*args, **kwargs) if i == 0 else (layer(*outputs) if isinstance(outputs, tuple) else
                                                              layer(outputs))
        return outputs


class Embed(_FlaxModule):
    """flax.linen.Embed: int32 token ids [...] -> embedding[ids] [..., features].

    Param embedding (num_embeddings, features), Flax's default_embed_init
    (variance_scaling(1.0, "fan_in", "normal", out_axis=0): normal, std
    1/sqrt(features)), drawn on the server. The result is in `dtype`, or
    param_dtype when unset (Flax promotes the embedding alone). An id outside
    [0, num_embeddings) gives a NaN row, as jnp.take does. `attend(query)` is
    the output projection tied to the embedding (query @ embedding.T):
    inside a composite, call the Embed first, then attend (an attend node
    reading this Embed's embedding; its gradient is summed into it)."""
    num_embeddings: int
    features: int
    dtype: Optional[object] = None
    param_dtype: object = np.float32

    def spec(self):
        pb = layers_pb2
        return pb.LayerSpec(flax_embed=pb.FlaxEmbed(
            num_embeddings=int(self.num_embeddings), features=int(self.features),
            **self._wire_fields("dtype", "param_dtype")))

    def output_wire(self, input_wire):
        if input_wire != dtypes.INT32:
            raise TypeError("Embed: inputs are %s; Embed takes int32 token ids" % dtypes.dtype_name(input_wire))
        return symbolic.wire_of(self.dtype if self.dtype is not None else self.param_dtype, "Embed.dtype")

    def output_shapes(self, input_shapes):
        return [tuple(input_shapes[0]) + (int(self.features),)]

    def __call__(self, inputs):
        return self._call(inputs)

    def attend(self, query):
        """Embed.attend: query [..., features] @ embedding.T -> [..., num_embeddings], in
        `dtype` or jnp.result_type(query, embedding)."""
        if not isinstance(query, symbolic.Symbol):
            raise TypeError("Embed.attend: query is a %s, not a traced tensor: attend runs in its composite's "
                            "graph" % type(query).__name__)
        frame = current_frame(self)
        name = "/".join(self._scope_in(frame))
        if frame.trace._owners.get(name) is not self:
            raise NotImplementedError("%s (Embed).attend before the Embed is called: call it on the token ids "
                                      "first (its module node holds the embedding)" % name)
        if not query.shape or query.shape[-1] != int(self.features):
            raise ValueError("%s (Embed).attend: query %s; want [..., %d] (features)" % (
                name, list(query.shape), self.features))
        if self.dtype is not None:
            wire = symbolic.wire_of(self.dtype, "Embed.dtype")
        else:
            wire = symbolic._promoted((query.wire, symbolic.wire_of(self.param_dtype, "Embed.param_dtype")), "attend")
        pb = layers_pb2
        return frame.trace.record("attend", pb.GraphSpec.Attend(embed=name, dtype=_dtype_wire(self.dtype, "Embed.dtype")),
                                  [query], [(tuple(query.shape[:-1]) + (int(self.num_embeddings),), wire)])[0]
