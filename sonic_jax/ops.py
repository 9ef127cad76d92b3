"""`sonic_jax.moe`: the functional Mixture-of-Experts layer."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.backends import resolve_backend
from sonic_jax.batching import split_batch_refusal, unsplit, whole
from sonic_jax.checks import check_capacity, check_experts, check_float, check_moe, check_rank
from sonic_jax.config import Config, check_config
from sonic_jax.experts import mixture
from sonic_jax.layout import build_grouped_layout, check_integer_array, int32_ids

Array = jax.Array


class MoEAux(NamedTuple):
  """What `moe` returns beside the output: routing results and the router's auxiliary losses.

  Attributes:
    expert_counts: (E,) int32, the (token, expert) pairs routed to each expert after token
      rounding and before any capacity drop: the load that `update_selection_bias` balances.
    expert_ids: (T, K) int32, each slot's expert; -1 where token rounding or a capacity
      (`capacity_factor`, or the all-to-all's slots under expert parallelism) dropped the pair.
    scores: (T, K) float32, each slot's weight; 0 where the pair was dropped.
    router_logits: (T, E) float32 (float64 for float64 inputs under jax_enable_x64); from
      `moe_all_gather`, those of all the axis's tokens (P * T_local, E).
    load_balance_loss: () float32, E * sum_e f_e * P_e (1 when uniform; sigmoid and
      sqrt_softplus gates are normalised with 1e-20 added to their sum, as DeepSeek's).
    z_loss: () float32, mean logsumexp(logits) ** 2.
    extra_tokens, extra_experts, extra_scores: (X,) int32, int32, float32: the pairs token
      rounding added beyond the K slots (T, E and 0 in unused entries; (0,)-shaped without
      token rounding).
    padded_rows: () int32, rows of the grouped GEMMs that hold no pair.
    dropped_pairs: () int32, pairs dropped by a capacity: `capacity_factor` on one device, or
      the all-to-all's buffers under expert parallelism (`sonic_jax.parallel.moe_all_to_all`;
      0 when dropless).
    probs: (T, E), the router's per-token distribution that the balance losses use (softmax;
      sigmoid or sqrt_softplus scores normalised over E), for
      `sonic_jax.routing.sequence_balance_loss`.
    choice_ids: (T, K) int32, the router's token-choice selection before token rounding or a
      capacity drop (`sonic_jax.moe`; None from the parallel ops).
  """

  expert_counts: Array
  expert_ids: Array
  scores: Array
  router_logits: Array
  load_balance_loss: Array
  z_loss: Array
  extra_tokens: Array | None = None
  extra_experts: Array | None = None
  extra_scores: Array | None = None
  padded_rows: Array | None = None
  dropped_pairs: Array | None = None
  probs: Array | None = None
  choice_ids: Array | None = None


def _refuse_split_batch(x, impl, token_rounding):
  """x, refused by name under a vmap of a batch split over Explicit mesh axes where Pallas kernels
  would run on it: the Hopper kernels, and token rounding's selection on a GPU."""
  if impl.name == "mosaic_gpu":
    return split_batch_refusal("backend='mosaic_gpu' (backend='xla' can)")(x)
  if token_rounding is not None and jax.default_backend() == "gpu":
    return split_batch_refusal("token rounding on a GPU")(x)
  return x


def expert_capacity(num_pairs: int, num_experts: int, capacity_factor: float) -> int:
  """Pairs an expert keeps at `capacity_factor`: ceil(c * P / E) for P routed pairs (P = T * K),
  at most P (an expert never gets more: any c >= E keeps every pair)."""
  return max(1, math.ceil(min(num_pairs, capacity_factor * num_pairs / num_experts)))


def layout_with_capacity(expert_ids, num_experts, row_tile, extra_tokens, extra_experts,
                         capacity, config, extras_by_expert=False):
  """The grouped layout after each expert keeps its first `capacity` pairs in pair order (token
  by token, slots in order, then the extra pairs), as Switch and MaxText drop.

  Returns (layout, kept expert ids (T, S), kept extra experts (X,), routed counts (E,) before the
  drop, dropped pairs ())."""
  layout = build_grouped_layout(expert_ids, num_experts, row_tile, extra_tokens, extra_experts,
                                extras_by_expert=extras_by_expert, config=config)
  if capacity is None:
    return layout, expert_ids, extra_experts, layout.expert_counts, jnp.zeros((), jnp.int32)
  starts = jnp.cumsum(layout.group_sizes) - layout.group_sizes
  over = lambda rows, ids, valid: valid & (
      rows - starts[jnp.clip(ids, 0, num_experts - 1)] >= capacity)
  drop = over(layout.pair_row, expert_ids, layout.pair_valid())
  kept = jnp.where(drop, -1, expert_ids)
  kept_extra = extra_experts
  dropped = jnp.sum(drop, dtype=jnp.int32)
  if extra_experts is not None:
    drop_extra = over(layout.extra_row, extra_experts, layout.extra_valid())
    kept_extra = jnp.where(drop_extra, num_experts, extra_experts)
    dropped = dropped + jnp.sum(drop_extra, dtype=jnp.int32)
  kept_layout = build_grouped_layout(kept, num_experts, row_tile, extra_tokens, kept_extra,
                                     extras_by_expert=extras_by_expert, config=config)
  return kept_layout, kept, kept_extra, layout.expert_counts, dropped


class ExpertsAux(NamedTuple):
  """What `routed_experts` returns beside the output.

  Attributes:
    expert_counts: (E,) int32, pairs routed to each expert, before any capacity drop.
    expert_ids: (T, S) int32, the ids given; -1 where the capacity dropped the pair.
    padded_rows: () int32, rows of the grouped GEMMs that hold no pair.
    dropped_pairs: () int32, pairs dropped by the capacity (0 without one).
    extra_experts: (X,) int32, the extra pairs' experts, E where unused or dropped by the
      capacity (None without extra pairs).
  """

  expert_counts: Array
  expert_ids: Array
  padded_rows: Array
  dropped_pairs: Array
  extra_experts: Array | None = None


def scaled_inputs(x, expert_ids, scores, extra_tokens, extra_experts, extra_scores):
  """Llama 4's input scaling for any routing: one pseudo-token per pair, its token scaled by the
  pair's weight, routed to the pair's expert with weight 1. Returns (x_pairs (P, d), ids (P, 1),
  a function summing the pairs' outputs back into tokens)."""
  t_count, slots = expert_ids.shape
  d = x.shape[1]
  scale = lambda rows, s: (rows.astype(s.dtype) * s[:, None]).astype(x.dtype)
  if slots == 1 and extra_tokens is None:  # top-1 (Llama 4): the tokens themselves, scaled
    return scale(x, scores[:, 0]), expert_ids, lambda y: y
  parts = [scale(jnp.repeat(x, slots, axis=0), scores.reshape(-1))]
  ids = [expert_ids.reshape(-1)]
  if extra_tokens is not None:
    parts.append(scale(x[jnp.clip(extra_tokens, 0, t_count - 1)], extra_scores))
    ids.append(extra_experts)

  def combine(y_pairs):
    y = jnp.sum(y_pairs[:t_count * slots].reshape(t_count, slots, d), axis=1)
    if extra_tokens is not None:
      y = y + jax.ops.segment_sum(y_pairs[t_count * slots:], extra_tokens,
                                  num_segments=t_count).astype(y.dtype)
    return y

  return jnp.concatenate(parts), jnp.concatenate(ids)[:, None], combine


def _experts(x, expert_ids, scores, w1, w2, b1, b2, act, gate_up_layout, impl, config,
             extra_tokens=None, extra_experts=None, extra_scores=None, scale_input=False,
             capacity_factor=None, extras_by_expert=False):
  """The routed experts on a given routing: (y, ExpertsAux, routed counts before any drop).
  extras_by_expert: the extra pairs come grouped by expert (`build_grouped_layout`)."""
  t_count, d = x.shape
  e_count = w1.shape[0]
  num_pairs = expert_ids.size + (0 if extra_tokens is None else extra_tokens.shape[0])
  capacity = (None if capacity_factor is None
              else expert_capacity(num_pairs, e_count, capacity_factor))
  if scale_input:
    x_in, ids_in, combine = scaled_inputs(x, expert_ids, scores, extra_tokens, extra_experts,
                                           extra_scores)
    layout, kept_all, _, counts, dropped = layout_with_capacity(
        ids_in, e_count, impl.row_tile, None, None, capacity, config)
    kept = kept_all[:expert_ids.size, 0].reshape(expert_ids.shape)
    kept_extra = None if extra_tokens is None else jnp.where(
        kept_all[expert_ids.size:, 0] >= 0, kept_all[expert_ids.size:, 0], e_count)
    if t_count and d and num_pairs:
      y = combine(mixture(x_in, jnp.ones(ids_in.shape, scores.dtype), None, layout, w1, w2, b1,
                          b2, act, gate_up_layout, impl))
  else:
    layout, kept, kept_extra, counts, dropped = layout_with_capacity(
        expert_ids, e_count, impl.row_tile, extra_tokens, extra_experts, capacity, config,
        extras_by_expert)
    if t_count and d and num_pairs:
      y = mixture(x, scores, extra_scores, layout, w1, w2, b1, b2, act, gate_up_layout, impl)
  if not (t_count and d and num_pairs):  # no tokens, d = 0 or no pairs: no expert has work
    y = jnp.zeros_like(x)
  aux = ExpertsAux(expert_counts=counts, expert_ids=kept,
                   padded_rows=jnp.sum(layout.group_sizes - layout.expert_counts),
                   dropped_pairs=dropped, extra_experts=kept_extra)
  return y, aux, counts


def _check_routing_arrays(x, expert_ids, scores, extra_tokens, extra_experts, extra_scores):
  t_count = x.shape[0]
  for name, a in (("expert_ids", expert_ids), ("scores", scores)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    check_rank(name, a, 2, f"(T, S) with T = {t_count}")
  if expert_ids.shape != scores.shape or expert_ids.shape[0] != t_count:
    raise ValueError(f"expert_ids and scores must both have shape (T, S) with T = {t_count}, got "
                     f"{tuple(expert_ids.shape)} and {tuple(scores.shape)}")
  check_integer_array("expert_ids", expert_ids)
  check_float("scores", scores)
  extras = (extra_tokens, extra_experts, extra_scores)
  if any(e is None for e in extras) and not all(e is None for e in extras):
    raise ValueError("extra_tokens, extra_experts and extra_scores must be given together")
  if extra_tokens is None:
    return
  for name, a in zip(("extra_tokens", "extra_experts", "extra_scores"), extras):
    if not hasattr(a, "shape") or a.ndim != 1 or a.shape != extra_tokens.shape:
      raise ValueError(f"extra_tokens, extra_experts and extra_scores must all be (X,), got "
                       f"{name} with shape {getattr(a, 'shape', None)}")
  for name, a in (("extra_tokens", extra_tokens), ("extra_experts", extra_experts)):
    check_integer_array(name, a)
  check_float("extra_scores", extra_scores)


def routed_experts(x: Array, expert_ids: Array, scores: Array, w1: Array, w2: Array, *,
                   activation: str | acts.Activation = "swiglu", gate_up_layout: str = "concat",
                   b1: Array | None = None, b2: Array | None = None,
                   extra_tokens: Array | None = None, extra_experts: Array | None = None,
                   extra_scores: Array | None = None, scale_input: bool = False,
                   capacity_factor: float | None = None, backend: str = "auto",
                   config: Config | None = None) -> tuple[Array, ExpertsAux]:
  """The experts of a Mixture-of-Experts layer on a routing you computed: any router (expert
  choice, hash routing, a sampling router such as PhiMoE's sparsemixer, a family's own rule), the
  same kernels and the same low-memory backward as `moe`.

  y_t = sum over the pairs of token t of score * expert(x_t) (with scale_input:
  sum of expert(score * x_t), Llama 4).

  Args:
    x: (T, d) tokens.
    expert_ids: (T, S) integer: S expert slots per token; -1 (any id outside [0, E)) is an empty
      slot. A token may name an expert in several slots (each counts).
    scores: (T, S) float: each slot's weight. Differentiable: the gradient flows into it (and from
      there into whatever router produced it).
    w1, w2, b1, b2, activation, gate_up_layout, backend, config: as `moe`.
    extra_tokens, extra_experts, extra_scores: optional (X,) (token, expert, weight) triples beyond
      the slots, for routings with no per-token bound (expert choice: expert e's C tokens, with
      expert_ids of shape (T, 0)). Unused entries: expert id outside [0, E) or token outside
      [0, T).
    scale_input: Llama 4's form, each expert sees score * x_t and its output is summed with weight
      1. With one slot and no extra pairs the scaled tokens feed the kernels directly; otherwise
      every pair becomes a scaled row (S * T rows of x in memory).
    capacity_factor: None (dropless) or c > 0: each expert keeps at most ceil(c * P / E) of the
      P = T * S (+ X) pairs, the first in token order; the rest are dropped (counted in
      `aux.dropped_pairs`, their ids -1 in `aux.expert_ids`), as Switch and MaxText drop.

  Returns:
    (y, aux): y (T, d) in x's dtype; aux an `ExpertsAux`.
  """
  act = check_experts(x, w1, w2, b1, b2, activation, gate_up_layout)
  _check_routing_arrays(x, expert_ids, scores, extra_tokens, extra_experts, extra_scores)
  check_capacity(capacity_factor)
  if not isinstance(scale_input, bool):
    raise TypeError(f"scale_input must be a bool, got {type(scale_input).__name__}")
  w1, w2, b1, b2 = unsplit("routed_experts", "experts", w1=w1, w2=w2, b1=b1, b2=b2)
  x, expert_ids, scores, extra_tokens, extra_experts, extra_scores = unsplit(
      "routed_experts", "tokens", x=x, expert_ids=expert_ids, scores=scores,
      extra_tokens=extra_tokens, extra_experts=extra_experts, extra_scores=extra_scores)
  config = check_config(config)
  impl = resolve_backend(backend, config)
  x, w1, w2 = map(jnp.asarray, (x, w1, w2))
  x = _refuse_split_batch(x, impl, None)
  b1, b2 = (None if b is None else jnp.asarray(b) for b in (b1, b2))
  scores = jnp.asarray(scores).astype(jnp.promote_types(scores.dtype, jnp.float32))
  e_count = w1.shape[0]
  expert_ids = int32_ids(expert_ids, e_count, -1)
  if extra_tokens is not None:
    extra_tokens = int32_ids(extra_tokens, x.shape[0], -1)
    extra_experts = int32_ids(extra_experts, e_count, e_count)
    # an entry is unused (its expert E) if its expert or its token is out of range
    used = ((extra_tokens >= 0) & (extra_tokens < x.shape[0]) & (extra_experts >= 0)
            & (extra_experts < e_count))
    extra_experts = jnp.where(used, extra_experts, e_count)
    extra_scores = jnp.asarray(extra_scores).astype(scores.dtype)
  y, aux, _ = _experts(x, expert_ids, scores, w1, w2, b1, b2, act, gate_up_layout, impl, config,
                       extra_tokens, extra_experts, extra_scores, scale_input, capacity_factor)
  return y, aux


def moe(x: Array, router_weight: Array, w1: Array, w2: Array, *, top_k: int,
        activation: str | acts.Activation = "swiglu",
        routing: str | routing_lib.Router = "softmax_topk", gate_up_layout: str = "concat",
        b1: Array | None = None, b2: Array | None = None, router_bias: Array | None = None,
        selection_bias: Array | None = None, token_rounding: str | None = None,
        capacity_factor: float | None = None, router_input: Array | None = None,
        expert_scale: Array | None = None, expert_ids: Array | None = None, backend: str = "auto",
        config: Config | None = None) -> tuple[Array, MoEAux]:
  """A token-choice Mixture-of-Experts layer with SonicMoE's low-activation-memory backward:
  a router, then `routed_experts`.

  On a mesh with Explicit axes the call routes all T tokens together: tokens split over such an
  axis are refused (for data parallelism call it per shard inside a `jax.shard_map`, or call the
  layer under `jax.set_mesh`), and so are expert weights split over their experts (that needs
  expert parallelism); x split over d and the weights and biases over their other dims (FSDP)
  are replicated for the call, their gradients split as they are.

  Args:
    x: (T, d) tokens.
    router_weight: (d, E); logits = x @ router_weight (+ router_bias) with float32 accumulation.
    w1: (E, d, 2n) for GLU activations ("swiglu", "geglu", "geglu_tanh", "reglu",
      "clamped_swiglu"), (E, d, n) otherwise.
    w2: (E, n, d).
    top_k: K, the experts per token, 1 <= K <= E.
    activation: a name in `sonic_jax.ACTIVATIONS` ("swiglu", "geglu", "geglu_tanh", "reglu",
      act(gate) * up; "clamped_swiglu": gpt-oss's, both halves clamped and 1 added to up (see
      `sonic_jax.clamped_swiglu`); "gelu" (exact erf form), "gelu_tanh", "relu", "relu_sq",
      "silu") or an `Activation` such as `sonic_jax.clamped_swiglu(alpha, limit)`.
    routing: a `sonic_jax.Router` (scores, renormalisation, groups, scaling, input scaling) or a
      preset name: "softmax_topk", "topk_softmax", "topk_softmax_raw", "sigmoid_topk",
      "sigmoid_topk_raw" (see `sonic_jax.routing.route`).
    gate_up_layout: for GLU activations, "concat" (w1[..., :n] is the gate, w1[..., n:] the up
      projection) or "interleaved" (gate and up alternate column by column).
    b1: optional (E, 2n) or (E, n) up-projection bias. b2: optional (E, d) down-projection bias.
    router_bias: optional (E,) bias of the router's logits, trained like a weight (gpt-oss).
    selection_bias: optional (E,) bias that moves the expert selection but not the weights
      (auxiliary-loss-free balancing; no gradient flows into it).
    token_rounding: None (plain top-K), or "down", "up", "nearest": SonicMoE's tile-aware token
      rounding for training (`sonic_jax.routing.round_tokens`), which moves every expert's token
      count to a multiple of the backend's row tile so that its grouped GEMMs compute no padding
      rows. Needs a softmax router without groups or input scaling, and no capacity_factor (a
      ValueError otherwise). The pairs it adds are in
      `aux.extra_*`; dropped slot pairs get expert id -1 and score 0. An expert with fewer than
      half a tile of tokens keeps none under "nearest" (and under "down", fewer than a tile):
      with few tokens (T * K / E well under the tile, as in small CPU runs) most pairs drop, and
      a `sonic_jax.routing.RoundingWarning` says so as the call is traced.
    capacity_factor: None (dropless) or c > 0: each expert keeps at most ceil(c * T * K / E)
      pairs (at most T * K), the first in token order (Switch, MaxText); the rest are dropped,
      counted in `aux.dropped_pairs` and marked -1 in `aux.expert_ids`.
    router_input: optional (T, d) input of the router in x's place (Gemma 4's router sees the
      block's input normalised on its own, the experts another normalisation of it).
    expert_scale: optional (E,) trained multiplier of each pair's weight by its expert, applied
      after the router's renormalisation and scaling (Gemma 4's per-expert scale).
    expert_ids: optional (T, K) integer: a fixed selection in place of the router's, whose weights
      the router still computes from the logits (DeepSeek-V4's hash-routed layers: a frozen table
      of each token id's experts); an id outside [0, E) is an empty slot (id -1, weight 0; where
      the router renormalises, the token's other weights are renormalised without it). Not with
      token_rounding, a selection_bias or groups, which only move a selection.
    backend: "auto", "xla" or "mosaic_gpu".
    config: a `sonic_jax.Config` (implementation choices and kernel tuning; None: the defaults).
      Static: under `jax.jit` pass it by closure or as a static argument.

  Returns:
    (y, aux): y has x's shape and dtype; aux is a `MoEAux`.

  Gradients flow to x (through the experts and the router, or router_input), router_weight,
  router_bias, expert_scale, w1, w2, b1 and b2. The backward keeps only x (and router_input where
  given, for the router GEMM's gradient), the pre-activation H, the scores and integer routing
  metadata, beside what autodiff keeps for the router's scores outside the expert op (at most a
  few (T, E) or (T, K) float arrays, e.g. the probabilities).
  """
  router = routing_lib.get_router(routing)
  act = check_moe(x, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
                  selection_bias=selection_bias, routing=router, router_bias=router_bias,
                  router_input=router_input, expert_scale=expert_scale, expert_ids=expert_ids,
                  token_rounding=token_rounding, capacity_factor=capacity_factor)
  w1, w2, b1, b2 = unsplit("sonic_jax.moe", "experts", w1=w1, w2=w2, b1=b1, b2=b2)
  x, router_input, expert_ids = unsplit("sonic_jax.moe", "tokens", x=x, router_input=router_input,
                                        expert_ids=expert_ids)
  x, router_weight, w1, w2, b1, b2, router_bias, expert_scale = (
      None if a is None else whole(jnp.asarray(a))
      for a in (x, router_weight, w1, w2, b1, b2, router_bias, expert_scale))
  selection_bias = whole(selection_bias)
  config = check_config(config)
  impl = resolve_backend(backend, config)
  x = _refuse_split_batch(x, impl, token_rounding)
  t_count = x.shape[0]
  logits, ids = routing_lib.router_logits_and_ids(
      x if router_input is None else jnp.asarray(router_input), router_weight, top_k, router,
      selection_bias, config=config, router_bias=router_bias,
      expert_ids=None if expert_ids is None else int32_ids(
          expert_ids, router_weight.shape[-1], -1))
  routed, choice = routing_lib.route_tokens(logits, top_k, router, selection_bias,
                                            token_rounding, impl.row_tile, ids,
                                            expert_scale=expert_scale)
  extra = routing_lib.extra_scores_or_none(routed)
  extras = (None, None, None) if extra is None else (routed.extra_tokens, routed.extra_experts,
                                                     extra)
  y, experts_aux, routed_counts = _experts(
      x, routed.expert_ids, routed.scores, w1, w2, b1, b2, act, gate_up_layout, impl, config,
      *extras, scale_input=router.scale_input, capacity_factor=capacity_factor,
      extras_by_expert=token_rounding is not None)
  no_tokens = lambda loss: loss if t_count else jnp.zeros((), loss.dtype)  # a mean over none
  aux = MoEAux(
      expert_counts=experts_aux.expert_counts,
      expert_ids=experts_aux.expert_ids,
      scores=(routed.scores if capacity_factor is None
              else jnp.where(experts_aux.expert_ids >= 0, routed.scores, 0.0)),
      router_logits=logits,
      load_balance_loss=no_tokens(routing_lib.load_balance_loss(routed.probs, routed_counts)),
      z_loss=no_tokens(routing_lib.z_loss(logits)),
      extra_tokens=routed.extra_tokens,
      extra_experts=routed.extra_experts,
      extra_scores=routed.extra_scores,
      padded_rows=experts_aux.padded_rows,
      dropped_pairs=experts_aux.dropped_pairs,
      probs=routed.probs,
      choice_ids=choice.expert_ids,
  )
  return y, aux
