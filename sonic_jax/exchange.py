"""The all-to-all exchange of (token, expert) rows between the devices of an expert-parallel axis.

Every device's send buffer has P slots of S rows, slot j for device j (which holds experts
[j*E_local, (j+1)*E_local)): the device's pairs routed there, sorted by expert, then zero rows. A
slot keeps at most S pairs (the slot capacity); the pairs beyond it are dropped and counted. The
receive buffer has the same shape, slot i holding what device i sent. From the all-gathered
per-expert counts C (P senders x E experts) every device computes its own `ExchangePlan`.

Two transports move the same plan with the same result:
- "dense": one `jax.lax.all_to_all` of the (P*S, d) buffer: every slot travels whole, padding
  included (S*d per device pair, whatever the routing);
- "ragged": one `jax.lax.ragged_all_to_all` that moves only each slot's pairs. XLA:CPU does not
  implement it (jax 0.11.2), so on CPU it runs through an all-gather emulation with the same values
  and gradients. On jax 0.11.2 XLA's ragged all-to-all moves about 1% of the dense all-to-all's
  bandwidth between GPUs (docs/decisions.md), so "auto" picks "dense".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sonic_jax.layout import GroupedLayout

Array = jax.Array

TRANSPORTS = ("auto", "dense", "ragged")


class ExchangePlan(NamedTuple):
  """One device's offsets and sizes for one direction of the exchange (ragged_all_to_all's
  arguments), plus what the receiver needs to know about the rows it gets.

  Sender-indexed (P,) arrays describe this device's slot for each receiver j; receiver-indexed
  ones the slot this device gets from each sender i.
  """

  input_offsets: Array  # (P,) where the slot for j starts in this device's send buffer
  send_sizes: Array  # (P,) rows this device sends to j (after the capacity cut)
  output_offsets: Array  # (P,) where this device's slot lands in j's receive buffer
  recv_sizes: Array  # (P,) rows this device receives from i
  row_expert: Array  # (P*S,) int32: local expert of each received row, E_local if none
  dropped: Array  # () int32: pairs of the whole axis that did not fit their slot


def exchange_plan(counts: Array, me: Array, slot_rows: int) -> tuple[ExchangePlan, ExchangePlan]:
  """The dispatch and combine plans of device `me` from the all-gathered counts.

  counts: (P, E) int32, counts[i, e] = pairs of sender i routed to expert e (E = P * E_local).
  slot_rows: S, the rows of one slot. Sender i's slot for j holds its first min(S, n_ij) pairs for
  j's experts in expert order (so a full slot drops its highest local experts' last pairs).
  Returns (dispatch, combine); the combine sends every received slot back to the slot it came from.
  """
  p, e_count = counts.shape
  e_local = e_count // p
  kept = jnp.minimum(counts.reshape(p, p, e_local).sum(-1), slot_rows)  # [i, j]
  dropped = jnp.sum(counts) - jnp.sum(kept)
  starts = jnp.arange(p, dtype=jnp.int32) * slot_rows

  # Local expert of every received row: in slot i, the blocks of local experts 0..E_local-1.
  mine = jax.lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # (P, E_local)
  block_end = jnp.cumsum(mine, axis=1)  # (P, E_local)
  offset = jnp.arange(slot_rows, dtype=jnp.int32)
  local = jax.vmap(lambda ends: jnp.searchsorted(ends, offset, side="right",
                                                 method="compare_all"))(block_end)
  row_expert = jnp.minimum(local, e_local).reshape(-1).astype(jnp.int32)  # E_local: empty row

  column = jax.lax.dynamic_index_in_dim(kept, me, axis=1, keepdims=False)  # [:, me]
  row = jax.lax.dynamic_index_in_dim(kept, me, axis=0, keepdims=False)  # [me, :]
  here = jnp.full((p,), me * slot_rows, jnp.int32)
  dispatch = ExchangePlan(input_offsets=starts, send_sizes=row, output_offsets=here,
                          recv_sizes=column, row_expert=row_expert, dropped=dropped)
  combine = ExchangePlan(input_offsets=starts, send_sizes=column, output_offsets=here,
                         recv_sizes=row, row_expert=row_expert, dropped=dropped)
  return dispatch, combine


def slot_layout(pairs: GroupedLayout, num_devices: int, slot_rows: int) -> GroupedLayout:
  """The sender's send buffer as a layout of P*S rows: `pairs` is its pairs in expert order (a
  grouped layout with a row tile of 1); the pairs of device j's experts move to slot j, those past
  its S rows (and pairs routed nowhere) to no row."""
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


def native_ragged_all_to_all() -> bool:
  """Whether this platform's XLA implements ragged-all-to-all (GPUs and TPUs do, CPU does not)."""
  return jax.default_backend() != "cpu"


def resolve_transport(transport: str) -> str:
  """The transport `transport` (one of `TRANSPORTS`) stands for: "auto" is "dense"."""
  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
  return "dense" if transport == "auto" else transport


def exchange(buffer: Array, plan: ExchangePlan, axis_name: str, transport: str) -> Array:
  """Sends slot j of `buffer` (P*S rows) to device j; returns the receive buffer of P*S rows whose
  slot i is what device i sent (its first plan.recv_sizes[i] rows; zeros after them).
  Differentiable: the transpose is the exchange back."""
  if resolve_transport(transport) == "dense":
    return jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)
  return ragged_exchange(buffer, plan, axis_name)


def ragged_exchange(operand: Array, plan: ExchangePlan, axis_name: str) -> Array:
  """Sends plan.send_sizes[j] rows of operand from plan.input_offsets[j] to device j, which writes
  them at the offset this device's plan.output_offsets[j] names; returns the receive buffer (as
  many rows as operand), zeros where nothing arrived. `jax.lax.ragged_all_to_all` where the
  platform has it (`native_ragged_all_to_all`), else an all-gather emulation with the same
  values."""
  # Not zeros_like: that would type the receive buffer, and every value downstream of the
  # exchange, as varying over the axis under shard_map's type check.
  output = jnp.zeros(operand.shape, operand.dtype)
  if native_ragged_all_to_all():
    return jax.lax.ragged_all_to_all(operand, output, plan.input_offsets, plan.send_sizes,
                                     plan.output_offsets, plan.recv_sizes, axis_name=axis_name)
  return _emulated_exchange(operand, output, plan, axis_name)


def _emulated_exchange(operand: Array, output: Array, plan: ExchangePlan, axis_name: str) -> Array:
  """`ragged_exchange` from an all-gather: receive-buffer row r takes row
  src_offset + (r - dst_offset) of the sender whose chunk covers r."""
  me = jax.lax.axis_index(axis_name)
  gathered = jax.lax.all_gather(operand, axis_name)  # (P, N, ...)
  # What every sender sends to this device: [i] entries of its (P,) arrays at index me.
  take = lambda a: jax.lax.dynamic_index_in_dim(jax.lax.all_gather(a, axis_name), me, axis=1,
                                                keepdims=False)
  src_start, size, dst_start = (take(a) for a in (plan.input_offsets, plan.send_sizes,
                                                  plan.output_offsets))
  r = jnp.arange(output.shape[0], dtype=jnp.int32)[:, None]
  covers = (r >= dst_start[None, :]) & (r < (dst_start + size)[None, :])  # (M, P)
  sender = jnp.argmax(covers, axis=1)
  arrived = jnp.any(covers, axis=1)
  src = jnp.clip(src_start[sender] + r[:, 0] - dst_start[sender], 0, operand.shape[0] - 1)
  rows = gathered[sender, src]
  mask = arrived.reshape((-1,) + (1,) * (operand.ndim - 1))
  return jnp.where(mask, rows, output)
