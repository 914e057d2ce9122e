"""FP8 recipes as transformer_engine.common.recipe spells them.

    from te_client.common.recipe import Format, DelayedScaling   # was: from transformer_engine.common.recipe import ...
    fp8_recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")

Fields and defaults are TE's (the subset te.v1 carries). te_client.recipe
holds the same classes, with autocast.
"""
import dataclasses
import enum


class Format(enum.Enum):
    """transformer_engine.common.recipe.Format."""
    E4M3 = "E4M3"      # E4M3 forward and backward
    E5M2 = "E5M2"      # E5M2 forward and backward
    HYBRID = "HYBRID"  # E4M3 forward, E5M2 for gradients


class Recipe:
    """The base of TE's recipes (isinstance(r, Recipe) holds for each below)."""


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    margin: float = 0.0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"   # "max" | "most_recent"


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    fp8_format: Format = Format.HYBRID
    amax_epsilon: float = 0.0


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """Blackwell 1x32-block scaling: native on sm100, emulated elsewhere (policy "emulate")."""
    fp8_format: Format = Format.E4M3


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """Blackwell FP4 (E2M1, 1x16 blocks): native on sm100, emulated elsewhere."""


RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling)

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"]
