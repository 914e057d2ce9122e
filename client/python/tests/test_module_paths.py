"""TE's module paths with te_client's prefix, and the old paths kept."""
import pytest

import te_client as te
import te_client.flax as te_flax


def test_flax_modules_live_where_te_keeps_them():
    from te_client.flax import module, transformer
    for name in ("DotProductAttention", "MultiHeadAttention", "RelativePositionBiases", "TransformerLayer",
                 "TransformerLayerType", "extend_logical_axis_rules"):
        assert getattr(transformer, name) is getattr(te_flax, name), name
    for name in ("DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "Softmax",
                 "TransformerEngineBase"):
        assert getattr(module, name) is getattr(te_flax, name), name
    # The plain-Flax layer is the notebook's class on te_client.linen, not a TE module.
    assert not hasattr(te_flax, "FlaxTransformerLayer")
    assert issubclass(te_flax.TransformerLayer, te_flax.TransformerEngineBase)
    # What te_client.flax held as one module stays importable from it.
    from te_client.flax import _dense_output_shape, _ints  # noqa: F401


def test_what_te_v1_cannot_run_says_so():
    with pytest.raises(NotImplementedError, match="RelativePositionBiases: .*enable_relative_embedding"):
        te_flax.RelativePositionBiases(num_buckets=32, max_distance=128, num_heads=8)
    with pytest.raises(NotImplementedError, match="Softmax"):
        te_flax.Softmax()
    from te_client._pb import layers_pb2
    assert te_flax.TransformerLayer(layer_type="decoder").spec().transformer_layer.layer_type == layers_pb2.DECODER
    assert te_flax.TransformerLayer().spec().HasField("transformer_layer")
    assert te_flax.extend_logical_axis_rules([("batch", "data")]) == (("batch", "data"),)


def test_recipes_at_te_common_recipe():
    from te_client.common import recipe
    import te_client.recipe as old
    for name in ("Format", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
                 "Recipe"):
        assert getattr(recipe, name) is getattr(old, name), name
    assert isinstance(recipe.DelayedScaling(), recipe.Recipe)
    with te.autocast(enabled=True, recipe=recipe.DelayedScaling(fp8_format=recipe.Format.E4M3)):
        assert te.recipe.current_autocast().recipe.fp8_format is old.Format.E4M3


def test_quickstart_utils_speedometer():
    from te_client import quickstart_jax_utils as utils
    assert utils.speedometer is te.speedometer
