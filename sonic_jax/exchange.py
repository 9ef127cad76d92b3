"""The all-to-all exchange of (token, expert) rows between the devices of an expert-parallel axis.

Every device's send buffer has P slots of C rows, slot j for device j (which holds experts
[j*E_local, (j+1)*E_local)): the device's pairs routed there, sorted by expert, then zero rows. A
slot keeps at most C pairs (the slot capacity); the pairs beyond it are dropped and counted. The
receive buffer has the same shape, slot i holding what device i sent. From the all-gathered
per-expert counts C (P senders x E experts) every device computes its own `ExchangePlan`.

One `jax.lax.all_to_all` of the (P*C, d) buffer moves it: every slot travels whole, padding
included (C*d per device pair, whatever the routing). XLA's ragged all-to-all, which would move
only each slot's pairs, ran at about 1% of its bandwidth between GPUs on jax 0.11.2
(docs/decisions.md, "Expert parallelism").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sonic_jax.layout import GroupedLayout

Array = jax.Array


class ExchangePlan(NamedTuple):
  """What a receiving device knows of the rows the dispatch brings it."""

  row_expert: Array  # (P*C,) int32: local expert of each received row, E_local if none
  dropped: Array  # () int32: pairs of the whole axis that did not fit their slot


def exchange_plan(counts: Array, me: Array, slot_rows: int) -> ExchangePlan:
  """The receive side of device `me`'s dispatch, from the all-gathered counts.

  counts: (P, E) int32, counts[i, e] = pairs of sender i routed to expert e (E = P * E_local).
  slot_rows: C, the rows of one slot. Sender i's slot for j holds its first min(C, n_ij) pairs for
  j's experts in expert order (so a full slot drops its highest local experts' last pairs); slot i
  of the receive buffer is sender i's slot for `me`. The combine sends every received slot back to
  the slot it came from.
  """
  p, e_count = counts.shape
  e_local = e_count // p
  kept = jnp.minimum(counts.reshape(p, p, e_local).sum(-1), slot_rows)  # [i, j]
  dropped = jnp.sum(counts) - jnp.sum(kept)

  # Local expert of every received row: in slot i, the blocks of local experts 0..E_local-1.
  mine = jax.lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # (P, E_local)
  block_end = jnp.cumsum(mine, axis=1)  # (P, E_local)
  offset = jnp.arange(slot_rows, dtype=jnp.int32)
  local = jax.vmap(lambda ends: jnp.searchsorted(ends, offset, side="right",
                                                 method="compare_all"))(block_end)
  row_expert = jnp.minimum(local, e_local).reshape(-1).astype(jnp.int32)  # E_local: empty row
  return ExchangePlan(row_expert=row_expert, dropped=dropped)


def slot_layout(pairs: GroupedLayout, num_devices: int, slot_rows: int) -> GroupedLayout:
  """The sender's send buffer as a layout of P*C rows: `pairs` is its pairs in expert order (a
  grouped layout with a row tile of 1); the pairs of device j's experts move to slot j, those past
  its C rows (and pairs routed nowhere) to no row."""
  e_count = pairs.num_experts
  e_local = e_count // num_devices
  rows = num_devices * slot_rows
  per_device = pairs.expert_counts.reshape(num_devices, e_local).sum(-1)
  first = jnp.cumsum(per_device) - per_device  # first sorted position of each device's pairs
  sorted_expert = pairs.row_expert  # (N,), E past the routed pairs
  device = jnp.minimum(sorted_expert // e_local, num_devices - 1)
  offset = jnp.arange(sorted_expert.shape[0], dtype=jnp.int32) - first[device]
  keep = (sorted_expert < e_count) & (offset < slot_rows)
  target = jnp.where(keep, device * slot_rows + offset, rows).astype(jnp.int32)  # sorted -> slot

  def moved(sorted_row):  # a pair's sorted row (N when routed nowhere) -> its slot row
    return jnp.where(sorted_row < target.shape[0], target[jnp.minimum(sorted_row,
                                                                      target.shape[0] - 1)], rows)

  row_pair = jnp.full((rows,), -1, jnp.int32).at[target].set(pairs.row_pair, mode="drop")
  row_token = jnp.zeros((rows,), jnp.int32).at[target].set(pairs.row_token, mode="drop")
  row_expert = jnp.full((rows,), e_count, jnp.int32).at[target].set(sorted_expert, mode="drop")
  kept_counts = jnp.zeros((e_count + 1,), jnp.int32).at[row_expert].add(1)[:e_count]
  return GroupedLayout(row_token=row_token, row_pair=row_pair, row_expert=row_expert,
                       pair_row=moved(pairs.pair_row), group_sizes=kept_counts,
                       expert_counts=kept_counts, tile_expert=row_expert,
                       num_tiles=jnp.sum(kept_counts), extra_row=moved(pairs.extra_row),
                       extra_token=pairs.extra_token)


def exchange(buffer: Array, axis_name: str) -> Array:
  """Sends slot j of `buffer` (P*C rows) to device j; returns the receive buffer of P*C rows whose
  slot i is what device i sent. Differentiable: the transpose is the exchange back."""
  return jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
