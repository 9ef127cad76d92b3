"""Flax layers over the functional op (NNX; Linen users wrap them with `flax.nnx.bridge`)."""

from sonic_jax.layers.moe import MoE, MoELayerAux, SelectionBias

__all__ = ["MoE", "MoELayerAux", "SelectionBias"]
