"""te.activation.activation on te_server.

    x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
    x = te.activation.activation(x, activation_type=("gelu",))    # [..., 1, I] -> [..., I]

As TE's: x is [..., len(activation_type), I] and the result [..., I]; a gated
pair such as ("gelu", "linear") multiplies act_0(x[..., 0, :]) by
act_1(x[..., 1, :]). A single activation also takes a plain [..., I].
Inside a Module's __call__ it is one more server layer (no parameters);
called on its own it runs in the current session.
"""
from te_client import errors
from te_client import module as module_lib
from te_client.module import ServerModule


class _Activation(ServerModule):
    activations: tuple = ("gelu",)

    def spec(self):
        from te_client.client import layers_pb2
        return layers_pb2.LayerSpec(activation=layers_pb2.Activation(activations=list(self.activations)))

    def __call__(self, x):
        return self._call(x)


def activation(x, activation_type, quantizer=None):
    if quantizer is not None:
        raise errors.UnimplementedError("activation: quantizer; use autocast for FP8")
    acts = tuple(activation_type)
    if not acts:
        raise errors.InvalidArgumentError("activation_type: empty")
    shape = tuple(x.shape)
    if len(acts) == 1 and len(shape) >= 2 and shape[-2] == 1:
        x = x.reshape(*shape[:-2], shape[-1])   # TE's [..., 1, I] -> the server's [..., I]
    elif len(acts) > 1 and (len(shape) < 2 or shape[-2] != len(acts)):
        raise errors.InvalidArgumentError("activation: x has shape %s; %r wants [..., %d, I]" % (
            list(shape), acts, len(acts)))
    layer = _Activation(acts)
    if module_lib._frame.get() is not None:
        return layer(x)
    return layer.apply(layer.init(0, x), x)
