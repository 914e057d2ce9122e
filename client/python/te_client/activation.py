"""te.activation.activation on te_server.

    x = x.reshape(*x.shape[:-1], 1, x.shape[-1])
    x = te.activation.activation(x, activation_type=("gelu",))    # [..., 1, I] -> [..., I]

As TE's: x is [..., len(activation_type), I] and the result [..., I]; a gated
pair such as ("gelu", "linear") multiplies act_0(x[..., 0, :]) by
act_1(x[..., 1, :]). A single activation also takes a plain [..., I].
Inside a composite's traced __call__ it records an activation node of the
graph (no parameters); called on an array it runs in the current session.
"""
from te_client import errors, symbolic
from te_client.module import ServerModule
from te_client._pb import layers_pb2


class _Activation(ServerModule):
    activations: tuple = ("gelu",)

    @staticmethod
    def spec_of(activations):
        return layers_pb2.LayerSpec(activation=layers_pb2.Activation(activations=list(activations)))

    def spec(self):
        return self.spec_of(self.activations)

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
    if isinstance(x, symbolic.Symbol):
        # A function in TE, not a Flax module: a glue-named node ("activation_0"), no variables.
        out_shape = x.shape if len(acts) == 1 else x.shape[:-2] + x.shape[-1:]
        return x.trace.record("module", _Activation.spec_of(acts), [x], [(out_shape, x.wire)],
                              label="activation")[0]
    layer = _Activation(acts)
    return layer.apply(layer.init(0, x), x)
