"""The all-to-all exchange of (token, expert) rows between the devices of an expert-parallel axis.

Every sender sorts its pairs by expert, so the rows for device j (which holds experts
[j*E_local, (j+1)*E_local)) are one contiguous chunk of its send buffer. The per-expert counts C
(P senders x E experts) are all-gathered (P*E integers), and from them every device computes the
same `ExchangePlan`: where each chunk starts in the sender's buffer, where it lands in the
receiver's buffer (senders in device order, each chunk sorted by local expert), and how many of its
rows fit in the receiver's static buffer of `capacity` rows (the rest are dropped and counted).

`ragged_exchange` moves the rows with `jax.lax.ragged_all_to_all` (NCCL on GPUs). XLA:CPU has no
ragged-all-to-all (jax 0.11.2: UNIMPLEMENTED), so on CPU the same semantics run through an
all-gather and a gather: slower, identical in values and gradients, and what the CPU tests check.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class ExchangePlan(NamedTuple):
  """Offsets and sizes of one device's dispatch (its rows out, other devices' rows in).

  Sender-indexed (P,) arrays describe this device's chunk for each receiver j; receiver-indexed
  ones the chunk this device gets from each sender i. The combine (results back) is the mirror
  image, a second plan from `exchange_plan`.
  """

  input_offsets: Array  # (P,) where the chunk for j starts in this device's send buffer
  send_sizes: Array  # (P,) rows this device sends to j (after the capacity cut)
  output_offsets: Array  # (P,) where this device's chunk lands in j's receive buffer
  recv_sizes: Array  # (P,) rows this device receives from i
  recv_offsets: Array  # (P,) where i's chunk starts in this device's receive buffer
  row_expert: Array  # (capacity,) int32: local expert of each received row, E_local if none
  dropped: Array  # () int32: pairs of the whole axis that did not fit their receiver's buffer


def _exclusive_cumsum(a: Array, axis: int) -> Array:
  return jnp.cumsum(a, axis=axis) - a


def exchange_plan(counts: Array, me: Array, capacity: int) -> tuple[ExchangePlan, ExchangePlan]:
  """The dispatch plan and the combine plan of device `me` from the all-gathered counts.

  counts: (P, E) int32, counts[i, e] = pairs of sender i routed to expert e (E = P * E_local).
  capacity: rows of every receiver's buffer. A sender's chunk for j keeps its first rows up to
  what still fits after the chunks of lower-numbered senders (so drops hit the highest-numbered
  senders' highest local experts first); a pair that does not fit is dropped and gets no output.
  Returns (dispatch, combine): the combine plan sends each received chunk (its surviving rows) back
  to where its rows came from in the sender's buffer.
  """
  p, e_count = counts.shape
  e_local = e_count // p
  per_device = counts.reshape(p, p, e_local).sum(-1)  # [i, j]: rows sender i has for device j
  land = _exclusive_cumsum(per_device, 0)  # [i, j]: where i's chunk starts on j (before the cut)
  kept = jnp.clip(capacity - land, 0, per_device)  # [i, j]: rows of it that fit
  send_start = _exclusive_cumsum(per_device, 1)  # [i, j]: where i's chunk for j starts in i's buffer
  dropped = jnp.sum(per_device - kept)

  # Local expert of every received row: chunks of senders 0..P-1 back to back, each sorted by
  # local expert, so the (sender, expert) blocks follow one another in flattened order.
  mine = jax.lax.dynamic_slice_in_dim(counts, me * e_local, e_local, axis=1)  # (P, E_local)
  block_end = jnp.cumsum(mine.reshape(-1))
  rows = jnp.arange(capacity, dtype=jnp.int32)
  block = jnp.searchsorted(block_end, rows, side="right").astype(jnp.int32)
  row_expert = jnp.where(block < p * e_local, block % e_local, e_local).astype(jnp.int32)

  column = lambda a: jax.lax.dynamic_index_in_dim(a, me, axis=1, keepdims=False)  # [:, me]
  row = lambda a: jax.lax.dynamic_index_in_dim(a, me, axis=0, keepdims=False)  # [me, :]
  dispatch = ExchangePlan(input_offsets=row(send_start), send_sizes=row(kept),
                          output_offsets=row(land), recv_sizes=column(kept),
                          recv_offsets=column(land), row_expert=row_expert, dropped=dropped)
  combine = ExchangePlan(input_offsets=column(land), send_sizes=column(kept),
                         output_offsets=column(send_start), recv_sizes=row(kept),
                         recv_offsets=row(send_start), row_expert=row_expert, dropped=dropped)
  return dispatch, combine


def native_ragged_all_to_all() -> bool:
  """Whether this platform's XLA implements ragged-all-to-all (GPUs and TPUs do, CPU does not)."""
  return jax.default_backend() != "cpu"


def ragged_exchange(operand: Array, out_rows: int, plan: ExchangePlan, axis_name: str,
                    native: bool | None = None) -> Array:
  """Sends plan.send_sizes[j] rows of operand from plan.input_offsets[j] to device j, which writes
  them at the offsets this device's plan.output_offsets names; returns the (out_rows, ...) receive
  buffer, zeros where nothing arrived. Differentiable (the transpose is the reverse exchange)."""
  native = native_ragged_all_to_all() if native is None else native
  output = jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype)
  if native:
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
