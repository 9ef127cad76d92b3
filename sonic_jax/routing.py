"""Token-choice routers: logits, top-K scores and the auxiliary losses.

A router maps logits (T, E) to `scores` (T, K) float32 and `expert_ids` (T, K) int32. Everything here
is plain JAX, so the router's backward (softmax or sigmoid backward, then the router GEMM's
backward) is JAX autodiff fed by the score gradient dS that the expert op returns.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_softmax_raw", "sigmoid_topk")


class RouterOutput(NamedTuple):
  scores: Array  # (T, K) float32 (float64 for float64 logits), the weight of each selected expert
  expert_ids: Array  # (T, K) int32
  probs: Array  # (T, E), the per-expert probabilities that the load-balance loss uses


def router_logits(x: Array, router_weight: Array) -> Array:
  """logits = x @ router_weight with float32 (float64 for float64 inputs) accumulation and result."""
  acc = jnp.promote_types(jnp.promote_types(x.dtype, router_weight.dtype), jnp.float32)
  return jnp.dot(x, router_weight, preferred_element_type=acc)


def _select(values: Array, top_k: int, selection_bias: Array | None):
  """Top-K of values (+ bias): the bias moves the selection only; returns (values[ids], ids)."""
  if selection_bias is None:
    return jax.lax.top_k(values, top_k)
  _, ids = jax.lax.top_k(values + jax.lax.stop_gradient(selection_bias).astype(values.dtype), top_k)
  return jnp.take_along_axis(values, ids, axis=-1), ids


def route(logits: Array, top_k: int, routing: str,
          selection_bias: Array | None = None) -> RouterOutput:
  """Selects K experts per token and their scores.

  selection_bias (E,), optional: added to the routing values (logits for "softmax_topk",
  probabilities or sigmoid gates otherwise) for choosing the experts only; the scores come from the
  unbiased values (DeepSeek-V3's auxiliary-loss-free balancing). It receives no gradient.

  - "softmax_topk": top-K of the logits, softmax over those K (SonicMoE's default; equal to a
    softmax over all E followed by top-K and renormalisation, gradients included).
  - "topk_softmax": softmax over all E, top-K, renormalised to sum to one (Qwen3 style).
  - "topk_softmax_raw": softmax over all E, top-K, not renormalised (Switch / Gemma style).
  - "sigmoid_topk": sigmoid scores, top-K, renormalised (DeepSeek-V3 style, without bias).
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  if routing == "softmax_topk":
    top_logits, ids = _select(logits, top_k, selection_bias)
    return RouterOutput(jax.nn.softmax(top_logits, axis=-1), ids, jax.nn.softmax(logits, axis=-1))
  if routing in ("topk_softmax", "topk_softmax_raw"):
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, ids = _select(probs, top_k, selection_bias)
    if routing == "topk_softmax":
      top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return RouterOutput(top_probs, ids, probs)
  if routing == "sigmoid_topk":
    gates = jax.nn.sigmoid(logits)
    top_gates, ids = _select(gates, top_k, selection_bias)
    scores = top_gates / (jnp.sum(top_gates, axis=-1, keepdims=True) + 1e-20)
    # DeepSeek's sequence-wise balance loss normalises the sigmoid gates per token.
    probs = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
    return RouterOutput(scores, ids, probs)
  raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")


def expert_counts(expert_ids: Array, num_experts: int) -> Array:
  """Number of (token, expert) pairs per expert, (E,) int32. Ids outside [0, E) are not counted."""
  flat = expert_ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, num_experts)].add(
      1, mode="drop")


def load_balance_loss(probs: Array, counts: Array) -> Array:
  """Switch-Transformer balance loss E * sum_e f_e * P_e.

  f_e is the fraction of routed pairs that go to expert e (not differentiable) and P_e the mean
  router probability of expert e over tokens. Equals 1 under perfectly uniform routing.
  """
  num_experts = probs.shape[-1]
  f = counts.astype(jnp.float32) / jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
  p = jnp.mean(probs, axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(f).astype(p.dtype) * p)


def z_loss(logits: Array) -> Array:
  """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.mean(lse * lse)
