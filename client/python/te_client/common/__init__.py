"""transformer_engine.common's client side: the FP8 recipes (te_client.common.recipe)."""
from te_client.common import recipe

__all__ = ["recipe"]
