"""sonic_jax: fast fine-grained Mixture-of-Experts layers for JAX (SonicMoE's algorithm)."""

from sonic_jax.activations import (ACTIVATIONS, GATE_UP_LAYOUTS, Activation, clamped_swiglu,
                                   convert_gate_up_layout)
from sonic_jax.backends import BACKENDS
from sonic_jax.config import Config
from sonic_jax.experts import expert_mixture
from sonic_jax.layout import GroupedLayout, build_grouped_layout
from sonic_jax.ops import ExpertsAux, MoEAux, moe, routed_experts
from sonic_jax.routing import (ROUTINGS, TOKEN_ROUNDINGS, RoundedRouting, RoundingWarning,
                               Router, RouterOutput, hf_load_balancing_loss, round_tokens, route,
                               router_logits, sequence_balance_loss)

__version__ = "0.1.0.dev0"  # the package's one version: pyproject.toml reads it from here

# Subpackages imported on first use (`sonic_jax.layers.MoE` after `import sonic_jax`), so that
# importing the functional op does not import Flax, the parallel ops or the checkpoint converters.
_SUBMODULES = ("hf", "layers", "mosaic_gpu", "pallas", "parallel")


def __getattr__(name):
  if name in _SUBMODULES:
    import importlib
    return importlib.import_module(f"sonic_jax.{name}")
  raise AttributeError(f"module 'sonic_jax' has no attribute {name!r}")


__all__ = [
    "ACTIVATIONS", "BACKENDS", "Activation", "Config", "ExpertsAux", "GATE_UP_LAYOUTS", "ROUTINGS",
    "RoundedRouting", "RoundingWarning", "Router", "RouterOutput", "TOKEN_ROUNDINGS",
    "GroupedLayout", "MoEAux", "build_grouped_layout",
    "clamped_swiglu", "convert_gate_up_layout", "expert_mixture", "hf_load_balancing_loss", "moe",
    "round_tokens", "route", "routed_experts", "router_logits", "sequence_balance_loss",
]
