"""The helpers of TE's JAX quickstart (docs/examples/quickstart_jax_utils.py), over te_server.

    from te_client import quickstart_jax_utils as utils   # was: import quickstart_jax_utils as utils
    utils.speedometer(model_apply_fn=layer.apply, variables=params, input=x, output_grad=dy,
                      dropout_key=key, forward_kwargs={"deterministic": False})

speedometer is te_client.speedometer (training.py): each step is one
ForwardBackward call on x and dy uploaded once, printing "Mean time: X ms" as
TE's helper does.
"""
from te_client.training import speedometer

__all__ = ["speedometer"]
