"""Expert parallelism with `jax.shard_map`: experts sharded over a mesh axis.

`moe_all_gather` is the gather-based scheme, for small expert-parallel degrees: every device
all-gathers the tokens of the expert axis, routes all of them (the router is replicated), runs only
its local experts on the pairs routed to them, and a reduce-scatter sums the partial outputs back to
the devices that own the tokens. Dropless and static in shape; the backward is the mirror image
(JAX transposes the collectives) and keeps the low-activation residuals of the single-device op.
Communication per layer: all-gather of x and reduce-scatter of y, 2 (P-1)/P * T*d each way, which
beats an all-to-all while P is small relative to K (every token goes to K experts anyway).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.backends import resolve_backend
from sonic_jax.experts import expert_mixture
from sonic_jax.layout import build_grouped_layout
from sonic_jax.ops import MoEAux, _validate

Array = jax.Array


def moe_all_gather(x: Array, router_weight: Array, w1: Array, w2: Array, *, axis_name: str,
                   top_k: int, activation: str = "swiglu", routing: str = "softmax_topk",
                   gate_up_layout: str = "concat", b1: Array | None = None,
                   b2: Array | None = None, selection_bias: Array | None = None,
                   token_rounding: str | None = None,
                   backend: str = "auto") -> tuple[Array, MoEAux]:
  """`sonic_jax.moe` with experts sharded over `axis_name`; call it inside `jax.shard_map`.

  Per device: x (T_local, d) — this device's tokens; router_weight (d, E) replicated; w1, w2, b1,
  b2 hold this device's E_local = E / P experts (device i holds experts [i*E_local, (i+1)*E_local)).
  Returns this device's y (T_local, d) and the aux of the whole routing (all gathered tokens,
  identical on every device of the axis). token_rounding rounds the global routing (every device
  computes the same one), so each expert's count is a multiple of the backend's row tile wherever
  the expert lives.
  """
  p = jax.lax.axis_size(axis_name)
  e_local = w1.shape[0]
  if router_weight.ndim != 2 or router_weight.shape[1] != e_local * p:
    raise ValueError(f"router_weight must have shape (d, E) with E = {p} devices x {e_local} "
                     f"local experts = {p * e_local}, got {tuple(router_weight.shape)}")
  x_all = jax.lax.all_gather(x, axis_name, tiled=True)  # (T, d)
  act = _validate(x_all, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
                  num_local_experts=e_local)
  impl = resolve_backend(backend)
  logits = routing_lib.router_logits(x_all, router_weight)
  rounded, routed = routing_lib.route_tokens(logits, top_k, routing, selection_bias,
                                             token_rounding, impl.row_tile)
  first = jax.lax.axis_index(axis_name) * e_local
  localize = lambda ids, none: jnp.where((ids >= first) & (ids < first + e_local), ids - first,
                                         none)  # `none`: another device's expert or no expert
  layout = build_grouped_layout(localize(rounded.expert_ids, -1), e_local, impl.row_tile,
                                rounded.extra_tokens, localize(rounded.extra_experts, e_local))
  y_partial = expert_mixture(x_all, rounded.scores, routing_lib.extra_scores_or_none(rounded),
                             layout, w1, w2, b1, b2, act, gate_up_layout, impl)
  # Sum the experts' contributions over devices in float32, then return each device its tokens.
  acc = acts.compute_dtype(x.dtype)
  y = jax.lax.psum_scatter(y_partial.astype(acc), axis_name, tiled=True).astype(x.dtype)
  counts = (routing_lib.expert_counts(rounded.expert_ids, e_local * p)
            + routing_lib.expert_counts(rounded.extra_experts[:, None], e_local * p))
  aux = MoEAux(expert_counts=counts, expert_ids=rounded.expert_ids, scores=rounded.scores,
               router_logits=logits,
               load_balance_loss=routing_lib.load_balance_loss(routed.probs, counts),
               z_loss=routing_lib.z_loss(logits), extra_tokens=rounded.extra_tokens,
               extra_experts=rounded.extra_experts, extra_scores=rounded.extra_scores,
               padded_rows=jax.lax.psum(jnp.sum(layout.group_sizes - layout.expert_counts),
                                        axis_name))
  return y, aux
