"""optax's softmax cross entropy with integer labels as a server loss node, and
the training step of a composite whose result is that loss (DESIGN.md section 12).

    from te_client import losses as optax      # was: import optax

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens, labels):
            embed = nn.Embed(256, 64)
            x = embed(tokens)
            ...                                  # TE TransformerLayers, a final norm
            logits = embed.attend(x)             # or nn.Dense(256)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

Inside a traced composite, `softmax_cross_entropy_with_integer_labels(...)
.mean()` records a softmax_cross_entropy node: the float32 mean over the
tokens of logsumexp(logits) - logits[label]. The composite's y is then its
loss: `apply(params, tokens, labels)` is a Forward that returns the loss, and
`te_client.optim.train_step(state, tokens, labels)` is one ForwardBackward with apply_update
in which only the int32 ids and labels cross the wire (the server seeds the
backward itself; no dy). (te_client.optim.train_step is the one step.) On numpy arrays the function is optax's, in float64.
"""
import dataclasses

import numpy as np

from te_client import dtypes, errors, layer_calls, symbolic
from te_client._pb import layers_pb2, service_pb2

__all__ = ["softmax_cross_entropy_with_integer_labels"]


class _TokenLosses:
    """optax's per-token losses of a traced composite: GraphSpec has the mean
    over the tokens as one node, so `.mean()` is what may follow."""

    def __init__(self, logits, labels):
        self.logits, self.labels = logits, labels
        self.shape = tuple(labels.shape)

    def mean(self, axis=None):
        if axis is not None:
            raise NotImplementedError("softmax_cross_entropy_with_integer_labels(...).mean(axis=%r): the loss "
                                      "node is the mean over every token" % (axis,))
        return self.logits.trace.record("softmax_cross_entropy", layers_pb2.GraphSpec.SoftmaxCrossEntropy(),
                                        [self.logits, self.labels], [((), dtypes.FLOAT32)])[0]

    def __getattr__(self, name):
        raise TypeError("softmax_cross_entropy_with_integer_labels(...).%s of a traced composite: its server "
                        "node is the mean over the tokens; call .mean()" % name)


def softmax_cross_entropy_with_integer_labels(logits, labels):
    """optax.softmax_cross_entropy_with_integer_labels: logits [..., V], labels
    int [...] -> losses [...] (traced: only their .mean() is recorded)."""
    if isinstance(logits, symbolic.Symbol) or isinstance(labels, symbolic.Symbol):
        if not (isinstance(logits, symbolic.Symbol) and isinstance(labels, symbolic.Symbol)):
            raise TypeError("softmax_cross_entropy_with_integer_labels: inside a composite both logits and labels "
                            "are traced tensors (pass the labels to __call__)")
        if labels.wire != dtypes.INT32:
            raise TypeError("softmax_cross_entropy_with_integer_labels: labels are %s; want int32" %
                            dtypes.dtype_name(labels.wire))
        if tuple(logits.shape[:-1]) != tuple(labels.shape):
            raise ValueError("softmax_cross_entropy_with_integer_labels: labels %s do not fit logits %s" % (
                list(labels.shape), list(logits.shape)))
        return _TokenLosses(logits, labels)
    logits = np.asarray(dtypes.as_numpy(logits), np.float64)
    labels = np.asarray(labels)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
    return lse - np.take_along_axis(logits, labels[..., None].astype(np.int64), axis=-1)[..., 0]


def softmax_cross_entropy(logits, labels):
    """optax.softmax_cross_entropy: logits [..., V], labels [..., V] (one-hot
    or any distribution over V) -> losses [...] = -sum(labels * log_softmax(logits)).
    Traced, it is glue (log_softmax, multiply, sum) on float labels; integer
    labels go to softmax_cross_entropy_with_integer_labels."""
    if isinstance(logits, symbolic.Symbol) or isinstance(labels, symbolic.Symbol):
        from te_client import numpy as jnp   # numpy <- losses would be a cycle at import
        return -jnp.sum(labels * symbolic.softmax(logits, axis=-1, log=True), axis=-1)
    logits = np.asarray(dtypes.as_numpy(logits), np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_p = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
    return -(np.asarray(dtypes.as_numpy(labels), np.float64) * log_p).sum(axis=-1)
