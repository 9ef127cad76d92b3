"""Expert parallelism with `jax.shard_map`: experts sharded over a mesh axis.

Two schemes, both dropless by default, static in shape, differentiable, and equal to the
single-device `sonic_jax.moe` in output and gradients:

`moe_all_to_all` is the dispatch scheme for any expert-parallel degree: every device routes its own
tokens, sends each (token, expert) row to the device that holds the expert with one all-to-all
(`sonic_jax.exchange`: `jax.lax.all_to_all` of fixed-size slots), runs its local experts on what
it received and returns each result row the same way; the sender sums its tokens' K rows.
Communication per layer: the whole slots, P*C rows of d each way, (P-1)/P of them crossing
devices.

`moe_all_gather` is the gather-based scheme, for small expert-parallel degrees: every device
routes its own tokens and all-gathers their logits and the tokens of the expert axis, runs only
its local experts on the pairs routed to them, and sends each device the partial outputs of its
tokens (one all-to-all), which it sums in float32. Dropless by default (a capacity factor drops
as the single-device op does) and static in shape; the backward is the mirror image and saves
what the single-device op saves (the gathered x, H and the routing), for P*T_local tokens.
Communication per layer and device: the all-gather of x and the combine, 2 (P-1) T_local rows of
d each way in x's dtype, which beats an all-to-all while P is small relative to K (every token
goes to K experts anyway).

Which wins: per device and direction, all-gather moves (P-1)*T_local rows of d and computes the
routing of all P*T_local tokens (from their logits) on every device; the all-to-all moves (P-1)*C
with C = c*K*T_local/P at a capacity factor c, and T_local*min(K, E_local) when dropless
(T_local*K for a given expert_ids, which may name an expert twice for a token). So
all-gather moves less while P < c*K (dropless, the all-to-all moves at least as much), and
all-to-all wins beyond; it also keeps the routing, the row gathers and the saved activations per
device independent of P (all-gather's grow with P). `python -m benchmarks.ep_bench` measures both.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax import exchange
from sonic_jax import routing as routing_lib
from sonic_jax import xla_backend
from sonic_jax.backends import resolve_backend
from sonic_jax.config import Config, check_config
from sonic_jax.experts import mixture, scores_by_row
from sonic_jax.layout import GroupedLayout, build_grouped_layout
from sonic_jax.checks import check_array, check_capacity, check_moe, check_rank
from sonic_jax.ops import MoEAux, expert_capacity, layout_with_capacity, scaled_inputs
from sonic_jax.varying import like_primal, varying_axes

Array = jax.Array

__all__ = ["EXPERT_PARALLEL_SCHEMES", "moe_all_gather", "moe_all_to_all", "resolve_scheme",
           "slot_capacity"]

EXPERT_PARALLEL_SCHEMES = ("all_to_all", "all_gather")


def resolve_scheme(scheme: str, num_devices: int, top_k: int,
                   capacity_factor: float | None = None) -> str:
  """The scheme `scheme` ("auto" or one of `EXPERT_PARALLEL_SCHEMES`) stands for over an expert
  axis of `num_devices` devices. "auto" is the one that moves fewer rows (the module docstring's
  traffic model): "all_gather" when dropless, or while P < c * K with a capacity factor c, and
  "all_to_all" beyond. Measured within one node: dropless, and with c = 1.25 at P = 2, the
  all-gather scheme is the faster one (docs/decisions.md). The two drop different pairs: per
  expert over the axis's tokens, or per (sender, receiver) slot."""
  if scheme not in ("auto",) + EXPERT_PARALLEL_SCHEMES:
    raise ValueError(f"scheme must be 'auto' or one of {EXPERT_PARALLEL_SCHEMES}, got {scheme!r}")
  if scheme != "auto":
    return scheme
  if capacity_factor is None or num_devices < capacity_factor * top_k:
    return "all_gather"
  return "all_to_all"


def _axis_size(axis_name):
  try:
    return jax.lax.axis_size(axis_name)
  except NameError as e:  # jax's "unbound axis name"
    raise ValueError(f"axis_name={axis_name!r} is not an axis bound here: call the op inside "
                     f"jax.shard_map over a mesh with that axis ({e})") from None


def _axis_names(axis_name) -> set:
  """The mesh axes `axis_name` names (one, or a tuple of them)."""
  return set(axis_name) if isinstance(axis_name, tuple) else {axis_name}


def _as_axis_name(axis_name):
  """A list of axes as the tuple JAX's collectives and this module's checks take."""
  return tuple(axis_name) if isinstance(axis_name, list) else axis_name


def _mixture(x, *args):
  """`mixture`, or zeros for rows 0 wide (d = 0): no expert has work, as in `sonic_jax.moe`."""
  return jnp.zeros_like(x) if x.shape[1] == 0 else mixture(x, *args)


def _check_router(router_weight, p, e_local, axis_name):
  # A split router is known under shard_map's type check (check_vma).
  if split := sorted(_axis_names(axis_name) & varying_axes(router_weight)):
    raise ValueError(f"router_weight is split over {split}: it must be replicated (P() in "
                     f"shard_map's in_specs), every device routing its tokens over all E experts")
  e_count = router_weight.shape[1]
  if e_count != e_local * p:
    hint = ""
    if e_count % p == 0:  # most likely the expert weights were not split over the axis
      hint = (f"; w1, w2, b1, b2 must hold E / P = {e_count // p} experts a device (shard them "
              f"over {axis_name!r} in shard_map's in_specs)")
    else:
      hint = (f"; E = {e_count} does not split over the {p} devices: expert parallelism over "
              f"{axis_name!r} needs E a multiple of {p}")
    raise ValueError(f"router_weight has E = {e_count} experts, but w1 holds {e_local} on each of "
                     f"the {p} devices of axis {axis_name!r} (E = P x E_local = {p * e_local})"
                     f"{hint}")


def _check_expert_split(axis_name, p, **arrays):
  """Refuses expert arrays that shard_map splits over other axes but not over `axis_name` (every
  axis of it, for a tuple): their local expert count can still pass `_check_router` (E = P x
  E_local) while every device of the axis holds the same experts. Needs shard_map's varying-axes
  types (check_vma, the default); without them nothing is known and nothing is refused."""
  if p == 1:
    return
  names = _axis_names(axis_name)
  for name, a in arrays.items():
    if a is None:
      continue
    vma = varying_axes(a)
    if vma and not names <= vma:
      raise ValueError(f"{name} is split over {sorted(vma)} but not over axis_name="
                       f"{axis_name!r}: its experts (first dimension) must be split over "
                       f"{axis_name!r} in shard_map's in_specs")


def _prepare(x, router_weight, w1, w2, b1, b2, axis_name, top_k, activation, routing,
             gate_up_layout, selection_bias, router_bias, router_input, expert_scale, expert_ids,
             token_rounding, capacity_factor, backend, config):
  """The parallel ops' checks, arrays' types and ranks first: (P, E_local, router, activation,
  config, backend)."""
  p = _axis_size(axis_name)
  for name, a, rank, doc in (("router_weight", router_weight, 2, "(d, E)"),
                             ("w1", w1, 3, "(E_local, d, 2n or n)")):
    check_array(name, a)
    check_rank(name, a, rank, doc)
  e_local = w1.shape[0]
  _check_router(router_weight, p, e_local, axis_name)
  _check_expert_split(axis_name, p, w1=w1, w2=w2, b1=b1, b2=b2)
  router = routing_lib.get_router(routing)
  act = check_moe(x, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
                  num_local_experts=e_local, selection_bias=selection_bias, routing=router,
                  router_bias=router_bias, router_input=router_input, expert_scale=expert_scale,
                  expert_ids=expert_ids, token_rounding=token_rounding,
                  capacity_factor=capacity_factor)
  config = check_config(config)
  return p, e_local, router, act, config, resolve_backend(backend, config)


def _no_tokens(x, router_input, router_weight, router_bias, top_k, e_count):
  """The result when the axis holds no tokens (T_local = 0, on every device alike): zeros and an
  empty routing, as `sonic_jax.moe` gives for T = 0."""
  logits, _ = routing_lib.router_logits_and_ids(router_input, router_weight, top_k,
                                                "softmax_topk", fused=False,
                                                router_bias=router_bias)
  zero, none = jnp.zeros((), logits.dtype), jnp.zeros((), jnp.int32)
  empty = jnp.zeros((0,), jnp.int32)
  return jnp.zeros_like(x), MoEAux(
      expert_counts=jnp.zeros((e_count,), jnp.int32),
      expert_ids=jnp.zeros((0, top_k), jnp.int32), scores=jnp.zeros((0, top_k), logits.dtype),
      router_logits=logits, load_balance_loss=zero, z_loss=zero, extra_tokens=empty,
      extra_experts=empty, extra_scores=jnp.zeros((0,), logits.dtype), padded_rows=none,
      dropped_pairs=none, probs=jnp.zeros((0, e_count), logits.dtype))


def moe_all_gather(x: Array, router_weight: Array, w1: Array, w2: Array, *,
                   axis_name: str | Sequence[str],
                   top_k: int, activation: str | acts.Activation = "swiglu",
                   routing: str | routing_lib.Router = "softmax_topk",
                   gate_up_layout: str = "concat", b1: Array | None = None,
                   b2: Array | None = None, router_bias: Array | None = None,
                   selection_bias: Array | None = None,
                   token_rounding: str | None = None, capacity_factor: float | None = None,
                   router_input: Array | None = None, expert_scale: Array | None = None,
                   expert_ids: Array | None = None, backend: str = "auto",
                   config: Config | None = None) -> tuple[Array, MoEAux]:
  """`sonic_jax.moe` with experts sharded over `axis_name`; call it inside `jax.shard_map`.

  Per device: x (T_local, d) — this device's tokens (router_input and expert_ids, if given,
  sharded as x); router_weight (d, E) and router_bias, selection_bias, expert_scale (E,)
  replicated; w1, w2, b1, b2 hold this device's E_local = E / P experts (device i holds experts
  [i*E_local, (i+1)*E_local)). A tuple axis_name lists its axes in the order of the expert
  weights' in_specs (P(("data", "ep")) with axis_name=("data", "ep")): device i is the i-th in
  that order, which the op cannot check.
  Returns this device's y (T_local, d) and the aux of the whole routing (all gathered tokens,
  identical on every device of the axis; shard_map types its counts and losses as replicated, for
  out_specs=P(), and its per-token fields as varying: take this device's rows of them, or return
  them under check_vma=False). token_rounding rounds the global routing (every device computes the
  same one), so each expert's count is a multiple of the backend's row tile wherever the expert
  lives. capacity_factor drops as `sonic_jax.moe` does on the axis's tokens (each expert keeps its
  first ceil(c * P * T_local * K / E) pairs in token order), so the result equals the single-device
  op's on the concatenated tokens, drops included. The other arguments are those of
  `sonic_jax.moe`.
  Placement is checked under shard_map's type check (check_vma, the default): expert weights not
  split over axis_name, or a router split over it, are refused by name. With check_vma=False
  nothing records how the inputs were split, so nothing can be checked: weights split over
  another axis then give a wrong answer.

  Every device routes its own tokens and all-gathers the logits (E floats a token), so all of
  them hold the routing of the axis's tokens; the d-wide rows move twice: the all-gather of x and
  the combine, one all-to-all of the partial outputs (x's dtype), which each token's owner sums in
  float32. The backward moves the same bytes the other way.
  """
  axis_name = _as_axis_name(axis_name)
  p, e_local, router, act, config, impl = _prepare(
      x, router_weight, w1, w2, b1, b2, axis_name, top_k, activation, routing, gate_up_layout,
      selection_bias, router_bias, router_input, expert_scale, expert_ids, token_rounding,
      capacity_factor, backend, config)
  e_count = e_local * p
  r_in = x if router_input is None else router_input
  if x.shape[0] == 0:
    return _no_tokens(x, r_in, router_weight, router_bias, top_k, e_count)
  logits, ids = routing_lib.router_logits_and_ids(
      r_in, router_weight, top_k, router, selection_bias, config=config, router_bias=router_bias,
      expert_ids=expert_ids)
  gather = lambda a: jax.lax.all_gather(a, axis_name, tiled=True)
  logits = gather(logits)  # (P*T_local, E): the axis's tokens, device by device
  rounded, routed = routing_lib.route_tokens(logits, top_k, router, selection_bias,
                                             token_rounding, impl.row_tile,
                                             None if ids is None else gather(ids),
                                             expert_scale=expert_scale)
  x_all = _gather_tokens(x, axis_name)  # (P*T_local, d)
  first = jax.lax.axis_index(axis_name) * e_local
  localize = lambda ids, none: jnp.where((ids >= first) & (ids < first + e_local), ids - first,
                                         none)  # `none`: another device's expert or no expert
  # Every device holds the axis's pairs in token order, so each drops its own experts' pairs as
  # `moe` would on the concatenated tokens (token rounding and a capacity exclude each other).
  capacity = (None if capacity_factor is None
              else expert_capacity(rounded.expert_ids.size, e_count, capacity_factor))
  if router.scale_input:  # each pair's token row scaled by its weight, summed with weight 1
    x_in, ids_in, combine = scaled_inputs(x_all, rounded.expert_ids, rounded.scores, None, None,
                                           None)
    mine = localize(ids_in, -1)
    layout, kept, _, _, dropped = layout_with_capacity(mine, e_local, impl.row_tile, None, None,
                                                       capacity, config)
    mine, kept = (a[:rounded.expert_ids.size, 0].reshape(rounded.expert_ids.shape)
                  for a in (mine, kept))
    # ones_like, not ones: the weights vary over the axis as the ids do (shard_map's type check)
    y_partial = combine(mixture(x_in, jnp.ones_like(ids_in, rounded.scores.dtype), None, layout,
                                w1, w2, b1, b2, act, gate_up_layout, impl))
  else:
    extra = routing_lib.extra_scores_or_none(rounded)
    extras = (rounded.extra_tokens, rounded.extra_experts, extra)
    if extra is not None:  # token rounding's lists come grouped by expert: keep this device's
      per_expert = extra.shape[0] // e_count
      extras = tuple(jax.lax.dynamic_slice_in_dim(a, first * per_expert, e_local * per_expert)
                     for a in extras)
    mine = localize(rounded.expert_ids, -1)
    layout, kept, _, _, dropped = layout_with_capacity(
        mine, e_local, impl.row_tile, extras[0], localize(extras[1], e_local), capacity, config,
        extras_by_expert=extra is not None)
    y_partial = _mixture(x_all, rounded.scores, extras[2], layout, w1, w2, b1, b2, act,
                         gate_up_layout, impl)
  y = _sum_partials(y_partial, axis_name)
  expert_ids, scores = rounded.expert_ids, rounded.scores
  if capacity is not None:  # the pairs each device dropped, marked on all of them as `moe` marks
    lost = jax.lax.psum(((mine >= 0) & (kept < 0)).astype(jnp.int32), axis_name) > 0
    expert_ids, scores = jnp.where(lost, -1, expert_ids), jnp.where(lost, 0.0, scores)
    dropped = jnp.sum(lost, dtype=jnp.int32)
  counts = (routing_lib.expert_counts(rounded.expert_ids, e_count)
            + routing_lib.expert_counts(rounded.extra_experts[:, None], e_count))
  # Every device computed the same values from the gathered logits; shard_map types them as
  # varying, so a max (integers) or mean (losses: their gradient is shared out, not repeated)
  # over the axis marks them replicated, as the docstring says, for out_specs=P().
  aux = MoEAux(expert_counts=jax.lax.pmax(counts, axis_name), expert_ids=expert_ids,
               scores=scores, router_logits=logits,
               load_balance_loss=jax.lax.pmean(
                   routing_lib.load_balance_loss(routed.probs, counts), axis_name),
               z_loss=jax.lax.pmean(routing_lib.z_loss(logits), axis_name),
               extra_tokens=rounded.extra_tokens,
               extra_experts=rounded.extra_experts, extra_scores=rounded.extra_scores,
               padded_rows=jax.lax.psum(jnp.sum(layout.group_sizes - layout.expert_counts),
                                        axis_name),
               dropped_pairs=dropped, probs=routed.probs)
  return y, aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_tokens(x: Array, axis_name: str) -> Array:
  """all_gather(x) over the axis, (P*T_local, d). Its transpose sums the devices' cotangents in
  float32 after one all-to-all of rows in x's dtype (`_sum_partials`): the bytes of a
  reduce-scatter in that dtype, whose ring would round every partial sum to it."""
  return jax.lax.all_gather(x, axis_name, tiled=True)


def _gather_tokens_fwd(x, axis_name):
  return _gather_tokens(x, axis_name), x[:0]  # an empty slice: x's shard_map type


def _gather_tokens_bwd(axis_name, like_x, g):
  # An x replicated over the axis gets the devices' cotangents summed (`like_primal`).
  return (like_primal(_sum_partials(g, axis_name), like_x),)


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


def _sum_partials(y_partial: Array, axis_name: str) -> Array:
  """(T_local, d): this device's rows of y_partial (P*T_local, d, device by device) summed over
  the axis in float32, returned in y_partial's dtype: one all-to-all, then a local sum in a fixed
  order. Differentiable: autodiff transposes it into an all-to-all of P copies of the cotangent,
  the bytes of its all-gather."""
  p = jax.lax.axis_size(axis_name)
  parts = y_partial.reshape(p, y_partial.shape[0] // p, *y_partial.shape[1:])  # d may be 0
  received = jax.lax.all_to_all(parts, axis_name, 0, 0)  # [i]: device i's partial of my rows
  acc = acts.compute_dtype(y_partial.dtype)
  return jnp.sum(received.astype(acc), axis=0).astype(y_partial.dtype)


# Rows of the sender's expert-sorted buffer (a grouped layout with a row tile of 1) and back. Each
# is the other's transpose, so the backward is the same deterministic gather / gather-sum (no
# scatter-add) as the forward.
@jax.custom_vjp
def _rows_of_pairs(x: Array, layout: GroupedLayout) -> Array:
  """(N, d): row r holds x[token of the r-th pair in expert order]; zeros past the routed pairs."""
  return jnp.where(layout.row_valid()[:, None], x[layout.row_token], 0).astype(x.dtype)


def _saved(layout: GroupedLayout):
  """The layout as a residual, None for its extra-pair fields where empty (the slot layouts):
  an int32[0] residual of the all-to-all's backward inside a scan under shard_map crashes
  XLA:CPU's compiler (jax 0.11.2). `_restored` puts them back."""
  if layout.extra_row.shape[0]:
    return layout
  return layout._replace(extra_row=None, extra_token=None)


def _restored(layout) -> GroupedLayout:
  if layout.extra_row is not None:
    return layout
  empty = jnp.zeros((0,), jnp.int32)
  return layout._replace(extra_row=empty, extra_token=empty)


def _rows_of_pairs_fwd(x, layout):
  return _rows_of_pairs(x, layout), (_saved(layout), x[:0])  # an empty slice: x's shard_map type


def _rows_of_pairs_bwd(residuals, g):
  layout, like_x = residuals
  return like_primal(_sum_pairs(g, _restored(layout)), like_x), None


@jax.custom_vjp
def _sum_pairs(rows: Array, layout: GroupedLayout) -> Array:
  """(T, d): each token's sum of its pairs' rows, float32 accumulation, in rows' dtype."""
  return xla_backend.gather_sum(rows, layout, None, rows.dtype)


def _sum_pairs_fwd(rows, layout):
  return _sum_pairs(rows, layout), (_saved(layout), rows[:0])


def _sum_pairs_bwd(residuals, g):
  layout, like_rows = residuals
  return like_primal(_rows_of_pairs(g, _restored(layout)), like_rows), None


_rows_of_pairs.defvjp(_rows_of_pairs_fwd, _rows_of_pairs_bwd)
_sum_pairs.defvjp(_sum_pairs_fwd, _sum_pairs_bwd)


def slot_capacity(num_tokens: int, top_k: int, num_extra: int, num_devices: int,
                  num_local_experts: int, capacity_factor: float | None, *,
                  distinct_experts: bool = True) -> int:
  """C, the rows of one (sender, receiver) slot of `moe_all_to_all`'s exchange buffers (P*C rows),
  at least 1: num_tokens is T_local (the sender's tokens), top_k K, num_extra X (token rounding's
  extra-pair entries), num_devices P (the expert axis's size), num_local_experts E_local and
  capacity_factor c or None.

  None: the dropless worst case, all of a sender's pairs routed to one device:
  T_local * min(K, E_local) + X, a token's K experts being distinct (as top-K routing picks them);
  T_local * K + X with distinct_experts=False (a given selection, `expert_ids`, may name one expert
  more than once). A factor c: ceil(c * T_local * K / P), c times the balanced share, at most the
  worst case; pairs beyond a full slot are dropped and counted.
  """
  per_token = min(top_k, num_local_experts) if distinct_experts else top_k
  worst = num_tokens * per_token + num_extra
  if capacity_factor is None:
    return max(1, worst)
  check_capacity(capacity_factor)
  return max(1, min(worst, math.ceil(capacity_factor * num_tokens * top_k / num_devices)))


def _local_rounding(logits, top_k, routing, selection_bias, token_rounding, tile, axis_name,
                    expert_scale):
  """Token rounding of the whole axis's tokens (it ranks tokens across devices), cut to this
  device's tokens. The (T_local, E) logits are all-gathered: E floats per token, much less than
  the d-wide rows that the exchange moves."""
  t_local = logits.shape[0]
  me = jax.lax.axis_index(axis_name)
  logits_all = jax.lax.all_gather(logits, axis_name, tiled=True)
  rounded, routed = routing_lib.route_tokens(logits_all, top_k, routing, selection_bias,
                                             token_rounding, tile, expert_scale=expert_scale)
  mine = lambda a: jax.lax.dynamic_slice_in_dim(a, me * t_local, t_local, axis=0)
  e_count = logits.shape[1]
  token = rounded.extra_tokens - me * t_local
  local = (token >= 0) & (token < t_local) & (rounded.extra_experts < e_count)
  local_rounded = routing_lib.RoundedRouting(
      scores=mine(rounded.scores), expert_ids=mine(rounded.expert_ids),
      extra_tokens=jnp.where(local, token, t_local).astype(jnp.int32),
      extra_experts=jnp.where(local, rounded.extra_experts, e_count).astype(jnp.int32),
      extra_scores=jnp.where(local, rounded.extra_scores, 0.0), probs=mine(rounded.probs))
  return local_rounded, routed


def moe_all_to_all(x: Array, router_weight: Array, w1: Array, w2: Array, *,
                   axis_name: str | Sequence[str],
                   top_k: int, activation: str | acts.Activation = "swiglu",
                   routing: str | routing_lib.Router = "softmax_topk",
                   gate_up_layout: str = "concat", b1: Array | None = None,
                   b2: Array | None = None, router_bias: Array | None = None,
                   selection_bias: Array | None = None,
                   token_rounding: str | None = None, capacity_factor: float | None = None,
                   router_input: Array | None = None,
                   expert_scale: Array | None = None, expert_ids: Array | None = None,
                   backend: str = "auto",
                   config: Config | None = None) -> tuple[Array, MoEAux]:
  """`sonic_jax.moe` with experts sharded over `axis_name`, tokens dispatched by all-to-all; call it
  inside `jax.shard_map`.

  Per device: x (T_local, d) — this device's tokens (router_input and expert_ids, if given,
  sharded as x); router_weight (d, E) and router_bias, selection_bias, expert_scale (E,)
  replicated; w1, w2, b1, b2 hold this device's E_local = E / P experts (device i holds experts
  [i*E_local, (i+1)*E_local)); a tuple axis_name lists its axes in the order of the expert
  weights' in_specs, as for `moe_all_gather`.
  capacity_factor: None (default) sizes the exchange's (sender, receiver) slots for the worst case,
  so nothing is ever dropped; a number c sizes them at c times the balanced share
  (`slot_capacity`), which bounds memory and traffic for large P, and drops the pairs that do not
  fit: they add nothing to their token's output, their aux expert id is -1 and score 0, and
  `aux.dropped_pairs` counts them.
  token_rounding rounds the routing of the whole axis's tokens (their (T_local, E) logits are
  all-gathered for it), so the result equals the single-device op.
  Returns this device's y (T_local, d) and the aux of this device's tokens, with the axis-wide
  expert_counts, load-balance and z losses, padded_rows and dropped_pairs.

  Saved for the backward per device: the received x rows (P*C, d) and their H, the scores and
  integer metadata; the exchange's backward is the exchange back. The other arguments are those of
  `sonic_jax.moe`.
  Placement is checked under shard_map's type check (check_vma, the default): expert weights not
  split over axis_name, or a router split over it, are refused by name. With check_vma=False
  nothing records how the inputs were split, so nothing can be checked: weights split over
  another axis then give a wrong answer.
  """
  axis_name = _as_axis_name(axis_name)
  p, e_local, router, act, config, impl = _prepare(
      x, router_weight, w1, w2, b1, b2, axis_name, top_k, activation, routing, gate_up_layout,
      selection_bias, router_bias, router_input, expert_scale, expert_ids, token_rounding,
      capacity_factor, backend, config)
  e_count, t_local = e_local * p, x.shape[0]
  r_in = x if router_input is None else router_input
  if t_local == 0:
    return _no_tokens(x, r_in, router_weight, router_bias, top_k, e_count)
  me = jax.lax.axis_index(axis_name)

  if token_rounding is None:
    logits, ids = routing_lib.router_logits_and_ids(
        r_in, router_weight, top_k, router, selection_bias, config=config,
        router_bias=router_bias, expert_ids=expert_ids)
    rounded, routed = routing_lib.route_tokens(logits, top_k, router, selection_bias, None,
                                               impl.row_tile, ids,
                                               expert_scale=expert_scale)
  else:
    logits, _ = routing_lib.router_logits_and_ids(r_in, router_weight, top_k, router,
                                                  fused=False, router_bias=router_bias)
    rounded, routed = _local_rounding(logits, top_k, router, selection_bias, token_rounding,
                                      impl.row_tile, axis_name, expert_scale)
  # The sender's pairs in expert order, then moved into one slot per receiving device.
  pairs = build_grouped_layout(rounded.expert_ids, e_count, 1, rounded.extra_tokens,
                               rounded.extra_experts, config=config)
  counts = jax.lax.all_gather(pairs.expert_counts, axis_name)  # (P, E)
  slot_rows = slot_capacity(t_local, top_k, pairs.num_extra, p, e_local, capacity_factor,
                            distinct_experts=expert_ids is None)
  dispatch = exchange.exchange_plan(counts, me, slot_rows)
  send = exchange.slot_layout(pairs, p, slot_rows)

  move = lambda rows: exchange.exchange(rows, axis_name)
  extra_scores = routing_lib.extra_scores_or_none(rounded)
  x_recv = move(_rows_of_pairs(x, send))
  s_recv = move(scores_by_row(rounded.scores, extra_scores, send)[:, None])
  experts = build_grouped_layout(dispatch.row_expert[:, None], e_local, impl.row_tile,
                                 config=config)
  if router.scale_input:  # Llama 4: the received row scaled by its weight, the output by 1
    x_recv = (x_recv.astype(s_recv.dtype) * s_recv).astype(x.dtype)
    s_recv = jnp.ones_like(s_recv)
  # (P*C, d): each received row times its score
  y_recv = _mixture(x_recv, s_recv, None, experts, w1, w2, b1, b2, act, gate_up_layout, impl)
  y = _sum_pairs(move(y_recv), send)

  total = jax.lax.psum(pairs.expert_counts, axis_name)  # counts.sum(0), typed replicated
  # Without rounding, routed holds this device's tokens: the mean averages P_e over the axis;
  # with it, every device computed the same loss, which the mean marks replicated.
  balance = jax.lax.pmean(routing_lib.load_balance_loss(routed.probs, total), axis_name)
  # A pair that no slot holds was dropped by the capacity (or routed nowhere): marked as `moe`
  # marks its capacity drops. Token rounding is dropless here, so its extra pairs stay as listed.
  sent = send.pair_valid()
  aux = MoEAux(expert_counts=total, expert_ids=jnp.where(sent, rounded.expert_ids, -1),
               scores=jnp.where(sent, rounded.scores, 0), router_logits=logits,
               load_balance_loss=balance,
               z_loss=jax.lax.pmean(routing_lib.z_loss(logits), axis_name),
               extra_tokens=rounded.extra_tokens, extra_experts=rounded.extra_experts,
               extra_scores=rounded.extra_scores,
               padded_rows=jax.lax.psum(jnp.sum(experts.group_sizes - experts.expert_counts),
                                        axis_name),
               dropped_pairs=jax.lax.pmax(dispatch.dropped, axis_name), probs=rounded.probs)
  return y, aux
