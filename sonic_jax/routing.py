"""Token-choice routers: logits, top-K scores and the auxiliary losses.

A router maps logits (T, E) to `scores` (T, K) float32 and `expert_ids` (T, K) int32. Everything here
is plain JAX (the top-K selection runs a Pallas kernel on GPUs: ids only, no gradient; for
'softmax_topk' one kernel runs the router GEMM and the selection, `router_logits_and_ids`), so the
router's backward (softmax or sigmoid backward, then the router GEMM's backward) is JAX autodiff
fed by the score gradient dS that the expert op returns.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sonic_jax import precision
from sonic_jax.config import Config, check_config
from sonic_jax.pallas import router_topk
from sonic_jax.precision import dot_f32

Array = jax.Array

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_softmax_raw", "sigmoid_topk")


class RouterOutput(NamedTuple):
  scores: Array  # (T, K) float32 (float64 for float64 logits), the weight of each selected expert
  expert_ids: Array  # (T, K) int32
  probs: Array  # (T, E), the per-expert probabilities that the load-balance loss uses


def router_logits(x: Array, router_weight: Array) -> Array:
  """logits = x @ router_weight with float32 (float64 for float64 inputs) accumulation and result.

  When x and the weight share a 16-bit dtype, the backward GEMMs take the logits' gradient in
  that dtype too (float32 accumulation; `sonic_jax.precision.dot_f32`), as a 16-bit GEMM's
  backward does in mixed-precision training; plain autodiff would run them on float32 operands.
  """
  return dot_f32(x, router_weight)


def _top_k_ids(values: Array, top_k: int) -> Array:
  """Expert ids of lax.top_k(values, top_k): on a GPU from the one-pass Pallas kernel
  (`sonic_jax.pallas.router_topk`, same ids), which XLA's GPU top-K is several times slower than."""
  if (router_topk.AVAILABLE and jax.default_backend() == "gpu"
      and router_topk.supports(values, top_k) is None):
    return router_topk.top_k(jax.lax.stop_gradient(values), top_k)[1]
  return jax.lax.top_k(jax.lax.stop_gradient(values), top_k)[1]


def fused_top_k_unsupported(x: Array, router_weight: Array, top_k: int, routing: str,
                            gpu_only: bool = True, config: Config | None = None) -> str | None:
  """None when `router_logits_and_ids` computes the logits and the expert ids in one kernel (by
  default only on a GPU, up to `config.router_kernel_max_experts` experts; gpu_only=False:
  whether the interpreter can run it elsewhere)."""
  config = check_config(config)
  if routing != "softmax_topk":
    return f"routing {routing!r} (the fused kernel selects on the logits: 'softmax_topk')"
  if not router_topk.AVAILABLE:
    return "Pallas's Triton lowering is not available"
  if gpu_only and jax.default_backend() != "gpu":
    return "not on a GPU"
  if gpu_only and router_weight.shape[-1] > config.router_kernel_max_experts:
    return (f"E={router_weight.shape[-1]} > Config.router_kernel_max_experts="
            f"{config.router_kernel_max_experts}")
  return router_topk.logits_supports(x, router_weight, top_k)


def router_logits_and_ids(x: Array, router_weight: Array, top_k: int, routing: str,
                          selection_bias: Array | None = None, fused: bool | None = None,
                          config: Config | None = None) -> tuple[Array, Array | None]:
  """(logits, expert ids or None): `router_logits(x, router_weight)` and, where one kernel can
  give them with the logits (`fused_top_k_unsupported` is None: a GPU, 16-bit x and weight,
  'softmax_topk'), the ids that `route` would select, for `route(..., expert_ids=ids)`. The fused
  kernel saves the top-K's pass over the logits and a launch; the gradients are those of
  `router_logits` (16-bit GEMMs, float32 accumulation; none into the selection bias).
  fused: None (where it applies and `config` chooses it), False (never: ids None), True (always;
  interpreted off a GPU; a ValueError where it does not apply)."""
  reason = fused_top_k_unsupported(x, router_weight, top_k, routing, gpu_only=fused is None,
                                   config=config)
  if fused is False or (reason is not None and not fused):
    return router_logits(x, router_weight), None
  if reason is not None:
    raise ValueError(f"router_logits_and_ids(fused=True): {reason}")
  # The kernel runs on stopped inputs, so autodiff never differentiates it (nor, through its integer
  # ids, the layout's kernels: a custom_vjp's integer output would carry a float0 tangent into
  # them); the logits get the router GEMM's gradient from `_with_router_gradient`.
  stop = jax.lax.stop_gradient
  logits, ids = router_topk.logits_top_k(
      stop(x), stop(router_weight), top_k, None if selection_bias is None else stop(selection_bias),
      interpret=jax.default_backend() != "gpu")
  return _with_router_gradient(x, router_weight, logits), ids


@jax.custom_vjp
def _with_router_gradient(x, router_weight, logits):
  """logits, computed elsewhere as x @ router_weight, with that product's gradient (16-bit GEMMs,
  float32 accumulation: `precision.dot_16bit_grads`)."""
  del x, router_weight
  return logits


def _with_router_gradient_fwd(x, router_weight, logits):
  return logits, (x, router_weight)


def _with_router_gradient_bwd(residuals, g):
  d_x, d_w = precision.dot_16bit_grads(*residuals, g)
  return d_x, d_w, jnp.zeros_like(g)


_with_router_gradient.defvjp(_with_router_gradient_fwd, _with_router_gradient_bwd)


def _select(values: Array, top_k: int, selection_bias: Array | None, logits: Array | None = None):
  """Top-K of values (+ bias): the bias moves the selection only; returns (values[ids], ids).

  logits: the logits that `values` are a per-token monotonic function of (softmax, sigmoid).
  Without a bias the selection ranks them instead: float32 probabilities and gates saturate (a
  sigmoid is exactly 1.0 above a logit of about 17, a softmax probability 0.0 far below the
  maximum), and ties among saturated values would fall to the lower expert id."""
  if selection_bias is not None:
    ranked = values + jax.lax.stop_gradient(selection_bias).astype(values.dtype)
  else:
    ranked = values if logits is None else logits
  ids = _top_k_ids(ranked, top_k)
  return jnp.take_along_axis(values, ids, axis=-1), ids


def route(logits: Array, top_k: int, routing: str,
          selection_bias: Array | None = None, expert_ids: Array | None = None) -> RouterOutput:
  """Selects K experts per token and their scores.

  selection_bias (E,), optional: added to the routing values (logits for "softmax_topk",
  probabilities or sigmoid gates otherwise) for choosing the experts only; the scores come from the
  unbiased values (DeepSeek-V3's auxiliary-loss-free balancing). It receives no gradient.

  - "softmax_topk": top-K of the logits, softmax over those K (SonicMoE's default; equal to a
    softmax over all E followed by top-K and renormalisation, gradients included).
  - "topk_softmax": softmax over all E, top-K, renormalised to sum to one (Qwen3 style).
  - "topk_softmax_raw": softmax over all E, top-K, not renormalised (Switch / Gemma style).
  - "sigmoid_topk": sigmoid scores, top-K, renormalised (DeepSeek-V3 style, without bias).

  expert_ids (T, K), optional ("softmax_topk" only): the selection, already made
  (`router_logits_and_ids`); the scores come from these logits.
  """
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  if expert_ids is not None and routing != "softmax_topk":
    raise ValueError(f"expert_ids are taken with routing='softmax_topk' only, got {routing!r}")
  if routing == "softmax_topk":
    if expert_ids is None:
      top_logits, ids = _select(logits, top_k, selection_bias)
    else:
      if expert_ids.shape != logits.shape[:-1] + (top_k,):
        raise ValueError(f"expert_ids must have shape {logits.shape[:-1] + (top_k,)}, got "
                         f"{expert_ids.shape}")
      ids = expert_ids.astype(jnp.int32)
      top_logits = jnp.take_along_axis(logits, ids, axis=-1)
    return RouterOutput(jax.nn.softmax(top_logits, axis=-1), ids, jax.nn.softmax(logits, axis=-1))
  if routing in ("topk_softmax", "topk_softmax_raw"):
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, ids = _select(probs, top_k, selection_bias, logits)
    if routing == "topk_softmax":
      top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    return RouterOutput(top_probs, ids, probs)
  if routing == "sigmoid_topk":
    gates = jax.nn.sigmoid(logits)
    top_gates, ids = _select(gates, top_k, selection_bias, logits)
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


# Token rounding (SonicMoE, DESIGN.md section 4): a training-time router that moves each expert's
# number of tokens to a multiple of the grouped GEMM's row tile, so no tile is partly padding.
TOKEN_ROUNDINGS = ("down", "up", "nearest")
ROUNDABLE = ("softmax_topk", "topk_softmax", "topk_softmax_raw")


class RoundedRouting(NamedTuple):
  """A routing after token rounding: the K slots of token choice, minus the pairs rounding dropped,
  plus X extra (token, expert) pairs that rounding added (at most `tile - 1` per expert, sorted by
  token)."""

  scores: Array  # (T, K) float32: kept pairs keep their token-choice score, dropped pairs 0
  expert_ids: Array  # (T, K) int32: -1 where the pair was dropped
  extra_tokens: Array  # (X,) int32: token of each added pair, T for unused entries
  extra_experts: Array  # (X,) int32: expert of each added pair, E for unused entries
  extra_scores: Array  # (X,) float32: the added pair's raw router probability, 0 when unused
  probs: Array  # (T, E) router probabilities (softmax over all E)


def extra_pairs_per_expert(mode: str, tile: int) -> int:
  """Static bound on the pairs that rounding adds to one expert."""
  return {"down": 0, "up": tile - 1, "nearest": tile // 2}[mode]


def round_tokens(routed: RouterOutput, tile: int, mode: str) -> RoundedRouting:
  """Token rounding of a softmax token-choice routing to multiples of `tile` rows per expert.

  With f_e the token-choice count of expert e, its target is floor ("down"), ceil ("up") or
  round-half-to-even ("nearest") of f_e / tile, times tile, capped at T. Each expert ranks the
  tokens as SonicMoE does: its token-choice (TC) tokens first, by their score, then the
  other tokens by raw probability, and takes the first target-many. So rounding down drops an
  expert's lowest-scored TC pairs and rounding up adds its most probable non-TC tokens; kept TC pairs
  keep their score, added pairs get their raw softmax probability (both differentiable; the
  selection is not). A token may end up with fewer or more than K experts, or none.
  Static shapes: the added pairs live in an (E * extra_pairs_per_expert(mode, tile),) list.
  """
  if mode not in TOKEN_ROUNDINGS:
    raise ValueError(f"token_rounding must be one of {TOKEN_ROUNDINGS} or None, got {mode!r}")
  if tile < 1:
    raise ValueError(f"token rounding tile must be >= 1, got {tile}")
  probs, ids = routed.probs, routed.expert_ids
  t_count, k_count = ids.shape
  e_count = probs.shape[1]
  flat_ids = ids.reshape(-1)
  counts = expert_counts(ids, e_count)
  if mode == "down":
    target = counts // tile * tile
  elif mode == "up":
    target = jnp.minimum((counts + tile - 1) // tile * tile, t_count)
  else:
    target = jnp.minimum(jnp.round(counts / tile).astype(jnp.int32) * tile, t_count)

  # Rounding down: rank each expert's TC pairs by score (ties by pair order) and keep the first
  # target_e of them.
  keep = jnp.ones_like(flat_ids, dtype=bool)
  if mode != "up":
    key = jax.lax.stop_gradient(routed.scores).reshape(-1)
    pair = jnp.arange(flat_ids.shape[0], dtype=jnp.int32)
    order = jnp.lexsort((pair, -key, flat_ids)).astype(jnp.int32)  # expert-major, best first
    starts = jnp.cumsum(counts) - counts
    rank_sorted = pair - starts[flat_ids[order]]
    rank = jnp.zeros_like(flat_ids).at[order].set(rank_sorted)
    keep = rank < target[flat_ids]
  keep = keep.reshape(t_count, k_count)
  scores = jnp.where(keep, routed.scores, 0.0)
  kept_ids = jnp.where(keep, ids, -1).astype(jnp.int32)

  # Rounding up: each expert adds its most probable tokens that did not choose it.
  per_expert = extra_pairs_per_expert(mode, tile)
  if per_expert == 0:
    empty = jnp.zeros((0,), jnp.int32)
    return RoundedRouting(scores, kept_ids, empty, empty, jnp.zeros((0,), scores.dtype), probs)
  per_expert = min(per_expert, t_count)
  chose = jnp.zeros((t_count, e_count), bool).at[
      jnp.arange(t_count)[:, None], ids].set(True)
  candidates = jnp.where(chose, -jnp.inf, jax.lax.stop_gradient(probs)).T  # (E, T)
  best, tokens = jax.lax.top_k(candidates, per_expert)  # (E, J)
  need = jnp.maximum(target - counts, 0)
  used = (jnp.arange(per_expert)[None, :] < need[:, None]) & (best > -jnp.inf)
  experts = jnp.broadcast_to(jnp.arange(e_count, dtype=jnp.int32)[:, None], used.shape)
  extra_tokens = jnp.where(used, tokens, t_count).reshape(-1).astype(jnp.int32)
  extra_experts = jnp.where(used, experts, e_count).reshape(-1)
  by_token = jnp.argsort(extra_tokens, stable=True)  # token order: locality in the aggregation
  extra_tokens, extra_experts = extra_tokens[by_token], extra_experts[by_token]
  ok = extra_tokens < t_count
  extra_scores = jnp.where(
      ok, probs[jnp.minimum(extra_tokens, t_count - 1), jnp.minimum(extra_experts, e_count - 1)],
      0.0)
  return RoundedRouting(scores, kept_ids, extra_tokens, extra_experts, extra_scores, probs)


def route_tokens(logits: Array, top_k: int, routing: str, selection_bias: Array | None,
                 token_rounding: str | None, tile: int,
                 expert_ids: Array | None = None) -> tuple[RoundedRouting, RouterOutput]:
  """`route`, then `round_tokens` when token_rounding is not None (an empty extra-pair list
  otherwise). Returns (the routing the experts see, the token-choice routing it started from)."""
  routed = route(logits, top_k, routing, selection_bias, expert_ids)
  if token_rounding is None:
    empty = jnp.zeros((0,), jnp.int32)
    return RoundedRouting(routed.scores, routed.expert_ids, empty, empty,
                          jnp.zeros((0,), routed.scores.dtype), routed.probs), routed
  if token_rounding not in TOKEN_ROUNDINGS:
    raise ValueError(f"token_rounding must be None or one of {TOKEN_ROUNDINGS}, "
                     f"got {token_rounding!r}")
  if routing not in ROUNDABLE:
    raise ValueError(f"token_rounding needs a softmax routing {ROUNDABLE}, got routing={routing!r}")
  return round_tokens(routed, tile, token_rounding), routed


def extra_scores_or_none(rounded: RoundedRouting) -> Array | None:
  """The extra pairs' scores for `expert_mixture`: None when there are none, since a zero-size
  differentiable input crashes XLA:CPU's collectives under shard_map on jax 0.11.2."""
  return rounded.extra_scores if rounded.extra_scores.shape[0] else None
