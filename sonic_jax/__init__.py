"""sonic_jax: fast fine-grained Mixture-of-Experts layers for JAX (SonicMoE's algorithm)."""

from sonic_jax.activations import ACTIVATIONS, GATE_UP_LAYOUTS, convert_gate_up_layout
from sonic_jax.backends import BACKENDS
from sonic_jax.config import Config
from sonic_jax.experts import expert_mixture
from sonic_jax.layout import GroupedLayout, build_grouped_layout
from sonic_jax.ops import MoEAux, moe
from sonic_jax.routing import ROUTINGS, TOKEN_ROUNDINGS, round_tokens, route, router_logits

__version__ = "0.1.0"  # the package's one version: pyproject.toml reads it from here

__all__ = [
    "ACTIVATIONS", "BACKENDS", "Config", "GATE_UP_LAYOUTS", "ROUTINGS", "TOKEN_ROUNDINGS", "GroupedLayout",
    "MoEAux", "build_grouped_layout", "convert_gate_up_layout", "expert_mixture", "moe",
    "round_tokens", "route", "router_logits",
]
