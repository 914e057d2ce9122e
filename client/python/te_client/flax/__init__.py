"""transformer_engine.jax.flax's modules, running on te_server.

    import te_client.flax as te_flax                         # was: import transformer_engine.jax.flax as te_flax
    from te_client.flax.transformer import DotProductAttention
    from te_client.flax.module import LayerNormMLP

The modules live where TE keeps them: module.py (LayerNorm, DenseGeneral,
LayerNormDenseGeneral, LayerNormMLP) and transformer.py (DotProductAttention,
MultiHeadAttention, TransformerLayer, TransformerLayerType). The quickstart's
plain-Flax layer is the notebook's own class on te_client.linen's Flax
modules. TE classes that te.v1 has no
server layer for (RelativePositionBiases, Softmax) import, and raise
NotImplementedError naming what to use instead when made.
"""
from te_client.flax.module import (DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP, Softmax,
                                   TransformerEngineBase)
from te_client.flax.transformer import (DotProductAttention, MultiHeadAttention,
                                        RelativePositionBiases, TransformerLayer, TransformerLayerType,
                                        extend_logical_axis_rules)
# Private helpers that te_client.linen builds its Flax modules with.
from te_client.flax.module import (_BIAS_TYPES, _LAYERNORM_TYPES, _MASK_TYPES, _QKV_LAYOUTS,  # noqa: F401
                                   _choice, _dense_output_shape, _ints, _no_transpose, _param_dtype, layers_pb2)

__all__ = [
    "DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "Softmax", "TransformerEngineBase",
    "DotProductAttention", "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer",
    "TransformerLayerType", "extend_logical_axis_rules",
]
