"""te_client: TE's JAX/Flax API, with the layers running on a te_server.

    import te_client as te                      # was: import transformer_engine.jax as te
    import te_client.flax as te_flax            # was: import transformer_engine.jax.flax as te_flax
    from te_client import linen as nn           # was: from flax import linen as nn
    import te_client.numpy as jnp               # was: import jax.numpy as jnp
    from te_client.recipe import Format, DelayedScaling

    client = te.connect("localhost:50051")
    with client.session(recipes=[DelayedScaling()]):
        layer = te_flax.DenseGeneral(features=256)
        with te.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=16)):
            params = layer.init(42, x)                 # {'params': ..., 'fp8_metas': ...}
            y = layer.apply(params, x)                 # numpy
            loss, (grads, dx) = te.value_and_grad(layer.apply)(params, x, dy)

A composite (an nn.Module whose __call__ glues TE modules with jnp.reshape,
jnp.split, +, nn.Dropout) is traced into one server graph at init (module.py,
graph.py): apply and value_and_grad are one call each.

Arrays in and out are numpy (JAX arrays are accepted); see dtypes.py for
bfloat16 with and without ml_dtypes. Large tensors travel by stream or, on the
server's host, shared memory (transport.py; te.connect(addr, transport=...)).
Every failure is a TeError with the gRPC status code and the server's message.
"""
from te_client import (activation, client, dtypes, errors, flax, graph, initializers, linen, numpy, optim,
                       recipe, symbolic, transport)
from te_client.connection import Client, connect
from te_client.dtypes import Bfloat16Array, asarray, bfloat16, dtype_of
from te_client.errors import (DeadlineExceededError, FailedPreconditionError, InvalidArgumentError,
                              NotFoundError, PermissionDeniedError, ResourceExhaustedError, TeError,
                              UnauthenticatedError, UnavailableError, UnimplementedError)
from te_client.generate import generate, generate_stream
from te_client.optim import TrainState, restore_checkpoint, save_checkpoint, train_step
from te_client.precision import default_matmul_precision
from te_client.recipe import autocast, fp8_autocast
from te_client.session import ResidentTensor, Session, current_session
from te_client.training import speedometer
from te_client.transforms import grad, value_and_grad
from te_client.variables import (Gradients, VariableRef, Variables, tree_flatten, tree_leaves, tree_map,
                                 tree_unflatten)

__all__ = [
    "activation", "client", "dtypes", "errors", "flax", "graph", "initializers", "linen", "numpy", "optim", "recipe",
    "symbolic", "transport",
    "Client", "ResidentTensor", "Session", "connect", "current_session",
    "Bfloat16Array", "asarray", "bfloat16", "dtype_of",
    "TeError", "InvalidArgumentError", "FailedPreconditionError", "NotFoundError", "UnauthenticatedError",
    "PermissionDeniedError", "ResourceExhaustedError", "UnavailableError", "DeadlineExceededError",
    "UnimplementedError",
    "autocast", "fp8_autocast", "default_matmul_precision", "speedometer", "value_and_grad", "grad",
    "generate", "generate_stream",
    "TrainState", "train_step", "save_checkpoint", "restore_checkpoint",
    "Gradients", "VariableRef", "Variables", "tree_map", "tree_leaves", "tree_flatten", "tree_unflatten",
]
